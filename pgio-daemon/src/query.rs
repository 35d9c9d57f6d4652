//! Userspace side of the query probe: reads `QUERY_HIST` at scrape time and writes
//! `pgio_query_seconds`, `pgio_query_io_seconds`, `pgio_query_read_miss_seconds` and
//! `pgio_query_cache_misses_total`.
use std::sync::Arc;

use anyhow::Result;
use aya::Ebpf;
use pgio_common::{
    SeriesId,
    key_quota::HistMap,
    query::{QueryKey, QueryMetric},
};

use crate::{
    collector::{Scrape, Snapshot, Source},
    exposition::{Encoder, Family, Kind},
    hist::{HistKey, HistReader, Hists},
    key_quota::Balanced,
    labels::WithLabels,
    provisional::Provisional,
};

pub const HIST_MAP: &str = "QUERY_HIST";
/// The eBPF global that turns the syscall exits' query bookkeeping on (`query_probes`).
pub const ENABLED_GLOBAL: &str = "QUERY_PROBES";

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct QueryId {
    pub series: SeriesId,
    pub metric: QueryMetric,
}

impl HistKey for QueryKey {
    type Id = QueryId;

    fn series(&self) -> SeriesId {
        self.series
    }

    fn slot(&self) -> u8 {
        self.slot
    }

    fn id(&self, series: SeriesId) -> QueryId {
        QueryId {
            series,
            // The kernel writes only these two.
            metric: QueryMetric::from_u8(self.metric).unwrap_or(QueryMetric::Io),
        }
    }

    fn series_of(id: &QueryId) -> SeriesId {
        id.series
    }
}

pub struct Queries {
    reader: Arc<HistReader<QueryKey>>,
}

impl Queries {
    /// `max_entries`: the histogram map's size as loaded.
    pub fn take(ebpf: &mut Ebpf, max_entries: u32) -> Result<Queries> {
        Ok(Queries {
            reader: Arc::new(HistReader::take(
                ebpf,
                HIST_MAP,
                HistMap::Query,
                max_entries,
            )?),
        })
    }

    /// The histogram map, for `key_quota`.
    pub fn balanced(&self) -> Arc<dyn Balanced> {
        self.reader.clone()
    }
}

impl Source for Queries {
    fn read(&self, routes: &Provisional) -> Box<dyn Snapshot> {
        Box::new(QuerySnapshot(self.reader.read_or_empty(routes)))
    }

    fn fold(&self, routes: &Provisional) -> Result<()> {
        self.reader.read(routes).map(drop)
    }
}

#[derive(Debug, Default)]
pub struct QuerySnapshot(pub Hists<QueryId>);

static QUERY_SECONDS: Family = Family {
    name: "pgio_query_seconds",
    help: "PostgreSQL query duration: from the backend reporting itself active to its next idle report, as pg_stat_activity.state shows it (seconds). One simple-protocol Query message, or one extended-protocol message sequence up to Sync.",
    kind: Kind::Histogram,
};
static QUERY_IO_SECONDS: Family = Family {
    name: "pgio_query_io_seconds",
    help: "Time each query spent in the backend's own IO syscalls (pread/pwrite/fsync/fdatasync/io_uring_enter, not futex waits), one observation per query (seconds). IO share: rate(pgio_query_io_seconds_sum) / rate(pgio_query_seconds_sum).",
    kind: Kind::Histogram,
};
static QUERY_READ_MISS_SECONDS: Family = Family {
    name: "pgio_query_read_miss_seconds",
    help: "Per query, the part of pgio_query_io_seconds spent in reads that missed the page cache (the reading thread submitted block IO), one observation per query (seconds).",
    kind: Kind::Histogram,
};
static QUERY_CACHE_MISSES: Family = Family {
    name: "pgio_query_cache_misses",
    help: "Reads during queries that submitted block IO (page-cache misses).",
    kind: Kind::Counter,
};

impl Snapshot for QuerySnapshot {
    fn encode(&self, scrape: &mut Scrape<'_>, enc: &mut Encoder) {
        let labels = |id: &QueryId| WithLabels {
            series: scrape.series(id.series),
            extra: [],
        };
        for (family, metric) in [
            (&QUERY_SECONDS, QueryMetric::Duration),
            (&QUERY_IO_SECONDS, QueryMetric::Io),
            (&QUERY_READ_MISS_SECONDS, QueryMetric::ReadMiss),
        ] {
            let mut f = enc.family(family);
            for (id, h) in self.0.iter().filter(|(id, _)| id.metric == metric) {
                f.histogram(labels(id), h);
            }
        }
        let mut f = enc.family(&QUERY_CACHE_MISSES);
        for (id, h) in self.0.iter() {
            if id.metric == QueryMetric::Duration {
                f.counter(labels(id), h.bytes);
            }
        }
    }
}
