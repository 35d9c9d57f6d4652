//! Userspace side of the syscall probes: reads `SYSCALL_HIST` (sum over CPUs) at scrape time.
use std::collections::BTreeMap;

use anyhow::Result;
use aya::maps::{MapData, PerCpuHashMap};
use pgio_common::{hist::Bucket, syscall::SyscallKey};

use crate::hist::Log2Hist;

/// (series, syscall, cache) of one syscall histogram.
pub type SyscallId = (u32, u8, u8);

pub struct SyscallReader {
    hist: PerCpuHashMap<MapData, SyscallKey, Bucket>,
}

impl SyscallReader {
    pub fn new(hist: PerCpuHashMap<MapData, SyscallKey, Bucket>) -> SyscallReader {
        SyscallReader { hist }
    }

    pub fn read(&self) -> Result<BTreeMap<SyscallId, Log2Hist>> {
        let mut out: BTreeMap<SyscallId, Log2Hist> = BTreeMap::new();
        for entry in self.hist.iter() {
            let (key, per_cpu) = entry?;
            let h = out.entry((key.series, key.syscall, key.cache)).or_default();
            for b in per_cpu.iter() {
                h.add(key.slot, b);
            }
        }
        Ok(out)
    }
}
