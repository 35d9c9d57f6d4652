//! The real daemon as a child process, for integration tests: built by cargo
//! (`CARGO_BIN_EXE_pgio-daemon`, with its eBPF object), listening on a free loopback port,
//! stopped with SIGTERM in Drop (and killed if it does not exit).
#![allow(dead_code)]

use std::{
    io::Write as _,
    net::TcpListener,
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::Duration,
};

use anyhow::{Context as _, Result, bail};
use pgio_testkit::{
    DiskStats, Metrics, TempDir, diskstats, metrics::http_get, scrape, temp_dir, wait_until,
};

pub struct Daemon {
    child: Child,
    pub url: String,
    _dir: TempDir,
    pub log: PathBuf,
}

/// A user rule for the config: (app, role, comm regex).
pub type Rule<'a> = (&'a str, &'a str, &'a str);

impl Daemon {
    pub fn start(rules: &[Rule]) -> Result<Daemon> {
        let dir = temp_dir()?;
        let mut config = String::new();
        for (app, role, comm) in rules {
            config.push_str(&format!(
                "[[rule]]\napp = \"{app}\"\nrole = \"{role}\"\ncomm = \"{comm}\"\n"
            ));
        }
        let config_path = dir.path().join("pgio.toml");
        std::fs::write(&config_path, config)?;
        let port = free_port()?;
        let log = dir.path().join("pgio.log");
        let log_file = std::fs::File::create(&log)?;
        let child = Command::new(env!("CARGO_BIN_EXE_pgio-daemon"))
            .args(["run", "--listen", &format!("127.0.0.1:{port}"), "--config"])
            .arg(&config_path)
            .stdout(Stdio::null())
            .stderr(log_file)
            .spawn()
            .context("spawning pgio-daemon")?;
        let mut d = Daemon {
            child,
            url: format!("http://127.0.0.1:{port}"),
            _dir: dir,
            log,
        };
        let healthz = format!("{}/healthz", d.url);
        let up = wait_until(Duration::from_secs(60), Duration::from_millis(100), || {
            http_get(&healthz, Duration::from_secs(2)).is_ok()
        });
        if !up {
            let status = d.child.try_wait()?;
            bail!(
                "pgio-daemon did not come up (status {status:?}); log:\n{}",
                d.log_text()
            );
        }
        Ok(d)
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn scrape(&self) -> Metrics {
        scrape(&format!("{}/metrics", self.url)).expect("scrape /metrics")
    }

    /// Waits until the daemon tracks `pid`'s process under `app` (via the lifecycle events).
    pub fn wait_tracked(&self, app: &str, role: &str) {
        let ok = wait_until(Duration::from_secs(10), Duration::from_millis(20), || {
            self.scrape()
                .sum("pgio_tracked_processes", &[("app", app), ("role", role)])
                >= 1.0
        });
        assert!(
            ok,
            "no process tracked as app={app} role={role}; log:\n{}",
            self.log_text()
        );
    }

    /// SIGTERM, then wait: the daemon must detach and exit 0 on its own.
    pub fn stop(mut self) -> Result<()> {
        let pid = self.child.id() as libc::pid_t;
        // SAFETY: signalling our own child.
        unsafe { libc::kill(pid, libc::SIGTERM) };
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
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            // SAFETY: signalling our own child.
            unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
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

fn free_port() -> Result<u16> {
    let l = TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.port())
}

/// Delta of a summed sample between two scrapes.
pub fn delta(before: &Metrics, after: &Metrics, name: &str, labels: &[(&str, &str)]) -> f64 {
    after.sum(name, labels) - before.sum(name, labels)
}

/// A scrape and the device's /proc/diskstats taken with no request completing in between
/// (diskstats read before and after the scrape agree), so both sides count the same window.
pub fn snapshot(daemon: &Daemon, device: &str) -> (Metrics, DiskStats) {
    for _ in 0..100 {
        let d1 = diskstats(device).expect("diskstats");
        let m = daemon.scrape();
        let d2 = diskstats(device).expect("diskstats");
        if d1 == d2 {
            return (m, d2);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("{device} never went quiet for the length of a scrape");
}
