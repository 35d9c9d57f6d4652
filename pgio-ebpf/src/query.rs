//! Query time and the IO time inside it, per backend thread: `pgstat_report_activity`
//! (attached per postgres binary by userspace) opens and closes a query; the syscall exits
//! add their time to the open one (`add_io`). Nothing per query leaves the kernel but two
//! histogram increments.
use aya_ebpf::{
    bindings::BPF_NOEXIST,
    helpers::{bpf_get_current_pid_tgid, bpf_ktime_get_ns},
    macros::{map, uprobe, uretprobe},
    maps::HashMap,
    programs::{ProbeContext, RetProbeContext},
};
use pgio_common::{
    SeriesId,
    drops::DropReason,
    hist::{Bucket, slot},
    query::{QUOTA, QueryKey, QueryMetric, QueryState},
};

use crate::{drops, hist, tracked};

/// `query_probes` from the config, written by userspace at load. The verifier sees the
/// constant: with it off, `add_io` is pruned from every syscall exit.
#[unsafe(no_mangle)]
static QUERY_PROBES: u8 = 0;

/// The running query of each backend thread, by thread id: an entry lives from a query's
/// start to its end (or the thread's exit), so the map holds only queries running now. A hash,
/// not task storage, so that the object loads on 5.10 (task storage for tracing is 5.11+);
/// preallocated, as a tracing program's hash must be.
#[map]
static QUERY: HashMap<u32, QueryState> = HashMap::with_max_entries(QUERY_MAX, 0);

/// Queries running at once on a node: far above any `max_connections` pgio has met. A query
/// that finds the map full is not timed (`query_unavailable`).
const QUERY_MAX: u32 = 16_384;

const EEXIST: i32 = 17;

#[inline(always)]
fn current_tid() -> u32 {
    bpf_get_current_pid_tgid() as u32
}

#[map]
static QUERY_HIST: HashMap<QueryKey, Bucket> = HashMap::with_max_entries(16_384, 0);

#[inline(always)]
fn book(series: SeriesId, metric: QueryMetric, ns: u64, misses: u64) {
    let key = QueryKey {
        series,
        metric: metric as u8,
        slot: slot(ns),
        _pad: [0; 2],
    };
    hist::add(&QUERY_HIST, QUOTA, series, &key, ns, misses);
}

/// `pgstat_report_activity(BackendState state, const char *cmd_str)` entry.
#[uprobe]
pub fn pgstat_report_activity(ctx: ProbeContext) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    let (tid, tgid) = (pid_tgid as u32, (pid_tgid >> 32) as u32);
    let Some(series) = tracked::series_of(tgid) else {
        return 0;
    };
    // The state's numbering changed in PostgreSQL 18 (STATE_STARTING went in after
    // STATE_UNDEFINED), but in every version the running states come with the query text and
    // the idle ones with NULL.
    let cmd_str: u64 = ctx.arg(1).unwrap_or(0);
    if cmd_str != 0 {
        // Extended protocol: Parse, Bind and Execute each report running; the query began at
        // the first, so an existing entry stays as it is.
        let start = QueryState {
            start_ns: unsafe { bpf_ktime_get_ns() },
            ..QueryState::default()
        };
        if let Err(e) = QUERY.insert(&tid, &start, BPF_NOEXIST as u64)
            && e != -EEXIST
        {
            drops::count(DropReason::QueryUnavailable);
        }
        return 0;
    }
    // SAFETY: a map value; only this thread's programs touch its key.
    let Some(s) = (unsafe { QUERY.get(&tid) }).copied() else {
        return 0;
    };
    let _ = QUERY.remove(&tid);
    let d = unsafe { bpf_ktime_get_ns() }.wrapping_sub(s.start_ns);
    book(series, QueryMetric::Duration, d, s.misses);
    // IO time is within the query's; the min guards a clock oddity, never a real case.
    book(series, QueryMetric::Io, s.io_ns.min(d), 0);
    book(series, QueryMetric::ReadMiss, s.miss_ns.min(d), 0);
    0
}

/// An IO syscall of this thread took `ns`: part of its running query, if one is. Inside an
/// AIO wait the wait's whole time is counted instead (with `io_method = io_uring` the wait is
/// an `io_uring_enter`: counting both would count it twice).
#[inline(always)]
pub fn add_io(tid: u32, ns: u64, miss: bool) {
    // SAFETY: a global the loader rewrites; volatile so the compiler keeps the load.
    if unsafe { core::ptr::read_volatile(&QUERY_PROBES) } == 0 {
        return;
    }
    let Some(q) = QUERY.get_ptr_mut(&tid) else {
        return;
    };
    // SAFETY: a map value; only this thread's programs touch its key.
    unsafe {
        if (*q).wait_start_ns == 0 {
            (*q).io_ns += ns;
            if miss {
                (*q).misses += 1;
                (*q).miss_ns += ns;
            }
        }
    }
}

/// PostgreSQL 18's `pgaio_wref_wait` entry: the backend waits for an IO it started, which with
/// `io_method = worker` an io worker performs (no IO syscall of the backend's own).
#[uprobe]
pub fn pgaio_wref_wait(_ctx: ProbeContext) -> u32 {
    let Some(q) = QUERY.get_ptr_mut(&current_tid()) else {
        return 0;
    };
    // SAFETY: a map value; only this thread's programs touch its key.
    unsafe {
        if (*q).wait_start_ns == 0 {
            (*q).wait_start_ns = bpf_ktime_get_ns();
        }
    }
    0
}

/// Its return: the wait is IO time of the running query.
#[uretprobe]
pub fn pgaio_wref_wait_return(_ctx: RetProbeContext) -> u32 {
    let Some(q) = QUERY.get_ptr_mut(&current_tid()) else {
        return 0;
    };
    // SAFETY: a map value; only this thread's programs touch its key.
    unsafe {
        let start = (*q).wait_start_ns;
        if start != 0 {
            (*q).wait_start_ns = 0;
            (*q).io_ns += bpf_ktime_get_ns().wrapping_sub(start);
        }
    }
    0
}

/// Called by `sched_process_exit` for every exiting thread: a backend that exits mid-query
/// (killed, or its client gone) leaves no entry behind.
#[inline(always)]
pub fn thread_exit(tid: u32) {
    let _ = QUERY.remove(&tid);
}
