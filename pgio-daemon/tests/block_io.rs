//! Test a: direct reads on a loop device. pgio's read request count for the device equals the
//! /proc/diskstats delta, and the reads are attributed to the process that did them.
mod common;

use std::time::Duration;

use common::{Daemon, delta, snapshot};
use pgio_testkit::{LoadProcess, LoopDevice, pgio_load_bin, require_root, temp_dir};

const READS: u64 = 20_000;

#[test]
fn direct_reads_match_diskstats_and_are_attributed_to_their_process() {
    if !require_root("direct_reads_match_diskstats") {
        return;
    }
    let dir = temp_dir().expect("temp dir");
    let lo = LoopDevice::create(dir.path(), 256 << 20, true).expect("loop device");
    let daemon = Daemon::start(&[("test", "direct-read", "^pgio-load$")]).expect("daemon");
    let dev = lo.path().to_str().expect("utf-8 path").to_owned();
    let mut load = LoadProcess::spawn(
        &pgio_load_bin().expect("pgio-load"),
        ["direct-read", &dev, &READS.to_string(), "8192"],
    )
    .expect("spawn pgio-load");
    daemon.wait_tracked("test", "direct-read");
    // udev/blkid probe a new loop device: let that finish before the window opens.
    lo.wait_quiet(Duration::from_secs(5));

    let (before, disk_before) = snapshot(&daemon, lo.name());
    assert_eq!(load.expect_run(), READS);
    let (after, disk_after) = snapshot(&daemon, lo.name());

    let device = [("device", lo.name()), ("op", "read")];
    let disk_reads = (disk_after.reads_completed - disk_before.reads_completed) as f64;
    let pgio_reads = delta(&before, &after, "pgio_block_io_requests_total", &device);
    let attributed = delta(
        &before,
        &after,
        "pgio_block_io_requests_total",
        &[
            ("device", lo.name()),
            ("op", "read"),
            ("app", "test"),
            ("role", "direct-read"),
        ],
    );
    let latency_count = delta(
        &before,
        &after,
        "pgio_block_io_device_seconds_count",
        &[("device", lo.name()), ("op", "read"), ("app", "test")],
    );
    let bytes = delta(
        &before,
        &after,
        "pgio_block_io_bytes_total",
        &[("device", lo.name()), ("op", "read"), ("app", "test")],
    );
    eprintln!(
        "diskstats reads {disk_reads}, pgio reads {pgio_reads}, attributed to pid {} {attributed}, bytes {bytes}",
        load.pid()
    );
    assert!(
        disk_reads >= READS as f64,
        "diskstats saw {disk_reads} reads"
    );
    assert!(
        (pgio_reads - disk_reads).abs() <= 0.001 * disk_reads,
        "pgio counted {pgio_reads} read requests, /proc/diskstats {disk_reads}"
    );
    assert!(
        attributed >= 0.99 * pgio_reads,
        "only {attributed} of {pgio_reads} reads attributed to the reading process"
    );
    assert!(
        attributed <= READS as f64,
        "{attributed} reads attributed, process did {READS}"
    );
    assert_eq!(
        latency_count, attributed,
        "histogram count equals request counter"
    );
    assert_eq!(bytes, attributed * 8192.0, "8 KiB per request");
    // Nothing in the window is lost.
    assert_eq!(
        delta(&before, &after, "pgio_events_dropped_total", &[]),
        0.0,
        "events dropped"
    );
    daemon.stop().expect("clean daemon exit");
}
