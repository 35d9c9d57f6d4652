//! The real pgio daemon as a child process: listening on a free loopback port, stopped with
//! SIGTERM in Drop (and killed if it does not exit). Used by the integration tests and by
//! `cargo xtask bench`.

use std::io::Write as _;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail};

use crate::metrics::http_get;
use crate::{Metrics, TempDir, scrape, temp_dir, wait_until};

/// How long a daemon may take to answer `/healthz` before a test gives up on it.
const STARTUP_TIMEOUT: Duration = Duration::from_secs(180);

pub struct Daemon {
    child: Child,
    pub url: String,
    log: PathBuf,
    _dir: TempDir,
}

impl Daemon {
    /// Starts `bin run --listen 127.0.0.1:<free port> --config <config_toml>` and waits for
    /// `/healthz` (up to 60 s: loading and attaching the programs takes a second or two).
    pub fn start(bin: &Path, config_toml: &str) -> Result<Daemon> {
        Daemon::start_in_cgroup(bin, config_toml, None)
    }

    /// `start`, the daemon in the cgroup (v1 or v2 directory) `cgroup` from its first
    /// instruction: it moves itself there, then execs the daemon (the same pid).
    pub fn start_in_cgroup(bin: &Path, config_toml: &str, cgroup: Option<&Path>) -> Result<Daemon> {
        Daemon::spawn(bin, config_toml, cgroup, false)
    }

    /// `start` with the benchmark's switch (`--bench-switch`): write `on`/`off` lines to the
    /// returned stdin, read the daemon's answers from its stdout.
    pub fn start_switched(
        bin: &Path,
        config_toml: &str,
    ) -> Result<(Daemon, ChildStdin, ChildStdout)> {
        let mut d = Daemon::spawn(bin, config_toml, None, true)?;
        let stdin = d.child.stdin.take().context("the daemon's stdin")?;
        let stdout = d.child.stdout.take().context("the daemon's stdout")?;
        Ok((d, stdin, stdout))
    }

    fn spawn(
        bin: &Path,
        config_toml: &str,
        cgroup: Option<&Path>,
        switched: bool,
    ) -> Result<Daemon> {
        let dir = temp_dir()?;
        let config_path = dir.path().join("pgio.toml");
        std::fs::write(&config_path, config_toml)?;
        let port = free_port()?;
        let log = dir.path().join("pgio.log");
        let log_file = std::fs::File::create(&log)?;
        let mut cmd = match cgroup {
            Some(cg) => {
                let mut c = Command::new("sh");
                c.arg("-c")
                    .arg("echo $$ > \"$0/cgroup.procs\" && exec \"$@\"")
                    .arg(cg)
                    .arg(bin);
                c
            }
            None => Command::new(bin),
        };
        cmd.args(["run", "--listen", &format!("127.0.0.1:{port}"), "--config"])
            .arg(&config_path);
        if switched {
            cmd.arg("--bench-switch")
                .stdin(Stdio::piped())
                .stdout(Stdio::piped());
        } else {
            cmd.stdout(Stdio::null());
        }
        let child = cmd
            .stderr(log_file)
            .spawn()
            .with_context(|| format!("spawning {}", bin.display()))?;
        let mut d = Daemon {
            child,
            url: format!("http://127.0.0.1:{port}"),
            log,
            _dir: dir,
        };
        let healthz = format!("{}/healthz", d.url);
        // Until it answers, or exits (then no need to wait the time out). Loading the
        // programs is the verifier's work: in the 6.1 guest under TCG on a slow host one
        // program took 19 s and all of them over 60 s.
        let mut exited = false;
        let up = wait_until(STARTUP_TIMEOUT, Duration::from_millis(100), || {
            exited = matches!(d.child.try_wait(), Ok(Some(_)));
            exited || http_get(&healthz, Duration::from_secs(2)).is_ok()
        });
        if !up || exited {
            let status = d.child.try_wait()?;
            bail!(
                "pgio-daemon did not come up (status {status:?}); log:\n{}",
                d.log_text()
            );
        }
        Ok(d)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn scrape(&self) -> Result<Metrics> {
        scrape(&format!("{}/metrics", self.url))
    }

    /// Waits (10 s at most) until some process is tracked under `app` and `role`.
    pub fn wait_tracked(&self, app: &str, role: &str) -> Result<()> {
        self.wait_tracked_as(&[("app", app), ("role", role)])
    }

    /// Waits (10 s at most) until some process is tracked under a series with these labels.
    pub fn wait_tracked_as(&self, labels: &[(&str, &str)]) -> Result<()> {
        let ok = wait_until(Duration::from_secs(10), Duration::from_millis(20), || {
            self.scrape()
                .is_ok_and(|m| m.sum("pgio_tracked_processes", labels) >= 1.0)
        });
        if !ok {
            bail!(
                "no process tracked as {labels:?}; log:\n{}",
                self.log_text()
            );
        }
        Ok(())
    }

    /// SIGTERM, then wait: the daemon must detach and exit 0 on its own.
    pub fn stop(mut self) -> Result<()> {
        self.terminate();
        let exited = wait_until(Duration::from_secs(20), Duration::from_millis(50), || {
            matches!(self.child.try_wait(), Ok(Some(_)))
        });
        if !exited {
            bail!("pgio-daemon did not exit within 20 s of SIGTERM");
        }
        let status = self.child.wait()?;
        if !status.success() {
            bail!(
                "pgio-daemon exited with {status}; log:\n{}",
                self.log_text()
            );
        }
        Ok(())
    }

    fn terminate(&self) {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            self.terminate();
            let exited = wait_until(Duration::from_secs(20), Duration::from_millis(50), || {
                matches!(self.child.try_wait(), Ok(Some(_)))
            });
            if !exited {
                let _ = self.child.kill();
            }
            let _ = self.child.wait();
        }
        if std::thread::panicking() {
            let _ = writeln!(std::io::stderr(), "pgio-daemon log:\n{}", self.log_text());
        }
    }
}

pub fn free_port() -> Result<u16> {
    let l = TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.port())
}

/// One `[[rule]]` of the daemon's config: (app, role, comm regex).
pub fn rules_config(rules: &[(&str, &str, &str)]) -> String {
    let mut config = String::new();
    for (app, role, comm) in rules {
        config.push_str(&format!(
            "[[rule]]\napp = \"{app}\"\nrole = \"{role}\"\ncomm = \"{comm}\"\n"
        ));
    }
    config
}
