//! Role and database names from a cluster's shared catalogs on disk (`pg_authid`,
//! `pg_database`). Only used to split a client-backend title whose user or database name
//! contains a space: the title alone cannot tell `a b c` = (`a b`, `c`) from (`a`, `b c`).
//!
//! Heap page and tuple layout, the relation mapper file and the first two columns of both
//! catalogs (`oid`, then a 64-byte `name`) are the same in PostgreSQL 15 to 18. The files hold
//! what the last checkpoint wrote: a role or database created since is not there yet.
use std::{
    collections::{HashMap, HashSet},
    os::fd::OwnedFd,
    path::Path,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

const BLCKSZ: usize = 8192;
const PG_AUTHID: u32 = 1260;
const PG_DATABASE: u32 = 1262;
const RELMAPPER_MAGIC: u32 = 0x0059_2717;
const MAX_MAPPINGS: usize = 64;
const NAMEDATALEN: usize = 64;
const LP_NORMAL: u32 = 1;
const HEAP_XMAX_LOCK_ONLY: u16 = 0x0080;
const HEAP_XMAX_COMMITTED: u16 = 0x0400;

#[derive(Debug, Default)]
pub struct CatalogNames {
    pub roles: HashSet<String>,
    pub databases: HashSet<String>,
}

/// The catalogs last read per data directory, for `TTL`: a connection storm of backends with
/// spaces in their names reads each cluster's files once, not once per backend. At most
/// `ENTRIES` directories (2 MiB of files each at worst), the oldest dropped first.
#[derive(Debug, Default)]
pub struct CatalogCache {
    entries: Mutex<HashMap<String, (Instant, Arc<CatalogNames>)>>,
}

const TTL: Duration = Duration::from_secs(10);
const ENTRIES: usize = 16;

impl CatalogCache {
    /// The names of data directory `key`, from `read` if not read within `TTL`.
    pub fn get(
        &self,
        key: &str,
        read: impl FnOnce() -> std::io::Result<CatalogNames>,
    ) -> std::io::Result<Arc<CatalogNames>> {
        let now = Instant::now();
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((at, names)) = entries.get(key)
            && now.duration_since(*at) < TTL
        {
            return Ok(names.clone());
        }
        let names = Arc::new(read()?);
        entries.retain(|_, (at, _)| now.duration_since(*at) < TTL);
        if entries.len() >= ENTRIES
            && let Some(oldest) = entries
                .iter()
                .min_by_key(|(_, (at, _))| *at)
                .map(|(k, _)| k.clone())
        {
            entries.remove(&oldest);
        }
        entries.insert(key.to_owned(), (now, names.clone()));
        Ok(names)
    }
}

/// Reads both catalogs of the cluster whose data directory is `data_dir` (pass
/// `/proc/<pid>/cwd` to see through a container's mount namespace).
pub fn read(data_dir: &Path) -> std::io::Result<CatalogNames> {
    use rustix::fs::{Mode, OFlags};
    let dir = rustix::fs::open(
        data_dir,
        OFlags::DIRECTORY | OFlags::RDONLY | OFlags::NONBLOCK | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    let owner = rustix::fs::fstat(&dir)?.st_uid;
    let map = read_capped(&dir, "global/pg_filenode.map", owner)?;
    let file_of = |oid: u32| -> std::io::Result<Vec<u8>> {
        let node = filenode(&map, oid).unwrap_or(oid);
        read_capped(&dir, &format!("global/{node}"), owner)
    };
    Ok(CatalogNames {
        roles: names_in_heap(&file_of(PG_AUTHID)?).collect(),
        databases: names_in_heap(&file_of(PG_DATABASE)?).collect(),
    })
}

/// `rel` beneath the data directory `dir`, trusting nothing in it: any process named
/// `postgres` can point pgio at its working directory. No symlink anywhere on the way (not
/// to /etc/shadow, not to another cluster's catalogs), a non-blocking open (a FIFO cannot
/// stall discovery), only a regular file owned by the directory's owner, at most `MAX_READ`
/// bytes (1 MiB is ~5,000 roles or databases).
fn read_capped(dir: &OwnedFd, rel: &str, owner: u32) -> std::io::Result<Vec<u8>> {
    use rustix::fs::{FileType, Mode, OFlags, ResolveFlags};
    use std::io::Read;
    let fd = rustix::fs::openat2(
        dir,
        rel,
        OFlags::RDONLY | OFlags::NONBLOCK | OFlags::CLOEXEC | OFlags::NOFOLLOW | OFlags::NOCTTY,
        Mode::empty(),
        ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS,
    )?;
    let st = rustix::fs::fstat(&fd)?;
    if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile || st.st_uid != owner {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("{rel}: not a regular file owned by the data directory's owner"),
        ));
    }
    let mut out = Vec::new();
    std::fs::File::from(fd)
        .take(MAX_READ)
        .read_to_end(&mut out)?;
    Ok(out)
}

const MAX_READ: u64 = 1 << 20;

/// The relation mapper (`global/pg_filenode.map`): shared catalogs have no pg_class row
/// giving their file, and VACUUM FULL moves them to a new one.
fn filenode(map: &[u8], oid: u32) -> Option<u32> {
    let u32_at = |off: usize| {
        map.get(off..off + 4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    };
    if u32_at(0)? != RELMAPPER_MAGIC {
        return None;
    }
    let n = (u32_at(4)? as usize).min(MAX_MAPPINGS);
    (0..n).find_map(|i| {
        let off = 8 + i * 8;
        (u32_at(off)? == oid).then(|| u32_at(off + 4)).flatten()
    })
}

/// The `name` column right after `oid` of every live-looking tuple. Tuples whose deletion is
/// known committed (hint bit) are skipped; others are kept, since an extra candidate only
/// matters if it makes a split ambiguous.
fn names_in_heap(file: &[u8]) -> impl Iterator<Item = String> + '_ {
    file.chunks_exact(BLCKSZ).flat_map(|page| {
        let u16_at = |off: usize| u16::from_le_bytes([page[off], page[off + 1]]) as usize;
        let lower = u16_at(12).clamp(24, BLCKSZ);
        (24..lower).step_by(4).filter_map(move |lp_at| {
            let lp = u32::from_le_bytes(page[lp_at..lp_at + 4].try_into().ok()?);
            let (off, flags, len) = ((lp & 0x7fff) as usize, (lp >> 15) & 3, (lp >> 17) as usize);
            if flags != LP_NORMAL || off + len > BLCKSZ || len < 24 {
                return None;
            }
            let tuple = &page[off..off + len];
            let infomask = u16::from_le_bytes([tuple[20], tuple[21]]);
            if infomask & HEAP_XMAX_COMMITTED != 0 && infomask & HEAP_XMAX_LOCK_ONLY == 0 {
                return None;
            }
            let hoff = tuple[22] as usize;
            let name = tuple.get(hoff + 4..hoff + 4 + NAMEDATALEN)?;
            let end = name.iter().position(|&b| b == 0).unwrap_or(NAMEDATALEN);
            std::str::from_utf8(&name[..end]).ok().map(str::to_owned)
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cache_reads_a_directory_once_per_ttl_and_keeps_few() {
        let cache = CatalogCache::default();
        let reads = std::cell::Cell::new(0);
        let read = || {
            reads.set(reads.get() + 1);
            Ok(CatalogNames::default())
        };
        for _ in 0..100 {
            cache.get("/srv/a", read).expect("names");
        }
        assert_eq!(reads.get(), 1);
        assert!(
            cache
                .get("/srv/b", || Err(std::io::Error::other("unreadable")))
                .is_err()
        );
        for i in 0..3 * ENTRIES {
            cache.get(&format!("/d{i}"), read).expect("names");
        }
        assert_eq!(reads.get(), 1 + 3 * ENTRIES);
        let n = cache.entries.lock().map(|e| e.len()).unwrap_or(0);
        assert_eq!(n, ENTRIES);
    }

    /// A heap page as PostgreSQL lays it out, with one tuple per name.
    fn page(names: &[(&str, u16)]) -> Vec<u8> {
        let mut p = vec![0u8; BLCKSZ];
        let mut upper = BLCKSZ;
        for (i, (name, infomask)) in names.iter().enumerate() {
            let hoff = 24usize;
            let len = hoff + 4 + NAMEDATALEN + 4;
            upper -= len.next_multiple_of(8);
            let t = &mut p[upper..upper + len];
            t[20..22].copy_from_slice(&infomask.to_le_bytes());
            t[22] = hoff as u8;
            t[hoff..hoff + 4].copy_from_slice(&(16384 + i as u32).to_le_bytes());
            t[hoff + 4..hoff + 4 + name.len()].copy_from_slice(name.as_bytes());
            let lp = upper as u32 | LP_NORMAL << 15 | (len as u32) << 17;
            p[24 + 4 * i..28 + 4 * i].copy_from_slice(&lp.to_le_bytes());
        }
        let lower = (24 + 4 * names.len()) as u16;
        p[12..14].copy_from_slice(&lower.to_le_bytes());
        p[14..16].copy_from_slice(&(upper as u16).to_le_bytes());
        p
    }

    #[test]
    fn names_from_a_heap_page_skipping_committed_deletes() {
        let p = page(&[
            ("postgres", 0),
            ("my db", 0),
            ("dropped", HEAP_XMAX_COMMITTED),
            ("locked", HEAP_XMAX_COMMITTED | HEAP_XMAX_LOCK_ONLY),
        ]);
        let names: Vec<String> = names_in_heap(&p).collect();
        assert_eq!(names, ["postgres", "my db", "locked"]);
    }

    #[test]
    fn garbage_is_not_a_name() {
        let mut p = page(&[("ok", 0)]);
        // A line pointer past the page end and one with a too short tuple.
        p[12..14].copy_from_slice(&32u16.to_le_bytes());
        p[28..32].copy_from_slice(&(8000u32 | LP_NORMAL << 15 | 400 << 17).to_le_bytes());
        assert_eq!(names_in_heap(&p).collect::<Vec<_>>(), ["ok"]);
        assert_eq!(names_in_heap(&[0u8; 100]).count(), 0);
    }

    #[test]
    fn relation_mapper() {
        let mut map = vec![0u8; 524];
        map[0..4].copy_from_slice(&RELMAPPER_MAGIC.to_le_bytes());
        map[4..8].copy_from_slice(&2u32.to_le_bytes());
        for (i, (oid, node)) in [(1260u32, 1260u32), (1262, 16999)].iter().enumerate() {
            map[8 + 8 * i..12 + 8 * i].copy_from_slice(&oid.to_le_bytes());
            map[12 + 8 * i..16 + 8 * i].copy_from_slice(&node.to_le_bytes());
        }
        assert_eq!(filenode(&map, PG_DATABASE), Some(16999));
        assert_eq!(filenode(&map, PG_AUTHID), Some(1260));
        assert_eq!(filenode(&map, 1213), None);
        assert_eq!(filenode(&map[..6], PG_AUTHID), None);
    }
}
