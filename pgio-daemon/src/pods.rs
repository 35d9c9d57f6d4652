//! Kubernetes labels (`namespace`, `pod`, `container`) without the Kubernetes API: the pod UID
//! and container ID come from the process' cgroup path, the names from the kubelet's node-local
//! log directories:
//!
//! - `/var/log/pods/<namespace>_<pod>_<uid>/<container>/`: one directory per pod, made by the
//!   kubelet before the pod's containers start;
//! - `/var/log/containers/<pod>_<namespace>_<container>-<id>.log`: one symlink per container
//!   (only its name is read), which ties a container ID to its name.
//!
//! Nothing here trusts a process: a cgroup path only counts when it has the kubelet's shape
//! (below `kubepods`, see `PodRef::parse`), a UID only when the kubelet made a directory for
//! it, and a name only when it is a valid Kubernetes name. Directories are listed, never
//! followed, and files are never opened.
use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    sync::Mutex,
    time::{Duration, Instant, SystemTime},
};

use crate::lock;

/// Where pod names come from; `None` when pod labels are off.
pub fn from_config(config: &crate::config::Config) -> Option<Pods> {
    config
        .flag(&POD_LABELS)
        .then(|| Pods::new(config.text(&POD_LOG_DIR), config.text(&CONTAINER_LOG_DIR)))
}

pub static POD_LABELS: crate::config::Key = crate::config::Key::flag(
    "pod_labels",
    true,
    "namespace, pod and container labels from the process' cgroup and the kubelet's log directories",
);
pub static POD_LOG_DIR: crate::config::Key = crate::config::Key::path(
    "pod_log_dir",
    "/var/log/pods",
    false,
    "the kubelet's `<namespace>_<pod>_<uid>/<container>/` directories",
);
pub static CONTAINER_LOG_DIR: crate::config::Key = crate::config::Key::path(
    "container_log_dir",
    "/var/log/containers",
    false,
    "the kubelet's `<pod>_<namespace>_<container>-<id>.log` links (only their names are read)",
);

/// Where a process runs: its pod's UID and, when the path names it, its container's ID.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodRef {
    pub uid: String,
    pub container_id: Option<String>,
}

/// A pod's names as the kubelet wrote them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodLabels {
    pub namespace: String,
    pub pod: String,
    pub container: String,
}

impl PodRef {
    /// The pod of one `/proc/<pid>/cgroup` path. Both kubelet cgroup drivers:
    ///
    /// - cgroupfs: `/kubepods[/besteffort|/burstable]/pod<uid>/<container>`
    /// - systemd: `/kubepods.slice[/kubepods-<qos>.slice]/kubepods[-<qos>]-pod<uid_>.slice/
    ///   <container>.scope` (the UID's dashes as underscores)
    ///
    /// with the container as containerd (`<64hex>`, `cri-containerd-<64hex>.scope`), CRI-O
    /// (`crio-<64hex>`), docker (`docker-<64hex>`) or podman (`libpod-<64hex>`) names it.
    ///
    /// Seen from a container with its own cgroup namespace (pgio in a pod), the path starts
    /// with `/..` segments up to the common ancestor, so the `kubepods` segment itself may be
    /// missing; only kubepods and QoS segments may stand between those and the pod segment.
    /// That keeps out a user's delegated cgroup (`/user.slice/…/kubepods.slice/…`) made to
    /// look like a pod.
    pub fn parse(path: &str) -> Option<PodRef> {
        let mut segments = path
            .split('/')
            .filter(|s| !s.is_empty())
            .skip_while(|s| *s == "..");
        let uid = loop {
            let s = segments.next()?;
            if let Some(uid) = pod_segment(s) {
                break uid;
            }
            if !is_qos_segment(s) {
                return None;
            }
        };
        let container_id = segments.next().and_then(container_segment);
        Some(PodRef { uid, container_id })
    }

    /// The pod of process `pid`, from `/proc/<pid>/cgroup` (kernel-written, small).
    pub fn of_process(pid: u32) -> Option<PodRef> {
        let cgroups = procfs::process::Process::new(pid as i32)
            .and_then(|p| p.cgroups())
            .ok()?;
        PodRef::from_cgroups(cgroups.0.iter().map(|c| c.pathname.as_str()))
    }

    /// The first pod among a process' cgroup lines (cgroup v2's `0::` line or any v1
    /// hierarchy: every hierarchy holds a pod's processes in the same path).
    pub fn from_cgroups<'a>(paths: impl IntoIterator<Item = &'a str>) -> Option<PodRef> {
        paths.into_iter().find_map(PodRef::parse)
    }
}

fn is_qos_segment(s: &str) -> bool {
    matches!(
        s,
        "kubepods" | "besteffort" | "burstable" | "guaranteed" | "kubepods.slice"
    ) || (s.starts_with("kubepods-") && s.ends_with(".slice") && !s.contains("-pod"))
}

/// `pod<uid>` or `kubepods[-<qos>]-pod<uid_>.slice` → the UID with dashes.
fn pod_segment(s: &str) -> Option<String> {
    let uid = if let Some(rest) = s.strip_suffix(".slice") {
        let (prefix, uid) = rest.rsplit_once("-pod")?;
        if !matches!(
            prefix,
            "kubepods" | "kubepods-besteffort" | "kubepods-burstable" | "kubepods-guaranteed"
        ) {
            return None;
        }
        uid.replace('_', "-")
    } else {
        s.strip_prefix("pod")?.to_owned()
    };
    is_uid(&uid).then_some(uid)
}

/// A pod UID as the API server makes them: 36 characters of lowercase hex and dashes.
fn is_uid(s: &str) -> bool {
    s.len() == 36
        && s.bytes().enumerate().all(|(i, b)| match i {
            8 | 13 | 18 | 23 => b == b'-',
            _ => b.is_ascii_hexdigit() && !b.is_ascii_uppercase(),
        })
}

/// The container ID in one of the runtimes' scope names.
fn container_segment(s: &str) -> Option<String> {
    let s = s.strip_suffix(".scope").unwrap_or(s);
    let id = ["cri-containerd-", "crio-", "docker-", "libpod-"]
        .iter()
        .find_map(|p| s.strip_prefix(p))
        .unwrap_or(s);
    is_container_id(id).then(|| id.to_owned())
}

fn is_container_id(s: &str) -> bool {
    s.len() == 64
        && s.bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
}

/// A DNS-1123 label or subdomain, the names Kubernetes allows for namespaces (63), pods (253)
/// and containers (63): anything else in a directory name is not the kubelet's.
fn is_k8s_name(s: &str, max: usize) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= max
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-' || *c == b'.')
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
}

/// `<namespace>_<pod>_<uid>` → (uid, namespace, pod).
fn parse_pod_dir(name: &str) -> Option<(String, String, String)> {
    let mut it = name.split('_');
    let (ns, pod, uid) = (it.next()?, it.next()?, it.next()?);
    (it.next().is_none() && is_k8s_name(ns, 63) && is_k8s_name(pod, 253) && is_uid(uid))
        .then(|| (uid.to_owned(), ns.to_owned(), pod.to_owned()))
}

/// `<pod>_<namespace>_<container>-<id>.log` → (id, namespace, pod, container).
fn parse_container_log(name: &str) -> Option<(String, PodLabels)> {
    let stem = name.strip_suffix(".log")?;
    let mut it = stem.split('_');
    let (pod, ns, rest) = (it.next()?, it.next()?, it.next()?);
    let (container, id) = rest.rsplit_once('-')?;
    (it.next().is_none()
        && is_k8s_name(ns, 63)
        && is_k8s_name(pod, 253)
        && is_k8s_name(container, 63)
        && is_container_id(id))
    .then(|| {
        (
            id.to_owned(),
            PodLabels {
                namespace: ns.to_owned(),
                pod: pod.to_owned(),
                container: container.to_owned(),
            },
        )
    })
}

/// At most this many entries are read from each directory: a node runs at most a few hundred
/// pods (110 by default), so the cap is only met by something that is not the kubelet's.
const MAX_ENTRIES: usize = 16_384;

/// A miss (a pod or container the listing does not know) lists the directories again when
/// one of them changed since (its mtime: a pod or symlink was added), else at most this often.
const RELIST_AFTER: Duration = Duration::from_secs(1);

/// The kubelet's log directories, listed on demand.
pub struct Pods {
    pod_log_dir: PathBuf,
    container_log_dir: PathBuf,
    index: Mutex<Index>,
}

#[derive(Default)]
struct Index {
    /// uid → (namespace, pod)
    pods: HashMap<String, (String, String)>,
    /// container id → its names
    containers: HashMap<String, PodLabels>,
    listed_at: Option<Instant>,
    /// The directories' mtimes at that listing.
    mtimes: [Option<SystemTime>; 2],
}

impl Pods {
    pub fn new(pod_log_dir: impl Into<PathBuf>, container_log_dir: impl Into<PathBuf>) -> Pods {
        Pods {
            pod_log_dir: pod_log_dir.into(),
            container_log_dir: container_log_dir.into(),
            index: Mutex::default(),
        }
    }

    /// Lists both directories again (each rescan: pods gone since drop out of the index).
    pub fn refresh(&self) {
        let mtimes = self.mtimes();
        let fresh = Index {
            mtimes,
            pods: list(&self.pod_log_dir, parse_pod_dir)
                .map(|(uid, ns, pod)| (uid, (ns, pod)))
                .collect(),
            containers: list(&self.container_log_dir, parse_container_log).collect(),
            listed_at: Some(Instant::now()),
        };
        *lock(&self.index) = fresh;
    }

    /// How many pods the kubelet's directory lists now; an error when it cannot be read.
    pub fn known(&self) -> std::io::Result<usize> {
        std::fs::read_dir(&self.pod_log_dir)?;
        self.refresh();
        Ok(lock(&self.index).pods.len())
    }

    /// The labels of the pod `r` names, if the kubelet made a log directory for it. The
    /// container name is left empty when its log symlink is not there and the pod has more
    /// than one container.
    pub fn labels(&self, r: &PodRef) -> Option<PodLabels> {
        if !self.knows(r) && self.stale() {
            self.refresh();
        }
        let index = lock(&self.index);
        let (namespace, pod) = index.pods.get(&r.uid)?.clone();
        let container = match r
            .container_id
            .as_ref()
            .and_then(|id| index.containers.get(id))
        {
            Some(c) if c.namespace == namespace && c.pod == pod => c.container.clone(),
            // A symlink naming another pod than the cgroup's is not believed.
            Some(_) => return None,
            None => drop_then(index, || self.only_container(&r.uid, &namespace, &pod)),
        };
        Some(PodLabels {
            namespace,
            pod,
            container,
        })
    }

    fn knows(&self, r: &PodRef) -> bool {
        let index = lock(&self.index);
        index.pods.contains_key(&r.uid)
            && r.container_id
                .as_ref()
                .is_none_or(|id| index.containers.contains_key(id))
    }

    fn stale(&self) -> bool {
        let index = lock(&self.index);
        index.listed_at.is_none_or(|t| t.elapsed() >= RELIST_AFTER) || index.mtimes != self.mtimes()
    }

    fn mtimes(&self) -> [Option<SystemTime>; 2] {
        let mtime = |d: &Path| std::fs::metadata(d).and_then(|m| m.modified()).ok();
        [mtime(&self.pod_log_dir), mtime(&self.container_log_dir)]
    }

    /// The pod's one container directory, when it has exactly one.
    fn only_container(&self, uid: &str, namespace: &str, pod: &str) -> String {
        let dir = self.pod_log_dir.join(format!("{namespace}_{pod}_{uid}"));
        let mut names = list(&dir, |n| is_k8s_name(n, 63).then(|| n.to_owned()));
        match (names.next(), names.next()) {
            (Some(only), None) => only,
            _ => String::new(),
        }
    }
}

fn drop_then<G, T>(guard: G, f: impl FnOnce() -> T) -> T {
    drop(guard);
    f()
}

/// The parsed names of a directory's entries (a missing directory has none).
fn list<T>(dir: &Path, parse: impl Fn(&str) -> Option<T>) -> impl Iterator<Item = T> {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .take(MAX_ENTRIES)
        .filter_map(move |e| parse(e.ok()?.file_name().to_str()?))
}

#[cfg(test)]
mod tests;
