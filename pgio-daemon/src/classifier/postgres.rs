//! PostgreSQL processes by title. Every process has comm `postgres`; the backend type is in
//! the title Postgres writes over argv: `postgres: [cluster_name: ]<title>`. The postmaster
//! keeps its real command line.
//!
//! Anyone can run a process called `postgres` with any title, so a title only counts for the
//! cluster the process plausibly belongs to (`trusted`): Postgres runs only as the owner of
//! its data directory, and every process of a cluster is its postmaster or a child the
//! postmaster forked from the same binary in the same directory. Anything else is not
//! tracked (`app="other"`), and a cluster name is only taken from a cluster's own processes,
//! by the first data directory that shows it.
use std::{collections::HashMap, sync::Mutex};

use tracing::debug;

use super::{Owner, ProcessInfo, pg_catalog};
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

/// Whether `p` is its data directory's postmaster (`Postmaster`), a child of it (`Child`), or
/// cannot be told apart from anyone's process with a made-up title (`None`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Trust {
    Postmaster,
    Child,
}

fn runs_its_data_dir(o: &Owner) -> bool {
    o.cwd.is_some() && o.cwd_owner == Some(o.uid)
}

fn trusted(p: &ProcessInfo) -> Option<Trust> {
    if p.vouched {
        return Some(Trust::Child);
    }
    if let Some(own) = p.owner.as_ref().filter(|o| o.hidden) {
        // pgio runs without CAP_SYS_PTRACE or CAP_DAC_READ_SEARCH (`pgio-daemon check` warns):
        // no data directory to check, and no cluster label either. What is left is the
        // parentage and the uid.
        if own.untitled && p.parent_comm.as_deref() != Some("postgres") {
            return Some(Trust::Postmaster);
        }
        let parent = p.parent.as_ref()?;
        return (parent.untitled && parent.uid == own.uid).then_some(Trust::Child);
    }
    let own = p.owner.as_ref().filter(|o| runs_its_data_dir(o))?;
    if own.untitled && p.parent_comm.as_deref() != Some("postgres") {
        return Some(Trust::Postmaster);
    }
    let parent = p.parent.as_ref()?;
    (parent.untitled
        && parent.uid == own.uid
        && parent.cwd == own.cwd
        && own.binary.is_some()
        && parent.binary == own.binary)
        .then_some(Trust::Child)
}

/// A data directory's `cluster_name` as its auxiliary processes show it, and when pgio first
/// saw the directory.
#[derive(Clone, Debug)]
struct Learned {
    name: Option<String>,
    seen: u64,
}

/// At most this many data directories are remembered (each rescan forgets those without a
/// process): beyond, a cluster is labelled by its data directory.
const MAX_CLUSTERS: usize = 1024;

/// What pgio knows per cluster, keyed by data directory (every Postgres process runs in it).
#[derive(Default, Debug)]
pub struct Clusters {
    /// Data directory → its `cluster_name` (`None`: the cluster has none), learned from the
    /// titles of auxiliary processes, which are unambiguous.
    names: Mutex<HashMap<String, Learned>>,
    next_seen: Mutex<u64>,
    catalogs: pg_catalog::CatalogCache,
}

impl Clusters {
    pub fn classify(&self, p: &ProcessInfo) -> Option<Labels> {
        // An exiting process has already lost its command line: nothing to tell from it (a live
        // postmaster always has one).
        if !is_postgres(p) || p.cmdline.is_empty() {
            return None;
        }
        let titled = p.cmdline.starts_with("postgres: ");
        let trust = trusted(p);
        if p.cwd.is_some() || titled || p.parent_comm.as_deref() == Some("postgres") {
            // Only a postmaster that has not changed into its data directory yet needs none.
            trust?;
        }
        let known = p.cwd.as_ref().and_then(|d| self.known(d));
        let mut labels = Labels::app_role("postgres", "");
        let title = p
            .cmdline
            .strip_prefix("postgres: ")
            .filter(|_| !title_being_written(&p.argv));
        let Some(title) = title else {
            // A forked child keeps the postmaster's command line until it sets its title.
            labels.role = if trust == Some(Trust::Child) {
                STARTING
            } else {
                "postmaster"
            }
            .into();
            // The postmaster's command line has no cluster_name: it is known once an
            // auxiliary child has shown its title. Until then the label is empty, which
            // keeps a postmaster started after pgio provisional.
            labels.cluster = match known {
                Some(name) => self.cluster_label(name, p),
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
        labels.cluster = self.cluster_label(prefix, p);
        parse_title(rest.trim(), &mut labels, p, &self.catalogs);
        Some(labels)
    }

    /// Records whether `p`'s cluster has a `cluster_name`, if `p` is an auxiliary process of
    /// it. Returns the data directory when that changed what its processes are labelled with.
    pub fn learn(&self, p: &ProcessInfo) -> Option<String> {
        if !is_postgres(p) || trusted(p) != Some(Trust::Child) {
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
        let full = names.len() >= MAX_CLUSTERS;
        match names.get_mut(dir) {
            Some(l) if l.name == name => return None,
            Some(l) => l.name = name,
            None if full => return None,
            None => {
                let mut next = self.next_seen.lock().unwrap_or_else(|e| e.into_inner());
                *next += 1;
                names.insert(dir.clone(), Learned { name, seen: *next });
            }
        }
        Some(dir.clone())
    }

    /// Forgets the data directories no process runs in any more (`live`: those of this scan).
    pub fn retain(&self, live: &std::collections::HashSet<String>) {
        let mut names = self.names.lock().unwrap_or_else(|e| e.into_inner());
        names.retain(|dir, _| live.contains(dir));
    }

    fn known(&self, dir: &str) -> Option<Option<String>> {
        let names = self.names.lock().unwrap_or_else(|e| e.into_inner());
        names.get(dir).map(|l| l.name.clone())
    }

    /// `cluster_name` if the cluster has one that no other data directory showed first (nor
    /// is another's path), else its data directory (so two clusters on a node stay apart
    /// without configuration, and a made-up cluster cannot take a real one's label).
    fn cluster_label(&self, name: Option<String>, p: &ProcessInfo) -> String {
        let dir = p.cwd.as_deref().unwrap_or_default();
        let name = name.filter(|n| {
            let names = self.names.lock().unwrap_or_else(|e| e.into_inner());
            let mine = names.get(dir).map_or(u64::MAX, |l| l.seen);
            !names
                .iter()
                .any(|(d, l)| d != dir && (d == n || (l.name.as_ref() == Some(n) && l.seen < mine)))
        });
        name.or_else(|| p.cwd.clone()).unwrap_or_default()
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

/// Whether /proc caught PostgreSQL writing its title over its argv: the title is in the
/// first argument and the old arguments follow until it pads them with NULs (Linux, where
/// it clobbers argv). Such a title can be cut anywhere (`postgres: postgres shop [lo` + an
/// old argument's tail): the process counts as not titled yet, and the next look or the
/// kernel's copy of the finished title classifies it.
fn title_being_written(argv: &[String]) -> bool {
    argv.len() > 1
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

fn parse_title(
    title: &str,
    labels: &mut Labels,
    p: &ProcessInfo,
    catalogs: &pg_catalog::CatalogCache,
) {
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
        split_names(names, p, catalogs)
    };
    labels.user = user;
    labels.database = database;
}

/// `user database` when either contains a space: the split both catalogs agree with. Without
/// one (catalogs unreadable, or names created after the last checkpoint) the user is taken to
/// be the first word.
fn split_names(
    names: &[&str],
    p: &ProcessInfo,
    catalogs: &pg_catalog::CatalogCache,
) -> (String, String) {
    let candidates = |catalog: &pg_catalog::CatalogNames| {
        (1..names.len())
            .map(|i| (names[..i].join(" "), names[i..].join(" ")))
            .filter(|(u, d)| catalog.roles.contains(u) && catalog.databases.contains(d))
            .collect::<Vec<_>>()
    };
    let dir = std::path::PathBuf::from(format!("/proc/{}/cwd", p.pid));
    let key = p.cwd.as_deref().unwrap_or_default();
    match catalogs
        .get(key, || pg_catalog::read(&dir))
        .map(|c| candidates(&c))
    {
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
mod tests;
