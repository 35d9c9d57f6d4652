//! The daemon built by cargo (`CARGO_BIN_EXE_pgio-daemon`, with its eBPF object) for
//! integration tests, and window helpers.
#![allow(dead_code)]

use std::{path::Path, time::Duration};

use pgio_testkit::{DiskStats, Metrics, diskstats, rules_config};

pub struct Daemon(pub pgio_testkit::Daemon);

/// A user rule for the config: (app, role, comm regex).
pub type Rule<'a> = (&'a str, &'a str, &'a str);

impl Daemon {
    pub fn start(rules: &[Rule]) -> anyhow::Result<Daemon> {
        let bin = Path::new(env!("CARGO_BIN_EXE_pgio-daemon"));
        pgio_testkit::Daemon::start(bin, &rules_config(rules)).map(Daemon)
    }

    pub fn url(&self) -> &str {
        &self.0.url
    }

    pub fn scrape(&self) -> Metrics {
        self.0.scrape().expect("scrape /metrics")
    }

    pub fn wait_tracked(&self, app: &str, role: &str) {
        self.0.wait_tracked(app, role).expect("tracked");
    }

    pub fn stop(self) -> anyhow::Result<()> {
        self.0.stop()
    }
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
