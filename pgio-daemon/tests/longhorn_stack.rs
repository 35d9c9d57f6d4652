//! One Longhorn volume, every layer side by side. The stand-in Longhorn (`longhorn-standin/`,
//! `pgio_testkit::longhorn`): 2 replicas on ext4 on a direct-IO loop device (the "backing"
//! disk), the engine, and the volume exposed as a direct-IO loop device over a FUSE file (the
//! role tgtd plays in real Longhorn), with `/dev/longhorn/<vol>` in a test directory.
//! PostgreSQL 15 on ext4 on the volume, cold cache, `pgbench -S` 20 s at a fixed 1,000 tps.
//! Then the same with 2 ms of latency injected in the replicas.
//!
//! Asserted from pgio's metrics, against /proc/diskstats and the stand-in's own counters:
//! - postgres client backends' pread64 are there;
//! - every block series of the volume's loop device carries `volume="<vol>"`, and pgio counts
//!   the device's reads as diskstats does (never more, at most 1 % fewer);
//! - engine, 2 replicas and the sync-agent are tracked with the same `volume`;
//! - the replicas' pread64 are ≥ 95 % of the volume device's read requests;
//! - ≥ 95 % of the backing device's reads are attributed to role `replica` of the volume;
//! - with injection, < 1 % of the volume device's reads complete within 2.1 ms (measured 0 %;
//!   without injection ≥ 20 %, measured 60 %), and the backing device's median rises by
//!   < 0.5 ms.
//!
//! `pgio-daemon top --volume <vol>` runs over 14 s in the middle of each pgbench: its four
//! layers all have reads, the replicas' preads keep up with the volume device's reads, and
//! with injection it puts the delay between the volume device and the replicas' disks (volume
//! device median > 2 ms, the disks' under half of it).
//!
//! Prints the per-layer medians (the closing note's table), top's picture of the volume and the
//! volume's /metrics lines.

mod common;

use std::time::Duration;

use common::{longhorn_daemon, pg_on_longhorn};
use pgio_testkit::{
    DiskStats, LonghornVolume, Metrics, diskstats, metrics::Histogram, require_root,
};

const RUN_SECS: u32 = 12;
/// pgbench's target rate (`-R`): well below what 2 vCPUs can do (~13–17k tps unthrottled), so
/// the latencies compared are the IO path's, not CPU queueing (unthrottled, the volume
/// device's median without injection moved between 1.1 and 2.1 ms from run to run).
const RATE: u32 = 1000;

#[derive(Debug)]
struct Layers {
    /// `top --volume --once --json`: (layer, count, p50 seconds) top to bottom.
    top_layers: Vec<(String, u64, Option<f64>)>,
    /// The same interval as `top --volume --once` prints it.
    top_text: String,
    tps: f64,
    pg_preads: f64,
    pg_pread_miss_ms: Option<f64>,
    volume_reads_diskstats: f64,
    volume_reads_pgio: f64,
    /// Where the volume device's reads went (app/role), its lost and unmatched completions: for
    /// a count that disagrees with diskstats.
    volume_reads_detail: String,
    volume_reads_labelled: f64,
    volume_ms: Option<f64>,
    /// Exact mean (`_sum / _count`) of the volume device's read latency.
    volume_mean_ms: Option<f64>,
    /// Share of the volume device's reads that took at most 2^21 ns (2.1 ms).
    volume_fast_share: f64,
    engine_futex_ms: Option<f64>,
    replica_preads: f64,
    replica_pread_ms: Option<f64>,
    backing_reads_diskstats: f64,
    backing_reads_replica: f64,
    backing_ms: Option<f64>,
    /// With the iSCSI frontend: tgtd's pread64 of the FUSE file, its futex waits, and its
    /// calls by syscall.
    tgtd: Option<(f64, f64, String)>,
    excerpt: String,
}

#[test]
fn longhorn_volume_stack_view() {
    if !require_root("longhorn_volume_stack_view") {
        return;
    }
    let plain = run(None, 56_420);
    print("no injection", &plain);
    check(&plain, "no injection");
    let slow = run(Some(Duration::from_millis(2)), 56_421);
    print("2 ms injected in the replicas", &slow);
    check(&slow, "2 ms injected");
    eprintln!(
        "pgio-daemon top --volume, 2 ms injected:\n{}",
        slow.top_text
    );
    // top shows where the time goes: below the volume device, above the replicas' disks.
    let p50 = |l: &Layers, i: usize| l.top_layers[i].2.expect("a median");
    assert!(
        p50(&slow, 1) > 2e-3 && p50(&slow, 3) < p50(&slow, 1) / 2.0,
        "top with 2 ms injected: volume device p50 {} s, replica disk p50 {} s",
        p50(&slow, 1),
        p50(&slow, 3)
    );
    eprintln!(
        "/metrics lines of the volume (no injection run):\n{}",
        plain.excerpt
    );

    // Every volume read waits for one replica read, so with 2 ms injected hardly any can
    // complete within 2^21 ns (2.1 ms: the sleep plus FUSE, engine and replica), while without
    // injection many do: an exact, bucket-aligned count (measured 0.0000 of 14,455 vs 0.60).
    // A median interpolated inside a log2 bucket ((2.1, 4.2] ms) can under-read the 2 ms
    // shift (rises of 0.98–2.24 ms measured) and the mean moves with the tail: both are
    // printed, not asserted on.
    // Under emulation the whole path (FUSE, Go engine, TCP, replica) is ~16× slower: measured
    // in cargo xtask integration (TCG, 6.12) a volume device median of 22 ms without
    // injection, 0 of 2,921 reads within 2.1 ms. The bars with injection below still hold.
    if let Some(emulator) = pgio_testkit::emulated() {
        eprintln!(
            "emulated ({emulator}): not asserting the no-injection share within 2.1 ms ({:.4})",
            plain.volume_fast_share
        );
    } else {
        assert!(
            plain.volume_fast_share >= 0.20,
            "without injection only {:.4} of the volume device's reads took <= 2.1 ms",
            plain.volume_fast_share
        );
    }
    assert!(
        slow.volume_fast_share < 0.01,
        "with 2 ms injected in the replicas, {:.4} of the volume device's reads still took <= 2.1 ms",
        slow.volume_fast_share
    );
    let (b0, b1) = (
        plain.backing_ms.expect("backing median"),
        slow.backing_ms.expect("backing median"),
    );
    assert!(
        b1 - b0 < 0.5,
        "the backing device's median read latency rose by {:.2} ms ({b0:.2} → {b1:.2}): the delay is in the replica, not the disk",
        b1 - b0
    );
}

fn check(l: &Layers, case: &str) {
    assert!(l.pg_preads > 1000.0, "{case}: {l:?}");
    // tgtd serves every read of sdX from the FUSE file; its io threads wait on a condition
    // variable between requests.
    if let Some((preads, futex_waits, by_syscall)) = &l.tgtd {
        assert!(
            *preads >= 0.95 * l.volume_reads_diskstats,
            "{case}: tgtd pread64 {preads} < 95 % of the volume device's {} reads",
            l.volume_reads_diskstats
        );
        assert!(
            *futex_waits > 0.0,
            "{case}: no tgtd futex waits; its calls: {by_syscall}"
        );
    }
    let names: Vec<&str> = l.top_layers.iter().map(|t| t.0.as_str()).collect();
    assert_eq!(
        names,
        [
            "postgres miss",
            "volume device",
            "replica pread",
            "replica disk"
        ],
        "{case}"
    );
    for (name, count, _) in &l.top_layers {
        assert!(*count > 100, "{case}: top's {name} layer: {count} reads");
    }
    let (volume, replica) = (l.top_layers[1].1 as f64, l.top_layers[2].1 as f64);
    assert!(
        replica >= 0.9 * volume,
        "{case}: top: replica preads {replica} vs volume device reads {volume}"
    );
    assert!(
        // Never more (see postgres.rs), at most 1 % fewer.
        l.volume_reads_pgio <= l.volume_reads_diskstats
            && l.volume_reads_diskstats - l.volume_reads_pgio <= 0.01 * l.volume_reads_diskstats
            && l.volume_reads_diskstats > 500.0,
        "{case}: volume device reads pgio {} vs diskstats {}: {}",
        l.volume_reads_pgio,
        l.volume_reads_diskstats,
        l.volume_reads_detail
    );
    assert_eq!(
        l.volume_reads_labelled, l.volume_reads_pgio,
        "{case}: every block series of the volume's device carries its volume"
    );
    assert!(
        l.replica_preads >= 0.95 * l.volume_reads_diskstats,
        "{case}: replica pread64 {} < 95 % of the volume device's {} reads",
        l.replica_preads,
        l.volume_reads_diskstats
    );
    assert!(
        l.backing_reads_replica >= 0.95 * l.backing_reads_diskstats
            && l.backing_reads_diskstats > 500.0,
        "{case}: backing device reads on role replica {} of {}",
        l.backing_reads_replica,
        l.backing_reads_diskstats
    );
}

fn ms(h: &Histogram) -> Option<f64> {
    h.quantile(0.5).map(|s| s * 1e3)
}

fn mean_ms(h: &Histogram) -> Option<f64> {
    (h.count > 0.0).then(|| h.sum / h.count * 1e3)
}

fn print(case: &str, l: &Layers) {
    let f = |v: Option<f64>| v.map_or("-".to_owned(), |v| format!("{v:.3} ms"));
    eprintln!(
        "longhorn_stack, {case}: pgbench -S -R {RATE} {RUN_SECS} s, {:.0} tps\n\
         \x20 layer                                   median      count\n\
         \x20 postgres pread64 (cache=miss)          {:>10}  {:>8}\n\
         \x20 volume device ({}) reads   {:>10}  {:>8} (diskstats {}; mean {}; ≤ 2.1 ms {:.4})\n\
         \x20 engine futex waits                     {:>10}\n\
         \x20 replica pread64                        {:>10}  {:>8}\n\
         \x20 backing device reads (role replica)    {:>10}  {:>8} (diskstats {}){}\n\
         \x20 volume device reads: {}",
        l.tps,
        f(l.pg_pread_miss_ms),
        l.pg_preads,
        if l.tgtd.is_some() {
            "sdX: tgtd over FUSE"
        } else {
            "loop over FUSE"
        },
        f(l.volume_ms),
        l.volume_reads_pgio,
        l.volume_reads_diskstats,
        f(l.volume_mean_ms),
        l.volume_fast_share,
        f(l.engine_futex_ms),
        f(l.replica_pread_ms),
        l.replica_preads,
        f(l.backing_ms),
        l.backing_reads_replica,
        l.backing_reads_diskstats,
        l.tgtd
            .as_ref()
            .map_or(String::new(), |(preads, futex, by_syscall)| format!(
                "\n  tgtd: pread64 {preads}, futex waits {futex} (role tgtd, no volume label: \
                 one tgtd serves all of a node's volumes); its calls: {by_syscall}"
            )),
        l.volume_reads_detail,
    );
}

fn run(latency: Option<Duration>, port: u16) -> Layers {
    let mut setup = pg_on_longhorn(latency, port, &[]);
    let daemon = longhorn_daemon(&setup.vol, "");
    setup.pg.start().expect("start cold");
    daemon
        .wait_tracked("postgres", "postmaster")
        .expect("postgres");
    daemon
        .wait_tracked("longhorn", "replica")
        .expect("replicas");

    let volume = setup.vol.volume().to_owned();
    let (lo, backing) = (
        setup.vol.device_name().to_owned(),
        setup.vol.backing_loop().name().to_owned(),
    );
    let (m0, d0, b0) = quiet_snapshot(&daemon, &setup.vol, &lo, &backing);
    let top = |json: bool| {
        let url = format!("{}/metrics", daemon.url);
        let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_pgio-daemon"));
        c.args([
            "top",
            "--once",
            "--interval",
            "14",
            "--url",
            &url,
            "--volume",
            &volume,
        ]);
        if json {
            c.arg("--json");
        }
        c.stdout(std::process::Stdio::piped())
            .spawn()
            .expect("spawn top")
    };
    let (top_json, top_text) = (top(true), top(false));
    let out = setup
        .pg
        .pgbench_ok(&[
            "-S",
            "-c",
            "4",
            "-j",
            "2",
            "-R",
            &RATE.to_string(),
            "-T",
            &RUN_SECS.to_string(),
            "postgres",
        ])
        .expect("pgbench -S");
    let (m1, d1, b1) = quiet_snapshot(&daemon, &setup.vol, &lo, &backing);
    let top_json = top_json.wait_with_output().expect("top --json");
    let top_text = top_text.wait_with_output().expect("top");
    for (what, out) in [("top --json", &top_json), ("top", &top_text)] {
        assert!(
            out.status.success(),
            "{what}: {}\nstderr: {}\nstdout: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr),
            String::from_utf8_lossy(&out.stdout)
        );
    }
    let j: pgio_testkit::serde_json::Value =
        pgio_testkit::serde_json::from_slice(&top_json.stdout).expect("top's JSON");
    let top_layers = j["layers"]
        .as_array()
        .expect("layers")
        .iter()
        .map(|l| {
            (
                l["layer"].as_str().unwrap_or("").to_owned(),
                l["count"].as_u64().unwrap_or(0),
                l["p50_seconds"].as_f64(),
            )
        })
        .collect();
    let tps = out
        .lines()
        .find_map(|l| l.strip_prefix("tps = "))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0.0);

    let d = |name: &str, labels: &[(&str, &str)]| m1.sum(name, labels) - m0.sum(name, labels);
    let h = |family: &str, labels: &[(&str, &str)]| {
        let after = m1.histogram(family, labels).expect("histogram");
        let before = m0.histogram(family, labels).expect("histogram");
        after.since(&before)
    };
    let vol_l = ("volume", volume.as_str());
    let pg_read = [
        ("app", "postgres"),
        ("role", "client backend"),
        ("syscall", "pread64"),
    ];
    let replica_read = [
        ("app", "longhorn"),
        ("role", "replica"),
        ("syscall", "pread64"),
        vol_l,
    ];
    let volume_read = [("device", lo.as_str()), ("op", "read")];
    let backing_replica = [
        ("device", backing.as_str()),
        ("op", "read"),
        ("role", "replica"),
        vol_l,
    ];

    for (role, n) in [("engine", 1.0), ("replica", 2.0), ("sync-agent", 1.0)] {
        let got = m1.sum(
            "pgio_tracked_processes",
            &[("app", "longhorn"), ("role", role), vol_l],
        );
        assert_eq!(got, n, "tracked longhorn {role} processes of {volume}");
    }
    assert_eq!(
        m1.sum("pgio_device_info", &[("device", lo.as_str()), vol_l]),
        1.0,
        "pgio_device_info maps {lo} to {volume}"
    );

    let excerpt = excerpt(&m1, &volume, &lo);
    let tgtd_l = [("app", "longhorn"), ("role", "tgtd")];
    let layers = Layers {
        tgtd: setup.vol.tgtd_pid().map(|_| {
            let calls = common::delta_by(
                &m0,
                &m1,
                "pgio_syscall_seconds_count",
                &tgtd_l,
                &["syscall"],
            );
            (
                d(
                    "pgio_syscall_seconds_count",
                    &[tgtd_l[0], tgtd_l[1], ("syscall", "pread64")],
                ),
                d("pgio_futex_wait_seconds_count", &tgtd_l),
                format!("{calls:?}"),
            )
        }),
        top_layers,
        top_text: String::from_utf8_lossy(&top_text.stdout).into_owned(),
        tps,
        pg_preads: d("pgio_syscall_seconds_count", &pg_read),
        pg_pread_miss_ms: ms(&h(
            "pgio_syscall_seconds",
            &[pg_read[0], pg_read[1], pg_read[2], ("cache", "miss")],
        )),
        volume_reads_diskstats: (d1.reads_completed - d0.reads_completed) as f64,
        volume_reads_pgio: d("pgio_block_io_requests_total", &volume_read),
        volume_reads_detail: format!(
            "by app/role {:?}, lost {}, unmatched {}; {}",
            common::delta_by(
                &m0,
                &m1,
                "pgio_block_io_requests_total",
                &volume_read,
                &["app", "role"]
            ),
            d("pgio_block_io_lost_completions_total", &volume_read),
            d(
                "pgio_block_io_unmatched_completions_total",
                &[("device", lo.as_str())]
            ),
            common::losses(&m0, &m1)
        ),
        volume_reads_labelled: d(
            "pgio_block_io_requests_total",
            &[volume_read[0], volume_read[1], vol_l],
        ),
        volume_ms: ms(&h("pgio_block_io_device_seconds", &volume_read)),
        volume_mean_ms: mean_ms(&h("pgio_block_io_device_seconds", &volume_read)),
        volume_fast_share: {
            let v = h("pgio_block_io_device_seconds", &volume_read);
            v.count_le(2.097152e-3) / v.count.max(1.0)
        },
        engine_futex_ms: ms(&h(
            "pgio_futex_wait_seconds",
            &[("app", "longhorn"), ("role", "engine"), vol_l],
        )),
        replica_preads: d("pgio_syscall_seconds_count", &replica_read),
        replica_pread_ms: ms(&h("pgio_syscall_seconds", &replica_read)),
        backing_reads_diskstats: (b1.reads_completed - b0.reads_completed) as f64,
        backing_reads_replica: d("pgio_block_io_requests_total", &backing_replica),
        backing_ms: ms(&h("pgio_block_io_device_seconds", &backing_replica)),
        excerpt,
    };
    daemon.stop().expect("daemon stop");
    setup.pg.stop().expect("stop");
    drop(setup);
    layers
}

/// A scrape with both devices' diskstats unchanged across it (no request completing).
fn quiet_snapshot(
    daemon: &pgio_testkit::Daemon,
    vol: &LonghornVolume,
    lo: &str,
    backing: &str,
) -> (Metrics, DiskStats, DiskStats) {
    for _ in 0..100 {
        vol.wait_quiet(Duration::from_secs(5));
        let (a1, b1) = (
            diskstats(lo).expect("diskstats"),
            diskstats(backing).expect("diskstats"),
        );
        let m = daemon.scrape().expect("scrape");
        let (a2, b2) = (
            diskstats(lo).expect("diskstats"),
            diskstats(backing).expect("diskstats"),
        );
        if a1 == a2 && b1 == b2 && common::holds_nothing_back(&m) {
            return (m, a2, b2);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("{lo}/{backing} never went quiet, with no process held provisional, for a scrape");
}

/// Counters of the volume's layers (no buckets), for the README.
fn excerpt(m: &Metrics, volume: &str, lo: &str) -> String {
    let mut out = String::new();
    for s in m.all() {
        let on_volume = s.labels.get("volume").is_some_and(|v| v == volume)
            || s.labels.get("device").is_some_and(|d| d == lo);
        let wanted = s.name.ends_with("_count")
            || s.name == "pgio_block_io_requests_total"
            || s.name == "pgio_device_info"
            || s.name == "pgio_tracked_processes";
        if on_volume && wanted {
            let labels: Vec<String> = s
                .labels
                .iter()
                .map(|(k, v)| format!("{k}=\"{v}\""))
                .collect();
            out += &format!("{}{{{}}} {}\n", s.name, labels.join(","), s.value);
        }
    }
    out
}
