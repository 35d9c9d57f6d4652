//! Userspace side of the block probes: reads `BLOCK_IO_HIST` (sum over CPUs) at scrape time.
use std::collections::BTreeMap;

use anyhow::Result;
use aya::maps::{MapData, PerCpuHashMap};
use pgio_common::{
    block_io::{BlockIoKey, BlockMetric},
    hist::Bucket,
};

use crate::hist::Log2Hist;

/// (series, dev, op) of one block histogram.
pub type BlockIoId = (u32, u32, u8);

#[derive(Default, Debug)]
pub struct BlockIoSnapshot {
    pub device: BTreeMap<BlockIoId, Log2Hist>,
    pub queue: BTreeMap<BlockIoId, Log2Hist>,
}

pub struct BlockIoReader {
    hist: PerCpuHashMap<MapData, BlockIoKey, Bucket>,
}

impl BlockIoReader {
    pub fn new(hist: PerCpuHashMap<MapData, BlockIoKey, Bucket>) -> BlockIoReader {
        BlockIoReader { hist }
    }

    pub fn read(&self) -> Result<BlockIoSnapshot> {
        let mut snap = BlockIoSnapshot::default();
        for entry in self.hist.iter() {
            let (key, per_cpu) = entry?;
            let id = (key.series, key.dev, key.op);
            let target = if key.metric == BlockMetric::Queue as u8 {
                snap.queue.entry(id).or_default()
            } else {
                snap.device.entry(id).or_default()
            };
            for b in per_cpu.iter() {
                target.add(key.slot, b);
            }
        }
        Ok(snap)
    }
}
