//! A row's time split over an interval, from the increases of a counter grouped like the
//! rows: where the queries of a `query` row spent it (`pgio_query_id_part_seconds_total`: on
//! CPU, runnable, each wait event type), and behind whose requests a `queue` row waited
//! (`pgio_block_io_queue_blame_seconds_total`, by culprit).
use std::collections::{BTreeMap, HashMap};

use prometheus_client::encoding::prometheus_protobuf::prometheus_data_model as pb;

use super::{
    interval::{Filter, LabelKey, Metric, Row, label, label_key},
    scrape::Scrape,
};
use crate::{query_id, queue_blame};

/// Seconds per part, per row key.
type Parts = BTreeMap<BTreeMap<String, String>, BTreeMap<String, f64>>;

/// `interval::rows`, the `query` and `queue` ones with their parts over the interval.
pub(super) fn rows(
    before: &Scrape,
    after: &Scrape,
    metrics: &[Metric],
    filter: &Filter,
    by: &[String],
) -> Vec<Row> {
    let mut rows = super::interval::rows(before, after, metrics, filter, by);
    let has = |m: Metric| metrics.contains(&m);
    let (mut query, mut queue) = (Parts::new(), Parts::new());
    if has(Metric::Query) {
        query = query_parts(before, after, filter, by);
    }
    if has(Metric::Queue) {
        queue = queue_blame(before, after, filter, by);
    }
    for r in &mut rows {
        let parts = match r.metric {
            Metric::Query => &mut query,
            Metric::Queue => &mut queue,
            _ => continue,
        };
        r.parts = parts.remove(&r.key).unwrap_or_default();
    }
    rows
}

/// Per row key of `query` rows (the labels in `by`), the seconds each part of the queries took
/// over the interval.
pub(super) fn query_parts(
    before: &Scrape,
    after: &Scrape,
    filter: &Filter,
    by: &[String],
) -> Parts {
    let family = query_id::QUERY_ID_PART_SECONDS.name;
    increases(
        before,
        after,
        filter,
        family,
        |n| by.iter().any(|b| b == n),
        |l| label(l, "part").to_owned(),
    )
}

/// Per row key of `queue` rows (the labels in `by`, device and op), the seconds of queue time
/// blamed on each culprit over the interval: `app/role`, `/database` when it has one.
pub(super) fn queue_blame(
    before: &Scrape,
    after: &Scrape,
    filter: &Filter,
    by: &[String],
) -> Parts {
    let family = queue_blame::BLAME_SECONDS.name;
    let keep = |n: &str| by.iter().any(|b| b == n) || n == "device" || n == "op";
    increases(before, after, filter, family, keep, |l| {
        let mut who = label(l, "culprit_app").to_owned();
        for extra in ["culprit_role", "culprit_database"] {
            let v = label(l, extra);
            if !v.is_empty() {
                who = format!("{who}/{v}");
            }
        }
        who
    })
}

/// Increases of counter `family` from `before` to `after` (one that went down, the daemon
/// restarted, counts from 0), summed per row key (the labels `keep` names) and part.
fn increases(
    before: &Scrape,
    after: &Scrape,
    filter: &Filter,
    family: &str,
    keep: impl Fn(&str) -> bool,
    part: impl Fn(&[pb::LabelPair]) -> String,
) -> Parts {
    let name = format!("{family}_total");
    let values = |s: &Scrape| -> Vec<(Vec<pb::LabelPair>, f64)> {
        s.families
            .iter()
            .filter(|f| f.name == name)
            .flat_map(|f| &f.metric)
            .filter_map(|m| Some((m.label.clone(), m.counter.as_ref()?.value)))
            .collect()
    };
    let earlier: HashMap<LabelKey, f64> = values(before)
        .into_iter()
        .map(|(l, v)| (label_key(&l), v))
        .collect();
    let mut out = Parts::new();
    for (labels, value) in values(after) {
        if !filter.matches(&labels) {
            continue;
        }
        let was = earlier.get(&label_key(&labels)).copied().unwrap_or(0.0);
        let inc = if value >= was { value - was } else { value };
        let key: BTreeMap<String, String> = labels
            .iter()
            .filter(|l| keep(&l.name))
            .map(|l| (l.name.clone(), l.value.clone()))
            .collect();
        *out.entry(key)
            .or_default()
            .entry(part(&labels))
            .or_default() += inc;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts_scrape(values: &[(&str, &str, f64)]) -> Scrape {
        let pair = |name: &str, value: &str| pb::LabelPair {
            name: name.into(),
            value: value.into(),
        };
        Scrape {
            at: std::time::Instant::now(),
            families: vec![pb::MetricFamily {
                name: "pgio_query_id_part_seconds_total".into(),
                metric: values
                    .iter()
                    .map(|(queryid, part, v)| pb::Metric {
                        label: vec![
                            pair("database", "db"),
                            pair("queryid", queryid),
                            pair("part", part),
                        ],
                        counter: Some(pb::Counter {
                            value: *v,
                            ..Default::default()
                        }),
                        ..Default::default()
                    })
                    .collect(),
                ..Default::default()
            }],
        }
    }

    #[test]
    fn query_parts_are_the_interval_increases_per_row_key() {
        let before = parts_scrape(&[("1", "cpu", 1.0), ("1", "IO", 2.0), ("2", "IO", 5.0)]);
        let after = parts_scrape(&[
            ("1", "cpu", 1.5),
            ("1", "IO", 4.0),
            ("2", "IO", 1.0),
            ("3", "Lock", 0.25),
        ]);
        let by = vec!["database".to_owned(), "queryid".to_owned()];
        let parts = query_parts(&before, &after, &Filter::default(), &by);
        let of = |q: &str| {
            parts
                .get(&BTreeMap::from([
                    ("database".to_owned(), "db".to_owned()),
                    ("queryid".to_owned(), q.to_owned()),
                ]))
                .cloned()
                .unwrap_or_default()
        };
        assert_eq!(
            of("1"),
            BTreeMap::from([("IO".into(), 2.0), ("cpu".into(), 0.5)])
        );
        assert_eq!(of("2")["IO"], 1.0, "a counter that went down counts from 0");
        assert_eq!(of("3")["Lock"], 0.25, "new since");
        // Grouped by database only, the ids add up.
        let parts = query_parts(&before, &after, &Filter::default(), &by[..1]);
        let db = &parts[&BTreeMap::from([("database".to_owned(), "db".to_owned())])];
        assert_eq!(db["IO"], 3.0);
    }

    #[test]
    fn queue_rows_split_by_culprit_per_device_and_op() {
        let pair = |name: &str, value: &str| pb::LabelPair {
            name: name.into(),
            value: value.into(),
        };
        // (victim app, culprit labels, value)
        type Sample<'a> = (&'a str, &'a [(&'a str, &'a str)], f64);
        let scrape = |v: &[Sample]| Scrape {
            at: std::time::Instant::now(),
            families: vec![pb::MetricFamily {
                name: "pgio_block_io_queue_blame_seconds_total".into(),
                metric: v
                    .iter()
                    .map(|(app, culprit, value)| {
                        let mut label =
                            vec![pair("device", "sdb"), pair("op", "read"), pair("app", app)];
                        label.extend(culprit.iter().map(|(n, v)| pair(n, v)));
                        pb::Metric {
                            label,
                            counter: Some(pb::Counter {
                                value: *value,
                                ..Default::default()
                            }),
                            ..Default::default()
                        }
                    })
                    .collect(),
                ..Default::default()
            }],
        };
        let vacuum: &[(&str, &str)] = &[
            ("culprit_app", "postgres"),
            ("culprit_role", "autovacuum worker"),
            ("culprit_database", "shop"),
        ];
        let rest: &[(&str, &str)] = &[("culprit_app", "(rest)")];
        let before = scrape(&[("postgres", vacuum, 1.0), ("postgres", rest, 0.5)]);
        let after = scrape(&[
            ("postgres", vacuum, 4.0),
            ("postgres", rest, 1.0),
            ("fio", vacuum, 2.0),
        ]);
        let by = vec!["app".to_owned()];
        let parts = queue_blame(&before, &after, &Filter::default(), &by);
        let key = |app: &str| {
            BTreeMap::from([
                ("app".to_owned(), app.to_owned()),
                ("device".to_owned(), "sdb".to_owned()),
                ("op".to_owned(), "read".to_owned()),
            ])
        };
        let pg = &parts[&key("postgres")];
        assert_eq!(pg["postgres/autovacuum worker/shop"], 3.0);
        assert_eq!(pg["(rest)"], 0.5);
        assert_eq!(parts[&key("fio")]["postgres/autovacuum worker/shop"], 2.0);
    }
}
