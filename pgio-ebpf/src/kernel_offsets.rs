//! Struct field offsets from the running kernel's BTF, written into a global by userspace at
//! load (Rust eBPF has no CO-RE field relocations yet). Used by `block_io` (request, bio,
//! queue, disk) and `lifecycle` (task, mm).
use pgio_common::kernel_offsets::KernelOffsets;

/// Set by userspace at load (`EbpfLoader::override_global`).
#[unsafe(no_mangle)]
static KERNEL_OFFSETS: KernelOffsets = KernelOffsets {
    request_cmd_flags: 0,
    request_data_len: 0,
    request_q: 0,
    queue_disk: 0,
    gendisk_major: 0,
    gendisk_first_minor: 0,
    task_pid: 0,
    task_tgid: 0,
    task_mm: 0,
    mm_arg_start: 0,
    request_disk: 0,
    block_rq_arg: 0,
    bio_bdev: 0,
    bio_disk: 0,
    bdev_disk: 0,
    gendisk_queue: 0,
    queue_mq_ops: 0,
    bio_opf: 0,
    bio_size: 0,
    block_bio_arg: 0,
    syscall_args_from_regs: 0,
    task_state: 0,
    task_run_delay: 0,
};

#[inline(always)]
pub fn offsets() -> KernelOffsets {
    // SAFETY: a global the loader rewrites; volatile so the compiler keeps the load.
    unsafe { core::ptr::read_volatile(&KERNEL_OFFSETS) }
}

/// `task_struct.pid`, read alone (`sched_switch`, at every switch).
#[inline(always)]
pub fn task_pid() -> u32 {
    // SAFETY: a global the loader rewrites; volatile so the compiler keeps the load.
    unsafe { core::ptr::read_volatile(&raw const KERNEL_OFFSETS.task_pid) }
}

/// `task_struct.sched_info.run_delay` and `task_struct.__state` (0: not known), read alone:
/// `sched_switch` asks at every switch, and a copy of the whole struct is 23 loads.
#[inline(always)]
pub fn task_sched() -> (u32, u32) {
    // SAFETY: a global the loader rewrites; volatile so the compiler keeps the loads.
    unsafe {
        (
            core::ptr::read_volatile(&raw const KERNEL_OFFSETS.task_run_delay),
            core::ptr::read_volatile(&raw const KERNEL_OFFSETS.task_state),
        )
    }
}

/// A u64 field of a task, by its offset; 0 if unreadable.
#[inline(always)]
pub fn task_u64(task: u64, off: u32) -> u64 {
    // SAFETY: a read of kernel memory, which may fail.
    unsafe { aya_ebpf::helpers::bpf_probe_read_kernel((task + off as u64) as *const u64) }
        .unwrap_or(0)
}

/// A u32 field of a task, by its offset; 0 if unreadable.
#[inline(always)]
pub fn task_u32(task: u64, off: u32) -> u32 {
    // SAFETY: as above.
    unsafe { aya_ebpf::helpers::bpf_probe_read_kernel((task + off as u64) as *const u32) }
        .unwrap_or(0)
}

/// Whether the syscall exits read the call's arguments from the saved user registers (the
/// loader attached no `sys_enter_*` program for them).
#[inline(always)]
pub fn syscall_args_from_regs() -> bool {
    // SAFETY: a global the loader rewrites; volatile so the compiler keeps the load.
    unsafe { core::ptr::read_volatile(&raw const KERNEL_OFFSETS.syscall_args_from_regs) != 0 }
}
