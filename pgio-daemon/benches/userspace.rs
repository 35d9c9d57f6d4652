//! Userspace hot spots: encoding /metrics for 5,000 series, classifying 10,000 process titles,
//! a full /proc scan. `cargo xtask bench` runs these and puts the figures in BENCHMARKS.md.
use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use pgio_common::{
    block_io::{BlockOp, mkdev},
    hist::{Bucket, slot},
    syscall::{Cache, Syscall},
};
use pgio_daemon::{
    classifier::{Classifier, ProcessInfo, rules::Rule},
    discovery::{Tracked, classify_all},
    exposition::{FixedSnapshot, Snapshot, openmetrics, prometheus_text},
    hist::Log2Hist,
    labels::Labels,
};
use prometheus_client::registry::Registry;

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

/// `label_sets` client-backend label sets (databases × 20 users), each with a pread64 hit and
/// miss histogram and a futex histogram, plus block device and queue histograms on 4 devices
/// for a fifth of them. Each histogram is 31 sample lines (28 buckets, sum, count, ...).
fn fixture(label_sets: u32) -> (Snapshot, Tracked) {
    let mut tracked = Tracked::default();
    let mut snap = Snapshot::default();
    for i in 0..label_sets {
        let id = tracked.registry.intern(Labels {
            app: "postgres".into(),
            role: "client backend".into(),
            database: format!("db_{}", i / 20),
            user: format!("user_{}", i % 20),
            cluster: "15/main".into(),
            volume: String::new(),
        });
        tracked.pids.insert(10_000 + i, id);
        for cache in [Cache::Hit, Cache::Miss] {
            snap.syscalls
                .insert((id, Syscall::Pread64 as u8, cache as u8), hist(i as u64));
        }
        snap.syscalls.insert(
            (id, Syscall::Futex as u8, Cache::None as u8),
            hist(i as u64 + 3),
        );
        if i < label_sets / 5 {
            let dev = mkdev(7, i % 4);
            snap.block
                .device
                .insert((id, dev, BlockOp::Read as u8), hist(i as u64 + 1));
            snap.block
                .queue
                .insert((id, dev, BlockOp::Read as u8), hist(i as u64 + 2));
        }
    }
    for m in 0..4 {
        snap.dev_names.insert(mkdev(7, m), format!("loop{m}"));
    }
    (snap, tracked)
}

fn exposition_of(c: &mut Criterion, name: &str, label_sets: u32) {
    let (snap, tracked) = fixture(label_sets);
    let mut registry = Registry::default();
    registry.register_collector(Box::new(FixedSnapshot(snap, tracked)));
    let text = prometheus_text(&openmetrics(&registry).expect("encode"));
    let series = text.lines().filter(|l| !l.starts_with('#')).count();
    eprintln!(
        "{name}: {label_sets} label sets, {series} series (sample lines), {} bytes",
        text.len()
    );
    // What Prometheus asks for (OpenMetrics), and the 0.0.4 text other scrapers get.
    c.bench_function(&format!("{name}_openmetrics"), |b| {
        b.iter(|| openmetrics(black_box(&registry)).expect("encode"))
    });
    c.bench_function(&format!("{name}_text"), |b| {
        b.iter(|| {
            let om = openmetrics(black_box(&registry)).expect("encode");
            black_box(prometheus_text(&om))
        })
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
    Classifier::new(vec![
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
    ])
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
