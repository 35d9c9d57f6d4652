//! IO per PostgreSQL relation file (issue 31): a tracked process' `openat` names the file
//! (`pgio_common::relation::parse_path`) and leaves it in the `(tgid, fd)` slot of
//! `RELATION_FDS`; each timed read, write or sync on that fd then also counts in
//! `RELATION_HIST` under the file. A call on an fd without its slot (opened before pgio
//! attached, or a slot another open took) counts as `(other)`.
use aya_ebpf::{
    helpers::{bpf_get_current_pid_tgid, bpf_probe_read_user_str_bytes},
    macros::{map, tracepoint},
    maps::{Array, HashMap, LruHashMap, PerCpuArray},
    programs::TracePointContext,
};
use pgio_common::{
    hist::{Bucket, slot},
    relation::{
        FD_SLOTS, FD_UNKNOWN, FdSlot, OPEN_MAX, PATH_MAX_PARSED, ParseScratch, ParseState, QUOTA,
        RelFile, RelationKey, fd_slot, fd_tag, finish, parse_byte,
    },
    syscall::{Cache, SyscallStart},
};

use crate::{
    drops, hist,
    sys_record::{ARG1, RET, field},
    tracked,
};

/// `relations` from the config, written by userspace at load: with it off the verifier
/// prunes the lookup from every syscall exit.
#[unsafe(no_mangle)]
static RELATIONS_ON: u8 = 1;

/// The file an `openat` in progress names, by thread id, from its entry to its exit. An LRU:
/// an exit never seen (pgio attached mid-call) cannot fill it.
#[map]
static RELATION_OPEN: LruHashMap<u32, RelFile> = LruHashMap::with_max_entries(OPEN_MAX, 0);

#[map]
static RELATION_FDS: Array<FdSlot> = Array::with_max_entries(FD_SLOTS, 0);

#[map]
static RELATION_HIST: HashMap<RelationKey, Bucket> = HashMap::with_max_entries(16_384, 0);

/// Each series' `(rest)`: IO `RELATION_HIST` had no room for (its owner's share, or full).
/// Its own map, which only these keys (a few per series) fill: a flood of files cannot take
/// its room, so the sum over a series' files stays its total.
#[map]
static RELATION_REST_HIST: HashMap<RelationKey, Bucket> = HashMap::with_max_entries(4_096, 0);

/// The path being parsed and the parser's state (see `ParseState` on why not the stack).
#[map]
static RELATION_PATH: PerCpuArray<ParseScratch> = PerCpuArray::with_max_entries(1, 0);

/// `openat(dfd, filename, flags, mode)`: `filename` is the second argument.
const FILENAME: usize = ARG1;

/// A tracked process opens a file: what its path names waits for the call's fd.
#[tracepoint]
pub fn sys_enter_openat(ctx: TracePointContext) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    if tracked::series_of((pid_tgid >> 32) as u32).is_none() {
        return 0;
    }
    let Some(scratch) = RELATION_PATH.get_ptr_mut(0) else {
        return 0;
    };
    let name = field(&ctx, FILENAME) as *const u8;
    // SAFETY: this CPU's scratch; programs on one CPU do not nest.
    let file = unsafe {
        match bpf_probe_read_user_str_bytes(name, &mut (*scratch).path) {
            Ok(s) => {
                let len = s.len();
                (*scratch).state = ParseState::default();
                let mut i = 0usize;
                while i < PATH_MAX_PARSED && i < len {
                    parse_byte(&mut (*scratch).state, (*scratch).path[i]);
                    i += 1;
                }
                finish(&(*scratch).state)
            }
            Err(_) => RelFile::OTHER,
        }
    };
    let _ = RELATION_OPEN.insert(&(pid_tgid as u32), &file, 0);
    0
}

/// Its exit: the fd's slot now names that file (also when it is none of PostgreSQL's, so that
/// a reused fd never keeps an earlier file's name).
#[tracepoint]
pub fn sys_exit_openat(ctx: TracePointContext) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    let tid = pid_tgid as u32;
    // SAFETY: a copy of this thread's entry.
    let Some(file) = (unsafe { RELATION_OPEN.get(&tid) }).copied() else {
        return 0;
    };
    let _ = RELATION_OPEN.remove(&tid);
    let ret = field(&ctx, RET) as i64;
    if ret < 0 || ret >= FD_UNKNOWN as i64 {
        return 0;
    }
    let (tgid, fd) = ((pid_tgid >> 32) as u32, ret as u16);
    let Some(s) = RELATION_FDS.get_ptr_mut(fd_slot(tgid, fd)) else {
        return 0;
    };
    // SAFETY: a map value. Tag cleared first and set last: a reader on another CPU (another
    // `(tgid, fd)` of this slot) sees no tag, or this one with its file, or at worst one
    // event's mixture while both race.
    unsafe {
        core::ptr::write_volatile(&mut (*s).tag, 0);
        (*s).file = file;
        core::ptr::write_volatile(&mut (*s).tag, fd_tag(tgid, fd));
    }
    0
}

/// A timed call of `tgid` on the fd in `s` took `d`: counted under its file if the fd's slot
/// is this process' own.
#[inline(always)]
pub fn add(tgid: u32, s: &SyscallStart, cache: Cache, d: u64, bytes: impl FnOnce() -> u64) {
    // SAFETY: a global the loader rewrites; volatile so the compiler keeps the load.
    if unsafe { core::ptr::read_volatile(&RELATIONS_ON) } == 0 || s.fd == FD_UNKNOWN {
        return;
    }
    let Some(slot_ptr) = RELATION_FDS.get_ptr(fd_slot(tgid, s.fd)) else {
        return;
    };
    // SAFETY: a map value (see `sys_exit_openat` on a concurrent writer).
    let (tag, file) = unsafe { (core::ptr::read_volatile(&(*slot_ptr).tag), (*slot_ptr).file) };
    // Not this fd's slot (opened before pgio attached and not found under the data directory,
    // or another open took the slot): `(other)`, so that the sum over files is the total.
    let file = if tag == fd_tag(tgid, s.fd) {
        file
    } else {
        RelFile::OTHER
    };
    let mut key = RelationKey {
        series: s.series,
        file,
        syscall: s.syscall,
        cache: cache as u8,
        slot: slot(d),
        _pad: 0,
    };
    let bytes = bytes();
    if hist::try_add(&RELATION_HIST, Some(QUOTA), s.series, &key, d, bytes).is_ok() {
        return;
    }
    // No room for the file's key: the series' `(rest)`.
    key.file = RelFile::REST;
    if let Err(reason) = hist::try_add(&RELATION_REST_HIST, None, s.series, &key, d, bytes) {
        drops::count(reason);
    }
}

/// Called by `sched_process_exit` for every exiting thread.
#[inline(always)]
pub fn thread_exit(tid: u32) {
    let _ = RELATION_OPEN.remove(&tid);
}
