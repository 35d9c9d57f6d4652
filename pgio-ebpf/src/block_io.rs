//! Block requests: submitter at `block_io_start` (its context), queue time submission → issue,
//! device time issue → complete, whole time submission → complete, joined on the
//! `struct request *`. Completion runs in softirq/IRQ context, so it never looks at "current".
//! A request is never dropped in silence: one whose completion pgio never sees (the kernel
//! skips its program for ~1 in 1,000-10,000 completions, see README) is counted `Lost`.
//! Bio-based disks (`dm-N`, md, zram) get no request events: their bios are joined instead,
//! `block_bio_queue` (submitter's context) → `block_bio_complete`, on the same map. The
//! programs of the hooks queue blame rides too are in the hook table (`hooks.rs`), which
//! calls this module's handler and then its `RequestRiders`.
use aya_ebpf::{
    EbpfContext as _,
    bindings::BPF_NOEXIST,
    helpers::{bpf_get_current_pid_tgid, bpf_ktime_get_ns},
    macros::{btf_tracepoint, map},
    maps::{HashMap, LruHashMap},
    programs::BtfTracePointContext,
};
use pgio_common::{
    SeriesId,
    block_io::{BlockIoInflight, BlockIoKey, BlockIoRow, BlockOp, QUOTA, mkdev},
    drops::DropReason,
    hist::{SLOTS, slot},
    queue_blame::QueueBlameMark,
};

use crate::{atomic::atomic_add, drops, hist, kernel_offsets::offsets, syscall, tracked};

/// What rides on a request's events after this family's own booking: the second column of
/// the hook table's block rows (`hooks.rs`, which defines these hooks' programs). Each is
/// handed the request's in-flight entry, so a rider needs no lookup of its own.
pub trait RequestRiders {
    /// A new request, its mark in `mark` (its entry's, or the copy about to be inserted);
    /// it waits on `wait_dev` (0: it does not) since `submitted_ns`.
    ///
    /// SAFETY: `mark` points to an in-flight map value's mark or a stack copy.
    unsafe fn started(mark: *mut QueueBlameMark, wait_dev: u32, submitted_ns: u64);
    /// Issued by `dev` at `now`.
    ///
    /// SAFETY: as `started`.
    unsafe fn issued(mark: *mut QueueBlameMark, series: SeriesId, dev: u32, op: u8, now: u64);
    /// A request (not a bio) of `series` completed by `dev` after `device_ns` on it; `mark`
    /// as `issued` left it.
    fn completed(
        mark: &QueueBlameMark,
        series: SeriesId,
        dev: u32,
        op: u8,
        device_ns: u64,
        now: u64,
    );
}

/// In-flight requests by `struct request *` (bios of bio-based disks by `struct bio *`). A
/// request's entry outlives it: blk-mq allocates a disk's `struct request`s once and reuses
/// them, so the next request on the same one finds its entry and writes it in place (a lookup,
/// ~40 ns) instead of an insert and a delete (~300 and ~150 ns here); a completed request
/// leaves it idle (all times 0). An LRU, because a big NVMe disk has more `struct request`s
/// than the map holds (hardware queues × depth, 1023 × 128 is common) and its tags cycle
/// through all of them: the least recently used, idle ones make room; an insert costs twice a
/// plain hash's, but only a request pointer not seen lately needs one. An entry whose
/// completion never comes is counted lost by userspace's sweep, one never issued (a request
/// merged away, a flush) is forgotten by it.
#[map]
static BLOCK_IO_INFLIGHT: LruHashMap<u64, BlockIoInflight> =
    LruHashMap::with_max_entries(65_536, 0);

/// One row of histograms per (submitter series, device, op), shared by every CPU (atomic
/// adds). A new row costs one of its owner's allowance (`key_quota`).
#[map]
static BLOCK_IO_HIST: HashMap<BlockIoKey, BlockIoRow> = HashMap::with_max_entries(4_096, 0);

/// What a new row is inserted from: 1.5 KiB does not fit the 512-byte BPF stack.
static ZERO_ROW: BlockIoRow = BlockIoRow::ZERO;

#[inline(always)]
fn current_series() -> SeriesId {
    match tracked::series_of((bpf_get_current_pid_tgid() >> 32) as u32) {
        // An io worker's request inside a call it does for a backend: that backend's.
        Some(s) => syscall::acting_series(s),
        None => SeriesId::UNTRACKED,
    }
}

/// A field of a kernel struct reached from a `tp_btf` argument: a plain load, which the
/// verifier checks against the kernel's BTF (the offset is a constant of the frozen
/// globals) and guards against faults, instead of a `bpf_probe_read_kernel` call (~40 ns each
/// here). A NULL pointer reads as 0.
#[inline(always)]
unsafe fn read<T: Copy>(addr: u64) -> Option<T> {
    Some(unsafe { core::ptr::read_volatile(addr as *const T) })
}

/// `rq->q->disk->{major, first_minor}` (before 5.15 `rq->rq_disk->…`) and the op from
/// `rq->cmd_flags`.
#[inline(always)]
fn device_and_op(rq: u64) -> Option<(u32, BlockOp)> {
    let off = offsets();
    unsafe {
        let flags: u32 = read(rq + off.request_cmd_flags as u64)?;
        let disk: u64 = if off.request_disk != 0 {
            read(rq + off.request_disk as u64)?
        } else {
            let q: u64 = read(rq + off.request_q as u64)?;
            read(q + off.queue_disk as u64)?
        };
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

/// The row of `(series, dev, op)`, made on first use if its owner may have one more.
#[inline(always)]
fn row(series: SeriesId, dev: u32, op: u8) -> Option<*mut BlockIoRow> {
    let key = BlockIoKey {
        series,
        dev,
        op,
        _pad: 0,
        _pad2: 0,
    };
    hist::row(&BLOCK_IO_HIST, &ZERO_ROW, QUOTA, series, &key)
}

/// A request pgio saw issued and never saw complete (`BlockMetric::Lost`).
#[inline(always)]
fn count_lost(series: SeriesId, dev: u32, op: u8) {
    if let Some(r) = row(series, dev, op) {
        // SAFETY: a map value, valid while the program runs; other CPUs add to it too.
        unsafe { atomic_add(&raw mut (*r).lost, 1) };
    }
}

/// The kernel starts a request pgio still holds as issued: its completion was never seen, so
/// it is counted as lost rather than overwritten in silence. Requeued requests had their issue
/// cleared.
#[inline(always)]
fn lost_if_issued(e: &BlockIoInflight) {
    if e.issue_ns != 0 {
        count_lost(e.series, e.dev, e.op);
    }
}

/// A request's entry as it starts: written field by field (a struct literal with zeroed
/// fields compiles to a call of aya-ebpf's byte-at-a-time `memset`).
#[derive(Clone, Copy)]
struct Fresh {
    series: SeriesId,
    dev: u32,
    op: u8,
    start_ns: u64,
    insert_ns: u64,
    issue_ns: u64,
    bytes: u32,
    /// The device a tracked request waits on from its submission, for queue blame's mark; 0:
    /// none (untracked, bio-based, or first seen at its issue).
    wait_dev: u32,
}

impl Fresh {
    /// The entry to insert (on the stack: only a new request pointer needs one).
    #[inline(always)]
    fn entry(&self) -> BlockIoInflight {
        BlockIoInflight {
            series: self.series,
            dev: self.dev,
            start_ns: self.start_ns,
            insert_ns: self.insert_ns,
            issue_ns: self.issue_ns,
            op: self.op,
            _pad: 0,
            _pad2: 0,
            bytes: self.bytes,
            blame: QueueBlameMark::ZERO,
        }
    }

    /// When the request's wait started (`BlockIoInflight::submitted_ns`).
    #[inline(always)]
    fn submitted_ns(&self) -> u64 {
        if self.start_ns != 0 {
            self.start_ns
        } else {
            self.insert_ns
        }
    }

    /// SAFETY: `e` points to an in-flight map value.
    #[inline(always)]
    unsafe fn write(&self, e: *mut BlockIoInflight) {
        use core::ptr::write_volatile as w;
        unsafe {
            w(&raw mut (*e).series, self.series);
            w(&raw mut (*e).dev, self.dev);
            w(&raw mut (*e).op, self.op);
            w(&raw mut (*e).start_ns, self.start_ns);
            w(&raw mut (*e).insert_ns, self.insert_ns);
            w(&raw mut (*e).issue_ns, self.issue_ns);
            w(&raw mut (*e).bytes, self.bytes);
        }
    }
}

/// A new in-flight entry, made whole (no lookup after it): written in place into the entry the
/// same `struct request` left idle, else inserted. An entry still issued lost its completion.
#[inline(always)]
fn start<R: RequestRiders>(rq: u64, v: Fresh) {
    if let Some(old) = BLOCK_IO_INFLIGHT.get_ptr_mut(&rq) {
        // SAFETY: map value pointer; only this request's own events touch it (and the sweep,
        // which reads it, and deletes it once lost).
        unsafe {
            lost_if_issued(&*old);
            v.write(old);
            R::started(&raw mut (*old).blame, v.wait_dev, v.submitted_ns());
        }
        return;
    }
    let mut e = v.entry();
    // SAFETY: a stack copy's mark.
    unsafe { R::started(&raw mut e.blame, v.wait_dev, v.submitted_ns()) };
    if BLOCK_IO_INFLIGHT
        .insert(&rq, &e, BPF_NOEXIST as u64)
        .is_err()
    {
        drops::count(DropReason::InflightFull);
    }
}

/// A fresh entry with only `dev`, `op` and the times given.
#[inline(always)]
fn fresh(series: SeriesId, start_ns: u64, insert_ns: u64, issue_ns: u64) -> Fresh {
    Fresh {
        series,
        dev: 0,
        op: 0,
        start_ns,
        insert_ns,
        issue_ns,
        bytes: 0,
        wait_dev: 0,
    }
}

/// The request's entry when pgio saw it start. An idle entry (left by the request's previous
/// use) is `None`, and so is an entry made at an insert or issue (a kernel without
/// `block_io_start`) and still issued when the kernel inserts or issues it again: it lost its
/// completion (a requeue clears the issue); the caller's `start` counts it and makes it anew.
#[inline(always)]
fn entry(rq: u64) -> Option<*mut BlockIoInflight> {
    let e = BLOCK_IO_INFLIGHT.get_ptr_mut(&rq)?;
    // SAFETY: map value pointer; only this request's own events touch it.
    unsafe { (!(*e).is_idle() && ((*e).issue_ns == 0 || (*e).start_ns != 0)).then_some(e) }
}

/// A request first seen at its insert or issue (kernel < 6.5, no `block_io_start`): that ran
/// in the submitter's context, so this is where a tracked thread's read becomes a page cache
/// miss (without it every read there counted as a hit).
#[inline(always)]
fn first_seen<R: RequestRiders>(rq: u64, mut v: Fresh) {
    v.series = current_series();
    if v.series.is_tracked() {
        syscall::mark_block_io();
        // Its wait starts at this insert (at an issue it has none).
        if v.insert_ns != 0 {
            v.wait_dev = device_and_op(rq).map_or(0, |(dev, _)| dev);
        }
    }
    start::<R>(rq, v);
}

/// The `struct request *` of `block_rq_insert`, `_issue` and `_requeue`: before 5.11 their
/// first argument was the queue. The offset is a constant of the frozen globals, so the
/// verifier drops the other branch (an argument the hook does not have is rejected).
#[inline(always)]
fn rq_arg(ctx: &BtfTracePointContext) -> u64 {
    if offsets().block_rq_arg == 1 {
        ctx.arg(1)
    } else {
        ctx.arg(0)
    }
}

/// `block_io_start`: runs in the submitter's context (kernel >= 6.5).
#[inline(always)]
pub fn io_start<R: RequestRiders>(ctx: &BtfTracePointContext) -> i32 {
    let rq: u64 = ctx.arg(0);
    let series = current_series();
    let mut v = fresh(series, unsafe { bpf_ktime_get_ns() }, 0, 0);
    if series.is_tracked() {
        // Its wait starts now; `rq->q->disk` is set when a request is allocated.
        v.wait_dev = device_and_op(rq).map_or(0, |(dev, _)| dev);
    }
    start::<R>(rq, v);
    if series.is_tracked() {
        syscall::mark_block_io();
    }
    0
}

/// `block_rq_insert`: only requests that go through a scheduler queue (or a requeue).
#[inline(always)]
pub fn rq_insert<R: RequestRiders>(ctx: &BtfTracePointContext) -> i32 {
    let rq = rq_arg(ctx);
    let now = unsafe { bpf_ktime_get_ns() };
    match entry(rq) {
        // SAFETY: map value pointer; a racing completion can at worst make this entry stale.
        Some(e) => unsafe {
            if (*e).insert_ns == 0 {
                (*e).insert_ns = now;
            }
        },
        None => first_seen::<R>(rq, fresh(SeriesId::UNTRACKED, 0, now, 0)),
    }
    0
}

/// `block_rq_issue`: keeps the device and op with the entry, for a request whose completion
/// never comes (the completion reads its own).
#[inline(always)]
pub fn rq_issue<R: RequestRiders>(ctx: &BtfTracePointContext) -> i32 {
    let rq = rq_arg(ctx);
    let now = unsafe { bpf_ktime_get_ns() };
    let (dev, op) = device_and_op(rq).unwrap_or((0, BlockOp::Other));
    match entry(rq) {
        // SAFETY: map value pointer; only this request's own events touch it.
        Some(e) => unsafe {
            (*e).dev = dev;
            (*e).op = op as u8;
            (*e).issue_ns = now;
            R::issued(&raw mut (*e).blame, (*e).series, dev, op as u8, now);
        },
        None => first_seen::<R>(
            rq,
            Fresh {
                dev,
                op: op as u8,
                ..fresh(SeriesId::UNTRACKED, 0, 0, now)
            },
        ),
    }
    0
}

/// A requeued request is issued again later: not a lost completion. Its times keep running
/// from its first submission.
#[btf_tracepoint(function = "block_rq_requeue")]
pub fn block_rq_requeue(ctx: BtfTracePointContext) -> i32 {
    let rq = rq_arg(&ctx);
    if let Some(e) = BLOCK_IO_INFLIGHT.get_ptr_mut(&rq) {
        unsafe { (*e).issue_ns = 0 };
    }
    0
}

/// `bio->bi_bdev->bd_disk` (before 5.12 `bio->bi_disk`) if that disk is bio-based (its queue
/// has no `mq_ops`): its device, op and bytes. `None` for a request-based disk's bio, which
/// its request counts.
#[inline(always)]
fn bio_based_device(bio: u64) -> Option<(u32, BlockOp, u32)> {
    let off = offsets();
    unsafe {
        let disk: u64 = if off.bio_bdev != 0 {
            let bdev: u64 = read(bio + off.bio_bdev as u64)?;
            if bdev == 0 {
                return None;
            }
            read(bdev + off.bdev_disk as u64)?
        } else {
            read(bio + off.bio_disk as u64)?
        };
        if disk == 0 {
            return None;
        }
        let q: u64 = read(disk + off.gendisk_queue as u64)?;
        let mq_ops: u64 = read(q + off.queue_mq_ops as u64)?;
        if mq_ops != 0 {
            return None;
        }
        let major: i32 = read(disk + off.gendisk_major as u64)?;
        let minor: i32 = read(disk + off.gendisk_first_minor as u64)?;
        let opf: u32 = read(bio + off.bio_opf as u64)?;
        let bytes: u32 = read(bio + off.bio_size as u64)?;
        Some((
            mkdev(major as u32, minor as u32),
            BlockOp::from_cmd_flags(opf),
            bytes,
        ))
    }
}

/// `block_bio_queue`: a bio submitted to a disk, in the submitter's context; the kernel traces
/// each bio's submission once, and then its completion. Before Linux 5.11 the bio is the
/// second argument (`hooks.rs` has a program for each).
#[inline(always)]
pub fn bio_queued<R: RequestRiders>(bio: u64) -> i32 {
    let Some((dev, op, bytes)) = bio_based_device(bio) else {
        return 0;
    };
    let series = current_series();
    let now = unsafe { bpf_ktime_get_ns() };
    let v = Fresh {
        series,
        dev,
        op: op as u8,
        start_ns: now,
        insert_ns: 0,
        issue_ns: now,
        bytes,
        wait_dev: 0,
    };
    // A bio is new memory, removed at its completion: insert first (the lookup `start` makes
    // first would miss), and only a pointer still held takes `start`'s path.
    if BLOCK_IO_INFLIGHT
        .insert(&bio, &v.entry(), BPF_NOEXIST as u64)
        .is_err()
    {
        start::<R>(bio, v);
    }
    // A read that reaches a bio-based disk missed the page cache, whatever its disks below do
    // (dm-delay, for one, submits to them from a kernel worker).
    if series.is_tracked() {
        syscall::mark_block_io();
    }
    0
}

/// `block_bio_complete(struct request_queue *q, struct bio *bio)`: fires for every traced bio,
/// a request-based disk's too; only the bios `block_bio_queue` kept have an entry.
#[btf_tracepoint(function = "block_bio_complete")]
pub fn block_bio_complete(ctx: BtfTracePointContext) -> i32 {
    let now = unsafe { bpf_ktime_get_ns() };
    let bio: u64 = ctx.arg(1);
    let Some(e) = BLOCK_IO_INFLIGHT.get_ptr(&bio) else {
        return 0;
    };
    let e = unsafe { *e };
    if BLOCK_IO_INFLIGHT.remove(&bio) == Err(-ENOENT) {
        return 0;
    }
    complete::<NoRiders>(|| None, e, now, e.bytes, false);
    0
}

/// A completion with no in-flight entry, or of a request never issued itself, counted per
/// device and op. Not a loss as a rule: a request that goes through a flush sequence
/// (REQ_PREFLUSH/REQ_FUA) fires `block_rq_complete` twice, once for its data and once at the
/// end of the sequence, and an empty flush completes without being issued (its flush request
/// is); also requests issued before pgio started.
#[inline(always)]
fn unmatched(dev_op: Option<(u32, BlockOp)>) {
    let Some((dev, op)) = dev_op else {
        drops::count(DropReason::DeviceUnreadable);
        return;
    };
    if let Some(r) = row(SeriesId::UNTRACKED, dev, op as u8) {
        // SAFETY: a map value, valid while the program runs; other CPUs add to it too.
        unsafe { atomic_add(&raw mut (*r).unmatched, 1) };
    }
}

/// One time into metric `m` of a row (`ROW_METRICS` order: device, queue, total).
///
/// SAFETY: `r` points to a `BLOCK_IO_HIST` value.
#[inline(always)]
unsafe fn observe(r: *mut BlockIoRow, m: usize, ns: u64) {
    // The mask proves the index to the verifier; `slot` never exceeds SLOTS - 1.
    let s = slot(ns) as usize & (SLOTS - 1);
    unsafe {
        atomic_add(&raw mut (*r).slots[m][s], 1);
        atomic_add(&raw mut (*r).sum_ns[m], ns);
    }
}

/// Books one completed request: device time, whole time, and queue time when it has one.
/// `dev_op`: reads the request's device and op, for an entry that lacks them (a request never
/// seen issued); a bio's entry (`None`) has everything from its submission.
#[inline(always)]
fn complete<R: RequestRiders>(
    dev_op: impl FnOnce() -> Option<(u32, BlockOp)>,
    mut e: BlockIoInflight,
    now: u64,
    nr_bytes: u32,
    request: bool,
) {
    if e.issue_ns == 0 {
        // Never issued itself: an empty flush (the flush sequence issues its own flush
        // request, which is counted; the kernel does not account the original either).
        if e.start_ns == 0 || nr_bytes == 0 {
            unmatched(dev_op());
            return;
        }
        // Started, carried data, but its issue went unseen: still one request of this
        // submitter, timed from its start.
        drops::count(DropReason::IssueMissed);
        e.issue_ns = e.start_ns;
        e.insert_ns = 0;
    }
    if e.dev == 0 {
        let Some((dev, op)) = dev_op() else {
            drops::count(DropReason::DeviceUnreadable);
            return;
        };
        e.dev = dev;
        e.op = op as u8;
    }
    // A bio-based disk has no queue to wait in: only requests go to the riders.
    if request {
        R::completed(
            &e.blame,
            e.series,
            e.dev,
            e.op,
            now.wrapping_sub(e.issue_ns),
            now,
        );
    }
    let Some(r) = row(e.series, e.dev, e.op) else {
        return;
    };
    let submitted = e.submitted_ns();
    // SAFETY: a map value, valid while the program runs; other CPUs add to it too.
    unsafe {
        observe(r, 0, now.wrapping_sub(e.issue_ns));
        atomic_add(&raw mut (*r).bytes, nr_bytes as u64);
        observe(r, 2, now.wrapping_sub(submitted));
        if submitted < e.issue_ns {
            observe(r, 1, e.issue_ns - submitted);
        }
    }
}

/// Leaves a completed request's entry idle (`BlockIoInflight::is_idle`), field by field.
///
/// SAFETY: `e` points to an in-flight map value.
#[inline(always)]
unsafe fn idle(e: *mut BlockIoInflight) {
    use core::ptr::write_volatile as w;
    unsafe {
        w(&raw mut (*e).start_ns, 0);
        w(&raw mut (*e).insert_ns, 0);
        w(&raw mut (*e).issue_ns, 0);
        w(&raw mut (*e).bytes, 0);
    }
}

/// The hook's first argument, loaded from the context anew (volatile: not the copy the
/// compiler may keep in a stack slot that has been a map key).
#[inline(always)]
fn first_arg(ctx: &BtfTracePointContext) -> u64 {
    // SAFETY: a tp_btf context is an array of u64 arguments; the hook has at least one.
    unsafe { core::ptr::read_volatile(ctx.as_ptr() as *const u64) }
}

/// `block_rq_complete(struct request *rq, blk_status_t error, unsigned int nr_bytes)`.
#[inline(always)]
pub fn rq_complete<R: RequestRiders>(ctx: &BtfTracePointContext) -> i32 {
    let now = unsafe { bpf_ktime_get_ns() };
    let rq: u64 = ctx.arg(0);
    let nr_bytes: u32 = ctx.arg(2);
    // Read before the lookup: once the stack slot holding `rq` has been a map helper's key,
    // 6.12's verifier no longer knows it as a BTF pointer (6.18's and 5.10's do). The device
    // and op, which only a request pgio did not see issued needs, are read after it from the
    // pointer loaded from the context again.
    let left: u32 = unsafe { read(rq + offsets().request_data_len as u64) }.unwrap_or(0);
    let dev_op = || device_and_op(first_arg(ctx));
    let Some(e) = BLOCK_IO_INFLIGHT.get_ptr_mut(&rq) else {
        unmatched(dev_op());
        return 0;
    };
    // A partial completion: the request goes on (is requeued, or completed in more parts),
    // and /proc/diskstats counts it once, at its end.
    if nr_bytes < left {
        // SAFETY: map value pointer; only this request's own events touch it.
        unsafe { (*e).bytes = (*e).bytes.wrapping_add(nr_bytes) };
        return 0;
    }
    // The entry stays, idle, for this `struct request`'s next use. (Lost by the sweep only after
    // `block_inflight_timeout_secs` in flight: a completion in the same microsecond as that
    // sweep is counted both lost and completed.)
    // SAFETY: map value pointer; only this request's own events touch it.
    let e = unsafe {
        let copy = *e;
        idle(e);
        copy
    };
    let nr_bytes = nr_bytes.wrapping_add(e.bytes);
    complete::<R>(dev_op, e, now, nr_bytes, true);
    0
}

const ENOENT: i32 = 2;

/// A bio's completion has no riders (`complete` calls none for it).
struct NoRiders;

impl RequestRiders for NoRiders {
    unsafe fn started(_: *mut QueueBlameMark, _: u32, _: u64) {}
    unsafe fn issued(_: *mut QueueBlameMark, _: SeriesId, _: u32, _: u8, _: u64) {}
    fn completed(_: &QueueBlameMark, _: SeriesId, _: u32, _: u8, _: u64, _: u64) {}
}
