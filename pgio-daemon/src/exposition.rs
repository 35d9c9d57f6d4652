//! Collector → Prometheus exposition. Reads the kernel maps at scrape time, turns series ids
//! into labels, and encodes with prometheus-client (OpenMetrics text), converted to the
//! Prometheus 0.0.4 text format unless the scraper asks for OpenMetrics.
use std::{
    collections::BTreeMap,
    fmt::{self, Write as _},
    os::fd::RawFd,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
};

use aya::maps::{MapData, PerCpuArray};
use pgio_common::{
    DROP_REASONS, Drop,
    block_io::{BlockOp, dev_major, dev_minor},
    syscall::{Cache, Syscall},
};
use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeLabelSet, NoLabelSet},
    metrics::MetricType,
    registry::Registry,
};
use tracing::warn;

use crate::{
    block_io::{BlockIoReader, BlockIoSnapshot},
    devices::{DeviceNames, LonghornVolumes},
    discovery::{SharedTracked, Tracked, lock},
    hist::Log2Hist,
    labels::{BlockLabels, Labels, WithLabels},
    probes::ProbeStatus,
    syscall::{SyscallId, SyscallReader},
};

pub struct PgioCollector {
    /// Shared with `fold_provisional`, which empties provisional keys between scrapes.
    pub block_io: Arc<BlockIoReader>,
    pub syscall: Arc<SyscallReader>,
    pub drops: PerCpuArray<MapData, u64>,
    pub tracked: SharedTracked,
    pub probes: Vec<ProbeStatus>,
    /// (program name, fd) for the per-program run time/count from /proc/self/fdinfo.
    pub program_fds: Vec<(String, RawFd)>,
    pub devices: Mutex<DeviceNames>,
    /// Device → Longhorn volume, read again at every scrape.
    pub volumes: Mutex<LonghornVolumes>,
}

impl fmt::Debug for PgioCollector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("PgioCollector")
    }
}

const HELP_DEVICE: &str =
    "Block request device time, issue to complete, by submitting process series (seconds).";
const HELP_QUEUE: &str = "Block request queue time, insert to issue, for requests that went through a scheduler queue (seconds).";
const HELP_REQUESTS: &str = "Block requests completed, by submitting process series.";
const HELP_BYTES: &str = "Bytes of block requests completed, by submitting process series.";
const HELP_SYSCALL: &str = "IO syscall latency, enter to exit, per tracked process series; cache=miss when the calling thread submitted block IO during a read (seconds).";
const HELP_FUTEX: &str = "futex waits (WAIT, WAIT_BITSET, LOCK_PI, LOCK_PI2, WAIT_REQUEUE_PI; futex_waitv), enter to exit (seconds). Not IO. In Go programs such as the Longhorn engine and replicas most of this is the Go runtime parking idle threads (scheduler and sysmon sleeps), not waiting on replicas, IO or locks: it grows with idle threads, not with latency.";

fn histograms<'a, L: EncodeLabelSet + 'a>(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    items: impl Iterator<Item = (L, &'a Log2Hist)>,
) -> fmt::Result {
    let mut m = enc.encode_descriptor(name, help, None, MetricType::Histogram)?;
    for (labels, h) in items {
        let buckets = h.prometheus_buckets();
        m.encode_family(&labels)?.encode_histogram::<NoLabelSet>(
            h.sum_seconds(),
            h.count(),
            &buckets,
            None,
        )?;
    }
    Ok(())
}

fn counters<L: EncodeLabelSet>(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    items: impl Iterator<Item = (L, u64)>,
) -> fmt::Result {
    let mut m = enc.encode_descriptor(name, help, None, MetricType::Counter)?;
    for (labels, v) in items {
        m.encode_family(&labels)?
            .encode_counter::<NoLabelSet, u64, u64>(&v, None)?;
    }
    Ok(())
}

fn gauges<L: EncodeLabelSet>(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    items: impl Iterator<Item = (L, i64)>,
) -> fmt::Result {
    let mut m = enc.encode_descriptor(name, help, None, MetricType::Gauge)?;
    for (labels, v) in items {
        m.encode_family(&labels)?.encode_gauge(&v)?;
    }
    Ok(())
}

/// Fixed labels of an info metric; empty values are left out.
struct NonEmpty<const N: usize>([(&'static str, String); N]);

impl<const N: usize> EncodeLabelSet for NonEmpty<N> {
    fn encode(&self, encoder: &mut prometheus_client::encoding::LabelSetEncoder) -> fmt::Result {
        use prometheus_client::encoding::EncodeLabel;
        for (k, v) in self.0.iter().filter(|(_, v)| !v.is_empty()) {
            (*k, v.as_str()).encode(encoder.encode_label())?;
        }
        Ok(())
    }
}

/// `run_time_ns`, `run_cnt`, `recursion_misses` of one program.
pub fn program_stats(fd: RawFd) -> Option<(u64, u64, u64)> {
    let text = std::fs::read_to_string(format!("/proc/self/fdinfo/{fd}")).ok()?;
    let field = |k: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(k)?.trim().parse::<u64>().ok())
            .unwrap_or(0)
    };
    Some((
        field("run_time_ns:"),
        field("run_cnt:"),
        field("recursion_misses:"),
    ))
}

/// Everything one scrape reads from the kernel, before labels are attached.
#[derive(Debug, Default)]
pub struct Snapshot {
    pub block: BlockIoSnapshot,
    pub syscalls: BTreeMap<SyscallId, Log2Hist>,
    pub dev_names: BTreeMap<u32, String>,
    /// Longhorn volume of each device that is one (dev → volume).
    pub dev_volumes: BTreeMap<u32, String>,
    pub probes: Vec<ProbeStatus>,
    pub drops: [u64; DROP_REASONS],
    /// (program, (run_time_ns, run_cnt, recursion_misses))
    pub programs: Vec<(String, (u64, u64, u64))>,
}

impl PgioCollector {
    pub fn snapshot(&self) -> Snapshot {
        // A copy, so discovery is not held up while the maps are read; a process classified
        // meanwhile is still pending here and folded at the next scrape.
        let routes = lock(&self.tracked).provisional_routes();
        let route = |series| routes.route(series);
        let block = self.block_io.read(route).unwrap_or_else(|e| {
            warn!(error = format!("{e:#}"), "reading block IO map");
            Default::default()
        });
        let syscalls = self.syscall.read(route).unwrap_or_else(|e| {
            warn!(error = format!("{e:#}"), "reading syscall map");
            BTreeMap::new()
        });
        let mut volumes = self.volumes.lock().unwrap_or_else(|e| e.into_inner());
        volumes.refresh();
        let dev_volumes: BTreeMap<u32, String> =
            volumes.iter().map(|(d, v)| (d, v.to_owned())).collect();
        drop(volumes);
        let mut devices = self.devices.lock().unwrap_or_else(|e| e.into_inner());
        let mut dev_names = BTreeMap::new();
        // Longhorn devices are listed in pgio_device_info before their first IO.
        let seen = block
            .device
            .keys()
            .chain(block.queue.keys())
            .map(|k| k.1)
            .chain(block.unmatched.keys().map(|k| k.0));
        for dev in seen.chain(dev_volumes.keys().copied()) {
            dev_names.entry(dev).or_insert_with(|| devices.name(dev));
        }
        drop(devices);
        let mut drops = [0; DROP_REASONS];
        for d in Drop::ALL {
            drops[d as usize] = self
                .drops
                .get(&(d as u32), 0)
                .map(|v| v.iter().sum::<u64>())
                .unwrap_or(0);
        }
        let programs = self
            .program_fds
            .iter()
            .filter_map(|(name, fd)| Some((name.clone(), program_stats(*fd)?)))
            .collect();
        Snapshot {
            block,
            syscalls,
            dev_names,
            dev_volumes,
            probes: self.probes.clone(),
            drops,
            programs,
        }
    }
}

/// Moves the events of processes classified since the last pass out of their provisional
/// kernel keys, once a second while there are any. Waiting for the next scrape would let them
/// pile up: under heavy connection churn (a thousand new backends a second, a 30 s scrape
/// interval) they could fill the histogram maps.
pub fn fold_provisional(
    block_io: Arc<BlockIoReader>,
    syscall: Arc<SyscallReader>,
    tracked: SharedTracked,
) {
    loop {
        std::thread::sleep(std::time::Duration::from_secs(1));
        let routes = {
            let mut t = lock(&tracked);
            if !t.provisional.take_closed_since_fold() {
                continue;
            }
            t.provisional_routes()
        };
        let route = |series| routes.route(series);
        if let Err(e) = block_io.read(route).and_then(|_| syscall.read(route)) {
            warn!(error = format!("{e:#}"), "folding provisional series");
        }
    }
}

impl Collector for PgioCollector {
    fn encode(&self, enc: DescriptorEncoder) -> fmt::Result {
        let snap = self.snapshot();
        encode_snapshot(&snap, &lock(&self.tracked), enc)
    }
}

/// A snapshot taken once, encoded at every scrape: for tests and benchmarks of the
/// exposition without kernel maps.
pub struct FixedSnapshot(pub Snapshot, pub Tracked);

impl fmt::Debug for FixedSnapshot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("FixedSnapshot")
    }
}

impl Collector for FixedSnapshot {
    fn encode(&self, enc: DescriptorEncoder) -> fmt::Result {
        encode_snapshot(&self.0, &self.1, enc)
    }
}

/// Labels the snapshot with the series registry and encodes every pgio metric family.
pub fn encode_snapshot(
    snap: &Snapshot,
    tracked: &Tracked,
    mut enc: DescriptorEncoder,
) -> fmt::Result {
    let (block, syscalls, dev_names) = (&snap.block, &snap.syscalls, &snap.dev_names);
    let other = Labels::app_role("other", "");
    let series = |id: u32| tracked.registry.labels(id).unwrap_or(&other);
    // `volume` on block series: the device's Longhorn volume, else the submitter's (see
    // `BlockLabels`).
    let block_labels = |(s, dev, op): &(u32, u32, u8)| BlockLabels {
        series: series(*s),
        device: dev_names.get(dev).map(String::as_str).unwrap_or(""),
        op: BlockOp::from_u8(*op).name(),
        device_volume: snap.dev_volumes.get(dev).map(String::as_str),
    };

    histograms(
        &mut enc,
        "pgio_block_io_device_seconds",
        HELP_DEVICE,
        block.device.iter().map(|(id, h)| (block_labels(id), h)),
    )?;
    histograms(
        &mut enc,
        "pgio_block_io_queue_seconds",
        HELP_QUEUE,
        block.queue.iter().map(|(id, h)| (block_labels(id), h)),
    )?;
    counters(
        &mut enc,
        "pgio_block_io_requests",
        HELP_REQUESTS,
        block
            .device
            .iter()
            .map(|(id, h)| (block_labels(id), h.count())),
    )?;
    counters(
        &mut enc,
        "pgio_block_io_bytes",
        HELP_BYTES,
        block
            .device
            .iter()
            .map(|(id, h)| (block_labels(id), h.bytes)),
    )?;

    let syscall_labels = |(s, sc, cache): &(u32, u8, u8)| WithLabels {
        series: series(*s),
        extra: [
            (
                "syscall",
                Syscall::from_u8(*sc)
                    .map(Syscall::name)
                    .unwrap_or("unknown"),
            ),
            ("cache", Cache::from_u8(*cache).label()),
        ],
    };
    let is_futex = |sc: u8| {
        matches!(
            Syscall::from_u8(sc),
            Some(Syscall::Futex | Syscall::FutexWaitv)
        )
    };
    histograms(
        &mut enc,
        "pgio_syscall_seconds",
        HELP_SYSCALL,
        syscalls
            .iter()
            .filter(|(id, _)| !is_futex(id.1))
            .map(|(id, h)| (syscall_labels(id), h)),
    )?;
    histograms(
        &mut enc,
        "pgio_futex_wait_seconds",
        HELP_FUTEX,
        syscalls
            .iter()
            .filter(|(id, _)| is_futex(id.1))
            .map(|(id, h)| (syscall_labels(id), h)),
    )?;

    let mut per_series: BTreeMap<u32, i64> = BTreeMap::new();
    for id in tracked.pids.values() {
        *per_series.entry(*id).or_default() += 1;
    }
    gauges(
        &mut enc,
        "pgio_tracked_processes",
        "Processes pgio tracks now, by series.",
        per_series.iter().map(|(id, n)| (series(*id), *n)),
    )?;
    gauges(
        &mut enc,
        "pgio_device_info",
        "Block devices seen by pgio, and Longhorn volume devices: name, kernel major:minor and the Longhorn volume it is, if any (value is always 1).",
        dev_names.iter().map(|(dev, name)| {
            let major = dev_major(*dev).to_string();
            let minor = dev_minor(*dev).to_string();
            let volume = snap.dev_volumes.get(dev).cloned().unwrap_or_default();
            let labels = [
                ("device", name.clone()),
                ("major", major),
                ("minor", minor),
                ("volume", volume),
            ];
            (NonEmpty(labels), 1)
        }),
    )?;

    gauges(
        &mut enc,
        "pgio_probe_attached",
        "1 when the eBPF program is attached, 0 when this kernel lacks its hook.",
        snap.probes
            .iter()
            .map(|p| ([("program", p.program.as_str())], p.attached as i64)),
    )?;
    let dropped = |d: Drop| snap.drops[d as usize];
    counters(
        &mut enc,
        "pgio_events_dropped",
        "Kernel events pgio could not record, by reason.",
        Drop::ALL
            .iter()
            .map(|d| ([("reason", d.reason())], dropped(*d))),
    )?;
    counters(
        &mut enc,
        "pgio_block_io_unmatched_completions",
        "block_rq_complete events pgio could not match to a request it saw start and issue, by device and op: the second completion of requests in a flush sequence (PREFLUSH/FUA writes), empty flushes (their flush request is counted), or requests issued before pgio started. Not lost IO as a rule.",
        snap.block.unmatched.iter().map(|((dev, op), n)| {
            (
                [
                    ("device", snap.dev_names.get(dev).map_or("", String::as_str)),
                    ("op", BlockOp::from_u8(*op).name()),
                ],
                *n,
            )
        }),
    )?;
    enc.encode_descriptor(
        "pgio_exits_missed",
        "Tracked processes the periodic /proc rescan found gone although no exit event untracked them (lost lifecycle events). Should stay 0; until the rescan, such a process is still counted in pgio_tracked_processes.",
        None,
        MetricType::Counter,
    )?
    .encode_counter::<NoLabelSet, u64, u64>(&tracked.exits_missed, None)?;
    let stats: Vec<(&str, (u64, u64, u64))> = snap
        .programs
        .iter()
        .map(|(n, s)| (n.as_str(), *s))
        .collect();
    let mut m = enc.encode_descriptor(
        "pgio_bpf_program_run_seconds",
        "CPU time spent in each eBPF program (needs bpf_stats = true in the config, else 0).",
        None,
        MetricType::Counter,
    )?;
    for (name, (ns, _, _)) in &stats {
        m.encode_family(&[("program", *name)])?
            .encode_counter::<NoLabelSet, f64, f64>(&(*ns as f64 * 1e-9), None)?;
    }
    counters(
        &mut enc,
        "pgio_bpf_program_runs",
        "Runs of each eBPF program (needs bpf_stats = true in the config, else 0).",
        stats
            .iter()
            .map(|(name, (_, n, _))| ([("program", *name)], *n)),
    )?;
    counters(
        &mut enc,
        "pgio_bpf_recursion_misses",
        "Runs of each eBPF program the kernel skipped because another BPF program was running on that CPU.",
        stats
            .iter()
            .map(|(name, (_, _, r))| ([("program", *name)], *r)),
    )?;
    gauges(
        &mut enc,
        "pgio_build_info",
        "pgio version (value is always 1).",
        std::iter::once(([("version", env!("CARGO_PKG_VERSION"))], 1)),
    )
}

pub fn registry(collector: PgioCollector) -> Registry {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(collector));
    registry
}

/// OpenMetrics text as prometheus-client writes it.
pub fn openmetrics(registry: &Registry) -> Result<String, fmt::Error> {
    // Start at the last size (plus a margin): no reallocation while encoding.
    static LAST_LEN: AtomicUsize = AtomicUsize::new(64 * 1024);
    let mut out = String::with_capacity(LAST_LEN.load(Ordering::Relaxed) + 4096);
    prometheus_client::encoding::text::encode(&mut out, registry)?;
    LAST_LEN.store(out.len(), Ordering::Relaxed);
    Ok(out)
}

/// The same in the Prometheus 0.0.4 text format: no `# EOF`/`# UNIT`, and counter families
/// are declared under their `_total` sample name. Label values keep their escapes, so no
/// sample line can start with `#`.
pub fn prometheus_text(openmetrics: &str) -> String {
    let mut out = String::with_capacity(openmetrics.len());
    let mut lines = openmetrics.lines().peekable();
    while let Some(line) = lines.next() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        // prometheus-client writes `# HELP x`, then `# TYPE x <type>`.
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let name = rest.split(' ').next().unwrap_or_default();
            let counter = lines.peek().is_some_and(|next| {
                next.strip_prefix("# TYPE ") == Some(&format!("{name} counter"))
            });
            if counter {
                let _ = writeln!(out, "# HELP {name}_total{}", &rest[name.len()..]);
                let _ = writeln!(out, "# TYPE {name}_total counter");
                lines.next();
                continue;
            }
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openmetrics_counter_becomes_prometheus_total() {
        let om = "# HELP pgio_x Things.\n# TYPE pgio_x counter\npgio_x_total{a=\"b\"} 3\n# HELP pgio_h Lat.\n# TYPE pgio_h histogram\npgio_h_sum 0.5\npgio_h_count 1\npgio_h_bucket{le=\"+Inf\"} 1\n# EOF\n";
        let p = prometheus_text(om);
        assert_eq!(
            p,
            "# HELP pgio_x_total Things.\n# TYPE pgio_x_total counter\npgio_x_total{a=\"b\"} 3\n# HELP pgio_h Lat.\n# TYPE pgio_h histogram\npgio_h_sum 0.5\npgio_h_count 1\npgio_h_bucket{le=\"+Inf\"} 1\n"
        );
    }

    #[test]
    fn hostile_label_values_stay_on_one_line() {
        let labels = Labels {
            app: "postgres".into(),
            role: "client backend".into(),
            database: "we\"ird\nname\\ x".into(),
            user: "ü".into(),
            cluster: String::new(),
            volume: String::new(),
        };
        let h = Log2Hist::default();
        let mut registry = Registry::default();
        #[derive(Debug)]
        struct One(Labels, Log2Hist);
        impl Collector for One {
            fn encode(&self, mut enc: DescriptorEncoder) -> fmt::Result {
                histograms(
                    &mut enc,
                    "pgio_t_seconds",
                    "t",
                    std::iter::once((&self.0, &self.1)),
                )
            }
        }
        registry.register_collector(Box::new(One(labels, h)));
        let text = prometheus_text(&openmetrics(&registry).expect("encode"));
        for line in text.lines() {
            assert!(
                line.starts_with("# ") || line.starts_with("pgio_t_seconds"),
                "{line}"
            );
        }
        assert!(text.contains(r#"database="we\"ird\nname\\ x""#), "{text}");
        // empty cluster is left out
        assert!(!text.contains("cluster="), "{text}");
    }

    fn exposition(snap: Snapshot, tracked: Tracked) -> String {
        let mut registry = Registry::default();
        registry.register_collector(Box::new(FixedSnapshot(snap, tracked)));
        prometheus_text(&openmetrics(&registry).expect("encode"))
    }

    /// Label names of a sample line, in order; panics on a malformed line.
    fn label_names(line: &str) -> Vec<String> {
        let Some(start) = line.find('{') else {
            return Vec::new();
        };
        let mut names = Vec::new();
        let mut rest = &line[start + 1..];
        loop {
            let (name, after) = rest.split_once("=\"").expect(line);
            names.push(name.to_owned());
            let mut chars = after.char_indices();
            let end = loop {
                match chars.next().expect(line) {
                    (_, '\\') => {
                        chars.next();
                    }
                    (i, '"') => break i,
                    _ => {}
                }
            };
            rest = &after[end + 1..];
            if let Some(r) = rest.strip_prefix(',') {
                rest = r;
            } else {
                assert!(rest.starts_with("} "), "{line}");
                return names;
            }
        }
    }

    fn one_request() -> Log2Hist {
        let mut h = Log2Hist::default();
        h.add(
            pgio_common::hist::slot(100_000),
            &pgio_common::hist::Bucket {
                count: 1,
                sum: 100_000,
                bytes: 4096,
            },
        );
        h
    }

    /// A replica (volume pvc-a) reads its backing disk vda and, like a Postgres backend
    /// (no volume), the Longhorn device sdb of volume pvc-b.
    fn longhorn_fixture(replica_volume: &str, device_volume: &str) -> (Snapshot, Tracked) {
        use pgio_common::block_io::mkdev;
        let mut tracked = Tracked::default();
        let replica = tracked.registry.intern(Labels {
            volume: replica_volume.into(),
            ..Labels::app_role("longhorn", "replica")
        });
        let backend = tracked
            .registry
            .intern(Labels::app_role("postgres", "client backend"));
        let (vda, sdb) = (mkdev(253, 0), mkdev(8, 16));
        let mut snap = Snapshot::default();
        for (series, dev) in [(replica, vda), (replica, sdb), (backend, sdb)] {
            let id = (series, dev, BlockOp::Read as u8);
            snap.block.device.insert(id, one_request());
            snap.block.queue.insert(id, one_request());
        }
        snap.dev_names.insert(vda, "vda".into());
        snap.dev_names.insert(sdb, "sdb".into());
        snap.dev_volumes.insert(sdb, device_volume.into());
        (snap, tracked)
    }

    fn samples<'a>(text: &'a str, prefix: &str) -> Vec<&'a str> {
        text.lines()
            .filter(|l| l.starts_with(prefix) && !l.contains("_bucket{"))
            .collect()
    }

    #[test]
    fn block_series_volume_is_the_devices_else_the_submitters() {
        let text = exposition_text_checked(longhorn_fixture("pvc-a", "pvc-b"));
        for family in [
            "pgio_block_io_device_seconds_count",
            "pgio_block_io_queue_seconds_count",
            "pgio_block_io_requests_total",
            "pgio_block_io_bytes_total",
        ] {
            let lines = samples(&text, &format!("{family}{{"));
            assert_eq!(
                lines
                    .iter()
                    .map(|l| l.rsplit_once(' ').map(|s| s.0))
                    .collect::<Vec<_>>(),
                [
                    Some(&*format!(
                        "{family}{{device=\"sdb\",op=\"read\",app=\"longhorn\",role=\"replica\",volume=\"pvc-b\"}}"
                    )),
                    Some(&*format!(
                        "{family}{{device=\"vda\",op=\"read\",app=\"longhorn\",role=\"replica\",volume=\"pvc-a\"}}"
                    )),
                    Some(&*format!(
                        "{family}{{device=\"sdb\",op=\"read\",app=\"postgres\",role=\"client backend\",volume=\"pvc-b\"}}"
                    )),
                ],
                "{text}"
            );
        }
        let info = samples(&text, "pgio_device_info{");
        assert_eq!(
            info,
            [
                "pgio_device_info{device=\"sdb\",major=\"8\",minor=\"16\",volume=\"pvc-b\"} 1",
                "pgio_device_info{device=\"vda\",major=\"253\",minor=\"0\"} 1",
            ],
            "{text}"
        );
    }

    /// Encodes, and checks every line: a comment or a pgio sample whose label names are
    /// unique.
    fn exposition_text_checked((snap, tracked): (Snapshot, Tracked)) -> String {
        let text = exposition(snap, tracked);
        for line in text.lines() {
            if line.starts_with("# ") {
                continue;
            }
            assert!(line.starts_with("pgio_"), "{line}");
            let names = label_names(line);
            let mut unique = names.clone();
            unique.sort();
            unique.dedup();
            assert_eq!(names.len(), unique.len(), "duplicate label name: {line}");
        }
        text
    }

    #[test]
    fn no_volume_anywhere_means_no_volume_label() {
        let text = exposition_text_checked(longhorn_fixture("", ""));
        assert!(!text.contains("volume="), "{text}");
    }

    #[test]
    fn hostile_volume_names_stay_escaped_on_one_line() {
        let hostile = "pvc-\"x\"\n# EOF\\ ü} 1";
        let text = exposition_text_checked(longhorn_fixture(hostile, hostile));
        let escaped = r#"volume="pvc-\"x\"\n# EOF\\ ü} 1""#;
        // Every block sample (the replica's on vda too) and sdb's device_info carry it.
        let lines: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("pgio_") && l.contains("device=\""))
            .filter(|l| !l.starts_with("pgio_device_info{device=\"vda\""))
            .collect();
        assert!(lines.len() > 3 * 4, "{text}");
        for line in lines {
            assert!(line.contains(escaped), "{line}");
        }
    }
}
