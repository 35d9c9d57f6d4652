//! Userspace side of the syscall probes: reads `SYSCALL_HIST` at scrape time and writes
//! `pgio_syscall_seconds` and `pgio_futex_wait_seconds`.
use std::sync::Arc;

use anyhow::Result;
use aya::Ebpf;
use pgio_common::{
    SeriesId,
    key_quota::HistMap,
    syscall::{Cache, Syscall, SyscallKey},
};

use crate::{
    collector::{Scrape, Snapshot, Source},
    exposition::{Encoder, Family, Kind},
    hist::{HistKey, HistReader, Hists},
    key_quota::Balanced,
    labels::WithLabels,
    provisional::Provisional,
};

pub const HIST_MAP: &str = "SYSCALL_HIST";

/// One syscall histogram: a series' calls of one syscall, by page-cache outcome.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct SyscallId {
    pub series: SeriesId,
    /// `Syscall` discriminant as the kernel wrote it.
    pub syscall: u8,
    pub cache: Cache,
}

impl SyscallId {
    fn syscall_name(&self) -> &'static str {
        Syscall::from_u8(self.syscall).map_or("unknown", Syscall::name)
    }

    /// Waits are not IO: they get their own family.
    fn is_futex(&self) -> bool {
        matches!(
            Syscall::from_u8(self.syscall),
            Some(Syscall::Futex | Syscall::FutexWaitv)
        )
    }
}

impl HistKey for SyscallKey {
    type Id = SyscallId;

    fn series(&self) -> SeriesId {
        self.series
    }

    fn slot(&self) -> u8 {
        self.slot
    }

    fn id(&self, series: SeriesId) -> SyscallId {
        SyscallId {
            series,
            syscall: self.syscall,
            cache: Cache::from_u8(self.cache),
        }
    }

    fn series_of(id: &SyscallId) -> SeriesId {
        id.series
    }
}

pub struct Syscalls {
    reader: Arc<HistReader<SyscallKey>>,
}

impl Syscalls {
    /// `max_entries`: the histogram map's size as loaded.
    pub fn take(ebpf: &mut Ebpf, max_entries: u32) -> Result<Syscalls> {
        Ok(Syscalls {
            reader: Arc::new(HistReader::take(
                ebpf,
                HIST_MAP,
                HistMap::Syscall,
                max_entries,
            )?),
        })
    }

    /// The histogram map, for `key_quota`.
    pub fn balanced(&self) -> Arc<dyn Balanced> {
        self.reader.clone()
    }
}

impl Source for Syscalls {
    fn read(&self, routes: &Provisional) -> Box<dyn Snapshot> {
        Box::new(SyscallSnapshot(self.reader.read_or_empty(routes)))
    }

    fn fold(&self, routes: &Provisional) -> Result<()> {
        self.reader.read(routes).map(drop)
    }
}

#[derive(Debug, Default)]
pub struct SyscallSnapshot(pub Hists<SyscallId>);

static SYSCALL_SECONDS: Family = Family {
    name: "pgio_syscall_seconds",
    help: "IO syscall latency, enter to exit, per tracked process series; cache=miss when the calling thread submitted block IO during a read (seconds).",
    kind: Kind::Histogram,
};
static FUTEX_WAIT_SECONDS: Family = Family {
    name: "pgio_futex_wait_seconds",
    help: "futex waits (WAIT, WAIT_BITSET, LOCK_PI, LOCK_PI2, WAIT_REQUEUE_PI; futex_waitv), enter to exit (seconds). Not IO. In Go programs such as the Longhorn engine and replicas most of this is the Go runtime parking idle threads (scheduler and sysmon sleeps), not waiting on replicas, IO or locks: it grows with idle threads, not with latency.",
    kind: Kind::Histogram,
};

impl Snapshot for SyscallSnapshot {
    fn encode(&self, scrape: &mut Scrape<'_>, enc: &mut Encoder) {
        let labels = |id: &SyscallId| WithLabels {
            series: scrape.series(id.series),
            extra: [("syscall", id.syscall_name()), ("cache", id.cache.label())],
        };
        for (family, futex) in [(&SYSCALL_SECONDS, false), (&FUTEX_WAIT_SECONDS, true)] {
            let mut f = enc.family(family);
            for (id, h) in self.0.iter().filter(|(id, _)| id.is_futex() == futex) {
                f.histogram(labels(id), h);
            }
        }
    }
}
