//! iSCSI on loopback, Longhorn v1's frontend shape without Longhorn: Debian's `tgtd` serves a
//! written file as LUN 1 (read with O_DIRECT by the target), open-iscsi logs in, and a process
//! does direct reads of the `/dev/sdX` that appears. pgio's read requests for sdX + its lost
//! completions equal the /proc/diskstats delta exactly, ≥ 99 % of them on the reader's series;
//! every byte the reader read was read again from the disk under the file by `tgtd`, on its
//! own series (`app="longhorn", role="tgtd"`).
//!
//! Needs the `iscsi_tcp` module: skipped (with the reason) on a kernel without it, e.g. the CI
//! host; required under `cargo xtask integration`, whose Debian kernels have it.
mod common;

use std::os::unix::fs::MetadataExt;
use std::time::Duration;

use common::{Daemon, delta, losses, snapshot};
use pgio_testkit::{iscsi::IscsiDisk, require_root, rules_config, temp_dir};

const READS: u64 = 4_000;
const BLOCK: u32 = 8192;
const SETTLE: Duration = Duration::from_millis(1300);

#[test]
fn direct_reads_of_an_iscsi_disk_match_diskstats_and_tgtd_reads_them_below() {
    if !require_root("iscsi") {
        return;
    }
    if let Some(why) = pgio_testkit::iscsi::unavailable() {
        assert!(
            pgio_testkit::emulated().is_none(),
            "iscsi: {why}, but cargo xtask integration's guests must have it"
        );
        eprintln!("iscsi: skipped: {why}");
        return;
    }
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
