//! `promtool` (to validate pgio's exposition the way Prometheus parses it): from PATH if
//! installed, else extracted from Debian's `prometheus` package into `<pg-dist root>/promtool/`
//! with `apt-get download` + `dpkg-deb -x`, which installs nothing and starts no service.

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
    let root = dist_root()?;
    make_dir(&root)?;
    let _lock = lock(&root.join(".promtool.lock"))?;
    let dir = root.join("promtool");
    let bin = dir.join("usr/bin/promtool");
    if bin.exists() {
        return Ok(bin);
    }
    eprintln!(
        "pgio-testkit: extracting promtool from Debian's prometheus package into {}",
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
    ensure!(
        tree.join("usr/bin/promtool").exists(),
        "{} has no usr/bin/promtool",
        deb.display()
    );
    remove_if_exists(&dir)?;
    std::fs::rename(&tree, &dir)
        .with_context(|| format!("renaming {} to {}", tree.display(), dir.display()))?;
    remove_if_exists(&staging)?;
    Ok(bin)
}
