//! Block requests: submitter at `block_io_start` (its context), queue time insert → issue,
//! device time issue → complete, joined on the `struct request *`. Completion runs in
//! softirq/IRQ context, so it never looks at "current".
use aya_ebpf::{
    helpers::{bpf_get_current_pid_tgid, bpf_ktime_get_ns, bpf_probe_read_kernel},
    macros::{btf_tracepoint, map},
    maps::{LruHashMap, PerCpuHashMap},
    programs::BtfTracePointContext,
};
use pgio_common::{
    SeriesId,
    block_io::{BlockIoInflight, BlockIoKey, BlockMetric, BlockOp, mkdev},
    drops::DropReason,
    hist::{Bucket, slot},
};

use crate::{drops, hist, kernel_offsets::offsets, syscall, tracked};

/// In-flight requests by `struct request *`. LRU: a completion we never see (device removed,
/// request started before pgio) must not leak an entry forever.
#[map]
static BLOCK_IO_INFLIGHT: LruHashMap<u64, BlockIoInflight> =
    LruHashMap::with_max_entries(65_536, 0);

#[map]
static BLOCK_IO_HIST: PerCpuHashMap<BlockIoKey, Bucket> =
    PerCpuHashMap::with_max_entries(65_536, 0);

#[inline(always)]
fn current_series() -> SeriesId {
    tracked::series_of((bpf_get_current_pid_tgid() >> 32) as u32).unwrap_or(SeriesId::UNTRACKED)
}

#[inline(always)]
fn start(rq: u64, series: SeriesId, start_ns: u64) -> Option<*mut BlockIoInflight> {
    let v = BlockIoInflight {
        series,
        start_ns,
        ..Default::default()
    };
    if BLOCK_IO_INFLIGHT.insert(&rq, &v, 0).is_err() {
        drops::count(DropReason::InflightFull);
        return None;
    }
    BLOCK_IO_INFLIGHT.get_ptr_mut(&rq)
}

/// Runs in the submitter's context (kernel >= 6.5).
#[btf_tracepoint(function = "block_io_start")]
pub fn block_io_start(ctx: BtfTracePointContext) -> i32 {
    let rq: u64 = ctx.arg(0);
    let series = current_series();
    let _ = start(rq, series, unsafe { bpf_ktime_get_ns() });
    if series.is_tracked() {
        syscall::mark_block_io();
    }
    0
}

/// Only requests that go through a scheduler queue get here. A request we have not seen yet
/// (kernel without `block_io_start`) is attributed to the inserting task.
#[btf_tracepoint(function = "block_rq_insert")]
pub fn block_rq_insert(ctx: BtfTracePointContext) -> i32 {
    let rq: u64 = ctx.arg(0);
    let e = match BLOCK_IO_INFLIGHT.get_ptr_mut(&rq) {
        Some(e) => e,
        None => match start(rq, current_series(), 0) {
            Some(e) => e,
            None => return 0,
        },
    };
    // SAFETY: map value pointer; a racing completion can at worst make this entry stale.
    unsafe { (*e).insert_ns = bpf_ktime_get_ns() };
    0
}

#[btf_tracepoint(function = "block_rq_issue")]
pub fn block_rq_issue(ctx: BtfTracePointContext) -> i32 {
    let rq: u64 = ctx.arg(0);
    let e = match BLOCK_IO_INFLIGHT.get_ptr_mut(&rq) {
        Some(e) => e,
        None => match start(rq, current_series(), 0) {
            Some(e) => e,
            None => return 0,
        },
    };
    unsafe { (*e).issue_ns = bpf_ktime_get_ns() };
    0
}

#[inline(always)]
unsafe fn read<T>(addr: u64) -> Option<T> {
    unsafe { bpf_probe_read_kernel(addr as *const T).ok() }
}

/// `rq->q->disk->{major, first_minor}` and the op from `rq->cmd_flags`.
#[inline(always)]
fn device_and_op(rq: u64) -> Option<(u32, BlockOp)> {
    let off = offsets();
    unsafe {
        let flags: u32 = read(rq + off.request_cmd_flags as u64)?;
        let q: u64 = read(rq + off.request_q as u64)?;
        let disk: u64 = read(q + off.queue_disk as u64)?;
        if disk == 0 {
            return None;
        }
        let major: i32 = read(disk + off.gendisk_major as u64)?;
        let minor: i32 = read(disk + off.gendisk_first_minor as u64)?;
        Some((
            mkdev(major as u32, minor as u32),
            BlockOp::from_cmd_flags(flags),
        ))
    }
}

/// A completion with no in-flight entry, or of a request never issued itself, counted per
/// device and op. Not a loss as a rule: a request that goes through a flush sequence
/// (REQ_PREFLUSH/REQ_FUA) fires `block_rq_complete` twice, once for its data and once at the
/// end of the sequence, and an empty flush completes without being issued (its flush request
/// is); also requests issued before pgio started.
#[inline(always)]
fn unmatched(rq: u64, nr_bytes: u32) {
    let Some((dev, op)) = device_and_op(rq) else {
        drops::count(DropReason::DeviceUnreadable);
        return;
    };
    let key = BlockIoKey {
        series: SeriesId::UNTRACKED,
        dev,
        op: op as u8,
        metric: BlockMetric::Unmatched as u8,
        slot: 0,
        _pad: 0,
    };
    hist::add(&BLOCK_IO_HIST, &key, 0, nr_bytes as u64);
}

/// `block_rq_complete(struct request *rq, blk_status_t error, unsigned int nr_bytes)`.
#[btf_tracepoint(function = "block_rq_complete")]
pub fn block_rq_complete(ctx: BtfTracePointContext) -> i32 {
    let now = unsafe { bpf_ktime_get_ns() };
    let rq: u64 = ctx.arg(0);
    let nr_bytes: u32 = ctx.arg(2);
    let Some(e) = BLOCK_IO_INFLIGHT.get_ptr(&rq) else {
        unmatched(rq, nr_bytes);
        return 0;
    };
    let mut e = unsafe { *e };
    let _ = BLOCK_IO_INFLIGHT.remove(&rq);
    if e.issue_ns == 0 {
        // Never issued itself: an empty flush (the flush sequence issues its own flush
        // request, which is counted; the kernel does not account the original either).
        if e.start_ns == 0 || nr_bytes == 0 {
            unmatched(rq, nr_bytes);
            return 0;
        }
        // Started, carried data, but its issue went unseen: still one request of this
        // submitter.
        drops::count(DropReason::IssueMissed);
        e.issue_ns = e.start_ns;
        e.insert_ns = 0;
    }
    let Some((dev, op)) = device_and_op(rq) else {
        drops::count(DropReason::DeviceUnreadable);
        return 0;
    };
    let device_ns = now.wrapping_sub(e.issue_ns);
    let mut key = BlockIoKey {
        series: e.series,
        dev,
        op: op as u8,
        metric: BlockMetric::Device as u8,
        slot: slot(device_ns),
        _pad: 0,
    };
    hist::add(&BLOCK_IO_HIST, &key, device_ns, nr_bytes as u64);
    if e.insert_ns != 0 && e.issue_ns >= e.insert_ns {
        let queue_ns = e.issue_ns - e.insert_ns;
        key.metric = BlockMetric::Queue as u8;
        key.slot = slot(queue_ns);
        hist::add(&BLOCK_IO_HIST, &key, queue_ns, 0);
    }
    0
}
