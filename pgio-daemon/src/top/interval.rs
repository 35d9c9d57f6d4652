//! What happened between two scrapes: each histogram series' bucket deltas, filtered and
//! summed into rows.
use std::collections::{BTreeMap, HashMap};

use prometheus_client::encoding::prometheus_protobuf::prometheus_data_model as pb;
use serde::Serialize;

use super::scrape::Scrape;
use crate::{block_io, device_info::DEVICE_INFO, query_id, relation, syscall};

/// The histogram families `top` shows, by a short name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Metric {
    /// pread/pwrite/fsync/io_uring_enter time (`pgio_syscall_seconds`).
    Syscall,
    /// futex wait time (`pgio_futex_wait_seconds`).
    Futex,
    /// Block requests' device time, issue → complete (`pgio_block_io_device_seconds`).
    Device,
    /// Block requests' queue time, submission → issue (`pgio_block_io_queue_seconds`).
    Queue,
    /// Block requests' whole time, submission → complete (`pgio_block_io_seconds`).
    Block,
    /// Read/write/sync time per PostgreSQL relation (`pgio_relation_io_seconds`,
    /// `relations = true`).
    Relation,
    /// Query time per query id (`pgio_query_id_seconds`).
    Query,
    /// IO time in queries per query id (`pgio_query_id_io_seconds`).
    #[value(name = "query-io")]
    QueryIo,
}

impl Metric {
    pub fn family(self) -> &'static str {
        match self {
            Metric::Syscall => syscall::SYSCALL_SECONDS.name,
            Metric::Futex => syscall::FUTEX_WAIT_SECONDS.name,
            Metric::Device => block_io::DEVICE_SECONDS.name,
            Metric::Queue => block_io::QUEUE_SECONDS.name,
            Metric::Block => block_io::SECONDS.name,
            Metric::Relation => relation::RELATION_IO_SECONDS.name,
            Metric::Query => query_id::QUERY_ID_SECONDS.name,
            Metric::QueryIo => query_id::QUERY_ID_IO_SECONDS.name,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Metric::Syscall => "syscall",
            Metric::Futex => "futex",
            Metric::Device => "device",
            Metric::Queue => "queue",
            Metric::Block => "block",
            Metric::Relation => "relation",
            Metric::Query => "query",
            Metric::QueryIo => "query-io",
        }
    }

    /// What a row's parts say (`render::parts`).
    pub fn parts_name(self) -> &'static str {
        match self {
            Metric::Queue => "behind",
            _ => "time",
        }
    }

    /// Labels that split a row of this metric beyond the grouping ones: what was timed.
    pub fn own_labels(self) -> &'static [&'static str] {
        match self {
            Metric::Syscall | Metric::Relation => &["syscall", "cache"],
            Metric::Futex => &["syscall"],
            Metric::Device | Metric::Queue | Metric::Block => &["device", "op"],
            Metric::Query | Metric::QueryIo => &[],
        }
    }
}

/// Exact label matches a series must have; a series without the label does not match.
#[derive(Clone, Debug, Default)]
pub struct Filter(pub Vec<(String, String)>);

impl Filter {
    pub fn matches(&self, labels: &[pb::LabelPair]) -> bool {
        self.0
            .iter()
            .all(|(name, value)| labels.iter().any(|l| l.name == *name && l.value == *value))
    }
}

/// Non-cumulative counts per classic bucket, `le` ascending, `+Inf` last.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Hist {
    pub le: Vec<f64>,
    pub counts: Vec<u64>,
    pub sum_seconds: f64,
}

impl Hist {
    pub fn count(&self) -> u64 {
        self.counts.iter().sum()
    }

    fn add(&mut self, other: &Hist) {
        if self.le.is_empty() {
            *self = other.clone();
            return;
        }
        if self.le != other.le {
            return; // Not pgio's buckets: never mixed.
        }
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            *a += b;
        }
        self.sum_seconds += other.sum_seconds;
    }

    /// The q-quantile as Prometheus' `histogram_quantile` estimates it from classic buckets:
    /// linear within the bucket holding the rank, from 0 in the first; the highest finite
    /// bound if it falls in `+Inf`. `None` without observations.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        let total = self.count();
        if total == 0 {
            return None;
        }
        let rank = q * total as f64;
        let mut below = 0u64;
        for (i, &n) in self.counts.iter().enumerate() {
            if n > 0 && (below + n) as f64 >= rank {
                let upper = self.le[i];
                if upper.is_infinite() {
                    return self.le.iter().rev().find(|l| l.is_finite()).copied();
                }
                let lower = if i == 0 { 0.0 } else { self.le[i - 1] };
                return Some(lower + (upper - lower) * (rank - below as f64) / n as f64);
            }
            below += n;
        }
        self.le.iter().rev().find(|l| l.is_finite()).copied()
    }
}

/// A series' classic histogram, cumulative as exposed.
fn cumulative(h: &pb::Histogram) -> (Vec<f64>, Vec<u64>) {
    let mut le: Vec<f64> = h.bucket.iter().map(|b| b.upper_bound).collect();
    let mut cum: Vec<u64> = h.bucket.iter().map(|b| b.cumulative_count).collect();
    if le.last().is_none_or(|l| l.is_finite()) {
        le.push(f64::INFINITY);
        cum.push(h.sample_count);
    }
    (le, cum)
}

pub(super) type LabelKey = Vec<(String, String)>;

pub(super) fn label_key(labels: &[pb::LabelPair]) -> LabelKey {
    let mut k: LabelKey = labels
        .iter()
        .map(|l| (l.name.clone(), l.value.clone()))
        .collect();
    k.sort();
    k
}

/// One series' increase over the interval. A series that went backwards (a restarted daemon)
/// counts from zero.
fn increase(after: &pb::Histogram, before: Option<&pb::Histogram>) -> Hist {
    let (le, cum) = cumulative(after);
    let (before_le, before_cum) = before.map(cumulative).unwrap_or_default();
    let reset = before.is_some_and(|b| b.sample_count > after.sample_count)
        || (before.is_some() && before_le != le);
    let prev = |i: usize| {
        if reset {
            0
        } else {
            before_cum.get(i).copied().unwrap_or(0)
        }
    };
    let mut counts = Vec::with_capacity(cum.len());
    let mut last = 0u64;
    for (i, &c) in cum.iter().enumerate() {
        let c = c.saturating_sub(prev(i));
        counts.push(c.saturating_sub(last));
        last = c;
    }
    let before_sum = match before {
        Some(b) if !reset => b.sample_sum,
        _ => 0.0,
    };
    Hist {
        le,
        counts,
        sum_seconds: (after.sample_sum - before_sum).max(0.0),
    }
}

/// A row: one metric's series that share `key`, summed over the interval.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    pub metric: Metric,
    pub key: BTreeMap<String, String>,
    #[serde(skip)]
    pub hist: Hist,
    /// `query` rows: the queries' seconds by part (on CPU, runnable, each wait event type)
    /// over the interval (`pgio_query_id_part_seconds`); `queue` rows: the seconds of queue
    /// time blamed on each culprit (`pgio_block_io_queue_blame_seconds`). Filled in by
    /// `parts::rows`.
    #[serde(skip)]
    pub parts: BTreeMap<String, f64>,
}

/// Each series of `metric` matching `filter`: its increase from `before` to `after`.
pub fn series(
    before: &Scrape,
    after: &Scrape,
    metric: Metric,
    filter: &Filter,
) -> Vec<(Vec<pb::LabelPair>, Hist)> {
    let family = |s: &'_ Scrape| -> Vec<pb::Metric> {
        s.families
            .iter()
            .filter(|f| f.name == metric.family())
            .flat_map(|f| f.metric.iter().cloned())
            .collect()
    };
    let before_family = family(before);
    let earlier: HashMap<LabelKey, &pb::Histogram> = before_family
        .iter()
        .filter_map(|m| Some((label_key(&m.label), m.histogram.as_ref()?)))
        .collect();
    family(after)
        .into_iter()
        .filter(|m| filter.matches(&m.label))
        .filter_map(|m| {
            let h = m.histogram.as_ref()?;
            let inc = increase(h, earlier.get(&label_key(&m.label)).copied());
            Some((m.label, inc))
        })
        .collect()
}

/// The rows of `metrics` over the interval: series matching `filter`, grouped by the labels in
/// `by` and each metric's own ones, busiest first; rows without observations left out.
pub fn rows(
    before: &Scrape,
    after: &Scrape,
    metrics: &[Metric],
    filter: &Filter,
    by: &[String],
) -> Vec<Row> {
    let mut out: BTreeMap<(Metric, BTreeMap<String, String>), Hist> = BTreeMap::new();
    for &metric in metrics {
        for (labels, hist) in series(before, after, metric, filter) {
            let key: BTreeMap<String, String> = labels
                .into_iter()
                .filter(|l| by.contains(&l.name) || metric.own_labels().contains(&l.name.as_str()))
                .map(|l| (l.name, l.value))
                .collect();
            out.entry((metric, key)).or_default().add(&hist);
        }
    }
    let mut rows: Vec<Row> = out
        .into_iter()
        .filter(|(_, h)| h.count() > 0)
        .map(|((metric, key), hist)| Row {
            parts: BTreeMap::new(),
            metric,
            key,
            hist,
        })
        .collect();
    rows.sort_by_key(|r| std::cmp::Reverse(r.hist.count()));
    rows
}

/// A Longhorn volume's read path, top to bottom, as the volume dashboard draws it.
pub struct Layer {
    pub name: &'static str,
    pub hist: Hist,
}

/// Values of `label` on `pgio_device_info` series with `volume="<volume>"`.
fn volume_devices(s: &Scrape, volume: &str) -> Vec<String> {
    s.families
        .iter()
        .filter(|f| f.name == DEVICE_INFO.name)
        .flat_map(|f| &f.metric)
        .filter(|m| {
            m.label
                .iter()
                .any(|l| l.name == "volume" && l.value == volume)
        })
        .flat_map(|m| m.label.iter().filter(|l| l.name == "device"))
        .map(|l| l.value.clone())
        .collect()
}

pub(super) fn label<'a>(labels: &'a [pb::LabelPair], name: &str) -> &'a str {
    labels
        .iter()
        .find(|l| l.name == name)
        .map_or("", |l| l.value.as_str())
}

const PREADS: [&str; 3] = ["pread64", "preadv", "preadv2"];

/// PostgreSQL's reads that missed the page cache (of `pg_cluster`, if given), the volume's
/// device, the replicas' preads, and the replicas' backing disks.
pub fn volume_layers(
    before: &Scrape,
    after: &Scrape,
    volume: &str,
    cluster: Option<&str>,
) -> Vec<Layer> {
    let devices = volume_devices(after, volume);
    let sum = |metric: Metric, filter: Filter, keep: &dyn Fn(&[pb::LabelPair]) -> bool| {
        let mut h = Hist::default();
        for (labels, inc) in series(before, after, metric, &filter) {
            if keep(&labels) {
                h.add(&inc);
            }
        }
        h
    };
    let f = |pairs: &[(&str, &str)]| {
        Filter(
            pairs
                .iter()
                .map(|(n, v)| (n.to_string(), v.to_string()))
                .collect(),
        )
    };
    let mut pg = vec![("app", "postgres"), ("cache", "miss")];
    if let Some(c) = cluster {
        pg.push(("pg_cluster", c));
    }
    let is_pread = |l: &[pb::LabelPair]| PREADS.contains(&label(l, "syscall"));
    let on_volume_device = |l: &[pb::LabelPair]| devices.iter().any(|d| d == label(l, "device"));
    vec![
        Layer {
            name: "postgres miss",
            hist: sum(Metric::Syscall, f(&pg), &is_pread),
        },
        Layer {
            name: "volume device",
            hist: sum(Metric::Device, f(&[("op", "read")]), &on_volume_device),
        },
        Layer {
            name: "replica pread",
            hist: sum(
                Metric::Syscall,
                f(&[("app", "longhorn"), ("role", "replica"), ("volume", volume)]),
                &is_pread,
            ),
        },
        Layer {
            name: "replica disk",
            hist: sum(
                Metric::Device,
                f(&[
                    ("app", "longhorn"),
                    ("role", "replica"),
                    ("volume", volume),
                    ("op", "read"),
                ]),
                &|l| !on_volume_device(l),
            ),
        },
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hist(le: &[f64], counts: &[u64]) -> Hist {
        Hist {
            le: le.to_vec(),
            counts: counts.to_vec(),
            sum_seconds: 0.0,
        }
    }

    #[test]
    fn quantiles_interpolate_like_prometheus() {
        let h = hist(&[1.0, 2.0, 4.0, f64::INFINITY], &[0, 10, 10, 0]);
        assert_eq!(h.quantile(0.5), Some(2.0));
        assert_eq!(h.quantile(0.25), Some(1.5));
        assert_eq!(h.quantile(0.75), Some(3.0));
        assert_eq!(h.quantile(1.0), Some(4.0));
        let first = hist(&[1.0, 2.0, f64::INFINITY], &[4, 0, 0]);
        assert_eq!(first.quantile(0.5), Some(0.5));
        let inf = hist(&[1.0, 2.0, f64::INFINITY], &[1, 0, 9]);
        assert_eq!(inf.quantile(0.99), Some(2.0));
        assert_eq!(hist(&[1.0, f64::INFINITY], &[0, 0]).quantile(0.5), None);
    }

    fn pb_hist(count: u64, cum: &[u64]) -> pb::Histogram {
        pb::Histogram {
            sample_count: count,
            sample_sum: count as f64,
            bucket: cum
                .iter()
                .enumerate()
                .map(|(i, &c)| pb::Bucket {
                    cumulative_count: c,
                    upper_bound: (1u64 << i) as f64,
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn an_increase_is_per_bucket_and_a_reset_counts_from_zero() {
        let before = pb_hist(5, &[1, 3]);
        let after = pb_hist(12, &[2, 7]);
        let inc = increase(&after, Some(&before));
        assert_eq!(inc.counts, vec![1, 3, 3]);
        assert_eq!(inc.le, vec![1.0, 2.0, f64::INFINITY]);
        assert_eq!(inc.sum_seconds, 7.0);
        let restarted = pb_hist(2, &[1, 2]);
        assert_eq!(increase(&restarted, Some(&before)).counts, vec![1, 1, 0]);
        assert_eq!(increase(&after, None).counts, vec![2, 5, 5]);
    }
}
