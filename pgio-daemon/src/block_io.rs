//! Userspace side of the block probes: reads `BLOCK_IO_HIST` (sum over CPUs) at scrape time.
use std::{collections::BTreeMap, sync::Mutex};

use anyhow::Result;
use aya::maps::{MapData, PerCpuHashMap};
use pgio_common::{
    block_io::{BlockIoKey, BlockMetric},
    hist::Bucket,
};

use crate::{hist::Log2Hist, provisional::Route};

/// (series, dev, op) of one block histogram.
pub type BlockIoId = (u32, u32, u8);

#[derive(Default, Debug)]
pub struct BlockIoSnapshot {
    pub device: BTreeMap<BlockIoId, Log2Hist>,
    pub queue: BTreeMap<BlockIoId, Log2Hist>,
    /// Unmatched completions by (dev, op) (see `BlockMetric::Unmatched`).
    pub unmatched: BTreeMap<(u32, u8), u64>,
}

impl BlockIoSnapshot {
    fn merge(&mut self, other: &BlockIoSnapshot) {
        for (mine, theirs) in [
            (&mut self.device, &other.device),
            (&mut self.queue, &other.queue),
        ] {
            for (id, h) in theirs {
                mine.entry(*id).or_default().merge(h);
            }
        }
        for (id, n) in &other.unmatched {
            *self.unmatched.entry(*id).or_default() += n;
        }
    }
}

pub struct BlockIoReader {
    hist: Mutex<PerCpuHashMap<MapData, BlockIoKey, Bucket>>,
    /// Histograms folded in from provisional series (deleted from the kernel map).
    carry: Mutex<BlockIoSnapshot>,
}

impl BlockIoReader {
    pub fn new(hist: PerCpuHashMap<MapData, BlockIoKey, Bucket>) -> BlockIoReader {
        BlockIoReader {
            hist: Mutex::new(hist),
            carry: Mutex::default(),
        }
    }

    /// `route` says where each key's series goes (see `provisional`).
    pub fn read(&self, route: impl Fn(u32) -> Route) -> Result<BlockIoSnapshot> {
        let mut hist = self.hist.lock().unwrap_or_else(|e| e.into_inner());
        let mut carry = self.carry.lock().unwrap_or_else(|e| e.into_inner());
        let mut snap = BlockIoSnapshot::default();
        let mut folded = Vec::new();
        for entry in hist.iter() {
            let (key, per_cpu) = entry?;
            if key.metric == BlockMetric::Unmatched as u8 {
                let n: u64 = per_cpu.iter().map(|b| b.count).sum();
                *snap.unmatched.entry((key.dev, key.op)).or_default() += n;
                continue;
            }
            let (series, into) = match route(key.series) {
                Route::Own => (key.series, &mut snap),
                Route::Pending => continue,
                Route::Fold(s) => {
                    folded.push(key);
                    (s, &mut *carry)
                }
            };
            let id = (series, key.dev, key.op);
            let target = if key.metric == BlockMetric::Queue as u8 {
                into.queue.entry(id).or_default()
            } else {
                into.device.entry(id).or_default()
            };
            for b in per_cpu.iter() {
                target.add(key.slot, b);
            }
        }
        for key in &folded {
            // Gone already is fine: nothing else deletes, and a late completion recreates it.
            let _ = hist.remove(key);
        }
        snap.merge(&carry);
        Ok(snap)
    }
}
