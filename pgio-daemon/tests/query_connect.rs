//! A new connection's first round trip, counted exactly under load (issue 46).
//!
//! `pgbench -C` opens a connection per transaction, so every transaction is a new backend's
//! first round trips: with `-M prepared` its Parse/Sync comes straight after the start-up,
//! while the backend is still provisional (pgio has not read its title yet) or has just been
//! classified. Two busy loops and a fork storm keep both CPUs saturated, so pgio's userspace
//! is late for most backends and many exit before it looks at them.
//!
//! Known answer: pgio's client-backend queries of the cluster = pgbench's transactions (plus,
//! with `-M prepared`, one Parse/Sync round trip per connection), exactly.
mod common;

use common::{Daemon, delta, delta_by, losses};
use pgio_testkit::{
    CpuHogs, MonotonicWatch, PgCluster, PgOptions,
    cpu_hogs::{FORK, SPIN},
    pg_bin_dir, require_root, temp_dir,
};

const QUERIES: &str = "pgio_query_seconds_count";

#[test]
fn pg15_new_connections_first_round_trip_counted_under_load() {
    if !require_root("pg15_new_connections_first_round_trip_counted_under_load") {
        return;
    }
    let bin = pg_bin_dir(15).expect("PostgreSQL 15");
    let dir = temp_dir().expect("temp dir");
    let opts =
        PgOptions::new(&bin, dir.path().join("data"), 56_530).setting("max_connections", "50");
    let mut pg = PgCluster::init_with(opts).expect("initdb");
    pg.start().expect("start");
    pg.pgbench_ok(&["-i", "-q", "-s", "1", "postgres"])
        .expect("pgbench -i");
    let data_dir = std::fs::canonicalize(pg.data_dir()).expect("data directory");
    let cluster = data_dir.to_str().expect("UTF-8 path").to_owned();
    // The -S statement as a script: the built-in one first asks the server for the scale,
    // on a connection of its own.
    let script = pg.socket_dir().join("select.sql");
    std::fs::write(
        &script,
        "\\set aid random(1, 100000)\nSELECT abalance FROM pgbench_accounts WHERE aid = :aid;\n",
    )
    .expect("script");
    let daemon = Daemon::with_config("").expect("daemon");
    daemon.wait_tracked("postgres", "postmaster");

    let load = CpuHogs::scripts(&[SPIN, SPIN, FORK]);
    // Scrapes back to back meanwhile: a scrape that reads a count twice, or misses one, while
    // the once-a-second pass moves a new backend's counts out of its provisional series
    // shows as a counter stepping back at the next scrape.
    let watch = MonotonicWatch::start(
        &format!("{}/metrics", daemon.url()),
        std::time::Duration::from_millis(5),
    );
    let mut failures = Vec::new();
    // (how pgbench runs, rounds): `-C` opens a connection per transaction; without it each
    // round connects 8 clients at once, whose first round trips all come together.
    let scenarios: [(&str, &[&str], u32); 3] = [
        (
            "-C -M prepared",
            &["-C", "-M", "prepared", "-c", "4", "-j", "2", "-t", "250"],
            1,
        ),
        (
            "-C -M simple",
            &["-C", "-M", "simple", "-c", "4", "-j", "2", "-t", "250"],
            1,
        ),
        (
            "-M prepared -c 8, 25 rounds",
            &["-M", "prepared", "-c", "8", "-j", "2", "-t", "5"],
            25,
        ),
    ];
    for (name, args, rounds) in scenarios {
        let before = daemon.scrape();
        let (mut transactions, mut connections) = (0.0, 0.0);
        for _ in 0..rounds {
            let mut all = vec!["-n"];
            all.extend_from_slice(args);
            let script = script.to_string_lossy();
            all.extend_from_slice(&["-f", &script, "postgres"]);
            let out = pg
                .pgbench_ok(&all)
                .unwrap_or_else(|e| panic!("pgbench {name}: {e:#}"));
            let n: f64 = out
                .lines()
                .find_map(|l| l.strip_prefix("number of transactions actually processed: "))
                .and_then(|v| v.split('/').next()?.trim().parse().ok())
                .unwrap_or_else(|| panic!("no transaction count in {out}"));
            transactions += n;
            connections += if args.contains(&"-C") {
                n
            } else {
                args[args.iter().position(|a| *a == "-c").expect("-c") + 1]
                    .parse::<f64>()
                    .expect("clients")
            };
        }
        // -M prepared: each connection first prepares the statement, a round trip of its own.
        let want = if name.contains("prepared") {
            transactions + connections
        } else {
            transactions
        };
        let backend = [
            ("app", "postgres"),
            ("role", "client backend"),
            ("pg_cluster", cluster.as_str()),
        ];
        // The last backends' queries reach the rows within a second (their CPU's run).
        pgio_testkit::wait_until(
            std::time::Duration::from_secs(10),
            std::time::Duration::from_millis(100),
            || delta(&before, &daemon.scrape(), QUERIES, &backend) >= want,
        );
        std::thread::sleep(std::time::Duration::from_millis(1_500));
        let after = daemon.scrape();
        let got = delta(&before, &after, QUERIES, &backend);
        let by_role = delta_by(
            &before,
            &after,
            QUERIES,
            &[("pg_cluster", cluster.as_str())],
            &["role", "database", "user"],
        );
        eprintln!(
            "PostgreSQL 15 {name}: {transactions} transactions, {connections} connections, \
             want {want} queries, pgio {got}; by role {by_role:?}; {}",
            losses(&before, &after)
        );
        if got != want {
            failures.push(format!("{name}: {got} queries for {want}"));
        }
    }
    drop(load);
    let watched = watch.finish().expect("scrapes");
    eprintln!(
        "{} scrapes back to back, {} samples stepped back",
        watched.scrapes,
        watched.steps_back.len()
    );
    if !watched.clean() {
        failures.push(format!(
            "{} samples stepped back, {} series twice in a scrape, in {} scrapes:\n{}",
            watched.steps_back.len(),
            watched.duplicates.len(),
            watched.scrapes,
            watched.describe(20)
        ));
    }
    assert!(failures.is_empty(), "{failures:#?}");
    daemon.stop().expect("daemon stop");
    pg.stop().expect("stop");
}
