use super::*;

/// A title the kernel sent for a postmaster's child (so its parentage is known), or a
/// postmaster's command line.
fn pg(cmdline: &str) -> Labels {
    let p = ProcessInfo {
        comm: "postgres".into(),
        cmdline: cmdline.into(),
        exe: None,
        kthread: false,
        vouched: cmdline.starts_with("postgres: "),
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

const PG_UID: u32 = 26;
const PG_BINARY: (u64, u64) = (8, 4242);

fn owner(uid: u32, dir: &str, untitled: bool) -> Owner {
    Owner {
        uid,
        binary: Some(PG_BINARY),
        cwd: Some(dir.into()),
        cwd_owner: Some(PG_UID),
        untitled,
        hidden: false,
    }
}

#[test]
fn without_the_capabilities_to_see_data_directories_parentage_and_uid_decide() {
    let c = Clusters::default();
    let hidden = |uid: u32, untitled: bool| Owner {
        uid,
        binary: None,
        cwd: None,
        cwd_owner: None,
        untitled,
        hidden: true,
    };
    let p = |parent_uid: u32| ProcessInfo {
        pid: 2,
        comm: "postgres".into(),
        cmdline: "postgres: checkpointer ".into(),
        owner: Some(hidden(PG_UID, false)),
        parent_comm: Some("postgres".into()),
        parent: Some(hidden(parent_uid, true)),
        ..Default::default()
    };
    assert_eq!(
        c.classify(&p(PG_UID)).map(|l| (l.role, l.cluster)),
        Some(("checkpointer".into(), String::new()))
    );
    assert_eq!(c.classify(&p(65534)), None, "another uid's parent");
    let orphan = ProcessInfo {
        parent: None,
        ..p(PG_UID)
    };
    assert_eq!(c.classify(&orphan), None, "not a postgres' child");
}

/// A process of the cluster in `dir` as /proc shows it: run by the directory's owner, a
/// titled one forked by its postmaster from the same binary.
fn in_dir(pid: u32, cmdline: &str, dir: &str) -> ProcessInfo {
    let untitled = !cmdline.starts_with("postgres: ");
    ProcessInfo {
        pid,
        comm: "postgres".into(),
        cmdline: cmdline.into(),
        cwd: Some(dir.into()),
        owner: Some(owner(PG_UID, dir, untitled)),
        parent_comm: Some(if untitled { "systemd" } else { "postgres" }.into()),
        parent: (!untitled).then(|| owner(PG_UID, dir, true)),
        ..Default::default()
    }
}

#[test]
fn only_a_clusters_own_processes_are_classified() {
    let c = Clusters::default();
    let backend = "postgres: postgres shop [local] idle";
    let real = in_dir(2, backend, "/srv/a");
    assert_eq!(
        c.classify(&real).map(|l| (l.role, l.cluster)),
        Some(("client backend".into(), "/srv/a".into()))
    );
    let untrusted = |f: &dyn Fn(&mut ProcessInfo)| {
        let mut p = in_dir(3, backend, "/srv/a");
        f(&mut p);
        c.classify(&p)
    };
    // Another uid than the data directory's owner (Postgres refuses to run so).
    assert_eq!(
        untrusted(&|p| p.owner.as_mut().expect("o").uid = 65534),
        None
    );
    // Not in a data directory, or a directory someone else owns.
    assert_eq!(
        untrusted(&|p| {
            p.cwd = None;
            p.owner.as_mut().expect("o").cwd = None;
        }),
        None
    );
    assert_eq!(
        untrusted(&|p| p.owner.as_mut().expect("o").cwd_owner = Some(0)),
        None
    );
    // Parent not a postmaster of the same directory, uid and binary.
    assert_eq!(untrusted(&|p| p.parent = None), None);
    assert_eq!(
        untrusted(&|p| p.parent.as_mut().expect("p").binary = Some((8, 1))),
        None
    );
    assert_eq!(
        untrusted(&|p| p.parent.as_mut().expect("p").cwd = Some("/srv/b".into())),
        None
    );
    assert_eq!(
        untrusted(&|p| p.parent.as_mut().expect("p").untitled = false),
        None
    );
    assert_eq!(
        untrusted(&|p| p.owner.as_mut().expect("o").binary = None),
        None
    );
    // A postmaster in someone else's data directory.
    let mut pm = in_dir(4, "/usr/lib/postgresql/15/bin/postgres -D /srv/a", "/srv/a");
    assert_eq!(c.classify(&pm).map(|l| l.role), Some("postmaster".into()));
    pm.owner.as_mut().expect("o").uid = 65534;
    assert_eq!(c.classify(&pm), None);
    // One before its chdir is provisional, as before.
    let early = ProcessInfo {
        cwd: None,
        owner: None,
        ..pm
    };
    assert_eq!(
        c.classify(&early).map(|l| (l.role, l.cluster)),
        Some(("postmaster".into(), String::new()))
    );
}

#[test]
fn a_made_up_cluster_cannot_take_a_real_ones_label() {
    let c = Clusters::default();
    // The real cluster: no cluster_name (labelled by its directory), then one named `main`.
    assert!(
        c.learn(&in_dir(2, "postgres: checkpointer ", "/srv/a"))
            .is_some()
    );
    assert!(
        c.learn(&in_dir(3, "postgres: main: checkpointer ", "/srv/b"))
            .is_some()
    );
    // Someone's own cluster claiming either label gets its directory.
    let fake = |title: &str| {
        let mut p = in_dir(9, title, "/home/x/d");
        for o in [p.owner.as_mut(), p.parent.as_mut()].into_iter().flatten() {
            o.uid = 65534;
        }
        p.owner.as_mut().expect("o").cwd_owner = Some(65534);
        p
    };
    for title in [
        "postgres: main: checkpointer ",
        "postgres: /srv/a: checkpointer ",
    ] {
        assert!(c.learn(&fake(title)).is_some());
        assert_eq!(
            c.classify(&fake("postgres: main: u shop [local] idle"))
                .map(|l| l.cluster),
            Some("/home/x/d".into()),
            "{title}"
        );
        assert_eq!(
            c.classify(&fake("postgres: /srv/a: u shop [local] idle"))
                .map(|l| l.cluster),
            Some("/home/x/d".into()),
            "{title}"
        );
    }
    // The real ones keep theirs.
    let b = in_dir(5, "postgres: main: u shop [local] idle", "/srv/b");
    assert_eq!(c.classify(&b).map(|l| l.cluster), Some("main".into()));
    let a = in_dir(6, "postgres: u shop [local] idle", "/srv/a");
    assert_eq!(c.classify(&a).map(|l| l.cluster), Some("/srv/a".into()));
    // Directories without a process are forgotten at a rescan.
    c.retain(&["/srv/b".to_string()].into());
    assert_eq!(c.known("/srv/a"), None);
    assert_eq!(c.known("/srv/b"), Some(Some("main".into())));
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

mod torn_title;
