//! A device-mapper `delay` target over a block device the test owns: a bio-based disk
//! (`/dev/dm-N`, no request queue of its own) that holds every bio for a fixed time before
//! passing it to the disk below. Needs the `dm_delay` module, which not every kernel here has
//! (the CI host has no modules; the `cargo xtask integration` guests do): `unavailable` says
//! why not. Drop removes the mapping.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};

use anyhow::{Context, Result, bail};

use crate::cmd;

/// Env var `cargo xtask integration` sets in its guests: a whole virtio disk nothing else uses,
/// for tests that need a disk below a stacked device.
pub const SPARE_DISK_ENV: &str = "PGIO_TEST_SPARE_DISK";

/// The spare disk the guest has, if any.
pub fn spare_disk() -> Option<PathBuf> {
    std::env::var_os(SPARE_DISK_ENV)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

/// Why a dm-delay device cannot be made on this machine, or None when it can.
pub fn unavailable() -> Option<String> {
    if !cmd::on_path("dmsetup") {
        return Some("dmsetup not installed (Debian: dmsetup)".to_owned());
    }
    if !cmd::module_available("dm_delay") {
        return Some("no dm_delay kernel module".to_owned());
    }
    if !Path::new("/dev/mapper/control").exists() {
        return Some("no /dev/mapper/control".to_owned());
    }
    None
}

/// `dmsetup create <name>` with a `delay` table over `below`.
pub struct DelayDevice {
    name: String,
    /// `dm-N`, as /proc/diskstats and pgio's `device` label name it.
    kernel_name: String,
    path: PathBuf,
}

impl DelayDevice {
    /// Reads of the whole of `below` delayed by `read_ms`, writes by `write_ms`.
    pub fn create(below: &Path, read_ms: u32, write_ms: u32) -> Result<Self> {
        let sectors = cmd::run(Command::new("blockdev").arg("--getsz").arg(below))?;
        let sectors: u64 = sectors
            .trim()
            .parse()
            .with_context(|| format!("blockdev --getsz {}: {sectors:?}", below.display()))?;
        static SEQ: AtomicU32 = AtomicU32::new(0);
        let name = format!(
            "pgio-test-delay-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        );
        let b = below.display();
        let table = format!("0 {sectors} delay {b} 0 {read_ms} {b} 0 {write_ms}");
        // No udev in the guests (nor on every host): dmsetup makes the node itself.
        cmd::run(Command::new("dmsetup").env("DM_DISABLE_UDEV", "1").args([
            "create",
            "--noudevsync",
            &name,
            "--table",
            &table,
        ]))?;
        let mut dev = DelayDevice {
            name,
            kernel_name: String::new(),
            path: PathBuf::new(),
        };
        let minor = cmd::run(Command::new("dmsetup").args([
            "info",
            "-c",
            "--noheadings",
            "-o",
            "minor",
            &dev.name,
        ]))?;
        let minor: u32 = minor
            .trim()
            .parse()
            .with_context(|| format!("dmsetup info {}: minor {minor:?}", dev.name))?;
        dev.kernel_name = format!("dm-{minor}");
        dev.path = PathBuf::from("/dev").join(&dev.kernel_name);
        if !dev.path.exists() {
            bail!(
                "{} has no {} (devtmpfs not mounted on /dev?)",
                dev.name,
                dev.path.display()
            );
        }
        Ok(dev)
    }

    /// `/dev/dm-N`.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `dm-N`.
    pub fn kernel_name(&self) -> &str {
        &self.kernel_name
    }
}

impl Drop for DelayDevice {
    fn drop(&mut self) {
        // A mapping still open (an unmount that has not finished) is retried once.
        for _ in 0..2 {
            let removed = Command::new("dmsetup")
                .env("DM_DISABLE_UDEV", "1")
                .args(["remove", "--noudevsync", &self.name])
                .stdout(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            if removed {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(500));
        }
        eprintln!("dmsetup remove {} failed: left behind", self.name);
    }
}
