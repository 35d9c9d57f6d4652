//! PostgreSQL processes by title. Every process has comm `postgres`; the backend type is in
//! the title Postgres writes over argv: `postgres: [cluster_name: ]<title>`. The postmaster
//! keeps its real command line.
use std::{collections::HashMap, sync::Mutex};

use tracing::debug;

use super::{ProcessInfo, pg_catalog};
use crate::labels::Labels;

/// Auxiliary titles, longest prefix first where one is the prefix of another, with the
/// `pg_stat_activity.backend_type` they map to.
const AUX: &[(&str, &str)] = &[
    ("checkpointer", "checkpointer"),
    ("background writer", "background writer"),
    ("walwriter", "walwriter"),
    ("autovacuum launcher", "autovacuum launcher"),
    ("autovacuum worker", "autovacuum worker"),
    (
        "logical replication launcher",
        "logical replication launcher",
    ),
    ("logical replication", "logical replication worker"),
    ("parallel worker", "parallel worker"),
    ("io worker", "io worker"),
    ("walsender", "walsender"),
    ("walreceiver", "walreceiver"),
    ("walsummarizer", "walsummarizer"),
    ("slotsync worker", "slotsync worker"),
    ("startup", "startup"),
    ("archiver", "archiver"),
    ("stats collector", "stats collector"),
    ("logger", "logger"),
    ("dead-end client backend", "client backend"),
];

pub fn is_postgres(p: &ProcessInfo) -> bool {
    p.comm == "postgres"
        || p.exe
            .as_deref()
            .and_then(|e| e.rsplit('/').next())
            .is_some_and(|b| b == "postgres")
}

/// What pgio knows per cluster, keyed by data directory (every Postgres process runs in it).
#[derive(Default, Debug)]
pub struct Clusters {
    /// Data directory → its `cluster_name` (`None`: the cluster has none), learned from the
    /// titles of auxiliary processes, which are unambiguous.
    names: Mutex<HashMap<String, Option<String>>>,
}

impl Clusters {
    pub fn classify(&self, p: &ProcessInfo) -> Option<Labels> {
        // An exiting process has already lost its command line: nothing to tell from it (a live
        // postmaster always has one).
        if !is_postgres(p) || p.cmdline.is_empty() {
            return None;
        }
        let known = p.cwd.as_ref().and_then(|d| self.known(d));
        let mut labels = Labels::app_role("postgres", "");
        let Some(title) = p.cmdline.strip_prefix("postgres: ") else {
            // A forked child keeps the postmaster's command line until it sets its title.
            labels.role = if p.parent_comm.as_deref() == Some("postgres") {
                STARTING
            } else {
                "postmaster"
            }
            .into();
            // The postmaster's command line has no cluster_name: it is known once an
            // auxiliary child has shown its title. Until then the label is empty, which
            // keeps a postmaster started after pgio provisional.
            labels.cluster = match known {
                Some(name) => cluster_label(name, p),
                None => String::new(),
            };
            return Some(labels);
        };
        let (prefix, rest) = match &known {
            Some(Some(name)) => match title.strip_prefix(name.as_str()) {
                Some(r) if r.starts_with(": ") => (Some(name.clone()), &r[2..]),
                _ => split_cluster(title),
            },
            Some(None) => (None, title),
            None => split_cluster(title),
        };
        labels.cluster = cluster_label(prefix, p);
        parse_title(rest.trim(), &mut labels, p);
        Some(labels)
    }

    /// Records whether `p`'s cluster has a `cluster_name`, if `p` is an auxiliary process.
    /// Returns the data directory when that changed what its processes are labelled with.
    pub fn learn(&self, p: &ProcessInfo) -> Option<String> {
        if !is_postgres(p) {
            return None;
        }
        let dir = p.cwd.as_ref()?;
        let title = p.cmdline.strip_prefix("postgres: ")?.trim();
        let name = if FIXED_TITLES.contains(&title) {
            None
        } else {
            let (prefix, _) = split_at_fixed_title(title)?;
            Some(prefix.to_owned())
        };
        let mut names = self.names.lock().unwrap_or_else(|e| e.into_inner());
        if names.get(dir) == Some(&name) {
            return None;
        }
        names.insert(dir.clone(), name);
        Some(dir.clone())
    }

    fn known(&self, dir: &str) -> Option<Option<String>> {
        let names = self.names.lock().unwrap_or_else(|e| e.into_inner());
        names.get(dir).cloned()
    }
}

/// Role of a process the postmaster forked that has not set its title yet (it still shows
/// the postmaster's command line), and of every child of the postmaster until pgio has read
/// its title.
pub const STARTING: &str = "starting";

/// A postmaster's children start in a provisional series of its cluster.
pub fn child_labels(parent: &Labels) -> Option<Labels> {
    (parent.role == "postmaster").then(|| Labels {
        app: parent.app.clone(),
        role: STARTING.into(),
        cluster: parent.cluster.clone(),
        ..Labels::default()
    })
}

/// A client backend's title only changes its state from here on; other processes may still
/// add something (an autovacuum worker its database, a background worker its name).
pub fn settled(labels: &Labels) -> bool {
    labels.role == "client backend"
}

/// `cluster_name` if the cluster has one, else its data directory (so two clusters on a node
/// stay apart without configuration).
fn cluster_label(name: Option<String>, p: &ProcessInfo) -> String {
    name.or_else(|| p.cwd.clone()).unwrap_or_default()
}

/// `cluster_name` prefix (`15/main: checkpointer`) when nothing is known about the cluster
/// yet. A title that already starts with a known type has none; otherwise the prefix is
/// everything up to the first `": "`.
fn split_cluster(title: &str) -> (Option<String>, &str) {
    if starts_with_aux(title).is_some() {
        return (None, title);
    }
    match title.split_once(": ") {
        Some((cluster, rest)) if !cluster.is_empty() => (Some(cluster.to_owned()), rest),
        _ => (None, title),
    }
}

/// Titles that are never followed by anything: only these teach a cluster's name, since a
/// client backend's title can contain any of them (a database called `x: checkpointer`) but
/// never ends with one (its host field comes after the database).
const FIXED_TITLES: &[&str] = &[
    "checkpointer",
    "background writer",
    "walwriter",
    "autovacuum launcher",
    "logical replication launcher",
];

/// `<cluster_name>: <fixed title>`, for any cluster name (it may contain `": "` itself).
fn split_at_fixed_title(title: &str) -> Option<(&str, &str)> {
    title.match_indices(": ").find_map(|(i, _)| {
        let rest = &title[i + 2..];
        (i > 0 && FIXED_TITLES.contains(&rest)).then_some((&title[..i], rest))
    })
}

fn starts_with_aux(title: &str) -> Option<(&'static str, &str)> {
    AUX.iter().find_map(|(prefix, role)| {
        let rest = title.strip_prefix(prefix)?;
        (rest.is_empty() || rest.starts_with(' ')).then_some((*role, rest.trim_start()))
    })
}

fn parse_title(title: &str, labels: &mut Labels, p: &ProcessInfo) {
    if let Some((role, rest)) = starts_with_aux(title) {
        labels.role = role.into();
        if role == "autovacuum worker" {
            // PG15-17 append the database being vacuumed.
            labels.database = rest.split(' ').next().unwrap_or_default().to_owned();
        }
        return;
    }
    // Client backend: `<user> <database> <host>[(<port>)] [<state>]`. With
    // update_process_title=off the state is missing; the host field is what tells it from an
    // unknown worker. Names may contain spaces, even `[local]`: take the last host-looking
    // field that is followed by nothing but a state.
    let fields: Vec<&str> = title.split(' ').collect();
    let host_at = (2..fields.len())
        .rev()
        .find(|&i| is_host(fields[i]) && fields[i + 1..].iter().all(is_state_word));
    let Some(host_at) = host_at else {
        labels.role = "other".into();
        return;
    };
    labels.role = "client backend".into();
    let names = &fields[..host_at];
    let (user, database) = if names.len() == 2 {
        (names[0].to_owned(), names[1].to_owned())
    } else {
        split_names(names, p)
    };
    labels.user = user;
    labels.database = database;
}

/// `user database` when either contains a space: the split both catalogs agree with. Without
/// one (catalogs unreadable, or names created after the last checkpoint) the user is taken to
/// be the first word.
fn split_names(names: &[&str], p: &ProcessInfo) -> (String, String) {
    let candidates = |catalog: &pg_catalog::CatalogNames| {
        (1..names.len())
            .map(|i| (names[..i].join(" "), names[i..].join(" ")))
            .filter(|(u, d)| catalog.roles.contains(u) && catalog.databases.contains(d))
            .collect::<Vec<_>>()
    };
    let dir = std::path::PathBuf::from(format!("/proc/{}/cwd", p.pid));
    match pg_catalog::read(&dir).map(|c| candidates(&c)) {
        Ok(mut found) if found.len() == 1 => found.swap_remove(0),
        outcome => {
            debug!(pid = p.pid, ?outcome, "cannot split a client backend title");
            (names[0].to_owned(), names[1..].join(" "))
        }
    }
}

/// `[local]`, or a client address with its port: `10.0.0.7(53412)`, `::1(40000)`, a host
/// name with `log_hostname`.
fn is_host(f: &str) -> bool {
    f == "[local]"
        || f.strip_suffix(')')
            .and_then(|s| s.rsplit_once('('))
            .is_some_and(|(host, port)| {
                !host.is_empty() && !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit())
            })
}

/// Words of a backend state or command tag: `idle in transaction (aborted)`, `SELECT`,
/// `CREATE INDEX`, `waiting`.
fn is_state_word(f: &&str) -> bool {
    f.bytes()
        .all(|b| b.is_ascii_alphabetic() || matches!(b, b'(' | b')' | b'_' | b'?'))
}

#[cfg(test)]
mod tests {
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
}
