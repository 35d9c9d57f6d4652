//! Kernel `dev_t` → device name (`loop3`, `vda`), from `/sys/dev/block/<major>:<minor>`.
use std::collections::HashMap;

use pgio_common::block_io::{dev_major, dev_minor};

#[derive(Default, Debug)]
pub struct DeviceNames {
    names: HashMap<u32, String>,
}

impl DeviceNames {
    /// Cached: a block device's name follows from its number (loopN is always 7:N), and a
    /// device that is gone keeps the name its series were exported under. A number not in
    /// /sys yet is looked up again on the next call.
    pub fn name(&mut self, dev: u32) -> String {
        if let Some(n) = self.names.get(&dev) {
            return n.clone();
        }
        let (major, minor) = (dev_major(dev), dev_minor(dev));
        match std::fs::read_link(format!("/sys/dev/block/{major}:{minor}")) {
            Ok(target) => {
                let name = target
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_else(|| format!("{major}:{minor}"));
                self.names.insert(dev, name.clone());
                name
            }
            Err(_) => format!("{major}:{minor}"),
        }
    }
}
