//! A freshly made ext4 filesystem mounted from a loop device (or another block device the
//! test owns), unmounted on drop.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result};

use crate::cmd;
use crate::loopdev::LoopDevice;

/// ext4 on a `LoopDevice`, mounted at a test-provided mountpoint.
/// Drop unmounts (retrying while busy, `umount -l` as last resort); drop it before the device
/// and after anything that uses files on it (e.g. a `PgCluster`).
#[derive(Debug)]
pub struct Ext4Mount {
    device: PathBuf,
    mountpoint: PathBuf,
    mounted: bool,
}

impl Ext4Mount {
    /// `mkfs.ext4 -q -F -E lazy_itable_init=0,lazy_journal_init=0` (no background init IO
    /// afterwards), creates `mountpoint` if needed and mounts it.
    pub fn new(dev: &LoopDevice, mountpoint: &Path) -> Result<Self> {
        Self::on_device(dev.path(), mountpoint)
    }

    /// `new` on any block device the test owns (e.g. a Longhorn stand-in volume).
    pub fn on_device(device: &Path, mountpoint: &Path) -> Result<Self> {
        cmd::run(
            Command::new("mkfs.ext4")
                .args(["-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0"])
                .arg(device),
        )?;
        std::fs::create_dir_all(mountpoint)
            .with_context(|| format!("creating {}", mountpoint.display()))?;
        let mut m = Ext4Mount {
            device: device.to_owned(),
            mountpoint: mountpoint.to_owned(),
            mounted: false,
        };
        m.mount()?;
        Ok(m)
    }

    /// The mountpoint.
    pub fn path(&self) -> &Path {
        &self.mountpoint
    }

    /// The block device (`/dev/loopN`).
    pub fn device(&self) -> &Path {
        &self.device
    }

    /// umount + mount: writes back and evicts this filesystem's page cache (a cold cache for
    /// the next reads) without a global drop_caches. Fails if files on it are still open.
    pub fn remount(&mut self) -> Result<()> {
        self.umount()?;
        self.mount()
    }

    fn mount(&mut self) -> Result<()> {
        cmd::run(
            Command::new("mount")
                .args(["-t", "ext4"])
                .arg(&self.device)
                .arg(&self.mountpoint),
        )?;
        self.mounted = true;
        Ok(())
    }

    fn umount(&mut self) -> Result<()> {
        cmd::run(Command::new("umount").arg(&self.mountpoint))?;
        self.mounted = false;
        Ok(())
    }

    /// Unmounts now, reporting errors (Drop does the same, retrying and then lazily).
    pub fn unmount(mut self) -> Result<()> {
        self.umount()
    }
}

impl Drop for Ext4Mount {
    fn drop(&mut self) {
        if !self.mounted {
            return;
        }
        let mut last_err = None;
        for _ in 0..10 {
            match self.umount() {
                Ok(()) => return,
                Err(e) => last_err = Some(e),
            }
            std::thread::sleep(Duration::from_millis(300));
        }
        eprintln!(
            "pgio-testkit: umount {} kept failing ({}); lazy unmount",
            self.mountpoint.display(),
            last_err.map(|e| format!("{e:#}")).unwrap_or_default()
        );
        if let Err(e) = cmd::run(Command::new("umount").arg("-l").arg(&self.mountpoint)) {
            eprintln!(
                "pgio-testkit: umount -l {} failed: {e:#}",
                self.mountpoint.display()
            );
        }
    }
}
