//! Where PostgreSQL's processes wait (`pgio_common::role_wait` has the rules): for the
//! processes other than client backends, the `sched_switch` program opens an interval when
//! such a thread blocks, under the wait event PostgreSQL set for it, marks when it runs
//! again, and books the interval when it next leaves the CPU, its run-queue wait then known.
//! A client backend's intervals inside its queries come from `query_wait` (`book_interval`).
use aya_ebpf::{
    helpers::{bpf_ktime_get_ns, bpf_probe_read_user},
    macros::map,
    maps::HashMap,
};
use pgio_common::{
    SeriesId,
    hist::slot,
    query_wait::{Part, part_of},
    role_wait::{QUOTA, RoleThread, RoleWaitKey},
    wait_event::UNREADABLE,
};

use crate::{
    hist,
    kernel_offsets::{task_sched, task_u32, task_u64},
    tracked, wait_event,
};

/// Off-CPU intervals per (series, part), one log2 slot a key (client backends' inside
/// their queries too).
#[map]
static ROLE_WAIT_HIST: HashMap<RoleWaitKey, pgio_common::hist::Bucket> =
    HashMap::with_max_entries(8_192, 0);

/// The open interval of each such thread, by thread id; it leaves at the thread's exit.
/// Preallocated (the default): `sched_switch` runs under the run-queue lock.
#[map]
static ROLE_WAIT_THREADS: HashMap<u32, RoleThread> = HashMap::with_max_entries(16_384, 0);

/// Zero for a new thread's entry.
static NEW_THREAD: RoleThread = RoleThread {
    off_ns: 0,
    off_delay: 0,
    on_ns: 0,
    event_at: 0,
    series: SeriesId::UNTRACKED,
    info: 0,
    major: 0,
    _pad: [0; 7],
};

/// The series of thread `tid` if it is a classified PostgreSQL process other than a client
/// backend (PostgreSQL's processes have one thread: tid = tgid). A provisional series has no
/// bit.
#[inline(always)]
fn waiter(tid: u32) -> Option<SeriesId> {
    let s = tracked::series_of(tid)?;
    tracked::books_waits(s).then_some(s)
}

#[inline(always)]
fn book_part(series: SeriesId, part: Part, ns: u64) {
    let key = RoleWaitKey {
        series,
        part: part as u8,
        slot: slot(ns),
        _pad: 0,
    };
    hist::add(&ROLE_WAIT_HIST, QUOTA, series, &key, ns, 0);
}

/// One off-CPU interval of a thread of `series` (a process of PostgreSQL `major`): `blocked`
/// under the type of the wait event `info` it blocked under (and under the event itself,
/// `wait_event`), then `queued` on a run queue after its wake-up under `Runnable`.
#[inline(always)]
pub fn book_interval(series: SeriesId, info: u32, major: u8, blocked: u64, queued: u64) {
    if series == SeriesId::UNTRACKED {
        return;
    }
    book_part(series, part_of(info), blocked);
    wait_event::book(series, info, major, blocked);
    if queued != 0 {
        book_part(series, Part::Runnable, queued);
    }
}

/// `sched_switch`, in the context of `prev`; `on`: `query_wait::on()` (the same kernel
/// fields and switch). `event_at` finds where the running (leaving) process keeps its wait
/// event and its PostgreSQL major version, asked once per thread (`query_id` knows).
#[inline(always)]
pub fn switched(
    on: bool,
    preempt: bool,
    prev: u64,
    prev_pid: u32,
    next_pid: u32,
    event_at: impl FnOnce() -> (u64, u8),
) {
    if !on {
        return;
    }
    if prev_pid != 0
        && let Some(series) = waiter(prev_pid)
    {
        left_cpu(prev, prev_pid, series, preempt, event_at);
    }
    if next_pid != 0
        && waiter(next_pid).is_some()
        && let Some(t) = ROLE_WAIT_THREADS.get_ptr_mut(&next_pid)
    {
        // SAFETY: a map value; its thread is not running anywhere while it is switched in.
        unsafe {
            if (*t).off_ns != 0 && (*t).on_ns == 0 {
                (*t).on_ns = bpf_ktime_get_ns();
            }
        }
    }
}

#[inline(always)]
fn left_cpu(
    task: u64,
    tid: u32,
    series: SeriesId,
    preempt: bool,
    event_at: impl FnOnce() -> (u64, u8),
) {
    let (run_delay_at, state_at) = task_sched();
    let blocked = !preempt && task_u32(task, state_at) != 0;
    let t = match ROLE_WAIT_THREADS.get_ptr_mut(&tid) {
        Some(t) => t,
        None if !blocked => return,
        None => {
            if ROLE_WAIT_THREADS.insert(&tid, &NEW_THREAD, 0).is_err() {
                return;
            }
            match ROLE_WAIT_THREADS.get_ptr_mut(&tid) {
                Some(t) => t,
                None => return,
            }
        }
    };
    // SAFETY: a map value of the thread leaving, in its context.
    unsafe {
        let delay = task_u64(task, run_delay_at);
        let (off, on) = ((*t).off_ns, (*t).on_ns);
        if off != 0 {
            (*t).off_ns = 0;
            // An interval whose end was not seen (pgio attached meanwhile) is dropped.
            if on >= off {
                let queued = delay.wrapping_sub((*t).off_delay).min(on - off);
                book_interval(
                    (*t).series,
                    (*t).info,
                    (*t).major,
                    on - off - queued,
                    queued,
                );
            }
        }
        if !blocked {
            return;
        }
        (*t).off_ns = bpf_ktime_get_ns();
        (*t).off_delay = delay;
        (*t).on_ns = 0;
        (*t).series = series;
        if (*t).event_at == 0 {
            ((*t).event_at, (*t).major) = event_at();
        }
        let at = (*t).event_at;
        (*t).info = if at == 0 {
            UNREADABLE
        } else {
            bpf_probe_read_user(at as *const u32).unwrap_or(UNREADABLE)
        };
    }
}

/// A thread's exit: its interval goes.
#[inline(always)]
pub fn thread_exit(tid: u32) {
    let _ = ROLE_WAIT_THREADS.remove(&tid);
}
