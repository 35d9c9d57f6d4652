//! The relation family (`relations = true`, the default): IO time per PostgreSQL relation.
//! The kernel names the file at the process' `openat` and counts each timed read, write and
//! sync on its fd under it (`pgio-ebpf/src/relation.rs`); this reads
//! `RELATION_HIST` and the rows of the fd slots (`slots`), names each file from its cluster's
//! catalogs (`book`, `names`), and gives the `max_relations` busiest relations of each
//! cluster series of their own (`top`):
//! `pgio_relation_io_seconds{relation="public.orders",kind="table",database,…}`, the others
//! `relation="(rest)"`, a file not (yet) in the catalogs `"(relfilenode <n>)"` (`snapshot`).
pub mod book;
pub mod merge;
pub mod names;
pub mod open_files;
mod served;
pub mod slots;
pub mod snapshot;
pub mod top;

use std::{
    collections::HashSet,
    sync::{Arc, Mutex},
    time::Instant,
};

use anyhow::Result;
use aya::Ebpf;
use pgio_common::{
    SeriesId,
    hist::Bucket,
    relation::{FD_SLOTS, OPEN_MAX, QUOTA, RelFile, RelationKey},
    syscall::{Cache, Syscall},
};

use crate::{
    collector::{Scrape, Snapshot, Source},
    config::Config,
    exposition::Encoder,
    family::{Attach, Family, Probe, Setup, Taken},
    hist::{HistId, HistKey, HistMapSpec, HistSource, Hists, add_slot},
    lock,
    provisional::Provisional,
    series::SharedTracked,
};
use book::NameBook;
use slots::Slots;
pub use snapshot::{
    INCONSISTENT_READS, RELATION_CATALOG_ERRORS, RELATION_IO_BYTES, RELATION_IO_SECONDS,
    RELATION_REST, RelationSnapshot,
};
use top::Top;

pub static RELATIONS: crate::config::Key = crate::config::Key::flag(
    "relations",
    true,
    "IO time per PostgreSQL relation (pgio_relation_io_seconds): openat/close tracepoints, ~0.25 µs per open + close on the node, +15 ns at a tracked read's exit, 9.3 MiB",
);
pub static MAX_RELATIONS: crate::config::Key = crate::config::Key::count(
    "max_relations",
    50,
    1,
    10_000,
    "relations with places per cluster, the ones with the most IO time over the last minute, each its own series (up to as many that lost their places keep theirs, frozen); the others: relation=\"(rest)\"",
);
static CONFIG_KEYS: &[&crate::config::Key] = &[&RELATIONS, &MAX_RELATIONS];

pub static HIST: HistMapSpec = HistMapSpec {
    family: "relation",
    map: "RELATION_HIST",
    quota: QUOTA,
};
/// The series' `(rest)` keys (not under the key quota: a few per series).
static REST_HIST: HistMapSpec = HistMapSpec {
    family: "relation",
    map: "RELATION_REST_HIST",
    quota: QUOTA,
};
const REST_ENTRIES: u32 = 4_096;
/// The eBPF global that turns the syscall exits' relation lookup on (`relations`).
const ENABLED_GLOBAL: &str = "RELATIONS_ON";

pub struct RelationFamily;

fn relations(config: &Config) -> bool {
    config.flag(&RELATIONS)
}

impl Family for RelationFamily {
    fn config_keys(&self) -> &'static [&'static crate::config::Key] {
        CONFIG_KEYS
    }

    fn name(&self) -> &'static str {
        "relation"
    }

    fn probes(&self) -> Vec<Probe> {
        ["sys_enter_openat", "sys_exit_openat", "sys_enter_close"]
            .into_iter()
            .map(|p| {
                // They take the running thread's ids from the syscall family's per-CPU slot.
                Probe::new(p, Attach::TracePoint("syscalls"), false)
                    .when(relations)
                    .after(crate::syscall::SCHED_SWITCH)
            })
            .collect()
    }

    fn maps(&self) -> &'static [&'static str] {
        &[
            "RELATION_HIST",
            "RELATION_REST_HIST",
            "RELATION_FDS",
            "RELATION_FOLDS",
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
        let on = config.flag(&RELATIONS);
        let size = |n: u32| if on { n } else { 1 };
        Setup {
            map_sizes: vec![
                (HIST.map, size(hist_entries(config))),
                (REST_HIST.map, size(REST_ENTRIES)),
                ("RELATION_FDS", size(FD_SLOTS)),
                ("RELATION_OPEN", size(OPEN_MAX)),
            ],
            globals: vec![(ENABLED_GLOBAL, vec![u8::from(on)])],
        }
    }

    fn take(&self, ebpf: &mut Ebpf, config: &Config) -> Result<Taken> {
        let entries = if config.flag(&RELATIONS) {
            hist_entries(config)
        } else {
            1
        };
        let hists = HistSource::<RelationKey>::take(ebpf, &HIST, entries)?;
        let rest = HistSource::<RelationKey>::take(
            ebpf,
            &REST_HIST,
            if config.flag(&RELATIONS) {
                REST_ENTRIES
            } else {
                1
            },
        )?;
        Ok(Taken {
            balanced: Some(hists.balanced()),
            source: Some(Box::new(RelationSource {
                hists,
                rest,
                state: Arc::new(Mutex::new(RelationState::new(config.size(&MAX_RELATIONS)))),
                slots: if config.flag(&RELATIONS) {
                    Some(Mutex::new(Slots::take(ebpf)?))
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
    (crate::hist::entries(config) / 4).max(1024)
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
    merge: merge::LabelMerge,
}

impl RelationState {
    pub fn new(max_relations: usize) -> RelationState {
        RelationState {
            book: NameBook::default(),
            top: Top::new(max_relations),
            merge: merge::LabelMerge::default(),
        }
    }
}

impl Default for RelationState {
    fn default() -> Self {
        RelationState::new(Config::default().size(&MAX_RELATIONS))
    }
}

pub struct RelationSource {
    hists: HistSource<RelationKey>,
    /// `RELATION_REST_HIST`, read and folded with `hists`.
    rest: HistSource<RelationKey>,
    state: Arc<Mutex<RelationState>>,
    /// `RELATION_FDS`: the rows counted in the fd slots, read with the hash maps; and the
    /// slots of the files a process opened before pgio attached (`open_files`). `None` with
    /// `relations = false`.
    slots: Option<Mutex<Slots>>,
    seeded: Mutex<open_files::Seeded>,
}

impl Source for RelationSource {
    fn read(&self, routes: &Provisional) -> Box<dyn Snapshot> {
        let read_maps = || {
            let mut hists = self.hists.reader.peek_or_empty(routes);
            for (id, h) in self.rest.reader.peek_or_empty(routes) {
                hists.entry(id).or_default().merge(&h);
            }
            hists
        };
        let (hists, inconsistent_reads) = match &self.slots {
            Some(slots) => {
                let mut slots = lock(slots);
                (slots.read_with(routes, read_maps), slots.inconsistent_reads)
            }
            None => (read_maps(), 0),
        };
        Box::new(RelationSnapshot {
            hists,
            state: self.state.clone(),
            inconsistent_reads,
        })
    }

    fn fold(&self, routes: &Provisional) -> Result<()> {
        self.hists.fold(routes)?;
        self.rest.fold(routes)
    }

    /// Names the open files of PostgreSQL processes seen for the first time, then reads the
    /// catalogs of the clusters due, outside the lock (a scrape never waits for it).
    fn housekeep(&self, tracked: &SharedTracked) {
        if let Some(slots) = &self.slots {
            let (live, all): (HashSet<u32>, HashSet<u32>) = {
                let t = lock(tracked);
                let live = t
                    .pids
                    .iter()
                    .filter(|(_, s)| {
                        let l = t.registry.exported(**s);
                        l.app == "postgres" && !l.cluster.is_empty()
                    })
                    .map(|(pid, _)| *pid)
                    .collect();
                (live, t.pids.keys().copied().collect())
            };
            let new = lock(&self.seeded).new_ones(&live);
            if !new.is_empty() {
                let routes = lock(tracked).provisional.clone();
                let mut slots = lock(slots);
                for pid in new {
                    // A slot taken from another fd keeps its counts: booked as the kernel's
                    // fold would. A process gone meanwhile has nothing to name.
                    let alive = |p| all.contains(&p);
                    let _ = open_files::seed(&mut slots.fds, pid, alive, |slot| {
                        for (key, b) in slots::row_keys(slot, |s| routes.generation(s)) {
                            self.hists.reader.book(key, b);
                        }
                    });
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

impl HistId for RelationId {
    fn series(&self) -> SeriesId {
        self.series
    }

    /// Not used: `RelationSnapshot` encodes the family, with its names and places.
    fn encode(_: &Hists<RelationId>, _: &mut Scrape<'_>, _: &mut Encoder) {}
}
