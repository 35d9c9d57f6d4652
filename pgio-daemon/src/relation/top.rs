//! Which relations get series of their own: per cluster, the `max_relations` that `places`
//! ranks first by IO time; the others are booked together as `relation="(rest)"` of their
//! database.
//!
//! Counters stay monotonic across moves, and the sum over a database's relation series stays
//! the total: `(rest)` counts a relation's calls only while it has no place, and keeps them
//! when it gets one. A relation that loses its place keeps its own series, frozen at what it
//! showed (up to `max_relations` such series per cluster, the latest to lose their places),
//! and goes on from there if it gets a place again. One pushed out of those moves what it
//! showed into `(rest)`, and its own series ends; should it get a place after that, its
//! series starts again from 0 (after at least one scrape without it: a new series).
use std::{
    collections::{BTreeMap, BTreeSet, HashMap, HashSet},
    time::Instant,
};

use pgio_common::SeriesId;

use crate::{hist::Log2Hist, places::Ranking};

/// A relation as it is ranked and exported within its cluster.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Rank {
    pub cluster: String,
    pub database: String,
    pub relation: String,
    pub kind: &'static str,
    /// `(wal)`, `(temp)`, `(other)`: always its own series, never counted against the places.
    pub fixed: bool,
}

/// A series' histogram of one syscall and cache outcome on one relation (`id`: the kernel
/// key's own identity, stable while its counts grow).
pub struct Item<Id> {
    pub id: Id,
    pub series: SeriesId,
    pub syscall: u8,
    pub cache: u8,
    pub rank: Rank,
    pub hist: Log2Hist,
}

/// What is exported: a series' histogram of one syscall and cache outcome on one relation
/// (or on its database's `(rest)`).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Exported {
    pub series: SeriesId,
    pub database: String,
    pub relation: String,
    pub kind: &'static str,
    pub syscall: u8,
    pub cache: u8,
}

pub const REST: &str = "(rest)";

#[derive(Debug)]
struct Booked {
    own: bool,
    /// The `(rest)` it counts under (or would): its database's, named once the catalogs are
    /// read (`(oid N)` until then).
    rest: Exported,
    /// The kernel key's counts at its last move (to or from a place, or to another `(rest)`).
    base: Log2Hist,
    /// What its own series showed in its earlier periods with a place.
    shown: Log2Hist,
}

#[derive(Debug)]
pub struct Top<Id> {
    max: usize,
    /// Places per cluster.
    ranking: Ranking<String, Rank>,
    /// IO time (ns) per relation at the last scrape (a scrape's items are cumulative).
    last_totals: HashMap<Rank, u64>,
    booked: BTreeMap<Id, Booked>,
    /// What relations booked into `(rest)` before they got places of their own.
    frozen: BTreeMap<Exported, Log2Hist>,
    /// Relations without a place whose own series is kept frozen, with when they lost it.
    kept: HashMap<Rank, Instant>,
}

impl<Id: Clone + Ord> Top<Id> {
    pub fn new(max: usize) -> Top<Id> {
        Top {
            max,
            // Relations are bounded by the kernel's keys: no cap of candidates.
            ranking: Ranking::new(max, usize::MAX),
            last_totals: HashMap::new(),
            booked: BTreeMap::new(),
            frozen: BTreeMap::new(),
            kept: HashMap::new(),
        }
    }

    /// Whether `id` was booked at an earlier scrape: it is shown, so it is never left out of
    /// one again (its series would step back), also while its file waits for its name.
    pub fn shown(&self, id: &Id) -> bool {
        self.booked.contains_key(id)
    }

    /// Relations booked under `(rest)` now, per cluster.
    pub fn in_rest(&self, items: &[Item<Id>]) -> BTreeMap<String, usize> {
        let mut rest: HashMap<&str, HashSet<&Rank>> = HashMap::new();
        for i in items {
            if !i.rank.fixed && !self.holds(&i.rank) {
                rest.entry(&i.rank.cluster).or_default().insert(&i.rank);
            }
        }
        rest.into_iter()
            .map(|(c, r)| (c.to_owned(), r.len()))
            .collect()
    }

    /// Books this scrape's cumulative `items` (all of them: a key missing is gone) at `now`.
    pub fn book(&mut self, now: Instant, items: &[Item<Id>]) -> BTreeMap<Exported, Log2Hist> {
        self.place(now, items);
        let mut out: BTreeMap<Exported, Log2Hist> = BTreeMap::new();
        for i in items {
            let own = i.rank.fixed || self.holds(&i.rank);
            let rest = rest_of(i);
            let b = self.booked.entry(i.id.clone()).or_insert(Booked {
                own,
                rest: rest.clone(),
                base: Log2Hist::default(),
                shown: Log2Hist::default(),
            });
            // A move: to or from a place, or between two `(rest)` (its database named since).
            if b.own != own || (!own && b.rest != rest) {
                let since = minus(&i.hist, &b.base);
                if b.own {
                    // Its own series stops growing, kept at what it showed.
                    b.shown.merge(&since);
                    self.kept.entry(i.rank.clone()).or_insert(now);
                } else {
                    // What it booked into a `(rest)` stays there (that one would step back).
                    self.frozen.entry(b.rest.clone()).or_default().merge(&since);
                    self.kept.remove(&i.rank);
                }
                b.base = i.hist.clone();
                b.own = own;
            }
            b.rest = rest.clone();
            let mut h = minus(&i.hist, &b.base);
            if own {
                h.merge(&b.shown);
                out.entry(own_of(i)).or_default().merge(&h);
            } else {
                out.entry(rest).or_default().merge(&h);
                if b.shown != Log2Hist::default() {
                    out.entry(own_of(i)).or_default().merge(&b.shown);
                }
            }
        }
        self.release_kept(items, &mut out);
        let live: BTreeSet<&Id> = items.iter().map(|i| &i.id).collect();
        self.booked.retain(|id, _| live.contains(id));
        let series: HashSet<SeriesId> = items.iter().map(|i| i.series).collect();
        self.frozen.retain(|k, _| series.contains(&k.series));
        for (k, h) in &self.frozen {
            out.entry(k.clone()).or_default().merge(h);
        }
        out
    }

    /// Past `max` kept series in a cluster, those that lost their places first end: what
    /// they showed moves into their `(rest)`, their series stop.
    fn release_kept(&mut self, items: &[Item<Id>], out: &mut BTreeMap<Exported, Log2Hist>) {
        let live: HashSet<&Rank> = items.iter().map(|i| &i.rank).collect();
        self.kept.retain(|r, _| live.contains(r));
        let mut by_cluster: HashMap<&str, Vec<(&Rank, Instant)>> = HashMap::new();
        for (r, at) in &self.kept {
            by_cluster.entry(&r.cluster).or_default().push((r, *at));
        }
        let mut released: HashSet<Rank> = HashSet::new();
        for kept in by_cluster.values_mut() {
            if kept.len() > self.max {
                kept.sort_by(|a, b| a.1.cmp(&b.1).then(a.0.cmp(b.0)));
                let over = kept.len() - self.max;
                released.extend(kept.iter().take(over).map(|(r, _)| (*r).clone()));
            }
        }
        if released.is_empty() {
            return;
        }
        for i in items.iter().filter(|i| released.contains(&i.rank)) {
            let Some(b) = self.booked.get_mut(&i.id) else {
                continue;
            };
            if b.own || b.shown == Log2Hist::default() {
                continue;
            }
            let own = own_of(i);
            if let Some(h) = out.get_mut(&own) {
                *h = minus(h, &b.shown);
                if *h == Log2Hist::default() {
                    out.remove(&own);
                }
            }
            // Into (rest) in `out` too: `frozen` is added to it after this.
            self.frozen
                .entry(b.rest.clone())
                .or_default()
                .merge(&b.shown);
            b.shown = Log2Hist::default();
        }
        self.kept.retain(|r, _| !released.contains(r));
    }

    fn holds(&self, rank: &Rank) -> bool {
        self.ranking.holds(&rank.cluster, rank)
    }

    /// Counts each relation's IO time since the last scrape and hands out the places
    /// (`places`): fixed relations never take one.
    fn place(&mut self, now: Instant, items: &[Item<Id>]) {
        let mut totals: HashMap<Rank, u64> = HashMap::new();
        for i in items.iter().filter(|i| !i.rank.fixed) {
            *totals.entry(i.rank.clone()).or_default() += i.hist.sum_ns;
        }
        self.ranking.retain(|_, r| totals.contains_key(r));
        for (r, ns) in &totals {
            let last = self.last_totals.get(r).copied().unwrap_or(0);
            self.ranking.add(&r.cluster, r, ns.saturating_sub(last));
        }
        self.last_totals = totals;
        self.ranking.place(now);
    }
}

fn own_of<Id>(i: &Item<Id>) -> Exported {
    Exported {
        series: i.series,
        database: i.rank.database.clone(),
        relation: i.rank.relation.clone(),
        kind: i.rank.kind,
        syscall: i.syscall,
        cache: i.cache,
    }
}

fn rest_of<Id>(i: &Item<Id>) -> Exported {
    Exported {
        series: i.series,
        database: i.rank.database.clone(),
        relation: REST.to_owned(),
        kind: "",
        syscall: i.syscall,
        cache: i.cache,
    }
}

/// `h` less `base`, slot by slot (never below 0: a key the kernel recreated starts over).
fn minus(h: &Log2Hist, base: &Log2Hist) -> Log2Hist {
    let mut out = h.clone();
    for (a, b) in out.slots.iter_mut().zip(base.slots.iter()) {
        *a = a.saturating_sub(*b);
    }
    out.sum_ns = out.sum_ns.saturating_sub(base.sum_ns);
    out.bytes = out.bytes.saturating_sub(base.bytes);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::places::INTERVAL;
    use std::time::Duration;

    fn rank(relation: &str) -> Rank {
        Rank {
            cluster: "c".into(),
            database: "db".into(),
            relation: relation.into(),
            kind: "table",
            fixed: false,
        }
    }

    fn item(id: u32, relation: &str, calls: u64, ns: u64) -> Item<u32> {
        let mut hist = Log2Hist::default();
        hist.slots[10] = calls;
        hist.sum_ns = ns;
        Item {
            id,
            series: SeriesId(1),
            syscall: 0,
            cache: 0,
            rank: rank(relation),
            hist,
        }
    }

    fn calls(out: &BTreeMap<Exported, Log2Hist>, relation: &str) -> Option<u64> {
        out.iter()
            .find(|(k, _)| k.relation == relation)
            .map(|(_, h)| h.count())
    }

    #[test]
    fn a_database_named_while_in_rest_leaves_what_it_showed_there() {
        let mut top: Top<u32> = Top::new(1);
        let t0 = Instant::now();
        let mut unnamed = item(2, "b", 5, 50);
        unnamed.rank.database = "(oid 5)".into();
        let out = top.book(t0, &[item(1, "a", 10, 100), unnamed]);
        let rest = |out: &BTreeMap<Exported, Log2Hist>, db: &str| {
            out.iter()
                .find(|(k, _)| k.relation == REST && k.database == db)
                .map(|(_, h)| h.count())
        };
        assert_eq!(rest(&out, "(oid 5)"), Some(5));
        // The catalogs named its database (3 more calls meanwhile, booked where they were
        // shown), then 2 more; a keeps its place.
        let out = top.book(t0, &[item(1, "a", 20, 1_000), item(2, "b", 8, 80)]);
        assert_eq!(rest(&out, "(oid 5)"), Some(8), "never steps back");
        assert_eq!(rest(&out, "db"), Some(0));
        let out = top.book(t0, &[item(1, "a", 30, 2_000), item(2, "b", 10, 100)]);
        assert_eq!(rest(&out, "(oid 5)"), Some(8));
        assert_eq!(rest(&out, "db"), Some(2), "what came after");
        let total: u64 = out.values().map(Log2Hist::count).sum();
        assert_eq!(total, 40, "the sum stays the total");
    }

    #[test]
    fn places_go_by_recent_io_time_and_every_counter_stays_monotonic() {
        let mut top: Top<u32> = Top::new(2);
        let t0 = Instant::now();
        // Three relations, two places: the busiest two get them at the first ranking.
        let out = top.book(
            t0,
            &[
                item(1, "a", 10, 100),
                item(2, "b", 20, 200),
                item(3, "c", 5, 50),
            ],
        );
        assert_eq!(calls(&out, "a"), Some(10));
        assert_eq!(calls(&out, "b"), Some(20));
        assert_eq!(calls(&out, "c"), None);
        assert_eq!(calls(&out, REST), Some(5));
        // c does IO, a and b none since the ranking: c takes the place of the member with
        // the least IO time since (a tie: the last by name, b). What c booked into (rest)
        // stays there; b's own series is kept at its 20 calls.
        let t1 = t0 + INTERVAL / 2;
        let out = top.book(
            t1,
            &[
                item(1, "a", 10, 100),
                item(2, "b", 20, 200),
                item(3, "c", 50, 5_000),
            ],
        );
        assert_eq!(calls(&out, "c"), Some(0));
        assert_eq!(calls(&out, "a"), Some(10));
        assert_eq!(calls(&out, "b"), Some(20));
        assert_eq!(calls(&out, REST), Some(50));
        assert_eq!(
            top.in_rest(&[item(2, "b", 20, 200)]).get("c"),
            Some(&1),
            "b in (rest) of cluster c"
        );
        // b's 20 ns since the ranking do not beat a's 40: nobody moves, b's IO goes to (rest).
        let out = top.book(
            t1 + Duration::from_secs(1),
            &[
                item(1, "a", 14, 140),
                item(2, "b", 22, 220),
                item(3, "c", 57, 5_700),
            ],
        );
        assert_eq!((calls(&out, "a"), calls(&out, "c")), (Some(14), Some(7)));
        assert_eq!((calls(&out, "b"), calls(&out, REST)), (Some(20), Some(52)));
        // The next ranking goes by the interval's IO time: c 5,650 ns and a 40 keep theirs.
        let out = top.book(
            t0 + INTERVAL,
            &[
                item(1, "a", 14, 140),
                item(2, "b", 22, 220),
                item(3, "c", 58, 5_800),
            ],
        );
        assert_eq!((calls(&out, "a"), calls(&out, "c")), (Some(14), Some(8)));
        assert_eq!(calls(&out, REST), Some(52));
        // A relation gone frees its place for the next one with IO at once; what b booked
        // into (rest) stays there, and its own series goes on from the 20 it showed: the
        // sum counts each call once.
        let out = top.book(
            t0 + INTERVAL + Duration::from_secs(1),
            &[item(1, "a", 14, 140), item(2, "b", 23, 230)],
        );
        assert_eq!(calls(&out, "b"), Some(20));
        assert_eq!(calls(&out, REST), Some(53));
    }

    #[test]
    fn a_relation_busy_in_this_interval_keeps_its_place_against_small_newcomers() {
        let mut top: Top<u32> = Top::new(1);
        let t0 = Instant::now();
        top.book(t0, &[item(1, "big", 1, 1)]);
        // big scans for 1 s after the ranking, then is idle; small does a little IO later.
        let t1 = t0 + Duration::from_secs(1);
        top.book(
            t1,
            &[item(1, "big", 1000, 1_000_000), item(2, "small", 1, 10)],
        );
        let out = top.book(
            t1 + Duration::from_secs(20),
            &[item(1, "big", 1000, 1_000_000), item(2, "small", 5, 50)],
        );
        assert_eq!(calls(&out, "big"), Some(1000));
        assert_eq!(calls(&out, "small"), None);
        assert_eq!(calls(&out, REST), Some(5));
    }

    #[test]
    fn newcomers_fill_free_places_and_then_displace_the_least_busy_member() {
        let mut top: Top<u32> = Top::new(3);
        let t0 = Instant::now();
        top.book(t0, &[item(1, "a", 1, 1_000)]);
        // Between rankings: a did 5 ns since; x (100), y (50) take the free places, z (20)
        // takes a's, w (1) none.
        let out = top.book(
            t0 + Duration::from_secs(1),
            &[
                item(1, "a", 2, 1_005),
                item(2, "x", 1, 100),
                item(3, "y", 1, 50),
                item(4, "z", 1, 20),
                item(5, "w", 1, 1),
            ],
        );
        for r in ["x", "y", "z"] {
            assert_eq!(calls(&out, r), Some(1), "{r}");
        }
        assert_eq!(
            (calls(&out, "a"), calls(&out, "w")),
            (Some(2), None),
            "a's series kept at what it showed"
        );
        assert_eq!(calls(&out, REST), Some(1), "w's call");
        // Past 3 kept series (the places' number), the first to lose its place ends: what it
        // showed moves into (rest). x, y, z lose theirs to p, q, r.
        let t2 = t0 + Duration::from_secs(2);
        let mut items = vec![
            item(1, "a", 2, 1_005),
            item(2, "x", 1, 100),
            item(3, "y", 1, 50),
            item(4, "z", 1, 20),
            item(5, "w", 1, 1),
        ];
        items.extend([
            item(6, "p", 1, 500),
            item(7, "q", 1, 400),
            item(8, "r", 1, 300),
        ]);
        let out = top.book(t2, &items);
        assert_eq!(calls(&out, "a"), None, "released");
        for r in ["x", "y", "z"] {
            assert_eq!(calls(&out, r), Some(1), "{r} kept");
        }
        assert_eq!(calls(&out, REST), Some(3), "w's call and a's two");
        let total: u64 = out.values().map(Log2Hist::count).sum();
        assert_eq!(total, 9, "each call once");
    }

    #[test]
    fn fixed_relations_never_take_a_place() {
        let mut top: Top<u32> = Top::new(1);
        let mut wal = item(9, "(wal)", 3, 30);
        wal.rank.fixed = true;
        let out = top.book(Instant::now(), &[wal, item(1, "a", 1, 10)]);
        assert_eq!(calls(&out, "(wal)"), Some(3));
        assert_eq!(calls(&out, "a"), Some(1));
    }
}
