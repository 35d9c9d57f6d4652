//! Block layer: per request, queue time (submission → issue), device time (issue → complete)
//! and the whole time (submission → complete), keyed by submitter series, device and op.
//! A bio-based disk (device-mapper `dm-N`, md, zram) has no requests: each bio submitted to it
//! is one "request" whose device time and whole time are both submission → completion (it
//! has no queue of its own; the disks below it have theirs).

use crate::{SeriesId, hist::SLOTS};

crate::abi_enum! {
    /// Which block latency (or count) a histogram entry holds.
    pub enum BlockMetric: u8 {
        /// issue → complete. Its count is the request counter, its `bytes` the byte counter.
        Device = 0 => "device",
        /// submission → issue: from `block_io_start` (kernel >= 6.5), else from
        /// `block_rq_insert` (so, before 6.5, only requests that went through a scheduler
        /// queue).
        Queue = 1 => "queue",
        /// A completion pgio could not match to a request it saw start and issue (series 0,
        /// slot 0, no time): counted per device and op so a gap against /proc/diskstats can be
        /// told apart from the flush sequence's second completions on another device.
        Unmatched = 2 => "unmatched",
        /// submission → complete, the whole time a request took (`biolatency -Q`); issue →
        /// complete where the submission went unseen.
        Total = 3 => "total",
        /// A request pgio saw issued whose completion it never saw (slot 0, no time, no
        /// bytes): found when the kernel starts the same `struct request` again, or by the
        /// userspace sweep of requests in flight for longer than
        /// `block_inflight_timeout_secs`.
        Lost = 4 => "lost",
    }
}

crate::abi_enum! {
    /// Request operation, from `request.cmd_flags & REQ_OP_MASK`.
    pub enum BlockOp: u8 {
        Read = 0 => "read",
        Write = 1 => "write",
        Flush = 2 => "flush",
        Discard = 3 => "discard",
        WriteZeroes = 4 => "write_zeroes",
        Other = 5 => "other",
    }
}

impl BlockOp {
    /// `enum req_op` of include/linux/blk_types.h (stable since 4.10).
    #[inline(always)]
    pub fn from_cmd_flags(cmd_flags: u32) -> BlockOp {
        match cmd_flags & 0xff {
            0 => BlockOp::Read,
            1 => BlockOp::Write,
            2 => BlockOp::Flush,
            3 | 5 => BlockOp::Discard, // DISCARD, SECURE_ERASE
            9 => BlockOp::WriteZeroes,
            _ => BlockOp::Other,
        }
    }
}

/// `block_io`'s histogram map in the key quota (`KEY_ALLOWANCE`).
pub const QUOTA: crate::key_quota::QuotaMap = crate::key_quota::QuotaMap(0);

/// Key of the `BLOCK_IO_HIST` map: one row per submitter series, device and op.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BlockIoKey {
    pub series: SeriesId,
    /// Kernel `dev_t` of the disk: `major << 20 | minor`.
    pub dev: u32,
    pub op: u8,
    /// Padding, zero. Not `[u8; 3]`: zeroing an odd-sized array compiles to a call of
    /// aya-ebpf's byte-loop `memset`.
    pub _pad: u8,
    pub _pad2: u16,
}

/// The timed metrics of a [`BlockIoRow`], in the order of its arrays.
pub const ROW_METRICS: [BlockMetric; 3] =
    [BlockMetric::Device, BlockMetric::Queue, BlockMetric::Total];

/// Value of the `BLOCK_IO_HIST` map: every block histogram of one key, so that a completed
/// request costs one map lookup (three, one per metric and slot, cost ~100 ns more), and
/// every CPU adds to it atomically.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockIoRow {
    /// Per metric of [`ROW_METRICS`]: requests in each log2 slot (`hist::slot`).
    pub slots: [[u64; SLOTS]; 3],
    /// Per metric of [`ROW_METRICS`]: sum of the times (ns).
    pub sum_ns: [u64; 3],
    /// Bytes of the completed requests.
    pub bytes: u64,
    /// [`BlockMetric::Lost`] requests.
    pub lost: u64,
    /// [`BlockMetric::Unmatched`] completions (on the untracked series' rows).
    pub unmatched: u64,
}

impl BlockIoRow {
    pub const ZERO: BlockIoRow = BlockIoRow {
        slots: [[0; SLOTS]; 3],
        sum_ns: [0; 3],
        bytes: 0,
        lost: 0,
        unmatched: 0,
    };
}

impl Default for BlockIoRow {
    fn default() -> Self {
        BlockIoRow::ZERO
    }
}

/// Value of the `BLOCK_IO_INFLIGHT` map, keyed by the `struct request *` (or, for a
/// bio-based disk, the `struct bio *`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct BlockIoInflight {
    /// Submitter's series (captured at `block_io_start` in the submitter's context).
    pub series: SeriesId,
    /// Kernel `dev_t` of the disk, read at issue; 0 before issue.
    pub dev: u32,
    /// `block_io_start` time, 0 when the request was first seen later (kernel without it).
    pub start_ns: u64,
    /// `block_rq_insert` time, 0 when the request skipped the scheduler queue.
    pub insert_ns: u64,
    /// `block_rq_issue` time, 0 before issue and again after a requeue.
    pub issue_ns: u64,
    /// [`BlockOp`] as `u8`, read at issue.
    pub op: u8,
    pub _pad: u8,
    pub _pad2: u16,
    /// A bio's bytes, read at submission. A request's come with its completion; here are
    /// those of its partial completions so far (a driver that completes part of a request,
    /// then requeues the rest: loop on a short read, SCSI).
    pub bytes: u32,
    /// Queue blame's copy of the device's clock when the wait started (`queue_blame`): it
    /// rides this entry so that it costs no map lookup of its own.
    pub blame: crate::queue_blame::QueueBlameMark,
}

impl BlockIoInflight {
    /// The entry a completed request leaves for its `struct request`'s next use.
    #[inline(always)]
    pub fn is_idle(&self) -> bool {
        self.start_ns == 0 && self.insert_ns == 0 && self.issue_ns == 0
    }

    /// When the request was submitted: `block_io_start`, else `block_rq_insert`, else issue.
    #[inline(always)]
    pub fn submitted_ns(&self) -> u64 {
        if self.start_ns != 0 {
            self.start_ns
        } else if self.insert_ns != 0 {
            self.insert_ns
        } else {
            self.issue_ns
        }
    }
}

crate::abi_size!(BlockIoKey, 12, 4);
crate::abi_size!(BlockIoRow, 1584, 8);
crate::abi_size!(BlockIoInflight, 80, 8);
crate::abi_pod!(BlockIoKey, BlockIoRow, BlockIoInflight);

/// `dev_t` as the kernel packs it internally (`MKDEV`).
pub const fn mkdev(major: u32, minor: u32) -> u32 {
    (major << 20) | (minor & 0xf_ffff)
}

pub const fn dev_major(dev: u32) -> u32 {
    dev >> 20
}

pub const fn dev_minor(dev: u32) -> u32 {
    dev & 0xf_ffff
}
