//! Provisional series of freshly forked processes. A postmaster's child runs in its own
//! kernel series `PROVISIONAL | tgid` until pgio has read its title (a millisecond or so).
//! Its events are held back while that lasts; once the child is classified, a scrape shows
//! them under the series it was classified as, and the once-a-second pass
//! (`collector::Collector::pass`) folds them into that series and deletes them from the kernel
//! map, every second while the closed entry lasts (a late block completion recreates its
//! key). A child
//! that exits unclassified has its events folded into its cluster's `role="starting"` series.
//! So connection churn books no event under a wrong series, and every exported series stays
//! monotonic (showing events under `starting` first and moving them later would not).
use std::{
    collections::{BTreeSet, HashMap},
    time::{Duration, Instant},
};

use pgio_common::SeriesId;

/// The longest a closed entry is kept: block requests submitted while provisional can complete
/// (and recreate their key) after the process was classified. Below it, the entry goes once
/// such a request can no longer complete under its key (`grace`).
const GRACE_MAX: Duration = Duration::from_secs(30);

/// How long a closed entry is kept, for a block family that counts a request in flight longer
/// than `inflight_timeout` as lost and forgets it within `sweep_every` after that: its late
/// completion is `unmatched` then, under no series. The timeout counts from the request's
/// issue, so one that waited in the queue for longer than the grace can still complete under
/// its provisional key after it (seconds in a scheduler's queue: rare). Capped at `GRACE_MAX`
/// (the default timeout, 180 s, would hold every `pgbench -C` connection's entry 6× longer).
/// A request that completes after the grace leaves its key pending until the key quota
/// evicts it.
pub fn grace(inflight_timeout: Duration, sweep_every: Duration) -> Duration {
    (inflight_timeout + sweep_every).min(GRACE_MAX)
}

/// How long a provisional series' keys stay in the kernel map after the kernel stopped
/// booking under it: a program that read the series just before the switch (or a request
/// submitted under it) may still add to a key, and an add between the fold's read of the key
/// and its delete would be lost. Scrapes count the keys under their target meanwhile. Short:
/// those programs run for microseconds, and every provisional key left in a map counts
/// against the provisional owner's share (`pgbench -C` makes hundreds a second).
const SETTLE: Duration = Duration::from_millis(100);

/// The longest the events of a process that exited unclassified are held back for its
/// title, which the kernel sent before the exit and discovery may read after it
/// (`classified_late`). They wait until discovery has drained the lifecycle ring after the
/// close (the title, sent earlier, has been read by then: see `ring_drained`), or this long
/// if it has not (the ring reader stuck). Then they go to the fallback for good: once shown
/// under one series, counts never move to another (its counters would step back). With a
/// fixed 2 s, a loaded node's discovery could read the title later than that: the likely
/// way CI's `pgbench -C` lost one query of 200 from its client backend series.
const LATE_TITLE: Duration = Duration::from_secs(10);

#[derive(Clone, Debug, Default)]
pub struct Provisional {
    entries: HashMap<u32, Entry>,
    /// Fallback series of a provisional process whose parent is not known (the cluster-less
    /// `starting` series).
    pub orphan: SeriesId,
    /// Retired series (see `series`): the next map read deletes their keys, then they are
    /// freed. Not provisional, but routed the same way: by the reader, at a map read.
    pub retired: BTreeSet<SeriesId>,
    /// Each series id's generation, moved on when the id is freed: the kernel's dense rows
    /// (`syscall`'s, `relation`'s fd slots) are tagged with it, so a row of a freed id is
    /// stale, never counted under the labels the id is given next (`SYSCALL_ROW_GEN` holds
    /// the kernel's copy).
    generations: Vec<u32>,
    /// When discovery last found the lifecycle ring empty, set once it has handled what it
    /// read: every event the kernel sent before then has been handled.
    ring_drained: Option<Instant>,
    /// How long closed entries are kept (`grace`); `GRACE_MAX` until set.
    pub grace: Option<Duration>,
}

impl Entry {
    /// Closed unclassified, and its title may still be in the ring: not drained since the
    /// close, and less than `LATE_TITLE` ago. Its events wait for it.
    fn holds_back(&self, now: Instant, ring_drained: Option<Instant>) -> bool {
        self.target.is_none()
            && !self.exit_seen
            && self.closed_at.is_some_and(|t| {
                ring_drained.is_none_or(|d| d <= t) && now.saturating_duration_since(t) < LATE_TITLE
            })
    }
}

#[derive(Clone, Debug)]
struct Entry {
    /// The cluster's `starting` series.
    fallback: SeriesId,
    /// The series the process was classified as.
    target: Option<SeriesId>,
    /// When the kernel stopped booking events under the provisional series.
    closed_at: Option<Instant>,
    /// Its exit came through the lifecycle ring, after any title the kernel sent for it.
    exit_seen: bool,
}

/// Where a histogram key's series goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    /// An ordinary series.
    Own,
    /// A provisional series still in use: not exported yet, left in the map.
    Pending,
    /// A provisional series no longer in use: move into this series, delete from the map.
    Fold(SeriesId),
    /// A retired series: delete from the map, export nothing.
    Retired,
}

impl Provisional {
    pub fn forked(&mut self, pid: u32, fallback: SeriesId) {
        self.entries.insert(
            pid,
            Entry {
                fallback,
                target: None,
                closed_at: None,
                exit_seen: false,
            },
        );
    }

    /// Is `pid` still running under its provisional series in the kernel?
    pub fn is_open(&self, pid: u32) -> bool {
        self.entries
            .get(&pid)
            .is_some_and(|e| e.closed_at.is_none())
    }

    /// The kernel now books `pid` under `series`.
    pub fn resolved(&mut self, pid: u32, series: SeriesId) {
        if let Some(e) = self.entries.get_mut(&pid).filter(|e| e.closed_at.is_none()) {
            e.target = Some(series);
            e.closed_at = Some(Instant::now());
        }
    }

    /// The `starting` series `pid` was forked into.
    pub fn fallback(&self, pid: u32) -> Option<SeriesId> {
        self.entries.get(&pid).map(|e| e.fallback)
    }

    /// Whether a title for `pid` still matters: it is open, or it was closed (exited, or
    /// found exiting by a /proc read) before it was classified.
    pub fn wants_title(&self, pid: u32) -> bool {
        self.entries.get(&pid).is_some_and(|e| e.target.is_none())
    }

    /// The title of a process that was closed unclassified arrived late (the ring buffer is
    /// read after a scheduled /proc look that found it exiting): its events go to `series`,
    /// if they are still held back (`LATE_TITLE`).
    pub fn classified_late(&mut self, pid: u32, series: SeriesId) {
        let now = Instant::now();
        if let Some(e) = self
            .entries
            .get_mut(&pid)
            .filter(|e| e.target.is_none() && e.holds_back(now, self.ring_drained))
        {
            e.target = Some(series);
        }
    }

    /// The kernel's exit event for `pid` was handled: closed, and no title can follow it.
    pub fn exited(&mut self, pid: u32) {
        self.closed(pid);
        if let Some(e) = self.entries.get_mut(&pid) {
            e.exit_seen = true;
        }
    }

    /// Discovery found the lifecycle ring empty at `at` and has handled every event it read
    /// before: a title the kernel sent before `at` is known.
    pub fn ring_drained(&mut self, at: Instant) {
        self.ring_drained = Some(at);
    }

    /// `pid` exited or stopped being tracked before it was classified: its events stay
    /// `starting`.
    pub fn closed(&mut self, pid: u32) {
        if let Some(e) = self.entries.get_mut(&pid).filter(|e| e.closed_at.is_none()) {
            e.closed_at = Some(Instant::now());
        }
    }

    /// Whether closed entries are kept (for the grace): their keys, also those a late event
    /// made after the last fold, are for the fold pass to move.
    pub fn has_closed(&self) -> bool {
        self.entries.values().any(|e| e.closed_at.is_some())
    }

    pub fn route(&self, series: SeriesId) -> Route {
        self.route_at(series, Instant::now())
    }

    /// `route` as of `now`.
    pub fn route_at(&self, series: SeriesId, now: Instant) -> Route {
        if !series.is_provisional() {
            return if self.retired.contains(&series) {
                Route::Retired
            } else {
                Route::Own
            };
        }
        match self.entries.get(&series.provisional_tgid()) {
            Some(e) if e.closed_at.is_none() => Route::Pending,
            Some(e) => match e.target {
                Some(target) => Route::Fold(target),
                // Exited unclassified: its title may still come (`classified_late`).
                None if e.holds_back(now, self.ring_drained) => Route::Pending,
                None => Route::Fold(e.fallback),
            },
            // The fork event has not been handled yet (the kernel writes keys first), or,
            // rarely, a request completing after the entry expired: not ours to move yet.
            None => Route::Pending,
        }
    }

    /// Whether the keys of provisional `series` may still be added to (closed less than
    /// `SETTLE` before `now`): the fold pass leaves them in the map until then.
    pub fn settling(&self, series: SeriesId, now: Instant) -> bool {
        series.is_provisional()
            && self
                .entries
                .get(&series.provisional_tgid())
                .and_then(|e| e.closed_at)
                .is_some_and(|t| now.saturating_duration_since(t) < SETTLE)
    }

    /// The generation series id `series` has now.
    pub fn generation(&self, series: SeriesId) -> u32 {
        self.generations
            .get(series.0 as usize)
            .copied()
            .unwrap_or(0)
    }

    /// `series` is freed: its rows go stale (the kernel's copy was moved on by the map pass).
    pub fn next_generation(&mut self, series: SeriesId) {
        let i = series.0 as usize;
        if series.0 >= pgio_common::CHILD_SERIES_MAX {
            return; // provisional ids have no rows
        }
        if self.generations.len() <= i {
            self.generations.resize(i + 1, 0);
        }
        self.generations[i] = self.generations[i].wrapping_add(1);
    }

    /// Series in use by provisional processes (their fallback and target).
    pub fn in_use(&self) -> impl Iterator<Item = SeriesId> + '_ {
        std::iter::once(self.orphan).chain(
            self.entries
                .values()
                .flat_map(|e| std::iter::once(e.fallback).chain(e.target)),
        )
    }

    /// Forgets entries closed long enough ago that nothing can be booked under them any more.
    pub fn expire(&mut self, now: Instant) {
        let grace = self.grace.unwrap_or(GRACE_MAX);
        self.entries
            .retain(|_, e| e.closed_at.is_none_or(|t| now.duration_since(t) < grace));
    }

    /// Processes whose events are held back now (`pgio_provisional_processes`).
    pub fn open(&self) -> usize {
        self.entries
            .values()
            .filter(|e| e.closed_at.is_none())
            .count()
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const fn s(id: u32) -> SeriesId {
        SeriesId(id)
    }

    #[test]
    fn live_then_folded_into_the_classified_series_then_expired() {
        let mut p = Provisional {
            orphan: s(9),
            ..Default::default()
        };
        assert_eq!(p.route(s(5)), Route::Own);
        p.forked(100, s(3));
        p.forked(101, s(3));
        assert!(p.is_open(100));
        assert_eq!(p.open(), 2);
        assert_eq!(p.route(SeriesId::provisional(100)), Route::Pending);
        assert!(!p.has_closed());
        p.resolved(100, s(7));
        p.closed(101);
        assert!(p.has_closed());
        assert!(!p.is_open(100));
        assert_eq!(
            (p.open(), p.len()),
            (0, 2),
            "closed, kept for late completions"
        );
        assert_eq!(p.route(SeriesId::provisional(100)), Route::Fold(s(7)));
        let now = Instant::now();
        assert!(p.settling(SeriesId::provisional(100), now), "just switched");
        assert!(!p.settling(SeriesId::provisional(100), now + SETTLE));
        assert!(!p.settling(s(7), now), "not provisional");
        assert_eq!(
            p.route(SeriesId::provisional(101)),
            Route::Pending,
            "exited unclassified: held back for a late title"
        );
        let later = Instant::now() + LATE_TITLE + Duration::from_millis(1);
        assert_eq!(
            p.route_at(SeriesId::provisional(101), later),
            Route::Fold(s(3)),
            "no title came, and the ring was never drained: starting"
        );
        assert_eq!(
            p.route(SeriesId::provisional(102)),
            Route::Pending,
            "fork event not handled yet"
        );
        // A title that arrives after an unclassified close still counts.
        assert!(p.wants_title(101));
        p.classified_late(101, s(8));
        assert_eq!(p.route(SeriesId::provisional(101)), Route::Fold(s(8)));
        assert!(!p.wants_title(101));
        // Closing twice keeps the first outcome.
        p.closed(100);
        assert_eq!(p.route(SeriesId::provisional(100)), Route::Fold(s(7)));
        p.forked(103, s(3));
        p.expire(Instant::now() + GRACE_MAX + Duration::from_secs(1));
        assert_eq!(p.len(), 1);
        assert!(p.is_open(103));
        assert!(!p.has_closed(), "expired with their grace");
    }

    #[test]
    fn the_grace_ends_once_a_late_request_counts_lost_at_most_after_thirty_seconds() {
        let secs = Duration::from_secs;
        assert_eq!(grace(secs(5), secs(1)), secs(6));
        assert_eq!(grace(secs(180), Duration::from_millis(22_500)), GRACE_MAX);
        let mut p = Provisional {
            grace: Some(secs(6)),
            ..Default::default()
        };
        p.forked(100, s(3));
        p.resolved(100, s(7));
        let closed = Instant::now();
        p.expire(closed + secs(5));
        assert_eq!(p.len(), 1, "kept while a late completion may still come");
        p.expire(closed + secs(7));
        assert_eq!(p.len(), 0);
    }

    /// A /proc look that finds a backend gone closes it before discovery reads the ring
    /// that holds its title: held back until the ring was drained after the close, however
    /// late (a fixed 2 s could give a `pgbench -C` query to `starting`); closed by its exit
    /// event, which comes after its title, nothing is held back.
    #[test]
    fn a_late_title_waits_for_the_ring_not_a_clock() {
        let mut p = Provisional::default();
        p.forked(300, s(3));
        p.ring_drained(Instant::now());
        p.closed(300);
        let closed = Instant::now();
        let late = closed + Duration::from_secs(5);
        assert_eq!(
            p.route_at(SeriesId::provisional(300), late),
            Route::Pending,
            "5 s later, the ring not drained since the close"
        );
        // The drain that reads the title handles it before it is marked drained.
        p.classified_late(300, s(8));
        p.ring_drained(late);
        assert_eq!(p.route(SeriesId::provisional(300)), Route::Fold(s(8)));

        p.forked(301, s(3));
        p.closed(301);
        p.ring_drained(Instant::now() + Duration::from_millis(1));
        assert_eq!(
            p.route_at(
                SeriesId::provisional(301),
                Instant::now() + Duration::from_millis(2)
            ),
            Route::Fold(s(3)),
            "drained after the close and no title: starting"
        );

        p.forked(302, s(3));
        p.exited(302);
        assert_eq!(
            p.route(SeriesId::provisional(302)),
            Route::Fold(s(3)),
            "its exit event came after any title"
        );
    }

    #[test]
    fn counts_shown_under_the_fallback_never_move_to_a_late_title() {
        let mut p = Provisional::default();
        p.forked(200, s(3));
        p.closed(200);
        if let Some(e) = p.entries.get_mut(&200) {
            e.closed_at = Some(Instant::now() - LATE_TITLE - Duration::from_millis(1));
        }
        assert_eq!(p.route(SeriesId::provisional(200)), Route::Fold(s(3)));
        p.classified_late(200, s(8));
        assert_eq!(
            p.route(SeriesId::provisional(200)),
            Route::Fold(s(3)),
            "a scrape may have shown them under the fallback already"
        );
    }
}
