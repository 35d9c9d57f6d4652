//! What pgio keeps of root once its programs are loaded and its listener bound.
//!
//! Kept (each only if pgio had it), because pgio does this for as long as it runs:
//! - CAP_BPF: every `bpf()` call (map reads at each scrape, links for uprobes) when
//!   `kernel.unprivileged_bpf_disabled` is set, as it is by default;
//! - CAP_PERFMON: `perf_event_open` for the uprobes attached to each new postgres binary;
//! - CAP_SYS_ADMIN: only where the kernel still wants it for those uprobes (Linux >= 6.16 and
//!   backports, found out by `uprobes_need_sys_admin`) or where CAP_BPF/CAP_PERFMON do not exist
//!   (kernels before 5.8);
//! - CAP_SYS_PTRACE: /proc/<pid>/{cwd,exe} of other users' processes;
//! - CAP_DAC_READ_SEARCH: files in other users' 0700 directories (a data directory's catalog).
//!
//! Everything else leaves the effective, permitted, inheritable, ambient and bounding sets, and
//! `no_new_privs` is set. Capabilities are per thread: this must run before pgio starts any.
use std::io;

use caps::{CapSet, Capability, CapsHashSet};
use tracing::{info, warn};

/// Soft RLIMIT_NOFILE raised to the hard limit: HTTP connections are capped, and the rest
/// (map fds, uprobe links, /proc reads) must not run out because of a low default soft 1,024.
pub fn raise_nofile() -> io::Result<(u64, u64)> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: plain struct out-argument.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(io::Error::last_os_error());
    }
    if lim.rlim_cur < lim.rlim_max {
        let raised = libc::rlimit {
            rlim_cur: lim.rlim_max,
            rlim_max: lim.rlim_max,
        };
        // SAFETY: plain struct argument.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } != 0 {
            return Err(io::Error::last_os_error());
        }
        lim = raised;
    }
    Ok((lim.rlim_cur, lim.rlim_max))
}

/// The capabilities kept, with why (for the log and `check`).
pub fn wanted(effective: &CapsHashSet, uprobes_need_sys_admin: bool) -> Vec<(Capability, &str)> {
    use Capability::*;
    let has = |c| effective.contains(&c);
    let mut keep = Vec::new();
    for (cap, why) in [
        (CAP_BPF, "bpf(): map reads, uprobe links"),
        (CAP_PERFMON, "perf_event_open for uprobes"),
        (CAP_SYS_PTRACE, "/proc/<pid>/cwd and exe of other users"),
        (
            CAP_DAC_READ_SEARCH,
            "files in other users' data directories",
        ),
    ] {
        if has(cap) {
            keep.push((cap, why));
        }
    }
    if has(CAP_SYS_ADMIN) {
        if !has(CAP_BPF) || !has(CAP_PERFMON) {
            keep.push((
                CAP_SYS_ADMIN,
                "bpf() and perf_event_open (no CAP_BPF/CAP_PERFMON)",
            ));
        } else if uprobes_need_sys_admin {
            keep.push((CAP_SYS_ADMIN, "this kernel creates uprobes only with it"));
        }
    }
    keep
}

/// What `drop_to` did.
#[derive(Debug)]
pub struct Dropped {
    pub kept: Vec<Capability>,
    /// Steps that failed (e.g. the bounding set without CAP_SETPCAP): pgio carries on.
    pub failed: Vec<String>,
}

/// Drops every capability but `keep` from all sets of this thread, and sets `no_new_privs`.
/// Failures are collected, not fatal: a non-root pgio with file capabilities may not be
/// allowed to change its bounding set.
pub fn drop_to(keep: &CapsHashSet) -> Dropped {
    let mut failed = Vec::new();
    // The bounding set first: it needs CAP_SETPCAP, which goes with the effective set below.
    match caps::read(None, CapSet::Bounding) {
        Ok(bounding) => {
            let mut left = Vec::new();
            for cap in bounding.difference(keep) {
                if caps::drop(None, CapSet::Bounding, *cap).is_err() {
                    left.push(cap.to_string());
                }
            }
            if !left.is_empty() {
                left.sort();
                // Without CAP_SETPCAP: harmless once permitted is reduced and no_new_privs set.
                failed.push(format!(
                    "{} left in the bounding set (no CAP_SETPCAP?): {}",
                    left.len(),
                    left.join(", ")
                ));
            }
        }
        Err(e) => failed.push(format!("reading the bounding set: {e}")),
    }
    for set in [CapSet::Ambient, CapSet::Inheritable] {
        if let Err(e) = caps::clear(None, set) {
            failed.push(format!("{set:?}: {e}"));
        }
    }
    for set in [CapSet::Effective, CapSet::Permitted] {
        let now = match caps::read(None, set) {
            Ok(s) => s,
            Err(e) => {
                failed.push(format!("reading {set:?}: {e}"));
                continue;
            }
        };
        let target: CapsHashSet = now.intersection(keep).copied().collect();
        if let Err(e) = caps::set(None, set, &target) {
            failed.push(format!("{set:?}: {e}"));
        }
    }
    // SAFETY: prctl with integer arguments.
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
        failed.push(format!("no_new_privs: {}", io::Error::last_os_error()));
    }
    let kept = caps::read(None, CapSet::Effective)
        .map(|s| s.into_iter().collect())
        .unwrap_or_default();
    Dropped { kept, failed }
}

/// Drops to what pgio needs from now on and logs what remains and why.
pub fn drop_unneeded() {
    let effective = match caps::read(None, CapSet::Effective) {
        Ok(e) => e,
        Err(e) => {
            warn!("cannot read capabilities, none dropped: {e}");
            return;
        }
    };
    let threads = thread_count();
    if threads != Some(1) {
        warn!(
            ?threads,
            "capabilities are dropped on this thread only, other threads keep theirs"
        );
    }
    let sys_admin_for_uprobes = effective.contains(&Capability::CAP_SYS_ADMIN)
        && effective.contains(&Capability::CAP_PERFMON)
        && uprobes_need_sys_admin();
    let wanted = wanted(&effective, sys_admin_for_uprobes);
    let keep: CapsHashSet = wanted.iter().map(|(c, _)| *c).collect();
    let dropped = drop_to(&keep);
    for (cap, why) in &wanted {
        info!("capability kept: {cap} ({why})");
    }
    let mut kept = dropped.kept.clone();
    kept.sort_by_key(|c| c.index());
    info!(
        kept = ?kept.iter().map(|c| c.to_string()).collect::<Vec<_>>(),
        "capabilities dropped but these; no_new_privs set"
    );
    for f in &dropped.failed {
        warn!("dropping capabilities: {f}");
    }
}

fn thread_count() -> Option<usize> {
    std::fs::read_dir("/proc/self/task").ok().map(|d| d.count())
}

/// Whether creating a uprobe needs CAP_SYS_ADMIN on this kernel (Linux 6.16 reverted uprobes
/// from CAP_PERFMON to CAP_SYS_ADMIN, and stable kernels took the revert). Asked of the
/// kernel: with CAP_SYS_ADMIN out of the effective set for a moment, `perf_event_open` on the
/// uprobe PMU for a path that does not exist fails with EACCES where the capability is
/// checked, and with ENOENT/EINVAL past that check, creating nothing. Unsure means yes.
pub fn uprobes_need_sys_admin() -> bool {
    let Some(pmu) = std::fs::read_to_string("/sys/bus/event_source/devices/uprobe/type")
        .ok()
        .and_then(|t| t.trim().parse::<u32>().ok())
    else {
        return true;
    };
    if caps::drop(None, CapSet::Effective, Capability::CAP_SYS_ADMIN).is_err() {
        return true;
    }
    let errno = perf_open_uprobe(pmu, c"/nonexistent/pgio-capability-probe");
    if let Err(e) = caps::raise(None, CapSet::Effective, Capability::CAP_SYS_ADMIN) {
        warn!("CAP_SYS_ADMIN could not be raised again: {e}");
    }
    match errno {
        Some(libc::EACCES) | Some(libc::EPERM) => true,
        Some(libc::ENOENT) | Some(libc::EINVAL) => false,
        other => {
            warn!(
                ?other,
                "unexpected answer probing uprobe privileges: CAP_SYS_ADMIN kept"
            );
            true
        }
    }
}

/// The first fields of `struct perf_event_attr` (PERF_ATTR_SIZE_VER1, 72 bytes).
#[repr(C)]
#[derive(Default)]
struct PerfEventAttr {
    type_: u32,
    size: u32,
    config: u64,
    sample_period: u64,
    sample_type: u64,
    read_format: u64,
    flags: u64,
    wakeup_events: u32,
    bp_type: u32,
    /// `uprobe_path`
    config1: u64,
    /// `probe_offset`
    config2: u64,
}

/// `perf_event_open` of a disabled, user-only uprobe on `path` for this thread; the errno, or
/// None if it was created (then closed again).
fn perf_open_uprobe(pmu: u32, path: &std::ffi::CStr) -> Option<i32> {
    const EXCLUDE_KERNEL: u64 = 1 << 5;
    const EXCLUDE_HV: u64 = 1 << 6;
    let attr = PerfEventAttr {
        type_: pmu,
        size: std::mem::size_of::<PerfEventAttr>() as u32,
        flags: DISABLED | EXCLUDE_KERNEL | EXCLUDE_HV,
        config1: path.as_ptr() as u64,
        ..Default::default()
    };
    // `path` outlives the call.
    perf_open(&attr, 0, -1)
}

/// `perf_event_open` of a disabled software event for every task on CPU 0, as a tracepoint
/// probe is opened: the errno, or None if the kernel allowed it (the event is closed again).
/// What it asks is what `perf_event_paranoid` and the capabilities decide, nothing more.
pub fn perf_open_system_wide() -> Option<i32> {
    const PERF_TYPE_SOFTWARE: u32 = 1;
    const PERF_COUNT_SW_DUMMY: u64 = 9;
    let attr = PerfEventAttr {
        type_: PERF_TYPE_SOFTWARE,
        size: std::mem::size_of::<PerfEventAttr>() as u32,
        config: PERF_COUNT_SW_DUMMY,
        flags: DISABLED,
        ..Default::default()
    };
    perf_open(&attr, -1, 0)
}

const DISABLED: u64 = 1;

/// `perf_event_open(attr, pid, cpu)`: the errno, or None if the event was created (and is
/// closed again at once).
fn perf_open(attr: &PerfEventAttr, pid: libc::pid_t, cpu: libc::c_int) -> Option<i32> {
    const PERF_FLAG_FD_CLOEXEC: libc::c_ulong = 1 << 3;
    // SAFETY: a valid attr of the size it gives; pointers in it are the caller's, live.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_perf_event_open,
            attr as *const PerfEventAttr,
            pid,
            cpu,
            -1 as libc::c_int,
            PERF_FLAG_FD_CLOEXEC,
        )
    };
    if fd >= 0 {
        // SAFETY: our own new fd.
        unsafe { libc::close(fd as i32) };
        None
    } else {
        io::Error::last_os_error().raw_os_error()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Capability::*;

    fn kept(effective: &[Capability], uprobes_need_sys_admin: bool) -> Vec<Capability> {
        let set: CapsHashSet = effective.iter().copied().collect();
        wanted(&set, uprobes_need_sys_admin)
            .into_iter()
            .map(|(c, _)| c)
            .collect()
    }

    #[test]
    fn root_keeps_five_or_four() {
        let root: Vec<Capability> = caps::all().into_iter().collect();
        let base = vec![CAP_BPF, CAP_PERFMON, CAP_SYS_PTRACE, CAP_DAC_READ_SEARCH];
        assert_eq!(kept(&root, false), base);
        let mut with_admin = base.clone();
        with_admin.push(CAP_SYS_ADMIN);
        assert_eq!(kept(&root, true), with_admin);
        // Before 5.8 (no CAP_BPF, CAP_PERFMON) CAP_SYS_ADMIN does their work.
        assert_eq!(
            kept(&[CAP_SYS_ADMIN, CAP_SYS_PTRACE, CAP_SETPCAP], false),
            [CAP_SYS_PTRACE, CAP_SYS_ADMIN]
        );
        // A container granted only some: only those, never more.
        assert_eq!(kept(&[CAP_BPF, CAP_PERFMON], true), [CAP_BPF, CAP_PERFMON]);
    }
}
