//! Where each postmaster's backends keep their query id (`IdSource`), found once per
//! postmaster from its binary and data directory (`query::backend_status`): its children
//! share its address space layout, so the kernel copies the postmaster's entry at each fork.
//! The postmaster's children that ran before pgio found it get theirs here.
use std::{collections::HashMap, io, path::Path};

use pgio_common::query_id::IdSource;

use crate::{lock, query::backend_status, relation::names, series::SharedTracked};

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

/// The postmasters looked at, and whether their source was found.
#[derive(Debug, Default)]
pub struct Sources {
    done: HashMap<u32, bool>,
}

impl Sources {
    /// Postmasters not looked at yet, each with those of `members` it is the parent of;
    /// forgets the ones gone.
    pub fn new_ones(&mut self, now: &[(u32, Vec<u32>)]) -> Vec<(u32, Vec<u32>)> {
        self.done.retain(|pid, _| now.iter().any(|(p, _)| p == pid));
        now.iter()
            .filter(|(pid, _)| !self.done.contains_key(pid))
            .map(|(pid, members)| {
                let children = members
                    .iter()
                    .copied()
                    .filter(|m| parent(*m) == Some(*pid))
                    .collect();
                (*pid, children)
            })
            .collect()
    }

    pub fn store(&mut self, pid: u32, found: io::Result<IdSource>) {
        if let Err(e) = &found {
            tracing::info!(pid, error = %e, "no query ids for this postmaster's backends");
        }
        self.done.insert(pid, found.is_ok());
    }

    /// (found, not found).
    pub fn count(&self) -> (u64, u64) {
        let found = self.done.values().filter(|f| **f).count() as u64;
        (found, self.done.len() as u64 - found)
    }
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
    let found = backend_status::symbol_addresses(
        pid,
        &[backend_status::SYMBOL, backend_status::WAIT_EVENT_SYMBOL],
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
    Ok(IdSource {
        my_be_entry,
        offset: offset.unwrap_or(0),
        my_wait_event_info,
    })
}
