//! PostgreSQL processes by title. Every process has comm `postgres`; the backend type is in
//! the title Postgres writes over argv: `postgres: [cluster_name: ]<title>`. The postmaster
//! keeps its real command line.
use super::ProcessInfo;
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

pub fn classify(p: &ProcessInfo) -> Option<Labels> {
    // An exiting process has already lost its command line: nothing to tell from it (a live
    // postmaster always has one).
    if !is_postgres(p) || p.cmdline.is_empty() {
        return None;
    }
    let mut labels = Labels::app_role("postgres", "");
    let Some(title) = p.cmdline.strip_prefix("postgres: ") else {
        labels.role = "postmaster".into();
        return Some(labels);
    };
    let title = title.trim();
    let (cluster, rest) = split_cluster(title);
    labels.cluster = cluster.to_owned();
    parse_title(rest, &mut labels);
    Some(labels)
}

/// `cluster_name` prefix (`15/main: checkpointer`). A title that already starts with a known
/// type has none; otherwise the prefix is everything up to the first `": "`.
fn split_cluster(title: &str) -> (&str, &str) {
    if starts_with_aux(title).is_some() {
        return ("", title);
    }
    match title.split_once(": ") {
        Some((cluster, rest)) if !cluster.is_empty() => (cluster, rest),
        _ => ("", title),
    }
}

fn starts_with_aux(title: &str) -> Option<(&'static str, &str)> {
    AUX.iter().find_map(|(prefix, role)| {
        let rest = title.strip_prefix(prefix)?;
        (rest.is_empty() || rest.starts_with(' ')).then_some((*role, rest.trim_start()))
    })
}

fn parse_title(title: &str, labels: &mut Labels) {
    if let Some((role, rest)) = starts_with_aux(title) {
        labels.role = role.into();
        if role == "autovacuum worker" {
            // PG15-17 append the database being vacuumed.
            labels.database = rest.split(' ').next().unwrap_or_default().to_owned();
        }
        return;
    }
    // Client backend: `user database host[(port)] [state]`. With update_process_title=off
    // the state is missing; the host field is what tells it from an unknown worker.
    let mut tokens = title.split(' ');
    if let (Some(user), Some(db), Some(host)) = (tokens.next(), tokens.next(), tokens.next())
        && looks_like_host(host)
    {
        labels.role = "client backend".into();
        labels.user = user.to_owned();
        labels.database = db.to_owned();
        return;
    }
    labels.role = "other".into();
}

fn looks_like_host(h: &str) -> bool {
    h == "[local]"
        || h.contains('(')
        || h.parse::<std::net::IpAddr>().is_ok()
        || (h.contains('.') && !h.contains('/'))
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
        classify(&p).expect("postgres")
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
        assert!(classify(&p).is_none());
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
        assert!(classify(&p).is_none());
    }
}
