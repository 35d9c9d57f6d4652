//! Struct field offsets the eBPF programs need, from the running kernel's BTF, written into
//! their `KERNEL_OFFSETS` global at load. Rust eBPF has no CO-RE field relocations yet, so this
//! is the loader doing the relocation by hand.
use anyhow::Result;
use pgio_common::kernel_offsets::KernelOffsets;

use crate::btf::KernelBtf;

/// The programs' global the offsets go into.
pub const GLOBAL: &str = "KERNEL_OFFSETS";

pub fn from_btf(btf: &KernelBtf) -> Result<KernelOffsets> {
    Ok(KernelOffsets {
        request_cmd_flags: btf.offset_of("request", "cmd_flags")?,
        request_q: btf.offset_of("request", "q")?,
        queue_disk: btf.offset_of("request_queue", "disk")?,
        gendisk_major: btf.offset_of("gendisk", "major")?,
        gendisk_first_minor: btf.offset_of("gendisk", "first_minor")?,
        task_pid: btf.offset_of("task_struct", "pid")?,
        task_tgid: btf.offset_of("task_struct", "tgid")?,
        task_mm: btf.offset_of("task_struct", "mm")?,
        mm_arg_start: btf.offset_of("mm_struct", "arg_start")?,
        _pad: 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reads this machine's BTF: the fields must exist and land where 6.x kernels put them.
    #[test]
    fn offsets_from_running_kernel() {
        if !std::path::Path::new(crate::btf::VMLINUX).exists() {
            eprintln!("skipped: no {}", crate::btf::VMLINUX);
            return;
        }
        let o = from_btf(&KernelBtf::open().expect("BTF")).expect("offsets");
        assert!(o.request_q < o.request_cmd_flags + 64, "{o:?}");
        assert!(
            o.task_tgid == o.task_pid + 4,
            "pid and tgid are adjacent: {o:?}"
        );
        assert!(o.gendisk_first_minor == o.gendisk_major + 4, "{o:?}");
    }
}
