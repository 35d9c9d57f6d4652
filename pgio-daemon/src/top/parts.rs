//! Where the queries of a `query` row spent their time over an interval: the increases of
//! `pgio_query_id_part_seconds_total` (on CPU, runnable, each wait event type), grouped like
//! the rows.
use std::collections::{BTreeMap, HashMap};

use prometheus_client::encoding::prometheus_protobuf::prometheus_data_model as pb;

use super::{
    interval::{Filter, LabelKey, label, label_key},
    scrape::Scrape,
};
use crate::query_id;

/// Per row key of `query` rows (the labels in `by`), the seconds each part of the queries took
/// over the interval: increases of `pgio_query_id_part_seconds_total` (a counter that went
/// down, the daemon restarted, counts from 0).
pub(super) fn query_parts(
    before: &Scrape,
    after: &Scrape,
    filter: &Filter,
    by: &[String],
) -> BTreeMap<BTreeMap<String, String>, BTreeMap<String, f64>> {
    let name = format!("{}_total", query_id::QUERY_ID_PART_SECONDS.name);
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
    let mut out: BTreeMap<BTreeMap<String, String>, BTreeMap<String, f64>> = BTreeMap::new();
    for (labels, value) in values(after) {
        if !filter.matches(&labels) {
            continue;
        }
        let was = earlier.get(&label_key(&labels)).copied().unwrap_or(0.0);
        let inc = if value >= was { value - was } else { value };
        let key: BTreeMap<String, String> = labels
            .iter()
            .filter(|l| by.contains(&l.name))
            .map(|l| (l.name.clone(), l.value.clone()))
            .collect();
        *out.entry(key)
            .or_default()
            .entry(label(&labels, "part").to_owned())
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
}
