//! How many new keys each owner may still create in each histogram map, so that no one owner
//! (an unprivileged user's made-up cluster, say) can fill a map while others need keys.
//!
//! Userspace gives every series an owner slot (`SERIES_OWNER`): the uid that runs it, or
//! `EXEMPT` for the bounded series (untracked, overflow); provisional series share
//! `PROVISIONAL`. Once a second it counts each owner's keys, and writes into `KEY_ALLOWANCE`
//! (per CPU) how many new keys each may create until the next count. The kernel looks there
//! only when an event needs a key that does not exist yet.

/// Owner slots per map.
pub const OWNER_SLOTS: u32 = 256;

/// Never refused: series whose keys are bounded by what pgio itself knows (the untracked
/// series, by device; each app's overflow series).
pub const EXEMPT: u8 = 0;
/// Every provisional series (a new process not yet classified).
pub const PROVISIONAL: u8 = 1;
/// The first slot given to a uid; the last one is shared by the uids beyond.
pub const FIRST_UID_SLOT: u8 = 2;

/// The histogram maps under quota.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HistMap {
    BlockIo = 0,
    Syscall = 1,
    Query = 2,
}

pub const HIST_MAPS: u32 = 3;

impl HistMap {
    pub const ALL: [HistMap; HIST_MAPS as usize] =
        [HistMap::BlockIo, HistMap::Syscall, HistMap::Query];

    pub const fn name(self) -> &'static str {
        match self {
            HistMap::BlockIo => "block_io",
            HistMap::Syscall => "syscall",
            HistMap::Query => "query",
        }
    }
}

/// Index of (map, owner) in `KEY_ALLOWANCE`.
#[inline(always)]
pub const fn allowance_index(map: HistMap, owner: u8) -> u32 {
    map as u32 * OWNER_SLOTS + owner as u32
}
