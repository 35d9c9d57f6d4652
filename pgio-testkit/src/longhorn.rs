//! A stand-in Longhorn v1 volume on this host: our Go `longhorn` binary (repo directory
//! `longhorn-standin/`) running as replicas, an optional sync-agent and an engine
//! (controller), a FUSE frontend (`longhorn-fuse`, in tgtd's place) exposing the volume as one
//! file, and a direct-IO loop device over that file as the volume's block device.
//!
//! ```text
//! /dev/loopN (device)  ─► longhorn-fuse ─► unix socket ─► longhorn controller
//!     ─► 2 TCP connections per replica ─► longhorn replica: fstat + O_DIRECT pread64
//!     ─► ext4 on /dev/loopM (backing_device) ─► file on the host disk
//! ```
//!
//! Both loop devices use direct IO and the FUSE file is opened FOPEN_DIRECT_IO, so each
//! O_DIRECT read of the volume device is exactly one replica read and one block read on the
//! backing device. Concurrent requests stay concurrent end to end, as with tgtd in front of
//! the real engine: the FUSE mount negotiates async direct IO (else the loop worker would
//! wait for each FUSE request before submitting the next), go-fuse serves requests in
//! parallel, the engine's socket and replica connections carry many requests at once, and
//! engine and replicas run a goroutine per request; [`EngineStats::max_inflight`] and
//! [`ReplicaStats::max_inflight`] show it. See DESIGN.md §5 for the real processes this
//! mimics.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};

use crate::cmd;
use crate::daemon::free_port;
use crate::{Ext4Mount, LoopDevice, TempDir, temp_dir, wait_until};

/// Directory with prebuilt `longhorn` and `longhorn-fuse` binaries; skips `go build`
/// (e.g. in a VM without a Go toolchain).
pub const LONGHORN_BIN_DIR_ENV: &str = "PGIO_LONGHORN_BIN_DIR";

/// How long any one stand-in process may take to report READY.
const READY_TIMEOUT: Duration = Duration::from_secs(15);

/// What to start. `Default`: a fresh `pvc-<uuid>` name, 256 MiB, 2 replicas, no injected
/// latency, with a sync-agent.
#[derive(Debug, Clone)]
pub struct LonghornOptions {
    /// Volume (= PV) name, e.g. `pvc-0a1b2c3d-…`. Must be unique among running volumes.
    pub volume: String,
    /// Volume size; a positive multiple of 4096.
    pub size_bytes: u64,
    /// Number of replica processes (≥ 1).
    pub replicas: usize,
    /// Each replica sleeps this long per request before replying (`--inject-latency`).
    pub replica_latency: Option<Duration>,
    /// Also start a `longhorn sync-agent` process.
    pub sync_agent: bool,
    /// The volume device is a SCSI disk `/dev/sdX` that Debian's `tgtd` serves from the FUSE
    /// file over iSCSI on loopback (Longhorn v1's `tgt-blockdev` frontend), not a loop device
    /// on it. Needs what `iscsi::unavailable` checks.
    pub iscsi: bool,
}

impl Default for LonghornOptions {
    fn default() -> Self {
        LonghornOptions {
            volume: unique_volume_name(),
            size_bytes: 256 << 20,
            replicas: 2,
            replica_latency: None,
            sync_agent: true,
            iscsi: false,
        }
    }
}

/// Counters a replica reports (requests served since it started).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ReplicaStats {
    pub reads: u64,
    pub writes: u64,
    pub unmaps: u64,
    pub read_bytes: u64,
    pub write_bytes: u64,
    /// The revision counter (bumped once per write).
    pub revision: u64,
    /// Requests from the engine being served now (until the reply is sent).
    pub inflight: u64,
    /// The most requests it has served at once since it started.
    pub max_inflight: u64,
}

/// Counters the engine reports (frontend requests since it started).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EngineStats {
    pub reads: u64,
    pub writes: u64,
    pub flushes: u64,
    pub unmaps: u64,
    /// Frontend requests being served now.
    pub inflight: u64,
    /// The most frontend requests it has served at once since it started.
    pub max_inflight: u64,
}

/// One started stand-in process.
#[derive(Debug)]
struct Proc {
    role: String,
    child: Child,
    log: PathBuf,
}

/// A running stand-in Longhorn volume. Drop tears it down in reverse order, also when a
/// test panics: volume loop device, `/dev/longhorn` node, FUSE frontend (unmounted; lazily if
/// it will not go), engine, sync-agent and replicas (SIGTERM, then SIGKILL, only our own
/// children), the replicas' ext4, its loop device, the temp dir.
#[derive(Debug)]
pub struct LonghornVolume {
    volume: String,
    size_bytes: u64,
    // Torn down by Drop in reverse order of this list.
    backing: Option<LoopDevice>,
    data: Option<Ext4Mount>,
    replicas: Vec<Proc>,
    replica_ports: Vec<u16>,
    replica_dirs: Vec<PathBuf>,
    sync_agent: Option<Proc>,
    controller: Option<Proc>,
    controller_port: u16,
    socket: PathBuf,
    frontend: Option<Proc>,
    mountpoint: PathBuf,
    fuse_file: PathBuf,
    /// The volume as a block device; detached before the frontend stops.
    device: Option<VolumeDevice>,
    dev_dir: PathBuf,
    // Dropped last, after Drop::drop emptied everything above.
    dir: TempDir,
}

impl LonghornVolume {
    /// Builds the Go binaries if needed, then starts replicas (+ sync-agent), engine and FUSE
    /// frontend, waiting for each to report READY, and attaches the direct-IO loop device.
    /// Needs root (mount, losetup, mknod).
    pub fn start(opts: LonghornOptions) -> Result<LonghornVolume> {
        ensure!(opts.replicas >= 1, "a volume needs at least one replica");
        ensure!(
            opts.size_bytes > 0 && opts.size_bytes.is_multiple_of(4096),
            "volume size must be a positive multiple of 4096"
        );
        ensure!(
            !opts.volume.is_empty()
                && opts
                    .volume
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-'),
            "volume name {:?}: use [A-Za-z0-9-] like a PV name",
            opts.volume
        );
        let bins = standin_bin_dir()?;
        let dir = temp_dir()?;
        let root = dir.path().to_owned();
        let mut v = LonghornVolume {
            volume: opts.volume.clone(),
            size_bytes: opts.size_bytes,
            backing: None,
            data: None,
            replicas: Vec::new(),
            replica_ports: Vec::new(),
            replica_dirs: Vec::new(),
            sync_agent: None,
            controller: None,
            controller_port: 0,
            socket: root.join(format!("run/longhorn-{}.sock", opts.volume)),
            frontend: None,
            mountpoint: root.join("fuse"),
            fuse_file: root.join("fuse").join(&opts.volume),
            device: None,
            dev_dir: root.join("dev/longhorn"),
            dir,
        };
        // From here on, an error drops `v`, which tears down whatever was started.
        for d in ["run", "logs", "fuse", "dev/longhorn", "disk"] {
            std::fs::create_dir_all(root.join(d))
                .with_context(|| format!("creating {}", root.join(d).display()))?;
        }

        // The replicas' disk: sparse, so room for every replica to be fully written costs
        // nothing until used.
        let backing_size =
            (opts.size_bytes * opts.replicas as u64 + (64 << 20)).next_multiple_of(1 << 20);
        v.backing = Some(LoopDevice::create(&root, backing_size, true)?);
        v.data = Some(Ext4Mount::new(
            v.backing.as_ref().unwrap(),
            &root.join("disk"),
        )?);
        let replicas_dir = root.join("disk/replicas");
        std::fs::create_dir_all(&replicas_dir)?;

        let longhorn = bins.join("longhorn");
        let vol = opts.volume.clone();
        let size = opts.size_bytes.to_string();
        for i in 0..opts.replicas {
            let suffix = format!("{:08x}", rand_u32());
            let rdir = replicas_dir.join(format!("{vol}-{suffix}"));
            let instance = format!("{vol}-r-{suffix}");
            let latency = opts.replica_latency.map(|d| format!("{}us", d.as_micros()));
            let (proc_, port) = spawn_with_port(&v.logs(), &format!("replica-{i}"), |port| {
                let mut c = Command::new(&longhorn);
                // Both argv shapes of DESIGN.md §5: even replicas give --volume-name as a
                // global flag (current), odd ones after `replica` (older releases).
                if i % 2 == 0 {
                    c.args(["--volume-name", &vol, "replica"]).arg(&rdir);
                } else {
                    c.arg("replica").arg(&rdir).args(["--volume-name", &vol]);
                }
                c.args(["--size", &size, "--replica-instance-name", &instance]);
                // After the subcommand, so a classifier that only skips the real global
                // flags still finds `replica` right after them.
                if let Some(l) = &latency {
                    c.args(["--inject-latency", l]);
                }
                c.args(["--listen", &format!("127.0.0.1:{port}")]);
                c
            })?;
            v.replicas.push(proc_);
            v.replica_ports.push(port);
            v.replica_dirs.push(rdir);
        }
        if opts.sync_agent {
            let (proc_, _) = spawn_with_port(&v.logs(), "sync-agent", |port| {
                let mut c = Command::new(&longhorn);
                c.args(["--volume-name", &vol, "sync-agent", "--listen"])
                    .arg(format!("127.0.0.1:{port}"));
                c
            })?;
            v.sync_agent = Some(proc_);
        }

        let replica_urls: Vec<String> = v
            .replica_ports
            .iter()
            .map(|p| format!("tcp://127.0.0.1:{p}"))
            .collect();
        let socket = v.socket.clone();
        let (proc_, port) = spawn_with_port(&v.logs(), "controller", |port| {
            let mut c = Command::new(&longhorn);
            c.args([
                "--engine-instance-name",
                &format!("{vol}-e-0"),
                "controller",
                &vol,
            ])
            .args(["--frontend", "socket", "--size", &size]);
            for u in &replica_urls {
                c.args(["--replica", u]);
            }
            c.args([
                "--listen",
                &format!("127.0.0.1:{port}"),
                "--frontend-socket",
            ])
            .arg(&socket);
            c
        })?;
        v.controller = Some(proc_);
        v.controller_port = port;

        let mut fuse = Command::new(bins.join("longhorn-fuse"));
        fuse.arg("--socket")
            .arg(&v.socket)
            .args(["--size", &size, "--volume", &vol])
            .arg(&v.mountpoint);
        v.frontend = Some(spawn_ready(&v.logs(), "frontend", &mut fuse)?);
        let len = std::fs::metadata(&v.fuse_file)
            .with_context(|| format!("stat {}", v.fuse_file.display()))?
            .len();
        ensure!(
            len == opts.size_bytes,
            "{} has size {len}, want {}",
            v.fuse_file.display(),
            opts.size_bytes
        );

        v.attach_device(opts.iscsi)?;
        Ok(v)
    }

    /// `/dev/loopN` (direct IO over the FUSE file) or `/dev/sdX` (`iscsi`): the volume as a
    /// block device.
    pub fn device(&self) -> &Path {
        match &self.device {
            Some(VolumeDevice::Loop(d)) => d.path(),
            Some(VolumeDevice::Iscsi(d)) => d.device(),
            None => Path::new(""),
        }
    }

    /// `loopN` or `sdX`, the volume device's name in /proc/diskstats and /sys/block.
    pub fn device_name(&self) -> &str {
        match &self.device {
            Some(VolumeDevice::Loop(d)) => d.name(),
            Some(VolumeDevice::Iscsi(d)) => d.name(),
            None => "",
        }
    }

    /// (major, minor) of the volume device (and of the node in `dev_dir`).
    pub fn device_major_minor(&self) -> (u32, u32) {
        match &self.device {
            Some(VolumeDevice::Loop(d)) => d.major_minor(),
            Some(VolumeDevice::Iscsi(d)) => d.major_minor().unwrap_or((0, 0)),
            None => (0, 0),
        }
    }

    /// The iSCSI target daemon serving the volume (`iscsi`).
    pub fn tgtd_pid(&self) -> Option<u32> {
        match &self.device {
            Some(VolumeDevice::Iscsi(d)) => d.tgtd_pid(),
            _ => None,
        }
    }

    /// Stands in for `/dev/longhorn`: holds a block node named after the volume with the
    /// volume device's major:minor (ends in `dev/longhorn`).
    pub fn dev_dir(&self) -> &Path {
        &self.dev_dir
    }

    /// `/dev/loopM` under the replicas' ext4: replica preads become block IO here.
    pub fn backing_device(&self) -> &Path {
        self.backing_loop().path()
    }

    /// The backing loop device fixture (name, major:minor, …).
    pub fn backing_loop(&self) -> &LoopDevice {
        self.backing
            .as_ref()
            .expect("backing loop exists while the volume lives")
    }

    /// Replica data directories (`…/replicas/<volume>-<8hex>`), in replica order.
    pub fn replica_dirs(&self) -> &[PathBuf] {
        &self.replica_dirs
    }

    /// The FUSE file the volume device is attached to.
    pub fn fuse_file(&self) -> &Path {
        &self.fuse_file
    }

    /// The engine's frontend socket (`…/longhorn-<volume>.sock`).
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    pub fn volume(&self) -> &str {
        &self.volume
    }

    pub fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    pub fn controller_pid(&self) -> u32 {
        self.controller.as_ref().map_or(0, |p| p.child.id())
    }

    pub fn replica_pids(&self) -> Vec<u32> {
        self.replicas.iter().map(|p| p.child.id()).collect()
    }

    pub fn sync_agent_pid(&self) -> Option<u32> {
        self.sync_agent.as_ref().map(|p| p.child.id())
    }

    /// The FUSE frontend (`longhorn-fuse`, in tgtd's place).
    pub fn frontend_pid(&self) -> u32 {
        self.frontend.as_ref().map_or(0, |p| p.child.id())
    }

    /// Every PID this volume started.
    pub fn pids(&self) -> Vec<u32> {
        self.procs().map(|p| p.child.id()).collect()
    }

    /// Each replica's counters, in replica order (asked over its data port).
    pub fn replica_stats(&self) -> Result<Vec<ReplicaStats>> {
        self.replica_ports
            .iter()
            .map(|&port| {
                let m = query_stats(port)?;
                Ok(ReplicaStats {
                    reads: field(&m, "reads")?,
                    writes: field(&m, "writes")?,
                    unmaps: field(&m, "unmaps")?,
                    read_bytes: field(&m, "read_bytes")?,
                    write_bytes: field(&m, "write_bytes")?,
                    revision: field(&m, "revision")?,
                    inflight: field(&m, "inflight")?,
                    max_inflight: field(&m, "max_inflight")?,
                })
            })
            .collect()
    }

    /// Reads served by all replicas together.
    pub fn replica_reads(&self) -> Result<u64> {
        Ok(self.replica_stats()?.iter().map(|s| s.reads).sum())
    }

    /// The engine's counters (asked over its --listen port).
    pub fn engine_stats(&self) -> Result<EngineStats> {
        let m = query_stats(self.controller_port)?;
        Ok(EngineStats {
            reads: field(&m, "reads")?,
            writes: field(&m, "writes")?,
            flushes: field(&m, "flushes")?,
            unmaps: field(&m, "unmaps")?,
            inflight: field(&m, "inflight")?,
            max_inflight: field(&m, "max_inflight")?,
        })
    }

    /// Waits (up to `timeout`) until the volume device has no IO in flight and its
    /// counters stayed unchanged for 300 ms. Returns whether it became quiet.
    pub fn wait_quiet(&self, timeout: Duration) -> bool {
        let mut last = None;
        let mut stable_since = Instant::now();
        wait_until(timeout, Duration::from_millis(50), || {
            let Ok(s) = crate::diskstats(self.device_name()) else {
                return false;
            };
            let key = (s.reads_completed, s.writes_completed, s.ios_in_progress);
            if last != Some(key) {
                last = Some(key);
                stable_since = Instant::now();
                return false;
            }
            s.ios_in_progress == 0 && stable_since.elapsed() >= Duration::from_millis(300)
        })
    }

    /// All stand-in logs (stderr of every process), for failure messages.
    pub fn logs_text(&self) -> String {
        let mut s = String::new();
        for p in self.procs() {
            s.push_str(&format!("--- {} (pid {}) ---\n", p.role, p.child.id()));
            s.push_str(&std::fs::read_to_string(&p.log).unwrap_or_default());
        }
        s
    }

    fn logs(&self) -> PathBuf {
        self.dir.path().join("logs")
    }

    fn procs(&self) -> impl Iterator<Item = &Proc> {
        self.replicas
            .iter()
            .chain(&self.sync_agent)
            .chain(&self.controller)
            .chain(&self.frontend)
    }

    /// A direct-IO loop device on the FUSE file (or the iSCSI disk tgtd serves from it), then
    /// the `/dev/longhorn` node.
    fn attach_device(&mut self, iscsi: bool) -> Result<()> {
        let dev = if iscsi {
            VolumeDevice::Iscsi(crate::iscsi::IscsiDisk::start(&self.fuse_file)?)
        } else {
            VolumeDevice::Loop(LoopDevice::attach(&self.fuse_file, true)?)
        };
        self.device = Some(dev);
        let (ma, mi) = self.device_major_minor();
        ensure!(ma != 0, "no major:minor for {}", self.device().display());
        let node = self.dev_dir.join(&self.volume);
        let c_node = std::ffi::CString::new(node.as_os_str().as_bytes())?;
        // SAFETY: c_node is a valid NUL-terminated path.
        let rc = unsafe {
            libc::mknod(
                c_node.as_ptr(),
                libc::S_IFBLK | 0o660,
                libc::makedev(ma, mi),
            )
        };
        if rc != 0 {
            bail!(
                "mknod {}: {}",
                node.display(),
                std::io::Error::last_os_error()
            );
        }
        Ok(())
    }

    fn detach_device(&mut self) {
        if let Some(dev) = self.device.take() {
            let _ = std::fs::remove_file(self.dev_dir.join(&self.volume));
            drop(dev);
        }
    }

    fn stop_frontend(&mut self) {
        if let Some(p) = self.frontend.take() {
            stop_all(vec![p]);
        }
        if is_mounted(&self.mountpoint) {
            eprintln!(
                "pgio-testkit: {} still mounted after the frontend exited; unmounting",
                self.mountpoint.display()
            );
            if cmd::run(Command::new("umount").arg(&self.mountpoint)).is_err()
                && let Err(e) = cmd::run(Command::new("umount").arg("-l").arg(&self.mountpoint))
            {
                eprintln!(
                    "pgio-testkit: umount -l {}: {e:#}",
                    self.mountpoint.display()
                );
            }
        }
    }
}

/// The volume's block device, by frontend.
#[derive(Debug)]
enum VolumeDevice {
    Loop(LoopDevice),
    Iscsi(crate::iscsi::IscsiDisk),
}

impl Drop for LonghornVolume {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("longhorn stand-in logs:\n{}", self.logs_text());
        }
        self.detach_device();
        self.stop_frontend();
        stop_all(self.controller.take().into_iter().collect());
        let mut rest: Vec<Proc> = self.sync_agent.take().into_iter().collect();
        rest.append(&mut self.replicas);
        stop_all(rest);
        drop(self.data.take());
        drop(self.backing.take());
        // `dir` goes when the fields drop.
    }
}

/// SIGTERM to each (our children only), up to 5 s for all to exit, SIGKILL the rest; reaps.
fn stop_all(mut procs: Vec<Proc>) {
    for p in &mut procs {
        if let Ok(None) = p.child.try_wait() {
            // SAFETY: signalling our own child, which has not been reaped (no PID reuse).
            unsafe { libc::kill(p.child.id() as libc::pid_t, libc::SIGTERM) };
        }
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    for p in &mut procs {
        let left = deadline.saturating_duration_since(Instant::now());
        let exited = wait_until(left, Duration::from_millis(10), || {
            !matches!(p.child.try_wait(), Ok(None))
        });
        if !exited {
            eprintln!(
                "pgio-testkit: {} (pid {}) ignored SIGTERM; killing",
                p.role,
                p.child.id()
            );
            let _ = p.child.kill();
        }
        let _ = p.child.wait();
    }
}

fn is_mounted(mountpoint: &Path) -> bool {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return false;
    };
    let mp = mountpoint.to_string_lossy();
    info.lines().any(|l| l.split(' ').nth(4) == Some(&*mp))
}

/// Starts a process that takes a `--listen 127.0.0.1:<port>`, on a free port; if another
/// process took the port between our probe and its bind, retries with a new one.
fn spawn_with_port(
    logs: &Path,
    role: &str,
    mut make: impl FnMut(u16) -> Command,
) -> Result<(Proc, u16)> {
    let mut attempt = 0;
    loop {
        attempt += 1;
        let port = free_port()?;
        match spawn_ready(logs, role, &mut make(port)) {
            Ok(p) => return Ok((p, port)),
            Err(e) if attempt < 3 && format!("{e:#}").contains("address already in use") => {
                continue;
            }
            Err(e) => return Err(e),
        }
    }
}

/// Spawns `cmd` (stdout piped, stderr to `<logs>/<role>.log`) and waits for its
/// "READY …" line. Kills it if it does not come.
fn spawn_ready(logs: &Path, role: &str, cmd: &mut Command) -> Result<Proc> {
    let log = logs.join(format!("{role}.log"));
    let log_file =
        std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(log_file)
        .spawn()
        .with_context(|| format!("spawning `{}`", cmd::describe(cmd)))?;
    let stdout = child.stdout.take().expect("piped stdout");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut lines = BufReader::new(stdout).lines();
        if let Some(Ok(line)) = lines.next() {
            let _ = tx.send(line);
        }
        // Keep draining so the child never blocks on a full pipe.
        for _ in lines {}
    });
    let mut p = Proc {
        role: role.to_owned(),
        child,
        log,
    };
    match rx.recv_timeout(READY_TIMEOUT) {
        Ok(line) if line.starts_with("READY ") => Ok(p),
        got => {
            kill_now(&mut p);
            bail!(
                "{role} did not become ready ({}): `{}`\nlog:\n{}",
                match got {
                    Ok(line) => format!("said {line:?}"),
                    Err(mpsc::RecvTimeoutError::Timeout) =>
                        format!("no READY in {READY_TIMEOUT:?}"),
                    Err(mpsc::RecvTimeoutError::Disconnected) => "exited".to_owned(),
                },
                cmd::describe(cmd),
                std::fs::read_to_string(&p.log)
                    .unwrap_or_default()
                    .trim_end()
            )
        }
    }
}

fn kill_now(p: &mut Proc) {
    let _ = p.child.kill();
    let _ = p.child.wait();
}

/// Sends a stats request (wire op 5, see longhorn-standin/internal/wire) to 127.0.0.1:port
/// and parses the `key=value …` reply.
fn query_stats(port: u16) -> Result<BTreeMap<String, u64>> {
    let mut s = TcpStream::connect(("127.0.0.1", port))
        .with_context(|| format!("connecting to 127.0.0.1:{port} for stats"))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut req = [0u8; 24];
    req[0] = 5; // op stats; length 0
    req[8..16].copy_from_slice(&1u64.to_le_bytes()); // id
    s.write_all(&req)?;
    let mut hdr = [0u8; 16];
    s.read_exact(&mut hdr)?;
    let errno = u32::from_le_bytes(hdr[8..12].try_into().unwrap());
    let len = u32::from_le_bytes(hdr[12..16].try_into().unwrap()) as usize;
    ensure!(errno == 0, "stats from port {port}: errno {errno}");
    ensure!(len < 4096, "stats from port {port}: {len} bytes");
    let mut body = vec![0u8; len];
    s.read_exact(&mut body)?;
    parse_stats(&String::from_utf8_lossy(&body))
}

fn parse_stats(text: &str) -> Result<BTreeMap<String, u64>> {
    text.split_whitespace()
        .map(|kv| {
            let (k, v) = kv
                .split_once('=')
                .with_context(|| format!("bad stats field {kv:?}"))?;
            Ok((
                k.to_owned(),
                v.parse().with_context(|| format!("stats {kv:?}"))?,
            ))
        })
        .collect()
}

fn field(m: &BTreeMap<String, u64>, key: &str) -> Result<u64> {
    m.get(key)
        .copied()
        .with_context(|| format!("stats lack {key:?}: {m:?}"))
}

/// A fresh `pvc-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` name (the shape of a CSI PV name).
pub fn unique_volume_name() -> String {
    let (a, b, c) = (rand_u32(), rand_u32(), rand_u32());
    format!(
        "pvc-{a:08x}-{:04x}-4{:03x}-8{:03x}-{:04x}{c:08x}",
        b >> 16,
        b & 0xfff,
        (a ^ c) & 0xfff,
        std::process::id() & 0xffff
    )
}

/// Not cryptographic: unique enough names across tests and test processes.
fn rand_u32() -> u32 {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let mut x = nanos
        ^ std::process::id().rotate_left(16)
        ^ COUNTER
            .fetch_add(1, Ordering::Relaxed)
            .wrapping_mul(0x9e37_79b9);
    // xorshift to spread the bits
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    x
}

/// Directory holding `longhorn` and `longhorn-fuse`: `$PGIO_LONGHORN_BIN_DIR`, else built
/// with `go build` into `<target>/longhorn-standin/` once per test process (Go's own cache
/// makes a rebuild of unchanged sources quick). Binaries are built into a private directory
/// and renamed into place, so parallel test processes never see half-written executables
/// and running ones keep their old inode.
pub fn standin_bin_dir() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os(LONGHORN_BIN_DIR_ENV) {
        return Ok(PathBuf::from(p));
    }
    static BUILT: Mutex<Option<PathBuf>> = Mutex::new(None);
    let mut built = BUILT.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(p) = built.as_ref() {
        return Ok(p.clone());
    }
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../longhorn-standin");
    let src = src
        .canonicalize()
        .with_context(|| format!("Go sources of the stand-in at {}", src.display()))?;
    let out = crate::load::target_dir()?.join("longhorn-standin");
    let staging = out.join(format!(".build-{}", std::process::id()));
    std::fs::create_dir_all(&staging).with_context(|| format!("creating {}", staging.display()))?;

    let go = go_binary()?;
    let mut c = Command::new(&go);
    c.current_dir(&src)
        .args(["build", "-buildvcs=false", "-o"])
        .arg(format!("{}/", staging.display()))
        .args(["./cmd/longhorn", "./cmd/longhorn-fuse"])
        .env("GOTOOLCHAIN", "local");
    if std::env::var_os("HOME").is_none() {
        // Go needs somewhere for its build and module caches.
        if std::env::var_os("GOCACHE").is_none() {
            c.env("GOCACHE", out.join("go-cache"));
        }
        if std::env::var_os("GOPATH").is_none() && std::env::var_os("GOMODCACHE").is_none() {
            c.env("GOPATH", out.join("go-path"));
        }
    }
    let result = cmd::run(&mut c);
    if result.is_ok() {
        for bin in ["longhorn", "longhorn-fuse"] {
            std::fs::rename(staging.join(bin), out.join(bin))
                .with_context(|| format!("moving {bin} into {}", out.display()))?;
        }
    }
    let _ = std::fs::remove_dir_all(&staging);
    result.context("building the Go Longhorn stand-in")?;
    *built = Some(out.clone());
    Ok(out)
}

/// `go` on PATH, else /usr/local/go/bin/go.
fn go_binary() -> Result<PathBuf> {
    let on_path = std::env::var_os("PATH")
        .map(|p| {
            std::env::split_paths(&p)
                .map(|d| d.join("go"))
                .collect::<Vec<_>>()
        })
        .unwrap_or_default();
    on_path
        .into_iter()
        .chain([PathBuf::from("/usr/local/go/bin/go")])
        .find(|p| p.is_file())
        .with_context(|| {
            format!(
                "no Go toolchain (`go` on PATH or /usr/local/go/bin/go): the Longhorn stand-in \
                 is a Go program; install Go (see longhorn-standin/go.mod for the version) or \
                 set {LONGHORN_BIN_DIR_ENV} to a directory with prebuilt binaries"
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_stats_lines() {
        let m = parse_stats("reads=3 writes=4 unmaps=0\n").unwrap();
        assert_eq!(field(&m, "reads").unwrap(), 3);
        assert_eq!(field(&m, "writes").unwrap(), 4);
        assert!(field(&m, "flushes").is_err());
        assert!(parse_stats("reads=x").is_err());
    }

    #[test]
    fn volume_names_look_like_pv_names_and_differ() {
        let a = unique_volume_name();
        let b = unique_volume_name();
        assert_ne!(a, b);
        assert_eq!(a.len(), "pvc-".len() + 36, "{a}");
        assert!(a.starts_with("pvc-"));
        assert_eq!(a.matches('-').count(), 5, "{a}");
    }
}
