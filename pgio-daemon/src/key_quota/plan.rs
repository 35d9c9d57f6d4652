//! The once-a-second plan of a histogram map's shares (see `key_quota`): allowances for
//! the next second, and evictions when the reservations no longer fit.
use pgio_common::key_quota::FIRST_UID_SLOT;

use crate::key_owners::{OTHER_UIDS, SLOTS};

/// One second's allowances and evictions for one map, per owner slot.
#[derive(Debug, PartialEq, Eq)]
pub struct Plan {
    pub allowance: Vec<u32>,
    pub evict: Vec<u32>,
}

/// See the module doc. `entries`: keys per slot now; `live`: slots that have series.
pub fn plan(max_entries: u32, entries: &[u32], live: &[bool]) -> Plan {
    let mut allowance = vec![0u32; SLOTS];
    let mut evict = vec![0u32; SLOTS];
    let room = (u64::from(max_entries) * 7 / 8).saturating_sub(u64::from(entries[0]));
    let owners: Vec<usize> = (1..SLOTS).filter(|&s| live[s] || entries[s] > 0).collect();
    let n = owners.len().max(1) as u64;
    let fair = room / n;
    let e = |s: usize| u64::from(entries[s]);
    // What each owner below its share may add by the next plan: half again what it has (at
    // least 1/16 of the map: a cluster starting up), up to its share. Room nobody reserves is
    // shared out below.
    let reserve = |s: usize| {
        let headroom = (e(s) / 2).max(u64::from(max_entries) / 16);
        (e(s) + headroom).min(fair).saturating_sub(e(s))
    };
    let total: u64 = owners.iter().map(|&s| e(s)).sum();
    let reserved: u64 = owners.iter().map(|&s| reserve(s)).sum();
    let needed = (total + reserved).saturating_sub(room);
    if needed > 0 {
        // Only owners above their share give back, in proportion to their excess, never
        // below it; their excess always covers what is needed.
        let excess: u64 = owners.iter().map(|&s| e(s).saturating_sub(fair)).sum();
        for &s in &owners {
            let x = e(s).saturating_sub(fair);
            evict[s] = (needed * x).div_ceil(excess.max(1)).min(x) as u32;
        }
    }
    let kept: u64 = owners.iter().map(|&s| e(s) - u64::from(evict[s])).sum();
    let spare = room.saturating_sub(kept + reserved) / n;
    for &s in &owners {
        allowance[s] = (reserve(s) + spare).min(u64::from(u32::MAX)) as u32;
    }
    // A uid seen for the first time before the next plan gets the lowest free slot: give the
    // next few a start out of the eighth left free.
    let grant = max_entries / 32;
    let mut slack = max_entries / 8;
    for s in FIRST_UID_SLOT as usize..OTHER_UIDS as usize {
        if slack < grant || grant == 0 {
            break;
        }
        if !live[s] && entries[s] == 0 {
            allowance[s] = grant;
            slack -= grant;
        }
    }
    Plan { allowance, evict }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn live(slots: &[usize]) -> Vec<bool> {
        let mut l = vec![false; SLOTS];
        for s in slots {
            l[*s] = true;
        }
        l
    }

    fn entries(pairs: &[(usize, u32)]) -> Vec<u32> {
        let mut e = vec![0; SLOTS];
        for (s, n) in pairs {
            e[*s] = *n;
        }
        e
    }

    #[test]
    fn the_allowances_never_add_up_past_seven_eighths() {
        let m = 65_536;
        for e in [
            entries(&[]),
            entries(&[(0, 3_000), (1, 100), (2, 200), (3, 40_000)]),
            entries(&[(1, 5), (2, 57_000), (3, 1)]),
            entries(&[(2, 20_000), (3, 20_000), (4, 17_000)]),
        ] {
            let l = live(&[1, 2, 3, 4]);
            let p = plan(m, &e, &l);
            let kept: u64 = (1..SLOTS).map(|s| u64::from(e[s] - p.evict[s])).sum();
            let owners: u64 = (1..SLOTS)
                .filter(|s| l[*s] || e[*s] > 0)
                .map(|s| u64::from(p.allowance[s]))
                .sum();
            assert!(
                u64::from(e[0]) + kept + owners <= u64::from(m) * 7 / 8,
                "{e:?}: kept {kept} + allowances {owners}"
            );
        }
    }

    #[test]
    fn a_flood_is_evicted_to_its_share_and_the_others_keep_room_to_grow() {
        // Provisional (1), postgres (2) with 3,000 keys, an attacker (3) with the rest.
        let m = 65_536;
        let e = entries(&[(1, 50), (2, 3_000), (3, 54_000)]);
        let p = plan(m, &e, &live(&[1, 2, 3]));
        let fair = (m * 7 / 8) / 3;
        // Postgres and provisional may each add 1/16 of the map.
        let reserved = 4_096 + 4_096;
        let needed = 50 + 3_000 + 54_000 + reserved - m * 7 / 8;
        assert_eq!(p.evict[3], needed);
        assert!(54_000 - p.evict[3] >= fair, "never below its share");
        assert_eq!(p.evict[2], 0);
        assert_eq!(p.evict[1], 0);
        assert_eq!(p.allowance[3], 0);
        assert_eq!(p.allowance[2], 4_096);
        assert_eq!(p.allowance[1], 4_096);
    }

    #[test]
    fn an_owner_above_its_share_keeps_its_keys_while_there_is_room() {
        let m = 65_536;
        let e = entries(&[(0, 500), (1, 10), (2, 300), (3, 30_000)]);
        let p = plan(m, &e, &live(&[1, 2, 3]));
        assert!(p.evict.iter().all(|n| *n == 0));
        let room = u64::from(m) * 7 / 8 - 500;
        let spare = (room - 30_310 - 4_096 - 4_096) / 3;
        assert_eq!(u64::from(p.allowance[3]), spare);
        assert_eq!(u64::from(p.allowance[2]), 4_096 + spare);
        // Exempt keys never get an allowance: the kernel does not ask.
        assert_eq!(p.allowance[0], 0);
    }

    #[test]
    fn a_lone_owner_may_use_seven_eighths() {
        let p = plan(8_192, &entries(&[(2, 1_000)]), &live(&[2]));
        // Provisional is not live here: one owner.
        assert_eq!(p.allowance[2], 7_168 - 1_000);
    }

    #[test]
    fn the_next_free_slots_get_a_newcomers_start() {
        let p = plan(65_536, &entries(&[]), &live(&[1, 2]));
        let grant = 65_536 / 32;
        assert_eq!(p.allowance[3], grant);
        assert_eq!(p.allowance[6], grant);
        assert_eq!(
            p.allowance[7], 0,
            "only an eighth of the map is handed out so"
        );
    }
}
