//! Series registry: each distinct label set gets a small integer id, written into the kernel's
//! `tgid → series` map. Ids are never reused, so histograms keyed by series stay monotonic
//! when processes exit. `Tracked` is what discovery keeps current and every scrape reads.
use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
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
    labels: Vec<Labels>,
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
            labels: vec![untracked],
        }
    }

    pub fn intern(&mut self, labels: Labels) -> SeriesId {
        if let Some(id) = self.ids.get(&labels) {
            return *id;
        }
        let id = SeriesId(self.labels.len() as u32);
        self.labels.push(labels.clone());
        self.ids.insert(labels, id);
        id
    }

    pub fn labels(&self, id: SeriesId) -> Option<&Labels> {
        self.labels.get(id.0 as usize)
    }

    /// The labels a series is exported with: an id pgio never gave out (it cannot happen, but
    /// a sample must not be lost) counts as untracked.
    pub fn exported(&self, id: SeriesId) -> &Labels {
        self.labels(id).unwrap_or(&self.labels[0])
    }
}

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
}
