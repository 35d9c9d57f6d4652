//! The probe table, and loading: creates the maps, writes the kernel's struct offsets into the
//! programs, attaches every program. A program that cannot attach (its hook is missing on this
//! kernel) is reported, exported as `pgio_probe_attached{program} 0`, and the rest keeps
//! working.
use anyhow::{Context as _, Result, bail};
use aya::{
    Btf, Ebpf, EbpfLoader,
    programs::{BtfTracePoint, TracePoint, UProbe},
};
use pgio_common::{kernel_offsets::KernelOffsets, key_quota::OWNER_SLOTS};
use tracing::{info, warn};

use crate::{
    bench_switch::{Attachments, Hook},
    btf::KernelBtf,
    config::Config,
    families::FAMILIES,
    family::{Attach, Probe},
    kernel_offsets, series, tracked_map,
};

mod floor;

pub use floor::{FLOOR_PARTS, FLOOR_PROGRAMS, FloorHooks, load_floor};

static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/pgio"));

/// The eBPF object this daemon loads (empty when built with `AYA_BUILD_SKIP`).
pub fn object() -> &'static [u8] {
    OBJECT
}

/// The kernel side's counters of events it could not record (`self_metrics`).
pub const DROPS_MAP: &str = "DROPS";

/// Maps of the kernel side that belong to no family: the series maps (`tracked_map`, `series`), the drop
/// counters (`self_metrics`), the key quota (`key_quota`) and the benchmark's floor.
pub const CORE_MAPS: &[&str] = &[
    tracked_map::TRACKED_MAP,
    series::CHILD_SERIES_MAP,
    series::SERVES_CLIENTS_MAP,
    series::NAMES_FILES_MAP,
    series::SERVES_BACKENDS_MAP,
    series::BOOKS_WAITS_MAP,
    DROPS_MAP,
    crate::key_owners::SERIES_OWNER_MAP,
    crate::key_quota::ALLOWANCE_MAP,
    crate::key_quota::REFUSED_MAP,
    crate::key_quota::ON_MAP,
];

/// The maps of the floor's `part_*` programs (`pgio-ebpf/src/floor.rs`).
pub const FLOOR_PART_MAPS: &[&str] = &[
    "PART_TID_HASH",
    "PART_HASH",
    "PART_SHARED_HASH",
    "PART_ARRAY",
    "PART_TID",
];

/// Globals of the kernel side that belong to no family.
pub const CORE_GLOBALS: &[&str] = &[kernel_offsets::GLOBAL];

/// Every program pgio loads, family by family. Loading, `pgio-daemon check` and
/// `pgio_probe_attached` read this.
pub fn table() -> Vec<Probe> {
    FAMILIES.iter().flat_map(|f| f.probes()).collect()
}

/// The uprobes attached to each postgres binary that `config` turns on.
pub fn per_binary(config: &Config) -> Vec<Probe> {
    table()
        .into_iter()
        .filter(|p| p.attach.is_per_binary() && p.is_on(config))
        .collect()
}

#[derive(Clone, Debug)]
pub struct ProbeStatus {
    pub program: String,
    pub attached: bool,
}

pub struct Probes {
    pub ebpf: Ebpf,
    pub status: Vec<ProbeStatus>,
    /// The links of the programs attached now: dropped, they detach (kept apart from the
    /// programs for the benchmark's switch).
    pub attachments: Attachments,
}

pub(crate) fn require_object() -> Result<()> {
    if OBJECT.is_empty() {
        bail!(
            "this pgio-daemon was built without its eBPF object (AYA_BUILD_SKIP was set); \
             rebuild with `cargo xtask build`"
        );
    }
    Ok(())
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

pub(crate) fn program<'a>(
    ebpf: &'a mut Ebpf,
    name: &str,
) -> Result<&'a mut aya::programs::Program> {
    ebpf.program_mut(name)
        .with_context(|| format!("program {name} missing from the eBPF object"))
}

/// Creates the maps and reads the programs (each program is loaded into the kernel when it
/// is attached): every family's map sizes and globals from `config`.
/// `(map, max_entries)` the loader sets: the maps sized from this node (pid_max) or from the
/// config (each family's `setup`).
pub fn map_sizes(config: &Config) -> Vec<(&'static str, u32)> {
    // One slot per pid: the tgid-indexed array must reach pid_max.
    let pid_max = procfs::sys::kernel::pid_max()
        .ok()
        .and_then(|p| u32::try_from(p).ok())
        .unwrap_or(pgio_common::PID_MAX_LIMIT)
        .min(pgio_common::PID_MAX_LIMIT);
    // The key quota's arrays hold one row of owners per histogram map.
    let quota_rows = FAMILIES.iter().filter(|f| f.hist_map().is_some()).count() as u32;
    let mut sizes = vec![
        (
            tracked_map::TRACKED_MAP,
            pgio_common::tracked_entries(pid_max),
        ),
        (crate::key_quota::ALLOWANCE_MAP, quota_rows * OWNER_SLOTS),
        (crate::key_quota::REFUSED_MAP, quota_rows * OWNER_SLOTS),
    ];
    // Only `floor --hooks parts` counts in them: one entry each otherwise (PART_HASH and
    // PART_ARRAY alone are per-CPU, 6 MiB at 128 possible CPUs).
    sizes.extend(FLOOR_PART_MAPS.iter().map(|m| (*m, 1)));
    for f in FAMILIES {
        sizes.extend(f.setup(config).map_sizes);
    }
    sizes
}

pub(crate) fn load(offsets: &KernelOffsets, config: &Config, floor_parts: bool) -> Result<Ebpf> {
    let mut loader = EbpfLoader::new();
    loader.override_global(kernel_offsets::GLOBAL, offsets, true);
    for (map, size) in map_sizes(config) {
        if !(floor_parts && FLOOR_PART_MAPS.contains(&map)) {
            loader.map_max_entries(map, size);
        }
    }
    let setups: Vec<_> = FAMILIES.iter().map(|f| f.setup(config)).collect();
    for setup in &setups {
        for (global, value) in &setup.globals {
            loader.override_global(global, value.as_slice(), true);
        }
    }
    loader.load(OBJECT).context("loading the eBPF object")
}

/// Loads the object for `config` and attaches every program of the table it can.
pub fn load_and_attach(config: &Config) -> Result<Probes> {
    require_object()?;
    // btf-rs' parse of the kernel's BTF is dropped before aya parses it again: both at once
    // were pgio's peak (71.6 MB resident at start against 23.5 MB after), enough with the
    // maps' 49.5 MiB for the DaemonSet's 128 MiB limit to kill it while it attached.
    let mut offsets =
        kernel_offsets::from_btf(&KernelBtf::open()?).context("reading struct offsets from BTF")?;
    if config.flag(&crate::query::QUERY_ARGS_AT_ENTRY) {
        offsets.syscall_args_from_regs = 0;
    }
    let mut ebpf = load(&offsets, config, false)?;
    // aya's loader wants its own parse of the same BTF.
    let aya_btf = Btf::from_sys_fs().context("reading kernel BTF")?;
    let mut status: Vec<ProbeStatus> = Vec::new();
    let mut attachments = Attachments::default();
    for probe in table()
        .into_iter()
        .filter(|p| p.is_on(config) && p.fits(&offsets))
    {
        let missing = probe
            .requires
            .filter(|needed| !status.iter().any(|s| s.program == *needed && s.attached));
        let result = match missing {
            Some(needed) => Err(anyhow::anyhow!(
                "{needed}, which this program needs, is not attached"
            )),
            None => attach_one(&mut ebpf, &mut attachments, &aya_btf, &probe, &offsets),
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
    if config.flag(&crate::query::QUERIES) {
        status.push(query_wait_status(&offsets, &status));
    }
    Ok(Probes {
        ebpf,
        status,
        attachments,
    })
}

/// `query_wait`, the part of `sched_switch` that splits query time by wait event: it needs the
/// program and the task's `sched_info` (no `CONFIG_SCHED_INFO`: no parts, and PostgreSQL 18's
/// io worker waits are not query IO time unless `query_probes` can attach).
fn query_wait_status(offsets: &KernelOffsets, status: &[ProbeStatus]) -> ProbeStatus {
    let switch = status
        .iter()
        .any(|s| s.program == crate::syscall::SCHED_SWITCH && s.attached);
    let attached = switch && offsets.task_run_delay != 0 && offsets.task_state != 0;
    if !attached {
        warn!(
            sched_switch = switch,
            sched_info = offsets.task_run_delay != 0,
            "query time is not split by wait event (pgio_query_part_seconds): the kernel lacks what it needs"
        );
    }
    ProbeStatus {
        program: "sched_switch:query_wait".to_owned(),
        attached,
    }
}

/// A program of the object that no row names: `block_bio_queue`'s twin.
pub const TWIN_PROGRAMS: &[&str] = &["block_bio_queue_before_5_11"];

/// The object's program for a row of the table: `block_bio_queue` has a twin for kernels
/// whose hook still takes the queue first (< 5.11).
fn object_program<'a>(name: &'a str, offsets: &KernelOffsets) -> &'a str {
    if name == "block_bio_queue" && offsets.block_bio_arg == 1 {
        TWIN_PROGRAMS[0]
    } else {
        name
    }
}

fn attach_one(
    ebpf: &mut Ebpf,
    attachments: &mut Attachments,
    btf: &Btf,
    probe: &Probe,
    offsets: &KernelOffsets,
) -> Result<()> {
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
            attachments.attach(ebpf, object_name, Hook::BtfTracePoint)?;
        }
        Attach::URetProbeLater { .. } | Attach::UProbeLater { .. } => {
            let p: &mut UProbe = prog.try_into()?;
            p.load().with_context(|| format!("loading uprobe {name}"))?;
        }
        Attach::TracePoint(category) => {
            let p: &mut TracePoint = prog.try_into()?;
            p.load()
                .with_context(|| format!("loading tracepoint/{category}/{name}"))?;
            let hook = Hook::TracePoint {
                category: category.into(),
                name: name.into(),
            };
            attachments.attach(ebpf, object_name, hook)?;
        }
    }
    Ok(())
}
