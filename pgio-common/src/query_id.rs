//! Queries by their `pg_stat_statements` query id (issue 31): each query the `query` family
//! times is also booked under the id its backend shows in `pg_stat_activity.query_id`, read at
//! the send that ends it from the backend's own `PgBackendStatus.st_query_id` (shared memory;
//! PostgreSQL sets it when a query starts and keeps it until the next one).
//!
//! Userspace finds where that is once per postmaster (`MyBEEntry`, a global of the binary,
//! and the field's offset for the major version) and writes it into `QUERY_ID_SOURCE` under
//! the postmaster's tgid; a fork copies the entry to the child, an exit removes it. The kernel
//! adds each query to the row of (series, epoch, id) in `QUERY_ID_HIST`; userspace flips the
//! epoch once a second and takes the rows of the other one out of the map (no program is
//! still adding to them), so the map holds only the ids of the last second or two however
//! many an application has.

use crate::SeriesId;

/// `query_id`'s histogram map in the key quota (`KEY_ALLOWANCE`).
pub const QUOTA: crate::key_quota::QuotaMap = crate::key_quota::QuotaMap(4);

crate::abi_enum! {
    /// What a row's `query_id` is.
    pub enum IdKind: u8 {
        /// The id PostgreSQL computed (`compute_query_id`).
        Known = 0 => "known",
        /// The backend showed 0: no id (utility statements before 16, `compute_query_id = off`).
        None = 1 => "none",
        /// pgio could not read it: a backend it has no `QUERY_ID_SOURCE` for (started before
        /// its postmaster's entry was written), or a read that failed.
        Unknown = 2 => "unknown",
        /// The map had no room for the id's row (its owner's share, or full): booked with the
        /// series' other ids.
        Refused = 3 => "refused",
    }
}

/// Where a postmaster's backends keep their query id: `*(my_be_entry) + offset`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IdSource {
    /// Address of the `MyBEEntry` pointer (a global: the same in every child of the postmaster).
    pub my_be_entry: u64,
    /// Offset of `st_query_id` in `PgBackendStatus`.
    pub offset: u64,
    /// Address of the `my_wait_event_info` pointer (a global; 0: not found): where the
    /// backend's wait event is (`query_wait`).
    pub my_wait_event_info: u64,
    /// The postmaster's tgid: which cluster a process belongs to (`io_worker`).
    pub postmaster: u32,
    /// Offset of `owner_procno` in `PgAioHandle` (0: no io workers, before PostgreSQL 18).
    pub aio_owner_at: u32,
    /// Addresses of the globals `error_context_stack`, `ProcGlobal` and `MyProcNumber`.
    pub error_context_stack: u64,
    pub proc_global: u64,
    pub my_proc_number: u64,
    /// `sizeof(PGPROC)` and the offset of its `pid`, for this major version.
    pub proc_size: u32,
    pub proc_pid_at: u32,
    /// The postmaster's PostgreSQL major version (`wait_event` names events by it).
    pub major: u32,
    pub _pad: u32,
}

impl IdSource {
    /// Whether an io worker of this postmaster can tell whom it serves.
    pub fn knows_aio_owners(&self) -> bool {
        self.aio_owner_at != 0
            && self.error_context_stack != 0
            && self.proc_global != 0
            && self.my_proc_number != 0
            && self.proc_size != 0
    }
}

/// Key of `QUERY_ID_HIST`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct QueryIdKey {
    pub series: SeriesId,
    /// 0 or 1: `QUERY_ID_EPOCH` when the row was made.
    pub epoch: u8,
    /// [`IdKind`].
    pub kind: u8,
    pub _pad: u16,
    /// `st_query_id` (`Known` only; 0 otherwise).
    pub query_id: u64,
}

/// The timed metrics of a [`QueryIdRow`], in the order of its arrays: the query's duration
/// and its IO time.
pub const ID_METRICS: usize = 2;

/// Value of `QUERY_ID_HIST`: one id's queries of one series in one epoch.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueryIdRow {
    /// Per metric: sum of the times (ns).
    pub sum_ns: [u64; ID_METRICS],
    /// Per metric: observations of 0 ns.
    pub zeros: [u64; ID_METRICS],
    /// Time in reads that missed the page cache (ns).
    pub miss_ns: u64,
    /// Reads that missed the page cache.
    pub misses: u64,
    /// Per metric: observations above 0 ns in each log2 slot (`hist::slot`).
    pub slots: [[u64; crate::hist::SLOTS]; ID_METRICS],
    /// The queries' time per `query_wait::Part` (ns).
    pub parts_ns: [u64; crate::query_wait::PARTS],
}

impl QueryIdRow {
    pub const ZERO: QueryIdRow = QueryIdRow {
        sum_ns: [0; ID_METRICS],
        zeros: [0; ID_METRICS],
        miss_ns: 0,
        misses: 0,
        slots: [[0; crate::hist::SLOTS]; ID_METRICS],
        parts_ns: [0; crate::query_wait::PARTS],
    };
}

impl Default for QueryIdRow {
    fn default() -> Self {
        QueryIdRow::ZERO
    }
}

crate::abi_size!(IdSource, 72, 8);
crate::abi_size!(QueryIdKey, 16, 8);
crate::abi_size!(
    QueryIdRow,
    48 + 2 * 8 * crate::hist::SLOTS + 8 * crate::query_wait::PARTS,
    8
);
crate::abi_pod!(IdSource, QueryIdKey, QueryIdRow);
