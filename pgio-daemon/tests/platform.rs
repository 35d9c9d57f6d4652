//! The kernel's own limits on tracing, kernel lockdown and `perf_event_paranoid`: what
//! `pgio-daemon check` says of them and what the daemon then attaches, both run with exactly
//! the DaemonSet's capabilities (deploy/kustomize/daemonset.yaml's `add`, every other one out
//! of the bounding set, uid 0 as in the pod). Root. On the host (no lockdown LSM here, paranoid
//! 2), and in guests booted with `cargo xtask integration --run-if-check-fails --append
//! lockdown=integrity` (or `confidentiality`, or `sysctl.kernel.perf_event_paranoid=3`).
//!
//! - check names the lockdown mode /sys/kernel/security/lockdown shows, and the paranoid
//!   level of /proc;
//! - where check says perf_event_open is allowed and lockdown is not confidentiality, every
//!   probe of the list below attaches; where it says refused, no tracepoint/ probe does; under
//!   confidentiality check fails, and the daemon exits naming it (tracefs is refused);
//! - with every family on, the verifier refuses none of the programs loaded.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;

use pgio_testkit::{Metrics, daemonset::Manifest, require_root, temp_dir};

/// Probes on `tracepoint/` (perf_event_open on a tracefs id) that every kernel from 5.10 has.
const TRACEPOINT_PROBES: [&str; 4] = [
    "sched_process_exec",
    "sched_process_exit",
    "sys_enter_pread64",
    "sys_exit_pread64",
];

/// Probes on `tp_btf/` (a BPF link, no perf event, no tracefs).
const BTF_PROBES: [&str; 4] = [
    "sched_process_fork",
    "sched_switch",
    "block_rq_issue",
    "block_rq_complete",
];

/// The `add` list of the DaemonSet's container, as setpriv names them (`+bpf,+perfmon,…`).
fn daemonset_capabilities() -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let yaml = std::fs::read_to_string(root.join("deploy/kustomize/daemonset.yaml"))
        .expect("deploy/kustomize/daemonset.yaml");
    let manifest = Manifest::parse(&yaml).expect("the DaemonSet parses");
    let pod = manifest.daemonset_pod_spec().expect("a pod spec");
    let add = pod["containers"][0]["securityContext"]["capabilities"]["add"]
        .as_array()
        .expect("capabilities.add");
    let names: Vec<String> = add
        .iter()
        .map(|c| format!("+{}", c.as_str().expect("a name").to_lowercase()))
        .collect();
    assert!(names.contains(&"+bpf".to_owned()), "{names:?}");
    names.join(",")
}

/// `pgio-daemon` behind setpriv: uid 0 with only `caps` in its bounding set (so permitted
/// and effective hold no more after exec), nothing inheritable.
fn wrapper(dir: &Path, caps: &str) -> std::path::PathBuf {
    let bin = env!("CARGO_BIN_EXE_pgio-daemon");
    let path = dir.join("pgio-daemon-daemonset-caps");
    std::fs::write(
        &path,
        format!(
            "#!/bin/sh\nexec setpriv --bounding-set=-all,{caps} --inh-caps=-all -- '{bin}' \"$@\"\n"
        ),
    )
    .expect("write the wrapper");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    path
}

/// The mode in brackets of /sys/kernel/security/lockdown, None when the file is absent.
fn lockdown_mode() -> Option<String> {
    let text = std::fs::read_to_string("/sys/kernel/security/lockdown").ok()?;
    text.split_whitespace()
        .find_map(|w| Some(w.strip_prefix('[')?.strip_suffix(']')?.to_owned()))
}

fn attached(m: &Metrics, program: &str) -> Option<f64> {
    m.matching("pgio_probe_attached", &[("program", program)])
        .next()
        .map(|s| s.value)
}

#[test]
fn check_and_daemon_agree_on_kernel_limits() {
    if !require_root("check_and_daemon_agree_on_kernel_limits") {
        return;
    }
    let caps = daemonset_capabilities();
    let dir = temp_dir().expect("temp dir");
    let bin = wrapper(dir.path(), &caps);
    let out = Command::new(&bin).arg("check").output().expect("run check");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    eprintln!(
        "capabilities {caps}; kernel command line: {}check:\n{text}",
        std::fs::read_to_string("/proc/cmdline").unwrap_or_default()
    );
    // `ok   what`, `warn what`, `FAIL what`.
    let line = |prefix: &str| {
        text.lines()
            .find(|l| l.get(5..).is_some_and(|w| w.starts_with(prefix)))
            .unwrap_or_else(|| panic!("no check line starting {prefix:?}:\n{text}"))
            .to_owned()
    };

    let mode = lockdown_mode();
    let lockdown = line("lockdown: ");
    match mode.as_deref() {
        Some(m) => assert!(
            lockdown[5..].starts_with(&format!("lockdown: {m}")),
            "kernel says {m}: {lockdown}"
        ),
        None => assert!(lockdown.contains("absent"), "{lockdown}"),
    }
    let confidential = mode.as_deref() == Some("confidentiality");
    assert_eq!(lockdown.starts_with("FAIL"), confidential, "{lockdown}");

    let level = std::fs::read_to_string("/proc/sys/kernel/perf_event_paranoid")
        .expect("perf_event_paranoid");
    let paranoid = line(&format!("perf_event_paranoid = {}: ", level.trim()));
    let perf_allowed = paranoid.contains("perf_event_open allowed");
    assert!(
        perf_allowed || paranoid.starts_with("FAIL"),
        "neither allowed nor refused: {paranoid}"
    );
    assert_eq!(
        out.status.success(),
        !text.lines().any(|l| l.starts_with("FAIL")),
        "check's exit status against its lines"
    );

    // Every family on, so that every program of the object is loaded.
    let daemon = pgio_testkit::Daemon::start(&bin, "relations = true\n");
    let daemon = match daemon {
        Ok(d) => d,
        // Only a check that failed may be followed by a daemon that does not come up.
        Err(e) => {
            assert!(
                !out.status.success(),
                "check passed, the daemon failed: {e:#}"
            );
            eprintln!("the daemon did not come up, as check said: {e:#}");
            // Under lockdown=confidentiality it exits naming it, not "tracefs not mounted".
            if confidential {
                assert!(
                    format!("{e:#}").contains("lockdown=confidentiality refuses tracefs"),
                    "{e:#}"
                );
            }
            return;
        }
    };
    let m = daemon.scrape().expect("scrape");
    let mut table = String::new();
    for p in TRACEPOINT_PROBES.iter().chain(&BTF_PROBES) {
        table += &format!("  {p:<20} attached {:?}\n", attached(&m, p));
    }
    eprintln!("probes with the DaemonSet's capabilities:\n{table}");
    // A program the verifier refuses is pgio's bug on any kernel it supports: one that took
    // the verifier past its million instructions left `sys_exit_openat` unattached, and every
    // relation test failed without saying why.
    let refused: Vec<String> = daemon
        .log_text()
        .lines()
        .filter(|l| l.contains("not attached") && l.contains("BPF_PROG_LOAD"))
        .map(|l| l.chars().take(400).collect())
        .collect();
    daemon.stop().expect("stop");
    assert!(
        refused.is_empty(),
        "refused by the verifier:\n{}",
        refused.join("\n")
    );

    let on = |p: &str| attached(&m, p) == Some(1.0);
    for p in TRACEPOINT_PROBES {
        assert_eq!(
            on(p),
            perf_allowed && !confidential,
            "tracepoint/{p}: check said {paranoid:?}, {lockdown:?}\n{table}"
        );
    }
    if !confidential {
        for p in BTF_PROBES {
            assert!(on(p), "tp_btf/{p} not attached without lockdown:\n{table}");
        }
    }
}
