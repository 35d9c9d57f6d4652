//! Benchmark fixtures, loaded only by `pgio-daemon floor`, never by `run`:
//! - empty programs on each hook type pgio can time pread64 with: their cost is the floor any
//!   tracer pays (`cargo xtask bench` compares pgio against it); and on pgio's own tracepoints
//!   and `sched_switch`, the mechanism's share of pgio's cost under a database load;
//! - `part_*`: one piece of the syscall timing each, on the pread64 tracepoint, so the kernel's
//!   per-program run time (bpf_stats) says what each piece costs.
use aya_ebpf::{
    bindings::BPF_NOEXIST,
    helpers::{bpf_get_current_pid_tgid, bpf_ktime_get_ns},
    macros::{btf_tracepoint, fentry, fexit, map, tracepoint},
    maps::{Array, HashMap, PerCpuArray, PerCpuHashMap},
    programs::{BtfTracePointContext, FEntryContext, FExitContext, TracePointContext},
};
use pgio_common::hist::Bucket;

use crate::{atomic::atomic_add, tracked};

#[tracepoint]
pub fn floor_sys_enter_pread64(_ctx: TracePointContext) -> u32 {
    0
}

#[tracepoint]
pub fn floor_sys_exit_pread64(_ctx: TracePointContext) -> u32 {
    0
}

/// The function name is given at load (it is arch-specific: `__x64_sys_pread64`, …).
#[fentry(function = "sys_pread64")]
pub fn floor_fentry_pread64(_ctx: FEntryContext) -> u32 {
    0
}

#[fexit(function = "sys_pread64")]
pub fn floor_fexit_pread64(_ctx: FExitContext) -> u32 {
    0
}

/// The raw syscall tracepoints behind every `syscalls/*` event: they fire for every syscall
/// of every process, so a program there must filter on the syscall number.
#[btf_tracepoint(function = "sys_enter")]
pub fn floor_tp_btf_sys_enter(_ctx: BtfTracePointContext) -> i32 {
    0
}

#[btf_tracepoint(function = "sys_exit")]
pub fn floor_tp_btf_sys_exit(_ctx: BtfTracePointContext) -> i32 {
    0
}

/// Attached to each `syscalls`/`sched` tracepoint pgio's table has (`floor --hooks pgio`).
#[tracepoint]
pub fn floor_tracepoint(_ctx: TracePointContext) -> u32 {
    0
}

/// And to `sched_switch`, pgio's hottest BTF hook under a database load.
#[btf_tracepoint(function = "sched_switch")]
pub fn floor_sched_switch(_ctx: BtfTracePointContext) -> i32 {
    0
}

#[map]
static PART_TID_HASH: HashMap<u32, u64> = HashMap::with_max_entries(16_384, 0);

#[map]
static PART_HASH: PerCpuHashMap<u64, Bucket> = PerCpuHashMap::with_max_entries(1_024, 0);

/// The histogram maps' kind: one value for all CPUs.
#[map]
static PART_SHARED_HASH: HashMap<u64, Bucket> = HashMap::with_max_entries(1_024, 0);

#[map]
static PART_ARRAY: PerCpuArray<Bucket> = PerCpuArray::with_max_entries(1_024, 0);

#[map]
static PART_TID: Array<u64> = Array::with_max_entries(1 << 16, 0);

#[tracepoint]
pub fn part_pid_tgid(_ctx: TracePointContext) -> u32 {
    bpf_get_current_pid_tgid() as u32
}

/// A per-thread value in an array indexed by thread id instead of task storage.
#[tracepoint]
pub fn part_tid_array(_ctx: TracePointContext) -> u32 {
    let tid = bpf_get_current_pid_tgid() as u32;
    if let Some(p) = PART_TID.get_ptr_mut(tid & 0xffff) {
        // SAFETY: a map value; a benchmark, races are harmless.
        unsafe { *p += 1 };
    }
    0
}

/// `bpf_get_current_pid_tgid` and the `TRACKED` lookup: what an untracked process pays.
#[tracepoint]
pub fn part_tracked(_ctx: TracePointContext) -> u32 {
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    tracked::series_of(tgid).map_or(0, |s| s.0)
}

/// `part_tracked` in a program whose stack frame is 64 bytes or more, as pgio's are: the
/// kernel (6.13 on) gives such a program a private per-CPU stack.
#[tracepoint]
pub fn part_tracked_big_frame(_ctx: TracePointContext) -> u32 {
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    let Some(s) = tracked::series_of(tgid) else {
        return 0;
    };
    let mut frame = [0u64; 16];
    for (i, v) in frame.iter_mut().enumerate() {
        // SAFETY: a local; volatile so that the frame is kept.
        unsafe { core::ptr::write_volatile(v, i as u64 ^ s.0 as u64) };
    }
    // SAFETY: a local.
    unsafe { core::ptr::read_volatile(&frame[(s.0 & 15) as usize]) as u32 }
}

/// A read of 8 bytes of the caller's memory (the pread64 buffer): what `query` pays per
/// reply for ReadyForQuery, and again for the query id.
#[tracepoint]
pub fn part_read_user(ctx: TracePointContext) -> u32 {
    let buf = crate::sys_record::field(&ctx, crate::sys_record::ARG1);
    // SAFETY: a read of user memory, which may fail.
    unsafe { aya_ebpf::helpers::bpf_probe_read_user(buf as *const u64) }.map_or(0, |v| v as u32)
}

/// The caller's saved registers (`bpf_task_pt_regs`), as `query` reads a socket call's
/// arguments at its exit.
#[cfg(bpf_target_arch = "x86_64")]
#[tracepoint]
pub fn part_pt_regs(_ctx: TracePointContext) -> u32 {
    use aya_ebpf::{bindings::pt_regs, helpers::generated};
    // SAFETY: the current task and its saved registers (a BTF pointer the verifier checks).
    unsafe {
        let regs =
            generated::bpf_task_pt_regs(generated::bpf_get_current_task_btf()) as *const pt_regs;
        if regs.is_null() {
            return 0;
        }
        ((*regs).rdi ^ (*regs).rsi ^ (*regs).rdx) as u32
    }
}

/// Elsewhere `query` takes the arguments at the entry: nothing to measure.
#[cfg(not(bpf_target_arch = "x86_64"))]
#[tracepoint]
pub fn part_pt_regs(_ctx: TracePointContext) -> u32 {
    0
}

#[tracepoint]
pub fn part_ktime(_ctx: TracePointContext) -> u32 {
    // SAFETY: no arguments.
    unsafe { bpf_ktime_get_ns() as u32 }
}

/// The thread's own value in a preallocated hash by thread id, created on first use,
/// written: what `add_io` does with `QUERY` (and a spilled syscall start with its hash).
#[tracepoint]
pub fn part_tid_hash(_ctx: TracePointContext) -> u32 {
    let tid = bpf_get_current_pid_tgid() as u32;
    match PART_TID_HASH.get_ptr_mut(&tid) {
        // SAFETY: a map value; a benchmark, races are harmless.
        Some(p) => unsafe { *p += 1 },
        None => {
            let _ = PART_TID_HASH.insert(&tid, &1, BPF_NOEXIST as u64);
        }
    }
    0
}

/// One existing key of a per-CPU hash, three adds: what `hist::add` does for a known key.
#[tracepoint]
pub fn part_hash(_ctx: TracePointContext) -> u32 {
    let key = 7u64;
    match PART_HASH.get_ptr_mut(&key) {
        // SAFETY: this CPU's value.
        Some(b) => unsafe {
            (*b).count += 1;
            (*b).sum += 1_000;
        },
        None => {
            let _ = PART_HASH.insert(&key, &Bucket::default(), BPF_NOEXIST as u64);
        }
    }
    0
}

/// One existing key of a shared hash, two atomic adds: what `hist::add` does for a known
/// key (the bytes add is skipped when there are none).
#[tracepoint]
pub fn part_shared_hash(_ctx: TracePointContext) -> u32 {
    let key = 7u64;
    match PART_SHARED_HASH.get_ptr_mut(&key) {
        // SAFETY: a map value, valid while the program runs.
        Some(b) => unsafe {
            atomic_add(&raw mut (*b).count, 1);
            atomic_add(&raw mut (*b).sum, 1_000);
        },
        None => {
            let _ = PART_SHARED_HASH.insert(&key, &Bucket::default(), BPF_NOEXIST as u64);
        }
    }
    0
}

/// The same in a per-CPU array: no hashing, inlined by the verifier on kernels ≥ 6.10.
#[tracepoint]
pub fn part_array(_ctx: TracePointContext) -> u32 {
    if let Some(b) = PART_ARRAY.get_ptr_mut(7) {
        // SAFETY: this CPU's value.
        unsafe {
            (*b).count += 1;
            (*b).sum += 1_000;
        }
    }
    0
}
