//! Per-CPU counters of events the kernel side could not record (`pgio_events_dropped_total`).
use aya_ebpf::{macros::map, maps::PerCpuArray};
use pgio_common::drops::{DROP_REASONS, DropReason};

#[map]
static DROPS: PerCpuArray<u64> = PerCpuArray::with_max_entries(DROP_REASONS as u32, 0);

#[inline(always)]
pub fn count(reason: DropReason) {
    if let Some(p) = DROPS.get_ptr_mut(reason as u32) {
        // SAFETY: per-CPU slot; programs do not preempt each other on one CPU's slot here.
        unsafe { *p += 1 };
    }
}
