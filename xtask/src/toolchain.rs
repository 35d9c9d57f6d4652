//! Rust toolchain pieces the eBPF build needs: `rust-src` for nightly and a `bpf-linker` that
//! uses the same LLVM major version as `rustc +nightly` (see /work/shared/TOOLCHAIN.md).

use std::fs::{self, File, OpenOptions};
use std::io::ErrorKind;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::util::{cargo_home, describe, fmt_duration, output, run, step, which};

const BPF_LINKER_VERSION: &str = "0.13.0";
const STAMP_FILE: &str = "bpf-linker.llvm-stamp";
const LOCK_FILE: &str = "bpf-linker.install.lock";

/// What the installed nightly toolchain looks like.
pub struct Nightly {
    /// `rustc +nightly -vV` output: the content of the stamp file.
    verbose_version: String,
    llvm_major: u32,
    sysroot: PathBuf,
}

impl Nightly {
    pub fn detect() -> Result<Self> {
        let verbose_version =
            output(Command::new("rustup").args(["run", "nightly", "rustc", "-vV"])).context(
                "the nightly toolchain is needed to build the eBPF crate \
                 (it is preinstalled on these machines; else `rustup toolchain install nightly`)",
            )?;
        let llvm = verbose_version
            .lines()
            .find_map(|l| l.strip_prefix("LLVM version:"))
            .map(str::trim)
            .context("`rustc +nightly -vV` prints no `LLVM version:` line")?;
        let llvm_major =
            leading_number(llvm).with_context(|| format!("cannot parse LLVM version `{llvm}`"))?;
        let sysroot =
            output(Command::new("rustup").args(["run", "nightly", "rustc", "--print", "sysroot"]))?;
        Ok(Nightly {
            verbose_version,
            llvm_major,
            sysroot: PathBuf::from(sysroot.trim()),
        })
    }

    fn lib_dir(&self) -> PathBuf {
        self.sysroot.join("lib")
    }
}

fn leading_number(s: &str) -> Option<u32> {
    let digits: String = s.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

pub fn ensure_rust_src() -> Result<()> {
    step("checking that the nightly toolchain has the rust-src component");
    let installed = output(Command::new("rustup").args([
        "component",
        "list",
        "--toolchain",
        "nightly",
        "--installed",
    ]))?;
    if installed
        .lines()
        .any(|l| l.trim() == "rust-src" || l.starts_with("rust-src "))
    {
        step("rust-src (nightly) is installed");
        return Ok(());
    }
    step("installing rust-src for nightly: rustup component add rust-src --toolchain nightly");
    run(Command::new("rustup").args(["component", "add", "rust-src", "--toolchain", "nightly"]))
}

/// Result of inspecting the bpf-linker on PATH.
enum Verdict {
    Good(String),
    Rebuild(String),
}

pub fn ensure_bpf_linker(nightly: &Nightly) -> Result<()> {
    step(format!(
        "checking bpf-linker (must run and use LLVM {} like rustc +nightly)",
        nightly.llvm_major
    ));
    let cargo_home = cargo_home()?;
    let stamp = cargo_home.join(STAMP_FILE);
    let _lock = InstallLock::acquire(&cargo_home.join(LOCK_FILE))?;

    let reason = match assess(nightly, &stamp)? {
        Verdict::Good(why) => {
            step(format!("bpf-linker is usable: {why}"));
            return Ok(());
        }
        Verdict::Rebuild(reason) => reason,
    };
    wait_for_foreign_install()?;
    // Someone else may have finished an install while we waited.
    if let Verdict::Good(why) = assess(nightly, &stamp)? {
        step(format!("bpf-linker is usable: {why}"));
        return Ok(());
    }
    step(format!(
        "installing bpf-linker {BPF_LINKER_VERSION} against nightly's LLVM {} ({reason}); takes ~2 min",
        nightly.llvm_major
    ));
    install(nightly, &cargo_home)?;
    write_stamp(&stamp, &nightly.verbose_version)?;
    match assess(nightly, &stamp)? {
        Verdict::Good(_) => {
            step(format!(
                "bpf-linker {BPF_LINKER_VERSION} installed; stamp written to {}",
                stamp.display()
            ));
            Ok(())
        }
        Verdict::Rebuild(why) => bail!("bpf-linker is still unusable after installing it: {why}"),
    }
}

fn assess(nightly: &Nightly, stamp: &Path) -> Result<Verdict> {
    let Some(bin) = which("bpf-linker") else {
        return Ok(Verdict::Rebuild("bpf-linker is not on PATH".into()));
    };
    let version = match Command::new(&bin).arg("--version").output() {
        Ok(out) if out.status.success() => String::from_utf8_lossy(&out.stdout).trim().to_owned(),
        Ok(out) => {
            let err = String::from_utf8_lossy(&out.stderr);
            return Ok(Verdict::Rebuild(format!(
                "`{} --version` fails: {}",
                bin.display(),
                err.lines().next().unwrap_or("").trim()
            )));
        }
        Err(err) => {
            return Ok(Verdict::Rebuild(format!(
                "`{} --version` cannot start: {err}",
                bin.display()
            )));
        }
    };
    let dynamic = read_dynamic(&bin);
    if let Some(dynamic) = &dynamic
        && let Some(major) = dynamic.llvm_major()
        && major != nightly.llvm_major
    {
        return Ok(Verdict::Rebuild(format!(
            "{} links libLLVM {major}, nightly rustc uses LLVM {}",
            bin.display(),
            nightly.llvm_major
        )));
    }
    match fs::read_to_string(stamp) {
        Ok(s) if s == nightly.verbose_version => {
            return Ok(Verdict::Good(format!(
                "{version} at {}, stamp matches rustc +nightly",
                bin.display()
            )));
        }
        Ok(_) | Err(_) => {}
    }
    let lib_dir = nightly.lib_dir();
    let runpath_ok = dynamic
        .as_ref()
        .is_some_and(|d| d.runpath.iter().any(|p| same_dir(Path::new(p), &lib_dir)));
    if runpath_ok {
        // Built against this very toolchain (e.g. by hand per TOOLCHAIN.md): adopt it.
        write_stamp(stamp, &nightly.verbose_version)?;
        return Ok(Verdict::Good(format!(
            "{version} at {}, RUNPATH is {}; stamp recorded",
            bin.display(),
            lib_dir.display()
        )));
    }
    let stamp_state = if stamp.exists() {
        "stamp differs from rustc +nightly -vV"
    } else {
        "no stamp"
    };
    Ok(Verdict::Rebuild(format!(
        "{stamp_state} and RUNPATH of {} does not point at {}",
        bin.display(),
        lib_dir.display()
    )))
}

fn same_dir(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => a == b,
    }
}

/// The parts of `readelf -d` we care about.
struct Dynamic {
    needed: Vec<String>,
    runpath: Vec<String>,
}

impl Dynamic {
    /// LLVM major from a NEEDED entry like `libLLVM.so.22.1-rust-1.97.0-nightly` or `libLLVM-19.so`.
    fn llvm_major(&self) -> Option<u32> {
        self.needed.iter().find_map(|lib| {
            let rest = lib.strip_prefix("libLLVM")?;
            let rest = rest
                .strip_prefix(".so.")
                .or_else(|| rest.strip_prefix('-'))?;
            leading_number(rest)
        })
    }
}

/// `readelf -d`; None when readelf is missing or fails (then only the stamp counts).
fn read_dynamic(bin: &Path) -> Option<Dynamic> {
    let out = Command::new("readelf").arg("-d").arg(bin).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let mut dynamic = Dynamic {
        needed: Vec::new(),
        runpath: Vec::new(),
    };
    for line in text.lines() {
        let bracketed = || {
            let start = line.find('[')?;
            let end = line.rfind(']')?;
            line.get(start + 1..end)
        };
        if line.contains("(NEEDED)") {
            if let Some(lib) = bracketed() {
                dynamic.needed.push(lib.to_owned());
            }
        } else if (line.contains("(RUNPATH)") || line.contains("(RPATH)"))
            && let Some(paths) = bracketed()
        {
            dynamic
                .runpath
                .extend(paths.split(':').filter(|p| !p.is_empty()).map(String::from));
        }
    }
    Some(dynamic)
}

fn write_stamp(stamp: &Path, content: &str) -> Result<()> {
    let tmp = stamp.with_extension("tmp");
    fs::write(&tmp, content).with_context(|| format!("cannot write {}", tmp.display()))?;
    fs::rename(&tmp, stamp)
        .with_context(|| format!("cannot rename {} to {}", tmp.display(), stamp.display()))
}

/// `ln -s libLLVM.so.<ver>-rust-<ver> $sysroot/lib/libLLVM.so` for the duration of the build.
struct LlvmSymlink {
    link: Option<PathBuf>,
}

impl LlvmSymlink {
    fn create(lib_dir: &Path) -> Result<Self> {
        let target = fs::read_dir(lib_dir)
            .with_context(|| format!("cannot list {}", lib_dir.display()))?
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .find(|name| name.starts_with("libLLVM.so.") && name.contains("-rust-"))
            .with_context(|| format!("no libLLVM.so.*-rust-* in {}", lib_dir.display()))?;
        let link = lib_dir.join("libLLVM.so");
        match fs::symlink_metadata(&link) {
            Ok(meta) if !meta.file_type().is_symlink() => {
                // A real file we did not create: use it, leave it alone.
                return Ok(LlvmSymlink { link: None });
            }
            Ok(_) => {
                // Left over from an interrupted build: replace it (and remove it afterwards).
                fs::remove_file(&link)
                    .with_context(|| format!("cannot remove stale {}", link.display()))?;
            }
            Err(err) if err.kind() == ErrorKind::NotFound => {}
            Err(err) => return Err(err).with_context(|| format!("cannot stat {}", link.display())),
        }
        step(format!(
            "temporarily linking {} -> {target}",
            link.display()
        ));
        std::os::unix::fs::symlink(&target, &link)
            .with_context(|| format!("cannot create symlink {}", link.display()))?;
        Ok(LlvmSymlink { link: Some(link) })
    }
}

impl Drop for LlvmSymlink {
    fn drop(&mut self) {
        if let Some(link) = self.link.take() {
            step(format!("removing temporary {}", link.display()));
            if let Err(err) = fs::remove_file(&link) {
                eprintln!("xtask: warning: cannot remove {}: {err}", link.display());
            }
        }
    }
}

fn install(nightly: &Nightly, cargo_home: &Path) -> Result<()> {
    let started = Instant::now();
    let _symlink = LlvmSymlink::create(&nightly.lib_dir())?;
    let mut cmd = Command::new("cargo");
    cmd.args(["+stable", "install"])
        .arg(format!("bpf-linker@{BPF_LINKER_VERSION}"))
        .args(["--locked", "--force", "--no-default-features", "--features"])
        .arg(format!("llvm-{}", nightly.llvm_major))
        .env("LLVM_PREFIX", &nightly.sysroot)
        // Outside the workspace, so its rust-toolchain.toml and .cargo/config.toml do not apply.
        .current_dir(cargo_home);
    step(format!(
        "running LLVM_PREFIX={} {}",
        nightly.sysroot.display(),
        describe(&cmd)
    ));
    run(&mut cmd).context("building bpf-linker failed")?;
    step(format!(
        "bpf-linker built in {}",
        fmt_duration(started.elapsed())
    ));
    Ok(())
}

/// Exclusive flock on a file in CARGO_HOME so two xtasks never build bpf-linker at once.
struct InstallLock {
    _file: File,
}

impl InstallLock {
    fn acquire(path: &Path) -> Result<Self> {
        if let Some(dir) = path.parent() {
            fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        }
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)
            .with_context(|| format!("cannot open lock file {}", path.display()))?;
        let fd = file.as_raw_fd();
        // SAFETY: fd is a valid open descriptor owned by `file` for the duration of the call.
        if unsafe { libc::flock(fd, libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            step(format!(
                "waiting for another xtask that holds {}",
                path.display()
            ));
            // SAFETY: as above.
            if unsafe { libc::flock(fd, libc::LOCK_EX) } != 0 {
                return Err(std::io::Error::last_os_error())
                    .with_context(|| format!("cannot lock {}", path.display()));
            }
        }
        Ok(InstallLock { _file: file })
    }
}

/// PIDs of running `cargo install ... bpf-linker...` processes started outside xtask.
fn foreign_installs() -> Vec<u32> {
    let me = std::process::id();
    let Ok(entries) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| pid != me)
        .filter(|pid| {
            let Ok(raw) = fs::read(format!("/proc/{pid}/cmdline")) else {
                return false;
            };
            let args: Vec<String> = raw
                .split(|&b| b == 0)
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect();
            let is_cargo = args
                .first()
                .is_some_and(|a| a == "cargo" || a.ends_with("/cargo"));
            is_cargo
                && args.iter().any(|a| a == "install")
                && args.iter().any(|a| a.starts_with("bpf-linker"))
        })
        .collect()
}

/// Do not race a `cargo install bpf-linker` that someone started by hand.
fn wait_for_foreign_install() -> Result<()> {
    let mut announced = false;
    loop {
        let pids = foreign_installs();
        if pids.is_empty() {
            return Ok(());
        }
        if !announced {
            step(format!(
                "waiting for a running `cargo install bpf-linker` (pid {pids:?}) to finish"
            ));
            announced = true;
        }
        thread::sleep(Duration::from_secs(5));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dynamic(needed: &[&str]) -> Dynamic {
        Dynamic {
            needed: needed.iter().map(|s| s.to_string()).collect(),
            runpath: Vec::new(),
        }
    }

    #[test]
    fn llvm_major_from_needed() {
        let rust = dynamic(&["libLLVM.so.22.1-rust-1.97.0-nightly", "libc.so.6"]);
        assert_eq!(rust.llvm_major(), Some(22));
        assert_eq!(dynamic(&["libLLVM-19.so"]).llvm_major(), Some(19));
        assert_eq!(dynamic(&["libLLVM.so.21.1"]).llvm_major(), Some(21));
        assert_eq!(dynamic(&["libc.so.6"]).llvm_major(), None);
    }

    #[test]
    fn leading_numbers() {
        assert_eq!(leading_number("22.1.4"), Some(22));
        assert_eq!(leading_number("x22"), None);
    }
}
