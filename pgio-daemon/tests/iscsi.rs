//! iSCSI on loopback, Longhorn v1's frontend shape without Longhorn: Debian's `tgtd` serves a
//! written file as LUN 1 (read with O_DIRECT by the target), open-iscsi logs in, and a process
//! does direct reads of the `/dev/sdX` that appears. pgio's read requests for sdX + its lost
//! completions equal the /proc/diskstats delta exactly, ≥ 99 % of them on the reader's series;
//! every byte the reader read was read again from the disk under the file by `tgtd`, on its
//! own series (`app="longhorn", role="tgtd"`).
//!
//! The same with the Longhorn stand-in behind tgtd (Longhorn v1's `tgt-blockdev` frontend):
//! tgtd serves the engine's FUSE frontend file, `/dev/longhorn/<vol>` carries sdX's
//! major:minor, and a reader's direct reads of sdX show every layer on the volume: sdX's series
//! labelled with it (= diskstats), tgtd's reads of the volume and its futex waits, the engine
//! and the replicas' reads.
//!
//! Needs the `iscsi_tcp` module: skipped (with the reason) on a kernel without it, e.g. the CI
//! host; required under `cargo xtask integration`, whose Debian kernels have it. One target
//! at a time (a fixed IQN and portal): the tests run one after the other.
mod common;

use std::sync::{Mutex, MutexGuard};

use std::os::unix::fs::MetadataExt;
use std::time::Duration;

use common::{Daemon, delta, losses, snapshot};
use pgio_testkit::{iscsi::IscsiDisk, require_root, rules_config, temp_dir};

const READS: u64 = 4_000;
/// Each goes through tgtd, FUSE, the engine and a replica: fewer, for emulated guests.
const LH_READS: u64 = 1_000;
const BLOCK: u32 = 8192;
const SETTLE: Duration = Duration::from_millis(1300);

/// None (with the skip printed) when this kernel has no iSCSI initiator.
fn setup(test: &str) -> Option<MutexGuard<'static, ()>> {
    static ONE_TARGET: Mutex<()> = Mutex::new(());
    let guard = ONE_TARGET.lock().unwrap_or_else(|e| e.into_inner());
    if !require_root(test) {
        return None;
    }
    if let Some(why) = pgio_testkit::iscsi::unavailable() {
        assert!(
            pgio_testkit::emulated().is_none(),
            "{test}: {why}, but cargo xtask integration's guests must have it"
        );
        eprintln!("{test}: skipped: {why}");
        return None;
    }
    Some(guard)
}

#[test]
fn direct_reads_of_an_iscsi_disk_match_diskstats_and_tgtd_reads_them_below() {
    let Some(_one) = setup("iscsi") else {
        return;
    };
    let dir = temp_dir().expect("temp dir");
    let file = dir.path().join("lun1.img");
    // Written, not sparse: every read of the LUN is a read of the disk below.
    let chunk: Vec<u8> = (0..1u32 << 20).map(|i| (i % 251) as u8 + 1).collect();
    {
        use std::io::Write;
        let mut f = std::fs::File::create(&file).expect("LUN file");
        for _ in 0..64 {
            f.write_all(&chunk).expect("writing the LUN file");
        }
        f.sync_all().expect("sync");
    }
    let st_dev = std::fs::metadata(&file).expect("stat").dev();
    let below = device_name(st_dev);

    let disk = IscsiDisk::start(&file).expect("iSCSI disk");
    let daemon = Daemon::with_config(&format!(
        "block_inflight_timeout_secs = 1\n{}",
        rules_config(&[("test", "iscsi-read", "^pgio-load$")])
    ))
    .expect("daemon");
    let mut load =
        pgio_testkit::load::direct_reader(disk.device(), READS, BLOCK).expect("spawn pgio-load");
    daemon.wait_tracked("test", "iscsi-read");
    daemon.wait_tracked("longhorn", "tgtd");
    std::thread::sleep(SETTLE);
    let (before, disk_before) = snapshot(&daemon, disk.name());
    assert_eq!(load.expect_run(), READS);
    std::thread::sleep(SETTLE);
    let (after, disk_after) = snapshot(&daemon, disk.name());

    let sd = [("device", disk.name()), ("op", "read")];
    let disk_reads = (disk_after.reads_completed - disk_before.reads_completed) as f64;
    let pgio_reads = delta(&before, &after, "pgio_block_io_requests_total", &sd);
    let lost = delta(&before, &after, "pgio_block_io_lost_completions_total", &sd);
    let attributed = delta(
        &before,
        &after,
        "pgio_block_io_requests_total",
        &[
            ("device", disk.name()),
            ("op", "read"),
            ("app", "test"),
            ("role", "iscsi-read"),
        ],
    );
    let tgtd_bytes = delta(
        &before,
        &after,
        "pgio_block_io_bytes_total",
        &[
            ("device", below.as_str()),
            ("op", "read"),
            ("app", "longhorn"),
            ("role", "tgtd"),
        ],
    );
    let read_bytes = (READS * u64::from(BLOCK)) as f64;
    eprintln!(
        "iscsi {} over {below} (tgtd pid {:?}): diskstats reads {disk_reads}, pgio {pgio_reads} + lost {lost}, \
         attributed to pgio-load {attributed}; tgtd read {tgtd_bytes} bytes of {below} for the reader's {read_bytes}; {}",
        disk.name(),
        disk.tgtd_pid(),
        losses(&before, &after)
    );
    assert!(
        disk_reads >= READS as f64,
        "diskstats saw {disk_reads} reads"
    );
    assert_eq!(
        pgio_reads + lost,
        disk_reads,
        "pgio counted {pgio_reads} read requests and {lost} lost, /proc/diskstats {disk_reads}"
    );
    assert!(lost <= 0.01 * disk_reads, "{lost} of {disk_reads} lost");
    assert!(
        attributed >= 0.99 * pgio_reads,
        "only {attributed} of {pgio_reads} reads on the reader's series"
    );
    assert!(
        tgtd_bytes >= read_bytes,
        "tgtd read {tgtd_bytes} bytes of {below} on its series, the reader {read_bytes} of {}",
        disk.name()
    );
    daemon.stop().expect("clean daemon exit");
}

#[test]
fn a_longhorn_volume_served_by_tgtd_shows_every_layer_on_its_volume() {
    let Some(_one) = setup("iscsi longhorn") else {
        return;
    };
    let vol = pgio_testkit::LonghornVolume::start(pgio_testkit::LonghornOptions {
        iscsi: true,
        ..pgio_testkit::LonghornOptions::default()
    })
    .expect("Longhorn stand-in over iSCSI");
    let (sd, volume) = (vol.device_name().to_owned(), vol.volume().to_owned());
    let daemon = Daemon::with_config(&format!(
        "block_inflight_timeout_secs = 1\nlonghorn_device_dir = \"{}\"\n{}",
        vol.dev_dir().display(),
        rules_config(&[
            ("longhorn", "frontend", "^longhorn-fuse$"),
            ("test", "volume-read", "^pgio-load$"),
        ])
    ))
    .expect("daemon");
    let mut load =
        pgio_testkit::load::direct_reader(vol.device(), LH_READS, BLOCK).expect("pgio-load");
    daemon.wait_tracked("test", "volume-read");
    daemon.wait_tracked("longhorn", "tgtd");
    daemon.wait_tracked("longhorn", "engine");
    std::thread::sleep(SETTLE);
    let (before, disk_before) = snapshot(&daemon, &sd);
    assert_eq!(load.expect_run(), LH_READS);
    std::thread::sleep(SETTLE);
    let (after, disk_after) = snapshot(&daemon, &sd);

    let d = |name: &str, labels: &[(&str, &str)]| delta(&before, &after, name, labels);
    let v = ("volume", volume.as_str());
    let reads = [("device", sd.as_str()), ("op", "read")];
    let disk_reads = (disk_after.reads_completed - disk_before.reads_completed) as f64;
    let pgio_reads = d("pgio_block_io_requests_total", &reads);
    let lost = d("pgio_block_io_lost_completions_total", &reads);
    let labelled = d("pgio_block_io_requests_total", &[reads[0], reads[1], v]);
    let reader = d(
        "pgio_block_io_requests_total",
        &[
            reads[0],
            reads[1],
            v,
            ("app", "test"),
            ("role", "volume-read"),
        ],
    );
    let pread = |role: &str, volume: Option<(&str, &str)>| {
        let mut l = vec![("app", "longhorn"), ("role", role), ("syscall", "pread64")];
        l.extend(volume);
        d("pgio_syscall_seconds_count", &l)
    };
    let (replica_preads, tgtd_preads) = (pread("replica", Some(v)), pread("tgtd", None));
    let tgtd_futex = d(
        "pgio_futex_wait_seconds_count",
        &[("app", "longhorn"), ("role", "tgtd")],
    );
    eprintln!(
        "iscsi longhorn {sd} = {volume}: diskstats reads {disk_reads}, pgio {pgio_reads} + lost \
         {lost}, labelled with the volume {labelled}, the reader's {reader}; tgtd pread64 \
         {tgtd_preads}, futex waits {tgtd_futex}; replicas' pread64 {replica_preads}; {}",
        losses(&before, &after)
    );
    assert!(
        disk_reads >= LH_READS as f64,
        "diskstats saw {disk_reads} reads"
    );
    assert_eq!(
        pgio_reads + lost,
        disk_reads,
        "pgio against /proc/diskstats"
    );
    assert_eq!(
        labelled, pgio_reads,
        "every series of {sd} carries its volume"
    );
    assert!(
        reader >= 0.99 * pgio_reads,
        "{reader} of {pgio_reads} on the reader"
    );
    assert_eq!(
        after.sum("pgio_device_info", &[("device", sd.as_str()), v]),
        1.0,
        "pgio_device_info maps {sd} to {volume}"
    );
    for (role, n) in [("engine", 1.0), ("replica", 2.0), ("sync-agent", 1.0)] {
        let got = after.sum(
            "pgio_tracked_processes",
            &[("app", "longhorn"), ("role", role), v],
        );
        assert_eq!(got, n, "tracked longhorn {role} processes of {volume}");
    }
    assert!(
        tgtd_preads >= 0.95 * disk_reads,
        "tgtd pread64 {tgtd_preads} of {disk_reads} reads"
    );
    assert!(
        replica_preads >= 0.95 * disk_reads,
        "replicas' pread64 {replica_preads} of {disk_reads} reads"
    );
    assert!(tgtd_futex > 0.0, "no tgtd futex waits");
    daemon.stop().expect("clean daemon exit");
}

/// The whole-disk name in /proc/diskstats holding device number `dev` (a partition's disk).
fn device_name(dev: u64) -> String {
    let (major, minor) = (libc::major(dev), libc::minor(dev));
    let sys = std::fs::canonicalize(format!("/sys/dev/block/{major}:{minor}"))
        .expect("/sys/dev/block entry of the LUN file's filesystem");
    // A partition's directory sits inside its disk's.
    let disk = if sys.join("partition").exists() {
        sys.parent()
            .map(std::path::Path::to_path_buf)
            .unwrap_or(sys)
    } else {
        sys
    };
    disk.file_name()
        .and_then(|n| n.to_str())
        .expect("device name")
        .to_owned()
}
