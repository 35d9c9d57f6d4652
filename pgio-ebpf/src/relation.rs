//! IO per PostgreSQL relation file (issue 31): a tracked process' `openat` names the file
//! (`pgio_common::relation::parse_path`) and leaves it in a slot of `RELATION_FDS` tagged
//! `(tgid, fd)`, one of the eight of its two sets (`pick_way`); each timed read, write or sync
//! on that fd then also counts under the file: in a row of the slot itself (up to eight array
//! lookups and tag compares, atomic adds), or, when the slot's row for that cache outcome
//! holds another (series, syscall) or the series is provisional, in `RELATION_HIST`. A call on an fd without its slot (opened before pgio
//! attached, or a slot another open took) counts as `(other)`.
use core::ffi::c_void;

use aya_ebpf::{
    EbpfContext as _,
    bindings::BPF_F_MMAPABLE,
    helpers::{bpf_ktime_get_ns, bpf_probe_read_user_str_bytes},
    macros::{map, tracepoint},
    maps::{Array, HashMap, LruHashMap, PerCpuArray},
    programs::TracePointContext,
};
use pgio_common::{
    CHILD_SERIES_MAX, SeriesId,
    hist::{Bucket, slot},
    relation::{
        FD_CANDIDATES, FD_CLOSED, FD_ROWS, FD_SLOTS, FD_UNKNOWN, FOLDS_FINISHED, FOLDS_STARTED,
        FdRow, FdSlot, OPEN_MAX, PATH_MAX_PARSED, ParseScratch, ParseState, QUOTA, ROW_SLOTS,
        RelFile, RelationKey, fd_candidate, fd_row_of, fd_sets, fd_tag, finish, parse_byte,
        pick_way, row_slot, slot_of_row,
    },
    syscall::{Cache, RowTag, SyscallStart},
};

use crate::{
    atomic::atomic_add,
    drops, hist,
    sys_record::{ARG0, ARG1, RET, field},
    tracked::{self, generation},
};

/// `relations` from the config, written by userspace at load: with it off the verifier
/// prunes the lookup from every syscall exit.
#[unsafe(no_mangle)]
static RELATIONS_ON: u8 = 1;

/// The file an `openat` in progress names, by thread id, from its entry to its exit. An LRU:
/// an exit never seen (pgio attached mid-call) cannot fill it.
#[map]
static RELATION_OPEN: LruHashMap<u32, RelFile> = LruHashMap::with_max_entries(OPEN_MAX, 0);

/// Mmapable: a scrape reads its rows from pgio's memory, not with 16,384 map lookups.
#[map]
static RELATION_FDS: Array<FdSlot> = Array::with_max_entries(FD_SLOTS, BPF_F_MMAPABLE);

#[map]
static RELATION_HIST: HashMap<RelationKey, Bucket> = HashMap::with_max_entries(16_384, 0);

/// Each series' `(rest)`: IO `RELATION_HIST` had no room for (its owner's share, or full).
/// Its own map, which only these keys (a few per series) fill: a flood of files cannot take
/// its room, so the sum over a series' files stays its total.
#[map]
static RELATION_REST_HIST: HashMap<RelationKey, Bucket> = HashMap::with_max_entries(4_096, 0);

/// Folds of live rows into `RELATION_HIST`, started and finished (`FOLDS_STARTED`,
/// `FOLDS_FINISHED`): a reader retries when one ran while it read the slots and the map.
#[map]
static RELATION_FOLDS: Array<u64> = Array::with_max_entries(2, 0);

/// The path being parsed and the parser's state (see `ParseState` on why not the stack).
#[map]
static RELATION_PATH: PerCpuArray<ParseScratch> = PerCpuArray::with_max_entries(1, 0);

/// `openat(dfd, filename, flags, mode)`: `filename` is the second argument.
const FILENAME: usize = ARG1;

/// A tracked process opens a file: what its path names waits for the call's fd.
#[tracepoint]
pub fn sys_enter_openat(ctx: TracePointContext) -> u32 {
    match tracked::caller() {
        Some(c) if tracked::names_files(c.series) => {
            sys_enter_openat_tracked(ctx.as_ptr(), c.pid_tgid)
        }
        _ => 0,
    }
}

/// A tracked process' program's work, in a function of its own (`tracked::caller`).
#[inline(never)]
fn sys_enter_openat_tracked(ctx: *mut c_void, pid_tgid: u64) -> u32 {
    let (ctx, tid) = (TracePointContext::new(ctx), pid_tgid as u32);
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
    let _ = RELATION_OPEN.insert(&tid, &file, 0);
    0
}

/// Its exit: the fd's slot now names that file (also when it is none of PostgreSQL's, so that
/// a reused fd never keeps an earlier file's name).
#[tracepoint]
pub fn sys_exit_openat(ctx: TracePointContext) -> u32 {
    // Nearly every `openat` on a node is an untracked process': an array lookup spares it the
    // hash's. One untracked mid-call leaves its entry to the LRU.
    match tracked::caller() {
        Some(c) => sys_exit_openat_tracked(ctx.as_ptr(), c.pid_tgid),
        None => 0,
    }
}

#[inline(never)]
fn sys_exit_openat_tracked(ctx: *mut c_void, pid_tgid: u64) -> u32 {
    let (ctx, tid, tgid) = (
        TracePointContext::new(ctx),
        pid_tgid as u32,
        (pid_tgid >> 32) as u32,
    );
    // SAFETY: a copy of this thread's entry.
    let Some(file) = (unsafe { RELATION_OPEN.get(&tid) }).copied() else {
        return 0;
    };
    let _ = RELATION_OPEN.remove(&tid);
    let ret = field(&ctx, RET) as i64;
    if ret < 0 || ret >= FD_UNKNOWN as i64 {
        return 0;
    }
    let fd = ret as u16;
    let (sets, mine) = (fd_sets(tgid, fd), fd_tag(tgid, fd));
    let mut tags = [0u64; FD_CANDIDATES];
    let mut last = [0u64; FD_CANDIDATES];
    for i in 0..FD_CANDIDATES {
        let Some(s) = RELATION_FDS.get_ptr_mut(fd_candidate(&sets, i)) else {
            return 0;
        };
        // SAFETY: a map value (see below on concurrent writers).
        unsafe {
            tags[i] = core::ptr::read_volatile(&(*s).tag);
            last[i] = (*s).last_ns;
        }
    }
    let way = pick_way(&tags, &last, mine, |t| tracked::series_of(t).is_some());
    let Some(s) = RELATION_FDS.get_ptr_mut(fd_candidate(&sets, way & (FD_CANDIDATES - 1))) else {
        return 0;
    };
    // SAFETY: a map value. Tag cleared first and set last: a reader on another CPU (another
    // `(tgid, fd)` of this slot) sees no tag, or this one with its file, or at worst one
    // event's mixture while both race.
    unsafe {
        core::ptr::write_volatile(&mut (*s).tag, 0);
        let held = (core::ptr::read_volatile(&(*s).rows[0].tag)
            | core::ptr::read_volatile(&(*s).rows[1].tag))
            != 0;
        if held {
            fold_rows(s);
        }
        (*s).file = file;
        (*s).last_ns = bpf_ktime_get_ns();
        core::ptr::write_volatile(&mut (*s).tag, mine);
    }
    0
}

/// Moves the counts of the slot's live rows into `RELATION_HIST` under the slot's file, and
/// frees the rows, before the slot names another file.
///
/// # Safety
/// `s` is a `RELATION_FDS` value.
#[inline(never)]
unsafe fn fold_rows(s: *mut FdSlot) {
    let Some(folds) = RELATION_FOLDS.get_ptr_mut(FOLDS_STARTED) else {
        return;
    };
    atomic_add(folds, 1);
    // SAFETY: as the caller says.
    let file = unsafe { (*s).file };
    let mut i = 0;
    while i < FD_ROWS {
        // SAFETY: as the caller says; `i` is below FD_ROWS.
        unsafe { fold_row(&mut (*s).rows[i], file) };
        i += 1;
    }
    if let Some(done) = RELATION_FOLDS.get_ptr_mut(FOLDS_FINISHED) {
        atomic_add(done, 1);
    }
}

/// # Safety
/// `r` is a row of a `RELATION_FDS` value.
#[inline(always)]
unsafe fn fold_row(r: *mut FdRow, file: RelFile) {
    // SAFETY: as the caller says.
    let held = unsafe { core::ptr::read_volatile(&(*r).tag) };
    let Some(t) = RowTag::decode(held) else {
        return;
    };
    // SAFETY: as the caller says. Untagged first: no call adds to it any more.
    unsafe { core::ptr::write_volatile(&mut (*r).tag, 0) };
    if generation(t.series) != t.generation {
        return; // stale: its series was retired, its counts with it
    }
    let mut key = RelationKey {
        series: t.series,
        file,
        syscall: t.syscall,
        cache: t.cache,
        slot: 0,
        _pad: 0,
    };
    // The row's sum and bytes go with its first counted slot (a histogram's sum is its
    // slots' sum).
    // SAFETY: as the caller says.
    let (mut sum, mut bytes) = unsafe { ((*r).sum, (*r).bytes) };
    let mut i = 0;
    while i < ROW_SLOTS {
        // SAFETY: as the caller says; `i` is below ROW_SLOTS.
        let count = unsafe { (*r).slots[i] };
        if count != 0 {
            key.slot = slot_of_row(i);
            book(&key, &Bucket { count, sum, bytes });
            (sum, bytes) = (0, 0);
        }
        i += 1;
    }
}

/// Counts `v` under `key` in `RELATION_HIST`, or in its series' `(rest)` when that map has
/// no room for it (its owner's share, or full).
#[inline(always)]
fn book(key: &RelationKey, v: &Bucket) {
    if hist::try_add_bucket(&RELATION_HIST, Some(QUOTA), key.series, key, v).is_ok() {
        return;
    }
    let mut rest = *key;
    rest.file = RelFile::REST;
    if let Err(reason) = hist::try_add_bucket(&RELATION_REST_HIST, None, key.series, &rest, v) {
        drops::count(reason);
    }
}

/// The slot of its two sets that `(tgid, fd)` holds.
#[inline(always)]
fn slot_of(tgid: u32, fd: u16) -> Option<*mut FdSlot> {
    let (sets, mine) = (fd_sets(tgid, fd), fd_tag(tgid, fd));
    for i in 0..FD_CANDIDATES {
        let fs = RELATION_FDS.get_ptr_mut(fd_candidate(&sets, i))?;
        // SAFETY: a map value (see `sys_exit_openat` on a concurrent writer).
        if unsafe { core::ptr::read_volatile(&(*fs).tag) } == mine {
            return Some(fs);
        }
    }
    None
}

/// `close(fd)` of a tracked process: the fd's slot is marked closed (`FD_CLOSED`), the
/// first of its set to be taken. Without it a closed fd's slot looked live until it aged,
/// and a process opening files by the thousand pushed out others' idle but open ones.
#[tracepoint]
pub fn sys_enter_close(ctx: TracePointContext) -> u32 {
    match tracked::caller() {
        Some(c) if tracked::names_files(c.series) => {
            sys_enter_close_tracked(ctx.as_ptr(), c.tgid())
        }
        _ => 0,
    }
}

#[inline(never)]
fn sys_enter_close_tracked(ctx: *mut c_void, tgid: u32) -> u32 {
    let ctx = TracePointContext::new(ctx);
    let fd = field(&ctx, ARG0);
    if fd >= FD_UNKNOWN as u64 {
        return 0;
    }
    if let Some(s) = slot_of(tgid, fd as u16) {
        // SAFETY: a map value; the tag alone changes (see `sys_exit_openat`).
        unsafe { core::ptr::write_volatile(&mut (*s).tag, fd_tag(tgid, fd as u16) | FD_CLOSED) };
    }
    0
}

/// A timed call of `tgid` on the fd in `s` took `d`: counted under its file if one of the
/// fd's set is this process' own.
#[inline(always)]
pub fn add(tgid: u32, s: &SyscallStart, cache: Cache, d: u64, bytes: impl FnOnce() -> u64) {
    // SAFETY: a global the loader rewrites; volatile so the compiler keeps the load.
    if unsafe { core::ptr::read_volatile(&RELATIONS_ON) } == 0 || s.fd == FD_UNKNOWN {
        return;
    }
    // Only PostgreSQL's processes have their IO on relations (and `(other)`): the others'
    // calls stop at this bit, before the fd's set is searched.
    if !tracked::names_files(s.series) {
        return;
    }
    let bytes = bytes();
    // Not this fd's slot (opened before pgio attached and not found under the data directory,
    // or another open took the slot): `(other)`, so that the sum over files is the total.
    let file = match slot_of(tgid, s.fd) {
        // SAFETY: this fd's slot, a map value; a plain store, the last call's end.
        Some(fs) => unsafe {
            (*fs).last_ns = s.start_ns + d;
            if add_to_row(fs, s.series, s.syscall, cache, d, bytes) {
                return;
            }
            (*fs).file
        },
        None => RelFile::OTHER,
    };
    let key = RelationKey {
        series: s.series,
        file,
        syscall: s.syscall,
        cache: cache as u8,
        slot: slot(d),
        _pad: 0,
    };
    book(
        &key,
        &Bucket {
            count: 1,
            sum: d,
            bytes,
        },
    );
}

/// Counts the call in the slot's row for its cache outcome if the row is free, its own, or
/// stale; `false`: another (series, syscall) holds it, or the series is provisional (only
/// the hash map's keys are folded into the series a process is classified as).
///
/// # Safety
/// `fs` is a `RELATION_FDS` value.
#[inline(always)]
unsafe fn add_to_row(
    fs: *mut FdSlot,
    series: SeriesId,
    syscall: u8,
    cache: Cache,
    d: u64,
    bytes: u64,
) -> bool {
    if series.0 >= CHILD_SERIES_MAX {
        return false;
    }
    let tag = RowTag {
        series,
        generation: generation(series),
        syscall,
        cache: cache as u8,
    }
    .encode();
    // SAFETY: as the caller says; the index is masked below FD_ROWS.
    let r = unsafe { &raw mut (*fs).rows[fd_row_of(cache as u8) & (FD_ROWS - 1)] };
    // SAFETY: a map value; the adds are atomic (a process' threads may share an fd).
    unsafe {
        let held = core::ptr::read_volatile(&(*r).tag);
        if held != tag {
            if let Some(h) = RowTag::decode(held)
                && generation(h.series) == h.generation
            {
                return false;
            }
            // Free or stale: zero it, then tag it (the tag last: see `FdRow`).
            let mut i = 0;
            while i < ROW_SLOTS {
                core::ptr::write_volatile(&mut (*r).slots[i], 0);
                i += 1;
            }
            (*r).sum = 0;
            (*r).bytes = 0;
            core::ptr::write_volatile(&mut (*r).tag, tag);
        }
        atomic_add(&raw mut (*r).slots[row_slot(slot(d)) & (ROW_SLOTS - 1)], 1);
        atomic_add(&raw mut (*r).sum, d);
        if bytes != 0 {
            atomic_add(&raw mut (*r).bytes, bytes);
        }
    }
    true
}

/// Called by `sched_process_exit` for every exiting thread.
#[inline(always)]
pub fn thread_exit(tid: u32) {
    let _ = RELATION_OPEN.remove(&tid);
}
