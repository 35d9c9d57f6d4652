//! The relation family (`relations = true`) on real PostgreSQL 15 and 17: PGDATA on ext4 on a
//! direct-IO loop device, shared_buffers 16MB, a table `a` (~25 MB) with an index `a_g` and a
//! table `b` (~2.5 MB), cold after a remount. Names come from the cluster's catalog files.
//! 1. A new session's sequential scan of `a`: its backend's reads on `relation="public.a"`
//!    (`kind="table"`, `database="postgres"`) = the blocks PostgreSQL read from outside shared
//!    buffers (`pg_statio_user_tables.heap_blks_read`), 8 KiB each (PostgreSQL 17 combines up
//!    to 16 blocks per `preadv`: bytes = blocks × 8 KiB); nothing on `public.b`.
//! 2. An index scan: the bytes read from `public.a_g` (`kind="index"`) = its
//!    `pg_statio_user_indexes.idx_blks_read` × 8 KiB.
//! 3. `VACUUM FULL a` (a new relfilenode) and a `CHECKPOINT`: a scan's reads go to
//!    `public.a` again once the catalogs are re-read, no `(relfilenode n)` is left, and
//!    `public.a` never went down.
//! 4. Rows of `b` updated and a `CHECKPOINT`: the checkpointer writes `public.b` and syncs it
//!    (at least one fsync), and writes nothing of `public.a`.
mod common;

use std::{sync::Mutex, time::Duration};

use common::{Daemon, delta};
use pgio_testkit::{
    Ext4Mount, LoopDevice, Metrics, PgCluster, PgOptions, pg_bin_dir, require_root, temp_dir,
    wait_until,
};

static SERIAL: Mutex<()> = Mutex::new(());

const FAMILY: &str = "pgio_relation_io_seconds_count";
const BYTES: &str = "pgio_relation_io_bytes_total";
const BACKEND: &str = "client backend";
/// A sequential scan of `a`, in one process (the index would answer `count(*)` alone).
const SEQ_SCAN_A: &str = "set max_parallel_workers_per_gather = 0; set enable_indexscan = off; \
                          set enable_indexonlyscan = off; set enable_bitmapscan = off; \
                          select count(*) from a";

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
        "create index a_g on a (g)",
        "vacuum (freeze, analyze) a, b",
        "checkpoint",
    ] {
        q(&pg, sql);
    }
    pg.stop().expect("stop");
    fs.remount().expect("remount");

    let daemon = Daemon::with_config("relations = true\n").expect("daemon");
    pg.start().expect("start cold");
    daemon.wait_tracked("postgres", "checkpointer");
    let stat = |sql: &str| -> f64 { q(&pg, sql).parse().expect("a number") };
    let heap_read = || stat("select heap_blks_read from pg_statio_user_tables where relname = 'a'");
    let idx_read =
        || stat("select idx_blks_read from pg_statio_user_indexes where indexrelname = 'a_g'");
    // This cluster only: other tests' clusters may run beside it.
    let pgdata = fs.path().join("pgdata").to_string_lossy().into_owned();
    let cluster = ("pg_cluster", pgdata.as_str());
    let on = |m: &Metrics, family: &str, relation: &str, role: &str| {
        m.sum(family, &[("relation", relation), ("role", role), cluster])
    };
    let reads_on = |m: &Metrics, relation: &str| {
        ["pread64", "preadv"]
            .map(|sc| {
                m.sum(
                    BYTES,
                    &[
                        ("relation", relation),
                        ("role", BACKEND),
                        ("syscall", sc),
                        cluster,
                    ],
                )
            })
            .iter()
            .sum::<f64>()
    };
    // Names come within a pass or two of a scrape that saw the file (5 s while one is
    // unnamed): scrape until `cond` holds.
    let settled = |cond: &dyn Fn(&Metrics) -> bool| -> Metrics {
        let mut last = daemon.scrape();
        let ok = wait_until(Duration::from_secs(20), Duration::from_millis(250), || {
            last = daemon.scrape();
            cond(&last)
        });
        if !ok {
            for s in last.samples(FAMILY) {
                eprintln!("  {:?} {}", s.labels, s.value);
            }
            panic!("the relation series did not settle");
        }
        last
    };
    let unnamed = |m: &Metrics| {
        m.samples(FAMILY)
            .filter(|s| s.labels.get("pg_cluster").is_some_and(|c| *c == pgdata))
            .filter(|s| {
                s.labels
                    .get("relation")
                    .is_some_and(|r| r.starts_with("(relfilenode"))
            })
            .count()
    };

    // 1. A cold sequential scan of `a` in a new session (its backend opens the file now).
    let read_before = heap_read();
    let before = daemon.scrape();
    q(&pg, SEQ_SCAN_A);
    let blocks = heap_read() - read_before;
    let after = settled(&|m| on(m, FAMILY, "public.a", BACKEND) > 0.0);
    let d = |family: &str, relation: &str| {
        on(&after, family, relation, BACKEND) - on(&before, family, relation, BACKEND)
    };
    let (reads_a, bytes_a, reads_b) = (
        d(FAMILY, "public.a"),
        d(BYTES, "public.a"),
        d(FAMILY, "public.b"),
    );
    eprintln!(
        "PG{major} cold scan of a: {blocks} blocks read by PostgreSQL; pgio: {reads_a} read \
         calls, {bytes_a} bytes on public.a, {reads_b} on public.b"
    );
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
    let labelled = after.sum(
        FAMILY,
        &[
            ("relation", "public.a"),
            ("kind", "table"),
            ("database", "postgres"),
            cluster,
        ],
    );
    assert_eq!(
        labelled,
        on(&after, FAMILY, "public.a", BACKEND),
        "kind and database of a"
    );

    // 2. An index scan books on the index.
    let idx_before = idx_read();
    let before = after;
    q(
        &pg,
        "set enable_seqscan = off; set enable_bitmapscan = off; \
         select sum(g) from a where g between 1 and 20000",
    );
    let idx_blocks = idx_read() - idx_before;
    let after = settled(&|m| on(m, BYTES, "public.a_g", BACKEND) >= idx_blocks * 8192.0);
    let bytes_idx =
        on(&after, BYTES, "public.a_g", BACKEND) - on(&before, BYTES, "public.a_g", BACKEND);
    eprintln!(
        "PG{major} index scan: {idx_blocks} index blocks read; pgio: {bytes_idx} bytes on public.a_g"
    );
    assert!(idx_blocks > 10.0, "the index scan read {idx_blocks} blocks");
    assert_eq!(bytes_idx, idx_blocks * 8192.0, "bytes read from the index");
    assert!(
        after.sum(
            FAMILY,
            &[("relation", "public.a_g"), ("kind", "index"), cluster]
        ) > 0.0,
        "the index's kind"
    );

    // 3. VACUUM FULL gives `a` a new file: its reads go to `public.a` once named.
    let old_node = q(&pg, "select pg_relation_filenode('a')");
    q(&pg, "vacuum full a");
    q(&pg, "checkpoint");
    let new_node = q(&pg, "select pg_relation_filenode('a')");
    assert_ne!(old_node, new_node, "VACUUM FULL kept the file");
    // The rewrite's own IO on the new file (its writes, the index build's reads) shows once
    // the file is named: the baseline waits for it.
    let writes_a = |m: &Metrics| {
        m.sum(
            FAMILY,
            &[
                ("relation", "public.a"),
                ("role", BACKEND),
                ("syscall", "pwrite64"),
                cluster,
            ],
        )
    };
    let before = settled(&|m| unnamed(m) == 0 && writes_a(m) > 0.0);
    let read_before = heap_read();
    q(&pg, SEQ_SCAN_A);
    let blocks = heap_read() - read_before;
    let want = reads_on(&before, "public.a") + blocks * 8192.0;
    let after = settled(&|m| unnamed(m) == 0 && reads_on(m, "public.a") >= want);
    let bytes_a = reads_on(&after, "public.a") - reads_on(&before, "public.a");
    eprintln!(
        "PG{major} after VACUUM FULL (relfilenode {old_node} -> {new_node}): {blocks} blocks \
         read; pgio: {bytes_a} bytes read from public.a"
    );
    assert!(blocks > 100.0, "the scan read only {blocks} blocks");
    assert_eq!(bytes_a, blocks * 8192.0, "bytes read from a's new file");

    // 4. Who dirties which table: updates of `b`, then a checkpoint.
    let before = daemon.scrape();
    q(&pg, "update b set pad = repeat('z', 200) where g % 2 = 0");
    q(&pg, "checkpoint");
    let after = settled(&|m| {
        m.sum(
            FAMILY,
            &[
                ("role", "checkpointer"),
                ("relation", "public.b"),
                ("syscall", "fsync"),
                cluster,
            ],
        ) > 0.0
    });
    let by = |relation: &str, syscall: &str| {
        delta(
            &before,
            &after,
            FAMILY,
            &[
                ("role", "checkpointer"),
                ("relation", relation),
                ("syscall", syscall),
                cluster,
            ],
        )
    };
    let (writes_b, syncs_b, writes_a) = (
        by("public.b", "pwrite64") + by("public.b", "pwritev"),
        by("public.b", "fsync"),
        by("public.a", "pwrite64") + by("public.a", "pwritev"),
    );
    eprintln!(
        "PG{major} checkpoint after updating b: checkpointer wrote public.b {writes_b} times, \
         synced it {syncs_b} times; wrote public.a {writes_a} times"
    );
    assert!(writes_b > 0.0, "the checkpointer wrote nothing of b");
    assert!(syncs_b >= 1.0, "the checkpointer did not sync b's file");
    assert_eq!(writes_a, 0.0, "a was not changed");
    daemon.stop().expect("daemon stop");
    pg.stop().expect("stop");
}

/// A session whose backend opened `a`'s file before pgio started: its reads of `a` are booked
/// on `public.a` (the fd is named from `/proc/<pid>/fd`), as many as `EXPLAIN (ANALYZE,
/// BUFFERS)` says it read (PostgreSQL 15: one `pread64` per block); `pgio-daemon top --by
/// database,relation` over the same scan shows the same count.
#[test]
fn pg15_files_opened_before_pgio_started_are_named() {
    if !require_root("pg15_files_opened_before_pgio_started_are_named") {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    use std::os::unix::fs::PermissionsExt;
    let bin = pg_bin_dir(15).unwrap_or_else(|e| panic!("PostgreSQL 15: {e:#}"));
    let dir = temp_dir().expect("temp dir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let out = dir.path().join("out");
    std::fs::create_dir(&out).expect("out dir");
    std::fs::set_permissions(&out, std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let pgdata = dir.path().join("pgdata");
    let opts = PgOptions::new(&bin, pgdata.clone(), 55_483)
        .shared_buffers("16MB")
        .setting("autovacuum", "off");
    let mut pg = PgCluster::init_with(opts).expect("initdb");
    pg.start().expect("start");
    q(
        &pg,
        "create table a as select g, repeat('x', 200) as pad from generate_series(1, 100000) g",
    );
    // `b` lives in a tablespace: its fd's link is the tablespace's real path, outside the
    // data directory. 40,000 rows (~9 MB) are over a quarter of shared_buffers, so each
    // sequential scan reads it again through a ring.
    let spc = dir.path().join("spc");
    std::fs::create_dir(&spc).expect("tablespace dir");
    let (uid, gid) = pg.os_user_ids();
    std::os::unix::fs::chown(&spc, Some(uid), Some(gid)).expect("chown tablespace dir");
    q(
        &pg,
        &format!("create tablespace spc location '{}'", spc.display()),
    );
    q(
        &pg,
        "create table b tablespace spc as \
         select g, repeat('y', 200) as pad from generate_series(1, 40000) g",
    );
    q(&pg, "checkpoint");
    // psql writes what `\o` names once it has run the statements before it.
    let wait_for = |file: &std::path::Path, text: &str| {
        let ok = wait_until(Duration::from_secs(30), Duration::from_millis(100), || {
            std::fs::read_to_string(file).is_ok_and(|s| s.contains(text))
        });
        assert!(ok, "psql wrote no {text:?} to {}", file.display());
        std::fs::read_to_string(file).unwrap_or_default()
    };
    let mut session = pg.session("postgres", "postgres").expect("session");
    let opened = out.join("opened.txt");
    session
        .send(&format!(
            "{SEQ_SCAN_A};\nselect count(*) from b;\n\\o {}\nselect 'opened';",
            opened.display()
        ))
        .expect("first scan");
    wait_for(&opened, "opened");

    let daemon = Daemon::with_config("relations = true\n").expect("daemon");
    daemon.wait_tracked("postgres", "client backend");
    // The pass that names the open files runs once a second.
    std::thread::sleep(Duration::from_secs(2));
    let cluster = pgdata.to_string_lossy().into_owned();
    let reads_of = |m: &Metrics, relation: &str| {
        m.sum(
            FAMILY,
            &[
                ("relation", relation),
                ("role", BACKEND),
                ("pg_cluster", cluster.as_str()),
            ],
        )
    };
    let reads_of_a = |m: &Metrics| reads_of(m, "public.a");
    let before = daemon.scrape();
    // `pgio-daemon top --by database,relation` over the same scan: the relation time.
    let top = std::process::Command::new(env!("CARGO_BIN_EXE_pgio-daemon"))
        .args(["top", "--once", "--json", "--interval", "6", "--url"])
        .arg(format!("{}/metrics", daemon.url()))
        .args([
            "--by",
            "database,relation",
            "--pg-cluster",
            cluster.as_str(),
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn top");
    // top scrapes at once, then after 6 s: the scan runs in between.
    std::thread::sleep(Duration::from_millis(1500));
    let explained = out.join("explain.txt");
    session
        .send(&format!(
            "\\o {}\nexplain (analyze, buffers) select count(*) from a;",
            explained.display()
        ))
        .expect("second scan");
    let plan = wait_for(&explained, "Execution Time");
    let read = blocks_read(&plan);
    let mut after = daemon.scrape();
    wait_until(Duration::from_secs(20), Duration::from_millis(250), || {
        after = daemon.scrape();
        reads_of_a(&after) - reads_of_a(&before) >= read
    });
    let booked = reads_of_a(&after) - reads_of_a(&before);
    let top = top.wait_with_output().expect("top");
    assert!(
        top.status.success(),
        "{}",
        String::from_utf8_lossy(&top.stderr)
    );
    let j: pgio_testkit::serde_json::Value =
        pgio_testkit::serde_json::from_slice(&top.stdout).expect("one JSON object");
    let top_reads: u64 = j["rows"]
        .as_array()
        .expect("rows")
        .iter()
        .filter(|r| {
            r["metric"] == "relation"
                && r["labels"]["relation"] == "public.a"
                && r["labels"]["database"] == "postgres"
                && r["labels"]["syscall"] == "pread64"
        })
        .filter_map(|r| r["count"].as_u64())
        .sum();
    eprintln!(
        "PG15, a's file opened before pgio started: the scan read {read} blocks; pgio: {booked} \
         reads on public.a, `top --by database,relation`: {top_reads}"
    );
    assert!(read > 1000.0, "the scan read {read} blocks");
    assert_eq!(booked, read, "reads booked on public.a");
    assert_eq!(
        top_reads as f64, read,
        "top's pread64 rows of postgres public.a:\n{j}"
    );

    // The tablespace's table: by the same session (a file opened before pgio, named from
    // `pg_tblspc/`'s link), then by a new one (the kernel parses its `openat` path).
    let before = daemon.scrape();
    let explained_b = out.join("explain_b.txt");
    session
        .send(&format!(
            "\\o {}\nexplain (analyze, buffers) select count(*) from b;",
            explained_b.display()
        ))
        .expect("scan of b");
    let read_old_fd = blocks_read(&wait_for(&explained_b, "Execution Time"));
    let read_new_fd = blocks_read(&q(
        &pg,
        "set max_parallel_workers_per_gather = 0; \
         explain (analyze, buffers) select count(*) from b",
    ));
    let want = read_old_fd + read_new_fd;
    let mut after = daemon.scrape();
    wait_until(Duration::from_secs(20), Duration::from_millis(250), || {
        after = daemon.scrape();
        reads_of(&after, "public.b") - reads_of(&before, "public.b") >= want
    });
    let booked_b = reads_of(&after, "public.b") - reads_of(&before, "public.b");
    eprintln!(
        "PG15, b in a tablespace: the scans read {read_old_fd} blocks (fd opened before pgio) + \
         {read_new_fd} (a new session); pgio: {booked_b} reads on public.b"
    );
    assert!(
        read_old_fd > 500.0 && read_new_fd > 500.0,
        "b's scans read too little"
    );
    assert_eq!(booked_b, want, "reads booked on public.b");
    drop(session);
    daemon.stop().expect("daemon stop");
    pg.stop().expect("stop");
}

/// The blocks a plan of `explain (analyze, buffers)` read (its first `read=`).
fn blocks_read(plan: &str) -> f64 {
    plan.lines()
        .find_map(|l| l.split("read=").nth(1))
        .and_then(|r| r.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no read= in the plan:\n{plan}"))
}
