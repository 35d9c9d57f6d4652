//! A tiny C program standing in for a postgres binary (`fake_postgres.c`): it exports
//! `init_ps_display`, so pgio attaches its title uretprobe to it when it runs as a
//! postmaster (comm `postgres`, its parent not postgres, in a directory holding
//! `PG_VERSION`). Built once per test with the system's C compiler.
#![allow(dead_code)]

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;

use pgio_testkit::Metrics;

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
    .filter(|s| !s.labels.contains_key("cluster"))
    .map(|s| s.value)
    .sum()
}
