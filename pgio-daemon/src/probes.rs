//! Loads the eBPF object, relocates kernel struct offsets, attaches every program. A program
//! that cannot attach (tracepoint missing on this kernel) is reported, exported as
//! `pgio_probe_attached{program} 0`, and the rest keeps working.
use anyhow::{Context as _, Result, bail};
use aya::{
    Btf, Ebpf, EbpfLoader,
    programs::{BtfTracePoint, TracePoint, UProbe, uprobe::UProbeScope},
};
use pgio_common::{block_io::KernelOffsets, syscall::Syscall};
use std::{
    collections::HashSet,
    sync::{Arc, Mutex},
};
use tracing::{info, warn};

use crate::kernel_offsets;

static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/pgio"));

/// How a program attaches.
#[derive(Clone, Copy, Debug)]
pub enum Attach {
    /// `tp_btf/<name>`
    Btf,
    /// `tracepoint/<category>/<name>`
    TracePoint(&'static str),
    /// A uretprobe loaded now and attached per binary later (`TitleProbe`).
    UProbeLater,
}

#[derive(Clone, Debug)]
pub struct ProbeStatus {
    /// Program name = tracepoint name (`sys_enter_pread64`, `block_rq_issue`, ...).
    pub program: String,
    pub attached: bool,
}

/// Every program of the object and where it attaches.
pub fn programs() -> Vec<(String, Attach)> {
    let mut v: Vec<(String, Attach)> = [
        "block_io_start",
        "block_rq_insert",
        "block_rq_issue",
        "block_rq_complete",
        "sched_process_fork",
    ]
    .into_iter()
    .map(|n| (n.to_owned(), Attach::Btf))
    .collect();
    v.push(("sched_process_exec".into(), Attach::TracePoint("sched")));
    v.push(("sched_process_exit".into(), Attach::TracePoint("sched")));
    v.push((TITLE_PROGRAM.into(), Attach::UProbeLater));
    for sc in Syscall::ALL {
        for dir in ["enter", "exit"] {
            v.push((
                format!("sys_{dir}_{}", sc.name()),
                Attach::TracePoint("syscalls"),
            ));
        }
    }
    v
}

/// The uretprobe on PostgreSQL's `init_ps_display` (program and function share the name).
pub const TITLE_PROGRAM: &str = "init_ps_display";

/// Attaches the title uretprobe to each distinct postgres executable, the first time one of
/// its postmasters is seen (by inode: the same binary under several paths or in several
/// containers is attached once).
pub struct TitleProbe {
    ebpf: Arc<Mutex<Ebpf>>,
    attached: HashSet<(u64, u64)>,
}

impl TitleProbe {
    pub fn new(ebpf: Arc<Mutex<Ebpf>>) -> TitleProbe {
        TitleProbe {
            ebpf,
            attached: HashSet::new(),
        }
    }

    /// Attaches to the executable of process `pid` unless already done. `/proc/<pid>/exe`
    /// reaches the binary also inside another mount namespace.
    pub fn attach_for(&mut self, pid: u32) {
        use std::os::unix::fs::MetadataExt;
        let exe = format!("/proc/{pid}/exe");
        let Ok(meta) = std::fs::metadata(&exe) else {
            return;
        };
        if !self.attached.insert((meta.dev(), meta.ino())) {
            return;
        }
        let mut ebpf = self.ebpf.lock().unwrap_or_else(|e| e.into_inner());
        let result = ebpf
            .program_mut(TITLE_PROGRAM)
            .context("program missing")
            .and_then(|p| <&mut UProbe>::try_from(p).map_err(Into::into))
            .and_then(|p| {
                p.attach(TITLE_PROGRAM, &exe, UProbeScope::AllProcesses)
                    .map_err(Into::into)
            });
        let binary = std::fs::read_link(&exe)
            .map(|p| p.display().to_string())
            .unwrap_or_default();
        match result {
            Ok(_) => info!(pid, binary, "title uretprobe attached"),
            // Classification falls back to reading /proc a few ms after fork.
            Err(e) => warn!(
                pid,
                binary,
                error = format!("{e:#}"),
                "title uretprobe not attached"
            ),
        }
    }
}

pub struct Probes {
    pub ebpf: Ebpf,
    pub status: Vec<ProbeStatus>,
}

fn require_object() -> Result<()> {
    if OBJECT.is_empty() {
        bail!(
            "this pgio-daemon was built without its eBPF object (AYA_BUILD_SKIP was set); \
             rebuild with `cargo xtask build`"
        );
    }
    Ok(())
}

/// Benchmark floor: only the empty `floor_sys_{enter,exit}_pread64` programs, attached to
/// the same tracepoints pgio uses for pread64.
pub fn load_floor() -> Result<Ebpf> {
    require_object()?;
    let mut ebpf = load(&KernelOffsets::default())?;
    for dir in ["enter", "exit"] {
        let name = format!("floor_sys_{dir}_pread64");
        let p: &mut TracePoint = ebpf
            .program_mut(&name)
            .with_context(|| format!("program {name} missing"))?
            .try_into()?;
        p.load()?;
        p.attach("syscalls", &format!("sys_{dir}_pread64"))?;
    }
    Ok(ebpf)
}

/// Creates the maps and reads the programs (each program is loaded into the kernel when it
/// is attached).
fn load(offsets: &KernelOffsets) -> Result<Ebpf> {
    EbpfLoader::new()
        // SYSCALL_START is a task storage map: aya 0.14 creates it but has no userspace type
        // for it (userspace never reads it).
        .allow_unsupported_maps()
        .override_global("KERNEL_OFFSETS", offsets, true)
        .map_max_entries("TRACKED", pid_max())
        .load(OBJECT)
        .context("loading the eBPF object")
}

pub fn load_and_attach() -> Result<Probes> {
    require_object()?;
    let offsets =
        kernel_offsets::from_vmlinux().context("reading struct offsets from kernel BTF")?;
    let mut ebpf = load(&offsets)?;
    let btf = Btf::from_sys_fs().context("reading kernel BTF")?;
    let mut status = Vec::new();
    for (name, attach) in programs() {
        let result = attach_one(&mut ebpf, &btf, &name, attach);
        match &result {
            Ok(()) => info!(program = %name, "attached"),
            Err(e) => warn!(program = %name, error = format!("{e:#}"), "not attached"),
        }
        status.push(ProbeStatus {
            program: name,
            attached: result.is_ok(),
        });
    }
    Ok(Probes { ebpf, status })
}

/// `/proc/sys/kernel/pid_max`: the tgid-indexed `TRACKED` array needs one slot per pid.
fn pid_max() -> u32 {
    std::fs::read_to_string("/proc/sys/kernel/pid_max")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(pgio_common::PID_MAX_LIMIT)
        .min(pgio_common::PID_MAX_LIMIT)
}

fn attach_one(ebpf: &mut Ebpf, btf: &Btf, name: &str, attach: Attach) -> Result<()> {
    let prog = ebpf
        .program_mut(name)
        .with_context(|| format!("program {name} missing from the eBPF object"))?;
    match attach {
        Attach::Btf => {
            let p: &mut BtfTracePoint = prog.try_into()?;
            p.load(name, btf)
                .with_context(|| format!("loading tp_btf/{name}"))?;
            p.attach()
                .with_context(|| format!("attaching tp_btf/{name}"))?;
        }
        Attach::UProbeLater => {
            let p: &mut UProbe = prog.try_into()?;
            p.load()
                .with_context(|| format!("loading uretprobe {name}"))?;
        }
        Attach::TracePoint(category) => {
            let p: &mut TracePoint = prog.try_into()?;
            p.load()
                .with_context(|| format!("loading tracepoint/{category}/{name}"))?;
            p.attach(category, name)
                .with_context(|| format!("attaching tracepoint/{category}/{name}"))?;
        }
    }
    Ok(())
}
