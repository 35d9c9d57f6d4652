//! `cargo xtask release --self-test`: the release pushed to a real registry on 127.0.0.1 and
//! taken back as a user would. Each platform is pulled by the index digest into an empty podman
//! store of its own (every blob comes from the registry, none from the images just built), its
//! architecture and manifest digest checked, the amd64 image run (`--version`), the arm64 one
//! too under qemu-user when there is one; the chart pulled by version and by digest, rendered
//! and its values read. Every check runs and is reported; any failure fails the command.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail, ensure};
use pgio_testkit::podman;
use serde_json::Value;

use crate::apt;
use crate::util::{fmt_duration, is_root, output, step, which};

use super::chart::Helm;
use super::checks;
use super::registry::LocalRegistry;
use super::{Options, Published, Target, release};

/// The kernel's binfmt_misc entry for arm64 programs, when qemu-user-static registered one.
const BINFMT_AARCH64: &str = "/proc/sys/fs/binfmt_misc/qemu-aarch64";

pub fn run(root: &Path, skip_setup: bool) -> Result<()> {
    let started = Instant::now();
    ensure!(
        is_root(),
        "the self-test mounts the pulled arm64 image (`podman image mount`): run it as root"
    );
    if !skip_setup {
        // Only for running the arm64 image; the rest does without it.
        if let Err(e) = apt::ensure(&["qemu-user-static"]) {
            step(format!(
                "qemu-user-static unavailable ({e:#}): arm64 is not run"
            ));
        }
    }
    let scratch = Scratch::new()?;
    let registry = LocalRegistry::start(root, &scratch.0.join("registry"))?;
    let target: Target = format!("{}/selftest/pgio", registry.addr).parse()?;
    let published = release(
        root,
        &Options {
            target,
            tls_verify: false,
            skip_setup,
        },
    )
    .with_context(|| format!("the release failed; registry log:\n{}", registry.log_tail()))?;

    let store = Store::new(&scratch.0.join("podman"));
    let helm = Helm::ensure(root, &scratch.0, false)?;
    let mut report = Report::default();
    report.check("dist: sha256sum -c SHA256SUMS, release.json", || {
        checks::dist(&published)
    });
    check_images(&mut report, &store, &published);
    let pulled_chart = scratch.0.join("chart");
    report.check("helm pull --version, by digest", || {
        checks::pull_chart(&helm, &published, &pulled_chart)
    });
    report.check("helm template: the DaemonSet's image", || {
        checks::rendered_image(&helm, &published, &pulled_chart)
    });
    report.check("helm show values: image.repository, image.digest", || {
        checks::shown_values(&helm, &published, &pulled_chart)
    });
    drop(registry);
    report.finish(started)
}

/// Each platform pulled into the empty `store` by the index digest, then run.
fn check_images(report: &mut Report, store: &Store, published: &Published) {
    report.check("the pulls' podman store is empty", || {
        let images = output(store.podman().args(["images", "--quiet"]))?;
        ensure!(images.trim().is_empty(), "it holds {images}");
        Ok(format!("{} (vfs)", store.0.display()))
    });
    let mut pulled = Vec::new();
    for (platform, digest) in &published.platforms {
        report.check(&format!("pull {platform} by index digest"), || {
            let (id, what) = pull(store, published, platform, digest)?;
            pulled.push((platform.clone(), id));
            Ok(what)
        });
    }
    for (platform, id) in &pulled {
        report.check(&format!("run {platform}: pgio-daemon --version"), || {
            run_version(store, platform, id, &published.version)
        });
    }
}

/// The scratch directory, removed on drop (after the registry, declared later, is gone).
struct Scratch(PathBuf);

impl Scratch {
    fn new() -> Result<Scratch> {
        let dir =
            std::env::temp_dir().join(format!("pgio-release-self-test-{}", std::process::id()));
        if dir.exists() {
            fs::remove_dir_all(&dir).with_context(|| format!("emptying {}", dir.display()))?;
        }
        fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        Ok(Scratch(dir))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if let Err(e) = fs::remove_dir_all(&self.0) {
            step(format!("removing {}: {e}", self.0.display()));
        }
    }
}

/// An empty podman store under the scratch directory (vfs: plain directories, nothing
/// mounted, nothing shared with the host's images).
struct Store(PathBuf);

impl Store {
    fn new(dir: &Path) -> Store {
        Store(dir.to_path_buf())
    }

    fn podman(&self) -> Command {
        let mut c = podman::podman();
        c.arg("--root")
            .arg(self.0.join("root"))
            .arg("--runroot")
            .arg(self.0.join("run"))
            .arg("--tmpdir")
            .arg(self.0.join("tmp"))
            .args(["--storage-driver", "vfs"]);
        c
    }
}

/// The checks' outcomes, printed as a table at the end.
#[derive(Default)]
struct Report(Vec<(String, Result<String>)>);

impl Report {
    fn check(&mut self, name: &str, f: impl FnOnce() -> Result<String>) {
        let started = Instant::now();
        step(format!("self-test: {name}"));
        let outcome = f().map(|s| format!("{s} ({})", fmt_duration(started.elapsed())));
        match &outcome {
            Ok(s) => step(format!("self-test: {name}: ok: {s}")),
            Err(e) => step(format!("self-test: {name}: FAILED: {e:#}")),
        }
        self.0.push((name.to_owned(), outcome));
    }

    fn finish(self, started: Instant) -> Result<()> {
        let failed = self.0.iter().filter(|(_, r)| r.is_err()).count();
        for (name, outcome) in &self.0 {
            match outcome {
                Ok(s) => step(format!("  ok      {name}: {s}")),
                Err(e) => step(format!("  FAILED  {name}: {e:#}")),
            }
        }
        let total = fmt_duration(started.elapsed());
        if failed > 0 {
            bail!(
                "release self-test: {failed} of {} checks failed ({total})",
                self.0.len()
            );
        }
        step(format!(
            "release self-test: {} checks passed in {total}",
            self.0.len()
        ));
        Ok(())
    }
}

/// `podman pull --platform` of `<image>@<index digest>`; checks the architecture and the
/// platform manifest's digest, returns the image id and what was checked.
fn pull(store: &Store, p: &Published, platform: &str, digest: &str) -> Result<(String, String)> {
    let reference = format!("{}@{}", p.target.image(), p.index_digest);
    let out = output(
        store
            .podman()
            .args([
                "pull",
                "--quiet",
                "--tls-verify=false",
                "--platform",
                platform,
            ])
            .arg(&reference),
    )?;
    let id = out.lines().last().unwrap_or_default().trim().to_owned();
    ensure!(!id.is_empty(), "`podman pull` printed no image id");
    let json = output(store.podman().args(["image", "inspect", &id]))?;
    let v: Value = serde_json::from_str(&json).context("podman image inspect's JSON")?;
    let arch = format!(
        "{}/{}",
        v[0]["Os"].as_str().unwrap_or("?"),
        v[0]["Architecture"].as_str().unwrap_or("?")
    );
    ensure!(
        arch == platform,
        "pulled {reference} for {platform}: it is {arch}"
    );
    // An image pulled through an index records both digests: the index's and its own
    // manifest's, which must be the one release.json names for this platform.
    let own = format!("{}@{digest}", p.target.image());
    let repo_digests = &v[0]["RepoDigests"];
    ensure!(
        repo_digests
            .as_array()
            .is_some_and(|a| a.iter().any(|d| d == own.as_str())),
        "pulled {platform}: RepoDigests {repo_digests} lack {own} (release.json's)"
    );
    let short = id.get(..12).unwrap_or(&id);
    Ok((
        id.clone(),
        format!("image {short}: {arch}, manifest {digest}"),
    ))
}

/// Runs the image's pgio-daemon `--version`: the amd64 one with podman; the arm64 one with
/// podman when binfmt_misc knows qemu-aarch64, else its mounted filesystem under
/// qemu-aarch64-static; neither there: said, not failed.
fn run_version(store: &Store, platform: &str, id: &str, version: &str) -> Result<String> {
    let arm64 = platform == "linux/arm64";
    let (how, out) = if !arm64 || Path::new(BINFMT_AARCH64).exists() {
        let mut run = store.podman();
        run.args(["run", "--rm", "--network", "none"])
            .args(podman::MACHINE_RUN_FLAGS)
            .args([id, "--version"]);
        let how = if arm64 {
            "podman run (binfmt qemu-aarch64)"
        } else {
            "podman run"
        };
        (how, output(&mut run)?)
    } else if let Some(qemu) = which("qemu-aarch64-static") {
        (
            "qemu-aarch64-static on the mounted image",
            under_qemu(store, id, &qemu)?,
        )
    } else {
        return Ok(
            "not run: no binfmt qemu-aarch64 and no qemu-aarch64-static \
                   (apt-get install qemu-user-static)"
                .to_owned(),
        );
    };
    let want = format!("pgio-daemon {version}");
    ensure!(
        out.trim() == want,
        "{how}: printed {:?}, expected {want:?}",
        out.trim()
    );
    Ok(format!("{how}: {}", out.trim()))
}

/// `qemu-aarch64-static -L <rootfs> <rootfs>/pgio-daemon --version` on the image's files: the
/// image's own loader and glibc, no binfmt registration on the host needed.
fn under_qemu(store: &Store, id: &str, qemu: &Path) -> Result<String> {
    let mounted = output(store.podman().args(["image", "mount", id]))?;
    let rootfs = PathBuf::from(mounted.trim());
    let ran = output(
        Command::new(qemu)
            .arg("-L")
            .arg(&rootfs)
            .arg(rootfs.join("pgio-daemon"))
            .arg("--version"),
    );
    let _ = output(store.podman().args(["image", "unmount", id]));
    ran
}
