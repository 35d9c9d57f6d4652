//! An io worker's IO syscall booked under the backend it serves (`pgio_common::io_worker` has
//! the rule): `acting_series` is asked by the syscall family's enter for a process of an io
//! worker's series; the call's start carries the answer, which the relation family's rows
//! and the block requests submitted inside the call then take.
use aya_ebpf::{helpers::bpf_probe_read_user, macros::map, maps::PerCpuArray};
use pgio_common::{
    SeriesId,
    io_worker::{ERROR_CONTEXT_ARG_AT, OUTCOMES, Outcome},
};

use crate::{query_id, tracked};

/// Calls of io workers by outcome (`pgio_io_worker_syscalls_total`).
#[map]
static IO_WORKER_CALLS: PerCpuArray<u64> = PerCpuArray::with_max_entries(OUTCOMES as u32, 0);

#[inline(always)]
fn count(o: Outcome) -> Option<SeriesId> {
    if let Some(c) = IO_WORKER_CALLS.get_ptr_mut(o as u32) {
        // SAFETY: this CPU's counter; programs on one CPU do not nest.
        unsafe { *c += 1 };
    }
    None
}

#[inline(always)]
fn read<T: Copy>(addr: u64) -> Option<T> {
    // SAFETY: a read of the current process' memory, which may fail.
    unsafe { bpf_probe_read_user(addr as *const T).ok() }
}

/// The pid in `PGPROC` number `procno` of the array at `procs`.
#[inline(always)]
fn proc_pid(procs: u64, procno: i32, size: u32, pid_at: u32) -> Option<u32> {
    // ProcNumber is an int; MaxBackends and the auxiliary processes stay far below 2^18.
    if !(0..1 << 18).contains(&procno) {
        return None;
    }
    read::<i32>(procs + procno as u64 * size as u64 + pid_at as u64).map(|p| p as u32)
}

/// The series the current call of io worker `tgid` is booked under: that of the backend
/// whose handle it serves, or `None` (its own).
#[inline(always)]
pub fn acting_series(tgid: u32) -> Option<SeriesId> {
    let Some(src) = query_id::source(tgid) else {
        return count(Outcome::NotFound);
    };
    if !src.knows_aio_owners() {
        return count(Outcome::OwnIo);
    }
    let Some(ctx) = read::<u64>(src.error_context_stack) else {
        return count(Outcome::Unreadable);
    };
    if ctx == 0 {
        return count(Outcome::OwnIo);
    }
    let Some(handle) = read::<u64>(ctx + ERROR_CONTEXT_ARG_AT) else {
        return count(Outcome::Unreadable);
    };
    if handle == 0 {
        return count(Outcome::OwnIo);
    }
    // One read at a time, each checked before the next: a tuple of reads compiled into code
    // that 5.10's verifier refuses (a call's scratched register read after it).
    let Some(owner) = read::<i32>(handle + src.aio_owner_at as u64) else {
        return count(Outcome::Unreadable);
    };
    let Some(me) = read::<i32>(src.my_proc_number) else {
        return count(Outcome::Unreadable);
    };
    let Some(procs_at) = read::<u64>(src.proc_global) else {
        return count(Outcome::Unreadable);
    };
    // `ProcGlobal->allProcs`, its first field.
    let Some(procs) = read::<u64>(procs_at) else {
        return count(Outcome::Unreadable);
    };
    if proc_pid(procs, me, src.proc_size, src.proc_pid_at) != Some(tgid) {
        return count(Outcome::Layout);
    }
    let Some(pid) = proc_pid(procs, owner, src.proc_size, src.proc_pid_at) else {
        return count(Outcome::OwnerUnknown);
    };
    // Only a process of the same postmaster: a made-up handle cannot book on anyone else.
    let same_cluster = query_id::source(pid).is_some_and(|o| o.postmaster == src.postmaster);
    match tracked::series_of(pid) {
        Some(series) if same_cluster && pid != tgid => {
            count(Outcome::Attributed);
            Some(series)
        }
        _ => count(Outcome::OwnerUnknown),
    }
}
