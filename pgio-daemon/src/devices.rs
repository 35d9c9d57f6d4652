//! Kernel `dev_t` → device name (`loop3`, `vda`), from `/sys/dev/block/<major>:<minor>`, and
//! → Longhorn volume, from the device nodes in `/dev/longhorn`.
use std::{
    collections::{BTreeMap, HashMap},
    os::unix::{ffi::OsStringExt, fs::FileTypeExt, fs::MetadataExt},
    path::{Path, PathBuf},
};

use pgio_common::block_io::{dev_major, dev_minor, mkdev};
use tracing::warn;

/// The Longhorn device directory, `None` when turned off (`""`).
pub fn longhorn_dir(config: &crate::config::Config) -> Option<PathBuf> {
    let dir = config.text(&LONGHORN_DEVICE_DIR);
    (!dir.is_empty()).then(|| PathBuf::from(dir))
}

pub static LONGHORN_DEVICE_DIR: crate::config::Key = crate::config::Key::path(
    "longhorn_device_dir",
    "/dev/longhorn",
    true,
    "Longhorn's volume device nodes (named after the PV), read at every scrape: their block series get volume=; in a container, the host's /dev/longhorn",
);

/// Device names and Longhorn volumes for one scrape, and the devices it has seen so far
/// (`pgio_device_info` lists them).
#[derive(Debug, Default)]
pub struct Devices {
    names: DeviceNames,
    volumes: LonghornVolumes,
    /// dev → name, of the devices seen in this scrape.
    seen: BTreeMap<u32, String>,
}

impl Devices {
    pub fn new(longhorn_device_dir: Option<PathBuf>) -> Devices {
        Devices {
            volumes: LonghornVolumes::new(longhorn_device_dir),
            ..Devices::default()
        }
    }

    /// Names and volumes given, nothing read from /sys or /dev (tests, benchmarks).
    pub fn fixed(
        names: impl IntoIterator<Item = (u32, String)>,
        volumes: impl IntoIterator<Item = (u32, String)>,
    ) -> Devices {
        let mut d = Devices::default();
        d.names.names.extend(names);
        d.volumes.by_dev.extend(volumes);
        d
    }

    pub fn refresh_volumes(&mut self) {
        self.volumes.refresh();
    }

    /// Longhorn devices are listed before their first IO.
    pub fn start_scrape(&mut self) {
        self.seen.clear();
        let volume_devs: Vec<u32> = self.volumes.iter().map(|(d, _)| d).collect();
        for dev in volume_devs {
            self.see(dev);
        }
    }

    /// Resolves `dev`'s name for `name` and lists it in this scrape's `pgio_device_info`.
    pub fn see(&mut self, dev: u32) {
        if !self.seen.contains_key(&dev) {
            let name = self.names.name(dev);
            self.seen.insert(dev, name);
        }
    }

    /// The name of a device `see` was given in this scrape.
    pub fn name(&self, dev: u32) -> &str {
        self.seen.get(&dev).map_or("", String::as_str)
    }

    /// (dev, name) of every device seen in this scrape.
    pub fn seen(&self) -> impl Iterator<Item = (u32, &str)> {
        self.seen.iter().map(|(d, n)| (*d, n.as_str()))
    }

    /// The Longhorn volume `dev` is, as of the last refresh.
    pub fn volume(&self, dev: u32) -> Option<&str> {
        self.volumes.volume(dev)
    }
}

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

/// Block device → Longhorn volume, from a directory of device nodes named after their volume
/// (`/dev/longhorn/<pv-name>`, same major:minor as the iSCSI disk `sdX` under it).
///
/// Refresh: the whole directory is read again at every scrape (`refresh`). It holds one node
/// per volume attached to this node, and reading it is `getdents` plus one `statx` per block
/// node. Measured (release build, tmpfs, this 2-vCPU VM where one `statx` takes 1.4 µs):
/// 27 µs for 10 volumes, 0.21 ms for 100, 2.2 ms for 1,000 (more than Longhorn attaches to
/// one node), next to ~9 ms for encoding a 5,000-series /metrics. Always correct, unlike
/// re-reading only when the directory's mtime changed: that is set from the kernel's coarse
/// clock, so a volume detached and another attached within one tick of a read would go
/// unnoticed until the next change.
#[derive(Debug, Default)]
pub struct LonghornVolumes {
    /// None: lookup turned off (`longhorn_device_dir = ""`).
    dir: Option<PathBuf>,
    by_dev: BTreeMap<u32, String>,
    /// The last read error that was logged, so a lasting one is logged once.
    logged_error: Option<std::io::ErrorKind>,
}

impl LonghornVolumes {
    pub fn new(dir: Option<PathBuf>) -> LonghornVolumes {
        LonghornVolumes {
            dir,
            ..LonghornVolumes::default()
        }
    }

    /// Reads the directory again. A missing directory is normal (Longhorn not installed, or
    /// no volume attached here) and means no volumes; other errors are logged once and mean
    /// no volumes too. Entries that are not block devices (following symlinks) are skipped;
    /// when two name the same device, the first name in byte order wins.
    pub fn refresh(&mut self) {
        let Some(dir) = &self.dir else { return };
        match read_volume_dir(dir) {
            Ok(map) => {
                self.by_dev = map;
                self.logged_error = None;
            }
            Err(e) => {
                self.by_dev.clear();
                if e.kind() != std::io::ErrorKind::NotFound && self.logged_error != Some(e.kind()) {
                    warn!(dir = %dir.display(), error = %e, "cannot read the Longhorn device directory");
                    self.logged_error = Some(e.kind());
                }
            }
        }
    }

    /// The volume of kernel device `dev` (`major << 20 | minor`), as of the last refresh.
    pub fn volume(&self, dev: u32) -> Option<&str> {
        self.by_dev.get(&dev).map(String::as_str)
    }

    /// (dev, volume) of every Longhorn device, as of the last refresh.
    pub fn iter(&self) -> impl Iterator<Item = (u32, &str)> {
        self.by_dev.iter().map(|(d, v)| (*d, v.as_str()))
    }
}

fn read_volume_dir(dir: &Path) -> std::io::Result<BTreeMap<u32, String>> {
    let mut entries: Vec<(Vec<u8>, u32)> = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let Ok(entry) = entry else { continue };
        // The type comes with the directory entry: only block devices and symlinks (followed)
        // cost a stat. An entry removed since readdir is skipped.
        let meta = match entry.file_type() {
            Ok(t) if t.is_block_device() => entry.metadata(),
            Ok(t) if t.is_symlink() => std::fs::metadata(entry.path()),
            _ => continue,
        };
        let Ok(meta) = meta else { continue };
        if !meta.file_type().is_block_device() {
            continue;
        }
        let rdev = meta.rdev();
        let (major, minor) = (libc::major(rdev), libc::minor(rdev));
        entries.push((entry.file_name().into_vec(), mkdev(major, minor)));
    }
    entries.sort();
    let mut map = BTreeMap::new();
    for (name, dev) in entries {
        map.entry(dev)
            .or_insert_with(|| String::from_utf8_lossy(&name).into_owned());
    }
    Ok(map)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_or_turned_off_directory_means_no_volumes() {
        let dir = pgio_testkit::temp_dir().expect("temp dir");
        let mut v = LonghornVolumes::new(Some(dir.path().join("longhorn")));
        v.refresh();
        assert_eq!(v.iter().count(), 0);
        let mut off = LonghornVolumes::new(None);
        off.refresh();
        assert_eq!(off.iter().count(), 0);
    }

    #[test]
    fn entries_that_are_not_block_devices_are_skipped() {
        let dir = pgio_testkit::temp_dir().expect("temp dir");
        std::fs::write(dir.path().join("pvc-file"), b"x").expect("file");
        std::fs::create_dir(dir.path().join("pvc-dir")).expect("dir");
        std::os::unix::fs::symlink("/nonexistent", dir.path().join("pvc-dangling"))
            .expect("symlink");
        let mut v = LonghornVolumes::new(Some(dir.path().to_owned()));
        v.refresh();
        assert_eq!(v.iter().count(), 0);
        // Not a directory: an error, logged, and no volumes.
        let mut v = LonghornVolumes::new(Some(dir.path().join("pvc-file")));
        v.refresh();
        assert_eq!(v.iter().count(), 0);
    }
}
