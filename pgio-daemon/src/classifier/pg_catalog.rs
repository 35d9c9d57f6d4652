//! Role and database names from a cluster's shared catalogs on disk (`pg_authid`,
//! `pg_database`). Only used to split a client-backend title whose user or database name
//! contains a space: the title alone cannot tell `a b c` = (`a b`, `c`) from (`a`, `b c`).
//!
//! The first two columns of both catalogs (`oid`, then a 64-byte `name`) are the same in
//! PostgreSQL 15 to 18 (`pg_files` reads them). The files hold what the last checkpoint
//! wrote: a role or database created since is not there yet.
use std::{
    collections::{HashMap, HashSet},
    path::Path,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use crate::pg_files;

const PG_AUTHID: u32 = 1260;
const PG_DATABASE: u32 = 1262;

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
    let (dir, owner) = pg_files::open_data_dir(data_dir)?;
    let map = pg_files::read_capped(&dir, "global/pg_filenode.map", owner, MAX_READ)?;
    let file_of = |oid: u32| -> std::io::Result<Vec<u8>> {
        let node = pg_files::filenode(&map, oid).unwrap_or(oid);
        pg_files::read_capped(&dir, &format!("global/{node}"), owner, MAX_READ)
    };
    Ok(CatalogNames {
        roles: names_in_heap(&file_of(PG_AUTHID)?).collect(),
        databases: names_in_heap(&file_of(PG_DATABASE)?).collect(),
    })
}

/// Database oid → name from `pg_database` of the cluster at `data_dir` (a renamed database:
/// its newest version).
pub fn database_names(data_dir: &Path) -> std::io::Result<HashMap<u32, String>> {
    let (dir, owner) = pg_files::open_data_dir(data_dir)?;
    let map = pg_files::read_capped(&dir, "global/pg_filenode.map", owner, MAX_READ)?;
    let node = pg_files::filenode(&map, PG_DATABASE).unwrap_or(PG_DATABASE);
    let file = pg_files::read_capped(&dir, &format!("global/{node}"), owner, MAX_READ)?;
    let mut names = HashMap::new();
    for page in file.chunks_exact(pg_files::BLCKSZ) {
        for t in pg_files::heap_tuples(page).filter(|t| !t.deleted && !t.aborted) {
            if let (Some(oid), Some(name)) =
                (pg_files::u32_at(t.data, 0), pg_files::name_at(t.data, 4))
                && (t.newest || !names.contains_key(&oid))
            {
                names.insert(oid, name.to_owned());
            }
        }
    }
    Ok(names)
}

/// 1 MiB is ~5,000 roles or databases.
const MAX_READ: u64 = 1 << 20;

/// The `name` column right after `oid` of every tuple not known deleted. Others are kept,
/// since an extra candidate only matters if it makes a split ambiguous.
fn names_in_heap(file: &[u8]) -> impl Iterator<Item = String> + '_ {
    file.chunks_exact(pg_files::BLCKSZ).flat_map(|page| {
        pg_files::heap_tuples(page)
            .filter(|t| !t.deleted)
            .filter_map(|t| pg_files::name_at(t.data, 4).map(str::to_owned))
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

    use crate::pg_files::tests::{oid_name, page};

    #[test]
    fn names_from_a_heap_page_skipping_committed_deletes() {
        let p = page(&[
            (oid_name(10, "postgres"), 0),
            (oid_name(16384, "my db"), 0),
            (oid_name(16385, "dropped"), 0x0400),
            (oid_name(16386, "locked"), 0x0400 | 0x0080),
        ]);
        let names: Vec<String> = names_in_heap(&p).collect();
        assert_eq!(names, ["postgres", "my db", "locked"]);
    }
}
