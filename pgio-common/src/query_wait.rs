//! Where a query's time goes (issue 47): on CPU, runnable but not running, and off CPU by
//! PostgreSQL's own wait event type. The parts of each query add up to its time exactly:
//!
//! - **runnable** (`Part::Runnable`): the growth of the thread's `sched_info.run_delay` over
//!   the query, the kernel's own count of its time on a run queue (`/proc/<pid>/schedstat`'s
//!   second field), read at the query's start and end, when the thread is running;
//! - **off CPU, by wait event type**: each time the thread leaves the CPU blocked, the
//!   `sched_switch` program reads the wait event PostgreSQL set for it
//!   (`*my_wait_event_info`, the backend's `PGPROC.wait_event_info`) and, when the thread has
//!   run again, books the time from that switch to the switch that ran it again, less the
//!   run-queue wait in between (its `run_delay` growth), under that event's type;
//! - **on CPU inside an IO syscall**: under the wait event PostgreSQL set around the call (an
//!   `IO` event: `DataFileRead`, `WALWrite`, …), read at its exit, as PostgreSQL reports it
//!   and samplers such as `pg_wait_sampling` see it (a read served from the page cache is
//!   `IO` time); the call's time less its off-CPU intervals (the blocked ones, booked as
//!   above, and its `run_delay` growth);
//! - **CPU** (`Part::Cpu`): the rest of the query's time.
//!
//! A query's IO time (`pgio_query_io_seconds`) is its IO syscalls' time (the syscall family's,
//! enter to exit) plus, for each time it blocked under an `IO` wait event outside those
//! syscalls, the time until it ran again (with `io_method = worker` the backend waits for its
//! io workers under `AioIoCompletion`/`DataFileRead` without a syscall of its own): never both
//! for the same moment, and wall-clock time as PostgreSQL's `read_time` is (a run-queue wait
//! after the wake-up included). The parts, a partition of the query's time, count that
//! run-queue wait as `runnable`.

crate::abi_enum! {
    /// A part of a query's time: `Cpu` and `Runnable`, then PostgreSQL's wait event types
    /// (the names `pg_stat_activity.wait_event_type` shows).
    pub enum Part: u8 {
        /// On CPU.
        Cpu = 0 => "cpu",
        /// Runnable, waiting for a CPU (preempted, or woken and not yet running).
        Runnable = 1 => "runnable",
        /// Blocked with no wait event set (a page fault, a wait PostgreSQL does not report).
        NoEvent = 2 => "none",
        LwLock = 3 => "LWLock",
        Lock = 4 => "Lock",
        BufferPin = 5 => "BufferPin",
        Activity = 6 => "Activity",
        Client = 7 => "Client",
        Extension = 8 => "Extension",
        Ipc = 9 => "IPC",
        Timeout = 10 => "Timeout",
        Io = 11 => "IO",
        InjectionPoint = 12 => "InjectionPoint",
        /// Blocked, and the wait event could not be read, or its class is none of the above.
        Unknown = 13 => "unknown",
    }
}

/// Parts of a query's time (`Part::ALL.len()`).
pub const PARTS: usize = 14;

/// The part a blocked backend's `wait_event_info` names: its class is the top byte
/// (`PG_WAIT_LWLOCK` 0x01 … `PG_WAIT_IO` 0x0A, `PG_WAIT_INJECTIONPOINT` 0x0B, the same in
/// PostgreSQL 15 to 18). Any other value is `Unknown`, never an index out of range.
#[inline(always)]
pub const fn part_of(wait_event_info: u32) -> Part {
    if wait_event_info == 0 {
        return Part::NoEvent;
    }
    match wait_event_info >> 24 {
        0x01 => Part::LwLock,
        0x03 => Part::Lock,
        0x04 => Part::BufferPin,
        0x05 => Part::Activity,
        0x06 => Part::Client,
        0x07 => Part::Extension,
        0x08 => Part::Ipc,
        0x09 => Part::Timeout,
        0x0A => Part::Io,
        0x0B => Part::InjectionPoint,
        _ => Part::Unknown,
    }
}

/// Value of the kernel's `QUERY_WAIT` array, one per `QUERY` way (same index): the off-CPU
/// intervals of the way's thread during its running query. Only that thread's programs and
/// the `sched_switch` that runs it again touch it, never at once.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QueryWait {
    /// When the thread last left the CPU blocked; 0: no interval open.
    pub off_ns: u64,
    /// Its `run_delay` then.
    pub off_delay: u64,
    /// When it ran again (`sched_switch` of `next`); 0: not yet.
    pub on_ns: u64,
    /// Its `run_delay` at the query's start.
    pub start_delay: u64,
    /// Where the thread's wait event is (`*my_wait_event_info`), found at its connection's
    /// first query; 0: not known.
    pub event_at: u64,
    /// Time from blocking under an `IO` wait event outside the thread's IO syscalls to running
    /// again (wall-clock, as a syscall's time and PostgreSQL's `read_time` are).
    pub io_wait_ns: u64,
    /// Blocked time in the running query, all parts (what `wait_ns` holds, summed).
    pub blocked_ns: u64,
    /// `run_delay` and `blocked_ns` when the thread first left the CPU inside its open IO
    /// syscall: both as at the call's start, since it ran until then.
    pub call_delay: u64,
    pub call_blocked: u64,
    /// Blocked time per part (`Part` index; `Cpu` and `Runnable` stay 0).
    pub wait_ns: [u64; PARTS],
    /// The thread this is for (a new one starts from nothing).
    pub tid: u32,
    /// `wait_event_info` of the open interval (`wait_event::UNREADABLE`: not read); its
    /// `Part` is `part_of(info)`.
    pub info: u32,
    /// The thread's series when the open interval began (`wait_event` books under it).
    pub series: crate::SeriesId,
    /// The thread's PostgreSQL major version, found with `event_at` (0: not known).
    pub major: u8,
    /// 1: the thread left the CPU inside an IO syscall that has not returned yet.
    pub in_io_call: u8,
    /// 1: the open interval counts as IO time (an `IO` event outside an IO syscall).
    pub open_io: u8,
    /// 1 while the thread runs a query (its intervals are booked).
    pub in_query: u8,
}

/// A query's parts as its end books them (ns, `Part` index), and its IO wait outside IO
/// syscalls.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QueryParts {
    pub ns: [u64; PARTS],
    pub io_wait_ns: u64,
}

crate::abi_size!(QueryWait, 72 + 8 * PARTS + 16, 8);
crate::abi_pod!(QueryWait);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_index_all() {
        assert_eq!(Part::ALL.len(), PARTS);
        for (i, p) in Part::ALL.iter().enumerate() {
            assert_eq!(*p as usize, i);
        }
    }

    #[test]
    fn wait_event_classes() {
        // PostgreSQL's own values: LWLock WALWrite, Lock transactionid, IO DataFileRead,
        // Timeout PgSleep, IPC BufferIo, Client ClientRead.
        assert_eq!(part_of(0x0100_0000 | 20), Part::LwLock);
        assert_eq!(part_of(0x0300_0004), Part::Lock);
        assert_eq!(part_of(0x0A00_0011), Part::Io);
        assert_eq!(part_of(0x0900_0002), Part::Timeout);
        assert_eq!(part_of(0x0800_0003), Part::Ipc);
        assert_eq!(part_of(0x0600_0000), Part::Client);
        assert_eq!(part_of(0), Part::NoEvent);
        assert_eq!(part_of(0x0200_0000), Part::Unknown);
        assert_eq!(part_of(u32::MAX), Part::Unknown);
    }
}
