//! `pgio-daemon check`: everything pgio needs from this node, each item ok / missing, and a
//! non-zero exit naming exactly what is missing.
use std::path::Path;

use caps::{CapSet, Capability};

use crate::{
    btf::{self, KernelBtf},
    config::Config,
    family::Attach,
    kernel_offsets, map_memory, probes, tracefs,
};

pub mod restrictions;

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

/// `possible_cpus`: the maps' memory for a node with that many possible CPUs instead of this
/// one (`check --possible-cpus`).
pub fn run_checks(possible_cpus: Option<u32>) -> Vec<Finding> {
    let mut out = Vec::new();
    out.extend(privileges());
    out.extend(restrictions::findings());
    let btf = if Path::new(btf::VMLINUX).exists() {
        match KernelBtf::open() {
            Ok(b) => {
                // The hooks below are still checked when an offset is missing.
                match kernel_offsets::from_btf(&b) {
                    Ok(o) => {
                        out.push(finding(
                            Level::Ok,
                            format!("BTF {}: struct offsets {o:?}", btf::VMLINUX),
                        ));
                        if o.task_run_delay == 0 {
                            out.push(finding(
                                Level::Warn,
                                "BTF: task_struct has no sched_info (CONFIG_SCHED_INFO): query time is not split by wait event, and PostgreSQL 18's waits for its io workers are IO time only with query_probes = true",
                            ));
                        }
                    }
                    Err(e) => out.push(finding(Level::Fail, format!("BTF: {e:#}"))),
                }
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
        None if crate::lockdown::mode() == Some(crate::lockdown::Lockdown::Confidentiality) => {
            out.push(finding(
                Level::Fail,
                "tracefs: its events/ cannot be read under lockdown=confidentiality (above)",
            ));
            None
        }
        None => {
            out.push(finding(
                Level::Warn,
                "tracefs not mounted: `pgio-daemon run` mounts it at /sys/kernel/tracing (needs CAP_SYS_ADMIN)",
            ));
            None
        }
    };
    out.push(map_memory_finding(possible_cpus));
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
            // Attached per postgres binary at run time (the title: a failure costs speed; the
            // query probe: the query metrics).
            Attach::URetProbeLater { .. } | Attach::UProbeLater { .. } => continue,
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

/// The kernel memory the maps will take on this node with the default config, against what
/// the memory cgroup has left; or on a node of `possible_cpus` (no cgroup to hold it to).
fn map_memory_finding(possible_cpus: Option<u32>) -> Finding {
    let line = match possible_cpus {
        Some(cpus) => map_memory::estimate(&Config::default(), cpus)
            .map(|(total, maps)| map_memory::describe(total, &maps, cpus)),
        None => map_memory::require_fits(&Config::default()),
    };
    match line {
        Ok(line) => finding(Level::Ok, line),
        Err(e) => finding(Level::Fail, format!("{e:#}")),
    }
}

/// Capabilities only (what `run` checks before loading anything).
pub fn privileges() -> Vec<Finding> {
    match caps::read(None, CapSet::Effective) {
        Ok(effective) => privileges_of(&effective),
        Err(e) => vec![finding(
            Level::Fail,
            format!("cannot read capabilities: {e}"),
        )],
    }
}

/// The check table for an effective capability set. deploy/CAPABILITIES.md has what was
/// measured without each one, in a container with all others granted.
pub fn privileges_of(effective: &caps::CapsHashSet) -> Vec<Finding> {
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
    // pgio runs without these, with less: each says what goes missing.
    for (cap, why, without) in [
        (
            Capability::CAP_SYS_PTRACE,
            "read /proc/<pid>/cwd and exe of other users' processes",
            "no `pg_cluster` label from a data directory, `exe` rules do not match other users' \
             processes, user/database names with spaces are split at the first space",
        ),
        (
            Capability::CAP_DAC_READ_SEARCH,
            "look into other users' 0700 directories, e.g. a PostgreSQL data directory",
            "no `pg_cluster` label from a data directory, user/database names with spaces are \
             split at the first space",
        ),
    ] {
        if has(cap) {
            out.push(finding(Level::Ok, format!("{cap} ({why})")));
        } else {
            out.push(finding(
                Level::Warn,
                format!("{cap} missing: cannot {why}: {without}"),
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn levels(caps: &[Capability]) -> Vec<(String, Level)> {
        let set: caps::CapsHashSet = caps.iter().copied().collect();
        privileges_of(&set)
            .into_iter()
            .map(|f| {
                let cap = f
                    .what
                    .split_whitespace()
                    .next()
                    .unwrap_or_default()
                    .to_owned();
                (cap, f.level)
            })
            .collect()
    }

    #[test]
    fn check_table() {
        use Capability::*;
        use Level::*;
        let all = [CAP_BPF, CAP_PERFMON, CAP_SYS_PTRACE, CAP_DAC_READ_SEARCH];
        let row = |b, p, t, d| {
            vec![
                ("CAP_BPF".to_owned(), b),
                ("CAP_PERFMON".to_owned(), p),
                ("CAP_SYS_PTRACE".to_owned(), t),
                ("CAP_DAC_READ_SEARCH".to_owned(), d),
            ]
        };
        assert_eq!(levels(&all), row(Ok, Ok, Ok, Ok));
        assert_eq!(levels(&[]), row(Fail, Fail, Warn, Warn));
        assert_eq!(
            levels(&[CAP_PERFMON, CAP_SYS_PTRACE, CAP_DAC_READ_SEARCH]),
            row(Fail, Ok, Ok, Ok)
        );
        assert_eq!(
            levels(&[CAP_BPF, CAP_SYS_PTRACE, CAP_DAC_READ_SEARCH]),
            row(Ok, Fail, Ok, Ok)
        );
        assert_eq!(levels(&[CAP_BPF, CAP_PERFMON]), row(Ok, Ok, Warn, Warn));
        // CAP_SYS_ADMIN stands in for BPF and PERFMON (kernels before 5.8 only know it), not
        // for the others.
        assert_eq!(levels(&[CAP_SYS_ADMIN]), row(Ok, Ok, Warn, Warn));
        // The failure names the capability: `run` exits with these lines.
        let set: caps::CapsHashSet = [CAP_BPF].into_iter().collect();
        let fail: Vec<String> = privileges_of(&set)
            .into_iter()
            .filter(|f| f.level == Fail)
            .map(|f| f.what)
            .collect();
        assert_eq!(
            fail,
            ["CAP_PERFMON missing: needed to attach tracepoints (run as root or grant it)"]
        );
    }
}
