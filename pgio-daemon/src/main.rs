//! pgio-daemon: per-node eBPF view of where PostgreSQL query time goes on the IO path.
use std::{
    os::fd::{AsFd, AsRawFd},
    path::PathBuf,
    process::ExitCode,
    sync::{Arc, Mutex},
};

use anyhow::{Context as _, Result, anyhow};
use aya::maps::{Array, PerCpuArray, PerCpuHashMap, RingBuf};
use clap::{Parser, Subcommand};
use tracing::{error, info};

use pgio_daemon::{
    block_io, check,
    classifier::Classifier,
    config::Config,
    devices::LonghornVolumes,
    discovery::{self, Discovery, SharedTracked},
    exposition::{self, PgioCollector},
    http, probes, syscall, tracefs,
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
        /// Log level or tracing filter (error, warn, info, debug, trace).
        #[arg(long, env = "PGIO_LOG", default_value = "info")]
        log_level: String,
    },
    /// Report BTF, tracefs, each tracepoint and privileges; exit 1 naming what is missing.
    Check,
    /// Benchmark fixture: attach empty programs to sys_{enter,exit}_pread64 until SIGTERM.
    #[command(hide = true)]
    Floor,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Check => run_check(),
        Command::Floor => match run_floor() {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("pgio-daemon floor: {e:#}");
                ExitCode::FAILURE
            }
        },
        Command::Run {
            listen,
            config,
            log_level,
        } => {
            let filter = tracing_subscriber::EnvFilter::try_new(&log_level)
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
            tracing_subscriber::fmt()
                .with_env_filter(filter)
                .with_writer(std::io::stderr)
                .init();
            let config = match config
                .as_deref()
                .map(Config::load)
                .unwrap_or_else(|| Ok(Config::default()))
            {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("pgio-daemon: invalid config: {e}");
                    return ExitCode::from(2);
                }
            };
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
            match rt.block_on(run(config, listen)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    error!("{e:#}");
                    eprintln!("pgio-daemon: {e:#}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}

fn run_check() -> ExitCode {
    let findings = check::run_checks();
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

fn run_floor() -> Result<()> {
    require_privileges()?;
    tracefs::ensure_mounted()?;
    let ebpf = probes::load_floor()?;
    println!("ready");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(shutdown_signal());
    // For `cargo xtask bench`: the programs' run time (kernel.bpf_stats_enabled) at exit.
    for (name, p) in ebpf.programs() {
        if let Some((ns, runs, _)) = p
            .fd()
            .ok()
            .and_then(|fd| exposition::program_stats(fd.as_fd().as_raw_fd()))
        {
            println!("stats {name} {ns} {runs}");
        }
    }
    Ok(())
}

fn require_privileges() -> Result<()> {
    let missing: Vec<String> = check::privileges()
        .into_iter()
        .filter(|f| f.level == check::Level::Fail)
        .map(|f| f.what)
        .collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(anyhow!("insufficient privileges: {}", missing.join("; ")))
    }
}

/// Kernels before 5.11 charge BPF maps to RLIMIT_MEMLOCK; harmless elsewhere.
fn raise_memlock() {
    let unlimited = libc::rlimit {
        rlim_cur: libc::RLIM_INFINITY,
        rlim_max: libc::RLIM_INFINITY,
    };
    // SAFETY: plain struct argument.
    if unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &unlimited) } != 0 {
        tracing::debug!("cannot raise RLIMIT_MEMLOCK (fine on kernels >= 5.11)");
    }
}

async fn run(config: Config, listen: Option<std::net::SocketAddr>) -> Result<()> {
    require_privileges()?;
    let listen = listen.unwrap_or(config.listen);
    // Bind before loading anything: a port in use is the most common start failure.
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("cannot listen on {listen}"))?;
    let tracefs = tracefs::ensure_mounted()?;
    info!(tracefs = %tracefs.display(), "tracefs");
    raise_memlock();

    let _stats = if config.bpf_stats {
        Some(
            aya::sys::enable_stats(aya::sys::Stats::RunTime)
                .context("enabling BPF run-time stats")?,
        )
    } else {
        None
    };
    let mut probes = probes::load_and_attach()?;
    let ebpf = &mut probes.ebpf;
    let take = |ebpf: &mut aya::Ebpf, name: &str| {
        ebpf.take_map(name)
            .with_context(|| format!("map {name} missing from the eBPF object"))
    };
    let tracked_map: Array<_, u32> = take(ebpf, "TRACKED")?.try_into()?;
    let child_series_map: Array<_, u32> = take(ebpf, "CHILD_SERIES")?.try_into()?;
    let ring: RingBuf<_> = take(ebpf, "LIFECYCLE")?.try_into()?;
    let block_hist: PerCpuHashMap<_, _, _> = take(ebpf, "BLOCK_IO_HIST")?.try_into()?;
    let syscall_hist: PerCpuHashMap<_, _, _> = take(ebpf, "SYSCALL_HIST")?.try_into()?;
    let drops: PerCpuArray<_, u64> = take(ebpf, "DROPS")?.try_into()?;
    let program_fds = ebpf
        .programs()
        .filter_map(|(name, p)| Some((name.to_owned(), p.fd().ok()?.as_fd().as_raw_fd())))
        .collect();
    // Discovery attaches the title uretprobe to postgres binaries as it finds them.
    let probes::Probes { ebpf, status } = probes;
    let ebpf = Arc::new(Mutex::new(ebpf));

    let shared: SharedTracked = Arc::default();
    let mut discovery = Discovery::new(
        Classifier::new(config.compiled_rules()),
        shared.clone(),
        tracked_map,
        child_series_map,
        Some(probes::TitleProbe::new(ebpf.clone())),
    );
    // Nothing was tracked before: no process can be missing.
    let _gone = discovery.scan_all()?;
    info!(
        tracked = discovery::lock(&shared).pids.len(),
        "initial /proc scan done"
    );

    let collector = PgioCollector {
        block_io: Arc::new(block_io::BlockIoReader::new(block_hist)),
        syscall: Arc::new(syscall::SyscallReader::new(syscall_hist)),
        drops,
        tracked: shared.clone(),
        probes: status,
        program_fds,
        devices: Mutex::default(),
        volumes: Mutex::new(LonghornVolumes::new(config.longhorn_device_dir())),
    };
    let (block_io, syscall) = (collector.block_io.clone(), collector.syscall.clone());
    let fold_tracked = shared.clone();
    std::thread::Builder::new()
        .name("fold-provisional".into())
        .spawn(move || exposition::fold_provisional(block_io, syscall, fold_tracked))
        .context("starting the provisional-series thread")?;
    let registry = Arc::new(exposition::registry(collector));
    let discovery_task = tokio::spawn(discovery.run(ring, config.rescan_interval()));

    info!(%listen, "serving /metrics");
    let server =
        axum::serve(listener, http::router(registry)).with_graceful_shutdown(shutdown_signal());
    tokio::select! {
        r = server => r.context("HTTP server")?,
        r = discovery_task => {
            r.context("discovery task panicked")?.context("discovery")?;
        }
    }
    drop(ebpf);
    info!("probes detached, exiting");
    Ok(())
}

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        error!("cannot install signal handlers; stop with SIGKILL");
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => info!("SIGTERM"),
        _ = int.recv() => info!("SIGINT"),
    }
}
