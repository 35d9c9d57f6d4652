//! Debian packages the integration tests need.

use std::path::Path;
use std::process::{Command, Stdio};

use anyhow::{Result, bail};

use crate::util::{is_root, run, step, which};

const PACKAGES: &[&str] = &[
    "postgresql-15",
    "e2fsprogs",
    "util-linux",
    "procps",
    "curl",
    // The independent check of block request counts and latencies (tests/fio.rs).
    "fio",
    // `pgio-daemon top`'s live mode is driven through a real terminal (tests/top.rs).
    "tmux",
    // Holds a postmaster's chdir to start it as slowly as a loaded node (tests/pg_clusters.rs).
    "strace",
    // The peer that samples wait events, which tests/wait_sampling.rs compares pgio with.
    "postgresql-15-pg-wait-sampling",
];
const PG_BIN: &str = "/usr/lib/postgresql/15/bin";

/// `dpkg -s <pkg>` reports `Status: install ok installed`.
fn installed(pkg: &str) -> bool {
    let Ok(out) = Command::new("dpkg")
        .args(["-s", pkg])
        .stdin(Stdio::null())
        .output()
    else {
        return false;
    };
    out.status.success()
        && String::from_utf8_lossy(&out.stdout).lines().any(|l| {
            l.strip_prefix("Status:")
                .is_some_and(|s| s.split_whitespace().eq(["install", "ok", "installed"]))
        })
}

fn missing<'a>(pkgs: &[&'a str]) -> Vec<&'a str> {
    pkgs.iter().copied().filter(|p| !installed(p)).collect()
}

pub fn ensure_packages() -> Result<()> {
    ensure(PACKAGES)?;
    check_pg_bin();
    Ok(())
}

/// Installs whichever of `pkgs` is missing (apt-get update once first); a no-op when all are.
pub fn ensure(pkgs: &[&str]) -> Result<()> {
    step(format!("checking Debian packages: {}", pkgs.join(" ")));
    if which("dpkg").is_none() {
        step("dpkg not found (not Debian?): skipping the package check");
        return Ok(());
    }
    let missing_pkgs = missing(pkgs);
    if missing_pkgs.is_empty() {
        step("Debian packages are installed");
        return Ok(());
    }
    if !is_root() {
        step(format!(
            "not root: skipping apt-get; install them with `sudo apt-get install -y --no-install-recommends {}`",
            missing_pkgs.join(" ")
        ));
        return Ok(());
    }
    step("apt-get update");
    run(Command::new("apt-get")
        .arg("update")
        .env("DEBIAN_FRONTEND", "noninteractive"))?;
    step(format!(
        "apt-get install -y --no-install-recommends {}",
        missing_pkgs.join(" ")
    ));
    run(Command::new("apt-get")
        .args(["install", "-y", "--no-install-recommends"])
        .args(&missing_pkgs)
        .env("DEBIAN_FRONTEND", "noninteractive"))?;
    let still = missing(pkgs);
    if !still.is_empty() {
        bail!(
            "still not installed after apt-get install: {}",
            still.join(" ")
        );
    }
    Ok(())
}

fn check_pg_bin() {
    for tool in ["postgres", "initdb", "pg_ctl"] {
        if !Path::new(PG_BIN).join(tool).exists() {
            eprintln!(
                "xtask: warning: {PG_BIN}/{tool} is missing although postgresql-15 is installed"
            );
        }
    }
}
