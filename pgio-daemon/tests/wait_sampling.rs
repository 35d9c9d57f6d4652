//! pgio's split of query time by wait event type, per query id, against a peer that samples
//! the same thing: `pg_wait_sampling` (Debian's `postgresql-15-pg-wait-sampling`, every
//! 1 ms), on PostgreSQL 15 under a mixed load of 10 s in one database:
//! - `pgbench -N -c 2 -R 400` on cold accounts (reads from the device; CPUs left free: what
//!   a backend waits for a CPU is `runnable` in pgio and its wait event in the samples);
//! - a locker holding a row lock 1.5 s, three times, while another session's `UPDATE` waits
//!   for it (`Lock`);
//! - cold scans of a 64 MB table for those 10 s, its pages dropped from the page cache before
//!   each (`IO`).
//!
//! Per query id that `pg_wait_sampling` saw wait at least 0.2 s (200 samples), the share of
//! each wait type in pgio's waits (`pgio_query_id_part_seconds_total`, the parts but `cpu`,
//! `runnable`, `none` and `unknown`: off CPU under a wait event, and IO syscalls' time on CPU)
//! is within 5 points of its share in the samples.
//! The blocked `UPDATE`, the cold scan and pgbench's `UPDATE` must be among them.
//!
//! Where the two differ by definition: `pg_wait_sampling` 1.1.4 samples a wait event while it
//! is set, also while the backend waits for a CPU, which pgio books as `runnable` (on busy
//! CPUs the sampled `IO` share grows by it: the cold scan read 89.6 % against pgio's 83.6 %
//! beside a build); it samples no CPU time; and it books a query's time under its id from
//! planning to `ExecutorEnd` (utility statements, parsing and the commit under 0), pgio from
//! reading the request to ReadyForQuery. Ids 0 are left out. Measured here: largest
//! difference 1.6-2.0 points in 3 runs (before IO syscalls' time on CPU was booked under
//! their wait event, the cold scan's `IO` share was 2.4 and 6.2 points under the samples',
//! beside a CI run).
mod common;

use std::{
    collections::BTreeMap,
    time::{Duration, Instant},
};

use common::Daemon;
use pgio_testkit::{PgCluster, PgOptions, drop_page_cache, pg_bin_dir, require_root, temp_dir};

const DB: &str = "sampled";
/// Samples of a query id's waits below which it is not compared (0.2 s at 1 ms).
const MIN_SAMPLES: f64 = 200.0;
/// Points a wait type's share may differ by (the bar).
const POINTS: f64 = 5.0;
/// Until every query's run and id rows are out of the kernel (as in `query_id.rs`).
const DRAINED: Duration = Duration::from_millis(4_000);
/// pgio's parts that are not a wait event type.
const NOT_WAITS: [&str; 4] = ["cpu", "runnable", "none", "unknown"];

const LIBRARY: &str = "/usr/lib/postgresql/15/lib/pg_wait_sampling.so";

type Shares = BTreeMap<String, f64>;

/// Each key's share of the sum, in points.
fn shares(by_type: &BTreeMap<String, f64>) -> Shares {
    let sum: f64 = by_type.values().sum();
    by_type
        .iter()
        .map(|(k, v)| (k.clone(), if sum > 0.0 { 100.0 * v / sum } else { 0.0 }))
        .collect()
}

#[test]
fn pg15_waits_by_query_id_against_pg_wait_sampling() {
    let name = "pg15_wait_sampling";
    if !require_root(name) {
        return;
    }
    assert!(
        std::path::Path::new(LIBRARY).is_file(),
        "{name}: {LIBRARY} is missing: `cargo xtask setup` installs postgresql-15-pg-wait-sampling"
    );
    let bin = pg_bin_dir(15).unwrap_or_else(|e| panic!("PostgreSQL 15: {e:#}"));
    let dir = temp_dir().expect("temp dir");
    let pgdata = dir.path().join("pgdata");
    let opts = PgOptions::new(&bin, pgdata.clone(), 55_591)
        .shared_buffers("16MB")
        .setting("autovacuum", "off")
        .setting(
            "shared_preload_libraries",
            "'pg_stat_statements,pg_wait_sampling'",
        )
        .setting("compute_query_id", "on")
        .setting("jit", "off")
        .setting("track_io_timing", "on")
        .setting("pg_wait_sampling.profile_period", "1")
        .setting("pg_wait_sampling.profile_pid", "false");
    let mut pg = PgCluster::init_with(opts).expect("initdb");
    pg.start().expect("start");
    let q = |pg: &PgCluster, sql: &str| {
        pg.psql_in(DB, sql)
            .unwrap_or_else(|e| panic!("{sql}: {e:#}"))
    };
    pg.psql(&format!("create database {DB}"))
        .expect("create database");
    q(&pg, "create extension pg_wait_sampling");
    q(&pg, "create extension pg_stat_statements");
    pg.pgbench_ok(&["-i", "-q", "-s", "3", DB])
        .expect("pgbench -i");
    q(
        &pg,
        "create table lock_me (id int primary key, v int, w int)",
    );
    q(&pg, "insert into lock_me values (1, 0, 0)");
    // ~64 MB: more than a quarter of shared buffers, so each scan reads it through syscalls.
    q(
        &pg,
        "create table cold as select g, repeat('x', 200) as pad from generate_series(1, 290000) g",
    );
    q(&pg, "vacuum freeze cold");
    q(&pg, "checkpoint");
    let file =
        |rel: &str| pgdata.join(q(&pg, &format!("select pg_relation_filepath('{rel}')")).trim());
    let cold = file("cold");
    // pgbench's accounts cold too: its queries wait for reads from the device.
    for rel in ["pgbench_accounts", "pgbench_accounts_pkey"] {
        drop_page_cache(&file(rel)).expect("drop cache");
    }

    let daemon = Daemon::start(&[]).expect("daemon");
    daemon.wait_tracked("postgres", "checkpointer");
    assert!(
        daemon.wait_postmaster_found(),
        "{name}: pgio found no postmaster's wait events"
    );
    let cluster = pgdata.to_string_lossy().into_owned();
    let labels = [("pg_cluster", cluster.as_str()), ("database", DB)];
    let mut locker = pg.session(DB, "postgres").expect("session");
    let mut blocked = pg.session(DB, "postgres").expect("session");
    q(&pg, "select pg_wait_sampling_reset_profile()");
    q(&pg, "select pg_stat_statements_reset()");
    let before = daemon.scrape();
    std::thread::scope(|s| {
        s.spawn(|| {
            pg.pgbench_ok(&["-n", "-N", "-c", "2", "-R", "400", "-T", "10", DB])
                .expect("pgbench -N")
        });
        // For pgbench's 10 s, and at least 6: on a fast disk 6 scans gave 196 samples, under
        // the 200 that a comparison needs (a CI run).
        s.spawn(|| {
            let until = Instant::now() + Duration::from_secs(10);
            let mut scans = 0;
            while scans < 6 || Instant::now() < until {
                drop_page_cache(&cold).expect("drop cache");
                q(&pg, "select count(*) from cold");
                scans += 1;
            }
            eprintln!("{name}: {scans} cold scans");
        });
        for _ in 0..3 {
            locker
                .send("begin; update lock_me set v = v + 1 where id = 1;")
                .expect("send");
            std::thread::sleep(Duration::from_millis(300));
            blocked
                .send("update lock_me set w = w + 1 where id = 1;")
                .expect("send");
            std::thread::sleep(Duration::from_millis(1_500));
            locker.send("commit;").expect("send");
            std::thread::sleep(Duration::from_millis(700));
        }
    });
    std::thread::sleep(DRAINED);
    let after = daemon.scrape();

    // The peer's samples per query id and wait type.
    let mut sampled: BTreeMap<String, BTreeMap<String, f64>> = BTreeMap::new();
    for line in q(
        &pg,
        "select queryid, event_type, sum(count) from pg_wait_sampling_profile \
         where queryid <> 0 group by 1, 2",
    )
    .lines()
    {
        let f: Vec<&str> = line.split('|').collect();
        assert_eq!(f.len(), 3, "{line}");
        let n: f64 = f[2].parse().expect("count");
        *sampled
            .entry(f[0].to_owned())
            .or_default()
            .entry(f[1].to_owned())
            .or_default() += n;
    }
    let pgss: BTreeMap<String, (String, String)> = q(
        &pg,
        "select queryid, calls || ' calls, ' || round(total_exec_time::numeric, 1) || ' ms, \
         reads ' || round(blk_read_time::numeric, 1) || ' ms', query from pg_stat_statements",
    )
    .lines()
    .filter_map(|l| {
        let mut f = l.splitn(3, '|');
        Some((
            f.next()?.to_owned(),
            (f.next()?.to_owned(), f.next()?.to_owned()),
        ))
    })
    .collect();
    let texts: BTreeMap<String, String> = pgss
        .iter()
        .map(|(id, (_, t))| (id.clone(), t.clone()))
        .collect();
    let delta = |family: &str, id: &str| {
        let l = [
            ("pg_cluster", cluster.as_str()),
            ("database", DB),
            ("queryid", id),
        ];
        after.sum(family, &l) - before.sum(family, &l)
    };
    // pgio's time per query id and part over the window.
    let mut booked: BTreeMap<String, BTreeMap<String, f64>> = BTreeMap::new();
    for s in after.matching("pgio_query_id_part_seconds_total", &labels) {
        let part = s.labels["part"].as_str();
        let was: f64 = before
            .matching("pgio_query_id_part_seconds_total", &labels)
            .filter(|b| b.labels == s.labels)
            .map(|b| b.value)
            .sum();
        *booked
            .entry(s.labels["queryid"].clone())
            .or_default()
            .entry(part.to_owned())
            .or_default() += s.value - was;
    }

    let mut compared = Vec::new();
    let mut worst = 0.0_f64;
    for (id, by_type) in &sampled {
        let samples: f64 = by_type.values().sum();
        let text = texts.get(id).map_or("?", String::as_str);
        if samples < MIN_SAMPLES {
            eprintln!("{name}: {id} `{text}`: {samples} samples, not compared");
            continue;
        }
        let empty = BTreeMap::new();
        let parts = booked.get(id).unwrap_or(&empty);
        let ours: BTreeMap<String, f64> = parts
            .iter()
            .filter(|(p, _)| !NOT_WAITS.contains(&p.as_str()))
            .map(|(p, v)| (p.clone(), *v))
            .collect();
        let (theirs, mine) = (shares(by_type), shares(&ours));
        let waited: f64 = ours.values().sum();
        let part = |p: &str| parts.get(p).copied().unwrap_or(0.0);
        eprintln!(
            "{name}: {id} `{text}`: pg_wait_sampling {samples} samples {theirs:.1?}; \
             pgio {waited:.3} s {mine:.1?}, cpu {:.3} s, runnable {:.3} s, none {:.3} s",
            part("cpu"),
            part("runnable"),
            part("none"),
        );
        eprintln!(
            "{name}: {id}: pg_stat_statements {}; pgio {} queries, {:.1} ms, IO {:.1} ms",
            pgss.get(id).map_or("?", |p| p.0.as_str()),
            delta("pgio_query_id_seconds_count", id),
            delta("pgio_query_id_seconds_sum", id) * 1e3,
            delta("pgio_query_id_io_seconds_sum", id) * 1e3,
        );
        for t in theirs.keys().chain(mine.keys()) {
            let (a, b) = (
                theirs.get(t).copied().unwrap_or(0.0),
                mine.get(t).copied().unwrap_or(0.0),
            );
            worst = worst.max((a - b).abs());
            assert!(
                (a - b).abs() <= POINTS,
                "{name}: {id} `{text}`: {t} is {a:.1} % of pg_wait_sampling's samples, \
                 {b:.1} % of pgio's waits"
            );
        }
        compared.push(text.to_owned());
    }
    eprintln!(
        "{name}: {} query ids compared, largest difference {worst:.1} points",
        compared.len()
    );
    for must in [
        "update lock_me set w",
        "select count(*) from cold",
        "UPDATE pgbench_accounts",
    ] {
        assert!(
            compared.iter().any(|t| t.starts_with(must)),
            "{name}: `{must}…` not compared (had {compared:?})"
        );
    }
    drop((locker, blocked));
}
