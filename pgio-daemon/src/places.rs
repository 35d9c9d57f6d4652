//! Who gets a series of their own where only a few may: per group (a cluster, a database),
//! the `max` members (relations, query ids) with the most IO time over the last
//! [`INTERVAL`]; the others are booked together as their group's `(rest)` by the family that
//! ranks them (`relation::top`, `query_id::places`), which also keeps its counters monotonic
//! across the moves. A hostile user with 100,000 tables or statements moves the places
//! around, never their number.
//!
//! Once an interval is over the places go again, to the members with the most IO time in it
//! (members first on a tie: no churn among idle ones). In between, a newcomer takes a free
//! place (`admit`); with `place`, also the place of the member with the least IO time since
//! the ranking if it had more: a member busy in this interval keeps its place until the next
//! ranking, places follow what is in use, and `(rest)` holds what more than `max` members did
//! at once. (Relations are placed so at each scrape; query ids, booked as deltas a row at a
//! time, only take free places between rankings: a displaced id's series would end.)
use std::{
    collections::{BTreeMap, HashMap, HashSet},
    hash::Hash,
    time::{Duration, Instant},
};

/// How often places are handed out again by IO time.
pub const INTERVAL: Duration = Duration::from_secs(60);

#[derive(Debug)]
pub struct Ranking<G, M> {
    max: usize,
    /// Members counted per interval on the whole node; past it, a new one waits for the next
    /// ranking (a flood of one-off members costs bounded memory).
    cap: usize,
    members: HashMap<G, HashSet<M>>,
    /// IO time (ns) per member since the last ranking.
    recent: HashMap<G, HashMap<M, u64>>,
    candidates: usize,
    ranked_at: Option<Instant>,
}

impl<G: Clone + Eq + Hash, M: Clone + Eq + Hash + Ord> Ranking<G, M> {
    pub fn new(max: usize, cap: usize) -> Ranking<G, M> {
        Ranking {
            max,
            cap,
            members: HashMap::new(),
            recent: HashMap::new(),
            candidates: 0,
            ranked_at: None,
        }
    }

    /// Counts `io_ns` of IO time of `member` in `group` (0 makes it a candidate).
    pub fn add(&mut self, group: &G, member: &M, io_ns: u64) {
        // Called for every relation at every scrape: no clone of a group already counted.
        if !self.recent.contains_key(group) {
            self.recent.insert(group.clone(), HashMap::new());
        }
        let Some(recent) = self.recent.get_mut(group) else {
            return;
        };
        match recent.get_mut(member) {
            Some(ns) => *ns = ns.saturating_add(io_ns),
            None if self.candidates < self.cap => {
                recent.insert(member.clone(), io_ns);
                self.candidates += 1;
            }
            None => {}
        }
    }

    /// Whether `member` has a place in `group`, taking a free one.
    pub fn admit(&mut self, group: &G, member: &M) -> bool {
        let members = self.members.entry(group.clone()).or_default();
        if members.contains(member) {
            return true;
        }
        if members.len() < self.max {
            members.insert(member.clone());
            return true;
        }
        false
    }

    /// Once an interval is over, hands the places out again (see the module doc): `true`
    /// when it did.
    pub fn rerank_if_due(&mut self, now: Instant) -> bool {
        let due = self
            .ranked_at
            .is_none_or(|at| now.saturating_duration_since(at) >= INTERVAL);
        if due {
            self.hand_out(true);
            self.ranked_at = Some(now);
            self.recent.clear();
            self.candidates = 0;
        }
        due
    }

    /// Hands out the places at `now`: anew once an interval is over, else to newcomers busier
    /// than the least busy member (see the module doc).
    pub fn place(&mut self, now: Instant) {
        if !self.rerank_if_due(now) {
            self.hand_out(false);
        }
    }

    /// A ranking of the members counted since the last one (`rerank`), or the places of the
    /// members kept but for newcomers busier than the least busy.
    fn hand_out(&mut self, rerank: bool) {
        let groups: HashSet<G> = self
            .recent
            .keys()
            .chain(self.members.keys())
            .cloned()
            .collect();
        let mut members = HashMap::new();
        for g in groups {
            let none = HashMap::new();
            let recent = self.recent.get(&g).unwrap_or(&none);
            let old = self.members.remove(&g).unwrap_or_default();
            let io = |m: &M| recent.get(m).copied().unwrap_or(0);
            let mut ranked: Vec<&M> = recent.keys().collect();
            if !rerank {
                ranked.extend(old.iter().filter(|m| !recent.contains_key(*m)));
            }
            // Most IO time first, members before others on a tie, then by key (stable).
            ranked.sort_by(|a, b| {
                io(b)
                    .cmp(&io(a))
                    .then(old.contains(*b).cmp(&old.contains(*a)))
                    .then(a.cmp(b))
            });
            let placed: HashSet<M> = if rerank {
                ranked.into_iter().take(self.max).cloned().collect()
            } else {
                let (mut kept, others): (Vec<&M>, Vec<&M>) =
                    ranked.into_iter().partition(|m| old.contains(*m));
                // `kept` stays busiest first, so its weakest is last.
                for m in others.into_iter().filter(|m| io(m) > 0) {
                    if kept.len() >= self.max {
                        if kept.last().is_some_and(|weakest| io(weakest) < io(m)) {
                            kept.pop();
                        } else {
                            break;
                        }
                    }
                    let at = kept.partition_point(|k| io(k) >= io(m));
                    kept.insert(at, m);
                }
                kept.into_iter().cloned().collect()
            };
            if !placed.is_empty() {
                members.insert(g, placed);
            }
        }
        self.members = members;
    }

    pub fn holds(&self, group: &G, member: &M) -> bool {
        self.members.get(group).is_some_and(|m| m.contains(member))
    }

    /// Drops the members and candidates `keep` refuses (gone since).
    pub fn retain(&mut self, keep: impl Fn(&G, &M) -> bool) {
        for (g, members) in &mut self.members {
            members.retain(|m| keep(g, m));
        }
        self.members.retain(|_, m| !m.is_empty());
        let mut dropped = 0;
        for (g, recent) in &mut self.recent {
            let before = recent.len();
            recent.retain(|m, _| keep(g, m));
            dropped += before - recent.len();
        }
        self.recent.retain(|_, r| !r.is_empty());
        self.candidates -= dropped.min(self.candidates);
    }

    /// Per group, the members counted since the last ranking that have no place.
    pub fn in_rest(&self) -> BTreeMap<G, usize>
    where
        G: Ord,
    {
        self.recent
            .iter()
            .map(|(g, recent)| {
                let n = recent.keys().filter(|m| !self.holds(g, m)).count();
                (g.clone(), n)
            })
            .filter(|(_, n)| *n > 0)
            .collect()
    }

    /// Members counted since the last ranking, on the whole node.
    pub fn candidates(&self) -> usize {
        self.candidates
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_ranking_goes_by_io_time_and_ties_keep_the_members() {
        let mut r: Ranking<&str, u32> = Ranking::new(2, usize::MAX);
        let t0 = Instant::now();
        r.add(&"g", &1, 10);
        r.add(&"g", &2, 30);
        r.add(&"g", &3, 20);
        assert!(r.rerank_if_due(t0));
        assert!(r.holds(&"g", &2) && r.holds(&"g", &3) && !r.holds(&"g", &1));
        assert!(!r.rerank_if_due(t0 + INTERVAL / 2));
        // A new interval in which all three had the same IO: the members keep their places.
        for m in [1, 2, 3] {
            r.add(&"g", &m, 5);
        }
        assert!(r.rerank_if_due(t0 + INTERVAL));
        assert!(r.holds(&"g", &2) && r.holds(&"g", &3));
        assert_eq!(r.in_rest().get("g"), None, "counted anew after a ranking");
        // One with no IO in an interval has no place after the next ranking.
        r.add(&"g", &2, 1);
        r.rerank_if_due(t0 + 2 * INTERVAL);
        assert!(r.holds(&"g", &2) && !r.holds(&"g", &3));
        // Between rankings a newcomer takes a free place, and only a free one.
        assert!(r.admit(&"g", &4));
        assert!(!r.admit(&"g", &5));
    }

    #[test]
    fn between_rankings_a_busier_newcomer_displaces_the_least_busy_member() {
        let mut r: Ranking<&str, u32> = Ranking::new(2, usize::MAX);
        let t0 = Instant::now();
        r.add(&"g", &1, 100);
        r.add(&"g", &2, 100);
        r.place(t0);
        let t = t0 + INTERVAL / 2;
        r.add(&"g", &1, 50);
        r.add(&"g", &2, 5);
        r.add(&"g", &3, 20);
        r.place(t);
        assert!(r.holds(&"g", &1) && r.holds(&"g", &3) && !r.holds(&"g", &2));
        // Not busier than the weakest member: stays out.
        r.add(&"g", &4, 19);
        r.place(t);
        assert!(!r.holds(&"g", &4));
        assert_eq!(r.in_rest().get("g"), Some(&2), "2 and 4");
    }

    #[test]
    fn a_flood_of_members_is_counted_up_to_the_cap_and_gone_ones_are_dropped() {
        let mut r: Ranking<&str, u32> = Ranking::new(3, 100);
        for m in 0..1_000 {
            r.add(&"g", &m, 1);
        }
        assert_eq!(r.candidates(), 100);
        r.place(Instant::now());
        assert_eq!(r.members.get("g").map(HashSet::len), Some(3));
        r.retain(|_, m| *m != 0);
        assert!(!r.holds(&"g", &0));
        assert!(r.holds(&"g", &1) && r.holds(&"g", &2));
    }
}
