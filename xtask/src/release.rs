//! `cargo xtask release --registry <host[:port]/repo>`: a release that can be pulled.
//!
//! 1. The images and their index, exactly as `cargo xtask image` builds them
//!    (linux/amd64 + linux/arm64), the index pushed with every platform to
//!    `docker://<host>/<repo>:<version>` (`podman manifest push --all --format oci`).
//! 2. The Helm chart with `image.repository` and `image.digest` pinned to that index in its
//!    values.yaml defaults, packaged and pushed to `oci://<host>/<repo's parent>/charts`
//!    ([`target`] says why there).
//! 3. `<target>/dist/pgio-<version>/`: the chart, the SBOMs, release.json, SHA256SUMS.
//!
//! Credentials: `podman login <host>` before; helm reads the same file (see [`chart::Helm`]).
//! `--self-test` does all of it against a `distribution` registry on 127.0.0.1 and pulls it
//! back ([`self_test`]).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{Context, Result, bail, ensure};
use pgio_testkit::podman;
use serde_json::Value;

use crate::image;
use crate::util::{describe, fmt_duration, output, run, step, target_dir};

mod chart;
mod checks;
mod dist;
mod registry;
mod self_test;
mod target;

pub use target::Target;

/// What `cargo xtask release` was asked for.
pub struct Options {
    pub target: Target,
    /// `false`: HTTPS without checking certificates, or plain HTTP (podman's meaning).
    pub tls_verify: bool,
    pub skip_setup: bool,
}

/// What a release pushed and wrote.
pub struct Published {
    pub version: String,
    pub target: Target,
    /// The pushed index's digest (`sha256:…`), what the chart pins.
    pub index_digest: String,
    /// (`linux/amd64`, manifest digest) of each platform in the pushed index, sorted.
    pub platforms: Vec<(String, String)>,
    pub chart: chart::Chart,
    /// `<target>/dist/pgio-<version>/`.
    pub dist: PathBuf,
}

impl Published {
    /// `helm install` of the pushed chart by its digest (helm checks it on pull).
    pub fn install_command(&self) -> String {
        format!(
            "helm install pgio {}@{} -n pgio",
            self.chart.reference, self.chart.digest
        )
    }
}

/// The subcommand: a release to `registry`, or with `self_test` the whole of it against a
/// registry of its own on 127.0.0.1.
pub fn command(
    root: &Path,
    registry: Option<&str>,
    tls_verify: bool,
    skip_setup: bool,
    self_test: bool,
) -> Result<()> {
    if self_test {
        return self_test::run(root, skip_setup);
    }
    let Some(registry) = registry else {
        bail!("--registry <host[:port]/repo> is required (or --self-test)");
    };
    let opts = Options {
        target: registry.parse()?,
        tls_verify,
        skip_setup,
    };
    let published = release(root, &opts)?;
    println!("{}", published.install_command());
    Ok(())
}

/// Builds, pushes and writes the release; see the module's documentation.
pub fn release(root: &Path, opts: &Options) -> Result<Published> {
    let started = Instant::now();
    let built = image::build_all(root, opts.skip_setup)?;
    let work = target_dir(root).join("release-work");
    if work.exists() {
        std::fs::remove_dir_all(&work).with_context(|| format!("emptying {}", work.display()))?;
    }
    std::fs::create_dir_all(&work).with_context(|| format!("creating {}", work.display()))?;

    let image = opts.target.image();
    let index_digest = push_index(&built, &image, &work, opts.tls_verify)?;
    let platforms = platform_digests(&built, &image, &index_digest)?;
    let helm = chart::Helm::ensure(root, &work, opts.tls_verify)?;
    let chart = chart::package_and_push(
        &helm,
        root,
        &work,
        &image,
        &index_digest,
        &opts.target.chart_repo(),
    )?;
    ensure!(
        chart.version == built.version,
        "the chart's version {} is not the image's {}: Chart.yaml and Cargo.toml must agree \
         (cargo xtask deploy-check says so too)",
        chart.version,
        built.version
    );
    let published = Published {
        dist: dist::dir(root, &built.version)?,
        version: built.version,
        target: opts.target.clone(),
        index_digest,
        platforms,
        chart,
    };
    let sboms: Vec<PathBuf> = built.sboms.iter().map(|(_, p)| p.clone()).collect();
    dist::write(&published, &sboms)?;
    step(format!(
        "released {image}:{} = {image}@{} ({}); chart {}:{} = {}; in {}",
        published.version,
        published.index_digest,
        published
            .platforms
            .iter()
            .map(|(p, d)| format!("{p} {d}"))
            .collect::<Vec<_>>()
            .join(", "),
        published.chart.reference,
        published.chart.version,
        published.chart.digest,
        fmt_duration(started.elapsed())
    ));
    step(format!("install: {}", published.install_command()));
    Ok(published)
}

/// `podman manifest push --all --format oci` of the local index to `<image>:<version>`;
/// returns the digest the registry stored it under.
fn push_index(built: &image::Built, image: &str, work: &Path, tls_verify: bool) -> Result<String> {
    let digest_file = work.join("index.pushed-digest");
    let mut push = podman::podman();
    push.args(["manifest", "push", "--all", "--format", "oci"])
        .arg(format!("--tls-verify={tls_verify}"))
        .arg("--digestfile")
        .arg(&digest_file)
        .arg(&built.index)
        .arg(format!("docker://{image}:{}", built.version));
    step(describe(&push));
    run(&mut push)?;
    let digest = std::fs::read_to_string(&digest_file)
        .with_context(|| format!("reading {}", digest_file.display()))?
        .trim()
        .to_owned();
    ensure!(
        chart::is_digest(&digest),
        "podman wrote {digest:?} as the pushed digest, expected sha256:<64 hex digits>"
    );
    if digest != built.digest {
        // Both are the same index unless podman re-encoded it on the way: say so, the
        // registry's is the one that counts.
        step(format!(
            "note: the registry's index digest {digest} differs from the OCI layout's {}",
            built.digest
        ));
    }
    Ok(digest)
}

/// The platforms of the pushed index: (`os/arch`, manifest digest), sorted. When the registry
/// stored the index under the OCI layout's digest (podman pushed the same bytes), the layout's
/// blob of that digest is the index; else it is read back from the registry (podman 4.3's
/// `manifest inspect` has no `--tls-verify`: that works for a registry with a valid
/// certificate only).
fn platform_digests(
    built: &image::Built,
    image: &str,
    digest: &str,
) -> Result<Vec<(String, String)>> {
    let json = if digest == built.digest {
        let hex = digest.trim_start_matches("sha256:");
        let blob = built.layout.join("blobs/sha256").join(hex);
        let sum = output(Command::new("sha256sum").arg(&blob))?;
        ensure!(
            sum.starts_with(hex),
            "{} does not hash to its name: {sum}",
            blob.display()
        );
        std::fs::read_to_string(&blob).with_context(|| format!("reading {}", blob.display()))?
    } else {
        output(podman::podman().args(["manifest", "inspect", &format!("{image}@{digest}")]))
            .with_context(|| {
                format!(
                    "reading the pushed index back (its digest {digest} is not the OCI \
                     layout's {})",
                    built.digest
                )
            })?
    };
    let platforms = index_manifests(&json)?;
    let names: Vec<&str> = platforms.iter().map(|(p, _)| p.as_str()).collect();
    ensure!(
        names == ["linux/amd64", "linux/arm64"],
        "{image}@{digest} lists {names:?}, expected linux/amd64 and linux/arm64"
    );
    Ok(platforms)
}

/// (`os/arch`, digest) of each manifest in an image index's JSON, sorted.
fn index_manifests(json: &str) -> Result<Vec<(String, String)>> {
    let v: Value = serde_json::from_str(json).context("the index's JSON")?;
    let mut out = Vec::new();
    for m in v["manifests"]
        .as_array()
        .context("the index has no manifests")?
    {
        let field = |k: &str| m["platform"][k].as_str().unwrap_or("?").to_owned();
        let digest = m["digest"]
            .as_str()
            .filter(|d| chart::is_digest(d))
            .with_context(|| format!("a manifest of the index has no sha256 digest: {m}"))?;
        out.push((
            format!("{}/{}", field("os"), field("architecture")),
            digest.to_owned(),
        ));
    }
    out.sort();
    Ok(out)
}

/// Runs `cmd` and returns its stdout and stderr together (helm prints its `Digest:` lines on
/// either, depending on the command); on failure the error carries both.
fn capture(cmd: &mut Command) -> Result<String> {
    let what = describe(cmd);
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("failed to start `{what}`"))?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if !out.status.success() {
        bail!("`{what}` failed ({}): {}", out.status, text.trim());
    }
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_an_index() {
        let d = |c: char| format!("sha256:{}", c.to_string().repeat(64));
        let json = format!(
            r#"{{"manifests":[{{"digest":"{}","platform":{{"os":"linux","architecture":"arm64"}}}},
                {{"digest":"{}","platform":{{"os":"linux","architecture":"amd64"}}}}]}}"#,
            d('b'),
            d('a')
        );
        let got = index_manifests(&json).unwrap();
        assert_eq!(
            got,
            [
                ("linux/amd64".to_owned(), d('a')),
                ("linux/arm64".to_owned(), d('b'))
            ]
        );
        assert!(index_manifests(r#"{"manifests":[{"platform":{}}]}"#).is_err());
    }
}
