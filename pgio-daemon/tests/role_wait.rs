//! Where PostgreSQL's processes other than client backends wait (issue 47, item 5), on a real
//! PostgreSQL 18 (PyPI, default `io_method = worker`, `wal_writer_delay = 10ms`), against
//! the kernel's own accounting and pgio's syscall times:
//! - the walwriter, idle but for its timer: over a 4 s window, its booked waits
//!   (`pgio_wait_seconds_sum`, every part) are its off-CPU time by `/proc/<pid>/schedstat`
//!   (wall time less run time) within 2 % and one hibernating sleep (0.25 s) at each edge of
//!   the window (a wait is booked when it ends: one open at the start is booked whole inside
//!   the window, one open at the end not at all), and 95 % of the blocked part is
//!   `Activity` (`WalWriterMain`);
//! - a cold 40 MB scan: the io workers' `IO` waits are > 0 and at most the scan's read
//!   syscall time (their reads, booked under the client backend since item 4) + 2 %;
//! - a `CHECKPOINT` after 20 MB of new rows: the checkpointer's `IO` waits are > 0 and at
//!   most its own write and sync syscall time + 2 %.
//!
//! - per role, the blocked time by individual wait event (`pgio_wait_event_seconds_total`)
//!   is the same as by type, the walwriter's `Activity` is `WalWriterMain`, and every event
//!   of a known type has its name.
//!
//! - a client backend's waits inside its queries are booked the same way: the cold scan's
//!   client waited for the io workers under `IO`, for no longer than its query took.
mod common;

use std::time::{Duration, Instant};

use common::Daemon;
use pgio_testkit::{Metrics, PgCluster, PgOptions, pg_bin_dir, require_root, temp_dir};

/// (run ns, run-queue ns) of a process, from `/proc/<pid>/schedstat`.
fn schedstat(pid: u32) -> (f64, f64) {
    let s = std::fs::read_to_string(format!("/proc/{pid}/schedstat")).expect("schedstat");
    let v: Vec<f64> = s
        .split_whitespace()
        .map(|x| x.parse().expect("number"))
        .collect();
    (v[0] / 1e9, v[1] / 1e9)
}

fn waits(m: &Metrics, cluster: &str, role: &str, part: Option<&str>) -> f64 {
    let mut l = vec![("pg_cluster", cluster), ("role", role)];
    if let Some(p) = part {
        l.push(("part", p));
    }
    m.sum("pgio_wait_seconds_sum", &l)
}

/// Blocked time by individual wait event of `role` (`None`: every type).
fn events(m: &Metrics, cluster: &str, role: &str, ty: Option<&str>, ev: Option<&str>) -> f64 {
    let mut l = vec![("pg_cluster", cluster), ("role", role)];
    l.extend(ty.map(|t| ("wait_event_type", t)));
    l.extend(ev.map(|e| ("wait_event", e)));
    m.sum("pgio_wait_event_seconds_total", &l)
}

/// The individual events are the same intervals as the parts by type, less the run-queue
/// waits: per role, within 1 % and 50 ms (the two maps are read a moment apart, and the
/// walwriter books a wait every 10 ms). Every event of a known type has its name.
fn events_match_waits(m: &Metrics, cluster: &str) {
    for role in [
        "walwriter",
        "checkpointer",
        "io worker",
        "background writer",
        "client backend",
    ] {
        let blocked = waits(m, cluster, role, None) - waits(m, cluster, role, Some("runnable"));
        let by_event = events(m, cluster, role, None, None);
        eprintln!("{role}: blocked {blocked:.4} s, by event {by_event:.4} s");
        assert!(
            (by_event - blocked).abs() <= 0.01 * blocked + 0.05,
            "{role}: {by_event} s by wait event, {blocked} s blocked by type"
        );
    }
    // `unknown` as the type too is a wait read before pgio found where the process keeps
    // its event (its first ones, at pgio's start): that is not a name missing.
    let unnamed: Vec<_> = m
        .matching(
            "pgio_wait_event_seconds_total",
            &[("pg_cluster", cluster), ("wait_event", "unknown")],
        )
        .filter(|s| s.labels["wait_event_type"] != "unknown")
        .map(|s| format!("{:?} {}", s.labels, s.value))
        .collect();
    assert!(unnamed.is_empty(), "events with no name: {unnamed:?}");
}

fn pid_of(pg: &PgCluster, backend_type: &str) -> u32 {
    pg.psql(&format!(
        "select pid from pg_stat_activity where backend_type = '{backend_type}' limit 1"
    ))
    .expect("pg_stat_activity")
    .trim()
    .parse()
    .expect("pid")
}

#[test]
fn pg18_waits_of_background_processes() {
    if !require_root("pg18_waits_of_background_processes") {
        return;
    }
    let bin = pg_bin_dir(18).unwrap_or_else(|e| panic!("PostgreSQL 18: {e:#}"));
    let dir = temp_dir().expect("temp dir");
    let pgdata = dir.path().join("pgdata");
    let opts = PgOptions::new(&bin, pgdata.clone(), 55_591)
        .shared_buffers("16MB")
        .setting("autovacuum", "off")
        .setting("wal_writer_delay", "10ms");
    let mut pg = PgCluster::init_with(opts).expect("initdb");
    pg.start().expect("start");
    pg.psql(
        "create table big as select g, repeat('x', 200) as pad from generate_series(1, 180000) g",
    )
    .expect("create table");
    pg.psql("vacuum freeze big").expect("vacuum");
    pg.psql("checkpoint").expect("checkpoint");
    pg.stop().expect("stop");
    pg.start().expect("start");
    let cluster = pgdata.to_string_lossy().into_owned();

    let daemon = Daemon::start(&[]).expect("daemon");
    daemon.wait_tracked("postgres", "walwriter");
    daemon.wait_tracked("postgres", "io worker");
    assert!(daemon.wait_postmaster_found(), "postmaster not found");
    // A wait is booked when its process next leaves the CPU: let the first ones through.
    std::thread::sleep(Duration::from_secs(1));

    // 1. The walwriter's off-CPU time against schedstat.
    let walwriter = pid_of(&pg, "walwriter");
    let (before, s0, t0) = (daemon.scrape(), schedstat(walwriter), Instant::now());
    std::thread::sleep(Duration::from_secs(4));
    let (after, s1, wall) = (
        daemon.scrape(),
        schedstat(walwriter),
        t0.elapsed().as_secs_f64(),
    );
    let booked =
        waits(&after, &cluster, "walwriter", None) - waits(&before, &cluster, "walwriter", None);
    let activity = waits(&after, &cluster, "walwriter", Some("Activity"))
        - waits(&before, &cluster, "walwriter", Some("Activity"));
    let runnable = waits(&after, &cluster, "walwriter", Some("runnable"))
        - waits(&before, &cluster, "walwriter", Some("runnable"));
    let off_cpu = wall - (s1.0 - s0.0);
    eprintln!(
        "walwriter: {wall:.3} s, on CPU {:.4} s, off CPU {off_cpu:.4} s; pgio booked {booked:.4} s (Activity {activity:.4} s, runnable {runnable:.4} s)",
        s1.0 - s0.0
    );
    assert!(
        (booked - off_cpu).abs() <= 2.0 * 0.25 + 0.02 * off_cpu,
        "walwriter: booked {booked} s of waits, off CPU {off_cpu} s"
    );
    assert!(
        activity >= 0.95 * (booked - runnable),
        "walwriter: Activity {activity} s of {booked} s booked ({runnable} s runnable)"
    );
    let main = |m: &Metrics| {
        events(
            m,
            &cluster,
            "walwriter",
            Some("Activity"),
            Some("WalWriterMain"),
        )
    };
    let main = main(&after) - main(&before);
    assert!(
        main >= 0.95 * activity,
        "walwriter: WalWriterMain {main} s of its Activity {activity} s"
    );

    // 2. The io workers' IO during a cold scan (the table's pages dropped with a restart and
    // the page cache's copy evicted).
    let file = pg
        .psql("select pg_relation_filepath('big')")
        .expect("filepath");
    let path = pgdata.join(file.trim());
    pgio_testkit::drop_page_cache(&path).expect("drop cache");
    let before = daemon.scrape();
    pg.psql("set max_parallel_workers_per_gather = 0; select count(*) from big")
        .expect("scan");
    std::thread::sleep(Duration::from_millis(500));
    let after = daemon.scrape();
    let io = waits(&after, &cluster, "io worker", Some("IO"))
        - waits(&before, &cluster, "io worker", Some("IO"));
    let reads = |m: &Metrics| {
        ["pread64", "preadv", "preadv2"]
            .iter()
            .map(|s| {
                m.sum(
                    "pgio_syscall_seconds_sum",
                    &[
                        ("pg_cluster", cluster.as_str()),
                        ("role", "client backend"),
                        ("syscall", s),
                    ],
                )
            })
            .sum::<f64>()
    };
    let read_s = reads(&after) - reads(&before);
    eprintln!("cold scan: io workers' IO waits {io:.4} s, the scan's read syscalls {read_s:.4} s");
    assert!(io > 0.0, "no IO wait booked for the io workers");
    // The client backend waited for them inside its query: IO waits of its own, no more
    // than its query's time.
    let q = |m: &Metrics| {
        m.sum(
            "pgio_query_seconds_sum",
            &[("pg_cluster", cluster.as_str()), ("role", "client backend")],
        )
    };
    let (client_io, query_s) = (
        waits(&after, &cluster, "client backend", Some("IO"))
            - waits(&before, &cluster, "client backend", Some("IO")),
        q(&after) - q(&before),
    );
    eprintln!("cold scan: the client backend's IO waits {client_io:.4} s of its {query_s:.4} s");
    assert!(
        client_io > 0.0 && client_io <= query_s,
        "client backend's IO waits {client_io} s, its queries {query_s} s"
    );
    assert!(
        io <= 1.02 * read_s,
        "io workers' IO waits {io} s, more than the reads they did {read_s} s"
    );

    // 3. The checkpointer's IO in a CHECKPOINT.
    pg.psql(
        "create table more as select g, repeat('y', 200) as pad from generate_series(1, 80000) g",
    )
    .expect("insert");
    let before = daemon.scrape();
    pg.psql("checkpoint").expect("checkpoint");
    std::thread::sleep(Duration::from_millis(500));
    let after = daemon.scrape();
    let io = waits(&after, &cluster, "checkpointer", Some("IO"))
        - waits(&before, &cluster, "checkpointer", Some("IO"));
    let own = |m: &Metrics| {
        ["pwrite64", "pwritev", "pwritev2", "fsync", "fdatasync"]
            .iter()
            .map(|s| {
                m.sum(
                    "pgio_syscall_seconds_sum",
                    &[
                        ("pg_cluster", cluster.as_str()),
                        ("role", "checkpointer"),
                        ("syscall", s),
                    ],
                )
            })
            .sum::<f64>()
    };
    let sync_s = own(&after) - own(&before);
    eprintln!(
        "checkpoint: checkpointer's IO waits {io:.4} s, its write and sync syscalls {sync_s:.4} s"
    );
    assert!(io > 0.0, "no IO wait booked for the checkpointer");
    assert!(
        io <= 1.02 * sync_s,
        "checkpointer IO waits {io} s, more than its write and sync calls {sync_s} s"
    );
    events_match_waits(&after, &cluster);
    daemon.stop().expect("daemon stop");
    pg.stop().expect("stop");
}
