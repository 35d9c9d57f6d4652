//! Struct field offsets the eBPF programs need (block requests, and the task/mm fields the
//! lifecycle programs read), taken by userspace from the running kernel's BTF.

/// Byte offsets inside kernel structs, read from `/sys/kernel/btf/vmlinux` by userspace and
/// written into the program's globals (Rust eBPF has no CO-RE field relocations yet).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KernelOffsets {
    /// `struct request.cmd_flags`
    pub request_cmd_flags: u32,
    /// `struct request.q`
    pub request_q: u32,
    /// `struct request_queue.disk`
    pub queue_disk: u32,
    /// `struct gendisk.major`
    pub gendisk_major: u32,
    /// `struct gendisk.first_minor`
    pub gendisk_first_minor: u32,
    /// `struct task_struct.pid`
    pub task_pid: u32,
    /// `struct task_struct.tgid`
    pub task_tgid: u32,
    /// `struct task_struct.mm`
    pub task_mm: u32,
    /// `struct mm_struct.arg_start` (where a process' argv, so a Postgres title, starts)
    pub mm_arg_start: u32,
    pub _pad: u32,
}
