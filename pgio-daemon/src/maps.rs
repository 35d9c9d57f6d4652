//! Taking a family's maps out of the loaded object, once, as the types it reads them with;
//! mapping an mmapable array's values into pgio's memory.
use std::{
    os::fd::{AsFd, AsRawFd},
    ptr::NonNull,
};

use anyhow::{Context as _, Result};
use aya::{
    Ebpf,
    maps::{Map, MapData, MapError},
};

/// A map of the object, as the type its family reads it with.
pub fn take_map<T>(ebpf: &mut Ebpf, name: &str) -> Result<T>
where
    T: TryFrom<Map, Error = MapError>,
{
    let map = ebpf
        .take_map(name)
        .with_context(|| format!("map {name} missing from the eBPF object"))?;
    T::try_from(map).with_context(|| format!("map {name}"))
}

/// A per-CPU array of counters, each summed over the CPUs (0 for one that cannot be read).
pub fn counter_sums<const N: usize>(map: &aya::maps::PerCpuArray<MapData, u64>) -> [u64; N] {
    std::array::from_fn(|i| {
        map.get(&(i as u32), 0)
            .map(|v| v.iter().sum::<u64>())
            .unwrap_or(0)
    })
}

/// The values of an mmapable array map (`BPF_F_MMAPABLE`) mapped into pgio's memory, from
/// offset 0, page-rounded as the kernel allows; unmapped on drop (the mapping keeps the map
/// alive in the kernel by itself).
pub struct MappedValues {
    base: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is owned by this value; what is read or written through it is the
// users' protocol with the kernel (atomic stores, volatile copies).
unsafe impl Send for MappedValues {}

impl MappedValues {
    /// `entries` values of `value_size` bytes of `map` (named `name` in errors).
    pub fn new(
        map: &MapData,
        name: &str,
        value_size: usize,
        entries: u32,
        writable: bool,
    ) -> Result<MappedValues> {
        // SAFETY: sysconf has no preconditions.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096);
        let len = (entries as usize * value_size).div_ceil(page) * page;
        let prot = if writable {
            libc::PROT_READ | libc::PROT_WRITE
        } else {
            libc::PROT_READ
        };
        // SAFETY: a shared mapping of an mmapable array map, offset 0, no longer than its
        // (page-rounded) values, as the kernel allows; checked for failure below.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                prot,
                libc::MAP_SHARED,
                map.fd().as_fd().as_raw_fd(),
                0,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error())
                .with_context(|| format!("mmap of map {name}"));
        }
        let base =
            NonNull::new(addr.cast::<u8>()).with_context(|| format!("mmap of map {name}: null"))?;
        Ok(MappedValues { base, len })
    }

    /// The first value, as `T`.
    pub fn as_ptr<T>(&self) -> *mut T {
        self.base.as_ptr().cast()
    }
}

impl Drop for MappedValues {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped once.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.len) };
    }
}
