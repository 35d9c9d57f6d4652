//! device-mapper: a `dm-delay` device (bio-based, so no `block_rq_*` event ever names it) over
//! a disk below, reads delayed by 20 ms. pgio shows the dm layer as its own device, on the
//! series of the process that submitted to it, from `block_bio_queue`/`block_bio_complete`:
//! - direct reads: the dm device's read requests equal its /proc/diskstats delta and all are
//!   the reader's, each ≥ 16 ms (20 ms at HZ=250 is 5 ticks, the first of which may be
//!   partial); the disk below keeps its own series (equal to its own diskstats delta), its
//!   time well below the dm device's; the reader's reads are page cache misses;
//! - PostgreSQL 15 on ext4 on the dm device: a cold sequential scan's reads of the dm device
//!   are the client backend's.
//!
//! Writes are not delayed (mkfs, initdb and the table load stay quick). The two tests share
//! the disk below, so they run one at a time.
//!
//! The disk below is `cargo xtask integration`'s spare virtio disk (`PGIO_TEST_SPARE_DISK`), or
//! a loop device elsewhere. Needs the `dm_delay` module: skipped (with the reason) on a kernel
//! without it, e.g. the CI host; required under `cargo xtask integration`.
mod common;

use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use common::{Daemon, delta, delta_by, losses, snapshot};
use pgio_testkit::{
    Ext4Mount, LoopDevice, PG15_BIN_DIR, PgCluster, PgOptions, TempDir, devmapper, diskstats,
    require_root, rules_config, temp_dir,
};

const READS: u64 = 200;
const BLOCK: u32 = 8192;
const DELAY_MS: u32 = 20;
/// The shortest a delayed bio can take at HZ=250 (see the module comment), with margin.
const MIN_DELAYED_S: f64 = 0.016;
const SETTLE: Duration = Duration::from_millis(1300);

/// The disk below the dm device: the guest's spare disk, else a loop device in `dir`.
enum Below {
    Spare(PathBuf),
    Loop(LoopDevice),
}

impl Below {
    fn new(dir: &Path) -> Below {
        match devmapper::spare_disk() {
            Some(disk) => Below::Spare(disk),
            None => Below::Loop(LoopDevice::create(dir, 256 << 20, true).expect("loop device")),
        }
    }

    fn path(&self) -> &Path {
        match self {
            Below::Spare(p) => p,
            Below::Loop(l) => l.path(),
        }
    }

    fn name(&self) -> String {
        self.path()
            .file_name()
            .and_then(|n| n.to_str())
            .expect("device name")
            .to_owned()
    }
}

/// None (with the skip printed) when this kernel cannot make a dm-delay device.
fn setup(test: &str) -> Option<(MutexGuard<'static, ()>, TempDir)> {
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    let guard = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    if !require_root(test) {
        return None;
    }
    if let Some(why) = devmapper::unavailable() {
        assert!(
            pgio_testkit::emulated().is_none(),
            "{test}: {why}, but cargo xtask integration's guests must have it"
        );
        eprintln!("{test}: skipped: {why}");
        return None;
    }
    Some((guard, temp_dir().expect("temp dir")))
}

fn device_hist(
    before: &pgio_testkit::Metrics,
    after: &pgio_testkit::Metrics,
    labels: &[(&str, &str)],
) -> pgio_testkit::metrics::Histogram {
    let h = |m: &pgio_testkit::Metrics| {
        m.histogram("pgio_block_io_device_seconds", labels)
            .unwrap_or_default()
    };
    h(after).since(&h(before))
}

#[test]
fn direct_reads_of_a_dm_delay_device_are_the_readers_on_dm_and_below() {
    let Some((_one, dir)) = setup("device_mapper direct reads") else {
        return;
    };
    let below = Below::new(dir.path());
    let dm = devmapper::DelayDevice::create(below.path(), DELAY_MS, 0).expect("dm-delay");
    let daemon = Daemon::with_config(&format!(
        "block_inflight_timeout_secs = 1\n{}",
        rules_config(&[("test", "dm-read", "^pgio-load$")])
    ))
    .expect("daemon");
    let mut load = pgio_testkit::load::direct_reader(dm.path(), READS, BLOCK).expect("pgio-load");
    daemon.wait_tracked("test", "dm-read");
    std::thread::sleep(SETTLE);
    let (before, dm_before) = snapshot(&daemon, dm.kernel_name());
    let below_before = diskstats(&below.name()).expect("diskstats below");
    assert_eq!(load.expect_run(), READS);
    std::thread::sleep(SETTLE);
    let (after, dm_after) = snapshot(&daemon, dm.kernel_name());
    let below_after = diskstats(&below.name()).expect("diskstats below");

    let below_name = below.name();
    fn on(dev: &str) -> [(&str, &str); 2] {
        [("device", dev), ("op", "read")]
    }
    let reader = [("app", "test"), ("role", "dm-read")];
    let dm_reads = (dm_after.reads_completed - dm_before.reads_completed) as f64;
    let below_reads = (below_after.reads_completed - below_before.reads_completed) as f64;
    let requests = |dev: &str| {
        delta(&before, &after, "pgio_block_io_requests_total", &on(dev))
            + delta(
                &before,
                &after,
                "pgio_block_io_lost_completions_total",
                &on(dev),
            )
    };
    let (pgio_dm, pgio_below) = (requests(dm.kernel_name()), requests(&below_name));
    let mut reader_dm = on(dm.kernel_name()).to_vec();
    reader_dm.extend(reader);
    let attributed = delta(&before, &after, "pgio_block_io_requests_total", &reader_dm);
    let dm_time = device_hist(&before, &after, &reader_dm);
    let below_time = device_hist(&before, &after, &on(&below_name));
    let mut miss = reader.to_vec();
    miss.extend([("syscall", "pread64"), ("cache", "miss")]);
    let misses = delta(&before, &after, "pgio_syscall_seconds_count", &miss);
    eprintln!(
        "{} (delay {DELAY_MS} ms) over {below_name}: diskstats reads {dm_reads} / {below_reads}, \
         pgio {pgio_dm} / {pgio_below}; the reader's on {}: {attributed}, mean {:.2} ms, \
         {} ≤ {MIN_DELAYED_S} s; {below_name} mean {:.2} ms; the reader's pread64 misses \
         {misses}; {}",
        dm.kernel_name(),
        dm.kernel_name(),
        1e3 * dm_time.sum / dm_time.count.max(1.0),
        dm_time.count_le(MIN_DELAYED_S),
        1e3 * below_time.sum / below_time.count.max(1.0),
        losses(&before, &after)
    );
    assert_eq!(dm_reads, READS as f64, "diskstats of {}", dm.kernel_name());
    assert_eq!(
        pgio_dm,
        dm_reads,
        "pgio's read requests (+ lost) of {} against /proc/diskstats",
        dm.kernel_name()
    );
    assert_eq!(
        attributed, READS as f64,
        "the reader's reads of the dm device"
    );
    assert_eq!(
        pgio_below, below_reads,
        "pgio's read requests (+ lost) of {below_name} against /proc/diskstats"
    );
    assert!(below_reads >= READS as f64, "{below_name}: {below_reads}");
    assert_eq!(dm_time.count, READS as f64);
    assert_eq!(
        dm_time.count_le(MIN_DELAYED_S),
        0.0,
        "every read waited the delay at the dm layer"
    );
    assert!(
        below_time.sum / below_time.count < dm_time.sum / dm_time.count - MIN_DELAYED_S,
        "the delay is above {below_name}, not in it"
    );
    assert_eq!(
        misses, READS as f64,
        "each direct read missed the page cache"
    );
    daemon.stop().expect("clean daemon exit");
}

#[test]
fn a_cold_postgres_scan_on_dm_delay_is_the_client_backends_on_dm() {
    let Some((_one, dir)) = setup("device_mapper postgres") else {
        return;
    };
    let below = Below::new(dir.path());
    let dm = devmapper::DelayDevice::create(below.path(), DELAY_MS, 0).expect("dm-delay");
    let mut fs = Ext4Mount::on_device(dm.path(), &dir.path().join("mnt")).expect("ext4");
    let opts = PgOptions::new(PG15_BIN_DIR, fs.path().join("pgdata"), 55_441)
        .shared_buffers("16MB")
        .setting("autovacuum", "off");
    let mut pg = PgCluster::init_with(opts).expect("initdb");
    pg.start().expect("start");
    // ~18 MB, beyond shared_buffers' ring for a sequential scan.
    pg.psql(
        "CREATE TABLE t AS SELECT g, repeat('x', 200) AS pad FROM generate_series(1, 80000) g; \
         CHECKPOINT",
    )
    .expect("table");
    pg.stop().expect("stop");
    fs.remount().expect("remount (cold cache)");
    let daemon = Daemon::start(&[]).expect("daemon");
    pg.start().expect("start cold");
    daemon.wait_tracked("postgres", "postmaster");
    std::thread::sleep(SETTLE);

    let (before, dm_before) = snapshot(&daemon, dm.kernel_name());
    // One process reads: no parallel workers (PostgreSQL would start 2 for this table).
    let rows = pg
        .psql("SET max_parallel_workers_per_gather = 0; SELECT count(*) FROM t")
        .expect("scan");
    std::thread::sleep(SETTLE);
    let (after, dm_after) = snapshot(&daemon, dm.kernel_name());

    let on_dm = [("device", dm.kernel_name()), ("op", "read")];
    let dm_reads = (dm_after.reads_completed - dm_before.reads_completed) as f64;
    let pgio_dm = delta(&before, &after, "pgio_block_io_requests_total", &on_dm)
        + delta(
            &before,
            &after,
            "pgio_block_io_lost_completions_total",
            &on_dm,
        );
    let mut backend = on_dm.to_vec();
    backend.extend([("app", "postgres"), ("role", "client backend")]);
    let backend_reads = delta(&before, &after, "pgio_block_io_requests_total", &backend);
    let backend_time = device_hist(&before, &after, &backend);
    let by_role = delta_by(
        &before,
        &after,
        "pgio_block_io_requests_total",
        &on_dm,
        &["app", "role"],
    );
    eprintln!(
        "count(*) = {rows}: {} reads: diskstats {dm_reads}, pgio {pgio_dm}, client backend \
         {backend_reads}, mean {:.2} ms; by role {by_role:?}; {}",
        dm.kernel_name(),
        1e3 * backend_time.sum / backend_time.count.max(1.0),
        losses(&before, &after)
    );
    assert_eq!(rows.lines().last(), Some("80000"));
    assert!(dm_reads >= 10.0, "a cold scan read {dm_reads} times");
    assert_eq!(pgio_dm, dm_reads, "pgio against /proc/diskstats");
    assert!(
        backend_reads >= 0.95 * dm_reads,
        "{backend_reads} of {dm_reads} reads of {} on the client backend",
        dm.kernel_name()
    );
    assert_eq!(
        backend_time.count_le(MIN_DELAYED_S),
        0.0,
        "every read waited the delay"
    );
    pg.stop().expect("stop");
    drop(pg);
    daemon.stop().expect("clean daemon exit");
    fs.unmount().expect("unmount");
}
