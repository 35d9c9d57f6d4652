//! Kubelet-shaped pods without a kubelet: real cgroups in the host's cgroup v2 hierarchy (the
//! cgroupfs or the systemd driver's names), and the node-local log directories the kubelet
//! writes (`pods/<namespace>_<pod>_<uid>/<container>/`, `containers/<pod>_<namespace>_
//! <container>-<id>.log`). Processes are put in a pod's container cgroup for real, so
//! `/proc/<pid>/cgroup` reads as it does on a node. Everything made is removed in `Drop`
//! (processes still in a cgroup are moved back to the root cgroup first).
use std::{
    io::Write,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, bail};

/// Where the cgroup v2 hierarchy is mounted (`/sys/fs/cgroup` on a v2 host, the `unified`
/// directory on a hybrid one).
pub fn cgroup2_root() -> Result<PathBuf> {
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").context("reading mountinfo")?;
    mounts
        .lines()
        .find_map(|l| {
            let (left, right) = l.split_once(" - ")?;
            let mount_point = left.split(' ').nth(4)?;
            (right.split(' ').next() == Some("cgroup2")).then(|| PathBuf::from(mount_point))
        })
        .context("no cgroup2 hierarchy mounted")
}

/// The two layouts of the kubelet's cgroup drivers.
#[derive(Clone, Copy, Debug)]
pub enum Driver {
    /// `kubepods/besteffort/pod<uid>/<64hex>` (containerd's name)
    Cgroupfs,
    /// `kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid_>.slice/
    /// cri-containerd-<64hex>.scope`
    Systemd,
}

/// A random-enough pod UID and container ID for one test run (pid and time based).
pub fn ids(seed: u32) -> (String, String) {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let x = format!(
        "{:032x}",
        t ^ ((std::process::id() as u128) << 64) ^ seed as u128
    );
    let uid = format!(
        "{}-{}-{}-{}-{}",
        &x[0..8],
        &x[8..12],
        &x[12..16],
        &x[16..20],
        &x[20..32]
    );
    (uid, format!("{x}{x}"))
}

/// One pod's container cgroup; the directories this made are removed in `Drop`.
pub struct PodCgroup {
    root: PathBuf,
    /// Made by us, innermost last.
    made: Vec<PathBuf>,
    leaf: PathBuf,
}

impl PodCgroup {
    pub fn create(driver: Driver, uid: &str, container_id: &str) -> Result<PodCgroup> {
        let root = cgroup2_root()?;
        let rel: Vec<String> = match driver {
            Driver::Cgroupfs => vec![
                "kubepods".into(),
                "besteffort".into(),
                format!("pod{uid}"),
                container_id.into(),
            ],
            Driver::Systemd => {
                let u = uid.replace('-', "_");
                vec![
                    "kubepods.slice".into(),
                    "kubepods-burstable.slice".into(),
                    format!("kubepods-burstable-pod{u}.slice"),
                    format!("cri-containerd-{container_id}.scope"),
                ]
            }
        };
        let mut made = Vec::new();
        let mut dir = root.clone();
        for seg in rel {
            dir.push(seg);
            // Another test may make the shared kubepods/QoS levels at the same time.
            match std::fs::create_dir(&dir) {
                Ok(()) => made.push(dir.clone()),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(e).with_context(|| format!("mkdir {}", dir.display())),
            }
        }
        Ok(PodCgroup {
            root,
            made,
            leaf: dir,
        })
    }

    /// The cgroup a process is in, as `/proc/<pid>/cgroup` names it (`/kubepods/…`).
    pub fn path(&self) -> String {
        format!(
            "/{}",
            self.leaf
                .strip_prefix(&self.root)
                .unwrap_or(&self.leaf)
                .display()
        )
    }

    /// The file whose write moves a process into this cgroup.
    pub fn procs_file(&self) -> PathBuf {
        self.leaf.join("cgroup.procs")
    }

    /// Moves `pid` (the whole process) into the cgroup.
    pub fn enter(&self, pid: u32) -> Result<()> {
        move_to(&self.procs_file(), pid)
    }

    /// `program args…` started inside the cgroup: a shell moves itself in, then execs it.
    pub fn command(&self, program: &Path, args: &[&str]) -> Command {
        let mut c = Command::new("/bin/sh");
        c.arg("-c")
            .arg("echo $$ > \"$0\" && exec \"$@\"")
            .arg(self.procs_file())
            .arg(program)
            .args(args);
        c
    }

    /// An existing cgroup directory, left in place by `Drop`.
    pub fn at(dir: &Path) -> PodCgroup {
        PodCgroup {
            root: cgroup2_root().unwrap_or_else(|_| dir.to_owned()),
            made: Vec::new(),
            leaf: dir.to_owned(),
        }
    }

    /// Makes `cmd` start inside the cgroup: its child moves itself in before it execs, so the
    /// program is in the pod from its first instruction.
    pub fn spawn_inside(&self, cmd: &mut Command) -> Result<()> {
        use std::os::unix::{io::AsRawFd, process::CommandExt};
        let procs = std::fs::OpenOptions::new()
            .write(true)
            .open(self.procs_file())
            .with_context(|| format!("opening {}", self.procs_file().display()))?;
        // SAFETY: the closure only calls write(2) on an fd the parent opened (async-signal-
        // safe); `procs` is moved into it and stays open until the command is dropped.
        unsafe {
            cmd.pre_exec(move || {
                // "0": the writing process itself.
                if libc::write(procs.as_raw_fd(), b"0".as_ptr().cast(), 1) == 1 {
                    Ok(())
                } else {
                    Err(std::io::Error::last_os_error())
                }
            });
        }
        Ok(())
    }

    /// Moves every process of the container cgroup to the root cgroup.
    pub fn evacuate(&self) -> Result<()> {
        evacuate(&self.leaf, &self.root)
    }

    /// Moves every process out (to the root cgroup) and removes what `create` made.
    pub fn remove(&mut self) -> Result<()> {
        for dir in self.made.iter().rev() {
            evacuate(dir, &self.root)?;
            if !dir.exists() {
                continue;
            }
            if let Err(e) = std::fs::remove_dir(dir) {
                // A shared kubepods/QoS level that another test's pod still uses stays.
                if dir != &self.leaf && has_subdirs(dir) {
                    continue;
                }
                return Err(e).with_context(|| format!("rmdir {}", dir.display()));
            }
        }
        // The shared levels, whoever made them, once no pod is left in them (the last test
        // to finish removes them; a level with pods in it refuses).
        let mut level = self.leaf.parent().and_then(Path::parent);
        while let Some(dir) = level.filter(|d| *d != self.root.as_path()) {
            if dir.exists() && !has_subdirs(dir) {
                let _ = std::fs::remove_dir(dir);
            }
            level = dir.parent();
        }
        self.made.clear();
        Ok(())
    }
}

impl Drop for PodCgroup {
    fn drop(&mut self) {
        if let Err(e) = self.remove() {
            eprintln!("kubepods: {e:#}");
        }
    }
}

fn has_subdirs(dir: &Path) -> bool {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .any(|e| e.file_type().is_ok_and(|t| t.is_dir()))
}

fn evacuate(dir: &Path, root: &Path) -> Result<()> {
    if let Ok(procs) = std::fs::read_to_string(dir.join("cgroup.procs")) {
        for pid in procs.lines().filter_map(|l| l.trim().parse().ok()) {
            move_to(&root.join("cgroup.procs"), pid)?;
        }
    }
    Ok(())
}

fn move_to(procs: &Path, pid: u32) -> Result<()> {
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .open(procs)
        .with_context(|| format!("opening {}", procs.display()))?;
    f.write_all(pid.to_string().as_bytes())
        .with_context(|| format!("moving pid {pid} to {}", procs.display()))
}

/// The kubelet's `/var/log/pods` and `/var/log/containers`, in a directory of the test's.
pub struct PodLogs {
    pub pods: PathBuf,
    pub containers: PathBuf,
}

impl PodLogs {
    pub fn create(dir: &Path) -> Result<PodLogs> {
        let logs = PodLogs {
            pods: dir.join("pods"),
            containers: dir.join("containers"),
        };
        std::fs::create_dir_all(&logs.pods)?;
        std::fs::create_dir_all(&logs.containers)?;
        Ok(logs)
    }

    /// A pod with one container, as the kubelet lays it out. Names may be anything (hostile
    /// ones too): they are written as given.
    pub fn add(
        &self,
        namespace: &str,
        pod: &str,
        uid: &str,
        container: &str,
        id: &str,
    ) -> Result<()> {
        let dir = self
            .pods
            .join(format!("{namespace}_{pod}_{uid}"))
            .join(container);
        std::fs::create_dir_all(&dir).with_context(|| format!("mkdir {}", dir.display()))?;
        let log = dir.join("0.log");
        std::fs::write(&log, b"")?;
        let link = self
            .containers
            .join(format!("{pod}_{namespace}_{container}-{id}.log"));
        std::os::unix::fs::symlink(&log, &link)
            .with_context(|| format!("symlink {}", link.display()))
    }

    /// The pod is deleted: its log directory and container symlinks go.
    pub fn remove(&self, namespace: &str, pod: &str, uid: &str) -> Result<()> {
        let dir = self.pods.join(format!("{namespace}_{pod}_{uid}"));
        if !dir.exists() {
            bail!("no pod directory {}", dir.display());
        }
        std::fs::remove_dir_all(&dir)?;
        for e in std::fs::read_dir(&self.containers)? {
            let e = e?;
            if e.file_name()
                .to_str()
                .is_some_and(|n| n.starts_with(&format!("{pod}_{namespace}_")))
            {
                std::fs::remove_file(e.path())?;
            }
        }
        Ok(())
    }

    /// The daemon's config lines pointing at these directories.
    pub fn config(&self) -> String {
        format!(
            "pod_log_dir = {:?}\ncontainer_log_dir = {:?}\n",
            self.pods.display().to_string(),
            self.containers.display().to_string()
        )
    }
}

/// A podman container run in a kubelet-shaped cgroup (`--cgroup-parent=/kubepods/besteffort/
/// pod<uid>`, cgroupfs layout: `…/pod<uid>/libpod-<id>`), the host's root filesystem as its
/// root through an overlay (`--rootfs /:O`: nothing is written to the host). Removed in `Drop`
/// with the pod cgroups podman made.
pub struct PodmanPod {
    name: String,
    uid: String,
    pub container_id: String,
}

/// podman as measured on these hosts (see TOOLCHAIN.md, "Containers here").
pub fn podman() -> Command {
    let mut c = Command::new("podman");
    c.args(["--runtime", "runc", "--cgroup-manager=cgroupfs"]);
    c
}

impl PodmanPod {
    /// Creates (does not start) `command` in pod `uid`; `extra` are more `podman create` flags.
    pub fn create(uid: &str, extra: &[&str], command: &[&str]) -> Result<PodmanPod> {
        let name = format!("pgio-test-pod-{}-{}", std::process::id(), &uid[..8]);
        let out = podman()
            .args(["create", "--name", &name, "--network=none"])
            .args([
                "--ulimit",
                "nofile=20000:20000",
                "--ulimit",
                "nproc=4096:4096",
            ])
            .arg(format!("--cgroup-parent=/kubepods/besteffort/pod{uid}"))
            .args(extra)
            .args(["--rootfs", "/:O"])
            .args(command)
            .output()
            .context("running podman create")?;
        if !out.status.success() {
            bail!(
                "podman create failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let container_id = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        let pod = PodmanPod {
            name,
            uid: uid.to_owned(),
            container_id,
        };
        if pod.container_id.len() != 64 {
            bail!(
                "podman create printed {:?}, not a container ID",
                pod.container_id
            );
        }
        Ok(pod)
    }

    /// Starts it and waits for it to exit; fails unless it exited 0.
    pub fn run(&self) -> Result<String> {
        let out = podman()
            .args(["start", "--attach", &self.name])
            .output()
            .context("running podman start")?;
        if !out.status.success() {
            bail!(
                "container {} failed: {}{}",
                self.name,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }
}

impl Drop for PodmanPod {
    fn drop(&mut self) {
        let _ = podman().args(["rm", "-f", &self.name]).output();
        // podman leaves the pod's (now empty) cgroup in every hierarchy.
        let Ok(hierarchies) = std::fs::read_dir("/sys/fs/cgroup") else {
            return;
        };
        for h in hierarchies.flatten() {
            let pod = h
                .path()
                .join(format!("kubepods/besteffort/pod{}", self.uid));
            if let Ok(children) = std::fs::read_dir(&pod) {
                for c in children.flatten().filter(|c| c.path().is_dir()) {
                    let _ = std::fs::remove_dir(c.path());
                }
                let _ = std::fs::remove_dir(&pod);
            }
            // And the levels above it, once no pod is left in them.
            for level in ["kubepods/besteffort", "kubepods"] {
                let dir = h.path().join(level);
                if dir.exists() && !has_subdirs(&dir) {
                    let _ = std::fs::remove_dir(&dir);
                }
            }
        }
    }
}
