//! `pgio-daemon run`: with all of pgio's privileges, `start` binds the listener, loads every
//! family's probes and takes their maps (`families::FAMILIES`), and scans /proc; then, with
//! fewer, `serve` runs the HTTP server, discovery and the once-a-second map pass.
use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use anyhow::{Context as _, Result, anyhow};
use tracing::{error, info, warn};

use crate::{
    bench_switch::{self, Attachments},
    check,
    classifier::{Classifier, rules},
    collector::Collector,
    config::Config,
    device_info::DeviceInfo,
    devices::{self, Devices},
    discovery::{self, Discovery},
    families::FAMILIES,
    health::Health,
    http,
    http_server::{self, HttpSelfMetrics, HttpStats},
    key_quota::{KeyQuota, KeyQuotaSource},
    lifecycle,
    map_memory::{self, MapMemory},
    pods, privileges, probes,
    self_metrics::{self, SelfMetrics},
    series::{self, KernelSeries, SharedTracked, Tracked},
    tracefs,
    tracked_processes::TrackedProcesses,
    web_config::{WebConfig, WebSelfMetrics},
};

/// Fails naming every capability pgio cannot run without; logs the ones it runs with less
/// without (other users' /proc files unreadable: fewer labels).
pub fn require_privileges() -> Result<()> {
    let mut missing = Vec::new();
    for f in check::privileges() {
        match f.level {
            check::Level::Fail => missing.push(f.what),
            check::Level::Warn => warn!("{}", f.what),
            check::Level::Ok => {}
        }
    }
    // The kernel's own limits: the probes they refuse show in pgio_probe_attached.
    for f in check::restrictions::findings() {
        if f.level != check::Level::Ok {
            warn!("{}", f.what);
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
pub struct Started {
    config: Config,
    listener: std::net::TcpListener,
    ebpf: Arc<Mutex<aya::Ebpf>>,
    collector: Arc<Collector>,
    key_quota: Arc<KeyQuota>,
    discovery: Discovery,
    ring: aya::maps::RingBuf<aya::maps::MapData>,
    health: Arc<Health>,
    http_stats: Arc<HttpStats>,
    web: WebConfig,
    /// The links of the programs attached at start: dropped, they detach.
    attachments: Attachments,
    /// Serve the benchmark's switch (`--bench-switch`) on them.
    bench_switch: bool,
    /// Keeps `kernel.bpf_stats_enabled` on while pgio runs.
    _bpf_stats: Option<std::os::fd::OwnedFd>,
}

/// Loads and attaches everything and binds `listen`; with `bench_switch` the benchmark's
/// switch will serve on stdin (see `bench_switch`).
pub fn start(
    config: Config,
    web: WebConfig,
    listen: Option<std::net::SocketAddr>,
    bench_switch: bool,
) -> Result<Started> {
    require_privileges()?;
    let listen = listen.unwrap_or(config.addr(&http_server::LISTEN));
    // Bind before loading anything: a port in use is the most common start failure.
    let listener = http_server::listener::bind(listen)
        .with_context(|| format!("cannot listen on {listen}"))?;
    listener
        .set_nonblocking(true)
        .context("listening socket non-blocking")?;
    match privileges::raise_nofile() {
        Ok((soft, hard)) => info!(
            soft,
            hard,
            http_max_connections = config.count(&http_server::HTTP_MAX_CONNECTIONS),
            "open files limit"
        ),
        Err(e) => warn!("cannot raise the open files limit: {e}"),
    }
    let tracefs = tracefs::ensure_mounted()?;
    info!(tracefs = %tracefs.display(), "tracefs");
    raise_memlock();

    let bpf_stats = if config.flag(&self_metrics::BPF_STATS) {
        Some(
            aya::sys::enable_stats(aya::sys::Stats::RunTime)
                .context("enabling BPF run-time stats")?,
        )
    } else {
        None
    };
    // Before anything is created: maps that cannot fit the memory cgroup fail here, named.
    info!("{}", map_memory::require_fits(&config)?);
    let probes::Probes {
        mut ebpf,
        status,
        attachments,
    } = probes::load_and_attach(&config)?;
    let map_memory = MapMemory::measure(&ebpf);
    info!(
        maps = map_memory.maps.len(),
        bytes = map_memory.total(),
        "eBPF maps loaded: {} of kernel memory (fdinfo memlock)",
        map_memory::mib(map_memory.total())
    );
    let kernel_series = KernelSeries::take(&mut ebpf)?;
    let ring = lifecycle::take_ring(&mut ebpf)?;
    let health = Arc::new(Health::new(&ebpf, probes::DROPS_MAP).context("health probe")?);
    let http_stats = Arc::new(HttpStats::default());
    let shared: SharedTracked = Arc::new(Mutex::new(Tracked::with_limits(series::limits(&config))));
    crate::lock(&shared).provisional.grace = Some(crate::block_io::provisional_grace(&config));
    // Families are encoded in this order (device info last: it lists the devices the others
    // saw).
    let mut collector =
        Collector::new(shared.clone(), Devices::new(devices::longhorn_dir(&config)));
    let mut balanced = Vec::new();
    for family in FAMILIES {
        let taken = family
            .take(&mut ebpf, &config)
            .with_context(|| format!("family {}", family.name()))?;
        if let Some(source) = taken.source {
            collector.register(source);
        }
        balanced.extend(taken.balanced);
    }
    let key_quota = Arc::new(KeyQuota::take(&mut ebpf, shared.clone(), balanced)?);
    collector.register(Box::new(KeyQuotaSource(key_quota.clone())));
    collector.register(Box::new(TrackedProcesses));
    collector.register(Box::new(DeviceInfo));
    collector.register(Box::new(map_memory));
    let postgres_probe_stats = Arc::new(lifecycle::PostgresProbeStats::default());
    collector.register(Box::new(SelfMetrics::take(
        &mut ebpf,
        status,
        postgres_probe_stats.clone(),
    )?));
    collector.register(Box::new(HttpSelfMetrics(http_stats.clone())));
    if !web.is_plain() {
        collector.register(Box::new(WebSelfMetrics {
            http: http_stats.clone(),
            certificate: web.certificate.clone(),
            auth: web.auth.clone(),
        }));
    }
    let collector = Arc::new(collector);

    let pod_log_dir = config.text(&pods::POD_LOG_DIR);
    let container_log_dir = config.text(&pods::CONTAINER_LOG_DIR);
    if let Some(pods) = pods::from_config(&config) {
        match pods.known() {
            Ok(n) => info!(pods = n, dir = %pod_log_dir, "pod labels on"),
            // Not a Kubernetes node (or the directory is not mounted): nothing to name.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => info!(
                dir = %pod_log_dir,
                "no kubelet pod directory: no pod labels (in a pod, mount the kubelet's {} and {})",
                pod_log_dir, container_log_dir
            ),
            Err(e) => warn!(
                "pod labels on, but {}: {e}: no pod will be named (mount the kubelet's {} and {} read-only, or set pod_labels = false)",
                pod_log_dir, pod_log_dir, container_log_dir
            ),
        }
    }
    // Discovery attaches the title uretprobe to postgres binaries as it finds them.
    let ebpf = Arc::new(Mutex::new(ebpf));
    let mut discovery = Discovery::new(
        Classifier::new(rules::compile(&config.rules), pods::from_config(&config)),
        shared,
        kernel_series,
        Some(lifecycle::PostgresProbes::new(
            ebpf.clone(),
            probes::per_binary(&config),
            config.size(&lifecycle::MAX_POSTGRES_BINARIES),
            postgres_probe_stats,
        )),
        config.secs(&series::SERIES_RETENTION),
    );
    // Nothing was tracked before: no process can be missing.
    let _gone = discovery.scan_all()?;
    info!(tracked = discovery.tracked(), "initial /proc scan done");
    Ok(Started {
        config,
        listener,
        ebpf,
        collector,
        key_quota,
        discovery,
        ring,
        health,
        http_stats,
        web,
        attachments,
        bench_switch,
        _bpf_stats: bpf_stats,
    })
}

pub async fn serve(started: Started) -> Result<()> {
    let Started {
        config,
        listener,
        ebpf,
        collector,
        key_quota,
        discovery,
        ring,
        health,
        http_stats,
        web,
        attachments,
        bench_switch,
        _bpf_stats,
    } = started;
    // Held until the end: the links detach when dropped.
    let attachments = if bench_switch {
        bench_switch::spawn(ebpf.clone(), attachments)?;
        None
    } else {
        Some(attachments)
    };
    let listener = tokio::net::TcpListener::from_std(listener).context("listening socket")?;
    let passes = collector.clone();
    std::thread::Builder::new()
        .name("map-passes".into())
        .spawn(move || every_second(&passes, &key_quota))
        .context("starting the map-passes thread (provisional folds, map shares)")?;
    // Its own thread: a rescan of thousands of processes runs for a while without yielding,
    // and on a runtime worker it would hold back the scrapes queued on that worker.
    let (discovery_done, discovery_task) = tokio::sync::oneshot::channel();
    let rescan_every = config.secs(&discovery::RESCAN_INTERVAL);
    std::thread::Builder::new()
        .name("discovery".into())
        .spawn(move || {
            let r = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .context("starting the discovery thread's runtime")
                .and_then(|rt| rt.block_on(discovery.run(ring, rescan_every)));
            let _ = discovery_done.send(r);
        })
        .context("starting the discovery thread")?;

    // The bound address: with port 0 the kernel picked one.
    let bound = listener.local_addr().context("listening socket")?;
    let limits = http_server::Limits {
        header_timeout: config.secs(&http_server::HTTP_HEADER_TIMEOUT),
        idle_timeout: config.secs(&http_server::HTTP_IDLE_TIMEOUT),
        max_connections: config.size(&http_server::HTTP_MAX_CONNECTIONS),
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
            r.context("the discovery thread panicked")?.context("discovery")?;
        }
    }
    info!("HTTP server done; detaching the probes, exiting");
    // Closing a syscall tracepoint's link waits for a grace period: ~60 ms each on some hosts.
    drop(attachments);
    drop(ebpf);
    Ok(())
}

pub async fn shutdown_signal() {
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

/// The map pass (`Collector::pass`), then the map shares' balance, once a second.
fn every_second(collector: &Collector, key_quota: &KeyQuota) {
    for second in 0u64.. {
        if second % TRIM_EVERY_SECS == 0 {
            crate::heap::trim();
        }
        std::thread::sleep(Duration::from_secs(1));
        collector.pass(|| {
            if let Err(e) = key_quota.balance() {
                warn!(error = format!("{e:#}"), "balancing the histogram maps");
            }
        });
    }
}

/// How often malloc's free memory goes back to the kernel (see `heap`); the first time right
/// after start-up.
const TRIM_EVERY_SECS: u64 = 10;
