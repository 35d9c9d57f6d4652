//! Rebuild the eBPF object when bpf-linker changes (it is not a Cargo dependency).
//! No panic when bpf-linker is missing: `cargo xtask setup` installs it, and userspace-only
//! builds (AYA_BUILD_SKIP=1) never reach this crate.
//! Also sets `bpf_target_arch`, as aya-ebpf does for its bindings: code that reads a
//! `pt_regs` picks the same architecture's fields.
fn main() -> aya_build::Result<()> {
    if let Ok(path) = which::which("bpf-linker") {
        println!("cargo:rerun-if-changed={}", path.display());
    }
    aya_build::emit_bpf_target_arch_cfg()
}
