//! The Grafana dashboards in `dashboards/` against real data.
//!
//! `dashboards_are_well_formed` (no root): each file is JSON in Grafana 10/11's schema with
//! unique panel ids, non-overlapping panels, the `${datasource}` Prometheus variable on every
//! panel, target and query variable, no UIDs but the dashboard's own, and no undefined
//! variable in a query; heatmap panels (every one in [`HEATMAPS`] present) draw pgio's `le`
//! buckets as they are (`format: heatmap`, `calculate: false`, `sum by (le)`).
//!
//! `every_panel_query_returns_data` (root): the Longhorn stand-in (2 replicas, the volume's
//! loop device given mq-deadline like a real Longhorn SCSI disk), ext4 and PostgreSQL 15 on
//! it, pgio (`bpf_stats = true`) and two real Prometheus scraping pgio every second, one
//! keeping classic histograms, one native histograms only (`_bucket`, `_sum`, `_count` are not
//! there: every panel but the heatmaps must still have data, read with `histogram_sum`,
//! `histogram_count`, `histogram_quantile` on the native series, joined with `or`). A
//! CHECKPOINT, `pgbench -S` at 1,000 tps for 15 s from a cold cache, `pgbench -N` for 3 s (WAL
//! flushes, WALWriteLock waits), another CHECKPOINT. Then every dashboard's variables are
//! resolved through Prometheus' API as Grafana does (`label_values(...)` → the label values
//! API, then Grafana's escaping for single values, multiple values and "All"), and every panel
//! target is run with `/api/v1/query` (`$__rate_interval` = 15 s): it must parse and — but for
//! the targets in [`MAY_BE_EMPTY`], each with its reason — return at least one series with a
//! finite value, and a heatmap target one cumulative series per `le` up to `+Inf` with
//! observations. Once with the variables' defaults ("All" where offered), and once more,
//! parse-only, with one concrete value each. Every recording rule of deploy/mixin returns data
//! on both Prometheus too. `--nocapture` prints every target's result.
//! `PGIO_DASHBOARDS_HOLD_SECS=<n>` keeps everything up for n seconds before the queries and
//! prints Prometheus' address, to try queries by hand.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::{longhorn_daemon, pg_on_longhorn};
use pgio_testkit::serde_json::{self, Value};
use pgio_testkit::{
    Prometheus,
    kubepods::{self, Driver, PodCgroup, PodLogs},
    require_root,
};

/// The pod the dashboards' PostgreSQL runs in.
const NAMESPACE: &str = "pgio-dash";
const POD: &str = "pg-dash-0";

const DASHBOARDS: [&str; 3] = ["pgio-postgres", "pgio-longhorn-volume", "pgio-self"];

/// Targets allowed to return no series (or only NaN) in this scenario: (dashboard uid, panel
/// title, refId, why).
const MAY_BE_EMPTY: &[(&str, &str, &str, &str)] = &[(
    "pgio-self",
    "Unmatched and lost block completions per second",
    "B",
    "a lost completion is the kernel skipping pgio's program (README), 0 in most windows",
)];

/// Why a heatmap is empty on a Prometheus that keeps native histograms only.
const NATIVE_HEATMAPS: &str = "heatmaps draw the classic `le` buckets (README: keep them next \
     to native ones); every other panel reads native histograms too";

/// Heatmap panels each dashboard must have (dashboard uid, title): the latency distributions a
/// user reads like bpftrace's log2 histograms.
const HEATMAPS: &[(&str, &str)] = &[
    ("pgio-postgres", "Query duration heatmap"),
    ("pgio-postgres", "IO time per query heatmap"),
    (
        "pgio-postgres",
        "Read latency heatmap, page-cache misses: $role",
    ),
    (
        "pgio-postgres",
        "Read latency heatmap, page-cache hits: $role",
    ),
    ("pgio-postgres", "fsync / fdatasync latency heatmap"),
    (
        "pgio-postgres",
        "Off-CPU wait heatmap: $wait_type (processes other than client backends)",
    ),
    (
        "pgio-postgres",
        "Query wait heatmap: $wait_type (client backends inside their queries)",
    ),
    (
        "pgio-postgres",
        "Block IO time heatmap: $device (submission → complete)",
    ),
    (
        "pgio-longhorn-volume",
        "Read latency heatmap: PostgreSQL reads that missed the page cache",
    ),
    (
        "pgio-longhorn-volume",
        "Read latency heatmap: the volume's device ($device)",
    ),
    (
        "pgio-longhorn-volume",
        "Read latency heatmap: replica pread64",
    ),
    (
        "pgio-longhorn-volume",
        "Read latency heatmap: the replicas' backing disks",
    ),
];

/// A heatmap panel draws pgio's buckets as they are: cumulative `le` series per interval
/// (`format: heatmap` turns them into per-bucket counts), never re-bucketed by Grafana.
fn check_heatmap(name: &str, p: &Value) {
    let title = str_of(p, "title").unwrap_or("");
    let options = p.get("options").expect("heatmap options");
    assert_eq!(
        options.get("calculate").and_then(Value::as_bool),
        Some(false),
        "{name}: {title:?}: options.calculate must be false (pgio's buckets, not Grafana's)"
    );
    assert_eq!(
        options.pointer("/yAxis/unit").and_then(Value::as_str),
        Some("s"),
        "{name}: {title:?}: y axis in seconds"
    );
    for t in array_of(p, "targets") {
        let expr = str_of(t, "expr").unwrap_or("");
        assert_eq!(str_of(t, "format"), Some("heatmap"), "{name}: {title:?}");
        assert_eq!(
            str_of(t, "legendFormat"),
            Some("{{le}}"),
            "{name}: {title:?}"
        );
        assert!(
            expr.starts_with("sum by (le) (rate(") && expr.contains("_bucket{"),
            "{name}: {title:?}: want sum by (le) (rate(<histogram>_bucket{{...}})): {expr}"
        );
    }
}

/// A heatmap query's result: one series per `le` and nothing else, cumulative (non-decreasing
/// in `le`), with observations in the window.
fn heatmap_shape(res: &[pgio_testkit::PromSample]) -> Result<(), String> {
    let mut by_le: Vec<(f64, f64)> = Vec::new();
    for s in res {
        if s.labels.keys().any(|k| k != "le") {
            return Err(format!("labels other than le: {:?}", s.labels));
        }
        let le = s.labels.get("le").ok_or("a series without le")?;
        let le: f64 = if le == "+Inf" {
            f64::INFINITY
        } else {
            le.parse().map_err(|e| format!("le {le:?}: {e}"))?
        };
        by_le.push((le, s.value));
    }
    by_le.sort_by(|a, b| a.0.total_cmp(&b.0));
    if by_le.len() < 2
        || by_le
            .last()
            .is_none_or(|l| !l.0.is_infinite() || l.1 <= 0.0)
    {
        return Err(format!(
            "want buckets up to +Inf with observations: {by_le:?}"
        ));
    }
    if by_le.windows(2).any(|w| w[1].1 + 1e-9 < w[0].1) {
        return Err(format!("not cumulative: {by_le:?}"));
    }
    Ok(())
}

const RATE_INTERVAL: &str = "15s";
const INTERVAL: &str = "5s";
const PGBENCH_SECS: u32 = 15;

fn dashboards_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../dashboards")
}

fn load(name: &str) -> Value {
    let path = dashboards_dir().join(format!("{name}.json"));
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: not JSON: {e}", path.display()))
}

fn str_of<'a>(j: &'a Value, key: &str) -> Option<&'a str> {
    j.get(key).and_then(Value::as_str)
}

fn bool_of(j: &Value, key: &str) -> bool {
    j.get(key).and_then(Value::as_bool).unwrap_or(false)
}

/// The array member `key` of `j`; empty if missing or not an array.
fn array_of<'a>(j: &'a Value, key: &str) -> &'a [Value] {
    j.get(key)
        .and_then(Value::as_array)
        .map_or(&[], Vec::as_slice)
}

/// Every panel, rows' nested `panels` included.
fn panels(d: &Value) -> Vec<&Value> {
    fn walk<'a>(list: &'a [Value], out: &mut Vec<&'a Value>) {
        for p in list {
            out.push(p);
            if let Some(nested) = p.get("panels").and_then(Value::as_array) {
                walk(nested, out);
            }
        }
    }
    let mut out = Vec::new();
    walk(array_of(d, "panels"), &mut out);
    out
}

/// (panel title, refId, expr) of every query target.
fn targets(d: &Value) -> Vec<(String, String, String)> {
    let mut out = Vec::new();
    for p in panels(d) {
        for t in array_of(p, "targets") {
            out.push((
                str_of(p, "title").unwrap_or("").to_owned(),
                str_of(t, "refId").unwrap_or("").to_owned(),
                str_of(t, "expr").unwrap_or("").to_owned(),
            ));
        }
    }
    out
}

fn variables(d: &Value) -> &[Value] {
    d.get("templating").map_or(&[], |t| array_of(t, "list"))
}

/// A query variable's query text (`query.query`, or a plain string).
fn variable_query(v: &Value) -> Option<&str> {
    match v.get("query")? {
        Value::String(s) => Some(s.as_str()),
        q => str_of(q, "query"),
    }
}

/// Names of `$name`, `${name}`, `${name:fmt}` and `[[name]]` references in `text`.
fn references(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let b = text.as_bytes();
    let ident = |from: usize| {
        let mut i = from;
        while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_') {
            i += 1;
        }
        i
    };
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'$' {
            if b.get(i + 1) == Some(&b'{') {
                let end = ident(i + 2);
                out.push(text[i + 2..end].to_owned());
                i = end;
                continue;
            }
            let end = ident(i + 1);
            if end > i + 1 {
                out.push(text[i + 1..end].to_owned());
            }
            i = end.max(i + 1);
        } else if text[i..].starts_with("[[") {
            let end = ident(i + 2);
            out.push(text[i + 2..end].to_owned());
            i = end;
        } else {
            i += 1;
        }
    }
    out
}

const BUILTINS: [&str; 7] = [
    "__rate_interval",
    "__interval",
    "__interval_ms",
    "__range",
    "__range_s",
    "__range_ms",
    "__name",
];

/// Every `"uid"` member anywhere in `j`, with `"datasource"` objects checked on the way.
fn walk_uids<'a>(j: &'a Value, path: &str, uids: &mut Vec<(String, &'a str)>) {
    match j {
        Value::Object(members) => {
            for (k, v) in members {
                let p = format!("{path}.{k}");
                if k == "uid"
                    && let Some(s) = v.as_str()
                {
                    uids.push((p.clone(), s));
                }
                if k == "datasource" && matches!(v, Value::Object(_)) {
                    assert_eq!(
                        str_of(v, "uid"),
                        Some("${datasource}"),
                        "{p}: datasource must be the ${{datasource}} variable"
                    );
                    assert_eq!(str_of(v, "type"), Some("prometheus"), "{p}");
                }
                walk_uids(v, &p, uids);
            }
        }
        Value::Array(items) => {
            for (i, v) in items.iter().enumerate() {
                walk_uids(v, &format!("{path}[{i}]"), uids);
            }
        }
        _ => {}
    }
}

#[test]
fn dashboards_are_well_formed() {
    let mut titles = BTreeSet::new();
    for name in DASHBOARDS {
        let d = load(name);
        assert_eq!(str_of(&d, "uid"), Some(name), "{name}: uid = file name");
        assert!(
            titles.insert(str_of(&d, "title").unwrap_or("").to_owned()),
            "{name}: title used twice"
        );
        let schema = d
            .get("schemaVersion")
            .and_then(Value::as_f64)
            .unwrap_or(0.0);
        assert!(
            (36.0..=41.0).contains(&schema),
            "{name}: schemaVersion {schema} is not Grafana 10/11's"
        );

        // Variables: the datasource first, then query variables on it.
        let vars = variables(&d);
        let first = vars.first().expect("variables");
        assert_eq!(str_of(first, "name"), Some("datasource"), "{name}");
        assert_eq!(str_of(first, "type"), Some("datasource"), "{name}");
        assert_eq!(str_of(first, "query"), Some("prometheus"), "{name}");
        let mut defined: BTreeSet<String> = BUILTINS.iter().map(|s| s.to_string()).collect();
        defined.insert("datasource".into());
        for v in &vars[1..] {
            let vname = str_of(v, "name").expect("variable name");
            assert_eq!(str_of(v, "type"), Some("query"), "{name}: ${vname}");
            let q = variable_query(v).unwrap_or_else(|| panic!("{name}: ${vname} has no query"));
            assert!(q.starts_with("label_values("), "{name}: ${vname}: {q}");
            for r in references(q) {
                assert!(
                    defined.contains(&r),
                    "{name}: ${vname} uses ${r}, which is not defined before it"
                );
            }
            assert!(defined.insert(vname.to_owned()), "{name}: ${vname} twice");
        }

        // UIDs: the dashboard's own, else the datasource variable.
        let mut uids = Vec::new();
        walk_uids(&d, "", &mut uids);
        for (path, uid) in uids {
            assert!(
                (path == ".uid" && uid == name) || uid == "${datasource}",
                "{name}: {path} = {uid:?}: no hard-coded UIDs"
            );
        }

        // Panels: unique ids, inside the 24-column grid, no overlaps, targets with queries.
        let all = panels(&d);
        assert!(!all.is_empty(), "{name}: no panels");
        let mut ids = BTreeSet::new();
        let mut boxes: Vec<(String, [f64; 4])> = Vec::new();
        for p in &all {
            let title = str_of(p, "title").unwrap_or("").to_owned();
            let id = p.get("id").and_then(Value::as_f64).expect("panel id");
            assert!(ids.insert(id as i64), "{name}: panel id {id} used twice");
            let g = p.get("gridPos").expect("gridPos");
            let n = |k: &str| g.get(k).and_then(Value::as_f64).expect("gridPos field");
            let b = [n("x"), n("y"), n("w"), n("h")];
            assert!(
                b[0] >= 0.0 && b[0] + b[2] <= 24.0,
                "{name}: {title:?} outside the grid"
            );
            for (other, o) in &boxes {
                let overlap = b[0] < o[0] + o[2]
                    && o[0] < b[0] + b[2]
                    && b[1] < o[1] + o[3]
                    && o[1] < b[1] + b[3];
                assert!(!overlap, "{name}: {title:?} overlaps {other:?}");
            }
            boxes.push((title.clone(), b));
            if str_of(p, "type") == Some("row") {
                continue;
            }
            if str_of(p, "type") == Some("heatmap") {
                check_heatmap(name, p);
            }
            let ts = array_of(p, "targets");
            assert!(!ts.is_empty(), "{name}: {title:?} has no targets");
            let mut refs = BTreeSet::new();
            for t in ts {
                let r = str_of(t, "refId").unwrap_or("");
                assert!(refs.insert(r), "{name}: {title:?}: refId {r:?} twice");
                let expr = str_of(t, "expr").unwrap_or("");
                assert!(!expr.trim().is_empty(), "{name}: {title:?} {r}: no expr");
                for v in references(expr) {
                    assert!(
                        defined.contains(&v),
                        "{name}: {title:?} {r} uses undefined ${v}"
                    );
                }
            }
        }
    }
    for (uid, title) in HEATMAPS {
        let d = load(uid);
        assert!(
            panels(&d)
                .iter()
                .any(|p| str_of(p, "type") == Some("heatmap") && str_of(p, "title") == Some(title)),
            "{uid}: no heatmap panel {title:?}"
        );
    }
    // Every listed exception names a target that exists.
    for (uid, title, r, _) in MAY_BE_EMPTY {
        let d = load(uid);
        assert!(
            targets(&d).iter().any(|(t, rr, _)| t == title && rr == r),
            "MAY_BE_EMPTY names {uid} / {title:?} / {r}, which does not exist"
        );
    }
}

// ---------------------------------------------------------------------------------------
// Grafana's variable interpolation for the Prometheus datasource
// ---------------------------------------------------------------------------------------

/// What a variable is set to.
#[derive(Debug, Clone)]
struct Selection {
    /// The chosen values (all of them for "All").
    values: Vec<String>,
    all: bool,
    all_value: Option<String>,
    /// `multi` or `includeAll`: Grafana regex-escapes such a variable's values.
    regex: bool,
}

/// Grafana's `prometheusRegularEscape` (single-value variables).
fn regular_escape(v: &str) -> String {
    v.replace('\\', "\\\\").replace('\'', "\\\\'")
}

/// Grafana's `prometheusSpecialRegexEscape` (multi-value and "All" variables).
fn regex_escape(v: &str) -> String {
    let mut out = String::new();
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\\\\\"),
            '$' | '^' | '*' | '{' | '}' | '[' | ']' | '\'' | '+' | '?' | '.' | '(' | ')' | '|' => {
                out.push_str("\\\\");
                out.push(c);
            }
            _ => out.push(c),
        }
    }
    out
}

/// How Grafana writes a selection into a Prometheus query (`interpolateQueryExpr`).
fn format_selection(s: &Selection) -> String {
    if s.all
        && let Some(a) = &s.all_value
    {
        return a.clone();
    }
    if !s.regex {
        return regular_escape(s.values.first().map_or("", String::as_str));
    }
    let escaped: Vec<String> = s.values.iter().map(|v| regex_escape(v)).collect();
    if escaped.len() == 1 {
        escaped[0].clone()
    } else {
        format!("({})", escaped.join("|"))
    }
}

/// Replaces `$name`, `${name}` and `[[name]]` with `vars[name]`; an unknown name is an error.
fn interpolate(text: &str, vars: &BTreeMap<String, String>) -> Result<String, String> {
    let b = text.as_bytes();
    let ident = |from: usize| {
        let mut i = from;
        while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_') {
            i += 1;
        }
        i
    };
    let mut out = String::new();
    let mut i = 0;
    while i < b.len() {
        let (name, next) = if b[i] == b'$' && b.get(i + 1) == Some(&b'{') {
            let end = ident(i + 2);
            if b.get(end) != Some(&b'}') {
                return Err(format!("unsupported variable syntax at {:?}", &text[i..]));
            }
            (&text[i + 2..end], end + 1)
        } else if b[i] == b'$' && ident(i + 1) > i + 1 {
            let end = ident(i + 1);
            (&text[i + 1..end], end)
        } else if text[i..].starts_with("[[") {
            let end = ident(i + 2);
            (&text[i + 2..end], end + 2)
        } else {
            let c = text[i..].chars().next().unwrap_or_default();
            out.push(c);
            i += c.len_utf8();
            continue;
        };
        let value = vars
            .get(name)
            .ok_or_else(|| format!("undefined variable ${name}"))?;
        out.push_str(value);
        i = next;
    }
    Ok(out)
}

/// `label_values(<selector>, <label>)` or `label_values(<label>)`.
fn parse_label_values(q: &str) -> Option<(Option<&str>, &str)> {
    let inner = q.trim().strip_prefix("label_values(")?.strip_suffix(')')?;
    Some(match inner.rfind(',') {
        Some(i) => (Some(inner[..i].trim()), inner[i + 1..].trim()),
        None => (None, inner.trim()),
    })
}

/// Resolves a dashboard's variables in order through Prometheus. With `concrete`, every
/// variable is set to one value (`prefer` if it offers it, else its first); without, to its
/// default: "All" where offered, else `prefer`/first. Each variable must have values.
fn resolve_variables(
    prom: &Prometheus,
    d: &Value,
    builtins: &BTreeMap<String, String>,
    prefer: &BTreeMap<&str, String>,
    concrete: bool,
    report: &mut Vec<String>,
) -> BTreeMap<String, String> {
    let uid = str_of(d, "uid").unwrap_or("");
    let mut vars = builtins.clone();
    vars.insert("datasource".into(), "prometheus".into());
    for v in &variables(d)[1..] {
        let name = str_of(v, "name").unwrap_or("");
        let q = variable_query(v).unwrap_or("");
        let q = interpolate(q, &vars).unwrap_or_else(|e| panic!("{uid}: ${name}: {e}"));
        let (selector, label) =
            parse_label_values(&q).unwrap_or_else(|| panic!("{uid}: ${name}: {q}"));
        let values = prom
            .label_values(label, selector.as_slice())
            .unwrap_or_else(|e| panic!("{uid}: ${name}: {q}: {e:#}"));
        assert!(!values.is_empty(), "{uid}: ${name}: {q} has no values");
        let include_all = bool_of(v, "includeAll");
        let preferred = prefer.get(name);
        if let Some(p) = preferred {
            assert!(
                values.contains(p),
                "{uid}: ${name}: {q} gives {values:?}, without {p:?}"
            );
        }
        let all = include_all && !concrete;
        let chosen = if all {
            values.clone()
        } else {
            vec![preferred.cloned().unwrap_or_else(|| values[0].clone())]
        };
        let s = Selection {
            values: chosen,
            all,
            all_value: str_of(v, "allValue").map(str::to_owned),
            regex: include_all || bool_of(v, "multi"),
        };
        let formatted = format_selection(&s);
        report.push(format!(
            "{uid}: ${name} = {} → {formatted}",
            if all {
                format!("All of {values:?}")
            } else {
                format!("{:?}", s.values)
            }
        ));
        vars.insert(name.to_owned(), formatted);
    }
    vars
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_secs_f64()
}

/// deploy/mixin/pgio-rules.yaml's recording rules: (record, expr).
fn recording_rules() -> Vec<(String, String)> {
    let file = dashboards_dir().join("../deploy/mixin/pgio-rules.yaml");
    let text = std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    let doc: Value = serde_yaml_ng::from_str(&text).expect("pgio-rules.yaml");
    let rules: Vec<(String, String)> = array_of(&doc, "groups")
        .iter()
        .flat_map(|g| array_of(g, "rules"))
        .filter_map(|r| {
            Some((
                str_of(r, "record")?.to_owned(),
                str_of(r, "expr")?.to_owned(),
            ))
        })
        .collect();
    assert!(rules.len() >= 6, "{} recording rules", rules.len());
    rules
}

#[test]
fn every_panel_query_returns_data() {
    if !require_root("every_panel_query_returns_data") {
        return;
    }
    let t0 = Instant::now();
    let cluster = format!("15/dash-{}", std::process::id());
    let cluster_name = format!("'{cluster}'");
    let mut s = pg_on_longhorn(
        None,
        56_430,
        &[
            ("cluster_name", cluster_name.as_str()),
            // pgbench's statements get query ids (the query id panels).
            ("compute_query_id", "on"),
        ],
    );
    let setup = t0.elapsed();

    // A real Longhorn volume is a SCSI disk with mq-deadline; the stand-in's loop device has
    // no scheduler, so no request would be queued (the queue-time panel).
    let _deadline =
        pgio_testkit::QueueKnobs::set(s.vol.device_name(), &[("scheduler", "mq-deadline")]);

    // The cluster runs in a kubelet-shaped pod (the dashboard's namespace and pod variables).
    let logs = PodLogs::create(&s.dir.path().join("log")).expect("pod log dirs");
    let (uid, container_id) = kubepods::ids(11);
    let pod_cgroup = PodCgroup::create(Driver::Systemd, &uid, &container_id).expect("pod cgroup");
    logs.add(NAMESPACE, POD, &uid, "postgres", &container_id)
        .expect("pod logs");
    let daemon = longhorn_daemon(
        &s.vol,
        &format!(
            "bpf_stats = true\nrescan_interval_secs = 1\nquery_probes = true\nrelations = true\n\
             max_relations = 5\nmax_query_ids = 20\n{}",
            logs.config()
        ),
    );
    let target = daemon.url.trim_start_matches("http://").to_owned();
    let prom = Prometheus::start("pgio", &[&target]).expect("prometheus");
    // The same scrapes kept as native histograms only (no `_bucket`, `_sum`, `_count` series).
    let native = Prometheus::start_with("pgio", &[&target], &["native-histograms"])
        .expect("prometheus, native histograms");
    let prom_start = unix_now();
    s.pg.start().expect("start cold");
    // As if the kubelet had started it there: the running cluster moves in, children follow.
    pod_cgroup
        .enter(s.pg.postmaster_pid().expect("postmaster"))
        .expect("move postmaster");
    for pid in s.pg.child_pids().expect("children") {
        pod_cgroup.enter(pid).expect("move child");
    }
    let in_pod =
        pgio_testkit::wait_until(Duration::from_secs(10), Duration::from_millis(50), || {
            daemon.scrape().is_ok_and(|m| {
                m.sum(
                    "pgio_tracked_processes",
                    &[("app", "postgres"), ("role", "checkpointer"), ("pod", POD)],
                ) >= 1.0
            })
        });
    assert!(in_pod, "the checkpointer is not tracked in its pod");
    daemon
        .wait_tracked("longhorn", "replica")
        .expect("replicas");
    for p in [&prom, &native] {
        p.wait_up("pgio", Duration::from_secs(20))
            .expect("prometheus scrapes pgio");
    }
    // A connected client at query time (for the tracked-processes panels).
    let _session = s.pg.session("postgres", "postgres").expect("psql session");
    // A series counts for rate() from its second sample on: this first checkpoint creates the
    // checkpointer's fsync/pwrite64 series, so that the last one's show in the window.
    s.pg.psql("checkpoint").expect("checkpoint");

    // Cold reads through the volume, at a rate 2 vCPUs keep up with.
    s.pg.pgbench_ok(&[
        "-S",
        "-c",
        "4",
        "-j",
        "2",
        "-R",
        "1000",
        "-T",
        &PGBENCH_SECS.to_string(),
        "postgres",
    ])
    .expect("pgbench -S");
    // A burst of commits: WAL flushes by backends and walwriter, and backends waiting for
    // WALWriteLock on their semaphores (futex).
    s.pg.pgbench_ok(&["-N", "-c", "4", "-j", "2", "-T", "3", "postgres"])
        .expect("pgbench -N");
    s.pg.psql("checkpoint").expect("checkpoint");
    // Two scrapes after the checkpoint.
    std::thread::sleep(Duration::from_millis(2500));
    let at = unix_now();
    if let Some(secs) = std::env::var("PGIO_DASHBOARDS_HOLD_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        eprintln!(
            "holding {secs} s: Prometheus {}, pgio {}/metrics",
            prom.url, daemon.url
        );
        std::thread::sleep(Duration::from_secs(secs));
    }

    let range_s = (at - prom_start).ceil() as u64;
    let builtins: BTreeMap<String, String> = [
        ("__rate_interval", RATE_INTERVAL.to_owned()),
        ("__interval", INTERVAL.to_owned()),
        ("__interval_ms", "5000".to_owned()),
        ("__range", format!("{range_s}s")),
        ("__range_s", range_s.to_string()),
        ("__range_ms", (range_s * 1000).to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect();
    // Values of this scenario (other volumes or clusters on the machine may be offered too).
    let prefer: BTreeMap<&str, String> = [
        ("pg_cluster", cluster.clone()),
        ("namespace", NAMESPACE.to_owned()),
        ("pod", POD.to_owned()),
        ("volume", s.vol.volume().to_owned()),
        ("device", s.vol.device_name().to_owned()),
        ("instance", target.clone()),
        ("database", "postgres".to_owned()),
        ("user", "postgres".to_owned()),
        ("role", "client backend".to_owned()),
    ]
    .into_iter()
    .collect();

    let mut report = Vec::new();
    let mut failures = Vec::new();
    let mut empty_as_allowed = Vec::new();
    let mut listed_but_data = Vec::new();
    let mut n_queries = 0;
    // The native one really keeps no classic series: every histogram reading there goes
    // through the native alternative.
    let buckets = |p: &Prometheus| {
        p.query(r#"count({__name__=~"pgio_.+_bucket"})"#, Some(at))
            .expect("count buckets")
            .first()
            .map_or(0.0, |s| s.value)
    };
    let (classic_buckets, native_buckets) = (buckets(&prom), buckets(&native));
    eprintln!("_bucket series: classic {classic_buckets}, native-only {native_buckets}");
    assert!(classic_buckets > 0.0 && native_buckets == 0.0);
    for (mode, prom) in [("classic", &prom), ("native", &native)] {
        for name in DASHBOARDS {
            let d = load(name);
            let heatmaps: BTreeSet<&str> = panels(&d)
                .into_iter()
                .filter(|p| str_of(p, "type") == Some("heatmap"))
                .filter_map(|p| str_of(p, "title"))
                .collect();
            for concrete in [false, true] {
                let vars = resolve_variables(prom, &d, &builtins, &prefer, concrete, &mut report);
                for (title, r, expr) in targets(&d) {
                    let q = interpolate(&expr, &vars)
                        .unwrap_or_else(|e| panic!("{name}: {title:?} {r}: {e}"));
                    n_queries += 1;
                    let name = format!("{mode}: {name}");
                    let res = match prom.query(&q, Some(at)) {
                        Ok(res) => res,
                        Err(e) => {
                            failures.push(format!("{name} / {title} / {r}: {e:#}\n    {q}"));
                            continue;
                        }
                    };
                    if concrete {
                        continue;
                    }
                    let heatmap = heatmaps.contains(title.as_str());
                    if heatmap
                        && mode == "classic"
                        && let Err(e) = heatmap_shape(&res)
                    {
                        failures.push(format!("{name} / {title} / {r}: heatmap: {e}\n    {q}"));
                    }
                    let finite: Vec<_> = res.iter().filter(|s| s.value.is_finite()).collect();
                    let allowed = MAY_BE_EMPTY
                        .iter()
                        .find(|(u, t, rr, _)| {
                            name.ends_with(&format!(": {u}")) && *t == title && *rr == r
                        })
                        .map(|(_, _, _, why)| *why)
                        .or((heatmap && mode == "native").then_some(NATIVE_HEATMAPS));
                    let first = finite.first().map(|s| {
                        let labels: Vec<String> =
                            s.labels.iter().map(|(k, v)| format!("{k}={v:?}")).collect();
                        format!("{{{}}} {:.6e}", labels.join(","), s.value)
                    });
                    report.push(format!(
                        "{name} / {title} / {r}: {} series, {} finite{}",
                        res.len(),
                        finite.len(),
                        first.map_or(String::new(), |f| format!(", e.g. {f}"))
                    ));
                    match (finite.is_empty(), allowed) {
                    (true, Some(why)) => {
                        empty_as_allowed.push(format!("{name} / {title} / {r}: {why}"))
                    }
                    (true, None) => failures.push(format!(
                        "{name} / {title} / {r}: no series with a finite value ({} series)\n    {q}",
                        res.len()
                    )),
                    (false, Some(_)) => listed_but_data.push(format!("{name} / {title} / {r}")),
                    (false, None) => {}
                }
                }
            }
        }
    }
    // The mixin's recording rules read histograms the same two ways: each returns data on both.
    for (mode, prom) in [("classic", &prom), ("native", &native)] {
        for (record, expr) in recording_rules() {
            n_queries += 1;
            match prom.query(&expr, Some(at)) {
                Ok(res) => {
                    let finite = res.iter().filter(|s| s.value.is_finite()).count();
                    report.push(format!(
                        "{mode}: rule {record}: {} series, {finite} finite",
                        res.len()
                    ));
                    if finite == 0 {
                        failures.push(format!(
                            "{mode}: rule {record}: no finite value\n    {expr}"
                        ));
                    }
                }
                Err(e) => failures.push(format!("{mode}: rule {record}: {e:#}\n    {expr}")),
            }
        }
    }
    // The volume dashboard's cluster variable is derived from the volume's block IO: ours.
    let clusters = prom
        .label_values(
            "pg_cluster",
            &[&format!(
                "pgio_block_io_requests_total{{volume=\"{}\",app=\"postgres\"}}",
                s.vol.volume()
            )],
        )
        .expect("clusters on the volume");
    // Only ours: the postmaster is held provisional until its cluster_name is known, so its
    // first reads are not booked under its working or data directory.
    assert_eq!(
        clusters,
        vec![cluster.clone()],
        "clusters with block IO on the volume"
    );
    eprintln!("clusters with block IO on the volume: {clusters:?}");

    eprintln!(
        "dashboards: {n_queries} queries at t={at:.0} ($__rate_interval={RATE_INTERVAL}, \
         $__range={range_s}s); setup {:.1} s, total {:.1} s\n{}",
        setup.as_secs_f64(),
        t0.elapsed().as_secs_f64(),
        report.join("\n")
    );
    if !empty_as_allowed.is_empty() {
        eprintln!(
            "empty, as listed in MAY_BE_EMPTY:\n  {}",
            empty_as_allowed.join("\n  ")
        );
    }
    if !listed_but_data.is_empty() {
        eprintln!(
            "listed in MAY_BE_EMPTY but returned data here:\n  {}",
            listed_but_data.join("\n  ")
        );
    }
    assert!(
        failures.is_empty(),
        "{} of {n_queries} queries failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn grafana_escaping() {
    let s = |values: &[&str], all: bool, all_value: Option<&str>, regex: bool| Selection {
        values: values.iter().map(|v| v.to_string()).collect(),
        all,
        all_value: all_value.map(str::to_owned),
        regex,
    };
    assert_eq!(
        format_selection(&s(&["15/main"], false, None, false)),
        "15/main"
    );
    assert_eq!(
        format_selection(&s(&["a.b", "c|d"], true, None, true)),
        "(a\\\\.b|c\\\\|d)"
    );
    assert_eq!(format_selection(&s(&["x"], true, Some(".*"), true)), ".*");
    let vars: BTreeMap<String, String> = [("a", "1"), ("__range", "5s")]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    assert_eq!(
        interpolate("x{a=\"$a\"}[${__range}] [[a]] é", &vars).unwrap(),
        "x{a=\"1\"}[5s] 1 é"
    );
    assert!(interpolate("$b", &vars).is_err());
    assert_eq!(
        parse_label_values("label_values(up{job=\"a,b\"}, instance)"),
        Some((Some("up{job=\"a,b\"}"), "instance"))
    );
    assert_eq!(parse_label_values("label_values(job)"), Some((None, "job")));
    assert_eq!(
        references("a $b ${c} ${d:csv} [[e]] $__rate_interval $"),
        ["b", "c", "d", "e", "__rate_interval"]
    );
}
