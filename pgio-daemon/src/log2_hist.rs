//! Log2 histograms summed over CPUs: slot `k` holds (2^(k-1), 2^k] ns, so each slot is
//! exactly one classic bucket `le = 2^k ns` (in seconds) and one native schema-0 bucket.
use pgio_common::hist::{Bucket, SLOTS};

/// Smallest `le`: 2^10 ns ≈ 1 µs (everything faster is folded into it: a syscall takes longer).
pub const MIN_SLOT: usize = 10;
/// Largest finite `le`: 2^34 ns ≈ 17.2 s (everything slower goes to `+Inf` only).
pub const MAX_SLOT: usize = 34;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Log2Hist {
    pub slots: [u64; SLOTS],
    pub sum_ns: u64,
    pub bytes: u64,
}

impl Default for Log2Hist {
    fn default() -> Self {
        Log2Hist {
            slots: [0; SLOTS],
            sum_ns: 0,
            bytes: 0,
        }
    }
}

impl Log2Hist {
    /// Adds one map entry (already summed over CPUs or one CPU's share).
    pub fn add(&mut self, slot: u8, b: &Bucket) {
        let slot = (slot as usize).min(SLOTS - 1);
        self.slots[slot] = self.slots[slot].wrapping_add(b.count);
        self.sum_ns = self.sum_ns.wrapping_add(b.sum);
        self.bytes = self.bytes.wrapping_add(b.bytes);
    }

    /// Adds one metric of a histogram row (every slot's count, and their sum).
    pub fn add_row(&mut self, slots: &[u64; SLOTS], sum_ns: u64) {
        for (a, n) in self.slots.iter_mut().zip(slots) {
            *a = a.wrapping_add(*n);
        }
        self.sum_ns = self.sum_ns.wrapping_add(sum_ns);
    }

    pub fn merge(&mut self, other: &Log2Hist) {
        for (a, b) in self.slots.iter_mut().zip(other.slots.iter()) {
            *a = a.wrapping_add(*b);
        }
        self.sum_ns = self.sum_ns.wrapping_add(other.sum_ns);
        self.bytes = self.bytes.wrapping_add(other.bytes);
    }

    pub fn count(&self) -> u64 {
        self.slots.iter().sum()
    }

    pub fn sum_seconds(&self) -> f64 {
        self.sum_ns as f64 * 1e-9
    }

    /// Non-cumulative counts of the exported buckets, `le = 2^k ns` for k in
    /// MIN_SLOT..=MAX_SLOT, then `+Inf`. Slot k holds (2^(k-1), 2^k] ns, so each slot maps onto
    /// exactly one bucket and nothing is re-binned.
    pub fn bucket_counts(&self) -> impl Iterator<Item = u64> + '_ {
        let below: u64 = self.slots[..=MIN_SLOT].iter().sum();
        let above: u64 = self.slots[MAX_SLOT + 1..].iter().sum();
        std::iter::once(below)
            .chain(self.slots[MIN_SLOT + 1..=MAX_SLOT].iter().copied())
            .chain(std::iter::once(above))
    }
}

pub fn le_seconds(slot: usize) -> f64 {
    (1u64 << slot) as f64 * 1e-9
}

#[cfg(test)]
mod tests {
    use super::*;
    use pgio_common::hist::slot;

    fn observe(h: &mut Log2Hist, ns: u64) {
        h.add(
            slot(ns),
            &Bucket {
                count: 1,
                sum: ns,
                bytes: 0,
            },
        );
    }

    #[test]
    fn buckets_are_upper_inclusive_powers_of_two_in_seconds() {
        let mut h = Log2Hist::default();
        observe(&mut h, 100); // below 1.024 µs: first bucket
        observe(&mut h, 1 << 20); // exactly 2^20 ns: le=2^20
        observe(&mut h, (1 << 20) + 1); // just above: le=2^21
        observe(&mut h, 1 << 40); // beyond 2^34: only +Inf
        let b: Vec<(f64, u64)> = (MIN_SLOT..=MAX_SLOT)
            .map(le_seconds)
            .chain([f64::INFINITY])
            .zip(h.bucket_counts())
            .collect();
        assert_eq!(b.len(), MAX_SLOT - MIN_SLOT + 2);
        assert_eq!(b[0], (1024e-9, 1));
        let at = |k: usize| b[k - MIN_SLOT];
        assert!((at(20).0 - 0.001048576).abs() < 1e-15);
        assert_eq!(at(20).1, 1);
        assert_eq!(at(21).1, 1);
        assert_eq!(b.last(), Some(&(f64::INFINITY, 1)));
        assert_eq!(b.iter().map(|x| x.1).sum::<u64>(), h.count());
        assert_eq!(h.count(), 4);
        assert_eq!(h.sum_ns, 100 + (1 << 20) + (1 << 20) + 1 + (1 << 40));
        assert!((h.sum_seconds() - h.sum_ns as f64 * 1e-9).abs() < 1e-12);
    }

    #[test]
    fn adding_per_cpu_shares_sums_them() {
        let mut h = Log2Hist::default();
        let b = Bucket {
            count: 3,
            sum: 30,
            bytes: 8192,
        };
        h.add(5, &b);
        h.add(5, &b);
        assert_eq!(h.slots[5], 6);
        assert_eq!(h.sum_ns, 60);
        assert_eq!(h.bytes, 16384);
    }
}
