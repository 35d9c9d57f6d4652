//! The subcommands.

use std::env;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::util::{describe, fmt_duration, in_ci, is_root, run_quiet, step, target_dir, which};
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

/// The Go programs (test and check tools): the Longhorn stand-in and deploy-check's Pod
/// Security checker. `gofmt -l` must list nothing, `go vet` must pass.
fn go_lint(root: &Path) -> Result<()> {
    let go = go_bin()?;
    let gofmt = go.with_file_name("gofmt");
    for rel in ["longhorn-standin", "xtask/psa"] {
        let dir = root.join(rel);
        timed(&format!("gofmt -l {rel}"), || {
            let out = Command::new(&gofmt)
                .arg("-l")
                .arg(".")
                .current_dir(&dir)
                .output()
                .with_context(|| format!("running {}", gofmt.display()))?;
            let listed = String::from_utf8_lossy(&out.stdout);
            anyhow::ensure!(
                out.status.success() && listed.trim().is_empty(),
                "gofmt would change:\n{listed}{}",
                String::from_utf8_lossy(&out.stderr)
            );
            Ok(())
        })?;
        let mut vet = Command::new(&go);
        vet.args(["vet", "./..."])
            .current_dir(&dir)
            .env("GOTOOLCHAIN", "local");
        timed(&format!("go vet ./... ({rel})"), || run_quiet(&mut vet))?;
    }
    Ok(())
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
fn cargo(root: &Path) -> Command {
    let mut cmd = Command::new("cargo");
    cmd.current_dir(root);
    cmd
}

/// Announce, run and time one step; a failure names the step.
fn timed(name: &str, f: impl FnOnce() -> Result<()>) -> Result<()> {
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

pub fn run_daemon(root: &Path, skip_setup: bool, args: &[String]) -> Result<()> {
    build(root, true, skip_setup)?;
    let bin = daemon_binary(root)?;
    let mut daemon_args = vec!["run".to_owned()];
    daemon_args.extend(args.iter().cloned());
    exec_privileged(root, &bin, &daemon_args)
}

pub fn soak(root: &Path, skip_setup: bool, minutes: u64, sample_secs: u64) -> Result<()> {
    anyhow::ensure!(is_root(), "the soak loads eBPF programs: run it as root");
    build(root, true, skip_setup)?;
    let opts = pgio_testkit::soak::SoakOptions {
        duration: Duration::from_secs(minutes * 60),
        sample_every: Duration::from_secs(sample_secs.max(5)),
        daemon_bin: daemon_binary(root)?,
        port: 56_431,
        held_backends: 4_000,
        scrape_p99: Duration::from_millis(100),
    };
    step(format!(
        "soak: {minutes} min, a sample every {sample_secs} s"
    ));
    let result = pgio_testkit::soak::run(&opts);
    let text = match &result {
        Ok(r) => format!("soak passed\n{}\n{}", r.table(), r.pgbench),
        Err(e) => format!("{e:#}"),
    };
    let path = target_dir(root).join("soak-report.txt");
    std::fs::write(&path, &text).with_context(|| format!("writing {}", path.display()))?;
    println!("{text}");
    step(format!("soak report: {}", path.display()));
    result.map(|_| ())
}

pub fn check(root: &Path, skip_setup: bool) -> Result<()> {
    build(root, true, skip_setup)?;
    let bin = daemon_binary(root)?;
    exec_privileged(root, &bin, &["check".to_owned()])
}

/// The guest tests `cargo xtask test` runs on Debian's 6.1 (~7 min under TCG on 2 cores).
const CI_GUEST_TESTS: &[&str] = &[
    "block_io",
    "big_node",
    "syscall",
    "futex",
    "postgres",
    "query_protocols:pg15_",
    "query_id:pg15_",
];

pub fn test(root: &Path, skip_setup: bool, extra: &[String]) -> Result<()> {
    let started = Instant::now();
    let result = test_steps(root, skip_setup, extra);
    let elapsed = fmt_duration(started.elapsed());
    match &result {
        Ok(()) => step(format!("test: all steps passed; total {elapsed}")),
        Err(_) => step(format!("test: FAILED; total {elapsed}")),
    }
    result
}

fn test_steps(root: &Path, skip_setup: bool, extra: &[String]) -> Result<()> {
    if skip_setup {
        step("skipping setup (--skip-setup)");
    } else {
        timed("setup", setup)?;
    }
    cargo_step(root, &["fmt", "--all", "--check"])?;
    // Default members (pgio-ebpf only builds for the BPF target, through aya-build). The eBPF
    // object is not needed to lint userspace: skip its separate debug-profile build.
    let mut clippy = cargo(root);
    clippy
        .args(["clippy", "--all-targets", "--", "-D", "warnings"])
        .env("AYA_BUILD_SKIP", "1");
    timed(&describe(&clippy), || run_quiet(&mut clippy))?;
    go_lint(root)?;
    timed(
        "deploy-check (Helm chart and kustomize base, offline)",
        || crate::deploy::check(root),
    )?;

    let mut cmd = cargo(root);
    cmd.args(["test", "--release"]).args(extra);
    const REQUIRE: &str = "PGIO_REQUIRE_ROOT_TESTS";
    if let Some(v) = env::var_os(REQUIRE) {
        step(format!(
            "{REQUIRE}={} (from the environment)",
            v.to_string_lossy()
        ));
    } else if is_root() || in_ci() {
        step(format!(
            "{REQUIRE}=1 ({}): root-only integration tests must run, not skip",
            if is_root() {
                "running as root"
            } else {
                "CI is set"
            }
        ));
        cmd.env(REQUIRE, "1");
    } else {
        step(format!(
            "not root and CI unset: root-only integration tests may skip ({REQUIRE} unset)"
        ));
    }
    timed(&describe(&cmd), || run_quiet(&mut cmd))?;
    if is_root() {
        // The kernels users run: 6.1 has no `block_io_start`, so this is pgio's fallback
        // path (the whole matrix: `cargo xtask integration --kernel all`).
        timed(
            &format!(
                "cargo xtask integration --kernel 6.1 --tests {}",
                CI_GUEST_TESTS.join(",")
            ),
            || {
                crate::integration::integration(
                    root,
                    skip_setup,
                    &crate::integration::ci_options(CI_GUEST_TESTS)?,
                )
            },
        )?;
    }
    if is_root() {
        // Benchmarks are not tests, but they must keep running: a smoke run of all of them.
        timed("cargo xtask bench --quick (smoke)", || {
            crate::bench::bench(root, &crate::bench::BenchOptions::quick())
        })
    } else {
        step("not root: skipping the benchmark smoke run");
        Ok(())
    }
}

pub(crate) fn daemon_binary(root: &Path) -> Result<std::path::PathBuf> {
    let bin = target_dir(root).join("release").join("pgio-daemon");
    if !bin.is_file() {
        bail!("{} is missing after a successful build", bin.display());
    }
    Ok(bin)
}

/// Replace this process with the daemon, as root: directly when root, else through `sudo -E`.
fn exec_privileged(root: &Path, bin: &Path, args: &[String]) -> Result<()> {
    let mut cmd = if is_root() {
        let mut cmd = Command::new(bin);
        cmd.args(args);
        cmd
    } else if let Some(sudo) = which("sudo") {
        step("not root: going through sudo -E (pgio-daemon loads eBPF programs)");
        let mut cmd = Command::new(sudo);
        cmd.arg("-E").arg(bin).args(args);
        cmd
    } else {
        bail!(
            "pgio-daemon must run as root (or with CAP_BPF + CAP_PERFMON) to load its eBPF \
             programs, and sudo is not installed: run `cargo xtask` as root, or run {} {} \
             with those capabilities",
            bin.display(),
            args.join(" ")
        );
    };
    cmd.current_dir(root);
    step(format!("exec {}", describe(&cmd)));
    let err = cmd.exec();
    Err(err).with_context(|| format!("cannot exec `{}`", describe(&cmd)))
}
