//! Queue blame (`pgio_common::queue_blame` has the rule, `pgio-ebpf/src/queue_blame.rs` the
//! kernel's part): whose block requests a tracked request's queue time was spent behind,
//! `pgio_block_io_queue_blame_seconds_total{device, op, <victim's series>, culprit_*}`, and
//! its device time, `pgio_block_io_device_blame_seconds_total` (the same labels). No program
//! of its own: it rides the block family's request entry.
//!
//! Bounded: per device at most seven culprits own a slot at a time, the rest are `(rest)`; a
//! key per (victim series, device, op, phase, culprit) under the key quota like every
//! histogram map.
use std::collections::BTreeSet;

use anyhow::Result;
use aya::Ebpf;
use pgio_common::{
    SeriesId,
    block_io::BlockOp,
    hist::Bucket,
    queue_blame::{CLOCKS, CULPRIT_REST, CULPRIT_SERIES, PHASE_DEVICE, QUOTA, QueueBlameKey},
};

use crate::{
    collector::{Scrape, Snapshot, Source},
    config::Config,
    exposition::{Encoder, Kind, LabelSet, LabelWriter, MetricFamily},
    family::{Family, Probe, Setup, Taken},
    hist::{HistId, HistKey, HistMapSpec, HistReader, HistSnapshot, Hists},
    labels::{BlockLabels, Labels},
    provisional::Provisional,
};

pub static QUEUE_BLAME: crate::config::Key = crate::config::Key::flag(
    "queue_blame",
    true,
    "whose block requests each tracked request's queue time and device time were spent behind (pgio_block_io_queue_blame_seconds_total, pgio_block_io_device_blame_seconds_total): a clock per device moved at every completion, ~450-530 ns a request in all, 40 bytes more per in-flight request (2.5 MiB)",
);
static CONFIG_KEYS: &[&crate::config::Key] = &[&QUEUE_BLAME];

pub static HIST: HistMapSpec = HistMapSpec {
    family: "queue_blame",
    map: "QUEUE_BLAME_HIST",
    quota: QUOTA,
};
const CLOCK_MAP: &str = "QUEUE_BLAME_CLOCK";
const ENABLED_GLOBAL: &str = "QUEUE_BLAME_ON";
/// `QUEUE_BLAME_HIST`'s size as compiled.
const MAX_ENTRIES: u32 = 4_096;

/// The queue-blame family (`Family`).
pub struct QueueBlameFamily;

impl Family for QueueBlameFamily {
    fn config_keys(&self) -> &'static [&'static crate::config::Key] {
        CONFIG_KEYS
    }

    fn name(&self) -> &'static str {
        "queue_blame"
    }

    fn probes(&self) -> Vec<Probe> {
        Vec::new()
    }

    fn maps(&self) -> &'static [&'static str] {
        &["QUEUE_BLAME_HIST", CLOCK_MAP]
    }

    fn globals(&self) -> &'static [&'static str] {
        &[ENABLED_GLOBAL]
    }

    fn hist_map(&self) -> Option<&'static HistMapSpec> {
        Some(&HIST)
    }

    /// Off, its maps shrink to one entry each (the verifier prunes every step).
    fn setup(&self, config: &Config) -> Setup {
        let on = config.flag(&QUEUE_BLAME);
        let size = |n: u32| if on { n } else { 1 };
        Setup {
            map_sizes: vec![(HIST.map, size(MAX_ENTRIES)), (CLOCK_MAP, size(CLOCKS))],
            globals: vec![(ENABLED_GLOBAL, vec![u8::from(on)])],
        }
    }

    fn take(&self, ebpf: &mut Ebpf, config: &Config) -> Result<Taken> {
        let entries = if config.flag(&QUEUE_BLAME) {
            MAX_ENTRIES
        } else {
            1
        };
        let reader = std::sync::Arc::new(HistReader::take(ebpf, &HIST, entries)?);
        Ok(Taken {
            balanced: Some(reader.clone()),
            source: Some(Box::new(QueueBlame { reader })),
        })
    }
}

/// Whom a wait is blamed on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Culprit {
    Series(SeriesId),
    /// The device's series without a slot of their own.
    Rest,
}

/// One counter: a victim series' requests on a device, by op, their queue time (or, with
/// `device`, their device time), and one culprit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct QueueBlameId {
    pub victim: SeriesId,
    pub dev: u32,
    pub op: BlockOp,
    pub device: bool,
    pub culprit: Culprit,
}

impl HistKey for QueueBlameKey {
    type Id = QueueBlameId;
    type Value = Bucket;

    fn series(&self) -> SeriesId {
        self.victim
    }

    /// The count in slot 0, the blamed ns its sum. A victim blamed on itself is blamed on the
    /// series it is booked under: a provisional process' own wait goes with it into the series
    /// it was classified as (as its own id, one series per process, every process of a role
    /// would show the same culprit labels, and step back when it folded).
    fn add_to(&self, victim: SeriesId, value: &Bucket, hists: &mut Hists<QueueBlameId>) -> bool {
        let culprit = match self.culprit_kind {
            CULPRIT_SERIES if self.culprit == self.victim => Culprit::Series(victim),
            // The kernel gives provisional series no slot; were one named, its labels would
            // not be its own yet.
            CULPRIT_SERIES if self.culprit.is_provisional() => Culprit::Rest,
            CULPRIT_SERIES => Culprit::Series(self.culprit),
            CULPRIT_REST => Culprit::Rest,
            _ => return false,
        };
        let Ok(op) = BlockOp::try_from(self.op) else {
            return false;
        };
        let id = QueueBlameId {
            victim,
            dev: self.dev,
            op,
            device: self.phase == PHASE_DEVICE,
            culprit,
        };
        hists.entry(id).or_default().add(0, value);
        true
    }
}

/// The histogram map's reader, with one more rule: a retired series' id is given to another
/// label set next, so what was blamed on it goes when it does, as its own series' counts do.
pub struct QueueBlame {
    reader: std::sync::Arc<HistReader<QueueBlameKey>>,
}

fn blames_retired(retired: &BTreeSet<SeriesId>) -> impl Fn(&QueueBlameId) -> bool + '_ {
    move |id| matches!(id.culprit, Culprit::Series(s) if retired.contains(&s))
}

impl Source for QueueBlame {
    fn read(&self, routes: &Provisional) -> Box<dyn Snapshot> {
        let mut hists = self.reader.peek_or_empty(routes);
        let gone = blames_retired(&routes.retired);
        hists.retain(|id, _| !gone(id));
        Box::new(HistSnapshot(hists))
    }

    fn fold(&self, routes: &Provisional) -> Result<()> {
        self.reader.fold(routes)?;
        if !routes.retired.is_empty() {
            let retired = &routes.retired;
            self.reader.forget(
                |k| k.culprit_kind == CULPRIT_SERIES && retired.contains(&k.culprit),
                blames_retired(retired),
            )?;
        }
        Ok(())
    }
}

pub static BLAME_SECONDS: MetricFamily = MetricFamily {
    name: "pgio_block_io_queue_blame_seconds",
    help: "Queue time of a tracked series' block requests (pgio_block_io_queue_seconds), shared out among the series whose requests the device completed meanwhile, in proportion to their device time (culprit_* labels: that series; culprit_app=\"(rest)\": series without one of the device's seven culprit slots). Summed over culprits, a victim's queue time. A wait during which nothing completed is the victim's own (seconds).",
    kind: Kind::Counter,
};

pub static DEVICE_BLAME_SECONDS: MetricFamily = MetricFamily {
    name: "pgio_block_io_device_blame_seconds",
    help: "Device time of a tracked series' block requests, from issue to completion (pgio_block_io_device_seconds), shared out among the series whose requests the device completed meanwhile, the request's own included, in proportion to their device time (culprit_* labels as in pgio_block_io_queue_blame_seconds_total). Summed over culprits, a victim's device time: where a device takes many requests at once, the wait behind others is here rather than in the queue (seconds).",
    kind: Kind::Counter,
};

/// The culprit's labels, each name prefixed `culprit_`; `(rest)` for the rest.
struct CulpritLabels<'a>(Option<&'a Labels>);

const CULPRIT_NAMES: [(&str, &str); 9] = [
    ("app", "culprit_app"),
    ("role", "culprit_role"),
    ("database", "culprit_database"),
    ("user", "culprit_user"),
    ("pg_cluster", "culprit_pg_cluster"),
    ("volume", "culprit_volume"),
    ("namespace", "culprit_namespace"),
    ("pod", "culprit_pod"),
    ("container", "culprit_container"),
];

impl LabelSet for CulpritLabels<'_> {
    fn write(&self, w: &mut LabelWriter<'_>) {
        let Some(labels) = self.0 else {
            w.label("culprit_app", "(rest)");
            return;
        };
        for (name, value) in labels.pairs() {
            if let Some((_, prefixed)) = CULPRIT_NAMES.iter().find(|(n, _)| *n == name) {
                w.label(prefixed, value);
            }
        }
    }
}

/// The victim's block labels, then the culprit's.
struct BlameLabels<'a> {
    victim: BlockLabels<'a>,
    culprit: CulpritLabels<'a>,
}

impl LabelSet for BlameLabels<'_> {
    fn write(&self, w: &mut LabelWriter<'_>) {
        self.victim.write(w);
        self.culprit.write(w);
    }
}

impl HistId for QueueBlameId {
    fn series(&self) -> SeriesId {
        self.victim
    }

    fn encode(hists: &Hists<QueueBlameId>, scrape: &mut Scrape<'_>, enc: &mut Encoder) {
        for id in hists.keys() {
            scrape.devices.see(id.dev);
        }
        let scrape = &*scrape;
        for (family, device) in [(&BLAME_SECONDS, false), (&DEVICE_BLAME_SECONDS, true)] {
            let mut f = enc.family(family);
            for (id, h) in hists.iter().filter(|(id, _)| id.device == device) {
                let victim = BlockLabels {
                    series: scrape.series(id.victim),
                    device: scrape.devices.name(id.dev),
                    op: id.op.name(),
                    device_volume: scrape.devices.volume(id.dev),
                };
                let culprit = CulpritLabels(match id.culprit {
                    Culprit::Series(s) => Some(scrape.series(s)),
                    Culprit::Rest => None,
                });
                f.counter_f64(BlameLabels { victim, culprit }, h.sum_ns as f64 / 1e9);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(culprit: u32, kind: u8) -> QueueBlameKey {
        QueueBlameKey {
            victim: SeriesId(3),
            culprit: SeriesId(culprit),
            dev: 7 << 20,
            op: BlockOp::Read as u8,
            culprit_kind: kind,
            phase: 0,
            _pad: 0,
        }
    }

    #[test]
    fn a_key_becomes_its_culprits_counter() {
        let mut hists = Hists::new();
        let b = Bucket {
            count: 2,
            sum: 5_000,
            bytes: 0,
        };
        assert!(key(9, CULPRIT_SERIES).add_to(SeriesId(4), &b, &mut hists));
        assert!(key(0, CULPRIT_REST).add_to(SeriesId(4), &b, &mut hists));
        assert!(!key(9, 7).add_to(SeriesId(4), &b, &mut hists));
        let ids: Vec<_> = hists.keys().map(|id| (id.victim, id.culprit)).collect();
        assert_eq!(
            ids,
            [
                (SeriesId(4), Culprit::Series(SeriesId(9))),
                (SeriesId(4), Culprit::Rest)
            ]
        );
        assert!(hists.values().all(|h| h.sum_ns == 5_000 && h.count() == 2));
    }

    #[test]
    fn a_provisional_victims_own_wait_goes_with_it() {
        let mut hists = Hists::new();
        let b = Bucket {
            count: 1,
            sum: 700,
            bytes: 0,
        };
        // Two processes of one role, each blamed on itself while provisional, then folded into
        // their series (4): one counter, the series' own.
        for tgid in [100, 101] {
            let p = SeriesId::provisional(tgid);
            let k = QueueBlameKey {
                victim: p,
                culprit: p,
                ..key(0, CULPRIT_SERIES)
            };
            assert!(k.add_to(SeriesId(4), &b, &mut hists));
        }
        // A provisional culprit other than the victim: `(rest)`.
        let k = QueueBlameKey {
            culprit: SeriesId::provisional(102),
            ..key(0, CULPRIT_SERIES)
        };
        assert!(k.add_to(SeriesId(4), &b, &mut hists));
        let got: Vec<_> = hists.iter().map(|(id, h)| (id.culprit, h.sum_ns)).collect();
        assert_eq!(
            got,
            [(Culprit::Series(SeriesId(4)), 1_400), (Culprit::Rest, 700)]
        );
    }

    #[test]
    fn culprits_of_retired_series_go_with_them() {
        let retired = BTreeSet::from([SeriesId(9)]);
        let gone = blames_retired(&retired);
        let id = |culprit| QueueBlameId {
            victim: SeriesId(1),
            dev: 1,
            op: BlockOp::Read,
            device: false,
            culprit,
        };
        assert!(gone(&id(Culprit::Series(SeriesId(9)))));
        assert!(!gone(&id(Culprit::Series(SeriesId(1)))));
        assert!(!gone(&id(Culprit::Rest)));
    }
}
