//! One sparse per-CPU hash entry per (key, log2 slot): one lookup and three adds per event. A
//! new key costs one of its owner's allowance (`key_quota`).
use aya_ebpf::{bindings::BPF_NOEXIST, maps::PerCpuHashMap};
use pgio_common::{SeriesId, drops::DropReason, hist::Bucket, key_quota::QuotaMap};

use crate::{drops, key_quota};

#[inline(always)]
fn add_to(b: *mut Bucket, value_ns: u64, bytes: u64) {
    // SAFETY: a per-CPU map value: only this CPU writes it.
    unsafe {
        (*b).count += 1;
        (*b).sum += value_ns;
        (*b).bytes += bytes;
    }
}

#[inline(always)]
pub fn add<K>(
    map: &PerCpuHashMap<K, Bucket>,
    quota: QuotaMap,
    series: SeriesId,
    key: &K,
    value_ns: u64,
    bytes: u64,
) {
    if let Some(b) = map.get_ptr_mut(key) {
        add_to(b, value_ns, bytes);
        return;
    }
    if !key_quota::take(quota, series) {
        drops::count(DropReason::HistOverShare);
        return;
    }
    let b = Bucket {
        count: 1,
        sum: value_ns,
        bytes,
    };
    if map.insert(key, &b, BPF_NOEXIST as u64).is_ok() {
        return;
    }
    // Another CPU created the key between our lookup and insert (the key is shared, the
    // values are per CPU): add to this CPU's share of it.
    match map.get_ptr_mut(key) {
        Some(b) => add_to(b, value_ns, bytes),
        None => drops::count(DropReason::HistFull),
    }
}
