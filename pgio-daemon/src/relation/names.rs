//! Which relation a file is: `schema.name` and kind of a relfilenode, from the database's own
//! `pg_class` and `pg_namespace` files on the node (no connection, no password), read with
//! `pg_files` (beneath the data directory, no symlink, non-blocking, owner-checked, capped).
//!
//! Only the files asked for are kept, so memory follows what pgio books, not how many tables
//! a user creates; pages are streamed one at a time. The files hold what the last checkpoint
//! (or the background writer) wrote: a relation created or rewritten since (`VACUUM FULL`,
//! `TRUNCATE`, `CLUSTER`, `REINDEX` give it a new relfilenode) is not found until then, and
//! its IO is booked under `(relfilenode <n>)`, never under a wrong name.
use std::{
    collections::{HashMap, HashSet},
    path::Path,
};

use crate::pg_files::{self, u32_at};

const PG_CLASS: u32 = 1259;
/// pg_namespace's oid: not a mapped catalog, so its file is in its pg_class row.
const PG_NAMESPACE: u32 = 2615;
/// `pg_global`: shared catalogs, mapped by `global/pg_filenode.map`.
const GLOBALTABLESPACE: u32 = 1664;
/// Pages read at most per catalog file: 64 MiB, ~250,000 relations.
const MAX_PAGES: usize = 8192;
const MAX_MAP: u64 = 1024;

/// A relation file: the `pg_class.reltablespace` its row gives (0: the database's default
/// tablespace; 1664: shared) and its relfilenode.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FileKey {
    pub tablespace: u32,
    pub relfilenode: u32,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Relation {
    pub schema: String,
    pub name: String,
    pub kind: Kind,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Table,
    Index,
    Toast,
    MaterializedView,
    Sequence,
    Other,
}

impl Kind {
    pub const ALL: [Kind; 6] = [
        Kind::Table,
        Kind::Index,
        Kind::Toast,
        Kind::MaterializedView,
        Kind::Sequence,
        Kind::Other,
    ];

    fn from_relkind(k: u8) -> Kind {
        match k {
            b'r' => Kind::Table,
            b'i' => Kind::Index,
            b't' => Kind::Toast,
            b'm' => Kind::MaterializedView,
            b'S' => Kind::Sequence,
            _ => Kind::Other,
        }
    }

    /// The `kind` label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Table => "table",
            Kind::Index => "index",
            Kind::Toast => "toast",
            Kind::MaterializedView => "matview",
            Kind::Sequence => "sequence",
            Kind::Other => "other",
        }
    }
}

/// Byte offsets in a pg_class tuple's data of the columns read. All precede the first
/// nullable column, so no null bitmap shifts them.
#[derive(Clone, Copy, Debug)]
struct PgClassLayout {
    relnamespace: usize,
    relfilenode: usize,
    reltablespace: usize,
    relisshared: usize,
    relkind: usize,
}

/// PostgreSQL 15-17: oid, relname (64), relnamespace, reltype, reloftype, relowner, relam,
/// relfilenode, reltablespace, relpages, reltuples, relallvisible, reltoastrelid, relhasindex,
/// relisshared, relpersistence, relkind. 18 adds relallfrozen after relallvisible.
fn layout(major: u32) -> Option<PgClassLayout> {
    let shift = match major {
        15..=17 => 0,
        18 => 4,
        _ => return None,
    };
    Some(PgClassLayout {
        relnamespace: 68,
        relfilenode: 88,
        reltablespace: 92,
        relisshared: 113 + shift,
        relkind: 115 + shift,
    })
}

/// What [`read`] found, and what it could not tell.
#[derive(Debug, Default)]
pub struct Found {
    pub relations: HashMap<FileKey, Relation>,
    /// A catalog file longer than [`MAX_PAGES`]: relations past it stay unnamed.
    pub truncated: bool,
}

/// The major version of the cluster at `data_dir`, from its `PG_VERSION`.
pub fn major(data_dir: &Path) -> std::io::Result<u32> {
    let (dir, owner) = pg_files::open_data_dir(data_dir)?;
    let text = pg_files::read_capped(&dir, "PG_VERSION", owner, 16)?;
    std::str::from_utf8(&text)
        .ok()
        .and_then(|t| t.trim().parse().ok())
        .ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "PG_VERSION is not a number",
            )
        })
}

/// The relations of database `db` (its oid) of the cluster at `data_dir` whose files are in
/// `wanted`, PostgreSQL `major`.
pub fn read(
    data_dir: &Path,
    major: u32,
    db: u32,
    wanted: &HashSet<FileKey>,
) -> std::io::Result<Found> {
    let layout = layout(major).ok_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::Unsupported,
            format!("pg_class layout of PostgreSQL {major} unknown"),
        )
    })?;
    let (dir, owner) = pg_files::open_data_dir(data_dir)?;
    let base = format!("base/{db}");
    let local_map =
        pg_files::read_capped(&dir, &format!("{base}/pg_filenode.map"), owner, MAX_MAP)?;
    let global_map = pg_files::read_capped(&dir, "global/pg_filenode.map", owner, MAX_MAP)?;
    let class_node = pg_files::filenode(&local_map, PG_CLASS).unwrap_or(PG_CLASS);

    struct Candidate {
        namespace: u32,
        name: String,
        kind: Kind,
        newest: bool,
    }
    let mut found: HashMap<FileKey, Candidate> = HashMap::new();
    let mut namespace_node = None;
    let class = pg_files::open_beneath(&dir, &format!("{base}/{class_node}"), owner)?;
    let pages = pg_files::for_each_page(class, MAX_PAGES, |page| {
        for t in pg_files::heap_tuples(page) {
            if t.deleted || t.aborted {
                continue;
            }
            let d = t.data;
            let (Some(oid), Some(node), Some(spc), Some(&shared), Some(&relkind)) = (
                u32_at(d, 0),
                u32_at(d, layout.relfilenode),
                u32_at(d, layout.reltablespace),
                d.get(layout.relisshared),
                d.get(layout.relkind),
            ) else {
                continue;
            };
            if oid == PG_NAMESPACE && node != 0 && (t.newest || namespace_node.is_none()) {
                namespace_node = Some(node);
            }
            // Mapped relations (pg_class itself, the shared catalogs, ...) say 0 here.
            let key = match (node, shared != 0) {
                (0, true) => pg_files::filenode(&global_map, oid).map(|n| (GLOBALTABLESPACE, n)),
                (0, false) => pg_files::filenode(&local_map, oid).map(|n| (spc, n)),
                (n, _) => Some((spc, n)),
            };
            let Some((tablespace, relfilenode)) = key else {
                continue;
            };
            let key = FileKey {
                tablespace,
                relfilenode,
            };
            if !wanted.contains(&key) || found.get(&key).is_some_and(|c| c.newest && !t.newest) {
                continue;
            }
            let (Some(name), Some(namespace)) =
                (pg_files::name_at(d, 4), u32_at(d, layout.relnamespace))
            else {
                continue;
            };
            found.insert(
                key,
                Candidate {
                    namespace,
                    name: name.to_owned(),
                    kind: Kind::from_relkind(relkind),
                    newest: t.newest,
                },
            );
        }
    })?;
    let mut truncated = pages == MAX_PAGES;

    let namespaces_wanted: HashSet<u32> = found.values().map(|c| c.namespace).collect();
    let mut schemas: HashMap<u32, String> = HashMap::new();
    if let Some(node) = namespace_node.filter(|_| !namespaces_wanted.is_empty()) {
        let file = pg_files::open_beneath(&dir, &format!("{base}/{node}"), owner)?;
        let pages = pg_files::for_each_page(file, MAX_PAGES, |page| {
            for t in pg_files::heap_tuples(page) {
                if t.deleted || t.aborted {
                    continue;
                }
                let (Some(oid), Some(name)) = (u32_at(t.data, 0), pg_files::name_at(t.data, 4))
                else {
                    continue;
                };
                if namespaces_wanted.contains(&oid) && (t.newest || !schemas.contains_key(&oid)) {
                    schemas.insert(oid, name.to_owned());
                }
            }
        })?;
        truncated |= pages == MAX_PAGES;
    }
    let relations = found
        .into_iter()
        .filter_map(|(key, c)| {
            let schema = schemas.get(&c.namespace)?.clone();
            Some((
                key,
                Relation {
                    schema,
                    name: c.name,
                    kind: c.kind,
                },
            ))
        })
        .collect();
    Ok(Found {
        relations,
        truncated,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_by_major() {
        assert_eq!(layout(17).map(|l| l.relkind), Some(115));
        assert_eq!(layout(18).map(|l| l.relkind), Some(119));
        assert!(layout(14).is_none() && layout(19).is_none());
        assert_eq!(Kind::from_relkind(b'i').as_str(), "index");
        assert_eq!(Kind::from_relkind(b'p').as_str(), "other");
    }
}
