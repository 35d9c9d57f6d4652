//! Pod Security admission, offline: `xtask/psa` (Go, k8s.io/pod-security-admission: the rules
//! the API server's admission plugin runs) evaluates each render's pod template. pgio's pods
//! must be admitted by a namespace enforcing "privileged" and refused by "baseline" and
//! "restricted", for exactly the reasons docs/deploy.md gives: a Helm install into a baseline
//! namespace creates a DaemonSet whose pods are refused, and the docs say why and what to label.

use std::collections::BTreeSet;
use std::fs;
use std::hash::{Hash, Hasher};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{Context, Result, ensure};
use serde_json::Value;

use super::{Paths, Render, make_dir, remove_if_exists};
use crate::util::{describe, fmt_duration, run, step};

/// Why "baseline" refuses pgio's pod (the library's `ForbiddenReason`s), as docs/deploy.md says.
const BASELINE_REASONS: [&str; 4] = [
    "forbidden AppArmor profile",
    "host namespaces",
    "hostPath volumes",
    "non-default capabilities",
];

pub(super) fn check(p: &Paths, renders: &[(&Render, &str)]) -> Result<()> {
    let bin = ensure_built(p)?;
    for (r, version) in renders {
        let minor = version
            .rsplit_once('.')
            .map_or(*version, |(major_minor, _)| major_minor);
        let mut cmd = Command::new(&bin);
        cmd.arg(format!("v{minor}"))
            .stdin(
                fs::File::open(&r.file).with_context(|| format!("opening {}", r.file.display()))?,
            )
            .stderr(Stdio::inherit());
        let out = cmd
            .output()
            .with_context(|| format!("failed to start `{}`", describe(&cmd)))?;
        ensure!(
            out.status.success(),
            "`{} < {}` failed ({})",
            describe(&cmd),
            r.file.display(),
            out.status
        );
        let report: Value = serde_json::from_slice(&out.stdout)
            .with_context(|| format!("psa-check's report on {}", r.file.display()))?;
        let level = |l: &str| &report["levels"][l];
        let reasons: BTreeSet<&str> = level("baseline")["forbidden"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|f| f["reason"].as_str())
            .collect();
        ensure!(
            level("privileged")["allowed"] == true,
            "{}: Pod Security \"privileged\" should admit the pod: {report}",
            r.what
        );
        ensure!(
            level("baseline")["allowed"] == false
                && reasons == BTreeSet::from(BASELINE_REASONS)
                && level("restricted")["allowed"] == false,
            "{}: Pod Security \"baseline\" should refuse the pod for {BASELINE_REASONS:?} (and \
             \"restricted\" refuse it too), as docs/deploy.md says; Kubernetes {minor}: {report}",
            r.what
        );
        step(format!(
            "Pod Security (Kubernetes {minor}), {}: privileged admits; baseline refuses: {}",
            r.what,
            reasons.into_iter().collect::<Vec<_>>().join(", ")
        ));
    }
    Ok(())
}

/// `<tools>/psa-check-<hash of xtask/psa>/psa-check`, built with `go build` unless there.
fn ensure_built(p: &Paths) -> Result<PathBuf> {
    let src = p.root.join("xtask").join("psa");
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    for f in ["go.mod", "go.sum", "main.go"] {
        let path = src.join(f);
        fs::read(&path)
            .with_context(|| format!("reading {}", path.display()))?
            .hash(&mut hasher);
    }
    let dir = p.tools.join(format!("psa-check-{:016x}", hasher.finish()));
    let bin = dir.join("psa-check");
    if bin.is_file() {
        return Ok(bin);
    }
    let started = Instant::now();
    let staging = p.tools.join(".psa-check.partial");
    remove_if_exists(&staging)?;
    make_dir(&staging)?;
    let mut cmd = Command::new(crate::build::go_bin()?);
    cmd.args(["build", "-trimpath", "-o"])
        .arg(staging.join("psa-check"))
        .arg(".")
        .current_dir(&src)
        .env("GOFLAGS", "-mod=readonly")
        .env("GOTOOLCHAIN", "local");
    step(format!(
        "building psa-check (k8s.io/pod-security-admission from the Go module proxy, once per \
         clone): {}",
        describe(&cmd)
    ));
    run(&mut cmd)?;
    remove_if_exists(&dir)?;
    fs::rename(&staging, &dir)
        .with_context(|| format!("renaming {} to {}", staging.display(), dir.display()))?;
    step(format!(
        "psa-check built in {}",
        fmt_duration(started.elapsed())
    ));
    Ok(bin)
}
