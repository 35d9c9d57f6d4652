//! A postmaster whose exec pgio handles late. A postmaster forks its first children (the
//! checkpointer, the io workers, …) milliseconds after its exec; on a busy node pgio can read
//! that exec later, when the kernel has already let the forks go by untracked (CI saw
//! PostgreSQL 18's io workers do a cold scan's 115 device reads unattributed: issue 46). Here
//! the daemon is stopped (SIGSTOP) while PostgreSQL 18 starts, then let go, with rescans
//! off: every auxiliary process must be tracked with its `backend_type` within seconds, as
//! `pg_stat_activity` counts them, and an io worker's reads then be booked for the backend
//! it served.
mod common;
mod fake_postgres;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::{Daemon, delta};
use pgio_testkit::{PgCluster, PgOptions, pg_bin_dir, require_root, temp_dir, wait_until};

/// The auxiliary processes PostgreSQL 18 starts with `io_method = worker` (3 io workers).
const AUXILIARY: [&str; 6] = [
    "checkpointer",
    "background writer",
    "walwriter",
    "io worker",
    "autovacuum launcher",
    "logical replication launcher",
];

/// One test at a time: each counts every process pgio tracks as `postgres`.
static SERIAL: Mutex<()> = Mutex::new(());

/// Lets the daemon run again however the test ends.
struct Stopped(u32);

impl Stopped {
    fn new(pid: u32) -> Stopped {
        signal(pid, libc::SIGSTOP);
        Stopped(pid)
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        signal(self.0, libc::SIGCONT);
    }
}

fn signal(pid: u32, sig: libc::c_int) {
    // SAFETY: a signal to the daemon this test started, by its PID.
    let rc = unsafe { libc::kill(pid as libc::pid_t, sig) };
    assert_eq!(
        rc,
        0,
        "kill({pid}, {sig}): {}",
        std::io::Error::last_os_error()
    );
}

#[test]
fn pg18_children_forked_before_pgio_read_the_exec_are_tracked() {
    if !require_root("pg18_children_forked_before_pgio_read_the_exec_are_tracked") {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let bin = pg_bin_dir(18).unwrap_or_else(|e| panic!("PostgreSQL 18: {e:#}"));
    let dir = temp_dir().expect("temp dir");
    let opts = PgOptions::new(&bin, dir.path().join("data"), 55_486)
        .shared_buffers("16MB")
        .setting("io_method", "worker");
    let mut pg = PgCluster::init_with(opts).expect("initdb");
    let daemon = Daemon::with_config("rescan_interval_secs = 3600\n").expect("daemon");

    let stopped = Stopped::new(daemon.0.pid());
    pg.start().expect("start");
    // Every auxiliary process has forked (pg_ctl -w waited for the server to accept
    // connections): all of them were forked by an untracked postmaster.
    let children = pg.child_pids().expect("children");
    drop(stopped);
    let let_go = Instant::now();

    let expected = auxiliary_counts(&pg);
    assert_eq!(
        expected.get("io worker"),
        Some(&3),
        "io workers: {expected:?}"
    );
    let mut tracked = BTreeMap::new();
    let all = wait_until(Duration::from_secs(5), Duration::from_millis(50), || {
        let m = daemon.scrape();
        tracked = AUXILIARY
            .iter()
            .map(|role| {
                let n = m.sum(
                    "pgio_tracked_processes",
                    &[("app", "postgres"), ("role", role)],
                );
                ((*role).to_owned(), n as usize)
            })
            .collect();
        tracked == expected
    });
    eprintln!(
        "late exec: {} children forked while pgio was stopped; tracked {:.2} s after it ran \
         again: {tracked:?} (pg_stat_activity: {expected:?})",
        children.len(),
        let_go.elapsed().as_secs_f64()
    );
    assert!(
        all,
        "after 5 s (no rescan), pgio tracks {tracked:?}; pg_stat_activity shows {expected:?}"
    );

    // An io worker's reads are the backend's: a scan of a table 3 times shared_buffers.
    pg.psql(
        "create table t as select g, repeat('x', 200) as pad from generate_series(1, 200000) g",
    )
    .expect("table");
    // Where the io workers read whom they serve: found once per postmaster, then copied to
    // the members that missed it at their fork (these did).
    assert!(daemon.wait_postmaster_found(), "postmaster not found");
    let before = daemon.scrape();
    pg.psql("select count(*) from t").expect("scan");
    let after = daemon.scrape();
    let outcomes = common::delta_by(
        &before,
        &after,
        "pgio_io_worker_syscalls_total",
        &[],
        &["outcome"],
    );
    eprintln!("late exec: io workers' calls in the scan: {outcomes:?}");
    let attributed = delta(
        &before,
        &after,
        "pgio_io_worker_syscalls_total",
        &[("outcome", "attributed")],
    );
    eprintln!("late exec: io workers' calls booked for the backend: {attributed}");
    assert!(
        attributed > 0.0,
        "no io worker call booked for the backend it served"
    );
    pg.stop().expect("stop");
    daemon.stop().expect("daemon stop");
}

/// `pg_stat_activity`'s auxiliary processes by `backend_type`.
fn auxiliary_counts(pg: &PgCluster) -> BTreeMap<String, usize> {
    let rows = pg
        .psql("select backend_type, count(*) from pg_stat_activity group by 1")
        .expect("pg_stat_activity");
    let mut out: BTreeMap<String, usize> = AUXILIARY.iter().map(|r| ((*r).to_owned(), 0)).collect();
    for line in rows.lines() {
        if let Some((kind, n)) = line.split_once('|')
            && let Some(v) = out.get_mut(kind)
        {
            *v = n.trim().parse().unwrap_or(0);
        }
    }
    out
}

/// Forks of the made-up postmaster below, while pgio does not track it.
const HOSTILE_FORKS: u32 = 100;

/// Any process may be called `postgres`: a made-up postmaster (run by `nobody` in a data
/// directory of its own) that forks in a loop before pgio has read its exec tells of
/// `EARLY_FORKS_PER_PROCESS` (64) of its children per exec (it execs itself once and forks
/// as many again), the rest is counted as `early_fork_over_budget`, exactly; the lifecycle
/// ring loses nothing. pgio then tracks the postmaster, takes in the children it was told of,
/// which had exited already, and lets each go at its first look: the postmaster alone stays
/// tracked, and nothing once it ends.
#[test]
fn a_made_up_postmaster_forking_before_pgio_read_its_exec_is_bounded() {
    if !require_root("a_made_up_postmaster_forking_before_pgio_read_its_exec_is_bounded") {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let tmp = temp_dir().expect("temp dir");
    let (_, data, postgres) = fake_postgres::setup(tmp.path());
    let daemon = Daemon::with_config("rescan_interval_secs = 3600\n").expect("daemon");
    let dropped = |m: &pgio_testkit::Metrics, reason: &str| {
        m.sum("pgio_events_dropped_total", &[("reason", reason)])
    };
    let postgres_tracked =
        |m: &pgio_testkit::Metrics| m.sum("pgio_tracked_processes", &[("app", "postgres")]);
    let before = daemon.scrape();

    let stopped = Stopped::new(daemon.0.pid());
    let mut postmaster = Command::new(&postgres)
        .args(["forks", &HOSTILE_FORKS.to_string(), "again"])
        .current_dir(&data)
        .uid(fake_postgres::NOBODY)
        .gid(fake_postgres::NOBODY)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("made-up postmaster");
    let mut out = BufReader::new(postmaster.stdout.take().expect("stdout"));
    for exec in ["first", "second"] {
        let mut line = String::new();
        out.read_line(&mut line).expect("its forks");
        assert_eq!(
            line.trim(),
            HOSTILE_FORKS.to_string(),
            "children forked, {exec} exec"
        );
    }
    drop(stopped);

    // Tracked, and every child it was told of let go again.
    let alone = wait_until(Duration::from_secs(5), Duration::from_millis(100), || {
        let m = daemon.scrape();
        fake_postgres::fake_postmasters(&m) == 1.0 && postgres_tracked(&m) == 1.0
    });
    let during = daemon.scrape();
    drop(postmaster.stdin.take());
    let _ = postmaster.wait();
    let gone = wait_until(Duration::from_secs(5), Duration::from_millis(100), || {
        postgres_tracked(&daemon.scrape()) == 0.0
    });
    let after = daemon.scrape();
    let over =
        dropped(&after, "early_fork_over_budget") - dropped(&before, "early_fork_over_budget");
    let ring = dropped(&after, "lifecycle_ring_full") - dropped(&before, "lifecycle_ring_full");
    eprintln!(
        "made-up postmaster: {HOSTILE_FORKS} forks after each of its 2 execs, before pgio read them: \
         early_fork_over_budget +{over}, lifecycle_ring_full +{ring}; postgres processes \
         tracked while it ran {}, after {}",
        postgres_tracked(&during),
        postgres_tracked(&after) + 0.0
    );
    assert_eq!(
        over,
        f64::from(2 * (HOSTILE_FORKS - 64)),
        "early_fork_over_budget"
    );
    assert_eq!(ring, 0.0, "lifecycle_ring_full");
    assert!(
        alone,
        "while it ran, pgio tracked {} postgres processes, {} of them postmasters (want 1, 1)",
        postgres_tracked(&during),
        fake_postgres::fake_postmasters(&during)
    );
    assert!(
        gone,
        "after it ended, pgio tracks {} postgres processes",
        postgres_tracked(&after)
    );
    daemon.stop().expect("daemon stop");
}
