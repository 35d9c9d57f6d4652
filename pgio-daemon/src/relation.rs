//! The relation family (issue 31, in progress, off by default: `relations = true`): IO time per
//! PostgreSQL relation file. The kernel names the file at the process' `openat` and counts
//! each timed read, write and sync on its fd under it (`pgio-ebpf/src/relation.rs`); this reads
//! `RELATION_HIST` and writes `pgio_relation_io_seconds` with the file as its path names it
//! (`file="base/16384/16385"`). Still to come: `schema.name` and kind from `names`, and the
//! per-cluster top-K with `(rest)`.
pub mod names;

use anyhow::Result;
use aya::Ebpf;
use pgio_common::{
    SeriesId,
    hist::Bucket,
    relation::{
        FD_SLOTS, FileClass, Fork, OPEN_MAX, PG_DEFAULT_TABLESPACE, PG_GLOBAL_TABLESPACE, QUOTA,
        RelFile, RelationKey,
    },
    syscall::{Cache, Syscall},
};

use crate::{
    collector::Scrape,
    config::Config,
    exposition::{Encoder, Kind, MetricFamily},
    family::{Attach, Family, Probe, Setup, Taken},
    hist::{HistId, HistKey, HistMapSpec, HistSource, Hists, add_slot},
    labels::WithLabels,
};

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
            source: Some(Box::new(hists)),
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

/// The `file` label: the path without the segment and the tablespace's version directory
/// (one relation, one value), or what kind of other file it is.
pub fn file_label(f: &RelFile) -> String {
    let fork = match f.fork {
        x if x == Fork::Fsm as u8 => "_fsm",
        x if x == Fork::Vm as u8 => "_vm",
        x if x == Fork::Init as u8 => "_init",
        _ => "",
    };
    match f.class {
        x if x == FileClass::Wal as u8 => "(wal)".to_owned(),
        x if x == FileClass::Temp as u8 => "(temp)".to_owned(),
        x if x == FileClass::Relation as u8 => match f.tablespace {
            PG_DEFAULT_TABLESPACE => format!("base/{}/{}{fork}", f.db, f.relfilenode),
            PG_GLOBAL_TABLESPACE => format!("global/{}{fork}", f.relfilenode),
            spc => format!("pg_tblspc/{spc}/{}/{}{fork}", f.db, f.relfilenode),
        },
        _ => "(other)".to_owned(),
    }
}

pub type RelationSnapshot = crate::hist::HistSnapshot<RelationId>;

pub static RELATION_IO_SECONDS: MetricFamily = MetricFamily {
    name: "pgio_relation_io_seconds",
    help: "Read, write and sync syscall latency per PostgreSQL relation file (file = its path in the data directory without segment, or (wal), (temp), (other)), for files opened while pgio runs; relations = true only, in progress (seconds).",
    kind: Kind::Histogram,
};

pub static RELATION_IO_BYTES: MetricFamily = MetricFamily {
    name: "pgio_relation_io_bytes",
    help: "Bytes read and written by those syscalls per PostgreSQL relation file (see pgio_relation_io_seconds).",
    kind: Kind::Counter,
};

impl HistId for RelationId {
    fn series(&self) -> SeriesId {
        self.series
    }

    fn encode(hists: &Hists<RelationId>, scrape: &mut Scrape<'_>, enc: &mut Encoder) {
        let files: Vec<String> = hists.keys().map(|id| file_label(&id.file)).collect();
        let scrape = &*scrape;
        let mut f = enc.family(&RELATION_IO_SECONDS);
        for ((id, h), file) in hists.iter().zip(&files) {
            f.histogram(labels(scrape, id, file), h);
        }
        let mut f = enc.family(&RELATION_IO_BYTES);
        for ((id, h), file) in hists.iter().zip(&files) {
            if id.syscall.moves_bytes() {
                f.counter(labels(scrape, id, file), h.bytes);
            }
        }
    }
}

fn labels<'a>(scrape: &'a Scrape<'_>, id: &RelationId, file: &'a str) -> WithLabels<'a, 3> {
    WithLabels {
        series: scrape.series(id.series),
        extra: [
            ("file", file),
            ("syscall", id.syscall.name()),
            ("cache", id.cache.name()),
        ],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_labels() {
        let rel = RelFile::relation;
        assert_eq!(file_label(&rel(1663, 5, 1259, Fork::Main)), "base/5/1259");
        assert_eq!(file_label(&rel(1664, 0, 1262, Fork::Vm)), "global/1262_vm");
        assert_eq!(
            file_label(&rel(16390, 5, 16391, Fork::Fsm)),
            "pg_tblspc/16390/5/16391_fsm"
        );
        assert_eq!(file_label(&RelFile::OTHER), "(other)");
    }
}
