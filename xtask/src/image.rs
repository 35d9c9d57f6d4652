//! `cargo xtask image`: the container image of pgio for linux/amd64 and linux/arm64 from the
//! one `deploy/image/Containerfile` (`FROM scratch`, COPY only: nothing is pulled and a foreign
//! platform needs no emulation), and an OCI index of the two. Per architecture the context
//! under `target/image/<arch>/context/` holds that release pgio-daemon (arm64 cross-compiled),
//! its shared libraries (`ldd` on the host's; for a foreign one the ELF `NEEDED` entries,
//! resolved in Debian's cross glibc) and an SPDX SBOM, which is also left next to it under
//! `target/image/`. `pgio_testkit::podman` builds each image, the functions the container test
//! uses.
//!
//! Names: `localhost/pgio:<version>-<arch>` per platform, the host's also `:<version>` and
//! `:latest` (what `podman run` here starts), and the index `localhost/pgio:<version>-index`,
//! also written as an OCI layout to `target/image/oci/` (its digest is the one printed).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail, ensure};
use pgio_testkit::podman;

use crate::cross::{self, Arch};
use crate::util::{fmt_duration, output, run, step, target_dir};
use crate::{apt, build};

/// Where the SBOM sits in the image.
const SBOM_IN_IMAGE: &str = "/usr/share/doc/pgio/sbom.spdx.json";

/// What [`build_all`] made: the index and what `cargo xtask release` publishes with it.
pub struct Built {
    /// pgio-daemon's version: the tag of everything built.
    pub version: String,
    /// `localhost/pgio:<version>-index` in podman's storage.
    pub index: String,
    /// The index's digest as pushed to the OCI layout (`sha256:…`).
    pub digest: String,
    /// That OCI layout (`target/image/oci/`): the index and its manifests as blobs.
    pub layout: PathBuf,
    /// The SPDX SBOM of each platform's image (also inside the image).
    pub sboms: Vec<(Arch, PathBuf)>,
}

pub fn image(root: &Path, skip_setup: bool) -> Result<()> {
    let built = build_all(root, skip_setup)?;
    println!("{}", built.digest);
    Ok(())
}

/// Builds both platforms' images and their index (`cargo xtask image` without the printing).
pub fn build_all(root: &Path, skip_setup: bool) -> Result<Built> {
    build::build(root, true, skip_setup)?;
    if !skip_setup {
        apt::ensure(podman::PACKAGES)?;
        apt::ensure(&["file"])?;
    }
    if !podman::available() {
        bail!(
            "podman and runc are needed to build the image: apt-get install -y {}",
            podman::PACKAGES.join(" ")
        );
    }
    let host_bin = build::daemon_binary(root)?;
    let version = daemon_version(&host_bin)?;
    let out = target_dir(root).join("image");
    let containerfile = root.join("deploy").join("image").join("Containerfile");
    let index = format!("localhost/pgio:{version}-index");

    let mut images = Vec::new();
    let mut sboms = Vec::new();
    for arch in Arch::ALL {
        let started = Instant::now();
        cross::ensure(arch, skip_setup)?;
        let bin = if arch.is_host() {
            host_bin.clone()
        } else {
            cross::build_daemon(root, arch)?
        };
        let says = cross::check_file(&bin, arch)?;
        step(format!("{}: {says}", arch.name()));
        let libs = libraries(&bin, arch)?;
        for (from, to) in &libs {
            let lib = cross::check_file(from, arch)
                .with_context(|| format!("library {} for {}", to.display(), arch.name()))?;
            step(format!("{}: {} ← {lib}", arch.name(), to.display()));
        }
        let host_files: Vec<PathBuf> = libs.iter().map(|(f, _)| f.clone()).collect();
        let sbom = crate::sbom::spdx(root, arch, &version, &host_files)?;
        let sbom_path = out.join(format!("pgio-{version}-linux-{}.spdx.json", arch.name()));
        std::fs::create_dir_all(&out)?;
        std::fs::write(&sbom_path, &sbom)
            .with_context(|| format!("writing {}", sbom_path.display()))?;
        let mut files = libs.clone();
        files.push((sbom_path.clone(), PathBuf::from(SBOM_IN_IMAGE)));

        let mut tags = vec![format!("localhost/pgio:{version}-{}", arch.name())];
        if arch.is_host() {
            tags.push(format!("localhost/pgio:{version}"));
            tags.push("localhost/pgio:latest".to_owned());
        }
        let platform = format!("linux/{}", arch.name());
        step(format!(
            "podman build --platform {platform} -f {} (tags {})",
            containerfile.display(),
            tags.join(", ")
        ));
        let image = podman::build_image_with(&podman::ImageInput {
            binary: &bin,
            files: &files,
            platform: Some(&platform),
            containerfile: &containerfile,
            context_dir: &out.join(arch.name()).join("context"),
            tags: &tags,
            build_args: &[("VERSION", version.as_str())],
        })?;
        let seen = output(podman::podman().args([
            "image",
            "inspect",
            "--format",
            "{{.Os}}/{{.Architecture}}",
            &tags[0],
        ]))?;
        ensure!(
            seen.trim() == platform,
            "{} is {} in podman, not {platform}",
            tags[0],
            seen.trim()
        );
        step(format!(
            "image {} = {}: {} bytes ({:.1} MB), {} files besides /pgio-daemon; SBOM {} ({})",
            tags[0],
            image.id.get(..12).unwrap_or(&image.id),
            image.size_bytes,
            image.size_bytes as f64 / 1e6,
            image.libraries.len(),
            sbom_path.display(),
            fmt_duration(started.elapsed())
        ));
        images.push((arch, tags[0].clone(), image));
        sboms.push((arch, sbom_path));
    }

    // The index: recreated from the per-platform images each time.
    let _ = output(podman::podman().args(["manifest", "rm", &index]));
    run(podman::podman().args(["manifest", "create", &index]))?;
    for (arch, tag, _) in &images {
        run(podman::podman()
            .args(["manifest", "add", "--os", "linux", "--arch", arch.name()])
            .arg(&index)
            .arg(format!("containers-storage:{tag}")))?;
    }
    let inspect = output(podman::podman().args(["manifest", "inspect", &index]))?;
    let platforms = index_platforms(&inspect)?;
    ensure!(
        platforms == ["linux/amd64", "linux/arm64"],
        "{index} lists {platforms:?}"
    );
    let layout = out.join("oci");
    if layout.exists() {
        std::fs::remove_dir_all(&layout)?;
    }
    let digest_file = out.join("index.digest");
    run(podman::podman()
        .args([
            "manifest",
            "push",
            "--all",
            "--format",
            "oci",
            "--digestfile",
        ])
        .arg(&digest_file)
        .arg(&index)
        .arg(format!("oci:{}:pgio-{version}", layout.display())))?;
    let digest = std::fs::read_to_string(&digest_file)
        .with_context(|| format!("reading {}", digest_file.display()))?;
    step(format!(
        "index {index}: {} ({}); OCI layout {}",
        platforms.join(" + "),
        digest.trim(),
        layout.display()
    ));
    for (arch, tag, image) in &images {
        step(format!(
            "  linux/{}: {tag} {} bytes",
            arch.name(),
            image.size_bytes
        ));
    }
    Ok(Built {
        version,
        index,
        digest: digest.trim().to_owned(),
        layout,
        sboms,
    })
}

/// `os/arch` of each manifest in `podman manifest inspect`'s JSON, sorted.
fn index_platforms(json: &str) -> Result<Vec<String>> {
    let v: serde_json::Value = serde_json::from_str(json).context("manifest inspect JSON")?;
    let mut out: Vec<String> = v["manifests"]
        .as_array()
        .context("no manifests in the index")?
        .iter()
        .map(|m| {
            format!(
                "{}/{}",
                m["platform"]["os"].as_str().unwrap_or("?"),
                m["platform"]["architecture"].as_str().unwrap_or("?")
            )
        })
        .collect();
    out.sort();
    Ok(out)
}

/// (file on this host, path in the image) of each shared library `bin` loads and its program
/// interpreter: `ldd` for the host's architecture, else [`cross_libraries`].
fn libraries(bin: &Path, arch: Arch) -> Result<Vec<(PathBuf, PathBuf)>> {
    if arch.is_host() {
        return Ok(podman::shared_libraries(bin)?
            .into_iter()
            .map(|l| (l.clone(), l))
            .collect());
    }
    cross_libraries(bin, arch)
}

/// A foreign binary cannot run `ldd`: read its `NEEDED` entries and interpreter with readelf
/// and find them (and theirs) in Debian's cross glibc, `/usr/<multiarch>/lib`. In the image
/// they go where Debian's own packages put them: `/lib/<multiarch>/`, and the interpreter at
/// the path the binary names (`/lib/ld-linux-aarch64.so.1`).
fn cross_libraries(bin: &Path, arch: Arch) -> Result<Vec<(PathBuf, PathBuf)>> {
    let sysroot = PathBuf::from("/usr").join(arch.multiarch()).join("lib");
    let mut out: Vec<(PathBuf, PathBuf)> = Vec::new();
    let (needed, interp) = elf_deps(bin)?;
    if let Some(interp) = interp {
        let name = Path::new(&interp)
            .file_name()
            .context("interpreter path")?
            .to_owned();
        out.push((sysroot.join(&name), PathBuf::from(&interp)));
    }
    let mut todo = needed;
    let mut seen = Vec::new();
    while let Some(name) = todo.pop() {
        if seen.contains(&name) {
            continue;
        }
        seen.push(name.clone());
        let from = sysroot.join(&name);
        ensure!(
            from.is_file(),
            "{name} (needed by {}) is not in {}: apt-get install libc6-dev-{}-cross",
            bin.display(),
            sysroot.display(),
            arch.name()
        );
        let to = PathBuf::from("/lib").join(arch.multiarch()).join(&name);
        // The interpreter is NEEDED by libc too; it is already in at its own path.
        if !out.iter().any(|(f, _)| *f == from) {
            out.push((from.clone(), to));
        }
        todo.extend(elf_deps(&from)?.0);
    }
    Ok(out)
}

/// `NEEDED` names and `PT_INTERP` of an ELF file, from binutils' readelf (any architecture).
fn elf_deps(path: &Path) -> Result<(Vec<String>, Option<String>)> {
    let text = output(Command::new("readelf").args(["-d", "-l", "-W"]).arg(path))
        .with_context(|| format!("readelf {}", path.display()))?;
    let between = |l: &str, open: &str| {
        l.split_once(open)
            .and_then(|(_, r)| r.split_once(']'))
            .map(|(v, _)| v.trim().to_owned())
    };
    let needed = text
        .lines()
        .filter(|l| l.contains("(NEEDED)"))
        .filter_map(|l| between(l, "Shared library: ["))
        .collect();
    let interp = text
        .lines()
        .find_map(|l| between(l, "Requesting program interpreter:"));
    Ok((needed, interp))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn platforms_of_an_index() {
        let json = r#"{"manifests":[{"platform":{"os":"linux","architecture":"arm64"}},
                       {"platform":{"os":"linux","architecture":"amd64"}}]}"#;
        assert_eq!(
            index_platforms(json).unwrap(),
            ["linux/amd64", "linux/arm64"]
        );
        assert!(index_platforms("{}").is_err());
    }
}
