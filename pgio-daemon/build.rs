//! Builds the eBPF object (`pgio-ebpf`, binary `pgio`) with the nightly toolchain through
//! aya-build, into `$OUT_DIR/pgio`. With `AYA_BUILD_SKIP=1` (userspace-only work: clippy,
//! unit tests without the eBPF toolchain) an empty placeholder is written instead; the
//! daemon then refuses to start with a clear message.
use std::{env, fs, path::PathBuf};

use anyhow::{Context as _, anyhow};

fn main() -> anyhow::Result<()> {
    let manifest_dir = env::var("CARGO_MANIFEST_DIR").context("CARGO_MANIFEST_DIR")?;
    let ebpf_dir = PathBuf::from(&manifest_dir).join("../pgio-ebpf");
    let ebpf_dir = ebpf_dir
        .to_str()
        .ok_or_else(|| anyhow!("non-UTF-8 path {}", ebpf_dir.display()))?;
    let package = aya_build::Package {
        name: "pgio-ebpf",
        root_dir: ebpf_dir,
        ..Default::default()
    };
    aya_build::build_ebpf([package], aya_build::Toolchain::Nightly)?;

    let object = PathBuf::from(env::var("OUT_DIR").context("OUT_DIR")?).join("pgio");
    if !object.exists() {
        fs::write(&object, b"").context("writing the placeholder eBPF object")?;
    }
    Ok(())
}
