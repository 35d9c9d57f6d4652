//! `promtool` (to validate pgio's exposition the way Prometheus parses it): from PATH if
//! installed, else extracted from Debian's `prometheus` package into `<pg-dist root>/promtool/`
//! with `apt-get download` + `dpkg-deb -x`, which installs nothing and starts no service.
//! The same tree has the `prometheus` server binary ([`crate::prometheus`]).

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result, ensure};

use crate::cmd;
use crate::pgdist::{dist_root, find_file, lock, make_dir, remove_if_exists};

pub fn promtool() -> Result<PathBuf> {
    if let Ok(out) = Command::new("promtool").arg("--version").output()
        && out.status.success()
    {
        return Ok(PathBuf::from("promtool"));
    }
    Ok(debian_prometheus_tree()?.join("usr/bin/promtool"))
}

/// `promtool check metrics` on an exposition: Ok with its report (stdout) when it accepts it,
/// an error with everything it said when not (parse errors and lint findings alike).
pub fn check_metrics(text: &str) -> Result<String> {
    use std::io::Write;
    use std::process::Stdio;
    let mut child = Command::new(promtool()?)
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting promtool")?;
    child
        .stdin
        .take()
        .context("promtool stdin")?
        .write_all(text.as_bytes())
        .context("writing to promtool")?;
    let out = child.wait_with_output().context("waiting for promtool")?;
    let report = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    ensure!(
        out.status.success(),
        "promtool check metrics failed ({}):\n{report}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(report)
}

/// The unpacked tree of Debian's `prometheus` package (`usr/bin/prometheus`,
/// `usr/bin/promtool`, …) in `<pg-dist root>/promtool/`, downloaded and unpacked on first use
/// (parallel callers, also in other processes, wait on a lock file).
pub(crate) fn debian_prometheus_tree() -> Result<PathBuf> {
    let root = dist_root()?;
    make_dir(&root)?;
    let _lock = lock(&root.join(".promtool.lock"))?;
    let dir = root.join("promtool");
    let bins = ["usr/bin/promtool", "usr/bin/prometheus"];
    if bins.iter().all(|b| dir.join(b).exists()) {
        return Ok(dir);
    }
    eprintln!(
        "pgio-testkit: extracting Debian's prometheus package into {}",
        dir.display()
    );
    let staging = root.join(".promtool.partial");
    remove_if_exists(&staging)?;
    make_dir(&staging)?;
    let download = || {
        cmd::run(
            Command::new("apt-get")
                .args(["download", "-q", "prometheus"])
                .current_dir(&staging),
        )
    };
    if download().is_err() {
        // A fresh machine has no package lists yet.
        cmd::run(Command::new("apt-get").args(["update", "-q"]))?;
        download()?;
    }
    let deb = find_file(&staging, |n| {
        n.starts_with("prometheus_") && n.ends_with(".deb")
    })?;
    let tree = staging.join("tree");
    cmd::run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&tree))?;
    for b in bins {
        ensure!(tree.join(b).exists(), "{} has no {b}", deb.display());
    }
    remove_if_exists(&dir)?;
    std::fs::rename(&tree, &dir)
        .with_context(|| format!("renaming {} to {}", tree.display(), dir.display()))?;
    remove_if_exists(&staging)?;
    Ok(dir)
}
