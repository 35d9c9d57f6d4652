//! `relation::names` against real servers: PostgreSQL 15 (Debian), 16, 17 and 18 (PyPI). In a
//! database with a schema, a table with a primary key, a TOAST table, an index, a materialized
//! view, a sequence and a table whose name has quotes and spaces, every relation file the
//! server itself reports (`pg_relation_filenode`, with the catalogs' mapped files) must get the
//! `schema.name` and kind `pg_class` gives, after a checkpoint. Then `VACUUM FULL` gives the
//! table a new relfilenode, which after the next checkpoint has the table's name. Asking for
//! two files returns those two only. Hostile catalog files (a FIFO, a symlink out, a huge
//! sparse file, noise) give an error or nothing, quickly, never a stall or a wrong name.
use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use pgio_daemon::relation::names::{self, FileKey, Relation};
use pgio_testkit::{PgCluster, PgOptions, pg_bin_dir, require_root, temp_dir};

const DB: &str = "shop";
const ODD: &str = "odd \"name\" t";

#[test]
fn pg15_relation_names_match_pg_class() {
    check_major(15);
}

#[test]
fn pg16_relation_names_match_pg_class() {
    check_major(16);
}

#[test]
fn pg17_relation_names_match_pg_class() {
    check_major(17);
}

#[test]
fn pg18_relation_names_match_pg_class() {
    check_major(18);
}

fn check_major(major: u32) {
    if !require_root(&format!("pg{major}_relation_names_match_pg_class")) {
        return;
    }
    let bin = pg_bin_dir(major).unwrap_or_else(|e| panic!("PostgreSQL {major}: {e:#}"));
    let dir = temp_dir().expect("temp dir");
    let port = 56_300 + major as u16;
    let opts = PgOptions::new(&bin, dir.path().join("data"), port).shared_buffers("16MB");
    let mut pg = PgCluster::init_with(opts).expect("initdb");
    pg.start().expect("start");
    pg.psql(&format!("create database {DB}"))
        .expect("create database");
    let sql = |q: &str| shop_psql(&pg, q);
    sql(&format!(
        "create schema sales;
         create table sales.orders (id int primary key, note text);
         insert into sales.orders select g, repeat('x', 100) from generate_series(1, 1000) g;
         create index orders_note on sales.orders (note);
         create materialized view sales.totals as select count(*) from sales.orders;
         create sequence sales.ticket;
         create table public.\"{}\" (x int);",
        ODD.replace('"', "\"\"")
    ));
    let db: u32 = sql(&format!(
        "select oid from pg_database where datname = '{DB}'"
    ))
    .parse()
    .expect("database oid");

    let expected = server_view(&pg);
    assert!(
        expected.len() > 100,
        "only {} relation files",
        expected.len()
    );
    sql("checkpoint");
    let wanted: HashSet<FileKey> = expected.keys().copied().collect();
    let started = Instant::now();
    let found = names::read(pg.data_dir(), major, db, &wanted).expect("read names");
    let took = started.elapsed();
    let mut wrong = Vec::new();
    for (key, want) in &expected {
        match found.relations.get(key) {
            Some(got) if got == want => {}
            other => wrong.push(format!("{key:?}: want {want:?}, got {other:?}")),
        }
    }
    assert!(
        wrong.is_empty() && !found.truncated,
        "PostgreSQL {major}: {} of {} files wrong:\n{}",
        wrong.len(),
        expected.len(),
        wrong.join("\n")
    );
    eprintln!(
        "PostgreSQL {major}: {} relation files named as pg_class names them, in {took:.1?}",
        expected.len()
    );
    for (name, kind) in [
        ("orders", "table"),
        ("orders_pkey", "index"),
        ("orders_note", "index"),
        ("totals", "matview"),
        ("ticket", "sequence"),
        (ODD, "table"),
    ] {
        assert!(
            found
                .relations
                .values()
                .any(|r| r.name == name && r.kind.as_str() == kind),
            "{name} ({kind}) not among the names"
        );
    }
    assert!(
        found
            .relations
            .values()
            .any(|r| r.schema == "pg_toast" && r.kind.as_str() == "toast"),
        "no TOAST table"
    );

    // A rewrite: a new relfilenode, named once the catalog page is on disk.
    let orders = |view: &HashMap<FileKey, Relation>| -> FileKey {
        *view
            .iter()
            .find(|(_, r)| r.schema == "sales" && r.name == "orders")
            .map(|(k, _)| k)
            .expect("sales.orders")
    };
    let before = orders(&expected);
    sql("vacuum full sales.orders");
    let after = orders(&server_view(&pg));
    assert_ne!(before, after, "VACUUM FULL kept the relfilenode");
    sql("checkpoint");
    let both: HashSet<FileKey> = [before, after].into();
    let found = names::read(pg.data_dir(), major, db, &both).expect("read names");
    let got = found
        .relations
        .get(&after)
        .map(|r| (r.schema.as_str(), r.name.as_str()));
    assert_eq!(got, Some(("sales", "orders")), "after VACUUM FULL");
    assert!(
        found.relations.len() <= 2,
        "asked for 2 files, got {}",
        found.relations.len()
    );
    pg.stop().expect("stop");
}

/// `psql -d shop`, one row per line, columns separated by U+001F.
fn shop_psql(pg: &PgCluster, sql: &str) -> String {
    let mut c = pg.as_os_user("psql");
    c.args([
        "-X",
        "-A",
        "-t",
        "-q",
        "-v",
        "ON_ERROR_STOP=1",
        "-F",
        "\u{1f}",
    ])
    .args(pg.conn_args())
    .args(["-d", DB, "-c", sql]);
    let out = c.output().expect("psql");
    assert!(
        out.status.success(),
        "psql {sql}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .trim_end_matches('\n')
        .to_owned()
}

/// Every relation file of the database as the server names it.
fn server_view(pg: &PgCluster) -> HashMap<FileKey, Relation> {
    let out = shop_psql(
        pg,
        "select case when c.relisshared then 1664 else c.reltablespace end,
                pg_relation_filenode(c.oid), n.nspname, c.relname, c.relkind
         from pg_class c join pg_namespace n on n.oid = c.relnamespace
         where pg_relation_filenode(c.oid) is not null",
    );
    out.lines()
        .map(|line| {
            let f: Vec<&str> = line.split('\u{1f}').collect();
            assert_eq!(f.len(), 5, "{line:?}");
            let kind = match f[4] {
                "r" => "table",
                "i" => "index",
                "t" => "toast",
                "m" => "matview",
                "S" => "sequence",
                _ => "other",
            };
            let key = FileKey {
                tablespace: f[0].parse().expect("tablespace"),
                relfilenode: f[1].parse().expect("relfilenode"),
            };
            let rel = Relation {
                schema: f[2].to_owned(),
                name: f[3].to_owned(),
                kind: names::Kind::ALL
                    .into_iter()
                    .find(|k| k.as_str() == kind)
                    .expect("kind"),
            };
            (key, rel)
        })
        .collect()
}

/// A made-up data directory whose pg_class file is hostile.
#[test]
fn hostile_catalog_files_give_errors_or_nothing_quickly() {
    if !require_root("hostile_catalog_files_give_errors_or_nothing_quickly") {
        return;
    }
    let dir = temp_dir().expect("temp dir");
    let data = dir.path().join("data");
    let base = data.join("base/5");
    std::fs::create_dir_all(&base).expect("dirs");
    std::fs::create_dir_all(data.join("global")).expect("global");
    // A relation mapper with pg_class (1259) in file 1259, in both places.
    let mut map = vec![0u8; 524];
    map[0..4].copy_from_slice(&0x0059_2717u32.to_le_bytes());
    map[4..8].copy_from_slice(&1u32.to_le_bytes());
    map[8..12].copy_from_slice(&1259u32.to_le_bytes());
    map[12..16].copy_from_slice(&1259u32.to_le_bytes());
    std::fs::write(base.join("pg_filenode.map"), &map).expect("map");
    std::fs::write(data.join("global/pg_filenode.map"), &map).expect("global map");
    let class = base.join("1259");
    let wanted: HashSet<FileKey> = [FileKey {
        tablespace: 0,
        relfilenode: 16384,
    }]
    .into();
    let read = || {
        let started = Instant::now();
        let r = names::read(&data, 17, 5, &wanted);
        (r, started.elapsed())
    };

    let fifo = std::ffi::CString::new(class.to_str().expect("utf-8")).expect("path");
    // SAFETY: a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o644) }, 0, "mkfifo");
    let (r, took) = read();
    assert!(
        r.is_err() && took < Duration::from_secs(1),
        "FIFO: {r:?} in {took:?}"
    );
    std::fs::remove_file(&class).expect("rm");

    std::os::unix::fs::symlink("/etc/passwd", &class).expect("symlink");
    let (r, _) = read();
    assert!(r.is_err(), "symlink out: {r:?}");
    std::fs::remove_file(&class).expect("rm");

    // 4 GiB, sparse: read up to the cap only, nothing found.
    let f = std::fs::File::create(&class).expect("create");
    f.set_len(4 << 30).expect("set_len");
    let (r, took) = read();
    let found = r.expect("a huge file is read up to the cap");
    assert!(found.relations.is_empty() && found.truncated, "{found:?}");
    eprintln!("4 GiB sparse pg_class: capped, read in {took:.1?}");
    assert!(took < Duration::from_secs(10), "{took:?}");

    let noise: Vec<u8> = (0..64 * 8192u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8)
        .collect();
    std::fs::write(&class, noise).expect("noise");
    let (r, _) = read();
    let found = r.expect("noise reads");
    assert!(found.relations.is_empty(), "{found:?}");

    // Another owner than the data directory's.
    std::fs::write(&class, []).expect("empty");
    std::os::unix::fs::chown(&class, Some(65534), Some(65534)).expect("chown");
    let (r, _) = read();
    assert!(r.is_err(), "a file of another owner: {r:?}");
}
