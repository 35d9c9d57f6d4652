//! The one reader every histogram map goes through (`HistReader`) and the one source that
//! exports a family's histograms (`HistSource`, `HistSnapshot`). A family brings its key type
//! (`HistKey`) and the histogram a key names (`HistId`), which writes the family's metrics.
use std::{
    collections::{BTreeMap, HashMap},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::Instant,
};

use anyhow::Result;
use aya::{
    Ebpf,
    maps::{HashMap as BpfHashMap, MapData},
};
use pgio_common::{
    SeriesId,
    hist::Bucket,
    key_quota::{OWNER_SLOTS, QuotaMap},
};
use tracing::warn;

pub use crate::log2_hist::{Log2Hist, MAX_SLOT, MIN_SLOT, le_seconds};
use crate::{
    collector::{Scrape, Snapshot, Source},
    exposition::Encoder,
    lock,
    maps::take_map,
    provisional::{Provisional, Route},
};

/// `hist_map_max_entries`: each family sizes its histogram map from it.
pub fn entries(config: &crate::config::Config) -> u32 {
    u32::try_from(config.count(&HIST_MAP_MAX_ENTRIES)).unwrap_or(1 << 20)
}

pub static HIST_MAP_MAX_ENTRIES: crate::config::Key = crate::config::Key::count(
    "hist_map_max_entries",
    65_536,
    1024,
    1 << 20,
    "keys of the syscall histogram map (block: a sixteenth, relation: a quarter, query: a 64th), 24 bytes per possible CPU each; no uid may hold more than its share while others need keys",
);

/// A histogram map's key: the series it books, and the rest, which names the exported
/// histograms its value adds to.
pub trait HistKey: aya::Pod + Eq + std::hash::Hash + Send {
    type Id: HistId;
    /// The map's value: one log2 slot of one histogram (`Bucket`), or whole histograms.
    type Value: HistValue;
    fn series(&self) -> SeriesId;
    /// Adds `value` to the histograms it belongs to, booked under `series`; `false` for a key
    /// with a value no variant has (`pgio_common::abi::UnknownValue`): such keys are left out.
    fn add_to(&self, series: SeriesId, value: &Self::Value, hists: &mut Hists<Self::Id>) -> bool;
}

/// A histogram map's value, summed with another of the same key.
pub trait HistValue: aya::Pod + Default + Send {
    fn merge(&mut self, other: &Self);
}

impl HistValue for Bucket {
    fn merge(&mut self, b: &Bucket) {
        self.count = self.count.wrapping_add(b.count);
        self.sum = self.sum.wrapping_add(b.sum);
        self.bytes = self.bytes.wrapping_add(b.bytes);
    }
}

/// `HistKey::add_to` for a key of one log2 slot of histogram `id`.
pub fn add_slot<Id: HistId>(id: Option<Id>, slot: u8, b: &Bucket, hists: &mut Hists<Id>) -> bool {
    let Some(id) = id else {
        return false;
    };
    hists.entry(id).or_default().add(slot, b);
    true
}

/// One exported histogram of a family (series plus the family's own labels).
pub trait HistId: Ord + Copy + Send + Sync + 'static {
    /// The series it is booked under.
    fn series(&self) -> SeriesId;
    /// Writes the family's metric families from one scrape's histograms.
    fn encode(hists: &Hists<Self>, scrape: &mut Scrape<'_>, enc: &mut Encoder);
}

pub type Hists<Id> = BTreeMap<Id, Log2Hist>;

/// A family's histogram map: its name in the object, and its place in the key quota.
#[derive(Debug)]
pub struct HistMapSpec {
    /// The family (`pgio_hist_map_*{map}`).
    pub family: &'static str,
    /// The map's name in the eBPF object.
    pub map: &'static str,
    pub quota: QuotaMap,
}

/// A histogram map under quota (`key_quota`).
pub trait Balanced: Send + Sync {
    fn spec(&self) -> &'static HistMapSpec;
    fn max_entries(&self) -> u32;
    /// Keys per owner slot.
    fn count_owners(&self, owner_of: &dyn Fn(SeriesId) -> u8) -> Result<Vec<u32>>;
    /// Moves up to `want[slot]` keys of each slot out of the kernel map into userspace;
    /// returns how many per slot.
    fn evict(&self, owner_of: &dyn Fn(SeriesId) -> u8, want: &[u32]) -> Result<Vec<u32>>;
}

/// Reads one histogram map (one value per key, every CPU adds to it) and gathers slots into
/// histograms. Keys of
/// provisional series (see `provisional`) are left in the map while their process is being
/// classified, then moved into the series it was classified as: deleted from the kernel map
/// and kept in `carry`, so every exported series stays monotonic. Scrapes only read
/// (`peek`); the once-a-second pass moves and deletes (`fold`).
pub struct HistReader<K: HistKey> {
    spec: &'static HistMapSpec,
    max_entries: u32,
    map: Mutex<BpfHashMap<MapData, K, K::Value>>,
    carry: Mutex<Hists<K::Id>>,
    /// Counts userspace books under a kernel key (`book`, `evict`): they take the same routes
    /// as the map's entries.
    booked: Mutex<HashMap<K, K::Value>>,
    /// A key with a value no variant has was seen (logged once).
    unknown_seen: AtomicBool,
}

impl<K: HistKey> HistReader<K> {
    /// Takes the histogram map of `spec` (`max_entries` as loaded) out of the loaded object.
    pub fn take(
        ebpf: &mut Ebpf,
        spec: &'static HistMapSpec,
        max_entries: u32,
    ) -> Result<HistReader<K>> {
        Ok(HistReader {
            spec,
            max_entries,
            map: Mutex::new(take_map(ebpf, spec.map)?),
            carry: Mutex::default(),
            booked: Mutex::default(),
            unknown_seen: AtomicBool::new(false),
        })
    }

    fn add_to(&self, key: &K, series: SeriesId, value: &K::Value, hists: &mut Hists<K::Id>) {
        if !key.add_to(series, value, hists) && !self.unknown_seen.swap(true, Ordering::Relaxed) {
            warn!(
                map = self.spec.map,
                "keys with values this pgio-daemon does not know are left out (an eBPF object \
                 from another build?)"
            );
        }
    }

    /// `peek` for a scrape: a map that cannot be read is logged and exported empty, so the
    /// other families still are.
    pub fn peek_or_empty(&self, routes: &Provisional) -> Hists<K::Id> {
        self.peek(routes).unwrap_or_else(|e| {
            warn!(
                map = self.spec.map,
                error = format!("{e:#}"),
                "reading a histogram map"
            );
            Hists::new()
        })
    }

    /// Adds `b` under `key` from userspace, for what only userspace finds (the block sweep's
    /// lost requests); writing the map would race the kernel's own atomic adds.
    pub fn book(&self, key: K, value: K::Value) {
        lock(&self.booked).entry(key).or_default().merge(&value);
    }

    /// Every histogram as a scrape shows it, changing nothing: keys of a classified
    /// provisional series count under the series it was classified as, retired series are
    /// left out.
    pub fn peek(&self, routes: &Provisional) -> Result<Hists<K::Id>> {
        let mut out = Hists::new();
        let mut add = |key: &K, value: &K::Value| {
            let series = match routes.route(key.series()) {
                Route::Own => key.series(),
                Route::Fold(series) => series,
                Route::Pending | Route::Retired => return,
            };
            self.add_to(key, series, value, &mut out);
        };
        // All three held at once, in `fold`'s order: a fold between the map's read and
        // `carry`'s would show the keys it moves twice (and the next scrape step back).
        let map = lock(&self.map);
        let carry = lock(&self.carry);
        let booked = lock(&self.booked);
        for entry in map.iter() {
            let (key, b) = entry?;
            add(&key, &b);
        }
        for (key, b) in booked.iter() {
            add(key, b);
        }
        for (id, h) in carry.iter() {
            if !routes.retired.contains(&id.series()) {
                out.entry(*id).or_default().merge(h);
            }
        }
        Ok(out)
    }

    /// Moves the keys of classified provisional series into `carry` and deletes them, and
    /// those of retired series, from the kernel map (the once-a-second pass).
    pub fn fold(&self, routes: &Provisional) -> Result<()> {
        let mut map = lock(&self.map);
        let mut carry = lock(&self.carry);
        let keys: Vec<K> = map.keys().collect::<Result<_, _>>()?;
        let now = Instant::now();
        for key in keys {
            match routes.route_at(key.series(), now) {
                Route::Own | Route::Pending => continue,
                // Scrapes count it under `series` until the kernel is done with it.
                Route::Fold(_) if routes.settling(key.series(), now) => continue,
                Route::Fold(series) => {
                    // Gone already is fine: nothing else deletes, and a late event recreates it.
                    let Ok(value) = map.get(&key, 0) else {
                        continue;
                    };
                    self.add_to(&key, series, &value, &mut carry);
                }
                Route::Retired => {}
            }
            let _ = map.remove(&key);
        }
        lock(&self.booked).retain(|key, b| match routes.route(key.series()) {
            Route::Own | Route::Pending => true,
            Route::Fold(series) => {
                self.add_to(key, series, b, &mut carry);
                false
            }
            Route::Retired => false,
        });
        if !routes.retired.is_empty() {
            carry.retain(|id, _| !routes.retired.contains(&id.series()));
        }
        Ok(())
    }
}

impl<K: HistKey> HistReader<K> {
    /// Deletes the kernel's keys and userspace's counts a family's own rule says are gone
    /// (`queue_blame`: what was blamed on a retired series), in the once-a-second pass.
    pub fn forget(
        &self,
        key_gone: impl Fn(&K) -> bool,
        id_gone: impl Fn(&K::Id) -> bool,
    ) -> Result<()> {
        let mut map = lock(&self.map);
        let mut carry = lock(&self.carry);
        let keys: Vec<K> = map.keys().collect::<Result<_, _>>()?;
        for key in keys.iter().filter(|k| key_gone(k)) {
            let _ = map.remove(key);
        }
        lock(&self.booked).retain(|key, _| !key_gone(key));
        carry.retain(|id, _| !id_gone(id));
        Ok(())
    }
}

impl<K: HistKey + 'static> Balanced for HistReader<K> {
    fn spec(&self) -> &'static HistMapSpec {
        self.spec
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
            let Ok(value) = map.get(&key, 0) else {
                continue;
            };
            if map.remove(&key).is_err() {
                continue;
            }
            booked.entry(key).or_default().merge(&value);
            moved[owner_of(key.series()) as usize] += 1;
        }
        Ok(moved)
    }
}

/// One scrape's histograms of a family.
#[derive(Debug)]
pub struct HistSnapshot<Id>(pub Hists<Id>);

impl<Id> Default for HistSnapshot<Id> {
    fn default() -> Self {
        HistSnapshot(Hists::new())
    }
}

impl<Id: HistId> Snapshot for HistSnapshot<Id> {
    fn encode(&self, scrape: &mut Scrape<'_>, enc: &mut Encoder) {
        Id::encode(&self.0, scrape, enc)
    }
}

/// A family whose map to read is its histogram map: read at each scrape, folded once a
/// second.
pub struct HistSource<K: HistKey> {
    pub reader: Arc<HistReader<K>>,
}

impl<K: HistKey + 'static> HistSource<K> {
    pub fn take(
        ebpf: &mut Ebpf,
        spec: &'static HistMapSpec,
        max_entries: u32,
    ) -> Result<HistSource<K>> {
        Ok(HistSource {
            reader: Arc::new(HistReader::take(ebpf, spec, max_entries)?),
        })
    }

    /// The histogram map, for `key_quota`.
    pub fn balanced(&self) -> Arc<dyn Balanced> {
        self.reader.clone()
    }
}

impl<K: HistKey + 'static> Source for HistSource<K> {
    fn read(&self, routes: &Provisional) -> Box<dyn Snapshot> {
        Box::new(HistSnapshot(self.reader.peek_or_empty(routes)))
    }

    fn fold(&self, routes: &Provisional) -> Result<()> {
        self.reader.fold(routes)
    }
}
