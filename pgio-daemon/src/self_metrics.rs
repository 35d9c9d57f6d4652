//! pgio's own health: events the kernel side dropped, probes attached, each program's run time,
//! lifecycle events missed, build info.
use std::{
    os::fd::{AsFd, AsRawFd, RawFd},
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
};

use anyhow::Result;
use aya::{
    Ebpf,
    maps::{MapData, PerCpuArray},
};
use pgio_common::drops::{DROP_REASONS, DropReason};

use crate::{
    collector::{Scrape, Snapshot, Source},
    exposition::{Encoder, Kind, MetricFamily},
    http_server::HttpStats,
    lifecycle::PostgresProbeStats,
    maps::take_map,
    probes::{DROPS_MAP, ProbeStatus},
    provisional::Provisional,
};

/// Run time, runs and recursion misses of one program (`/proc/self/fdinfo/<fd>`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProgramStats {
    pub run_time_ns: u64,
    pub runs: u64,
    pub recursion_misses: u64,
}

pub fn program_stats(fd: RawFd) -> Option<ProgramStats> {
    let text = std::fs::read_to_string(format!("/proc/self/fdinfo/{fd}")).ok()?;
    let field = |k: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(k)?.trim().parse::<u64>().ok())
            .unwrap_or(0)
    };
    Some(ProgramStats {
        run_time_ns: field("run_time_ns:"),
        runs: field("run_cnt:"),
        recursion_misses: field("recursion_misses:"),
    })
}

pub struct SelfMetrics {
    drops: PerCpuArray<MapData, u64>,
    probes: Vec<ProbeStatus>,
    /// (program name, fd); the fds live as long as the loaded `Ebpf`.
    program_fds: Vec<(String, RawFd)>,
    postgres_probes: Arc<PostgresProbeStats>,
}

impl SelfMetrics {
    pub fn take(
        ebpf: &mut Ebpf,
        probes: Vec<ProbeStatus>,
        postgres_probes: Arc<PostgresProbeStats>,
    ) -> Result<SelfMetrics> {
        let program_fds = ebpf
            .programs()
            .filter_map(|(name, p)| Some((name.to_owned(), p.fd().ok()?.as_fd().as_raw_fd())))
            .collect();
        Ok(SelfMetrics {
            drops: take_map(ebpf, DROPS_MAP)?,
            probes,
            program_fds,
            postgres_probes,
        })
    }
}

impl Source for SelfMetrics {
    fn read(&self, _: &Provisional) -> Box<dyn Snapshot> {
        let mut drops = [0; DROP_REASONS];
        for d in DropReason::ALL {
            drops[d as usize] = self
                .drops
                .get(&(d as u32), 0)
                .map(|v| v.iter().sum::<u64>())
                .unwrap_or(0);
        }
        let programs = self
            .program_fds
            .iter()
            .filter_map(|(name, fd)| Some((name.clone(), program_stats(*fd)?)))
            .collect();
        let p = &self.postgres_probes;
        Box::new(SelfSnapshot {
            probes: self.probes.clone(),
            drops,
            programs,
            postgres_binaries: PostgresBinaries {
                attached: p.binaries_attached.load(Ordering::Relaxed),
                refused: p.binaries_refused.load(Ordering::Relaxed),
                detached: p.binaries_detached.load(Ordering::Relaxed),
            },
        })
    }
}

#[derive(Debug, Default)]
pub struct SelfSnapshot {
    pub probes: Vec<ProbeStatus>,
    pub drops: [u64; DROP_REASONS],
    pub programs: Vec<(String, ProgramStats)>,
    pub postgres_binaries: PostgresBinaries,
}

/// `lifecycle::PostgresProbeStats` read at a scrape.
#[derive(Clone, Copy, Debug, Default)]
pub struct PostgresBinaries {
    pub attached: u64,
    pub refused: u64,
    pub detached: u64,
}

static PROBE_ATTACHED: MetricFamily = MetricFamily {
    name: "pgio_probe_attached",
    help: "1 when the eBPF program is attached, 0 when this kernel lacks its hook.",
    kind: Kind::Gauge,
};
static EVENTS_DROPPED: MetricFamily = MetricFamily {
    name: "pgio_events_dropped",
    help: "Kernel events pgio could not record, by reason.",
    kind: Kind::Counter,
};
static EXITS_MISSED: MetricFamily = MetricFamily {
    name: "pgio_exits_missed",
    help: "Tracked processes the periodic /proc rescan found gone although no exit event untracked them (lost lifecycle events). Should stay 0; until the rescan, such a process is still counted in pgio_tracked_processes.",
    kind: Kind::Counter,
};
static PROVISIONAL: MetricFamily = MetricFamily {
    name: "pgio_provisional_processes",
    help: "Processes whose events pgio holds back until it has classified them: a postmaster's new children until their title, a postmaster until its cluster is known. Their events appear in a later scrape, under the series they are classified as (role=\"starting\" if never).",
    kind: Kind::Gauge,
};
static SERIES: MetricFamily = MetricFamily {
    name: "pgio_series",
    help: "Label sets (series ids) pgio holds now, kernel and userspace: the live processes' label sets plus those within series_retention_secs of their last process, at most max_series (plus one overflow series per app).",
    kind: Kind::Gauge,
};
static SERIES_RETIRED: MetricFamily = MetricFamily {
    name: "pgio_series_retired",
    help: "Series dropped from the exposition series_retention_secs after their last process exited; their ids are reused.",
    kind: Kind::Counter,
};
static SERIES_REFUSED: MetricFamily = MetricFamily {
    name: "pgio_series_refused",
    help: "New label sets booked under their app's role=\"overflow\" series because max_series, max_series_per_app or max_series_per_group was reached (counted per classification).",
    kind: Kind::Counter,
};
static LABELS_TRUNCATED: MetricFamily = MetricFamily {
    name: "pgio_label_values_truncated",
    help: "Label sets with a value cut at max_label_len bytes.",
    kind: Kind::Counter,
};
static KERNEL_MAP_ERRORS: MetricFamily = MetricFamily {
    name: "pgio_kernel_map_errors",
    help: "Failed writes of a process' or a postmaster's children's series into the kernel's maps (that process is booked as untracked). Should stay 0.",
    kind: Kind::Counter,
};
static PROGRAM_RUN_SECONDS: MetricFamily = MetricFamily {
    name: "pgio_bpf_program_run_seconds",
    help: "CPU time spent in each eBPF program (needs bpf_stats = true in the config, else 0).",
    kind: Kind::Counter,
};
static PROGRAM_RUNS: MetricFamily = MetricFamily {
    name: "pgio_bpf_program_runs",
    help: "Runs of each eBPF program (needs bpf_stats = true in the config, else 0).",
    kind: Kind::Counter,
};
static RECURSION_MISSES: MetricFamily = MetricFamily {
    name: "pgio_bpf_recursion_misses",
    help: "Runs of each eBPF program the kernel skipped because another BPF program was running on that CPU.",
    kind: Kind::Counter,
};
static POSTGRES_BINARIES_ATTACHED: MetricFamily = MetricFamily {
    name: "pgio_postgres_binaries_attached",
    help: "Postgres binaries carrying pgio's uprobes now (at most max_postgres_binaries); a binary's uprobes are detached at the first rescan after no postmaster runs it.",
    kind: Kind::Gauge,
};
static POSTGRES_BINARIES_REFUSED: MetricFamily = MetricFamily {
    name: "pgio_postgres_binaries_refused",
    help: "Postgres binaries not given uprobes because max_postgres_binaries were attached (binaries not owned by root: three quarters of it); tried again at each rescan. Their backends are classified from /proc, without titles from the kernel or query metrics.",
    kind: Kind::Counter,
};
static POSTGRES_BINARIES_DETACHED: MetricFamily = MetricFamily {
    name: "pgio_postgres_binaries_detached",
    help: "Postgres binaries whose uprobes were detached because no postmaster ran them any more.",
    kind: Kind::Counter,
};
static BUILD_INFO: MetricFamily = MetricFamily {
    name: "pgio_build_info",
    help: "pgio version (value is always 1).",
    kind: Kind::Gauge,
};

impl Snapshot for SelfSnapshot {
    fn encode(&self, scrape: &mut Scrape<'_>, enc: &mut Encoder) {
        let mut f = enc.family(&PROBE_ATTACHED);
        for p in &self.probes {
            f.gauge([("program", p.program.as_ref())], p.attached as i64);
        }
        let mut f = enc.family(&EVENTS_DROPPED);
        for d in DropReason::ALL {
            f.counter([("reason", d.name())], self.drops[d as usize]);
        }
        enc.family(&EXITS_MISSED)
            .counter((), scrape.tracked.exits_missed);
        enc.family(&PROVISIONAL)
            .gauge((), scrape.tracked.provisional.open() as i64);
        let registry = &scrape.tracked.registry;
        enc.family(&SERIES).gauge((), registry.len() as i64);
        enc.family(&SERIES_RETIRED)
            .counter((), registry.retired_total);
        let mut f = enc.family(&SERIES_REFUSED);
        for (app, n) in &registry.refused {
            f.counter([("app", app.as_str())], *n);
        }
        enc.family(&LABELS_TRUNCATED)
            .counter((), registry.truncated_total);
        enc.family(&KERNEL_MAP_ERRORS)
            .counter((), scrape.tracked.kernel_map_errors);
        fn program(name: &str) -> [(&str, &str); 1] {
            [("program", name)]
        }
        let mut f = enc.family(&PROGRAM_RUN_SECONDS);
        for (name, s) in &self.programs {
            f.counter_f64(program(name), s.run_time_ns as f64 * 1e-9);
        }
        let mut f = enc.family(&PROGRAM_RUNS);
        for (name, s) in &self.programs {
            f.counter(program(name), s.runs);
        }
        let mut f = enc.family(&RECURSION_MISSES);
        for (name, s) in &self.programs {
            f.counter(program(name), s.recursion_misses);
        }
        let b = &self.postgres_binaries;
        enc.family(&POSTGRES_BINARIES_ATTACHED)
            .gauge((), b.attached as i64);
        enc.family(&POSTGRES_BINARIES_REFUSED)
            .counter((), b.refused);
        enc.family(&POSTGRES_BINARIES_DETACHED)
            .counter((), b.detached);
        enc.family(&BUILD_INFO)
            .gauge([("version", env!("CARGO_PKG_VERSION"))], 1);
    }
}

/// What the HTTP server did with its connections (`http_server`).
pub struct HttpSelfMetrics(pub Arc<HttpStats>);

#[derive(Debug, Default)]
pub struct HttpSnapshot {
    pub open: u64,
    pub accepted: u64,
    pub rejected: u64,
    /// By reason.
    pub closed: [(&'static str, u64); 3],
    pub accept_errors: u64,
}

impl Source for HttpSelfMetrics {
    fn read(&self, _: &Provisional) -> Box<dyn Snapshot> {
        let h = &self.0;
        let v = |c: &AtomicU64| c.load(Ordering::Relaxed);
        Box::new(HttpSnapshot {
            open: v(&h.open),
            accepted: v(&h.accepted),
            rejected: v(&h.rejected),
            closed: [
                ("evicted", v(&h.evicted)),
                ("header_timeout", v(&h.header_timeouts)),
                ("idle_timeout", v(&h.idle_timeouts)),
            ],
            accept_errors: v(&h.accept_errors),
        })
    }
}

static HTTP_OPEN: MetricFamily = MetricFamily {
    name: "pgio_http_connections",
    help: "HTTP connections open now (at most http_max_connections, + 1 for a moment).",
    kind: Kind::Gauge,
};
static HTTP_ACCEPTED: MetricFamily = MetricFamily {
    name: "pgio_http_connections_accepted",
    help: "HTTP connections accepted, including those closed at once.",
    kind: Kind::Counter,
};
static HTTP_REJECTED: MetricFamily = MetricFamily {
    name: "pgio_http_connections_rejected",
    help: "HTTP connections closed at once: http_max_connections were open and none could be evicted (all busy with a request, or one already closing).",
    kind: Kind::Counter,
};
static HTTP_CLOSED: MetricFamily = MetricFamily {
    name: "pgio_http_connections_closed",
    help: "HTTP connections pgio closed, by reason: evicted (the one waiting longest for a request, to make room at http_max_connections), header_timeout (no complete request head within http_header_timeout_secs), idle_timeout (no request within http_idle_timeout_secs).",
    kind: Kind::Counter,
};
static HTTP_ACCEPT_ERRORS: MetricFamily = MetricFamily {
    name: "pgio_http_accept_errors",
    help: "Failed accept() calls on the HTTP socket (e.g. out of file descriptors).",
    kind: Kind::Counter,
};

impl Snapshot for HttpSnapshot {
    fn encode(&self, _: &mut Scrape<'_>, enc: &mut Encoder) {
        enc.family(&HTTP_OPEN).gauge((), self.open as i64);
        enc.family(&HTTP_ACCEPTED).counter((), self.accepted);
        enc.family(&HTTP_REJECTED).counter((), self.rejected);
        let mut f = enc.family(&HTTP_CLOSED);
        for (reason, n) in self.closed {
            f.counter([("reason", reason)], n);
        }
        enc.family(&HTTP_ACCEPT_ERRORS)
            .counter((), self.accept_errors);
    }
}
