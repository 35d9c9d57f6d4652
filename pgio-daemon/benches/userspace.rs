//! Userspace hot spots: encoding /metrics for 5,000 series, classifying 10,000 process titles,
//! a full /proc scan. `cargo xtask bench` runs these and puts the figures in BENCHMARKS.md.
use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use pgio_common::{
    SeriesId,
    block_io::{BlockMetric, BlockOp, dev_major, dev_minor, mkdev},
    hist::{Bucket, slot},
    syscall::{Cache, Syscall},
};
use pgio_daemon::{
    block_io::{BlockIoId, BlockIoSnapshot},
    classifier::{Classifier, ProcessInfo, rules::Rule},
    collector::{self, Snapshot},
    device_info::DeviceInfo,
    devices::Devices,
    exposition::{Encoder, Format},
    hist::{Log2Hist, MAX_SLOT, MIN_SLOT, le_seconds},
    labels::Labels,
    proc_scan::classify_all,
    series::Tracked,
    syscall::{SyscallId, SyscallSnapshot},
    tracked_processes::TrackedProcesses,
};

fn hist(seed: u64) -> Log2Hist {
    let mut h = Log2Hist::default();
    for i in 0..12u64 {
        let ns = 1_000 << ((seed + i) % 14);
        h.add(
            slot(ns),
            &Bucket {
                count: 1 + i,
                sum: ns * (1 + i),
                bytes: 8192,
            },
        );
    }
    h
}

struct Fixture {
    block: BlockIoSnapshot,
    syscalls: SyscallSnapshot,
    tracked: Tracked,
    names: Vec<(u32, String)>,
}

/// `label_sets` client-backend label sets (databases × 20 users), each with a pread64 hit and
/// miss histogram and a futex histogram, plus block device and queue histograms on 4 devices
/// for a fifth of them. Each histogram is 31 sample lines (28 buckets, sum, count, ...).
fn fixture(label_sets: u32) -> Fixture {
    let mut tracked = Tracked::default();
    let (mut block, mut syscalls) = (BlockIoSnapshot::default(), SyscallSnapshot::default());
    for i in 0..label_sets {
        let series = tracked.registry.intern(Labels {
            app: "postgres".into(),
            role: "client backend".into(),
            database: format!("db_{}", i / 20),
            user: format!("user_{}", i % 20),
            cluster: "15/main".into(),
            ..Labels::default()
        });
        tracked.pids.insert(10_000 + i, series);
        for (syscall, cache, seed) in [
            (Syscall::Pread64, Cache::Hit, 0),
            (Syscall::Pread64, Cache::Miss, 0),
            (Syscall::Futex, Cache::None, 3),
        ] {
            let id = SyscallId {
                series,
                syscall,
                cache,
            };
            syscalls.0.insert(id, hist(i as u64 + seed));
        }
        if i < label_sets / 5 {
            let dev = mkdev(7, i % 4);
            for (metric, seed) in [(BlockMetric::Device, 1), (BlockMetric::Queue, 2)] {
                let id = BlockIoId {
                    series,
                    dev,
                    op: BlockOp::Read,
                    metric,
                };
                block.0.insert(id, hist(i as u64 + seed));
            }
        }
    }
    let names = (0..4).map(|m| (mkdev(7, m), format!("loop{m}"))).collect();
    Fixture {
        block,
        syscalls,
        tracked,
        names,
    }
}

/// What `/metrics` writes for these readings.
fn pgio(f: &Fixture, devices: &mut Devices, format: Format) -> Vec<u8> {
    let mut enc = Encoder::new(format, 0);
    let sources: [&dyn Snapshot; 4] = [&f.block, &f.syscalls, &TrackedProcesses, &DeviceInfo];
    collector::encode(sources, &f.tracked, devices, &mut enc);
    enc.finish()
}

/// The baseline: the same families encoded the way pgio did before its own encoder, with
/// prometheus-client (OpenMetrics), rewritten into the 0.0.4 text format afterwards.
mod before {
    use std::fmt::{self, Write as _};

    use prometheus_client::{
        collector::Collector,
        encoding::{DescriptorEncoder, EncodeLabel, EncodeLabelSet, LabelSetEncoder, NoLabelSet},
        metrics::MetricType,
        registry::Registry,
    };

    use super::*;

    struct PcLabels<'a, const N: usize>([(&'static str, &'a str); N]);

    impl<const N: usize> EncodeLabelSet for PcLabels<'_, N> {
        fn encode(&self, encoder: &mut LabelSetEncoder) -> fmt::Result {
            for (k, v) in self.0.iter().filter(|(_, v)| !v.is_empty()) {
                (*k, *v).encode(encoder.encode_label())?;
            }
            Ok(())
        }
    }

    fn series<'a, const N: usize>(
        extra: [(&'static str, &'a str); N],
        l: &'a Labels,
    ) -> PcLabels<'a, 8> {
        let mut out = [("", ""); 8];
        let labels = extra.into_iter().chain([
            ("app", l.app.as_str()),
            ("role", l.role.as_str()),
            ("database", l.database.as_str()),
            ("user", l.user.as_str()),
            ("pg_cluster", l.cluster.as_str()),
            ("volume", l.volume.as_str()),
        ]);
        for (slot, label) in out.iter_mut().zip(labels) {
            *slot = label;
        }
        PcLabels(out)
    }

    fn buckets(h: &Log2Hist) -> Vec<(f64, u64)> {
        (MIN_SLOT..=MAX_SLOT)
            .map(le_seconds)
            .chain([f64::INFINITY])
            .zip(h.bucket_counts())
            .collect()
    }

    pub struct Fixed(pub Fixture);

    impl fmt::Debug for Fixed {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("Fixed")
        }
    }

    impl Collector for Fixed {
        fn encode(&self, mut enc: DescriptorEncoder) -> fmt::Result {
            let f = &self.0;
            let labels = |s: SeriesId| f.tracked.registry.exported(s);
            let name = |dev: u32| {
                f.names
                    .iter()
                    .find(|(d, _)| *d == dev)
                    .map_or("", |(_, n)| n.as_str())
            };
            for (family, metric) in [
                ("pgio_block_io_device_seconds", BlockMetric::Device),
                ("pgio_block_io_queue_seconds", BlockMetric::Queue),
            ] {
                let mut m = enc.encode_descriptor(family, "h", None, MetricType::Histogram)?;
                for (id, h) in f.block.0.iter().filter(|(id, _)| id.metric == metric) {
                    let l = series(
                        [("device", name(id.dev)), ("op", id.op.name())],
                        labels(id.series),
                    );
                    m.encode_family(&l)?.encode_histogram::<NoLabelSet>(
                        h.sum_seconds(),
                        h.count(),
                        &buckets(h),
                        None,
                    )?;
                }
            }
            for (family, bytes) in [
                ("pgio_block_io_requests", false),
                ("pgio_block_io_bytes", true),
            ] {
                let mut m = enc.encode_descriptor(family, "c", None, MetricType::Counter)?;
                for (id, h) in f
                    .block
                    .0
                    .iter()
                    .filter(|(id, _)| id.metric == BlockMetric::Device)
                {
                    let l = series(
                        [("device", name(id.dev)), ("op", id.op.name())],
                        labels(id.series),
                    );
                    let v = if bytes { h.bytes } else { h.count() };
                    m.encode_family(&l)?
                        .encode_counter::<NoLabelSet, u64, u64>(&v, None)?;
                }
            }
            for (family, futex) in [
                ("pgio_syscall_seconds", false),
                ("pgio_futex_wait_seconds", true),
            ] {
                let mut m = enc.encode_descriptor(family, "h", None, MetricType::Histogram)?;
                for (id, h) in &f.syscalls.0 {
                    if id.syscall.is_wait() != futex {
                        continue;
                    }
                    let l = series(
                        [("syscall", id.syscall.name()), ("cache", id.cache.name())],
                        labels(id.series),
                    );
                    m.encode_family(&l)?.encode_histogram::<NoLabelSet>(
                        h.sum_seconds(),
                        h.count(),
                        &buckets(h),
                        None,
                    )?;
                }
            }
            let mut per_series = std::collections::BTreeMap::<SeriesId, i64>::new();
            for s in f.tracked.pids.values() {
                *per_series.entry(*s).or_default() += 1;
            }
            let mut m =
                enc.encode_descriptor("pgio_tracked_processes", "g", None, MetricType::Gauge)?;
            for (s, n) in per_series {
                m.encode_family(&series([], labels(s)))?.encode_gauge(&n)?;
            }
            let mut m = enc.encode_descriptor("pgio_device_info", "g", None, MetricType::Gauge)?;
            for (dev, n) in &f.names {
                let (major, minor) = (dev_major(*dev).to_string(), dev_minor(*dev).to_string());
                let l = PcLabels([("device", n.as_str()), ("major", &major), ("minor", &minor)]);
                m.encode_family(&l)?.encode_gauge(&1)?;
            }
            Ok(())
        }
    }

    pub fn registry(f: Fixture) -> Registry {
        let mut registry = Registry::default();
        registry.register_collector(Box::new(Fixed(f)));
        registry
    }

    pub fn openmetrics(registry: &Registry) -> String {
        let mut out = String::with_capacity(1 << 20);
        prometheus_client::encoding::text::encode(&mut out, registry).expect("encode");
        out
    }

    /// The string surgery pgio did to get 0.0.4 text out of prometheus-client.
    pub fn prometheus_text(openmetrics: &str) -> String {
        let mut out = String::with_capacity(openmetrics.len());
        let mut lines = openmetrics.lines().peekable();
        while let Some(line) = lines.next() {
            if line == "# EOF" || line.starts_with("# UNIT ") {
                continue;
            }
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
}

fn sample_lines(text: &str) -> usize {
    text.lines().filter(|l| !l.starts_with('#')).count()
}

/// pgio's encoder and the baseline side by side, in one run.
fn exposition_of(c: &mut Criterion, name: &str, label_sets: u32) {
    let f = fixture(label_sets);
    let mut devices = Devices::fixed(f.names.clone(), []);
    let text = String::from_utf8(pgio(&f, &mut devices, Format::Prometheus)).expect("UTF-8");
    let registry = before::registry(fixture(label_sets));
    let baseline = before::prometheus_text(&before::openmetrics(&registry));
    // The same samples, or the comparison means nothing.
    assert_eq!(sample_lines(&text), sample_lines(&baseline));
    eprintln!(
        "{name}: {label_sets} label sets, {} series (sample lines), {} bytes",
        sample_lines(&text),
        text.len()
    );
    // What Prometheus asks for (OpenMetrics), and the 0.0.4 text other scrapers get.
    c.bench_function(&format!("{name}_openmetrics"), |b| {
        b.iter(|| pgio(black_box(&f), &mut devices, Format::OpenMetrics))
    });
    c.bench_function(&format!("{name}_text"), |b| {
        b.iter(|| pgio(black_box(&f), &mut devices, Format::Prometheus))
    });
    // Native histograms (what Prometheus asks for with them enabled); no baseline: informative.
    c.bench_function(&format!("{name}_protobuf"), |b| {
        b.iter(|| pgio(black_box(&f), &mut devices, Format::Protobuf))
    });
    c.bench_function(&format!("{name}_openmetrics_prometheus_client"), |b| {
        b.iter(|| before::openmetrics(black_box(&registry)))
    });
    c.bench_function(&format!("{name}_text_prometheus_client"), |b| {
        b.iter(|| before::prometheus_text(&before::openmetrics(black_box(&registry))))
    });
}

/// The target: /metrics of ~5,000 series (sample lines): 52 label sets, a busy node.
fn exposition(c: &mut Criterion) {
    exposition_of(c, "metrics_5000_series", 52);
}

/// For scale: 5,000 label sets (~500,000 sample lines).
fn exposition_large(c: &mut Criterion) {
    exposition_of(c, "metrics_5000_label_sets", 5_000);
}

fn titles() -> Vec<ProcessInfo> {
    let aux = [
        "postgres: checkpointer ",
        "postgres: background writer ",
        "postgres: walwriter ",
        "postgres: 15/main: autovacuum launcher ",
        "postgres: io worker 2",
        "postgres: parallel worker for PID 4242 ",
    ];
    (0..10_000u32)
        .map(|i| {
            let (comm, cmdline) = match i % 10 {
                0..=5 => (
                    "postgres",
                    format!("postgres: 15/main: user_{} db_{} 10.0.{}.{}(5{:04}) idle", i % 20, i % 250, i % 7, i % 250, i % 9999),
                ),
                6 | 7 => ("postgres", aux[i as usize % aux.len()].to_owned()),
                8 => ("bash", "-bash".to_owned()),
                _ => ("longhorn", format!("longhorn --volume-name pvc-{i:08x} replica /host/replicas/pvc-{i:08x}-0a1b2c3d")),
            };
            ProcessInfo {
                comm: comm.into(),
                // Postgres overwrites argv with its title: one element, as /proc shows it.
                argv: if comm == "longhorn" {
                    cmdline.split(' ').map(String::from).collect()
                } else {
                    vec![cmdline.clone()]
                },
                cmdline,
                exe: Some(format!("/usr/bin/{comm}")),
                kthread: false,
                ..Default::default()
            }
        })
        .collect()
}

fn classifier() -> Classifier {
    let re = |s: &str| Some(regex::Regex::new(s).expect("regex"));
    Classifier::new(
        vec![
            Rule {
                app: "fio".into(),
                role: "bench".into(),
                comm: re("^fio$"),
                exe: None,
                cmdline: None,
            },
            Rule {
                app: "pgbouncer".into(),
                role: String::new(),
                comm: re("^pgbouncer$"),
                exe: None,
                cmdline: re("pgbouncer"),
            },
        ],
        None,
    )
}

fn classify(c: &mut Criterion) {
    let titles = titles();
    let classifier = classifier();
    c.bench_function("classify_10000_titles", |b| {
        b.iter(|| {
            let mut n = 0;
            for t in black_box(&titles) {
                n += classifier.classify(t).is_some() as u32;
            }
            n
        })
    });
}

fn proc_scan(c: &mut Criterion) {
    let classifier = classifier();
    let n = classify_all(&classifier).expect("scan").len();
    eprintln!("/proc holds {n} processes");
    c.bench_function("proc_scan", |b| {
        b.iter(|| classify_all(black_box(&classifier)).expect("scan"))
    });
}

fn config() -> Criterion {
    // Short by default: the xtask bench runs all three in well under a minute.
    Criterion::default()
        .warm_up_time(std::time::Duration::from_millis(500))
        .measurement_time(std::time::Duration::from_secs(3))
        .sample_size(20)
}

criterion_group! {
    name = benches;
    config = config();
    targets = exposition, classify, proc_scan
}
criterion_group! {
    name = large;
    config = config().sample_size(10);
    targets = exposition_large
}
criterion_main!(benches, large);
