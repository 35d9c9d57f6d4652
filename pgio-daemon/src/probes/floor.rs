//! `pgio-daemon floor`: the benchmark floor's programs (`pgio-ebpf/src/floor.rs`), each set
//! loaded and attached alone, so that `cargo xtask bench` can price pgio's hooks against them.
use anyhow::{Context as _, Result};
use aya::{
    Btf, Ebpf,
    programs::{BtfTracePoint, FEntry, FExit, TracePoint},
};
use pgio_common::kernel_offsets::KernelOffsets;

use super::{load, program, require_object, syscall_function, table};
use crate::{
    bench_switch::{Attachments, Hook},
    btf::KernelBtf,
    config::Config,
    family::Attach,
    kernel_offsets,
};

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
    /// `floor_tracepoint` on every tracepoint of the probe table (with the default config)
    /// and `floor_sched_switch`: what pgio's hooks cost before its programs do anything.
    Pgio,
}

/// The floor's programs, for the object test.
pub const FLOOR_PROGRAMS: &[&str] = &[
    "floor_sys_enter_pread64",
    "floor_sys_exit_pread64",
    "floor_fentry_pread64",
    "floor_fexit_pread64",
    "floor_tp_btf_sys_enter",
    "floor_tp_btf_sys_exit",
    "floor_tracepoint",
    "floor_sched_switch",
];

pub const FLOOR_PARTS: [&str; 11] = [
    "part_pid_tgid",
    "part_tracked",
    "part_tracked_big_frame",
    "part_read_user",
    "part_pt_regs",
    "part_tid_array",
    "part_ktime",
    "part_tid_hash",
    "part_hash",
    "part_shared_hash",
    "part_array",
];

/// Benchmark floor: only the `hooks` programs are attached.
pub fn load_floor(hooks: FloorHooks) -> Result<(Ebpf, Attachments)> {
    let mut attachments = Attachments::default();
    require_object()?;
    let mut ebpf = load(
        &KernelOffsets::default(),
        &Config::default(),
        hooks == FloorHooks::Parts,
    )?;
    match hooks {
        FloorHooks::Tracepoint => {
            for dir in ["enter", "exit"] {
                let name = format!("floor_sys_{dir}_pread64");
                attach_tracepoint(
                    &mut ebpf,
                    &mut attachments,
                    &name,
                    &format!("sys_{dir}_pread64"),
                )?;
            }
        }
        FloorHooks::Pgio => {
            let config = Config::default();
            let offsets = kernel_offsets::from_btf(&KernelBtf::open()?)?;
            let p: &mut TracePoint = program(&mut ebpf, "floor_tracepoint")?.try_into()?;
            p.load()?;
            for probe in table()
                .into_iter()
                .filter(|p| p.is_on(&config) && p.fits(&offsets))
            {
                if let Attach::TracePoint(category) = probe.attach {
                    let hook = Hook::TracePoint {
                        category: category.into(),
                        name: probe.program.into_owned(),
                    };
                    attachments.attach(&mut ebpf, "floor_tracepoint", hook)?;
                }
            }
            let btf = Btf::from_sys_fs().context("reading kernel BTF")?;
            let p: &mut BtfTracePoint = program(&mut ebpf, "floor_sched_switch")?.try_into()?;
            p.load("sched_switch", &btf)?;
            attachments.attach(&mut ebpf, "floor_sched_switch", Hook::BtfTracePoint)?;
        }
        FloorHooks::Parts => {
            for name in FLOOR_PARTS {
                attach_tracepoint(&mut ebpf, &mut attachments, name, "sys_enter_pread64")?;
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
    Ok((ebpf, attachments))
}

fn attach_tracepoint(
    ebpf: &mut Ebpf,
    attachments: &mut Attachments,
    name: &str,
    tracepoint: &str,
) -> Result<()> {
    let p: &mut TracePoint = program(ebpf, name)?.try_into()?;
    p.load()?;
    let hook = Hook::TracePoint {
        category: "syscalls".into(),
        name: tracepoint.into(),
    };
    attachments.attach(ebpf, name, hook)
}
