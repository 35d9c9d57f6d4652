//! Where PostgreSQL's other processes wait (issue 47, item 5): the checkpointer, background
//! writer, walwriter, autovacuum, io workers, walsenders, parallel workers, … (every tracked
//! PostgreSQL process but the client backends, whose time is their queries'). Each time one
//! leaves the CPU blocked, the `sched_switch` program reads the wait event PostgreSQL set for
//! it (as `query_wait` does for a query) and, when it leaves the CPU the next time (its
//! `run_delay` then includes the run-queue wait after the wake-up), books the interval: the
//! blocked part under the event's type (`query_wait::Part`), the run-queue part under
//! `Runnable`. One observation per interval in `ROLE_WAIT_HIST`, a histogram per (series,
//! part): how long each wait was, and in all.
//!
//! A client backend's blocked intervals inside its queries, which `query_wait` settles into
//! the query's parts, are booked here the same way (issue 47, item 7: a heatmap per type for
//! every role); its preemptions and its time between queries are not.

use crate::SeriesId;

/// `role_wait`'s histogram map in the key quota (`KEY_ALLOWANCE`).
pub const QUOTA: crate::key_quota::QuotaMap = crate::key_quota::QuotaMap(5);

/// Key of `ROLE_WAIT_HIST`: one log2 slot of one (series, part) histogram.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RoleWaitKey {
    pub series: SeriesId,
    /// `query_wait::Part`.
    pub part: u8,
    /// `hist::slot` of the interval.
    pub slot: u8,
    pub _pad: u16,
}

/// Value of `ROLE_WAIT_THREADS`, by thread id: the thread's open interval. Only the thread's
/// own switches touch it (out: in its context; in: the switch that runs it).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RoleThread {
    /// When it last left the CPU blocked; 0: no interval open.
    pub off_ns: u64,
    /// Its `run_delay` then.
    pub off_delay: u64,
    /// When it ran again; 0: not yet.
    pub on_ns: u64,
    /// Where its wait event is (`*my_wait_event_info`), found at its first wait; 0: not yet.
    pub event_at: u64,
    /// The series the open interval is booked under.
    pub series: SeriesId,
    /// `wait_event_info` of the open interval (`wait_event::UNREADABLE`: not read); its
    /// `query_wait::Part` is `part_of(info)`.
    pub info: u32,
    /// The process's PostgreSQL major version, found with `event_at` (0: not known).
    pub major: u8,
    pub _pad: [u8; 7],
}

crate::abi_size!(RoleWaitKey, 8, 4);
crate::abi_size!(RoleThread, 48, 8);
crate::abi_pod!(RoleWaitKey, RoleThread);
