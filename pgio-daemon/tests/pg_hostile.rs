//! Hostile role and database names on a real PostgreSQL 15: quotes, backslashes, newlines,
//! spaces (in both names at once, so the title alone is ambiguous), UTF-8, 63-byte names and
//! a name that contains a whole fake `[local] idle`. With pgio running, one idle session per
//! (user, database) pair is opened; then
//! - `promtool check metrics` (Debian's prometheus package) accepts /metrics, and our own
//!   parser reads both the Prometheus text and the OpenMetrics exposition;
//! - `pgio_tracked_processes` has, for every client backend `pg_stat_activity` lists, a
//!   series whose `user`/`database` are exactly `usename`/`datname` (read back hex-encoded,
//!   so nothing is lost to psql's output format).
//!
//! Names with spaces are resolved from the cluster's catalogs on disk, which hold what the
//! last checkpoint wrote: the test runs CHECKPOINT after creating them, as any database
//! older than a few minutes has been checkpointed.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::Daemon;
use pgio_testkit::{
    Metrics, PgCluster, PgOptions, check_metrics, metrics::http_get, pg_bin_dir, promtool,
    require_root, temp_dir, wait_until,
};

const PAIRS: &[(&str, &str)] = &[
    ("o'brien \"q\" \\x", "db with spaces"),
    ("plain", "new\nline"),
    ("ünï 🐘", "données 🐘"),
    (
        "uuuuuuuuuuuuuuuuuuuuuuuuuuuuuuuuuuuuuuuuuuuuuuuuuuuuuuuuuuuuuuu",
        "ddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddd",
    ),
    ("plain", "ééééééééééééééééééééééééééééééé_"),
    ("plain", "x [local] idle"),
    ("back\\slash", "tab\there"),
];

fn ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

#[test]
fn hostile_names_give_valid_exposition_and_exact_labels() {
    if !require_root("hostile_names_give_valid_exposition_and_exact_labels") {
        return;
    }
    for (u, d) in PAIRS {
        assert!(
            u.len() <= 63 && d.len() <= 63,
            "{u:?} {d:?} longer than NAMEDATALEN-1"
        );
    }
    // Fetched first: fail before the cluster is set up.
    promtool().expect("promtool");
    let bin = pg_bin_dir(15).expect("PostgreSQL 15");
    let dir = temp_dir().expect("temp dir");
    let port = 56_400;
    let mut pg =
        PgCluster::init_with(PgOptions::new(&bin, dir.path().join("data"), port)).expect("initdb");
    pg.start().expect("start");
    let mut roles: Vec<&str> = PAIRS.iter().map(|(u, _)| *u).collect();
    roles.sort_unstable();
    roles.dedup();
    for r in &roles {
        pg.psql(&format!("create role {} login", ident(r)))
            .expect("create role");
    }
    for (_, d) in PAIRS {
        pg.psql(&format!("create database {}", ident(d)))
            .expect("create database");
    }
    pg.psql("checkpoint").expect("checkpoint");

    let data_dir = std::fs::canonicalize(pg.data_dir()).expect("data directory");
    let cluster = data_dir.to_str().expect("UTF-8 path");
    let daemon = Daemon::start(&[]).expect("daemon");
    daemon.wait_tracked("postgres", "checkpointer");
    // Forked while pgio runs: classified through the fork path.
    let sessions: Vec<_> = PAIRS
        .iter()
        .map(|(u, d)| pg.session(d, u).expect("session"))
        .collect();

    let mut want = Vec::new();
    let settled = wait_until(Duration::from_secs(20), Duration::from_millis(100), || {
        want = client_backends(&pg);
        want.len() == PAIRS.len()
    });
    assert!(settled, "pg_stat_activity shows {want:?}");
    let mut want_count: BTreeMap<(String, String), f64> = BTreeMap::new();
    for pair in &want {
        *want_count.entry(pair.clone()).or_default() += 1.0;
    }

    // Exactly these: pgio may lag the server by a little under load (the psql backends of
    // the polling above come and go), so both formats are scraped back to back until each
    // shows exactly what pg_stat_activity showed.
    let metrics_url = format!("{}/metrics", daemon.url());
    let (mut text, mut openmetrics) = (String::new(), String::new());
    let (mut got, mut got_om) = (BTreeMap::new(), BTreeMap::new());
    let labelled = wait_until(Duration::from_secs(10), Duration::from_millis(100), || {
        text = http_get(&metrics_url, Duration::from_secs(10)).expect("scrape");
        openmetrics = pgio_testkit::metrics::http_get_accept(
            &metrics_url,
            "application/openmetrics-text; version=1.0.0",
            Duration::from_secs(10),
        )
        .expect("scrape OpenMetrics");
        got = tracked_client_backends(&Metrics::parse(&text).expect("text parses"), cluster);
        got_om = tracked_client_backends(
            &Metrics::parse(&openmetrics).expect("OpenMetrics parses"),
            cluster,
        );
        got == want_count && got_om == want_count
    });
    assert!(
        labelled,
        "pgio's client backend labels disagree with pg_stat_activity:\n want {want_count:#?}\n \
         got (text) {got:#?}\n got (OpenMetrics) {got_om:#?}\ndaemon log:\n{}",
        daemon.0.log_text()
    );
    assert!(
        openmetrics.ends_with("# EOF\n"),
        "OpenMetrics must end with # EOF"
    );

    for (_, d) in PAIRS {
        let escaped = d
            .replace('\\', "\\\\")
            .replace('\n', "\\n")
            .replace('"', "\\\"");
        assert!(
            text.contains(&format!("database=\"{escaped}\"")),
            "{d:?} not in the exposition as {escaped:?}"
        );
    }
    let report = check_metrics(&text).unwrap_or_else(|e| panic!("{e:#}"));
    let lines: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("pgio_tracked_processes{") && l.contains("client backend"))
        .collect();
    eprintln!("pg_hostile: /metrics excerpt:\n{}", lines.join("\n"));
    eprintln!(
        "{} client backends with hostile names, all labelled as pg_stat_activity says; promtool: {}",
        want.len(),
        report
    );
    drop(sessions);
    daemon.stop().expect("daemon stop");
    pg.stop().expect("stop");
}

/// (usename, datname) of every client backend but our own query's.
fn client_backends(pg: &PgCluster) -> Vec<(String, String)> {
    let out = pg
        .psql(
            "select encode(convert_to(usename, 'UTF8'), 'hex'), \
             encode(convert_to(datname, 'UTF8'), 'hex') from pg_stat_activity \
             where backend_type = 'client backend' and pid <> pg_backend_pid()",
        )
        .unwrap_or_default();
    out.lines()
        .filter_map(|l| {
            let (u, d) = l.split_once('|')?;
            Some((unhex(u)?, unhex(d)?))
        })
        .collect()
}

fn unhex(h: &str) -> Option<String> {
    let bytes: Option<Vec<u8>> = (0..h.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(h.get(i..i + 2)?, 16).ok())
        .collect();
    String::from_utf8(bytes?).ok()
}

/// Client backends whose `pg_cluster` is `cluster` (others may run on the machine).
fn tracked_client_backends(m: &Metrics, cluster: &str) -> BTreeMap<(String, String), f64> {
    let mut out = BTreeMap::new();
    for s in m.matching(
        "pgio_tracked_processes",
        &[
            ("app", "postgres"),
            ("role", "client backend"),
            ("pg_cluster", cluster),
        ],
    ) {
        if s.value > 0.0 {
            let get = |k: &str| s.labels.get(k).cloned().unwrap_or_default();
            *out.entry((get("user"), get("database"))).or_default() += s.value;
        }
    }
    out
}
