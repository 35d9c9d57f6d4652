//! The image's SBOM, SPDX 2.3 JSON, made from what the build used and nothing fetched: the
//! crates of pgio-daemon's normal-dependency closure for the image's target (`cargo metadata
//! --filter-platform`), the crates compiled into its embedded eBPF object (pgio-ebpf's), their
//! Cargo.lock checksums, and the Debian packages that own the shared libraries copied in.
//! `created` is the commit's time, so the same tree gives the same document (and the same
//! image layer).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result};
use serde_json::{Value, json};

use crate::cross::Arch;
use crate::util::output;

/// The roots whose dependency closures end up in the image.
const ROOTS: &[&str] = &["pgio-daemon", "pgio-ebpf"];

/// SPDX 2.3 JSON for the pgio-daemon of `arch` and the `libraries` (files on this host) that
/// go into its image.
pub fn spdx(root: &Path, arch: Arch, version: &str, libraries: &[PathBuf]) -> Result<String> {
    let meta = output(
        Command::new("cargo")
            .current_dir(root)
            .args(["metadata", "--format-version", "1", "--locked"])
            .args(["--filter-platform", arch.triple()]),
    )?;
    let meta: Value = serde_json::from_str(&meta).context("cargo metadata's JSON")?;
    let lock = std::fs::read_to_string(root.join("Cargo.lock")).context("reading Cargo.lock")?;
    let checksums = lock_checksums(&lock);
    let crates = closure(&meta)?;

    let commit = git(root, &["rev-parse", "HEAD"]).unwrap_or_else(|| "unknown".to_owned());
    let created = git(
        root,
        &[
            "log",
            "-1",
            "--format=%cd",
            "--date=format-local:%Y-%m-%dT%H:%M:%SZ",
        ],
    )
    .unwrap_or_else(|| "1970-01-01T00:00:00Z".to_owned());

    let mut packages = Vec::new();
    let mut relationships = vec![json!({
        "spdxElementId": "SPDXRef-DOCUMENT",
        "relationshipType": "DESCRIBES",
        "relatedSpdxElement": spdx_id("crate", "pgio-daemon", version),
    })];
    for pkg in &crates {
        let (name, ver) = (str_of(pkg, "name"), str_of(pkg, "version"));
        let id = spdx_id("crate", name, ver);
        let registry = pkg["source"]
            .as_str()
            .is_some_and(|s| s.starts_with("registry+"));
        let mut p = json!({
            "SPDXID": id,
            "name": name,
            "versionInfo": ver,
            "downloadLocation": if registry {
                format!("https://crates.io/api/v1/crates/{name}/{ver}/download")
            } else {
                "NOASSERTION".to_owned()
            },
            "filesAnalyzed": false,
            "licenseConcluded": "NOASSERTION",
            "licenseDeclared": license(pkg["license"].as_str()),
            "copyrightText": "NOASSERTION",
            "externalRefs": [{
                "referenceCategory": "PACKAGE-MANAGER",
                "referenceType": "purl",
                "referenceLocator": format!("pkg:cargo/{name}@{ver}"),
            }],
        });
        if let Some(sum) = checksums.get(&(name.to_owned(), ver.to_owned())) {
            p["checksums"] = json!([{ "algorithm": "SHA256", "checksumValue": sum }]);
        }
        packages.push(p);
        if name != "pgio-daemon" {
            relationships.push(json!({
                "spdxElementId": spdx_id("crate", "pgio-daemon", version),
                "relationshipType": "CONTAINS",
                "relatedSpdxElement": id,
            }));
        }
    }
    for (name, ver, deb_arch) in debian_packages(libraries) {
        let id = spdx_id("deb", &name, &ver);
        packages.push(json!({
            "SPDXID": id,
            "name": name,
            "versionInfo": ver,
            "downloadLocation": "NOASSERTION",
            "filesAnalyzed": false,
            "licenseConcluded": "NOASSERTION",
            "licenseDeclared": "NOASSERTION",
            "copyrightText": "NOASSERTION",
            "externalRefs": [{
                "referenceCategory": "PACKAGE-MANAGER",
                "referenceType": "purl",
                "referenceLocator": format!("pkg:deb/debian/{name}@{ver}?arch={deb_arch}"),
            }],
        }));
        relationships.push(json!({
            "spdxElementId": "SPDXRef-DOCUMENT",
            "relationshipType": "DESCRIBES",
            "relatedSpdxElement": id,
        }));
    }
    let doc = json!({
        "spdxVersion": "SPDX-2.3",
        "dataLicense": "CC0-1.0",
        "SPDXID": "SPDXRef-DOCUMENT",
        "name": format!("pgio-{version}-linux-{}", arch.name()),
        "documentNamespace": format!(
            "https://pgio.invalid/spdx/pgio-{version}-{}-{commit}",
            arch.name()
        ),
        "creationInfo": {
            "created": created,
            "creators": ["Tool: pgio-xtask-sbom"],
            "comment": "Rust crates: pgio-daemon's and pgio-ebpf's normal dependencies for this \
                        target (cargo metadata, Cargo.lock checksums); Debian packages: owners \
                        of the shared libraries in the image (dpkg -S).",
        },
        "packages": packages,
        "relationships": relationships,
    });
    serde_json::to_string_pretty(&doc).context("serialising the SBOM")
}

fn str_of<'a>(v: &'a Value, key: &str) -> &'a str {
    v[key].as_str().unwrap_or("NOASSERTION")
}

/// `SPDXRef-<kind>-<name>-<version>` with only the characters SPDX ids allow.
fn spdx_id(kind: &str, name: &str, version: &str) -> String {
    let clean: String = format!("{name}-{version}")
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '.' || c == '-' {
                c
            } else {
                '-'
            }
        })
        .collect();
    format!("SPDXRef-{kind}-{clean}")
}

/// Cargo's license field as an SPDX expression (`MIT/Apache-2.0` is the old spelling of OR).
fn license(l: Option<&str>) -> String {
    match l {
        Some(l) if !l.trim().is_empty() => l.replace('/', " OR "),
        _ => "NOASSERTION".to_owned(),
    }
}

/// (name, version) → sha256 from Cargo.lock's `[[package]]` entries.
fn lock_checksums(lock: &str) -> BTreeMap<(String, String), String> {
    let mut out = BTreeMap::new();
    for block in lock.split("[[package]]").skip(1) {
        let field = |k: &str| {
            block.lines().find_map(|l| {
                l.strip_prefix(k)
                    .and_then(|r| r.trim_start().strip_prefix('='))
                    .map(|v| v.trim().trim_matches('"').to_owned())
            })
        };
        if let (Some(n), Some(v), Some(c)) = (field("name"), field("version"), field("checksum")) {
            out.insert((n, v), c);
        }
    }
    out
}

/// The packages reachable from [`ROOTS`] over normal (not dev, not build) dependencies, by id.
fn closure(meta: &Value) -> Result<Vec<Value>> {
    let packages: BTreeMap<&str, &Value> = meta["packages"]
        .as_array()
        .context("cargo metadata: no packages")?
        .iter()
        .filter_map(|p| Some((p["id"].as_str()?, p)))
        .collect();
    let nodes: BTreeMap<&str, &Value> = meta["resolve"]["nodes"]
        .as_array()
        .context("cargo metadata: no resolve graph")?
        .iter()
        .filter_map(|n| Some((n["id"].as_str()?, n)))
        .collect();
    let mut todo: Vec<&str> = packages
        .iter()
        .filter(|(_, p)| ROOTS.contains(&str_of(p, "name")))
        .map(|(id, _)| *id)
        .collect();
    let mut seen = BTreeSet::new();
    while let Some(id) = todo.pop() {
        if !seen.insert(id) {
            continue;
        }
        let Some(node) = nodes.get(id) else { continue };
        for dep in node["deps"].as_array().into_iter().flatten() {
            let normal = dep["dep_kinds"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|k| k["kind"].is_null());
            if normal && let Some(d) = dep["pkg"].as_str() {
                todo.push(d);
            }
        }
    }
    Ok(seen
        .into_iter()
        .filter_map(|id| packages.get(id).map(|p| (*p).clone()))
        .collect())
}

/// (package, version) of the Debian packages owning `files`; files dpkg does not know are left
/// out. `dpkg -S` prints `pkg:arch: path` for a multi-arch package: the name is before the
/// first `:`.
fn debian_packages(files: &[PathBuf]) -> BTreeSet<(String, String, String)> {
    let mut out = BTreeSet::new();
    for f in files {
        // dpkg knows a file by the path its package ships (`/lib/x86_64-linux-gnu/libc.so.6`),
        // which on a merged-/usr host is not the canonical one: the path as given, then that.
        let real = std::fs::canonicalize(f).unwrap_or_else(|_| f.clone());
        let Some(owner) = [f, &real]
            .into_iter()
            .find_map(|p| output(Command::new("dpkg").arg("-S").arg(p)).ok())
        else {
            continue;
        };
        // `libc6-arm64-cross: /usr/aarch64-linux-gnu/lib/libc.so.6`
        let Some(pkg) = owner.lines().next().and_then(|l| l.split(':').next()) else {
            continue;
        };
        let Ok(info) = output(Command::new("dpkg-query").args([
            "-W",
            "-f=${Version} ${Architecture}\n",
            pkg.trim(),
        ])) else {
            continue;
        };
        // The cross packages are `all`; the host's are its architecture.
        if let Some((ver, arch)) = info.lines().next().and_then(|l| l.split_once(' ')) {
            out.insert((pkg.trim().to_owned(), ver.to_owned(), arch.to_owned()));
        }
    }
    out
}

fn git(root: &Path, args: &[&str]) -> Option<String> {
    output(
        Command::new("git")
            .arg("-C")
            .arg(root)
            .args(args)
            .env("TZ", "UTC"),
    )
    .ok()
    .map(|s| s.trim().to_owned())
    .filter(|s| !s.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_and_licenses() {
        assert_eq!(spdx_id("crate", "a_b", "1.0+x"), "SPDXRef-crate-a-b-1.0-x");
        assert_eq!(license(Some("MIT/Apache-2.0")), "MIT OR Apache-2.0");
        assert_eq!(license(None), "NOASSERTION");
    }

    #[test]
    fn lock_checksums_parse() {
        let lock = "version = 4\n\n[[package]]\nname = \"a\"\nversion = \"1.0.0\"\n\
                    source = \"registry+x\"\nchecksum = \"abc\"\n\n[[package]]\nname = \"b\"\n\
                    version = \"0.1.0\"\n";
        let c = lock_checksums(lock);
        assert_eq!(c.len(), 1);
        assert_eq!(c[&("a".to_owned(), "1.0.0".to_owned())], "abc");
    }
}
