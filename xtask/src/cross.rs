//! The CPU architectures pgio ships for, and building its binaries for the one that is not the
//! host's: rustup's `aarch64-unknown-linux-gnu` target with Debian's cross gcc as linker
//! (`.cargo/config.toml` names it) and the arm64 glibc of `libc6-dev-arm64-cross`. The eBPF
//! object is the same bytecode on both; aya-build compiles it with `bpf_target_arch` set to the
//! target's architecture, which picks the register layout uprobes and `pt_regs` reads use.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::util::{describe, output, run, step, target_dir};

/// A Debian architecture pgio is built for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    Amd64,
    Arm64,
}

impl Arch {
    pub const ALL: [Arch; 2] = [Arch::Amd64, Arch::Arm64];

    /// Debian's (and OCI's) name: `amd64`, `arm64`.
    pub const fn name(self) -> &'static str {
        match self {
            Arch::Amd64 => "amd64",
            Arch::Arm64 => "arm64",
        }
    }

    /// The Rust target triple.
    pub const fn triple(self) -> &'static str {
        match self {
            Arch::Amd64 => "x86_64-unknown-linux-gnu",
            Arch::Arm64 => "aarch64-unknown-linux-gnu",
        }
    }

    /// The host's architecture: the one cargo builds for without `--target`.
    pub fn host() -> Arch {
        if cfg!(target_arch = "aarch64") {
            Arch::Arm64
        } else {
            Arch::Amd64
        }
    }

    pub fn is_host(self) -> bool {
        self == Arch::host()
    }

    /// Debian's multiarch directory (`/usr/lib/<this>`): where the cross glibc lives on the
    /// host (`/usr/<this>/lib`) and where the image puts the libraries.
    pub const fn multiarch(self) -> &'static str {
        match self {
            Arch::Amd64 => "x86_64-linux-gnu",
            Arch::Arm64 => "aarch64-linux-gnu",
        }
    }

    /// What `file` says about an executable of this architecture.
    pub const fn file_says(self) -> &'static str {
        match self {
            Arch::Amd64 => "x86-64",
            Arch::Arm64 => "ARM aarch64",
        }
    }
}

impl std::str::FromStr for Arch {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<Arch> {
        match s {
            "amd64" | "x86_64" => Ok(Arch::Amd64),
            "arm64" | "aarch64" => Ok(Arch::Arm64),
            _ => bail!("unknown architecture {s:?} (known: amd64, arm64)"),
        }
    }
}

/// Debian packages a cross build for `arch` needs on this (amd64) host.
fn cross_packages(arch: Arch) -> &'static [&'static str] {
    match arch {
        Arch::Amd64 => &["gcc-x86-64-linux-gnu", "libc6-dev-amd64-cross"],
        Arch::Arm64 => &["gcc-aarch64-linux-gnu", "libc6-dev-arm64-cross"],
    }
}

/// Installs what building for `arch` needs: nothing for the host's own, else the Rust target
/// (rustup, ~30 MB once) and Debian's cross gcc and glibc.
pub fn ensure(arch: Arch, skip_setup: bool) -> Result<()> {
    if arch.is_host() || skip_setup {
        return Ok(());
    }
    let installed = output(Command::new("rustup").args(["target", "list", "--installed"]))?;
    if !installed.lines().any(|l| l.trim() == arch.triple()) {
        let mut add = Command::new("rustup");
        add.args(["target", "add", arch.triple()]);
        step(describe(&add));
        run(&mut add)?;
    }
    crate::apt::ensure(cross_packages(arch))
}

/// `cargo` with `--target` for a foreign `arch` (none for the host's, so host builds keep
/// sharing `target/release`).
pub fn cargo(root: &Path, arch: Arch, args: &[&str]) -> Command {
    let mut c = Command::new("cargo");
    c.current_dir(root).args(args);
    if !arch.is_host() {
        c.args(["--target", arch.triple()]);
    }
    c
}

/// `target/release` or `target/<triple>/release`.
pub fn release_dir(root: &Path, arch: Arch) -> PathBuf {
    let t = target_dir(root);
    if arch.is_host() {
        t.join("release")
    } else {
        t.join(arch.triple()).join("release")
    }
}

/// Builds the release pgio-daemon for `arch` and returns it.
pub fn build_daemon(root: &Path, arch: Arch) -> Result<PathBuf> {
    let mut c = cargo(root, arch, &["build", "--release", "-p", "pgio-daemon"]);
    step(describe(&c));
    run(&mut c)?;
    let bin = release_dir(root, arch).join("pgio-daemon");
    check_file(&bin, arch)?;
    Ok(bin)
}

/// The Go Longhorn stand-in (`longhorn`, `longhorn-fuse`: test-only) for a foreign `arch`, into
/// `target/longhorn-standin/<arch>/`: Go cross-compiles by itself (pure Go, no cgo). The host's
/// is built by the testkit (`pgio_testkit::longhorn::standin_bin_dir`).
pub fn build_longhorn_standin(root: &Path, arch: Arch) -> Result<PathBuf> {
    let out = target_dir(root).join("longhorn-standin").join(arch.name());
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let go = crate::build::go_bin()?;
    let mut c = Command::new(go);
    c.current_dir(root.join("longhorn-standin"))
        .args(["build", "-buildvcs=false", "-o"])
        .arg(format!("{}/", out.display()))
        .args(["./cmd/longhorn", "./cmd/longhorn-fuse"])
        .env("GOTOOLCHAIN", "local")
        .env("GOOS", "linux")
        .env("GOARCH", arch.name())
        .env("CGO_ENABLED", "0");
    step(format!("GOARCH={} {}", arch.name(), describe(&c)));
    run(&mut c)?;
    for bin in ["longhorn", "longhorn-fuse"] {
        check_file(&out.join(bin), arch)?;
    }
    Ok(out)
}

/// Fails unless `file` says `path` is an executable of `arch`.
pub fn check_file(path: &Path, arch: Arch) -> Result<String> {
    let says = output(Command::new("file").arg("-L").arg(path))
        .with_context(|| format!("running file on {}", path.display()))?;
    if !says.contains(arch.file_says()) {
        bail!("{} is not {}: {}", path.display(), arch.name(), says.trim());
    }
    Ok(says.trim().to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse() {
        assert_eq!("arm64".parse::<Arch>().unwrap(), Arch::Arm64);
        assert_eq!("x86_64".parse::<Arch>().unwrap(), Arch::Amd64);
        assert!("riscv64".parse::<Arch>().is_err());
        for a in Arch::ALL {
            assert_eq!(a.name().parse::<Arch>().unwrap(), a);
        }
    }
}
