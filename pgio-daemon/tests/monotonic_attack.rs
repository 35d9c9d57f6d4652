//! No counter steps back (issue 51): while someone else's fork burst churns the maps, and
//! across a watched cluster's restarts.
//!
//! The burst: a made-up PostgreSQL cluster run by `nobody` (a `PG_VERSION`, a "postmaster", 2,000 children
//! each reading a file) starts beside a real PostgreSQL 15 under `pgbench -C -S -R 100`, while
//! `/metrics` is scraped back to back. Every counter and histogram sample of every series is
//! compared with the one before; the relation family's reads of the real cluster's client
//! backends add up to their `pread64` calls.
mod common;

use std::time::Duration;

use common::{Daemon, delta};
use pgio_testkit::{
    MonotonicWatch, PgCluster, PgOptions, WatchReport, fake::AttackerFiles, fake::Fake, pg_bin_dir,
    require_root, temp_dir,
};

const CHILDREN: usize = 2_000;
/// Scrapes each watch checks at least: it goes on after the events until then.
const MIN_SCRAPES: usize = 100;

#[test]
fn no_counter_steps_back_during_an_unprivileged_fork_burst() {
    if !require_root("no_counter_steps_back_during_an_unprivileged_fork_burst") {
        return;
    }
    let bin = pg_bin_dir(15).expect("PostgreSQL 15");
    let dir = temp_dir().expect("temp dir");
    let attacker = AttackerFiles::create(dir.path(), &["postgres"]).expect("attacker files");
    let mut pg = PgCluster::init_with(
        PgOptions::new(&bin, dir.path().join("pgdata"), 56_540).setting("max_connections", "50"),
    )
    .expect("initdb");
    pg.start().expect("start");
    pg.pgbench_ok(&["-i", "-s", "2", "-q", "postgres"])
        .expect("pgbench -i");
    let cluster = std::fs::canonicalize(pg.data_dir()).expect("data directory");
    let cluster = cluster.to_str().expect("UTF-8").to_owned();
    let daemon = Daemon::with_config("").expect("daemon");
    daemon.wait_tracked("postgres", "checkpointer");

    let mut bench = pg.as_os_user("pgbench");
    bench
        .args(pg.conn_args())
        .args(["-C", "-S", "-R", "100", "-c", "4", "-j", "2", "-T", "30"])
        .arg("postgres")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let before = daemon.scrape();
    let watch = MonotonicWatch::start(&format!("{}/metrics", daemon.url()), Duration::ZERO);
    let bench = bench.spawn().expect("pgbench");
    std::thread::sleep(Duration::from_secs(5));
    let file = attacker.file.to_str().expect("path").to_owned();
    let children = CHILDREN.to_string();
    let mut fake = Fake::start(
        &attacker.bin("postgres"),
        "postgres",
        &["-D", "data"],
        &attacker.data,
        &[
            ("FAKE_FILE", &file),
            ("FAKE_READS", "20"),
            ("FAKE_REOPEN", "1"),
            ("FAKE_CHILDREN", &children),
            ("FAKE_TITLE", "postgres: eve db%d [local] idle"),
        ],
    )
    .expect("made-up cluster");
    fake.wait_done(CHILDREN).expect("the children's reads");
    let out = bench.wait_with_output().expect("pgbench");
    assert!(
        out.status.success(),
        "pgbench: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    fake.end();
    // The last runs and folds land within a pass or two.
    std::thread::sleep(Duration::from_secs(3));
    let watched = watch.finish_after(MIN_SCRAPES).expect("scrapes");
    let after = daemon.scrape();
    let backend = [
        ("app", "postgres"),
        ("role", "client backend"),
        ("pg_cluster", cluster.as_str()),
    ];
    let relation_reads = delta(
        &before,
        &after,
        "pgio_relation_io_seconds_count",
        &[backend[0], backend[1], backend[2], ("syscall", "pread64")],
    );
    let syscall_reads = delta(
        &before,
        &after,
        "pgio_syscall_seconds_count",
        &[backend[0], backend[1], backend[2], ("syscall", "pread64")],
    );
    let inconsistent = delta(&before, &after, "pgio_inconsistent_reads_total", &[]);
    eprintln!(
        "{} scrapes back to back, {} samples stepped back; real cluster's client backends: \
         pread64 {syscall_reads}, by relation {relation_reads}; inconsistent reads served \
         what was shown last {inconsistent}",
        watched.scrapes,
        watched.steps_back.len()
    );
    assert_clean(&watched);
    assert!(syscall_reads > 0.0, "the real cluster read nothing");
    assert_eq!(
        relation_reads, syscall_reads,
        "the real cluster's reads by relation"
    );
    daemon.stop().expect("daemon stop");
    pg.stop().expect("stop");
}

const TABLES: usize = 8;

/// Writes to every table, then a checkpoint: the checkpointer writes and syncs each file.
fn write_all(pg: &PgCluster, round: usize) {
    for t in 0..TABLES {
        pg.psql(&format!(
            "INSERT INTO t{t} SELECT g, repeat('x', 200) FROM generate_series(1, 2000) g; \
             SELECT count(*) FROM t{t} WHERE v <> 'round {round}';"
        ))
        .expect("insert");
    }
    pg.psql("CHECKPOINT").expect("checkpoint");
}

/// No counter steps back when a watched cluster restarts (issue 51): the new postmaster's
/// processes take the label sets of the old ones (same cluster, roles, databases), so each
/// exported series must go on from what it showed, in every family. One daemon runs with
/// `max_relations = 2`, which puts most files under `relation="(rest)"` (several kernel keys,
/// relations changing places, databases named late): it is watched for steps back. A second
/// one with the default places counts every call of the checkpointers under a relation: a
/// relation that gets a place back goes on from what it showed, which `(rest)` keeps too
/// (`relation::top`), so only without moves is the sum over relations the total.
#[test]
fn no_counter_steps_back_across_a_cluster_restart() {
    if !require_root("no_counter_steps_back_across_a_cluster_restart") {
        return;
    }
    let bin = pg_bin_dir(15).expect("PostgreSQL 15");
    let dir = temp_dir().expect("temp dir");
    let mut pg = PgCluster::init_with(PgOptions::new(&bin, dir.path().join("pgdata"), 56_560))
        .expect("initdb");
    pg.start().expect("start");
    for t in 0..TABLES {
        pg.psql(&format!("CREATE TABLE t{t} (id int, v text)"))
            .expect("create table");
    }
    let cluster = std::fs::canonicalize(pg.data_dir()).expect("data directory");
    let cluster = cluster.to_str().expect("UTF-8").to_owned();
    let watched = Daemon::with_config("max_relations = 2\n").expect("daemon");
    let daemon = Daemon::with_config("").expect("daemon");
    watched.wait_tracked("postgres", "checkpointer");
    daemon.wait_tracked("postgres", "checkpointer");

    let before = daemon.scrape();
    let watch = MonotonicWatch::start(&format!("{}/metrics", watched.url()), Duration::ZERO);
    let checkpointer = [
        ("app", "postgres"),
        ("role", "checkpointer"),
        ("pg_cluster", cluster.as_str()),
    ];
    for round in 0..3 {
        write_all(&pg, round);
        pg.stop().expect("stop");
        std::thread::sleep(Duration::from_millis(1500));
        pg.start().expect("restart");
    }
    write_all(&pg, 3);
    // IO on a file the family has not named yet is held back until the cluster's catalogs
    // are read again (up to 5 s): then every write and sync of the checkpointers is on a file.
    let calls = |m: &pgio_testkit::Metrics| {
        (
            delta(&before, m, "pgio_relation_io_seconds_count", &checkpointer),
            delta(&before, m, "pgio_syscall_seconds_count", &checkpointer),
        )
    };
    pgio_testkit::wait_until(Duration::from_secs(15), Duration::from_millis(200), || {
        let (by_relation, syscalls) = calls(&daemon.scrape());
        by_relation == syscalls
    });
    let report = watch.finish_after(MIN_SCRAPES).expect("scrapes");
    let (by_relation, syscalls) = calls(&daemon.scrape());
    eprintln!(
        "{} scrapes back to back across 3 restarts, {} samples stepped back; the checkpointers' \
         calls {syscalls}, by relation {by_relation}",
        report.scrapes,
        report.steps_back.len()
    );
    assert_clean(&report);
    assert!(
        syscalls >= 4.0 * TABLES as f64,
        "4 checkpoints: {syscalls} calls"
    );
    assert_eq!(
        by_relation, syscalls,
        "the checkpointers' calls by relation, across restarts"
    );
    daemon.stop().expect("daemon stop");
    watched.stop().expect("daemon stop");
    pg.stop().expect("stop");
}

/// At least `MIN_SCRAPES` scrapes, none with a sample lower than the scrape before or a series twice.
fn assert_clean(report: &WatchReport) {
    assert!(report.scrapes >= MIN_SCRAPES, "{} scrapes", report.scrapes);
    assert!(
        report.clean(),
        "{} samples stepped back, {} series twice in a scrape:\n{}",
        report.steps_back.len(),
        report.duplicates.len(),
        report.describe(30)
    );
}
