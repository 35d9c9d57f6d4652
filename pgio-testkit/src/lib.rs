//! Real-kernel fixtures for pgio's integration tests: loop devices, ext4 mounts,
//! /proc/diskstats, PostgreSQL clusters (15 from Debian, 16 to 18 downloaded by `pgdist`),
//! the `pgio-load` load generator and a Prometheus scrape helper. Every fixture cleans up in `Drop`, also when a test panics.
//!
//! Drop order matters for stacked fixtures: declare them in creation order
//! (`TempDir`, `LoopDevice`, `Ext4Mount`, `PgCluster`) so they are torn down in reverse.

mod cmd;
pub mod cpu_hogs;
pub mod daemon;
pub mod daemonset;
pub mod devmapper;
pub mod diskstats;
pub mod ext4;
pub mod fake;
pub mod fio;
pub mod iscsi;
pub mod kubepods;
pub mod load;
pub mod longhorn;
pub mod loopdev;
pub mod metrics;
pub mod monotonic;
pub mod pgdist;
pub mod podman;
pub mod postgres;
pub mod process;
pub mod prometheus;
pub mod promtool;
pub mod soak;

use std::time::{Duration, Instant};

pub use cmd::on_path;
pub use cpu_hogs::CpuHogs;
pub use daemon::{Daemon, rules_config};
pub use diskstats::{DiskStats, diskstats};
pub use ext4::Ext4Mount;
pub use load::{LoadProcess, pgio_load_bin};
pub use longhorn::{EngineStats, LonghornOptions, LonghornVolume, ReplicaStats};
pub use loopdev::{LoopDevice, QueueKnobs};
pub use metrics::{Metrics, Sample, scrape};
pub use monotonic::{Monotonic, MonotonicWatch, WatchReport};
pub use pgdist::pg_bin_dir;
pub use postgres::{PG15_BIN_DIR, PgCluster, PgOptions, PsqlSession};
pub use process::{pid_alive, processes_with_cmdline_containing, processes_with_parent};
pub use prometheus::{PromSample, Prometheus, prometheus_bin};
pub use promtool::{check_metrics, promtool};
/// For tests that read JSON (Grafana dashboards) without depending on it themselves.
pub use serde_json;
pub use serde_yaml_ng;
pub use tempfile::TempDir;

/// Env var that turns "skip without root" into a test failure (for CI running as root).
pub const REQUIRE_ROOT_ENV: &str = "PGIO_REQUIRE_ROOT_TESTS";

/// Env var `cargo xtask integration` sets in its guests (to `tcg`): the machine is emulated,
/// ~16× slower than the host, so bars on absolute latencies of a userspace IO path do not hold
/// there (counts and attribution still do).
pub const EMULATED_ENV: &str = "PGIO_TEST_EMULATED";

/// The emulator named by `PGIO_TEST_EMULATED`, when the tests run in one.
pub fn emulated() -> Option<String> {
    std::env::var(EMULATED_ENV).ok().filter(|v| !v.is_empty())
}

/// The running kernel's (major, minor) from `/proc/sys/kernel/osrelease`; (0, 0) if unreadable.
pub fn kernel_version() -> (u32, u32) {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mut v = release
        .trim()
        .split(|c: char| !c.is_ascii_digit())
        .map(|n| n.parse().unwrap_or(0));
    (v.next().unwrap_or(0), v.next().unwrap_or(0))
}

/// True if the test may run (effective uid 0). Otherwise panics when
/// `PGIO_REQUIRE_ROOT_TESTS` is set, or prints a skip reason and returns false.
pub fn require_root(test_name: &str) -> bool {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        return true;
    }
    if std::env::var_os(REQUIRE_ROOT_ENV).is_some() {
        panic!(
            "{test_name}: needs root for eBPF and loop devices, but {REQUIRE_ROOT_ENV} is set and euid != 0"
        );
    }
    eprintln!(
        "{test_name}: skipped: needs root for eBPF and loop devices (set {REQUIRE_ROOT_ENV} to fail instead)"
    );
    false
}

/// Drops a file's pages from the page cache (`POSIX_FADV_DONTNEED`), its dirty ones written
/// back first (a dirty page stays): its next reads go to the device.
pub fn drop_page_cache(path: &std::path::Path) -> anyhow::Result<()> {
    use anyhow::Context;
    use std::os::fd::AsRawFd;
    let f = std::fs::File::open(path).with_context(|| format!("open {}", path.display()))?;
    f.sync_all()
        .with_context(|| format!("fsync {}", path.display()))?;
    // SAFETY: a valid fd for the call.
    let rc = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    if rc != 0 {
        anyhow::bail!(
            "posix_fadvise {}: {}",
            path.display(),
            std::io::Error::from_raw_os_error(rc)
        );
    }
    Ok(())
}

/// A fresh temporary directory with mode 0755, so that other users (the `postgres`
/// OS user) can traverse it to reach data and socket directories below it.
pub fn temp_dir() -> anyhow::Result<TempDir> {
    use anyhow::Context;
    use std::os::unix::fs::PermissionsExt;
    tempfile::Builder::new()
        .prefix("pgio-test-")
        .permissions(std::fs::Permissions::from_mode(0o755))
        .tempdir()
        .context("creating temp dir")
}

/// Polls `cond` every `poll_interval` until it returns true (-> true) or `timeout`
/// elapses (-> false). `cond` is always evaluated at least once, and once more at the deadline.
pub fn wait_until(
    timeout: Duration,
    poll_interval: Duration,
    mut cond: impl FnMut() -> bool,
) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if cond() {
            return true;
        }
        let now = Instant::now();
        if now >= deadline {
            return false;
        }
        std::thread::sleep(poll_interval.min(deadline - now));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wait_until_succeeds_and_times_out() {
        let mut n = 0;
        assert!(wait_until(
            Duration::from_secs(5),
            Duration::from_millis(1),
            || {
                n += 1;
                n == 3
            }
        ));
        let t = Instant::now();
        assert!(!wait_until(
            Duration::from_millis(30),
            Duration::from_millis(5),
            || false
        ));
        assert!(t.elapsed() >= Duration::from_millis(30));
    }

    #[test]
    fn temp_dir_is_traversable() {
        use std::os::unix::fs::PermissionsExt;
        let d = temp_dir().unwrap();
        let mode = std::fs::metadata(d.path()).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o755);
    }
}
