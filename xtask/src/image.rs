//! `cargo xtask image`: the container image `localhost/pgio:<version>` (and `:latest`) from
//! `deploy/image/Containerfile`, `FROM scratch`: nothing is pulled. The context under
//! `target/image-context/` holds the release pgio-daemon and the shared libraries `ldd` lists;
//! `pgio_testkit::podman::build_image` assembles it, the same function the container test uses.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, bail};
use pgio_testkit::podman;

use crate::util::{output, step, target_dir};
use crate::{apt, commands};

pub fn image(root: &Path, skip_setup: bool) -> Result<()> {
    commands::build(root, true, skip_setup)?;
    apt::ensure(podman::PACKAGES)?;
    if !podman::available() {
        bail!(
            "podman and runc are needed to build the image: apt-get install -y {}",
            podman::PACKAGES.join(" ")
        );
    }
    let bin = commands::daemon_binary(root)?;
    let version = daemon_version(&bin)?;
    let tags = [
        format!("localhost/pgio:{version}"),
        "localhost/pgio:latest".to_owned(),
    ];
    let containerfile = root.join("deploy").join("image").join("Containerfile");
    let context = target_dir(root).join("image-context");
    step(format!(
        "podman build -f {} {} (tags {})",
        containerfile.display(),
        context.display(),
        tags.join(", ")
    ));
    let image = podman::build_image(
        &bin,
        &containerfile,
        &context,
        &tags,
        &[("VERSION", version.as_str())],
    )?;
    let libs: Vec<String> = image
        .libraries
        .iter()
        .map(|l| l.display().to_string())
        .collect();
    step(format!(
        "image {} = {}: {} bytes ({:.1} MB); /pgio-daemon plus {}",
        tags.join(" = "),
        image.id.get(..12).unwrap_or(&image.id),
        image.size_bytes,
        image.size_bytes as f64 / 1e6,
        if libs.is_empty() {
            "nothing (static binary)".to_owned()
        } else {
            libs.join(" ")
        }
    ));
    Ok(())
}

/// `pgio-daemon 0.1.0` → `0.1.0`: the version of the binary that goes into the image.
fn daemon_version(bin: &Path) -> Result<String> {
    let out = output(Command::new(bin).arg("--version"))?;
    let version = out
        .split_whitespace()
        .nth(1)
        .with_context(|| format!("unexpected `{} --version` output {out:?}", bin.display()))?;
    Ok(version.to_owned())
}
