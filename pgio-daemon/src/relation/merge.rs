//! Relation series whose labels come out the same are exported as one. A relation's
//! `database` replaces the process' (a checkpointer writes every database's tables), so two
//! series that differ only in `database` (an autovacuum worker before and after its title
//! names the database it vacuums) can name one label set: exporting both would repeat a
//! series in one scrape, and Prometheus keeps only one of them. Their sum is exported instead,
//! kept monotonic while any of them lives: a contributor that ends leaves its counts behind.
//! Once none is left, the label set ends too (nothing is kept for it).
use std::collections::HashMap;

use super::snapshot::RelationLabels;
use super::top::Exported;
use crate::hist::Log2Hist;

#[derive(Debug, Default)]
pub struct LabelMerge {
    /// Each contributor's histogram at the last scrape, and the label set it went to.
    last: HashMap<Exported, (RelationLabels, Log2Hist)>,
    /// Per label set, what its contributors that ended had shown.
    carry: HashMap<RelationLabels, Log2Hist>,
}

impl LabelMerge {
    /// One label set each: the sum of its contributors now, plus what those that ended showed.
    pub fn merge(
        &mut self,
        exported: Vec<(Exported, RelationLabels, Log2Hist)>,
    ) -> Vec<(RelationLabels, Log2Hist)> {
        let mut out: HashMap<RelationLabels, Log2Hist> = HashMap::new();
        let mut now = HashMap::with_capacity(exported.len());
        for (e, l, h) in exported {
            out.entry(l.clone()).or_default().merge(&h);
            now.insert(e, (l, h));
        }
        for (e, (l, h)) in self.last.drain() {
            if !now.contains_key(&e) {
                self.carry.entry(l).or_default().merge(&h);
            }
        }
        self.carry.retain(|l, _| out.contains_key(l));
        for (l, c) in &self.carry {
            if let Some(h) = out.get_mut(l) {
                h.merge(c);
            }
        }
        self.last = now;
        let mut out: Vec<_> = out.into_iter().collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }
}

#[cfg(test)]
mod tests {
    use pgio_common::{
        SeriesId,
        syscall::{Cache, Syscall},
    };

    use super::*;
    use crate::labels::Labels;

    fn labels() -> RelationLabels {
        RelationLabels {
            series: Labels {
                database: "shop".into(),
                ..Labels::app_role("postgres", "autovacuum worker")
            },
            relation: "public.orders".into(),
            kind: "table",
            syscall: Syscall::Pread64,
            cache: Cache::Hit,
        }
    }

    fn exported(series: u32) -> Exported {
        Exported {
            series: SeriesId(series),
            database: "shop".into(),
            relation: "public.orders".into(),
            kind: "table",
            syscall: Syscall::Pread64 as u8,
            cache: Cache::Hit as u8,
        }
    }

    fn hist(n: u64) -> Log2Hist {
        let mut h = Log2Hist::default();
        h.slots[10] = n;
        h.sum_ns = 1_000 * n;
        h
    }

    fn count(out: &[(RelationLabels, Log2Hist)]) -> Vec<u64> {
        out.iter().map(|(_, h)| h.slots[10]).collect()
    }

    #[test]
    fn one_label_set_once_its_sum_monotonic_until_none_is_left() {
        let mut m = LabelMerge::default();
        // Series 3 (no database yet) and 4 (the same process, titled): one label set.
        let out = m.merge(vec![
            (exported(3), labels(), hist(5)),
            (exported(4), labels(), hist(2)),
        ]);
        assert_eq!(count(&out), vec![7], "exported once, the sum");
        // Series 3 ends: what it showed stays.
        let out = m.merge(vec![(exported(4), labels(), hist(6))]);
        assert_eq!(count(&out), vec![11]);
        let out = m.merge(vec![(exported(4), labels(), hist(8))]);
        assert_eq!(count(&out), vec![13]);
        // Neither is left: the label set ends, and nothing is kept for it.
        assert!(m.merge(vec![]).is_empty());
        assert!(m.carry.is_empty() && m.last.is_empty());
    }
}
