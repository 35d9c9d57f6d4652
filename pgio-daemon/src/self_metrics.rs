//! pgio's own health: probes attached, events the kernel side dropped, each program's run
//! time, build info; in between, the series' (`series::metrics`) and the postgres binaries'
//! (`lifecycle`) own counts, written by their modules.
use std::{
    os::fd::{AsFd, AsRawFd, RawFd},
    sync::Arc,
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
    heap::Heap,
    lifecycle::{PostgresBinaries, PostgresProbeStats},
    maps::take_map,
    probes::{DROPS_MAP, ProbeStatus},
    provisional::Provisional,
};

pub static BPF_STATS: crate::config::Key = crate::config::Key::flag(
    "bpf_stats",
    false,
    "kernel.bpf_stats_enabled while pgio runs: per-program run time (pgio_program_run_seconds_total), ~20 ns per program run; a container cannot set it",
);

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
        let drops: [u64; DROP_REASONS] = crate::maps::counter_sums(&self.drops);
        let programs = self
            .program_fds
            .iter()
            .filter_map(|(name, fd)| Some((name.clone(), program_stats(*fd)?)))
            .collect();
        Box::new(SelfSnapshot {
            probes: self.probes.clone(),
            drops,
            programs,
            postgres_binaries: self.postgres_probes.read(),
            heap: Heap::read(),
        })
    }
}

#[derive(Debug, Default)]
pub struct SelfSnapshot {
    pub probes: Vec<ProbeStatus>,
    pub drops: [u64; DROP_REASONS],
    pub programs: Vec<(String, ProgramStats)>,
    pub postgres_binaries: PostgresBinaries,
    pub heap: Option<Heap>,
}

static PROBE_ATTACHED: MetricFamily = MetricFamily {
    name: "pgio_probe_attached",
    help: "1 when the eBPF program is attached, 0 when this kernel lacks its hook; for sched_switch:query_wait, query time split by wait event (needs the task's sched_info).",
    kind: Kind::Gauge,
};
static EVENTS_DROPPED: MetricFamily = MetricFamily {
    name: "pgio_events_dropped",
    help: "Kernel events pgio could not record, by reason.",
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
        scrape.tracked.encode_self(enc);
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
        self.postgres_binaries.encode(enc);
        if let Some(heap) = &self.heap {
            heap.encode(enc);
        }
        enc.family(&BUILD_INFO)
            .gauge([("version", env!("CARGO_PKG_VERSION"))], 1);
    }
}
