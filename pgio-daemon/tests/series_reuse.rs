//! Issue 15's row "124,000 execs push series ids past 65,536": ids were never reused, the
//! kernel's `CHILD_SERIES` write failed silently past its size, and later real backends were
//! booked as `postmaster` and `starting`. Scaled down: with `max_series = 56`, a made-up
//! cluster (as nobody) churns two rounds of 36 client backends of new databases, more label
//! sets than the cap, each round retired before the next. Then:
//! - ids were given out again (series retired + held > the cap) and none was refused;
//! - each round's series hold exactly its own reads (a reused id carries nothing over);
//! - a root reader started afterwards gets its exact `pread64` count, and a new session of the
//!   real PostgreSQL is a `client backend`, not `starting`;
//! - `pgio_kernel_map_errors_total` stays 0.
mod common;

use std::time::Duration;

use common::Daemon;
use pgio_testkit::{
    LoopDevice, Metrics, PgCluster,
    fake::{AttackerFiles, Fake},
    load::{direct_reader, reader_rule},
    pg_bin_dir, require_root, temp_dir, wait_until,
};

const MAX_SERIES: usize = 56;
const BACKENDS: usize = 36;
const FAKE_READS: usize = 5;
const READS: u64 = 1_000;

/// `pread64` calls booked on the made-up cluster's series of databases `r<round>db…`.
fn round_reads(m: &Metrics, cluster: &str, round: usize) -> f64 {
    let prefix = format!("r{round}db");
    m.matching(
        "pgio_syscall_seconds_count",
        &[("cluster", cluster), ("syscall", "pread64")],
    )
    .filter(|s| {
        s.labels
            .get("database")
            .is_some_and(|d| d.starts_with(&prefix))
    })
    .map(|s| s.value)
    .sum()
}

#[test]
fn series_ids_are_reused_and_a_reused_id_carries_nothing_over() {
    if !require_root("series_ids_are_reused_and_a_reused_id_carries_nothing_over") {
        return;
    }
    let bin_dir = pg_bin_dir(15).expect("PostgreSQL 15");
    let dir = temp_dir().expect("temp dir");
    let mut pg = PgCluster::init(&bin_dir, &dir.path().join("data"), 56_440).expect("initdb");
    pg.start().expect("start");
    let cluster = std::fs::canonicalize(pg.data_dir()).expect("data directory");
    let cluster = cluster.to_str().expect("UTF-8 path").to_owned();
    let attacker = AttackerFiles::create(dir.path(), &["postgres"]).expect("fakes");
    let fake_cluster = attacker.data.to_str().expect("path").to_owned();
    let lo = LoopDevice::create_written(dir.path(), 16 << 20, true).expect("loop device");
    let daemon = Daemon::with_config(&format!(
        "rescan_interval_secs = 1\nseries_retention_secs = 1\nmax_series = {MAX_SERIES}\n\
         max_series_per_group = {MAX_SERIES}\n{}",
        reader_rule(lo.path(), "reader")
    ))
    .expect("daemon");
    daemon.wait_tracked("postgres", "checkpointer");
    let start = daemon.scrape();

    for round in 1..=2 {
        let title = format!("postgres: mallory r{round}db%d [local] idle");
        let mut flood = Fake::start(
            &attacker.bin("postgres"),
            "postgres",
            &["-D", &fake_cluster, &" ".repeat(200)],
            &attacker.data,
            &[
                ("FAKE_FILE", attacker.file.to_str().expect("path")),
                ("FAKE_READS", &FAKE_READS.to_string()),
                ("FAKE_CHILDREN", &BACKENDS.to_string()),
                ("FAKE_TITLE", &title),
            ],
        )
        .expect("flood");
        flood.wait_done(BACKENDS).expect("the backends' reads");
        let want = (BACKENDS * FAKE_READS) as f64;
        let counted = wait_until(Duration::from_secs(10), Duration::from_millis(200), || {
            round_reads(&daemon.scrape(), &fake_cluster, round) >= want
        });
        let got = round_reads(&daemon.scrape(), &fake_cluster, round);
        assert!(
            counted && got == want,
            "round {round}: {got} reads, made {want}; label sets refused {}",
            daemon.scrape().sum("pgio_series_refused_total", &[])
        );
        flood.end();
        // Retired once the backends' 30 s provisional grace and the 1 s retention are over.
        let retired = wait_until(Duration::from_secs(60), Duration::from_millis(500), || {
            let m = daemon.scrape();
            m.sum("pgio_series_retired_total", &[])
                >= start.sum("pgio_series_retired_total", &[]) + (round * BACKENDS) as f64
        });
        assert!(
            retired,
            "round {round}'s series were not retired within 60 s"
        );
        // Retired is not yet free: a map read deletes their kernel keys, then the ids are
        // given out again. The next round's label sets need them.
        let held = |m: &Metrics| m.sum("pgio_series", &[]);
        let freed = wait_until(Duration::from_secs(30), Duration::from_millis(200), || {
            held(&daemon.scrape()) <= held(&start) + 2.0
        });
        assert!(
            freed,
            "round {round}'s series ids were not freed: {} held, {} at the start",
            held(&daemon.scrape()),
            held(&start)
        );
    }

    let mut reader = direct_reader(lo.path(), READS, 4096).expect("spawn pgio-load");
    daemon.wait_tracked("test", "reader");
    let before = daemon.scrape();
    reader.go().expect("go");
    assert_eq!(reader.wait_done().expect("reader"), READS);
    let mut session = pg.session("postgres", "postgres").expect("session");
    session.send("select 1;").expect("query");
    let backend = [
        ("app", "postgres"),
        ("role", "client backend"),
        ("cluster", cluster.as_str()),
    ];
    let tracked = wait_until(Duration::from_secs(10), Duration::from_millis(100), || {
        daemon.scrape().sum("pgio_tracked_processes", &backend) >= 1.0
    });
    let m = daemon.scrape();
    let reader_labels = [("app", "test"), ("role", "reader"), ("syscall", "pread64")];
    let reads = m.sum("pgio_syscall_seconds_count", &reader_labels)
        - before.sum("pgio_syscall_seconds_count", &reader_labels);
    let series = m.sum("pgio_series", &[]);
    let retired = m.sum("pgio_series_retired_total", &[]);
    let refused = m.sum("pgio_series_refused_total", &[]);
    eprintln!(
        "series held {series}, retired {retired}, refused {refused}; reader {reads} of {READS}; \
         starting processes {}",
        m.sum(
            "pgio_tracked_processes",
            &[("cluster", cluster.as_str()), ("role", "starting")]
        )
    );
    assert!(
        series + retired > MAX_SERIES as f64,
        "no id given out twice: {series} held + {retired} retired, cap {MAX_SERIES}"
    );
    assert_eq!(refused, 0.0, "label sets refused: the ids were not freed");
    assert_eq!(reads, READS as f64, "the reader's pread64s on a reused id");
    assert!(
        tracked,
        "a new session of the real cluster is not a client backend"
    );
    assert_eq!(
        m.sum(
            "pgio_tracked_processes",
            &[("cluster", cluster.as_str()), ("role", "starting")]
        ),
        0.0
    );
    assert_eq!(m.sum("pgio_kernel_map_errors_total", &[]), 0.0);
    drop(session);
    daemon.stop().expect("clean daemon exit");
    lo.detach().expect("detach");
}
