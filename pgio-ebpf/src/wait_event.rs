//! Blocked intervals by PostgreSQL's individual wait event (`pgio_common::wait_event` has the
//! rules): no hook of its own. `query_wait` and `role_wait` hand it each interval they book
//! under a wait event type, with the raw event read at the block.
use aya_ebpf::{macros::map, maps::HashMap};
use pgio_common::{
    SeriesId,
    wait_event::{QUOTA, WaitEventKey},
};

use crate::hist;

/// Blocked time and intervals per (series, wait event, major); sized as compiled (see the
/// bound in `pgio_common::wait_event`).
#[map]
static WAIT_EVENT_HIST: HashMap<WaitEventKey, pgio_common::hist::Bucket> =
    HashMap::with_max_entries(8_192, 0);

/// `ns` blocked under `info` by a thread of `series` (a process of PostgreSQL `major`).
#[inline(always)]
pub fn book(series: SeriesId, info: u32, major: u8, ns: u64) {
    if series == SeriesId::UNTRACKED {
        return;
    }
    let key = WaitEventKey {
        series,
        info,
        major,
        _pad: [0; 3],
    };
    hist::add(&WAIT_EVENT_HIST, QUOTA, series, &key, ns, 0);
}
