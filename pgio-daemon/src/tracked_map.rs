//! The kernel's `TRACKED` array (tgid → series), mapped into pgio's memory: one u16 a tgid
//! (`SeriesId::tracked_slot`), four to each 8-byte array value. Writing through the mapping
//! changes exactly one tgid's two bytes; a map update would write the whole value and could
//! undo what the fork program just wrote for a neighbouring tgid.
use std::sync::atomic::{AtomicU16, Ordering};

use anyhow::{Context, Result, bail};
use aya::{
    Ebpf,
    maps::{Map, MapData},
};
use pgio_common::{SeriesId, TRACKED_PER_ENTRY};

use crate::maps::MappedValues;

/// Sized to `pid_max` by the loader (`pgio_common::tracked_entries`).
pub const TRACKED_MAP: &str = "TRACKED";

pub struct TrackedMap {
    /// Written only with atomic 2-byte stores.
    values: MappedValues,
    /// tgids the array reaches: `TRACKED_PER_ENTRY` × its entries.
    tgids: u32,
    _map: MapData,
}

/// Why a tgid could not be written.
#[derive(Debug, thiserror::Error)]
pub enum TrackedError {
    #[error("pid {0} is beyond the TRACKED array (pid_max raised after pgio started?)")]
    PidTooLarge(u32),
    #[error("series {0} cannot be stored in TRACKED")]
    Unrepresentable(u32),
}

impl TrackedMap {
    pub fn take(ebpf: &mut Ebpf) -> Result<TrackedMap> {
        let map = match ebpf.take_map(TRACKED_MAP) {
            Some(Map::Array(m)) => m,
            Some(_) => bail!("map {TRACKED_MAP} is not an array"),
            None => bail!("map {TRACKED_MAP} missing from the eBPF object"),
        };
        let info = map.info().context("map TRACKED: info")?;
        let entries = info.max_entries();
        if info.value_size() != 8 {
            bail!("map {TRACKED_MAP}: value size {}, not 8", info.value_size());
        }
        let values = MappedValues::new(&map, TRACKED_MAP, 8, entries, true)?;
        Ok(TrackedMap {
            values,
            tgids: entries.saturating_mul(TRACKED_PER_ENTRY),
            _map: map,
        })
    }

    /// Books `tgid`'s events under `series` from now on.
    pub fn set(&self, tgid: u32, series: SeriesId) -> Result<(), TrackedError> {
        if tgid >= self.tgids {
            return Err(TrackedError::PidTooLarge(tgid));
        }
        let v = series
            .tracked_slot(tgid)
            .ok_or(TrackedError::Unrepresentable(series.0))?;
        // SAFETY: `tgid` < `tgids`, so within the mapping; little-endian targets only (the
        // u16 lanes of each u64 value are its bytes in order).
        unsafe {
            (*self.values.as_ptr::<AtomicU16>().add(tgid as usize)).store(v, Ordering::Relaxed)
        };
        Ok(())
    }
}

#[cfg(not(target_endian = "little"))]
compile_error!("TRACKED's u16 lanes are laid out for little-endian targets");
