//! Log2 histograms summed over CPUs, and the one reader every histogram map goes through.
use std::{
    collections::{BTreeMap, HashMap},
    sync::Mutex,
};

use anyhow::Result;
use aya::{
    Ebpf,
    maps::{MapData, PerCpuHashMap},
};
use pgio_common::{
    SeriesId,
    hist::{Bucket, SLOTS},
    key_quota::{HistMap, OWNER_SLOTS},
};

use tracing::warn;

use crate::{
    key_quota::Balanced,
    lock,
    maps::take_map,
    provisional::{Provisional, Route},
};

/// Smallest `le`: 2^10 ns ≈ 1 µs (everything faster is folded into it: a syscall takes longer).
pub const MIN_SLOT: usize = 10;
/// Largest finite `le`: 2^34 ns ≈ 17.2 s (everything slower goes to `+Inf` only).
pub const MAX_SLOT: usize = 34;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Log2Hist {
    pub slots: [u64; SLOTS],
    pub sum_ns: u64,
    pub bytes: u64,
}

impl Default for Log2Hist {
    fn default() -> Self {
        Log2Hist {
            slots: [0; SLOTS],
            sum_ns: 0,
            bytes: 0,
        }
    }
}

impl Log2Hist {
    /// Adds one map entry (already summed over CPUs or one CPU's share).
    pub fn add(&mut self, slot: u8, b: &Bucket) {
        let slot = (slot as usize).min(SLOTS - 1);
        self.slots[slot] = self.slots[slot].wrapping_add(b.count);
        self.sum_ns = self.sum_ns.wrapping_add(b.sum);
        self.bytes = self.bytes.wrapping_add(b.bytes);
    }

    pub fn merge(&mut self, other: &Log2Hist) {
        for (a, b) in self.slots.iter_mut().zip(other.slots.iter()) {
            *a = a.wrapping_add(*b);
        }
        self.sum_ns = self.sum_ns.wrapping_add(other.sum_ns);
        self.bytes = self.bytes.wrapping_add(other.bytes);
    }

    pub fn count(&self) -> u64 {
        self.slots.iter().sum()
    }

    pub fn sum_seconds(&self) -> f64 {
        self.sum_ns as f64 * 1e-9
    }

    /// Non-cumulative counts of the exported buckets, `le = 2^k ns` for k in
    /// MIN_SLOT..=MAX_SLOT, then `+Inf`. Slot k holds (2^(k-1), 2^k] ns, so each slot maps onto
    /// exactly one bucket and nothing is re-binned.
    pub fn bucket_counts(&self) -> impl Iterator<Item = u64> + '_ {
        let below: u64 = self.slots[..=MIN_SLOT].iter().sum();
        let above: u64 = self.slots[MAX_SLOT + 1..].iter().sum();
        std::iter::once(below)
            .chain(self.slots[MIN_SLOT + 1..=MAX_SLOT].iter().copied())
            .chain(std::iter::once(above))
    }
}

pub fn le_seconds(slot: usize) -> f64 {
    (1u64 << slot) as f64 * 1e-9
}

/// A histogram map's key: the series it books, its log2 slot, and the rest, which names one
/// exported histogram.
pub trait HistKey: aya::Pod + Eq + std::hash::Hash + Send {
    type Id: Ord + Copy;
    fn series(&self) -> SeriesId;
    fn slot(&self) -> u8;
    /// The histogram this key's slot belongs to, booked under `series`.
    fn id(&self, series: SeriesId) -> Self::Id;
    /// The series a histogram is booked under.
    fn series_of(id: &Self::Id) -> SeriesId;
}

pub type Hists<Id> = BTreeMap<Id, Log2Hist>;

/// Reads one per-CPU histogram map: sums the CPUs and gathers slots into histograms. Keys of
/// provisional series (see `provisional`) are left in the map while their process is being
/// classified, then moved into the series it was classified as: deleted from the kernel map
/// and kept in `carry`, so every exported series stays monotonic.
pub struct HistReader<K: HistKey> {
    /// The map's name, for log messages.
    name: &'static str,
    quota: HistMap,
    max_entries: u32,
    map: Mutex<PerCpuHashMap<MapData, K, Bucket>>,
    carry: Mutex<Hists<K::Id>>,
    /// Counts userspace books under a kernel key (`book`, `evict`): they take the same routes
    /// as the map's entries.
    booked: Mutex<HashMap<K, Bucket>>,
}

impl<K: HistKey> HistReader<K> {
    /// Takes the histogram map `name` (`max_entries` as loaded) out of the loaded object.
    pub fn take(
        ebpf: &mut Ebpf,
        name: &'static str,
        quota: HistMap,
        max_entries: u32,
    ) -> Result<HistReader<K>> {
        Ok(HistReader {
            name,
            quota,
            max_entries,
            map: Mutex::new(take_map(ebpf, name)?),
            carry: Mutex::default(),
            booked: Mutex::default(),
        })
    }

    /// `read` for a scrape: a map that cannot be read is logged and exported empty, so the
    /// other families still are.
    pub fn read_or_empty(&self, routes: &Provisional) -> Hists<K::Id> {
        self.read(routes).unwrap_or_else(|e| {
            warn!(
                map = self.name,
                error = format!("{e:#}"),
                "reading a histogram map"
            );
            Hists::new()
        })
    }

    /// Adds `b` under `key` from userspace, for what only userspace finds (the block sweep's
    /// lost requests); writing the per-CPU map would race the kernel's own adds.
    pub fn book(&self, key: K, b: Bucket) {
        add_bucket(lock(&self.booked).entry(key).or_default(), &b);
    }

    pub fn read(&self, routes: &Provisional) -> Result<Hists<K::Id>> {
        let mut map = lock(&self.map);
        let mut carry = lock(&self.carry);
        let mut out = Hists::new();
        let mut removed = Vec::new();
        for entry in map.iter() {
            let (key, per_cpu) = entry?;
            let h = match routes.route(key.series()) {
                Route::Own => out.entry(key.id(key.series())),
                Route::Pending => continue,
                Route::Fold(series) => {
                    removed.push(key);
                    carry.entry(key.id(series))
                }
                Route::Retired => {
                    removed.push(key);
                    continue;
                }
            }
            .or_default();
            for b in per_cpu.iter() {
                h.add(key.slot(), b);
            }
        }
        for key in &removed {
            // Gone already is fine: nothing else deletes, and a late event recreates it.
            let _ = map.remove(key);
        }
        lock(&self.booked).retain(|key, b| match routes.route(key.series()) {
            Route::Own => {
                out.entry(key.id(key.series()))
                    .or_default()
                    .add(key.slot(), b);
                true
            }
            Route::Pending => true,
            Route::Fold(series) => {
                carry.entry(key.id(series)).or_default().add(key.slot(), b);
                false
            }
            Route::Retired => false,
        });
        if !routes.retired.is_empty() {
            carry.retain(|id, _| !routes.retired.contains(&K::series_of(id)));
        }
        for (id, h) in carry.iter() {
            out.entry(*id).or_default().merge(h);
        }
        Ok(out)
    }
}

fn add_bucket(sum: &mut Bucket, b: &Bucket) {
    sum.count = sum.count.wrapping_add(b.count);
    sum.sum = sum.sum.wrapping_add(b.sum);
    sum.bytes = sum.bytes.wrapping_add(b.bytes);
}

impl<K: HistKey + 'static> Balanced for HistReader<K>
where
    K::Id: Send,
{
    fn quota(&self) -> HistMap {
        self.quota
    }

    fn max_entries(&self) -> u32 {
        self.max_entries
    }

    fn count_owners(&self, owner_of: &dyn Fn(SeriesId) -> u8) -> Result<Vec<u32>> {
        let map = lock(&self.map);
        let mut n = vec![0u32; OWNER_SLOTS as usize];
        for key in map.keys() {
            n[owner_of(key?.series()) as usize] += 1;
        }
        Ok(n)
    }

    /// Each key is read, deleted, then booked in userspace: an event landing on it in
    /// between (microseconds, and only on keys of an owner above its share) is lost.
    fn evict(&self, owner_of: &dyn Fn(SeriesId) -> u8, want: &[u32]) -> Result<Vec<u32>> {
        let mut map = lock(&self.map);
        let mut want = want.to_vec();
        let mut moved = vec![0u32; OWNER_SLOTS as usize];
        let keys: Vec<K> = map
            .keys()
            .filter_map(Result::ok)
            .filter(|k| {
                let s = owner_of(k.series()) as usize;
                let take = want[s] > 0;
                want[s] = want[s].saturating_sub(1);
                take
            })
            .collect();
        let mut booked = lock(&self.booked);
        for key in keys {
            let Ok(per_cpu) = map.get(&key, 0) else {
                continue;
            };
            if map.remove(&key).is_err() {
                continue;
            }
            let sum = booked.entry(key).or_default();
            for b in per_cpu.iter() {
                add_bucket(sum, b);
            }
            moved[owner_of(key.series()) as usize] += 1;
        }
        Ok(moved)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pgio_common::hist::slot;

    fn observe(h: &mut Log2Hist, ns: u64) {
        h.add(
            slot(ns),
            &Bucket {
                count: 1,
                sum: ns,
                bytes: 0,
            },
        );
    }

    #[test]
    fn buckets_are_upper_inclusive_powers_of_two_in_seconds() {
        let mut h = Log2Hist::default();
        observe(&mut h, 100); // below 1.024 µs: first bucket
        observe(&mut h, 1 << 20); // exactly 2^20 ns: le=2^20
        observe(&mut h, (1 << 20) + 1); // just above: le=2^21
        observe(&mut h, 1 << 40); // beyond 2^34: only +Inf
        let b: Vec<(f64, u64)> = (MIN_SLOT..=MAX_SLOT)
            .map(le_seconds)
            .chain([f64::INFINITY])
            .zip(h.bucket_counts())
            .collect();
        assert_eq!(b.len(), MAX_SLOT - MIN_SLOT + 2);
        assert_eq!(b[0], (1024e-9, 1));
        let at = |k: usize| b[k - MIN_SLOT];
        assert!((at(20).0 - 0.001048576).abs() < 1e-15);
        assert_eq!(at(20).1, 1);
        assert_eq!(at(21).1, 1);
        assert_eq!(b.last(), Some(&(f64::INFINITY, 1)));
        assert_eq!(b.iter().map(|x| x.1).sum::<u64>(), h.count());
        assert_eq!(h.count(), 4);
        assert_eq!(h.sum_ns, 100 + (1 << 20) + (1 << 20) + 1 + (1 << 40));
        assert!((h.sum_seconds() - h.sum_ns as f64 * 1e-9).abs() < 1e-12);
    }

    #[test]
    fn adding_per_cpu_shares_sums_them() {
        let mut h = Log2Hist::default();
        let b = Bucket {
            count: 3,
            sum: 30,
            bytes: 8192,
        };
        h.add(5, &b);
        h.add(5, &b);
        assert_eq!(h.slots[5], 6);
        assert_eq!(h.sum_ns, 60);
        assert_eq!(h.bytes, 16384);
    }
}
