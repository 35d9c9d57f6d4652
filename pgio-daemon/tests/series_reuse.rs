//! Issue 15's row "124,000 execs push series ids past 65,536": ids were never reused, the
//! kernel's `CHILD_SERIES` write failed silently past its size, and later real backends were
//! booked as `postmaster` and `starting`. Scaled down: with `max_series = 56`, a made-up
//! cluster (as nobody) starts a round of client backends of new databases that fills the
//! registry up to the cap and is retired, then a round on the freed ids. Then:
//! - ids were given out again (series retired + held > the cap) and none was refused while
//!   the round fit;
//! - each round's series hold exactly its own reads (a reused id carries nothing over);
//! - the last round has 5 backends more than the room: the registry stops at the cap, each
//!   label set refused is one backend whose reads are on the overflow series, none lost (so
//!   at most 5 refused: the rest of the round took reused ids);
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
/// Rounds that fit; one more, on their freed ids, goes past the cap. Each round waits out the
/// provisional grace before its ids are free: one round that fits is enough to reuse.
const ROUNDS: usize = 1;
/// Backends the last round has beyond the room it finds.
const PAST_CAP: usize = 5;
/// Series a made-up cluster needs besides its backends': its postmaster's and the one its
/// children start in.
const CLUSTER_SERIES: usize = 2;
const FAKE_READS: usize = 5;
/// A forked backend's series is held until its late block requests count lost
/// (`provisional::grace`): 5 s + a 1 s sweep here, not the default's 30 s.
const GRACE_CONFIG: &str = "block_inflight_timeout_secs = 5\n";
const READS: u64 = 1_000;

/// `pread64` calls booked on the made-up cluster's series of databases `r<round>db…`.
fn round_reads(m: &Metrics, cluster: &str, round: usize) -> f64 {
    let prefix = format!("r{round}db");
    m.matching(
        "pgio_syscall_seconds_count",
        &[("pg_cluster", cluster), ("syscall", "pread64")],
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
         max_series_per_group = {MAX_SERIES}\n{GRACE_CONFIG}{}",
        reader_rule(lo.path(), "reader")
    ))
    .expect("daemon");
    daemon.wait_tracked("postgres", "checkpointer");
    let start = daemon.scrape();

    for round in 1..=ROUNDS + 1 {
        let past_cap = round > ROUNDS;
        let at_start = daemon.scrape();
        // Each round takes the registry up to its cap; the last one goes past it.
        let held_now = at_start.sum("pgio_series", &[]) as usize;
        let room = MAX_SERIES - held_now - CLUSTER_SERIES;
        let backends = room + if past_cap { PAST_CAP } else { 0 };
        let refused_before = at_start.sum("pgio_series_refused_total", &[]);
        let title = format!("postgres: mallory r{round}db%d [local] idle");
        let mut flood = Fake::start(
            &attacker.bin("postgres"),
            "postgres",
            &["-D", &fake_cluster, &" ".repeat(200)],
            &attacker.data,
            &[
                ("FAKE_FILE", attacker.file.to_str().expect("path")),
                ("FAKE_READS", &FAKE_READS.to_string()),
                ("FAKE_CHILDREN", &backends.to_string()),
                ("FAKE_TITLE", &title),
            ],
        )
        .expect("flood");
        flood.wait_done(backends).expect("the backends' reads");
        let overflow = [
            ("app", "postgres"),
            ("role", "overflow"),
            ("syscall", "pread64"),
        ];
        let overflow_before = at_start.sum("pgio_syscall_seconds_count", &overflow);
        let made = (backends * FAKE_READS) as f64;
        let counted = wait_until(Duration::from_secs(10), Duration::from_millis(200), || {
            let m = daemon.scrape();
            round_reads(&m, &fake_cluster, round) + m.sum("pgio_syscall_seconds_count", &overflow)
                - overflow_before
                >= made
        });
        let m = daemon.scrape();
        let got = round_reads(&m, &fake_cluster, round);
        let got_overflow = m.sum("pgio_syscall_seconds_count", &overflow) - overflow_before;
        let refused = m.sum("pgio_series_refused_total", &[]) - refused_before;
        let held = m.sum("pgio_series", &[]);
        eprintln!(
            "round {round}: {held_now} series held before, {backends} backends, {held} held, \
             {got} reads on their own series, {got_overflow} on overflow, {refused} refused"
        );
        assert!(
            counted && got + got_overflow == made,
            "round {round}: {got} reads on the round's series + {got_overflow} on overflow, \
             made {made}"
        );
        // Each label set refused is one backend on the overflow series, with its reads.
        assert_eq!(
            got_overflow,
            refused * FAKE_READS as f64,
            "round {round}: reads on overflow against label sets refused"
        );
        assert!(
            held <= (MAX_SERIES + 1) as f64,
            "round {round}: {held} series held, cap {MAX_SERIES} (+ the overflow series)"
        );
        if past_cap {
            assert!(
                refused >= 1.0 && refused <= PAST_CAP as f64,
                "round {round} ({backends} backends, room for {room}): {refused} refused"
            );
        } else {
            assert_eq!(
                refused, 0.0,
                "round {round} ({backends} backends, room for {room}): label sets refused"
            );
        }
        flood.end();
        // Retired once the backends' provisional grace (6 s) and the 1 s retention are over.
        let retired = wait_until(Duration::from_secs(20), Duration::from_millis(500), || {
            let m = daemon.scrape();
            m.sum("pgio_series_retired_total", &[])
                >= at_start.sum("pgio_series_retired_total", &[]) + (backends as f64 - refused)
        });
        assert!(
            retired,
            "round {round}'s series were not retired within 20 s"
        );
        // Retired is not yet free: a map read deletes their kernel keys, then the ids are
        // given out again. The next round's label sets need them.
        let held = |m: &Metrics| m.sum("pgio_series", &[]);
        let freed = wait_until(Duration::from_secs(30), Duration::from_millis(200), || {
            // The overflow series may outlive its one process by the retention.
            held(&daemon.scrape()) <= held(&start) + (CLUSTER_SERIES + usize::from(past_cap)) as f64
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
        ("pg_cluster", cluster.as_str()),
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
            &[("pg_cluster", cluster.as_str()), ("role", "starting")]
        )
    );
    assert!(
        series + retired > MAX_SERIES as f64,
        "no id given out twice: {series} held + {retired} retired, cap {MAX_SERIES}"
    );
    // The last round's backends past the cap, and its cluster's own label sets when they came
    // after the backends had filled it.
    assert!(
        refused >= 1.0 && refused <= (PAST_CAP + CLUSTER_SERIES) as f64,
        "label sets refused: {refused}, only the last round's past the cap may be"
    );
    assert_eq!(reads, READS as f64, "the reader's pread64s on a reused id");
    assert!(
        tracked,
        "a new session of the real cluster is not a client backend"
    );
    assert_eq!(
        m.sum(
            "pgio_tracked_processes",
            &[("pg_cluster", cluster.as_str()), ("role", "starting")]
        ),
        0.0
    );
    assert_eq!(m.sum("pgio_kernel_map_errors_total", &[]), 0.0);
    drop(session);
    daemon.stop().expect("clean daemon exit");
    lo.detach().expect("detach");
}
