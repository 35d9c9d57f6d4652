//! Test a: direct reads on a loop device. pgio's read requests for the device plus the ones it
//! reports lost equal the /proc/diskstats delta exactly, and the reads are attributed to the
//! process that did them.
mod common;

use std::time::Duration;

use common::{Daemon, delta, losses, snapshot};
use pgio_testkit::{LoadProcess, LoopDevice, pgio_load_bin, require_root, rules_config, temp_dir};

const READS: u64 = 20_000;
/// The daemon counts a request lost 1 s after its issue if its completion never came; a
/// window waits that out at both ends so it neither gains nor loses one.
const SETTLE: Duration = Duration::from_millis(1300);

#[test]
fn direct_reads_match_diskstats_and_are_attributed_to_their_process() {
    if !require_root("direct_reads_match_diskstats") {
        return;
    }
    let dir = temp_dir().expect("temp dir");
    let lo = LoopDevice::create(dir.path(), 256 << 20, true).expect("loop device");
    let daemon = Daemon::with_config(&format!(
        "block_inflight_timeout_secs = 1\n{}",
        rules_config(&[("test", "direct-read", "^pgio-load$")])
    ))
    .expect("daemon");
    let dev = lo.path().to_str().expect("utf-8 path").to_owned();
    let mut load = LoadProcess::spawn(
        &pgio_load_bin().expect("pgio-load"),
        ["direct-read", &dev, &READS.to_string(), "8192"],
    )
    .expect("spawn pgio-load");
    daemon.wait_tracked("test", "direct-read");
    // udev/blkid probe a new loop device: let that finish before the window opens.
    lo.wait_quiet(Duration::from_secs(5));

    std::thread::sleep(SETTLE);
    let (before, disk_before) = snapshot(&daemon, lo.name());
    assert_eq!(load.expect_run(), READS);
    std::thread::sleep(SETTLE);
    let (after, disk_after) = snapshot(&daemon, lo.name());

    let device = [("device", lo.name()), ("op", "read")];
    let disk_reads = (disk_after.reads_completed - disk_before.reads_completed) as f64;
    let pgio_reads = delta(&before, &after, "pgio_block_io_requests_total", &device);
    let lost = delta(
        &before,
        &after,
        "pgio_block_io_lost_completions_total",
        &device,
    );
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
        "diskstats reads {disk_reads}, pgio reads {pgio_reads} + lost {lost}, attributed to pid {} {attributed}, bytes {bytes}; {}",
        load.pid(),
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
    assert!(
        lost <= 0.01 * disk_reads,
        "{lost} of {disk_reads} completions never seen"
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
