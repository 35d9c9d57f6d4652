//! The relation family's reading as a scrape sees it: each kernel key's file named
//! (`book`), placed (`top`), and written as `pgio_relation_io_seconds`,
//! `pgio_relation_io_bytes_total`, `pgio_relation_rest_relations` and
//! `pgio_relation_catalog_errors_total`.
use std::{
    collections::{HashMap, HashSet},
    sync::{Arc, Mutex},
    time::Instant,
};

use pgio_common::{
    relation::{FileClass, RelFile},
    syscall::{Cache, Syscall},
};

use super::{
    RelationId, RelationState,
    book::FileRef,
    top::{Exported, Item, Rank},
};
use crate::{
    collector::{Scrape, Snapshot},
    exposition::{Encoder, Kind, LabelSet, LabelWriter, MetricFamily},
    hist::Hists,
    labels::Labels,
    lock,
};

/// One scrape's relation histograms, by kernel key, and the family's state to name them.
#[derive(Default)]
pub struct RelationSnapshot {
    pub hists: Hists<RelationId>,
    pub state: Arc<Mutex<RelationState>>,
    /// Scrapes so far that served what was shown last (`slots::Slots::read_with`).
    pub inconsistent_reads: u64,
}

/// The `relation` label of a file that is no relation of a catalog, or is not (yet) in one.
fn unnamed(f: &RelFile) -> (String, &'static str, bool) {
    match f.class {
        x if x == FileClass::Wal as u8 => ("(wal)".into(), "", true),
        x if x == FileClass::Temp as u8 => ("(temp)".into(), "", true),
        // The kernel map had no room for the file's key.
        x if x == FileClass::Rest as u8 => (super::top::REST.into(), "", true),
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
                state.top.shown(id)
                    || !file_ref(&id.file).is_some_and(|f| state.book.pending(cluster, &f))
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
        let labelled: Vec<(Exported, RelationLabels, crate::hist::Log2Hist)> = exported
            .into_iter()
            .filter_map(|(e, h)| {
                let syscall = Syscall::try_from(e.syscall).ok()?;
                let cache = Cache::try_from(e.cache).ok()?;
                let l = RelationLabels::new(scrape.series(e.series), &e, syscall, cache);
                Some((e, l, h))
            })
            .collect();
        let labelled = state.merge.merge(labelled);
        drop(state);

        let mut f = enc.family(&RELATION_IO_SECONDS);
        for (l, h) in &labelled {
            f.histogram(l, h);
        }
        let mut f = enc.family(&RELATION_IO_BYTES);
        for (l, h) in &labelled {
            if l.syscall.moves_bytes() {
                f.counter(l, h.bytes);
            }
        }
        let mut f = enc.family(&RELATION_REST);
        for (cluster, n) in &in_rest {
            f.gauge([("pg_cluster", cluster.as_str())], *n as i64);
        }
        let mut f = enc.family(&RELATION_CATALOG_ERRORS);
        f.counter((), read_errors);
        let mut f = enc.family(&INCONSISTENT_READS);
        f.counter(
            [("family", "relation"), ("reason", "folds_during_read")],
            self.inconsistent_reads,
        );
    }
}

/// A relation series' labels: `relation`, `kind`, `syscall`, `cache`, then the process'
/// series labels with `database` the relation's (a checkpointer's write too), or the
/// process' own for a file of no database.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RelationLabels {
    pub(super) series: Labels,
    pub(super) relation: String,
    pub(super) kind: &'static str,
    pub(super) syscall: Syscall,
    pub(super) cache: Cache,
}

impl RelationLabels {
    fn new(series: &Labels, e: &Exported, syscall: Syscall, cache: Cache) -> RelationLabels {
        // A file of no database (WAL, a shared catalog, `(other)`) keeps the process' own:
        // taking its empty one would give two backends of two databases one label set.
        let database = if e.database.is_empty() {
            series.database.clone()
        } else {
            e.database.clone()
        };
        RelationLabels {
            series: Labels {
                database,
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
    help: "Read, write and sync syscall latency per PostgreSQL relation (relation = schema.name from the cluster's catalogs, kind = table/index/toast/matview/sequence/other; (relfilenode N) until the catalogs name it; (wal), (temp), (other); (rest) past max_relations per cluster, or, without database, IO the kernel map had no room for), database = the relation's, or the process' own for a file of no database (WAL, shared catalogs, (other)) (seconds).",
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

pub static INCONSISTENT_READS: MetricFamily = MetricFamily {
    name: "pgio_inconsistent_reads",
    help: "Scrapes that could not read a family's kernel counts as one view (reason=folds_during_read: the kernel kept moving the relation family's fd-slot counts into its map while they were read) and served what that family showed at the scrape before: stale for that scrape, never lower.",
    kind: Kind::Counter,
};

pub static RELATION_CATALOG_ERRORS: MetricFamily = MetricFamily {
    name: "pgio_relation_catalog_errors",
    help: "Reads of a cluster's catalogs for relation names that failed (not a regular file of the data directory's owner, unreadable, unknown version): its files stay (relfilenode N).",
    kind: Kind::Counter,
};

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
