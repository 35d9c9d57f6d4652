//! Syscalls timed enter → exit per thread.

use crate::SeriesId;

/// Every syscall pgio times. The discriminant indexes [`Syscall::ALL`].
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Syscall {
    Pread64 = 0,
    Preadv = 1,
    Preadv2 = 2,
    Pwrite64 = 3,
    Pwritev = 4,
    Pwritev2 = 5,
    Fsync = 6,
    Fdatasync = 7,
    IoUringEnter = 8,
    Futex = 9,
    FutexWaitv = 10,
}

pub const SYSCALLS: usize = 11;

impl Syscall {
    pub const ALL: [Syscall; SYSCALLS] = [
        Syscall::Pread64,
        Syscall::Preadv,
        Syscall::Preadv2,
        Syscall::Pwrite64,
        Syscall::Pwritev,
        Syscall::Pwritev2,
        Syscall::Fsync,
        Syscall::Fdatasync,
        Syscall::IoUringEnter,
        Syscall::Futex,
        Syscall::FutexWaitv,
    ];

    /// Name as in the tracepoints `syscalls/sys_{enter,exit}_<name>` and the `syscall` label.
    pub const fn name(self) -> &'static str {
        match self {
            Syscall::Pread64 => "pread64",
            Syscall::Preadv => "preadv",
            Syscall::Preadv2 => "preadv2",
            Syscall::Pwrite64 => "pwrite64",
            Syscall::Pwritev => "pwritev",
            Syscall::Pwritev2 => "pwritev2",
            Syscall::Fsync => "fsync",
            Syscall::Fdatasync => "fdatasync",
            Syscall::IoUringEnter => "io_uring_enter",
            Syscall::Futex => "futex",
            Syscall::FutexWaitv => "futex_waitv",
        }
    }

    pub fn from_u8(v: u8) -> Option<Syscall> {
        Syscall::ALL.get(v as usize).copied()
    }

    /// futex waits: timed, but not IO.
    pub const fn is_wait(self) -> bool {
        matches!(self, Syscall::Futex | Syscall::FutexWaitv)
    }

    /// Reads get a `cache` label: hit unless the thread started block IO during the call.
    pub const fn is_read(self) -> bool {
        matches!(self, Syscall::Pread64 | Syscall::Preadv | Syscall::Preadv2)
    }
}

/// Page-cache outcome of a read syscall.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Cache {
    /// Not a read syscall.
    None = 0,
    Hit = 1,
    Miss = 2,
}

impl Cache {
    pub fn from_u8(v: u8) -> Cache {
        match v {
            1 => Cache::Hit,
            2 => Cache::Miss,
            _ => Cache::None,
        }
    }

    pub const fn label(self) -> &'static str {
        match self {
            Cache::None => "",
            Cache::Hit => "hit",
            Cache::Miss => "miss",
        }
    }
}

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

/// Value of the per-thread `SYSCALL_START` map.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct SyscallStart {
    pub start_ns: u64,
    pub series: SeriesId,
    pub syscall: u8,
    /// Set by `block_io_start` when this thread submits a block request during the call.
    pub block_io: u8,
    pub _pad: u16,
}

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
    fn names_index_all() {
        for (i, s) in Syscall::ALL.iter().enumerate() {
            assert_eq!(*s as usize, i);
            assert_eq!(Syscall::from_u8(i as u8), Some(*s));
        }
        assert_eq!(Syscall::from_u8(SYSCALLS as u8), None);
    }
}
