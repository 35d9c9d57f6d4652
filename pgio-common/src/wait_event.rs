//! Off-CPU time by PostgreSQL's individual wait event (issue 47, item 6): where `query_wait`
//! and `role_wait` book a blocked interval under its wait event *type*, this books the same
//! interval under the raw `wait_event_info` read at the block (class in the top byte, event
//! in the low 16 bits) and the PostgreSQL major version of the process, so that userspace
//! names it as `pg_stat_activity.wait_event` does for that version.
//!
//! Bounded: one key per (series, event, major) actually seen. PostgreSQL 15–18 have ~250
//! fixed events (and ~100 LWLock tranches); an extension's LWLock tranche or wait event, or a
//! made-up value, is one more key of the same class, named `unknown` by userspace. The map
//! has a fixed size and every uid its share of it (`key_quota`).

use crate::SeriesId;

/// `wait_event`'s map in the key quota (`KEY_ALLOWANCE`).
pub const QUOTA: crate::key_quota::QuotaMap = crate::key_quota::QuotaMap(7);

/// `wait_event_info` of a block whose wait event could not be read (no address known yet, or
/// the read failed): class 0xFF, which no PostgreSQL uses (`query_wait::part_of` gives
/// `Unknown`).
pub const UNREADABLE: u32 = u32::MAX;

/// Key of `WAIT_EVENT_HIST`: one series' blocked intervals under one wait event.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WaitEventKey {
    pub series: SeriesId,
    /// PostgreSQL's `wait_event_info` when the thread blocked (0: none set; `UNREADABLE`).
    pub info: u32,
    /// The process's PostgreSQL major version (15, …; 0: not known).
    pub major: u8,
    pub _pad: [u8; 3],
}

crate::abi_size!(WaitEventKey, 12, 4);
crate::abi_pod!(WaitEventKey);
