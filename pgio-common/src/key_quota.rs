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

/// A histogram map under quota: its place in `KEY_ALLOWANCE` and `KEY_REFUSED`. Each family
/// with a histogram map declares its own (`<family>::QUOTA`); the daemon checks that its
/// families' are distinct and dense, and sizes both arrays for them at load.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct QuotaMap(pub u32);

/// Histogram maps the object's quota arrays have room for as compiled (the loader shrinks
/// them to the families present).
pub const QUOTA_MAPS: u32 = 8;

/// Index of (map, owner) in `KEY_ALLOWANCE`.
#[inline(always)]
pub const fn allowance_index(map: QuotaMap, owner: u8) -> u32 {
    map.0 * OWNER_SLOTS + owner as u32
}
