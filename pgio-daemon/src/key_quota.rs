//! Shares of the histogram maps (`pgio_common::key_quota`): no owner (uid) can fill a map
//! while another needs keys.
//!
//! Every series has an owner slot: the uid of the process it was made for (read once, when
//! the id is given out), or `EXEMPT` for the series whose keys pgio bounds itself. Once a
//! second `KeyQuota::balance` counts each owner's keys in each map and plans (`plan`):
//! seven eighths of the map are shared equally among the owners present; an owner below its
//! share may still grow to it, the room nobody reserves is split among all; and when the
//! reservations no longer fit, owners above their share have their keys moved into userspace
//! (still exported, `pgio_hist_map_evicted_total`) down to it. The kernel then refuses an
//! owner's new keys past its allowance (`pgio_events_dropped_total{reason="hist_over_share"}`).
//! An attacker can make its own events go uncounted, never a legitimate owner's.
use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
};

use anyhow::{Context as _, Result};
use aya::{
    Ebpf,
    maps::{Array, MapData, PerCpuArray},
};
use pgio_common::{
    SeriesId,
    key_quota::{EXEMPT, FIRST_UID_SLOT, HistMap, OWNER_SLOTS, PROVISIONAL, allowance_index},
};

use crate::{
    collector::{Scrape, Snapshot, Source},
    exposition::{Encoder, Family, Kind},
    lock,
    maps::take_map,
    provisional::Provisional,
    series::SharedTracked,
};

const SLOTS: usize = OWNER_SLOTS as usize;
/// Shared by every uid beyond the first 253.
const OTHER_UIDS: u8 = (OWNER_SLOTS - 1) as u8;
/// A series whose process was gone before its uid could be read.
const UNKNOWN_UID: u32 = u32::MAX;

const SERIES_OWNER_MAP: &str = "SERIES_OWNER";
const ALLOWANCE_MAP: &str = "KEY_ALLOWANCE";
const ON_MAP: &str = "KEY_QUOTA_ON";
const REFUSED_MAP: &str = "KEY_REFUSED";

/// Owner slots of series ids, kept by discovery as it gives ids out, mirrored into the
/// kernel's `SERIES_OWNER`.
pub struct Owners {
    by_series: Vec<Option<u8>>,
    uids: HashMap<u32, u8>,
    slot_uid: Vec<Option<u32>>,
    /// Series per slot.
    refs: Vec<u32>,
    kernel: Option<Array<MapData, u8>>,
}

impl Default for Owners {
    fn default() -> Owners {
        Owners {
            by_series: Vec::new(),
            uids: HashMap::new(),
            slot_uid: vec![None; SLOTS],
            refs: vec![0; SLOTS],
            kernel: None,
        }
    }
}

/// Whom a new series' keys count against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyOwner {
    /// The uid running this process (if it is still there).
    Pid(u32),
    /// Never refused: pgio bounds its keys.
    Exempt,
}

impl std::fmt::Debug for Owners {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Owners")
            .field("uids", &self.uids)
            .field("kernel", &self.kernel.is_some())
            .finish_non_exhaustive()
    }
}

impl Owners {
    /// Mirrors assignments into the kernel from now on.
    pub fn attach(&mut self, ebpf: &mut Ebpf) -> Result<()> {
        self.kernel = Some(take_map(ebpf, SERIES_OWNER_MAP)?);
        Ok(())
    }

    pub fn is_assigned(&self, id: SeriesId) -> bool {
        self.by_series
            .get(id.0 as usize)
            .is_some_and(Option::is_some)
    }

    /// Gives `id` its owner's slot; `Err` if the kernel could not be told (the series then
    /// counts as exempt there).
    pub fn assign(&mut self, id: SeriesId, owner: KeyOwner) -> Result<(), aya::maps::MapError> {
        let slot = match owner {
            KeyOwner::Exempt => EXEMPT,
            KeyOwner::Pid(pid) => self.slot_for(uid_of(pid).unwrap_or(UNKNOWN_UID)),
        };
        let i = id.0 as usize;
        if self.by_series.len() <= i {
            self.by_series.resize(i + 1, None);
        }
        if let Some(old) = self.by_series[i].replace(slot) {
            self.unref(old);
        }
        self.refs[slot as usize] += 1;
        match self.kernel.as_mut() {
            Some(k) => k.set(id.0, slot, 0),
            None => Ok(()),
        }
    }

    /// `id` was freed.
    pub fn release(&mut self, id: SeriesId) {
        if let Some(slot) = self.by_series.get_mut(id.0 as usize).and_then(Option::take) {
            self.unref(slot);
        }
    }

    fn unref(&mut self, slot: u8) {
        let s = slot as usize;
        self.refs[s] = self.refs[s].saturating_sub(1);
        if self.refs[s] == 0
            && slot != OTHER_UIDS
            && let Some(uid) = self.slot_uid[s].take()
        {
            self.uids.remove(&uid);
        }
    }

    fn slot_for(&mut self, uid: u32) -> u8 {
        if let Some(s) = self.uids.get(&uid) {
            return *s;
        }
        // The lowest free slot: the one `plan` gave a newcomer's allowance.
        let Some(s) = (FIRST_UID_SLOT..OTHER_UIDS).find(|s| self.slot_uid[*s as usize].is_none())
        else {
            return OTHER_UIDS;
        };
        self.slot_uid[s as usize] = Some(uid);
        self.uids.insert(uid, s);
        s
    }

    /// Slot of each series id, which slots have series, and their names.
    fn snapshot(&self) -> OwnerTable {
        let mut live: Vec<bool> = self.refs.iter().map(|r| *r > 0).collect();
        live[PROVISIONAL as usize] = true;
        OwnerTable {
            by_series: self.by_series.iter().map(|s| s.unwrap_or(EXEMPT)).collect(),
            live,
            names: (0..SLOTS).map(|s| self.name(s as u8)).collect(),
        }
    }

    fn name(&self, slot: u8) -> String {
        match slot {
            EXEMPT => "exempt".into(),
            PROVISIONAL => "provisional".into(),
            OTHER_UIDS => "other_uids".into(),
            s => match self.slot_uid[s as usize] {
                Some(UNKNOWN_UID) => "unknown".into(),
                Some(uid) => uid.to_string(),
                None => "free".into(),
            },
        }
    }
}

fn uid_of(pid: u32) -> Option<u32> {
    procfs::process::Process::new(pid as i32).ok()?.uid().ok()
}

struct OwnerTable {
    by_series: Vec<u8>,
    live: Vec<bool>,
    names: Vec<String>,
}

impl OwnerTable {
    fn owner_of(&self, series: SeriesId) -> u8 {
        if series.is_provisional() {
            return PROVISIONAL;
        }
        self.by_series
            .get(series.0 as usize)
            .copied()
            .unwrap_or(EXEMPT)
    }
}

/// One second's allowances and evictions for one map, per owner slot.
#[derive(Debug, PartialEq, Eq)]
pub struct Plan {
    pub allowance: Vec<u32>,
    pub evict: Vec<u32>,
}

/// See the module doc. `entries`: keys per slot now; `live`: slots that have series.
pub fn plan(max_entries: u32, entries: &[u32], live: &[bool]) -> Plan {
    let mut allowance = vec![0u32; SLOTS];
    let mut evict = vec![0u32; SLOTS];
    let room = (u64::from(max_entries) * 7 / 8).saturating_sub(u64::from(entries[0]));
    let owners: Vec<usize> = (1..SLOTS).filter(|&s| live[s] || entries[s] > 0).collect();
    let n = owners.len().max(1) as u64;
    let fair = room / n;
    let e = |s: usize| u64::from(entries[s]);
    // What each owner below its share may add by the next plan: half again what it has (at
    // least 1/16 of the map: a cluster starting up), up to its share. Room nobody reserves is
    // shared out below.
    let reserve = |s: usize| {
        let headroom = (e(s) / 2).max(u64::from(max_entries) / 16);
        (e(s) + headroom).min(fair).saturating_sub(e(s))
    };
    let total: u64 = owners.iter().map(|&s| e(s)).sum();
    let reserved: u64 = owners.iter().map(|&s| reserve(s)).sum();
    let needed = (total + reserved).saturating_sub(room);
    if needed > 0 {
        // Only owners above their share give back, in proportion to their excess, never
        // below it; their excess always covers what is needed.
        let excess: u64 = owners.iter().map(|&s| e(s).saturating_sub(fair)).sum();
        for &s in &owners {
            let x = e(s).saturating_sub(fair);
            evict[s] = (needed * x).div_ceil(excess.max(1)).min(x) as u32;
        }
    }
    let kept: u64 = owners.iter().map(|&s| e(s) - u64::from(evict[s])).sum();
    let spare = room.saturating_sub(kept + reserved) / n;
    for &s in &owners {
        allowance[s] = (reserve(s) + spare).min(u64::from(u32::MAX)) as u32;
    }
    // A uid seen for the first time before the next plan gets the lowest free slot: give the
    // next few a start out of the eighth left free.
    let grant = max_entries / 32;
    let mut slack = max_entries / 8;
    for s in FIRST_UID_SLOT as usize..OTHER_UIDS as usize {
        if slack < grant || grant == 0 {
            break;
        }
        if !live[s] && entries[s] == 0 {
            allowance[s] = grant;
            slack -= grant;
        }
    }
    Plan { allowance, evict }
}

/// A histogram map under quota (`hist::HistReader`).
pub trait Balanced: Send + Sync {
    fn quota(&self) -> HistMap;
    fn max_entries(&self) -> u32;
    /// Keys per owner slot.
    fn count_owners(&self, owner_of: &dyn Fn(SeriesId) -> u8) -> Result<Vec<u32>>;
    /// Moves up to `want[slot]` keys of each slot out of the kernel map into userspace;
    /// returns how many per slot.
    fn evict(&self, owner_of: &dyn Fn(SeriesId) -> u8, want: &[u32]) -> Result<Vec<u32>>;
}

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

pub struct KeyQuota {
    tracked: SharedTracked,
    maps: Vec<Arc<dyn Balanced>>,
    allowance: Mutex<Array<MapData, i64>>,
    refused: PerCpuArray<MapData, u64>,
    /// The kernel's refusal counts at the last balance, per map and slot.
    refused_seen: Mutex<Vec<Vec<u64>>>,
    on: Mutex<Array<MapData, u32>>,
    /// Slots written last time, per map: rewritten (to 0) when they drop out.
    written: Mutex<Vec<Vec<bool>>>,
    stats: Mutex<Vec<MapStats>>,
}

impl KeyQuota {
    pub fn take(
        ebpf: &mut Ebpf,
        tracked: SharedTracked,
        maps: Vec<Arc<dyn Balanced>>,
    ) -> Result<KeyQuota> {
        lock(&tracked).owners.attach(ebpf)?;
        Ok(KeyQuota {
            written: Mutex::new(vec![vec![false; SLOTS]; maps.len()]),
            refused_seen: Mutex::new(vec![vec![0; SLOTS]; maps.len()]),
            refused: take_map(ebpf, REFUSED_MAP)?,
            stats: Mutex::new(
                maps.iter()
                    .map(|m| MapStats {
                        max_entries: m.max_entries(),
                        ..MapStats::default()
                    })
                    .collect(),
            ),
            tracked,
            maps,
            allowance: Mutex::new(take_map(ebpf, ALLOWANCE_MAP)?),
            on: Mutex::new(take_map(ebpf, ON_MAP)?),
        })
    }

    /// Counts, evicts and writes the next second's allowances (see the module doc).
    pub fn balance(&self) -> Result<()> {
        let table = lock(&self.tracked).owners.snapshot();
        let owner_of = |s: SeriesId| table.owner_of(s);
        let mut written = lock(&self.written);
        let mut stats = lock(&self.stats);
        let mut allowance = lock(&self.allowance);
        let mut refused_seen = lock(&self.refused_seen);
        for (i, m) in self.maps.iter().enumerate() {
            // Refusals since the last balance go to the slot's owner now (a slot is reused
            // only after its last series is gone).
            for s in (1..SLOTS).filter(|s| table.live[*s] || written[i][*s]) {
                let index = allowance_index(m.quota(), s as u8);
                let n: u64 = self
                    .refused
                    .get(&index, 0)
                    .with_context(|| format!("reading {REFUSED_MAP}"))?
                    .iter()
                    .sum();
                let new = n.saturating_sub(refused_seen[i][s]);
                refused_seen[i][s] = n;
                if new > 0 {
                    *stats[i].refused.entry(table.names[s].clone()).or_default() += new;
                }
            }
            let mut entries = m.count_owners(&owner_of)?;
            let p = plan(m.max_entries(), &entries, &table.live);
            if p.evict.iter().any(|n| *n > 0) {
                let moved = m.evict(&owner_of, &p.evict)?;
                for (e, n) in entries.iter_mut().zip(&moved) {
                    *e -= (*n).min(*e);
                }
                stats[i].evicted_total += moved.iter().map(|n| u64::from(*n)).sum::<u64>();
            }
            for s in 0..SLOTS {
                let a = p.allowance[s];
                if a == 0 && !written[i][s] {
                    continue;
                }
                allowance
                    .set(allowance_index(m.quota(), s as u8), i64::from(a), 0)
                    .with_context(|| format!("writing {ALLOWANCE_MAP}"))?;
                written[i][s] = a > 0;
            }
            stats[i].entries = entries.iter().map(|n| u64::from(*n)).sum();
            stats[i].max_entries = m.max_entries();
            stats[i].by_owner = entries
                .iter()
                .enumerate()
                .filter(|(_, n)| **n > 0)
                .map(|(s, n)| (table.names[s].clone(), *n))
                .collect();
            // Owners gone leave the counter (at most one per slot is kept).
            let present: Vec<&String> = (0..SLOTS)
                .filter(|s| table.live[*s] || entries[*s] > 0)
                .map(|s| &table.names[s])
                .collect();
            stats[i].refused.retain(|name, _| present.contains(&name));
        }
        lock(&self.on)
            .set(0, 1, 0)
            .with_context(|| format!("writing {ON_MAP}"))
    }
}

/// `pgio_hist_map_*` at a scrape.
pub struct KeyQuotaSource(pub Arc<KeyQuota>);

/// Each histogram map's shares, by map name.
#[derive(Debug, Default)]
pub struct KeyQuotaSnapshot(pub Vec<(&'static str, MapStats)>);

impl Source for KeyQuotaSource {
    fn read(&self, _routes: &Provisional) -> Box<dyn Snapshot> {
        let stats = lock(&self.0.stats).clone();
        Box::new(KeyQuotaSnapshot(
            self.0
                .maps
                .iter()
                .map(|m| m.quota().name())
                .zip(stats)
                .collect(),
        ))
    }
}

static ENTRIES: Family = Family {
    name: "pgio_hist_map_entries",
    help: "Keys in each histogram map at the last balance (once a second). pgio keeps them under seven eighths of pgio_hist_map_max_entries.",
    kind: Kind::Gauge,
};
static MAX_ENTRIES: Family = Family {
    name: "pgio_hist_map_max_entries",
    help: "Size of each histogram map (config hist_map_max_entries; the query map a quarter of it).",
    kind: Kind::Gauge,
};
static OWNER_ENTRIES: Family = Family {
    name: "pgio_hist_map_owner_entries",
    help: "Keys in each histogram map by owner: the uid whose processes made the series, provisional (new processes not yet classified), exempt (series pgio bounds itself: untracked, overflow), other_uids (uids beyond the 253 slots).",
    kind: Kind::Gauge,
};
static REFUSED: Family = Family {
    name: "pgio_hist_map_refused",
    help: "Events not counted because they needed a new key in a histogram map and their owner had used up its allowance, as of the last balance (once a second; the sum over owners is pgio_events_dropped_total{reason=\"hist_over_share\"}); an owner's counter goes when its last series does.",
    kind: Kind::Counter,
};
static EVICTED: Family = Family {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn live(slots: &[usize]) -> Vec<bool> {
        let mut l = vec![false; SLOTS];
        for s in slots {
            l[*s] = true;
        }
        l
    }

    fn entries(pairs: &[(usize, u32)]) -> Vec<u32> {
        let mut e = vec![0; SLOTS];
        for (s, n) in pairs {
            e[*s] = *n;
        }
        e
    }

    #[test]
    fn the_allowances_never_add_up_past_seven_eighths() {
        let m = 65_536;
        for e in [
            entries(&[]),
            entries(&[(0, 3_000), (1, 100), (2, 200), (3, 40_000)]),
            entries(&[(1, 5), (2, 57_000), (3, 1)]),
            entries(&[(2, 20_000), (3, 20_000), (4, 17_000)]),
        ] {
            let l = live(&[1, 2, 3, 4]);
            let p = plan(m, &e, &l);
            let kept: u64 = (1..SLOTS).map(|s| u64::from(e[s] - p.evict[s])).sum();
            let owners: u64 = (1..SLOTS)
                .filter(|s| l[*s] || e[*s] > 0)
                .map(|s| u64::from(p.allowance[s]))
                .sum();
            assert!(
                u64::from(e[0]) + kept + owners <= u64::from(m) * 7 / 8,
                "{e:?}: kept {kept} + allowances {owners}"
            );
        }
    }

    #[test]
    fn a_flood_is_evicted_to_its_share_and_the_others_keep_room_to_grow() {
        // Provisional (1), postgres (2) with 3,000 keys, an attacker (3) with the rest.
        let m = 65_536;
        let e = entries(&[(1, 50), (2, 3_000), (3, 54_000)]);
        let p = plan(m, &e, &live(&[1, 2, 3]));
        let fair = (m * 7 / 8) / 3;
        // Postgres and provisional may each add 1/16 of the map.
        let reserved = 4_096 + 4_096;
        let needed = 50 + 3_000 + 54_000 + reserved - m * 7 / 8;
        assert_eq!(p.evict[3], needed);
        assert!(54_000 - p.evict[3] >= fair, "never below its share");
        assert_eq!(p.evict[2], 0);
        assert_eq!(p.evict[1], 0);
        assert_eq!(p.allowance[3], 0);
        assert_eq!(p.allowance[2], 4_096);
        assert_eq!(p.allowance[1], 4_096);
    }

    #[test]
    fn an_owner_above_its_share_keeps_its_keys_while_there_is_room() {
        let m = 65_536;
        let e = entries(&[(0, 500), (1, 10), (2, 300), (3, 30_000)]);
        let p = plan(m, &e, &live(&[1, 2, 3]));
        assert!(p.evict.iter().all(|n| *n == 0));
        let room = u64::from(m) * 7 / 8 - 500;
        let spare = (room - 30_310 - 4_096 - 4_096) / 3;
        assert_eq!(u64::from(p.allowance[3]), spare);
        assert_eq!(u64::from(p.allowance[2]), 4_096 + spare);
        // Exempt keys never get an allowance: the kernel does not ask.
        assert_eq!(p.allowance[0], 0);
    }

    #[test]
    fn a_lone_owner_may_use_seven_eighths() {
        let p = plan(8_192, &entries(&[(2, 1_000)]), &live(&[2]));
        // Provisional is not live here: one owner.
        assert_eq!(p.allowance[2], 7_168 - 1_000);
    }

    #[test]
    fn the_next_free_slots_get_a_newcomers_start() {
        let p = plan(65_536, &entries(&[]), &live(&[1, 2]));
        let grant = 65_536 / 32;
        assert_eq!(p.allowance[3], grant);
        assert_eq!(p.allowance[6], grant);
        assert_eq!(
            p.allowance[7], 0,
            "only an eighth of the map is handed out so"
        );
    }

    #[test]
    fn uids_get_slots_that_are_freed_with_their_last_series() {
        let mut o = Owners::default();
        let me = std::process::id();
        o.assign(SeriesId(1), KeyOwner::Pid(me)).expect("no kernel");
        o.assign(SeriesId(2), KeyOwner::Pid(me)).expect("no kernel");
        o.assign(SeriesId(3), KeyOwner::Exempt).expect("no kernel");
        let t = o.snapshot();
        assert_eq!(t.owner_of(SeriesId(1)), FIRST_UID_SLOT);
        assert_eq!(t.owner_of(SeriesId(2)), FIRST_UID_SLOT);
        assert_eq!(t.owner_of(SeriesId(3)), EXEMPT);
        assert_eq!(t.owner_of(SeriesId::provisional(42)), PROVISIONAL);
        assert_eq!(t.owner_of(SeriesId(99)), EXEMPT, "never given out");
        let uid = uid_of(me).expect("own uid");
        assert_eq!(t.names[FIRST_UID_SLOT as usize], uid.to_string());
        o.release(SeriesId(1));
        assert!(o.snapshot().live[FIRST_UID_SLOT as usize]);
        o.release(SeriesId(2));
        assert!(!o.snapshot().live[FIRST_UID_SLOT as usize]);
        // A pid that is gone: an unknown uid, in the freed slot.
        o.assign(SeriesId(4), KeyOwner::Pid(u32::MAX - 1))
            .expect("no kernel");
        assert_eq!(o.snapshot().names[FIRST_UID_SLOT as usize], "unknown");
    }
}
