//! Files a PostgreSQL process opened before pgio attached: the kernel never saw their `openat`,
//! so their fds have no `RELATION_FDS` slot and their IO is booked under no relation. A
//! backend of a connection pool, or the checkpointer, can keep them for hours. When a process
//! is first seen, the links of `/proc/<pid>/fd` beneath its data directory (`/proc/<pid>/cwd`)
//! are parsed as the kernel parses an `openat` path and written into their slots, unless the
//! kernel has named that fd since (its tag is already there).
//!
//! Only links are read (no file is opened), at most [`MAX_FDS`] per process. A file reached
//! through a tablespace's symlink shows its real path, outside the data directory: it is
//! matched against the targets of the links in `pg_tblspc/` (read as links, never followed,
//! at most [`MAX_TABLESPACES`]) and named as the kernel names `pg_tblspc/<oid>/…`.
use std::{
    collections::HashSet,
    os::unix::ffi::{OsStrExt, OsStringExt},
    path::{Path, PathBuf},
};

use aya::maps::{Array, MapData};
use pgio_common::relation::{
    FD_CANDIDATES, FdSlot, PATH_MAX_PARSED, RelFile, fd_candidate, fd_sets, fd_tag, parse_path,
    pick_way,
};

/// Fds looked at per process.
const MAX_FDS: usize = 4096;
/// Entries of `pg_tblspc/` looked at per process.
const MAX_TABLESPACES: usize = 64;

/// A tablespace's oid and the directory its `pg_tblspc/<oid>` link names.
pub type Tablespace = (u32, PathBuf);

/// The file `link` (an fd's target) is, if beneath `data_dir` or one of its `tablespaces`.
pub fn file_of(data_dir: &Path, tablespaces: &[Tablespace], link: &Path) -> Option<RelFile> {
    let mut path = [0u8; PATH_MAX_PARSED];
    let len = if let Ok(rel) = link.strip_prefix(data_dir) {
        let rel = rel.as_os_str().as_bytes();
        if rel.is_empty() || rel.len() > PATH_MAX_PARSED {
            return None;
        }
        path[..rel.len()].copy_from_slice(rel);
        rel.len()
    } else {
        let (oid, rest) = tablespaces
            .iter()
            .find_map(|(oid, target)| Some((oid, link.strip_prefix(target).ok()?)))?;
        let rel = format!("pg_tblspc/{oid}/");
        let (head, rest) = (rel.as_bytes(), rest.as_os_str().as_bytes());
        let len = head.len() + rest.len();
        if rest.is_empty() || len > PATH_MAX_PARSED {
            return None;
        }
        path[..head.len()].copy_from_slice(head);
        path[head.len()..len].copy_from_slice(rest);
        len
    };
    Some(parse_path(&path, len))
}

/// The links of `<data dir>/pg_tblspc/` of process `pid` (its cwd): read where the process
/// sees them (through `/proc/<pid>/cwd`), as links; `pg_tblspc` itself must be a directory
/// reached without a symlink, owned by the data directory's owner.
fn tablespaces(pid: u32) -> Vec<Tablespace> {
    use rustix::fs::{Dir, FileType, Mode, OFlags, ResolveFlags};
    let read = || -> std::io::Result<Vec<Tablespace>> {
        let (data_dir, owner) =
            crate::pg_files::open_data_dir(Path::new(&format!("/proc/{pid}/cwd")))?;
        let dir = rustix::fs::openat2(
            &data_dir,
            "pg_tblspc",
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NONBLOCK | OFlags::CLOEXEC,
            Mode::empty(),
            ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS,
        )?;
        let st = rustix::fs::fstat(&dir)?;
        if FileType::from_raw_mode(st.st_mode) != FileType::Directory || st.st_uid != owner {
            return Ok(Vec::new());
        }
        let mut links = Vec::new();
        for entry in Dir::read_from(&dir)?.take(MAX_TABLESPACES) {
            let entry = entry?;
            let Some(oid) = entry.file_name().to_str().ok().and_then(|n| n.parse().ok()) else {
                continue;
            };
            let Ok(target) = rustix::fs::readlinkat(&dir, entry.file_name(), Vec::new()) else {
                continue;
            };
            let target = PathBuf::from(std::ffi::OsString::from_vec(target.into_bytes()));
            if target.is_absolute() {
                links.push((oid, target));
            }
        }
        Ok(links)
    };
    read().unwrap_or_default()
}

/// Writes the slots of `pid`'s open files beneath its data directory; returns how many.
/// A slot is chosen of its two sets as the kernel's `openat` does (`pick_way`; `alive`: whether a
/// process is still tracked). `taking` sees each slot before it is written (its rows may
/// hold another fd's counts).
pub fn seed(
    fds: &mut Array<MapData, FdSlot>,
    pid: u32,
    alive: impl Fn(u32) -> bool,
    mut taking: impl FnMut(&FdSlot),
) -> std::io::Result<usize> {
    let data_dir = std::fs::read_link(format!("/proc/{pid}/cwd"))?;
    let tablespaces = tablespaces(pid);
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
        let Some(file) = file_of(&data_dir, &tablespaces, &link) else {
            continue;
        };
        let (sets, tag) = (fd_sets(pid, fd), fd_tag(pid, fd));
        let index: [u32; FD_CANDIDATES] = std::array::from_fn(|i| fd_candidate(&sets, i));
        let slots = index.map(|i| fds.get(&i, 0).unwrap_or_default());
        let (tags, last) = (slots.map(|s| s.tag), slots.map(|s| s.last_ns));
        if tags.contains(&tag) {
            continue; // named by the kernel since
        }
        let way = pick_way(&tags, &last, tag, &alive);
        taking(&slots[way]);
        let named = FdSlot {
            tag,
            last_ns: crate::block_io::monotonic_ns(),
            file,
            ..FdSlot::default()
        };
        if fds.set(index[way], named, 0).is_ok() {
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
        let file = |link: &str| file_of(dir, &[], Path::new(link));
        let f = file("/srv/pg/15/main/base/5/16385.2").expect("a file");
        assert_eq!(f, RelFile::relation(1663, 5, 16385, Fork::Main));
        let wal = file("/srv/pg/15/main/pg_wal/000000010000000000000001");
        assert_eq!(wal.map(|f| f.class), Some(FileClass::Wal as u8));
        assert_eq!(file("/srv/pg/15/mainx/base/5/1"), None);
        assert_eq!(file("/mnt/tblspc/PG_15_202209061/5/16390"), None);
        assert_eq!(file("socket:[123]"), None);
    }

    #[test]
    fn links_beneath_a_tablespace_are_named_by_its_oid() {
        let dir = Path::new("/srv/pg/15/main");
        let spaces = [
            (16389, PathBuf::from("/mnt/fast")),
            (16390, PathBuf::from("/mnt/tblspc")),
        ];
        let file = |link: &str| file_of(dir, &spaces, Path::new(link));
        assert_eq!(
            file("/mnt/tblspc/PG_15_202209061/5/16391.1"),
            Some(RelFile::relation(16390, 5, 16391, Fork::Main))
        );
        assert_eq!(
            file("/mnt/fast/PG_15_202209061/5/16392_fsm"),
            Some(RelFile::relation(16389, 5, 16392, Fork::Fsm))
        );
        // The data directory first; a directory that only starts like a target is not it.
        assert_eq!(
            file("/srv/pg/15/main/base/5/1"),
            Some(RelFile::relation(1663, 5, 1, Fork::Main))
        );
        assert_eq!(file("/mnt/tblspcx/PG_15_202209061/5/16391"), None);
        assert_eq!(file("/mnt/tblspc"), None);
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
