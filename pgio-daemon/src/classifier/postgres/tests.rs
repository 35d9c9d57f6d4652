use super::*;

fn pg(cmdline: &str) -> Labels {
    let p = ProcessInfo {
        comm: "postgres".into(),
        cmdline: cmdline.into(),
        exe: None,
        kthread: false,
        ..Default::default()
    };
    Clusters::default().classify(&p).expect("postgres")
}

#[test]
fn postmaster_keeps_its_command_line() {
    let l = pg(
        "/usr/lib/postgresql/15/bin/postgres -D /var/lib/postgresql/15/main -c config_file=/etc/postgresql/15/main/postgresql.conf",
    );
    assert_eq!(l.role, "postmaster");
    assert_eq!(l.app, "postgres");
}

#[test]
fn auxiliary_titles_with_and_without_cluster_name() {
    for (title, role) in [
        ("postgres: checkpointer ", "checkpointer"),
        ("postgres: background writer ", "background writer"),
        ("postgres: walwriter ", "walwriter"),
        ("postgres: autovacuum launcher ", "autovacuum launcher"),
        (
            "postgres: logical replication launcher ",
            "logical replication launcher",
        ),
        ("postgres: parallel worker for PID 4242 ", "parallel worker"),
        ("postgres: io worker 1", "io worker"),
        ("postgres: io worker", "io worker"),
        (
            "postgres: startup recovering 000000010000000000000003",
            "startup",
        ),
        (
            "postgres: archiver last was 000000010000000000000002",
            "archiver",
        ),
        (
            "postgres: walsender repl 127.0.0.1(5432) streaming 0/3000148",
            "walsender",
        ),
        ("postgres: walreceiver streaming 0/3000148", "walreceiver"),
        (
            "postgres: logical replication apply worker for subscription 16394 ",
            "logical replication worker",
        ),
        (
            "postgres: logical replication worker for subscription 16394 ",
            "logical replication worker",
        ),
    ] {
        assert_eq!(pg(title).role, role, "{title}");
        assert_eq!(pg(title).cluster, "", "{title}");
        let with_cluster = title.replacen("postgres: ", "postgres: 15/main: ", 1);
        assert_eq!(pg(&with_cluster).role, role, "{with_cluster}");
        assert_eq!(pg(&with_cluster).cluster, "15/main", "{with_cluster}");
    }
}

#[test]
fn autovacuum_worker_carries_database() {
    let l = pg("postgres: autovacuum worker bench");
    assert_eq!(l.role, "autovacuum worker");
    assert_eq!(l.database, "bench");
}

#[test]
fn client_backends() {
    let l = pg("postgres: alice shop [local] idle");
    assert_eq!(
        (l.role.as_str(), l.user.as_str(), l.database.as_str()),
        ("client backend", "alice", "shop")
    );
    let l = pg("postgres: 15/main: bob db1 127.0.0.1(53412) SELECT");
    assert_eq!(
        (
            l.role.as_str(),
            l.user.as_str(),
            l.database.as_str(),
            l.cluster.as_str()
        ),
        ("client backend", "bob", "db1", "15/main")
    );
    // update_process_title=off: no state.
    let l = pg("postgres: carol db2 [local]");
    assert_eq!(
        (l.role.as_str(), l.database.as_str()),
        ("client backend", "db2")
    );
    let l = pg("postgres: dave db3 ::1(40000) idle in transaction");
    assert_eq!(l.role, "client backend");
}

fn in_dir(pid: u32, cmdline: &str, dir: &str) -> ProcessInfo {
    ProcessInfo {
        pid,
        comm: "postgres".into(),
        cmdline: cmdline.into(),
        cwd: Some(dir.into()),
        ..Default::default()
    }
}

#[test]
fn cluster_is_cluster_name_else_data_directory() {
    let c = Clusters::default();
    let pm = in_dir(1, "/usr/lib/postgresql/15/bin/postgres -D /srv/a", "/srv/a");
    let ckpt = in_dir(2, "postgres: checkpointer ", "/srv/a");
    assert_eq!(
        c.classify(&pm).map(|l| l.cluster),
        Some("".into()),
        "not known yet"
    );
    assert_eq!(
        c.learn(&ckpt),
        Some("/srv/a".into()),
        "no cluster_name: learnt"
    );
    assert_eq!(c.classify(&pm).map(|l| l.cluster), Some("/srv/a".into()));
    assert_eq!(c.learn(&ckpt), None, "nothing new");
    assert_eq!(c.classify(&ckpt).map(|l| l.cluster), Some("/srv/a".into()));

    let pm = in_dir(3, "/usr/lib/postgresql/15/bin/postgres -D /srv/b", "/srv/b");
    let ckpt = in_dir(4, "postgres: b: 1: checkpointer ", "/srv/b");
    assert_eq!(c.classify(&pm).map(|l| l.cluster), Some("".into()));
    assert_eq!(c.learn(&ckpt), Some("/srv/b".into()));
    assert_eq!(c.classify(&pm).map(|l| l.cluster), Some("b: 1".into()));
    assert_eq!(c.classify(&ckpt).map(|l| l.cluster), Some("b: 1".into()));
    // A hostile database name does not teach a cluster name.
    let db = in_dir(7, "postgres: u x: checkpointer [local] idle", "/srv/a");
    assert_eq!(c.learn(&db), None);
    let db = in_dir(8, "postgres: u x: checkpointer [local]", "/srv/c");
    assert_eq!(c.learn(&db), None);
    // A client backend of a cluster known to have no cluster_name: a ": " in a name is
    // not a prefix.
    let l = c
        .classify(&in_dir(5, "postgres: u x: y [local] idle", "/srv/a"))
        .expect("postgres");
    assert_eq!((l.user.as_str(), l.database.as_str()), ("u", "x: y"));
    assert_eq!(l.cluster, "/srv/a");
    let l = c
        .classify(&in_dir(6, "postgres: b: 1: u x: y [local] idle", "/srv/b"))
        .expect("postgres");
    assert_eq!(
        (l.user.as_str(), l.database.as_str(), l.cluster.as_str()),
        ("u", "x: y", "b: 1")
    );
}

#[test]
fn hostile_names_in_client_backend_titles() {
    for (title, user, db) in [
        ("postgres: u d\"q'\\ [local] idle", "u", "d\"q'\\"),
        ("postgres: u d\nline 10.1.2.3(5432) SELECT", "u", "d\nline"),
        (
            "postgres: u x [local] idle [local] idle",
            "u x [local] idle",
            "?",
        ),
        (
            "postgres: ünïcødé ß ::1(40000) idle in transaction (aborted)",
            "ünïcødé",
            "ß",
        ),
        ("postgres: u d(1) [local] CREATE INDEX waiting", "u", "d(1)"),
    ] {
        let l = pg(title);
        assert_eq!(l.role, "client backend", "{title}");
        if db != "?" {
            assert_eq!(
                (l.user.as_str(), l.database.as_str()),
                (user, db),
                "{title}"
            );
        } else {
            // Three name words and no catalog to ask: the user is the first word.
            assert_eq!(format!("{} {}", l.user, l.database), user, "{title}");
        }
    }
    // A state word that is not one: the host is not the last field.
    assert_eq!(pg("postgres: u d [local] 5").role, "other");
}

#[test]
fn unknown_titles_are_other_never_dropped() {
    assert_eq!(pg("postgres: pg_cron launcher ").role, "other");
    assert_eq!(
        pg("postgres: TimescaleDB Background Worker Scheduler").role,
        "other"
    );
}

#[test]
fn exiting_process_without_cmdline_is_not_classified() {
    let p = ProcessInfo {
        comm: "postgres".into(),
        cmdline: String::new(),
        exe: None,
        kthread: false,
        ..Default::default()
    };
    assert!(Clusters::default().classify(&p).is_none());
}

#[test]
fn not_postgres() {
    let p = ProcessInfo {
        comm: "bash".into(),
        cmdline: "postgres: fake".into(),
        exe: Some("/bin/bash".into()),
        kthread: false,
        ..Default::default()
    };
    assert!(Clusters::default().classify(&p).is_none());
}
