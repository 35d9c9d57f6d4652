//! The image in a real podman container, with exactly the DaemonSet's security context: the
//! pod spec of `kubectl kustomize deploy/kustomize` translated into `podman run` flags
//! (`pgio_testkit::daemonset`, which fails on any field it cannot translate). With it, /metrics
//! shows a host process' direct reads of a loop device (count = /proc/diskstats' delta) and a
//! PostgreSQL cluster's roles with their database, user and cluster labels. Then, for each
//! capability the manifest adds, a run without it shows what it is for: the daemon exits naming
//! BPF or PERFMON, and labels go missing without SYS_PTRACE or DAC_READ_SEARCH. Between the
//! two, the same run under the Localhost seccomp profile (`deploy/seccomp/pgio.json`) with
//! every syscall it does not list killing the process: a syscall the daemon needs and the
//! profile lacks fails here instead of degrading on a node. Then components/tracefs-debugfs
//! on a "node" whose tracefs is only under debugfs (a debugfs mounted in the test's temp dir):
//! the container's /sys/kernel/tracing is that automount, and queries are counted.
//!
//! The image is built from the binary under test with `pgio_testkit::podman::build_image`, the
//! function `cargo xtask image` uses, and its tag removed at the end.
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use pgio_testkit::daemonset::{self, Manifest, Node, PodmanRun};
use pgio_testkit::kubepods::{self, Driver, PodCgroup, PodLogs};
use pgio_testkit::podman::{self, Container};
use pgio_testkit::{
    DiskStats, LoadProcess, LoopDevice, Metrics, PG15_BIN_DIR, PgCluster, PgOptions, PsqlSession,
    REQUIRE_ROOT_ENV, TempDir, daemon::free_port, diskstats, metrics::http_get, pgio_load_bin,
    scrape, temp_dir, wait_until,
};

/// Statements the session runs under pgio in the container.
const QUERIES: u64 = 10;
const READS: u64 = 2_000;
const APP: &str = "container-test";
/// The container's daemon counts a request lost 1 s after its issue when its completion never
/// came; a window waits that out at both ends so it neither gains nor loses one.
const SETTLE: Duration = Duration::from_millis(1300);
/// The hostPath mounts pod labels are read from.
const KUBELET_DIRS: [&str; 2] = ["/var/log/pods", "/var/log/containers"];
const PG_PORT: u16 = 55_471;
const PG_USER: &str = "pgio user";
const PG_DB: &str = "pgio db";

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_owned()
}

/// Root and podman, or a reason to skip. With CI or PGIO_REQUIRE_ROOT_TESTS set, or as root
/// without podman, not being able to run is a failure.
fn can_run() -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let ci = std::env::var("CI")
        .is_ok_and(|v| !matches!(v.trim().to_ascii_lowercase().as_str(), "" | "0" | "false"));
    let required = ci || std::env::var_os(REQUIRE_ROOT_ENV).is_some();
    let missing = if !root {
        Some("needs root (podman rootful, eBPF, loop devices)")
    } else if !podman::available() {
        Some("needs podman and runc (`cargo xtask setup` installs them)")
    } else {
        None
    };
    match missing {
        None => true,
        Some(why) if required || root => panic!("container test cannot run: {why}"),
        Some(why) => {
            eprintln!("\n*** container test SKIPPED: {why} (set {REQUIRE_ROOT_ENV} to fail) ***\n");
            false
        }
    }
}

/// Removes the test's image tag on drop.
struct ImageTag(String);

impl Drop for ImageTag {
    fn drop(&mut self) {
        if let Err(e) = podman::remove_tag(&self.0) {
            eprintln!("removing image tag {}: {e:#}", self.0);
        }
    }
}

/// What the test gives the translation for the node-side names.
struct NodeFiles {
    dir: TempDir,
    config_maps: BTreeMap<String, BTreeMap<String, String>>,
    runtime_default: PathBuf,
    /// hostPaths that stand for another directory here (the node's layout, not this host's).
    host_subst: Vec<(&'static str, PathBuf)>,
}

impl NodeFiles {
    fn new(manifest: &Manifest, extra_config: &str) -> NodeFiles {
        let dir = temp_dir().expect("temp dir");
        let mut config_maps = BTreeMap::new();
        for doc in manifest.docs.iter().filter(|d| d["kind"] == "ConfigMap") {
            let name = doc["metadata"]["name"].as_str().expect("ConfigMap name");
            let mut data = manifest.config_map_data(name).expect("ConfigMap data");
            // The test's user rule goes into the config file the DaemonSet passes, and requests
            // never seen completing count as lost after 1 s instead of the shipped 180 s, so a
            // window can wait that out.
            if let Some(toml) = data.get_mut("pgio.toml") {
                let shipped = "\nblock_inflight_timeout_secs = 180\n";
                assert!(toml.contains(shipped), "{name}: no `{}`", shipped.trim());
                *toml = toml.replace(shipped, "\nblock_inflight_timeout_secs = 1\n");
                toml.push_str(extra_config);
            }
            config_maps.insert(name.to_owned(), data);
        }
        let podman_default = std::fs::read_to_string("/usr/share/containers/seccomp.json")
            .expect("podman's default seccomp profile");
        let runtime_default = dir.path().join("runtime-default.json");
        std::fs::write(
            &runtime_default,
            daemonset::containerd_like_default_profile(&podman_default).expect("profile"),
        )
        .expect("write profile");
        NodeFiles {
            dir,
            config_maps,
            runtime_default,
            host_subst: Vec::new(),
        }
    }

    /// The node's `/var/log/pods` and `/var/log/containers`, as mounted into the container.
    fn pod_logs(&self) -> PodLogs {
        let subst = self.dir.path().join("host");
        let [pods, containers] = KUBELET_DIRS.map(|d| subst.join(d.trim_start_matches('/')));
        for d in [&pods, &containers] {
            std::fs::create_dir_all(d).expect("kubelet dir");
        }
        PodLogs { pods, containers }
    }

    fn translate(&self, pod: &pgio_testkit::serde_json::Value, host_port: u16) -> PodmanRun {
        let subst = self.dir.path().join("host");
        let host_path = |path: &str, kind: &str| -> anyhow::Result<PathBuf> {
            // The kubelet's log directories are the test's (see `NodeFiles::pod_logs`), also
            // on a machine that has them.
            if let Some((_, dir)) = self.host_subst.iter().find(|(p, _)| *p == path) {
                return Ok(dir.clone());
            }
            if KUBELET_DIRS.contains(&path) {
                let dir = subst.join(path.trim_start_matches('/'));
                std::fs::create_dir_all(&dir)?;
                return Ok(dir);
            }
            if Path::new(path).exists() {
                return Ok(PathBuf::from(path));
            }
            anyhow::ensure!(
                kind == "DirectoryOrCreate",
                "hostPath {path} ({kind:?}) does not exist on this machine"
            );
            // The kubelet would create it; the test does not create it on the host.
            let dir = subst.join(path.trim_start_matches('/'));
            std::fs::create_dir_all(&dir)?;
            Ok(dir)
        };
        let config_map_dir = |name: &str| -> anyhow::Result<PathBuf> {
            let files = self
                .config_maps
                .get(name)
                .ok_or_else(|| anyhow::anyhow!("no ConfigMap {name} in the manifest"))?;
            let dir = self.dir.path().join("configmaps").join(name);
            std::fs::create_dir_all(&dir)?;
            for (file, text) in files {
                std::fs::write(dir.join(file), text)?;
            }
            Ok(dir)
        };
        let seccomp_root = workspace().join("deploy").join("seccomp");
        let hostname = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        let node = Node {
            host_path: &host_path,
            config_map_dir: &config_map_dir,
            seccomp_root: &seccomp_root,
            runtime_default_seccomp: &self.runtime_default,
            host_port,
            node_name: hostname.trim(),
        };
        daemonset::to_podman(pod, &node).expect("translating the DaemonSet's pod spec")
    }
}

/// A started container and where its /metrics is.
struct Pgio {
    container: Container,
    base: String,
}

impl Pgio {
    fn start(name: &str, run: &PodmanRun, image: &str) -> Pgio {
        let container = Container::run(name, &run.flags, image, &run.args).expect("podman run");
        let port = run.url_port.expect("the DaemonSet has a container port");
        Pgio {
            container,
            base: format!("http://127.0.0.1:{port}"),
        }
    }

    /// Waits for /healthz; None if the container exited first (with its exit code).
    fn wait_up(&self) -> Result<(), i32> {
        let healthz = format!("{}/healthz", self.base);
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            if http_get(&healthz, Duration::from_secs(2)).is_ok() {
                return Ok(());
            }
            if let Ok(Some(code)) = self.container.exit_code() {
                return Err(code);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!(
            "pgio in {} did not come up in 60 s:\n{}",
            self.container.name(),
            self.container.logs()
        );
    }

    fn scrape(&self) -> Metrics {
        scrape(&format!("{}/metrics", self.base)).expect("scrape /metrics")
    }

    /// A scrape and the device's diskstats with no request completing in between.
    fn snapshot(&self, device: &str) -> (Metrics, DiskStats) {
        for _ in 0..500 {
            let d1 = diskstats(device).expect("diskstats");
            let m = self.scrape();
            let d2 = diskstats(device).expect("diskstats");
            // Nothing held provisional either (see common::holds_nothing_back).
            if d1 == d2 && m.sum("pgio_provisional_processes", &[]) == 0.0 {
                return (m, d2);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("{device} never went quiet, with no process held provisional, for a scrape");
    }

    /// The queries pgio counts on `backend` while `session` runs QUERIES statements.
    fn queries_of(&self, session: &mut PsqlSession, backend: &[(&str, &str)]) -> f64 {
        let queries = |m: &Metrics| m.sum("pgio_query_seconds_count", backend);
        let before = self.scrape();
        for _ in 0..QUERIES {
            session.send("SELECT 1;").expect("send");
        }
        wait_until(Duration::from_secs(10), Duration::from_millis(100), || {
            queries(&self.scrape()) - queries(&before) >= QUERIES as f64
        });
        std::thread::sleep(Duration::from_millis(300));
        queries(&self.scrape()) - queries(&before)
    }

    fn wait_tracked(&self, labels: &[(&str, &str)]) -> bool {
        wait_until(Duration::from_secs(15), Duration::from_millis(100), || {
            self.scrape().sum("pgio_tracked_processes", labels) >= 1.0
        })
    }
}

/// A debugfs mounted in the test's temp dir: its `tracing/` is the kernel's tracefs automount,
/// as on a node that has tracefs only under /sys/kernel/debug. Unmounted (both) on drop.
struct DebugfsMount(PathBuf);

impl DebugfsMount {
    fn new(parent: &Path) -> DebugfsMount {
        let dir = parent.join("debugfs");
        std::fs::create_dir_all(&dir).expect("debugfs dir");
        let mut mount = std::process::Command::new("mount");
        mount.args(["-t", "debugfs", "none"]).arg(&dir);
        let status = mount.status().expect("mount");
        assert!(
            status.success(),
            "mount -t debugfs none {}: {status}",
            dir.display()
        );
        let m = DebugfsMount(dir);
        assert!(
            m.tracing().join("events").is_dir(),
            "no tracefs automount under {}",
            m.0.display()
        );
        m
    }

    fn tracing(&self) -> PathBuf {
        self.0.join("tracing")
    }
}

impl Drop for DebugfsMount {
    fn drop(&mut self) {
        let mut umount = std::process::Command::new("umount");
        umount.arg("-R").arg(&self.0);
        match umount.status() {
            Ok(s) if s.success() => {}
            other => eprintln!("umount -R {}: {other:?}", self.0.display()),
        }
    }
}

/// An overlay of the kustomize base with these components, in `dir` (kustomize wants relative
/// paths).
fn overlay(dir: &Path, components: &[&str]) -> PathBuf {
    let base = workspace().join("deploy").join("kustomize");
    let depth = dir
        .canonicalize()
        .expect("overlay dir")
        .components()
        .count()
        - 1;
    let rel = PathBuf::from("../".repeat(depth)).join(
        base.canonicalize()
            .expect("base")
            .strip_prefix("/")
            .expect("absolute"),
    );
    let mut text = format!("resources: [{}]\ncomponents:\n", rel.display());
    for c in components {
        text.push_str(&format!(
            "  - {}\n",
            rel.join("components").join(c).display()
        ));
    }
    std::fs::write(dir.join("kustomization.yaml"), text).expect("overlay");
    dir.to_path_buf()
}

/// `pgio-daemon check` in a container with these flags: its output.
fn check_output(name: &str, run: &PodmanRun, image: &str) -> String {
    let c = Container::run(name, &run.flags, image, &["check".to_owned()]).expect("podman run");
    c.wait_exit(Duration::from_secs(30)).expect("check exits");
    c.logs()
}

/// The flags without `--cap-add=<cap>`.
fn without_cap(run: &PodmanRun, cap: &str) -> PodmanRun {
    let mut r = run.clone();
    let flag = format!("--cap-add={cap}");
    let before = r.flags.len();
    r.flags.retain(|f| *f != flag);
    assert_eq!(r.flags.len(), before - 1, "{flag} not in {:?}", run.flags);
    r.cap_add.retain(|c| c != cap);
    r
}

/// (major, minor) of the running kernel.
/// `run` under `deploy/seccomp/pgio.json`, but with `SCMP_ACT_KILL_PROCESS` for anything it
/// does not list instead of EPERM (which the daemon would survive, with less).
fn under_strict_localhost_profile(run: &PodmanRun, dir: &Path) -> PodmanRun {
    let shipped = workspace().join("deploy").join("seccomp").join("pgio.json");
    let text = std::fs::read_to_string(&shipped).expect("the Localhost profile");
    let mut profile: pgio_testkit::serde_json::Value =
        pgio_testkit::serde_json::from_str(&text).expect("the Localhost profile's JSON");
    let top = profile.as_object_mut().expect("a JSON object");
    top.insert("defaultAction".into(), "SCMP_ACT_KILL_PROCESS".into());
    top.remove("defaultErrnoRet");
    let strict = dir.join("pgio-strict.json");
    std::fs::write(&strict, profile.to_string()).expect("write the strict profile");
    let mut out = run.clone();
    out.flags
        .retain(|f| !f.starts_with("--security-opt=seccomp="));
    out.flags
        .push(format!("--security-opt=seccomp={}", strict.display()));
    out
}

#[test]
fn daemonset_security_context_in_podman() {
    if !can_run() {
        return;
    }
    let started = Instant::now();
    assert!(
        Path::new(PG15_BIN_DIR).join("postgres").exists(),
        "PostgreSQL 15 missing in {PG15_BIN_DIR} (cargo xtask setup installs postgresql-15)"
    );
    let id = std::process::id();

    // The image, from the binary under test.
    let tag = ImageTag(format!("localhost/pgio:container-test-{id}"));
    let context = temp_dir().expect("context dir");
    let image = podman::build_image(
        Path::new(env!("CARGO_BIN_EXE_pgio-daemon")),
        &workspace()
            .join("deploy")
            .join("image")
            .join("Containerfile"),
        &context.path().join("ctx"),
        std::slice::from_ref(&tag.0),
        &[("VERSION", env!("CARGO_PKG_VERSION"))],
    )
    .expect("podman build");
    eprintln!(
        "image {} {} bytes, libraries {:?}",
        tag.0, image.size_bytes, image.libraries
    );

    // The DaemonSet, as kustomize renders it.
    let manifest =
        Manifest::kustomize(&workspace().join("deploy").join("kustomize")).expect("kustomize");
    let pod = manifest.daemonset_pod_spec().expect("DaemonSet");
    let rule = format!("\n[[rule]]\napp = \"{APP}\"\nrole = \"dd\"\ncomm = \"^pgio-load$\"\n");
    let node = NodeFiles::new(&manifest, &rule);
    let run = node.translate(pod, free_port().expect("free port"));
    eprintln!(
        "podman run {} {} {} {}\n(not translated: {:?})",
        podman::MACHINE_RUN_FLAGS.join(" "),
        run.flags.join(" "),
        tag.0,
        run.args.join(" "),
        run.ignored
    );
    assert!(!run.cap_add.is_empty(), "the DaemonSet adds no capability");

    // A PostgreSQL 15 cluster in a 0700 data directory owned by postgres, a role and a database
    // whose names have a space (their split needs the catalogs), and a session between them.
    let dir = temp_dir().expect("temp dir");
    let data_dir = dir.path().join("data");
    let mut pg =
        PgCluster::init_with(PgOptions::new(PG15_BIN_DIR, &data_dir, PG_PORT)).expect("initdb");
    pg.start().expect("start");
    pg.psql(&format!("create role \"{PG_USER}\" login"))
        .expect("create role");
    pg.psql(&format!("create database \"{PG_DB}\" owner \"{PG_USER}\""))
        .expect("create database");
    pg.psql("checkpoint").expect("checkpoint");
    let mut session = pg.session(PG_DB, PG_USER).expect("psql session");
    let seen = wait_until(Duration::from_secs(10), Duration::from_millis(50), || {
        pg.psql(&format!(
            "select datname || '/' || usename from pg_stat_activity \
             where backend_type = 'client backend' and usename = '{PG_USER}'"
        ))
        .is_ok_and(|s| s == format!("{PG_DB}/{PG_USER}"))
    });
    assert!(
        seen,
        "pg_stat_activity never showed the session as {PG_DB}/{PG_USER}"
    );
    let cluster = data_dir.to_str().expect("utf-8 path").to_owned();
    let backend = [
        ("app", "postgres"),
        ("role", "client backend"),
        ("database", PG_DB),
        ("user", PG_USER),
        ("pg_cluster", cluster.as_str()),
    ];

    let lo = LoopDevice::create(dir.path(), 64 << 20, true).expect("loop device");

    // 1. Everything the DaemonSet grants.
    let full = Pgio::start(&format!("pgio-container-test-{id}"), &run, &tag.0);
    if let Err(code) = full.wait_up() {
        panic!(
            "pgio exited ({code}) with the DaemonSet's permissions:\n{}",
            full.container.logs()
        );
    }
    for probe in &run.probes {
        // Published: the probe's container port is reached through url_port.
        assert_eq!(Some(probe.port), run.container_port, "{probe:?}");
        let url = format!("{}{}", full.base, probe.path);
        http_get(&url, Duration::from_secs(5))
            .unwrap_or_else(|e| panic!("{} GET {url}: {e:#}", probe.kind));
    }
    for role in [
        "postmaster",
        "checkpointer",
        "background writer",
        "walwriter",
    ] {
        let labels = [
            ("app", "postgres"),
            ("role", role),
            ("pg_cluster", cluster.as_str()),
        ];
        assert!(
            full.wait_tracked(&labels),
            "no {role} of {cluster} tracked:\n{}",
            full.container.logs()
        );
    }
    assert!(
        full.wait_tracked(&backend),
        "client backend not tracked as {backend:?}; tracked:\n{}",
        full.scrape()
            .matching("pgio_tracked_processes", &[("app", "postgres")])
            .map(|s| format!("{:?}\n", s.labels))
            .collect::<String>()
    );

    // The DaemonSet's memory limit as pgio serves it (PgioNearMemoryLimit's input), and what
    // its cgroup holds: at least its maps (charged there on kernels >= 5.11) and below the
    // limit.
    let limit = pgio_testkit::daemonset::memory_bytes(
        pod["containers"][0]["resources"]["limits"]["memory"]
            .as_str()
            .expect("the DaemonSet's memory limit"),
    )
    .expect("a memory quantity");
    let m = full.scrape();
    assert_eq!(
        m.sum("pgio_memory_cgroup_limit_bytes", &[]),
        limit as f64,
        "the DaemonSet's limit"
    );
    let usage = m.sum("pgio_memory_cgroup_usage_bytes", &[]);
    let maps = m.sum("pgio_bpf_map_memory_bytes", &[]);
    assert!(
        usage > 0.0 && usage < limit as f64,
        "cgroup usage {usage}, limit {limit}"
    );
    if pgio_testkit::kernel_version() >= (5, 11) {
        assert!(usage >= maps, "cgroup usage {usage} holds maps of {maps}");
    }
    eprintln!(
        "memory cgroup: {:.1} of {:.1} MiB, maps {:.1} MiB",
        usage / 1048576.0,
        limit as f64 / 1048576.0,
        maps / 1048576.0
    );

    // A host process' direct reads, counted on the device as /proc/diskstats counts them. It
    // runs in a kubelet-shaped pod cgroup whose names are in the mounted /var/log/pods tree:
    // the pod labels work from inside the container.
    let (uid, container_id) = kubepods::ids(21);
    let pod_cgroup = PodCgroup::create(Driver::Systemd, &uid, &container_id).expect("pod cgroup");
    node.pod_logs()
        .add("tenant", "reader-0", &uid, "dd", &container_id)
        .expect("pod logs");
    lo.wait_quiet(Duration::from_secs(5));
    // pgio-load waits to be told to read until pgio tracks it: a process exec'd by an
    // untracked one is untracked until userspace has matched its rule, and a read in that
    // first millisecond is not the reader's (CI, loaded: 1,999 of 2,000 with dd).
    let mut reader = std::process::Command::new(pgio_load_bin().expect("pgio-load"));
    reader.args([
        "direct-read",
        lo.path().to_str().expect("utf-8 path"),
        &READS.to_string(),
        "8192",
    ]);
    pod_cgroup
        .spawn_inside(&mut reader)
        .expect("reader in the pod");
    let mut reader = LoadProcess::spawn_command(reader).expect("spawn pgio-load");
    assert!(
        full.wait_tracked(&[("app", APP), ("role", "dd"), ("pod", "reader-0")]),
        "the reader was not tracked in its pod"
    );
    std::thread::sleep(SETTLE);
    let (before, disk_before) = full.snapshot(lo.name());
    assert_eq!(reader.expect_run(), READS);
    std::thread::sleep(SETTLE);
    let (after, disk_after) = full.snapshot(lo.name());
    let disk_reads = (disk_after.reads_completed - disk_before.reads_completed) as f64;
    // Counted, or counted lost (README: every request is counted or reported).
    let delta = |labels: &[(&str, &str)]| {
        [
            "pgio_block_io_requests_total",
            "pgio_block_io_lost_completions_total",
        ]
        .iter()
        .map(|f| after.sum(f, labels) - before.sum(f, labels))
        .sum::<f64>()
    };
    let device = [("device", lo.name()), ("op", "read")];
    let on_device = delta(&device);
    let by_dd = delta(&[
        ("device", lo.name()),
        ("op", "read"),
        ("app", APP),
        ("role", "dd"),
        ("namespace", "tenant"),
        ("pod", "reader-0"),
        ("container", "dd"),
    ]);
    eprintln!("diskstats reads {disk_reads}, pgio {on_device}, attributed to dd {by_dd}");
    assert_eq!(
        disk_reads, READS as f64,
        "diskstats: {READS} reads expected"
    );
    assert_eq!(
        on_device,
        disk_reads,
        "pgio's read requests on {}",
        lo.name()
    );
    assert_eq!(
        by_dd, disk_reads,
        "reads attributed to app={APP} role=dd in pod tenant/reader-0"
    );
    // Query metrics with the DaemonSet's capabilities (tracepoints on the client socket, no
    // uprobe): the session, connected before pgio started, runs QUERIES statements.
    let got = full.queries_of(&mut session, &backend);
    eprintln!("queries: {QUERIES} statements, pgio {got}");
    assert_eq!(
        got,
        QUERIES as f64,
        "one query per statement of the session:\n{}",
        full.container.logs()
    );
    let code = full.container.stop(Duration::from_secs(20)).expect("stop");
    assert_eq!(
        code,
        0,
        "pgio's exit on SIGTERM:\n{}",
        full.container.logs()
    );
    drop(full);

    // 2. The Localhost seccomp profile, strictly: the catalogs (openat2), the capability drop
    // (capset), the probes, the scrapes and the query metrics all within it.
    let strict = under_strict_localhost_profile(&run, dir.path());
    let confined = Pgio::start(
        &format!("pgio-container-test-{id}-seccomp"),
        &strict,
        &tag.0,
    );
    if let Err(code) = confined.wait_up() {
        panic!(
            "pgio exited ({code}; 159 is SIGSYS: a syscall deploy/seccomp/pgio.json lacks) under \
             the Localhost profile:\n{}",
            confined.container.logs()
        );
    }
    assert!(
        confined.wait_tracked(&backend),
        "client backend not tracked as {backend:?} under the Localhost profile:\n{}",
        confined.container.logs()
    );
    let got = confined.queries_of(&mut session, &backend);
    let code = confined
        .container
        .stop(Duration::from_secs(20))
        .expect("stop");
    let logs = confined.container.logs();
    eprintln!("under the Localhost profile: {got} queries, exit {code}");
    assert_eq!(
        got, QUERIES as f64,
        "queries under the Localhost profile:\n{logs}"
    );
    assert_eq!(
        code, 0,
        "pgio's exit on SIGTERM under the Localhost profile:\n{logs}"
    );
    assert!(
        !logs.contains("dropping capabilities:"),
        "the capability drop failed under the Localhost profile:\n{logs}"
    );
    drop(confined);

    // 2b. A node whose tracefs is only under debugfs (Amazon Linux 2): the tracefs-debugfs
    // component mounts the host's /sys/kernel/debug/tracing at /sys/kernel/tracing.
    let debugfs = DebugfsMount::new(dir.path());
    let overlay_dir = dir.path().join("overlay-tracefs-debugfs");
    std::fs::create_dir_all(&overlay_dir).expect("overlay dir");
    let manifest = Manifest::kustomize(&overlay(&overlay_dir, &["tracefs-debugfs"]))
        .expect("kustomize with components/tracefs-debugfs");
    let mut debugfs_node = NodeFiles::new(&manifest, &rule);
    debugfs_node
        .host_subst
        .push(("/sys/kernel/debug/tracing", debugfs.tracing()));
    let debugfs_run = debugfs_node.translate(
        manifest.daemonset_pod_spec().expect("DaemonSet"),
        free_port().expect("free port"),
    );
    let volume = format!(
        "--volume={}:/sys/kernel/tracing:ro",
        debugfs.tracing().display()
    );
    assert!(
        debugfs_run.flags.iter().any(|f| f.starts_with(&volume)),
        "{volume} not among {:?}",
        debugfs_run.flags
    );
    let pgio = Pgio::start(
        &format!("pgio-container-test-{id}-debugfs"),
        &debugfs_run,
        &tag.0,
    );
    if let Err(code) = pgio.wait_up() {
        panic!(
            "pgio exited ({code}) with tracefs from debugfs:\n{}",
            pgio.container.logs()
        );
    }
    assert!(pgio.wait_tracked(&backend), "{}", pgio.container.logs());
    let got = pgio.queries_of(&mut session, &backend);
    eprintln!("tracefs from a debugfs automount: {got} queries");
    assert_eq!(got, QUERIES as f64, "{}", pgio.container.logs());
    drop(pgio);
    drop(debugfs);

    // 3. Each capability the DaemonSet adds, taken away: what it is for.
    let (major, minor) = pgio_testkit::kernel_version();
    for cap in run.cap_add.clone() {
        let name = format!("pgio-container-test-{id}-no-{}", cap.to_lowercase());
        let reduced = without_cap(&run, &cap);
        let check = check_output(&format!("{name}-check"), &reduced, &tag.0);
        let pgio = Pgio::start(&name, &reduced, &tag.0);
        let outcome = pgio.wait_up();
        let logs = pgio.container.logs();
        let cap_name = format!("CAP_{cap}");
        match cap.as_str() {
            "BPF" | "PERFMON" => {
                let code = outcome.expect_err("pgio must not start");
                assert_ne!(code, 0);
                assert!(
                    logs.contains(&format!("{cap_name} missing")),
                    "exit {code} without {cap_name}, but the output does not name it:\n{logs}"
                );
                assert!(
                    check.contains(&format!("FAIL {cap_name} missing")),
                    "{check}"
                );
                eprintln!(
                    "without {cap}: exit {code}: {}",
                    logs.trim().lines().last().unwrap_or("")
                );
            }
            "SYS_PTRACE" | "DAC_READ_SEARCH" => {
                if let Err(code) = outcome {
                    panic!("pgio exited ({code}) without {cap_name}:\n{logs}");
                }
                assert!(pgio.wait_tracked(&[("app", "postgres"), ("role", "checkpointer")]));
                let m = pgio.scrape();
                let with_cluster = m.sum(
                    "pgio_tracked_processes",
                    &[("app", "postgres"), ("pg_cluster", cluster.as_str())],
                );
                assert_eq!(
                    with_cluster, 0.0,
                    "without {cap_name} the data directory should be unreadable"
                );
                assert_eq!(m.sum("pgio_tracked_processes", &backend), 0.0);
                assert!(
                    check.contains(&format!("warn {cap_name} missing")),
                    "{check}"
                );
                eprintln!("without {cap}: runs; no cluster label, {PG_USER:?}/{PG_DB:?} not split");
            }
            "SYS_RESOURCE" if (major, minor) >= (5, 11) => {
                // Kernels before 5.11 charge BPF maps to RLIMIT_MEMLOCK: there pgio raises it.
                // Here maps are charged to the memory cgroup, and pgio runs as well without.
                if let Err(code) = outcome {
                    panic!("pgio exited ({code}) without {cap_name} on {major}.{minor}:\n{logs}");
                }
                assert!(pgio.wait_tracked(&backend), "{logs}");
                eprintln!("without {cap}: no difference on kernel {major}.{minor} (needed < 5.11)");
            }
            other => panic!(
                "the DaemonSet adds {other}, and this test knows no failure without it: measure \
                 one (deploy/CAPABILITIES.md) and add it here, or drop the capability"
            ),
        }
    }
    eprintln!("container test done in {:.1?}", started.elapsed());
}
