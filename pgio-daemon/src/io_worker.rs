//! PostgreSQL 18's io workers' IO booked under the backend served (`pgio_common::io_worker`
//! has the rule, `pgio-ebpf/src/io_worker.rs` the reads): no program of its own, it rides on
//! the syscall family's enter. What it exports: how many of the io workers' IO syscalls were
//! booked under their owner, and why the others were not.
use anyhow::Result;
use aya::{
    Ebpf,
    maps::{MapData, PerCpuArray},
};
use pgio_common::io_worker::{OUTCOMES, Outcome};

use crate::{
    collector::{Scrape, Snapshot, Source},
    config::Config,
    exposition::{Encoder, Kind, MetricFamily},
    family::{Family, Probe, Taken},
    maps::{counter_sums, take_map},
    provisional::Provisional,
};

const CALLS_MAP: &str = "IO_WORKER_CALLS";

/// The io-worker family (`Family`).
pub struct IoWorkerFamily;

impl Family for IoWorkerFamily {
    fn name(&self) -> &'static str {
        "io_worker"
    }

    fn probes(&self) -> Vec<Probe> {
        Vec::new()
    }

    fn maps(&self) -> &'static [&'static str] {
        &[CALLS_MAP]
    }

    fn take(&self, ebpf: &mut Ebpf, _: &Config) -> Result<Taken> {
        Ok(Taken {
            source: Some(Box::new(IoWorkerCalls {
                map: take_map(ebpf, CALLS_MAP)?,
            })),
            balanced: None,
        })
    }
}

struct IoWorkerCalls {
    map: PerCpuArray<MapData, u64>,
}

impl Source for IoWorkerCalls {
    fn read(&self, _: &Provisional) -> Box<dyn Snapshot> {
        Box::new(IoWorkerSnapshot {
            calls: counter_sums(&self.map),
        })
    }
}

/// The io workers' IO syscalls by `Outcome`.
#[derive(Clone, Debug, Default)]
pub struct IoWorkerSnapshot {
    pub calls: [u64; OUTCOMES],
}

static SYSCALLS: MetricFamily = MetricFamily {
    name: "pgio_io_worker_syscalls",
    help: "IO syscalls of PostgreSQL's io workers (PostgreSQL 18, io_method = worker), by outcome: attributed (booked under the series of the backend whose IO handle the worker served, so that pgio_syscall_*, pgio_relation_* and pgio_block_io_* carry that backend's labels), own_io (no handle being served: the worker's own), owner_unknown (the owner is not a tracked process of the worker's postmaster), layout (the worker's own PGPROC did not hold its pid: pgio does not know this build's layout), unreadable (a read of the worker's memory failed), not_found (pgio has not found where the worker's postmaster keeps these yet). All but attributed stay under role=\"io worker\".",
    kind: Kind::Counter,
};

impl Snapshot for IoWorkerSnapshot {
    fn encode(&self, _: &mut Scrape<'_>, enc: &mut Encoder) {
        let mut f = enc.family(&SYSCALLS);
        for o in Outcome::ALL {
            f.counter([("outcome", o.name())], self.calls[o as usize]);
        }
    }
}
