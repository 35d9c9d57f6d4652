//! Small helpers: step messages, running commands with context, PATH lookups, privileges.

use std::env;
use std::ffi::OsString;
use std::fmt::Display;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail};

/// Print the one-line `xtask: ...` announcement of a step.
pub fn step(msg: impl Display) {
    eprintln!("xtask: {msg}");
}

/// `program arg1 arg2 ...`, for messages.
pub fn describe(cmd: &Command) -> String {
    let mut s = cmd.get_program().to_string_lossy().into_owned();
    for arg in cmd.get_args() {
        s.push(' ');
        s.push_str(&arg.to_string_lossy());
    }
    s
}

/// Run a command with inherited stdio; fail if it cannot start or exits unsuccessfully.
pub fn run(cmd: &mut Command) -> Result<()> {
    let what = describe(cmd);
    let status = cmd
        .status()
        .with_context(|| format!("failed to start `{what}`"))?;
    if !status.success() {
        bail!("`{what}` failed ({status})");
    }
    Ok(())
}

/// Like [`run`], for steps whose name already is the command: the error only gives the status.
pub fn run_quiet(cmd: &mut Command) -> Result<()> {
    let status = cmd
        .status()
        .with_context(|| format!("failed to start `{}`", describe(cmd)))?;
    if !status.success() {
        bail!("{status}");
    }
    Ok(())
}

/// Run a command and return its stdout; fail (with its stderr) if it exits unsuccessfully.
pub fn output(cmd: &mut Command) -> Result<String> {
    let what = describe(cmd);
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("failed to start `{what}`"))?;
    if !out.status.success() {
        bail!(
            "`{what}` failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    String::from_utf8(out.stdout).with_context(|| format!("`{what}` printed non-UTF-8 output"))
}

/// `$CARGO_HOME`, or `$HOME/.cargo`.
pub fn cargo_home() -> Result<PathBuf> {
    if let Some(home) = env::var_os("CARGO_HOME").filter(|h| !h.is_empty()) {
        return Ok(PathBuf::from(home));
    }
    let home = env::var_os("HOME")
        .filter(|h| !h.is_empty())
        .context("neither CARGO_HOME nor HOME is set")?;
    Ok(PathBuf::from(home).join(".cargo"))
}

/// Put `$CARGO_HOME/bin` on PATH (first) for this process and its children when it is missing,
/// so a freshly installed bpf-linker is what rustc and aya-build find.
pub fn ensure_cargo_bin_on_path() -> Result<()> {
    let bin = cargo_home()?.join("bin");
    let current = env::var_os("PATH").unwrap_or_default();
    if env::split_paths(&current).any(|p| p == bin) {
        return Ok(());
    }
    let joined: OsString = env::join_paths(std::iter::once(bin).chain(env::split_paths(&current)))
        .context("cannot add $CARGO_HOME/bin to PATH")?;
    // SAFETY: xtask is single-threaded; nothing reads the environment concurrently.
    unsafe { env::set_var("PATH", joined) };
    Ok(())
}

/// First executable file named `name` on PATH.
pub fn which(name: &str) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let path = env::var_os("PATH")?;
    env::split_paths(&path).map(|dir| dir.join(name)).find(|p| {
        p.metadata()
            .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
            .unwrap_or(false)
    })
}

pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// CI is "set" unless it is absent, empty, "0" or "false".
pub fn in_ci() -> bool {
    match env::var("CI") {
        Ok(v) => !matches!(v.trim().to_ascii_lowercase().as_str(), "" | "0" | "false"),
        Err(_) => false,
    }
}

pub fn fmt_duration(d: Duration) -> String {
    let secs = d.as_secs_f64();
    if secs < 60.0 {
        format!("{secs:.1}s")
    } else {
        let whole = d.as_secs();
        format!("{}m {:02}s", whole / 60, whole % 60)
    }
}

/// The cargo target directory of the workspace (honours CARGO_TARGET_DIR).
pub fn target_dir(root: &Path) -> PathBuf {
    match env::var_os("CARGO_TARGET_DIR")
        .or_else(|| env::var_os("CARGO_BUILD_TARGET_DIR"))
        .filter(|d| !d.is_empty())
    {
        Some(dir) => root.join(dir), // join keeps an absolute dir as is
        None => root.join("target"),
    }
}
