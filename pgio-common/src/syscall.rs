//! Syscalls timed enter → exit per thread.

use crate::SeriesId;

crate::abi_enum! {
    /// Every syscall pgio times; `name()` is the tracepoints' `syscalls/sys_{enter,exit}_<name>`
    /// and the `syscall` label. The discriminant indexes [`Syscall::ALL`].
    pub enum Syscall: u8 {
        Pread64 = 0 => "pread64",
        Preadv = 1 => "preadv",
        Preadv2 = 2 => "preadv2",
        Pwrite64 = 3 => "pwrite64",
        Pwritev = 4 => "pwritev",
        Pwritev2 = 5 => "pwritev2",
        Fsync = 6 => "fsync",
        Fdatasync = 7 => "fdatasync",
        IoUringEnter = 8 => "io_uring_enter",
        Futex = 9 => "futex",
        FutexWaitv = 10 => "futex_waitv",
    }
}

impl Syscall {
    /// futex waits: timed, but not IO.
    pub const fn is_wait(self) -> bool {
        matches!(self, Syscall::Futex | Syscall::FutexWaitv)
    }

    /// Reads get a `cache` label: hit unless the thread started block IO during the call.
    pub const fn is_read(self) -> bool {
        matches!(self, Syscall::Pread64 | Syscall::Preadv | Syscall::Preadv2)
    }

    /// Its return value is bytes read or written.
    pub const fn moves_bytes(self) -> bool {
        matches!(
            self,
            Syscall::Pread64
                | Syscall::Preadv
                | Syscall::Preadv2
                | Syscall::Pwrite64
                | Syscall::Pwritev
                | Syscall::Pwritev2
        )
    }
}

crate::abi_enum! {
    /// Page-cache outcome of a read syscall (the `cache` label; empty: not a read).
    pub enum Cache: u8 {
        /// Not a read syscall.
        None = 0 => "",
        Hit = 1 => "hit",
        Miss = 2 => "miss",
    }
}

/// `syscall`'s histogram map in the key quota (`KEY_ALLOWANCE`).
pub const QUOTA: crate::key_quota::QuotaMap = crate::key_quota::QuotaMap(1);

/// Key of the `SYSCALL_HIST` map.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SyscallKey {
    pub series: SeriesId,
    pub syscall: u8,
    pub cache: u8,
    pub slot: u8,
    pub _pad: u8,
}

/// A timed syscall's start: in its CPU's `SYSCALL_CPU` while the thread runs there, moved
/// into `SYSCALL_SPILLED` (by thread id) when the thread is switched out mid-call.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct SyscallStart {
    pub start_ns: u64,
    pub series: SeriesId,
    pub syscall: u8,
    /// Set by `block_io_start` when this thread submits a block request during the call.
    pub block_io: u8,
    /// The call's file descriptor, for the relation family (`relation::FD_UNKNOWN`: none).
    pub fd: u16,
}

/// Value of the per-CPU `SYSCALL_CPU`: the thread running on this CPU and its tracked syscall
/// in progress. `sched_switch` clears the ids (the next program asks the kernel once) and
/// moves an outgoing thread's pending start into `SYSCALL_SPILLED`: between a thread's enter
/// and exit no other thread runs on the CPU unless the scheduler switches.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuSyscall {
    /// The running thread; 0 (the idle task, which makes no syscalls): not asked since the
    /// last switch.
    pub tid: u32,
    pub tgid: u32,
    /// Nonzero: the running thread entered a tracked syscall on this CPU and has not been
    /// switched out since; `start` is that call's (`start.start_ns == 0`: not timed, a
    /// futex wake).
    pub open: u32,
    pub _pad: u32,
    pub start: SyscallStart,
}

/// Rows of the dense per-CPU `SYSCALL_ROWS_MAP` array at most: the histograms of the hottest
/// (series, syscall, cache) triples are counted there with no hashing; a triple whose row
/// another holds on this CPU goes to `SYSCALL_HIST` as before. 256 rows: 135 KiB per CPU.
pub const SYSCALL_ROWS: u32 = 256;

/// What the rows may take on all CPUs together: past ~124 possible CPUs their count halves
/// each time the CPUs double (128: 128 rows, 8.3 MiB; 256: 64).
pub const SYSCALL_ROWS_BUDGET: u64 = 16 << 20;

/// The rows loaded with `cpus` possible CPUs: the largest power of two up to
/// [`SYSCALL_ROWS`] within [`SYSCALL_ROWS_BUDGET`], at least 1.
pub const fn syscall_rows_for(cpus: u32) -> u32 {
    let per_row =
        core::mem::size_of::<SyscallRow>() as u64 * if cpus == 0 { 1 } else { cpus as u64 };
    let mut rows = SYSCALL_ROWS;
    while rows > 1 && rows as u64 * per_row > SYSCALL_ROWS_BUDGET {
        rows /= 2;
    }
    rows
}

/// One histogram of `SYSCALL_ROWS`. `tag` first: a reader that copies the row while the
/// kernel reclaims it sees the old tag (and skips the row) or the new one with zeroed slots.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct SyscallRow {
    /// [`SyscallRow::tag`] of the triple counted here; 0: free.
    pub tag: u64,
    /// Sum of the values (ns), for `_sum`.
    pub sum: u64,
    pub slots: [u64; crate::hist::SLOTS],
}

/// A row tag's fields: (series, generation, syscall, cache).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowTag {
    /// Below [`crate::CHILD_SERIES_MAX`] (2^16): the ids userspace gives out.
    pub series: SeriesId,
    /// `SYSCALL_ROW_GEN[series]` when the row was claimed: a freed series id's generation
    /// moves on, so its rows are stale before the id is given out again. 32 bits: a row left
    /// stale on some CPU cannot come back to life by wrapping.
    pub generation: u32,
    pub syscall: u8,
    pub cache: u8,
}

impl RowTag {
    /// Never 0 (bit 0 is set).
    #[inline(always)]
    pub const fn encode(self) -> u64 {
        ((self.series.0 & 0xffff) as u64) << 48
            | (self.generation as u64) << 16
            | (self.syscall as u64) << 8
            | ((self.cache & 0xf) as u64) << 4
            | 1
    }

    pub const fn decode(tag: u64) -> Option<RowTag> {
        if tag & 1 == 0 {
            return None;
        }
        Some(RowTag {
            series: SeriesId((tag >> 48) as u32),
            generation: (tag >> 16) as u32,
            syscall: (tag >> 8) as u8,
            cache: ((tag >> 4) & 0xf) as u8,
        })
    }

    /// The row this triple may take of `rows` (a power of two): a multiplicative hash, so a
    /// series' syscalls and consecutive series ids spread over the rows. The generation is
    /// left out: a reused id's triple reclaims its own stale row.
    #[inline(always)]
    pub const fn row(self, rows: u32) -> u32 {
        let x = ((self.series.0 as u64) << 8 | (self.syscall as u64) << 2 | self.cache as u64)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15);
        (x >> 32) as u32 & rows.wrapping_sub(1)
    }
}

crate::abi_size!(SyscallKey, 8, 4);
crate::abi_size!(SyscallStart, 16, 8);
crate::abi_size!(CpuSyscall, 32, 8);
crate::abi_size!(SyscallRow, 528, 8);
crate::abi_pod!(SyscallKey, SyscallStart, CpuSyscall, SyscallRow);

/// futex(2) commands that wait (after masking PRIVATE and CLOCK_REALTIME): WAIT,
/// LOCK_PI, WAIT_BITSET, WAIT_REQUEUE_PI, LOCK_PI2. glibc's `sem_wait` (Postgres
/// semaphores) is WAIT_BITSET|CLOCK_REALTIME, which must count.
#[inline(always)]
pub fn futex_op_waits(op: u32) -> bool {
    const FUTEX_PRIVATE_FLAG: u32 = 128;
    const FUTEX_CLOCK_REALTIME: u32 = 256;
    let cmd = op & !(FUTEX_PRIVATE_FLAG | FUTEX_CLOCK_REALTIME);
    matches!(cmd, 0 | 6 | 9 | 11 | 13)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn futex_wait_ops() {
        assert!(futex_op_waits(0)); // FUTEX_WAIT
        assert!(futex_op_waits(128)); // FUTEX_WAIT_PRIVATE
        assert!(futex_op_waits(9 | 128 | 256)); // sem_wait: WAIT_BITSET|PRIVATE|CLOCK_REALTIME
        assert!(futex_op_waits(6)); // LOCK_PI
        assert!(futex_op_waits(13)); // LOCK_PI2
        assert!(futex_op_waits(11)); // WAIT_REQUEUE_PI
        assert!(!futex_op_waits(1)); // WAKE
        assert!(!futex_op_waits(1 | 128)); // WAKE_PRIVATE
        assert!(!futex_op_waits(10)); // WAKE_BITSET
        assert!(!futex_op_waits(5)); // WAKE_OP
        assert!(!futex_op_waits(7)); // UNLOCK_PI
    }

    #[test]
    fn row_tags_round_trip_and_rows_spread() {
        let t = RowTag {
            series: SeriesId(65_535),
            generation: u32::MAX,
            syscall: Syscall::Preadv2 as u8,
            cache: Cache::Miss as u8,
        };
        assert_ne!(t.encode(), 0);
        assert_eq!(RowTag::decode(t.encode()), Some(t));
        assert_eq!(RowTag::decode(0), None);
        // 40 series × pread64 hit/miss + futex: 120 triples take at least 90 distinct rows.
        let mut taken = [false; SYSCALL_ROWS as usize];
        for s in 1..=40 {
            for (sc, c) in [
                (Syscall::Pread64, Cache::Hit),
                (Syscall::Pread64, Cache::Miss),
                (Syscall::Futex, Cache::None),
            ] {
                let t = RowTag {
                    series: SeriesId(s),
                    generation: 0,
                    syscall: sc as u8,
                    cache: c as u8,
                };
                assert!(t.row(SYSCALL_ROWS) < SYSCALL_ROWS);
                taken[t.row(SYSCALL_ROWS) as usize] = true;
                assert!(t.row(64) < 64 && t.row(1) == 0);
            }
        }
        let rows = taken.iter().filter(|t| **t).count();
        assert!(rows >= 90, "{rows} rows");
    }

    #[test]
    fn rows_follow_possible_cpus_within_the_budget() {
        assert_eq!(syscall_rows_for(2), 256);
        assert_eq!(syscall_rows_for(64), 256);
        assert_eq!(syscall_rows_for(128), 128);
        assert_eq!(syscall_rows_for(256), 64);
        assert_eq!(syscall_rows_for(1 << 20), 1);
        for cpus in [1, 2, 96, 124, 125, 128, 200, 4096] {
            let rows = syscall_rows_for(cpus);
            assert!(rows.is_power_of_two());
            assert!(rows == 1 || u64::from(rows) * 528 * u64::from(cpus) <= SYSCALL_ROWS_BUDGET);
        }
    }

    #[test]
    fn names_index_all() {
        for (i, s) in Syscall::ALL.iter().enumerate() {
            assert_eq!(*s as usize, i);
            assert_eq!(Syscall::try_from(i as u8), Ok(*s));
        }
        let n = Syscall::ALL.len() as u8;
        assert_eq!(
            Syscall::try_from(n),
            Err(crate::abi::UnknownValue(n.into()))
        );
    }
}
