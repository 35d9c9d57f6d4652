//! The release build every command that runs pgio's tests or binaries shares: one
//! `cargo test --release --no-run` over the workspace's default members, the package set
//! `cargo xtask test`'s test step builds, so later steps reuse its artifacts as they are. A
//! narrower `-p` unifies other features and rebuilt pgio-common, pgio-daemon and pgio-testkit:
//! 45.6 + 29.4 + 46.9 s in the guest step and 80 s in the bench smoke of one CI run.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;

use anyhow::{Context, Result};

use crate::cross::{self, Arch};
use crate::util::{describe, output, step};

/// What the build made, by target name: integration-test executables, binaries and benches.
pub struct Executables {
    pub tests: BTreeMap<String, PathBuf>,
    pub bins: BTreeMap<String, PathBuf>,
    pub benches: BTreeMap<String, PathBuf>,
}

impl Executables {
    pub fn bin(&self, name: &str) -> Result<PathBuf> {
        self.bins
            .get(name)
            .cloned()
            .with_context(|| format!("cargo built no binary named {name}"))
    }

    pub fn bench(&self, name: &str) -> Result<PathBuf> {
        self.benches
            .get(name)
            .cloned()
            .with_context(|| format!("cargo built no bench named {name}"))
    }

    fn parse(json: &str) -> Result<Executables> {
        let mut out = Executables {
            tests: BTreeMap::new(),
            bins: BTreeMap::new(),
            benches: BTreeMap::new(),
        };
        for line in json.lines().filter(|l| l.starts_with('{')) {
            let v: serde_json::Value =
                serde_json::from_str(line).context("cargo's JSON message")?;
            if v["reason"] != "compiler-artifact" {
                continue;
            }
            let (Some(name), Some(exe)) = (v["target"]["name"].as_str(), v["executable"].as_str())
            else {
                continue;
            };
            let kind = |k: &str| {
                v["target"]["kind"]
                    .as_array()
                    .is_some_and(|ks| ks.iter().any(|x| x == k))
            };
            // An integration test's harness, a binary itself (not its unit-test harness), or
            // a bench (criterion's own main: `harness = false`).
            let map = match (v["profile"]["test"] == true, kind("test"), kind("bin")) {
                _ if kind("bench") => &mut out.benches,
                (true, true, _) => &mut out.tests,
                (false, _, true) => &mut out.bins,
                _ => continue,
            };
            map.insert(name.to_owned(), PathBuf::from(exe));
        }
        Ok(out)
    }
}

/// Builds (or finds up to date) the tests, binaries and, for the host, benches of `arch`; a
/// foreign one builds only pgio-daemon and pgio-testkit, what its guests run. The benches in
/// the release profile here share the test build's libraries: `cargo bench` (its own `bench`
/// profile) compiled pgio-daemon again, 52.5 s of CI's bench smoke.
pub fn build(root: &Path, arch: Arch) -> Result<Executables> {
    let mut cmd = cross::cargo(
        root,
        arch,
        &["test", "--release", "--no-run", "--message-format=json"],
    );
    if arch.is_host() {
        cmd.arg("--all-targets");
    } else {
        cmd.args(["-p", "pgio-daemon", "-p", "pgio-testkit"]);
    }
    step(describe(&cmd));
    let json = output(cmd.stderr(Stdio::inherit()))?;
    Executables::parse(&json)
}
