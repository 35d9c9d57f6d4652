//! Which query ids get series of their own: per (cluster, database), the `max` ids that
//! `places` ranks first by IO time (until the places are taken, any id that shows up). The
//! other ids' queries are booked together as `queryid="(rest)"` of their series.
//!
//! Counts arrive as deltas (the kernel rows of one epoch), so every exported counter is
//! monotonic: an id's own series starts from zero when it first gets its place (what it
//! booked into `(rest)` before stays there), and when it loses the place its series ends and
//! what it showed moves into `(rest)` (the sum over ids stays the total). An id that gets a
//! place back within the next interval goes on from what its series showed (from 0 it would
//! read as a counter reset); from then on that amount is in both.
use std::{
    collections::{BTreeMap, HashMap},
    time::Instant,
};

use pgio_common::{SeriesId, query_wait::PARTS};

use crate::{hist::Log2Hist, places::Ranking};

/// Ids ranked per interval on the whole node; past it, a new id goes to `(rest)` until the
/// next ranking (a flood of one-off statements costs bounded memory).
pub const MAX_CANDIDATES: usize = 10_000;

/// What a series' queries are booked under.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Qid {
    /// `pg_stat_activity.query_id`.
    Id(u64),
    /// The backend showed no id.
    None,
    /// pgio could not read it.
    Unknown,
    /// The other ids of its database (past `max_query_ids`, or refused by the kernel map).
    Rest,
}

impl Qid {
    /// The `queryid` label: the id as `pg_stat_statements.queryid` shows it (a signed bigint).
    pub fn label(self) -> String {
        match self {
            Qid::Id(id) => (id as i64).to_string(),
            Qid::None => "(none)".into(),
            Qid::Unknown => "(unknown)".into(),
            Qid::Rest => "(rest)".into(),
        }
    }
}

/// A series' queries under one id: durations, IO times, and the reads that missed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    pub duration: Log2Hist,
    pub io: Log2Hist,
    pub miss_ns: u64,
    pub misses: u64,
    /// The queries' time per `query_wait::Part` (ns).
    pub parts_ns: [u64; PARTS],
}

impl Counts {
    pub fn merge(&mut self, o: &Counts) {
        self.duration.merge(&o.duration);
        self.io.merge(&o.io);
        self.miss_ns = self.miss_ns.wrapping_add(o.miss_ns);
        self.misses = self.misses.wrapping_add(o.misses);
        for (a, b) in self.parts_ns.iter_mut().zip(&o.parts_ns) {
            *a = a.wrapping_add(*b);
        }
    }
}

/// The group an id is ranked in: its series' cluster and database.
pub type Group = (String, String);

#[derive(Debug)]
pub struct Places {
    max: usize,
    ranking: Ranking<Group, u64>,
    /// What is exported: cumulative since each key began.
    pub exported: BTreeMap<(SeriesId, Qid), Counts>,
    /// What the series of ids that lost their place showed, and the ranking they lost it in
    /// (kept one interval more; at most the ids exported).
    ended: HashMap<(SeriesId, u64), (Counts, u64)>,
    /// Rankings so far.
    rankings: u64,
}

impl Places {
    pub fn new(max: usize) -> Places {
        Places {
            max,
            ranking: Ranking::new(max, MAX_CANDIDATES),
            exported: BTreeMap::new(),
            ended: HashMap::new(),
            rankings: 0,
        }
    }

    /// Books one delta of `series` (in `group`) under `qid` at `now`.
    pub fn book(&mut self, now: Instant, series: SeriesId, group: &Group, qid: Qid, d: &Counts) {
        if self.ranking.rerank_if_due(now) {
            // Ids that lost their place in the ranking before the last may not go on.
            self.rankings += 1;
            let rankings = self.rankings;
            self.ended.retain(|_, (_, at)| *at + 1 >= rankings);
        }
        let key = match qid {
            Qid::Id(id) => {
                self.ranking.add(group, &id, d.io.sum_ns);
                if self.max > 0 && self.ranking.admit(group, &id) {
                    Qid::Id(id)
                } else {
                    Qid::Rest
                }
            }
            other => other,
        };
        let ended = &mut self.ended;
        self.exported
            .entry((series, key))
            .or_insert_with(|| match key {
                Qid::Id(id) => ended
                    .remove(&(series, id))
                    .map(|(c, _)| c)
                    .unwrap_or_default(),
                _ => Counts::default(),
            })
            .merge(d);
    }

    /// Ends the series of ids without a place (after a ranking), moving what they showed into
    /// their series' `(rest)` (the sum over ids stays the total), and of series gone.
    pub fn retain(&mut self, group_of: impl Fn(SeriesId) -> Option<Group>) {
        let ranking = &self.ranking;
        let mut moved: Vec<(SeriesId, u64, Counts)> = Vec::new();
        self.exported.retain(|(series, qid), counts| {
            let Some(group) = group_of(*series) else {
                return false;
            };
            match qid {
                Qid::Id(id) if !ranking.holds(&group, id) => {
                    moved.push((*series, *id, std::mem::take(counts)));
                    false
                }
                _ => true,
            }
        });
        for (series, id, counts) in moved {
            self.exported
                .entry((series, Qid::Rest))
                .or_default()
                .merge(&counts);
            self.ended.insert((series, id), (counts, self.rankings));
        }
        self.ended
            .retain(|(series, _), _| group_of(*series).is_some());
    }

    /// Ids of each group that had IO in this interval but no place.
    pub fn in_rest(&self) -> BTreeMap<Group, usize> {
        self.ranking.in_rest()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::places::INTERVAL;

    fn counts(queries: u64, io_ns: u64) -> Counts {
        let mut c = Counts::default();
        c.duration.slots[20] = queries;
        c.duration.sum_ns = queries * 1_000_000;
        c.io.slots[15] = queries;
        c.io.sum_ns = io_ns;
        c
    }

    fn queries(p: &Places, qid: Qid) -> Option<u64> {
        p.exported
            .iter()
            .filter(|((_, q), _)| *q == qid)
            .map(|(_, c)| c.duration.count())
            .reduce(|a, b| a + b)
    }

    #[test]
    fn the_busiest_ids_keep_places_and_the_rest_is_booked_together() {
        let g: Group = ("c".into(), "db".into());
        let s = SeriesId(3);
        let mut p = Places::new(2);
        let t0 = Instant::now();
        // Two places: the first two ids take them, the third goes to (rest).
        p.book(t0, s, &g, Qid::Id(1), &counts(1, 10));
        p.book(t0, s, &g, Qid::Id(2), &counts(1, 20));
        p.book(t0, s, &g, Qid::Id(3), &counts(5, 5_000));
        p.book(t0, s, &g, Qid::None, &counts(7, 0));
        assert_eq!(queries(&p, Qid::Id(1)), Some(1));
        assert_eq!(queries(&p, Qid::Id(3)), None);
        assert_eq!(queries(&p, Qid::Rest), Some(5));
        assert_eq!(queries(&p, Qid::None), Some(7), "never ranked");
        assert_eq!(p.in_rest().get(&g), Some(&1));
        // The next ranking goes by the interval's IO time: 3 (5,000 ns) and 2 (20) keep
        // places, 1 loses its own series (its query moves into (rest)); what 3 booked into
        // (rest) stays there.
        let t1 = t0 + INTERVAL;
        p.book(t1, s, &g, Qid::Id(3), &counts(2, 100));
        p.retain(|_| Some(g.clone()));
        assert_eq!(queries(&p, Qid::Id(3)), Some(2));
        assert_eq!(queries(&p, Qid::Id(1)), None);
        assert_eq!(
            queries(&p, Qid::Rest),
            Some(6),
            "1's query moved there with its place"
        );
        p.book(t1, s, &g, Qid::Id(1), &counts(1, 1));
        assert_eq!(
            queries(&p, Qid::Rest),
            Some(7),
            "1 has no place until the next ranking"
        );
        // At the next ranking 1 (busy since) gets a place back: its series goes on from the
        // query it showed (from 0 it would read as a counter reset).
        let t2 = t1 + INTERVAL;
        p.book(t2, s, &g, Qid::Id(1), &counts(9, 90_000));
        assert_eq!(queries(&p, Qid::Id(1)), Some(10));
        // A series gone ends all its keys.
        p.retain(|_| None);
        assert!(p.exported.is_empty());
        assert!(p.ended.is_empty());
    }

    #[test]
    fn a_flood_of_ids_costs_bounded_memory() {
        let g: Group = ("c".into(), "db".into());
        let mut p = Places::new(20);
        let t0 = Instant::now();
        for id in 0..(MAX_CANDIDATES as u64 * 3) {
            p.book(t0, SeriesId(1), &g, Qid::Id(id), &counts(1, 1));
        }
        assert_eq!(p.exported.len(), 21, "20 places and (rest)");
        assert_eq!(p.ranking.candidates(), MAX_CANDIDATES);
        assert_eq!(queries(&p, Qid::Rest), Some(MAX_CANDIDATES as u64 * 3 - 20));
    }
}
