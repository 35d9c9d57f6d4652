//! The names of the relation files pgio books IO on, per cluster: `schema.name` and kind
//! (`names`) and each database's name (`pg_catalog::database_names`), read through a live
//! process of the cluster (`/proc/<pid>/cwd`: a container's data directory too) by the
//! collector's pass, never by a scrape.
//!
//! Only the files the last scrape saw are asked for and kept, so memory follows the relation
//! map's keys, not how many tables a user creates. A cluster is read again `REREAD_UNNAMED`
//! after its last read while one of its files has no name (a relfilenode made since the last
//! checkpoint: `VACUUM FULL`, `TRUNCATE`, a new table), and every `REREAD` anyway, for
//! renames. A file keeps its name once known while pgio books IO on it: only a relfilenode
//! reused after the OID counter wrapped (4 billion new relations) could be misnamed so.
use std::{
    collections::{BTreeMap, HashMap, HashSet},
    path::PathBuf,
    time::{Duration, Instant},
};

use pgio_common::relation::{PG_DEFAULT_TABLESPACE, PG_GLOBAL_TABLESPACE};

use super::names::{self, FileKey, Relation};
use crate::classifier::pg_catalog;

const REREAD_UNNAMED: Duration = Duration::from_secs(5);
const REREAD: Duration = Duration::from_secs(60);
/// `template1`: every cluster has it, and its `pg_class` lists the shared catalogs too.
const TEMPLATE1: u32 = 1;

/// A relation file as its path names it: database oid (0 under `global/`), the tablespace of
/// the path (`base/`: 1663), relfilenode.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FileRef {
    pub db: u32,
    pub tablespace: u32,
    pub relfilenode: u32,
}

impl FileRef {
    /// The `pg_class` keys that may name it, best first: `reltablespace` is 0 for a relation in
    /// its database's default tablespace, which is `pg_default` for nearly every database.
    fn keys(self) -> [FileKey; 2] {
        let key = |tablespace| FileKey {
            tablespace,
            relfilenode: self.relfilenode,
        };
        match self.tablespace {
            PG_DEFAULT_TABLESPACE => [key(0), key(PG_DEFAULT_TABLESPACE)],
            PG_GLOBAL_TABLESPACE => [key(PG_GLOBAL_TABLESPACE), key(PG_GLOBAL_TABLESPACE)],
            spc => [key(spc), key(0)],
        }
    }
}

#[derive(Debug, Default)]
struct ClusterBook {
    /// A live process of the cluster, as of the last scrape.
    pid: u32,
    wanted: HashSet<FileRef>,
    /// Wanted files a read has looked for (found or not).
    tried: HashSet<FileRef>,
    relations: HashMap<FileRef, Relation>,
    databases: HashMap<u32, String>,
    read_at: Option<Instant>,
}

/// What a pass must read: one cluster's wanted files, through `pid`.
pub struct Job {
    cluster: String,
    pid: u32,
    wanted: HashSet<FileRef>,
}

/// What a read found.
pub struct Read {
    relations: HashMap<FileRef, Relation>,
    databases: HashMap<u32, String>,
}

#[derive(Debug, Default)]
pub struct NameBook {
    clusters: HashMap<String, ClusterBook>,
    /// Catalog reads that failed (unreadable, not a regular file, wrong owner, unknown
    /// version): the cluster's files stay `(relfilenode <n>)`.
    pub read_errors: u64,
}

impl NameBook {
    /// The files each cluster's series booked IO on in this scrape, and a live process of
    /// it (0: none now, so not read); clusters not listed are forgotten.
    pub fn want(&mut self, wanted: HashMap<String, (u32, HashSet<FileRef>)>) {
        self.clusters.retain(|c, _| wanted.contains_key(c));
        for (cluster, (pid, files)) in wanted {
            let book = self.clusters.entry(cluster).or_default();
            book.relations.retain(|f, _| files.contains(f));
            book.tried.retain(|f| files.contains(f));
            book.pid = pid;
            book.wanted = files;
        }
    }

    /// What a read of `cluster` found for `file`: its relation and database, or nothing
    /// (fixtures: `tests/exposition.rs`).
    pub fn remember(&mut self, cluster: &str, file: FileRef, found: Option<(Relation, &str)>) {
        let book = self.clusters.entry(cluster.to_owned()).or_default();
        book.wanted.insert(file);
        book.tried.insert(file);
        if let Some((relation, database)) = found {
            book.databases.insert(file.db, database.to_owned());
            book.relations.insert(file, relation);
        }
    }

    pub fn relation(&self, cluster: &str, file: &FileRef) -> Option<&Relation> {
        self.clusters.get(cluster)?.relations.get(file)
    }

    /// `file` of `cluster` has not been looked for yet, and will be (the cluster has a live
    /// process): the family holds its IO back until then (a few seconds), so that it starts
    /// under its name rather than as `(relfilenode <n>)` taking a place or landing in `(rest)`.
    pub fn pending(&self, cluster: &str, file: &FileRef) -> bool {
        self.clusters.get(cluster).is_some_and(|b| {
            b.pid != 0 && !b.tried.contains(file) && !b.relations.contains_key(file)
        })
    }

    pub fn database(&self, cluster: &str, db: u32) -> Option<&str> {
        self.clusters
            .get(cluster)?
            .databases
            .get(&db)
            .map(String::as_str)
    }

    /// The clusters due for a read at `now`.
    pub fn due(&self, now: Instant) -> Vec<Job> {
        self.clusters
            .iter()
            .filter(|(_, b)| b.pid != 0 && !b.wanted.is_empty())
            .filter(|(_, b)| {
                let unnamed = b.wanted.iter().any(|f| !b.relations.contains_key(f));
                b.read_at.is_none_or(|at| {
                    let age = now.saturating_duration_since(at);
                    age >= REREAD || (unnamed && age >= REREAD_UNNAMED)
                })
            })
            .map(|(cluster, b)| Job {
                cluster: cluster.clone(),
                pid: b.pid,
                wanted: b.wanted.clone(),
            })
            .collect()
    }

    /// Stores what reading `job` gave (at `now`).
    pub fn store(&mut self, job: &Job, read: std::io::Result<Read>, now: Instant) {
        let Some(book) = self.clusters.get_mut(&job.cluster) else {
            return;
        };
        book.read_at = Some(now);
        book.tried
            .extend(job.wanted.iter().filter(|f| book.wanted.contains(f)));
        match read {
            Ok(r) => {
                // A file keeps its name once known: the IO on it was IO on that relation,
                // also after a VACUUM FULL or a DROP took the file out of pg_class (a rename
                // renames it).
                book.relations.extend(r.relations);
                book.databases.extend(r.databases);
            }
            Err(_) => self.read_errors += 1,
        }
    }
}

impl Job {
    /// Reads the catalogs (no lock held: this may read megabytes).
    pub fn read(&self) -> std::io::Result<Read> {
        let dir = PathBuf::from(format!("/proc/{}/cwd", self.pid));
        let major = names::major(&dir)?;
        let databases = pg_catalog::database_names(&dir)?;
        let mut by_db: BTreeMap<u32, Vec<FileRef>> = BTreeMap::new();
        for f in &self.wanted {
            by_db.entry(f.db).or_default().push(*f);
        }
        // Shared catalogs are listed in every database's pg_class: read them with another
        // database's, or template1's.
        if let Some(global) = by_db.remove(&0) {
            let with = by_db.keys().next().copied().unwrap_or(TEMPLATE1);
            by_db.entry(with).or_default().extend(global);
        }
        let mut relations = HashMap::new();
        for (db, files) in by_db {
            let keys: HashSet<FileKey> = files.iter().flat_map(|f| f.keys()).collect();
            let found = names::read(&dir, major, db, &keys)?;
            for f in files {
                if let Some(r) = f.keys().iter().find_map(|k| found.relations.get(k)) {
                    relations.insert(f, r.clone());
                }
            }
        }
        Ok(Read {
            relations,
            databases,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::relation::names::Kind;

    fn file(relfilenode: u32) -> FileRef {
        FileRef {
            db: 5,
            tablespace: PG_DEFAULT_TABLESPACE,
            relfilenode,
        }
    }

    #[test]
    fn reads_are_due_sooner_while_a_file_is_unnamed_and_forgotten_files_go() {
        let mut book = NameBook::default();
        let t0 = Instant::now();
        let want = |files: &[u32]| {
            HashMap::from([(
                "c".to_owned(),
                (42, files.iter().map(|n| file(*n)).collect()),
            )])
        };
        book.want(want(&[1, 2]));
        assert!(book.pending("c", &file(2)));
        let jobs = book.due(t0);
        assert_eq!(jobs.len(), 1);
        let a = Relation {
            schema: "public".into(),
            name: "a".into(),
            kind: Kind::Table,
        };
        let read = Read {
            relations: HashMap::from([(file(1), a.clone())]),
            databases: HashMap::from([(5, "db".into())]),
        };
        book.store(&jobs[0], Ok(read), t0);
        assert_eq!(book.relation("c", &file(1)), Some(&a));
        assert_eq!(book.database("c", 5), Some("db"));
        assert!(!book.pending("c", &file(2)) && !book.pending("other", &file(2)));
        // File 2 has no name yet: read again after REREAD_UNNAMED, not before.
        assert!(book.due(t0 + Duration::from_secs(1)).is_empty());
        assert_eq!(book.due(t0 + REREAD_UNNAMED).len(), 1);
        // All named: only after REREAD.
        book.want(want(&[1]));
        assert!(book.due(t0 + REREAD_UNNAMED).is_empty());
        assert_eq!(book.due(t0 + REREAD).len(), 1);
        // A failed read counts and loses no name; a file out of the catalogs keeps its name.
        let job = &book.due(t0 + REREAD)[0];
        book.store(job, Err(std::io::Error::other("fifo")), t0 + REREAD);
        assert_eq!(book.read_errors, 1);
        let empty = Read {
            relations: HashMap::new(),
            databases: HashMap::new(),
        };
        book.store(job, Ok(empty), t0 + REREAD);
        assert_eq!(book.relation("c", &file(1)), Some(&a));
        // A cluster with no live process is not read: nothing waits for it.
        book.want(HashMap::from([(
            "c".to_owned(),
            (0, HashSet::from([file(3)])),
        )]));
        assert!(!book.pending("c", &file(3)) && book.due(t0 + REREAD).is_empty());
        book.want(HashMap::new());
        assert!(book.clusters.is_empty());
    }

    #[test]
    fn a_file_in_base_is_looked_up_in_the_default_tablespace_first() {
        assert_eq!(file(7).keys()[0].tablespace, 0);
        let spc = FileRef {
            db: 5,
            tablespace: 16_400,
            relfilenode: 7,
        };
        assert_eq!(spc.keys()[0].tablespace, 16_400);
    }
}
