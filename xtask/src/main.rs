//! `cargo xtask`: sets up the toolchain and drives the build, run and test workflows of pgio.
//!
//! Every step prints `xtask: <what it is doing>` (on stderr) before it acts, and every setup step
//! is idempotent: when the machine is already in the wanted state it only checks and moves on.

mod apt;
mod bench;
mod build;
mod commands;
mod cross;
mod deploy;
mod image;
mod integration;
mod ports;
mod release;
mod sbom;
mod steps;
mod test_build;
mod toolchain;
mod util;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "cargo xtask",
    bin_name = "cargo xtask",
    about = "Set up the eBPF toolchain, then build, run and test pgio"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Ensure rust-src (nightly), a bpf-linker matching nightly's LLVM, and the Debian packages
    /// the tests need (postgresql-15, e2fsprogs, util-linux, procps, curl).
    Setup,
    /// Setup, then `cargo build --package pgio-daemon`.
    Build {
        /// Build with the release profile.
        #[arg(long)]
        release: bool,
        #[command(flatten)]
        setup: SetupFlag,
    },
    /// Setup, build pgio-daemon (release) and run `pgio-daemon run <ARGS>` as root.
    Run {
        #[command(flatten)]
        setup: SetupFlag,
        /// Arguments passed to `pgio-daemon run` (after `--`).
        #[arg(last = true, value_name = "ARGS")]
        args: Vec<String>,
    },
    /// Setup, then cargo fmt --check, clippy -D warnings, cargo test --release and, as root, a
    /// benchmark smoke run (`bench --quick`).
    Test {
        #[command(flatten)]
        setup: SetupFlag,
        /// Extra arguments appended to `cargo test --release` (after `--`).
        #[arg(last = true, value_name = "CARGO_TEST_ARGS")]
        args: Vec<String>,
    },
    /// Measure pgio's overhead side by side with its baselines; writes BENCHMARKS.md.
    Bench {
        #[command(flatten)]
        setup: SetupFlag,
        /// Smoke run: small counts, BENCHMARKS.md untouched (what CI runs).
        #[arg(long)]
        quick: bool,
        /// Only the per-call cost table (while working on the hot path); BENCHMARKS.md untouched.
        #[arg(long)]
        per_call_only: bool,
        /// Only the in-kernel run time of the programs (kernel bpf_stats, per piece, per
        /// hook type); BENCHMARKS.md untouched.
        #[arg(long, conflicts_with = "per_call_only")]
        programs_only: bool,
        /// Only the block programs' cost per request (fio on a loop device, kernel
        /// bpf_stats); its section of BENCHMARKS.md rewritten, the rest untouched.
        #[arg(long, conflicts_with_all = ["per_call_only", "programs_only"])]
        block_only: bool,
        /// Only section 2 (pgbench -S under each configuration, per-round ratios with
        /// bootstrap intervals, the pairs, the profile); with the default 2 clients its section
        /// of BENCHMARKS.md is rewritten, with others only printed.
        #[arg(long, conflicts_with_all = ["per_call_only", "programs_only", "block_only"])]
        pgbench_only: bool,
        /// Only section 2's profile (perf, cpu-clock: where a transaction's CPU goes without
        /// pgio, with the floor, with pgio); with the default 2 clients its section of
        /// BENCHMARKS.md is rewritten, with others only printed.
        #[arg(long, conflicts_with_all = ["per_call_only", "programs_only", "block_only", "pgbench_only"])]
        profile_only: bool,
        /// Rounds of each configuration in the profile.
        #[arg(long, default_value_t = 3)]
        profile_rounds: usize,
        /// Interleaved rounds of the pgbench runs of seconds (0: only the switched run).
        #[arg(long, default_value_t = 8)]
        pgbench_rounds: usize,
        /// Seconds of the switched pgbench run (configurations alternated every 100 ms).
        #[arg(long, default_value_t = 600)]
        switched_secs: u32,
        /// pgbench's clients and threads in section 2 (`-c N -j N`): the node's CPU count
        /// measures pgio with every CPU busy (at most 64: PostgreSQL's 100 connections).
        #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=64))]
        clients: u32,
    },
    /// Setup, build pgio-daemon (release) and, as root, soak it: PostgreSQL under `pgbench -C`
    /// churn plus every hostile input at once; RSS, fds, series and dropped events sampled
    /// must stay flat (report in target/soak-report.txt).
    Soak {
        #[command(flatten)]
        setup: SetupFlag,
        /// How long to run.
        #[arg(long, default_value_t = 60)]
        minutes: u64,
        /// Seconds between samples.
        #[arg(long, default_value_t = 30)]
        sample_secs: u64,
    },
    /// Offline checks of deploy/: helm lint, helm template, kubectl kustomize, kubeconform
    /// -strict, and the Helm and kustomize DaemonSets agree (builds helm and kubeconform once).
    DeployCheck,
    /// Setup, build pgio-daemon (release) and run `pgio-daemon check` as root.
    Check {
        #[command(flatten)]
        setup: SetupFlag,
    },
    /// Boot Debian's own kernels (5.10, 6.1, 6.12) in qemu (TCG) on the host's root filesystem
    /// (read-only 9p + tmpfs overlay) and run the root integration tests inside each; prints
    /// a table kernel × test (also in target/integration/report.md). Needs root. With
    /// `--arch arm64`: Debian's arm64 kernels under qemu-system-aarch64 on a root filesystem
    /// unpacked from Debian's arm64 packages (report-arm64.md).
    Integration {
        #[command(flatten)]
        setup: SetupFlag,
        /// Kernel series: 5.10, 6.1, 6.12, a comma-separated list of them, or all.
        #[arg(long, default_value = "6.1")]
        kernel: String,
        /// Tests, comma-separated: integration test targets of pgio-daemon, each optionally
        /// with libtest filters joined by `+` (`block_io,pg_scan:pg15_+pg17_`). Default:
        /// block_io, syscall, futex, postgres, pg_scan:pg15_+pg17_, pg_churn, longhorn_stack.
        #[arg(long, value_delimiter = ',')]
        tests: Vec<integration::TestSpec>,
        /// Per test binary, in the guest (TCG is ~16x slower than the host).
        #[arg(long, default_value_t = 1200)]
        test_timeout_secs: u64,
        /// Guest memory.
        #[arg(long, default_value_t = 4096)]
        memory_mb: u32,
        /// Resolve and download the newest kernel packages again instead of using the cache
        /// under target/integration/kernels.
        #[arg(long)]
        update_kernels: bool,
        /// Run the tests even when `pgio-daemon check` fails in the guest (by default they
        /// are listed as not run: each would only wait a minute for a daemon that cannot start).
        #[arg(long)]
        run_if_check_fails: bool,
        /// Possible CPUs of the guest (2 of them online: `-smp 2,maxcpus=N`). Per-CPU map
        /// memory follows possible CPUs, so every guest is a big node by default.
        #[arg(long, default_value_t = integration::DEFAULT_MAX_CPUS)]
        max_cpus: u32,
        /// More kernel command line for the guests, e.g. `lockdown=confidentiality` or
        /// `sysctl.kernel.perf_event_paranoid=3` (Linux takes `sysctl.*` there since 5.8).
        #[arg(long, default_value = "")]
        append: String,
        /// The guests' architecture: amd64 (qemu-system-x86_64 on the host's root filesystem)
        /// or arm64 (qemu-system-aarch64 -M virt, cross-compiled binaries, a root filesystem
        /// unpacked from Debian's arm64 packages; 2 possible CPUs, no hotplug).
        #[arg(long, default_value = "amd64")]
        arch: cross::Arch,
    },
    /// Setup, build pgio-daemon (release) for amd64 and arm64 (cross-compiled) and their images
    /// from deploy/image/Containerfile with podman (installed if missing):
    /// localhost/pgio:<version>-<arch> (the host's also :<version> and :latest), each with an
    /// SPDX SBOM, and the OCI index localhost/pgio:<version>-index; prints its digest.
    Image {
        #[command(flatten)]
        setup: SetupFlag,
    },
    /// Build the images as `image` does, push the index (amd64 + arm64) to
    /// <REGISTRY>:<version>, push the Helm chart pinned to its digest to
    /// oci://<host>/<repo's parent>/charts, and write target/dist/pgio-<version>/ (chart,
    /// SBOMs, release.json, SHA256SUMS). `podman login` first.
    Release {
        #[command(flatten)]
        setup: SetupFlag,
        /// `<host[:port]>/<repository>`, e.g. registry.example.com/team/pgio.
        #[arg(long, required_unless_present = "self_test")]
        registry: Option<String>,
        /// `false`: HTTPS without certificate checks, or plain HTTP (podman's meaning).
        #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
        tls_verify: bool,
        /// Release to a registry started on 127.0.0.1 and pull it back: each platform by
        /// digest, run, the chart rendered. As root.
        #[arg(long, conflicts_with = "registry")]
        self_test: bool,
    },
}

#[derive(Args)]
struct SetupFlag {
    /// Do not run the setup step (toolchain and package checks).
    #[arg(long)]
    skip_setup: bool,
}

/// The workspace root: the parent of this crate's manifest directory, independent of the cwd.
fn workspace_root() -> Result<PathBuf> {
    let manifest_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest_dir
        .parent()
        .map(PathBuf::from)
        .with_context(|| format!("{} has no parent directory", manifest_dir.display()))
}

fn real_main() -> Result<()> {
    let cli = Cli::parse();
    let root = workspace_root()?;
    util::ensure_cargo_bin_on_path()?;
    match cli.command {
        Cmd::Setup => build::setup(),
        Cmd::Build { release, setup } => build::build(&root, release, setup.skip_setup),
        Cmd::Run { setup, args } => commands::run_daemon(&root, setup.skip_setup, &args),
        Cmd::Test { setup, args } => commands::test(&root, setup.skip_setup, &args),
        Cmd::Check { setup } => commands::check(&root, setup.skip_setup),
        Cmd::DeployCheck => deploy::check(&root),
        Cmd::Soak {
            setup,
            minutes,
            sample_secs,
        } => commands::soak(&root, setup.skip_setup, minutes, sample_secs),
        Cmd::Image { setup } => image::image(&root, setup.skip_setup),
        Cmd::Release {
            setup,
            registry,
            tls_verify,
            self_test,
        } => release::command(
            &root,
            registry.as_deref(),
            tls_verify,
            setup.skip_setup,
            self_test,
        ),
        Cmd::Integration {
            setup,
            kernel,
            tests,
            test_timeout_secs,
            memory_mb,
            update_kernels,
            run_if_check_fails,
            max_cpus,
            append,
            arch,
        } => {
            let tests = if tests.is_empty() {
                integration::DEFAULT_TESTS
                    .iter()
                    .map(|t| t.parse())
                    .collect::<Result<Vec<_>>>()?
            } else {
                tests
            };
            let opts = integration::Options {
                kernels: integration::kernel_by_series(&kernel, arch)?,
                tests,
                test_timeout: std::time::Duration::from_secs(test_timeout_secs),
                memory_mb,
                update_kernels,
                run_if_check_fails,
                max_cpus,
                append,
                arch,
            };
            integration::integration(&root, setup.skip_setup, &opts)
        }
        Cmd::Bench {
            setup,
            quick,
            per_call_only,
            programs_only,
            block_only,
            pgbench_only,
            profile_only,
            profile_rounds,
            pgbench_rounds,
            switched_secs,
            clients,
        } => {
            if !setup.skip_setup {
                build::setup()?;
                if let Err(e) = apt::ensure(&["bpftrace"]) {
                    util::step(format!(
                        "bpftrace unavailable ({e:#}): its column is left out"
                    ));
                }
                if let Err(e) = apt::ensure(&["linux-perf"]) {
                    util::step(format!(
                        "perf unavailable ({e:#}): section 2's profile is left out"
                    ));
                }
            }
            let o = if quick {
                bench::BenchOptions {
                    profile_only,
                    ..bench::BenchOptions::quick()
                }
            } else {
                bench::BenchOptions {
                    pairs: pgbench_rounds,
                    switched_secs,
                    clients,
                    profile_only,
                    profile_rounds: profile_rounds.max(1),
                    ..bench::BenchOptions::full(
                        per_call_only,
                        programs_only,
                        block_only,
                        pgbench_only,
                    )
                }
            };
            bench::bench(&root, &o)
        }
    }
}

fn main() -> ExitCode {
    match real_main() {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("xtask: error: {err:#}");
            ExitCode::FAILURE
        }
    }
}
