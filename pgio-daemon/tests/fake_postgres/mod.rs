//! A tiny C program standing in for a postgres binary (`fake_postgres.c`): it exports
//! `init_ps_display`, so pgio attaches its title uretprobe to it when it runs as a
//! postmaster (comm `postgres`, its parent not postgres, in a directory holding
//! `PG_VERSION`). Built once per test with the system's C compiler.
#![allow(dead_code)]

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use pgio_testkit::{Metrics, wait_until};

use crate::common::Daemon;

pub const NOBODY: u32 = 65_534;

/// Compiles the program to `out` (mode 0755).
pub fn build(out: &Path) {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fake_postgres/fake_postgres.c");
    let status = Command::new("cc")
        .args(["-O2", "-o"])
        .arg(out)
        .arg(&src)
        .status()
        .expect("running cc");
    assert!(status.success(), "cc {} failed", src.display());
    std::fs::set_permissions(out, std::fs::Permissions::from_mode(0o755)).expect("chmod");
}

/// The program built in `tmp`, a data directory `tmp/data` owned by nobody, and the program
/// copied as a `postgres` binary owned by nobody: (fake, data directory, postgres).
pub fn setup(tmp: &Path) -> (PathBuf, PathBuf, PathBuf) {
    let fake = tmp.join("fake");
    build(&fake);
    let data = tmp.join("data");
    data_dir(&data);
    let postgres = copy_as(&fake, &tmp.join("pg"), "postgres", NOBODY);
    (fake, data, postgres)
}

/// `postgres args…` run by nobody in `data` (stdin and stdout piped), once `daemon` tracks it
/// as a postmaster; killed, and the test failed, if it does not within 10 s.
pub fn start_postmaster(daemon: &Daemon, postgres: &Path, args: &[&str], data: &Path) -> Child {
    let mut postmaster = Command::new(postgres)
        .args(args)
        .current_dir(data)
        .uid(NOBODY)
        .gid(NOBODY)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("fake postmaster");
    let tracked = wait_until(Duration::from_secs(10), Duration::from_millis(100), || {
        fake_postmasters(&daemon.scrape()) >= 1.0
    });
    if !tracked {
        let _ = postmaster.kill();
        let _ = postmaster.wait();
        panic!("the fake postmaster was not tracked");
    }
    postmaster
}

/// `dir` as a data directory owned by nobody: `PG_VERSION` in it.
pub fn data_dir(dir: &Path) {
    std::fs::create_dir_all(dir).expect("data dir");
    std::fs::write(dir.join("PG_VERSION"), "15\n").expect("PG_VERSION");
    for p in [dir.to_path_buf(), dir.join("PG_VERSION")] {
        std::os::unix::fs::chown(&p, Some(NOBODY), Some(NOBODY)).expect("chown");
    }
}

/// A copy of `fake` as `<dir>/<name>` (its own inode, so its own binary to pgio), owned by
/// `uid`, in a directory anyone may enter.
pub fn copy_as(fake: &Path, dir: &Path, name: &str, uid: u32) -> std::path::PathBuf {
    std::fs::create_dir_all(dir).expect("dir");
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let bin = dir.join(name);
    std::fs::copy(fake, &bin).expect("copy");
    std::os::unix::fs::chown(&bin, Some(uid), Some(uid)).expect("chown");
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    bin
}

/// Open fds of process `pid`.
pub fn fd_count(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

/// Postmasters without a cluster label: ours (no auxiliary process ever named their cluster),
/// not those of real servers other tests may run.
pub fn fake_postmasters(m: &Metrics) -> f64 {
    m.matching(
        "pgio_tracked_processes",
        &[("app", "postgres"), ("role", "postmaster")],
    )
    .filter(|s| !s.labels.contains_key("pg_cluster"))
    .map(|s| s.value)
    .sum()
}
