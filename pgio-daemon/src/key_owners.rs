//! Who owns each series' histogram keys (`key_quota`): the uid of the process it was made
//! for, read once when the id is given out, or `EXEMPT` for the series pgio bounds itself.
//! Discovery keeps it as it gives ids out; the kernel reads it from `SERIES_OWNER` when an
//! event needs a new key.
use std::collections::HashMap;

use anyhow::Result;
use aya::{
    Ebpf,
    maps::{Array, MapData},
};
use pgio_common::{
    SeriesId,
    key_quota::{EXEMPT, FIRST_UID_SLOT, OWNER_SLOTS, PROVISIONAL},
};

use crate::maps::take_map;

pub(crate) const SLOTS: usize = OWNER_SLOTS as usize;
/// Shared by every uid beyond the first 253.
pub(crate) const OTHER_UIDS: u8 = (OWNER_SLOTS - 1) as u8;
/// A series whose process was gone before its uid could be read.
const UNKNOWN_UID: u32 = u32::MAX;

pub const SERIES_OWNER_MAP: &str = "SERIES_OWNER";

/// Owner slots of series ids, kept by discovery as it gives ids out, mirrored into the
/// kernel's `SERIES_OWNER`.
pub struct Owners {
    by_series: Vec<Option<u8>>,
    uids: HashMap<u32, u8>,
    slot_uid: Vec<Option<u32>>,
    /// Series per slot.
    refs: Vec<u32>,
    kernel: Option<Array<MapData, u8>>,
}

impl Default for Owners {
    fn default() -> Owners {
        Owners {
            by_series: Vec::new(),
            uids: HashMap::new(),
            slot_uid: vec![None; SLOTS],
            refs: vec![0; SLOTS],
            kernel: None,
        }
    }
}

/// Whom a new series' keys count against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyOwner {
    /// The uid running this process (if it is still there).
    Pid(u32),
    /// Never refused: pgio bounds its keys.
    Exempt,
}

impl std::fmt::Debug for Owners {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Owners")
            .field("uids", &self.uids)
            .field("kernel", &self.kernel.is_some())
            .finish_non_exhaustive()
    }
}

impl Owners {
    /// Mirrors assignments into the kernel from now on.
    pub fn attach(&mut self, ebpf: &mut Ebpf) -> Result<()> {
        self.kernel = Some(take_map(ebpf, SERIES_OWNER_MAP)?);
        Ok(())
    }

    pub fn is_assigned(&self, id: SeriesId) -> bool {
        self.by_series
            .get(id.0 as usize)
            .is_some_and(Option::is_some)
    }

    /// Gives `id` its owner's slot; `Err` if the kernel could not be told (the series then
    /// counts as exempt there).
    pub fn assign(&mut self, id: SeriesId, owner: KeyOwner) -> Result<(), aya::maps::MapError> {
        let slot = match owner {
            KeyOwner::Exempt => EXEMPT,
            KeyOwner::Pid(pid) => self.slot_for(uid_of(pid).unwrap_or(UNKNOWN_UID)),
        };
        let i = id.0 as usize;
        if self.by_series.len() <= i {
            self.by_series.resize(i + 1, None);
        }
        if let Some(old) = self.by_series[i].replace(slot) {
            self.unref(old);
        }
        self.refs[slot as usize] += 1;
        match self.kernel.as_mut() {
            Some(k) => k.set(id.0, slot, 0),
            None => Ok(()),
        }
    }

    /// `id` was freed.
    pub fn release(&mut self, id: SeriesId) {
        if let Some(slot) = self.by_series.get_mut(id.0 as usize).and_then(Option::take) {
            self.unref(slot);
        }
    }

    fn unref(&mut self, slot: u8) {
        let s = slot as usize;
        self.refs[s] = self.refs[s].saturating_sub(1);
        if self.refs[s] == 0
            && slot != OTHER_UIDS
            && let Some(uid) = self.slot_uid[s].take()
        {
            self.uids.remove(&uid);
        }
    }

    fn slot_for(&mut self, uid: u32) -> u8 {
        if let Some(s) = self.uids.get(&uid) {
            return *s;
        }
        // The lowest free slot: the one `plan` gave a newcomer's allowance.
        let Some(s) = (FIRST_UID_SLOT..OTHER_UIDS).find(|s| self.slot_uid[*s as usize].is_none())
        else {
            return OTHER_UIDS;
        };
        self.slot_uid[s as usize] = Some(uid);
        self.uids.insert(uid, s);
        s
    }

    /// Slot of each series id, which slots have series, and their names.
    pub fn snapshot(&self) -> OwnerTable {
        let mut live: Vec<bool> = self.refs.iter().map(|r| *r > 0).collect();
        live[PROVISIONAL as usize] = true;
        OwnerTable {
            by_series: self.by_series.iter().map(|s| s.unwrap_or(EXEMPT)).collect(),
            live,
            names: (0..SLOTS).map(|s| self.name(s as u8)).collect(),
        }
    }

    fn name(&self, slot: u8) -> String {
        match slot {
            EXEMPT => "exempt".into(),
            PROVISIONAL => "provisional".into(),
            OTHER_UIDS => "other_uids".into(),
            s => match self.slot_uid[s as usize] {
                Some(UNKNOWN_UID) => "unknown".into(),
                Some(uid) => uid.to_string(),
                None => "free".into(),
            },
        }
    }
}

fn uid_of(pid: u32) -> Option<u32> {
    procfs::process::Process::new(pid as i32).ok()?.uid().ok()
}

/// The owners as the once-a-second balance sees them.
pub struct OwnerTable {
    by_series: Vec<u8>,
    /// Slots that have series.
    pub live: Vec<bool>,
    /// Each slot's `owner` label.
    pub names: Vec<String>,
}

impl OwnerTable {
    pub fn owner_of(&self, series: SeriesId) -> u8 {
        if series.is_provisional() {
            return PROVISIONAL;
        }
        self.by_series
            .get(series.0 as usize)
            .copied()
            .unwrap_or(EXEMPT)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uids_get_slots_that_are_freed_with_their_last_series() {
        let mut o = Owners::default();
        let me = std::process::id();
        o.assign(SeriesId(1), KeyOwner::Pid(me)).expect("no kernel");
        o.assign(SeriesId(2), KeyOwner::Pid(me)).expect("no kernel");
        o.assign(SeriesId(3), KeyOwner::Exempt).expect("no kernel");
        let t = o.snapshot();
        assert_eq!(t.owner_of(SeriesId(1)), FIRST_UID_SLOT);
        assert_eq!(t.owner_of(SeriesId(2)), FIRST_UID_SLOT);
        assert_eq!(t.owner_of(SeriesId(3)), EXEMPT);
        assert_eq!(t.owner_of(SeriesId::provisional(42)), PROVISIONAL);
        assert_eq!(t.owner_of(SeriesId(99)), EXEMPT, "never given out");
        let uid = uid_of(me).expect("own uid");
        assert_eq!(t.names[FIRST_UID_SLOT as usize], uid.to_string());
        o.release(SeriesId(1));
        assert!(o.snapshot().live[FIRST_UID_SLOT as usize]);
        o.release(SeriesId(2));
        assert!(!o.snapshot().live[FIRST_UID_SLOT as usize]);
        // A pid that is gone: an unknown uid, in the freed slot.
        o.assign(SeriesId(4), KeyOwner::Pid(u32::MAX - 1))
            .expect("no kernel");
        assert_eq!(o.snapshot().names[FIRST_UID_SLOT as usize], "unknown");
    }
}
