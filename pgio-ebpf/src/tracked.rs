//! `tgid → series id`, written by userspace (classifier) and by `sched_process_fork`
//! (a child inherits its parent's series, or gets a provisional one when `CHILD_SERIES` says
//! so, until userspace reclassifies it).
//!
//! An array indexed by tgid rather than a hash: the verifier inlines array lookups into a
//! bounds check and an address computation, so an untracked process pays almost nothing.
//! 0 (`SERIES_UNTRACKED`) means not tracked. Sized to `pid_max` by the loader (4 bytes a pid:
//! 128 KiB for the default 32768, 16 MiB for 2^22).
use aya_ebpf::{macros::map, maps::Array};
use pgio_common::{CHILD_SERIES_MAX, PID_MAX_LIMIT, PROVISIONAL, SERIES_UNTRACKED};

#[map]
static TRACKED: Array<u32> = Array::with_max_entries(PID_MAX_LIMIT, 0);

/// `series → nonzero if a process of that series forks processes of another kind`. A
/// postmaster's children are backends, not postmasters: each starts in its own provisional
/// series (`PROVISIONAL | tgid`), which userspace folds into the series it classifies the
/// child as, so not even a new backend's first syscalls are booked as the postmaster's.
#[map]
static CHILD_SERIES: Array<u32> = Array::with_max_entries(CHILD_SERIES_MAX, 0);

#[inline(always)]
pub fn child_series_of(series: u32, child_tgid: u32) -> u32 {
    // A provisional parent (a postmaster that has just started) forks processes of another
    // kind too; its own provisional series is not theirs.
    if series & PROVISIONAL != 0 {
        return PROVISIONAL | child_tgid;
    }
    match CHILD_SERIES.get(series) {
        Some(s) if *s != SERIES_UNTRACKED => PROVISIONAL | child_tgid,
        _ => series,
    }
}

#[inline(always)]
pub fn series_of(tgid: u32) -> Option<u32> {
    match TRACKED.get(tgid) {
        Some(s) if *s != SERIES_UNTRACKED => Some(*s),
        _ => None,
    }
}

#[inline(always)]
pub fn set(tgid: u32, series: u32) {
    if let Some(p) = TRACKED.get_ptr_mut(tgid) {
        // SAFETY: a plain u32 slot; a racing userspace write of the same slot is benign.
        unsafe { *p = series };
    }
}
