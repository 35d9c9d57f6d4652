//! Running external tools (losetup, mkfs.ext4, mount, pg_ctl, ...) with useful errors.

use std::process::{Command, Output};

use anyhow::{Context, Result, bail};

/// `program arg1 arg2 ...` for messages.
pub(crate) fn describe(cmd: &Command) -> String {
    let mut s = cmd.get_program().to_string_lossy().into_owned();
    for a in cmd.get_args() {
        s.push(' ');
        s.push_str(&a.to_string_lossy());
    }
    s
}

/// Runs `cmd` to completion (stdin from /dev/null), capturing output.
pub(crate) fn output(cmd: &mut Command) -> Result<Output> {
    cmd.stdin(std::process::Stdio::null())
        .output()
        .with_context(|| format!("spawning `{}`", describe(cmd)))
}

/// Runs `cmd`, fails with its stderr/stdout if it exits non-zero, returns its stdout.
pub(crate) fn run(cmd: &mut Command) -> Result<String> {
    let out = output(cmd)?;
    check(cmd, &out)?;
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Fails with the command line, status, stderr and stdout if `out` is not a success.
pub(crate) fn check(cmd: &Command, out: &Output) -> Result<()> {
    if !out.status.success() {
        bail!(
            "`{}` failed with {}\nstderr: {}\nstdout: {}",
            describe(cmd),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim_end(),
            String::from_utf8_lossy(&out.stdout).trim_end()
        );
    }
    Ok(())
}

/// Whether `tool` is a file in a `$PATH` directory.
pub fn on_path(tool: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file()))
}

/// Whether kernel module `name` is loaded, or `modprobe -q` loads it now.
pub(crate) fn module_available(name: &str) -> bool {
    std::path::Path::new("/sys/module").join(name).exists()
        || std::process::Command::new("modprobe")
            .args(["-q", name])
            .stdin(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
}
