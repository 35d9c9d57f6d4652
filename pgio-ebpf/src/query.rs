//! Query time and the IO time inside it, per client backend thread, from its client-socket
//! syscalls (`pgio_common::query` has the rules): `recvfrom` and `sendto` move the backend's
//! `Phase`; the syscall exits add their time to the running query (`add_io`). A query ends
//! counted in its CPU's run (`QUERY_RUNS`), which goes into `QUERY_HIST` in one go.
use core::ffi::c_void;

use aya_ebpf::{
    EbpfContext as _,
    helpers::{bpf_ktime_get_ns, bpf_probe_read_user},
    macros::{map, tracepoint, uprobe, uretprobe},
    maps::{Array, HashMap, PerCpuArray},
    programs::{ProbeContext, RetProbeContext, TracePointContext},
};
use pgio_common::{
    SeriesId,
    drops::DropReason,
    hist::slot_branchless,
    query::{
        Pending, Phase, QUERY_SETS, QUERY_WAYS, QUOTA, QueryKey, QueryRow, QueryRun, QueryRuns,
        QueryState, RUN_BASE_UNSET, RUN_CHECK_JIFFIES, RUN_MAX_NS, RUN_SLOTS, RUNS_PER_CPU, Wire,
        is_connection_start, is_encrypted, is_ready_for_query, run_base, run_index,
    },
    query_wait::PARTS,
};

use crate::{
    atomic::atomic_add,
    drops, hist, query_wait,
    sys_record::{ARG0, ARG1, ARG2, RET, field},
    thread, tracked,
};

/// `queries` from the config, written by userspace at load. The verifier sees the constant:
/// with it off, `add_io` is pruned from every syscall exit.
#[unsafe(no_mangle)]
static QUERIES_ON: u8 = 1;

/// Each client backend thread's connection, from its first read of its client socket to its
/// exit: `QUERY_SETS` sets of `QUERY_WAYS`, a thread's set chosen by its id. An array, not a
/// hash: the verifier inlines its lookups, which spares every socket call and every tracked
/// IO syscall's exit a helper call (a hash lookup measured +90 ns a call, an array +11). When
/// a thread finds its set full, the way whose query started longest ago is taken, so that
/// processes posing as backends cannot lock real ones out: the one pushed out loses its
/// running query (`query_unavailable`), then is learnt again.
#[map]
static QUERY: Array<QueryState> = Array::with_max_entries(QUERY_SETS * QUERY_WAYS, 0);

#[map]
static QUERY_HIST: HashMap<QueryKey, QueryRow> = HashMap::with_max_entries(1_024, 0);

/// This CPU's queries not yet in `QUERY_HIST` (`QueryRun`): per CPU, so counted with plain
/// adds. Programs that touch it run with preemption off (syscall tracepoints, `sched_switch`).
#[map]
static QUERY_RUNS: PerCpuArray<QueryRuns> = PerCpuArray::with_max_entries(1, 0);

/// The way of `tid`'s set that holds its connection.
#[inline(always)]
fn find(tid: u32) -> Option<*mut QueryState> {
    let set = tid & (QUERY_SETS - 1);
    for way in 0..QUERY_WAYS {
        let s = QUERY.get_ptr_mut(set * QUERY_WAYS + way)?;
        // SAFETY: a map value; a way is only written by the thread it names (or one taking
        // it over, which checks its claim afterwards).
        if unsafe { (*s).tid } == tid {
            return Some(s);
        }
    }
    None
}

/// A way of `tid`'s set for a new connection on `fd`: a free one, else the one whose query
/// started longest ago. Two threads may take the same way at once: each reads it back, and
/// the one that finds another's thread or socket there gives up until its next read.
#[inline(always)]
fn claim(tid: u32, fd: u32) -> Option<*mut QueryState> {
    let set = tid & (QUERY_SETS - 1);
    let mut taken: Option<(*mut QueryState, u32)> = None;
    let mut oldest = u64::MAX;
    for way in 0..QUERY_WAYS {
        let index = set * QUERY_WAYS + way;
        let s = QUERY.get_ptr_mut(index)?;
        // SAFETY: a map value (see `find`).
        let (owner, start) = unsafe { ((*s).tid, (*s).start_ns) };
        if owner == 0 {
            taken = Some((s, index));
            break;
        }
        if start < oldest {
            oldest = start;
            taken = Some((s, index));
        }
    }
    let (s, index) = taken?;
    // SAFETY: a map value (see `find`).
    unsafe {
        if (*s).tid != 0 {
            drops::count(DropReason::QueryUnavailable);
        }
        *s = QueryState {
            client_fd: fd,
            tid,
            index,
            ..QueryState::default()
        };
        let won = core::ptr::read_volatile(&raw const (*s).tid) == tid
            && core::ptr::read_volatile(&raw const (*s).client_fd) == fd;
        if won {
            query_wait::connected(index, tid);
        }
        won.then_some(s)
    }
}

/// Inserted as a new row's value (a map insert copies it).
static ZERO_ROW: QueryRow = QueryRow::ZERO;

const EAGAIN: i64 = 11;

/// The row of `(series, wire)`, made on first use if its owner may have one more.
#[inline(always)]
fn row(series: SeriesId, wire: u8) -> Option<*mut QueryRow> {
    let key = QueryKey {
        series,
        wire: wire as u32,
    };
    hist::row(&QUERY_HIST, &ZERO_ROW, QUOTA, series, &key)
}

/// One query's times, as a run counts them (`ROW_METRICS` order: duration, io, read miss),
/// with their log2 slots (0 for 0 ns), worked out once.
#[derive(Clone, Copy)]
struct Observed {
    ns: [u64; 3],
    slots: [u8; 3],
    misses: u64,
    multi_send: bool,
}

impl Observed {
    #[inline(always)]
    fn new(ns: [u64; 3], misses: u64, multi_send: bool) -> Observed {
        let s = |v: u64| if v == 0 { 0 } else { slot_branchless(v) };
        Observed {
            ns,
            slots: [s(ns[0]), s(ns[1]), s(ns[2])],
            misses,
            multi_send,
        }
    }
}

/// Whether every time of `o` falls in `r`'s windows.
///
/// SAFETY: `r` is a `QUERY_RUNS` value.
#[inline(always)]
unsafe fn fits(r: *const QueryRun, o: &Observed) -> bool {
    let mut m = 0;
    while m < 3 {
        let s = o.slots[m];
        // SAFETY: as the caller says.
        let base = unsafe { (*r).base[m] };
        if s != 0 && base != RUN_BASE_UNSET && run_index(base, s).is_none() {
            return false;
        }
        m += 1;
    }
    true
}

/// `o` into run `r` (which `fits` it).
///
/// SAFETY: `r` is this CPU's `QUERY_RUNS` value.
#[inline(always)]
unsafe fn count(r: *mut QueryRun, o: &Observed) {
    let mut m = 0;
    while m < 3 {
        let s = o.slots[m];
        // SAFETY: as the caller says; only programs on this CPU, one at a time, touch it.
        unsafe {
            (*r).sum_ns[m] += o.ns[m];
            if s == 0 {
                (*r).zeros[m] += 1;
            } else {
                let mut base = (*r).base[m];
                if base == RUN_BASE_UNSET {
                    base = run_base(s);
                    (*r).base[m] = base;
                }
                if let Some(w) = run_index(base, s) {
                    (*r).counts[m][w & (RUN_SLOTS - 1)] += 1;
                }
            }
        }
        m += 1;
    }
    // SAFETY: as above.
    unsafe {
        (*r).misses += o.misses;
        (*r).multi_send += o.multi_send as u32;
    }
}

/// Moves run `r` into its rows and frees it.
///
/// SAFETY: `r` is this CPU's `QUERY_RUNS` value.
#[inline(never)]
unsafe fn flush(r: *mut QueryRun) {
    // SAFETY: as the caller says.
    unsafe {
        let series = (*r).series;
        // A series retired meanwhile: its id may name another process' labels now.
        if tracked::generation(series) == (*r).generation {
            if let Some(row) = row(series, (*r).wire) {
                hist::add_run(
                    &raw mut (*row).zeros[0],
                    &raw mut (*row).slots[0],
                    &raw mut (*row).sum_ns[0],
                    r,
                    0,
                );
                hist::add_run(
                    &raw mut (*row).zeros[1],
                    &raw mut (*row).slots[1],
                    &raw mut (*row).sum_ns[1],
                    r,
                    1,
                );
                hist::add_run(
                    &raw mut (*row).zeros[2],
                    &raw mut (*row).slots[2],
                    &raw mut (*row).sum_ns[2],
                    r,
                    2,
                );
                if (*r).misses != 0 {
                    atomic_add(&raw mut (*row).misses, (*r).misses);
                }
                if (*r).multi_send != 0 {
                    atomic_add(&raw mut (*row).multi_send, (*r).multi_send as u64);
                }
                query_wait::add_run_parts(&raw mut (*row).parts_ns, r);
            }
            crate::query_id::book_run(series, r);
        }
        clear(r);
    }
}

/// A free run. Volatile stores: merged into one clear, they become a `memset` subprogram.
///
/// SAFETY: `r` is this CPU's `QUERY_RUNS` value.
#[inline(always)]
unsafe fn clear(r: *mut QueryRun) {
    // SAFETY: as the caller says.
    unsafe {
        core::ptr::write_volatile(&raw mut (*r).first_ns, 0);
        let mut m = 0;
        while m < 3 {
            core::ptr::write_volatile(&raw mut (*r).sum_ns[m], 0);
            core::ptr::write_volatile(&raw mut (*r).zeros[m], 0);
            core::ptr::write_volatile(&raw mut (*r).base[m], RUN_BASE_UNSET);
            let mut w = 0;
            while w < RUN_SLOTS {
                core::ptr::write_volatile(&raw mut (*r).counts[m][w], 0);
                w += 1;
            }
            m += 1;
        }
        core::ptr::write_volatile(&raw mut (*r).misses, 0);
        core::ptr::write_volatile(&raw mut (*r).multi_send, 0);
        let mut p = 0;
        while p < PARTS {
            core::ptr::write_volatile(&raw mut (*r).parts_ns[p], 0);
            p += 1;
        }
    }
}

/// The query that ran from `s.start_ns` to `end`, counted in this CPU's run of its series,
/// wire and query id (begun, or taken from the run that began longest ago, if none fits).
///
/// SAFETY: `s` points to this thread's `QUERY` value.
#[inline(always)]
unsafe fn book_query(series: SeriesId, s: *mut QueryState, end: u64) {
    // SAFETY: as the caller promises; not used past the fields read below.
    let q = unsafe { &*s };
    let d = end.wrapping_sub(q.start_ns);
    let index = q.index;
    // Its IO syscalls, and its blocked time under an IO wait event outside them (an io
    // worker's reads it waited for). IO time is within the query's; the min guards IO done
    // after an encrypted cycle's last send, which counts in it.
    let io = q.io_ns + query_wait::finish(index);
    let o = Observed::new([d, io.min(d), q.miss_ns.min(d)], q.misses, q.sends > 1);
    let wire = q.wire;
    // SAFETY: as the caller promises.
    let (kind, query_id) = unsafe { crate::query_id::current(s) };
    let Some(runs) = QUERY_RUNS.get_ptr_mut(0) else {
        return;
    };
    let generation = tracked::generation(series);
    // The run of this key, else a free one, else the one begun longest ago.
    let mut pick = RUNS_PER_CPU;
    let mut same = false;
    let mut oldest = 0;
    let mut oldest_ns = u64::MAX;
    let mut i = 0;
    while i < RUNS_PER_CPU {
        // SAFETY: this CPU's value; programs that touch it run one at a time on it.
        let (first, key) = unsafe {
            let r = &raw const (*runs).runs[i];
            (
                (*r).first_ns,
                (*r).series == series
                    && (*r).generation == generation
                    && (*r).wire == wire
                    && (*r).kind == kind
                    && (*r).query_id == query_id,
            )
        };
        if first != 0 && key {
            pick = i;
            same = true;
            break;
        }
        if first == 0 && pick == RUNS_PER_CPU {
            pick = i;
        }
        if first != 0 && first < oldest_ns {
            oldest_ns = first;
            oldest = i;
        }
        i += 1;
    }
    if pick == RUNS_PER_CPU {
        pick = oldest;
    }
    // SAFETY: as above; the mask proves the index.
    unsafe {
        let r = &raw mut (*runs).runs[pick & (RUNS_PER_CPU - 1)];
        let first = (*r).first_ns;
        if !(same && end.wrapping_sub(first) < RUN_MAX_NS && fits(r, &o)) {
            if first != 0 {
                flush(r);
            }
            (*r).first_ns = end.max(1);
            (*r).series = series;
            (*r).generation = generation;
            (*r).wire = wire;
            (*r).kind = kind;
            (*r).query_id = query_id;
            // A run never used is all zeros (slot 0 is a window too).
            (*r).base = [RUN_BASE_UNSET; 3];
        }
        count(r, &o);
        query_wait::add_parts(index, d, &raw mut (*r).parts_ns);
        // A process not classified yet: userspace routes its rows while it knows the tgid.
        if series.is_provisional() {
            flush(r);
        }
    }
}

/// Called by `sched_switch`: a CPU going idle moves its runs into the rows (nothing else
/// would until its next query), and a busy one those `RUN_MAX_NS` old, looked at once per
/// `RUN_CHECK_JIFFIES` (tracing programs may not read the coarse clock). A CPU that only
/// spins still switches now and then (14 times in 3 s here, one spinning thread pinned).
#[inline(always)]
pub fn switched(next_idle: bool) {
    // SAFETY: a global the loader rewrites; volatile so the compiler keeps the load.
    if unsafe { core::ptr::read_volatile(&QUERIES_ON) } == 0 {
        return;
    }
    let Some(runs) = QUERY_RUNS.get_ptr_mut(0) else {
        return;
    };
    // SAFETY: this CPU's value; the syscall programs cannot run while the scheduler does.
    unsafe {
        let mut pending = 0;
        let mut i = 0;
        while i < RUNS_PER_CPU {
            pending |= (*runs).runs[i].first_ns;
            i += 1;
        }
        if pending == 0 {
            return;
        }
        let now = if next_idle {
            u64::MAX
        } else {
            let jiffies = aya_ebpf::helpers::generated::bpf_jiffies64();
            if jiffies < (*runs).next_check_jiffies {
                return;
            }
            (*runs).next_check_jiffies = jiffies + RUN_CHECK_JIFFIES;
            bpf_ktime_get_ns()
        };
        let mut i = 0;
        while i < RUNS_PER_CPU {
            let r = &raw mut (*runs).runs[i];
            let first = (*r).first_ns;
            if first != 0 && now.wrapping_sub(first) >= RUN_MAX_NS {
                flush(r);
            }
            i += 1;
        }
    }
}

/// The next query starts at `start` (`Running`, or `AfterReply` when busy since a reply).
#[inline(always)]
fn restart(s: *mut QueryState, phase: Phase, start: u64) {
    // SAFETY: a map value; only this thread's programs touch its way. Volatile: merged
    // into one clear, the three stores become a call of a `memset` subprogram.
    unsafe {
        (*s).phase = phase as u8;
        (*s).start_ns = start;
        core::ptr::write_volatile(&raw mut (*s).io_ns, 0);
        core::ptr::write_volatile(&raw mut (*s).misses, 0);
        core::ptr::write_volatile(&raw mut (*s).miss_ns, 0);
        (*s).sends = 0;
        if phase == Phase::Waiting {
            query_wait::stop((*s).index);
        } else {
            query_wait::begin((*s).index, (*s).tid, crate::query_id::wait_event_at);
        }
    }
}

/// A client-socket call's arguments, read at its exit.
#[derive(Clone, Copy)]
struct Call {
    fd: u32,
    buf: u64,
    len: u64,
}

/// The call's arguments from the thread's saved user registers, which the kernel keeps
/// until it returns to user space: one program per call instead of an entry and an exit.
#[cfg(bpf_target_arch = "x86_64")]
#[inline(always)]
fn call_from_regs() -> Option<Call> {
    use aya_ebpf::{bindings::pt_regs, helpers::generated};
    // SAFETY: the current task, and its saved registers (a BTF pointer the verifier checks).
    unsafe {
        let regs =
            generated::bpf_task_pt_regs(generated::bpf_get_current_task_btf()) as *const pt_regs;
        if regs.is_null() {
            return None;
        }
        Some(Call {
            fd: (*regs).rdi as u32,
            buf: (*regs).rsi,
            len: (*regs).rdx,
        })
    }
}

/// Elsewhere the loader attaches the `sys_enter_*` programs, which keep the arguments.
#[cfg(not(bpf_target_arch = "x86_64"))]
#[inline(always)]
fn call_from_regs() -> Option<Call> {
    None
}

/// The call's arguments from its `sys_enter_*` record, read once: the verifier refuses a
/// context pointer the compiler has moved.
#[inline(always)]
fn call_at_entry(ctx: &TracePointContext) -> Call {
    Call {
        fd: field(ctx, ARG0) as u32,
        buf: field(ctx, ARG1),
        len: field(ctx, ARG2),
    }
}

/// Kernels without `bpf_task_pt_regs` (< 5.15): the `sys_enter_*` program keeps a call on
/// the thread's client socket for its exit (`Pending::Call`).
#[inline(always)]
fn keep_call(call: Call, s: *mut QueryState) {
    // SAFETY: a map value; only this thread's programs touch its way.
    unsafe {
        if (*s).client_fd != call.fd || (*s).phase == Phase::Ignored as u8 {
            return;
        }
        (*s).pending = Pending::Call as u8;
        (*s).call_buf = call.buf;
        (*s).call_len = call.len;
    }
}

/// At a client-socket call's exit: the thread's connection, if this call is on its client
/// socket. `open`: a `recvfrom` makes the connection of a client backend thread.
#[inline(always)]
fn socket_call(tid: u32, series: SeriesId, open: bool) -> Option<(*mut QueryState, Call)> {
    if !crate::kernel_offsets::syscall_args_from_regs() {
        let s = find(tid)?;
        // SAFETY: a map value; only this thread's programs touch its way.
        unsafe {
            if (*s).pending != Pending::Call as u8 {
                return None;
            }
            (*s).pending = Pending::None as u8;
            let call = Call {
                fd: (*s).client_fd,
                buf: (*s).call_buf,
                len: (*s).call_len,
            };
            return Some((s, call));
        }
    }
    let call = call_from_regs()?;
    let s = if open {
        open_connection(tid, series, call.fd)?
    } else {
        find(tid)?
    };
    // SAFETY: a map value; only this thread's programs touch its way.
    unsafe {
        if (*s).client_fd != call.fd || (*s).phase == Phase::Ignored as u8 {
            return None;
        }
    }
    Some((s, call))
}

/// A client backend thread's connection, made at its first read (whose `fd` names its client
/// socket). Other tracked processes (Longhorn's) only pay the bitmap lookup; a walsender or
/// a replication client, classified since its first read, leaves its entry.
#[inline(always)]
fn open_connection(tid: u32, series: SeriesId, fd: u32) -> Option<*mut QueryState> {
    let s = find(tid);
    if !tracked::serves_clients(series) {
        if let Some(s) = s {
            free(s);
        }
        return None;
    }
    s.or_else(|| claim(tid, fd))
}

/// A way no thread holds any more.
#[inline(always)]
fn free(s: *mut QueryState) {
    // SAFETY: a map value; the thread it named has gone (or is not a client backend).
    unsafe {
        (*s).tid = 0;
        query_wait::connected((*s).index, 0);
    }
}

/// `recvfrom(fd, buf, len, …)` before 5.15: keeps the call for its exit.
#[tracepoint]
pub fn sys_enter_recvfrom(ctx: TracePointContext) -> u32 {
    match tracked::caller() {
        Some(c) => sys_enter_recvfrom_tracked(ctx.as_ptr(), c.pid_tgid, c.series.0),
        None => 0,
    }
}

/// A tracked process' program's work, in a function of its own (`tracked::caller`).
#[inline(never)]
fn sys_enter_recvfrom_tracked(ctx: *mut c_void, pid_tgid: u64, series: u32) -> u32 {
    let (ctx, tid, series) = (
        TracePointContext::new(ctx),
        pid_tgid as u32,
        SeriesId(series),
    );
    let call = call_at_entry(&ctx);
    if let Some(s) = open_connection(tid, series, call.fd) {
        keep_call(call, s);
    }
    0
}

/// A read of the backend's client socket returned: a request arrived (or, `EAGAIN`, the
/// backend is about to wait for one).
#[tracepoint]
pub fn sys_exit_recvfrom(ctx: TracePointContext) -> u32 {
    match tracked::caller() {
        Some(c) => sys_exit_recvfrom_tracked(ctx.as_ptr(), c.pid_tgid, c.series.0),
        None => 0,
    }
}

#[inline(never)]
fn sys_exit_recvfrom_tracked(ctx: *mut c_void, pid_tgid: u64, series: u32) -> u32 {
    let (ctx, tid, series) = (
        TracePointContext::new(ctx),
        pid_tgid as u32,
        SeriesId(series),
    );
    let Some((s, call)) = socket_call(tid, series, true) else {
        return 0;
    };
    let ret = field(&ctx, RET) as i64;
    let data = ret > 0;
    if !data && ret != -EAGAIN {
        return 0; // end of stream or an error: the backend is going
    }
    // SAFETY: a map value; only this thread's programs touch its way.
    unsafe {
        let phase = (*s).phase;
        // Encrypted: a read after a send ends the cycle at that send.
        let cycle_done = (*s).wire == Wire::Encrypted as u8 && (*s).sends > 0;
        if phase == Phase::New as u8 {
            if data {
                read_first(s, series, call.buf, ret);
            }
        } else if phase == Phase::Waiting as u8 {
            if data {
                restart(s, Phase::Running, bpf_ktime_get_ns());
            }
        } else if phase == Phase::AfterReply as u8 {
            if data {
                (*s).phase = Phase::Running as u8;
            } else {
                (*s).phase = Phase::Waiting as u8;
                query_wait::stop((*s).index);
            }
        } else if phase == Phase::Running as u8 {
            if cycle_done {
                let end = (*s).last_send_ns;
                book_query(series, s, end);
                restart(s, if data { Phase::Running } else { Phase::Waiting }, end);
            }
        } else if phase == Phase::Startup as u8 && cycle_done {
            // The TLS handshake's flight: what follows is counted in cycles.
            let end = (*s).last_send_ns;
            restart(s, if data { Phase::Running } else { Phase::Waiting }, end);
        }
    }
    0
}

/// A thread's first bytes from its socket: a connection's start, a running connection's
/// request (a client backend that was connected before pgio started), or, for a process not
/// classified yet, the client side of a connection (a replication worker).
#[inline(always)]
unsafe fn read_first(s: *mut QueryState, series: SeriesId, buf: u64, ret: i64) {
    let first = if ret >= 8 {
        // SAFETY: a read of user memory, which may fail.
        unsafe { bpf_probe_read_user(buf as *const [u8; 8]) }.ok()
    } else {
        None
    };
    // SAFETY: a map value; only this thread's programs touch its way.
    unsafe {
        if first.is_some_and(|b| is_connection_start(&b)) {
            (*s).phase = Phase::Startup as u8;
        } else if !series.is_provisional() {
            restart(s, Phase::Running, bpf_ktime_get_ns());
        } else {
            (*s).phase = Phase::Ignored as u8;
        }
    }
}

/// `sendto(fd, buf, len, …)` before 5.15: keeps the call for its exit.
#[tracepoint]
pub fn sys_enter_sendto(ctx: TracePointContext) -> u32 {
    match tracked::caller() {
        Some(c) => sys_enter_sendto_tracked(ctx.as_ptr(), c.pid_tgid),
        None => 0,
    }
}

#[inline(never)]
fn sys_enter_sendto_tracked(ctx: *mut c_void, pid_tgid: u64) -> u32 {
    let (ctx, tid) = (TracePointContext::new(ctx), pid_tgid as u32);
    let call = call_at_entry(&ctx);
    if let Some(s) = find(tid) {
        keep_call(call, s);
    }
    0
}

/// The backend wrote to its client socket. Its bytes tell the connection's wire, and, on a
/// plain one, whether the send ended with ReadyForQuery: the end of a query.
#[tracepoint]
pub fn sys_exit_sendto(ctx: TracePointContext) -> u32 {
    match tracked::caller() {
        Some(c) => sys_exit_sendto_tracked(ctx.as_ptr(), c.pid_tgid, c.series.0),
        None => 0,
    }
}

#[inline(never)]
fn sys_exit_sendto_tracked(ctx: *mut c_void, pid_tgid: u64, series: u32) -> u32 {
    let (ctx, tid, series) = (
        TracePointContext::new(ctx),
        pid_tgid as u32,
        SeriesId(series),
    );
    let Some((s, call)) = socket_call(tid, series, false) else {
        return 0;
    };
    let ret = field(&ctx, RET) as i64;
    // SAFETY: a map value; only this thread's programs touch its way.
    unsafe {
        let phase = (*s).phase;
        if ret <= 0 || phase == Phase::New as u8 {
            return 0;
        }
        if (*s).wire == Wire::Unknown as u8
            && let Ok(first) = bpf_probe_read_user(call.buf as *const u8)
            && is_encrypted(first)
        {
            (*s).wire = Wire::Encrypted as u8;
            if phase == Phase::Startup as u8
                && let Some(r) = row(series, Wire::Encrypted as u8)
            {
                // A map value; other CPUs add to it too.
                atomic_add(&raw mut (*r).encrypted_connections, 1);
            }
        }
        if (*s).wire == Wire::Encrypted as u8 {
            // Waiting: an asynchronous notification, not a reply.
            if phase != Phase::Waiting as u8 {
                (*s).last_send_ns = bpf_ktime_get_ns();
                (*s).sends = (*s).sends.saturating_add(1);
            }
            return 0;
        }
        // A partial write: the rest, which ends with ReadyForQuery, follows.
        let len = call.len;
        if len < 6 || ret as u64 != len {
            return 0;
        }
        let Ok(tail) = bpf_probe_read_user((call.buf + len - 6) as *const [u8; 6]) else {
            return 0;
        };
        if !is_ready_for_query(&tail) {
            return 0;
        }
        (*s).wire = Wire::Plain as u8;
        let now = bpf_ktime_get_ns();
        if phase == Phase::Running as u8 || phase == Phase::AfterReply as u8 {
            book_query(series, s, now);
        }
        restart(s, Phase::AfterReply, now);
    }
    0
}

/// An IO syscall of this thread, booked under `series`, took `ns`: part of its running query,
/// if one is. Inside an AIO wait the wait's whole time is counted instead (with
/// `io_method = io_uring` the wait is an `io_uring_enter`: counting both would count it twice).
#[inline(always)]
pub fn add_io(series: SeriesId, tid: u32, ns: u64, miss: bool) {
    // SAFETY: a global the loader rewrites; volatile so the compiler keeps the load.
    if unsafe { core::ptr::read_volatile(&QUERIES_ON) } == 0 {
        return;
    }
    // Only a client backend's thread holds a way: any other process' call stops at one bit,
    // not a search of its set's ways.
    if !tracked::serves_clients(series) {
        return;
    }
    let Some(q) = find(tid) else {
        return;
    };
    // SAFETY: a map value; only this thread's programs touch its way.
    unsafe {
        query_wait::io_call_done((*q).index, ns);
        let phase = (*q).phase;
        if (phase == Phase::Running as u8 || phase == Phase::AfterReply as u8)
            && (*q).wait_start_ns == 0
        {
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
    // The wait's blocked time is counted by its wait event (`AioIoCompletion`).
    if query_wait::on() {
        return 0;
    }
    let Some(q) = find(thread::current().0) else {
        return 0;
    };
    // SAFETY: a map value; only this thread's programs touch its way.
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
    if query_wait::on() {
        return 0;
    }
    let Some(q) = find(thread::current().0) else {
        return 0;
    };
    // SAFETY: a map value; only this thread's programs touch its way.
    unsafe {
        let start = (*q).wait_start_ns;
        if start != 0 {
            (*q).wait_start_ns = 0;
            (*q).io_ns += bpf_ktime_get_ns().wrapping_sub(start);
        }
    }
    0
}

/// Called by `sched_process_exit` for every exiting thread: a backend's connection ends
/// with it.
#[inline(always)]
pub fn thread_exit(tid: u32) {
    if let Some(s) = find(tid) {
        free(s);
    }
}
