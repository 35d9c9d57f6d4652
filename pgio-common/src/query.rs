//! Queries of PostgreSQL client backends, and the IO time inside each, from the backend's
//! own client-socket syscalls (`recvfrom`, `sendto`: what `recv` and `send` become).
//!
//! A client backend reads a request from its socket, works, writes its reply and reads
//! again. Its client socket is the one it read its startup packet from (or, for a backend
//! that was already connected when pgio started, the first one it reads from).
//! - **Plain connections** (`Wire::Plain`): a query ends with the send whose last six bytes
//!   are a ReadyForQuery message (`Z`, length 5, status `I`/`T`/`E`): PostgreSQL flushes at
//!   every ReadyForQuery and at nothing later. It began when the backend read the first bytes of
//!   the request after waiting for them, or, when it did not wait (a pipeline, or a request
//!   already there), at the previous ReadyForQuery. So simple, extended and prepared
//!   protocols, pipelines, COPY, errors and cancels count one query per ReadyForQuery:
//!   exactly what `pg_stat_activity.state` shows as `active`.
//! - **Encrypted connections** (`Wire::Encrypted`, TLS or GSSAPI; their sends begin with a
//!   byte below 0x20, which no protocol message type is): the bytes say nothing, so a query
//!   is a request/response cycle: from reading a request to the last send before the
//!   backend reads again. Their observations carry `wire="encrypted"`. A pipeline answered
//!   without reading in between is one cycle (`MultiSend` counts cycles of more than one
//!   send), a `COPY FROM STDIN` is two, and the authentication round trips after the TLS
//!   handshake are cycles too (`EncryptedConnections` counts connections, so they can be
//!   told apart).

use crate::{SeriesId, query_wait::PARTS};

crate::abi_enum! {
    /// What a query histogram measures.
    pub enum QueryMetric: u8 {
        /// The query's duration; the bucket's `bytes` field sums its page-cache misses.
        Duration = 0 => "duration",
        /// The time the backend spent in IO syscalls during the query.
        Io = 1 => "io",
        /// The part of it in reads that missed the page cache (submitted block IO).
        ReadMiss = 2 => "read_miss",
        /// Encrypted cycles whose reply took more than one send (count only).
        MultiSend = 3 => "multi_send",
        /// Encrypted connections that started while pgio ran (count only).
        EncryptedConnections = 4 => "encrypted_connections",
        /// The queries' time in one `query_wait::Part` (a sum only, userspace's).
        Part = 5 => "part",
    }
}

crate::abi_enum! {
    /// How a connection's queries are delimited (see the module doc).
    pub enum Wire: u8 {
        /// Not known yet: nothing is booked.
        Unknown = 0 => "unknown",
        /// Message boundaries (ReadyForQuery).
        Plain = 1 => "plain",
        /// Request/response cycles.
        Encrypted = 2 => "encrypted",
    }
}

crate::abi_enum! {
    /// Where a backend is in its connection (`QueryState::phase`).
    pub enum Phase: u8 {
        /// Its client socket is known; it has not read a byte from it yet.
        New = 0 => "new",
        /// It read a startup packet (or a TLS ClientHello): connection start-up, not a query.
        Startup = 1 => "startup",
        /// Waiting for the client (its read found nothing).
        Waiting = 2 => "waiting",
        /// Running a query.
        Running = 3 => "running",
        /// It sent ReadyForQuery and has not waited yet: busy towards the next query.
        AfterReply = 4 => "after_reply",
        /// Not the server end of a connection (a replication or foreign-data client).
        Ignored = 5 => "ignored",
    }
}

/// `query`'s histogram map in the key quota (`KEY_ALLOWANCE`).
pub const QUOTA: crate::key_quota::QuotaMap = crate::key_quota::QuotaMap(2);

/// Key of `QUERY_HIST`: one row per series and wire.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct QueryKey {
    pub series: SeriesId,
    /// `Wire`.
    pub wire: u32,
}

/// The timed metrics of a [`QueryRow`], in the order of its arrays.
pub const ROW_METRICS: [QueryMetric; 3] = [
    QueryMetric::Duration,
    QueryMetric::Io,
    QueryMetric::ReadMiss,
];

/// Value of `QUERY_HIST`: every query histogram of one key, so that a run of queries
/// (`QueryRun`) costs one map lookup (one per metric cost ~150 ns more), and every CPU adds
/// to it atomically. The counters a run without IO touches come first, together.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueryRow {
    /// Per metric of [`ROW_METRICS`]: sum of the times (ns).
    pub sum_ns: [u64; 3],
    /// Per metric of [`ROW_METRICS`]: observations of 0 ns (slot 0 of its histogram).
    pub zeros: [u64; 3],
    /// Reads of the queries that missed the page cache.
    pub misses: u64,
    /// [`QueryMetric::MultiSend`] cycles.
    pub multi_send: u64,
    /// [`QueryMetric::EncryptedConnections`].
    pub encrypted_connections: u64,
    /// Per metric of [`ROW_METRICS`]: observations above 0 ns in each log2 slot
    /// (`hist::slot`).
    pub slots: [[u64; crate::hist::SLOTS]; 3],
    /// The queries' time per `query_wait::Part` (ns).
    pub parts_ns: [u64; PARTS],
}

impl QueryRow {
    pub const ZERO: QueryRow = QueryRow {
        sum_ns: [0; 3],
        zeros: [0; 3],
        misses: 0,
        multi_send: 0,
        encrypted_connections: 0,
        slots: [[0; crate::hist::SLOTS]; 3],
        parts_ns: [0; PARTS],
    };
}

impl Default for QueryRow {
    fn default() -> Self {
        QueryRow::ZERO
    }
}

/// Queries of one CPU not yet in the shared rows (`QUERY_RUNS`, per CPU): consecutive queries
/// of one (series, wire, query id) whose times fall in a window of `RUN_SLOTS` log2 slots
/// per metric are counted here with plain adds, then moved into `QUERY_HIST` (and
/// `QUERY_ID_HIST`) in one go: when a query does not fit, when the run is `RUN_MAX_NS` old,
/// or when its CPU goes idle. Two map lookups and a dozen atomic adds on lines every CPU
/// writes become, for a run of n queries, one n-th of that.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueryRun {
    /// Its first query's end; 0: a free run.
    pub first_ns: u64,
    /// `QueryIdKey::query_id` of its queries.
    pub query_id: u64,
    /// Per metric of [`ROW_METRICS`]: sum of the times (ns).
    pub sum_ns: [u64; 3],
    pub misses: u64,
    pub series: SeriesId,
    /// The series' generation when the run began: a series retired meanwhile drops it.
    pub generation: u32,
    pub multi_send: u32,
    /// Per metric: observations of 0 ns.
    pub zeros: [u32; 3],
    /// `Wire`.
    pub wire: u8,
    /// `query_id::IdKind`.
    pub kind: u8,
    /// Per metric: the log2 slot its window starts at; `RUN_BASE_UNSET` before its first
    /// observation above 0 ns.
    pub base: [u8; 3],
    pub _pad: [u8; 3],
    /// Per metric: observations in slots `base..base + RUN_SLOTS`.
    pub counts: [[u32; RUN_SLOTS]; 3],
    /// Its queries' time per `query_wait::Part` (ns).
    pub parts_ns: [u64; PARTS],
}

/// `QUERY_RUNS`' value: the runs of one CPU.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueryRuns {
    pub runs: [QueryRun; RUNS_PER_CPU],
    /// The jiffy from which a switch with runs pending reads the clock again.
    pub next_check_jiffies: u64,
}

/// Log2 slots a run keeps per metric: a factor of 2^8 between its shortest and longest query.
pub const RUN_SLOTS: usize = 8;
pub const RUNS_PER_CPU: usize = 4;
/// A run this old is moved into the rows at its CPU's next query of the same key or switch.
pub const RUN_MAX_NS: u64 = 1_000_000_000;
/// Jiffies between two clock reads of a CPU's switches (64 ms at HZ=1000, 640 at 100): the
/// jiffies counter is a plain load, the clock a read of the clock source.
pub const RUN_CHECK_JIFFIES: u64 = 64;
pub const RUN_BASE_UNSET: u8 = u8::MAX;

/// Where a run whose first observation above 0 ns falls in log2 slot `slot` starts its
/// window: half below it, within the histogram.
pub const fn run_base(slot: u8) -> u8 {
    let half = RUN_SLOTS as u8 / 2;
    let b = if slot > half { slot - half } else { 1 };
    let top = crate::hist::SLOTS as u8 - RUN_SLOTS as u8;
    if b > top { top } else { b }
}

/// The window index of log2 slot `slot` in a run starting at `base`, if inside.
pub const fn run_index(base: u8, slot: u8) -> Option<usize> {
    if base == RUN_BASE_UNSET || slot < base || (slot - base) as usize >= RUN_SLOTS {
        None
    } else {
        Some((slot - base) as usize)
    }
}

/// A client backend thread's connection and running query (a way of `QUERY`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QueryState {
    /// The running query's start (in `AfterReply`, the last ReadyForQuery's time).
    pub start_ns: u64,
    /// IO syscall time of the running query.
    pub io_ns: u64,
    /// Its reads that submitted block IO (page-cache misses).
    pub misses: u64,
    /// Their time.
    pub miss_ns: u64,
    /// Inside `pgaio_wref_wait` (PostgreSQL 18 AIO) since then; 0 outside.
    pub wait_start_ns: u64,
    /// Encrypted: when the cycle's last send returned.
    pub last_send_ns: u64,
    /// Before 5.15, the client-socket call in progress (`Pending::Call`): its buffer and
    /// length, kept by its `sys_enter_*` program for its exit.
    pub call_buf: u64,
    pub call_len: u64,
    /// Where this backend keeps its query id (`query_id`): found at its first query once its
    /// postmaster's `IdSource` is known, then read at each query's end; 0 until then.
    pub query_id_at: u64,
    pub client_fd: u32,
    /// The thread whose connection this is (`QUERY`'s ways are found by it); 0: a free way.
    pub tid: u32,
    /// Encrypted: sends in this cycle.
    pub sends: u16,
    /// `Phase`.
    pub phase: u8,
    /// `Wire`.
    pub wire: u8,
    /// `Pending`.
    pub pending: u8,
    pub _pad: [u8; 3],
    /// This way's index in `QUERY` (and in `query_wait`'s arrays).
    pub index: u32,
    pub _pad2: u32,
}

/// `QUERY` holds `QUERY_SETS` sets of `QUERY_WAYS` connections; a thread's set is its id's
/// low bits (ids are handed out in sequence, so live backends spread over the sets).
pub const QUERY_WAYS: u32 = 4;
pub const QUERY_SETS: u32 = 4_096;

crate::abi_enum! {
    /// Whether a `sys_enter_*` program kept a client-socket call (`QueryState::pending`).
    pub enum Pending: u8 {
        None = 0 => "none",
        Call = 1 => "call",
    }
}

/// A ReadyForQuery message: `Z`, length 5, and a transaction status.
pub const fn is_ready_for_query(b: &[u8; 6]) -> bool {
    b[0] == b'Z'
        && b[1] == 0
        && b[2] == 0
        && b[3] == 0
        && b[4] == 5
        && matches!(b[5], b'I' | b'T' | b'E')
}

/// A send's first byte: TLS records (0x14–0x17) and GSSAPI packets (a big-endian length,
/// 0 first) begin below 0x20; protocol messages begin with a letter or digit.
pub const fn is_encrypted(first: u8) -> bool {
    first < 0x20
}

/// The first 8 bytes a backend read from its socket begin a connection: a startup packet
/// (length, then protocol 3.x or the SSL/GSSAPI/cancel request codes 80877102–80877104),
/// or a TLS ClientHello of a direct-TLS connection (PostgreSQL 17+).
pub const fn is_connection_start(b: &[u8; 8]) -> bool {
    let code = u32::from_be_bytes([b[4], b[5], b[6], b[7]]);
    let protocol_3 = b[4] == 0 && b[5] == 3;
    let request = code >= 80_877_102 && code <= 80_877_104;
    let client_hello = b[0] == 0x16 && b[1] == 3;
    (b[0] == 0 && (protocol_3 || request)) || client_hello
}

/// `SERVES_CLIENTS`: one bit per series, set for client backends' series (and `NAMES_FILES`,
/// set for PostgreSQL's series: the relation family, the same size).
pub const SERVES_CLIENTS_WORDS: u32 = crate::CHILD_SERIES_MAX / 64;

crate::abi_size!(QueryKey, 8, 4);
crate::abi_size!(QueryRow, 1608 + 8 * PARTS, 8);
crate::abi_size!(QueryState, 96, 8);
crate::abi_size!(QueryRun, 176 + 8 * PARTS, 8);
crate::abi_size!(QueryRuns, 4 * (176 + 8 * PARTS) + 8, 8);
crate::abi_pod!(QueryKey, QueryRow, QueryState, QueryRun, QueryRuns);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_for_query_and_nothing_else() {
        assert!(is_ready_for_query(b"Z\0\0\0\x05I"));
        assert!(is_ready_for_query(b"Z\0\0\0\x05T"));
        assert!(is_ready_for_query(b"Z\0\0\0\x05E"));
        assert!(!is_ready_for_query(b"Z\0\0\0\x05X"));
        assert!(!is_ready_for_query(b"C\0\0\0\x05I"));
        assert!(!is_ready_for_query(b"Z\0\0\x01\x05I"));
    }

    #[test]
    fn connection_starts() {
        let startup = |v: [u8; 4]| {
            let mut b = [0, 0, 0, 0x54, 0, 0, 0, 0];
            b[4..].copy_from_slice(&v);
            b
        };
        assert!(is_connection_start(&startup([0, 3, 0, 0])));
        assert!(is_connection_start(&startup([0, 3, 0, 2])), "3.2 (PG18)");
        for code in [80_877_102u32, 80_877_103, 80_877_104] {
            let mut b = [0, 0, 0, 8, 0, 0, 0, 0];
            b[4..].copy_from_slice(&code.to_be_bytes());
            assert!(is_connection_start(&b), "{code}");
        }
        assert!(is_connection_start(&[0x16, 3, 1, 0, 0xf4, 1, 0, 0]));
        // Messages of a running connection.
        assert!(!is_connection_start(b"Q\0\0\0\x0dSEL"));
        assert!(!is_connection_start(b"P\0\0\0\x20\0SE"));
        assert!(!is_connection_start(&[0x17, 3, 3, 0, 0x20, 1, 2, 3]));
    }

    #[test]
    fn run_windows_stay_in_the_histogram() {
        for slot in 1..crate::hist::SLOTS as u8 {
            let base = run_base(slot);
            assert!(base >= 1, "{slot}");
            assert!(base as usize + RUN_SLOTS <= crate::hist::SLOTS, "{slot}");
            assert!(
                run_index(base, slot).is_some(),
                "{slot}: its own slot is inside"
            );
        }
        assert_eq!(run_index(RUN_BASE_UNSET, 5), None);
        assert_eq!(run_index(10, 9), None);
        assert_eq!(run_index(10, 17), Some(7));
        assert_eq!(run_index(10, 18), None);
    }

    #[test]
    fn encrypted_first_bytes() {
        for b in [0x14, 0x15, 0x16, 0x17, 0] {
            assert!(is_encrypted(b));
        }
        for b in *b"TDCZENSRK12ntAG" {
            assert!(!is_encrypted(b));
        }
    }
}
