//! Where PostgreSQL's processes wait (`pgio_common::role_wait` has the rules,
//! `pgio-ebpf/src/role_wait.rs` the program's part): a histogram of off-CPU intervals per
//! series and part, so that a checkpointer's IO, an autovacuum worker's Lock waits, the
//! walwriter's WAL IO or a client backend's waits inside its queries show per role, as a
//! heatmap per type. No program of its own: it rides on `sched_switch` (the syscall
//! family's) where `query_wait` is on.
use anyhow::Result;
use aya::Ebpf;
use pgio_common::{
    SeriesId,
    hist::Bucket,
    query_wait::Part,
    role_wait::{QUOTA, RoleWaitKey},
};

use crate::{
    collector::Scrape,
    config::Config,
    exposition::{Encoder, Kind, MetricFamily},
    family::{Family, Probe, Taken},
    hist::{HistId, HistKey, HistMapSpec, HistSource, Hists, add_slot},
    labels::WithLabels,
};

pub static HIST: HistMapSpec = HistMapSpec {
    family: "role_wait",
    map: "ROLE_WAIT_HIST",
    quota: QUOTA,
};

/// `ROLE_WAIT_HIST`'s size as compiled.
const MAX_ENTRIES: u32 = 8_192;

/// The role-wait family (`Family`).
pub struct RoleWaitFamily;

impl Family for RoleWaitFamily {
    fn name(&self) -> &'static str {
        "role_wait"
    }

    fn probes(&self) -> Vec<Probe> {
        Vec::new()
    }

    fn maps(&self) -> &'static [&'static str] {
        &["ROLE_WAIT_HIST", "ROLE_WAIT_THREADS"]
    }

    fn hist_map(&self) -> Option<&'static HistMapSpec> {
        Some(&HIST)
    }

    fn take(&self, ebpf: &mut Ebpf, _: &Config) -> Result<Taken> {
        let hists: HistSource<RoleWaitKey> = HistSource::take(ebpf, &HIST, MAX_ENTRIES)?;
        Ok(Taken {
            balanced: Some(hists.balanced()),
            source: Some(Box::new(hists) as Box<dyn crate::collector::Source>),
        })
    }
}

/// One histogram: a series' off-CPU intervals of one part.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct RoleWaitId {
    pub series: SeriesId,
    pub part: Part,
}

impl HistKey for RoleWaitKey {
    type Id = RoleWaitId;
    type Value = Bucket;

    fn series(&self) -> SeriesId {
        self.series
    }

    fn add_to(&self, series: SeriesId, value: &Bucket, hists: &mut Hists<RoleWaitId>) -> bool {
        let id = Part::try_from(self.part)
            .ok()
            .map(|part| RoleWaitId { series, part });
        add_slot(id, self.slot, value, hists)
    }
}

pub static WAIT_SECONDS: MetricFamily = MetricFamily {
    name: "pgio_wait_seconds",
    help: "Off-CPU intervals of PostgreSQL's processes: the checkpointer, background writer, walwriter, autovacuum, io workers, walsenders, parallel workers, … and the client backends inside their queries, by part: PostgreSQL's wait_event_type when the process blocked (IO, Lock, LWLock, BufferPin, IPC, Timeout, Client, Extension, Activity, InjectionPoint; none: no wait event set; unknown: unreadable), from blocking to running again less the run-queue wait after the wake-up, which is part=\"runnable\" (seconds). A client backend's whole query time by part, its time on CPU and preempted included, is pgio_query_part_seconds_total.",
    kind: Kind::Histogram,
};

impl HistId for RoleWaitId {
    fn series(&self) -> SeriesId {
        self.series
    }

    fn encode(hists: &Hists<RoleWaitId>, scrape: &mut Scrape<'_>, enc: &mut Encoder) {
        let mut f = enc.family(&WAIT_SECONDS);
        for (id, h) in hists {
            let labels = WithLabels {
                series: scrape.series(id.series),
                extra: [("part", id.part.name())],
            };
            f.histogram(labels, h);
        }
    }
}
