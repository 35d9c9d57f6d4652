//! Types shared by the eBPF programs (`pgio-ebpf`) and the daemon (`pgio-daemon`).
//!
//! Every map key and value is `#[repr(C)]` with explicit padding so both sides agree on the
//! layout byte for byte. Module names follow the data path: each probe family has the same
//! name here, in `pgio-ebpf` and in `pgio-daemon`.
#![no_std]

#[macro_use]
pub mod abi;
pub mod block_io;
pub mod drops;
pub mod hist;
pub mod kernel_offsets;
pub mod key_quota;
pub mod lifecycle;
pub mod query;
pub mod syscall;

/// Size of the `tgid → series` array as compiled: the kernel's PID_MAX_LIMIT (2^22). The
/// loader shrinks it to this node's `/proc/sys/kernel/pid_max`.
pub const PID_MAX_LIMIT: u32 = 1 << 22;

/// Size of the `series → children are provisional` array: children of series ids beyond it
/// inherit their parent's series.
pub const CHILD_SERIES_MAX: u32 = 1 << 16;

/// A series: one label set of processes (app, role, database, …), never a pid. Userspace
/// gives each distinct label set an id and writes `tgid → id` into the kernel's `TRACKED`
/// map; histograms are keyed by it.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeriesId(pub u32);

impl SeriesId {
    /// Anything pgio does not track (block IO of untracked submitters).
    pub const UNTRACKED: SeriesId = SeriesId(0);

    /// Set in a freshly forked process's own provisional series, `PROVISIONAL | tgid`: the
    /// kernel books its events there until userspace has classified it, then userspace adds
    /// them to the series it was classified as.
    const PROVISIONAL: u32 = 1 << 31;

    #[inline(always)]
    pub const fn provisional(tgid: u32) -> SeriesId {
        SeriesId(Self::PROVISIONAL | tgid)
    }

    #[inline(always)]
    pub const fn is_provisional(self) -> bool {
        self.0 & Self::PROVISIONAL != 0
    }

    /// The process a provisional series belongs to.
    #[inline(always)]
    pub const fn provisional_tgid(self) -> u32 {
        self.0 & !Self::PROVISIONAL
    }

    #[inline(always)]
    pub const fn is_tracked(self) -> bool {
        self.0 != Self::UNTRACKED.0
    }
}

abi_size!(SeriesId, 4, 4);

abi_pod!(SeriesId);
