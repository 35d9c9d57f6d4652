//! Process → labels. User rules from the config come first, then the built-in rules
//! (PostgreSQL by process title, Longhorn by argv, kernel threads by name). `None` = not tracked.
pub mod kernel;
pub mod longhorn;
pub mod pg_catalog;
pub mod postgres;
pub mod rules;

use crate::{
    labels::Labels,
    pods::{PodRef, Pods},
};

/// What the classifier looks at, read from /proc.
#[derive(Clone, Debug, Default)]
pub struct ProcessInfo {
    pub pid: u32,
    /// `/proc/<pid>/comm` (15 bytes at most).
    pub comm: String,
    /// `/proc/<pid>/cmdline`, arguments joined by single spaces (Postgres overwrites argv with
    /// its process title, so this is the title).
    pub cmdline: String,
    /// The same arguments, one per element (Longhorn's flags and subcommand).
    pub argv: Vec<String>,
    /// Target of `/proc/<pid>/cwd` once it is a data directory (holds `PG_VERSION`); read for
    /// Postgres only (the postmaster changes into it early, children inherit it).
    pub cwd: Option<String>,
    /// `comm` of the parent; read for Postgres only (a postmaster's freshly forked child
    /// still has the postmaster's command line).
    pub parent_comm: Option<String>,
    /// Who runs it and from which file: read for Postgres only, to tell a cluster's own
    /// processes from anyone's process that calls itself `postgres` (see `postgres::trusted`).
    pub owner: Option<Owner>,
    /// The same of its parent, when the parent is a `postgres` too.
    pub parent: Option<Owner>,
    /// The kernel saw it forked by a tracked postmaster (its title came from the uretprobe):
    /// its parentage needs no /proc check.
    pub vouched: bool,
    /// Target of `/proc/<pid>/exe`, when readable.
    pub exe: Option<String>,
    /// The Kubernetes pod its cgroup names; `None`: read `/proc/<pid>/cgroup` when needed.
    pub pod: Option<PodRef>,
    /// PF_KTHREAD set in `/proc/<pid>/stat`.
    pub kthread: bool,
    /// PF_EXITING set: its exit may already have been reported, so it must not be tracked
    /// again; its title can still tell where its held-back events belong.
    pub exiting: bool,
}

/// A process' uid, binary and working directory, as far as /proc shows them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Owner {
    /// Effective uid (the owner of `/proc/<pid>`).
    pub uid: u32,
    /// (st_dev, st_ino) of `/proc/<pid>/exe`'s target.
    pub binary: Option<(u64, u64)>,
    /// The working directory's path and owner uid, when it is a data directory.
    pub cwd: Option<String>,
    pub cwd_owner: Option<u32>,
    /// Its command line is not a `postgres: ` title (a postmaster's).
    pub untitled: bool,
    /// pgio may not see its working directory or binary (a capability is missing).
    pub hidden: bool,
}

pub struct Classifier {
    rules: Vec<rules::Rule>,
    postgres: postgres::Clusters,
    /// Where pod names come from; `None`: no pod labels.
    pods: Option<Pods>,
}

impl Classifier {
    pub fn new(rules: Vec<rules::Rule>, pods: Option<Pods>) -> Classifier {
        Classifier {
            rules,
            postgres: postgres::Clusters::default(),
            pods,
        }
    }

    pub fn classify(&self, p: &ProcessInfo) -> Option<Labels> {
        let labels = self.rules.iter().find_map(|r| r.apply(p)).or_else(|| {
            if p.kthread {
                return Some(kernel::classify(&p.comm));
            }
            self.postgres.classify(p).or_else(|| longhorn::classify(p))
        })?;
        let Some(pods) = &self.pods else {
            return Some(labels);
        };
        let pod = p.pod.clone().or_else(|| PodRef::of_process(p.pid));
        Some(labels.in_pod(pod.and_then(|r| pods.labels(&r))))
    }

    /// The pod directories are listed again (each rescan: deleted pods drop out).
    pub fn refresh_pods(&self) {
        if let Some(pods) = &self.pods {
            pods.refresh();
        }
    }

    /// Labels for the children of a process labelled `parent` until they are classified
    /// themselves (in the parent's pod); `None`: they inherit the parent's.
    pub fn child_labels(parent: &Labels) -> Option<Labels> {
        (parent.app == "postgres")
            .then(|| postgres::child_labels(parent))
            .flatten()
            .map(|child| child.in_pod(parent.pod_labels()))
    }

    /// Labels of a provisional process whose parent is not known any more.
    pub fn orphan_child_labels() -> Labels {
        Labels::app_role("postgres", postgres::STARTING)
    }

    /// A postmaster's child that has not shown its title yet.
    pub fn is_starting(labels: &Labels) -> bool {
        labels.app == "postgres" && labels.role == postgres::STARTING
    }

    /// Labels that only say "not classified yet": a child that has not set its title, a
    /// postmaster that has not changed into its data directory.
    pub fn is_provisional(labels: &Labels) -> bool {
        Self::is_starting(labels) || Self::awaits_cluster(labels)
    }

    /// A postmaster whose data directory has not shown its cluster label yet (no auxiliary
    /// process classified): the first one that is relabels it.
    pub fn awaits_cluster(labels: &Labels) -> bool {
        labels.app == "postgres" && labels.role == "postmaster" && labels.cluster.is_empty()
    }

    /// Whether a process with these labels serves client connections, whose socket
    /// delimits its queries (`query`): a PostgreSQL client backend.
    pub fn serves_clients(labels: &Labels) -> bool {
        labels.app == "postgres" && labels.role == "client backend"
    }

    /// Whether processes with these labels do IO for other backends (PostgreSQL 18's io
    /// workers): their IO is booked under the backend served (`pgio_common::io_worker`).
    pub fn serves_backends(labels: &Labels) -> bool {
        labels.app == "postgres" && labels.role == "io worker"
    }

    /// Whether a process with these labels can still change them by retitling itself (so a
    /// freshly forked one is worth looking at again).
    pub fn settled(labels: &Labels) -> bool {
        labels.app != "postgres" || postgres::settled(labels)
    }

    /// Whether reading `p` should also read its working directory and its parent's comm
    /// (Postgres: the cluster's data directory, and whether it is a postmaster's fresh child).
    pub fn needs_cwd_and_parent(p: &ProcessInfo) -> bool {
        postgres::is_postgres(p)
    }

    /// Whether the title uretprobe goes on this process' binary (a postmaster's: its children
    /// announce their titles through it).
    pub fn announces_titles(labels: &Labels) -> bool {
        labels.app == "postgres" && labels.role == "postmaster"
    }

    /// Whether `labels` belong to the Postgres cluster in data directory `dir`.
    pub fn in_cluster(labels: &Labels, dir: &str) -> bool {
        labels.app == "postgres" && labels.cluster == dir
    }

    /// `p` as its title says, when the title came from the kernel (the uretprobe) rather than
    /// from /proc: possibly after the process exited, so `p` may hold nothing else.
    pub fn with_title(mut p: ProcessInfo, pid: u32, title: String, vouched: bool) -> ProcessInfo {
        // Only postgres binaries carry the uretprobe, and only a postmaster's children send.
        p.pid = pid;
        p.comm = "postgres".into();
        p.argv = vec![title.clone()];
        p.cmdline = title;
        p.parent_comm = Some("postgres".into());
        p.vouched = vouched;
        p
    }

    /// Learns what `p` tells about its Postgres cluster (its `cluster_name`, from the title
    /// prefix). Returns the data directory whose cluster label changed, if any: processes
    /// classified earlier under that directory (the postmaster, which has no title prefix)
    /// need classifying again.
    pub fn learn(&self, p: &ProcessInfo) -> Option<String> {
        self.postgres.learn(p)
    }

    /// Forgets what was learned of data directories no process in `live` runs in.
    pub fn retain_clusters(&self, live: &std::collections::HashSet<String>) {
        self.postgres.retain(live);
    }
}
