//! Log2 latency buckets shared by every histogram map.
//!
//! Slot `k` counts values `v` with `2^(k-1) < v <= 2^k` (slot 0 holds `v <= 1`). That is exactly
//! Prometheus' classic bucket `le = 2^k ns`, so userspace never re-bins (native histograms,
//! in seconds, are the nearest schema-0 bucket: see pgio-daemon's `native`). Maps are sparse: one per-CPU hash entry per (key, slot) actually hit, each holding
//! the count and the sum of the values that fell in it. One map update per event.

/// Number of log2 slots: values up to 2^63 ns.
pub const SLOTS: usize = 64;

/// Value of every histogram map entry.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Bucket {
    /// Events in this slot.
    pub count: u64,
    /// Sum of their values (ns), for `_sum`.
    pub sum: u64,
    /// Extra per-event quantity (bytes for block IO, 0 elsewhere).
    pub bytes: u64,
}

crate::abi_size!(Bucket, 24, 8);
crate::abi_pod!(Bucket);

/// `ceil(log2(v))`, written with shifts only: BPF has no count-leading-zeros instruction.
#[inline(always)]
pub fn slot(v: u64) -> u8 {
    if v <= 1 {
        return 0;
    }
    let mut x = v - 1;
    let mut r: u8 = 0;
    if x >> 32 != 0 {
        x >>= 32;
        r += 32;
    }
    if x >> 16 != 0 {
        x >>= 16;
        r += 16;
    }
    if x >> 8 != 0 {
        x >>= 8;
        r += 8;
    }
    if x >> 4 != 0 {
        x >>= 4;
        r += 4;
    }
    if x >> 2 != 0 {
        x >>= 2;
        r += 2;
    }
    if x >> 1 != 0 {
        r += 1;
    }
    // The top slot also takes the (absurd) values above 2^63 ns.
    if r >= SLOTS as u8 - 1 {
        return SLOTS as u8 - 1;
    }
    r + 1
}

/// `slot(v)` for `v >= 1` without a branch (bits smeared right, then counted): the verifier
/// sees one unknown value, not one constant per path of `slot`'s comparisons, so a program
/// that keeps several slots and compares them stays small to verify.
#[inline(always)]
pub const fn slot_branchless(v: u64) -> u8 {
    let mut x = v.wrapping_sub(1);
    x |= x >> 1;
    x |= x >> 2;
    x |= x >> 4;
    x |= x >> 8;
    x |= x >> 16;
    x |= x >> 32;
    x -= (x >> 1) & 0x5555_5555_5555_5555;
    x = (x & 0x3333_3333_3333_3333) + ((x >> 2) & 0x3333_3333_3333_3333);
    x = (x + (x >> 4)) & 0x0f0f_0f0f_0f0f_0f0f;
    let bits = x.wrapping_mul(0x0101_0101_0101_0101) >> 56;
    // 64 bits (v above 2^63) go to the top slot, as in `slot`.
    (bits - (bits >> 6)) as u8
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn branchless_slot_is_slot() {
        let check = |v: u64| assert_eq!(slot_branchless(v), slot(v), "{v}");
        (1..5000).for_each(check);
        for b in 0..64 {
            let p = 1u64 << b;
            [p - 1, p, p + 1, p.wrapping_mul(3) / 2]
                .into_iter()
                .filter(|&v| v >= 1)
                .for_each(check);
        }
        [u64::MAX, u64::MAX - 1, 1 << 63, (1 << 63) + 1]
            .into_iter()
            .for_each(check);
    }

    #[test]
    fn slot_is_ceil_log2() {
        assert_eq!(slot(0), 0);
        assert_eq!(slot(1), 0);
        assert_eq!(slot(2), 1);
        assert_eq!(slot(3), 2);
        assert_eq!(slot(4), 2);
        assert_eq!(slot(5), 3);
        assert_eq!(slot(1 << 20), 20);
        assert_eq!(slot((1 << 20) + 1), 21);
        assert_eq!(slot(u64::MAX), 63);
        assert_eq!(slot(1 << 63), 63);
        for k in 1..63u32 {
            let v = 1u64 << k;
            assert_eq!(slot(v) as u32, k, "2^{k}");
            assert_eq!(slot(v + 1) as u32, k + 1, "2^{k}+1");
        }
    }
}
