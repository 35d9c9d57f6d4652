//! A real OCI registry on 127.0.0.1 for the self-test: CNCF `distribution` (the registry
//! Docker Hub and GitLab run), built once per clone from the Go module proxy into
//! `<target>/deploy-tools/registry-<version>/`, serving plain HTTP from a directory that goes
//! away with it.

use std::fs;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::deploy::{GoTool, ensure_go_tool};
use crate::util::{step, target_dir};

/// The newest v3 release the Go module proxy serves (checked with `go list -m -versions`).
const REGISTRY: GoTool = GoTool {
    name: "registry",
    package: "github.com/distribution/distribution/v3/cmd/registry",
    version: "v3.1.2",
};

/// A running registry; dropping it kills it (by its pid) and removes its storage.
pub struct LocalRegistry {
    child: Child,
    dir: PathBuf,
    /// `127.0.0.1:<port>`.
    pub addr: String,
}

impl LocalRegistry {
    /// Builds the registry if needed and starts it on a free port, storing into `dir`.
    pub fn start(root: &Path, dir: &Path) -> Result<LocalRegistry> {
        let tools = target_dir(root).join("deploy-tools");
        fs::create_dir_all(&tools).with_context(|| format!("creating {}", tools.display()))?;
        let bin = ensure_go_tool(&tools, &REGISTRY)?;
        fs::create_dir_all(dir.join("storage"))
            .with_context(|| format!("creating {}", dir.display()))?;
        let addr = format!("127.0.0.1:{}", free_port()?);
        let config = dir.join("config.yml");
        fs::write(&config, config_yaml(&dir.join("storage"), &addr))
            .with_context(|| format!("writing {}", config.display()))?;
        let log = fs::File::create(dir.join("registry.log")).context("creating registry.log")?;
        let child = Command::new(&bin)
            .arg("serve")
            .arg(&config)
            // v3 exports OpenTelemetry traces by default; nothing here would receive them.
            .env("OTEL_TRACES_EXPORTER", "none")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let mut registry = LocalRegistry {
            child,
            dir: dir.to_path_buf(),
            addr,
        };
        registry.wait_ready(Duration::from_secs(30))?;
        step(format!(
            "registry {} on {} (pid {}), storage {}",
            REGISTRY.version,
            registry.addr,
            registry.child.id(),
            dir.display()
        ));
        Ok(registry)
    }

    /// Until `GET /v2/` answers 200 (the API's version check), or the process ends.
    fn wait_ready(&mut self, limit: Duration) -> Result<()> {
        let started = Instant::now();
        while started.elapsed() < limit {
            if let Some(status) = self.child.try_wait()? {
                bail!(
                    "the registry exited ({status}) before serving: {}",
                    self.log_tail()
                );
            }
            if api_answers(&self.addr) {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        bail!(
            "the registry did not answer GET /v2/ on {} within {limit:?}: {}",
            self.addr,
            self.log_tail()
        )
    }

    /// The log's last lines, less the `blob unknown` answers to the HEAD requests a push
    /// makes before uploading each blob (expected, not errors of the registry).
    pub fn log_tail(&self) -> String {
        let text = fs::read_to_string(self.dir.join("registry.log")).unwrap_or_default();
        let lines: Vec<&str> = text
            .lines()
            .filter(|l| !l.contains("err.code=\"blob unknown\""))
            .collect();
        lines[lines.len().saturating_sub(15)..].join("\n")
    }
}

impl Drop for LocalRegistry {
    fn drop(&mut self) {
        let pid = self.child.id();
        if let Err(e) = self.child.kill() {
            step(format!("registry (pid {pid}): kill failed: {e}"));
        }
        let _ = self.child.wait();
        if let Err(e) = fs::remove_dir_all(&self.dir) {
            step(format!("removing {}: {e}", self.dir.display()));
        }
        step(format!(
            "registry (pid {pid}) stopped, {} removed",
            self.dir.display()
        ));
    }
}

/// Filesystem storage (deletes allowed so a rerun can overwrite), plain HTTP on `addr`.
fn config_yaml(storage: &Path, addr: &str) -> String {
    format!(
        "version: 0.1\n\
         log:\n  level: warn\n  accesslog:\n    disabled: true\n\
         storage:\n  filesystem:\n    rootdirectory: {}\n  delete:\n    enabled: true\n\
         http:\n  addr: {addr}\n",
        storage.display()
    )
}

/// A port the kernel just handed out on 127.0.0.1 (closed again for the registry to take).
fn free_port() -> Result<u16> {
    let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).context("binding 127.0.0.1:0")?;
    Ok(l.local_addr()?.port())
}

/// True when `GET /v2/` on `addr` answers `200`.
fn api_answers(addr: &str) -> bool {
    let Ok(mut s) = TcpStream::connect(addr) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    if s.write_all(b"GET /v2/ HTTP/1.0\r\nHost: localhost\r\n\r\n")
        .is_err()
    {
        return false;
    }
    let mut head = [0u8; 16];
    let n = s.read(&mut head).unwrap_or(0);
    let status = String::from_utf8_lossy(&head[..n]);
    status.starts_with("HTTP/1.0 200") || status.starts_with("HTTP/1.1 200")
}
