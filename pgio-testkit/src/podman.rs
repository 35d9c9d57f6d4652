//! Podman as it works on these machines (`../shared/TOOLCHAIN.md`, "Containers here"): the
//! pgio image (`FROM scratch`: the daemon and the shared libraries `ldd` lists), and running
//! containers that are removed on drop. `cargo xtask image` and the container test build the
//! image with the same function, [`build_image`].

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};

use crate::cmd;

/// Global podman flags every call needs here: `crun` (podman's default) fails on this hybrid
/// cgroup v1 + v2 host, and there is no systemd cgroup manager to talk to.
pub const GLOBAL_FLAGS: &[&str] = &["--runtime", "runc", "--cgroup-manager=cgroupfs"];

/// `podman run` flags the machine needs, not the manifest: the host's hard `RLIMIT_NOFILE` is
/// 20000 and podman's defaults ask for more ("setrlimit: Operation not permitted").
pub const MACHINE_RUN_FLAGS: &[&str] = &[
    "--ulimit",
    "nofile=20000:20000",
    "--ulimit",
    "nproc=4096:4096",
];

/// The Debian packages podman needs here (`runc`: see [`GLOBAL_FLAGS`]).
pub const PACKAGES: &[&str] = &["podman", "runc"];

/// `podman <GLOBAL_FLAGS>`.
pub fn podman() -> Command {
    let mut c = Command::new("podman");
    c.args(GLOBAL_FLAGS);
    c
}

/// True if `podman` and `runc` are on PATH.
pub fn available() -> bool {
    ["podman", "runc"]
        .iter()
        .all(|tool| crate::cmd::on_path(tool))
}

/// What [`build_image`] made.
#[derive(Debug, Clone)]
pub struct Image {
    /// Every tag given, the first one is the image's name in messages.
    pub tags: Vec<String>,
    pub id: String,
    pub size_bytes: u64,
    /// The files in the image besides the daemon (from `ldd`; empty for a static binary).
    pub libraries: Vec<PathBuf>,
}

/// Builds the image of `containerfile` from a context in `context_dir` (emptied first): the
/// `binary` as `rootfs/pgio-daemon` and each shared library `ldd` lists at its own path under
/// `rootfs/`. `build_args` are `--build-arg` pairs. Podman's layer cache makes a rebuild of
/// unchanged files a no-op with the same image id.
pub fn build_image(
    binary: &Path,
    containerfile: &Path,
    context_dir: &Path,
    tags: &[String],
    build_args: &[(&str, &str)],
) -> Result<Image> {
    let files = shared_libraries(binary)?
        .into_iter()
        .map(|l| (l.clone(), l))
        .collect::<Vec<_>>();
    let mut image = build_image_with(&ImageInput {
        binary,
        files: &files,
        platform: None,
        containerfile,
        context_dir,
        tags,
        build_args,
    })?;
    image.libraries = files.into_iter().map(|(from, _)| from).collect();
    Ok(image)
}

/// What [`build_image_with`] puts into an image.
pub struct ImageInput<'a> {
    /// Becomes `/pgio-daemon`.
    pub binary: &'a Path,
    /// (file on this host, absolute path in the image): its libraries, an SBOM.
    pub files: &'a [(PathBuf, PathBuf)],
    /// `linux/arm64`: `podman build --platform`. A `FROM scratch` image of COPYs needs no
    /// emulation for a foreign platform; `None` builds for the host's.
    pub platform: Option<&'a str>,
    pub containerfile: &'a Path,
    /// Emptied first.
    pub context_dir: &'a Path,
    pub tags: &'a [String],
    /// `--build-arg` pairs.
    pub build_args: &'a [(&'a str, &'a str)],
}

/// Builds the image of `input.containerfile` from a context holding `rootfs/pgio-daemon` and
/// each of `input.files` at its image path; `libraries` of the result are those image paths.
pub fn build_image_with(input: &ImageInput<'_>) -> Result<Image> {
    let tags = input.tags;
    ensure!(!tags.is_empty(), "an image needs at least one tag");
    let context_dir = input.context_dir;
    let rootfs = context_dir.join("rootfs");
    if context_dir.exists() {
        std::fs::remove_dir_all(context_dir)
            .with_context(|| format!("emptying {}", context_dir.display()))?;
    }
    std::fs::create_dir_all(&rootfs).with_context(|| format!("creating {}", rootfs.display()))?;
    copy_file(input.binary, &rootfs.join("pgio-daemon"))?;
    for (from, to) in input.files {
        ensure!(
            to.is_absolute(),
            "image path {} is not absolute",
            to.display()
        );
        let rel = to.strip_prefix("/").unwrap_or(to);
        copy_file(from, &rootfs.join(rel))?;
    }
    let mut build = podman();
    build.arg("build").arg("--file").arg(input.containerfile);
    if let Some(p) = input.platform {
        build.arg("--platform").arg(p);
    }
    for (k, v) in input.build_args {
        build.arg("--build-arg").arg(format!("{k}={v}"));
    }
    for t in tags {
        build.arg("--tag").arg(t);
    }
    build.arg(context_dir);
    cmd::run(&mut build)?;
    let inspect = cmd::run(podman().args([
        "image",
        "inspect",
        "--format",
        "{{.Id}} {{.Size}}",
        &tags[0],
    ]))?;
    let (id, size) = inspect
        .trim()
        .split_once(' ')
        .with_context(|| format!("unexpected `podman image inspect` output {inspect:?}"))?;
    Ok(Image {
        tags: tags.to_vec(),
        id: id.to_owned(),
        size_bytes: size.parse().context("image size")?,
        libraries: input.files.iter().map(|(_, to)| to.clone()).collect(),
    })
}

/// `podman rmi <tag>`: untags, and removes the image when no other tag names it.
pub fn remove_tag(tag: &str) -> Result<()> {
    cmd::run(podman().args(["rmi", tag])).map(|_| ())
}

/// Copies the content (symlinks followed) and the permission bits.
fn copy_file(from: &Path, to: &Path) -> Result<()> {
    if let Some(dir) = to.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    std::fs::copy(from, to)
        .with_context(|| format!("copying {} to {}", from.display(), to.display()))?;
    Ok(())
}

/// The absolute paths `ldd` lists for `binary` (libraries and the program interpreter; the
/// vDSO has none). Empty for a static binary; an error for a library `ldd` cannot find.
pub fn shared_libraries(binary: &Path) -> Result<Vec<PathBuf>> {
    let out = cmd::output(Command::new("ldd").arg(binary))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        if stdout.contains("not a dynamic executable")
            || stderr.contains("not a dynamic executable")
        {
            return Ok(Vec::new());
        }
        bail!(
            "`ldd {}` failed ({}): {stderr}",
            binary.display(),
            out.status
        );
    }
    parse_ldd(&stdout)
}

fn parse_ldd(text: &str) -> Result<Vec<PathBuf>> {
    let mut libs = Vec::new();
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
        if line.contains("statically linked") {
            continue;
        }
        let target = match line.split_once("=>") {
            Some((name, rest)) => {
                let rest = rest.trim();
                ensure!(
                    !rest.starts_with("not found"),
                    "ldd: {} not found",
                    name.trim()
                );
                rest
            }
            None => line,
        };
        let path = target.split_whitespace().next().unwrap_or_default();
        if path.starts_with('/') {
            libs.push(PathBuf::from(path));
        }
    }
    Ok(libs)
}

/// A container started with `podman run -d --name <name>`; Drop removes it (`podman rm -f`)
/// whatever state it is in, also when a test panics.
#[derive(Debug)]
pub struct Container {
    name: String,
}

impl Container {
    /// `podman run -d --name <name> <MACHINE_RUN_FLAGS> <run_flags> <image> <args>`. A container
    /// of that name left over from an earlier run is removed first.
    pub fn run(
        name: &str,
        run_flags: &[String],
        image: &str,
        args: &[String],
    ) -> Result<Container> {
        let _ = cmd::output(podman().args(["rm", "-f", "--time", "0", name]));
        let mut c = podman();
        c.args(["run", "-d", "--name", name])
            .args(MACHINE_RUN_FLAGS)
            .args(run_flags)
            .arg(image)
            .args(args);
        cmd::run(&mut c)?;
        Ok(Container {
            name: name.to_owned(),
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// `Some(exit code)` once the container has stopped, `None` while it runs.
    pub fn exit_code(&self) -> Result<Option<i32>> {
        let out = cmd::run(podman().args([
            "inspect",
            "--format",
            "{{.State.Running}} {{.State.ExitCode}}",
            &self.name,
        ]))?;
        match out.trim().split_once(' ') {
            Some(("true", _)) => Ok(None),
            Some((_, code)) => Ok(Some(code.parse().context("exit code")?)),
            None => bail!("unexpected `podman inspect` output {out:?}"),
        }
    }

    /// Waits up to `timeout` for the container to stop; its exit code.
    pub fn wait_exit(&self, timeout: Duration) -> Result<i32> {
        let mut code = None;
        crate::wait_until(timeout, Duration::from_millis(100), || {
            code = self.exit_code().ok().flatten();
            code.is_some()
        });
        code.with_context(|| format!("container {} still running after {timeout:?}", self.name))
    }

    /// stdout and stderr of the container so far (`podman logs`), ANSI colours removed.
    pub fn logs(&self) -> String {
        match cmd::output(podman().args(["logs", &self.name])) {
            Ok(out) => strip_ansi(&format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            )),
            Err(e) => format!("(podman logs failed: {e:#})"),
        }
    }

    /// PID of the container's first process on the host (0 when it is not running).
    pub fn host_pid(&self) -> Result<u32> {
        let out = cmd::run(podman().args(["inspect", "--format", "{{.State.Pid}}", &self.name]))?;
        out.trim().parse().context("container pid")
    }

    /// `podman stop --time <grace>` (SIGTERM, then SIGKILL after `grace`); the exit code.
    pub fn stop(&self, grace: Duration) -> Result<i32> {
        cmd::run(podman().args([
            "stop",
            "--time",
            &grace.as_secs().max(1).to_string(),
            &self.name,
        ]))?;
        self.wait_exit(Duration::from_secs(5))
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("container {} output:\n{}", self.name, self.logs());
        }
        let mut rm = podman();
        rm.args(["rm", "-f", "--time", "2", &self.name])
            .stdout(Stdio::null());
        if let Err(e) = cmd::run(&mut rm) {
            eprintln!("pgio-testkit: removing container {}: {e:#}", self.name);
        }
    }
}

/// Removes `ESC [ … letter` sequences (tracing colours its log lines).
pub fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_ldd_output() {
        let text = "\tlinux-vdso.so.1 (0x00007ffd)\n\
                    \tlibgcc_s.so.1 => /lib/x86_64-linux-gnu/libgcc_s.so.1 (0x00007f67)\n\
                    \tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f67)\n\
                    \t/lib64/ld-linux-x86-64.so.2 (0x00007f67)\n";
        assert_eq!(
            parse_ldd(text).unwrap(),
            [
                "/lib/x86_64-linux-gnu/libgcc_s.so.1",
                "/lib/x86_64-linux-gnu/libc.so.6",
                "/lib64/ld-linux-x86-64.so.2"
            ]
            .map(PathBuf::from)
        );
        assert!(parse_ldd("\tstatically linked\n").unwrap().is_empty());
        let err = parse_ldd("\tlibfoo.so.1 => not found\n").unwrap_err();
        assert!(err.to_string().contains("libfoo.so.1 not found"), "{err}");
    }

    #[test]
    fn strips_ansi_colours() {
        assert_eq!(
            strip_ansi("\u{1b}[2m2026\u{1b}[0m \u{1b}[31mERROR\u{1b}[0m x"),
            "2026 ERROR x"
        );
    }
}
