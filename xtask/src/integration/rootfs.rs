//! The root filesystem of a guest whose architecture is not the host's (arm64 here): the host's
//! own root cannot serve it, its binaries are amd64. Built from Debian's packages of that
//! architecture without running any of them (no emulation): apt resolves the packages below
//! and their dependencies against an empty dpkg status in the private apt state, and each .deb
//! is unpacked with `dpkg-deb -x`. Maintainer scripts do not run, so what they would have made
//! is made here: the users and groups (the host's passwd and group: the same `postgres` uid;
//! shadow files with every password locked, not the host's hashes), PAM's `common-*` files,
//! `/bin/sh`. Cached under `target/integration/rootfs/<arch>/`; the stamp (a layout version and
//! the package list) is written last, so a half-built or outdated tree is redone.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, ensure};

use super::{Apt, apt_state};
use crate::cross::Arch;
use crate::util::{run, step};

/// What the guest script and the tests run: busybox (the initramfs's and the guest's init),
/// glibc and libgcc (the Rust binaries), util-linux (losetup, runuser, taskset, mount),
/// e2fsprogs (mkfs.ext4), kmod (modprobe), PostgreSQL 15 with psql and pgbench, the shell
/// tools the guest script and the tests' `sh -c` use.
pub const PACKAGES: &[&str] = &[
    "busybox-static",
    "libc6",
    "libgcc-s1",
    "base-files",
    "base-passwd",
    "bash",
    "dash",
    "coreutils",
    "util-linux",
    "mount",
    "e2fsprogs",
    "kmod",
    "procps",
    "iproute2",
    "hostname",
    "sed",
    "grep",
    "findutils",
    "gzip",
    "tar",
    "tzdata",
    "libpam-modules",
    "libpam-runtime",
    "postgresql-15",
    "postgresql-client-15",
];

/// Bumped when [`fixups`] changes, so cached trees are rebuilt.
const LAYOUT: u32 = 2;

/// Host files copied in when the packages left them missing (their maintainer scripts write
/// them on a real install). Text, the same for every architecture.
const HOST_ETC: &[&str] = &[
    "etc/passwd",
    "etc/group",
    "etc/nsswitch.conf",
    "etc/pam.d/common-auth",
    "etc/pam.d/common-account",
    "etc/pam.d/common-password",
    "etc/pam.d/common-session",
    "etc/pam.d/common-session-noninteractive",
];

/// The cached root filesystem of `arch`, built if missing (or `update`); `apt` is the private
/// apt state, updated when first needed.
pub fn ensure(base: &Path, arch: Arch, update: bool, apt: &mut Option<Apt>) -> Result<PathBuf> {
    let dir = base.join("rootfs").join(arch.name());
    let root = dir.join("root");
    let stamp = dir.join("packages");
    let want = format!("layout {LAYOUT}\n{}\n", PACKAGES.join("\n"));
    if !update && fs::read_to_string(&stamp).is_ok_and(|s| s == want) && root.is_dir() {
        step(format!(
            "{} root filesystem: cached {}",
            arch.name(),
            root.display()
        ));
        return Ok(root);
    }
    let apt = apt_state(base, apt)?;
    if dir.exists() {
        fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
    }
    let debs = dir.join("debs");
    fs::create_dir_all(debs.join("partial"))?;
    let status = dir.join("dpkg-status");
    fs::write(&status, "")?;
    step(format!(
        "{} root filesystem: apt-get install --download-only ({} packages and their dependencies)",
        arch.name(),
        PACKAGES.len()
    ));
    run(apt
        .cmd("apt-get")
        .arg("-o")
        .arg(format!("APT::Architecture={}", arch.name()))
        .arg("-o")
        .arg(format!("Dir::State::status={}", status.display()))
        .arg("-o")
        .arg(format!("Dir::Cache::archives={}", debs.display()))
        // Nothing is installed: the host's dpkg lock is not ours to take.
        .args(["-o", "Debug::NoLocking=1"])
        .args([
            "-q",
            "-y",
            "--no-install-recommends",
            "install",
            "--download-only",
        ])
        .args(PACKAGES))?;
    let mut files: Vec<PathBuf> = fs::read_dir(&debs)?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "deb"))
        .collect();
    files.sort();
    ensure!(!files.is_empty(), "apt left no .deb in {}", debs.display());
    step(format!(
        "{} root filesystem: dpkg-deb -x {} packages into {}",
        arch.name(),
        files.len(),
        root.display()
    ));
    fs::create_dir_all(&root)?;
    for deb in &files {
        run(Command::new("dpkg-deb").arg("-x").arg(deb).arg(&root))?;
    }
    fixups(&root)?;
    fs::remove_dir_all(&debs)?;
    fs::remove_file(&status)?;
    fs::write(&stamp, want)?;
    Ok(root)
}

/// What maintainer scripts and a booted system would have made.
fn fixups(root: &Path) -> Result<()> {
    for rel in HOST_ETC {
        let to = root.join(rel);
        let from = Path::new("/").join(rel);
        if !to.exists() && from.is_file() {
            if let Some(d) = to.parent() {
                fs::create_dir_all(d)?;
            }
            fs::copy(&from, &to)
                .with_context(|| format!("copying {} to {}", from.display(), to.display()))?;
        }
    }
    // PAM's account check reads them; every password locked (runuser as root needs none).
    for (file, source, tail) in [
        ("etc/shadow", "etc/passwd", ":*:::::::"),
        ("etc/gshadow", "etc/group", ":*::"),
    ] {
        let to = root.join(file);
        if to.exists() {
            continue;
        }
        let names = fs::read_to_string(root.join(source)).unwrap_or_default();
        let text: String = names
            .lines()
            .filter_map(|l| l.split(':').next())
            .filter(|n| !n.is_empty())
            .map(|n| format!("{n}{tail}\n"))
            .collect();
        fs::write(&to, text)?;
        fs::set_permissions(&to, fs::Permissions::from_mode(0o640))?;
    }
    // dash's postinst makes /bin/sh.
    let sh = root.join("bin/sh");
    if fs::symlink_metadata(&sh).is_err() {
        std::os::unix::fs::symlink("dash", &sh).context("linking /bin/sh")?;
    }
    for d in [
        "tmp",
        "root",
        "run",
        "var/lib/postgresql",
        "dev",
        "proc",
        "sys",
    ] {
        fs::create_dir_all(root.join(d))?;
    }
    // postgres owns its home, as its postinst would have set.
    if let Some((uid, gid)) = user_ids(&root.join("etc/passwd"), "postgres") {
        std::os::unix::fs::chown(root.join("var/lib/postgresql"), Some(uid), Some(gid))?;
    }
    for must in [
        "bin/busybox",
        "bin/sh",
        "usr/lib/postgresql/15/bin/postgres",
    ] {
        ensure!(
            fs::symlink_metadata(root.join(must)).is_ok(),
            "the root filesystem has no /{must}"
        );
    }
    Ok(())
}

/// uid and gid of `user` in a passwd file.
fn user_ids(passwd: &Path, user: &str) -> Option<(u32, u32)> {
    let text = fs::read_to_string(passwd).ok()?;
    text.lines().find_map(|l| {
        let f: Vec<&str> = l.split(':').collect();
        (f.first() == Some(&user) && f.len() > 3)
            .then(|| Some((f[2].parse().ok()?, f[3].parse().ok()?)))
            .flatten()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwd_ids() {
        let dir = pgio_testkit::temp_dir().unwrap();
        let p = dir.path().join("passwd");
        fs::write(
            &p,
            "root:x:0:0::/root:/bin/sh\npostgres:x:105:110::/var/lib/postgresql:/bin/bash\n",
        )
        .unwrap();
        assert_eq!(user_ids(&p, "postgres"), Some((105, 110)));
        assert_eq!(user_ids(&p, "nobody"), None);
    }
}
