//! `pgio_hist_map_*`: each histogram map's shares at the last balance, as a scrape shows
//! them.
use crate::{
    collector::{Scrape, Snapshot},
    exposition::{Encoder, Kind, MetricFamily},
};

/// One histogram map's shares at the last balance.
#[derive(Clone, Debug, Default)]
pub struct MapStats {
    pub entries: u64,
    pub max_entries: u32,
    pub evicted_total: u64,
    /// (owner name, keys), owners with keys only.
    pub by_owner: Vec<(String, u32)>,
    /// New keys refused by owner name, for owners that have series or keys.
    pub refused: std::collections::BTreeMap<String, u64>,
}

/// Each histogram map's shares, by map name.
#[derive(Debug, Default)]
pub struct KeyQuotaSnapshot(pub Vec<(&'static str, MapStats)>);

static ENTRIES: MetricFamily = MetricFamily {
    name: "pgio_hist_map_entries",
    help: "Keys in each histogram map at the last balance (once a second). pgio keeps them under seven eighths of pgio_hist_map_max_entries.",
    kind: Kind::Gauge,
};
static MAX_ENTRIES: MetricFamily = MetricFamily {
    name: "pgio_hist_map_max_entries",
    help: "Size of each histogram map in keys (config hist_map_max_entries; the block map a sixteenth of it, one row of every histogram of a series, device and op per key; the query map a sixty-fourth, one row per series and wire).",
    kind: Kind::Gauge,
};
static OWNER_ENTRIES: MetricFamily = MetricFamily {
    name: "pgio_hist_map_owner_entries",
    help: "Keys in each histogram map by owner: the uid whose processes made the series, provisional (new processes not yet classified), exempt (series pgio bounds itself: untracked, overflow), other_uids (uids beyond the 253 slots).",
    kind: Kind::Gauge,
};
static REFUSED: MetricFamily = MetricFamily {
    name: "pgio_hist_map_refused",
    help: "Events not counted because they needed a new key in a histogram map and their owner had used up its allowance, as of the last balance (once a second; the sum over owners is pgio_events_dropped_total{reason=\"hist_over_share\"}); an owner's counter goes when its last series does.",
    kind: Kind::Counter,
};
static EVICTED: MetricFamily = MetricFamily {
    name: "pgio_hist_map_evicted",
    help: "Keys moved out of a histogram map into pgio's memory because their owner held more than its share while others needed room: their counts are still exported; the owner's new keys are refused (pgio_events_dropped_total{reason=\"hist_over_share\"}).",
    kind: Kind::Counter,
};

impl Snapshot for KeyQuotaSnapshot {
    fn encode(&self, _scrape: &mut Scrape<'_>, enc: &mut Encoder) {
        let mut f = enc.family(&ENTRIES);
        for (m, s) in &self.0 {
            f.gauge([("map", *m)], s.entries as i64);
        }
        let mut f = enc.family(&MAX_ENTRIES);
        for (m, s) in &self.0 {
            f.gauge([("map", *m)], i64::from(s.max_entries));
        }
        let mut f = enc.family(&OWNER_ENTRIES);
        for (m, s) in &self.0 {
            for (owner, n) in &s.by_owner {
                f.gauge([("map", *m), ("owner", owner.as_str())], i64::from(*n));
            }
        }
        let mut f = enc.family(&REFUSED);
        for (m, s) in &self.0 {
            for (owner, n) in &s.refused {
                f.counter([("map", *m), ("owner", owner.as_str())], *n);
            }
        }
        let mut f = enc.family(&EVICTED);
        for (m, s) in &self.0 {
            f.counter([("map", *m)], s.evicted_total);
        }
    }
}
