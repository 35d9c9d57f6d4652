//! Process lifecycle events sent to userspace through a ring buffer, so new Postgres
//! backends are classified within milliseconds of their fork.

use crate::SeriesId;

crate::abi_enum! {
    pub enum LifecycleKind: u32 {
        /// A tracked process forked a new process (not a thread); the child already inherits
        /// the parent's series in the kernel.
        Fork = 0 => "fork",
        /// Any process called exec: userspace classifies it.
        Exec = 1 => "exec",
        /// A tracked process exited; the kernel already removed it from the tracked map.
        Exit = 2 => "exit",
        /// A provisional process (a new Postgres backend) has just set its title: a
        /// [`TitleEvent`], so it can be classified even if it exits before userspace looks.
        Titled = 3 => "titled",
    }
}

/// Titles one process (tgid) may send from `init_ps_display` while provisional. PostgreSQL
/// calls it once per process, right after fork; more is a process calling it in a loop.
/// Counted per process incarnation: reset when a tracked process forks it, and when it exits.
pub const TITLES_PER_PROCESS: u32 = 2;

/// Processes whose title count the kernel keeps (an LRU hash: one evicted by a flood of new
/// processes just gets its budget again; each of those needed a fork of its own).
pub const TITLE_BUDGET_ENTRIES: u32 = 16_384;

/// Bytes of a title sent with [`TitleEvent`]: `cluster_name: user database host(port)` with
/// 63-byte names fits.
pub const TITLE_MAX: usize = 256;

/// New processes an untracked process called `postgres` may tell of (`forked`): a postmaster
/// forks its auxiliary processes and io workers (up to 32) before pgio may have read its
/// exec; a process merely called `postgres` may fork without end.
pub const EARLY_FORKS_PER_PROCESS: u32 = 64;

/// Processes whose early forks the kernel counts (an LRU hash, as the titles').
pub const EARLY_FORK_ENTRIES: u32 = 4_096;

/// The lifecycle ring's size. Between two drains it holds a burst of new backends: each sends
/// a fork (24 bytes with the ring's header), a title (~70) and maybe an exec (24); 1 MiB is
/// ~9,000 of them (`tests/lifecycle_burst.rs` forks 4,000 at once).
pub const LIFECYCLE_RING_BYTES: u32 = 1 << 20;

/// Bytes of a [`TitleEvent`] before its title: a title event on the ring is this many bytes
/// plus `len`.
pub const TITLE_HEAD: usize = 16;

/// Sent from the return of PostgreSQL's `init_ps_display` (a uretprobe) for provisional
/// processes. Shares the lifecycle ring buffer, so it arrives before the process' exit. Only
/// its first `TITLE_HEAD + len` bytes are sent.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct TitleEvent {
    /// `LifecycleKind::Titled`, at the same place as `LifecycleEvent::kind`.
    pub kind: u32,
    pub pid: u32,
    /// Bytes of `title` written, the terminating NUL included.
    pub len: u32,
    pub _pad: u32,
    /// The start of the process' argv, where Postgres writes its title.
    pub title: [u8; TITLE_MAX],
}

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LifecycleEvent {
    pub kind: u32,
    /// The process (tgid) the event is about.
    pub pid: u32,
    /// Fork: the parent's tgid. Otherwise 0.
    pub ppid: u32,
    /// Fork: the series the child starts in (the parent's, or `PROVISIONAL | pid`). Exit: the
    /// series it had. Exec: 0.
    pub series: SeriesId,
}

crate::abi_size!(TitleEvent, 272, 4);
const _: () = assert!(core::mem::offset_of!(TitleEvent, title) == TITLE_HEAD);
crate::abi_size!(LifecycleEvent, 16, 4);
crate::abi_pod!(LifecycleEvent);
