//! Whether a series may create one more histogram key (see `pgio_common::key_quota`).
use aya_ebpf::{macros::map, maps::Array};
use pgio_common::{
    CHILD_SERIES_MAX, SeriesId,
    key_quota::{EXEMPT, OWNER_SLOTS, PROVISIONAL, QUOTA_MAPS, QuotaMap, allowance_index},
};

use crate::atomic::atomic_add;

/// `series → owner slot`, written by userspace when it gives out the id.
#[map]
static SERIES_OWNER: Array<u8> = Array::with_max_entries(CHILD_SERIES_MAX, 0);

/// New keys each (map, owner) may still create, rewritten by userspace once a second. One
/// counter for all CPUs (a per-CPU split would starve an owner whose threads run on few
/// CPUs): read, then decremented with an atomic add (BPF_XADD, every kernel), so CPUs racing
/// on the last key can take it between them, at most one each.
#[map]
static KEY_ALLOWANCE: Array<i64> = Array::with_max_entries(QUOTA_MAPS * OWNER_SLOTS, 0);

/// New keys refused per (map, owner) (`pgio_hist_map_refused_total`). One counter for all
/// CPUs, added to atomically: a refusal is rare but for an owner past its share, whose own
/// events then pay for the shared line; per CPU it took 2 MiB at 128 possible CPUs.
#[map]
static KEY_REFUSED: Array<u64> = Array::with_max_entries(QUOTA_MAPS * OWNER_SLOTS, 0);

/// Nonzero once userspace has written the first allowances: until then nothing is refused.
#[map]
static KEY_QUOTA_ON: Array<u32> = Array::with_max_entries(1, 0);

/// Takes one key from the allowance of `series`' owner in `map`; `false`: none left.
#[inline(always)]
pub fn take(map: QuotaMap, series: SeriesId) -> bool {
    match KEY_QUOTA_ON.get(0) {
        Some(on) if *on != 0 => {}
        _ => return true,
    }
    let owner = if series.is_provisional() {
        PROVISIONAL
    } else {
        SERIES_OWNER.get(series.0).copied().unwrap_or(EXEMPT)
    };
    if owner == EXEMPT {
        return true;
    }
    let i = allowance_index(map, owner);
    let Some(left) = KEY_ALLOWANCE.get_ptr_mut(i) else {
        return true;
    };
    // SAFETY: a map value, valid while the program runs; shared with other CPUs, hence the
    // volatile read and the atomic decrement. Userspace rewrites it whole, at worst undoing
    // one take.
    unsafe {
        if core::ptr::read_volatile(left) <= 0 {
            if let Some(n) = KEY_REFUSED.get_ptr_mut(i) {
                atomic_add(n, 1);
            }
            return false;
        }
        atomic_add(left.cast::<u64>(), (-1i64) as u64);
    }
    true
}
