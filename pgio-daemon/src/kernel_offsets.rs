//! Struct field offsets the eBPF programs need, read from the running kernel's BTF
//! (`/sys/kernel/btf/vmlinux`). Rust eBPF has no CO-RE field relocations yet, so this is the
//! loader doing the relocation by hand; a kernel that renames a field fails here, by name.
use anyhow::{Context as _, Result, anyhow, bail};
use btf_rs::{Btf, Type};
use pgio_common::block_io::KernelOffsets;

pub const VMLINUX_BTF: &str = "/sys/kernel/btf/vmlinux";

pub fn from_vmlinux() -> Result<KernelOffsets> {
    let btf = Btf::from_file(VMLINUX_BTF).with_context(|| format!("reading {VMLINUX_BTF}"))?;
    Ok(KernelOffsets {
        request_cmd_flags: offset_of(&btf, "request", "cmd_flags")?,
        request_q: offset_of(&btf, "request", "q")?,
        queue_disk: offset_of(&btf, "request_queue", "disk")?,
        gendisk_major: offset_of(&btf, "gendisk", "major")?,
        gendisk_first_minor: offset_of(&btf, "gendisk", "first_minor")?,
        task_pid: offset_of(&btf, "task_struct", "pid")?,
        task_tgid: offset_of(&btf, "task_struct", "tgid")?,
        task_mm: offset_of(&btf, "task_struct", "mm")?,
        mm_arg_start: offset_of(&btf, "mm_struct", "arg_start")?,
        _pad: 0,
    })
}

/// Byte offset of `field` in `struct name`, looking through anonymous struct/union members.
pub fn offset_of(btf: &Btf, name: &str, field: &str) -> Result<u32> {
    let types = btf
        .resolve_types_by_name(name)
        .with_context(|| format!("struct {name} not in kernel BTF"))?;
    let st = types
        .iter()
        .find_map(|t| match t {
            Type::Struct(s) if !s.members.is_empty() => Some(s),
            _ => None,
        })
        .ok_or_else(|| anyhow!("struct {name} not in kernel BTF"))?;
    let bits = find_member(btf, st, field, 0)?
        .ok_or_else(|| anyhow!("struct {name} has no field {field} in kernel BTF"))?;
    if bits % 8 != 0 {
        bail!("{name}.{field} is a bitfield");
    }
    Ok(bits / 8)
}

fn find_member(btf: &Btf, st: &btf_rs::Struct, field: &str, base: u32) -> Result<Option<u32>> {
    for m in &st.members {
        let name = btf.resolve_name(m).unwrap_or_default();
        if name == field {
            return Ok(Some(base + m.bit_offset()));
        }
        if name.is_empty() {
            let inner = resolve_struct(btf, m)?;
            if let Some(inner) = inner
                && let Some(off) = find_member(btf, &inner, field, base + m.bit_offset())?
            {
                return Ok(Some(off));
            }
        }
    }
    Ok(None)
}

/// The struct or union an anonymous member is, through typedefs and qualifiers.
fn resolve_struct(btf: &Btf, m: &btf_rs::Member) -> Result<Option<btf_rs::Struct>> {
    let mut t = btf.resolve_chained_type(m)?;
    loop {
        match t {
            Type::Struct(s) | Type::Union(s) => return Ok(Some(s)),
            Type::Typedef(ref x) => t = btf.resolve_chained_type(x)?,
            Type::Const(ref x) | Type::Volatile(ref x) => t = btf.resolve_chained_type(x)?,
            _ => return Ok(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reads this machine's BTF: the fields must exist and land where 6.x kernels put them.
    #[test]
    fn offsets_from_running_kernel() {
        if !std::path::Path::new(VMLINUX_BTF).exists() {
            eprintln!("skipped: no {VMLINUX_BTF}");
            return;
        }
        let o = from_vmlinux().expect("offsets");
        assert!(o.request_q < o.request_cmd_flags + 64, "{o:?}");
        assert!(
            o.task_tgid == o.task_pid + 4,
            "pid and tgid are adjacent: {o:?}"
        );
        assert!(o.gendisk_first_minor == o.gendisk_major + 4, "{o:?}");
    }
}
