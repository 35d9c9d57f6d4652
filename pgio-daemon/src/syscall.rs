//! Userspace side of the syscall probes: reads `SYSCALL_HIST` (sum over CPUs) at scrape time.
use std::{collections::BTreeMap, sync::Mutex};

use anyhow::Result;
use aya::maps::{MapData, PerCpuHashMap};
use pgio_common::{hist::Bucket, syscall::SyscallKey};

use crate::{hist::Log2Hist, provisional::Route};

/// (series, syscall, cache) of one syscall histogram.
pub type SyscallId = (u32, u8, u8);

pub struct SyscallReader {
    hist: Mutex<PerCpuHashMap<MapData, SyscallKey, Bucket>>,
    /// Histograms folded in from provisional series (deleted from the kernel map).
    carry: Mutex<BTreeMap<SyscallId, Log2Hist>>,
}

impl SyscallReader {
    pub fn new(hist: PerCpuHashMap<MapData, SyscallKey, Bucket>) -> SyscallReader {
        SyscallReader {
            hist: Mutex::new(hist),
            carry: Mutex::default(),
        }
    }

    /// `route` says where each key's series goes (see `provisional`).
    pub fn read(&self, route: impl Fn(u32) -> Route) -> Result<BTreeMap<SyscallId, Log2Hist>> {
        let mut hist = self.hist.lock().unwrap_or_else(|e| e.into_inner());
        let mut carry = self.carry.lock().unwrap_or_else(|e| e.into_inner());
        let mut out: BTreeMap<SyscallId, Log2Hist> = BTreeMap::new();
        let mut folded = Vec::new();
        for entry in hist.iter() {
            let (key, per_cpu) = entry?;
            let h = match route(key.series) {
                Route::Own => out.entry((key.series, key.syscall, key.cache)),
                Route::Pending => continue,
                Route::Fold(s) => {
                    folded.push(key);
                    carry.entry((s, key.syscall, key.cache))
                }
            }
            .or_default();
            for b in per_cpu.iter() {
                h.add(key.slot, b);
            }
        }
        for key in &folded {
            // Gone already is fine: nothing else deletes, and a late update recreates it.
            let _ = hist.remove(key);
        }
        for (id, h) in carry.iter() {
            out.entry(*id).or_default().merge(h);
        }
        Ok(out)
    }
}
