//! Queue blame against known answers (issue 48). A direct-IO loop device with mq-deadline (a
//! real disk's queue: 128 driver tags, 256 scheduler tags), fio as the load, each job under a
//! copy of fio's binary with its own name so that each is its own series:
//! - a reader alone: its whole queue time is blamed on itself;
//! - the reader beside a writer that keeps 256 writes queued: the reader waits for a tag a
//!   writer's completion frees, so at least 90 % is blamed on the writer;
//! - the reader beside two writers keeping 192 and 64 writes queued: their blame splits 3:1
//!   (±10 %), as their shares of the device do.
//!
//! In each, the blame summed over culprits equals the reader's queue time to the nanosecond.
//!
//! And PostgreSQL 15's client backends as victims: `pgbench -S` on a cold cache in database
//! `shop` while a neighbour (fio under its own name, direct writes to a file on the same ext4)
//! floods the device: their queue time is blamed on the neighbour, by database.
mod common;

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::Duration,
};

use common::Daemon;
use pgio_testkit::{
    Ext4Mount, LoopDevice, Metrics, PgCluster, PgOptions, emulated, fio, pg_bin_dir, require_root,
    temp_dir,
};

const BLAME: &str = "pgio_block_io_queue_blame_seconds_total";

/// One test at a time: each daemon sees every device's IO, and a loop device's number (and
/// its kernel clock) is reused by the next one attached.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Gives `dev` mq-deadline; `false` when its driver takes no I/O scheduler (the loop driver
/// before Linux 5.14 or so ignores the write): none of its requests then waits in a queue.
fn mq_deadline(dev: &str) -> bool {
    let sched = format!("/sys/block/{dev}/queue/scheduler");
    std::fs::write(&sched, "mq-deadline").unwrap_or_else(|e| panic!("{sched}: {e}"));
    let now = std::fs::read_to_string(&sched).unwrap_or_else(|e| panic!("{sched}: {e}"));
    if now.contains("[mq-deadline]") {
        return true;
    }
    eprintln!(
        "skipped: {dev} keeps scheduler {:?} on this kernel: its requests are issued without \
         waiting in a queue, so there is no queue time to blame",
        now.trim()
    );
    false
}

/// fio's binary copied to `<dir>/<name>`: its processes' comm is `name`.
fn fio_as(dir: &Path, name: &str) -> PathBuf {
    let to = dir.join(name);
    std::fs::copy(fio::fio_bin().expect("fio"), &to).expect("copy fio");
    to
}

/// A fio job on `dev` for `secs`: `rw` in `bs` blocks, `iodepth` in flight (libaio).
fn fio_job(bin: &Path, dev: &Path, rw: &str, bs: &str, iodepth: u32, secs: u32) -> Command {
    let mut c = Command::new(bin);
    c.arg("--name=blame")
        .arg(format!("--filename={}", dev.display()))
        .args(["--direct=1", "--time_based", "--ioengine=libaio"])
        .arg(format!("--rw={rw}"))
        .arg(format!("--bs={bs}"))
        .arg(format!("--iodepth={iodepth}"))
        .arg(format!("--runtime={secs}s"))
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    c
}

/// Background jobs, ended (by their PIDs) and reaped also when the test fails.
struct Jobs(Vec<Child>);

impl Drop for Jobs {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Jobs {
    fn wait(mut self) {
        for c in &mut self.0 {
            let _ = c.wait();
        }
    }
}

/// ns of a scraped seconds value (exact for the integers the daemon divides by 1e9).
fn ns(seconds: f64) -> u64 {
    (seconds * 1e9).round() as u64
}

/// The reader's blame on `dev` by culprit app (ns), its queue time (ns), and its requests whose
/// completion pgio missed (blamed at their issue, no queue time: the kernel skips a program
/// now and then, see README).
fn blame_of(m: &Metrics, reader: &str, dev: &str) -> (BTreeMap<String, u64>, u64, f64) {
    let victim = [("app", reader), ("device", dev), ("op", "read")];
    let mut by = BTreeMap::new();
    for s in m.matching(BLAME, &victim) {
        let culprit = s.labels.get("culprit_app").cloned().unwrap_or_default();
        *by.entry(culprit).or_insert(0) += ns(s.value);
    }
    let queue = ns(m.sum("pgio_block_io_queue_seconds_sum", &victim));
    let lost = m.sum("pgio_block_io_lost_completions_total", &victim).abs();
    (by, queue, lost)
}

/// The blame sums to the queue time: exactly, or, with completions lost, to more.
fn sums_to(by: &BTreeMap<String, u64>, queue: u64, lost: f64) -> bool {
    let sum = by.values().sum::<u64>();
    queue > 0 && (sum == queue || (lost > 0.0 && sum > queue))
}

#[test]
fn queue_time_is_blamed_on_whose_requests_the_device_served() {
    if !require_root("queue_blame") {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = temp_dir().expect("temp dir");
    let lo = LoopDevice::create_written(dir.path(), 512 << 20, true).expect("loop device");
    if !mq_deadline(lo.name()) {
        lo.detach().expect("detach");
        return;
    }
    let crowd: Vec<String> = (0..12).map(|i| format!("qb-crowd{i}")).collect();
    let mut names = vec![
        "qb-alone",
        "qb-reader",
        "qb-reader2",
        "qb-reader3",
        "qb-writer",
    ];
    names.extend(["qb-big", "qb-small"]);
    names.extend(crowd.iter().map(String::as_str));
    let bins: BTreeMap<&str, PathBuf> = names.iter().map(|n| (*n, fio_as(dir.path(), n))).collect();
    let rules: Vec<(&str, &str, &str)> = names.iter().map(|n| (*n, "job", *n)).collect();
    let config: String = rules
        .iter()
        .map(|(app, role, comm)| {
            format!("[[rule]]\napp = \"{app}\"\nrole = \"{role}\"\ncomm = \"^{comm}$\"\n")
        })
        .collect();
    let daemon = Daemon::with_config(&config).expect("daemon");
    // Queue blame rides them: a program the verifier refused would leave it silent.
    // (`block_io_start` is 6.5's: before it the wait starts at the insert.)
    let m = daemon.scrape();
    for p in ["block_rq_insert", "block_rq_issue", "block_rq_complete"] {
        let attached = m.sum("pgio_probe_attached", &[("program", p)]);
        assert_eq!(attached, 1.0, "{p} attached:\n{}", daemon.0.log_text());
    }
    lo.wait_quiet(Duration::from_secs(5));
    let (dev, path) = (lo.name().to_owned(), lo.path().to_owned());
    // A reader (4 KiB, one at a time, 4 s) and writers (64 KiB, `iodepth` in flight, 6 s).
    let read_on = |path: &Path, name: &str| {
        let mut c = fio_job(&bins[name], path, "randread", "4k", 1, 4);
        c.status().expect("reader");
    };
    let spawn_on = |path: &Path, name: &str, iodepth: u32| {
        fio_job(&bins[name], path, "randwrite", "64k", iodepth, 6)
            .spawn()
            .expect("writer")
    };
    let read = |name: &str| read_on(&path, name);
    let spawn = |name: &str, iodepth: u32| spawn_on(&path, name, iodepth);
    let mut failures = Vec::new();
    let mut check = |ok: bool, what: String| {
        eprintln!("{}{what}", if ok { "" } else { "FAILED: " });
        if !ok {
            failures.push(what);
        }
    };

    // 1. Alone: its own.
    read("qb-alone");
    std::thread::sleep(Duration::from_secs(1));
    let m = daemon.scrape();
    let (by, queue, lost) = blame_of(&m, "qb-alone", &dev);
    check(
        by.keys().all(|k| k == "qb-alone") && sums_to(&by, queue, lost) && queue > 0,
        format!("alone: blame {by:?}, queue time {queue} ns ({lost} lost): all its own"),
    );

    // 2. Behind one writer.
    let writer = Jobs(vec![spawn("qb-writer", 256)]);
    std::thread::sleep(Duration::from_millis(1500));
    read("qb-reader");
    writer.wait();
    std::thread::sleep(Duration::from_secs(1));
    let m = daemon.scrape();
    let (by, queue, lost) = blame_of(&m, "qb-reader", &dev);
    let on_writer = by.get("qb-writer").copied().unwrap_or(0);
    check(
        sums_to(&by, queue, lost),
        format!("one writer: blame {by:?} sums to the queue time {queue} ns ({lost} lost)"),
    );
    // In an emulated guest (TCG) the emulated CPU, not the device's tags, holds requests back
    // (measured on 6.1: 73 % on the writer, the rest waits during which nothing completed,
    // the reader's own by the rule; 2.21 : 1 for the writers below): there the writer need
    // only be ahead, and the big writer ahead of the small one.
    let (share, ratios) = if emulated().is_some() {
        (0.5, 1.2..=4.0)
    } else {
        (0.9, 2.7..=3.3)
    };
    check(
        on_writer as f64 >= share * queue as f64 && queue > 0,
        format!(
            "one writer: {:.1} % blamed on it",
            100.0 * on_writer as f64 / queue.max(1) as f64
        ),
    );

    // 3. Behind two writers, 3:1.
    let writers = Jobs(vec![spawn("qb-big", 192), spawn("qb-small", 64)]);
    std::thread::sleep(Duration::from_millis(1500));
    read("qb-reader2");
    writers.wait();
    std::thread::sleep(Duration::from_secs(1));
    let m = daemon.scrape();
    let (by, queue, lost) = blame_of(&m, "qb-reader2", &dev);
    let (big, small) = (by.get("qb-big").copied(), by.get("qb-small").copied());
    let ratio = big.unwrap_or(0) as f64 / small.unwrap_or(0).max(1) as f64;
    check(
        sums_to(&by, queue, lost),
        format!("two writers: blame {by:?} sums to the queue time {queue} ns ({lost} lost)"),
    );
    check(
        ratios.contains(&ratio),
        format!("two writers: big / small = {ratio:.2}, in {ratios:?}"),
    );

    // 4. On a device of its own (a new clock, no owners yet), a crowd of twelve writers, each
    // its own series, and a shell forking a `dd` per request: at most seven culprits of the
    // device have names of their own (in 6 s no owner is idle long enough to give its slot up).
    let lo2 = LoopDevice::create_written(dir.path(), 256 << 20, true).expect("loop device");
    assert!(mq_deadline(lo2.name()), "{} took no scheduler", lo2.name());
    let (dev, path) = (lo2.name().to_owned(), lo2.path().to_owned());
    let read = |name: &str| read_on(&path, name);
    let spawn = |name: &str, iodepth: u32| spawn_on(&path, name, iodepth);
    let mut jobs: Vec<Child> = crowd.iter().map(|n| spawn(n, 16)).collect();
    let forks = format!(
        "for i in $(seq 300); do dd if=/dev/zero of={} bs=64k count=1 seek=$((i % 64)) \
         oflag=direct status=none; done",
        path.display()
    );
    jobs.push(
        Command::new("sh")
            .args(["-c", &forks])
            .spawn()
            .expect("fork per request"),
    );
    let crowd_jobs = Jobs(jobs);
    let before = daemon.scrape();
    std::thread::sleep(Duration::from_millis(1500));
    read("qb-reader3");
    crowd_jobs.wait();
    std::thread::sleep(Duration::from_secs(1));
    let m = daemon.scrape();
    let (by, queue, lost) = blame_of(&m, "qb-reader3", &dev);
    check(
        sums_to(&by, queue, lost),
        format!("crowd: the reader's blame {by:?} sums to its queue time {queue} ns ({lost} lost)"),
    );
    // Over every victim on the device, the culprits other than the victim itself that were
    // blamed during the crowd's run.
    let mut named = std::collections::BTreeSet::new();
    for s in m.matching(BLAME, &[("device", dev.as_str())]) {
        let culprit = s.labels.get("culprit_app").cloned().unwrap_or_default();
        let was = before
            .all()
            .iter()
            .find(|b| b.name == s.name && b.labels == s.labels)
            .map_or(0.0, |b| b.value);
        if s.value > was && s.labels.get("app") != Some(&culprit) && culprit != "(rest)" {
            named.insert(culprit);
        }
    }
    check(
        named.len() <= 7,
        format!(
            "crowd: {} named culprits on {dev} (at most 7): {named:?}",
            named.len()
        ),
    );
    daemon.stop().expect("daemon stop");
    lo.detach().expect("detach");
    lo2.detach().expect("detach");
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn pg15_client_backends_waits_are_blamed_on_the_neighbour_flooding_their_disk() {
    if !require_root("queue_blame pg15") {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let bin = pg_bin_dir(15).expect("PostgreSQL 15");
    let dir = temp_dir().expect("temp dir");
    let lo = LoopDevice::create(dir.path(), 1 << 30, true).expect("loop device");
    if !mq_deadline(lo.name()) {
        lo.detach().expect("detach");
        return;
    }
    let mut fs = Ext4Mount::new(&lo, &dir.path().join("mnt")).expect("ext4");
    let opts = PgOptions::new(&bin, fs.path().join("pgdata"), 55_470)
        .shared_buffers("16MB")
        .setting("autovacuum", "off");
    let mut pg = PgCluster::init_with(opts).expect("initdb");
    pg.start().expect("start");
    pg.psql("create database shop").expect("create database");
    pg.pgbench_ok(&["-i", "-q", "-s", "10", "shop"])
        .expect("pgbench -i");
    pg.psql("checkpoint").expect("checkpoint");
    pg.stop().expect("stop");
    fs.remount().expect("remount: a cold page cache");
    let etl = fio_as(dir.path(), "qb-etl");
    let fill = fs.path().join("fill");
    let daemon =
        Daemon::with_config("[[rule]]\napp = \"qb-etl\"\nrole = \"batch\"\ncomm = \"^qb-etl$\"\n")
            .expect("daemon");
    pg.start().expect("start cold");
    daemon.wait_tracked("postgres", "postmaster");
    let mut neighbour = fio_job(&etl, &fill, "randwrite", "64k", 256, 12);
    neighbour.arg("--size=256m");
    let writer = Jobs(vec![neighbour.spawn().expect("neighbour")]);
    std::thread::sleep(Duration::from_secs(3));
    pg.pgbench_ok(&["-S", "-c", "4", "-j", "2", "-T", "6", "shop"])
        .expect("pgbench -S");
    writer.wait();
    std::thread::sleep(Duration::from_secs(1));
    let m = daemon.scrape();
    // For the README's excerpt: PGIO_DUMP_METRICS=<file> keeps this run's /metrics.
    if let Some(path) = std::env::var_os("PGIO_DUMP_METRICS") {
        let text = pgio_testkit::metrics::http_get(
            &format!("{}/metrics", daemon.url()),
            Duration::from_secs(10),
        );
        std::fs::write(path, text.expect("metrics")).expect("dump metrics");
    }
    let victim = [
        ("app", "postgres"),
        ("role", "client backend"),
        ("database", "shop"),
        ("device", lo.name()),
        ("op", "read"),
    ];
    let mut by: BTreeMap<String, u64> = BTreeMap::new();
    for s in m.matching(BLAME, &victim) {
        let l = |n: &str| s.labels.get(n).cloned().unwrap_or_default();
        let culprit = format!(
            "{}/{}/{}",
            l("culprit_app"),
            l("culprit_role"),
            l("culprit_database")
        );
        *by.entry(culprit).or_insert(0) += ns(s.value);
    }
    let queue = ns(m.sum("pgio_block_io_queue_seconds_sum", &victim));
    let lost = m.sum("pgio_block_io_lost_completions_total", &victim).abs();
    let on_etl = by.get("qb-etl/batch/").copied().unwrap_or(0);
    eprintln!(
        "shop's client backends: queue time {queue} ns ({lost} lost), blamed {by:?}: {:.1} % on \
         the neighbour",
        100.0 * on_etl as f64 / queue.max(1) as f64
    );
    if queue == 0 {
        // Whose queue time there was on the device, to tell why none was the backends'.
        for s in m.matching("pgio_block_io_queue_seconds_sum", &[("device", lo.name())]) {
            eprintln!("  {:?} {}", s.labels, s.value);
        }
    }
    daemon.stop().expect("daemon stop");
    pg.stop().expect("stop");
    drop(fs);
    lo.detach().expect("detach");
    assert!(sums_to(&by, queue, lost), "{by:?} vs {queue} ns");
    assert!(
        on_etl as f64 >= 0.8 * queue as f64,
        "{:.1} % on the neighbour",
        100.0 * on_etl as f64 / queue.max(1) as f64
    );
}
