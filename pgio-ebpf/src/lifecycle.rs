//! Process lifecycle → ring buffer → userspace discovery. Only events userspace acts on:
//! forks of tracked processes (and the first `EARLY_FORKS_PER_PROCESS` of an untracked one
//! called `postgres`), every exec, exits of tracked processes, and a provisional process'
//! first titles (at most `TITLES_PER_PROCESS` each, so one process cannot flood the ring that
//! carries everyone's fork and exit). The fork and exit programs are in the hook
//! table (`hooks`): other families ride on them.
use aya_ebpf::{
    bindings::BPF_NOEXIST,
    helpers::{
        bpf_get_current_comm, bpf_get_current_pid_tgid, bpf_probe_read_kernel,
        bpf_probe_read_user_str_bytes, generated::bpf_get_current_task,
    },
    macros::{map, tracepoint, uretprobe},
    maps::{LruHashMap, RingBuf},
    programs::{BtfTracePointContext, RetProbeContext, TracePointContext},
};
use pgio_common::{
    SeriesId,
    drops::DropReason,
    lifecycle::{
        EARLY_FORK_ENTRIES, EARLY_FORKS_PER_PROCESS, LIFECYCLE_RING_BYTES, LifecycleEvent,
        LifecycleKind, TITLE_BUDGET_ENTRIES, TITLE_HEAD, TITLE_MAX, TITLES_PER_PROCESS, TitleEvent,
    },
};

use crate::{drops, kernel_offsets::offsets, tracked};

#[map]
static LIFECYCLE: RingBuf = RingBuf::with_byte_size(LIFECYCLE_RING_BYTES, 0);

/// `tgid → titles sent` by `init_ps_display`; a process' entry goes when it forks from a
/// tracked parent (a new incarnation of a reused pid) and when it exits.
#[map]
static TITLES_SENT: LruHashMap<u32, u32> = LruHashMap::with_max_entries(TITLE_BUDGET_ENTRIES, 0);

/// `tgid → new processes told of` while untracked (`forked`); a process' entry goes when it
/// execs a `postgres` binary (a new postmaster, on a pid a process forking in a loop had).
#[map]
static EARLY_FORKS: LruHashMap<u32, u32> = LruHashMap::with_max_entries(EARLY_FORK_ENTRIES, 0);

/// Takes one title from `tgid`'s budget; false when it has none left.
#[inline(always)]
fn title_budget_take(tgid: u32) -> bool {
    budget_take(&TITLES_SENT, tgid, TITLES_PER_PROCESS)
}

/// Takes one from `tgid`'s count in `map`, of `budget`; false when it has none left.
#[inline(always)]
fn budget_take(map: &LruHashMap<u32, u32>, tgid: u32, budget: u32) -> bool {
    match map.get_ptr_mut(tgid) {
        Some(sent) => {
            // SAFETY: a u32 in map memory. Threads of one process racing here can each take
            // one more at most: once the count is spent it only stays spent.
            unsafe {
                if *sent >= budget {
                    return false;
                }
                *sent += 1;
            }
            true
        }
        None => map.insert(tgid, 1, BPF_NOEXIST as u64).is_ok(),
    }
}

#[inline(always)]
fn emit(kind: LifecycleKind, pid: u32, ppid: u32, series: SeriesId) {
    let ev = LifecycleEvent {
        kind: kind as u32,
        pid,
        ppid,
        series,
    };
    if LIFECYCLE.output::<LifecycleEvent>(&ev, 0).is_err() {
        drops::count(DropReason::LifecycleRingFull);
    }
}

/// `sched_process_fork(struct task_struct *parent, struct task_struct *child)`, in the
/// parent's context, before the child first runs: the child gets its series now (the
/// parent's, or its own provisional one), so its first syscalls are already counted.
/// Returns (parent, child) tgids for a new process of a tracked parent.
///
/// A process called `postgres` that is not tracked yet tells of its new processes too, with
/// no series: a postmaster forks its first children milliseconds after its exec, which a busy
/// node's pgio may handle later than that. Userspace takes them in once it has (`adopt`),
/// instead of at its next rescan.
#[inline(always)]
pub fn forked(ctx: &BtfTracePointContext) -> Option<(u32, u32)> {
    let parent_tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    let series = tracked::series_of(parent_tgid);
    if series.is_none() && !current_is_postgres() {
        return None;
    }
    let child: u64 = ctx.arg(1);
    let off = offsets();
    let (pid, tgid) = unsafe {
        (
            bpf_probe_read_kernel((child + off.task_pid as u64) as *const i32),
            bpf_probe_read_kernel((child + off.task_tgid as u64) as *const i32),
        )
    };
    let (Ok(pid), Ok(tgid)) = (pid, tgid) else {
        return None;
    };
    if pid != tgid {
        return None; // a new thread: it is looked up by its tgid already
    }
    let Some(series) = series else {
        if budget_take(&EARLY_FORKS, parent_tgid, EARLY_FORKS_PER_PROCESS) {
            emit(
                LifecycleKind::Fork,
                tgid as u32,
                parent_tgid,
                SeriesId::UNTRACKED,
            );
        } else {
            drops::count(DropReason::EarlyForkOverBudget);
        }
        return None;
    };
    let series = tracked::child_series_of(series, tgid as u32);
    tracked::set(tgid as u32, series);
    // A new process: a reused pid does not inherit the last holder's spent title budget.
    let _ = TITLES_SENT.remove(tgid as u32);
    emit(LifecycleKind::Fork, tgid as u32, parent_tgid, series);
    Some((parent_tgid, tgid as u32))
}

/// Whether the running process' name is `postgres` (PostgreSQL's binary; the comm is the
/// name the process was exec'd under, which any user may choose: userspace decides).
#[inline(always)]
fn current_is_postgres() -> bool {
    bpf_get_current_comm().is_ok_and(|c| c[..9] == *b"postgres\0")
}

#[tracepoint]
pub fn sched_process_exec(_ctx: TracePointContext) -> u32 {
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    if current_is_postgres() {
        let _ = EARLY_FORKS.remove(tgid);
    }
    emit(LifecycleKind::Exec, tgid, 0, SeriesId::UNTRACKED);
    0
}

/// A process' exit (its leader's, from `sched_process_exit`): untracked, and told.
#[inline(always)]
pub fn process_exited(tgid: u32) {
    let Some(series) = tracked::series_of(tgid) else {
        return;
    };
    tracked::set(tgid, SeriesId::UNTRACKED);
    let _ = TITLES_SENT.remove(tgid);
    emit(LifecycleKind::Exit, tgid, 0, series);
}

/// Return of PostgreSQL's `init_ps_display()`: the process has just written its title over
/// its argv. For a provisional process (a postmaster's new child) the title is sent now, so
/// userspace can classify it even when it exits before userspace could read /proc (a
/// `pgbench -C` backend lives a few milliseconds). Attached per postgres binary by userspace.
/// PostgreSQL calls it once per process: past `TITLES_PER_PROCESS`, a title is counted as
/// `title_over_budget` and not sent (userspace reads the title from /proc anyway).
#[uretprobe]
pub fn init_ps_display(_ctx: RetProbeContext) -> u32 {
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    match tracked::series_of(tgid) {
        Some(series) if series.is_provisional() => {}
        _ => return 0,
    }
    if !title_budget_take(tgid) {
        drops::count(DropReason::TitleOverBudget);
        return 0;
    }
    let off = offsets();
    // SAFETY: reads of the current task's own fields through BTF offsets; failures return.
    let arg_start = unsafe {
        let task = bpf_get_current_task();
        let Ok(mm) = bpf_probe_read_kernel((task + off.task_mm as u64) as *const u64) else {
            return 0;
        };
        let Ok(arg_start) = bpf_probe_read_kernel((mm + off.mm_arg_start as u64) as *const u64)
        else {
            return 0;
        };
        arg_start
    };
    // Built on the stack and sent with only the title's bytes: a title is ~50 bytes, and a
    // connection storm of thousands of new backends must fit the ring between two drains.
    let mut ev = TitleEvent {
        kind: LifecycleKind::Titled as u32,
        pid: tgid,
        len: 0,
        _pad: 0,
        title: [0; TITLE_MAX],
    };
    // SAFETY: the string is read into `ev.title`, which bounds it.
    let len = unsafe { bpf_probe_read_user_str_bytes(arg_start as *const u8, &mut ev.title) }
        .map(|s| s.len() + 1)
        .unwrap_or(0);
    if len == 0 || len > TITLE_MAX {
        return 0;
    }
    ev.len = len as u32;
    let sent = TITLE_HEAD + len;
    if sent > size_of::<TitleEvent>() {
        return 0;
    }
    // SAFETY: the first `sent` bytes of `ev`, which is `size_of::<TitleEvent>()` long.
    let bytes = unsafe { core::slice::from_raw_parts(&ev as *const TitleEvent as *const u8, sent) };
    if LIFECYCLE.output::<[u8]>(bytes, 0).is_err() {
        drops::count(DropReason::LifecycleRingFull);
    }
    0
}
