//! Pod labels from real kubelet-shaped cgroups (both drivers' layouts, in the host's cgroup v2
//! hierarchy, and a real podman container under `--cgroup-parent`) and a `/var/log/pods` tree
//! in a temp directory: each process' block reads carry its pod's namespace/pod/container,
//! processes outside any pod (or in something that only looks like one) carry none, a
//! PostgreSQL cluster in a pod has them on its client backends, and a deleted pod's series
//! leave the exposition after `pod_series_retention_secs`.
mod common;

use std::{path::Path, process::Command, time::Duration};

use common::{Daemon, delta, delta_by};
use pgio_testkit::{
    LoadProcess, LoopDevice, Metrics, PG15_BIN_DIR, PgCluster, PgOptions, check_metrics,
    kubepods::{Driver, PodCgroup, PodLogs, PodmanPod, cgroup2_root, ids},
    pgio_load_bin, require_root, rules_config, temp_dir, wait_until,
};

const READS: u64 = 2_000;
/// Longer than the windows after pod a's reader exits (3 of them, each `SETTLE`, the run and
/// up to ~2 s for its last reads to be counted: under 15 s), so pod a's series is still
/// exported when the test deletes it.
const RETENTION_SECS: u64 = 20;

fn config(logs: &PodLogs, rules: &[(&str, &str, &str)]) -> String {
    format!(
        "rescan_interval_secs = 1\npod_series_retention_secs = {RETENTION_SECS}\n\
         block_inflight_timeout_secs = 1\n{}{}",
        logs.config(),
        rules_config(rules)
    )
}

/// The daemon counts a request lost 1 s after its issue when its completion never came (the
/// kernel skips pgio's completion program for up to ~0.4 % of them, README): a window waits
/// that out before it opens, so it gains none of an earlier run's, and gives its reader's exec
/// that long to be handled by pgio (a read before that is untracked).
const SETTLE: Duration = Duration::from_millis(1300);

/// The longest a window waits after its reads for all of them to be counted: a request whose
/// completion the kernel skipped at the very end of a run is counted lost by the sweep of the
/// first once-a-second pass more than `block_inflight_timeout_secs` after its issue, ~2 s
/// later. A window that is short for longer fails.
const COUNTED: Duration = Duration::from_secs(6);

/// The pod labels block reads of `app` went to in a window, counted or counted lost:
/// "namespace/pod/container" → count.
fn reads_by_pod(
    before: &Metrics,
    after: &Metrics,
    device: &str,
    app: &str,
) -> std::collections::BTreeMap<String, f64> {
    let mut by_pod = std::collections::BTreeMap::new();
    for family in [
        "pgio_block_io_requests_total",
        "pgio_block_io_lost_completions_total",
    ] {
        for (pod, n) in delta_by(
            before,
            after,
            family,
            &[("device", device), ("op", "read"), ("app", app)],
            &["namespace", "pod", "container"],
        ) {
            *by_pod.entry(pod).or_default() += n;
        }
    }
    // A deleted pod's series retired during the window is gone from `after`: its earlier
    // reads show as a negative delta, not as reads of this window.
    by_pod.retain(|_, n| *n > 0.0);
    by_pod
}

fn exposition_is_valid(daemon: &Daemon) {
    let text = pgio_testkit::metrics::http_get(
        &format!("{}/metrics", daemon.url()),
        Duration::from_secs(10),
    )
    .expect("metrics");
    check_metrics(&text).unwrap_or_else(|e| panic!("{e:#}"));
}

/// Every read of the window is under one label set, `want`, and the count is the process'
/// own.
fn assert_all_under(by_pod: std::collections::BTreeMap<String, f64>, want: &str, what: &str) {
    let got: Vec<(String, f64)> = by_pod.into_iter().collect();
    assert_eq!(
        got,
        [(want.to_owned(), READS as f64)],
        "{what}: want all {READS} reads under {want:?}"
    );
}

/// Runs `load` to its end between two scrapes: where its reads went, by pod.
fn window(
    daemon: &Daemon,
    mut load: LoadProcess,
    device: &str,
) -> std::collections::BTreeMap<String, f64> {
    std::thread::sleep(SETTLE);
    let before = daemon.scrape();
    assert_eq!(load.expect_run(), READS);
    let mut by_pod = Default::default();
    wait_until(COUNTED, Duration::from_millis(100), || {
        by_pod = reads_by_pod(&before, &daemon.scrape(), device, "test");
        by_pod.values().sum::<f64>() >= READS as f64
    });
    by_pod
}

/// A `pgio-load` reading `dev` started inside `cgroup` (it is classified at its exec, in the
/// cgroup already).
fn reader_in(cgroup: &PodCgroup, dev: &str) -> LoadProcess {
    let load = pgio_load_bin().expect("pgio-load");
    let cmd = cgroup.command(&load, &[]);
    let mut args: Vec<String> = cmd
        .get_args()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    args.extend([
        "direct-read".into(),
        dev.into(),
        READS.to_string(),
        "8192".into(),
    ]);
    LoadProcess::spawn(Path::new("/bin/sh"), &args).expect("spawn pgio-load in a pod cgroup")
}

#[test]
fn processes_in_kubelet_cgroups_carry_their_pods_labels() {
    if !require_root("processes_in_kubelet_cgroups_carry_their_pods_labels") {
        return;
    }
    let dir = temp_dir().expect("temp dir");
    let lo = LoopDevice::create(dir.path(), 64 << 20, true).expect("loop device");
    let dev = lo.path().to_str().expect("utf-8").to_owned();
    let logs = PodLogs::create(&dir.path().join("log")).expect("log dirs");
    let (uid_a, id_a) = ids(1);
    let (uid_b, id_b) = ids(2);
    let (uid_c, id_c) = ids(3);
    let mut systemd = PodCgroup::create(Driver::Systemd, &uid_a, &id_a).expect("systemd cgroup");
    let cgroupfs = PodCgroup::create(Driver::Cgroupfs, &uid_b, &id_b).expect("cgroupfs cgroup");
    let odd = PodCgroup::create(Driver::Cgroupfs, &uid_c, &id_c).expect("cgroup");
    logs.add("db", "reader-0", &uid_a, "reader", &id_a)
        .expect("pod a");
    logs.add("web", "reader-1.x", &uid_b, "side-car", &id_b)
        .expect("pod b");
    // Names the kubelet never writes: quotes, a newline, upper case.
    logs.add("we\"ird\nns", "Pod", &uid_c, "c", &id_c)
        .expect("pod c");
    // Outside kubepods, a path naming pod a: what an unprivileged user's delegated cgroup
    // could look like.
    let fake_root = cgroup2_root()
        .expect("cgroup2")
        .join(format!("pgio-test-{}", std::process::id()));
    let fake = FakeCgroup::create(
        &fake_root,
        &format!("kubepods/besteffort/pod{uid_a}/{id_a}"),
    );

    let daemon = Daemon::with_config(&config(&logs, &[("test", "direct-read", "^pgio-load$")]))
        .expect("daemon");
    lo.wait_quiet(Duration::from_secs(5));
    let expect = |ns: &str, pod: &str, c: &str| format!("{ns}/{pod}/{c}");
    for (name, cgroup, want) in [
        (
            "systemd driver",
            &systemd,
            expect("db", "reader-0", "reader"),
        ),
        (
            "cgroupfs driver",
            &cgroupfs,
            expect("web", "reader-1.x", "side-car"),
        ),
        ("odd names", &odd, expect("", "", "")),
    ] {
        let by_pod = window(&daemon, reader_in(cgroup, &dev), lo.name());
        eprintln!("{name}: cgroup {}, reads by pod {by_pod:?}", cgroup.path());
        assert_all_under(by_pod, &want, name);
    }
    assert_all_under(
        window(&daemon, fake.reader(&dev), lo.name()),
        "//",
        "a cgroup that only looks like a pod gives no pod labels",
    );
    exposition_is_valid(&daemon);

    // Pod a is deleted (log directory and cgroup); its series leave the exposition after the
    // retention, and a process in a cgroup with its UID gets no labels any more.
    let series_of_a = |m: &Metrics| {
        m.all()
            .iter()
            .filter(|s| s.labels.get("pod").is_some_and(|p| p == "reader-0"))
            .count()
    };
    let retired_before = daemon.scrape().sum("pgio_series_retired_total", &[]);
    assert!(series_of_a(&daemon.scrape()) > 0);
    logs.remove("db", "reader-0", &uid_a)
        .expect("remove pod a logs");
    systemd.remove().expect("remove pod a cgroup");
    let gone = wait_until(
        Duration::from_secs(RETENTION_SECS + 10),
        Duration::from_millis(200),
        || series_of_a(&daemon.scrape()) == 0,
    );
    assert!(
        gone,
        "pod a's series still exported {RETENTION_SECS} s after it was deleted"
    );
    let retired = daemon.scrape().sum("pgio_series_retired_total", &[]) - retired_before;
    assert!(
        retired >= 1.0,
        "pgio_series_retired_total rose by {retired}"
    );
    let again = PodCgroup::create(Driver::Systemd, &uid_a, &id_a).expect("cgroup again");
    assert_all_under(
        window(&daemon, reader_in(&again, &dev), lo.name()),
        "//",
        "a deleted pod's names are not given out again",
    );
    // A new pod's series takes the retired series' id: it starts from zero, so the retired
    // series' kernel entries were deleted, not handed on.
    let (uid_d, id_d) = ids(4);
    let pod_d = PodCgroup::create(Driver::Systemd, &uid_d, &id_d).expect("pod d cgroup");
    logs.add("db", "reader-3", &uid_d, "reader", &id_d)
        .expect("pod d");
    let mut load = reader_in(&pod_d, &dev);
    // A read made before pgio has handled its exec is untracked: wait for that (pods a to c
    // get `SETTLE` for it in `window`).
    daemon.wait_tracked_as(&[("app", "test"), ("pod", "reader-3")]);
    assert_eq!(load.expect_run(), READS);
    let pod_d_reads = [("device", lo.name()), ("op", "read"), ("pod", "reader-3")];
    let mut total = 0.0;
    wait_until(COUNTED, Duration::from_millis(100), || {
        let m = daemon.scrape();
        total = m.sum("pgio_block_io_requests_total", &pod_d_reads)
            + m.sum("pgio_block_io_lost_completions_total", &pod_d_reads);
        total >= READS as f64
    });
    assert_eq!(
        total, READS as f64,
        "pod d's series holds {total} reads (counted or lost), it did {READS}"
    );
    daemon.stop().expect("clean exit");
}

/// A cgroup outside kubepods, removed in `Drop`.
struct FakeCgroup {
    root: std::path::PathBuf,
    leaf: PodCgroup,
}

impl FakeCgroup {
    fn create(root: &Path, rel: &str) -> FakeCgroup {
        std::fs::create_dir_all(root.join(rel)).expect("fake cgroup");
        FakeCgroup {
            root: root.to_owned(),
            leaf: PodCgroup::at(&root.join(rel)),
        }
    }
    fn reader(&self, dev: &str) -> LoadProcess {
        reader_in(&self.leaf, dev)
    }
}

impl Drop for FakeCgroup {
    fn drop(&mut self) {
        let _ = self.leaf.evacuate();
        let mut dirs: Vec<_> = walk(&self.root);
        dirs.sort_by_key(|d| std::cmp::Reverse(d.components().count()));
        for d in dirs {
            let _ = std::fs::remove_dir(d);
        }
    }
}

fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = vec![dir.to_owned()];
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if e.file_type().is_ok_and(|t| t.is_dir()) {
            out.extend(walk(&e.path()));
        }
    }
    out
}

#[test]
fn a_podman_container_under_a_kubepods_cgroup_parent_carries_its_pod() {
    if !require_root("a_podman_container_under_a_kubepods_cgroup_parent_carries_its_pod") {
        return;
    }
    if Command::new("podman").arg("--version").output().is_err() {
        assert!(
            std::env::var_os("CI").is_none(),
            "podman missing (cargo xtask test installs it)"
        );
        eprintln!("skipped: podman missing (cargo xtask test installs it)");
        return;
    }
    let dir = temp_dir().expect("temp dir");
    let lo = LoopDevice::create(dir.path(), 64 << 20, true).expect("loop device");
    let logs = PodLogs::create(&dir.path().join("log")).expect("log dirs");
    let (uid, _) = ids(7);
    let dev = lo.path().to_str().expect("utf-8").to_owned();
    // The shell and the dd it becomes share their labels: reads made before pgio has handled
    // the exec still land in the pod's series.
    let script = format!("sleep 1; exec dd if={dev} of=/dev/null bs=8k count={READS} iflag=direct");
    let pod = PodmanPod::create(&uid, &["--device", &dev], &["/bin/sh", "-c", &script])
        .expect("podman create");
    logs.add("tenant-a", "dd-0", &uid, "dd", &pod.container_id)
        .expect("pod logs");
    let daemon =
        Daemon::with_config(&config(&logs, &[("podtest", "reader", "^(sh|dd)$")])).expect("daemon");
    lo.wait_quiet(Duration::from_secs(5));
    std::thread::sleep(SETTLE);
    let disk_before = pgio_testkit::diskstats(lo.name()).expect("diskstats");
    let before = daemon.scrape();
    pod.run().expect("container run");
    std::thread::sleep(SETTLE);
    let after = daemon.scrape();
    let disk_after = pgio_testkit::diskstats(lo.name()).expect("diskstats");
    let by_pod = reads_by_pod(&before, &after, lo.name(), "podtest");
    let disk = (disk_after.reads_completed - disk_before.reads_completed) as f64;
    eprintln!(
        "container {}: reads by pod {by_pod:?}, diskstats {disk}",
        pod.container_id
    );
    assert_eq!(
        by_pod.into_iter().collect::<Vec<_>>(),
        vec![("tenant-a/dd-0/dd".to_owned(), READS as f64)]
    );
    assert_eq!(
        disk, READS as f64,
        "/proc/diskstats saw the container's reads"
    );
    assert_eq!(
        delta(&before, &after, "pgio_events_dropped_total", &[]),
        0.0
    );
    daemon.stop().expect("clean exit");
}

#[test]
fn a_postgres_cluster_in_a_pod_labels_its_backends() {
    if !require_root("a_postgres_cluster_in_a_pod_labels_its_backends") {
        return;
    }
    let dir = temp_dir().expect("temp dir");
    let logs = PodLogs::create(&dir.path().join("log")).expect("log dirs");
    let (uid, id) = ids(9);
    let mut cgroup = PodCgroup::create(Driver::Systemd, &uid, &id).expect("cgroup");
    logs.add("pg", "pg-0", &uid, "postgres", &id)
        .expect("pod logs");
    let opts = PgOptions::new(PG15_BIN_DIR, dir.path().join("pgdata"), 55_446)
        .setting("autovacuum", "off");
    let mut pg = PgCluster::init_with(opts).expect("initdb");
    pg.start().expect("start");
    // The kubelet starts a container's first process in its cgroup; children inherit it.
    // Moving the running cluster in gives the same /proc/<pid>/cgroup.
    cgroup
        .enter(pg.postmaster_pid().expect("postmaster"))
        .expect("move postmaster");
    for pid in pg.child_pids().expect("children") {
        cgroup.enter(pid).expect("move child");
    }
    let daemon = Daemon::with_config(&config(&logs, &[])).expect("daemon");
    let pod = [
        ("namespace", "pg"),
        ("pod", "pg-0"),
        ("container", "postgres"),
    ];
    for role in [
        "postmaster",
        "checkpointer",
        "background writer",
        "walwriter",
    ] {
        let mut want = vec![("app", "postgres"), ("role", role)];
        want.extend(pod);
        let ok = wait_until(Duration::from_secs(10), Duration::from_millis(50), || {
            daemon.scrape().sum("pgio_tracked_processes", &want) >= 1.0
        });
        assert!(ok, "{role} not tracked with its pod labels");
    }
    let mut session = pg.session("postgres", "postgres").expect("session");
    session
        .send(
            "CREATE TABLE t AS SELECT g FROM generate_series(1, 100000) g; SELECT count(*) FROM t;",
        )
        .expect("query");
    // psql connects when it starts, not when `session` returns: wait for its backend.
    let mut activity = String::new();
    wait_until(Duration::from_secs(10), Duration::from_millis(50), || {
        activity = pg
            .psql(
                "SELECT datname || '/' || usename FROM pg_stat_activity \
                 WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()",
            )
            .expect("pg_stat_activity");
        !activity.trim().is_empty()
    });
    let (database, user) = activity.trim().split_once('/').expect("datname/usename");
    let mut want = vec![
        ("app", "postgres"),
        ("role", "client backend"),
        ("database", database),
        ("user", user),
    ];
    want.extend(pod);
    let ok = wait_until(Duration::from_secs(10), Duration::from_millis(50), || {
        daemon.scrape().sum("pgio_syscall_seconds_count", &want) >= 1.0
    });
    assert!(
        ok,
        "no syscall of the client backend under {want:?}; log:\n{}",
        daemon.0.log_text()
    );
    // Nothing of this cluster is outside its pod (other clusters on the host may be).
    let m = daemon.scrape();
    let data_dir = pg.data_dir().to_string_lossy().into_owned();
    let outside: Vec<_> = m
        .samples("pgio_tracked_processes")
        .filter(|s| {
            s.labels.get("app").is_some_and(|a| a == "postgres")
                && s.labels.get("pg_cluster").is_some_and(|c| *c == data_dir)
                && !s.labels.contains_key("pod")
                && s.value > 0.0
        })
        .map(|s| format!("{:?}", s.labels))
        .collect();
    assert!(
        outside.is_empty(),
        "postgres processes outside the pod: {outside:?}"
    );
    drop(session);
    pg.stop().expect("stop");
    logs.remove("pg", "pg-0", &uid).expect("remove logs");
    cgroup.remove().expect("remove cgroup");
    // Forked backends' provisional bookkeeping keeps the cluster's `starting` series in use
    // for its grace (late block completions fold into it: 2 s with this config's 1 s in-flight
    // timeout), then the retention runs.
    let left = || {
        daemon
            .scrape()
            .all()
            .iter()
            .filter(|s| s.labels.get("pod").is_some_and(|p| p == "pg-0"))
            .map(|s| format!("{} {:?}", s.name, s.labels))
            .collect::<Vec<_>>()
    };
    let gone = wait_until(
        Duration::from_secs(2 + RETENTION_SECS + 10),
        Duration::from_millis(500),
        || left().is_empty(),
    );
    assert!(
        gone,
        "the deleted pod's series are still exported: {:?}",
        left()
    );
    daemon.stop().expect("clean exit");
}
