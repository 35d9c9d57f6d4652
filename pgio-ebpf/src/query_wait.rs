//! Where a running query's time goes (`pgio_common::query_wait` has the rules): the
//! `sched_switch` program books a query thread's blocked intervals under the wait event
//! PostgreSQL set for it; `query` asks at the query's end for its IO wait and its parts.
//!
//! `CONNECTED` holds, per `QUERY` way, its client backend thread: the only thing every switch
//! of every thread on the node looks at (one set of 4 ids for `prev`, one for `next`). It is
//! written when a connection is made or ends, not per query: a line every switch reads must
//! not bounce between CPUs at each query (that cost +45 ns a switch under pgbench -S). Whether
//! the thread runs a query is in its own `QUERY_WAIT` value, which its CPU has at hand.
use aya_ebpf::{
    helpers::{bpf_get_current_task, bpf_ktime_get_ns, bpf_probe_read_user},
    macros::map,
    maps::Array,
};
use pgio_common::{
    query::{QUERY_SETS, QUERY_WAYS, QueryRun},
    query_wait::{PARTS, Part, QueryWait, part_of},
    syscall::Syscall,
    wait_event::UNREADABLE,
};

use crate::{
    atomic::atomic_add,
    kernel_offsets::{task_u32, task_u64},
    role_wait, thread, tracked,
};

/// `queries` from the config, written by userspace at load; `on()` also needs the offsets of
/// the task's `sched_info.run_delay` and state. Off, the verifier prunes the rest.
#[unsafe(no_mangle)]
static QUERY_WAIT_ON: u8 = 1;

/// Per `QUERY` set, per way: its client backend thread, else 0 (one lookup per switch side).
#[map]
static CONNECTED: Array<[u32; QUERY_WAYS as usize]> = Array::with_max_entries(QUERY_SETS, 0);

/// Per `QUERY` way: its thread's blocked intervals in the running query.
#[map]
static QUERY_WAIT: Array<QueryWait> = Array::with_max_entries(QUERY_SETS * QUERY_WAYS, 0);

#[inline(always)]
pub fn on() -> bool {
    // SAFETY: a global the loader rewrites; volatile so the compiler keeps the load.
    let on = unsafe { core::ptr::read_volatile(&QUERY_WAIT_ON) } != 0;
    let (run_delay, state) = crate::kernel_offsets::task_sched();
    on && run_delay != 0 && state != 0
}

/// The way of client backend thread `tid`, if it is one.
#[inline(always)]
fn way_of(tid: u32) -> Option<u32> {
    let set = tid & (QUERY_SETS - 1);
    let ways = CONNECTED.get(set)?;
    let mut way = 0;
    while way < QUERY_WAYS {
        if ways[way as usize] == tid {
            return Some(set * QUERY_WAYS + way);
        }
        way += 1;
    }
    None
}

/// Way `i` now holds thread `tid`'s connection (0: none).
#[inline(always)]
pub fn connected(i: u32, tid: u32) {
    if !on() {
        return;
    }
    if let Some(ways) = CONNECTED.get_ptr_mut(i / QUERY_WAYS) {
        // SAFETY: a map value; the mask proves the index.
        unsafe {
            core::ptr::write_volatile(
                &raw mut (*ways)[(i % QUERY_WAYS) as usize & (QUERY_WAYS as usize - 1)],
                tid,
            )
        };
    }
}

/// The running thread's `run_delay`.
#[inline(always)]
fn my_run_delay() -> u64 {
    // SAFETY: the current task's address, only read through `bpf_probe_read_kernel`.
    task_u64(
        unsafe { bpf_get_current_task() },
        crate::kernel_offsets::task_sched().0,
    )
}

/// The blocked part of `w`'s open interval, booked: from leaving the CPU to running again,
/// less the run-queue wait in between (`delay` is the thread's `run_delay` after it ran
/// again). An interval whose end was not seen (pgio attached meanwhile) is dropped.
///
/// SAFETY: `w` is a `QUERY_WAIT` value of the running (or leaving) thread.
#[inline(always)]
unsafe fn settle(w: *mut QueryWait, delay: u64) {
    // SAFETY: as the caller says.
    unsafe {
        let (off, on) = ((*w).off_ns, (*w).on_ns);
        (*w).off_ns = 0;
        if on < off {
            return;
        }
        let queued = delay.wrapping_sub((*w).off_delay).min(on - off);
        let blocked = on - off - queued;
        let info = (*w).info;
        let p = part_of(info) as usize;
        if p < PARTS {
            (*w).wait_ns[p] += blocked;
        }
        (*w).blocked_ns += blocked;
        // Each interval also as one observation, as the other processes' are: a heatmap of
        // the client backends' waits per type, and their individual wait events.
        role_wait::book_interval((*w).series, info, (*w).major, blocked, queued);
        // IO time is wall-clock, like a syscall's and like PostgreSQL's `read_time`: until
        // the thread ran again, its run-queue wait after the wake-up included.
        if (*w).open_io != 0 {
            (*w).io_wait_ns += on - off;
        }
    }
}

/// The `wait_event_info` of the thread leaving the CPU (or returning from an IO syscall),
/// from its own memory; `UNREADABLE` if it cannot be read.
///
/// SAFETY: `w` is that thread's `QUERY_WAIT` value, and the program runs in its context.
#[inline(always)]
unsafe fn wait_event_info(w: *const QueryWait) -> u32 {
    // SAFETY: as the caller says; then a read of the thread's memory, which may fail.
    unsafe {
        let at = (*w).event_at;
        if at == 0 {
            return UNREADABLE;
        }
        bpf_probe_read_user(at as *const u32).unwrap_or(UNREADABLE)
    }
}

/// `sched_switch`, in the context of `prev`: a query thread leaving the CPU settles its last
/// blocked interval and, if it blocks, opens one under its wait event; a query thread run
/// again marks when.
#[inline(always)]
pub fn switched(preempt: bool, prev: u64, prev_pid: u32, next_pid: u32) {
    if !on() {
        return;
    }
    if prev_pid != 0
        && let Some(i) = way_of(prev_pid)
    {
        left_cpu(i, prev, prev_pid, preempt);
    }
    if next_pid != 0
        && let Some(i) = way_of(next_pid)
        && let Some(w) = QUERY_WAIT.get_ptr_mut(i)
    {
        // SAFETY: a map value; its thread is not running anywhere while it is switched in.
        unsafe {
            if (*w).tid == next_pid && (*w).in_query != 0 && (*w).off_ns != 0 && (*w).on_ns == 0 {
                (*w).on_ns = bpf_ktime_get_ns();
            }
        }
    }
}

#[inline(always)]
fn left_cpu(i: u32, task: u64, tid: u32, preempt: bool) {
    let Some(w) = QUERY_WAIT.get_ptr_mut(i) else {
        return;
    };
    let (run_delay_at, state_at) = crate::kernel_offsets::task_sched();
    // SAFETY: a map value of the thread leaving, in its context.
    unsafe {
        if (*w).tid != tid || (*w).in_query == 0 {
            return;
        }
        // An IO syscall of this thread entered since it last ran here (its start is still
        // in this CPU's slot, which the syscall family spills after this): its blocked time
        // is the syscall's, counted as IO already, however often it leaves the CPU in it.
        // The first time, its off-CPU counts start (`io_call_done` takes them from its time).
        let entering_call = (*w).in_io_call == 0
            && thread::slot_as_is().is_some_and(|c| {
                (*c).open != 0
                    && (*c).start.start_ns != 0
                    && (*c).start.syscall < Syscall::Futex as u8
            });
        if entering_call {
            (*w).in_io_call = 1;
        }
        // Preempted, or woken before it slept: it stays on a run queue (`run_delay`).
        let blocked = !preempt && task_u32(task, state_at) != 0;
        if (*w).off_ns == 0 && !blocked && !entering_call {
            return;
        }
        let delay = task_u64(task, run_delay_at);
        if (*w).off_ns != 0 {
            settle(w, delay);
        }
        if entering_call {
            (*w).call_delay = delay;
            (*w).call_blocked = (*w).blocked_ns;
        }
        if !blocked {
            return;
        }
        (*w).off_ns = bpf_ktime_get_ns();
        (*w).off_delay = delay;
        (*w).on_ns = 0;
        let info = wait_event_info(w);
        (*w).info = info;
        (*w).series = tracked::series_of(tid).unwrap_or(pgio_common::SeriesId::UNTRACKED);
        (*w).open_io = (part_of(info) == Part::Io && (*w).in_io_call == 0) as u8;
    }
}

/// A query starts on way `i` of thread `tid` (running): its parts from nothing.
/// `event_at` finds where the thread's wait event is and its PostgreSQL major version, asked
/// once per connection.
#[inline(always)]
pub fn begin(i: u32, tid: u32, event_at: impl FnOnce() -> (u64, u8)) {
    if !on() {
        return;
    }
    let Some(w) = QUERY_WAIT.get_ptr_mut(i) else {
        return;
    };
    // SAFETY: a map value; only this thread's programs and its switches touch it.
    // Volatile stores: merged, they become a call of a `memset` subprogram.
    unsafe {
        if (*w).tid != tid {
            (*w).tid = tid;
            (*w).event_at = 0;
        }
        if (*w).event_at == 0 {
            ((*w).event_at, (*w).major) = event_at();
        }
        core::ptr::write_volatile(&raw mut (*w).off_ns, 0);
        core::ptr::write_volatile(&raw mut (*w).on_ns, 0);
        core::ptr::write_volatile(&raw mut (*w).io_wait_ns, 0);
        core::ptr::write_volatile(&raw mut (*w).blocked_ns, 0);
        (*w).in_io_call = 0;
        (*w).open_io = 0;
        let mut p = 0;
        while p < PARTS {
            core::ptr::write_volatile(&raw mut (*w).wait_ns[p], 0);
            p += 1;
        }
        (*w).start_delay = my_run_delay();
        (*w).in_query = 1;
    }
}

/// Way `i`'s thread runs no query any more (it waits for its client).
#[inline(always)]
pub fn stop(i: u32) {
    if !on() {
        return;
    }
    if let Some(w) = QUERY_WAIT.get_ptr_mut(i) {
        // SAFETY: a map value of the running thread.
        unsafe { (*w).in_query = 0 };
    }
}

/// An IO syscall of `ns` of way `i`'s thread returned: its time on CPU goes under the wait
/// event PostgreSQL set around it (its blocked time is booked already, and its run-queue wait
/// is `runnable`).
#[inline(always)]
pub fn io_call_done(i: u32, ns: u64) {
    if !on() {
        return;
    }
    let Some(w) = QUERY_WAIT.get_ptr_mut(i) else {
        return;
    };
    // SAFETY: a map value of the running thread.
    unsafe {
        let mut on_cpu = ns;
        if (*w).in_io_call != 0 {
            (*w).in_io_call = 0;
            // It ran again since it left: its last interval is over.
            let delay = my_run_delay();
            if (*w).off_ns != 0 {
                settle(w, delay);
            }
            let off = (*w)
                .blocked_ns
                .wrapping_sub((*w).call_blocked)
                .wrapping_add(delay.wrapping_sub((*w).call_delay));
            on_cpu = ns.saturating_sub(off);
        }
        if (*w).in_query == 0 || on_cpu == 0 {
            return;
        }
        let p = part_of(wait_event_info(w));
        if p != Part::NoEvent && p != Part::Unknown && (p as usize) < PARTS {
            (*w).wait_ns[p as usize] += on_cpu;
        }
    }
}

/// The query on way `i` ends now, in its thread's context: its last blocked interval is
/// settled. Returns its blocked time under an `IO` event outside its IO syscalls.
#[inline(always)]
pub fn finish(i: u32) -> u64 {
    if !on() {
        return 0;
    }
    let Some(w) = QUERY_WAIT.get_ptr_mut(i) else {
        return 0;
    };
    let delay = my_run_delay();
    // SAFETY: a map value of the running thread.
    unsafe {
        if (*w).off_ns != 0 {
            settle(w, delay);
        }
        // From here `start_delay` holds the query's run-queue time.
        (*w).start_delay = delay.wrapping_sub((*w).start_delay);
        (*w).io_wait_ns
    }
}

/// The parts of the query of `d` ns that `finish` settled on way `i`, added to `parts`
/// (a run's sums): the waits by type, the run-queue time, and the rest on CPU.
///
/// SAFETY: `parts` is this CPU's `QUERY_RUNS` value's array.
#[inline(always)]
pub unsafe fn add_parts(i: u32, d: u64, parts: *mut [u64; PARTS]) {
    if !on() {
        return;
    }
    let Some(w) = QUERY_WAIT.get_ptr(i) else {
        return;
    };
    // SAFETY: a map value of the running thread; `parts` as the caller says.
    unsafe {
        let mut left = d;
        let runnable = (*w).start_delay.min(left);
        left -= runnable;
        (*parts)[Part::Runnable as usize] += runnable;
        let mut p = Part::NoEvent as usize;
        while p < PARTS {
            let ns = (*w).wait_ns[p].min(left);
            left -= ns;
            (*parts)[p] += ns;
            p += 1;
        }
        (*parts)[Part::Cpu as usize] += left;
    }
}

/// Run `r`'s parts of its queries' time into a row's (or a query id row's) counters.
///
/// SAFETY: `r` is this CPU's `QUERY_RUNS` value; `to` a map value other CPUs add to too.
#[inline(always)]
pub unsafe fn add_run_parts(to: *mut [u64; PARTS], r: *const QueryRun) {
    let mut p = 0;
    while p < PARTS {
        // SAFETY: as the caller says.
        unsafe {
            let ns = (*r).parts_ns[p];
            if ns != 0 {
                atomic_add(&raw mut (*to)[p], ns);
            }
        }
        p += 1;
    }
}
