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
mod metrics;
mod plan;

use std::sync::{Arc, Mutex};

use anyhow::{Context as _, Result};
use aya::{
    Ebpf,
    maps::{Array, MapData},
};
use pgio_common::{SeriesId, key_quota::allowance_index};

pub use self::metrics::{KeyQuotaSnapshot, MapStats};
pub use self::plan::{Plan, plan};
use crate::{
    collector::{Snapshot, Source},
    hist::Balanced,
    key_owners::SLOTS,
    lock,
    maps::take_map,
    provisional::Provisional,
    series::SharedTracked,
};

pub const ALLOWANCE_MAP: &str = "KEY_ALLOWANCE";
pub const ON_MAP: &str = "KEY_QUOTA_ON";
pub const REFUSED_MAP: &str = "KEY_REFUSED";

pub struct KeyQuota {
    tracked: SharedTracked,
    maps: Vec<Arc<dyn Balanced>>,
    allowance: Mutex<Array<MapData, i64>>,
    refused: Array<MapData, u64>,
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
                let index = allowance_index(m.spec().quota, s as u8);
                let n: u64 = self
                    .refused
                    .get(&index, 0)
                    .with_context(|| format!("reading {REFUSED_MAP}"))?;
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
                    .set(allowance_index(m.spec().quota, s as u8), i64::from(a), 0)
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

impl Source for KeyQuotaSource {
    fn read(&self, _routes: &Provisional) -> Box<dyn Snapshot> {
        let stats = lock(&self.0.stats).clone();
        Box::new(KeyQuotaSnapshot(
            self.0
                .maps
                .iter()
                .map(|m| m.spec().family)
                .zip(stats)
                .collect(),
        ))
    }
}
