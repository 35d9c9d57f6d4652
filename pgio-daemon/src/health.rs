//! What `/healthz` checks: that pgio can still do its work, not just answer HTTP. Two
//! syscalls-cheap probes per call, neither of which can block: a /proc file opened and read
//! (fails when pgio is out of file descriptors, or /proc is gone or hides other processes), and
//! one lookup in a kernel map (fails when pgio lost the right to read its maps).
use std::{io::Read as _, os::fd::AsFd as _};

use aya::{
    Ebpf,
    maps::{Map, MapData, PerCpuArray},
};

/// The /proc file read: pid 1 always exists in pgio's pid namespace, and with `hidepid` it is
/// invisible to a reader that lacks CAP_SYS_PTRACE, like every other process pgio watches.
const PROC_PROBE: &str = "/proc/1/stat";

pub struct Health {
    map: Option<PerCpuArray<MapData, u64>>,
}

impl Health {
    /// Probes `map_name` (a per-CPU array) through its own fd, so the source that owns the
    /// map keeps it.
    pub fn new(ebpf: &Ebpf, map_name: &str) -> anyhow::Result<Health> {
        let data = match ebpf.map(map_name) {
            Some(Map::PerCpuArray(d)) => d,
            _ => anyhow::bail!("map {map_name} missing or not a per-CPU array"),
        };
        let fd = data.fd().as_fd().try_clone_to_owned()?;
        let map = PerCpuArray::try_from(Map::PerCpuArray(MapData::from_fd(fd)?))?;
        Ok(Health { map: Some(map) })
    }

    /// Only the /proc probe (tests).
    pub fn proc_only() -> Health {
        Health { map: None }
    }

    /// `Err` is the one-line reason `/healthz` answers 503 with.
    pub fn check(&self) -> Result<(), String> {
        let mut buf = [0u8; 512];
        std::fs::File::open(PROC_PROBE)
            .and_then(|mut f| f.read(&mut buf))
            .map_err(|e| format!("cannot read {PROC_PROBE}: {e}"))?;
        if let Some(map) = &self.map {
            map.get(&0, 0)
                .map_err(|e| format!("cannot read kernel map: {e}"))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_probe_passes_here() {
        assert_eq!(Health::proc_only().check(), Ok(()));
    }
}
