//! The running kernel's BTF (`/sys/kernel/btf/vmlinux`), read with btf-rs: struct field
//! offsets for the programs (`kernel_offsets`) and which `tp_btf` hooks exist (`check`).
//! aya's loader parses the same file again into its own type (`aya::Btf`), which its API needs.
use anyhow::{Context as _, Result, anyhow, bail};
use btf_rs::{Btf, Type};

pub const VMLINUX: &str = "/sys/kernel/btf/vmlinux";

pub struct KernelBtf(Btf);

impl KernelBtf {
    pub fn open() -> Result<KernelBtf> {
        Btf::from_file(VMLINUX)
            .map(KernelBtf)
            .with_context(|| format!("reading {VMLINUX}"))
    }

    /// Whether `tp_btf/<name>` can attach: the kernel defines `btf_trace_<name>`.
    pub fn has_btf_tracepoint(&self, name: &str) -> bool {
        self.0
            .resolve_ids_by_name(&format!("btf_trace_{name}"))
            .is_ok_and(|ids| !ids.is_empty())
    }

    /// How many arguments `tp_btf/<name>` passes (its `btf_trace_<name>` prototype less the
    /// leading `void *`), or None when the kernel has no such hook.
    pub fn btf_tracepoint_args(&self, name: &str) -> Result<Option<usize>> {
        let Ok(types) = self.0.resolve_types_by_name(&format!("btf_trace_{name}")) else {
            return Ok(None);
        };
        let Some(Type::Typedef(td)) = types.into_iter().next() else {
            return Ok(None);
        };
        let mut t = self.0.resolve_chained_type(&td)?;
        if let Type::Ptr(p) = t {
            t = self.0.resolve_chained_type(&p)?;
        }
        match t {
            Type::FuncProto(fp) => Ok(Some(fp.parameters.len().saturating_sub(1))),
            other => bail!(
                "btf_trace_{name} is a {}, not a function pointer",
                other.name()
            ),
        }
    }

    /// Whether the kernel's programs may call helper `name` (`BPF_FUNC_<helper>`, a member of
    /// `enum bpf_func_id`); false when the BTF does not say (the programs then take the path
    /// that needs no newer helper).
    pub fn has_helper(&self, name: &str) -> bool {
        let Ok(types) = self.0.resolve_types_by_name("bpf_func_id") else {
            return false;
        };
        types.iter().any(|t| match t {
            Type::Enum(e) => e
                .members
                .iter()
                .any(|m| self.0.resolve_name(m).is_ok_and(|n| n == name)),
            _ => false,
        })
    }

    /// Byte offset of `field` in `struct name`, looking through anonymous struct/union
    /// members. A kernel that renamed the field fails here, by name.
    pub fn offset_of(&self, name: &str, field: &str) -> Result<u32> {
        offset_of(&self.0, name, field)
    }
}

fn offset_of(btf: &Btf, name: &str, field: &str) -> Result<u32> {
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

    /// Every kernel with BTF has `map_lookup_elem`; no kernel has the made-up one.
    #[test]
    fn helpers_are_read_from_the_running_kernel() {
        if !std::path::Path::new(VMLINUX).exists() {
            eprintln!("no {VMLINUX}: skipped");
            return;
        }
        let btf = KernelBtf::open().expect("kernel BTF");
        assert!(btf.has_helper("BPF_FUNC_map_lookup_elem"));
        assert!(!btf.has_helper("BPF_FUNC_no_such_helper"));
    }
}
