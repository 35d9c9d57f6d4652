//! One sparse hash entry per (key, log2 slot), shared by every CPU: one lookup and two or
//! three atomic adds per event. Not per-CPU: a per-CPU value costs its size once per
//! *possible* CPU (465 MiB of maps on a 128-CPU node), and a scrape would sum every CPU of
//! every key. An atomic add on a line another CPU just wrote costs more than a plain add, but
//! only for the same (series, syscall or device, slot) on two CPUs at once. A new key costs
//! one of its owner's allowance (`key_quota`).
use aya_ebpf::{bindings::BPF_NOEXIST, maps::HashMap};
use pgio_common::{
    SeriesId,
    drops::DropReason,
    hist::{Bucket, SLOTS},
    key_quota::QuotaMap,
    query::{QueryRun, RUN_BASE_UNSET, RUN_SLOTS},
};

use crate::{atomic::atomic_add, drops, key_quota};

#[inline(always)]
fn add_to(b: *mut Bucket, v: &Bucket) {
    // SAFETY: a map value, valid while the program runs; other CPUs add to it too.
    unsafe {
        atomic_add(&raw mut (*b).count, v.count);
        atomic_add(&raw mut (*b).sum, v.sum);
        if v.bytes != 0 {
            atomic_add(&raw mut (*b).bytes, v.bytes);
        }
    }
}

#[inline(always)]
pub fn add<K>(
    map: &HashMap<K, Bucket>,
    quota: QuotaMap,
    series: SeriesId,
    key: &K,
    value_ns: u64,
    bytes: u64,
) {
    if let Err(reason) = try_add(map, Some(quota), series, key, value_ns, bytes) {
        drops::count(reason);
    }
}

/// `add`, telling why the event was not counted (the caller counts the drop, or books it
/// elsewhere); `quota: None` makes a new key without taking from its owner's allowance (for
/// keys bounded per series).
#[inline(always)]
pub fn try_add<K>(
    map: &HashMap<K, Bucket>,
    quota: Option<QuotaMap>,
    series: SeriesId,
    key: &K,
    value_ns: u64,
    bytes: u64,
) -> Result<(), DropReason> {
    let v = Bucket {
        count: 1,
        sum: value_ns,
        bytes,
    };
    try_add_bucket(map, quota, series, key, &v)
}

/// `try_add` of several events at once (`v.count` of them, their sum and bytes).
#[inline(always)]
pub fn try_add_bucket<K>(
    map: &HashMap<K, Bucket>,
    quota: Option<QuotaMap>,
    series: SeriesId,
    key: &K,
    v: &Bucket,
) -> Result<(), DropReason> {
    if let Some(b) = map.get_ptr_mut(key) {
        add_to(b, v);
        return Ok(());
    }
    if let Some(quota) = quota
        && !key_quota::take(quota, series)
    {
        return Err(DropReason::HistOverShare);
    }
    if map.insert(key, v, BPF_NOEXIST as u64).is_ok() {
        return Ok(());
    }
    // Another CPU created the key between our lookup and insert: add to it.
    match map.get_ptr_mut(key) {
        Some(b) => {
            add_to(b, v);
            Ok(())
        }
        None => Err(DropReason::HistFull),
    }
}

/// The row of `key` in a map of histogram rows (a value per key holding every histogram of
/// it), made from `zero` on first use if its owner may have one more.
#[inline(always)]
pub fn row<K, V>(
    map: &HashMap<K, V>,
    zero: &V,
    quota: QuotaMap,
    series: SeriesId,
    key: &K,
) -> Option<*mut V> {
    if let Some(r) = map.get_ptr_mut(key) {
        return Some(r);
    }
    if !key_quota::take(quota, series) {
        drops::count(DropReason::HistOverShare);
        return None;
    }
    // Failing because another CPU made it first is fine: the lookup finds it.
    let _ = map.insert(key, zero, BPF_NOEXIST as u64);
    let r = map.get_ptr_mut(key);
    if r.is_none() {
        drops::count(DropReason::HistFull);
    }
    r
}

/// A run's counts of metric `m` into a histogram of a row every CPU adds to: its count of
/// 0 ns, its log2 slots and its sum (`query`'s and `query_id`'s rows).
///
/// SAFETY: the three point into one map value; `r` is a `QUERY_RUNS` value.
#[inline(always)]
pub unsafe fn add_run(
    zeros: *mut u64,
    slots: *mut [u64; SLOTS],
    sum: *mut u64,
    r: *const QueryRun,
    m: usize,
) {
    let m = m % 3;
    unsafe {
        let z = (*r).zeros[m];
        if z != 0 {
            atomic_add(zeros, z as u64);
        }
        let ns = (*r).sum_ns[m];
        if ns != 0 {
            atomic_add(sum, ns);
        }
        let base = (*r).base[m];
        if base == RUN_BASE_UNSET {
            return;
        }
        let mut w = 0;
        while w < RUN_SLOTS {
            let c = (*r).counts[m][w];
            if c != 0 {
                // The mask proves the index to the verifier; `run_base` keeps it below SLOTS.
                let i = (base as usize + w) & (SLOTS - 1);
                atomic_add(&raw mut (*slots)[i], c as u64);
            }
            w += 1;
        }
    }
}
