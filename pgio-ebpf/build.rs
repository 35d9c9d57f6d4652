//! Rebuild the eBPF object when bpf-linker changes (it is not a Cargo dependency).
//! No panic when bpf-linker is missing: `cargo xtask setup` installs it, and userspace-only
//! builds (AYA_BUILD_SKIP=1) never reach this crate.
fn main() {
    if let Ok(path) = which::which("bpf-linker") {
        println!("cargo:rerun-if-changed={}", path.display());
    }
}
