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
        Daemon::with_config(&rules_config(rules))
    }

    /// The daemon with this TOML config.
    pub fn with_config(toml: &str) -> anyhow::Result<Daemon> {
        let bin = Path::new(env!("CARGO_BIN_EXE_pgio-daemon"));
        pgio_testkit::Daemon::start(bin, toml).map(Daemon)
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

    pub fn wait_tracked_as(&self, labels: &[(&str, &str)]) {
        self.0.wait_tracked_as(labels).expect("tracked");
    }

    /// Waits (20 s at most) until pgio has found where a postmaster's backends keep their
    /// query id and wait event (`pgio_query_id_postmasters{state="found"}`).
    pub fn wait_postmaster_found(&self) -> bool {
        pgio_testkit::wait_until(Duration::from_secs(20), Duration::from_millis(100), || {
            self.scrape()
                .sum("pgio_query_id_postmasters", &[("state", "found")])
                >= 1.0
        })
    }

    pub fn stop(self) -> anyhow::Result<()> {
        self.0.stop()
    }
}

/// Delta of a summed sample between two scrapes.
pub fn delta(before: &Metrics, after: &Metrics, name: &str, labels: &[(&str, &str)]) -> f64 {
    after.sum(name, labels) - before.sum(name, labels)
}

/// Nonzero deltas of a counter between two scrapes, grouped by the values of `by` (joined
/// with `/`): where a window's events went, for failure messages.
pub fn delta_by(
    before: &Metrics,
    after: &Metrics,
    name: &str,
    labels: &[(&str, &str)],
    by: &[&str],
) -> std::collections::BTreeMap<String, f64> {
    let mut out = std::collections::BTreeMap::new();
    for (m, sign) in [(after, 1.0), (before, -1.0)] {
        for s in m.matching(name, labels) {
            let key: Vec<&str> = by
                .iter()
                .map(|k| s.labels.get(*k).map_or("", String::as_str))
                .collect();
            *out.entry(key.join("/")).or_default() += sign * s.value;
        }
    }
    out.retain(|_, v: &mut f64| *v != 0.0);
    out
}

/// pgio's own loss counters in a window, for failure messages: unmatched block completions,
/// dropped events by reason, BPF recursion misses by program.
pub fn losses(before: &Metrics, after: &Metrics) -> String {
    format!(
        "lost completions {}, unmatched completions {}, dropped {:?}, recursion misses {:?}",
        delta(before, after, "pgio_block_io_lost_completions_total", &[]),
        delta(
            before,
            after,
            "pgio_block_io_unmatched_completions_total",
            &[]
        ),
        delta_by(before, after, "pgio_events_dropped_total", &[], &["reason"]),
        delta_by(
            before,
            after,
            "pgio_bpf_recursion_misses_total",
            &[],
            &["program"]
        ),
    )
}

/// A scrape and the device's /proc/diskstats taken with no request completing in between
/// (diskstats read before and after the scrape agree), so both sides count the same window.
pub fn snapshot(daemon: &Daemon, device: &str) -> (Metrics, DiskStats) {
    for _ in 0..500 {
        let d1 = diskstats(device).expect("diskstats");
        let m = daemon.scrape();
        let d2 = diskstats(device).expect("diskstats");
        if d1 == d2 && holds_nothing_back(&m) {
            return (m, d2);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("{device} never went quiet, with no process held provisional, for a scrape");
}

/// No process's events are held back (`pgio_provisional_processes`): a scrape that holds some
/// back shows them only later, in a window that did not cause them.
pub fn holds_nothing_back(m: &Metrics) -> bool {
    m.sum("pgio_provisional_processes", &[]) == 0.0
}

/// PostgreSQL 15 on ext4 on a Longhorn stand-in volume (2 replicas and a sync-agent): pgbench
/// tables of scale 10 (4 under emulation) with 16MB of shared_buffers, checkpointed, the
/// server stopped and the filesystem remounted, so the next start reads from a cold cache.
/// Fields drop in declaration order: server, ext4, temp dir, volume.
pub struct PgOnLonghorn {
    pub pg: pgio_testkit::PgCluster,
    pub fs: pgio_testkit::Ext4Mount,
    pub dir: pgio_testkit::TempDir,
    pub vol: pgio_testkit::LonghornVolume,
}

pub fn pg_on_longhorn(
    replica_latency: Option<Duration>,
    port: u16,
    settings: &[(&str, &str)],
) -> PgOnLonghorn {
    use pgio_testkit::{Ext4Mount, LonghornOptions, LonghornVolume, PgCluster, PgOptions};
    let bin = pgio_testkit::pg_bin_dir(15).expect("PostgreSQL 15");
    // Longhorn v1's own frontend (tgtd serves the volume as /dev/sdX) where the kernel has
    // iSCSI, except under emulation: there pgbench -i's writes kept SCSI commands queued until
    // error recovery reset the session (6.12 and 5.10 under TCG); the iscsi test covers that
    // stack with direct reads instead.
    let iscsi = match pgio_testkit::iscsi::unavailable() {
        Some(why) => {
            eprintln!("Longhorn stand-in: loop device frontend ({why})");
            false
        }
        None if pgio_testkit::emulated().is_some() => {
            eprintln!("Longhorn stand-in: loop device frontend (emulated)");
            false
        }
        None => true,
    };
    let vol = LonghornVolume::start(LonghornOptions {
        size_bytes: 640 << 20,
        replicas: 2,
        replica_latency,
        sync_agent: true,
        iscsi,
        ..LonghornOptions::default()
    })
    .expect("Longhorn stand-in");
    eprintln!(
        "Longhorn stand-in: volume device {} (tgtd {:?})",
        vol.device().display(),
        vol.tgtd_pid()
    );
    let dir = pgio_testkit::temp_dir().expect("temp dir");
    let mut fs = Ext4Mount::on_device(vol.device(), &dir.path().join("mnt")).expect("ext4");
    let mut opts = PgOptions::new(&bin, fs.path().join("pgdata"), port)
        .shared_buffers("16MB")
        .setting("autovacuum", "off");
    for (k, v) in settings {
        opts = opts.setting(k, v);
    }
    let mut pg = PgCluster::init_with(opts).expect("initdb");
    pg.start().expect("start");
    // Under emulation (~16× slower) a smaller table: still ~4× shared_buffers, so the run
    // reads from the volume, and its setup stays within the test's time.
    let scale = if pgio_testkit::emulated().is_some() {
        "4"
    } else {
        "10"
    };
    pg.pgbench_ok(&["-i", "-q", "-s", scale, "postgres"])
        .expect("pgbench -i");
    pg.psql("checkpoint").expect("checkpoint");
    pg.stop().expect("stop");
    fs.remount().expect("remount: cold cache");
    PgOnLonghorn { pg, fs, dir, vol }
}

/// pgio with `longhorn_device_dir` pointing at the stand-in's `/dev/longhorn`, `extra` config
/// lines, and the FUSE frontend tracked: it stands in for tgtd, so it is ours, not
/// Longhorn's, and needs a user rule.
pub fn longhorn_daemon(vol: &pgio_testkit::LonghornVolume, extra: &str) -> pgio_testkit::Daemon {
    let config = format!(
        "{extra}longhorn_device_dir = \"{}\"\n{}",
        vol.dev_dir().display(),
        rules_config(&[("longhorn", "frontend", "^longhorn-fuse$")])
    );
    pgio_testkit::Daemon::start(Path::new(env!("CARGO_BIN_EXE_pgio-daemon")), &config)
        .expect("daemon")
}
