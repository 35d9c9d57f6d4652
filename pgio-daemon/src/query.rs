//! Userspace side of the query probe: reads `QUERY_HIST` at scrape time and writes
//! `pgio_query_seconds`, `pgio_query_io_seconds`, `pgio_query_read_miss_seconds` and
//! `pgio_query_cache_misses_total`.
use anyhow::Result;
use aya::Ebpf;
use pgio_common::{
    SeriesId,
    hist::Bucket,
    query::{QUOTA, QueryKey, QueryMetric},
};

use crate::{
    collector::Scrape,
    config::Config,
    exposition::{Encoder, Kind, MetricFamily},
    family::{Attach, Family, Probe, Setup, Taken},
    hist::{HistId, HistKey, HistMapSpec, HistSnapshot, HistSource, Hists, add_slot},
    labels::WithLabels,
};

pub static HIST: HistMapSpec = HistMapSpec {
    family: "query",
    map: "QUERY_HIST",
    quota: QUOTA,
};
/// The eBPF global that turns the syscall exits' query bookkeeping on (`query_probes`).
const ENABLED_GLOBAL: &str = "QUERY_PROBES";

/// The query family (`Family`): uprobes on PostgreSQL, attached per binary.
pub struct QueryFamily;

impl Family for QueryFamily {
    fn name(&self) -> &'static str {
        "query"
    }

    fn probes(&self) -> Vec<Probe> {
        let uprobe = |function| Attach::UProbeLater { function };
        vec![
            // PostgreSQL reports each change of `pg_stat_activity.state` through
            // `pgstat_report_activity`: a query runs from `active` to the next idle state.
            // Without it, no query metrics.
            Probe::new(
                "pgstat_report_activity",
                uprobe("pgstat_report_activity"),
                true,
            ),
            // PostgreSQL 18's wait for an asynchronous IO (with `io_method = worker` an io
            // worker does the read): its time is the query's IO time. Absent before 18.
            Probe::new("pgaio_wref_wait", uprobe("pgaio_wref_wait"), true),
            Probe::new(
                "pgaio_wref_wait_return",
                Attach::URetProbeLater {
                    function: "pgaio_wref_wait",
                },
                true,
            ),
        ]
    }

    fn maps(&self) -> &'static [&'static str] {
        &["QUERY_HIST", "QUERY"]
    }

    fn globals(&self) -> &'static [&'static str] {
        &[ENABLED_GLOBAL]
    }

    fn hist_map(&self) -> Option<&'static HistMapSpec> {
        Some(&HIST)
    }

    fn setup(&self, config: &Config) -> Setup {
        Setup {
            map_sizes: vec![(HIST.map, entries(config))],
            globals: vec![(ENABLED_GLOBAL, vec![u8::from(config.query_probes)])],
        }
    }

    fn enabled(&self, config: &Config) -> bool {
        config.query_probes
    }

    fn take(&self, ebpf: &mut Ebpf, config: &Config) -> Result<Taken> {
        let hists = HistSource::<QueryKey>::take(ebpf, &HIST, entries(config))?;
        Ok(Taken {
            balanced: Some(hists.balanced()),
            source: Some(Box::new(hists)),
        })
    }
}

/// A quarter of the other histogram maps: a few keys per series.
fn entries(config: &Config) -> u32 {
    (config.hist_map_entries() / 4).max(1024)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct QueryId {
    pub series: SeriesId,
    pub metric: QueryMetric,
}

impl HistKey for QueryKey {
    type Id = QueryId;
    type Value = Bucket;

    fn series(&self) -> SeriesId {
        self.series
    }

    fn add_to(&self, series: SeriesId, value: &Bucket, hists: &mut Hists<QueryId>) -> bool {
        let id = || {
            Some(QueryId {
                series,
                metric: QueryMetric::try_from(self.metric).ok()?,
            })
        };
        add_slot(id(), self.slot, value, hists)
    }
}

pub type QuerySnapshot = HistSnapshot<QueryId>;

static QUERY_SECONDS: MetricFamily = MetricFamily {
    name: "pgio_query_seconds",
    help: "PostgreSQL query duration: from the backend reporting itself active to its next idle report, as pg_stat_activity.state shows it (seconds). One simple-protocol Query message, or one extended-protocol message sequence up to Sync.",
    kind: Kind::Histogram,
};
static QUERY_IO_SECONDS: MetricFamily = MetricFamily {
    name: "pgio_query_io_seconds",
    help: "Time each query spent in the backend's own IO syscalls (pread/pwrite/fsync/fdatasync/io_uring_enter, not futex waits), one observation per query (seconds). IO share: rate(pgio_query_io_seconds_sum) / rate(pgio_query_seconds_sum).",
    kind: Kind::Histogram,
};
static QUERY_READ_MISS_SECONDS: MetricFamily = MetricFamily {
    name: "pgio_query_read_miss_seconds",
    help: "Per query, the part of pgio_query_io_seconds spent in reads that missed the page cache (the reading thread submitted block IO), one observation per query (seconds).",
    kind: Kind::Histogram,
};
static QUERY_CACHE_MISSES: MetricFamily = MetricFamily {
    name: "pgio_query_cache_misses",
    help: "Reads during queries that submitted block IO (page-cache misses).",
    kind: Kind::Counter,
};

impl HistId for QueryId {
    fn series(&self) -> SeriesId {
        self.series
    }

    fn encode(hists: &Hists<QueryId>, scrape: &mut Scrape<'_>, enc: &mut Encoder) {
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
            for (id, h) in hists.iter().filter(|(id, _)| id.metric == metric) {
                f.histogram(labels(id), h);
            }
        }
        let mut f = enc.family(&QUERY_CACHE_MISSES);
        for (id, h) in hists.iter() {
            if id.metric == QueryMetric::Duration {
                f.counter(labels(id), h.bytes);
            }
        }
    }
}
