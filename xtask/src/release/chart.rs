//! The Helm chart of a release: `deploy/helm/pgio` copied, its `values.yaml` defaults pinned to
//! the pushed image (`image.repository` and `image.digest`, so a plain `helm install` pulls
//! exactly the index that was tested), packaged with `helm package` and pushed with `helm push`.
//! The helm is deploy-check's (`<target>/deploy-tools/helm-<version>/helm`, built once).

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail, ensure};
use serde::Deserialize as _;
use serde_json::Value;

use crate::deploy::{HELM, NEWEST_MINOR, ensure_go_tool, kube_version};
use crate::util::{run, step, target_dir};

use super::capture;

/// The helm of deploy-check, with registry credentials and TLS as the release was asked for.
pub struct Helm {
    bin: PathBuf,
    /// `HELM_CACHE_HOME`: pulled charts land here, not in the user's cache.
    cache: PathBuf,
    /// `HELM_REGISTRY_CONFIG`: podman's auth file when there is one (one `podman login` then
    /// serves both pushes), else helm's own default (`helm registry login`).
    registry_config: Option<PathBuf>,
    tls_verify: bool,
}

impl Helm {
    /// Builds helm once per clone (Go module proxy), like `cargo xtask deploy-check`.
    pub fn ensure(root: &Path, work: &Path, tls_verify: bool) -> Result<Helm> {
        let tools = target_dir(root).join("deploy-tools");
        fs::create_dir_all(&tools).with_context(|| format!("creating {}", tools.display()))?;
        Ok(Helm {
            bin: ensure_go_tool(&tools, &HELM)?,
            cache: work.join("helm-cache"),
            registry_config: podman_auth_file(),
            tls_verify,
        })
    }

    /// `helm template` of a packaged chart for the newest Kubernetes deploy-check validates
    /// (helm's default, 1.20, is older than the chart's `kubeVersion`).
    pub fn template(&self, chart: &Path) -> Command {
        let mut cmd = self.cmd();
        cmd.args(["template", "pgio", "-n", "pgio", "--kube-version"])
            .arg(kube_version(NEWEST_MINOR))
            .arg(chart);
        cmd
    }

    pub fn cmd(&self) -> Command {
        let mut cmd = Command::new(&self.bin);
        cmd.env("HELM_CACHE_HOME", &self.cache);
        if let Some(auth) = &self.registry_config {
            cmd.env("HELM_REGISTRY_CONFIG", auth);
        }
        cmd
    }

    /// Runs a registry command (`push`, `pull`) and returns what it printed. With TLS
    /// verification off it behaves as podman's `--tls-verify=false` does: HTTPS without
    /// checking the certificate, and plain HTTP when the registry answers HTTPS with HTTP
    /// (helm has no such fallback of its own).
    pub fn registry(&self, args: &[&str]) -> Result<String> {
        if self.tls_verify {
            return capture(self.cmd().args(args));
        }
        match capture(self.cmd().args(args).arg("--insecure-skip-tls-verify")) {
            Err(e) if format!("{e:#}").contains("HTTP response to HTTPS client") => {
                step("the registry speaks plain HTTP: again with --plain-http");
                capture(self.cmd().args(args).arg("--plain-http"))
            }
            other => other,
        }
    }
}

/// Where `podman login` keeps credentials, if that file exists: `$REGISTRY_AUTH_FILE`, else
/// podman's default, `$XDG_RUNTIME_DIR/containers/auth.json` or `/run/containers/<uid>/auth.json`.
fn podman_auth_file() -> Option<PathBuf> {
    let set = |name: &str| {
        std::env::var_os(name)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    let file = set("REGISTRY_AUTH_FILE").unwrap_or_else(|| match set("XDG_RUNTIME_DIR") {
        Some(dir) => dir.join("containers/auth.json"),
        // SAFETY: getuid has no preconditions and cannot fail.
        None => PathBuf::from(format!("/run/containers/{}/auth.json", unsafe {
            libc::getuid()
        })),
    });
    file.is_file().then_some(file)
}

/// What [`package_and_push`] published.
pub struct Chart {
    /// `pgio-<version>.tgz`, in the release's work directory.
    pub file: PathBuf,
    /// `oci://<host>/…/charts/pgio`.
    pub reference: String,
    pub version: String,
    /// The chart's OCI manifest digest, as `helm push` printed it.
    pub digest: String,
}

/// Copies the chart, pins its image defaults, packages it (checking the render names the
/// image by digest) and pushes it to `chart_repo` (`oci://…`).
pub fn package_and_push(
    helm: &Helm,
    root: &Path,
    work: &Path,
    image: &str,
    digest: &str,
    chart_repo: &str,
) -> Result<Chart> {
    let copy = work.join("chart").join("pgio");
    copy_dir(&root.join("deploy/helm/pgio"), &copy)?;
    let values = copy.join("values.yaml");
    let text =
        fs::read_to_string(&values).with_context(|| format!("reading {}", values.display()))?;
    fs::write(&values, pin_values(&text, image, digest)?)
        .with_context(|| format!("writing {}", values.display()))?;
    step(format!("chart values pinned: image {image}@{digest}"));

    let packaged = work.join("packaged");
    fs::create_dir_all(&packaged)?;
    run(helm
        .cmd()
        .arg("package")
        .arg(&copy)
        .arg("--destination")
        .arg(&packaged))?;
    let file = only_tgz(&packaged)?;
    let version = chart_version(&file)?;

    let rendered = capture(&mut helm.template(&file))?;
    let want = format!("{image}@{digest}");
    let got = daemonset_image(&rendered)?;
    ensure!(
        got == want,
        "the packaged chart renders image {got}, expected {want}"
    );

    let file_arg = file.to_string_lossy().into_owned();
    let pushed = helm.registry(&["push", &file_arg, chart_repo])?;
    let chart_digest = printed_digest(&pushed)
        .with_context(|| format!("`helm push` printed no `Digest: sha256:…` line: {pushed:?}"))?;
    let reference = format!("{chart_repo}/pgio");
    step(format!(
        "chart {reference}:{version} pushed: {chart_digest}"
    ));
    Ok(Chart {
        file,
        reference,
        version,
        digest: chart_digest,
    })
}

/// values.yaml with `image.repository` and `image.digest` set, the rest (comments included)
/// as it was. The lines are edited in place rather than re-serialised so the packaged file
/// still documents every value; the result is parsed back to prove the edit.
pub fn pin_values(text: &str, repository: &str, digest: &str) -> Result<String> {
    ensure!(
        is_digest(digest),
        "index digest {digest:?}: expected sha256:<64 hex digits>"
    );
    let mut out = Vec::new();
    let mut in_image = false;
    let (mut repo_lines, mut digest_lines) = (0, 0);
    for line in text.lines() {
        if !line.starts_with([' ', '#']) && !line.is_empty() {
            in_image = line.trim_end() == "image:";
        }
        let key = line.trim_start().split(':').next().unwrap_or_default();
        let nested = line.starts_with("  ") && !line.starts_with("   ");
        if in_image && nested && key == "repository" {
            out.push(
                "  # Pinned by `cargo xtask release`: the index pushed with this chart.".to_owned(),
            );
            out.push(format!("  repository: {repository}"));
            repo_lines += 1;
        } else if in_image && nested && key == "digest" {
            out.push(format!("  digest: \"{digest}\""));
            digest_lines += 1;
        } else {
            out.push(line.to_owned());
        }
    }
    ensure!(
        repo_lines == 1 && digest_lines == 1,
        "values.yaml: expected one `repository:` and one `digest:` under `image:`, found \
         {repo_lines} and {digest_lines}"
    );
    let pinned = out.join("\n") + "\n";
    let v: Value = serde_yaml_ng::from_str(&pinned).context("parsing the pinned values.yaml")?;
    ensure!(
        v["image"]["repository"] == repository && v["image"]["digest"] == digest,
        "the pinned values.yaml reads image {} @ {}, expected {repository} @ {digest}",
        v["image"]["repository"],
        v["image"]["digest"]
    );
    Ok(pinned)
}

pub fn is_digest(s: &str) -> bool {
    s.strip_prefix("sha256:")
        .is_some_and(|h| h.len() == 64 && h.chars().all(|c| c.is_ascii_hexdigit()))
}

/// The `Digest: sha256:…` line helm prints after a push or a pull.
pub fn printed_digest(out: &str) -> Option<String> {
    out.lines()
        .filter_map(|l| l.trim().strip_prefix("Digest:"))
        .map(str::trim)
        .find(|d| is_digest(d))
        .map(str::to_owned)
}

/// The image of the DaemonSet's `pgio` container in a `helm template` output.
pub fn daemonset_image(rendered: &str) -> Result<String> {
    for doc in serde_yaml_ng::Deserializer::from_str(rendered) {
        let v = Value::deserialize(doc).context("parsing the helm template output")?;
        if v["kind"] != "DaemonSet" {
            continue;
        }
        let containers = v["spec"]["template"]["spec"]["containers"]
            .as_array()
            .context("the DaemonSet has no containers")?;
        return containers
            .iter()
            .find(|c| c["name"] == "pgio")
            .and_then(|c| c["image"].as_str())
            .map(str::to_owned)
            .context("the DaemonSet has no `pgio` container with an image");
    }
    bail!("the helm template output has no DaemonSet")
}

/// `pgio-0.1.0.tgz` → `0.1.0`.
fn chart_version(tgz: &Path) -> Result<String> {
    tgz.file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.strip_prefix("pgio-"))
        .and_then(|n| n.strip_suffix(".tgz"))
        .map(str::to_owned)
        .with_context(|| format!("{}: expected pgio-<version>.tgz", tgz.display()))
}

/// The one `.tgz` `helm package` wrote into `dir`.
fn only_tgz(dir: &Path) -> Result<PathBuf> {
    let found: Vec<PathBuf> = fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "tgz"))
        .collect();
    match found.as_slice() {
        [one] => Ok(one.clone()),
        _ => bail!(
            "expected one chart .tgz in {}, found {found:?}",
            dir.display()
        ),
    }
}

/// `from` copied to `to` (emptied first), files and directories only.
fn copy_dir(from: &Path, to: &Path) -> Result<()> {
    if to.exists() {
        fs::remove_dir_all(to).with_context(|| format!("emptying {}", to.display()))?;
    }
    fs::create_dir_all(to).with_context(|| format!("creating {}", to.display()))?;
    for entry in fs::read_dir(from).with_context(|| format!("reading {}", from.display()))? {
        let entry = entry?;
        let (src, dst) = (entry.path(), to.join(entry.file_name()));
        if entry.file_type()?.is_dir() {
            copy_dir(&src, &dst)?;
        } else {
            fs::copy(&src, &dst)
                .with_context(|| format!("copying {} to {}", src.display(), dst.display()))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const DIGEST: &str = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    #[test]
    fn pins_the_shipped_values() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let text = fs::read_to_string(root.join("deploy/helm/pgio/values.yaml")).unwrap();
        let pinned = pin_values(&text, "registry.example.com/team/pgio", DIGEST).unwrap();
        let v: Value = serde_yaml_ng::from_str(&pinned).unwrap();
        let before: Value = serde_yaml_ng::from_str(&text).unwrap();
        assert_eq!(v["image"]["repository"], "registry.example.com/team/pgio");
        assert_eq!(v["image"]["digest"], DIGEST);
        // Nothing else changed.
        let (mut a, mut b) = (v.clone(), before.clone());
        a["image"] = Value::Null;
        b["image"] = Value::Null;
        assert_eq!(a, b);
        assert_eq!(v["image"]["tag"], before["image"]["tag"]);
    }

    #[test]
    fn refuses_what_it_cannot_pin() {
        assert!(
            pin_values(
                "image:\n  repository: x\n  digest: \"\"\n",
                "r/p",
                "sha256:12"
            )
            .is_err()
        );
        assert!(pin_values("image:\n  repository: x\n", "r/p", DIGEST).is_err());
        assert!(pin_values("other:\n  repository: x\n  digest: \"\"\n", "r/p", DIGEST).is_err());
    }

    #[test]
    fn reads_helms_digest_line() {
        let out = format!("Pushed: 127.0.0.1:5000/charts/pgio:0.1.0\nDigest: {DIGEST}\n");
        assert_eq!(printed_digest(&out).as_deref(), Some(DIGEST));
        assert_eq!(printed_digest("Pushed: x\n"), None);
    }

    #[test]
    fn finds_the_daemonsets_image() {
        let r = "kind: Service\n---\nkind: DaemonSet\nspec:\n  template:\n    spec:\n      \
                 containers:\n      - name: pgio\n        image: r/p@sha256:1\n";
        assert_eq!(daemonset_image(r).unwrap(), "r/p@sha256:1");
        assert!(daemonset_image("kind: Service\n").is_err());
    }
}
