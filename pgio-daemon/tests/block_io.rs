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

/// Sends SIGCONT to a process this test stopped, also when an assertion fails first.
struct Stopped(u32);

impl Stopped {
    fn stop(pid: u32) -> Stopped {
        // SAFETY: plain syscall on a child process of this test (the stand-in's frontend).
        assert_eq!(
            unsafe { libc::kill(pid as i32, libc::SIGSTOP) },
            0,
            "SIGSTOP"
        );
        Stopped(pid)
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        // SAFETY: as above.
        unsafe { libc::kill(self.0 as i32, libc::SIGCONT) };
    }
}

/// A request whose completion does not come within `block_inflight_timeout_secs` is counted
/// lost, on its submitter's series, by the next scrape; when it does complete later it is
/// not counted a second time (the sweep deleted it: the completion is `unmatched`). The
/// request is held by stopping the FUSE server under the Longhorn stand-in's volume device.
#[test]
fn a_request_that_never_completes_is_counted_lost_once() {
    if !require_root("a_request_that_never_completes_is_counted_lost_once") {
        return;
    }
    let vol = pgio_testkit::LonghornVolume::start(pgio_testkit::LonghornOptions {
        replicas: 1,
        sync_agent: false,
        ..Default::default()
    })
    .expect("Longhorn stand-in");
    let daemon = Daemon::with_config(&format!(
        "block_inflight_timeout_secs = 1\nlonghorn_device_dir = \"\"\n{}",
        rules_config(&[("test", "stalled-read", "^(sh|dd)$")])
    ))
    .expect("daemon");
    assert!(
        vol.wait_quiet(Duration::from_secs(10)),
        "volume never quiet"
    );
    let dev = vol.device_name().to_owned();
    let device = [("device", dev.as_str()), ("op", "read")];
    let on_dd = [
        ("device", dev.as_str()),
        ("op", "read"),
        ("app", "test"),
        ("role", "stalled-read"),
    ];
    // dd reads at once after its exec, before userspace could classify a new process: a shell
    // tracked first execs it when told to, so the read is booked on the rule's series.
    let mut dd = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!(
            "read go && exec dd if={} of=/dev/null bs=4096 count=1 skip=1000 iflag=direct",
            vol.device().display()
        ))
        .stdin(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn sh");
    daemon.wait_tracked("test", "stalled-read");
    std::thread::sleep(SETTLE);
    let (before, disk_before) = snapshot(&daemon, &dev);

    let stopped = Stopped::stop(vol.frontend_pid());
    {
        use std::io::Write;
        let mut go = dd.stdin.take().expect("sh's stdin");
        go.write_all(b"go\n").expect("telling sh to exec dd");
    }
    let in_flight = || {
        std::fs::read_to_string(format!("/sys/block/{dev}/inflight"))
            .ok()
            .and_then(|s| s.split_whitespace().next()?.parse::<u64>().ok())
            .unwrap_or(0)
    };
    assert!(
        pgio_testkit::wait_until(Duration::from_secs(10), Duration::from_millis(20), || {
            in_flight() == 1
        }),
        "dd's read never went in flight on {dev}"
    );
    let d = |a: &pgio_testkit::Metrics, b: &pgio_testkit::Metrics, name, labels: &[_]| {
        delta(a, b, name, labels)
    };
    // The sweep runs in the once-a-second pass, every max(timeout / 8, 1 s): the request
    // shows as lost a second or two after its timeout.
    let mut mid = daemon.scrape();
    pgio_testkit::wait_until(Duration::from_secs(10), Duration::from_millis(100), || {
        mid = daemon.scrape();
        d(
            &before,
            &mid,
            "pgio_block_io_lost_completions_total",
            &on_dd,
        ) >= 1.0
    });
    std::thread::sleep(SETTLE);
    let mid = daemon.scrape();
    let lost_mid = d(
        &before,
        &mid,
        "pgio_block_io_lost_completions_total",
        &on_dd,
    );
    let counted_mid = d(&before, &mid, "pgio_block_io_requests_total", &device);

    drop(stopped);
    let status = dd.wait().expect("dd");
    assert!(
        vol.wait_quiet(Duration::from_secs(10)),
        "volume never quiet"
    );
    let (after, disk_after) = snapshot(&daemon, &dev);
    let disk = (disk_after.reads_completed - disk_before.reads_completed) as f64;
    let lost = d(
        &before,
        &after,
        "pgio_block_io_lost_completions_total",
        &device,
    );
    let counted = d(&before, &after, "pgio_block_io_requests_total", &device);
    let unmatched = d(
        &before,
        &after,
        "pgio_block_io_unmatched_completions_total",
        &device,
    );
    eprintln!(
        "held: in flight {}, lost {lost_mid}, counted {counted_mid}; released ({status}): \
         diskstats {disk}, counted {counted}, lost {lost}, unmatched {unmatched}; {}",
        in_flight(),
        losses(&before, &after)
    );
    assert!(status.success(), "dd failed: {status}");
    assert_eq!(
        (lost_mid, counted_mid),
        (1.0, 0.0),
        "held past the timeout: lost on dd's series, not counted"
    );
    assert_eq!(disk, 1.0, "diskstats reads of {dev}");
    assert_eq!(
        (counted, lost, unmatched),
        (0.0, 1.0, 1.0),
        "released: still lost once, its late completion unmatched, not counted"
    );
    daemon.stop().expect("clean daemon exit");
}
