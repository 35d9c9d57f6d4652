//! Taking a family's maps out of the loaded object, once, as the types it reads them with.
use anyhow::{Context as _, Result};
use aya::{
    Ebpf,
    maps::{Map, MapError},
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
