//! Series registry: each distinct label set gets a small integer id, written into the kernel's
//! `tgid → series` map. A series outlives its processes, so histograms keyed by series stay
//! monotonic when processes exit; only a pod's series is retired, `retention` after its last
//! process left (pods churn; a label set with a pod name would otherwise be kept for good):
//! discovery retires it, the next map read deletes its kernel keys (`Route::Retired`), then
//! its id is freed for reuse. `Tracked` is what discovery keeps current and every scrape
//! reads.
use std::{
    collections::{BTreeSet, HashMap},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use anyhow::Result;
use aya::{
    Ebpf,
    maps::{Array, MapData, MapError},
};
use pgio_common::SeriesId;

use crate::{labels::Labels, maps::take_map, provisional::Provisional};

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
}

impl Default for SeriesRegistry {
    fn default() -> Self {
        SeriesRegistry::new()
    }
}

impl SeriesRegistry {
    pub fn new() -> SeriesRegistry {
        let untracked = Labels::app_role("other", "");
        let mut ids = HashMap::new();
        ids.insert(untracked.clone(), SeriesId::UNTRACKED);
        SeriesRegistry {
            ids,
            labels: vec![Some(untracked.clone())],
            free: Vec::new(),
            idle_since: HashMap::new(),
            retired_total: 0,
        }
    }

    pub fn intern(&mut self, labels: Labels) -> SeriesId {
        if let Some(id) = self.ids.get(&labels) {
            return *id;
        }
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

    /// Pod series that no process in `in_use` has used for `retention`: taken out of the
    /// registry (a new process with the same labels gets another id) and returned, to have
    /// their kernel keys deleted and then be freed (`free`).
    pub fn retire_idle(
        &mut self,
        in_use: &BTreeSet<SeriesId>,
        now: Instant,
        retention: Duration,
    ) -> Vec<SeriesId> {
        let mut retired = Vec::new();
        for (i, labels) in self.labels.iter().enumerate() {
            let id = SeriesId(i as u32);
            let Some(labels) = labels.as_ref().filter(|l| !l.pod.is_empty()) else {
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
}

impl Tracked {
    /// Series `retired` had their kernel keys deleted by a map read: free their ids.
    pub fn free_retired(&mut self, retired: &BTreeSet<SeriesId>) {
        if retired.is_empty() {
            return;
        }
        self.registry.free(retired.iter().copied());
        self.provisional.retired.retain(|id| !retired.contains(id));
    }

    /// Retires the pod series no process has used for `retention` (see the module doc).
    pub fn retire_idle(&mut self, now: Instant, retention: Duration) -> Vec<SeriesId> {
        let in_use: BTreeSet<SeriesId> = self
            .pids
            .values()
            .copied()
            .chain(self.provisional.in_use())
            .collect();
        let retired = self.registry.retire_idle(&in_use, now, retention);
        self.provisional.retired.extend(retired.iter().copied());
        retired
    }
}

pub type SharedTracked = Arc<Mutex<Tracked>>;

/// The kernel's `TRACKED` (tgid → series) and `CHILD_SERIES` (series → its children start
/// provisional) maps.
pub struct KernelSeries {
    tracked: Array<MapData, SeriesId>,
    child: Array<MapData, SeriesId>,
}

/// Sized to `pid_max` by the loader.
pub const TRACKED_MAP: &str = "TRACKED";
const CHILD_SERIES_MAP: &str = "CHILD_SERIES";

impl KernelSeries {
    pub fn take(ebpf: &mut Ebpf) -> Result<KernelSeries> {
        Ok(KernelSeries {
            tracked: take_map(ebpf, TRACKED_MAP)?,
            child: take_map(ebpf, CHILD_SERIES_MAP)?,
        })
    }

    /// Fails for a pid above the map's size (`pid_max` raised after pgio started).
    pub fn set(&mut self, pid: u32, series: SeriesId) -> Result<(), MapError> {
        self.tracked.set(pid, series, 0)
    }

    pub fn clear(&mut self, pid: u32) {
        // Out of range cannot have been set.
        let _ = self.tracked.set(pid, SeriesId::UNTRACKED, 0);
    }

    /// Children of `parent` start in their own provisional series (`child` is their labels'
    /// series, nonzero). Ids past the array's end just keep inheriting the parent's series.
    pub fn set_children(&mut self, parent: SeriesId, child: SeriesId) {
        let _ = self.child.set(parent.0, child, 0);
    }
}

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
    fn idle_pod_series_retire_after_retention_and_their_ids_are_reused() {
        let mut r = SeriesRegistry::new();
        let host = r.intern(Labels::app_role("postgres", "checkpointer"));
        let a = r.intern(in_pod("checkpointer", "pg-0"));
        let b = r.intern(in_pod("walwriter", "pg-0"));
        let t0 = Instant::now();
        let keep = Duration::from_secs(300);
        let used = |ids: &[SeriesId]| ids.iter().copied().collect::<BTreeSet<_>>();
        assert!(
            r.retire_idle(&used(&[b]), t0, keep).is_empty(),
            "a: idle from t0"
        );
        assert!(r.retire_idle(&used(&[b]), t0 + keep / 2, keep).is_empty());
        // b was used at t0: its idle time starts now.
        assert_eq!(r.retire_idle(&used(&[]), t0 + keep, keep), vec![a]);
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
        assert_eq!(r.len(), 5);
        // b has been idle since t0 + keep; a2 and c only from now on. Host series never go.
        assert_eq!(r.retire_idle(&used(&[]), t0 + 3 * keep, keep), vec![b]);
        assert_eq!(r.retire_idle(&used(&[]), t0 + 9 * keep, keep), vec![c, a2]);
        assert!(r.labels(host).is_some());
        r.free([SeriesId::UNTRACKED, b, b]);
        assert_eq!(
            r.labels(SeriesId::UNTRACKED).map(|l| l.app.as_str()),
            Some("other")
        );
        assert_eq!(r.len(), 4);
    }
}
