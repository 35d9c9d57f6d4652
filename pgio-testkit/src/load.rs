//! Spawning the `pgio-load` generator as a child with a known PID.

use std::ffi::OsStr;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::Mutex;
use std::time::SystemTime;

use anyhow::{Context, Result, bail, ensure};

use crate::cmd;

/// Env var overriding where `pgio_load_bin` finds the binary.
pub const PGIO_LOAD_BIN_ENV: &str = "PGIO_LOAD_BIN";

/// A running `pgio-load` that has printed `ready <pid>` and waits for `go`.
/// Drop kills (SIGKILL, this child only) and reaps it if it is still running.
#[derive(Debug)]
pub struct LoadProcess {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
    pid: u32,
    reaped: bool,
    cpu_ns: Option<u64>,
    done_fields: Vec<(String, u64)>,
}

impl LoadProcess {
    /// Spawns `bin args...` (stdin/stdout piped, stderr inherited) and reads its
    /// `ready <pid>` line; all of the generator's setup syscalls are done by then.
    pub fn spawn<I, S>(bin: &Path, args: I) -> Result<Self>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let mut command = Command::new(bin);
        command.args(args);
        Self::spawn_command(command)
    }

    /// The same for a command set up by the caller (e.g. to start in a pod's cgroup).
    pub fn spawn_command(mut command: Command) -> Result<Self> {
        command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = command
            .spawn()
            .with_context(|| format!("spawning `{}`", cmd::describe(&command)))?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            bail!("child pipes missing")
        };
        let pid = child.id();
        let mut lp = LoadProcess {
            child,
            stdin: Some(stdin),
            stdout: BufReader::new(stdout),
            pid,
            reaped: false,
            cpu_ns: None,
            done_fields: Vec::new(),
        };
        let line = lp.read_line().context("waiting for `ready <pid>`")?;
        let announced: u32 = line
            .strip_prefix("ready ")
            .and_then(|p| p.trim().parse().ok())
            .with_context(|| format!("expected `ready <pid>`, got {line:?}"))?;
        ensure!(
            announced == pid,
            "pgio-load announced pid {announced} but the child is {pid}"
        );
        Ok(lp)
    }

    /// The generator's PID (the only thread doing the IO).
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Tells the generator to start its IO.
    pub fn go(&mut self) -> Result<()> {
        let stdin = self.stdin.as_mut().context("go() already called")?;
        stdin
            .write_all(b"go\n")
            .and_then(|_| stdin.flush())
            .context("writing go to pgio-load")?;
        Ok(())
    }

    /// CPU time (ns) the generator spent between `go` and `done`, once `wait_done` returned.
    pub fn cpu_ns(&self) -> Option<u64> {
        self.cpu_ns
    }

    /// A mode-specific `key=value` field of the `done` line (e.g. io-uring's `completions`),
    /// once `wait_done` returned.
    pub fn done_field(&self, key: &str) -> Option<u64> {
        self.done_fields
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| *v)
    }

    /// Reads `done <n> <cpu_ns> [key=value...]`, waits for the exit and fails unless it
    /// exited 0. Returns n.
    pub fn wait_done(&mut self) -> Result<u64> {
        let line = self.read_line().context("waiting for `done <n>`")?;
        let mut fields = line.strip_prefix("done ").unwrap_or_default().split(' ');
        let n = fields
            .next()
            .and_then(|n| n.trim().parse().ok())
            .with_context(|| format!("expected `done <n> <cpu_ns>`, got {line:?}"));
        self.cpu_ns = fields.next().and_then(|c| c.trim().parse().ok());
        self.done_fields = parse_done_fields(fields);
        self.stdin = None;
        let status = self.child.wait().context("waiting for pgio-load")?;
        self.reaped = true;
        ensure!(
            status.success(),
            "pgio-load (pid {}) failed: {status}",
            self.pid
        );
        n
    }

    /// `go()` followed by `wait_done()`, panicking on failure (test convenience).
    pub fn expect_run(&mut self) -> u64 {
        self.go()
            .and_then(|_| self.wait_done())
            .expect("pgio-load run")
    }

    /// Reads one stdout line; on EOF reports the exit status instead.
    fn read_line(&mut self) -> Result<String> {
        let mut line = String::new();
        let n = self
            .stdout
            .read_line(&mut line)
            .context("reading pgio-load stdout")?;
        if n == 0 {
            let status = self.child.wait().context("waiting for pgio-load")?;
            self.reaped = true;
            bail!(
                "pgio-load (pid {}) closed stdout and exited with {status} (see its stderr above)",
                self.pid
            );
        }
        Ok(line.trim_end().to_owned())
    }
}

impl Drop for LoadProcess {
    fn drop(&mut self) {
        if self.reaped {
            return;
        }
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

/// `key=value` pairs with a u64 value; anything else is ignored.
fn parse_done_fields<'a>(fields: impl Iterator<Item = &'a str>) -> Vec<(String, u64)> {
    fields
        .filter_map(|f| {
            let (k, v) = f.split_once('=')?;
            Some((k.to_owned(), v.trim().parse().ok()?))
        })
        .collect()
}

/// `pgio-load direct-read <device> <reads> <block_size>`, ready and waiting for `go`.
pub fn direct_reader(device: &Path, reads: u64, block_size: u32) -> Result<LoadProcess> {
    let device = device
        .to_str()
        .with_context(|| format!("{} is not UTF-8", device.display()))?;
    LoadProcess::spawn(
        &pgio_load_bin()?,
        [
            "direct-read",
            device,
            &reads.to_string(),
            &block_size.to_string(),
        ],
    )
}

/// A user rule booking `pgio-load` runs on `device` as `app="test"`, `role`.
pub fn reader_rule(device: &Path, role: &str) -> String {
    format!(
        "[[rule]]\napp = \"test\"\nrole = \"{role}\"\ncomm = \"^pgio-load$\"\ncmdline = \"{} \"\n",
        device.display()
    )
}

/// Path of the `pgio-load` binary for integration tests of any workspace crate:
/// `$PGIO_LOAD_BIN` if set, else `target/<profile>/pgio-load` next to the running test
/// executable (`target/<profile>/deps/<test>`). Builds it with
/// `cargo build -p pgio-testkit --bin pgio-load [--release|--profile P]` (cargo from `$CARGO`)
/// if it is missing or older than this crate's sources.
pub fn pgio_load_bin() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os(PGIO_LOAD_BIN_ENV) {
        return Ok(PathBuf::from(p));
    }
    // Checked (and built) once per test process; parallel tests wait for the first.
    static CHECKED: Mutex<Option<PathBuf>> = Mutex::new(None);
    let mut checked = CHECKED.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(p) = checked.as_ref() {
        return Ok(p.clone());
    }

    let exe = std::env::current_exe().context("locating the current executable")?;
    let profile_dir = profile_dir_of(&exe)?;
    let bin = profile_dir.join("pgio-load");
    let src_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let fresh = match (mtime(&bin), newest_mtime(&src_dir)) {
        (Some(b), Some(s)) => b >= s,
        (Some(_), None) => true, // sources not available: use what is there
        (None, _) => false,
    };
    if !fresh {
        build_pgio_load(&profile_dir)?;
        ensure!(
            bin.is_file(),
            "cargo build succeeded but {} is missing",
            bin.display()
        );
    }
    *checked = Some(bin.clone());
    Ok(bin)
}

/// target/<profile> for an executable in target/<profile>/deps or target/<profile>.
pub(crate) fn profile_dir_of(exe: &Path) -> Result<PathBuf> {
    let dir = exe
        .parent()
        .with_context(|| format!("{} has no parent", exe.display()))?;
    let dir = if dir.file_name() == Some(OsStr::new("deps")) {
        dir.parent()
            .with_context(|| format!("{} has no parent", dir.display()))?
    } else {
        dir
    };
    Ok(dir.to_owned())
}

/// The cargo target directory this test executable was built into (fixtures cache
/// downloads and builds there).
pub(crate) fn target_dir() -> Result<PathBuf> {
    let exe = std::env::current_exe().context("locating the current executable")?;
    target_dir_of(&profile_dir_of(&exe)?)
}

/// `target` for `target/<profile>` or `target/<triple>/<profile>`.
fn target_dir_of(profile_dir: &Path) -> Result<PathBuf> {
    let parent = profile_dir
        .parent()
        .with_context(|| format!("{} has no parent", profile_dir.display()))?;
    let is_triple = parent
        .file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.contains("-linux-"));
    Ok(match (is_triple, parent.parent()) {
        (true, Some(target)) => target.to_owned(),
        _ => parent.to_owned(),
    })
}

fn build_pgio_load(profile_dir: &Path) -> Result<()> {
    let profile = profile_dir
        .file_name()
        .and_then(|n| n.to_str())
        .with_context(|| format!("no profile name in {}", profile_dir.display()))?;
    let mut target_dir = profile_dir
        .parent()
        .context("profile dir has no parent")?
        .to_owned();
    let mut triple = None;
    // target/<triple>/<profile> when cross-compiling with --target.
    if let Some(name) = target_dir.file_name().and_then(|n| n.to_str())
        && name.contains("-linux-")
    {
        triple = Some(name.to_owned());
        target_dir = target_dir
            .parent()
            .context("target dir has no parent")?
            .to_owned();
    }
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut c = Command::new(cargo);
    c.arg("build")
        .arg("--manifest-path")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml"))
        .args(["-p", "pgio-testkit", "--bin", "pgio-load"])
        .arg("--target-dir")
        .arg(&target_dir);
    match profile {
        "debug" => {}
        "release" => {
            c.arg("--release");
        }
        other => {
            c.args(["--profile", other]);
        }
    }
    if let Some(t) = triple {
        c.args(["--target", &t]);
    }
    eprintln!("pgio-testkit: building pgio-load: {}", cmd::describe(&c));
    cmd::run(&mut c).map(|_| ())
}

fn mtime(p: &Path) -> Option<SystemTime> {
    std::fs::metadata(p).and_then(|m| m.modified()).ok()
}

fn newest_mtime(dir: &Path) -> Option<SystemTime> {
    let mut newest = None;
    for entry in std::fs::read_dir(dir).ok()?.flatten() {
        let p = entry.path();
        let t = if p.is_dir() {
            newest_mtime(&p)
        } else {
            mtime(&p)
        };
        newest = newest.max(t);
    }
    newest
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn target_dir_from_profile_dir() {
        assert_eq!(
            target_dir_of(Path::new("/w/target/release")).unwrap(),
            Path::new("/w/target")
        );
        assert_eq!(
            target_dir_of(Path::new("/w/target/x86_64-unknown-linux-gnu/debug")).unwrap(),
            Path::new("/w/target")
        );
    }

    #[test]
    fn parses_done_fields() {
        assert_eq!(
            parse_done_fields("reads=5 iou_wrk_threads=3 junk x=y".split(' ')),
            vec![("reads".to_owned(), 5), ("iou_wrk_threads".to_owned(), 3)]
        );
    }

    #[test]
    fn profile_dir_from_test_and_bin_paths() {
        assert_eq!(
            profile_dir_of(Path::new("/w/target/release/deps/fixtures-0123")).unwrap(),
            Path::new("/w/target/release")
        );
        assert_eq!(
            profile_dir_of(Path::new("/w/target/debug/pgio-daemon")).unwrap(),
            Path::new("/w/target/debug")
        );
    }
}
