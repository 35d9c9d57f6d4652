//! The relation family (`relations = true`) on real PostgreSQL 15 and 17: PGDATA on ext4 on a
//! direct-IO loop device, shared_buffers 16MB, a table `a` (~25 MB) and a table `b` (~2.5 MB),
//! cold after a remount. A new session's sequential scan of `a`:
//! - its backend's reads on `a`'s file (`file="base/<db>/<relfilenode>"`) = the blocks
//!   PostgreSQL read from outside shared buffers (`pg_statio_user_tables.heap_blks_read` of
//!   `a`), each 8 KiB on PostgreSQL 15; PostgreSQL 17 combines up to 16 blocks per `preadv`, so
//!   there the bytes equal blocks × 8 KiB;
//! - nothing on `b`'s file.
//!
//! Then rows of `b` are updated and a `CHECKPOINT` runs: the checkpointer writes `b`'s file
//! and syncs it (at least one fsync on it), and writes nothing of `a`'s.
mod common;

use std::sync::Mutex;

use common::{Daemon, delta};
use pgio_testkit::{
    Ext4Mount, LoopDevice, Metrics, PgCluster, PgOptions, pg_bin_dir, require_root, temp_dir,
};

static SERIAL: Mutex<()> = Mutex::new(());

const FAMILY: &str = "pgio_relation_io_seconds_count";

#[test]
fn pg15_reads_and_writes_by_relation_file() {
    case(15, 0);
}

#[test]
fn pg17_reads_and_writes_by_relation_file() {
    case(17, 1);
}

fn q(pg: &PgCluster, sql: &str) -> String {
    pg.psql(sql).unwrap_or_else(|e| panic!("{sql}: {e:#}"))
}

fn case(major: u32, n: u16) {
    if !require_root(&format!("relation_io PG{major}")) {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let bin = pg_bin_dir(major).unwrap_or_else(|e| panic!("PostgreSQL {major}: {e:#}"));
    let dir = temp_dir().expect("temp dir");
    let lo = LoopDevice::create(dir.path(), 512 << 20, true).expect("loop device");
    let mut fs = Ext4Mount::new(&lo, &dir.path().join("mnt")).expect("ext4");
    let opts = PgOptions::new(&bin, fs.path().join("pgdata"), 55_480 + n)
        .shared_buffers("16MB")
        .setting("autovacuum", "off");
    let mut pg = PgCluster::init_with(opts).expect("initdb");
    pg.start().expect("start");
    for sql in [
        "create table a as select g, repeat('x', 200) as pad from generate_series(1, 100000) g",
        "create table b as select g, repeat('y', 200) as pad from generate_series(1, 10000) g",
        "vacuum (freeze, analyze) a, b",
        "checkpoint",
    ] {
        q(&pg, sql);
    }
    let db = q(
        &pg,
        "select oid from pg_database where datname = 'postgres'",
    );
    let file_of = |t: &str| {
        format!(
            "base/{db}/{}",
            q(&pg, &format!("select pg_relation_filenode('{t}')"))
        )
    };
    let (file_a, file_b) = (file_of("a"), file_of("b"));
    pg.stop().expect("stop");
    fs.remount().expect("remount");

    let daemon = Daemon::with_config("relations = true\n").expect("daemon");
    pg.start().expect("start cold");
    daemon.wait_tracked("postgres", "checkpointer");
    let blks_read = || -> f64 {
        q(
            &pg,
            "select heap_blks_read from pg_statio_user_tables where relname = 'a'",
        )
        .parse()
        .expect("heap_blks_read")
    };
    let backend = |file: &str| -> Vec<(&'static str, String)> {
        vec![
            ("app", "postgres".into()),
            ("role", "client backend".into()),
            ("file", file.to_owned()),
        ]
    };
    let count = |m: &Metrics, family: &str, labels: &[(&'static str, String)]| {
        let l: Vec<(&str, &str)> = labels.iter().map(|(k, v)| (*k, v.as_str())).collect();
        m.sum(family, &l)
    };

    // 1. A cold sequential scan of `a` in a new session (its backend opens the file now).
    let read_before = blks_read();
    let before = daemon.scrape();
    q(
        &pg,
        "set max_parallel_workers_per_gather = 0; select count(*) from a",
    );
    let after = daemon.scrape();
    // The session's backend flushes its statistics when it exits.
    let blocks = blks_read() - read_before;
    let d = |family: &str, labels: &[(&'static str, String)]| {
        count(&after, family, labels) - count(&before, family, labels)
    };
    let reads_a = d(FAMILY, &backend(&file_a));
    let reads_b = d(FAMILY, &backend(&file_b));
    let bytes_a = delta(
        &before,
        &after,
        "pgio_relation_io_bytes_total",
        &[("file", file_a.as_str()), ("role", "client backend")],
    );
    eprintln!(
        "PG{major} cold scan of a ({file_a}): {blocks} blocks read by PostgreSQL; pgio: {reads_a} \
         read calls, {bytes_a} bytes on a, {reads_b} on b"
    );
    if reads_a == 0.0 {
        for s in after.samples(FAMILY) {
            eprintln!("  {:?} {}", s.labels, s.value);
        }
        for s in after.samples("pgio_probe_attached") {
            eprintln!("  attached {:?} {}", s.labels, s.value);
        }
        for s in after.samples("pgio_syscall_seconds_count") {
            eprintln!("  syscall {:?} {}", s.labels, s.value);
        }
    }
    assert!(blocks > 1000.0, "the scan read only {blocks} blocks");
    if major == 15 {
        assert_eq!(reads_a, blocks, "PG15 reads one block per call");
    } else {
        assert!(
            reads_a > 0.0 && reads_a <= blocks,
            "{reads_a} calls for {blocks} blocks"
        );
    }
    assert_eq!(bytes_a, blocks * 8192.0, "bytes read from a's file");
    assert_eq!(reads_b, 0.0, "nothing read from b's file");

    // 2. Who dirties which table: updates of `b`, then a checkpoint.
    let before = daemon.scrape();
    q(&pg, "update b set pad = repeat('z', 200) where g % 2 = 0");
    q(&pg, "checkpoint");
    let after = daemon.scrape();
    let by = |role: &str, file: &str, syscall: &str| {
        delta(
            &before,
            &after,
            FAMILY,
            &[("role", role), ("file", file), ("syscall", syscall)],
        )
    };
    let (writes_b, syncs_b, writes_a) = (
        by("checkpointer", &file_b, "pwrite64") + by("checkpointer", &file_b, "pwritev"),
        by("checkpointer", &file_b, "fsync"),
        by("checkpointer", &file_a, "pwrite64") + by("checkpointer", &file_a, "pwritev"),
    );
    eprintln!(
        "PG{major} checkpoint after updating b: checkpointer wrote {file_b} {writes_b} times, \
         synced it {syncs_b} times; wrote {file_a} {writes_a} times"
    );
    assert!(writes_b > 0.0, "the checkpointer wrote nothing of b");
    assert!(syncs_b >= 1.0, "the checkpointer did not sync b's file");
    assert_eq!(writes_a, 0.0, "a was not changed");
    daemon.stop().expect("daemon stop");
    pg.stop().expect("stop");
}
