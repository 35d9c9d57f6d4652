//! The subcommands that run things: the daemon, its checks, the soak and the test suite
//! (building is `build`'s).

use std::env;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::build::{build, cargo, daemon_binary, go_bin, setup, timed};
use crate::util::{describe, fmt_duration, in_ci, is_root, run_quiet, step, target_dir, which};

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
    if let Ok(r) = &result
        && minutes >= SOAK_MD_MINUTES
    {
        let md = root.join("SOAK.md");
        std::fs::write(&md, soak_md(root, minutes, r))
            .with_context(|| format!("writing {}", md.display()))?;
        step(format!("soak: {} rewritten", md.display()));
    }
    result.map(|_| ())
}

/// A soak this long or longer that passes rewrites SOAK.md (shorter ones only write
/// target/soak-report.txt).
const SOAK_MD_MINUTES: u64 = 60;

/// SOAK.md: the report of a passing soak of at least `SOAK_MD_MINUTES`, with where it ran.
fn soak_md(root: &Path, minutes: u64, r: &pgio_testkit::soak::SoakReport) -> String {
    let run = |cmd: &mut Command| {
        crate::util::output(cmd)
            .map(|s| s.trim().to_owned())
            .unwrap_or_default()
    };
    let commit =
        run(Command::new("git")
            .arg("-C")
            .arg(root)
            .args(["rev-parse", "--short", "HEAD"]));
    let kernel = run(Command::new("uname").arg("-r"));
    format!(
        "# pgio under a {minutes}-minute soak\n\n\
         Written by `cargo xtask soak --minutes {minutes}` (this file is its output, only when \
         the soak passed): tree {commit}, kernel {kernel}, {} CPUs. What the soak does and \
         what it checks: [docs/labels-and-bounds.md](docs/labels-and-bounds.md).\n\n\
         ```\n{}\n```\n\npgbench:\n\n```\n{}\n```\n",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        r.table().trim_end(),
        r.pgbench.trim_end()
    )
}

pub fn check(root: &Path, skip_setup: bool) -> Result<()> {
    build(root, true, skip_setup)?;
    let bin = daemon_binary(root)?;
    exec_privileged(root, &bin, &["check".to_owned()])
}

/// The guest tests `cargo xtask test` runs on Debian's 6.1: what only a guest can prove (the
/// fallback path without `block_io_start`, map memory at 128 possible CPUs). `syscall` and
/// `futex` (79 s of TCG) take the same paths there as on the host, which runs them in CI, and
/// so does `postgres` (115 s of TCG, which took CI past its 35 minutes); `cargo xtask
/// integration --kernel all` runs every test on every kernel.
const CI_GUEST_TESTS: &[&str] = &["block_io", "big_node"];

/// Every step runs even when one before it failed (one flaky test must not hide the rest);
/// the run ends with a table of the steps' times and the failures by name.
pub fn test(root: &Path, skip_setup: bool, extra: &[String]) -> Result<()> {
    let started = Instant::now();
    let mut steps = crate::steps::Steps::default();
    if skip_setup {
        step("skipping setup (--skip-setup)");
    } else if !steps.run("setup", setup) {
        // Nothing below can run without the toolchain.
        eprintln!("{}", steps.report(started.elapsed()));
        bail!("setup failed");
    }
    test_steps(root, skip_setup, extra, &mut steps);
    let elapsed = started.elapsed();
    eprintln!("\nxtask test: steps\n{}", steps.report(elapsed));
    if steps.all_passed() {
        step(format!(
            "test: all steps passed; total {}",
            fmt_duration(elapsed)
        ));
        Ok(())
    } else {
        step(format!("test: FAILED; total {}", fmt_duration(elapsed)));
        bail!("some steps failed (the table above names them)")
    }
}

fn test_steps(root: &Path, skip_setup: bool, extra: &[String], steps: &mut crate::steps::Steps) {
    let mut fmt = cargo(root);
    fmt.args(["fmt", "--all", "--check"]);
    steps.run(&describe(&fmt), || run_quiet(&mut fmt));
    // Default members (pgio-ebpf only builds for the BPF target, through aya-build). The eBPF
    // object is not needed to lint userspace: skip its separate debug-profile build.
    let mut clippy = cargo(root);
    clippy
        .args(["clippy", "--all-targets", "--", "-D", "warnings"])
        .env("AYA_BUILD_SKIP", "1");
    steps.run(&describe(&clippy), || run_quiet(&mut clippy));
    steps.run("gofmt and go vet", || go_lint(root));
    steps.run(
        "deploy-check (Helm chart and kustomize base, offline)",
        || crate::deploy::check(root),
    );

    // Every test binary runs, also after one failed: the failures are listed at the end.
    let mut cmd = cargo(root);
    cmd.args(["test", "--release", "--no-fail-fast"])
        .args(extra);
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
    {
        let _ports = crate::ports::ReservedPorts::reserve();
        steps.run_tests(&describe(&cmd), &mut cmd);
    }
    if !is_root() {
        step("not root: skipping the guest tests and the benchmark smoke run");
        return;
    }
    // The kernels users run: 6.1 has no `block_io_start`, so this is pgio's fallback path.
    steps.run(
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
    );
    // Benchmarks are not tests, but they must keep running: a smoke run of all of them.
    steps.run("cargo xtask bench --quick (smoke)", || {
        crate::bench::bench(root, &crate::bench::BenchOptions::quick())
    });
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
