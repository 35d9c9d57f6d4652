//! pgio-daemon: per-node eBPF view of where PostgreSQL query time goes on the IO path.
use std::{
    os::fd::{AsFd, AsRawFd},
    path::PathBuf,
    process::ExitCode,
    sync::{Arc, Mutex},
};

use anyhow::{Context as _, Result, anyhow};
use clap::{Parser, Subcommand};
use tracing::{error, info, warn};

use pgio_daemon::{
    block_io, check,
    classifier::Classifier,
    collector::Collector,
    config::Config,
    device_info::DeviceInfo,
    devices::Devices,
    discovery::Discovery,
    health::Health,
    http,
    http_server::{self, HttpStats},
    key_quota::{KeyQuota, KeyQuotaSource},
    lifecycle, privileges, probes, query,
    self_metrics::{self, HttpSelfMetrics, SelfMetrics},
    series::{KernelSeries, SharedTracked, Tracked},
    syscall, tracefs,
    tracked_processes::TrackedProcesses,
    web_config::{WebConfig, WebSelfMetrics},
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
    },
    /// Report BTF, tracefs, each tracepoint and privileges; exit 1 naming what is missing.
    Check,
    /// A running daemon's latency histograms per interval, in the terminal (no root needed).
    Top(pgio_daemon::top::TopArgs),
    /// Benchmark fixture: attach empty programs to pread64's hooks until SIGTERM.
    #[command(hide = true)]
    Floor {
        /// Which hooks: the syscall tracepoints, fentry/fexit, or the `part_*` programs that
        /// each do one piece of pgio's syscall timing.
        #[arg(long, value_enum, default_value = "tracepoint")]
        hooks: probes::FloorHooks,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Check => run_check(),
        Command::Top(args) => match pgio_daemon::top::run(args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("pgio-daemon top: {e:#}");
                ExitCode::FAILURE
            }
        },
        Command::Floor { hooks } => match run_floor(hooks) {
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
                .map(Config::load)
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
            let started = match start(config, web, listen) {
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

fn run_floor(hooks: probes::FloorHooks) -> Result<()> {
    require_privileges()?;
    tracefs::ensure_mounted()?;
    let ebpf = probes::load_floor(hooks)?;
    println!("ready");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(shutdown_signal());
    // For `cargo xtask bench`: the programs' run time (kernel.bpf_stats_enabled) at exit.
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

/// Fails naming every capability pgio cannot run without; logs the ones it runs with less
/// without (other users' /proc files unreadable: fewer labels).
fn require_privileges() -> Result<()> {
    let mut missing = Vec::new();
    for f in check::privileges() {
        match f.level {
            check::Level::Fail => missing.push(f.what),
            check::Level::Warn => warn!("{}", f.what),
            check::Level::Ok => {}
        }
    }
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

/// What `start` set up with all of pgio's privileges, for `serve` to run with fewer.
struct Started {
    config: Config,
    listener: std::net::TcpListener,
    ebpf: Arc<Mutex<aya::Ebpf>>,
    collector: Arc<Collector>,
    discovery: Discovery,
    ring: aya::maps::RingBuf<aya::maps::MapData>,
    health: Arc<Health>,
    http_stats: Arc<HttpStats>,
    web: WebConfig,
    /// Keeps `kernel.bpf_stats_enabled` on while pgio runs.
    _bpf_stats: Option<std::os::fd::OwnedFd>,
}

fn start(config: Config, web: WebConfig, listen: Option<std::net::SocketAddr>) -> Result<Started> {
    require_privileges()?;
    let listen = listen.unwrap_or(config.listen);
    // Bind before loading anything: a port in use is the most common start failure.
    let listener = std::net::TcpListener::bind(listen)
        .with_context(|| format!("cannot listen on {listen}"))?;
    listener
        .set_nonblocking(true)
        .context("listening socket non-blocking")?;
    match privileges::raise_nofile() {
        Ok((soft, hard)) => info!(
            soft,
            hard,
            http_max_connections = config.http_max_connections,
            "open files limit"
        ),
        Err(e) => warn!("cannot raise the open files limit: {e}"),
    }
    let tracefs = tracefs::ensure_mounted()?;
    info!(tracefs = %tracefs.display(), "tracefs");
    raise_memlock();

    let hist_sizes = config.hist_map_sizes();
    let bpf_stats = if config.bpf_stats {
        Some(
            aya::sys::enable_stats(aya::sys::Stats::RunTime)
                .context("enabling BPF run-time stats")?,
        )
    } else {
        None
    };
    let probes::Probes { mut ebpf, status } =
        probes::load_and_attach(config.query_probes, hist_sizes)?;
    let kernel_series = KernelSeries::take(&mut ebpf)?;
    let ring = lifecycle::take_ring(&mut ebpf)?;
    let health = Arc::new(Health::new(&ebpf, self_metrics::DROPS_MAP).context("health probe")?);
    let http_stats = Arc::new(HttpStats::default());
    let shared: SharedTracked = Arc::new(Mutex::new(Tracked::with_limits(config.series_limits())));
    // One registration per source; families are encoded in this order (device info last:
    // it lists the devices the others saw).
    let mut collector = Collector::new(shared.clone(), Devices::new(config.longhorn_device_dir()));
    let block_io = block_io::BlockIo::take(
        &mut ebpf,
        config.block_inflight_timeout(),
        hist_sizes.block_io,
    )?;
    let syscalls = syscall::Syscalls::take(&mut ebpf, hist_sizes.syscall)?;
    let queries = query::Queries::take(&mut ebpf, hist_sizes.query)?;
    let key_quota = Arc::new(KeyQuota::take(
        &mut ebpf,
        shared.clone(),
        vec![block_io.balanced(), syscalls.balanced(), queries.balanced()],
    )?);
    collector.register(block_io);
    collector.register(syscalls);
    collector.register(queries);
    collector.register(KeyQuotaSource(key_quota.clone()));
    collector.set_key_quota(key_quota);
    collector.register(TrackedProcesses);
    collector.register(DeviceInfo);
    let postgres_probe_stats = Arc::new(lifecycle::PostgresProbeStats::default());
    collector.register(SelfMetrics::take(
        &mut ebpf,
        status,
        postgres_probe_stats.clone(),
    )?);
    collector.register(HttpSelfMetrics(http_stats.clone()));
    if !web.is_plain() {
        collector.register(WebSelfMetrics {
            http: http_stats.clone(),
            tls: web.tls.is_some(),
            auth: web.auth.clone(),
        });
    }
    let collector = Arc::new(collector);

    if let Some(pods) = config.pods() {
        match pods.known() {
            Ok(n) => info!(pods = n, dir = %config.pod_log_dir, "pod labels on"),
            // Not a Kubernetes node (or the directory is not mounted): nothing to name.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => info!(
                dir = %config.pod_log_dir,
                "no kubelet pod directory: no pod labels (in a pod, mount the kubelet's {} and {})",
                config.pod_log_dir, config.container_log_dir
            ),
            Err(e) => warn!(
                "pod labels on, but {}: {e}: no pod will be named (mount the kubelet's {} and {} read-only, or set pod_labels = false)",
                config.pod_log_dir, config.pod_log_dir, config.container_log_dir
            ),
        }
    }
    // Discovery attaches the title uretprobe to postgres binaries as it finds them.
    let ebpf = Arc::new(Mutex::new(ebpf));
    let mut discovery = Discovery::new(
        Classifier::new(config.compiled_rules(), config.pods()),
        shared,
        kernel_series,
        Some(lifecycle::PostgresProbes::new(
            ebpf.clone(),
            config.query_probes,
            config.max_postgres_binaries,
            postgres_probe_stats,
        )),
        config.series_retention(),
    );
    // Nothing was tracked before: no process can be missing.
    let _gone = discovery.scan_all()?;
    info!(tracked = discovery.tracked(), "initial /proc scan done");
    Ok(Started {
        config,
        listener,
        ebpf,
        collector,
        discovery,
        ring,
        health,
        http_stats,
        web,
        _bpf_stats: bpf_stats,
    })
}

async fn serve(started: Started) -> Result<()> {
    let Started {
        config,
        listener,
        ebpf,
        collector,
        discovery,
        ring,
        health,
        http_stats,
        web,
        _bpf_stats,
    } = started;
    let listener = tokio::net::TcpListener::from_std(listener).context("listening socket")?;
    let passes = collector.clone();
    std::thread::Builder::new()
        .name("map-passes".into())
        .spawn(move || passes.every_second())
        .context("starting the map-passes thread (provisional folds, map shares)")?;
    let discovery_task = tokio::spawn(discovery.run(ring, config.rescan_interval()));

    // The bound address: with port 0 the kernel picked one.
    let bound = listener.local_addr().context("listening socket")?;
    let limits = http_server::Limits {
        header_timeout: config.http_header_timeout(),
        idle_timeout: config.http_idle_timeout(),
        max_connections: config.http_max_connections,
    };
    info!(
        listen = %bound,
        header_timeout = ?limits.header_timeout,
        idle_timeout = ?limits.idle_timeout,
        max_connections = limits.max_connections,
        tls = web.tls.is_some(),
        basic_auth_users = web.auth.as_ref().map_or(0, |a| a.users()),
        "serving /metrics"
    );
    if web.auth.is_some() && web.tls.is_none() {
        warn!("basic auth without TLS: passwords cross the network in clear text");
    }
    let server = http_server::serve(
        listener,
        web.tls,
        http::router(collector, health, web.auth),
        limits,
        http_stats,
        shutdown_signal(),
    );
    tokio::select! {
        () = server => {}
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
