//! `tgid → series id`, written by userspace (classifier) and by `sched_process_fork`
//! (a child inherits its parent's series, or gets a provisional one when `CHILD_SERIES` says
//! so, until userspace reclassifies it).
//!
//! An array indexed by tgid rather than a hash: the verifier inlines array lookups into a
//! bounds check and an address computation, so an untracked process pays almost nothing.
//! `SeriesId::UNTRACKED` (0) means not tracked. Sized to `pid_max` by the loader (4 bytes a pid:
//! 128 KiB for the default 32768, 16 MiB for 2^22).
use aya_ebpf::{macros::map, maps::Array};
use pgio_common::{CHILD_SERIES_MAX, PID_MAX_LIMIT, SeriesId};

#[map]
static TRACKED: Array<SeriesId> = Array::with_max_entries(PID_MAX_LIMIT, 0);

/// `series → nonzero if a process of that series forks processes of another kind`. A
/// postmaster's children are backends, not postmasters: each starts in its own provisional
/// series (`PROVISIONAL | tgid`), which userspace folds into the series it classifies the
/// child as, so not even a new backend's first syscalls are booked as the postmaster's.
#[map]
static CHILD_SERIES: Array<SeriesId> = Array::with_max_entries(CHILD_SERIES_MAX, 0);

#[inline(always)]
pub fn child_series_of(series: SeriesId, child_tgid: u32) -> SeriesId {
    // A provisional parent (a postmaster that has just started) forks processes of another
    // kind too; its own provisional series is not theirs.
    if series.is_provisional() {
        return SeriesId::provisional(child_tgid);
    }
    match CHILD_SERIES.get(series.0) {
        Some(s) if s.is_tracked() => SeriesId::provisional(child_tgid),
        _ => series,
    }
}

#[inline(always)]
pub fn series_of(tgid: u32) -> Option<SeriesId> {
    match TRACKED.get(tgid) {
        Some(s) if s.is_tracked() => Some(*s),
        _ => None,
    }
}

#[inline(always)]
pub fn set(tgid: u32, series: SeriesId) {
    if let Some(p) = TRACKED.get_ptr_mut(tgid) {
        // SAFETY: a plain u32 slot; a racing userspace write of the same slot is benign.
        unsafe { *p = series };
    }
}
