//! Queries of PostgreSQL backends, and the IO time inside each.
//!
//! A query is what `pg_stat_activity` shows as `active`: from the backend reporting itself
//! running (`pgstat_report_activity` with the query text) to its next idle report (with NULL),
//! which it makes right before `ReadyForQuery`. PostgreSQL 18 renumbered `BackendState`
//! (measured with bpftrace: running is 2 before 18, 3 from 18), so the text argument, not the
//! state, tells them apart. Every PostgreSQL build exports `pgstat_report_activity`, so
//! one uprobe on it serves Debian's and the PyPI builds, 15 to 18, with or without USDT.

use crate::SeriesId;

crate::abi_enum! {
    /// What a query histogram measures.
    pub enum QueryMetric: u8 {
        /// The query's duration; the bucket's `bytes` field sums its page-cache misses.
        Duration = 0 => "duration",
        /// The time the backend spent in IO syscalls during the query.
        Io = 1 => "io",
        /// The part of it in reads that missed the page cache (submitted block IO).
        ReadMiss = 2 => "read_miss",
    }
}

/// `query`'s histogram map in the key quota (`KEY_ALLOWANCE`).
pub const QUOTA: crate::key_quota::QuotaMap = crate::key_quota::QuotaMap(2);

/// Key of `QUERY_HIST`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct QueryKey {
    pub series: SeriesId,
    pub metric: u8,
    pub slot: u8,
    pub _pad: [u8; 2],
}

/// A backend thread's running query (`QUERY`, by thread id).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QueryState {
    pub start_ns: u64,
    /// IO syscall time of the running query.
    pub io_ns: u64,
    /// Its reads that submitted block IO (page-cache misses).
    pub misses: u64,
    /// Their time.
    pub miss_ns: u64,
    /// Inside `pgaio_wref_wait` (PostgreSQL 18 AIO) since then; 0 outside.
    pub wait_start_ns: u64,
}

crate::abi_size!(QueryKey, 8, 4);
crate::abi_size!(QueryState, 40, 8);
crate::abi_pod!(QueryKey, QueryState);
