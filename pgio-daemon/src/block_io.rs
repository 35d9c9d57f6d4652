//! Userspace side of the block probes: reads `BLOCK_IO_HIST` at scrape time and writes the
//! `pgio_block_io_*` families.
use anyhow::Result;
use aya::Ebpf;
use pgio_common::{
    SeriesId,
    block_io::{BlockIoKey, BlockMetric, BlockOp},
};
use tracing::warn;

use crate::{
    collector::{Scrape, Snapshot, Source},
    exposition::{Encoder, Family, Kind},
    hist::{HistKey, HistReader, Hists},
    labels::BlockLabels,
    maps::take_map,
    provisional::Provisional,
};

const HIST_MAP: &str = "BLOCK_IO_HIST";

/// One block histogram: a submitter series' requests on a device, by op.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct BlockIoId {
    pub series: SeriesId,
    /// Kernel `dev_t`: `major << 20 | minor`.
    pub dev: u32,
    pub op: BlockOp,
    pub metric: BlockMetric,
}

impl HistKey for BlockIoKey {
    type Id = BlockIoId;

    fn series(&self) -> SeriesId {
        self.series
    }

    fn slot(&self) -> u8 {
        self.slot
    }

    fn id(&self, series: SeriesId) -> BlockIoId {
        BlockIoId {
            series,
            dev: self.dev,
            op: BlockOp::from_u8(self.op),
            metric: BlockMetric::from_u8(self.metric),
        }
    }

    fn series_of(id: &BlockIoId) -> SeriesId {
        id.series
    }
}

pub struct BlockIo {
    reader: HistReader<BlockIoKey>,
}

impl BlockIo {
    pub fn take(ebpf: &mut Ebpf) -> Result<BlockIo> {
        Ok(BlockIo {
            reader: HistReader::new(take_map(ebpf, HIST_MAP)?),
        })
    }
}

impl Source for BlockIo {
    fn read(&self, routes: &Provisional) -> Box<dyn Snapshot> {
        let hists = self.reader.read(routes).unwrap_or_else(|e| {
            warn!(error = format!("{e:#}"), "reading block IO map");
            Hists::new()
        });
        Box::new(BlockIoSnapshot(hists))
    }

    fn fold(&self, routes: &Provisional) -> Result<()> {
        self.reader.read(routes).map(drop)
    }
}

/// Every block histogram; `BlockMetric::Unmatched` ones (series untracked, slot 0) count
/// completions only.
#[derive(Debug, Default)]
pub struct BlockIoSnapshot(pub Hists<BlockIoId>);

static DEVICE_SECONDS: Family = Family {
    name: "pgio_block_io_device_seconds",
    help: "Block request device time, issue to complete, by submitting process series (seconds).",
    kind: Kind::Histogram,
};
static QUEUE_SECONDS: Family = Family {
    name: "pgio_block_io_queue_seconds",
    help: "Block request queue time, insert to issue, for requests that went through a scheduler queue (seconds).",
    kind: Kind::Histogram,
};
static REQUESTS: Family = Family {
    name: "pgio_block_io_requests",
    help: "Block requests completed, by submitting process series.",
    kind: Kind::Counter,
};
static BYTES: Family = Family {
    name: "pgio_block_io_bytes",
    help: "Bytes of block requests completed, by submitting process series.",
    kind: Kind::Counter,
};
static UNMATCHED: Family = Family {
    name: "pgio_block_io_unmatched_completions",
    help: "block_rq_complete events pgio could not match to a request it saw start and issue, by device and op: the second completion of requests in a flush sequence (PREFLUSH/FUA writes), empty flushes (their flush request is counted), or requests issued before pgio started. Not lost IO as a rule.",
    kind: Kind::Counter,
};

impl BlockIoSnapshot {
    fn of(
        &self,
        metric: BlockMetric,
    ) -> impl Iterator<Item = (&BlockIoId, &crate::hist::Log2Hist)> {
        self.0.iter().filter(move |(id, _)| id.metric == metric)
    }
}

impl Snapshot for BlockIoSnapshot {
    fn encode(&self, scrape: &mut Scrape<'_>, enc: &mut Encoder) {
        for id in self.0.keys() {
            scrape.devices.see(id.dev);
        }
        let scrape = &*scrape;
        // `volume`: the device's Longhorn volume, else the submitter's (see `BlockLabels`).
        let labels = |id: &BlockIoId| BlockLabels {
            series: scrape.series(id.series),
            device: scrape.devices.name(id.dev),
            op: id.op.name(),
            device_volume: scrape.devices.volume(id.dev),
        };
        let mut f = enc.family(&DEVICE_SECONDS);
        for (id, h) in self.of(BlockMetric::Device) {
            f.histogram(labels(id), h);
        }
        let mut f = enc.family(&QUEUE_SECONDS);
        for (id, h) in self.of(BlockMetric::Queue) {
            f.histogram(labels(id), h);
        }
        let mut f = enc.family(&REQUESTS);
        for (id, h) in self.of(BlockMetric::Device) {
            f.counter(labels(id), h.count());
        }
        let mut f = enc.family(&BYTES);
        for (id, h) in self.of(BlockMetric::Device) {
            f.counter(labels(id), h.bytes);
        }
        let mut f = enc.family(&UNMATCHED);
        for (id, h) in self.of(BlockMetric::Unmatched) {
            let device = scrape.devices.name(id.dev);
            f.counter([("device", device), ("op", id.op.name())], h.count());
        }
    }
}
