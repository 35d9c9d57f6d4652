//! Two PostgreSQL clusters on one node stay apart: cluster A is PostgreSQL 15 without
//! `cluster_name` (its `pg_cluster` label is its data directory), cluster B is PostgreSQL 17 with
//! `cluster_name = 'bravo'`. Each has its data on its own loop device. Both are started after
//! pgio, so the postmasters come in through exec and learn their label from their children.
//!
//! Asserted:
//! - every process of each postmaster (itself and every child, from /proc) is tracked under
//!   its cluster's label;
//! - a cold seq scan in A: ≥ 95 % of A's device reads are on A's client backend, none on
//!   `bravo`'s series, and B's backends make no read syscall; then the same the other way.

mod common;

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use common::{Daemon, delta, delta_by, losses, snapshot};
use pgio_testkit::{
    Ext4Mount, LoopDevice, Metrics, PgCluster, PgOptions, TempDir, on_path, pg_bin_dir,
    processes_with_parent, require_root, temp_dir, wait_until,
};

const ROWS: u64 = 150_000;

/// The tests run one at a time: each reads every postmaster pgio tracks on the node, and the
/// other's initdb runs `postgres --boot`/`--single` processes, which are postmasters without a
/// cluster label until they exit (seen in CI: the slow-start test saw one beside its own).
fn one_at_a_time() -> MutexGuard<'static, ()> {
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

struct Cluster {
    label: String,
    pg: PgCluster,
    fs: Ext4Mount,
    lo: LoopDevice,
    _dir: TempDir,
}

fn cluster(major: u32, port: u16, name: Option<&str>) -> Cluster {
    let bin = pg_bin_dir(major).unwrap_or_else(|e| panic!("PostgreSQL {major}: {e:#}"));
    let dir = temp_dir().expect("temp dir");
    let lo = LoopDevice::create(dir.path(), 512 << 20, true).expect("loop device");
    let fs = Ext4Mount::new(&lo, &dir.path().join("mnt")).expect("ext4");
    let data = fs.path().join("pgdata");
    let mut opts = PgOptions::new(&bin, &data, port)
        .shared_buffers("16MB")
        .setting("autovacuum", "off");
    if let Some(n) = name {
        opts = opts.setting("cluster_name", &format!("'{n}'"));
    }
    let mut pg = PgCluster::init_with(opts).expect("initdb");
    pg.start().expect("start");
    for sql in [
        format!(
            "create table t as select g, repeat('x', 200) as pad from generate_series(1, {ROWS}) g"
        ),
        "vacuum (freeze, analyze) t".into(),
        "checkpoint".into(),
    ] {
        pg.psql(&sql).expect("prepare table t");
    }
    pg.stop().expect("stop");
    let label = match name {
        Some(n) => n.to_owned(),
        None => std::fs::canonicalize(&data)
            .expect("canonical data directory")
            .to_string_lossy()
            .into_owned(),
    };
    Cluster {
        label,
        pg,
        fs,
        lo,
        _dir: dir,
    }
}

#[test]
fn two_clusters_stay_apart() {
    let _one = one_at_a_time();
    if !require_root("two_clusters_stay_apart") {
        return;
    }
    let mut a = cluster(15, 56_430, None);
    let mut b = cluster(17, 56_431, Some("bravo"));
    for c in [&mut a, &mut b] {
        c.fs.remount().expect("remount: cold cache");
    }
    let daemon = Daemon::start(&[]).expect("daemon");
    a.pg.start().expect("start A");
    b.pg.start().expect("start B");

    // Every process of each cluster under its own label.
    let mut got = BTreeMap::new();
    let mut want = BTreeMap::new();
    let settled = wait_until(Duration::from_secs(10), Duration::from_millis(200), || {
        want = [&a, &b]
            .iter()
            .map(|c| {
                let pm = c.pg.postmaster_pid().expect("postmaster");
                (
                    c.label.clone(),
                    1.0 + processes_with_parent(pm).len() as f64,
                )
            })
            .collect();
        // Other clusters may run on the machine: a process of ours under any other label
        // shows as a shortfall here.
        got = by_cluster(&daemon.scrape());
        got.retain(|k, _| want.contains_key(k));
        got == want
    });
    assert!(
        settled,
        "tracked Postgres processes by cluster: got {got:?}, want {want:?}"
    );
    for c in [&a, &b] {
        let m = daemon.scrape();
        assert_eq!(
            m.sum(
                "pgio_tracked_processes",
                &[("role", "postmaster"), ("pg_cluster", c.label.as_str())]
            ),
            1.0,
            "the postmaster of {} carries its cluster label",
            c.label
        );
    }

    scan_in(&daemon, &a, &b);
    scan_in(&daemon, &b, &a);
    daemon.stop().expect("daemon stop");
    for c in [&mut a, &mut b] {
        c.pg.stop().expect("stop");
    }
}

/// A postmaster slower to change into its data directory than pgio's looks at it (strace
/// holds its `chdir` 3 s; the last look comes 2 s after exec: TCG guests and loaded nodes
/// start Postgres that slowly) gets its cluster label as soon as its first auxiliary process
/// is classified, not at the next /proc rescan (an hour away here): until then its events
/// were held back or booked without a cluster.
#[test]
fn a_postmaster_slow_to_start_is_labelled_by_its_first_auxiliary_process() {
    let _one = one_at_a_time();
    if !require_root("a_postmaster_slow_to_start_is_labelled_by_its_first_auxiliary_process") {
        return;
    }
    assert!(
        on_path("strace"),
        "strace is missing (cargo xtask setup installs it)"
    );
    let bin = pg_bin_dir(15).unwrap_or_else(|e| panic!("PostgreSQL 15: {e:#}"));
    let dir = temp_dir().expect("temp dir");
    let data = dir.path().join("pgdata");
    let mut pg = PgCluster::init_with(PgOptions::new(&bin, &data, 56_432).shared_buffers("16MB"))
        .expect("initdb");
    let label = std::fs::canonicalize(&data)
        .expect("canonical data directory")
        .to_string_lossy()
        .into_owned();
    let daemon = Daemon::with_config("rescan_interval_secs = 3600\n").expect("daemon");
    let mut strace = pg
        .start_under(&[
            "strace",
            "-qq",
            "-o",
            "/dev/null",
            "-e",
            "trace=chdir",
            "-e",
            "inject=chdir:delay_enter=3000000",
        ])
        .expect("start under strace");
    let pm = pg.postmaster_pid().expect("postmaster");
    let postmasters = |m: &Metrics| {
        m.matching("pgio_tracked_processes", &[("role", "postmaster")])
            .filter(|s| s.value > 0.0)
            .map(|s| format!("{:?}", s.labels))
            .collect::<Vec<_>>()
    };
    let mut m = daemon.scrape();
    let labelled = wait_until(Duration::from_secs(10), Duration::from_millis(100), || {
        m = daemon.scrape();
        m.sum(
            "pgio_tracked_processes",
            &[("role", "postmaster"), ("pg_cluster", label.as_str())],
        ) == 1.0
            && m.sum("pgio_provisional_processes", &[]) == 0.0
    });
    let unlabelled = m
        .matching(
            "pgio_tracked_processes",
            &[("app", "postgres"), ("role", "postmaster")],
        )
        .filter(|s| s.value > 0.0 && !s.labels.contains_key("pg_cluster"))
        .count();
    pg.stop().expect("stop");
    let _ = strace.wait();
    daemon.stop().expect("daemon stop");
    assert!(
        labelled && unlabelled == 0,
        "postmaster {pm} of {label}: tracked postmasters {:?}, provisional processes {}",
        postmasters(&m),
        m.sum("pgio_provisional_processes", &[])
    );
}

/// pgio_tracked_processes{app="postgres"} summed by cluster.
fn by_cluster(m: &Metrics) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for s in m.matching("pgio_tracked_processes", &[("app", "postgres")]) {
        let c = s.labels.get("pg_cluster").cloned().unwrap_or_default();
        *out.entry(c).or_default() += s.value;
    }
    out.retain(|_, v| *v > 0.0);
    out
}

/// A cold seq scan in `c` while `other` idles with an open session.
fn scan_in(daemon: &Daemon, c: &Cluster, other: &Cluster) {
    // Plan once first so the window holds only the table's reads (see pg_scan.rs).
    let settings = "set enable_indexonlyscan = off; set max_parallel_workers_per_gather = 0;";
    c.pg.psql(&format!("{settings} explain select count(*) from t"))
        .expect("explain");
    let _idle = other.pg.session("postgres", "postgres").expect("session");
    std::thread::sleep(Duration::from_millis(300));
    c.lo.wait_quiet(Duration::from_secs(10));
    let (before, d0) = snapshot(daemon, c.lo.name());
    let count =
        c.pg.psql(&format!("{settings} select count(*) from t"))
            .expect("scan");
    let (after, d1) = snapshot(daemon, c.lo.name());
    assert_eq!(count, ROWS.to_string());

    let device_reads = (d1.reads_completed - d0.reads_completed) as f64;
    let reads = |cluster: &str| {
        delta(
            &before,
            &after,
            "pgio_block_io_requests_total",
            &[
                ("device", c.lo.name()),
                ("op", "read"),
                ("role", "client backend"),
                ("pg_cluster", cluster),
            ],
        )
    };
    let syscalls = |cluster: &str| {
        delta(
            &before,
            &after,
            "pgio_syscall_seconds_count",
            &[
                ("app", "postgres"),
                ("role", "client backend"),
                ("pg_cluster", cluster),
            ],
        )
    };
    let (mine, theirs) = (reads(&c.label), reads(&other.label));
    let other_syscalls = syscalls(&other.label);
    eprintln!(
        "pg_clusters: scan in {:?}: {} device reads ({:.1} MiB), {mine} on its client backend, {theirs} on {:?}'s; read syscalls {} vs {other_syscalls}",
        c.label,
        device_reads,
        (d1.sectors_read - d0.sectors_read) as f64 / 2048.0,
        other.label,
        syscalls(&c.label)
    );
    // ~35 MB of table; readahead makes the requests large (about 1 MB each here).
    let mib = (d1.sectors_read - d0.sectors_read) as f64 / 2048.0;
    assert!(
        mib >= 25.0,
        "{}: the cold scan read only {mib:.1} MiB from its device",
        c.label
    );
    assert!(
        mine >= 0.95 * device_reads,
        "{}: {mine} of {device_reads} device reads on its client backend; pgio's reads on the \
         device by app/role/cluster: {:#?}; {}",
        c.label,
        delta_by(
            &before,
            &after,
            "pgio_block_io_requests_total",
            &[("device", c.lo.name()), ("op", "read")],
            &["app", "role", "pg_cluster"],
        ),
        losses(&before, &after),
    );
    assert_eq!(
        theirs, 0.0,
        "{}'s reads booked under {}",
        c.label, other.label
    );
    assert_eq!(other_syscalls, 0.0, "the idle cluster {} read", other.label);
}
