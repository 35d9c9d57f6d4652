//! Syscall latency, enter → exit of the same thread, for tracked processes only.
use aya_ebpf::{
    EbpfContext,
    helpers::{bpf_get_current_pid_tgid, bpf_ktime_get_ns},
    macros::{btf_map, map, tracepoint},
    maps::PerCpuHashMap,
    programs::TracePointContext,
};
use pgio_common::{
    drops::DropReason,
    hist::{Bucket, slot},
    key_quota::HistMap,
    syscall::{Cache, Syscall, SyscallKey, SyscallStart, futex_op_waits},
};

use crate::{drops, hist, query, task_storage::TaskStorage, tracked};

/// Per-thread syscall start, in the thread's own task storage.
#[btf_map]
static SYSCALL_START: TaskStorage<SyscallStart> = TaskStorage::new();

#[map]
static SYSCALL_HIST: PerCpuHashMap<SyscallKey, Bucket> = PerCpuHashMap::with_max_entries(65_536, 0);

/// `futex(uaddr, op, ...)`: `op` is the second argument, at offset 16 + 8 in every kernel's
/// `sys_enter_futex` record.
const FUTEX_OP_OFFSET: usize = 24;

/// Values live as long as their thread and are rewritten in place. `start_ns == 0`: the
/// thread is outside any timed syscall.
#[inline(always)]
fn enter(sc: Syscall) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    let Some(series) = tracked::series_of((pid_tgid >> 32) as u32) else {
        return 0;
    };
    let start = SyscallStart {
        start_ns: unsafe { bpf_ktime_get_ns() },
        series,
        syscall: sc as u8,
        block_io: 0,
        _pad: 0,
    };
    match SYSCALL_START.current_or_zeroed() {
        // SAFETY: this thread's own storage; nothing else writes it while the thread runs
        // here but `block_io_start` of this same thread, which runs after this returns.
        Some(s) => unsafe { *s = start },
        None => drops::count(DropReason::SyscallStartUnavailable),
    }
    0
}

#[inline(always)]
fn exit(sc: Syscall) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    // Untracked processes return here, before any hash lookup.
    if tracked::series_of((pid_tgid >> 32) as u32).is_none() {
        return 0;
    }
    let Some(p) = SYSCALL_START.current() else {
        return 0;
    };
    // SAFETY: this thread's own entry (see `enter`).
    let s = unsafe { *p };
    if s.start_ns == 0 {
        return 0;
    }
    unsafe { (*p).start_ns = 0 };
    if s.syscall != sc as u8 {
        return 0; // enter of another syscall whose exit we missed (attached mid-call)
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
    hist::add(&SYSCALL_HIST, HistMap::Syscall, s.series, &key, d, 0);
    if !sc.is_wait() {
        query::add_io(d, cache == Cache::Miss);
    }
    0
}

macro_rules! syscall_probes {
    ($($sc:expr => $enter:ident, $exit:ident;)*) => {$(
        #[tracepoint]
        pub fn $enter(_ctx: TracePointContext) -> u32 {
            enter($sc)
        }
        #[tracepoint]
        pub fn $exit(_ctx: TracePointContext) -> u32 {
            exit($sc)
        }
    )*};
}

syscall_probes! {
    Syscall::Pread64 => sys_enter_pread64, sys_exit_pread64;
    Syscall::Preadv => sys_enter_preadv, sys_exit_preadv;
    Syscall::Preadv2 => sys_enter_preadv2, sys_exit_preadv2;
    Syscall::Pwrite64 => sys_enter_pwrite64, sys_exit_pwrite64;
    Syscall::Pwritev => sys_enter_pwritev, sys_exit_pwritev;
    Syscall::Pwritev2 => sys_enter_pwritev2, sys_exit_pwritev2;
    Syscall::Fsync => sys_enter_fsync, sys_exit_fsync;
    Syscall::Fdatasync => sys_enter_fdatasync, sys_exit_fdatasync;
    Syscall::IoUringEnter => sys_enter_io_uring_enter, sys_exit_io_uring_enter;
    Syscall::FutexWaitv => sys_enter_futex_waitv, sys_exit_futex_waitv;
}

/// futex: only the waiting operations are timed; wakes return before any map lookup.
#[tracepoint]
pub fn sys_enter_futex(ctx: TracePointContext) -> u32 {
    // SAFETY: inside the fixed-size syscall record.
    let op = unsafe { *(ctx.as_ptr().add(FUTEX_OP_OFFSET) as *const u64) } as u32;
    if !futex_op_waits(op) {
        return 0;
    }
    enter(Syscall::Futex)
}

#[tracepoint]
pub fn sys_exit_futex(_ctx: TracePointContext) -> u32 {
    exit(Syscall::Futex)
}

/// Called by `block_io_start` in the submitter's context: a read syscall of this thread that
/// submits block IO is a page-cache miss.
#[inline(always)]
pub fn mark_block_io() {
    if let Some(s) = SYSCALL_START.current() {
        // SAFETY: the entry belongs to this thread, which is running here.
        unsafe { (*s).block_io = 1 };
    }
}
