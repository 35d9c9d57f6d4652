//! The kernel's own limits on tracing, whatever pgio's capabilities: kernel lockdown and
//! `perf_event_paranoid`. Each is a `check` line saying what it disables and the fix.
use std::io;

use super::{Finding, Level, finding};
use crate::lockdown::{LOCKDOWN, Lockdown, parse_lockdown};
use crate::privileges;

pub const PERF_EVENT_PARANOID: &str = "/proc/sys/kernel/perf_event_paranoid";

/// Both lines, read from this node and tried with this process' capabilities.
pub fn findings() -> Vec<Finding> {
    let paranoid = std::fs::read_to_string(PERF_EVENT_PARANOID)
        .ok()
        .and_then(|t| t.trim().parse().ok());
    vec![
        lockdown_finding(std::fs::read_to_string(LOCKDOWN)),
        paranoid_finding(paranoid, privileges::perf_open_system_wide()),
    ]
}

/// `read`: /sys/kernel/security/lockdown's text, or why it could not be read.
pub fn lockdown_finding(read: io::Result<String>) -> Finding {
    let text = match read {
        Ok(t) => t,
        // No lockdown LSM, or no securityfs in this mount namespace (a container's).
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return finding(
                Level::Ok,
                format!(
                    "lockdown: {LOCKDOWN} absent (no lockdown LSM, or securityfs not mounted \
                     here); under lockdown=confidentiality tracefs is refused and pgio cannot run"
                ),
            );
        }
        Err(e) => return finding(Level::Warn, format!("lockdown: reading {LOCKDOWN}: {e}")),
    };
    match parse_lockdown(&text) {
        Some(Lockdown::None) => finding(Level::Ok, "lockdown: none"),
        Some(Lockdown::Integrity) => finding(
            Level::Ok,
            "lockdown: integrity (it refuses bpf_probe_write_user and debugfs writes, which \
             pgio does not use)",
        ),
        Some(Lockdown::Confidentiality) => finding(
            Level::Fail,
            "lockdown: confidentiality: the kernel refuses tracefs (`pgio-daemon run` exits: \
             no tracepoint/ probe can attach) and bpf_probe_read_kernel; boot with \
             lockdown=integrity (Debian's, Ubuntu's, RHEL's default under Secure Boot) or \
             without lockdown",
        ),
        None => finding(
            Level::Warn,
            format!("lockdown: {LOCKDOWN} says {:?}", text.trim()),
        ),
    }
}

/// `errno`: what a system-wide `perf_event_open` got (None: allowed).
pub fn paranoid_finding(paranoid: Option<i64>, errno: Option<i32>) -> Finding {
    let level = paranoid.map_or("unreadable".to_owned(), |p| p.to_string());
    match errno {
        None => finding(
            Level::Ok,
            format!("perf_event_paranoid = {level}: perf_event_open allowed"),
        ),
        Some(e @ (libc::EACCES | libc::EPERM)) => finding(
            Level::Fail,
            format!(
                "perf_event_paranoid = {level}: perf_event_open refused ({}): the tracepoint/ \
                 probes (syscalls, sched_process_exec/exit) and PostgreSQL's uprobes cannot \
                 attach. Debian's and Ubuntu's kernels refuse it from 3 on without \
                 CAP_SYS_ADMIN (upstream stops at 2); fix: sysctl kernel.perf_event_paranoid=2 \
                 on the node, or grant SYS_ADMIN",
                io::Error::from_raw_os_error(e)
            ),
        ),
        Some(e) => finding(
            Level::Warn,
            format!(
                "perf_event_paranoid = {level}: a test perf_event_open failed: {}",
                io::Error::from_raw_os_error(e)
            ),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lockdown_modes() {
        assert_eq!(
            parse_lockdown("[none] integrity confidentiality\n"),
            Some(Lockdown::None)
        );
        assert_eq!(
            parse_lockdown("none integrity [confidentiality]"),
            Some(Lockdown::Confidentiality)
        );
        assert_eq!(parse_lockdown("none integrity confidentiality"), None);
        let level = |t: &str| lockdown_finding(Ok(t.to_owned())).level;
        assert_eq!(level("[none] integrity confidentiality"), Level::Ok);
        assert_eq!(level("none [integrity] confidentiality"), Level::Ok);
        assert_eq!(level("none integrity [confidentiality]"), Level::Fail);
        assert_eq!(level("garbage"), Level::Warn);
        let absent = io::Error::from(io::ErrorKind::NotFound);
        assert_eq!(lockdown_finding(Err(absent)).level, Level::Ok);
    }

    #[test]
    fn paranoid_answers() {
        assert_eq!(paranoid_finding(Some(4), None).level, Level::Ok);
        let refused = paranoid_finding(Some(3), Some(libc::EACCES));
        assert_eq!(refused.level, Level::Fail);
        assert!(
            refused
                .what
                .starts_with("perf_event_paranoid = 3: perf_event_open refused"),
            "{}",
            refused.what
        );
        assert_eq!(
            paranoid_finding(None, Some(libc::ENODEV)).level,
            Level::Warn
        );
    }
}
