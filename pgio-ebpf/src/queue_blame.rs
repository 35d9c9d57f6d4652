//! Queue blame's kernel side (`pgio_common::queue_blame` has the rule). It rides the block
//! hooks (`hooks.rs`), handed each request's in-flight entry by `block_io`: a tracked request's
//! wait takes a copy of its device's clock when it starts (`mark`), is shared out at its issue
//! (`issued`), which marks it again, and its device time at its completion; every completed
//! request, anyone's, moves the clock (`completed`). No program of its own, no lookup of the
//! in-flight map.
use aya_ebpf::{
    macros::map,
    maps::{Array, HashMap},
};
use pgio_common::{
    SeriesId,
    hist::Bucket,
    queue_blame::{
        CLOCK_PROBES, CLOCKS, CULPRIT_REST, CULPRIT_SERIES, CULPRIT_SLOTS, OWNER_IDLE_NS,
        PHASE_DEVICE, PHASE_QUEUE, QUOTA, QueueBlameClock, QueueBlameKey, QueueBlameMark,
        clock_index, deltas, mark_of, shares,
    },
};

use crate::{atomic::atomic_add, hist};

/// `queue_blame` from the config, written by userspace at load: off, the verifier prunes
/// every step below.
#[unsafe(no_mangle)]
static QUEUE_BLAME_ON: u8 = 1;

/// Each device's clock, taken by its first completion (`clock`).
#[map]
static QUEUE_BLAME_CLOCK: Array<QueueBlameClock> = Array::with_max_entries(CLOCKS, 0);

/// Blamed time per (victim series, device, op, culprit).
#[map]
static QUEUE_BLAME_HIST: HashMap<QueueBlameKey, Bucket> = HashMap::with_max_entries(4_096, 0);

/// How stale an owner's `last_ns` may be (its slot is taken after `OWNER_IDLE_NS`).
const LAST_EVERY_NS: u64 = 100_000_000;

/// Device `dev`'s clock: the entry at its hash or one of the next `CLOCK_PROBES - 1` that
/// holds it; with `take`, the first free one of them becomes its (a completion's). Two CPUs
/// taking one entry for two devices at once: the later one has it, and the other device's
/// next completion takes another. `None`: no clock (yet, or all its entries taken; then its
/// waits are blamed on their victims).
#[inline(always)]
fn clock(dev: u32, take: bool) -> Option<*mut QueueBlameClock> {
    let first = clock_index(dev);
    let mut k = 0;
    while k < CLOCK_PROBES {
        let c = QUEUE_BLAME_CLOCK.get_ptr_mut((first + k) & (CLOCKS - 1))?;
        // SAFETY: an array value, valid while the program runs.
        unsafe {
            match (*c).dev {
                d if d == dev => return Some(c),
                0 if take => {
                    (*c).dev = dev;
                    return Some(c);
                }
                0 => return None,
                _ => {}
            }
        }
        k += 1;
    }
    None
}

#[inline(always)]
fn on() -> bool {
    // SAFETY: a global the loader rewrites; volatile so the compiler keeps the load.
    unsafe { core::ptr::read_volatile(&QUEUE_BLAME_ON) != 0 }
}

/// Writes every field of `m`: the device's clock now, the wait from `from_ns` (0: no mark, for
/// a request whose device is unknown or that is not blamed).
///
/// SAFETY: `m` points to an in-flight entry's mark (a map value or a stack copy).
#[inline(always)]
pub unsafe fn mark(m: *mut QueueBlameMark, dev: u32, from_ns: u64) {
    use core::ptr::write_volatile as w;
    let clock = if on() && dev != 0 {
        clock(dev, false)
    } else {
        None
    };
    unsafe {
        w(&raw mut (*m).from_ns, if dev != 0 { from_ns } else { 0 });
        let mut i = 0;
        while i < CULPRIT_SLOTS {
            let v = match clock {
                Some(c) => mark_of((*c).done_ns[i]),
                None => 0,
            };
            w(&raw mut (*m).done[i], v);
            i += 1;
        }
    }
}

/// Adds `ns` to `key`'s blame. Not inlined: a call per culprit leaves the caller's state the
/// same whichever way the lookup went, so the verifier walks the eight culprits one after the
/// other instead of every combination of their paths (inlined, `block_rq_issue` exceeded the
/// 1,000,000 instructions a program may take to verify).
#[inline(never)]
fn book(key: &QueueBlameKey, ns: u64) {
    match QUEUE_BLAME_HIST.get_ptr_mut(key) {
        // SAFETY: a map value, valid while the program runs; other CPUs add to it too.
        Some(b) => unsafe { atomic_add(&raw mut (*b).sum, ns) },
        None => hist::add(&QUEUE_BLAME_HIST, QUOTA, key.victim, key, ns, 0),
    }
}

/// `wait` of `key.victim` shared out among the culprits of `c` whose `done` (a copy of its
/// clock) moved since `mark` (none: its own).
///
/// SAFETY: `c` points to a `QUEUE_BLAME_CLOCK` value.
#[inline(always)]
unsafe fn share_out(
    mut key: QueueBlameKey,
    c: *mut QueueBlameClock,
    done: &[u64; CULPRIT_SLOTS],
    mark: &[u32; CULPRIT_SLOTS],
    wait: u64,
) {
    let s = shares(wait, &deltas(done, mark));
    let mut any = false;
    let mut i = 0;
    while i < CULPRIT_SLOTS {
        if s[i] != 0 {
            any = true;
            (key.culprit, key.culprit_kind) = if i == 0 {
                (SeriesId::UNTRACKED, CULPRIT_REST)
            } else {
                // SAFETY: as above.
                (unsafe { (*c).owners[i] }, CULPRIT_SERIES)
            };
            book(&key, s[i]);
        }
        i += 1;
    }
    if !any {
        key.culprit = key.victim;
        key.culprit_kind = CULPRIT_SERIES;
        book(&key, wait);
    }
}

/// The request of `victim` is issued on `dev` at `now`: the wait since its mark is shared out
/// among the culprits the clock moved for (none: its own), and the mark moves to `now`, for
/// its device time (and for a second issue after a requeue).
///
/// SAFETY: `m` points to an in-flight entry's mark.
#[inline(always)]
pub unsafe fn issued(m: *mut QueueBlameMark, victim: SeriesId, dev: u32, op: u8, now: u64) {
    if !on() || !victim.is_tracked() || dev == 0 {
        return;
    }
    let from = unsafe { (*m).from_ns };
    let key = QueueBlameKey {
        victim,
        culprit: victim,
        dev,
        op,
        culprit_kind: CULPRIT_SERIES,
        phase: PHASE_QUEUE,
        _pad: 0,
    };
    let c = clock(dev, false);
    // One copy of the clock for the queue wait's shares and the device time's mark: a
    // completion between two reads would be in neither.
    // SAFETY: a map value, valid while the program runs; other CPUs add to it.
    let done = c.map_or([0; CULPRIT_SLOTS], |c| unsafe { (*c).done_ns });
    if from != 0 && from < now {
        match c {
            // SAFETY: as the caller says; only this request's own events write its mark.
            Some(c) => unsafe { share_out(key, c, &done, &(*m).done, now - from) },
            None => book(&key, now - from),
        }
    }
    // SAFETY: as above.
    unsafe {
        (*m).from_ns = now;
        let mut i = 0;
        while i < CULPRIT_SLOTS {
            (*m).done[i] = mark_of(done[i]);
            i += 1;
        }
    }
}

/// The slot `series` books its device time in: its own, else a free one, else the one idle
/// longest if it has been idle more than `OWNER_IDLE_NS`, else `(rest)` (0). Two CPUs may
/// claim one slot at once: the later owner wins, and the other's time in it is blamed on it.
///
/// SAFETY: `c` points to a `QUEUE_BLAME_CLOCK` value.
#[inline(always)]
unsafe fn slot_of(c: *mut QueueBlameClock, series: SeriesId, now: u64) -> usize {
    if series.is_provisional() {
        return 0;
    }
    let (mut idle, mut idle_last) = (0usize, u64::MAX);
    let mut i = 1;
    while i < CULPRIT_SLOTS {
        let last = unsafe { (*c).last_ns[i] };
        if last != 0 && unsafe { (*c).owners[i] } == series {
            return i;
        }
        if last < idle_last {
            (idle, idle_last) = (i, last);
        }
        i += 1;
    }
    if idle == 0 || (idle_last != 0 && now.saturating_sub(idle_last) <= OWNER_IDLE_NS) {
        return 0;
    }
    unsafe { (*c).owners[idle & (CULPRIT_SLOTS - 1)] = series };
    idle
}

/// A request of `series` completed on `dev` after `device_ns` on the device: the clock moves,
/// then a tracked request's device time since its issue (`mark`) is shared out, its own
/// completion included.
#[inline(always)]
pub fn completed(
    mark: &QueueBlameMark,
    series: SeriesId,
    dev: u32,
    op: u8,
    device_ns: u64,
    now: u64,
) {
    if !on() || dev == 0 {
        return;
    }
    let Some(c) = clock(dev, true) else {
        return;
    };
    // SAFETY: a map value, valid while the program runs; other CPUs add to it too.
    unsafe {
        let i = slot_of(c, series, now) & (CULPRIT_SLOTS - 1);
        atomic_add(&raw mut (*c).done_ns[i], device_ns);
        // Written at most every 100 ms: a line every CPU's completions would write otherwise.
        if i != 0 && now.saturating_sub((*c).last_ns[i]) > LAST_EVERY_NS {
            (*c).last_ns[i] = now;
        }
    }
    // Marked at its issue: a tracked request seen issued.
    if !series.is_tracked() || mark.from_ns == 0 || device_ns == 0 {
        return;
    }
    let key = QueueBlameKey {
        victim: series,
        culprit: series,
        dev,
        op,
        culprit_kind: CULPRIT_SERIES,
        phase: PHASE_DEVICE,
        _pad: 0,
    };
    // SAFETY: as above.
    unsafe {
        let done = (*c).done_ns;
        share_out(key, c, &done, &mark.done, device_ns)
    };
}
