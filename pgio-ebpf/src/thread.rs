//! The running thread, as every family's programs see it: its ids (`current`, from the
//! kernel), and its CPU's slot (`SYSCALL_CPU`), which holds the syscall family's call in
//! progress of a tracked thread (`syscall` reads and writes that part) with the ids filled in
//! by the first program that looks at it since the last switch.
use aya_ebpf::{helpers::bpf_get_current_pid_tgid, macros::map, maps::PerCpuArray};
use pgio_common::syscall::CpuSyscall;

/// This CPU's running thread and its tracked syscall in progress.
#[map]
static SYSCALL_CPU: PerCpuArray<CpuSyscall> = PerCpuArray::with_max_entries(1, 0);

/// This CPU's slot, with its running thread's ids filled in: asked of the kernel by the first
/// program that needs them since the last switch.
#[inline(always)]
pub fn slot() -> Option<*mut CpuSyscall> {
    let c = SYSCALL_CPU.get_ptr_mut(0)?;
    // SAFETY: this CPU's slot; syscall and scheduler programs on one CPU do not nest.
    unsafe {
        if (*c).tid == 0 {
            fill(c, bpf_get_current_pid_tgid());
        }
    }
    Some(c)
}

/// `slot`, for a program that has asked the kernel for the ids already (`tracked::caller`).
#[inline(always)]
pub fn slot_of(pid_tgid: u64) -> Option<*mut CpuSyscall> {
    let c = SYSCALL_CPU.get_ptr_mut(0)?;
    // SAFETY: as in `slot`.
    unsafe {
        if (*c).tid == 0 {
            fill(c, pid_tgid);
        }
    }
    Some(c)
}

/// SAFETY: `c` is this CPU's slot.
#[inline(always)]
unsafe fn fill(c: *mut CpuSyscall, pid_tgid: u64) {
    // SAFETY: as the caller promises.
    unsafe {
        (*c).tid = pid_tgid as u32;
        (*c).tgid = (pid_tgid >> 32) as u32;
    }
}

/// This CPU's slot as it is, ids not asked for (`sched_switch`: the thread leaving).
#[inline(always)]
pub fn slot_as_is() -> Option<*mut CpuSyscall> {
    SYSCALL_CPU.get_ptr_mut(0)
}

/// The running thread's (tid, tgid), from the kernel: the helper costs an empty program
/// +0.5 ns, a lookup of the CPU's slot +5 to +9 (BENCHMARKS.md, the pieces), so a program
/// that does not need the slot does not look it up (the untracked path of every process on
/// the node).
#[inline(always)]
pub fn current() -> (u32, u32) {
    let pid_tgid = bpf_get_current_pid_tgid();
    (pid_tgid as u32, (pid_tgid >> 32) as u32)
}
