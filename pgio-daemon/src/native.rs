//! A `Log2Hist` as one protobuf histogram: pgio's classic `le` buckets, plus a native
//! histogram of schema 0 (bucket `i` holds `(2^(i-1), 2^i]` seconds, upper-inclusive like
//! pgio's slots).
//!
//! Slot `k` holds `(2^(k-1), 2^k]` **nanoseconds**, and a nanosecond is not a power of two of
//! a second (2^k ns = 2^(k - 29.9) s), so no schema's boundaries fall on pgio's. Slot `k` goes
//! to native bucket `k - 30`, upper bound 2^(k-30) s = 0.93 × 2^k ns: the one that shares 90 %
//! of the slot's log2 range. A native quantile therefore reads up to 7 % below the classic
//! one, never by more than one bucket. Slot 0 (`<= 1 ns`) is the zero bucket.
use prometheus_client::encoding::prometheus_protobuf::prometheus_data_model as pb;

use crate::log2_hist::{Log2Hist, MAX_SLOT, MIN_SLOT, le_seconds};

/// Native bucket index of slot `k` is `k - SLOT_OFFSET`.
pub const SLOT_OFFSET: i32 = 30;
/// The zero bucket's width: the lower bound of slot 1's native bucket, 2^-30 s ≈ 0.93 ns.
/// Non-zero also marks an empty histogram as native for the scraper.
pub const ZERO_THRESHOLD: f64 = 1.0 / (1u64 << SLOT_OFFSET) as f64;

pub fn histogram(h: &Log2Hist) -> pb::Histogram {
    let mut cumulative = 0;
    // The `+Inf` bucket is implied by `sample_count`.
    let bucket = (MIN_SLOT..=MAX_SLOT)
        .zip(h.bucket_counts())
        .map(|(k, n)| {
            cumulative += n;
            pb::Bucket {
                cumulative_count: cumulative,
                upper_bound: le_seconds(k),
                ..Default::default()
            }
        })
        .collect();
    let (positive_span, positive_delta) = spans(&h.slots[1..], 1 - SLOT_OFFSET);
    pb::Histogram {
        sample_count: h.count(),
        sample_sum: h.sum_seconds(),
        bucket,
        schema: 0,
        zero_threshold: ZERO_THRESHOLD,
        zero_count: h.slots[0],
        positive_span,
        positive_delta,
        ..Default::default()
    }
}

/// The non-empty entries of `counts` (the first at native index `first`) as spans, and each
/// bucket's count as the difference to the previous bucket's, as the protobuf wants them.
fn spans(counts: &[u64], first: i32) -> (Vec<pb::BucketSpan>, Vec<i64>) {
    let mut spans: Vec<pb::BucketSpan> = Vec::new();
    let mut deltas = Vec::new();
    let mut previous = 0i64;
    // The native index just past the last span.
    let mut end = first;
    for (index, &n) in (first..).zip(counts) {
        if n == 0 {
            continue;
        }
        match spans.last_mut() {
            Some(span) if index == end => span.length += 1,
            _ => spans.push(pb::BucketSpan {
                offset: if spans.is_empty() { index } else { index - end },
                length: 1,
            }),
        }
        end = index + 1;
        let n = n as i64;
        deltas.push(n - previous);
        previous = n;
    }
    (spans, deltas)
}

#[cfg(test)]
mod tests {
    use super::*;
    use pgio_common::hist::{Bucket, SLOTS, slot};

    fn hist(ns: &[u64]) -> Log2Hist {
        let mut h = Log2Hist::default();
        for &v in ns {
            h.add(
                slot(v),
                &Bucket {
                    count: 1,
                    sum: v,
                    bytes: 0,
                },
            );
        }
        h
    }

    /// (native index, count) of every populated native bucket, read back from spans and deltas.
    fn buckets(h: &pb::Histogram) -> Vec<(i32, u64)> {
        let mut out = Vec::new();
        let mut deltas = h.positive_delta.iter();
        let (mut index, mut count) = (0i32, 0i64);
        for (i, span) in h.positive_span.iter().enumerate() {
            index = if i == 0 {
                span.offset
            } else {
                index + span.offset
            };
            for _ in 0..span.length {
                count += deltas.next().expect("a delta per bucket");
                out.push((index, count as u64));
                index += 1;
            }
        }
        assert!(deltas.next().is_none(), "no delta without a bucket");
        out
    }

    #[test]
    fn slot_k_is_native_bucket_k_minus_30_and_the_counts_survive() {
        // 600 µs twice (slot 20), 3 ms (slot 22), 1.5 µs (slot 11), 40 s (slot 36), 1 ns.
        let h = hist(&[600_000, 600_000, 3_000_000, 1_500, 40_000_000_000, 1]);
        let p = histogram(&h);
        assert_eq!(p.sample_count, 6);
        assert_eq!(p.zero_count, 1);
        assert_eq!(buckets(&p), vec![(-19, 1), (-10, 2), (-8, 1), (6, 1)]);
        // Native bucket -10 is (2^-11, 2^-10] s = (488, 977] µs: it holds the 600 µs reads.
        let upper = |i: i32| 2f64.powi(i);
        assert!(upper(-11) < 600e-6 && 600e-6 <= upper(-10));
        assert!(upper(-9) < 3e-3 && 3e-3 <= upper(-8));
        // Beyond the classic buckets (17.2 s) the native one still places 40 s.
        assert!(upper(5) < 40.0 && 40.0 <= upper(6));
        assert_eq!(p.bucket.len(), MAX_SLOT - MIN_SLOT + 1);
        assert_eq!(p.bucket.last().map(|b| b.cumulative_count), Some(5));
        assert_eq!(p.bucket[0].cumulative_count, 1, "1 ns is in le=1.024µs");
        assert!((p.sample_sum - h.sum_seconds()).abs() < 1e-12);
    }

    #[test]
    fn every_slot_round_trips_through_spans_and_deltas() {
        let mut h = Log2Hist::default();
        for (k, n) in h.slots.iter_mut().enumerate().skip(1) {
            // Gaps, runs, rising and falling counts.
            *n = if k % 7 == 3 { 0 } else { (k as u64 * 37) % 11 };
        }
        let p = histogram(&h);
        let want: Vec<(i32, u64)> = (1..SLOTS)
            .filter(|&k| h.slots[k] != 0)
            .map(|k| (k as i32 - SLOT_OFFSET, h.slots[k]))
            .collect();
        assert_eq!(buckets(&p), want);
        let from_buckets: u64 = buckets(&p).iter().map(|b| b.1).sum();
        assert_eq!(from_buckets + p.zero_count, p.sample_count);
    }

    #[test]
    fn an_empty_histogram_is_still_native() {
        let p = histogram(&Log2Hist::default());
        assert_eq!(p.sample_count, 0);
        assert!(p.positive_span.is_empty());
        // The scraper tells native from classic by a non-zero threshold or buckets.
        assert!(p.zero_threshold > 0.0);
        const { assert!(ZERO_THRESHOLD < 1e-9 && ZERO_THRESHOLD > 0.9e-9) };
    }
}
