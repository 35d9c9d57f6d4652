//! Off-CPU time by PostgreSQL's individual wait event (`pgio_common::wait_event` has the
//! rules, `pgio-ebpf/src/wait_event.rs` the kernel's part): per series, the time blocked
//! under each `wait_event` and how many times, named as `pg_stat_activity` names them for the
//! process's major version (`names`). No program of its own: `query_wait` (a client backend's
//! blocks inside its queries) and `role_wait` (every block of the other PostgreSQL processes)
//! hand it their intervals.
mod names;

use std::collections::BTreeMap;

use anyhow::Result;
use aya::Ebpf;
use pgio_common::{
    SeriesId,
    hist::Bucket,
    wait_event::{QUOTA, WaitEventKey},
};

use crate::{
    collector::Scrape,
    config::Config,
    exposition::{Encoder, Kind, MetricFamily},
    family::{Family, Probe, Taken},
    hist::{HistId, HistKey, HistMapSpec, HistSource, Hists, add_slot},
    labels::WithLabels,
};

pub use names::{event_name, names_of, type_name};

pub static HIST: HistMapSpec = HistMapSpec {
    family: "wait_event",
    map: "WAIT_EVENT_HIST",
    quota: QUOTA,
};

/// `WAIT_EVENT_HIST`'s size as compiled.
const MAX_ENTRIES: u32 = 8_192;

/// The wait-event family (`Family`).
pub struct WaitEventFamily;

impl Family for WaitEventFamily {
    fn name(&self) -> &'static str {
        "wait_event"
    }

    fn probes(&self) -> Vec<Probe> {
        Vec::new()
    }

    fn maps(&self) -> &'static [&'static str] {
        &["WAIT_EVENT_HIST"]
    }

    fn hist_map(&self) -> Option<&'static HistMapSpec> {
        Some(&HIST)
    }

    fn take(&self, ebpf: &mut Ebpf, _: &Config) -> Result<Taken> {
        let hists: HistSource<WaitEventKey> = HistSource::take(ebpf, &HIST, MAX_ENTRIES)?;
        Ok(Taken {
            balanced: Some(hists.balanced()),
            source: Some(Box::new(hists) as Box<dyn crate::collector::Source>),
        })
    }
}

/// One key's totals: a series' blocks under one raw event of one major version. Several may
/// share a name (an extension's tranches are all `unknown`): `encode` adds them up.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct WaitEventId {
    pub series: SeriesId,
    pub info: u32,
    pub major: u8,
}

impl HistKey for WaitEventKey {
    type Id = WaitEventId;
    type Value = Bucket;

    fn series(&self) -> SeriesId {
        self.series
    }

    fn add_to(&self, series: SeriesId, value: &Bucket, hists: &mut Hists<WaitEventId>) -> bool {
        let id = WaitEventId {
            series,
            info: self.info,
            major: self.major,
        };
        add_slot(Some(id), 0, value, hists)
    }
}

pub static WAIT_EVENT_SECONDS: MetricFamily = MetricFamily {
    name: "pgio_wait_event_seconds",
    help: "Time PostgreSQL's processes spent blocked (off CPU) by wait event, named as pg_stat_activity names it for the process's major version (wait_event_type none: no wait event set; unknown: unreadable, or an event this PostgreSQL version does not have, such as an extension's): a client backend's blocks inside its queries, every block of the other processes; from blocking to running again less the run-queue wait after the wake-up (seconds).",
    kind: Kind::Counter,
};

pub static WAIT_EVENT_WAITS: MetricFamily = MetricFamily {
    name: "pgio_wait_event_waits",
    help: "Times PostgreSQL's processes blocked under each wait event (the intervals of pgio_wait_event_seconds_total).",
    kind: Kind::Counter,
};

impl HistId for WaitEventId {
    fn series(&self) -> SeriesId {
        self.series
    }

    fn encode(hists: &Hists<WaitEventId>, scrape: &mut Scrape<'_>, enc: &mut Encoder) {
        // By name: two raw values with one name must not give one label set twice.
        let mut named: BTreeMap<(SeriesId, &str, &str), (u64, u64)> = BTreeMap::new();
        for (id, h) in hists {
            let key = (id.series, type_name(id.info), event_name(id.major, id.info));
            let e = named.entry(key).or_default();
            e.0 = e.0.wrapping_add(h.count());
            e.1 = e.1.wrapping_add(h.sum_ns);
        }
        {
            let mut f = enc.family(&WAIT_EVENT_SECONDS);
            for ((series, ty, ev), (_, ns)) in &named {
                let labels = WithLabels {
                    series: scrape.series(*series),
                    extra: [("wait_event_type", *ty), ("wait_event", *ev)],
                };
                f.counter_f64(labels, *ns as f64 * 1e-9);
            }
        }
        let mut f = enc.family(&WAIT_EVENT_WAITS);
        for ((series, ty, ev), (n, _)) in &named {
            let labels = WithLabels {
                series: scrape.series(*series),
                extra: [("wait_event_type", *ty), ("wait_event", *ev)],
            };
            f.counter(labels, *n);
        }
    }
}
