//! Syscall latency, enter → exit of the same thread, for tracked processes only.
//!
//! The start of a call waits in its CPU's slot (`thread`): a cached read neither blocks nor
//! is preempted, so its exit finds it there with an array lookup. When the scheduler switches
//! a thread out mid-call (`switched_out`), its start moves into `SYSCALL_SPILLED`, keyed by
//! thread id, where the exit looks on any CPU. The IO syscalls' exit programs are in the hook
//! table (`hooks`): other families ride on them.
use aya_ebpf::{
    EbpfContext as _,
    helpers::bpf_ktime_get_ns,
    macros::{map, tracepoint},
    maps::{HashMap, PerCpuArray},
    programs::TracePointContext,
};
use pgio_common::{
    CHILD_SERIES_MAX, SeriesId,
    drops::DropReason,
    hist::{Bucket, SLOTS, slot},
    relation::FD_UNKNOWN,
    syscall::{
        Cache, CpuSyscall, QUOTA, RowTag, SYSCALL_ROWS, Syscall, SyscallKey, SyscallRow,
        SyscallStart, futex_op_waits,
    },
};

use crate::{
    drops, hist, io_worker,
    sys_record::{ARG0, ARG1, RET, field},
    thread,
    tracked::{self, generation},
};

/// Starts of calls whose thread was switched out before their exit, by thread id.
/// Preallocated (the default for hash maps): `sched_switch` runs under the runqueue lock,
/// where nothing may allocate. Entries leave at the call's exit, or at the thread's exit.
#[map]
static SYSCALL_SPILLED: HashMap<u32, SyscallStart> = HashMap::with_max_entries(SPILLED_MAX, 0);

/// Tracked threads switched out in a timed syscall at once (idle threads' futex waits
/// count); past it a call is not timed and counts as `syscall_start_unavailable`. ~1.4 MiB.
const SPILLED_MAX: u32 = 16_384;

#[map]
static SYSCALL_HIST: HashMap<SyscallKey, Bucket> = HashMap::with_max_entries(65_536, 0);

/// Dense rows for the hottest histograms (see `pgio_common::syscall::SYSCALL_ROWS`): an
/// array lookup instead of hashing the key.
#[map]
static SYSCALL_ROWS_MAP: PerCpuArray<SyscallRow> = PerCpuArray::with_max_entries(SYSCALL_ROWS, 0);

/// Rows of `SYSCALL_ROWS_MAP` in use (a power of two; 0: `syscall_rows = false`), written by
/// userspace at load (the verifier sees the constant and prunes what is off).
#[unsafe(no_mangle)]
static SYSCALL_ROWS_N: u32 = SYSCALL_ROWS;

/// A tracked call's start in this CPU's slot (`tracked::caller`: the rest of the node's
/// processes pay one helper and one array read). A futex call that does not wait is not
/// timed: it only opens the slot, so that its exit knows there is nothing to look up.
/// `with_fd`: the call's first argument is a file descriptor (the relation family's). Inlined
/// into a function of each program's own: `sc` and `with_fd` are constants there.
#[inline(always)]
fn enter_tracked(
    ctx: *mut core::ffi::c_void,
    pid_tgid: u64,
    series: u32,
    sc: Syscall,
    with_fd: bool,
) -> u32 {
    let ctx = TracePointContext::new(ctx);
    let mut series = SeriesId(series);
    // `futex(uaddr, op, ...)`: `op` is the second argument.
    let timed = sc != Syscall::Futex || futex_op_waits(field(&ctx, ARG1) as u32);
    let Some(c) = thread::slot_of(pid_tgid) else {
        return 0;
    };
    // SAFETY: this CPU's slot (see `thread::slot`). Anything pending in it is this thread's own call
    // whose exit was missed (pgio attached mid-call): another thread's would have been
    // moved out at the switch.
    unsafe {
        // An io worker's IO is booked under the backend it does it for.
        if !sc.is_wait() && tracked::serves_backends(series) {
            series = io_worker::acting_series((*c).tgid).unwrap_or(series);
        }
        (*c).open = 1;
        (*c).start = SyscallStart {
            start_ns: if timed { bpf_ktime_get_ns() } else { 0 },
            series,
            syscall: sc as u8,
            block_io: 0,
            fd: if with_fd { fd_arg(&ctx) } else { FD_UNKNOWN },
        };
    }
    0
}

/// Takes this thread's pending start: from this CPU's slot if it has not been switched out
/// since its enter, or else from the spilled ones. `None`: nothing to time.
#[inline(always)]
fn take_start(c: *mut CpuSyscall) -> Option<SyscallStart> {
    // SAFETY: this CPU's slot (see `thread::slot`).
    unsafe {
        if (*c).open != 0 {
            (*c).open = 0;
            return ((*c).start.start_ns != 0).then_some((*c).start);
        }
        let tid = (*c).tid;
        // SAFETY: a map value; only this thread's programs touch its key.
        let s = *SYSCALL_SPILLED.get(&tid)?;
        let _ = SYSCALL_SPILLED.remove(&tid);
        Some(s)
    }
}

/// A timed IO syscall (not a wait) of a tracked thread that returned: what the families that
/// ride on its exit (`hooks`) are given.
pub struct IoExit {
    pub syscall: Syscall,
    pub tid: u32,
    pub tgid: u32,
    pub start: SyscallStart,
    pub cache: Cache,
    /// Exit minus enter.
    pub ns: u64,
}

impl IoExit {
    /// Bytes moved (0 for a sync; an error counts its time only), read only when counted.
    #[inline(always)]
    pub fn bytes(&self, ctx: &TracePointContext) -> u64 {
        let ret = field(ctx, RET) as i64;
        if ret > 0 && self.syscall.moves_bytes() {
            ret as u64
        } else {
            0
        }
    }
}

/// Books the latency of a tracked thread's call (`pid_tgid`, from `tracked::caller`: an
/// untracked one started nothing, so there is no slot to look at; a process untracked
/// mid-call leaves its start in the slot: the next enter overwrites it, the next switch drops
/// it); `Some` for an IO call, whose exit other families ride on.
#[inline(always)]
pub fn exit(pid_tgid: u64, sc: Syscall) -> Option<IoExit> {
    let c = thread::slot_of(pid_tgid)?;
    let s = take_start(c)?;
    if s.syscall != sc as u8 {
        return None; // enter of another syscall whose exit we missed (attached mid-call)
    }
    let d = unsafe { bpf_ktime_get_ns() }.wrapping_sub(s.start_ns);
    let cache = if !sc.is_read() {
        Cache::None
    } else if s.block_io != 0 {
        Cache::Miss
    } else {
        Cache::Hit
    };
    let key = SyscallKey {
        series: s.series,
        syscall: sc as u8,
        cache: cache as u8,
        slot: slot(d),
        _pad: 0,
    };
    if !add_to_row(&key, d) {
        hist::add(&SYSCALL_HIST, QUOTA, s.series, &key, d, 0);
    }
    if sc.is_wait() {
        return None;
    }
    // SAFETY: this CPU's slot (see `thread::slot`).
    let (tid, tgid) = unsafe { ((*c).tid, (*c).tgid) };
    Some(IoExit {
        syscall: sc,
        tid,
        tgid,
        start: s,
        cache,
        ns: d,
    })
}

/// The call's fd as the relation family keeps it.
#[inline(always)]
fn fd_arg(ctx: &TracePointContext) -> u16 {
    let fd = field(ctx, ARG0);
    if fd < FD_UNKNOWN as u64 {
        fd as u16
    } else {
        FD_UNKNOWN
    }
}

/// Counts `d` in the key's row if the row is free, its own, or stale; `false`: another
/// triple holds it on this CPU (or the series is provisional, which userspace folds from
/// the hash map only).
#[inline(always)]
fn add_to_row(key: &SyscallKey, d: u64) -> bool {
    // SAFETY: a global the loader rewrites; volatile so the compiler keeps the load.
    let rows = unsafe { core::ptr::read_volatile(&SYSCALL_ROWS_N) };
    if rows == 0 || key.series.0 >= CHILD_SERIES_MAX {
        return false; // off, or a provisional series (userspace folds those from the hash)
    }
    let t = RowTag {
        series: key.series,
        generation: generation(key.series),
        syscall: key.syscall,
        cache: key.cache,
    };
    let tag = t.encode();
    let Some(r) = SYSCALL_ROWS_MAP.get_ptr_mut(t.row(rows)) else {
        return false;
    };
    // SAFETY: this CPU's copy of the row; only this CPU's programs write it, and they do not
    // nest (tracepoint programs do not preempt each other).
    unsafe {
        let held = (*r).tag;
        if held != tag {
            if let Some(h) = RowTag::decode(held)
                && generation(h.series) == h.generation
            {
                return false;
            }
            // Free or stale: zero it, then tag it (the tag last: see `SyscallRow`).
            for i in 0..SLOTS {
                core::ptr::write_volatile(&mut (*r).slots[i], 0);
            }
            (*r).sum = 0;
            core::ptr::write_volatile(&mut (*r).tag, tag);
        }
        (*r).slots[(key.slot as usize) & (SLOTS - 1)] += 1;
        (*r).sum += d;
    }
    true
}

macro_rules! syscall_enters {
    ($($sc:expr, $with_fd:expr => $enter:ident;)*) => {$(
        #[tracepoint]
        pub fn $enter(ctx: TracePointContext) -> u32 {
            #[inline(never)]
            fn tracked_enter(ctx: *mut core::ffi::c_void, pid_tgid: u64, series: u32) -> u32 {
                enter_tracked(ctx, pid_tgid, series, $sc, $with_fd)
            }
            match tracked::caller() {
                Some(c) => tracked_enter(ctx.as_ptr(), c.pid_tgid, c.series.0),
                None => 0,
            }
        }
    )*};
}

// Their exits: `hooks::io_syscall_exits`. futex: only the waiting operations are timed; a
// wake of a tracked process costs what an untracked call does, plus marking the slot so
// that its exit looks nothing up.
syscall_enters! {
    Syscall::Pread64, true => sys_enter_pread64;
    Syscall::Preadv, true => sys_enter_preadv;
    Syscall::Preadv2, true => sys_enter_preadv2;
    Syscall::Pwrite64, true => sys_enter_pwrite64;
    Syscall::Pwritev, true => sys_enter_pwritev;
    Syscall::Pwritev2, true => sys_enter_pwritev2;
    Syscall::Fsync, true => sys_enter_fsync;
    Syscall::Fdatasync, true => sys_enter_fdatasync;
    Syscall::IoUringEnter, false => sys_enter_io_uring_enter;
    Syscall::FutexWaitv, false => sys_enter_futex_waitv;
    Syscall::Futex, false => sys_enter_futex;
}

/// A wait's exit: nobody rides on it.
#[tracepoint]
pub fn sys_exit_futex_waitv(_ctx: TracePointContext) -> u32 {
    #[inline(never)]
    fn tracked_exit(pid_tgid: u64) -> u32 {
        let _ = exit(pid_tgid, Syscall::FutexWaitv);
        0
    }
    tracked::caller().map_or(0, |c| tracked_exit(c.pid_tgid))
}

#[tracepoint]
pub fn sys_exit_futex(_ctx: TracePointContext) -> u32 {
    #[inline(never)]
    fn tracked_exit(pid_tgid: u64) -> u32 {
        let _ = exit(pid_tgid, Syscall::Futex);
        0
    }
    tracked::caller().map_or(0, |c| tracked_exit(c.pid_tgid))
}

/// Called by `sched_switch` in the context of the thread being switched out (`current` is
/// still `prev`): a start pending on this CPU is that thread's, and moves into
/// `SYSCALL_SPILLED`; then the slot forgets who runs.
#[inline(always)]
pub fn switched_out() {
    let Some(c) = thread::slot_as_is() else {
        return;
    };
    // SAFETY: this CPU's slot; the syscall programs cannot run while the scheduler does.
    unsafe {
        if (*c).open != 0 {
            (*c).open = 0;
            // Only a tracked process' start is kept: one untracked mid-call is dropped here,
            // never found by a later exit of a call of the same kind.
            if (*c).start.start_ns != 0
                && tracked::series_of((*c).tgid).is_some()
                && SYSCALL_SPILLED.insert(&(*c).tid, &(*c).start, 0).is_err()
            {
                drops::count(DropReason::SyscallStartUnavailable);
            }
        }
        // The next syscall program on this CPU asks the kernel who runs, once: cheaper than
        // reading `next`'s ids here, at every switch of every process on the node.
        (*c).tid = 0;
        (*c).tgid = 0;
    }
}

/// Called by `sched_process_exit` for every exiting thread: a call it never returned from
/// must not hold a spilled entry forever.
#[inline(always)]
pub fn thread_exit(tid: u32) {
    let _ = SYSCALL_SPILLED.remove(&tid);
}

/// The series the current thread's call in progress is booked under, for a thread of `own`
/// (its process' series) submitting block IO: an io worker's call may be booked under the
/// backend it serves (`io_worker`); anyone else's under `own`.
#[inline(always)]
pub fn acting_series(own: SeriesId) -> SeriesId {
    if !tracked::serves_backends(own) {
        return own;
    }
    let Some(c) = thread::slot() else {
        return own;
    };
    // SAFETY: this CPU's slot (see `thread::slot`); this thread is running here.
    unsafe {
        if (*c).open != 0 {
            return (*c).start.series;
        }
        match SYSCALL_SPILLED.get(&(*c).tid) {
            Some(s) => s.series,
            None => own,
        }
    }
}

/// Called by `block_io_start` in the submitter's context: a read syscall of this thread that
/// submits block IO is a page-cache miss.
#[inline(always)]
pub fn mark_block_io() {
    let Some(c) = thread::slot() else {
        return;
    };
    // SAFETY: this CPU's slot (see `thread::slot`); this thread is running here.
    unsafe {
        if (*c).open != 0 {
            (*c).start.block_io = 1;
        } else if let Some(s) = SYSCALL_SPILLED.get_ptr_mut(&(*c).tid) {
            // SAFETY: this thread's own entry.
            (*s).block_io = 1;
        }
    }
}
