//! Files a PostgreSQL process opened before pgio attached: the kernel never saw their `openat`,
//! so their fds have no `RELATION_FDS` slot and their IO is booked under no relation. A
//! backend of a connection pool, or the checkpointer, can keep them for hours. When a process
//! is first seen, the links of `/proc/<pid>/fd` beneath its data directory (`/proc/<pid>/cwd`)
//! are parsed as the kernel parses an `openat` path and written into their slots, unless the
//! kernel has named that fd since (its tag is already there).
//!
//! Only links are read (no file is opened), at most [`MAX_FDS`] per process. A file reached
//! through a tablespace's symlink shows its real path, outside the data directory: it stays
//! unnamed (`(other)`) until the process opens it again.
use std::{collections::HashSet, os::unix::ffi::OsStrExt, path::Path};

use aya::maps::{Array, MapData};
use pgio_common::relation::{FdSlot, PATH_MAX_PARSED, RelFile, fd_slot, fd_tag, parse_path};

/// Fds looked at per process.
const MAX_FDS: usize = 4096;

/// The file `link` (an fd's target) is, if beneath `data_dir`.
pub fn file_of(data_dir: &Path, link: &Path) -> Option<RelFile> {
    let rel = link.strip_prefix(data_dir).ok()?.as_os_str().as_bytes();
    if rel.is_empty() || rel.len() > PATH_MAX_PARSED {
        return None;
    }
    let mut path = [0u8; PATH_MAX_PARSED];
    path[..rel.len()].copy_from_slice(rel);
    Some(parse_path(&path, rel.len()))
}

/// Writes the slots of `pid`'s open files beneath its data directory; returns how many.
/// `taking` sees each slot before it is written (its rows may hold another fd's counts).
pub fn seed(
    fds: &mut Array<MapData, FdSlot>,
    pid: u32,
    mut taking: impl FnMut(&FdSlot),
) -> std::io::Result<usize> {
    let data_dir = std::fs::read_link(format!("/proc/{pid}/cwd"))?;
    let mut seeded = 0;
    for entry in std::fs::read_dir(format!("/proc/{pid}/fd"))?.take(MAX_FDS) {
        let Ok(entry) = entry else { continue };
        let Some(fd) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u16>().ok())
            .filter(|fd| *fd != u16::MAX)
        else {
            continue;
        };
        let Ok(link) = std::fs::read_link(entry.path()) else {
            continue;
        };
        let Some(file) = file_of(&data_dir, &link) else {
            continue;
        };
        let (tag, slot) = (fd_tag(pid, fd), fd_slot(pid, fd));
        match fds.get(&slot, 0) {
            Ok(s) if s.tag == tag => continue, // named by the kernel since
            Ok(s) => taking(&s),
            Err(_) => {}
        }
        let named = FdSlot {
            tag,
            file,
            ..FdSlot::default()
        };
        if fds.set(slot, named, 0).is_ok() {
            seeded += 1;
        }
    }
    Ok(seeded)
}

/// The processes already looked at, so each is seeded once (bounded by the tracked ones).
#[derive(Debug, Default)]
pub struct Seeded(HashSet<u32>);

impl Seeded {
    /// Of `live` (tracked PostgreSQL processes now), those not seeded yet; forgets the others.
    pub fn new_ones(&mut self, live: &HashSet<u32>) -> Vec<u32> {
        self.0.retain(|p| live.contains(p));
        let new: Vec<u32> = live.difference(&self.0).copied().collect();
        self.0.extend(&new);
        new
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pgio_common::relation::{FileClass, Fork};

    #[test]
    fn links_beneath_the_data_directory_are_parsed_like_openat_paths() {
        let dir = Path::new("/srv/pg/15/main");
        let f = file_of(dir, Path::new("/srv/pg/15/main/base/5/16385.2")).expect("a file");
        assert_eq!(f, RelFile::relation(1663, 5, 16385, Fork::Main));
        let wal = file_of(
            dir,
            Path::new("/srv/pg/15/main/pg_wal/000000010000000000000001"),
        );
        assert_eq!(wal.map(|f| f.class), Some(FileClass::Wal as u8));
        assert_eq!(file_of(dir, Path::new("/srv/pg/15/mainx/base/5/1")), None);
        assert_eq!(
            file_of(dir, Path::new("/mnt/tblspc/PG_15_202209061/5/16390")),
            None
        );
        assert_eq!(file_of(dir, Path::new("socket:[123]")), None);
    }

    #[test]
    fn each_process_is_seeded_once_while_it_lives() {
        let mut seeded = Seeded::default();
        let live: HashSet<u32> = [1, 2].into();
        let mut first = seeded.new_ones(&live);
        first.sort();
        assert_eq!(first, vec![1, 2]);
        assert!(seeded.new_ones(&live).is_empty());
        assert_eq!(seeded.new_ones(&[2, 3].into()), vec![3]);
        assert_eq!(seeded.0.len(), 2);
    }
}
