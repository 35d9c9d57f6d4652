//! Query time and the IO time inside it, per backend thread: `pgstat_report_activity`
//! (attached per postgres binary by userspace) opens and closes a query; the syscall exits
//! add their time to the open one (`add_io`). Nothing per query leaves the kernel but two
//! histogram increments.
use aya_ebpf::{
    helpers::{bpf_get_current_pid_tgid, bpf_ktime_get_ns},
    macros::{btf_map, map, uprobe, uretprobe},
    maps::PerCpuHashMap,
    programs::{ProbeContext, RetProbeContext},
};
use pgio_common::{
    SeriesId,
    hist::{Bucket, slot},
    key_quota::HistMap,
    query::{QueryKey, QueryMetric, QueryState},
};

use crate::{hist, task_storage::TaskStorage, tracked};

/// `query_probes` from the config, written by userspace at load. The verifier sees the
/// constant: with it off, `add_io` is pruned from every syscall exit.
#[unsafe(no_mangle)]
static QUERY_PROBES: u8 = 0;

/// The running query of each backend thread.
#[btf_map]
static QUERY: TaskStorage<QueryState> = TaskStorage::new();

#[map]
static QUERY_HIST: PerCpuHashMap<QueryKey, Bucket> = PerCpuHashMap::with_max_entries(16_384, 0);

#[inline(always)]
fn book(series: SeriesId, metric: QueryMetric, ns: u64, misses: u64) {
    let key = QueryKey {
        series,
        metric: metric as u8,
        slot: slot(ns),
        _pad: [0; 2],
    };
    hist::add(&QUERY_HIST, HistMap::Query, series, &key, ns, misses);
}

/// `pgstat_report_activity(BackendState state, const char *cmd_str)` entry.
#[uprobe]
pub fn pgstat_report_activity(ctx: ProbeContext) -> u32 {
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    let Some(series) = tracked::series_of(tgid) else {
        return 0;
    };
    // The state's numbering changed in PostgreSQL 18 (STATE_STARTING went in after
    // STATE_UNDEFINED), but in every version the running states come with the query text and
    // the idle ones with NULL.
    let cmd_str: u64 = ctx.arg(1).unwrap_or(0);
    if cmd_str != 0 {
        let Some(q) = QUERY.current_or_zeroed() else {
            return 0;
        };
        // SAFETY: this thread's own storage, written only by this thread's programs.
        unsafe {
            // Extended protocol: Parse, Bind and Execute each report running; the query began
            // at the first.
            if (*q).start_ns == 0 {
                *q = QueryState {
                    start_ns: bpf_ktime_get_ns(),
                    io_ns: 0,
                    misses: 0,
                    miss_ns: 0,
                    wait_start_ns: 0,
                };
            }
        }
        return 0;
    }
    let Some(q) = QUERY.current() else {
        return 0;
    };
    // SAFETY: as above.
    let s = unsafe { *q };
    if s.start_ns == 0 {
        return 0;
    }
    unsafe {
        (*q).start_ns = 0;
        (*q).wait_start_ns = 0;
    }
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
pub fn add_io(ns: u64, miss: bool) {
    // SAFETY: a global the loader rewrites; volatile so the compiler keeps the load.
    if unsafe { core::ptr::read_volatile(&QUERY_PROBES) } == 0 {
        return;
    }
    let Some(q) = QUERY.current() else {
        return;
    };
    // SAFETY: this thread's own storage.
    unsafe {
        if (*q).start_ns != 0 && (*q).wait_start_ns == 0 {
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
    let Some(q) = QUERY.current() else {
        return 0;
    };
    // SAFETY: this thread's own storage.
    unsafe {
        if (*q).start_ns != 0 && (*q).wait_start_ns == 0 {
            (*q).wait_start_ns = bpf_ktime_get_ns();
        }
    }
    0
}

/// Its return: the wait is IO time of the running query.
#[uretprobe]
pub fn pgaio_wref_wait_return(_ctx: RetProbeContext) -> u32 {
    let Some(q) = QUERY.current() else {
        return 0;
    };
    // SAFETY: this thread's own storage.
    unsafe {
        let start = (*q).wait_start_ns;
        if start != 0 {
            (*q).wait_start_ns = 0;
            (*q).io_ns += bpf_ktime_get_ns().wrapping_sub(start);
        }
    }
    0
}
