//! Plain-text pictures of an interval, bpftrace style: per row a header with rate, p50 and p99,
//! then one line per log2 bucket from the first to the last non-empty one, with its count and a
//! bar. ASCII only, so a dumb terminal or a bug report shows the same thing.
use std::{collections::BTreeMap, fmt::Write as _};

use super::interval::{Hist, Layer, Row};

/// A duration, short: `950ns`, `12us`, `1.5ms`, `2.1s`.
pub fn duration(seconds: f64) -> String {
    let (v, unit) = if seconds < 1e-6 {
        (seconds * 1e9, "ns")
    } else if seconds < 1e-3 {
        (seconds * 1e6, "us")
    } else if seconds < 1.0 {
        (seconds * 1e3, "ms")
    } else {
        (seconds, "s")
    };
    if v < 10.0 {
        format!("{v:.1}{unit}")
    } else {
        format!("{v:.0}{unit}")
    }
}

fn rate(count: u64, seconds: f64) -> String {
    let r = count as f64 / seconds.max(1e-9);
    if r < 10.0 {
        format!("{r:.1}/s")
    } else {
        format!("{r:.0}/s")
    }
}

/// `(lower, upper]` of bucket `i`: pgio's buckets are upper-inclusive.
fn bucket_label(h: &Hist, i: usize) -> String {
    let upper = h.le[i];
    if upper.is_infinite() {
        return format!("({}, ...)", duration(h.le[i.saturating_sub(1)]));
    }
    if i == 0 {
        return format!("(0, {}]", duration(upper));
    }
    format!("({}, {}]", duration(h.le[i - 1]), duration(upper))
}

/// `@` × the count's share of `max`, at least one for a non-zero count.
fn bar(n: u64, max: u64, width: usize) -> String {
    if n == 0 || max == 0 {
        return String::new();
    }
    let len = ((n as f64 / max as f64) * width as f64).round() as usize;
    "@".repeat(len.clamp(1, width))
}

/// Indices of the first and last non-empty bucket over all of `hists`.
fn span(hists: &[&Hist]) -> Option<(usize, usize)> {
    let nonzero = |h: &&Hist| {
        let first = h.counts.iter().position(|&n| n > 0)?;
        let last = h.counts.iter().rposition(|&n| n > 0)?;
        Some((first, last))
    };
    hists
        .iter()
        .filter_map(nonzero)
        .reduce(|a, b| (a.0.min(b.0), a.1.max(b.1)))
}

pub fn summary(h: &Hist, seconds: f64) -> String {
    let q = |q| h.quantile(q).map_or("-".into(), duration);
    format!(
        "{} ({} in {:.1}s)  p50 {}  p99 {}",
        rate(h.count(), seconds),
        h.count(),
        seconds,
        q(0.5),
        q(0.99)
    )
}

/// What a row times and for whom: `syscall=pread64 cache=miss | app=postgres role=checkpointer`.
pub fn row_title(row: &Row) -> String {
    // Titles are untrusted: no control characters reach the terminal.
    let pair = |k: &str, v: &str| {
        let v: String = v
            .chars()
            .map(|c| if c.is_control() { '?' } else { c })
            .collect();
        format!("{k}={v}")
    };
    let own = row.metric.own_labels();
    let mut what = vec![row.metric.name().to_owned()];
    what.extend(own.iter().filter_map(|k| Some(pair(k, row.key.get(*k)?))));
    let who: Vec<String> = row
        .key
        .iter()
        .filter(|(k, _)| !own.contains(&k.as_str()))
        .map(|(k, v)| pair(k, v))
        .collect();
    if who.is_empty() {
        what.join(" ")
    } else {
        format!("{} | {}", what.join(" "), who.join(" "))
    }
}

/// Where the queries' time went, largest part first, as shares of their time:
/// `time: IO 62% cpu 30% runnable 5% LWLock 3%`; for queue time, behind whom it was spent:
/// `behind: postgres/autovacuum worker/shop 91% postgres/client backend/shop 9%`.
pub fn parts(what: &str, parts: &BTreeMap<String, f64>, total: f64) -> String {
    let mut p: Vec<(&String, &f64)> = parts.iter().filter(|(_, s)| **s > 0.0).collect();
    p.sort_by(|a, b| b.1.total_cmp(a.1).then(a.0.cmp(b.0)));
    let shares: Vec<String> = p
        .iter()
        .map(|(name, s)| {
            let name: String = name
                .chars()
                .map(|c| if c.is_control() { '?' } else { c })
                .collect();
            format!("{name} {:.0}%", 100.0 * **s / total.max(1e-12))
        })
        .collect();
    format!("{what}: {}", shares.join(" "))
}

/// One row: title, summary, histogram lines; `width` columns at most.
pub fn row(out: &mut Vec<String>, row: &Row, seconds: f64, width: usize) {
    let h = &row.hist;
    out.push(clip(&row_title(row), width));
    out.push(clip(&format!("  {}", summary(h, seconds)), width));
    if !row.parts.is_empty() {
        out.push(clip(
            &format!(
                "  {}",
                parts(row.metric.parts_name(), &row.parts, h.sum_seconds)
            ),
            width,
        ));
    }
    let Some((first, last)) = span(&[h]) else {
        return;
    };
    // "  (131us, 262us]  12345678 |@@@...|"
    let bar_width = width.saturating_sub(2 + 16 + 1 + 8 + 3).clamp(8, 60);
    let max = h.counts[first..=last].iter().copied().max().unwrap_or(0);
    for i in first..=last {
        let n = h.counts[i];
        out.push(format!(
            "  {:<16} {:>8} |{:<bar_width$}|",
            bucket_label(h, i),
            n,
            bar(n, max, bar_width)
        ));
    }
    out.push(String::new());
}

/// A volume's layers side by side: one line per bucket, a count and a bar per layer.
pub fn layers(out: &mut Vec<String>, volume: &str, layers: &[Layer], seconds: f64, width: usize) {
    out.push(clip(
        &format!("volume {volume}: reads, top to bottom"),
        width,
    ));
    for l in layers {
        out.push(clip(
            &format!("  {:<14} {}", l.name, summary(&l.hist, seconds)),
            width,
        ));
    }
    let hists: Vec<&Hist> = layers.iter().map(|l| &l.hist).collect();
    let Some((first, last)) = span(&hists) else {
        out.push("  (no reads in this interval)".into());
        return;
    };
    // Bucket column 16, then per layer: count 7, space, bar, space.
    let cell = (width.saturating_sub(16) / layers.len().max(1)).max(10);
    let bar_width = cell - 9;
    let mut header = format!("{:<16}", "");
    for l in layers {
        let _ = write!(header, "{:<cell$}", clip(l.name, cell - 1));
    }
    out.push(header.trim_end().to_owned());
    let reference = hists
        .iter()
        .find(|h| !h.le.is_empty())
        .copied()
        .cloned()
        .unwrap_or_default();
    for i in first..=last {
        let mut line = format!("{:<16}", bucket_label(&reference, i));
        for h in &hists {
            let n = h.counts.get(i).copied().unwrap_or(0);
            let max = h.counts.iter().copied().max().unwrap_or(0);
            let _ = write!(line, "{:>7} {:<bar_width$} ", n, bar(n, max, bar_width));
        }
        out.push(line.trim_end().to_owned());
    }
}

/// `s` cut to `width` characters.
pub fn clip(s: &str, width: usize) -> String {
    s.chars().take(width).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::top::interval::Metric;

    #[test]
    fn parts_read_as_shares_of_the_query_time_largest_first() {
        let p = BTreeMap::from([
            ("cpu".to_owned(), 0.3),
            ("IO".to_owned(), 0.62),
            ("runnable".to_owned(), 0.05),
            ("Lock".to_owned(), 0.0),
            ("LWLock\n".to_owned(), 0.03),
        ]);
        assert_eq!(
            parts("time", &p, 1.0),
            "time: IO 62% cpu 30% runnable 5% LWLock? 3%"
        );
    }

    #[test]
    fn durations_and_bucket_labels_read_like_bpftrace() {
        assert_eq!(duration(1.024e-6), "1.0us");
        assert_eq!(duration(131_072e-9), "131us");
        assert_eq!(duration(0.0021), "2.1ms");
        assert_eq!(duration(17.18), "17s");
        let h = Hist {
            le: vec![1.024e-6, 2.048e-6, f64::INFINITY],
            counts: vec![1, 2, 3],
            sum_seconds: 0.0,
        };
        assert_eq!(bucket_label(&h, 0), "(0, 1.0us]");
        assert_eq!(bucket_label(&h, 1), "(1.0us, 2.0us]");
        assert_eq!(bucket_label(&h, 2), "(2.0us, ...)");
    }

    #[test]
    fn a_row_fits_80_columns_and_hostile_labels_stay_on_one_line() {
        let mut le: Vec<f64> = (10..=34).map(|k| (1u64 << k) as f64 * 1e-9).collect();
        le.push(f64::INFINITY);
        let mut counts = vec![0; le.len()];
        counts[3] = 99_999_999;
        counts[4] = 1;
        counts[25] = 7;
        let r = Row {
            metric: Metric::Syscall,
            key: [
                ("syscall".to_string(), "pread64".to_string()),
                ("app".into(), "postgres".into()),
                ("database".into(), "we\"ird\nname\x1b[2J".into()),
            ]
            .into_iter()
            .collect(),
            hist: Hist {
                le,
                counts,
                sum_seconds: 1.0,
            },
            parts: BTreeMap::new(),
        };
        let mut out = Vec::new();
        row(&mut out, &r, 2.0, 80);
        for l in &out {
            assert!(l.chars().count() <= 80, "{l:?}");
            assert!(!l.chars().any(|c| c.is_control()), "{l:?}");
        }
        assert_eq!(
            out[0],
            "syscall syscall=pread64 | app=postgres database=we\"ird?name?[2J"
        );
        assert!(
            out[2].starts_with("  (4.1us, 8.2us]   99999999 |@@@@"),
            "{}",
            out[2]
        );
        assert!(out[3].contains("       1 |@ "), "{}", out[3]);
        // 23 buckets from the first to the last non-empty one, each listed.
        assert_eq!(out.len(), 2 + 23 + 1);
        assert!(out[24].starts_with("  (17s, ...)"), "{}", out[24]);
    }
}
