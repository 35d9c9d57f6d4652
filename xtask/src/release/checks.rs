//! The self-test's checks of what a user gets from the registry besides the images: the
//! release's files, and the chart pulled back (by version and by digest), rendered and read.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, ensure};
use serde_json::Value;

use crate::util::output;

use super::Published;
use super::capture;
use super::chart::{Helm, daemonset_image, printed_digest};
use super::dist::{MANIFEST, SUMS};

/// SHA256SUMS verifies, and release.json names what was pushed.
pub fn dist(p: &Published) -> Result<String> {
    let sums = output(
        Command::new("sha256sum")
            .args(["-c", SUMS])
            .current_dir(&p.dist),
    )?;
    let text = fs::read_to_string(p.dist.join(MANIFEST)).context("reading release.json")?;
    let v: Value = serde_json::from_str(&text).context("parsing release.json")?;
    ensure!(
        v["image"]["index_digest"] == p.index_digest.as_str()
            && v["chart"]["digest"] == p.chart.digest.as_str()
            && v["image"]["platforms"].as_array().map(Vec::len) == Some(p.platforms.len()),
        "release.json does not name the pushed digests: {text}"
    );
    Ok(format!("{} files verified", sums.lines().count()))
}

/// `helm pull` by version, then by digest; both must be the pushed chart.
pub fn pull_chart(helm: &Helm, p: &Published, dest: &Path) -> Result<String> {
    let by_digest = dest.join("by-digest");
    fs::create_dir_all(&by_digest)?;
    let dest_arg = dest.to_string_lossy().into_owned();
    let out = helm.registry(&[
        "pull",
        &p.chart.reference,
        "--version",
        &p.version,
        "--destination",
        &dest_arg,
    ])?;
    let got = printed_digest(&out).with_context(|| format!("`helm pull` printed {out:?}"))?;
    ensure!(
        got == p.chart.digest,
        "helm pull got {got}, pushed {}",
        p.chart.digest
    );
    let reference = format!("{}@{}", p.chart.reference, p.chart.digest);
    helm.registry(&[
        "pull",
        &reference,
        "--destination",
        &by_digest.to_string_lossy(),
    ])?;
    let by_version = fs::read(pulled_tgz(dest, p)?).context("reading the pulled chart")?;
    let same = fs::read_dir(&by_digest)?
        .filter_map(|e| e.ok())
        .any(|e| fs::read(e.path()).is_ok_and(|b| b == by_version));
    ensure!(
        same,
        "helm pull {reference} wrote no copy of the chart pulled by version into {}",
        by_digest.display()
    );
    Ok(format!(
        "{}:{} = {got}, the same file by {reference}",
        p.chart.reference, p.version
    ))
}

fn tgz_name(p: &Published) -> String {
    format!("pgio-{}.tgz", p.version)
}

fn pulled_tgz(dest: &Path, p: &Published) -> Result<PathBuf> {
    let file = dest.join(tgz_name(p));
    ensure!(file.is_file(), "no pulled chart at {}", file.display());
    Ok(file)
}

/// The pulled chart, rendered with no values given, runs `<image>@<index digest>`.
pub fn rendered_image(helm: &Helm, p: &Published, dest: &Path) -> Result<String> {
    let tgz = pulled_tgz(dest, p)?;
    let rendered = capture(&mut helm.template(&tgz))?;
    let image = daemonset_image(&rendered)?;
    let want = format!("{}@{}", p.target.image(), p.index_digest);
    ensure!(image == want, "rendered image {image}, expected {want}");
    Ok(image)
}

/// `helm show values` of the pulled chart has the repository and the digest as defaults.
pub fn shown_values(helm: &Helm, p: &Published, dest: &Path) -> Result<String> {
    let tgz = pulled_tgz(dest, p)?;
    let text = output(helm.cmd().args(["show", "values"]).arg(&tgz))?;
    let v: Value = serde_yaml_ng::from_str(&text).context("parsing helm show values")?;
    let (repo, digest) = (&v["image"]["repository"], &v["image"]["digest"]);
    ensure!(
        repo == p.target.image().as_str() && digest == p.index_digest.as_str(),
        "helm show values: image.repository {repo}, image.digest {digest}; expected {} and {}",
        p.target.image(),
        p.index_digest
    );
    Ok(format!("repository {repo}, digest {digest}"))
}
