//! The query-id family (issue 31): the queries the `query` family times, again per
//! `pg_stat_statements` query id. The kernel books each query under the id its backend shows
//! (`pgio-ebpf/src/query_id.rs`); once a second this tells it where each postmaster's
//! backends keep that id (`sources`), takes the rows of the last epoch out of
//! `QUERY_ID_HIST`, and gives the `max_query_ids` busiest ids of each database series of
//! their own (`places`): `pgio_query_id_seconds{queryid="-1234…",database,…}` and
//! `pgio_query_id_io_seconds`, the other ids `queryid="(rest)"`.
pub mod places;
mod sources;

use std::sync::{Arc, Mutex};

use anyhow::Result;
use aya::{
    Ebpf,
    maps::{Array, HashMap as BpfHashMap, MapData},
};
use pgio_common::{
    SeriesId,
    key_quota::OWNER_SLOTS,
    query_id::{ID_METRICS, IdKind, IdSource, QUOTA, QueryIdKey, QueryIdRow},
    query_wait::Part,
};

use crate::{
    classifier::Classifier,
    collector::{Scrape, Snapshot, Source},
    config::Config,
    exposition::{Encoder, Kind, MetricFamily},
    family::{Family, Probe, Setup, Taken},
    hist::{Balanced, HistMapSpec, Log2Hist},
    labels::WithLabels,
    lock,
    maps::take_map,
    provisional::{Provisional, Route},
    series::SharedTracked,
};
use places::{Counts, Group, Places, Qid};

pub static QUERY_IDS: crate::config::Key = crate::config::Key::flag(
    "query_ids",
    true,
    "with queries, each query booked again under its pg_stat_statements query id (pgio_query_id_seconds), ~0.3-0.45 µs per query",
);
pub static MAX_QUERY_IDS: crate::config::Key = crate::config::Key::count(
    "max_query_ids",
    20,
    1,
    1_000,
    "query ids with series of their own per database, the ones with the most IO time over the last minute; the others: queryid=\"(rest)\"",
);
static CONFIG_KEYS: &[&crate::config::Key] = &[&QUERY_IDS, &MAX_QUERY_IDS];

pub static HIST: HistMapSpec = HistMapSpec {
    family: "query_id",
    map: "QUERY_ID_HIST",
    quota: QUOTA,
};
/// The eBPF global that turns the bookkeeping on (`max_query_ids` > 0 with `queries`).
const ENABLED_GLOBAL: &str = "QUERY_IDS_ON";
const SOURCE_MAP: &str = "QUERY_ID_SOURCE";
const EPOCH_MAP: &str = "QUERY_ID_EPOCH";

pub struct QueryIdFamily;

fn on(config: &Config) -> bool {
    config.flag(&crate::query::QUERIES) && config.flag(&QUERY_IDS)
}

/// Whether the postmasters' `IdSource`s are kept: also where `query_wait` reads a backend's
/// wait event, so whenever queries are timed.
fn sources_on(config: &Config) -> bool {
    config.flag(&crate::query::QUERIES)
}

/// Keys of `QUERY_ID_HIST`: the (series, id) pairs of one or two seconds (1 KiB each, 2 MiB
/// in all, not per CPU).
const HIST_ENTRIES: u32 = 2_048;
/// Processes with an `IdSource`: every process of every tracked cluster (`QUERY` has room
/// for as many client backends).
const SOURCE_ENTRIES: u32 = 16_384;

impl Family for QueryIdFamily {
    fn config_keys(&self) -> &'static [&'static crate::config::Key] {
        CONFIG_KEYS
    }

    fn name(&self) -> &'static str {
        "query_id"
    }

    /// None of its own: it books in the `query` family's socket programs and follows
    /// processes in the `lifecycle` family's fork and exit.
    fn probes(&self) -> Vec<Probe> {
        Vec::new()
    }

    fn maps(&self) -> &'static [&'static str] {
        &["QUERY_ID_HIST", SOURCE_MAP, EPOCH_MAP]
    }

    fn globals(&self) -> &'static [&'static str] {
        &[ENABLED_GLOBAL]
    }

    fn hist_map(&self) -> Option<&'static HistMapSpec> {
        Some(&HIST)
    }

    /// Off, its maps shrink to one entry each (the verifier prunes every use).
    fn setup(&self, config: &Config) -> Setup {
        let size = |n: u32| if on(config) { n } else { 1 };
        Setup {
            map_sizes: vec![
                (HIST.map, size(HIST_ENTRIES)),
                (
                    SOURCE_MAP,
                    if sources_on(config) {
                        SOURCE_ENTRIES
                    } else {
                        1
                    },
                ),
            ],
            globals: vec![(ENABLED_GLOBAL, vec![u8::from(on(config))])],
        }
    }

    fn take(&self, ebpf: &mut Ebpf, config: &Config) -> Result<Taken> {
        let inner = Arc::new(Inner {
            hist: Mutex::new(take_map(ebpf, HIST.map)?),
            sources: Mutex::new(take_map(ebpf, SOURCE_MAP)?),
            epoch_map: Mutex::new(take_map(ebpf, EPOCH_MAP)?),
            max_entries: if on(config) { HIST_ENTRIES } else { 1 },
            state: Mutex::new(State {
                places: Places::new(config.size(&MAX_QUERY_IDS)),
                epoch: 0,
            }),
            known: Mutex::default(),
            on: on(config),
            sources_on: sources_on(config),
        });
        Ok(Taken {
            balanced: Some(inner.clone()),
            source: Some(Box::new(QueryIdSource(inner))),
        })
    }
}

struct Inner {
    hist: Mutex<BpfHashMap<MapData, QueryIdKey, QueryIdRow>>,
    sources: Mutex<BpfHashMap<MapData, u32, IdSource>>,
    epoch_map: Mutex<Array<MapData, u32>>,
    max_entries: u32,
    state: Mutex<State>,
    /// The postmasters whose sources were looked for.
    known: Mutex<sources::Sources>,
    on: bool,
    sources_on: bool,
}

struct State {
    places: Places,
    /// The epoch the kernel makes rows in now.
    epoch: u8,
}

pub struct QueryIdSource(Arc<Inner>);

/// A row's counts.
fn counts(row: &QueryIdRow) -> Counts {
    let hist = |m: usize| {
        let mut slots = row.slots[m];
        slots[0] = slots[0].wrapping_add(row.zeros[m]);
        let mut h = Log2Hist::default();
        h.add_row(&slots, row.sum_ns[m]);
        h
    };
    const _: () = assert!(ID_METRICS == 2);
    Counts {
        duration: hist(0),
        io: hist(1),
        miss_ns: row.miss_ns,
        misses: row.misses,
        parts_ns: row.parts_ns,
    }
}

fn qid(key: &QueryIdKey) -> Qid {
    match IdKind::try_from(key.kind) {
        Ok(IdKind::Known) => Qid::Id(key.query_id),
        Ok(IdKind::None) => Qid::None,
        Ok(IdKind::Refused) => Qid::Rest,
        Ok(IdKind::Unknown) | Err(_) => Qid::Unknown,
    }
}

impl Inner {
    /// Takes the rows of the epoch the kernel no longer makes rows in (it flipped at the
    /// last pass: no program adds to them any more) out of the map, and books them.
    fn drain(&self, tracked: &SharedTracked) {
        let mut state = lock(&self.state);
        let epoch = state.epoch;
        let mut rows: Vec<(SeriesId, Qid, Counts)> = Vec::new();
        {
            let routes = lock(tracked).provisional.clone();
            let mut map = lock(&self.hist);
            let keys: Vec<QueryIdKey> = map.keys().filter_map(Result::ok).collect();
            for key in keys.into_iter().filter(|k| k.epoch != epoch) {
                let series = match routes.route(key.series) {
                    Route::Own => key.series,
                    Route::Fold(series) => series,
                    // Still provisional: taken once its process is classified.
                    Route::Pending => continue,
                    Route::Retired => {
                        let _ = map.remove(&key);
                        continue;
                    }
                };
                if let Ok(row) = map.get(&key, 0) {
                    rows.push((series, qid(&key), counts(&row)));
                }
                let _ = map.remove(&key);
            }
        }
        state.epoch ^= 1;
        if let Err(e) = lock(&self.epoch_map).set(0, u32::from(state.epoch), 0) {
            tracing::warn!(error = %e, "flipping the query id epoch");
        }
        let now = std::time::Instant::now();
        let t = lock(tracked);
        let group_of = |s: SeriesId| -> Option<Group> {
            if t.provisional.retired.contains(&s) {
                return None;
            }
            let l = t.registry.labels(s)?;
            Classifier::serves_clients(l).then(|| (l.cluster.clone(), l.database.clone()))
        };
        for (series, q, c) in &rows {
            if let Some(g) = group_of(*series) {
                state.places.book(now, *series, &g, *q, c);
            }
        }
        state.places.retain(group_of);
    }
}

impl Source for QueryIdSource {
    fn read(&self, _routes: &Provisional) -> Box<dyn Snapshot> {
        let state = lock(&self.0.state);
        Box::new(QueryIdSnapshot {
            exported: state.places.exported.clone(),
            in_rest: state.places.in_rest(),
            sources: lock(&self.0.known).count(),
        })
    }

    /// Tells the kernel where new postmasters' backends keep their query id, then takes the
    /// last epoch's rows.
    fn housekeep(&self, tracked: &SharedTracked) {
        if !self.0.sources_on {
            return;
        }
        sources::publish(tracked, &self.0.known, &self.0.sources);
        if self.0.on {
            self.0.drain(tracked);
        }
    }
}

impl Balanced for Inner {
    fn spec(&self) -> &'static HistMapSpec {
        &HIST
    }

    fn max_entries(&self) -> u32 {
        self.max_entries
    }

    fn count_owners(&self, owner_of: &dyn Fn(SeriesId) -> u8) -> Result<Vec<u32>> {
        let map = lock(&self.hist);
        let mut n = vec![0u32; OWNER_SLOTS as usize];
        for key in map.keys() {
            n[owner_of(key?.series) as usize] += 1;
        }
        Ok(n)
    }

    /// Nothing to evict: every row leaves the map within two seconds (`drain`); an owner
    /// past its share has its new ids booked as `(rest)` meanwhile.
    fn evict(&self, _: &dyn Fn(SeriesId) -> u8, _: &[u32]) -> Result<Vec<u32>> {
        Ok(vec![0; OWNER_SLOTS as usize])
    }
}

/// One scrape's reading: what each series booked under each id, the ids in `(rest)`, and
/// the postmasters whose ids pgio reads (found, not found).
#[derive(Default)]
pub struct QueryIdSnapshot {
    pub exported: std::collections::BTreeMap<(SeriesId, Qid), Counts>,
    pub in_rest: std::collections::BTreeMap<Group, usize>,
    pub sources: (u64, u64),
}

pub static QUERY_ID_SECONDS: MetricFamily = MetricFamily {
    name: "pgio_query_id_seconds",
    help: "pgio_query_seconds per query id: queryid = pg_stat_activity.query_id at the query's end, as pg_stat_statements.queryid shows it; the max_query_ids ids of each database with the most IO time in the last minute, the others queryid=\"(rest)\"; (none): the backend had no id (compute_query_id off, a utility statement before PostgreSQL 16); (unknown): pgio could not read it (seconds).",
    kind: Kind::Histogram,
};
pub static QUERY_ID_IO_SECONDS: MetricFamily = MetricFamily {
    name: "pgio_query_id_io_seconds",
    help: "pgio_query_io_seconds per query id (see pgio_query_id_seconds): IO share of a query id = rate(pgio_query_id_io_seconds_sum) / rate(pgio_query_id_seconds_sum) (seconds).",
    kind: Kind::Histogram,
};
pub static QUERY_ID_READ_MISS_SECONDS: MetricFamily = MetricFamily {
    name: "pgio_query_id_read_miss_seconds",
    help: "Per query id, the part of pgio_query_id_io_seconds spent in reads that missed the page cache (seconds).",
    kind: Kind::Counter,
};
pub static QUERY_ID_CACHE_MISSES: MetricFamily = MetricFamily {
    name: "pgio_query_id_cache_misses",
    help: "Per query id, reads during its queries that missed the page cache.",
    kind: Kind::Counter,
};
pub static QUERY_ID_PART_SECONDS: MetricFamily = MetricFamily {
    name: "pgio_query_id_part_seconds",
    help: "pgio_query_part_seconds per query id (see pgio_query_id_seconds): where the id's query time went, by part (seconds).",
    kind: Kind::Counter,
};
pub static QUERY_ID_REST: MetricFamily = MetricFamily {
    name: "pgio_query_id_rest_ids",
    help: "Query ids of a database with IO time in the last minute that had no place (more than max_query_ids): booked as queryid=\"(rest)\".",
    kind: Kind::Gauge,
};
pub static QUERY_ID_CLUSTERS: MetricFamily = MetricFamily {
    name: "pgio_query_id_postmasters",
    help: "Postmasters whose backends' query ids pgio reads (found), and those where it could not find them (not_found: no MyBEEntry symbol, an unknown major version, an unreadable binary).",
    kind: Kind::Gauge,
};

impl Snapshot for QueryIdSnapshot {
    fn encode(&self, scrape: &mut Scrape<'_>, enc: &mut Encoder) {
        let labelled: Vec<_> = self
            .exported
            .iter()
            .filter(|((s, _), _)| Classifier::serves_clients(scrape.series(*s)))
            .map(|((s, q), c)| (q.label(), scrape.series(*s), c))
            .collect();
        fn labels<'a>(q: &'a str, l: &'a crate::labels::Labels) -> WithLabels<'a, 1> {
            WithLabels {
                series: l,
                extra: [("queryid", q)],
            }
        }
        let mut f = enc.family(&QUERY_ID_SECONDS);
        for (q, l, c) in &labelled {
            f.histogram(labels(q, l), &c.duration);
        }
        let mut f = enc.family(&QUERY_ID_IO_SECONDS);
        for (q, l, c) in &labelled {
            f.histogram(labels(q, l), &c.io);
        }
        let mut f = enc.family(&QUERY_ID_READ_MISS_SECONDS);
        for (q, l, c) in &labelled {
            f.counter_f64(labels(q, l), c.miss_ns as f64 / 1e9);
        }
        let mut f = enc.family(&QUERY_ID_CACHE_MISSES);
        for (q, l, c) in &labelled {
            f.counter(labels(q, l), c.misses);
        }
        let mut f = enc.family(&QUERY_ID_PART_SECONDS);
        for (q, l, c) in &labelled {
            for (part, ns) in Part::ALL.iter().zip(c.parts_ns) {
                if ns != 0 {
                    let labels = WithLabels {
                        series: l,
                        extra: [("queryid", q.as_str()), ("part", part.name())],
                    };
                    f.counter_f64(labels, ns as f64 / 1e9);
                }
            }
        }
        let mut f = enc.family(&QUERY_ID_REST);
        for ((cluster, database), n) in &self.in_rest {
            f.gauge(
                [
                    ("pg_cluster", cluster.as_str()),
                    ("database", database.as_str()),
                ],
                *n as i64,
            );
        }
        let mut f = enc.family(&QUERY_ID_CLUSTERS);
        f.gauge([("state", "found")], self.sources.0 as i64);
        f.gauge([("state", "not_found")], self.sources.1 as i64);
    }
}
