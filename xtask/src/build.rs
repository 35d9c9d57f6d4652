//! Setting up and building: the toolchain, the Debian packages, the release daemon. Every
//! command that builds goes through here (no command module is needed to build).

use std::env;
use std::path::Path;
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail};

use crate::util::{describe, fmt_duration, run_quiet, step, target_dir};
use crate::{apt, toolchain};

pub fn setup() -> Result<()> {
    let started = Instant::now();
    toolchain::ensure_rust_src()?;
    let nightly = toolchain::Nightly::detect()?;
    toolchain::ensure_bpf_linker(&nightly)?;
    apt::ensure_packages()?;
    // The container test (pgio-daemon/tests/container.rs) and `cargo xtask image`.
    apt::ensure(pgio_testkit::podman::PACKAGES)?;
    report_tracefs();
    step(format!("setup done in {}", fmt_duration(started.elapsed())));
    Ok(())
}

/// Only reported: pgio-daemon mounts tracefs itself when it is missing.
fn report_tracefs() {
    if Path::new("/sys/kernel/tracing/events").is_dir() {
        step("tracefs is mounted at /sys/kernel/tracing");
    } else {
        step("tracefs is not mounted at /sys/kernel/tracing; pgio-daemon mounts it itself");
    }
}

/// `go` on PATH, else Go's default install location.
pub(crate) fn go_bin() -> Result<std::path::PathBuf> {
    let on_path = env::var_os("PATH")
        .map(|p| {
            env::split_paths(&p)
                .map(|d| d.join("go"))
                .collect::<Vec<_>>()
        })
        .unwrap_or_default();
    on_path
        .into_iter()
        .chain([std::path::PathBuf::from("/usr/local/go/bin/go")])
        .find(|p| p.is_file())
        .context(
            "no Go toolchain (`go` on PATH or /usr/local/go/bin/go): the Longhorn stand-in the \
             tests run is Go (longhorn-standin/go.mod says which version)",
        )
}

/// `cargo <args>` in the workspace root (so rust-toolchain.toml applies).
pub(crate) fn cargo(root: &Path) -> Command {
    let mut cmd = Command::new("cargo");
    cmd.current_dir(root);
    cmd
}

/// Announce, run and time one step; a failure names the step.
pub(crate) fn timed(name: &str, f: impl FnOnce() -> Result<()>) -> Result<()> {
    let started = Instant::now();
    step(name);
    f().with_context(|| format!("step `{name}` failed"))?;
    step(format!("{name}: ok ({})", fmt_duration(started.elapsed())));
    Ok(())
}

fn cargo_step(root: &Path, args: &[&str]) -> Result<()> {
    let mut cmd = cargo(root);
    cmd.args(args);
    timed(&describe(&cmd), || run_quiet(&mut cmd))
}

pub fn build(root: &Path, release: bool, skip_setup: bool) -> Result<()> {
    if skip_setup {
        step("skipping setup (--skip-setup)");
    } else {
        setup().context("step `setup` failed")?;
    }
    let mut args = vec!["build", "--package", "pgio-daemon"];
    if release {
        args.push("--release");
    }
    cargo_step(root, &args)
}

pub(crate) fn daemon_binary(root: &Path) -> Result<std::path::PathBuf> {
    let bin = target_dir(root).join("release").join("pgio-daemon");
    if !bin.is_file() {
        bail!("{} is missing after a successful build", bin.display());
    }
    Ok(bin)
}
