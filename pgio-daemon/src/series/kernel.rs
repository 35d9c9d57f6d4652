//! The kernel's series maps, which discovery writes together with `Tracked`.
use anyhow::Result;
use aya::{
    Ebpf,
    maps::{Array, MapData, MapError},
};
use pgio_common::SeriesId;

use crate::{
    maps::take_map,
    tracked_map::{TrackedError, TrackedMap},
};

/// The kernel's `TRACKED` (tgid → series) and `CHILD_SERIES` (series → its children start
/// provisional) maps.
pub struct KernelSeries {
    tracked: TrackedMap,
    child: Array<MapData, SeriesId>,
    serves_clients: SeriesBits,
    names_files: SeriesBits,
    serves_backends: SeriesBits,
    books_waits: SeriesBits,
}

/// A kernel bitmap with one bit per series, and what it holds: only changed words are
/// written.
struct SeriesBits {
    map: Array<MapData, u64>,
    words: Vec<u64>,
}

impl SeriesBits {
    fn take(ebpf: &mut Ebpf, name: &str) -> Result<SeriesBits> {
        Ok(SeriesBits {
            map: take_map(ebpf, name)?,
            words: vec![0; pgio_common::query::SERVES_CLIENTS_WORDS as usize],
        })
    }

    fn set(&mut self, series: SeriesId, on: bool) -> Result<(), MapError> {
        let (word, bit) = ((series.0 / 64) as usize, 1u64 << (series.0 % 64));
        let Some(w) = self.words.get_mut(word) else {
            return Ok(()); // beyond the series cap: never a tracked id
        };
        let new = if on { *w | bit } else { *w & !bit };
        if new != *w {
            self.map.set(word as u32, new, 0)?;
            *w = new;
        }
        Ok(())
    }
}

pub const CHILD_SERIES_MAP: &str = "CHILD_SERIES";
/// Bitmap of the series whose processes serve client connections (`pgio_common::query`).
pub const SERVES_CLIENTS_MAP: &str = "SERVES_CLIENTS";
/// Bitmap of PostgreSQL's series, whose files the relation family names.
pub const NAMES_FILES_MAP: &str = "NAMES_FILES";
/// Bitmap of io workers' series, whose IO is booked under the backend served (`io_worker`).
pub const SERVES_BACKENDS_MAP: &str = "SERVES_BACKENDS";
/// Bitmap of PostgreSQL's series other than client backends, whose waits `role_wait` books.
pub const BOOKS_WAITS_MAP: &str = "BOOKS_WAITS";

impl KernelSeries {
    pub fn take(ebpf: &mut Ebpf) -> Result<KernelSeries> {
        Ok(KernelSeries {
            tracked: TrackedMap::take(ebpf)?,
            child: take_map(ebpf, CHILD_SERIES_MAP)?,
            serves_clients: SeriesBits::take(ebpf, SERVES_CLIENTS_MAP)?,
            names_files: SeriesBits::take(ebpf, NAMES_FILES_MAP)?,
            serves_backends: SeriesBits::take(ebpf, SERVES_BACKENDS_MAP)?,
            books_waits: SeriesBits::take(ebpf, BOOKS_WAITS_MAP)?,
        })
    }

    /// Whether `series`' processes are client backends, whose client sockets delimit
    /// queries. Set before any process is booked under it; an id's labels never change while
    /// it lives, and a reused id is set again for its new labels.
    pub fn set_serves_clients(&mut self, series: SeriesId, on: bool) -> Result<(), MapError> {
        self.serves_clients.set(series, on)
    }

    /// Whether the relation family names the files of `series`' processes (PostgreSQL's);
    /// set like `set_serves_clients`.
    pub fn set_names_files(&mut self, series: SeriesId, on: bool) -> Result<(), MapError> {
        self.names_files.set(series, on)
    }

    /// Whether `series`' processes are io workers, doing IO for other backends; set like
    /// `set_serves_clients`.
    pub fn set_serves_backends(&mut self, series: SeriesId, on: bool) -> Result<(), MapError> {
        self.serves_backends.set(series, on)
    }

    /// Whether `role_wait` books the waits of `series`' processes; set like
    /// `set_serves_clients`.
    pub fn set_books_waits(&mut self, series: SeriesId, on: bool) -> Result<(), MapError> {
        self.books_waits.set(series, on)
    }

    /// Fails for a pid above the map's size (`pid_max` raised after pgio started).
    pub fn set(&mut self, pid: u32, series: SeriesId) -> Result<(), TrackedError> {
        self.tracked.set(pid, series)
    }

    pub fn clear(&mut self, pid: u32) {
        // Out of range cannot have been set.
        let _ = self.tracked.set(pid, SeriesId::UNTRACKED);
    }

    /// Children of `parent` start in their own provisional series (`child` is their labels'
    /// series, nonzero). Cannot fail for an id below the series cap (checked by the config).
    pub fn set_children(&mut self, parent: SeriesId, child: SeriesId) -> Result<(), MapError> {
        self.child.set(parent.0, child, 0)
    }
}
