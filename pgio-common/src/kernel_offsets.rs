//! Struct field offsets the eBPF programs need (block requests, and the task/mm fields the
//! lifecycle programs read), taken by userspace from the running kernel's BTF.

/// Byte offsets inside kernel structs, read from `/sys/kernel/btf/vmlinux` by userspace and
/// written into the program's globals (Rust eBPF has no CO-RE field relocations yet).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KernelOffsets {
    /// `struct request.cmd_flags`
    pub request_cmd_flags: u32,
    /// `struct request.__data_len`: the bytes a request has left, before a completion's
    /// (`block_rq_complete` fires before the kernel subtracts them).
    pub request_data_len: u32,
    /// `struct request.q`
    pub request_q: u32,
    /// `struct request_queue.disk` (Linux >= 5.15; 0 when `request_disk` is used)
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
    /// `struct request.rq_disk` on kernels before 5.15, where the queue has no `disk`; 0
    /// (never a real offset: `q` comes first) when the disk is `rq->q->disk`.
    pub request_disk: u32,
    /// Which argument of `block_rq_insert`/`_issue`/`_requeue` is the `struct request *`: 1
    /// before Linux 5.11 (`(struct request_queue *q, struct request *rq)`), else 0.
    pub block_rq_arg: u32,
    /// `struct bio.bi_bdev` (Linux >= 5.12); 0 when the bio names its disk (`bio_disk`).
    pub bio_bdev: u32,
    /// `struct bio.bi_disk` before 5.12; 0 when `bio_bdev` is used.
    pub bio_disk: u32,
    /// `struct block_device.bd_disk`
    pub bdev_disk: u32,
    /// `struct gendisk.queue`
    pub gendisk_queue: u32,
    /// `struct request_queue.mq_ops`: NULL for a bio-based disk (dm, md, zram).
    pub queue_mq_ops: u32,
    /// `struct bio.bi_opf`
    pub bio_opf: u32,
    /// `struct bio.bi_iter.bi_size`: the bio's bytes, read at submission.
    pub bio_size: u32,
    /// Which argument of `block_bio_queue` is the `struct bio *`: 1 before Linux 5.11
    /// (`(struct request_queue *q, struct bio *bio)`), else 0. Read by the loader, which
    /// attaches the program written for it.
    pub block_bio_arg: u32,
    /// 1 when a syscall's exit can read the call's arguments from the thread's saved user
    /// registers (`bpf_task_pt_regs`, Linux >= 5.15, and pgio reads them on x86_64): the
    /// query family then needs no `sys_enter_*` program on the client socket's calls.
    pub syscall_args_from_regs: u32,
    /// `struct task_struct.__state` (`state` before 5.14): 0 while runnable.
    pub task_state: u32,
    /// `struct task_struct.sched_info.run_delay`: the task's time on a run queue (ns); 0
    /// when the kernel has no `sched_info` (no `CONFIG_SCHED_INFO`): `query_wait` is off.
    pub task_run_delay: u32,
}

crate::abi_size!(KernelOffsets, 92, 4);
crate::abi_pod!(KernelOffsets);
