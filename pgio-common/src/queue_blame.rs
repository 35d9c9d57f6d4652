//! Queue blame: whose requests a block request waited behind (issue 48).
//!
//! **The rule.** A request of series V waits on device D from its submission to its issue
//! (its queue time, `BlockMetric::Queue`). That wait is shared out among the series whose
//! requests D *completed* meanwhile, in proportion to those requests' device time: a request
//! waits for a free slot of the device, which a completion gives it, so whoever the device
//! served while V waited is whom V waited behind, and a long write holds it longer than a
//! short read. Nothing completed during the wait (an idle device, the scheduler's own delay,
//! a plug): the wait is V's own. The shares sum to the wait exactly (the rounding remainder
//! goes to the largest share), so per victim the blame summed over culprits is its queue time.
//! V's own completions meanwhile blame V itself.
//!
//! **Device time, the second figure.** The same request's time on the device, from its issue
//! to its completion, is shared out the same way among the series whose requests D completed
//! meanwhile, its own completion included (so alone on the device it is V's own): where a
//! device takes many requests at once (a loop device's worker, a virtio or NVMe queue), a
//! request waits there rather than in the scheduler, behind whatever the device is busy with.
//! Per victim it sums to its device time (`pgio_block_io_device_seconds_sum`).
//!
//! **How, in the kernel.** Per device a clock ([`QueueBlameClock`]): per culprit slot, the
//! device time of the completed requests of the slot's owner, added at each completion. A
//! request takes a copy of the clock when its wait starts ([`QueueBlameMark`], in its
//! in-flight entry) and, at its issue, the difference is each slot's share. Atomic adds only:
//! no lock, no read-modify-write of anything another CPU writes.
//!
//! **Culprit slots.** [`CULPRIT_SLOTS`] per device: slot 0 is `(rest)`, every other is owned
//! by one series at a time. A completing request's series takes the slot it owns, else a
//! free one, else the one whose owner has been idle longest if that is more than
//! [`OWNER_IDLE_NS`], else `(rest)`. Provisional series (processes not yet classified) go to
//! `(rest)`: a fork per request cannot churn the owners.

use crate::SeriesId;

/// `queue_blame`'s histogram map in the key quota (`KEY_ALLOWANCE`).
pub const QUOTA: crate::key_quota::QuotaMap = crate::key_quota::QuotaMap(6);

/// Culprits per device: `(rest)` and seven owners.
pub const CULPRIT_SLOTS: usize = 8;

/// An owner whose requests completed last this long ago gives its slot to a newcomer.
pub const OWNER_IDLE_NS: u64 = 10_000_000_000;

/// Entries of `QUEUE_BLAME_CLOCK`: an array, whose lookups the verifier inlines (a hash
/// lookup costs ~25 ns, and every request takes three).
pub const CLOCKS: u32 = 1_024;

/// How many entries from its hash a device's clock may be.
pub const CLOCK_PROBES: u32 = 4;

/// The first entry of `QUEUE_BLAME_CLOCK` device `dev` may have (Fibonacci hashing).
#[inline(always)]
pub const fn clock_index(dev: u32) -> u32 {
    ((dev as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 54) as u32 & (CLOCKS - 1)
}

/// Value of `QUEUE_BLAME_CLOCK`: one device's clock, at `clock_index(dev)` or up to
/// `CLOCK_PROBES - 1` entries after it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QueueBlameClock {
    /// Device time (ns) of the completed requests of each slot's owners, ever.
    pub done_ns: [u64; CULPRIT_SLOTS],
    /// When each slot's owner last completed a request; 0: free (slot 0: unused).
    pub last_ns: [u64; CULPRIT_SLOTS],
    /// Each slot's owner (slot 0: unused).
    pub owners: [SeriesId; CULPRIT_SLOTS],
    /// The device (`dev_t` as `block_io::mkdev` packs it); 0: a free entry.
    pub dev: u32,
    pub _pad: u32,
}

/// A waiting request's copy of its device's clock, in its `BlockIoInflight`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QueueBlameMark {
    /// When the part of the wait not yet blamed began: the submission, then each issue (a
    /// requeued request is issued again; its queue time runs from its submission to its last
    /// issue, and so, summed, does its blame). 0: not marked (an untracked victim's).
    pub from_ns: u64,
    /// `QueueBlameClock::done_ns` at `from_ns`, in `MARK_UNIT_NS` units, the low 32 bits
    /// (`mark_of`): a difference is right up to 2^32 units (18 min) of device time completed
    /// per slot during one wait, and a mark takes 32 bytes, not 64 (2 MiB over the in-flight
    /// map's 65,536 entries).
    pub done: [u32; CULPRIT_SLOTS],
}

/// The unit of a mark: 256 ns.
pub const MARK_SHIFT: u32 = 8;

/// A clock's value as a mark holds it.
#[inline(always)]
pub const fn mark_of(done_ns: u64) -> u32 {
    (done_ns >> MARK_SHIFT) as u32
}

impl QueueBlameMark {
    pub const ZERO: QueueBlameMark = QueueBlameMark {
        from_ns: 0,
        done: [0; CULPRIT_SLOTS],
    };
}

/// What a culprit key names.
pub const CULPRIT_SERIES: u8 = 0;
/// The device's `(rest)`: series without a slot of their own.
pub const CULPRIT_REST: u8 = 1;

/// `QueueBlameKey::phase` of queue time (submission to issue).
pub const PHASE_QUEUE: u8 = 0;
/// `QueueBlameKey::phase` of device time (issue to completion).
pub const PHASE_DEVICE: u8 = 1;

/// Key of `QUEUE_BLAME_HIST`: one (victim series, device, op, phase, culprit). Its `Bucket`:
/// `sum` the ns blamed (`count` is not kept: one atomic add less per request).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct QueueBlameKey {
    pub victim: SeriesId,
    /// The culprit's series (`CULPRIT_SERIES`); `UNTRACKED` for `(rest)`.
    pub culprit: SeriesId,
    pub dev: u32,
    /// `block_io::BlockOp` of the victim's request.
    pub op: u8,
    /// `CULPRIT_SERIES` or `CULPRIT_REST`.
    pub culprit_kind: u8,
    /// `PHASE_QUEUE` or `PHASE_DEVICE`.
    pub phase: u8,
    pub _pad: u8,
}

crate::abi_size!(QueueBlameClock, 168, 8);
crate::abi_size!(QueueBlameMark, 40, 8);
crate::abi_size!(QueueBlameKey, 16, 4);
crate::abi_pod!(QueueBlameClock, QueueBlameMark, QueueBlameKey);

/// Each slot's device time completed since `mark` (in `MARK_SHIFT` units).
#[inline(always)]
pub fn deltas(clock: &[u64; CULPRIT_SLOTS], mark: &[u32; CULPRIT_SLOTS]) -> [u64; CULPRIT_SLOTS] {
    let mut d = [0u64; CULPRIT_SLOTS];
    let mut i = 0;
    while i < CULPRIT_SLOTS {
        d[i] = mark_of(clock[i]).wrapping_sub(mark[i]) as u64;
        i += 1;
    }
    d
}

/// `wait_ns` shared out in proportion to `deltas` (none: all zero, the caller blames the
/// victim). Exact: the shares sum to `wait_ns`, the remainder of the rounding on the largest
/// share. In 2^-20 fractions, so no product overflows: waits up to 2^44 ns (4.8 h), deltas
/// summing to less than 2^64 ns. One culprit, the common case, takes it all without a
/// division (~15 ns each on x86).
#[inline(always)]
pub fn shares(wait_ns: u64, deltas: &[u64; CULPRIT_SLOTS]) -> [u64; CULPRIT_SLOTS] {
    // Few branches, none that makes a slot's value known on one path only: the kernel's
    // verifier walks every combination of them (eight slots), and a program has a budget.
    let mut out = [0u64; CULPRIT_SLOTS];
    let (mut total, mut largest) = (0u64, 0usize);
    let mut i = 0;
    while i < CULPRIT_SLOTS {
        total = total.wrapping_add(deltas[i]);
        if deltas[i] > deltas[largest] {
            largest = i;
        }
        i += 1;
    }
    let largest = largest & (CULPRIT_SLOTS - 1);
    if total == 0 {
        return out;
    }
    if deltas[largest] == total {
        out[largest] = wait_ns;
        return out;
    }
    // Fractions of 2^20: scale the deltas down first if their total exceeds 2^43 ns.
    let shift = if total >> 43 != 0 { 21 } else { 0 };
    let total = (total >> shift).max(1);
    let wait = wait_ns & ((1 << 44) - 1);
    let mut given = 0u64;
    i = 0;
    while i < CULPRIT_SLOTS {
        let frac = ((deltas[i] >> shift) << 20) / total;
        out[i] = (wait * frac) >> 20;
        given += out[i];
        i += 1;
    }
    out[largest] += wait_ns - given;
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_sum_to_the_wait_and_follow_the_device_time() {
        let d = [0, 3_000, 1_000, 0, 0, 0, 0, 0];
        let s = shares(1_000_001, &d);
        assert_eq!(s.iter().sum::<u64>(), 1_000_001);
        assert_eq!((s[1], s[2]), (750_001, 250_000));
        // Nothing completed: no share; the caller blames the victim.
        assert_eq!(shares(5, &[0; CULPRIT_SLOTS]), [0; CULPRIT_SLOTS]);
        // One culprit takes it all.
        assert_eq!(shares(7, &[0, 0, 9, 0, 0, 0, 0, 0])[2], 7);
    }

    #[test]
    fn huge_deltas_and_waits_stay_exact() {
        let mut d = [1 << 58; CULPRIT_SLOTS];
        d[0] = 1;
        let wait = (1 << 44) - 1;
        let s = shares(wait, &d);
        assert_eq!(s.iter().sum::<u64>(), wait);
        assert!(s[1..].iter().all(|&x| x >= wait / 8 - 8));
    }

    #[test]
    fn marks_hold_the_clock_in_256_ns_units_and_wrap() {
        let clock = [5 << 8, (1u64 << 40) + (3 << 8), 0, 0, 0, 0, 0, 0];
        let mark = [
            mark_of(2 << 8),
            mark_of((1u64 << 40) - (4 << 8)),
            0,
            0,
            0,
            0,
            0,
            0,
        ];
        // Across the 32 bits' wrap too.
        assert_eq!(deltas(&clock, &mark)[..3], [3, 7, 0]);
    }
}
