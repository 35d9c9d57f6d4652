//! Where each postmaster's backends keep their query id (`IdSource`), found once per
//! postmaster from its binary and data directory (`query::backend_status`): its children
//! share its address space layout, so the kernel copies the postmaster's entry at each fork.
//! The postmaster's children that ran before pgio found it get theirs here.
use std::{
    collections::{HashMap, HashSet},
    io,
    path::Path,
    sync::Mutex,
};

use aya::maps::{HashMap as BpfHashMap, MapData};
use pgio_common::query_id::IdSource;

use crate::{lock, query::backend_status, relation::names, series::SharedTracked};

/// Tells the kernel where new postmasters' backends keep their query id, and where the
/// members it missed at their fork keep theirs.
pub fn publish(
    tracked: &SharedTracked,
    known: &Mutex<Sources>,
    map: &Mutex<BpfHashMap<MapData, u32, IdSource>>,
) {
    let postmasters = postmasters(tracked);
    let new = lock(known).new_ones(&postmasters);
    for (pid, children) in new {
        let found = find(pid);
        if let Ok(src) = &found {
            let mut map = lock(map);
            for p in std::iter::once(pid).chain(children) {
                // A process gone meanwhile needs none.
                let _ = map.insert(p, *src, 0);
            }
        }
        let members = postmasters
            .iter()
            .find(|(p, _)| *p == pid)
            .map_or(&[][..], |(_, m)| m.as_slice());
        lock(known).store(pid, found, members);
    }
    let late = lock(known).late_members(&postmasters);
    for (pm, src, members) in late {
        let mut map = lock(map);
        // Most have theirs, copied at their fork: one map lookup spares a /proc read.
        let missing: Vec<u32> = members
            .into_iter()
            .filter(|p| map.get(p, 0).is_err())
            .collect();
        for p in children(pm, &missing) {
            let _ = map.insert(p, src, 0);
        }
    }
}

/// Postmasters pgio tracks now, with the tracked PostgreSQL processes of their clusters.
pub fn postmasters(tracked: &SharedTracked) -> Vec<(u32, Vec<u32>)> {
    let t = lock(tracked);
    let mut by_cluster: HashMap<&str, (Vec<u32>, Vec<u32>)> = HashMap::new();
    for (pid, series) in &t.pids {
        let l = t.registry.exported(*series);
        if l.app != "postgres" || l.cluster.is_empty() {
            continue;
        }
        let e = by_cluster.entry(l.cluster.as_str()).or_default();
        if l.role == "postmaster" {
            e.0.push(*pid);
        } else {
            e.1.push(*pid);
        }
    }
    by_cluster
        .into_values()
        .flat_map(|(pms, others)| pms.into_iter().map(move |pm| (pm, others.clone())))
        .collect()
}

/// The postmasters looked at, and what was found.
#[derive(Debug, Default)]
pub struct Sources {
    done: HashMap<u32, Looked>,
}

#[derive(Debug)]
struct Looked {
    found: Option<IdSource>,
    /// Its tracked processes that have their entry (copied at their fork, or written here).
    given: HashSet<u32>,
}

impl Sources {
    /// Postmasters not looked at yet, each with those of `members` it is the parent of;
    /// forgets the ones gone.
    pub fn new_ones(&mut self, now: &[(u32, Vec<u32>)]) -> Vec<(u32, Vec<u32>)> {
        self.done.retain(|pid, _| now.iter().any(|(p, _)| p == pid));
        now.iter()
            .filter(|(pid, _)| !self.done.contains_key(pid))
            .map(|(pid, members)| (*pid, children(*pid, members)))
            .collect()
    }

    /// The found postmasters' processes tracked since the last pass, each postmaster with
    /// its pid and source: a child forked after the postmaster was tracked but before its
    /// entry was written got no copy at its fork (PostgreSQL 18's io workers start with
    /// their postmaster, so they nearly always do), and would never be read otherwise. Marks
    /// them given.
    pub fn late_members(&mut self, now: &[(u32, Vec<u32>)]) -> Vec<(u32, IdSource, Vec<u32>)> {
        let mut out = Vec::new();
        for (pid, members) in now {
            let Some(l) = self.done.get_mut(pid) else {
                continue;
            };
            l.given.retain(|m| members.contains(m));
            let Some(src) = l.found else {
                continue;
            };
            let new: Vec<u32> = members
                .iter()
                .copied()
                .filter(|m| !l.given.contains(m))
                .collect();
            l.given.extend(&new);
            if !new.is_empty() {
                out.push((*pid, src, new));
            }
        }
        out
    }

    /// What was found for postmaster `pid`; `members`: its tracked processes now, which
    /// have their entry from here on.
    pub fn store(&mut self, pid: u32, found: io::Result<IdSource>, members: &[u32]) {
        if let Err(e) = &found {
            tracing::info!(pid, error = %e, "no query ids for this postmaster's backends");
        }
        self.done.insert(
            pid,
            Looked {
                found: found.ok(),
                given: members.iter().copied().collect(),
            },
        );
    }

    /// (found, not found).
    pub fn count(&self) -> (u64, u64) {
        let found = self.done.values().filter(|l| l.found.is_some()).count() as u64;
        (found, self.done.len() as u64 - found)
    }
}

/// Those of `members` whose parent is `pid`.
pub fn children(pid: u32, members: &[u32]) -> Vec<u32> {
    members
        .iter()
        .copied()
        .filter(|m| parent(*m) == Some(pid))
        .collect()
}

fn parent(pid: u32) -> Option<u32> {
    let stat = procfs::process::Process::new(pid as i32)
        .ok()?
        .stat()
        .ok()?;
    u32::try_from(stat.ppid).ok()
}

/// Where the backends of postmaster `pid` keep their query id and their wait event. A
/// PostgreSQL whose `PgBackendStatus` layout pgio does not know keeps its wait events.
pub fn find(pid: u32) -> io::Result<IdSource> {
    let major = names::major(Path::new(&format!("/proc/{pid}/cwd")))?;
    let offset = backend_status::query_id_offset(major);
    let [error_context_stack, proc_global, my_proc_number] = backend_status::AIO_OWNER_SYMBOLS;
    let found = backend_status::symbol_addresses(
        pid,
        &[
            backend_status::SYMBOL,
            backend_status::WAIT_EVENT_SYMBOL,
            error_context_stack,
            proc_global,
            my_proc_number,
        ],
    )?;
    let my_be_entry = offset.and(found[0]).unwrap_or(0);
    let my_wait_event_info = found[1].unwrap_or(0);
    if my_be_entry == 0 && my_wait_event_info == 0 {
        return Err(io::Error::new(
            io::ErrorKind::Unsupported,
            format!(
                "PostgreSQL {major}: no MyBEEntry of a known PgBackendStatus layout, no my_wait_event_info"
            ),
        ));
    }
    let (aio_owner_at, proc_size, proc_pid_at) =
        backend_status::aio_layout(major).unwrap_or_default();
    Ok(IdSource {
        my_be_entry,
        offset: offset.unwrap_or(0),
        my_wait_event_info,
        postmaster: pid,
        aio_owner_at,
        error_context_stack: found[2].unwrap_or(0),
        proc_global: found[3].unwrap_or(0),
        my_proc_number: found[4].unwrap_or(0),
        proc_size,
        proc_pid_at,
        major,
        _pad: 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn late_members_are_given_once_and_again_after_they_left() {
        let src = IdSource {
            postmaster: 10,
            ..IdSource::default()
        };
        let mut s = Sources::default();
        s.store(10, Ok(src), &[11, 12]);
        s.store(20, Err(io::Error::other("no symbols")), &[21]);
        let now = vec![(10, vec![11, 12, 13]), (20, vec![21, 22])];
        // 13 came after the store; 20 has no source to give.
        assert_eq!(s.late_members(&now), vec![(10, src, vec![13])]);
        assert_eq!(s.late_members(&now), vec![]);
        // 12 gone (its pid free), then a process with that pid is a member again.
        assert_eq!(s.late_members(&[(10, vec![11, 13])]), vec![]);
        assert_eq!(s.late_members(&now), vec![(10, src, vec![12])]);
        assert_eq!(s.count(), (1, 1));
    }
}
