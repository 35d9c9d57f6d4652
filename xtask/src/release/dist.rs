//! The release's files for a release page: `<target>/dist/pgio-<version>/` holds the packaged
//! chart (values pinned to the image), each platform's SPDX SBOM, `release.json` (what was
//! pushed, by digest) and `SHA256SUMS` over all of them (`sha256sum -c SHA256SUMS` checks).

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, ensure};
use serde_json::json;

use crate::util::{output, step, target_dir};

use super::Published;

pub const SUMS: &str = "SHA256SUMS";
pub const MANIFEST: &str = "release.json";

/// `<target>/dist/pgio-<version>/`, emptied first.
pub fn dir(root: &Path, version: &str) -> Result<PathBuf> {
    let dir = target_dir(root)
        .join("dist")
        .join(format!("pgio-{version}"));
    if dir.exists() {
        fs::remove_dir_all(&dir).with_context(|| format!("emptying {}", dir.display()))?;
    }
    fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(dir)
}

/// Copies the chart and the SBOMs into `p.dist`, then writes release.json and SHA256SUMS.
pub fn write(p: &Published, sboms: &[PathBuf]) -> Result<()> {
    let mut names = vec![copy_in(&p.chart.file, &p.dist)?];
    for sbom in sboms {
        names.push(copy_in(sbom, &p.dist)?);
    }
    let manifest = manifest(p, &names)?;
    fs::write(p.dist.join(MANIFEST), manifest + "\n")
        .with_context(|| format!("writing {MANIFEST} in {}", p.dist.display()))?;
    names.push(MANIFEST.to_owned());
    names.sort();
    let sums = output(Command::new("sha256sum").args(&names).current_dir(&p.dist))?;
    ensure!(
        sums.lines().count() == names.len(),
        "sha256sum listed {} files, expected {}",
        sums.lines().count(),
        names.len()
    );
    fs::write(p.dist.join(SUMS), &sums)
        .with_context(|| format!("writing {SUMS} in {}", p.dist.display()))?;
    step(format!(
        "{}: {} and {SUMS}",
        p.dist.display(),
        names.join(", ")
    ));
    Ok(())
}

/// release.json: everything a deployer needs to pin, by digest.
fn manifest(p: &Published, files: &[String]) -> Result<String> {
    let image = p.target.image();
    let platforms: Vec<_> = p
        .platforms
        .iter()
        .map(|(platform, digest)| json!({ "platform": platform, "digest": digest }))
        .collect();
    let v = json!({
        "version": p.version,
        "image": {
            "repository": image,
            "tag": p.version,
            "index_digest": p.index_digest,
            "reference": format!("{image}@{}", p.index_digest),
            "platforms": platforms,
        },
        "chart": {
            "reference": p.chart.reference,
            "version": p.chart.version,
            "digest": p.chart.digest,
            "file": files.first(),
            "install": p.install_command(),
        },
        "files": files,
    });
    serde_json::to_string_pretty(&v).context("serialising release.json")
}

/// Copies `file` into `dir`, returning its name there.
fn copy_in(file: &Path, dir: &Path) -> Result<String> {
    let name = file
        .file_name()
        .and_then(|n| n.to_str())
        .with_context(|| format!("{}: expected a UTF-8 file name", file.display()))?;
    fs::copy(file, dir.join(name))
        .with_context(|| format!("copying {} to {}", file.display(), dir.display()))?;
    Ok(name.to_owned())
}
