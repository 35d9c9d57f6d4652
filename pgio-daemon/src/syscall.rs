//! Userspace side of the syscall probes: reads `SYSCALL_HIST` at scrape time and writes
//! `pgio_syscall_seconds` and `pgio_futex_wait_seconds`.
use std::sync::{Arc, Mutex};

use anyhow::Result;
use aya::{
    Ebpf,
    maps::{Array, MapData, PerCpuArray},
};
use pgio_common::{
    SeriesId,
    hist::Bucket,
    key_quota::HistMap,
    syscall::{Cache, RowTag, SYSCALL_ROWS, Syscall, SyscallKey, SyscallRow},
};
use tracing::warn;

use crate::{
    collector::{Scrape, Snapshot, Source},
    exposition::{Encoder, Family, Kind},
    hist::{HistKey, HistReader, Hists},
    key_quota::Balanced,
    labels::WithLabels,
    lock,
    maps::take_map,
    provisional::{Provisional, Route},
};

pub const HIST_MAP: &str = "SYSCALL_HIST";
const ROWS_MAP: &str = "SYSCALL_ROWS_MAP";
/// The eBPF global that turns the dense rows on (`syscall_rows`).
pub const ROWS_GLOBAL: &str = "SYSCALL_ROWS_ON";
const ROW_GEN_MAP: &str = "SYSCALL_ROW_GEN";

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
    rows: Mutex<Rows>,
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
            rows: Mutex::new(Rows {
                rows: take_map(ebpf, ROWS_MAP)?,
                generation: take_map(ebpf, ROW_GEN_MAP)?,
                generations: Vec::new(),
            }),
        })
    }

    /// The histogram map, for `key_quota`.
    pub fn balanced(&self) -> Arc<dyn Balanced> {
        self.reader.clone()
    }

    fn read_all(&self, routes: &Provisional) -> Result<Hists<SyscallId>> {
        let mut hists = self.reader.read(routes)?;
        let mut rows = lock(&self.rows);
        let read = rows.read(routes, &mut hists);
        rows.retire(routes);
        read.map(|()| hists)
    }
}

/// The kernel's dense rows (`SYSCALL_ROWS_MAP`) and the generation of each series id
/// (`SYSCALL_ROW_GEN`), which only this reader writes.
struct Rows {
    rows: PerCpuArray<MapData, SyscallRow>,
    generation: Array<MapData, u32>,
    /// Mirror of `SYSCALL_ROW_GEN`, by series id.
    generations: Vec<u32>,
}

impl Rows {
    fn generation(&self, series: SeriesId) -> u32 {
        self.generations
            .get(series.0 as usize)
            .copied()
            .unwrap_or(0)
    }

    /// Adds each CPU's rows of live series to `out`.
    fn read(&self, routes: &Provisional, out: &mut Hists<SyscallId>) -> Result<()> {
        for i in 0..SYSCALL_ROWS {
            let per_cpu = self.rows.get(&i, 0)?;
            for row in per_cpu.iter() {
                let Some(t) = RowTag::decode(row.tag) else {
                    continue;
                };
                if t.generation != self.generation(t.series) || routes.route(t.series) != Route::Own
                {
                    continue;
                }
                let h = out
                    .entry(SyscallId {
                        series: t.series,
                        syscall: t.syscall,
                        cache: Cache::from_u8(t.cache),
                    })
                    .or_default();
                for (slot, count) in row.slots.iter().enumerate() {
                    if *count != 0 {
                        let b = Bucket {
                            count: *count,
                            sum: 0,
                            bytes: 0,
                        };
                        h.add(slot as u8, &b);
                    }
                }
                h.sum_ns = h.sum_ns.wrapping_add(row.sum);
            }
        }
        Ok(())
    }

    /// Moves the generation of the series retired at this pass on, before their ids are given
    /// out again: their rows go stale (moving it twice for one retirement is harmless).
    fn retire(&mut self, routes: &Provisional) {
        for series in &routes.retired {
            let i = series.0 as usize;
            if self.generations.len() <= i {
                self.generations.resize(i + 1, 0);
            }
            let next = self.generations[i].wrapping_add(1);
            match self.generation.set(series.0, next, 0) {
                Ok(()) => self.generations[i] = next,
                // The id stays below the map's size (the config caps max_series); were it
                // not, its rows would be counted under its next labels.
                Err(e) => {
                    warn!(series = series.0, error = %e, "moving a series' row generation on")
                }
            }
        }
    }
}

impl Source for Syscalls {
    fn read(&self, routes: &Provisional) -> Box<dyn Snapshot> {
        Box::new(SyscallSnapshot(self.read_all(routes).unwrap_or_else(|e| {
            warn!(error = format!("{e:#}"), "reading the syscall histograms");
            Hists::new()
        })))
    }

    /// Rows never hold provisional series: only the hash map has anything to fold.
    fn fold(&self, routes: &Provisional) -> Result<()> {
        let read = self.reader.read(routes).map(drop);
        lock(&self.rows).retire(routes);
        read
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
