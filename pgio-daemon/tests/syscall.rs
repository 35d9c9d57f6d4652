//! Test b: a process doing exactly N pread64 and M preadv calls is counted exactly.
mod common;

use common::{Daemon, delta};
use pgio_testkit::{LoadProcess, pgio_load_bin, require_root, temp_dir};

const PREAD64: u64 = 5_000;
const PREADV: u64 = 3_000;

/// A rule booking the `pgio-load` runs whose command line matches `cmdline` as `app="test"`.
fn rule(role: &str, cmdline: &str) -> String {
    format!(
        "[[rule]]\napp = \"test\"\nrole = \"{role}\"\ncomm = \"^pgio-load$\"\ncmdline = \"{cmdline}\"\n"
    )
}

#[test]
fn exact_pread64_and_preadv_counts() {
    if !require_root("exact_pread64_and_preadv_counts") {
        return;
    }
    let dir = temp_dir().expect("temp dir");
    let file = dir.path().join("data");
    std::fs::write(&file, vec![7u8; 1 << 20]).expect("data file");
    // Its own file in the rule: the other test of this binary runs `pgio-load` at once.
    let daemon =
        Daemon::with_config(&rule("pread", &format!("{} ", file.display()))).expect("daemon");
    let path = file.to_str().expect("utf-8").to_owned();
    let mut load = LoadProcess::spawn(
        &pgio_load_bin().expect("pgio-load"),
        ["pread", &path, &PREAD64.to_string(), &PREADV.to_string()],
    )
    .expect("spawn");
    daemon.wait_tracked("test", "pread");
    let before = daemon.scrape();
    assert_eq!(load.expect_run(), PREAD64 + PREADV);
    let after = daemon.scrape();
    let count = |syscall: &str| {
        delta(
            &before,
            &after,
            "pgio_syscall_seconds_count",
            &[("app", "test"), ("role", "pread"), ("syscall", syscall)],
        )
    };
    eprintln!(
        "pid {}: pread64 {}, preadv {}, preadv2 {}",
        load.pid(),
        count("pread64"),
        count("preadv"),
        count("preadv2")
    );
    assert_eq!(count("pread64"), PREAD64 as f64);
    assert_eq!(count("preadv"), PREADV as f64);
    assert_eq!(count("preadv2"), 0.0);
    // The file was just written: every read is served from the page cache.
    let hits = delta(
        &before,
        &after,
        "pgio_syscall_seconds_count",
        &[("app", "test"), ("role", "pread"), ("cache", "hit")],
    );
    assert_eq!(
        hits,
        (PREAD64 + PREADV) as f64,
        "cache=hit for page-cache reads"
    );
    daemon.stop().expect("clean daemon exit");
}

/// The syscall programs learn who runs on a CPU from `sched_switch`, and a call's start waits
/// in its CPU's slot until the thread is switched out. Two tracked readers, an untracked
/// reader, a tracked futex waker (wakes are not timed, but open the slot) and a tracked
/// futex waiter (every wait is switched out mid-call) share one CPU, so the scheduler moves
/// between them thousands of times while they run: each tracked reader's calls are counted
/// exactly, the waker's none, the waiter's all, and nothing else lands on their series.
#[test]
fn exact_counts_for_processes_sharing_one_cpu() {
    if !require_root("exact_counts_for_processes_sharing_one_cpu") {
        return;
    }
    const READS: u64 = 100_000;
    const WAKES: u64 = 200_000;
    const WAITS: u64 = 200;
    let dir = temp_dir().expect("temp dir");
    let (tracked, untracked) = (dir.path().join("tracked"), dir.path().join("untracked"));
    for f in [&tracked, &untracked] {
        std::fs::write(f, vec![7u8; 1 << 20]).expect("data file");
    }
    let daemon = Daemon::with_config(&format!(
        "{}{}{}",
        rule("reader", &format!("{} ", tracked.display())),
        rule("waker", "futex-wake"),
        rule("waiter", "futex-wait")
    ))
    .expect("daemon");
    let bin = pgio_load_bin().expect("pgio-load");
    let path = |p: &std::path::Path| p.to_str().expect("utf-8").to_owned();
    let mut loads = vec![
        LoadProcess::spawn(&bin, ["pread", &path(&tracked), &READS.to_string(), "0"]),
        LoadProcess::spawn(&bin, ["pread", &path(&tracked), &READS.to_string(), "0"]),
        LoadProcess::spawn(&bin, ["pread", &path(&untracked), &READS.to_string(), "0"]),
        LoadProcess::spawn(&bin, ["futex-wake", &WAKES.to_string()]),
        LoadProcess::spawn(&bin, ["futex-wait", &WAITS.to_string(), "1"]),
    ]
    .into_iter()
    .collect::<anyhow::Result<Vec<_>>>()
    .expect("spawn");
    for l in &loads {
        let pinned = std::process::Command::new("taskset")
            .args(["-cp", "0", &l.pid().to_string()])
            .output()
            .expect("taskset");
        assert!(pinned.status.success(), "taskset: {pinned:?}");
    }
    for role in ["reader", "waker", "waiter"] {
        daemon.wait_tracked("test", role);
    }
    let pids: Vec<u32> = loads.iter().map(LoadProcess::pid).collect();
    let switches = || -> u64 {
        pids.iter()
            .filter_map(|pid| {
                let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
                let n = s
                    .lines()
                    .filter(|l| l.contains("ctxt_switches"))
                    .filter_map(|l| l.split_whitespace().last()?.parse::<u64>().ok())
                    .sum::<u64>();
                Some(n)
            })
            .sum()
    };
    let before = daemon.scrape();
    let switches_before = switches();
    for l in &mut loads {
        l.go().expect("go");
    }
    // The waiter sleeps 200 × 1 ms and ends last: the others' switches are counted by then.
    let mut done = Vec::new();
    for l in loads.iter_mut().take(4) {
        done.push(l.wait_done().expect("load"));
    }
    let switched = switches().saturating_sub(switches_before);
    done.push(loads[4].wait_done().expect("waiter"));
    assert_eq!(done, [READS, READS, READS, WAKES, WAITS]);
    let after = daemon.scrape();
    // Calls of `role` in the syscall family (`syscall` = "": all of them), or its futex waits.
    let count = |family: &str, role: &str, syscall: &str| {
        let mut labels = vec![("app", "test"), ("role", role)];
        if !syscall.is_empty() {
            labels.push(("syscall", syscall));
        }
        delta(
            &before,
            &after,
            &format!("pgio_{family}_seconds_count"),
            &labels,
        )
    };
    let (total, futex) = (|r| count("syscall", r, ""), |r| count("futex_wait", r, ""));
    eprintln!(
        "{switched} context switches of the loads while they ran; reader pread64 {} (of {}), \
         waker futex {}, waiter futex {}",
        count("syscall", "reader", "pread64"),
        2 * READS,
        futex("waker"),
        futex("waiter")
    );
    assert!(
        switched >= 100,
        "the loads shared the CPU: {switched} switches"
    );
    assert_eq!(count("syscall", "reader", "pread64"), (2 * READS) as f64);
    assert_eq!(total("reader"), (2 * READS) as f64);
    assert_eq!(futex("reader") + total("waker") + futex("waker"), 0.0);
    assert_eq!(futex("waiter"), WAITS as f64);
    assert_eq!(total("waiter"), 0.0);
    daemon.stop().expect("clean daemon exit");
}
