//! tracefs: aya attaches tracepoints by id read from tracefs, which is not always mounted
//! (it is not on a bare VM; DaemonSets mount the host's).
use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result};

use crate::lockdown::{self, LOCKDOWN, Lockdown};

const CANDIDATES: [&str; 2] = ["/sys/kernel/tracing", "/sys/kernel/debug/tracing"];

pub fn root() -> Option<PathBuf> {
    CANDIDATES
        .iter()
        .map(PathBuf::from)
        .find(|p| p.join("events").is_dir())
}

/// Mounts tracefs at /sys/kernel/tracing unless some tracefs is already there.
pub fn ensure_mounted() -> Result<PathBuf> {
    if let Some(root) = root() {
        return Ok(root);
    }
    if lockdown::mode() == Some(Lockdown::Confidentiality) {
        anyhow::bail!(
            "kernel lockdown=confidentiality refuses tracefs ({LOCKDOWN}; no events/ readable \
             under {} or {}): pgio's tracepoints cannot attach; boot the node with \
             lockdown=integrity or without lockdown",
            CANDIDATES[0],
            CANDIDATES[1]
        );
    }
    // SAFETY: constant NUL-terminated strings, no data argument.
    let rc = unsafe {
        libc::mount(
            c"nodev".as_ptr(),
            c"/sys/kernel/tracing".as_ptr(),
            c"tracefs".as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    if rc != 0 {
        let err = std::io::Error::last_os_error();
        anyhow::bail!(
            "tracefs is not mounted (no events/ under {} or {}) and mounting it at {} failed: \
             {err}; in a container, mount the host's tracefs at {} (a node with tracefs only \
             under debugfs: the Helm value tracefsHostPath=/sys/kernel/debug/tracing, or \
             deploy/kustomize/components/tracefs-debugfs)",
            CANDIDATES[0],
            CANDIDATES[1],
            CANDIDATES[0],
            CANDIDATES[0]
        );
    }
    root().context("tracefs mounted but has no events/ directory")
}

pub fn tracepoint_exists(root: &Path, category: &str, name: &str) -> bool {
    root.join("events")
        .join(category)
        .join(name)
        .join("id")
        .exists()
}
