//! `pgio-daemon check`: everything pgio needs from this node, each item ok / missing, and a
//! non-zero exit naming exactly what is missing.
use std::path::Path;

use caps::{CapSet, Capability};

use crate::{kernel_offsets, probes, tracefs};

#[derive(Debug, PartialEq, Eq)]
pub enum Level {
    Ok,
    /// pgio runs, with less (a fallback is used).
    Warn,
    /// pgio cannot run.
    Fail,
}

pub struct Finding {
    pub level: Level,
    pub what: String,
}

fn finding(level: Level, what: impl Into<String>) -> Finding {
    Finding {
        level,
        what: what.into(),
    }
}

/// Programs pgio still works without: `block_io_start` appeared in 6.5 (the submitter then
/// comes from insert/issue), `futex_waitv` in 5.16.
fn optional(program: &str) -> bool {
    matches!(
        program,
        "block_io_start" | "sys_enter_futex_waitv" | "sys_exit_futex_waitv"
    )
}

pub fn run_checks() -> Vec<Finding> {
    let mut out = Vec::new();
    out.extend(privileges());
    let btf_ok = Path::new(kernel_offsets::VMLINUX_BTF).exists();
    if btf_ok {
        match kernel_offsets::from_vmlinux() {
            Ok(o) => out.push(finding(
                Level::Ok,
                format!("BTF {}: struct offsets {o:?}", kernel_offsets::VMLINUX_BTF),
            )),
            Err(e) => out.push(finding(Level::Fail, format!("BTF: {e:#}"))),
        }
    } else {
        out.push(finding(
            Level::Fail,
            format!(
                "BTF: {} missing (kernel built without CONFIG_DEBUG_INFO_BTF)",
                kernel_offsets::VMLINUX_BTF
            ),
        ));
    }
    let root = match tracefs::root() {
        Some(r) => {
            out.push(finding(
                Level::Ok,
                format!("tracefs mounted at {}", r.display()),
            ));
            Some(r)
        }
        None => {
            out.push(finding(
                Level::Warn,
                "tracefs not mounted: `pgio-daemon run` mounts it at /sys/kernel/tracing (needs CAP_SYS_ADMIN)",
            ));
            None
        }
    };
    let vmlinux = std::fs::read(kernel_offsets::VMLINUX_BTF).unwrap_or_default();
    for (program, attach) in probes::programs() {
        let present = match attach {
            probes::Attach::Btf => contains(&vmlinux, format!("btf_trace_{program}\0").as_bytes()),
            probes::Attach::TracePoint(cat) => match &root {
                Some(r) => tracefs::tracepoint_exists(r, cat, &program),
                None => continue,
            },
            // Attached per postgres binary at run time; a failure only costs speed.
            probes::Attach::UProbeLater => continue,
        };
        let kind = match attach {
            probes::Attach::Btf => format!("tp_btf/{program}"),
            probes::Attach::TracePoint(cat) => format!("tracepoint/{cat}/{program}"),
            probes::Attach::UProbeLater => continue,
        };
        let level = match (present, optional(&program)) {
            (true, _) => Level::Ok,
            (false, true) => Level::Warn,
            (false, false) => Level::Fail,
        };
        let what = if present {
            kind
        } else {
            format!("{kind} missing")
        };
        out.push(finding(level, what));
    }
    out
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    memchr::memmem::find(haystack, needle).is_some()
}

/// Capabilities only (what `run` checks before loading anything).
pub fn privileges() -> Vec<Finding> {
    let effective = match caps::read(None, CapSet::Effective) {
        Ok(c) => c,
        Err(e) => {
            return vec![finding(
                Level::Fail,
                format!("cannot read capabilities: {e}"),
            )];
        }
    };
    let has = |c: Capability| effective.contains(&c);
    let admin = has(Capability::CAP_SYS_ADMIN);
    let mut out = Vec::new();
    for (cap, why) in [
        (Capability::CAP_BPF, "load eBPF programs and maps"),
        (Capability::CAP_PERFMON, "attach tracepoints"),
    ] {
        if has(cap) || admin {
            out.push(finding(Level::Ok, format!("{cap} ({why})")));
        } else {
            out.push(finding(
                Level::Fail,
                format!("{cap} missing: needed to {why} (run as root or grant it)"),
            ));
        }
    }
    if has(Capability::CAP_SYS_PTRACE) {
        out.push(finding(
            Level::Ok,
            "CAP_SYS_PTRACE (read /proc/<pid>/exe of other users)",
        ));
    } else {
        out.push(finding(
            Level::Warn,
            "CAP_SYS_PTRACE missing: exe-based rules cannot see other users' processes",
        ));
    }
    out
}
