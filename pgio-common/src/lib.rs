//! Types shared by the eBPF programs (`pgio-ebpf`) and the daemon (`pgio-daemon`).
//!
//! Every map key and value is `#[repr(C)]` with explicit padding so both sides agree on the
//! layout byte for byte. Module names follow the data path: each probe family has the same
//! name here, in `pgio-ebpf` and in `pgio-daemon`.
#![no_std]

pub mod block_io;
pub mod hist;
pub mod lifecycle;
pub mod syscall;

/// Series id of anything pgio does not track (block IO of untracked submitters).
pub const SERIES_UNTRACKED: u32 = 0;

/// Size of the `tgid → series` array as compiled: the kernel's PID_MAX_LIMIT (2^22). The
/// loader shrinks it to this node's `/proc/sys/kernel/pid_max`.
pub const PID_MAX_LIMIT: u32 = 1 << 22;

/// Size of the `series → children are provisional` array: children of series ids beyond it
/// inherit their parent's series.
pub const CHILD_SERIES_MAX: u32 = 1 << 16;

/// Series ids with this bit set are a freshly forked process's own provisional series,
/// `PROVISIONAL | tgid`: the kernel books its events there until userspace has classified it,
/// then userspace adds them to the series it was classified as.
pub const PROVISIONAL: u32 = 1 << 31;

/// Counters of events the kernel side could not record, indexed by [`Drop`].
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Drop {
    /// A histogram map was full: the event was not counted.
    HistFull = 0,
    /// The lifecycle ring buffer was full: userspace missed a fork/exec/exit.
    LifecycleRingFull = 1,
    /// The in-flight request map was full: a request got no submitter.
    InflightFull = 2,
    /// The thread's task storage for the syscall start could not be had (out of memory, or
    /// another BPF program on this CPU held the task storage lock): a syscall was not timed.
    SyscallStartUnavailable = 3,
    /// A request completed whose `block_rq_issue` pgio did not see: it is still counted, on
    /// its submitter's series, with its device time measured from `block_io_start` (so it
    /// includes any queue time).
    IssueMissed = 4,
    /// A completion whose device (`rq->q->disk`) could not be read: the request was not
    /// counted.
    DeviceUnreadable = 5,
}

pub const DROP_REASONS: usize = 6;

impl Drop {
    pub const ALL: [Drop; DROP_REASONS] = [
        Drop::HistFull,
        Drop::LifecycleRingFull,
        Drop::InflightFull,
        Drop::SyscallStartUnavailable,
        Drop::IssueMissed,
        Drop::DeviceUnreadable,
    ];

    pub const fn reason(self) -> &'static str {
        match self {
            Drop::HistFull => "hist_map_full",
            Drop::LifecycleRingFull => "lifecycle_ring_full",
            Drop::InflightFull => "inflight_map_full",
            Drop::SyscallStartUnavailable => "syscall_start_unavailable",
            Drop::IssueMissed => "block_rq_issue_missed",
            Drop::DeviceUnreadable => "block_device_unreadable",
        }
    }
}

#[cfg(feature = "user")]
mod pod {
    // SAFETY: all are #[repr(C)] plain integers with explicit padding fields.
    unsafe impl aya::Pod for crate::hist::Bucket {}
    unsafe impl aya::Pod for crate::block_io::BlockIoKey {}
    unsafe impl aya::Pod for crate::block_io::BlockIoInflight {}
    unsafe impl aya::Pod for crate::block_io::KernelOffsets {}
    unsafe impl aya::Pod for crate::syscall::SyscallKey {}
    unsafe impl aya::Pod for crate::syscall::SyscallStart {}
    unsafe impl aya::Pod for crate::lifecycle::LifecycleEvent {}
}
