//! The kernel's `TRACKED` array (tgid → series), mapped into pgio's memory: one u16 a tgid
//! (`SeriesId::tracked_slot`), four to each 8-byte array value. Writing through the mapping
//! changes exactly one tgid's two bytes; a map update would write the whole value and could
//! undo what the fork program just wrote for a neighbouring tgid.
use std::{
    os::fd::{AsFd, AsRawFd},
    ptr::NonNull,
    sync::atomic::{AtomicU16, Ordering},
};

use anyhow::{Context, Result, bail};
use aya::{
    Ebpf,
    maps::{Map, MapData},
};
use pgio_common::{SeriesId, TRACKED_PER_ENTRY};

/// Sized to `pid_max` by the loader (`pgio_common::tracked_entries`).
pub const TRACKED_MAP: &str = "TRACKED";

pub struct TrackedMap {
    base: NonNull<AtomicU16>,
    /// tgids the array reaches: `TRACKED_PER_ENTRY` × its entries.
    tgids: u32,
    /// Bytes mapped.
    len: usize,
    /// Keeps the map (and so the mapping's object) alive.
    _map: MapData,
}

// SAFETY: the mapping is shared memory written only with atomic 2-byte stores; it lives as
// long as this value, which owns it.
unsafe impl Send for TrackedMap {}

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
        // SAFETY: sysconf has no preconditions.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096);
        let len = (entries as usize * 8).div_ceil(page) * page;
        // SAFETY: a shared read-write mapping of an mmapable array map, offset 0, no longer
        // than its (page-rounded) values, as the kernel allows; checked for failure below.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                map.fd().as_fd().as_raw_fd(),
                0,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error()).context("mmap of map TRACKED");
        }
        let base = NonNull::new(addr.cast::<AtomicU16>()).context("mmap of map TRACKED: null")?;
        Ok(TrackedMap {
            base,
            tgids: entries.saturating_mul(TRACKED_PER_ENTRY),
            len,
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
        unsafe { (*self.base.as_ptr().add(tgid as usize)).store(v, Ordering::Relaxed) };
        Ok(())
    }
}

impl Drop for TrackedMap {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `take`, unmapped once.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.len) };
    }
}

#[cfg(not(target_endian = "little"))]
compile_error!("TRACKED's u16 lanes are laid out for little-endian targets");
