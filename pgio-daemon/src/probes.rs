//! The probe table, and loading: creates the maps, writes the kernel's struct offsets into the
//! programs, attaches every program. A program that cannot attach (its hook is missing on this
//! kernel) is reported, exported as `pgio_probe_attached{program} 0`, and the rest keeps
//! working.
use std::borrow::Cow;

use anyhow::{Context as _, Result, bail};
use aya::{
    Btf, Ebpf, EbpfLoader,
    programs::{BtfTracePoint, FEntry, FExit, TracePoint, UProbe},
};
use pgio_common::{kernel_offsets::KernelOffsets, syscall::Syscall};
use tracing::{info, warn};

use crate::{
    block_io, btf::KernelBtf, config::HistMapSizes, kernel_offsets, query, series, syscall,
};

static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/pgio"));

/// How a program attaches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Attach {
    /// `tp_btf/<program>`
    BtfTracePoint,
    /// `tracepoint/<category>/<program>`
    TracePoint(&'static str),
    /// A uretprobe on `function`, loaded now and attached to each postgres binary as it is
    /// found (`lifecycle::PostgresProbes`).
    URetProbeLater { function: &'static str },
    /// A uprobe on `function`'s entry, attached like `URetProbeLater`.
    UProbeLater { function: &'static str },
}

/// The probe family a program belongs to: its kernel side is `pgio-ebpf/src/<family>.rs`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProbeFamily {
    BlockIo,
    Syscall,
    Lifecycle,
    Query,
}

#[derive(Clone, Debug)]
pub struct Probe {
    /// The program's name in the eBPF object (= its tracepoint's name).
    pub program: Cow<'static, str>,
    pub attach: Attach,
    /// pgio still works on kernels without its hook, with less.
    pub optional: bool,
    pub family: ProbeFamily,
}

const fn probe(
    program: &'static str,
    attach: Attach,
    optional: bool,
    family: ProbeFamily,
) -> Probe {
    Probe {
        program: Cow::Borrowed(program),
        attach,
        optional,
        family,
    }
}

/// PostgreSQL's `init_ps_display` returns with the title written (program and function share
/// the name). Without it, a new backend is classified from /proc a few ms after fork.
pub const TITLE: Probe = probe(
    "init_ps_display",
    Attach::URetProbeLater {
        function: "init_ps_display",
    },
    true,
    ProbeFamily::Lifecycle,
);

/// PostgreSQL reports each change of `pg_stat_activity.state` through
/// `pgstat_report_activity`: a query runs from `active` to the next idle state. Without it,
/// no query metrics.
pub const QUERY: Probe = probe(
    "pgstat_report_activity",
    Attach::UProbeLater {
        function: "pgstat_report_activity",
    },
    true,
    ProbeFamily::Query,
);

/// PostgreSQL 18's wait for an asynchronous IO (with `io_method = worker` an io worker does the
/// read): its time is the query's IO time. Absent before 18.
pub const QUERY_IO_WAIT: Probe = probe(
    "pgaio_wref_wait",
    Attach::UProbeLater {
        function: "pgaio_wref_wait",
    },
    true,
    ProbeFamily::Query,
);
pub const QUERY_IO_WAIT_RETURN: Probe = probe(
    "pgaio_wref_wait_return",
    Attach::URetProbeLater {
        function: "pgaio_wref_wait",
    },
    true,
    ProbeFamily::Query,
);

/// The probes attached to each postgres binary rather than at start.
pub const POSTGRES_BINARY: [Probe; 4] = [TITLE, QUERY, QUERY_IO_WAIT, QUERY_IO_WAIT_RETURN];

const SCHED_SWITCH: &str = "sched_switch";

/// Every program pgio loads. Loading, `pgio-daemon check` and `pgio_probe_attached` read this.
pub fn table() -> Vec<Probe> {
    use Attach::{BtfTracePoint, TracePoint};
    use ProbeFamily::{BlockIo, Lifecycle};
    let mut table = vec![
        // Kernel >= 6.5; before it the submitter comes from insert/issue.
        probe("block_io_start", BtfTracePoint, true, BlockIo),
        probe("block_rq_insert", BtfTracePoint, false, BlockIo),
        probe("block_rq_issue", BtfTracePoint, false, BlockIo),
        probe("block_rq_requeue", BtfTracePoint, false, BlockIo),
        probe("block_rq_complete", BtfTracePoint, false, BlockIo),
        // Bio-based disks (dm-N, md, zram): without them only the disks below are seen.
        probe("block_bio_queue", BtfTracePoint, true, BlockIo),
        probe("block_bio_complete", BtfTracePoint, true, BlockIo),
        probe("sched_process_fork", BtfTracePoint, false, Lifecycle),
        probe("sched_process_exec", TracePoint("sched"), false, Lifecycle),
        probe("sched_process_exit", TracePoint("sched"), false, Lifecycle),
        // Tells the syscall programs that another thread runs and moves a switched-out
        // thread's pending syscall start off its CPU; before them in this table.
        probe(SCHED_SWITCH, BtfTracePoint, false, ProbeFamily::Syscall),
        TITLE,
        QUERY,
        QUERY_IO_WAIT,
        QUERY_IO_WAIT_RETURN,
    ];
    for sc in Syscall::ALL {
        for dir in ["enter", "exit"] {
            table.push(Probe {
                program: format!("sys_{dir}_{}", sc.name()).into(),
                attach: TracePoint("syscalls"),
                // futex_waitv appeared in 5.16.
                optional: sc == Syscall::FutexWaitv,
                family: ProbeFamily::Syscall,
            });
        }
    }
    table
}

#[derive(Clone, Debug)]
pub struct ProbeStatus {
    pub program: String,
    pub attached: bool,
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

/// `pgio-daemon floor`'s programs (`pgio-ebpf/src/floor.rs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum FloorHooks {
    /// `floor_sys_{enter,exit}_pread64` on `syscalls/sys_{enter,exit}_pread64`.
    Tracepoint,
    /// `floor_f{entry,exit}_pread64` on the syscall's arch-specific entry point.
    Fentry,
    /// `floor_tp_btf_sys_{enter,exit}` on the raw `sys_enter`/`sys_exit` (every syscall).
    TpBtf,
    /// The `part_*` programs, all on `syscalls/sys_enter_pread64`.
    Parts,
}

const FLOOR_PARTS: [&str; 7] = [
    "part_pid_tgid",
    "part_tracked",
    "part_tid_array",
    "part_ktime",
    "part_tid_hash",
    "part_hash",
    "part_array",
];

/// Benchmark floor: only the `hooks` programs are attached.
pub fn load_floor(hooks: FloorHooks) -> Result<Ebpf> {
    require_object()?;
    let mut ebpf = load(
        &KernelOffsets::default(),
        false,
        crate::config::Config::default().hist_map_sizes(),
    )?;
    match hooks {
        FloorHooks::Tracepoint => {
            for dir in ["enter", "exit"] {
                let name = format!("floor_sys_{dir}_pread64");
                attach_tracepoint(&mut ebpf, &name, &format!("sys_{dir}_pread64"))?;
            }
        }
        FloorHooks::Parts => {
            for name in FLOOR_PARTS {
                attach_tracepoint(&mut ebpf, name, "sys_enter_pread64")?;
            }
        }
        FloorHooks::TpBtf => {
            let btf = Btf::from_sys_fs().context("reading kernel BTF")?;
            for dir in ["enter", "exit"] {
                let p: &mut BtfTracePoint =
                    program(&mut ebpf, &format!("floor_tp_btf_sys_{dir}"))?.try_into()?;
                p.load(&format!("sys_{dir}"), &btf)?;
                p.attach()?;
            }
        }
        FloorHooks::Fentry => {
            let btf = Btf::from_sys_fs().context("reading kernel BTF")?;
            let function = syscall_function("pread64");
            let p: &mut FEntry = program(&mut ebpf, "floor_fentry_pread64")?.try_into()?;
            p.load(&function, &btf)
                .with_context(|| format!("loading fentry/{function}"))?;
            p.attach()?;
            let p: &mut FExit = program(&mut ebpf, "floor_fexit_pread64")?.try_into()?;
            p.load(&function, &btf)
                .with_context(|| format!("loading fexit/{function}"))?;
            p.attach()?;
        }
    }
    Ok(ebpf)
}

/// The kernel function behind syscall `name` on this architecture.
pub fn syscall_function(name: &str) -> String {
    let arch = if cfg!(target_arch = "aarch64") {
        "arm64"
    } else {
        "x64"
    };
    format!("__{arch}_sys_{name}")
}

fn program<'a>(ebpf: &'a mut Ebpf, name: &str) -> Result<&'a mut aya::programs::Program> {
    ebpf.program_mut(name)
        .with_context(|| format!("program {name} missing from the eBPF object"))
}

fn attach_tracepoint(ebpf: &mut Ebpf, name: &str, tracepoint: &str) -> Result<()> {
    let p: &mut TracePoint = program(ebpf, name)?.try_into()?;
    p.load()?;
    p.attach("syscalls", tracepoint)
        .with_context(|| format!("attaching {name} to syscalls/{tracepoint}"))?;
    Ok(())
}

/// Creates the maps and reads the programs (each program is loaded into the kernel when it
/// is attached).
fn load(offsets: &KernelOffsets, query_probes: bool, hist: HistMapSizes) -> Result<Ebpf> {
    // One slot per pid: the tgid-indexed array must reach pid_max.
    let pid_max = procfs::sys::kernel::pid_max()
        .ok()
        .and_then(|p| u32::try_from(p).ok())
        .unwrap_or(pgio_common::PID_MAX_LIMIT)
        .min(pgio_common::PID_MAX_LIMIT);
    EbpfLoader::new()
        .override_global(kernel_offsets::GLOBAL, offsets, true)
        .override_global(query::ENABLED_GLOBAL, &u8::from(query_probes), true)
        .override_global(syscall::ROWS_GLOBAL, &u8::from(hist.syscall_rows), true)
        .map_max_entries(series::TRACKED_MAP, pid_max)
        .map_max_entries(block_io::HIST_MAP, hist.block_io)
        .map_max_entries(syscall::HIST_MAP, hist.syscall)
        .map_max_entries(query::HIST_MAP, hist.query)
        .load(OBJECT)
        .context("loading the eBPF object")
}

/// `query_probes`: whether the syscall exits keep the query bookkeeping (see `query`).
pub fn load_and_attach(query_probes: bool, hist: HistMapSizes) -> Result<Probes> {
    require_object()?;
    let btf = KernelBtf::open()?;
    let offsets = kernel_offsets::from_btf(&btf).context("reading struct offsets from BTF")?;
    let mut ebpf = load(&offsets, query_probes, hist)?;
    // aya's loader wants its own parse of the same BTF.
    let aya_btf = Btf::from_sys_fs().context("reading kernel BTF")?;
    let mut status: Vec<ProbeStatus> = Vec::new();
    for probe in table() {
        // The syscall programs learn from `sched_switch` that another thread runs: without
        // it they would book one thread's calls on another's series, so they stay off.
        let switch_missing = probe.family == ProbeFamily::Syscall
            && probe.program != SCHED_SWITCH
            && status
                .iter()
                .any(|s| s.program == SCHED_SWITCH && !s.attached);
        let result = if switch_missing {
            Err(anyhow::anyhow!(
                "tp_btf/{SCHED_SWITCH}, which tells the syscall programs that another thread \
                 runs, is not attached"
            ))
        } else {
            attach_one(&mut ebpf, &aya_btf, &probe, &offsets)
        };
        let program = probe.program.into_owned();
        match &result {
            Ok(()) => info!(program, "attached"),
            Err(e) => warn!(program, error = format!("{e:#}"), "not attached"),
        }
        status.push(ProbeStatus {
            program,
            attached: result.is_ok(),
        });
    }
    Ok(Probes { ebpf, status })
}

/// The object's program for a row of the table: `block_bio_queue` has a twin for kernels
/// whose hook still takes the queue first (< 5.11).
fn object_program<'a>(name: &'a str, offsets: &KernelOffsets) -> &'a str {
    if name == "block_bio_queue" && offsets.block_bio_arg == 1 {
        "block_bio_queue_before_5_11"
    } else {
        name
    }
}

fn attach_one(ebpf: &mut Ebpf, btf: &Btf, probe: &Probe, offsets: &KernelOffsets) -> Result<()> {
    let name = &*probe.program;
    let object_name = object_program(name, offsets);
    let prog = ebpf
        .program_mut(object_name)
        .with_context(|| format!("program {object_name} missing from the eBPF object"))?;
    match probe.attach {
        Attach::BtfTracePoint => {
            let p: &mut BtfTracePoint = prog.try_into()?;
            p.load(name, btf)
                .with_context(|| format!("loading tp_btf/{name}"))?;
            p.attach()
                .with_context(|| format!("attaching tp_btf/{name}"))?;
        }
        Attach::URetProbeLater { .. } | Attach::UProbeLater { .. } => {
            let p: &mut UProbe = prog.try_into()?;
            p.load().with_context(|| format!("loading uprobe {name}"))?;
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
