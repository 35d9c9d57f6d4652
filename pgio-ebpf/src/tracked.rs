//! `tgid → series id`, written by userspace (classifier) and by `sched_process_fork`
//! (a child inherits its parent's series, or gets a provisional one when `CHILD_SERIES` says
//! so, until userspace reclassifies it).
//!
//! An array indexed by tgid rather than a hash: the verifier inlines array lookups into a
//! bounds check and an address computation, so an untracked process pays almost nothing.
//! One u16 a tgid (`SeriesId::tracked_slot`), four to a value (`TRACKED_PER_ENTRY`), 0 for not
//! tracked. Sized to `pid_max` by the loader (2 bytes a pid: 64 KiB for the default 32768,
//! 8 MiB for 2^22). Mappable, so that userspace writes one tgid's u16 in place: a write of the
//! whole value would undo a fork's write to its neighbour.
use aya_ebpf::{bindings::BPF_F_MMAPABLE, macros::map, maps::Array};
use pgio_common::{
    CHILD_SERIES_MAX, PID_MAX_LIMIT, SeriesId, TRACKED_PER_ENTRY, query::SERVES_CLIENTS_WORDS,
    tracked_entries,
};

/// `series → generation`, moved on by userspace when it frees the id: rows tagged with an
/// older generation are stale (the syscall family's dense rows, the relation slots, the
/// query runs).
#[map]
static SYSCALL_ROW_GEN: Array<u32> = Array::with_max_entries(CHILD_SERIES_MAX, 0);

/// The generation series id `series` has now.
#[inline(always)]
pub fn generation(series: SeriesId) -> u32 {
    SYSCALL_ROW_GEN.get(series.0).map_or(0, |g| *g)
}

#[map]
static TRACKED: Array<u64> =
    Array::with_max_entries(tracked_entries(PID_MAX_LIMIT), BPF_F_MMAPABLE);

/// `tgid`'s u16 in `TRACKED`.
#[inline(always)]
fn slot(tgid: u32) -> Option<*mut u16> {
    let e = TRACKED.get_ptr_mut(tgid / TRACKED_PER_ENTRY)?;
    // SAFETY: within the 8-byte value: the lane is below TRACKED_PER_ENTRY.
    Some(unsafe { e.cast::<u16>().add((tgid % TRACKED_PER_ENTRY) as usize) })
}

/// `series → nonzero if a process of that series forks processes of another kind`. A
/// postmaster's children are backends, not postmasters: each starts in its own provisional
/// series (`PROVISIONAL | tgid`), which userspace folds into the series it classifies the
/// child as, so not even a new backend's first syscalls are booked as the postmaster's.
#[map]
static CHILD_SERIES: Array<SeriesId> = Array::with_max_entries(CHILD_SERIES_MAX, 0);

#[inline(always)]
pub fn child_series_of(series: SeriesId, child_tgid: u32) -> SeriesId {
    // A provisional parent (a postmaster that has just started) forks processes of another
    // kind too; its own provisional series is not theirs.
    if series.is_provisional() {
        return SeriesId::provisional(child_tgid);
    }
    match CHILD_SERIES.get(series.0) {
        Some(s) if s.is_tracked() => SeriesId::provisional(child_tgid),
        _ => series,
    }
}

/// The running thread of a tracked process: its ids (`bpf_get_current_pid_tgid`'s value) and
/// its process' series.
#[derive(Clone, Copy)]
pub struct Caller {
    pub pid_tgid: u64,
    pub series: SeriesId,
}

impl Caller {
    #[inline(always)]
    pub fn tgid(self) -> u32 {
        (self.pid_tgid >> 32) as u32
    }
}

/// The running thread, if its process is tracked: all that the syscall programs cost the
/// node's other processes, one helper and one array read. A program does no more than this
/// before it calls an `#[inline(never)]` function with a tracked call's work, so that its own
/// stack frame stays under 64 bytes: from 64 bytes on, the kernel (6.13 on) runs a program on
/// a private per-CPU stack, which every run pays, an untracked process' too (BENCHMARKS.md,
/// the pieces: `part_tracked_big_frame`).
#[inline(always)]
pub fn caller() -> Option<Caller> {
    let pid_tgid = aya_ebpf::helpers::bpf_get_current_pid_tgid();
    let series = series_of((pid_tgid >> 32) as u32)?;
    Some(Caller { pid_tgid, series })
}

#[inline(always)]
pub fn series_of(tgid: u32) -> Option<SeriesId> {
    // SAFETY: a map value's u16; userspace writes it with single 2-byte stores.
    let v = unsafe { core::ptr::read_volatile(slot(tgid)?) };
    let s = SeriesId::from_tracked_slot(tgid, v);
    s.is_tracked().then_some(s)
}

#[inline(always)]
pub fn set(tgid: u32, series: SeriesId) {
    let (Some(p), Some(v)) = (slot(tgid), series.tracked_slot(tgid)) else {
        return;
    };
    // SAFETY: one 2-byte store, which leaves the other tgids of the value alone; a racing
    // userspace write of the same tgid is benign.
    unsafe { core::ptr::write_volatile(p, v) };
}

/// One bit per series: set for client backends' series (`pgio_common::query`). Written by
/// userspace before it books any process under the series.
#[map]
static SERVES_CLIENTS: Array<u64> = Array::with_max_entries(SERVES_CLIENTS_WORDS, 0);

/// One bit per series: set for PostgreSQL's series, whose files the relation family names.
/// Written by userspace before it books any process under the series.
#[map]
static NAMES_FILES: Array<u64> = Array::with_max_entries(SERVES_CLIENTS_WORDS, 0);

/// One bit per series: set for PostgreSQL's io workers' series, whose IO syscalls are booked
/// under the backend they serve (`io_worker`). Written by userspace before it books any
/// process under the series.
#[map]
static SERVES_BACKENDS: Array<u64> = Array::with_max_entries(SERVES_CLIENTS_WORDS, 0);

#[inline(always)]
fn bit(map: &Array<u64>, series: SeriesId) -> bool {
    map.get(series.0 / 64)
        .is_some_and(|w| w & (1 << (series.0 % 64)) != 0)
}

/// Whether a process of `series` may be the server end of a client connection: a client
/// backend, or a postmaster's child not classified yet (its first read tells).
#[inline(always)]
pub fn serves_clients(series: SeriesId) -> bool {
    series.is_provisional() || bit(&SERVES_CLIENTS, series)
}

/// Whether the relation family names the files of a process of `series`: PostgreSQL's
/// (a postmaster's child not classified yet too). Longhorn's or a rule's processes are not
/// PostgreSQL's: their calls pay no slot lookup and no `(other)` key.
#[inline(always)]
pub fn names_files(series: SeriesId) -> bool {
    series.is_provisional() || bit(&NAMES_FILES, series)
}

/// One bit per series: set for PostgreSQL's series other than client backends, whose waits
/// `role_wait` books. Written by userspace before it books any process under the series.
#[map]
static BOOKS_WAITS: Array<u64> = Array::with_max_entries(SERVES_CLIENTS_WORDS, 0);

/// Whether `role_wait` books the waits of `series`' processes (one lookup: it is asked at
/// every switch).
#[inline(always)]
pub fn books_waits(series: SeriesId) -> bool {
    bit(&BOOKS_WAITS, series)
}

/// Whether `series` is an io worker's, doing IO for other backends.
#[inline(always)]
pub fn serves_backends(series: SeriesId) -> bool {
    !series.is_provisional() && bit(&SERVES_BACKENDS, series)
}
