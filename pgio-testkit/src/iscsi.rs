//! An iSCSI disk on loopback, Longhorn v1's frontend shape (DESIGN.md §7): Debian's `tgtd`
//! serves a file as LUN 1 on 127.0.0.1:3260, open-iscsi's `iscsid` + `iscsiadm` log in, and the
//! kernel's `iscsi_tcp` gives a `/dev/sdX`. Needs the `iscsi_tcp` module, which not every kernel
//! here has (the CI host has no modules; the `cargo xtask integration` guests do): `available`
//! says why not. Drop logs out, deletes the target and stops both daemons.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail};

use crate::{cmd, wait_until};

const PORTAL: &str = "127.0.0.1:3260";
const IQN: &str = "iqn.2026-11.io.pgio:test";

/// Why an iSCSI disk cannot be made on this machine, or None when it can.
pub fn unavailable() -> Option<String> {
    for tool in ["tgtd", "tgtadm", "iscsid", "iscsiadm"] {
        if !cmd::on_path(tool) {
            return Some(format!("{tool} not installed (Debian: tgt, open-iscsi)"));
        }
    }
    if !cmd::module_available("iscsi_tcp") {
        return Some("no iscsi_tcp kernel module".to_owned());
    }
    // Built in on some kernels; a module on Debian's.
    let _ = cmd::module_available("sd_mod");
    None
}

/// A logged-in iSCSI disk backed by `file`.
#[derive(Debug)]
pub struct IscsiDisk {
    tgtd: Option<Child>,
    iscsid: Option<Child>,
    logged_in: bool,
    device: PathBuf,
    name: String,
}

impl IscsiDisk {
    /// Serves `file` (with `O_DIRECT` in the target: `--bsoflags direct`, so each read of the
    /// disk is a read of the device under `file`) and logs in; waits for `/dev/sdX`.
    pub fn start(file: &Path) -> Result<IscsiDisk> {
        let before = iet_disks();
        let mut disk = IscsiDisk {
            tgtd: None,
            iscsid: None,
            logged_in: false,
            device: PathBuf::new(),
            name: String::new(),
        };
        disk.iscsid = Some(
            // Its own process group: iscsid signals its whole group when it stops (the test
            // died of SIGTERM when it shared ours).
            Command::new("iscsid")
                .arg("-f")
                .process_group(0)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .spawn()
                .context("starting iscsid -f")?,
        );
        disk.tgtd = Some(
            Command::new("tgtd")
                .args(["-f", "--iscsi", &format!("portal={PORTAL}")])
                .process_group(0)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .context("starting tgtd -f")?,
        );
        // tgtadm talks to tgtd over its unix socket: retry until it answers.
        let up = wait_until(Duration::from_secs(30), Duration::from_millis(200), || {
            tgtadm(&["--op", "show", "--mode", "target"]).is_ok()
        });
        if !up {
            bail!("tgtd did not answer tgtadm within 30 s");
        }
        tgtadm(&["--op", "new", "--mode", "target", "--tid", "1", "-T", IQN])?;
        let file_s = file
            .to_str()
            .with_context(|| format!("{} is not UTF-8", file.display()))?;
        tgtadm(&[
            "--op",
            "new",
            "--mode",
            "logicalunit",
            "--tid",
            "1",
            "--lun",
            "1",
            "-b",
            file_s,
            "--bsoflags",
            "direct",
        ])?;
        tgtadm(&[
            "--op", "bind", "--mode", "target", "--tid", "1", "-I", "ALL",
        ])?;
        // iscsid's control socket may take a moment too.
        let mut last = None;
        let discovered =
            wait_until(
                Duration::from_secs(30),
                Duration::from_millis(300),
                || match iscsiadm(&["-m", "discovery", "-t", "sendtargets", "-p", PORTAL]) {
                    Ok(_) => true,
                    Err(e) => {
                        last = Some(e);
                        false
                    }
                },
            );
        if !discovered {
            bail!("iSCSI discovery failed: {last:?}");
        }
        // No NOP-Out pings: under emulation (cargo xtask integration's TCG guests) a busy
        // target misses their 5 s deadline and the initiator drops a healthy session.
        for (name, value) in [
            ("node.conn[0].timeo.noop_out_interval", "0"),
            ("node.conn[0].timeo.noop_out_timeout", "0"),
        ] {
            iscsiadm(&[
                "-m", "node", "-T", IQN, "-p", PORTAL, "-o", "update", "-n", name, "-v", value,
            ])?;
        }
        iscsiadm(&["-m", "node", "-T", IQN, "-p", PORTAL, "--login"])?;
        disk.logged_in = true;
        let mut found = None;
        wait_until(Duration::from_secs(60), Duration::from_millis(200), || {
            found = iet_disks().into_iter().find(|d| !before.contains(d));
            found
                .as_ref()
                .is_some_and(|n| Path::new("/dev").join(n).exists())
        });
        let name = found.context("no new IET disk (tgt's vendor id) after the iSCSI login")?;
        // The SCSI command timeout (30 s) starts error recovery, which resets the session: a
        // loaded target under emulation (2 ms injected per replica request, pgbench -i's
        // writes) has kept commands queued longer than that.
        let timeout = format!("/sys/block/{name}/device/timeout");
        std::fs::write(&timeout, "600").with_context(|| format!("writing {timeout}"))?;
        disk.device = Path::new("/dev").join(&name);
        disk.name = name;
        Ok(disk)
    }

    /// `/dev/sdX`.
    pub fn device(&self) -> &Path {
        &self.device
    }

    /// `sdX`, the name in /proc/diskstats.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// (major, minor) of `/dev/sdX`.
    pub fn major_minor(&self) -> Result<(u32, u32)> {
        use std::os::unix::fs::MetadataExt;
        let rdev = std::fs::metadata(&self.device)
            .with_context(|| format!("stat {}", self.device.display()))?
            .rdev();
        Ok((libc::major(rdev), libc::minor(rdev)))
    }

    /// The target daemon's pid.
    pub fn tgtd_pid(&self) -> Option<u32> {
        self.tgtd.as_ref().map(Child::id)
    }
}

impl Drop for IscsiDisk {
    fn drop(&mut self) {
        if self.logged_in {
            let _ = iscsiadm(&["-m", "node", "-T", IQN, "-p", PORTAL, "--logout"]);
            let _ = iscsiadm(&["-m", "node", "-T", IQN, "-p", PORTAL, "-o", "delete"]);
        }
        let _ = tgtadm(&[
            "--op", "delete", "--mode", "target", "--tid", "1", "--force",
        ]);
        for child in [self.tgtd.take(), self.iscsid.take()].into_iter().flatten() {
            stop(child);
        }
    }
}

fn stop(mut child: Child) {
    // SAFETY: plain kill(2) on our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let gone = wait_until(Duration::from_secs(5), Duration::from_millis(50), || {
        matches!(child.try_wait(), Ok(Some(_)))
    });
    if !gone {
        let _ = child.kill();
    }
    let _ = child.wait();
}

fn tgtadm(args: &[&str]) -> Result<String> {
    cmd::run(Command::new("tgtadm").args(["--lld", "iscsi"]).args(args))
}

fn iscsiadm(args: &[&str]) -> Result<String> {
    cmd::run(Command::new("iscsiadm").args(args))
}

/// Block devices whose SCSI vendor is tgt's (`IET`).
fn iet_disks() -> Vec<String> {
    let Ok(dir) = std::fs::read_dir("/sys/block") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| {
            std::fs::read_to_string(format!("/sys/block/{n}/device/vendor"))
                .is_ok_and(|v| v.trim() == "IET")
        })
        .collect()
}
