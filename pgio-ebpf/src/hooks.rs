//! The hook table: the programs of the kernel hooks that more than one family rides on, each
//! calling its families in order. A family that needs one of these hooks adds its line here;
//! no family calls into another's module (`thread` and `tracked` below them hold what they
//! all read). Two exceptions, a family's second key rather than a hook's rider: `query_id`,
//! which books the runs `query` moves into its rows, from `query` itself; `role_wait`'s
//! `book_interval`, which books each off-CPU interval `query_wait` and `role_wait` settle as
//! one observation of its histogram and, through `wait_event`, under its individual wait
//! event, from their settling. The block hooks'
//! riders (`BlockRiders`) are handed the request's in-flight entry by `block_io`, so they need
//! no lookup of their own.
//!
//! | hook | families, in order |
//! |---|---|
//! | `block_io_start`, `block_rq_insert`, `block_bio_queue` | block_io (the submitter, the times), queue_blame (a tracked request's wait starts: its mark) |
//! | `block_rq_issue` | block_io (device and op), queue_blame (the wait is shared out among the culprits; the mark moves to the issue) |
//! | `block_rq_complete` | block_io (device, queue and whole time), queue_blame (the device's clock moves; a tracked request's device time is shared out) |
//! | `sys_exit_<IO syscall>` | syscall (latency), query (IO time of the running query), relation (per file) |
//! | `sys_enter_<IO syscall>` | syscall (the start), io_worker (an io worker's call booked under the backend served) |
//! | `sched_switch` | query_wait (a query thread's blocked intervals), role_wait (the other PostgreSQL processes' waits), both with wait_event (the interval by individual event), query (this CPU's runs), syscall (the thread's call in progress) |
//! | `sched_process_fork` | lifecycle (the child's series, the fork event), query_id (where the child's id is) |
//! | `sched_process_exit` | syscall, query, relation, role_wait (the thread's state); for a process: query_id, lifecycle |
use aya_ebpf::{
    EbpfContext as _,
    helpers::bpf_get_current_pid_tgid,
    macros::{btf_tracepoint, tracepoint},
    programs::{BtfTracePointContext, TracePointContext},
};
use pgio_common::{
    SeriesId,
    queue_blame::QueueBlameMark,
    syscall::{Cache, Syscall},
};

use crate::{
    block_io, lifecycle, query, query_id, query_wait, queue_blame, relation, role_wait, syscall,
    tracked,
};

/// The block hooks' riders, after `block_io`.
struct BlockRiders;

impl block_io::RequestRiders for BlockRiders {
    unsafe fn started(mark: *mut QueueBlameMark, wait_dev: u32, submitted_ns: u64) {
        unsafe { queue_blame::mark(mark, wait_dev, submitted_ns) }
    }

    unsafe fn issued(mark: *mut QueueBlameMark, series: SeriesId, dev: u32, op: u8, now: u64) {
        unsafe { queue_blame::issued(mark, series, dev, op, now) }
    }

    fn completed(
        mark: &QueueBlameMark,
        series: SeriesId,
        dev: u32,
        op: u8,
        device_ns: u64,
        now: u64,
    ) {
        queue_blame::completed(mark, series, dev, op, device_ns, now);
    }
}

#[btf_tracepoint(function = "block_io_start")]
pub fn block_io_start(ctx: BtfTracePointContext) -> i32 {
    block_io::io_start::<BlockRiders>(&ctx)
}

#[btf_tracepoint(function = "block_rq_insert")]
pub fn block_rq_insert(ctx: BtfTracePointContext) -> i32 {
    block_io::rq_insert::<BlockRiders>(&ctx)
}

#[btf_tracepoint(function = "block_rq_issue")]
pub fn block_rq_issue(ctx: BtfTracePointContext) -> i32 {
    block_io::rq_issue::<BlockRiders>(&ctx)
}

#[btf_tracepoint(function = "block_rq_complete")]
pub fn block_rq_complete(ctx: BtfTracePointContext) -> i32 {
    block_io::rq_complete::<BlockRiders>(&ctx)
}

#[btf_tracepoint(function = "block_bio_queue")]
pub fn block_bio_queue(ctx: BtfTracePointContext) -> i32 {
    block_io::bio_queued::<BlockRiders>(ctx.arg(0))
}

/// The same hook before Linux 5.11, `(struct request_queue *q, struct bio *bio)`; userspace
/// attaches one of the two. (One program choosing the argument by a global compiles to an
/// offset context pointer, which 5.10's verifier rejects.)
#[btf_tracepoint(function = "block_bio_queue")]
pub fn block_bio_queue_before_5_11(ctx: BtfTracePointContext) -> i32 {
    block_io::bio_queued::<BlockRiders>(ctx.arg(1))
}

/// A tracked process' IO syscall exit (`tracked::caller`): its latency, then the running
/// query's IO time and its file's row. Inlined into a function of each program's own, so that
/// `sc` is a constant the compiler folds (as an argument, the nine exits took 40 % longer to
/// verify, and Linux 5.10's verifier under TCG past the tests' minute).
#[inline(always)]
fn io_syscall_exit_tracked(ctx: *mut core::ffi::c_void, pid_tgid: u64, sc: Syscall) -> u32 {
    let ctx = &TracePointContext::new(ctx);
    let Some(e) = syscall::exit(pid_tgid, sc) else {
        return 0;
    };
    query::add_io(e.start.series, e.tid, e.ns, e.cache == Cache::Miss);
    relation::add(e.tgid, &e.start, e.cache, e.ns, || e.bytes(ctx));
    0
}

macro_rules! io_syscall_exits {
    ($($sc:expr => $exit:ident;)*) => {$(
        #[tracepoint]
        pub fn $exit(ctx: TracePointContext) -> u32 {
            #[inline(never)]
            fn tracked_exit(ctx: *mut core::ffi::c_void, pid_tgid: u64) -> u32 {
                io_syscall_exit_tracked(ctx, pid_tgid, $sc)
            }
            match tracked::caller() {
                Some(c) => tracked_exit(ctx.as_ptr(), c.pid_tgid),
                None => 0,
            }
        }
    )*};
}

// Their enters: `syscall`.
io_syscall_exits! {
    Syscall::Pread64 => sys_exit_pread64;
    Syscall::Preadv => sys_exit_preadv;
    Syscall::Preadv2 => sys_exit_preadv2;
    Syscall::Pwrite64 => sys_exit_pwrite64;
    Syscall::Pwritev => sys_exit_pwritev;
    Syscall::Pwritev2 => sys_exit_pwritev2;
    Syscall::Fsync => sys_exit_fsync;
    Syscall::Fdatasync => sys_exit_fdatasync;
    Syscall::IoUringEnter => sys_exit_io_uring_enter;
}

/// `sched_switch(bool preempt, struct task_struct *prev, struct task_struct *next, …)`, in
/// the context of `prev`. A query thread's blocked intervals open and close (before the
/// syscall family forgets the leaving thread's call: `query_wait` reads it), and so do the
/// other PostgreSQL processes' (`role_wait`); the query family
/// moves this CPU's runs into their rows when it goes idle (`next` is the idle task, pid 0)
/// or they are old; the syscall family spills the leaving thread's call in progress.
#[btf_tracepoint(function = "sched_switch")]
pub fn sched_switch(ctx: BtfTracePointContext) -> i32 {
    let pid_at = crate::kernel_offsets::task_pid() as u64;
    let preempt: u64 = ctx.arg(0);
    let prev: u64 = ctx.arg(1);
    let next: u64 = ctx.arg(2);
    let pid = |task: u64| {
        if pid_at == 0 || task == 0 {
            return None;
        }
        // SAFETY: a BTF task pointer and the offset a constant of the frozen globals: a
        // plain load the verifier checks (and guards against faults).
        Some(unsafe { core::ptr::read_volatile((task + pid_at) as *const i32) } as u32)
    };
    let next_pid = pid(next);
    let prev_pid = pid(prev).unwrap_or(0);
    // Both wait families follow PostgreSQL's threads only (tid = tgid, tracked): the node's
    // other switches pay two `TRACKED` reads, and their work is a function of its own, which
    // keeps this program's frame small (`tracked::caller`).
    let tracked = |tid: u32| tid != 0 && tracked::series_of(tid).is_some();
    if tracked(prev_pid) || tracked(next_pid.unwrap_or(0)) {
        waits_switched(preempt as u8 != 0, prev, prev_pid, next_pid.unwrap_or(0));
    }
    query::switched(next_pid == Some(0));
    syscall::switched_out();
    0
}

/// A tracked thread left or got a CPU: its blocked intervals open and close.
#[inline(never)]
fn waits_switched(preempt: bool, prev: u64, prev_pid: u32, next_pid: u32) -> i32 {
    query_wait::switched(preempt, prev, prev_pid, next_pid);
    role_wait::switched(
        query_wait::on(),
        preempt,
        prev,
        prev_pid,
        next_pid,
        query_id::wait_event_at,
    );
    0
}

#[btf_tracepoint(function = "sched_process_fork")]
pub fn sched_process_fork(ctx: BtfTracePointContext) -> i32 {
    if let Some((parent, child)) = lifecycle::forked(&ctx) {
        query_id::forked(parent, child);
    }
    0
}

/// Fires for every exiting thread; the process is gone when its leader exits.
#[tracepoint]
pub fn sched_process_exit(_ctx: TracePointContext) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    let (tid, tgid) = (pid_tgid as u32, (pid_tgid >> 32) as u32);
    // Every thread, tracked or not: its process may have been untracked mid-call.
    syscall::thread_exit(tid);
    query::thread_exit(tid);
    relation::thread_exit(tid);
    role_wait::thread_exit(tid);
    if tid != tgid {
        return 0;
    }
    query_id::exited(tgid);
    lifecycle::process_exited(tgid);
    0
}
