//! Series registry: each distinct label set gets a small integer id, written into the kernel's
//! `tgid → series` map. Ids are never reused, so histograms keyed by series stay monotonic
//! when processes exit.
use std::collections::HashMap;

use pgio_common::SERIES_UNTRACKED;

use crate::labels::Labels;

#[derive(Debug)]
pub struct SeriesRegistry {
    ids: HashMap<Labels, u32>,
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
        ids.insert(untracked.clone(), SERIES_UNTRACKED);
        SeriesRegistry {
            ids,
            labels: vec![untracked],
        }
    }

    pub fn intern(&mut self, labels: Labels) -> u32 {
        if let Some(id) = self.ids.get(&labels) {
            return *id;
        }
        let id = self.labels.len() as u32;
        self.labels.push(labels.clone());
        self.ids.insert(labels, id);
        id
    }

    pub fn labels(&self, id: u32) -> Option<&Labels> {
        self.labels.get(id as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_labels_same_id_and_untracked_is_zero() {
        let mut r = SeriesRegistry::new();
        assert_eq!(
            r.labels(SERIES_UNTRACKED).map(|l| l.app.as_str()),
            Some("other")
        );
        let a = r.intern(Labels::app_role("postgres", "checkpointer"));
        let b = r.intern(Labels::app_role("postgres", "walwriter"));
        let a2 = r.intern(Labels::app_role("postgres", "checkpointer"));
        assert_eq!(a, 1);
        assert_eq!(b, 2);
        assert_eq!(a, a2);
        assert_eq!(r.labels(b).map(|l| l.role.as_str()), Some("walwriter"));
        assert_eq!(r.labels(3), None);
    }
}
