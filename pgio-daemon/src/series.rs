//! Series registry: each distinct label set gets a small integer id, written into the kernel's
//! `tgid → series` map. A series outlives its processes, so histograms keyed by series stay
//! monotonic when processes exit; a series no process has used for `retention` is retired
//! (connections, pods and hostile titles churn; their label sets would otherwise be kept for
//! good): discovery retires it, the next map read deletes its kernel keys (`Route::Retired`),
//! then its id is freed for reuse. `Tracked` is what discovery keeps current and every scrape
//! reads.
//!
//! Label sets are bounded: every value is cut at `Limits::label_len` bytes, and past a cap
//! (in total, per app, per group: one cluster, volume or pod) a new label set is booked under
//! its app's `role="overflow"` series instead, counted in `pgio_series_refused_total`. A group
//! is what one postmaster (or one pod) can create, so a hostile cluster fills its own group,
//! not a legitimate cluster's.
mod kernel;
mod metrics;

pub use kernel::{
    BOOKS_WAITS_MAP, CHILD_SERIES_MAP, KernelSeries, NAMES_FILES_MAP, SERVES_BACKENDS_MAP,
    SERVES_CLIENTS_MAP,
};

use std::{
    collections::{BTreeMap, BTreeSet, HashMap, HashSet, hash_map::RandomState},
    hash::BuildHasher,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use pgio_common::SeriesId;

use crate::{
    key_owners::{KeyOwner, Owners},
    labels::Labels,
    provisional::Provisional,
};

/// The caps of the config's keys.
pub fn limits(config: &crate::config::Config) -> Limits {
    Limits {
        total: config.size(&MAX_SERIES),
        per_app: config.size(&MAX_SERIES_PER_APP),
        per_group: config.size(&MAX_SERIES_PER_GROUP),
        label_len: config.size(&MAX_LABEL_LEN),
    }
}

pub static SERIES_RETENTION: crate::config::Key = crate::config::Key::at_least(
    "series_retention_secs",
    300,
    1,
    "a series whose processes are all gone is exported this long, then dropped and its id reused",
)
.alias(&["pod_series_retention_secs"]);
pub static MAX_SERIES: crate::config::Key = crate::config::Key::count(
    "max_series",
    4096,
    1,
    pgio_common::CHILD_SERIES_MAX as u64 - 1024,
    "label sets in total; past a cap, new label sets go to their app's role=\"overflow\" series",
);
pub static MAX_SERIES_PER_APP: crate::config::Key =
    crate::config::Key::at_least("max_series_per_app", 2048, 1, "label sets per app");
pub static MAX_SERIES_PER_GROUP: crate::config::Key = crate::config::Key::at_least(
    "max_series_per_group",
    256,
    1,
    "label sets per group: one cluster, volume or pod",
);
pub static MAX_LABEL_LEN: crate::config::Key =
    crate::config::Key::count("max_label_len", 128, 16, 4096, "bytes of a label value");

/// Caps on label sets (config `max_series`, `max_series_per_app`, `max_series_per_group`,
/// `max_label_len`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    pub total: usize,
    pub per_app: usize,
    pub per_group: usize,
    /// Bytes per label value.
    pub label_len: usize,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            total: 4096,
            per_app: 2048,
            per_group: 256,
            label_len: 128,
        }
    }
}

/// The role of an app's overflow series.
pub const OVERFLOW: &str = "overflow";

/// Who may create label sets from one budget: one cluster (Postgres), volume (Longhorn) or pod.
type Group = (String, String, String, String, String);

fn group_of(l: &Labels) -> Group {
    (
        l.app.clone(),
        l.cluster.clone(),
        l.volume.clone(),
        l.namespace.clone(),
        l.pod.clone(),
    )
}

#[derive(Debug)]
pub struct SeriesRegistry {
    ids: HashMap<Labels, SeriesId>,
    /// By id; `None`: free.
    labels: Vec<Option<Labels>>,
    free: Vec<SeriesId>,
    /// Retirable series without a process, since when.
    idle_since: HashMap<SeriesId, Instant>,
    /// Series retired so far (`pgio_series_retired_total`).
    pub retired_total: u64,
    limits: Limits,
    /// Interned (not retired) label sets per app and per group, against the caps.
    per_app: HashMap<String, usize>,
    per_group: HashMap<Group, usize>,
    /// Label sets booked under an overflow series, per app, each counted once
    /// (`pgio_series_refused_total`).
    pub refused: BTreeMap<String, u64>,
    /// Refused label sets already counted (hashed with this registry's random keys): the
    /// processes of one are refused again at every rescan. One is forgotten when it gets a
    /// series, all at `REFUSED_SEEN_MAX`.
    refused_seen: HashSet<u64>,
    hasher: RandomState,
    /// Label values cut at `label_len` (`pgio_label_values_truncated_total`).
    pub truncated_total: u64,
}

impl Default for SeriesRegistry {
    fn default() -> Self {
        SeriesRegistry::new()
    }
}

impl SeriesRegistry {
    pub fn new() -> SeriesRegistry {
        SeriesRegistry::with_limits(Limits::default())
    }

    pub fn with_limits(limits: Limits) -> SeriesRegistry {
        let untracked = Labels::app_role("other", "");
        let mut ids = HashMap::new();
        ids.insert(untracked.clone(), SeriesId::UNTRACKED);
        SeriesRegistry {
            ids,
            labels: vec![Some(untracked.clone())],
            free: Vec::new(),
            idle_since: HashMap::new(),
            retired_total: 0,
            limits,
            per_app: HashMap::new(),
            per_group: HashMap::new(),
            refused: BTreeMap::new(),
            refused_seen: HashSet::new(),
            hasher: RandomState::new(),
            truncated_total: 0,
        }
    }

    /// The id of `labels` (values cut at the length cap), a new one if they have none, or
    /// their app's overflow series past a cap.
    pub fn intern(&mut self, mut labels: Labels) -> SeriesId {
        if labels.truncate_values(self.limits.label_len) {
            self.truncated_total += 1;
        }
        if let Some(id) = self.ids.get(&labels) {
            return *id;
        }
        if labels.role == OVERFLOW {
            // One per app, and apps come from the config: never capped.
            return self.allocate(labels);
        }
        let group = group_of(&labels);
        let full = self.len() >= self.limits.total
            || self.per_app.get(&labels.app).copied().unwrap_or(0) >= self.limits.per_app
            || self.per_group.get(&group).copied().unwrap_or(0) >= self.limits.per_group;
        let seen = self.hasher.hash_one(&labels);
        if full {
            if self.refused_seen.len() >= REFUSED_SEEN_MAX {
                self.refused_seen.clear();
            }
            if self.refused_seen.insert(seen) {
                *self.refused.entry(labels.app.clone()).or_default() += 1;
            }
            return self.intern(Labels::app_role(&labels.app, OVERFLOW));
        }
        self.refused_seen.remove(&seen);
        *self.per_app.entry(labels.app.clone()).or_default() += 1;
        *self.per_group.entry(group).or_default() += 1;
        self.allocate(labels)
    }

    /// The id `labels` have now, if any.
    pub fn id_of(&self, labels: &Labels) -> Option<SeriesId> {
        self.ids.get(labels).copied()
    }

    fn allocate(&mut self, labels: Labels) -> SeriesId {
        let id = match self.free.pop() {
            Some(id) => {
                self.labels[id.0 as usize] = Some(labels.clone());
                id
            }
            None => {
                self.labels.push(Some(labels.clone()));
                SeriesId(self.labels.len() as u32 - 1)
            }
        };
        self.ids.insert(labels, id);
        id
    }

    pub fn labels(&self, id: SeriesId) -> Option<&Labels> {
        self.labels.get(id.0 as usize).and_then(Option::as_ref)
    }

    /// The labels a series is exported with: an id pgio never gave out (it cannot happen, but
    /// a sample must not be lost) counts as untracked.
    pub fn exported(&self, id: SeriesId) -> &Labels {
        self.labels(id)
            .or(self.labels[0].as_ref())
            .unwrap_or(&UNTRACKED_LABELS)
    }

    /// Ids handed out and not freed.
    pub fn len(&self) -> usize {
        self.labels.len() - self.free.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Series that no process in `in_use` has used for `retention` (all but the untracked
    /// and the overflow series): taken out of the registry (a new process with the same labels
    /// gets another id) and returned, to have their kernel keys deleted and then be freed
    /// (`free`).
    pub fn retire_idle(
        &mut self,
        in_use: &BTreeSet<SeriesId>,
        now: Instant,
        retention: Duration,
    ) -> Vec<SeriesId> {
        let mut retired = Vec::new();
        for (i, labels) in self.labels.iter().enumerate() {
            let id = SeriesId(i as u32);
            let Some(labels) = labels
                .as_ref()
                .filter(|l| id != SeriesId::UNTRACKED && l.role != OVERFLOW)
            else {
                continue;
            };
            if in_use.contains(&id) || !self.ids.contains_key(labels) {
                self.idle_since.remove(&id);
                continue;
            }
            let since = *self.idle_since.entry(id).or_insert(now);
            if now.duration_since(since) >= retention {
                retired.push(id);
            }
        }
        for id in &retired {
            self.idle_since.remove(id);
            if let Some(labels) = self.labels(*id).cloned() {
                self.ids.remove(&labels);
                release(&mut self.per_app, &labels.app);
                release(&mut self.per_group, &group_of(&labels));
            }
        }
        self.retired_total += retired.len() as u64;
        retired
    }

    /// Retired series whose kernel keys are gone: their ids can be given out again.
    pub fn free(&mut self, ids: impl IntoIterator<Item = SeriesId>) {
        for id in ids {
            if let Some(slot) = self.labels.get_mut(id.0 as usize)
                && id != SeriesId::UNTRACKED
                && slot.take().is_some()
            {
                self.free.push(id);
            }
        }
    }
}

/// Refused label sets remembered as counted (8 bytes each, 512 KiB at most); past it, a
/// label set refused before may be counted again.
const REFUSED_SEEN_MAX: usize = 65_536;

/// One label set less against a cap; empty counts are dropped (groups come and go).
fn release<K: std::hash::Hash + Eq>(counts: &mut HashMap<K, usize>, key: &K) {
    if let Some(n) = counts.get_mut(key) {
        *n = n.saturating_sub(1);
        if *n == 0 {
            counts.remove(key);
        }
    }
}

static UNTRACKED_LABELS: std::sync::LazyLock<Labels> =
    std::sync::LazyLock::new(|| Labels::app_role("other", ""));

/// What discovery keeps current and the collector reads: series labels and who is tracked.
#[derive(Default, Debug)]
pub struct Tracked {
    pub registry: SeriesRegistry,
    /// tgid → series, mirror of the kernel's `TRACKED` map (a provisional process: its
    /// cluster's `starting` series).
    pub pids: HashMap<u32, SeriesId>,
    pub provisional: Provisional,
    /// Tracked processes a rescan found gone with no exit event handled: lost events, or a
    /// process tracked again after its exit. Stays 0 when discovery is right.
    pub exits_missed: u64,
    /// Writes to the kernel's `TRACKED` or `CHILD_SERIES` that failed: a process booked under
    /// the wrong series. Stays 0 (ids stay below the caps, pids below pid_max).
    pub kernel_map_errors: u64,
    /// Whose share of the histogram maps each series' keys count against.
    pub owners: Owners,
}

impl Tracked {
    /// `labels`' id (see `SeriesRegistry::intern`); a new id gets `owner`'s share of the maps
    /// (the overflow series are exempt: pgio bounds them).
    pub fn intern(&mut self, labels: Labels, owner: KeyOwner) -> SeriesId {
        let id = self.registry.intern(labels);
        if !self.owners.is_assigned(id) {
            let owner = match self.registry.labels(id) {
                Some(l) if l.role == OVERFLOW => KeyOwner::Exempt,
                _ => owner,
            };
            if self.owners.assign(id, owner).is_err() {
                self.kernel_map_errors += 1;
            }
        }
        id
    }

    /// Series `retired` had their kernel keys deleted by a map read: free their ids.
    pub fn free_retired(&mut self, retired: &BTreeSet<SeriesId>) {
        if retired.is_empty() {
            return;
        }
        for id in retired {
            self.owners.release(*id);
            self.provisional.next_generation(*id);
        }
        self.registry.free(retired.iter().copied());
        self.provisional.retired.retain(|id| !retired.contains(id));
    }

    /// Retires the series no process has used for `retention` (see the module doc). Still
    /// in use, besides the processes' own series: the provisional ones, and each series'
    /// children's (`child_of`: a postmaster's `starting` series, which the kernel books its
    /// new children under).
    pub fn retire_idle(
        &mut self,
        now: Instant,
        retention: Duration,
        child_of: impl Fn(&Labels) -> Option<Labels>,
    ) -> Vec<SeriesId> {
        let mut in_use: BTreeSet<SeriesId> = self
            .pids
            .values()
            .copied()
            .chain(self.provisional.in_use())
            .chain([self.provisional.orphan])
            .collect();
        let children: Vec<SeriesId> = in_use
            .iter()
            .filter_map(|id| child_of(self.registry.labels(*id)?))
            .filter_map(|l| self.registry.id_of(&l))
            .collect();
        in_use.extend(children);
        let retired = self.registry.retire_idle(&in_use, now, retention);
        self.provisional.retired.extend(retired.iter().copied());
        retired
    }

    pub fn with_limits(limits: Limits) -> Tracked {
        Tracked {
            registry: SeriesRegistry::with_limits(limits),
            ..Tracked::default()
        }
    }
}

pub type SharedTracked = Arc<Mutex<Tracked>>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_labels_same_id_and_untracked_is_zero() {
        let mut r = SeriesRegistry::new();
        assert_eq!(
            r.labels(SeriesId::UNTRACKED).map(|l| l.app.as_str()),
            Some("other")
        );
        let a = r.intern(Labels::app_role("postgres", "checkpointer"));
        let b = r.intern(Labels::app_role("postgres", "walwriter"));
        let a2 = r.intern(Labels::app_role("postgres", "checkpointer"));
        assert_eq!(a, SeriesId(1));
        assert_eq!(b, SeriesId(2));
        assert_eq!(a, a2);
        assert_eq!(r.labels(b).map(|l| l.role.as_str()), Some("walwriter"));
        assert_eq!(r.labels(SeriesId(3)), None);
    }

    fn in_pod(role: &str, pod: &str) -> Labels {
        Labels {
            namespace: "db".into(),
            pod: pod.into(),
            container: "postgres".into(),
            ..Labels::app_role("postgres", role)
        }
    }

    #[test]
    fn idle_series_retire_after_retention_and_their_ids_are_reused() {
        let mut r = SeriesRegistry::new();
        let host = r.intern(Labels::app_role("postgres", "checkpointer"));
        let a = r.intern(in_pod("checkpointer", "pg-0"));
        let b = r.intern(in_pod("walwriter", "pg-0"));
        let overflow = r.intern(Labels::app_role("postgres", OVERFLOW));
        let t0 = Instant::now();
        let keep = Duration::from_secs(300);
        let used = |ids: &[SeriesId]| ids.iter().copied().collect::<BTreeSet<_>>();
        assert!(
            r.retire_idle(&used(&[b, host]), t0, keep).is_empty(),
            "a: idle from t0"
        );
        assert!(
            r.retire_idle(&used(&[b, host]), t0 + keep / 2, keep)
                .is_empty()
        );
        // b was used at t0: its idle time starts now.
        assert_eq!(r.retire_idle(&used(&[host]), t0 + keep, keep), vec![a]);
        assert_eq!(r.retired_total, 1);
        // Retired: still readable (a scrape may be encoding it), no longer interned.
        assert!(r.labels(a).is_some());
        let a2 = r.intern(in_pod("checkpointer", "pg-0"));
        assert_ne!(a2, a, "not handed out before its kernel keys are gone");
        r.free([a]);
        assert_eq!(r.labels(a), None);
        assert_eq!(r.exported(a).app, "other");
        let c = r.intern(in_pod("checkpointer", "pg-1"));
        assert_eq!(c, a, "freed ids are reused");
        assert_eq!(r.len(), 6);
        // b has been idle since t0 + keep; a2 and c only from now on; host from here on.
        assert_eq!(r.retire_idle(&used(&[]), t0 + 3 * keep, keep), vec![b]);
        assert_eq!(
            r.retire_idle(&used(&[]), t0 + 9 * keep, keep),
            vec![host, c, a2]
        );
        assert!(r.labels(overflow).is_some(), "overflow series never go");
        r.free([SeriesId::UNTRACKED, b, b]);
        assert_eq!(
            r.labels(SeriesId::UNTRACKED).map(|l| l.app.as_str()),
            Some("other")
        );
        assert_eq!(r.len(), 5);
    }

    fn backend(cluster: &str, database: &str) -> Labels {
        Labels {
            cluster: cluster.into(),
            database: database.into(),
            user: "u".into(),
            ..Labels::app_role("postgres", "client backend")
        }
    }

    #[test]
    fn past_a_cap_new_label_sets_go_to_their_apps_overflow_series() {
        let mut r = SeriesRegistry::with_limits(Limits {
            total: 9,
            per_app: 6,
            per_group: 3,
            label_len: 16,
        });
        // A hostile cluster fills its group; the real cluster keeps its own.
        let fake: Vec<SeriesId> = (0..5)
            .map(|i| r.intern(backend("/tmp/x", &format!("d{i}"))))
            .collect();
        let overflow = r.id_of(&Labels::app_role("postgres", OVERFLOW));
        assert_eq!(fake[3..], [overflow.expect("interned"); 2]);
        assert_eq!(r.refused.get("postgres"), Some(&2));
        let real = r.intern(backend("main", "shop"));
        assert!(!fake.contains(&real));
        assert_eq!(r.labels(real).map(|l| l.database.as_str()), Some("shop"));
        // Long values are cut before the lookup.
        let long = r.intern(backend("main", "shop-and-a-very-long-name"));
        assert_eq!(
            r.labels(long).map(|l| l.database.as_str()),
            Some("shop-and-a-very-")
        );
        assert_eq!(
            r.intern(backend("main", "shop-and-a-very-other-name")),
            long
        );
        assert_eq!(r.truncated_total, 2);
        // Per app: 3 + 3 = 6 postgres label sets.
        assert_ne!(r.intern(backend("main", "crm")), overflow.expect("some"));
        assert_eq!(r.intern(backend("other", "x")), overflow.expect("some"));
        assert_eq!(r.refused.get("postgres"), Some(&3));
        // Total: untracked + 6 postgres + overflow = 8; one more fits, then the cap.
        let k = r.intern(Labels::app_role("kernel", "kworker"));
        assert_eq!(r.labels(k).map(|l| l.role.as_str()), Some("kworker"));
        let k2 = r.intern(Labels::app_role("kernel", "ksoftirqd"));
        assert_eq!(r.labels(k2).map(|l| l.role.as_str()), Some(OVERFLOW));
        assert_eq!(r.refused.get("kernel"), Some(&1));
        // A label set refused again (its processes, at every rescan) is counted once.
        for _ in 0..3 {
            r.intern(Labels::app_role("kernel", "ksoftirqd"));
            r.intern(backend("other", "x"));
        }
        assert_eq!(r.refused.get("kernel"), Some(&1));
        assert_eq!(r.refused.get("postgres"), Some(&3));
        // Known label sets keep their id at the cap.
        assert_eq!(r.intern(backend("main", "shop")), real);
        // A retired series frees its room in its app and group.
        let used: BTreeSet<SeriesId> = [real].into();
        let t0 = Instant::now();
        let keep = Duration::from_secs(1);
        r.retire_idle(&used, t0, keep);
        let retired = r.retire_idle(&used, t0 + keep, keep);
        assert!(retired.contains(&fake[0]) && !retired.contains(&real));
        r.free(retired);
        let again = r.intern(backend("/tmp/x", "d9"));
        assert_eq!(r.labels(again).map(|l| l.database.as_str()), Some("d9"));
    }
}
