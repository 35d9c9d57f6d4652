//! `tgid → series id`, written by userspace (classifier) and by `sched_process_fork`
//! (a child inherits its parent's series until userspace reclassifies it).
use aya_ebpf::{macros::map, maps::HashMap};
use pgio_common::MAX_TRACKED;

#[map]
pub static TRACKED: HashMap<u32, u32> = HashMap::with_max_entries(MAX_TRACKED, 0);

#[inline(always)]
pub fn series_of(tgid: u32) -> Option<u32> {
    // SAFETY: values are plain u32 copied out at once.
    unsafe { TRACKED.get(&tgid).copied() }
}
