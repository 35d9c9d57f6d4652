//! What a scrape serves of the relation rows: never less than was shown, per histogram, and
//! exact in sum. The kernel moves counts between files of one (series, syscall, cache) group
//! and only there: a fold whose `RELATION_HIST` key is refused puts a slot's rows under the
//! group's `(rest)` file, not under their own. So a file's read value can go down while the
//! group's total does not. Per group:
//!
//! - each file is served `max(read, shown)`, bucket by bucket;
//! - the group's `(rest)` is served what the group read in all, less what its files are
//!   served (and never less than it showed).
//!
//! A file's served value grows by at most what its read value grew, and a file's read value
//! goes down only by what moved into `(rest)`; so the served `(rest)` never goes down either,
//! and the group's served total is its read total. (A view read while counts were in flight
//! could break the second premise; `slots::Slots::read_with` reads only views with no fold
//! meanwhile, and the `max` with what was shown still holds every series up.)
use std::collections::HashMap;

use pgio_common::relation::RelFile;

use super::RelationId;
use crate::{hist::Hists, log2_hist::Log2Hist};

/// `view` raised per file to `shown`, its `(rest)` files what is left of each group's total.
pub fn at_least_shown(view: Hists<RelationId>, shown: &Hists<RelationId>) -> Hists<RelationId> {
    type Group = (
        pgio_common::SeriesId,
        pgio_common::syscall::Syscall,
        pgio_common::syscall::Cache,
    );
    let group = |id: &RelationId| (id.series, id.syscall, id.cache);
    let mut totals: HashMap<Group, Log2Hist> = HashMap::new();
    for (id, h) in &view {
        totals.entry(group(id)).or_default().merge(h);
    }
    let mut served = view;
    // Files shown before and not read now keep what they showed (their counts are in the
    // group's total under another file).
    for (id, h) in shown {
        if id.file != RelFile::REST && totals.contains_key(&group(id)) {
            served.entry(*id).or_insert_with(|| h.clone());
        }
    }
    let mut files: HashMap<Group, Log2Hist> = HashMap::new();
    for (id, h) in served.iter_mut() {
        if id.file == RelFile::REST {
            continue;
        }
        if let Some(s) = shown.get(id) {
            raise(h, s);
        }
        files.entry(group(id)).or_default().merge(h);
    }
    for (g, total) in totals {
        let id = RelationId {
            series: g.0,
            file: RelFile::REST,
            syscall: g.1,
            cache: g.2,
        };
        let mut rest = less(&total, files.get(&g));
        if let Some(s) = shown.get(&id) {
            raise(&mut rest, s);
        }
        if rest != Log2Hist::default() || served.contains_key(&id) {
            served.insert(id, rest);
        }
    }
    served
}

/// `h` raised to `floor`, bucket by bucket.
fn raise(h: &mut Log2Hist, floor: &Log2Hist) {
    for (a, b) in h.slots.iter_mut().zip(&floor.slots) {
        *a = (*a).max(*b);
    }
    h.sum_ns = h.sum_ns.max(floor.sum_ns);
    h.bytes = h.bytes.max(floor.bytes);
}

/// `total` less `part`, bucket by bucket, at least 0.
fn less(total: &Log2Hist, part: Option<&Log2Hist>) -> Log2Hist {
    let mut out = total.clone();
    if let Some(p) = part {
        for (a, b) in out.slots.iter_mut().zip(&p.slots) {
            *a = a.saturating_sub(*b);
        }
        out.sum_ns = out.sum_ns.saturating_sub(p.sum_ns);
        out.bytes = out.bytes.saturating_sub(p.bytes);
    }
    out
}

#[cfg(test)]
mod tests {
    use pgio_common::{
        SeriesId,
        relation::Fork,
        syscall::{Cache, Syscall},
    };

    use super::*;

    fn id(file: RelFile) -> RelationId {
        RelationId {
            series: SeriesId(7),
            file,
            syscall: Syscall::Pread64,
            cache: Cache::Miss,
        }
    }

    fn hist(count: u64) -> Log2Hist {
        let mut h = Log2Hist::default();
        h.slots[12] = count;
        h.sum_ns = count * 3_000;
        h.bytes = count * 8_192;
        h
    }

    fn file(n: u32) -> RelFile {
        RelFile::relation(1663, 5, n, Fork::Main)
    }

    fn count(v: &Hists<RelationId>, f: RelFile) -> u64 {
        v.get(&id(f)).map_or(0, Log2Hist::count)
    }

    #[test]
    fn a_file_whose_rows_moved_into_rest_keeps_what_it_showed_and_rest_takes_the_new() {
        let shown: Hists<RelationId> = [(id(file(1)), hist(46)), (id(RelFile::REST), hist(10))]
            .into_iter()
            .collect();
        // The kernel's fold found no key for file 1: 6 of its 46 calls now under (rest), and
        // 3 new calls on file 1 since.
        let view: Hists<RelationId> = [(id(file(1)), hist(43)), (id(RelFile::REST), hist(16))]
            .into_iter()
            .collect();
        let served = at_least_shown(view, &shown);
        assert_eq!(count(&served, file(1)), 46, "never below what it showed");
        assert_eq!(
            count(&served, RelFile::REST),
            13,
            "the group's 59 calls, less the 46 served to file 1"
        );
        // Then file 1 grows past what it showed: it goes on, (rest) stays.
        let view: Hists<RelationId> = [(id(file(1)), hist(50)), (id(RelFile::REST), hist(16))]
            .into_iter()
            .collect();
        let again = at_least_shown(view, &served);
        assert_eq!(count(&again, file(1)), 50);
        assert_eq!(count(&again, RelFile::REST), 16);
    }

    #[test]
    fn a_file_gone_from_the_view_stays_and_its_group_total_holds() {
        let shown: Hists<RelationId> = [(id(file(1)), hist(20)), (id(file(2)), hist(5))]
            .into_iter()
            .collect();
        // File 1's 20 calls all moved into (rest), file 2 did 1 more.
        let view: Hists<RelationId> = [(id(file(2)), hist(6)), (id(RelFile::REST), hist(20))]
            .into_iter()
            .collect();
        let served = at_least_shown(view, &shown);
        assert_eq!(count(&served, file(1)), 20);
        assert_eq!(count(&served, file(2)), 6);
        assert_eq!(count(&served, RelFile::REST), 0);
        let total: u64 = served.values().map(Log2Hist::count).sum();
        assert_eq!(total, 26, "the group's read total");
    }

    #[test]
    fn a_series_no_longer_read_is_not_served() {
        let shown: Hists<RelationId> = [(id(file(1)), hist(20))].into_iter().collect();
        assert!(at_least_shown(Hists::new(), &shown).is_empty());
    }

    #[test]
    fn nothing_moved_serves_the_view_as_read() {
        let view: Hists<RelationId> = [
            (id(file(1)), hist(3)),
            (id(file(2)), hist(4)),
            (id(RelFile::REST), hist(5)),
        ]
        .into_iter()
        .collect();
        assert_eq!(at_least_shown(view.clone(), &Hists::new()), view);
        let shown = view.clone();
        assert_eq!(at_least_shown(view.clone(), &shown), view);
    }
}
