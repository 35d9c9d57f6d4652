//! Reads processes from /proc for the classifier: the start-up scan, the periodic rescan, and
//! single processes as lifecycle events name them.
use anyhow::{Context as _, Result};
use procfs::process::{Process, StatFlags};

use crate::{
    classifier::{Classifier, Owner, ProcessInfo},
    labels::Labels,
};

pub fn read_process(pid: u32) -> Option<ProcessInfo> {
    let p = Process::new(pid as i32).ok()?;
    let stat = p.stat().ok()?;
    // Not `stat.flags()`: it refuses the whole word when the kernel sets a flag procfs does
    // not know yet.
    let flags = StatFlags::from_bits_truncate(stat.flags);
    let argv = p.cmdline().ok().unwrap_or_default();
    let exe = p.exe().ok().map(|e| e.to_string_lossy().into_owned());
    let mut info = ProcessInfo {
        pid,
        comm: stat.comm,
        cmdline: argv.join(" "),
        argv,
        exe,
        cwd: None,
        parent_comm: None,
        owner: None,
        parent: None,
        vouched: false,
        // Read by the classifier, for tracked processes only.
        pod: None,
        kthread: flags.contains(StatFlags::PF_KTHREAD),
        // Set on the leader before the kernel reports its exit, and readable until the parent
        // reaps it: a read in between must not track a process no event will untrack.
        exiting: flags.contains(StatFlags::PF_EXITING),
    };
    if Classifier::needs_cwd_and_parent(&info) {
        let (owner, cwd) = owner_of(&p, &info.cmdline);
        info.cwd = cwd;
        info.owner = owner;
        if let Ok(parent) = Process::new(stat.ppid)
            && let Ok(pstat) = parent.stat()
        {
            if pstat.comm == "postgres" {
                let cmdline = parent.cmdline().ok().unwrap_or_default().join(" ");
                info.parent = owner_of(&parent, &cmdline).0;
            }
            info.parent_comm = Some(pstat.comm);
        }
    }
    Some(info)
}

/// Who runs `p` from which binary in which data directory (`None` as long as its working
/// directory is not one: a postmaster changes into it after exec).
fn owner_of(p: &Process, cmdline: &str) -> (Option<Owner>, Option<String>) {
    use std::{io::ErrorKind::PermissionDenied, os::unix::fs::MetadataExt};
    let Ok(uid) = p.uid() else {
        return (None, None);
    };
    let dir = format!("/proc/{}/cwd", p.pid);
    let version = std::fs::metadata(format!("{dir}/PG_VERSION"));
    let link = p.cwd();
    let exe = std::fs::metadata(format!("/proc/{}/exe", p.pid));
    let cwd = link
        .as_ref()
        .ok()
        .filter(|_| version.is_ok())
        .map(|c| c.to_string_lossy().into_owned());
    let owner = Owner {
        uid,
        binary: exe.as_ref().ok().map(|m| (m.dev(), m.ino())),
        cwd_owner: cwd
            .as_ref()
            .and_then(|_| std::fs::metadata(&dir).ok())
            .map(|m| m.uid()),
        cwd: cwd.clone(),
        untitled: !cmdline.starts_with("postgres: "),
        // Without CAP_SYS_PTRACE (the links) or CAP_DAC_READ_SEARCH (a data directory is
        // 0700): see `postgres::trusted`.
        hidden: matches!(link, Err(procfs::ProcError::PermissionDenied(_)))
            || version.is_err_and(|e| e.kind() == PermissionDenied)
            || exe.is_err_and(|e| e.kind() == PermissionDenied),
    };
    (Some(owner), cwd)
}

/// Reads and classifies every process in /proc (the start-up scan, and the periodic rescan).
pub fn classify_all(classifier: &Classifier) -> Result<Vec<(u32, Option<Labels>)>> {
    let mut pids = Vec::new();
    for p in procfs::process::all_processes().context("listing /proc")? {
        let Ok(p) = p else { continue };
        pids.push(p.pid as u32);
    }
    Ok(classify_pids(classifier, &pids))
}

/// Reads all processes first and lets the classifier learn from all of them (a postmaster's
/// cluster name is only in its children's titles), then classifies each.
pub fn classify_pids(classifier: &Classifier, pids: &[u32]) -> Vec<(u32, Option<Labels>)> {
    let infos: Vec<(u32, Option<ProcessInfo>)> = pids
        .iter()
        .map(|&pid| (pid, read_process(pid).filter(|i| !i.exiting)))
        .collect();
    for info in infos.iter().filter_map(|(_, i)| i.as_ref()) {
        classifier.learn(info);
    }
    classifier.retain_clusters(
        &infos
            .iter()
            .filter_map(|(_, i)| i.as_ref()?.cwd.clone())
            .collect(),
    );
    infos
        .into_iter()
        .map(|(pid, info)| (pid, info.and_then(|i| classifier.classify(&i))))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// An exited, not yet reaped child is still in /proc with its comm: it must read as
    /// exiting, or a rescan that runs after its exit event would track it again.
    #[test]
    fn an_exited_process_reads_as_exiting() {
        let mut child = std::process::Command::new("sleep")
            .arg("0")
            .spawn()
            .expect("spawn sleep");
        let pid = child.id();
        let zombie = (0..500).any(|_| {
            std::thread::sleep(Duration::from_millis(2));
            Process::new(pid as i32)
                .and_then(|p| p.stat())
                .is_ok_and(|s| s.state == 'Z')
        });
        assert!(zombie, "sleep 0 did not become a zombie within 1 s");
        let seen = read_process(pid);
        child.wait().expect("reap");
        assert!(
            seen.is_some_and(|i| i.exiting),
            "a zombie must read as exiting"
        );
        assert!(read_process(std::process::id()).is_some_and(|i| !i.exiting));
    }
}
