//! Userspace side of the block probes: reads `BLOCK_IO_HIST` at scrape time and writes the
//! `pgio_block_io_*` families; sweeps `BLOCK_IO_INFLIGHT` in the once-a-second pass for
//! requests whose completion never came (counted lost, so none is dropped in silence).
use std::{
    sync::Mutex,
    time::{Duration, Instant},
};

use anyhow::Result;
use aya::{
    Ebpf,
    maps::{HashMap, MapData},
};
use pgio_common::{
    SeriesId,
    block_io::{BlockIoInflight, BlockIoKey, BlockIoRow, BlockMetric, BlockOp, QUOTA, ROW_METRICS},
};

use crate::{
    collector::{Scrape, Snapshot, Source},
    config::Config,
    exposition::{Encoder, Kind, MetricFamily},
    family::{Attach, Family, Probe, Setup, Taken},
    hist::{HistId, HistKey, HistMapSpec, HistSnapshot, HistSource, HistValue, Hists, Log2Hist},
    labels::BlockLabels,
    lock,
    maps::take_map,
    provisional::Provisional,
};

pub static INFLIGHT_TIMEOUT: crate::config::Key = crate::config::Key::at_least(
    "block_inflight_timeout_secs",
    180,
    1,
    "a block request issued this long ago, never seen completing, counts in pgio_block_io_lost_completions_total and is forgotten (SCSI: 30 s, 5 retries)",
);
static CONFIG_KEYS: &[&crate::config::Key] = &[&INFLIGHT_TIMEOUT];

pub static HIST: HistMapSpec = HistMapSpec {
    family: "block_io",
    map: "BLOCK_IO_HIST",
    quota: QUOTA,
};
const INFLIGHT_MAP: &str = "BLOCK_IO_INFLIGHT";

/// The block family (`Family`).
pub struct BlockIoFamily;

impl Family for BlockIoFamily {
    fn config_keys(&self) -> &'static [&'static crate::config::Key] {
        CONFIG_KEYS
    }

    fn name(&self) -> &'static str {
        "block_io"
    }

    fn probes(&self) -> Vec<Probe> {
        use Attach::BtfTracePoint;
        vec![
            // Kernel >= 6.5; before it the submitter comes from insert/issue.
            Probe::new("block_io_start", BtfTracePoint, true),
            Probe::new("block_rq_insert", BtfTracePoint, false),
            Probe::new("block_rq_issue", BtfTracePoint, false),
            Probe::new("block_rq_requeue", BtfTracePoint, false),
            Probe::new("block_rq_complete", BtfTracePoint, false),
            // Bio-based disks (dm-N, md, zram): without them only the disks below are seen.
            Probe::new("block_bio_queue", BtfTracePoint, true),
            Probe::new("block_bio_complete", BtfTracePoint, true),
        ]
    }

    fn maps(&self) -> &'static [&'static str] {
        &["BLOCK_IO_HIST", INFLIGHT_MAP]
    }

    fn hist_map(&self) -> Option<&'static HistMapSpec> {
        Some(&HIST)
    }

    fn setup(&self, config: &Config) -> Setup {
        Setup {
            map_sizes: vec![(HIST.map, hist_rows(config))],
            ..Setup::default()
        }
    }

    fn take(&self, ebpf: &mut Ebpf, config: &Config) -> Result<Taken> {
        let block = BlockIo::take(ebpf, config.secs(&INFLIGHT_TIMEOUT), hist_rows(config))?;
        Ok(Taken {
            balanced: Some(block.hists.balanced()),
            source: Some(Box::new(block)),
        })
    }
}

/// One block histogram: a submitter series' requests on a device, by op.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct BlockIoId {
    pub series: SeriesId,
    /// Kernel `dev_t`: `major << 20 | minor`.
    pub dev: u32,
    pub op: BlockOp,
    pub metric: BlockMetric,
}

/// Rows of `BLOCK_IO_HIST`: one per (series, device, op), each holding that key's every
/// histogram (1.5 KiB), where a one-slot key held one slot of one: a sixteenth of
/// `hist_map_max_entries` (4,096 by default, 6.6 MiB), at least 1,024.
fn hist_rows(config: &Config) -> u32 {
    (crate::hist::entries(config) / 16).max(1024)
}

impl HistValue for BlockIoRow {
    fn merge(&mut self, o: &BlockIoRow) {
        for (a, b) in self.slots.iter_mut().zip(&o.slots) {
            for (x, y) in a.iter_mut().zip(b) {
                *x = x.wrapping_add(*y);
            }
        }
        for (x, y) in self.sum_ns.iter_mut().zip(&o.sum_ns) {
            *x = x.wrapping_add(*y);
        }
        self.bytes = self.bytes.wrapping_add(o.bytes);
        self.lost = self.lost.wrapping_add(o.lost);
        self.unmatched = self.unmatched.wrapping_add(o.unmatched);
    }
}

impl HistKey for BlockIoKey {
    type Id = BlockIoId;
    type Value = BlockIoRow;

    fn series(&self) -> SeriesId {
        self.series
    }

    /// A histogram for each metric the row has counts of: its device histogram carries the
    /// bytes, lost and unmatched requests are counts (slot 0).
    fn add_to(&self, series: SeriesId, row: &BlockIoRow, hists: &mut Hists<BlockIoId>) -> bool {
        let Ok(op) = BlockOp::try_from(self.op) else {
            return false;
        };
        let id = |metric| BlockIoId {
            series,
            dev: self.dev,
            op,
            metric,
        };
        for (m, metric) in ROW_METRICS.into_iter().enumerate() {
            if row.slots[m].iter().all(|&n| n == 0) {
                continue;
            }
            let h = hists.entry(id(metric)).or_default();
            h.add_row(&row.slots[m], row.sum_ns[m]);
            if metric == BlockMetric::Device {
                h.bytes = h.bytes.wrapping_add(row.bytes);
            }
        }
        for (metric, n) in [
            (BlockMetric::Lost, row.lost),
            (BlockMetric::Unmatched, row.unmatched),
        ] {
            if n != 0 {
                let h = hists.entry(id(metric)).or_default();
                h.slots[0] = h.slots[0].wrapping_add(n);
            }
        }
        true
    }
}

pub struct BlockIo {
    hists: HistSource<BlockIoKey>,
    inflight: Mutex<HashMap<MapData, u64, BlockIoInflight>>,
    timeout: Duration,
    /// When the sweep last ran (`sweep_every`).
    swept: Mutex<Instant>,
}

impl BlockIo {
    /// `timeout`: how long a request may be in flight before its completion counts as lost;
    /// `max_entries`: the histogram map's size as loaded.
    pub fn take(ebpf: &mut Ebpf, timeout: Duration, max_entries: u32) -> Result<BlockIo> {
        Ok(BlockIo {
            hists: HistSource::take(ebpf, &HIST, max_entries)?,
            inflight: Mutex::new(take_map(ebpf, INFLIGHT_MAP)?),
            timeout,
            swept: Mutex::new(Instant::now()),
        })
    }

    /// Counts as lost every request issued longer than `timeout` ago, and forgets it: the
    /// kernel side finds a lost completion only when the same `struct request` starts again,
    /// which an idle device may never do. Entries never issued for `UNISSUED_FORGET` are
    /// requests that ended without IO of their own (a request merged into another, a flush the
    /// flush sequence replaced): forgotten. Idle entries (a completed request's, kept for its
    /// `struct request`'s next use) are left to the LRU. Reads every entry (two syscalls each,
    /// ~130 ms for a full map here), so it runs in the once-a-second pass, every
    /// `sweep_every`, never in a scrape.
    fn sweep(&self) {
        let now = monotonic_ns();
        let timeout = self.timeout.as_nanos() as u64;
        let mut map = lock(&self.inflight);
        let stale: Vec<(u64, BlockIoInflight)> = map
            .iter()
            .filter_map(|r| r.ok())
            .filter(|(_, e)| is_lost(e, now, timeout) || never_issued(e, now))
            .collect();
        for (rq, e) in stale {
            if map.remove(&rq).is_ok() && e.issue_ns != 0 {
                self.hists.reader.book(
                    row_key(&e),
                    BlockIoRow {
                        lost: 1,
                        ..BlockIoRow::ZERO
                    },
                );
            }
        }
    }
}

/// How often the sweep reads the in-flight map: an eighth of the lost-request timeout (a lost
/// request shows at most that late), between 1 and 30 s.
fn sweep_every(timeout: Duration) -> Duration {
    (timeout / 8).clamp(Duration::from_secs(1), Duration::from_secs(30))
}

/// How long a forked process' provisional series is kept for its block requests' late
/// completions (`provisional::grace`): until the sweep has counted them lost.
pub fn provisional_grace(config: &Config) -> Duration {
    let timeout = config.secs(&INFLIGHT_TIMEOUT);
    crate::provisional::grace(timeout, sweep_every(timeout))
}

/// How long a request may wait to be issued before the sweep forgets it: far longer than any
/// scheduler holds one (and a request issued after all is still counted, from its issue).
const UNISSUED_FORGET: Duration = Duration::from_secs(120);

/// Submitted `UNISSUED_FORGET` ago and not issued since (not idle).
fn never_issued(e: &BlockIoInflight, now_ns: u64) -> bool {
    !e.is_idle()
        && e.issue_ns == 0
        && now_ns.saturating_sub(e.submitted_ns()) > UNISSUED_FORGET.as_nanos() as u64
}

/// Issued (and not requeued since) longer than `timeout_ns` before `now_ns`.
fn is_lost(e: &BlockIoInflight, now_ns: u64, timeout_ns: u64) -> bool {
    e.issue_ns != 0 && now_ns.saturating_sub(e.issue_ns) > timeout_ns
}

fn row_key(e: &BlockIoInflight) -> BlockIoKey {
    BlockIoKey {
        series: e.series,
        dev: e.dev,
        op: e.op,
        _pad: 0,
        _pad2: 0,
    }
}

/// `CLOCK_MONOTONIC`, the clock of `bpf_ktime_get_ns` (also a relation slot's `last_ns`).
pub(crate) fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid timespec pointer; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

impl Source for BlockIo {
    fn read(&self, routes: &Provisional) -> Box<dyn Snapshot> {
        self.hists.read(routes)
    }

    fn fold(&self, routes: &Provisional) -> Result<()> {
        self.hists.fold(routes)
    }

    fn housekeep(&self, _: &crate::series::SharedTracked) {
        let mut swept = lock(&self.swept);
        if swept.elapsed() >= sweep_every(self.timeout) {
            self.sweep();
            *swept = Instant::now();
        }
    }
}

/// Every block histogram; `BlockMetric::Unmatched` ones (series untracked, slot 0) count
/// completions only.
pub type BlockIoSnapshot = HistSnapshot<BlockIoId>;

pub static DEVICE_SECONDS: MetricFamily = MetricFamily {
    name: "pgio_block_io_device_seconds",
    help: "Block request device time, issue to complete, by submitting process series (seconds).",
    kind: Kind::Histogram,
};
pub static QUEUE_SECONDS: MetricFamily = MetricFamily {
    name: "pgio_block_io_queue_seconds",
    help: "Block request queue time, submission (block_io_start; block_rq_insert before kernel 6.5) to issue (seconds).",
    kind: Kind::Histogram,
};
pub static SECONDS: MetricFamily = MetricFamily {
    name: "pgio_block_io_seconds",
    help: "Block request time, submission to complete: queue plus device time, like biolatency -Q (seconds).",
    kind: Kind::Histogram,
};
static REQUESTS: MetricFamily = MetricFamily {
    name: "pgio_block_io_requests",
    help: "Block requests completed, by submitting process series.",
    kind: Kind::Counter,
};
static BYTES: MetricFamily = MetricFamily {
    name: "pgio_block_io_bytes",
    help: "Bytes of block requests completed, by submitting process series.",
    kind: Kind::Counter,
};
static UNMATCHED: MetricFamily = MetricFamily {
    name: "pgio_block_io_unmatched_completions",
    help: "block_rq_complete events pgio could not match to a request it saw start and issue, by device and op: the second completion of requests in a flush sequence (PREFLUSH/FUA writes), empty flushes (their flush request is counted), requests issued before pgio started, or (rarely) a request still in flight while 65,536 others started after it. Not lost IO as a rule.",
    kind: Kind::Counter,
};
static LOST: MetricFamily = MetricFamily {
    name: "pgio_block_io_lost_completions",
    help: "Block requests pgio saw issued but never saw complete (the kernel started the same request again, or it was in flight longer than block_inflight_timeout_secs), by submitting process series. Not in pgio_block_io_requests_total.",
    kind: Kind::Counter,
};

fn of(
    hists: &Hists<BlockIoId>,
    metric: BlockMetric,
) -> impl Iterator<Item = (&BlockIoId, &Log2Hist)> {
    hists.iter().filter(move |(id, _)| id.metric == metric)
}

impl HistId for BlockIoId {
    fn series(&self) -> SeriesId {
        self.series
    }

    fn encode(hists: &Hists<BlockIoId>, scrape: &mut Scrape<'_>, enc: &mut Encoder) {
        for id in hists.keys() {
            scrape.devices.see(id.dev);
        }
        let scrape = &*scrape;
        // `volume`: the device's Longhorn volume, else the submitter's (see `BlockLabels`).
        let labels = |id: &BlockIoId| BlockLabels {
            series: scrape.series(id.series),
            device: scrape.devices.name(id.dev),
            op: id.op.name(),
            device_volume: scrape.devices.volume(id.dev),
        };
        let mut f = enc.family(&DEVICE_SECONDS);
        for (id, h) in of(hists, BlockMetric::Device) {
            f.histogram(labels(id), h);
        }
        let mut f = enc.family(&QUEUE_SECONDS);
        for (id, h) in of(hists, BlockMetric::Queue) {
            f.histogram(labels(id), h);
        }
        let mut f = enc.family(&SECONDS);
        for (id, h) in of(hists, BlockMetric::Total) {
            f.histogram(labels(id), h);
        }
        let mut f = enc.family(&REQUESTS);
        for (id, h) in of(hists, BlockMetric::Device) {
            f.counter(labels(id), h.count());
        }
        let mut f = enc.family(&BYTES);
        for (id, h) in of(hists, BlockMetric::Device) {
            f.counter(labels(id), h.bytes);
        }
        let mut f = enc.family(&UNMATCHED);
        for (id, h) in of(hists, BlockMetric::Unmatched) {
            let device = scrape.devices.name(id.dev);
            f.counter([("device", device), ("op", id.op.name())], h.count());
        }
        let mut f = enc.family(&LOST);
        for (id, h) in of(hists, BlockMetric::Lost) {
            f.counter(labels(id), h.count());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_issued_requests_older_than_the_timeout_are_lost() {
        let e = |issue_ns| BlockIoInflight {
            issue_ns,
            ..Default::default()
        };
        let now = 100_000_000_000;
        let timeout = 60_000_000_000;
        assert!(is_lost(&e(now - timeout - 1), now, timeout));
        assert!(!is_lost(&e(now - timeout), now, timeout));
        // Started, never issued (merged, or sitting in a queue): not a lost completion.
        assert!(!is_lost(&e(0), now, timeout));
        // Issued after `now` was taken (a racing issue): not lost.
        assert!(!is_lost(&e(now + 5), now, timeout));
    }

    #[test]
    fn a_row_becomes_the_histograms_it_has_counts_of() {
        let key = BlockIoKey {
            series: SeriesId(3),
            dev: 7 << 20,
            op: BlockOp::Read as u8,
            _pad: 0,
            _pad2: 0,
        };
        let mut row = BlockIoRow {
            bytes: 3 * 8192,
            lost: 1,
            ..BlockIoRow::ZERO
        };
        row.slots[0][20] = 3;
        row.sum_ns[0] = 3_000_000;
        row.slots[2][21] = 3;
        row.sum_ns[2] = 4_000_000;
        let mut hists = Hists::new();
        // Booked under the series it was routed to, not the key's.
        assert!(key.add_to(SeriesId(9), &row, &mut hists));
        let get = |metric| {
            hists.get(&BlockIoId {
                series: SeriesId(9),
                dev: 7 << 20,
                op: BlockOp::Read,
                metric,
            })
        };
        let device = get(BlockMetric::Device).expect("device histogram");
        assert_eq!((device.slots[20], device.count()), (3, 3));
        assert_eq!((device.sum_ns, device.bytes), (3_000_000, 3 * 8192));
        let total = get(BlockMetric::Total).expect("total histogram");
        assert_eq!((total.slots[21], total.count(), total.bytes), (3, 3, 0));
        assert_eq!(get(BlockMetric::Lost).map(Log2Hist::count), Some(1));
        // No queue time, no unmatched completion: no histogram.
        assert!(get(BlockMetric::Queue).is_none());
        assert!(get(BlockMetric::Unmatched).is_none());
        assert_eq!(hists.len(), 3);
        // An op this build does not know: left out.
        let unknown = BlockIoKey { op: 200, ..key };
        assert!(!unknown.add_to(SeriesId(9), &row, &mut Hists::new()));
    }

    #[test]
    fn the_sweep_runs_every_eighth_of_the_timeout_within_one_to_thirty_seconds() {
        let s = Duration::from_secs;
        assert_eq!(sweep_every(s(1)), s(1));
        assert_eq!(sweep_every(s(180)), Duration::from_millis(22_500));
        assert_eq!(sweep_every(s(3600)), s(30));
    }

    #[test]
    fn unissued_requests_are_forgotten_only_long_after_their_submission() {
        let now = 1_000_000_000_000;
        let forget = UNISSUED_FORGET.as_nanos() as u64;
        let started = |start_ns| BlockIoInflight {
            start_ns,
            ..Default::default()
        };
        assert!(never_issued(&started(now - forget - 1), now));
        assert!(!never_issued(&started(now - forget), now));
        // First seen at its insert (no `block_io_start`).
        let inserted = BlockIoInflight {
            insert_ns: now - forget - 1,
            ..Default::default()
        };
        assert!(never_issued(&inserted, now));
        // Issued: the lost-completion rule decides, not this one.
        let issued = BlockIoInflight {
            start_ns: now - forget - 1,
            issue_ns: now - forget - 1,
            ..Default::default()
        };
        assert!(!never_issued(&issued, now));
        // Idle: a completed request's entry, kept for the next one.
        assert!(!never_issued(&BlockIoInflight::default(), now));
    }
}
