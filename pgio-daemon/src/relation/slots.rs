//! The kernel's fd slots (`RELATION_FDS`): the file each fd of a tracked process names, and
//! the rows of calls the kernel counted on it there (`pgio-ebpf/src/relation.rs`). A row's
//! counts live in the slot until an `openat` takes the slot for another file and folds them
//! into `RELATION_HIST`; so a scrape reads the hash map and the slots as one view, and reads
//! again when a fold ran meanwhile (it would have seen the moved counts twice, or not at all,
//! and the exported counters would step back at the next scrape). A consistent view is then
//! served never below what was shown (`served`). When folds keep coming for every try (an
//! `openat` storm on slots with counts), the scrape serves what it showed last instead, less
//! the series freed since: stale for a scrape, never smaller
//! (`pgio_inconsistent_reads_total` counts those scrapes).
use std::{collections::BTreeMap, thread, time::Duration};

use anyhow::{Context, Result, bail};
use aya::{
    Ebpf,
    maps::{Array, IterableMap, MapData},
};
use pgio_common::{
    SeriesId,
    hist::Bucket,
    relation::{FOLDS_FINISHED, FOLDS_STARTED, FdRow, FdSlot, RelFile, RelationKey, slot_of_row},
    syscall::{Cache, RowTag, Syscall},
};
use tracing::warn;

use super::{RelationId, served};
use crate::{
    hist::Hists,
    maps::{MappedValues, take_map},
    provisional::{Provisional, Route},
};

/// Reads of one view before giving up on a quiet moment (a fold takes microseconds; only an
/// `openat` storm on slots with counts keeps them coming).
const TRIES: u32 = 8;

pub struct Slots {
    /// For writes (`open_files`).
    pub fds: Array<MapData, FdSlot>,
    /// The same array mapped read-only (it is mmapable), for reads.
    view: MappedValues,
    entries: u32,
    folds: Array<MapData, u64>,
    /// What the last scrape served, and the generation of each of its series then (a series
    /// freed since is left out of it).
    shown: Hists<RelationId>,
    generations: BTreeMap<SeriesId, u32>,
    /// Scrapes that got `last_consistent` because folds kept coming.
    pub inconsistent_reads: u64,
}

impl Slots {
    pub fn take(ebpf: &mut Ebpf) -> Result<Slots> {
        let fds: Array<MapData, FdSlot> = take_map(ebpf, "RELATION_FDS")?;
        let info = fds.map().info().context("map RELATION_FDS: info")?;
        let entries = info.max_entries();
        if info.value_size() as usize != size_of::<FdSlot>() {
            bail!(
                "map RELATION_FDS: value size {}, not {}",
                info.value_size(),
                size_of::<FdSlot>()
            );
        }
        let view = MappedValues::new(
            fds.map(),
            "RELATION_FDS",
            size_of::<FdSlot>(),
            entries,
            false,
        )?;
        Ok(Slots {
            fds,
            view,
            entries,
            folds: take_map(ebpf, "RELATION_FOLDS")?,
            shown: Hists::new(),
            generations: BTreeMap::new(),
            inconsistent_reads: 0,
        })
    }

    /// A copy of slot `i` as the kernel left it.
    fn slot(&self, i: u32) -> Option<FdSlot> {
        // SAFETY: below `entries`, so within the mapping; FdSlot is plain integers. Volatile:
        // the kernel writes it meanwhile (see `read_with`).
        (i < self.entries).then(|| unsafe {
            std::ptr::read_volatile(self.view.as_ptr::<FdSlot>().add(i as usize))
        })
    }

    fn folds(&self, which: u32) -> u64 {
        self.folds.get(&which, 0).unwrap_or(0)
    }

    /// `read_map()` (the hash maps' histograms) plus the slots' rows, with no fold between
    /// the first read and the last, served never below what was shown; else what was shown
    /// (see the module doc).
    pub fn read_with(
        &mut self,
        routes: &Provisional,
        read_map: impl Fn() -> Hists<RelationId>,
    ) -> Hists<RelationId> {
        for attempt in 0..TRIES {
            let finished = self.folds(FOLDS_FINISHED);
            let started = self.folds(FOLDS_STARTED);
            if started != finished {
                if attempt + 1 < TRIES {
                    thread::sleep(Duration::from_micros(200));
                }
                continue;
            }
            let mut view = read_map();
            self.add_rows(routes, &mut view);
            if self.folds(FOLDS_STARTED) == started {
                self.forget_freed(routes);
                let view = served::at_least_shown(view, &self.shown);
                self.generations = view
                    .keys()
                    .map(|id| (id.series, routes.generation(id.series)))
                    .collect();
                self.shown = view.clone();
                return view;
            }
        }
        self.inconsistent_reads += 1;
        if self.inconsistent_reads == 1 {
            warn!(
                tries = TRIES,
                "relation rows: fd slots kept being taken while read; serving what \
                 was shown last (pgio_inconsistent_reads_total counts each such scrape)"
            );
        }
        self.forget_freed(routes);
        self.shown.clone()
    }

    /// Leaves out of what was shown the series freed since (or freed and given out again).
    fn forget_freed(&mut self, routes: &Provisional) {
        let generations = &self.generations;
        self.shown.retain(|id, _| {
            generations.get(&id.series) == Some(&routes.generation(id.series))
                && !routes.retired.contains(&id.series)
        });
    }

    /// Adds the rows of live series to `out`, under their slot's file.
    fn add_rows(&self, routes: &Provisional, out: &mut Hists<RelationId>) {
        for i in 0..self.entries {
            let Some(slot) = self.slot(i) else {
                continue;
            };
            for row in &slot.rows {
                let Some(id) = live_row(row, slot.file, routes) else {
                    continue;
                };
                let h = out.entry(id).or_default();
                for (i, count) in row.slots.iter().enumerate() {
                    if *count != 0 {
                        let b = Bucket {
                            count: *count,
                            sum: 0,
                            bytes: 0,
                        };
                        h.add(slot_of_row(i), &b);
                    }
                }
                h.sum_ns = h.sum_ns.wrapping_add(row.sum);
                h.bytes = h.bytes.wrapping_add(row.bytes);
            }
        }
    }
}

/// The histogram a row counts for, if it holds a live series' calls.
fn live_row(row: &FdRow, file: RelFile, routes: &Provisional) -> Option<RelationId> {
    let t = RowTag::decode(row.tag)?;
    if t.generation != routes.generation(t.series) || routes.route(t.series) != Route::Own {
        return None;
    }
    Some(RelationId {
        series: t.series,
        file,
        syscall: Syscall::try_from(t.syscall).ok()?,
        cache: Cache::try_from(t.cache).ok()?,
    })
}

/// The counts of a slot's live rows as `RELATION_HIST` keys, for userspace to book before it
/// writes the slot (`open_files`): what the kernel's fold does when an `openat` takes it.
pub fn row_keys(slot: &FdSlot, generation: impl Fn(SeriesId) -> u32) -> Vec<(RelationKey, Bucket)> {
    let mut out = Vec::new();
    for row in &slot.rows {
        let Some(t) = RowTag::decode(row.tag) else {
            continue;
        };
        if t.generation != generation(t.series) {
            continue;
        }
        let (mut sum, mut bytes) = (row.sum, row.bytes);
        for (i, count) in row.slots.iter().enumerate() {
            if *count == 0 {
                continue;
            }
            let key = RelationKey {
                series: t.series,
                file: slot.file,
                syscall: t.syscall,
                cache: t.cache,
                slot: slot_of_row(i),
                _pad: 0,
            };
            out.push((
                key,
                Bucket {
                    count: *count,
                    sum,
                    bytes,
                },
            ));
            (sum, bytes) = (0, 0);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use pgio_common::relation::{FdRow, Fork, ROW_SLOTS, row_slot};

    fn row(series: u32, generation: u32, calls: &[(u64, u64)]) -> FdRow {
        let mut r = FdRow {
            tag: RowTag {
                series: SeriesId(series),
                generation,
                syscall: Syscall::Pread64 as u8,
                cache: Cache::Hit as u8,
            }
            .encode(),
            ..FdRow::default()
        };
        for (ns, bytes) in calls {
            r.slots[row_slot(pgio_common::hist::slot(*ns))] += 1;
            r.sum += ns;
            r.bytes += bytes;
        }
        r
    }

    #[test]
    fn a_live_row_becomes_keys_with_its_sum_once_and_a_stale_one_none() {
        let mut slot = FdSlot {
            tag: 1,
            file: RelFile::relation(1663, 5, 16385, Fork::Main),
            ..FdSlot::default()
        };
        slot.rows[0] = row(3, 0, &[(1_500, 8192), (1_600, 8192), (900_000, 8192)]);
        slot.rows[1] = row(4, 0, &[(2_000, 8192)]);
        let keys = row_keys(&slot, |s| if s.0 == 4 { 1 } else { 0 });
        assert_eq!(
            keys.len(),
            2,
            "two slots of series 3; series 4's row is stale"
        );
        let count: u64 = keys.iter().map(|(_, b)| b.count).sum();
        let sum: u64 = keys.iter().map(|(_, b)| b.sum).sum();
        let bytes: u64 = keys.iter().map(|(_, b)| b.bytes).sum();
        assert_eq!((count, sum, bytes), (3, 903_100, 3 * 8192));
        assert!(
            keys.iter()
                .all(|(k, _)| k.file == slot.file && k.series.0 == 3)
        );
        assert_eq!(keys[0].0.slot, 11, "1.5 µs is in (1024, 2048] ns");
    }

    #[test]
    fn rows_of_freed_ids_and_untagged_rows_are_not_read() {
        let file = RelFile::OTHER;
        let routes = Provisional::default();
        assert!(live_row(&FdRow::default(), file, &routes).is_none());
        assert!(live_row(&row(3, 0, &[(1_000, 0)]), file, &routes).is_some());
        assert!(live_row(&row(3, 1, &[(1_000, 0)]), file, &routes).is_none());
        assert_eq!(ROW_SLOTS, 32);
    }
}
