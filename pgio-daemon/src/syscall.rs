//! Userspace side of the syscall probes: reads `SYSCALL_HIST` at scrape time and writes
//! `pgio_syscall_seconds` and `pgio_futex_wait_seconds`.
use std::sync::Mutex;

use anyhow::Result;
use aya::{
    Ebpf,
    maps::{Array, MapData, PerCpuArray},
};
use pgio_common::{
    SeriesId,
    hist::Bucket,
    syscall::{Cache, QUOTA, RowTag, Syscall, SyscallKey, SyscallRow, syscall_rows_for},
};
use tracing::warn;

use crate::{
    collector::{Scrape, Snapshot, Source},
    config::Config,
    exposition::{Encoder, Kind, MetricFamily},
    family::{Attach, Family, Probe, Setup, Taken},
    hist::{HistId, HistKey, HistMapSpec, HistSnapshot, HistSource, Hists, add_slot},
    labels::WithLabels,
    lock,
    maps::take_map,
    provisional::{Provisional, Route},
};

pub static SYSCALL_ROWS: crate::config::Key = crate::config::Key::flag(
    "syscall_rows",
    true,
    "the busiest syscall histograms in dense per-CPU rows, ~60 ns less per timed syscall: up to 256 rows (135 KiB) per CPU, 16 MiB on all CPUs at most",
);
static CONFIG_KEYS: &[&crate::config::Key] = &[&SYSCALL_ROWS];

pub static HIST: HistMapSpec = HistMapSpec {
    family: "syscall",
    map: "SYSCALL_HIST",
    quota: QUOTA,
};
const ROWS_MAP: &str = "SYSCALL_ROWS_MAP";
/// The eBPF global that says how many dense rows there are (0: `syscall_rows = false`).
const ROWS_GLOBAL: &str = "SYSCALL_ROWS_N";
const ROW_GEN_MAP: &str = "SYSCALL_ROW_GEN";
/// Tells the syscall programs that another thread runs, and moves a switched-out thread's
/// pending syscall start off its CPU.
pub const SCHED_SWITCH: &str = "sched_switch";

/// The syscall family (`Family`).
pub struct SyscallFamily;

impl Family for SyscallFamily {
    fn config_keys(&self) -> &'static [&'static crate::config::Key] {
        CONFIG_KEYS
    }

    fn name(&self) -> &'static str {
        "syscall"
    }

    fn probes(&self) -> Vec<Probe> {
        let mut probes = vec![Probe::new(SCHED_SWITCH, Attach::BtfTracePoint, false)];
        for sc in Syscall::ALL {
            for dir in ["enter", "exit"] {
                probes.push(Probe {
                    program: format!("sys_{dir}_{}", sc.name()).into(),
                    attach: Attach::TracePoint("syscalls"),
                    // futex_waitv appeared in 5.16.
                    optional: sc == Syscall::FutexWaitv,
                    // Without it they would book one thread's calls on another's series.
                    requires: Some(SCHED_SWITCH),
                    when: None,
                    kernel: None,
                });
            }
        }
        probes
    }

    fn maps(&self) -> &'static [&'static str] {
        &[
            "SYSCALL_HIST",
            ROWS_MAP,
            ROW_GEN_MAP,
            "SYSCALL_CPU",
            "SYSCALL_SPILLED",
        ]
    }

    fn globals(&self) -> &'static [&'static str] {
        &[ROWS_GLOBAL]
    }

    fn hist_map(&self) -> Option<&'static HistMapSpec> {
        Some(&HIST)
    }

    fn setup(&self, config: &Config) -> Setup {
        let rows = rows(config);
        Setup {
            map_sizes: vec![
                (HIST.map, crate::hist::entries(config)),
                (ROWS_MAP, rows.max(1)),
            ],
            globals: vec![(ROWS_GLOBAL, rows.to_ne_bytes().to_vec())],
        }
    }

    fn take(&self, ebpf: &mut Ebpf, config: &Config) -> Result<Taken> {
        let syscalls = Syscalls::take(ebpf, crate::hist::entries(config), rows(config))?;
        Ok(Taken {
            balanced: Some(syscalls.hists.balanced()),
            source: Some(Box::new(syscalls)),
        })
    }
}

/// The dense rows loaded: as many as the node's possible CPUs allow within the budget, none
/// with `syscall_rows = false`.
fn rows(config: &Config) -> u32 {
    if config.flag(&SYSCALL_ROWS) {
        syscall_rows_for(config.possible_cpus)
    } else {
        0
    }
}

/// One syscall histogram: a series' calls of one syscall, by page-cache outcome.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct SyscallId {
    pub series: SeriesId,
    pub syscall: Syscall,
    pub cache: Cache,
}

impl HistKey for SyscallKey {
    type Id = SyscallId;
    type Value = Bucket;

    fn series(&self) -> SeriesId {
        self.series
    }

    fn add_to(&self, series: SeriesId, value: &Bucket, hists: &mut Hists<SyscallId>) -> bool {
        let id = || {
            Some(SyscallId {
                series,
                syscall: Syscall::try_from(self.syscall).ok()?,
                cache: Cache::try_from(self.cache).ok()?,
            })
        };
        add_slot(id(), self.slot, value, hists)
    }
}

pub struct Syscalls {
    hists: HistSource<SyscallKey>,
    rows: Mutex<Rows>,
}

impl Syscalls {
    /// `max_entries`: the histogram map's size as loaded; `rows`: the dense rows in use.
    pub fn take(ebpf: &mut Ebpf, max_entries: u32, rows: u32) -> Result<Syscalls> {
        Ok(Syscalls {
            hists: HistSource::take(ebpf, &HIST, max_entries)?,
            rows: Mutex::new(Rows {
                in_use: rows,
                rows: take_map(ebpf, ROWS_MAP)?,
                generation: take_map(ebpf, ROW_GEN_MAP)?,
            }),
        })
    }

    fn read_all(&self, routes: &Provisional) -> Result<Hists<SyscallId>> {
        let mut hists = self.hists.reader.peek(routes)?;
        lock(&self.rows).read(routes, &mut hists)?;
        Ok(hists)
    }
}

/// The kernel's dense rows (`SYSCALL_ROWS_MAP`) and the generation of each series id
/// (`SYSCALL_ROW_GEN`, the kernel's copy of `Provisional::generation`), which only this
/// reader writes.
struct Rows {
    /// Rows the kernel counts in (0: none).
    in_use: u32,
    rows: PerCpuArray<MapData, SyscallRow>,
    generation: Array<MapData, u32>,
}

impl Rows {
    /// Adds each CPU's rows of live series to `out`.
    fn read(&self, routes: &Provisional, out: &mut Hists<SyscallId>) -> Result<()> {
        for i in 0..self.in_use {
            let per_cpu = self.rows.get(&i, 0)?;
            for row in per_cpu.iter() {
                let Some(t) = RowTag::decode(row.tag) else {
                    continue;
                };
                if t.generation != routes.generation(t.series)
                    || routes.route(t.series) != Route::Own
                {
                    continue;
                }
                let (Ok(syscall), Ok(cache)) =
                    (Syscall::try_from(t.syscall), Cache::try_from(t.cache))
                else {
                    continue;
                };
                let h = out
                    .entry(SyscallId {
                        series: t.series,
                        syscall,
                        cache,
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

    /// Moves the kernel's generation of the series retired at this pass on, before their
    /// ids are given out again (`Tracked::free_retired` moves `routes`' copy after the pass):
    /// their rows go stale. Setting it twice for one retirement is harmless.
    fn retire(&mut self, routes: &Provisional) {
        for series in &routes.retired {
            let next = routes.generation(*series).wrapping_add(1);
            // The id stays below the map's size (the config caps max_series); were it not,
            // its rows would be counted under its next labels.
            if let Err(e) = self.generation.set(series.0, next, 0) {
                warn!(series = series.0, error = %e, "moving a series' row generation on")
            }
        }
    }
}

impl Source for Syscalls {
    fn read(&self, routes: &Provisional) -> Box<dyn Snapshot> {
        Box::new(HistSnapshot(self.read_all(routes).unwrap_or_else(|e| {
            warn!(error = format!("{e:#}"), "reading the syscall histograms");
            Hists::new()
        })))
    }

    /// Rows never hold provisional series: only the hash map has anything to fold; the rows
    /// of retired series go stale here.
    fn fold(&self, routes: &Provisional) -> Result<()> {
        let folded = self.hists.fold(routes);
        lock(&self.rows).retire(routes);
        folded
    }
}

pub type SyscallSnapshot = HistSnapshot<SyscallId>;

pub static SYSCALL_SECONDS: MetricFamily = MetricFamily {
    name: "pgio_syscall_seconds",
    help: "IO syscall latency, enter to exit, per tracked process series; cache=miss when the calling thread submitted block IO during a read (seconds).",
    kind: Kind::Histogram,
};
pub static FUTEX_WAIT_SECONDS: MetricFamily = MetricFamily {
    name: "pgio_futex_wait_seconds",
    help: "futex waits (WAIT, WAIT_BITSET, LOCK_PI, LOCK_PI2, WAIT_REQUEUE_PI; futex_waitv), enter to exit (seconds). Not IO. In Go programs such as the Longhorn engine and replicas most of this is the Go runtime parking idle threads (scheduler and sysmon sleeps), not waiting on replicas, IO or locks: it grows with idle threads, not with latency.",
    kind: Kind::Histogram,
};

impl HistId for SyscallId {
    fn series(&self) -> SeriesId {
        self.series
    }

    fn encode(hists: &Hists<SyscallId>, scrape: &mut Scrape<'_>, enc: &mut Encoder) {
        let labels = |id: &SyscallId| WithLabels {
            series: scrape.series(id.series),
            extra: [("syscall", id.syscall.name()), ("cache", id.cache.name())],
        };
        // Waits are not IO: they get their own family.
        for (family, futex) in [(&SYSCALL_SECONDS, false), (&FUTEX_WAIT_SECONDS, true)] {
            let mut f = enc.family(family);
            for (id, h) in hists.iter().filter(|(id, _)| id.syscall.is_wait() == futex) {
                f.histogram(labels(id), h);
            }
        }
    }
}
