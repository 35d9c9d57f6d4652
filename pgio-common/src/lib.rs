//! Types shared by the eBPF programs (`pgio-ebpf`) and the daemon (`pgio-daemon`).
//!
//! Every map key and value is `#[repr(C)]` with explicit padding so both sides agree on the
//! layout byte for byte. Module names follow the data path: each probe family has the same
//! name here, in `pgio-ebpf` and in `pgio-daemon`.
#![no_std]

#[macro_use]
pub mod abi;
pub mod block_io;
pub mod drops;
pub mod hist;
pub mod io_worker;
pub mod kernel_offsets;
pub mod key_quota;
pub mod lifecycle;
pub mod query;
pub mod query_id;
pub mod query_wait;
pub mod queue_blame;
pub mod relation;
pub mod role_wait;
pub mod syscall;
pub mod wait_event;

/// Largest tgid the `tgid → series` array (`TRACKED`) reaches as compiled: the kernel's
/// PID_MAX_LIMIT (2^22). The loader shrinks it to this node's `/proc/sys/kernel/pid_max`.
pub const PID_MAX_LIMIT: u32 = 1 << 22;

/// `TRACKED` holds one u16 a tgid, four to an 8-byte array value: an array rounds every value
/// up to 8 bytes, so a `SeriesId` (u32) a tgid took 8 bytes, 32 MiB at the pid_max of 4194304
/// that systemd sets; this takes 8 MiB. Read as memory (little-endian) it is a flat u16 array
/// indexed by tgid, which is how userspace writes it (mmap).
pub const TRACKED_PER_ENTRY: u32 = 4;

/// `TRACKED` entries for tgids below `pid_max`.
pub const fn tracked_entries(pid_max: u32) -> u32 {
    pid_max.div_ceil(TRACKED_PER_ENTRY)
}

/// Size of the `series → children are provisional` array: children of series ids beyond it
/// inherit their parent's series.
pub const CHILD_SERIES_MAX: u32 = 1 << 16;

/// A series: one label set of processes (app, role, database, …), never a pid. Userspace
/// gives each distinct label set an id and writes `tgid → id` into the kernel's `TRACKED`
/// map; histograms are keyed by it.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeriesId(pub u32);

impl SeriesId {
    /// Anything pgio does not track (block IO of untracked submitters).
    pub const UNTRACKED: SeriesId = SeriesId(0);

    /// Set in a freshly forked process's own provisional series, `PROVISIONAL | tgid`: the
    /// kernel books its events there until userspace has classified it, then userspace adds
    /// them to the series it was classified as.
    const PROVISIONAL: u32 = 1 << 31;

    #[inline(always)]
    pub const fn provisional(tgid: u32) -> SeriesId {
        SeriesId(Self::PROVISIONAL | tgid)
    }

    #[inline(always)]
    pub const fn is_provisional(self) -> bool {
        self.0 & Self::PROVISIONAL != 0
    }

    /// The process a provisional series belongs to.
    #[inline(always)]
    pub const fn provisional_tgid(self) -> u32 {
        self.0 & !Self::PROVISIONAL
    }

    #[inline(always)]
    pub const fn is_tracked(self) -> bool {
        self.0 != Self::UNTRACKED.0
    }

    /// `TRACKED`'s u16 for process `tgid` in this series: the id itself, or `OWN_PROVISIONAL`
    /// for its own provisional series. `None`: not representable (an id of `OWN_PROVISIONAL`
    /// or more, which the series cap rules out, or another process's provisional series).
    #[inline(always)]
    pub const fn tracked_slot(self, tgid: u32) -> Option<u16> {
        if self.is_provisional() {
            return if self.provisional_tgid() == tgid {
                Some(Self::OWN_PROVISIONAL)
            } else {
                None
            };
        }
        if self.0 >= Self::OWN_PROVISIONAL as u32 {
            return None;
        }
        Some(self.0 as u16)
    }

    /// The series `TRACKED`'s u16 `v` of process `tgid` names.
    #[inline(always)]
    pub const fn from_tracked_slot(tgid: u32, v: u16) -> SeriesId {
        if v == Self::OWN_PROVISIONAL {
            SeriesId::provisional(tgid)
        } else {
            SeriesId(v as u32)
        }
    }

    /// `TRACKED`'s u16 of a process in its own provisional series.
    const OWN_PROVISIONAL: u16 = u16::MAX;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tracked_slots_round_trip_and_refuse_what_they_cannot_hold() {
        for (tgid, s) in [
            (7, SeriesId::UNTRACKED),
            (7, SeriesId(1)),
            (4_194_303, SeriesId(0xfffe)),
            (4_194_303, SeriesId::provisional(4_194_303)),
        ] {
            let v = s.tracked_slot(tgid).unwrap();
            assert_eq!(SeriesId::from_tracked_slot(tgid, v), s);
        }
        assert_eq!(SeriesId(0xffff).tracked_slot(1), None);
        assert_eq!(SeriesId::provisional(2).tracked_slot(1), None);
        assert_eq!(tracked_entries(32_768), 8_192);
        assert_eq!(tracked_entries(32_769), 8_193);
    }
}

abi_size!(SeriesId, 4, 4);

abi_pod!(SeriesId);
