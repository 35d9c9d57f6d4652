//! The relation family's shared rules (issue 31, in progress): which file a PostgreSQL backend
//! opened, from the path it passed to `openat`. PostgreSQL works in its data directory and
//! names its files relative to it:
//!
//! - `base/<db>/<relfilenode>[_fsm|_vm|_init][.<segment>]`: a relation of database `<db>` in
//!   the default tablespace (`pg_default`, oid 1663);
//! - `global/<relfilenode>…`: a shared catalog (`pg_global`, 1664);
//! - `pg_tblspc/<spc>/<version dir>/<db>/<relfilenode>…`: a relation in tablespace `<spc>`;
//! - `pg_wal/…` the WAL; `…/pgsql_tmp/…` temporary files (sorts, hashes spilled to disk);
//! - anything else (`pg_xact/`, config files, extensions' files, absolute paths) is other.
//!
//! [`parse_path`] runs in the kernel, once per `openat` of a tracked process: a bounded loop
//! over at most [`PATH_MAX_PARSED`] bytes, no recursion, every index masked.

/// The relation histograms' place in the key quota arrays.
pub const QUOTA: crate::key_quota::QuotaMap = crate::key_quota::QuotaMap(3);

/// Slots of `RELATION_FDS`, the `(tgid, fd) → file` array that a tracked process' `openat`
/// fills, and that counts the calls on that fd (`FdSlot`): 584 B each, 9.1 MiB. An open whose
/// candidate slots ([`fd_sets`]) are all live takes the one used longest ago, and that
/// earlier file's IO counts as `(other)` until it is opened again.
pub const FD_SLOTS: u32 = 16_384;

/// `openat` calls of tracked threads in flight at once (`RELATION_OPEN`, an LRU).
pub const OPEN_MAX: u32 = 4_096;

/// A file descriptor no slot is kept for: beyond u16 (PostgreSQL's stay far below), or a
/// syscall without one.
pub const FD_UNKNOWN: u16 = u16::MAX;

/// Log2 slots an `FdRow` keeps: `ROW_FIRST_SLOT..ROW_FIRST_SLOT + ROW_SLOTS` of
/// `crate::hist::slot`, i.e. (32 ns, 68.7 s]; a call outside counts in the first or last.
/// The exported `le` buckets (1 µs .. 17.2 s) are all inside, so nothing they show changes.
pub const ROW_SLOTS: usize = 32;
pub const ROW_FIRST_SLOT: u8 = 6;

/// The row slot of log2 slot `slot`.
#[inline(always)]
pub const fn row_slot(slot: u8) -> usize {
    let s = if slot < ROW_FIRST_SLOT {
        0
    } else {
        (slot - ROW_FIRST_SLOT) as usize
    };
    if s >= ROW_SLOTS { ROW_SLOTS - 1 } else { s }
}

/// The log2 slot row slot `i` stands for.
pub const fn slot_of_row(i: usize) -> u8 {
    ROW_FIRST_SLOT + i as u8
}

/// One histogram counted in an fd's slot: the calls of one (series, syscall, cache) triple on
/// it (`crate::syscall::RowTag`). `tag` is written last when the kernel claims the row and
/// cleared first when it folds it away, so a reader sees a whole row or none.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct FdRow {
    /// `RowTag::encode` of its triple; 0: free.
    pub tag: u64,
    pub sum: u64,
    pub bytes: u64,
    pub slots: [u64; ROW_SLOTS],
}

impl Default for FdRow {
    fn default() -> Self {
        FdRow {
            tag: 0,
            sum: 0,
            bytes: 0,
            slots: [0; ROW_SLOTS],
        }
    }
}

/// The rows of one slot: a read's cache outcome picks one (hits and writes share the first,
/// misses have the second), so a backend's cached and uncached reads of a table both count
/// here. A call whose row another triple holds goes to `RELATION_HIST`.
pub const FD_ROWS: usize = 2;

#[inline(always)]
pub const fn fd_row_of(cache: u8) -> usize {
    (cache == crate::syscall::Cache::Miss as u8) as usize
}

/// One `RELATION_FDS` slot: the file `tgid`'s `fd` names, from its last `openat`, and the
/// calls on it. An `openat` that takes a slot whose rows hold live counts folds them into
/// `RELATION_HIST` first (`RELATION_FOLDS` tells a reader it happened).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct FdSlot {
    /// [`fd_tag`] of its `(tgid, fd)`; 0: free.
    pub tag: u64,
    /// When it was last opened or counted in (`bpf_ktime_get_ns`, CLOCK_MONOTONIC): a closed
    /// fd's slot (no `close` is traced) ages and is the first of its set to be taken.
    pub last_ns: u64,
    pub file: RelFile,
    pub rows: [FdRow; FD_ROWS],
}

crate::abi_size!(FdRow, 24 + 8 * ROW_SLOTS, 8);
crate::abi_size!(FdSlot, 32 + 2 * (24 + 8 * ROW_SLOTS), 8);
crate::abi_pod!(FdSlot, FdRow);

/// `RELATION_FOLDS` entries: folds started and finished. A reader that saw both equal
/// before reading the maps, and `FOLDS_STARTED` unchanged after, read no count twice and
/// missed none (a fold moves a row's counts from the slot into the hash map).
pub const FOLDS_STARTED: u32 = 0;
pub const FOLDS_FINISHED: u32 = 1;

/// Never 0: fd is below 2^16 and one is added.
#[inline(always)]
pub const fn fd_tag(tgid: u32, fd: u16) -> u64 {
    (tgid as u64) << 32 | (fd as u64 + 1)
}

/// Set in a slot's tag when its process closes the fd (`sys_enter_close`): no call matches
/// it any more (a pipe or socket that gets the number is not the file), and it is taken as
/// soon as its set needs a slot (its rows' counts are folded then).
pub const FD_CLOSED: u64 = 1 << 31;

/// `RELATION_FDS` is `FD_SLOTS / FD_WAYS` sets of `FD_WAYS` slots: an fd may take any slot
/// of its set, so fds hashed alike do not push each other out (direct-mapped, with 10,000
/// open fds on a node ~45 % would have lost their slot to another's and counted as `(other)`).
pub const FD_WAYS: u32 = 4;

/// Sets an fd may take a slot in ([`fd_sets`]): the one of them with more room. With one set,
/// 20 sessions holding 400 fds each (half the slots) lost 0.02 % to 5 % of their fds to
/// full sets, depending on their pids (simulated; 1.83 % in a CI run); with two, none, and
/// 0.4–0.5 % at three quarters full (simulated, 4 pid draws each).
pub const FD_CHOICES: usize = 2;

/// The slots an `openat` chooses among and a call looks its fd up in: both sets' ways.
pub const FD_CANDIDATES: usize = FD_CHOICES * FD_WAYS as usize;

/// The first slots of the two sets `(tgid, fd)` may take a slot of: a multiplicative hash
/// (one process' consecutive fds land in distinct sets) and a mixed one (independent of it).
#[inline(always)]
pub const fn fd_sets(tgid: u32, fd: u16) -> [u32; FD_CHOICES] {
    const SETS_MASK: u64 = (FD_SLOTS / FD_WAYS - 1) as u64;
    let x = fd_tag(tgid, fd).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let mut y = x ^ (x >> 29);
    y = y.wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
    y ^= y >> 32;
    [
        ((x >> 40) & SETS_MASK) as u32 * FD_WAYS,
        (y & SETS_MASK) as u32 * FD_WAYS,
    ]
}

/// The `RELATION_FDS` index of candidate `i` (below [`FD_CANDIDATES`]) of `sets`.
#[inline(always)]
pub const fn fd_candidate(sets: &[u32; FD_CHOICES], i: usize) -> u32 {
    sets[(i / FD_WAYS as usize) & (FD_CHOICES - 1)] + (i as u32 & (FD_WAYS - 1))
}

/// The process an [`fd_tag`] names.
#[inline(always)]
pub const fn tag_tgid(tag: u64) -> u32 {
    (tag >> 32) as u32
}

/// Which candidate slot ([`fd_candidate`]) an `openat` of `mine` takes, given the candidates'
/// tags and `last_ns`: its own (the fd number reused), else a room (a free or closed slot, or
/// one of a process `alive` no longer says is there) of the set with more rooms, the first
/// set on a tie, else the slot used longest ago.
///
/// Three short passes, not one: the verifier walks every combination of branches a pass
/// carries state across, and one pass keeping counts, first rooms and the oldest at once took
/// it past its million instructions.
#[inline(always)]
pub fn pick_way(
    tags: &[u64; FD_CANDIDATES],
    last: &[u64; FD_CANDIDATES],
    mine: u64,
    alive: impl Fn(u32) -> bool,
) -> usize {
    const W: usize = FD_WAYS as usize;
    let room = |t: u64| t == 0 || t & FD_CLOSED != 0 || !alive(tag_tgid(t));
    let mut i = 0;
    while i < FD_CANDIDATES {
        if tags[i] == mine {
            return i;
        }
        i += 1;
    }
    let (mut first_set, mut second_set) = (0u32, 0u32);
    i = 0;
    while i < W {
        first_set += u32::from(room(tags[i]));
        second_set += u32::from(room(tags[W + i]));
        i += 1;
    }
    if first_set + second_set != 0 {
        let base = if second_set > first_set { W } else { 0 };
        i = 0;
        while i < W {
            if room(tags[base + i]) {
                return base + i;
            }
            i += 1;
        }
    }
    let (mut best, mut oldest) = (0, u64::MAX);
    i = 0;
    while i < FD_CANDIDATES {
        if last[i] < oldest {
            (best, oldest) = (i, last[i]);
        }
        i += 1;
    }
    best
}

/// Key of `RELATION_HIST`: one log2 slot of one (series, file, syscall, cache) histogram.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RelationKey {
    pub series: crate::SeriesId,
    pub file: RelFile,
    pub syscall: u8,
    pub cache: u8,
    pub slot: u8,
    pub _pad: u8,
}

crate::abi_size!(RelationKey, 24, 4);
crate::abi_size!(ParseState, 8 * 28 + 24, 4);
crate::abi_size!(ParseScratch, 128 + 8 * 28 + 24, 4);
crate::abi_pod!(RelationKey);

/// Bytes of a path the kernel reads and parses; longer paths are cut (and parse as what their
/// first bytes say, or as other).
pub const PATH_MAX_PARSED: usize = 128;

pub const PG_DEFAULT_TABLESPACE: u32 = 1663;
pub const PG_GLOBAL_TABLESPACE: u32 = 1664;

#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FileClass {
    Other = 0,
    Relation = 1,
    Wal = 2,
    Temp = 3,
    /// Not a file: where a series' IO goes when the relation map had no room for its file's
    /// key (its owner's share, or full), so that the sum over relations stays its total.
    Rest = 4,
}

#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fork {
    Main = 0,
    Fsm = 1,
    Vm = 2,
    Init = 3,
}

/// A file as its path names it. For a relation: the tablespace its path is in (1663 for
/// `base/`, 1664 for `global/`), the database (0 for `global/`) and the relfilenode.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RelFile {
    pub tablespace: u32,
    pub db: u32,
    pub relfilenode: u32,
    pub class: u8,
    pub fork: u8,
    pub _pad: u16,
}

crate::abi_size!(RelFile, 16, 4);
crate::abi_pod!(RelFile);

impl RelFile {
    pub const OTHER: RelFile = RelFile::of_class(FileClass::Other);
    pub const REST: RelFile = RelFile::of_class(FileClass::Rest);

    /// A relation's file: in `tablespace` (1663 for `base/`, 1664 for `global/`), of database
    /// `db`, with `relfilenode` and `fork`.
    pub const fn relation(tablespace: u32, db: u32, relfilenode: u32, fork: Fork) -> RelFile {
        RelFile {
            tablespace,
            db,
            relfilenode,
            class: FileClass::Relation as u8,
            fork: fork as u8,
            _pad: 0,
        }
    }

    const fn of_class(class: FileClass) -> RelFile {
        RelFile {
            tablespace: 0,
            db: 0,
            relfilenode: 0,
            class: class as u8,
            fork: Fork::Main as u8,
            _pad: 0,
        }
    }
}

/// One `/`-separated component as the parser saw it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Component {
    /// Its leading decimal digits' value (saturating), and how many there were.
    number: u32,
    digits: u32,
    /// The fork suffix after the digits, if it is one of PostgreSQL's (`u8::MAX`: another).
    fork: u32,
    /// Something other than digits, a fork suffix and a `.<digits>` segment (0: clean).
    unclean: u32,
    /// A `.` with no segment digits after it yet.
    dot_pending: u32,
    len: u32,
    /// Of all its bytes ([`word_hash`]): names the directories PostgreSQL uses.
    hash: u32,
}

/// The parser's state between bytes. In the kernel it lives in a per-CPU map value, not on
/// the stack: the verifier then sees its fields as unknown numbers, and every byte's paths
/// meet again at the next byte (exact counters on the stack make each path distinct, and a
/// 128-byte loop exceeds the verifier's budget).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ParseState {
    comps: [Component; MAX_COMPONENTS],
    /// The current component's index; past the last: too many components.
    n: u32,
    /// Within the current component: past its leading digits, in a `_fork`, in a `.segment`.
    after_digits: u32,
    in_fork: u32,
    in_segment: u32,
    fork_first: u32,
    _pad: u32,
}

#[inline(always)]
const fn hash_step(h: u32, b: u8) -> u32 {
    h.wrapping_mul(31).wrapping_add(b as u32)
}

/// The hash a component holding exactly `word` has.
pub const fn word_hash(word: &[u8]) -> u32 {
    let mut h = 0;
    let mut i = 0;
    while i < word.len() {
        h = hash_step(h, word[i]);
        i += 1;
    }
    h
}

const BASE: u32 = word_hash(b"base");
const GLOBAL: u32 = word_hash(b"global");
const PG_TBLSPC: u32 = word_hash(b"pg_tblspc");
const PG_WAL: u32 = word_hash(b"pg_wal");
const PGSQL_TMP: u32 = word_hash(b"pgsql_tmp");

/// Components kept (a power of two: indices are masked); `pg_tblspc/<spc>/<version>/<db>/<file>`
/// has five.
const MAX_COMPONENTS: usize = 8;

/// What the path `p[..len]` (no NUL) names.
pub fn parse_path(p: &[u8; PATH_MAX_PARSED], len: usize) -> RelFile {
    let mut st = ParseState::default();
    let mut i = 0usize;
    while i < len && i < PATH_MAX_PARSED {
        parse_byte(&mut st, p[i & (PATH_MAX_PARSED - 1)]);
        i += 1;
    }
    finish(&st)
}

/// One byte of the path into `st`. Not inlined: in the kernel each call is verified with
/// `st` a map value, so its branches end at its return.
#[inline(never)]
pub fn parse_byte(st: &mut ParseState, b: u8) {
    if b == b'/' {
        st.n = st.n.saturating_add(1);
        st.after_digits = 0;
        st.in_fork = 0;
        st.in_segment = 0;
        st.fork_first = 0;
        return;
    }
    if st.n as usize >= MAX_COMPONENTS {
        return;
    }
    let c = &mut st.comps[st.n as usize & (MAX_COMPONENTS - 1)];
    c.len = c.len.saturating_add(1);
    c.hash = hash_step(c.hash, b);
    if st.after_digits == 0 && b.is_ascii_digit() {
        c.number = c
            .number
            .saturating_mul(10)
            .saturating_add((b - b'0') as u32);
        c.digits = c.digits.saturating_add(1);
        return;
    }
    if st.after_digits == 0 {
        st.after_digits = 1;
        if c.digits == 0 {
            c.unclean = 1;
            return;
        }
    }
    if st.in_segment != 0 {
        if b.is_ascii_digit() {
            c.dot_pending = 0;
        } else {
            c.unclean = 1;
        }
    } else if b == b'.' {
        st.in_segment = 1;
        st.in_fork = 0;
        c.dot_pending = 1;
    } else if st.in_fork != 0 {
        // The fork's name: its first letter decides (fsm, vm, init); the rest must be letters.
        if st.fork_first == 0 {
            st.fork_first = b as u32;
            c.fork = fork_from(b, u8::MAX) as u32;
        }
        if !b.is_ascii_lowercase() {
            c.unclean = 1;
        }
    } else if b == b'_' && c.fork == Fork::Main as u32 {
        st.in_fork = 1;
        st.fork_first = 0;
    } else {
        c.unclean = 1;
    }
}

/// The kernel's per-CPU scratch for one `openat`: the path as read, and the parser's state.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ParseScratch {
    pub path: [u8; PATH_MAX_PARSED],
    pub state: ParseState,
}

/// What the bytes given to `st` name.
pub fn finish(st: &ParseState) -> RelFile {
    if st.n as usize >= MAX_COMPONENTS {
        return RelFile::OTHER;
    }
    classify(&st.comps, st.n as usize + 1)
}

#[inline(always)]
fn fork_from(first: u8, fallback: u8) -> u8 {
    match first {
        b'f' => Fork::Fsm as u8,
        b'v' => Fork::Vm as u8,
        b'i' => Fork::Init as u8,
        _ => fallback,
    }
}

/// A component equal to the word whose hash is `word` (the parser keeps no text).
#[inline(always)]
fn is(c: &Component, word: u32) -> bool {
    c.digits == 0 && c.hash == word
}

#[inline(always)]
fn is_temp(c: &Component) -> bool {
    is(c, PGSQL_TMP)
}

#[inline(always)]
fn file(tablespace: u32, db: u32, c: &Component) -> RelFile {
    if c.digits == 0 || c.unclean != 0 || c.dot_pending != 0 || c.fork == u8::MAX as u32 {
        return RelFile::OTHER;
    }
    RelFile {
        tablespace,
        db,
        relfilenode: c.number,
        class: FileClass::Relation as u8,
        fork: c.fork as u8,
        _pad: 0,
    }
}

#[inline(always)]
fn number(c: &Component) -> Option<u32> {
    (c.digits > 0 && c.digits == c.len).then_some(c.number)
}

fn classify(c: &[Component; MAX_COMPONENTS], count: usize) -> RelFile {
    let c0 = &c[0];
    if is(c0, PG_WAL) && count >= 2 {
        return RelFile::of_class(FileClass::Wal);
    }
    if is(c0, BASE) {
        if count >= 2 && is_temp(&c[1]) {
            return RelFile::of_class(FileClass::Temp);
        }
        if count == 3
            && let Some(db) = number(&c[1])
        {
            return file(PG_DEFAULT_TABLESPACE, db, &c[2]);
        }
    }
    if is(c0, GLOBAL) && count == 2 {
        return file(PG_GLOBAL_TABLESPACE, 0, &c[1]);
    }
    if is(c0, PG_TBLSPC)
        && count >= 4
        && let Some(spc) = number(&c[1])
    {
        if is_temp(&c[3]) {
            return RelFile::of_class(FileClass::Temp);
        }
        if count == 5
            && let Some(db) = number(&c[3])
        {
            return file(spc, db, &c[4]);
        }
    }
    RelFile::OTHER
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Candidates of two sets: `[first set's four, second set's four]`.
    fn two(a: [u64; 4], b: [u64; 4]) -> [u64; FD_CANDIDATES] {
        let mut t = [0; FD_CANDIDATES];
        t[..4].copy_from_slice(&a);
        t[4..].copy_from_slice(&b);
        t
    }

    #[test]
    fn an_open_takes_its_own_slot_then_a_room_of_the_emptier_set_then_the_oldest() {
        let mine = fd_tag(7, 20);
        let (a, b, c) = (fd_tag(8, 3), fd_tag(9, 4), fd_tag(10, 5));
        let alive = |tgid: u32| tgid != 9;
        let at = |t: u64| two([t; 4], [t; 4]);
        // Its own wins over free slots anywhere, also in the second set.
        assert_eq!(
            pick_way(&two([0, a, mine, c], [0; 4]), &at(1), mine, alive),
            2
        );
        assert_eq!(
            pick_way(&two([0, a, a, c], [a, mine, 0, 0]), &at(1), mine, alive),
            5
        );
        // A room of the set with more of them: free, closed, or a dead process' slot.
        assert_eq!(
            pick_way(&two([a, 0, c, a], [a, c, a, c]), &at(1), mine, alive),
            1
        );
        assert_eq!(
            pick_way(&two([a, 0, c, a], [a, 0, 0, c]), &at(1), mine, alive),
            5
        );
        assert_eq!(
            pick_way(&two([a, c, b, a], [a, c, a, c]), &at(1), mine, alive),
            2
        );
        assert_eq!(
            pick_way(
                &two([a, c, a, c], [a, c | FD_CLOSED, b, c]),
                &at(1),
                mine,
                alive
            ),
            5
        );
        // A tie: the first set.
        assert_eq!(
            pick_way(&two([a, c, 0, a], [0, c, a, c]), &at(1), mine, alive),
            2
        );
        // A closed slot of its own fd number is not its own, but a room.
        assert_eq!(
            pick_way(
                &two([a, mine | FD_CLOSED, c, c], [a; 4]),
                &at(1),
                mine,
                alive
            ),
            1
        );
        // No room: the slot used longest ago, of either set.
        let last = two([50, 40, 30, 60], [70, 45, 20, 90]);
        assert_eq!(
            pick_way(&two([a, c, a, c], [c, a, c, a]), &last, mine, alive),
            6
        );
    }

    #[test]
    fn an_fds_two_sets_spread_and_stay_in_the_array() {
        // One process' 1,000 fds take at least 900 of the 4,096 first sets, and their second
        // sets spread as well.
        let mut taken = [[false; (FD_SLOTS / FD_WAYS) as usize]; FD_CHOICES];
        let mut same = 0;
        for fd in 0..1000 {
            let sets = fd_sets(4242, fd);
            same += usize::from(sets[0] == sets[1]);
            for (choice, s) in sets.iter().enumerate() {
                assert!(s.is_multiple_of(FD_WAYS) && s + FD_WAYS <= FD_SLOTS);
                taken[choice][(s / FD_WAYS) as usize] = true;
            }
            for i in 0..FD_CANDIDATES {
                assert!(fd_candidate(&sets, i) < FD_SLOTS);
            }
            assert_eq!(fd_candidate(&sets, 5), sets[1] + 1);
        }
        for (choice, sets) in taken.iter().enumerate() {
            let n = sets.iter().filter(|t| **t).count();
            assert!(n >= 850, "choice {choice}: {n} sets");
        }
        assert!(same <= 5, "{same} fds with one set twice");
    }

    /// 20 processes opening 400 fds each, round-robin, into the slots as the kernel's
    /// `openat` does (half the slots live): none loses its slot, for 8 draws of pids.
    #[test]
    fn twenty_sessions_of_400_fds_keep_their_slots() {
        extern crate std;
        use std::{collections::HashSet, vec, vec::Vec};
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for _ in 0..8 {
            let base = 1000 + (next() % 4_000_000) as u32;
            let pids: Vec<u32> = (0..20).map(|_| base + (next() % 400) as u32).collect();
            let mut tags = vec![0u64; FD_SLOTS as usize];
            let mut last = vec![0u64; FD_SLOTS as usize];
            let mut clock = 0;
            for fd in 12..412u16 {
                for &pid in &pids {
                    clock += 1;
                    let sets = fd_sets(pid, fd);
                    let idx: [usize; FD_CANDIDATES] =
                        core::array::from_fn(|i| fd_candidate(&sets, i) as usize);
                    let way = pick_way(
                        &idx.map(|i| tags[i]),
                        &idx.map(|i| last[i]),
                        fd_tag(pid, fd),
                        |_| true,
                    );
                    (tags[idx[way]], last[idx[way]]) = (fd_tag(pid, fd), clock);
                }
            }
            let live: HashSet<u64> = tags.iter().copied().collect();
            let lost = (12..412u16)
                .flat_map(|fd| pids.iter().map(move |&p| fd_tag(p, fd)))
                .filter(|t| !live.contains(t))
                .count();
            assert_eq!(lost, 0, "pids {pids:?}");
        }
    }

    fn parse(s: &str) -> RelFile {
        let mut p = [0u8; PATH_MAX_PARSED];
        let n = s.len().min(PATH_MAX_PARSED);
        p[..n].copy_from_slice(&s.as_bytes()[..n]);
        parse_path(&p, n)
    }

    const fn rel(tablespace: u32, db: u32, relfilenode: u32, fork: Fork) -> RelFile {
        RelFile::relation(tablespace, db, relfilenode, fork)
    }

    #[test]
    fn row_slots_cover_the_exported_buckets() {
        assert_eq!(row_slot(0), 0);
        assert_eq!(row_slot(ROW_FIRST_SLOT), 0);
        assert_eq!(row_slot(ROW_FIRST_SLOT + 5), 5);
        assert_eq!(row_slot(63), ROW_SLOTS - 1);
        for s in ROW_FIRST_SLOT..ROW_FIRST_SLOT + ROW_SLOTS as u8 {
            assert_eq!(slot_of_row(row_slot(s)), s);
        }
        // 1 µs (slot 10) .. 17.2 s (slot 34), and the slot past it (+Inf), are kept apart.
        assert!(slot_of_row(0) < 10 && slot_of_row(ROW_SLOTS - 1) > 35);
    }

    #[test]
    fn relation_files() {
        assert_eq!(
            parse("base/16384/16385"),
            rel(1663, 16384, 16385, Fork::Main)
        );
        assert_eq!(
            parse("base/16384/16385.12"),
            rel(1663, 16384, 16385, Fork::Main)
        );
        assert_eq!(parse("base/5/2619_fsm"), rel(1663, 5, 2619, Fork::Fsm));
        assert_eq!(parse("base/5/2619_vm"), rel(1663, 5, 2619, Fork::Vm));
        assert_eq!(parse("base/5/16400_init"), rel(1663, 5, 16400, Fork::Init));
        assert_eq!(parse("base/5/2619_fsm.1"), rel(1663, 5, 2619, Fork::Fsm));
        assert_eq!(parse("global/1262"), rel(1664, 0, 1262, Fork::Main));
        assert_eq!(parse("global/1262_vm"), rel(1664, 0, 1262, Fork::Vm));
        assert_eq!(
            parse("pg_tblspc/16390/PG_15_202209061/16384/16391.3"),
            rel(16390, 16384, 16391, Fork::Main)
        );
        assert_eq!(
            parse("pg_tblspc/16390/PG_18_202506291/16384/16391_vm"),
            rel(16390, 16384, 16391, Fork::Vm)
        );
        // A fork letter in the version directory does not carry over.
        assert_eq!(parse("pg_tblspc/1/PG_v/2/3.1"), rel(1, 2, 3, Fork::Main));
    }

    #[test]
    fn wal_and_temporary_files() {
        let class = |s| parse(s).class;
        assert_eq!(
            class("pg_wal/000000010000000000000001"),
            FileClass::Wal as u8
        );
        assert_eq!(class("pg_wal/archive_status/x.ready"), FileClass::Wal as u8);
        assert_eq!(
            class("base/pgsql_tmp/pgsql_tmp1234.0"),
            FileClass::Temp as u8
        );
        assert_eq!(
            class("pg_tblspc/16390/PG_15_202209061/pgsql_tmp/pgsql_tmp77.3"),
            FileClass::Temp as u8
        );
    }

    #[test]
    fn everything_else_is_other() {
        for s in [
            "",
            "base",
            "base/",
            "base/16384",
            "base/16384/",
            "base/16384/16385/x",
            "base/x1/16385",
            "base/16384/16385_xyz",
            "base/16384/16385_fsmX",
            "base/16384/16385.1a",
            "base/16384/16385.",
            "base/16384/abc",
            "base/16384/PG_VERSION",
            "base/16384/pg_filenode.map",
            "global/pg_control",
            "global/",
            "pg_xact/0000",
            "pg_log/postgresql.log",
            "log/postgresql-2026.log",
            "bass/1/2",
            "pg_tblspc/1/PG_v/2/3_x.1",
            "postgresql.auto.conf",
            "/etc/passwd",
            "/srv/pg/base/1/2",
            "pg_tblspc/16390",
            "pg_tblspc/x/PG_15/1/2",
            "a/b/c/d/e/f/g",
            "base/1/2/3/4/5/6/7/8",
        ] {
            assert_eq!(parse(s), RelFile::OTHER, "{s:?}");
        }
    }

    #[test]
    fn huge_numbers_and_cut_paths_stay_in_bounds() {
        assert_eq!(
            parse("base/99999999999/16385").db,
            u32::MAX,
            "saturating, not wrapping"
        );
        let mut long = [b'1'; PATH_MAX_PARSED];
        long[..11].copy_from_slice(b"base/16384/");
        let r = parse_path(&long, PATH_MAX_PARSED);
        assert_eq!(
            (r.class, r.relfilenode),
            (FileClass::Relation as u8, u32::MAX)
        );
        let mut p = [b'/'; PATH_MAX_PARSED];
        assert_eq!(parse_path(&p, PATH_MAX_PARSED), RelFile::OTHER);
        p = [b'9'; PATH_MAX_PARSED];
        assert_eq!(parse_path(&p, usize::MAX), RelFile::OTHER);
    }
}
