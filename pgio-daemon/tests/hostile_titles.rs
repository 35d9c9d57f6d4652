//! Processes anyone can start, run by `nobody` against a real PostgreSQL 15 and pgio as root
//! (issue 15's rows on titles and label sets). A small C program plays each part: it runs
//! under any name, rewrites its command line as Postgres does, and does a known number of
//! `pread64`s once told to.
//! - A process titled as a client backend of the real cluster (`postgres: <its label>: postgres
//!   postgres [local] idle`): it is not tracked, its 3,000 reads are on none of the cluster's
//!   series (the old code put all 3,000 on the real client backend series).
//! - A made-up cluster of its own (a data directory owned by nobody, a "postmaster" forking
//!   200 "client backends" of 200 databases): at most `max_series_per_group` of its label sets
//!   get a series, the rest go to `role="overflow"`, `pgio_series_refused_total` counts them,
//!   and a database created meanwhile in the real cluster still gets its own series.
//! - A `longhorn` with a 100 KB volume name: every exposition line stays short, the value is
//!   cut at `max_label_len` and counted.
//! - When they are gone, their series leave the exposition after `series_retention_secs`, and
//!   pgio's fd count and series count are back where they were.
mod common;

use std::time::Duration;

use common::Daemon;
use pgio_testkit::{
    Metrics, PgCluster,
    fake::{AttackerFiles, Fake},
    pg_bin_dir, require_root, temp_dir, wait_until,
};

const PER_GROUP: usize = 40;
const FAKE_BACKENDS: usize = 200;
const READS: u64 = 3_000;

fn fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

fn preads(m: &Metrics, labels: &[(&str, &str)]) -> f64 {
    let mut l = vec![("syscall", "pread64")];
    l.extend_from_slice(labels);
    m.sum("pgio_syscall_seconds_count", &l)
}

/// Label values of `label` among the `pgio_syscall_seconds_count` series matching `labels`.
fn values(m: &Metrics, label: &str, labels: &[(&str, &str)]) -> Vec<String> {
    let mut v: Vec<String> = m
        .matching("pgio_syscall_seconds_count", labels)
        .filter_map(|s| s.labels.get(label).cloned())
        .collect();
    v.sort();
    v.dedup();
    v
}

#[test]
fn hostile_titles_cannot_write_into_a_clusters_series_nor_bloat_the_exposition() {
    if !require_root("hostile_titles_cannot_write_into_a_clusters_series_nor_bloat_the_exposition")
    {
        return;
    }
    let bin_dir = pg_bin_dir(15).expect("PostgreSQL 15");
    let dir = temp_dir().expect("temp dir");
    let mut pg = PgCluster::init(&bin_dir, &dir.path().join("data"), 56_420).expect("initdb");
    pg.start().expect("start");
    let cluster = std::fs::canonicalize(pg.data_dir()).expect("data directory");
    let cluster = cluster.to_str().expect("UTF-8 path").to_owned();

    // The attacker's files: its binaries, a file to read, a data directory of its own.
    let attacker = AttackerFiles::create(dir.path(), &["postgres", "longhorn"]).expect("fakes");
    let (fakes, fake_data) = (attacker.dir.clone(), attacker.data.clone());
    let (postgres, longhorn) = (attacker.bin("postgres"), attacker.bin("longhorn"));
    let file = attacker.file.to_str().expect("path");

    let daemon = Daemon::with_config(&format!(
        "rescan_interval_secs = 1\nseries_retention_secs = 4\nmax_series_per_group = {PER_GROUP}\n\
         block_inflight_timeout_secs = 5\n"
    ))
    .expect("daemon");
    daemon.wait_tracked("postgres", "checkpointer");
    let mut session = pg.session("postgres", "postgres").expect("session");
    session.send("select 1;").expect("query");
    let real_backend = [
        ("app", "postgres"),
        ("role", "client backend"),
        ("pg_cluster", cluster.as_str()),
    ];
    assert!(
        wait_until(Duration::from_secs(10), Duration::from_millis(50), || {
            daemon.scrape().sum("pgio_tracked_processes", &real_backend) >= 1.0
        }),
        "the real session is not tracked under cluster {cluster}"
    );
    let pid = daemon.0.pid();
    let fds_before = fds(pid);
    let series_before = daemon.scrape().sum("pgio_series", &[]);

    // 1. A title naming the real cluster, run from the attacker's own directory.
    let title = format!("postgres: {cluster}: postgres postgres [local] idle");
    let mut impostor = Fake::start(
        &postgres,
        &title,
        &[],
        &fake_data,
        &[("FAKE_FILE", file), ("FAKE_READS", &READS.to_string())],
    )
    .expect("impostor");
    std::thread::sleep(Duration::from_millis(1500)); // exec event and a rescan
    let before = daemon.scrape();
    impostor.go_and_wait(1).expect("impostor reads");
    let after = daemon.scrape();
    let on_real = preads(&after, &real_backend) - preads(&before, &real_backend);
    assert_eq!(
        on_real, 0.0,
        "the impostor's reads were booked on the real cluster's client backends"
    );
    // Untracked: booked nowhere (concurrent tests' clusters may read, but not 3,000 times as
    // `postgres` on `postgres` in this window).
    let claimed = [("database", "postgres"), ("user", "postgres")];
    let anywhere = preads(&after, &claimed) - preads(&before, &claimed);
    assert!(
        anywhere < READS as f64,
        "{anywhere} pread64 booked on database=postgres user=postgres"
    );
    assert_eq!(
        after.sum(
            "pgio_tracked_processes",
            &[("pg_cluster", cluster.as_str())]
        ),
        before.sum(
            "pgio_tracked_processes",
            &[("pg_cluster", cluster.as_str())]
        ),
        "the impostor is tracked in the real cluster"
    );
    impostor.end();

    // 2. A made-up cluster with 200 client backends of 200 databases.
    let mut flood = Fake::start(
        &postgres,
        "postgres",
        &["-D", fake_data.to_str().expect("path"), &" ".repeat(200)],
        &fake_data,
        &[
            ("FAKE_FILE", file),
            ("FAKE_READS", "5"),
            ("FAKE_CHILDREN", &FAKE_BACKENDS.to_string()),
            ("FAKE_TITLE", "postgres: mallory db%d [local] idle"),
        ],
    )
    .expect("flood");
    flood.wait_done(FAKE_BACKENDS).expect("backends' reads");
    let fake_cluster = fake_data.to_str().expect("path");
    let refused_enough = wait_until(Duration::from_secs(20), Duration::from_millis(200), || {
        daemon
            .scrape()
            .sum("pgio_series_refused_total", &[("app", "postgres")])
            >= (FAKE_BACKENDS - PER_GROUP) as f64
    });
    let m = daemon.scrape();
    let fake_dbs = values(&m, "database", &[("pg_cluster", fake_cluster)]);
    assert!(
        refused_enough,
        "pgio_series_refused_total{{app=\"postgres\"}} = {}, want >= {}; {} databases of the made-up cluster have series",
        m.sum("pgio_series_refused_total", &[("app", "postgres")]),
        FAKE_BACKENDS - PER_GROUP,
        fake_dbs.len()
    );
    // Every rescan (each second here) classifies the refused backends again: a refused label
    // set counts once, so a steady attack does not move the counter.
    let refused = m.sum("pgio_series_refused_total", &[("app", "postgres")]);
    std::thread::sleep(Duration::from_millis(3500));
    let steady = daemon
        .scrape()
        .sum("pgio_series_refused_total", &[("app", "postgres")]);
    assert_eq!(
        steady, refused,
        "pgio_series_refused_total grew over three rescans with the same {FAKE_BACKENDS} backends"
    );
    assert!(
        fake_dbs.len() <= PER_GROUP,
        "{} label sets of one made-up cluster, cap {PER_GROUP}",
        fake_dbs.len()
    );
    assert!(
        preads(&m, &[("app", "postgres"), ("role", "overflow")]) > 0.0,
        "the refused backends' reads are on the overflow series"
    );
    // Meanwhile a new database of the real cluster gets its own series.
    pg.psql("create database legit_new")
        .expect("create database");
    let mut legit = pg.session("legit_new", "postgres").expect("session");
    legit.send("select 1;").expect("query");
    let legit_labels = [
        ("role", "client backend"),
        ("pg_cluster", cluster.as_str()),
        ("database", "legit_new"),
    ];
    assert!(
        wait_until(Duration::from_secs(10), Duration::from_millis(100), || {
            daemon.scrape().sum("pgio_tracked_processes", &legit_labels) >= 1.0
        }),
        "a new database of the real cluster got no series during the flood"
    );

    // 3. A longhorn replica with a 100 KB volume name.
    let huge = "v".repeat(100_000);
    let mut replica = Fake::start(
        &longhorn,
        "longhorn",
        &["--volume-name", &huge, "replica", "/x"],
        &fakes,
        &[("FAKE_FILE", file), ("FAKE_READS", "10")],
    )
    .expect("replica");
    std::thread::sleep(Duration::from_millis(1500));
    replica.go_and_wait(1).expect("replica reads");
    let text = pgio_testkit::metrics::http_get(
        &format!("{}/metrics", daemon.url()),
        Duration::from_secs(10),
    )
    .expect("metrics");
    let longest = text.lines().map(str::len).max().unwrap_or(0);
    assert!(longest < 2_000, "an exposition line of {longest} bytes");
    let m = Metrics::parse(&text).expect("parse");
    let volumes = values(&m, "volume", &[("app", "longhorn"), ("role", "replica")]);
    assert_eq!(volumes, ["v".repeat(128)], "the volume cut at 128 bytes");
    assert!(m.sum("pgio_label_values_truncated_total", &[]) >= 1.0);
    let fds_during = fds(pid);
    assert!(
        fds_during <= fds_before + 10,
        "pgio's fds {fds_before} -> {fds_during} during the attack"
    );
    assert_eq!(m.sum("pgio_kernel_map_errors_total", &[]), 0.0);

    // 4. All gone: their series leave the exposition after the retention, which starts once
    // the forked processes' grace for late block completions (`provisional`: 5 s + a 1 s sweep
    // with this config) is over.
    flood.end();
    replica.end();
    drop(legit);
    // Retired series leave the exposition at once and are freed at the next pass (once a
    // second): wait for both (CI: one scrape in between counted 62 series against 19).
    let gone = wait_until(Duration::from_secs(60), Duration::from_millis(500), || {
        let m = daemon.scrape();
        values(&m, "database", &[("pg_cluster", fake_cluster)]).is_empty()
            && values(&m, "volume", &[("app", "longhorn")]).is_empty()
            && m.sum("pgio_series", &[]) <= series_before + 3.0
    });
    let m = daemon.scrape();
    assert!(
        gone,
        "made-up series still exported {} s after their processes exited: {:?}",
        60,
        values(&m, "database", &[("pg_cluster", fake_cluster)])
    );
    let series_after = m.sum("pgio_series", &[]);
    assert!(
        series_after <= series_before + 3.0,
        "pgio_series {series_before} before the attack, {series_after} after"
    );
    assert!(m.sum("pgio_series_retired_total", &[]) >= PER_GROUP as f64);
    assert!(
        fds(pid) <= fds_before + 3,
        "pgio's fds {fds_before} -> {} after the attack",
        fds(pid)
    );
    // The real cluster's session is still on its series.
    assert!(m.sum("pgio_tracked_processes", &real_backend) >= 1.0);
    drop(session);
    daemon.stop().expect("clean stop");
    pg.stop().expect("stop");
}
