//! `pgio-daemon check`: everything pgio needs from this node, each item ok / missing, and a
//! non-zero exit naming exactly what is missing.
use std::path::Path;

use caps::{CapSet, Capability};

use crate::{
    btf::{self, KernelBtf},
    kernel_offsets,
    probes::{self, Attach},
    tracefs,
};

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

pub fn run_checks() -> Vec<Finding> {
    let mut out = Vec::new();
    out.extend(privileges());
    let btf = if Path::new(btf::VMLINUX).exists() {
        match KernelBtf::open().and_then(|b| Ok((kernel_offsets::from_btf(&b)?, b))) {
            Ok((o, b)) => {
                out.push(finding(
                    Level::Ok,
                    format!("BTF {}: struct offsets {o:?}", btf::VMLINUX),
                ));
                Some(b)
            }
            Err(e) => {
                out.push(finding(Level::Fail, format!("BTF: {e:#}")));
                None
            }
        }
    } else {
        out.push(finding(
            Level::Fail,
            format!(
                "BTF: {} missing (kernel built without CONFIG_DEBUG_INFO_BTF)",
                btf::VMLINUX
            ),
        ));
        None
    };
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
    for probe in probes::table() {
        let program = &*probe.program;
        let (kind, present) = match probe.attach {
            Attach::BtfTracePoint => (
                format!("tp_btf/{program}"),
                btf.as_ref().is_some_and(|b| b.has_btf_tracepoint(program)),
            ),
            Attach::TracePoint(cat) => match &root {
                Some(r) => (
                    format!("tracepoint/{cat}/{program}"),
                    tracefs::tracepoint_exists(r, cat, program),
                ),
                None => continue,
            },
            // Attached per postgres binary at run time; a failure only costs speed.
            Attach::URetProbeLater { .. } => continue,
        };
        let level = match (present, probe.optional) {
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
