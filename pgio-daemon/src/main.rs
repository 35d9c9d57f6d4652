//! pgio-daemon: per-node eBPF view of where PostgreSQL query time goes on the IO path.
use std::{
    os::fd::{AsFd, AsRawFd},
    path::PathBuf,
    process::ExitCode,
};

use anyhow::Result;
use clap::{Parser, Subcommand};

use pgio_daemon::{
    check,
    config::Config,
    privileges, probes,
    run::{require_privileges, serve, shutdown_signal, start},
    self_metrics, tracefs,
    web_config::WebConfig,
};

#[derive(Parser)]
#[command(
    version,
    about = "Where PostgreSQL query time goes on the IO path (eBPF)"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Load the probes and serve /metrics until SIGTERM/SIGINT.
    Run {
        /// HTTP listen address (overrides `listen` in the config).
        #[arg(long, env = "PGIO_LISTEN")]
        listen: Option<std::net::SocketAddr>,
        /// Config file (TOML); without it, built-in defaults.
        #[arg(long, env = "PGIO_CONFIG")]
        config: Option<PathBuf>,
        /// TLS and basic auth for /metrics (YAML, Prometheus exporter-toolkit format).
        #[arg(long, env = "PGIO_WEB_CONFIG_FILE")]
        web_config_file: Option<PathBuf>,
        /// Log level or tracing filter (error, warn, info, debug, trace).
        #[arg(long, env = "PGIO_LOG", default_value = "info")]
        log_level: String,
        /// Benchmark fixture: detach and re-attach the programs on `off`/`on` lines on stdin.
        #[arg(long, hide = true)]
        bench_switch: bool,
    },
    /// Report BTF, tracefs, each tracepoint, privileges and the maps' kernel memory; exit 1
    /// naming what is missing.
    Check {
        /// Estimate the maps' kernel memory for a node with this many possible CPUs instead.
        #[arg(long)]
        possible_cpus: Option<u32>,
    },
    /// A running daemon's latency histograms per interval, in the terminal (no root needed).
    Top(pgio_daemon::top::TopArgs),
    /// Benchmark fixture: attach empty programs to pread64's hooks until SIGTERM.
    #[command(hide = true)]
    Floor {
        /// Which hooks: the syscall tracepoints, fentry/fexit, or the `part_*` programs that
        /// each do one piece of pgio's syscall timing.
        #[arg(long, value_enum, default_value = "tracepoint")]
        hooks: probes::FloorHooks,
        /// Detach and re-attach the programs on `off`/`on` lines on stdin.
        #[arg(long)]
        bench_switch: bool,
    },
}

fn main() -> ExitCode {
    pgio_daemon::heap::configure();
    let cli = Cli::parse();
    match cli.command {
        Command::Check { possible_cpus } => run_check(possible_cpus),
        Command::Top(args) => match pgio_daemon::top::run(args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("pgio-daemon top: {e:#}");
                ExitCode::FAILURE
            }
        },
        Command::Floor {
            hooks,
            bench_switch,
        } => match run_floor(hooks, bench_switch) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("pgio-daemon floor: {e:#}");
                ExitCode::FAILURE
            }
        },
        Command::Run {
            listen,
            config,
            web_config_file,
            log_level,
            bench_switch,
        } => {
            let filter = tracing_subscriber::EnvFilter::try_new(&log_level)
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
            // Colours only for a person at a terminal, not in a journal or a pod's log.
            tracing_subscriber::fmt()
                .with_env_filter(filter)
                .with_writer(std::io::stderr)
                .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
                .init();
            let config = match config
                .as_deref()
                .map(pgio_daemon::settings::load)
                .unwrap_or_else(|| Ok(Config::default()))
            {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("pgio-daemon: invalid config: {e}");
                    return ExitCode::from(2);
                }
            };
            // Read now, with all of root's capabilities: the key file may be root's only.
            let web = match web_config_file
                .as_deref()
                .map(WebConfig::load)
                .unwrap_or_else(|| Ok(WebConfig::default()))
            {
                Ok(w) => w,
                Err(e) => {
                    eprintln!("pgio-daemon: invalid web config: {e}");
                    return ExitCode::from(2);
                }
            };
            // Everything that needs root happens on this one thread; capabilities are per
            // thread, so the runtime's and the other threads start only after the drop.
            let started = match start(config, web, listen, bench_switch) {
                Ok(s) => s,
                Err(e) => {
                    // Once, plainly: the log goes to stderr too.
                    eprintln!("pgio-daemon: {e:#}");
                    return ExitCode::FAILURE;
                }
            };
            privileges::drop_unneeded();
            let rt = match tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    eprintln!("pgio-daemon: cannot start the async runtime: {e}");
                    return ExitCode::FAILURE;
                }
            };
            match rt.block_on(serve(started)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("pgio-daemon: {e:#}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}

fn run_check(possible_cpus: Option<u32>) -> ExitCode {
    let findings = check::run_checks(possible_cpus);
    let mut failed = Vec::new();
    for f in &findings {
        let tag = match f.level {
            check::Level::Ok => "ok  ",
            check::Level::Warn => "warn",
            check::Level::Fail => "FAIL",
        };
        println!("{tag} {}", f.what);
        if f.level == check::Level::Fail {
            failed.push(f.what.as_str());
        }
    }
    if failed.is_empty() {
        println!("pgio can run on this node");
        ExitCode::SUCCESS
    } else {
        println!(
            "pgio cannot run on this node; missing: {}",
            failed.join("; ")
        );
        ExitCode::FAILURE
    }
}

fn run_floor(hooks: probes::FloorHooks, bench_switch: bool) -> Result<()> {
    require_privileges()?;
    tracefs::ensure_mounted()?;
    let (ebpf, attachments) = probes::load_floor(hooks)?;
    let ebpf = std::sync::Arc::new(std::sync::Mutex::new(ebpf));
    // Held until the end: the links detach when dropped.
    let _attachments = if bench_switch {
        pgio_daemon::bench_switch::spawn(ebpf.clone(), attachments)?;
        None
    } else {
        Some(attachments)
    };
    println!("ready");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(shutdown_signal());
    // For `cargo xtask bench`: the programs' run time (kernel.bpf_stats_enabled) at exit.
    let ebpf = ebpf
        .lock()
        .map_err(|_| anyhow::anyhow!("the eBPF object's lock is poisoned"))?;
    for (name, p) in ebpf.programs() {
        if let Some(s) = p
            .fd()
            .ok()
            .and_then(|fd| self_metrics::program_stats(fd.as_fd().as_raw_fd()))
        {
            println!("stats {name} {} {}", s.run_time_ns, s.runs);
        }
    }
    Ok(())
}
