//! A made-up cluster run by `nobody` (a "postmaster" named `postgres` in a data directory of
//! its own, and a child titled as a client backend whose user and database contain spaces,
//! so pgio reads the cluster's catalogs from its working directory) cannot stall pgio or make
//! it read what it points at:
//! - `global/pg_filenode.map` a FIFO: /metrics and /healthz keep answering at once, and the
//!   process is classified (names split at the first space, as without catalogs);
//! - `global/pg_filenode.map` and `global/1260` symlinks to a root-owned secret, `global`
//!   a symlink to another directory: pgio never opens the secret (inotify).
mod common;

use std::ffi::CString;
use std::os::unix::fs::{PermissionsExt, symlink};
use std::path::Path;
use std::time::{Duration, Instant};

use common::Daemon;
use pgio_testkit::{
    fake::{Fake, NOBODY, compile},
    metrics::http_get,
    require_root, temp_dir, wait_until,
};

const TITLE: &str = "postgres: u one db one [local] idle";

/// `dir` as a data directory owned by nobody: `PG_VERSION` and an empty `global/`.
fn fake_data_dir(dir: &Path) {
    std::fs::create_dir_all(dir.join("global")).expect("global");
    std::fs::write(dir.join("PG_VERSION"), "15\n").expect("PG_VERSION");
    for p in [
        dir.to_path_buf(),
        dir.join("global"),
        dir.join("PG_VERSION"),
    ] {
        std::os::unix::fs::chown(&p, Some(NOBODY), Some(NOBODY)).expect("chown");
    }
}

/// A made-up cluster run by nobody in `cwd`: a "postmaster" and one child titled as a client
/// backend whose user and database contain spaces (so pgio reads the catalogs).
fn fake_cluster(bin: &Path, cwd: &Path) -> Fake {
    let mut f = Fake::start(
        bin,
        "postgres",
        &["-D", "data", &" ".repeat(64)],
        cwd,
        &[("FAKE_CHILDREN", "1"), ("FAKE_TITLE", TITLE)],
    )
    .expect("fake cluster");
    f.wait_done(1).expect("titled");
    f
}

fn mkfifo(path: &Path) {
    let c = CString::new(path.as_os_str().as_encoded_bytes()).expect("path");
    // SAFETY: a valid C string.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0, "mkfifo");
    std::os::unix::fs::chown(path, Some(NOBODY), Some(NOBODY)).expect("chown fifo");
}

/// `rchar` of /proc/<pid>/io: bytes the process read.
fn rchar(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/io"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("rchar: ")?.trim().parse().ok())
        })
        .unwrap_or(0)
}

fn classified(daemon: &Daemon) -> bool {
    daemon.scrape().sum(
        "pgio_tracked_processes",
        &[
            ("role", "client backend"),
            ("user", "u"),
            ("database", "one db one"),
        ],
    ) >= 1.0
}

#[test]
fn a_fifo_or_symlinks_in_a_fake_data_directory_neither_stall_nor_leak() {
    if !require_root("a_fifo_or_symlinks_in_a_fake_data_directory_neither_stall_nor_leak") {
        return;
    }
    let tmp = temp_dir().expect("temp dir");
    std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let bin = compile(tmp.path(), "postgres").expect("cc");
    let daemon = Daemon::start(&[]).expect("daemon");

    // 1. A FIFO as the relation map.
    let fifo_dir = tmp.path().join("fifo");
    fake_data_dir(&fifo_dir);
    mkfifo(&fifo_dir.join("global/pg_filenode.map"));
    let fake = fake_cluster(&bin, &fifo_dir);
    let started = Instant::now();
    let mut slowest = Duration::ZERO;
    let ok = wait_until(Duration::from_secs(10), Duration::from_millis(100), || {
        for path in ["/healthz", "/metrics"] {
            let t = Instant::now();
            let answered = http_get(&format!("{}{path}", daemon.url()), Duration::from_secs(5));
            slowest = slowest.max(t.elapsed());
            assert!(answered.is_ok(), "{path}: {answered:?}");
        }
        classified(&daemon)
    });
    eprintln!(
        "FIFO: classified after {:?}, slowest answer {slowest:?}",
        started.elapsed()
    );
    assert!(ok, "the fake backend was not classified");
    assert!(
        slowest < Duration::from_secs(2),
        "an answer took {slowest:?}"
    );
    drop(fake);

    // 2. Symlinks to a secret, watched with inotify.
    let secret = tmp.path().join("secret");
    std::fs::write(&secret, vec![b's'; 64 << 10]).expect("secret");
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    let link_dir = tmp.path().join("links");
    fake_data_dir(&link_dir);
    symlink(&secret, link_dir.join("global/pg_filenode.map")).expect("symlink");
    symlink(&secret, link_dir.join("global/1260")).expect("symlink");
    let other = tmp.path().join("other");
    fake_data_dir(&other);
    std::fs::remove_dir(other.join("global")).expect("rmdir");
    symlink(link_dir.join("global"), other.join("global")).expect("symlink global");

    // SAFETY: plain syscalls on a fresh inotify fd owned by this test.
    let ino = unsafe { libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC) };
    assert!(ino >= 0, "inotify_init1");
    let path = CString::new(secret.as_os_str().as_encoded_bytes()).expect("path");
    // SAFETY: as above.
    let wd =
        unsafe { libc::inotify_add_watch(ino, path.as_ptr(), libc::IN_OPEN | libc::IN_ACCESS) };
    assert!(wd >= 0, "inotify_add_watch");
    let read_before = rchar(daemon.0.pid());
    let fakes = [fake_cluster(&bin, &link_dir), fake_cluster(&bin, &other)];
    let ok = wait_until(Duration::from_secs(10), Duration::from_millis(100), || {
        daemon.scrape().sum(
            "pgio_tracked_processes",
            &[
                ("role", "client backend"),
                ("user", "u"),
                ("database", "one db one"),
            ],
        ) >= 2.0
    });
    assert!(ok, "the two fake backends were not classified");
    let mut buf = [0u8; 4096];
    // SAFETY: reading into a local buffer from our own fd.
    let n = unsafe { libc::read(ino, buf.as_mut_ptr().cast(), buf.len()) };
    // SAFETY: our own fd.
    unsafe { libc::close(ino) };
    let read = rchar(daemon.0.pid()) - read_before;
    eprintln!("symlinks: inotify events {n} bytes (-1 = none), pgio read {read} bytes meanwhile");
    assert!(n <= 0, "pgio opened or read the secret through a symlink");
    drop(fakes);
    daemon.stop().expect("daemon stop");
}
