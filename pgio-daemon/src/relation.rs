//! The relation family (issue 31, in progress, off by default: `relations = true`): IO time per
//! PostgreSQL relation. The kernel names the file at the process' `openat` and counts each
//! timed read, write and sync on its fd under it (`pgio-ebpf/src/relation.rs`); this reads
//! `RELATION_HIST`, names each file from its cluster's catalogs (`book`, `names`), and gives
//! the `max_relations` busiest relations of each cluster series of their own (`top`):
//! `pgio_relation_io_seconds{relation="public.orders",kind="table",database,…}`, the others
//! `relation="(rest)"`, a file not (yet) in the catalogs `"(relfilenode <n>)"`.
pub mod book;
pub mod names;
pub mod open_files;
pub mod top;

use std::{
    collections::{HashMap, HashSet},
    sync::{Arc, Mutex},
    time::Instant,
};

use anyhow::Result;
use aya::{
    Ebpf,
    maps::{Array, MapData},
};
use pgio_common::{
    SeriesId,
    hist::Bucket,
    relation::{FD_SLOTS, FdSlot, FileClass, OPEN_MAX, QUOTA, RelFile, RelationKey},
    syscall::{Cache, Syscall},
};

use crate::{
    collector::{Scrape, Snapshot, Source},
    config::Config,
    exposition::{Encoder, Kind, LabelSet, LabelWriter, MetricFamily},
    family::{Attach, Family, Probe, Setup, Taken},
    hist::{HistId, HistKey, HistMapSpec, HistSource, Hists, add_slot},
    labels::Labels,
    lock,
    maps::take_map,
    provisional::Provisional,
    series::SharedTracked,
};
use book::{FileRef, NameBook};
use top::{Exported, Item, Rank, Top};

pub static HIST: HistMapSpec = HistMapSpec {
    family: "relation",
    map: "RELATION_HIST",
    quota: QUOTA,
};
/// The eBPF global that turns the syscall exits' relation lookup on (`relations`).
const ENABLED_GLOBAL: &str = "RELATIONS_ON";

pub struct RelationFamily;

fn relations(config: &Config) -> bool {
    config.relations
}

impl Family for RelationFamily {
    fn name(&self) -> &'static str {
        "relation"
    }

    fn probes(&self) -> Vec<Probe> {
        ["sys_enter_openat", "sys_exit_openat"]
            .into_iter()
            .map(|p| Probe::new(p, Attach::TracePoint("syscalls"), false).when(relations))
            .collect()
    }

    fn maps(&self) -> &'static [&'static str] {
        &[
            "RELATION_HIST",
            "RELATION_FDS",
            "RELATION_OPEN",
            "RELATION_PATH",
        ]
    }

    fn globals(&self) -> &'static [&'static str] {
        &[ENABLED_GLOBAL]
    }

    fn hist_map(&self) -> Option<&'static HistMapSpec> {
        Some(&HIST)
    }

    /// Off, its maps shrink to one entry each (nothing reaches them: the verifier prunes the
    /// lookup, and the openat programs are not attached).
    fn setup(&self, config: &Config) -> Setup {
        let on = config.relations;
        let size = |n: u32| if on { n } else { 1 };
        Setup {
            map_sizes: vec![
                (HIST.map, size(hist_entries(config))),
                ("RELATION_FDS", size(FD_SLOTS)),
                ("RELATION_OPEN", size(OPEN_MAX)),
            ],
            globals: vec![(ENABLED_GLOBAL, vec![u8::from(on)])],
        }
    }

    fn take(&self, ebpf: &mut Ebpf, config: &Config) -> Result<Taken> {
        let entries = if config.relations {
            hist_entries(config)
        } else {
            1
        };
        let hists = HistSource::<RelationKey>::take(ebpf, &HIST, entries)?;
        Ok(Taken {
            balanced: Some(hists.balanced()),
            source: Some(Box::new(RelationSource {
                hists,
                state: Arc::new(Mutex::new(RelationState::new(config.max_relations))),
                fds: if config.relations {
                    Some(Mutex::new(take_map(ebpf, "RELATION_FDS")?))
                } else {
                    None
                },
                seeded: Mutex::default(),
            })),
        })
    }
}

/// A quarter of the other histogram maps' keys: a key here is a file, not a syscall.
fn hist_entries(config: &Config) -> u32 {
    (config.hist_map_entries() / 4).max(1024)
}

/// One relation histogram: a series' calls of one syscall on one file, by cache outcome.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct RelationId {
    pub series: SeriesId,
    pub file: RelFile,
    pub syscall: Syscall,
    pub cache: Cache,
}

impl HistKey for RelationKey {
    type Id = RelationId;
    type Value = Bucket;

    fn series(&self) -> SeriesId {
        self.series
    }

    fn add_to(&self, series: SeriesId, value: &Bucket, hists: &mut Hists<RelationId>) -> bool {
        let id = || {
            Some(RelationId {
                series,
                file: self.file,
                syscall: Syscall::try_from(self.syscall).ok()?,
                cache: Cache::try_from(self.cache).ok()?,
            })
        };
        add_slot(id(), self.slot, value, hists)
    }
}

/// What the relation family keeps between scrapes: names, and who has a place.
#[derive(Debug)]
pub struct RelationState {
    pub book: NameBook,
    top: Top<RelationId>,
}

impl RelationState {
    pub fn new(max_relations: usize) -> RelationState {
        RelationState {
            book: NameBook::default(),
            top: Top::new(max_relations),
        }
    }
}

impl Default for RelationState {
    fn default() -> Self {
        RelationState::new(Config::default().max_relations)
    }
}

pub struct RelationSource {
    hists: HistSource<RelationKey>,
    state: Arc<Mutex<RelationState>>,
    /// `RELATION_FDS`, to name the files a process opened before pgio attached
    /// (`open_files`); `None` with `relations = false`.
    fds: Option<Mutex<Array<MapData, FdSlot>>>,
    seeded: Mutex<open_files::Seeded>,
}

impl Source for RelationSource {
    fn read(&self, routes: &Provisional) -> Box<dyn Snapshot> {
        Box::new(RelationSnapshot {
            hists: self.hists.reader.peek_or_empty(routes),
            state: self.state.clone(),
        })
    }

    fn fold(&self, routes: &Provisional) -> Result<()> {
        self.hists.fold(routes)
    }

    /// Names the open files of PostgreSQL processes seen for the first time, then reads the
    /// catalogs of the clusters due, outside the lock (a scrape never waits for it).
    fn housekeep(&self, tracked: &SharedTracked) {
        if let Some(fds) = &self.fds {
            let live: HashSet<u32> = {
                let t = lock(tracked);
                t.pids
                    .iter()
                    .filter(|(_, s)| {
                        let l = t.registry.exported(**s);
                        l.app == "postgres" && !l.cluster.is_empty()
                    })
                    .map(|(pid, _)| *pid)
                    .collect()
            };
            let new = lock(&self.seeded).new_ones(&live);
            if !new.is_empty() {
                let mut fds = lock(fds);
                for pid in new {
                    // A process gone meanwhile has nothing to name.
                    let _ = open_files::seed(&mut fds, pid);
                }
            }
        }
        let jobs = lock(&self.state).book.due(Instant::now());
        for job in jobs {
            let read = job.read();
            lock(&self.state).book.store(&job, read, Instant::now());
        }
    }
}

/// One scrape's relation histograms, by kernel key, and the family's state to name them.
#[derive(Default)]
pub struct RelationSnapshot {
    pub hists: Hists<RelationId>,
    pub state: Arc<Mutex<RelationState>>,
}

/// The `relation` label of a file that is no relation of a catalog, or is not (yet) in one.
fn unnamed(f: &RelFile) -> (String, &'static str, bool) {
    match f.class {
        x if x == FileClass::Wal as u8 => ("(wal)".into(), "", true),
        x if x == FileClass::Temp as u8 => ("(temp)".into(), "", true),
        x if x == FileClass::Relation as u8 => {
            (format!("(relfilenode {})", f.relfilenode), "", false)
        }
        _ => ("(other)".into(), "", true),
    }
}

fn file_ref(f: &RelFile) -> Option<FileRef> {
    (f.class == FileClass::Relation as u8).then_some(FileRef {
        db: f.db,
        tablespace: f.tablespace,
        relfilenode: f.relfilenode,
    })
}

impl Snapshot for RelationSnapshot {
    fn encode(&self, scrape: &mut Scrape<'_>, enc: &mut Encoder) {
        let mut state = lock(&self.state);
        let scrape = &*scrape;
        // The catalogs of a cluster are read through a live process of it, its postmaster
        // if pgio tracks it (it outlives every other).
        let mut cluster_pid: HashMap<&str, (bool, u32)> = HashMap::new();
        for (pid, series) in &scrape.tracked.pids {
            let l = scrape.series(*series);
            if l.app != "postgres" || l.cluster.is_empty() {
                continue;
            }
            let postmaster = l.role == "postmaster";
            let e = cluster_pid.entry(&l.cluster).or_insert((postmaster, *pid));
            if postmaster && !e.0 {
                *e = (true, *pid);
            }
        }
        // Every cluster with relation files keeps its names, also while none of its processes
        // runs (its series are still exported); one without a live process is not read.
        let mut wanted: HashMap<String, (u32, HashSet<FileRef>)> = HashMap::new();
        for id in self.hists.keys() {
            let l = scrape.series(id.series);
            if let Some(f) = file_ref(&id.file)
                && l.app == "postgres"
                && !l.cluster.is_empty()
            {
                let w = wanted.entry(l.cluster.clone()).or_default();
                w.0 = cluster_pid
                    .get(l.cluster.as_str())
                    .map_or(0, |(_, pid)| *pid);
                w.1.insert(f);
            }
        }
        state.book.want(wanted);

        let items: Vec<Item<RelationId>> = self
            .hists
            .iter()
            .filter(|(id, _)| {
                let cluster = &scrape.series(id.series).cluster;
                !file_ref(&id.file).is_some_and(|f| state.book.pending(cluster, &f))
            })
            .map(|(id, h)| {
                let cluster = &scrape.series(id.series).cluster;
                let named = file_ref(&id.file).and_then(|f| state.book.relation(cluster, &f));
                let (relation, kind, fixed) = match named {
                    Some(r) => (format!("{}.{}", r.schema, r.name), r.kind.as_str(), false),
                    None => unnamed(&id.file),
                };
                let database = match file_ref(&id.file) {
                    Some(f) if f.db != 0 => state
                        .book
                        .database(cluster, f.db)
                        .map_or_else(|| format!("(oid {})", f.db), str::to_owned),
                    _ => String::new(),
                };
                Item {
                    id: *id,
                    series: id.series,
                    syscall: id.syscall as u8,
                    cache: id.cache as u8,
                    rank: Rank {
                        cluster: cluster.clone(),
                        database,
                        relation,
                        kind,
                        fixed,
                    },
                    hist: h.clone(),
                }
            })
            .collect();
        let exported = state.top.book(Instant::now(), &items);
        let in_rest = state.top.in_rest(&items);
        let read_errors = state.book.read_errors;
        drop(state);

        let labelled: Vec<(RelationLabels, &crate::hist::Log2Hist, bool)> = exported
            .iter()
            .filter_map(|(e, h)| {
                let syscall = Syscall::try_from(e.syscall).ok()?;
                let cache = Cache::try_from(e.cache).ok()?;
                Some((
                    RelationLabels::new(scrape.series(e.series), e, syscall, cache),
                    h,
                    syscall.moves_bytes(),
                ))
            })
            .collect();
        let mut f = enc.family(&RELATION_IO_SECONDS);
        for (l, h, _) in &labelled {
            f.histogram(l, h);
        }
        let mut f = enc.family(&RELATION_IO_BYTES);
        for (l, h, moves) in &labelled {
            if *moves {
                f.counter(l, h.bytes);
            }
        }
        let mut f = enc.family(&RELATION_REST);
        for (cluster, n) in &in_rest {
            f.gauge([("cluster", cluster.as_str())], *n as i64);
        }
        let mut f = enc.family(&RELATION_CATALOG_ERRORS);
        f.counter((), read_errors);
    }
}

/// A relation series' labels: `relation`, `kind`, `syscall`, `cache`, then the process'
/// series labels with `database` the relation's (a checkpointer's write too).
pub struct RelationLabels {
    series: Labels,
    relation: String,
    kind: &'static str,
    syscall: Syscall,
    cache: Cache,
}

impl RelationLabels {
    fn new(series: &Labels, e: &Exported, syscall: Syscall, cache: Cache) -> RelationLabels {
        RelationLabels {
            series: Labels {
                database: e.database.clone(),
                ..series.clone()
            },
            relation: e.relation.clone(),
            kind: e.kind,
            syscall,
            cache,
        }
    }
}

impl LabelSet for &RelationLabels {
    fn write(&self, w: &mut LabelWriter<'_>) {
        [
            ("relation", self.relation.as_str()),
            ("kind", self.kind),
            ("syscall", self.syscall.name()),
            ("cache", self.cache.name()),
        ]
        .into_iter()
        .filter(|(_, v)| !v.is_empty())
        .for_each(|(k, v)| w.label(k, v));
        self.series.write(w);
    }
}

pub static RELATION_IO_SECONDS: MetricFamily = MetricFamily {
    name: "pgio_relation_io_seconds",
    help: "Read, write and sync syscall latency per PostgreSQL relation (relation = schema.name from the cluster's catalogs, kind = table/index/toast/matview/sequence/other; (relfilenode N) until the catalogs name it; (wal), (temp), (other); (rest) past max_relations per cluster), database = the relation's, for files opened while pgio runs; relations = true only, in progress (seconds).",
    kind: Kind::Histogram,
};

pub static RELATION_IO_BYTES: MetricFamily = MetricFamily {
    name: "pgio_relation_io_bytes",
    help: "Bytes read and written by those syscalls per PostgreSQL relation (see pgio_relation_io_seconds).",
    kind: Kind::Counter,
};

pub static RELATION_REST: MetricFamily = MetricFamily {
    name: "pgio_relation_rest_relations",
    help: "Relations of a cluster booked under relation=\"(rest)\" now: more had IO than max_relations.",
    kind: Kind::Gauge,
};

pub static RELATION_CATALOG_ERRORS: MetricFamily = MetricFamily {
    name: "pgio_relation_catalog_errors",
    help: "Reads of a cluster's catalogs for relation names that failed (not a regular file of the data directory's owner, unreadable, unknown version): its files stay (relfilenode N).",
    kind: Kind::Counter,
};

impl HistId for RelationId {
    fn series(&self) -> SeriesId {
        self.series
    }

    /// Not used: `RelationSnapshot` encodes the family, with its names and places.
    fn encode(_: &Hists<RelationId>, _: &mut Scrape<'_>, _: &mut Encoder) {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use pgio_common::relation::{Fork, PG_DEFAULT_TABLESPACE, PG_GLOBAL_TABLESPACE};

    #[test]
    fn files_outside_the_catalogs_have_fixed_names() {
        let rel = RelFile::relation;
        assert_eq!(
            unnamed(&rel(1663, 5, 16385, Fork::Vm)).0,
            "(relfilenode 16385)"
        );
        assert_eq!(unnamed(&RelFile::OTHER), ("(other)".to_owned(), "", true));
        assert_eq!(
            file_ref(&rel(PG_GLOBAL_TABLESPACE, 0, 1262, Fork::Main)),
            Some(FileRef {
                db: 0,
                tablespace: PG_GLOBAL_TABLESPACE,
                relfilenode: 1262
            })
        );
        assert_eq!(file_ref(&RelFile::OTHER), None);
        assert_eq!(PG_DEFAULT_TABLESPACE, 1663);
    }
}
