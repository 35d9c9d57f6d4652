//! The files pgio reads for relation names, made hostile by whoever can write the data
//! directory, under a real PostgreSQL 15 (which reads its top-level `PG_VERSION` only at start,
//! so it keeps serving): `PG_VERSION` as a FIFO, as a symlink out of the directory, as a 1 GiB
//! sparse file. For each, a new table's reads are booked under `(relfilenode <n>)`, never a
//! name, `pgio_relation_catalog_errors_total` grows, and a scrape answers within a second
//! (nothing waits on the FIFO). With the file restored, the next new table gets its name.
mod common;

use std::{
    os::unix::fs::MetadataExt,
    path::Path,
    time::{Duration, Instant},
};

use common::Daemon;
use pgio_testkit::{Metrics, PgCluster, PgOptions, pg_bin_dir, require_root, temp_dir, wait_until};

const FAMILY: &str = "pgio_relation_io_seconds_count";
const ERRORS: &str = "pgio_relation_catalog_errors_total";

fn q(pg: &PgCluster, sql: &str) -> String {
    pg.psql(sql).unwrap_or_else(|e| panic!("{sql}: {e:#}"))
}

/// Creates a table of ~25 MB (more than shared_buffers) and reads it in a new session.
fn new_table_read(pg: &PgCluster, table: &str) -> String {
    q(
        pg,
        &format!(
            "create table {table} as select g, repeat('x', 200) as pad \
             from generate_series(1, 100000) g"
        ),
    );
    q(pg, "checkpoint");
    q(
        pg,
        &format!("set max_parallel_workers_per_gather = 0; select count(*) from {table}"),
    );
    q(pg, &format!("select pg_relation_filenode('{table}')"))
}

/// Puts a hostile file at the path.
type MakeFile<'a> = dyn Fn(&Path) + 'a;

fn chown(path: &Path, uid: u32, gid: u32) {
    std::os::unix::fs::lchown(path, Some(uid), Some(gid)).expect("chown");
}

#[test]
fn hostile_catalog_files_leave_files_unnamed_and_count() {
    if !require_root("hostile_catalog_files_leave_files_unnamed_and_count") {
        return;
    }
    let bin = pg_bin_dir(15).unwrap_or_else(|e| panic!("PostgreSQL 15: {e:#}"));
    let dir = temp_dir().expect("temp dir");
    let pgdata = dir.path().join("pgdata");
    let opts = PgOptions::new(&bin, pgdata.clone(), 55_490)
        .shared_buffers("16MB")
        .setting("autovacuum", "off");
    let mut pg = PgCluster::init_with(opts).expect("initdb");
    pg.start().expect("start");
    let daemon = Daemon::with_config("relations = true\n").expect("daemon");
    daemon.wait_tracked("postgres", "checkpointer");
    let cluster = pgdata.to_string_lossy().into_owned();
    let meta = std::fs::metadata(&pgdata).expect("data directory");
    let (uid, gid) = (meta.uid(), meta.gid());
    let version = pgdata.join("PG_VERSION");
    let kept = pgdata.join("PG_VERSION.kept");
    let on = |m: &Metrics, relation: &str| {
        m.sum(
            FAMILY,
            &[("relation", relation), ("pg_cluster", cluster.as_str())],
        )
    };

    let hostile: [(&str, &MakeFile<'_>); 3] = [
        ("fifo", &|p| {
            let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).expect("path");
            // SAFETY: a valid C string; mkfifo has no other precondition.
            assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo");
            chown(p, uid, gid);
        }),
        ("symlink", &|p| {
            std::os::unix::fs::symlink("/etc/hostname", p).expect("symlink");
            chown(p, uid, gid);
        }),
        ("huge", &|p| {
            let f = std::fs::File::create(p).expect("create");
            f.set_len(1 << 30).expect("1 GiB sparse");
            chown(p, uid, gid);
        }),
    ];
    for (what, make) in hostile {
        std::fs::rename(&version, &kept).expect("keep PG_VERSION");
        make(&version);
        let errors_before = daemon.scrape().sum(ERRORS, &[]);
        let node = new_table_read(&pg, &format!("t_{what}"));
        let unnamed = format!("(relfilenode {node})");
        let mut slowest = Duration::ZERO;
        let mut last = daemon.scrape();
        let seen = wait_until(Duration::from_secs(20), Duration::from_millis(250), || {
            let t = Instant::now();
            last = daemon.scrape();
            slowest = slowest.max(t.elapsed());
            on(&last, &unnamed) > 0.0 && last.sum(ERRORS, &[]) > errors_before
        });
        let errors = last.sum(ERRORS, &[]) - errors_before;
        eprintln!(
            "PG_VERSION as a {what}: t_{what}'s reads under {unnamed}: {}, catalog errors +{errors}, \
             slowest scrape {slowest:?}",
            on(&last, &unnamed)
        );
        assert!(
            seen,
            "{what}: no reads under {unnamed} or no catalog error counted"
        );
        assert_eq!(
            on(&last, &format!("public.t_{what}")),
            0.0,
            "{what}: a name without reading the catalogs"
        );
        assert!(
            slowest < Duration::from_secs(1),
            "{what}: a scrape took {slowest:?}"
        );
        std::fs::remove_file(&version).expect("remove the hostile PG_VERSION");
        std::fs::rename(&kept, &version).expect("restore PG_VERSION");
    }

    new_table_read(&pg, "t_restored");
    let named = wait_until(Duration::from_secs(20), Duration::from_millis(250), || {
        on(&daemon.scrape(), "public.t_restored") > 0.0
    });
    assert!(named, "PG_VERSION restored, the new table is still unnamed");
    daemon.stop().expect("daemon stop");
    pg.stop().expect("stop");
}
