//! One sparse per-CPU hash entry per (key, log2 slot): one lookup and three adds per event.
use aya_ebpf::{bindings::BPF_NOEXIST, maps::PerCpuHashMap};
use pgio_common::{drops::DropReason, hist::Bucket};

use crate::drops;

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
pub fn add<K>(map: &PerCpuHashMap<K, Bucket>, key: &K, value_ns: u64, bytes: u64) {
    if let Some(b) = map.get_ptr_mut(key) {
        add_to(b, value_ns, bytes);
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
