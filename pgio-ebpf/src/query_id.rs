//! Each timed query booked again under its query id (`pgio_common::query_id` has the rules):
//! `current` reads the id a query is booked under, `book_run` books `query`'s runs under it;
//! `forked` and `exited` keep `QUERY_ID_SOURCE` per process.
use aya_ebpf::{
    bindings::BPF_NOEXIST,
    helpers::{bpf_get_current_pid_tgid, bpf_probe_read_user},
    macros::map,
    maps::{Array, HashMap},
};
use pgio_common::{
    SeriesId,
    drops::DropReason,
    query::{QueryRun, QueryState},
    query_id::{IdKind, IdSource, QUOTA, QueryIdKey, QueryIdRow},
};

use crate::{atomic::atomic_add, drops, key_quota};

/// `max_query_ids` above 0, written by userspace at load. Off, the verifier prunes the rest.
#[unsafe(no_mangle)]
static QUERY_IDS_ON: u8 = 1;

/// Where the processes of a postmaster keep their query id, by tgid: userspace writes the
/// postmaster's, a fork copies it to the child (one entry per process of a tracked cluster;
/// when full, the newest processes' ids are `Unknown`).
#[map]
static QUERY_ID_SOURCE: HashMap<u32, IdSource> = HashMap::with_max_entries(16_384, 0);

/// The epoch new rows are made in (0 or 1), flipped by userspace once a second.
#[map]
static QUERY_ID_EPOCH: Array<u32> = Array::with_max_entries(1, 0);

#[map]
static QUERY_ID_HIST: HashMap<QueryIdKey, QueryIdRow> = HashMap::with_max_entries(2_048, 0);

static ZERO_ROW: QueryIdRow = QueryIdRow::ZERO;

#[inline(always)]
fn on() -> bool {
    // SAFETY: a global the loader rewrites; volatile so the compiler keeps the load.
    unsafe { core::ptr::read_volatile(&QUERY_IDS_ON) != 0 }
}

/// Whether `QUERY_ID_SOURCE` is kept: for the ids, and for where `query_wait` reads the wait
/// event.
#[inline(always)]
fn sources_on() -> bool {
    on() || crate::query_wait::on()
}

/// A new process of a tracked parent inherits where its query id is (a postmaster's child
/// shares its address space layout).
#[inline(always)]
pub fn forked(parent_tgid: u32, child_tgid: u32) {
    if !sources_on() {
        return;
    }
    if let Some(src) = QUERY_ID_SOURCE.get_ptr(&parent_tgid) {
        // SAFETY: a map value, copied before the insert.
        let src = unsafe { *src };
        let _ = QUERY_ID_SOURCE.insert(&child_tgid, &src, 0);
    }
}

/// A process' exit (its leader's): its entry goes.
#[inline(always)]
pub fn exited(tgid: u32) {
    if sources_on() {
        let _ = QUERY_ID_SOURCE.remove(&tgid);
    }
}

/// Where a process of a tracked postmaster keeps what pgio reads of it (a copy).
#[inline(always)]
pub fn source(tgid: u32) -> Option<IdSource> {
    if !sources_on() {
        return None;
    }
    // SAFETY: a map value, copied.
    QUERY_ID_SOURCE.get_ptr(&tgid).map(|s| unsafe { *s })
}

/// Where the current process keeps its query id: its `PgBackendStatus` entry (set once when
/// the backend starts) plus the offset; 0 while not known.
#[inline(always)]
fn find_id(tgid: u32) -> u64 {
    let Some(src) = QUERY_ID_SOURCE.get_ptr(&tgid) else {
        return 0;
    };
    // SAFETY: a map value; then a read of the process' own memory, which may fail.
    unsafe {
        let src = *src;
        match bpf_probe_read_user(src.my_be_entry as *const u64) {
            Ok(entry) if entry != 0 => entry.wrapping_add(src.offset),
            _ => 0,
        }
    }
}

/// Where the current process' wait event is (`*my_wait_event_info`: its `PGPROC`'s, in shared
/// memory, once the backend has started), 0 while not known; and its PostgreSQL major.
#[inline(always)]
pub fn wait_event_at() -> (u64, u8) {
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    let Some(src) = QUERY_ID_SOURCE.get_ptr(&tgid) else {
        return (0, 0);
    };
    // SAFETY: a map value; then a read of the process' own memory, which may fail.
    unsafe {
        let at = (*src).my_wait_event_info;
        if at == 0 {
            return (0, 0);
        }
        (
            bpf_probe_read_user(at as *const u64).unwrap_or(0),
            (*src).major as u8,
        )
    }
}

/// The current process' query id now (what `pg_stat_activity.query_id` shows), from its
/// connection's `query_id_at`, found once.
///
/// SAFETY: `s` points to this thread's `QUERY` value.
#[inline(always)]
unsafe fn current_id(s: *mut QueryState) -> (IdKind, u64) {
    unsafe {
        let mut at = (*s).query_id_at;
        if at == 0 {
            at = find_id((bpf_get_current_pid_tgid() >> 32) as u32);
            if at == 0 {
                return (IdKind::Unknown, 0);
            }
            (*s).query_id_at = at;
        }
        match bpf_probe_read_user(at as *const u64) {
            Ok(0) => (IdKind::None, 0),
            Ok(id) => (IdKind::Known, id),
            Err(_) => (IdKind::Unknown, 0),
        }
    }
}

/// The row of `key`, made if its owner may have one more; else the series' `Refused` row of
/// this epoch (one per series and epoch: not counted against the share).
#[inline(always)]
fn row(series: SeriesId, key: &mut QueryIdKey) -> Option<*mut QueryIdRow> {
    if let Some(r) = QUERY_ID_HIST.get_ptr_mut(&*key) {
        return Some(r);
    }
    if key_quota::take(QUOTA, series) {
        let _ = QUERY_ID_HIST.insert(&*key, &ZERO_ROW, BPF_NOEXIST as u64);
        if let Some(r) = QUERY_ID_HIST.get_ptr_mut(&*key) {
            return Some(r);
        }
    }
    key.kind = IdKind::Refused as u8;
    key.query_id = 0;
    if let Some(r) = QUERY_ID_HIST.get_ptr_mut(&*key) {
        return Some(r);
    }
    let _ = QUERY_ID_HIST.insert(&*key, &ZERO_ROW, BPF_NOEXIST as u64);
    let r = QUERY_ID_HIST.get_ptr_mut(&*key);
    if r.is_none() {
        drops::count(DropReason::HistFull);
    }
    r
}

/// The id the current query is booked under: `(IdKind, query_id)`.
///
/// SAFETY: `s` points to this thread's `QUERY` value.
#[inline(always)]
pub unsafe fn current(s: *mut QueryState) -> (u8, u64) {
    if !on() {
        return (IdKind::Unknown as u8, 0);
    }
    // SAFETY: as the caller promises.
    let (kind, query_id) = unsafe { current_id(s) };
    (kind as u8, query_id)
}

/// A run of queries (`query`'s `QUERY_RUNS`), booked under its id.
///
/// SAFETY: `r` is this CPU's `QUERY_RUNS` value.
#[inline(always)]
pub unsafe fn book_run(series: SeriesId, r: *const QueryRun) {
    if !on() {
        return;
    }
    let epoch = QUERY_ID_EPOCH.get(0).copied().unwrap_or(0) as u8 & 1;
    // SAFETY: as the caller promises.
    let (kind, query_id, misses, miss_ns) =
        unsafe { ((*r).kind, (*r).query_id, (*r).misses, (*r).sum_ns[2]) };
    let mut key = QueryIdKey {
        series,
        epoch,
        kind,
        _pad: 0,
        query_id,
    };
    let Some(row) = row(series, &mut key) else {
        return;
    };
    // SAFETY: a map value, valid while the program runs; other CPUs add to it too.
    unsafe {
        crate::hist::add_run(
            &raw mut (*row).zeros[0],
            &raw mut (*row).slots[0],
            &raw mut (*row).sum_ns[0],
            r,
            0,
        );
        crate::hist::add_run(
            &raw mut (*row).zeros[1],
            &raw mut (*row).slots[1],
            &raw mut (*row).sum_ns[1],
            r,
            1,
        );
        if misses != 0 {
            atomic_add(&raw mut (*row).misses, misses);
        }
        if miss_ns != 0 {
            atomic_add(&raw mut (*row).miss_ns, miss_ns);
        }
        crate::query_wait::add_run_parts(&raw mut (*row).parts_ns, r);
    }
}
