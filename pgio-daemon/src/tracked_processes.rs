//! `pgio_tracked_processes`: how many processes each series has now, from the registry at
//! encoding time.
use std::collections::BTreeMap;

use pgio_common::SeriesId;

use crate::{
    collector::{Scrape, Snapshot, Source},
    exposition::{Encoder, Kind, MetricFamily},
    provisional::Provisional,
};

static TRACKED_PROCESSES: MetricFamily = MetricFamily {
    name: "pgio_tracked_processes",
    help: "Processes pgio tracks now, by series.",
    kind: Kind::Gauge,
};

pub struct TrackedProcesses;

impl Source for TrackedProcesses {
    fn read(&self, _: &Provisional) -> Box<dyn Snapshot> {
        Box::new(TrackedProcesses)
    }
}

impl Snapshot for TrackedProcesses {
    fn encode(&self, scrape: &mut Scrape<'_>, enc: &mut Encoder) {
        let tracked = scrape.tracked;
        let mut per_series: BTreeMap<SeriesId, i64> = BTreeMap::new();
        for id in tracked.pids.values() {
            *per_series.entry(*id).or_default() += 1;
        }
        let mut family = enc.family(&TRACKED_PROCESSES);
        for (id, n) in per_series {
            family.gauge(tracked.registry.exported(id), n);
        }
    }
}
