//! The soak (`cargo xtask soak`, and a short run in CI): a real PostgreSQL 15 under
//! `pgbench -C -S -R 100` connection churn while every hostile input of issue 15 runs at once,
//! as `nobody`, renewed every round:
//! - a made-up cluster whose "postmaster" forks 100 client backends of new databases each
//!   round (label sets churn past `max_series_per_group`);
//! - a process titled as a client backend of the real cluster, reading each round;
//! - a made-up cluster whose `global/pg_filenode.map` is a FIFO and whose `global/1260` is a
//!   symlink to /etc/shadow, with a backend whose names contain spaces (catalogs are read);
//! - a `longhorn` with a 100 KB argv;
//! - 50 HTTP connections that send half a request line, opened anew each round;
//! - a made-up cluster of `held_backends` client backends (4,000 in `cargo xtask soak`, 2,000
//!   in the tests' short run), forked at once and held for the whole run: most of them on the
//!   overflow series.
//!
//! A scraper scrapes `/metrics` every second for the whole run; the report gives its
//! latency's p50, p99 and maximum, and the run fails when p99 is over `scrape_p99`.
//!
//! pgio's anonymous RSS is sampled every second, its fds, series, histogram map keys, tracked
//! processes and dropped events every `sample_every`. After the first third (warm-up) they
//! must be flat: anonymous RSS drift ≤ 1 MiB over the last half (median of its second half
//! against its first), fds,
//! series and map keys within bounds, no lost lifecycle event, no exit missed, no full map;
//! the real cluster's auxiliary processes are each tracked exactly once, and pgbench fails no
//! transaction.
use std::fmt::Write as _;
use std::io::Write as _;
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::sync::{
    Arc,
    atomic::{AtomicBool, Ordering},
};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail, ensure};

use crate::{
    Daemon, Metrics, Monotonic, PgCluster, PgOptions, WatchReport,
    fake::{Fake, chown_nobody, compile},
    pg_bin_dir, temp_dir,
};

pub struct SoakOptions {
    pub duration: Duration,
    pub sample_every: Duration,
    /// The pgio-daemon binary (with its eBPF object).
    pub daemon_bin: PathBuf,
    pub port: u16,
    /// Client backends of the held made-up cluster.
    pub held_backends: usize,
    /// The bar for the scrape latency's 99th percentile.
    pub scrape_p99: Duration,
}

#[derive(Clone, Debug, Default)]
pub struct SoakSample {
    pub secs: u64,
    pub rss_kib: u64,
    /// The anonymous part of RSS (heap, stacks): what pgio's own allocations can grow. VmRSS
    /// also holds the binary's file pages, which the kernel drops and reads back.
    pub anon_kib: u64,
    pub fds: usize,
    pub series: f64,
    /// Series retired so far: with `series`, the ids given out (reused ids counted anew).
    pub retired: f64,
    pub refused: f64,
    pub tracked: f64,
    pub dropped: f64,
    /// Keys in the histogram maps, and the attacker's new keys refused past its share.
    pub map_entries: f64,
    pub over_share: f64,
    pub exits_missed: f64,
    pub scrape_ms: u128,
    pub exposition_bytes: usize,
    /// pgio's heap in use and free (`pgio_heap_bytes`), KiB.
    pub heap_used_kib: u64,
    pub heap_free_kib: u64,
    pub ring_full: f64,
    /// CPU seconds pgio used so far.
    pub cpu_secs: f64,
}

/// Latencies of the once-a-second scrapes.
#[derive(Clone, Debug, Default)]
pub struct ScrapeLatencies(pub Vec<Duration>);

impl ScrapeLatencies {
    /// The `q` quantile (nearest rank), zero without scrapes.
    pub fn quantile(&self, q: f64) -> Duration {
        let mut v = self.0.clone();
        v.sort_unstable();
        if v.is_empty() {
            return Duration::ZERO;
        }
        let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
        v[rank - 1]
    }

    pub fn summary(&self) -> String {
        let over = self.0.iter().filter(|d| d.as_millis() > 100).count();
        format!(
            "scrapes: {} (one a second, and one per sample), p50 {:.1} ms, p90 {:.1} ms, p99 {:.1} ms, max {:.1} ms, {over} over 100 ms",
            self.0.len(),
            ms(self.quantile(0.5)),
            ms(self.quantile(0.9)),
            ms(self.quantile(0.99)),
            ms(self.quantile(1.0)),
        )
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

pub struct SoakReport {
    pub samples: Vec<SoakSample>,
    /// pgio's anonymous RSS (KiB) once a second, what the RSS rule judges.
    pub anon_each_second: Vec<u64>,
    pub scrapes: ScrapeLatencies,
    /// Counter and histogram samples lower than the series' value a scrape before.
    pub monotonic: WatchReport,
    pub pgbench: String,
}

impl SoakReport {
    pub fn table(&self) -> String {
        let mut out = String::from(
            "    s   RSS KiB  anon KiB  heap used  heap free   fds   series  retired  refused  tracked  dropped  ring full  map keys  over share  missed  scrape ms   bytes  CPU s\n",
        );
        for s in &self.samples {
            let _ = writeln!(
                out,
                "{:>5} {:>9} {:>9} {:>10} {:>10} {:>5} {:>8} {:>8} {:>8} {:>8} {:>8} {:>10} {:>9} {:>11} {:>7} {:>10} {:>7} {:>6.1}",
                s.secs,
                s.rss_kib,
                s.anon_kib,
                s.heap_used_kib,
                s.heap_free_kib,
                s.fds,
                s.series,
                s.retired,
                s.refused,
                s.tracked,
                s.dropped,
                s.ring_full,
                s.map_entries,
                s.over_share,
                s.exits_missed,
                s.scrape_ms,
                s.exposition_bytes,
                s.cpu_secs
            );
        }
        out.push_str(&self.scrapes.summary());
        out.push('\n');
        let _ = writeln!(
            out,
            "counters: every counter and histogram sample of {} once-a-second scrapes compared \
             with the scrape before: {} stepped back; series twice in one scrape: {}",
            self.monotonic.scrapes,
            self.monotonic.steps_back.len(),
            self.monotonic.duplicates.len()
        );
        let (first, last) = self.samples.split_at(self.samples.len() / 2);
        let rss = |s: &[SoakSample]| median(s.iter().map(|s| s.rss_kib).collect());
        let _ = writeln!(
            out,
            "RSS median: {} KiB in the first half, {} KiB in the last",
            rss(first),
            rss(last),
        );
        let anon = &self.anon_each_second;
        let _ = writeln!(
            out,
            "anonymous RSS, {} samples a second apart: {}..{} KiB; floor after each trim: {:?}",
            anon.len(),
            anon.iter().min().unwrap_or(&0),
            anon.iter().max().unwrap_or(&0),
            trim_floors(anon),
        );
        out
    }
}

const AUXILIARY: [&str; 4] = [
    "checkpointer",
    "background writer",
    "walwriter",
    "autovacuum launcher",
];

/// A `<field> <n> kB` line of `/proc/<pid>/status` in KiB (0 when unreadable).
pub fn status_kib(pid: u32, field: &str) -> u64 {
    kib_field(&format!("/proc/{pid}/status"), field)
}

/// A `<field> <n> kB` line of `/proc/meminfo` in KiB (0 when unreadable).
pub fn meminfo_kib(field: &str) -> u64 {
    kib_field("/proc/meminfo", field)
}

fn kib_field(path: &str, field: &str) -> u64 {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix(field))
                .and_then(|v| v.split_whitespace().next()?.parse().ok())
        })
        .unwrap_or(0)
}

/// CPU seconds (user + system) `pid` has used.
fn cpu_secs(pid: u32) -> f64 {
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            let rest = &s[s.rfind(')')? + 1..];
            let f: Vec<&str> = rest.split_whitespace().collect();
            Some((f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?) / hz)
        })
        .unwrap_or(0.0)
}

/// Scrapes `url` once a second until `stop`, timing each, and compares every counter and
/// histogram sample with the series' last value (`Monotonic`).
/// Scrapes once a second; reads pgio's anonymous RSS before each scrape, so the RSS samples
/// fall at every phase of pgio's 10-s trim and of its once-a-second pass.
fn scrape_every_second(
    url: String,
    pid: u32,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<(ScrapeLatencies, WatchReport, Vec<u64>)> {
    std::thread::spawn(move || {
        let mut took = ScrapeLatencies::default();
        let mut monotonic = Monotonic::default();
        let mut anon_kib = Vec::new();
        while !stop.load(Ordering::Relaxed) {
            anon_kib.push(status_kib(pid, "RssAnon:"));
            let t0 = Instant::now();
            match crate::metrics::http_get(&url, Duration::from_secs(10)) {
                Ok(body) => {
                    took.0.push(t0.elapsed());
                    if let Ok(m) = Metrics::parse(&body) {
                        monotonic.observe(&m);
                    }
                }
                Err(_) => took.0.push(Duration::from_secs(10)),
            }
            std::thread::sleep(Duration::from_secs(1).saturating_sub(t0.elapsed()));
        }
        (took, monotonic.report, anon_kib)
    })
}

fn fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count())
}

/// A made-up data directory owned by nobody.
fn fake_data_dir(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir.join("global"))?;
    std::fs::write(dir.join("PG_VERSION"), "15\n")?;
    for p in [
        dir.to_path_buf(),
        dir.join("global"),
        dir.join("PG_VERSION"),
    ] {
        chown_nobody(&p)?;
    }
    Ok(())
}

pub fn run(opts: &SoakOptions) -> Result<SoakReport> {
    let bin_dir = pg_bin_dir(15).context("PostgreSQL 15")?;
    let dir = temp_dir()?;
    std::fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )?;
    let mut pg = PgCluster::init_with(
        PgOptions::new(&bin_dir, dir.path().join("data"), opts.port)
            .setting("max_connections", "50"),
    )?;
    pg.start()?;
    pg.pgbench_ok(&["-i", "-s", "2", "-q", "postgres"])?;
    let cluster = std::fs::canonicalize(pg.data_dir())?;
    let cluster = cluster.to_str().context("UTF-8 path")?.to_owned();

    let fakes = dir.path().join("fakes");
    std::fs::create_dir_all(&fakes)?;
    chown_nobody(&fakes)?;
    let file = fakes.join("file");
    std::fs::write(&file, vec![7u8; 8192])?;
    chown_nobody(&file)?;
    let file = file.to_str().context("path")?.to_owned();
    let postgres = compile(&fakes, "postgres")?;
    let longhorn = compile(&fakes, "longhorn")?;
    let flood_dir = fakes.join("flood");
    let fifo_dir = fakes.join("fifo");
    let link_dir = fakes.join("links");
    let held_dir = fakes.join("held");
    for d in [&flood_dir, &fifo_dir, &link_dir, &held_dir] {
        fake_data_dir(d)?;
    }
    let fifo = fifo_dir.join("global/pg_filenode.map");
    let status = std::process::Command::new("mkfifo").arg(&fifo).status()?;
    ensure!(status.success(), "mkfifo");
    chown_nobody(&fifo)?;
    for name in ["pg_filenode.map", "1260"] {
        std::os::unix::fs::symlink("/etc/shadow", link_dir.join("global").join(name))?;
    }

    let daemon = Daemon::start(
        &opts.daemon_bin,
        "rescan_interval_secs = 2\nseries_retention_secs = 20\nmax_series_per_group = 64\n",
    )?;
    daemon.wait_tracked("postgres", "checkpointer")?;
    let pid = daemon.pid();
    let url = daemon.url.clone();
    let addr = url
        .strip_prefix("http://")
        .context("daemon url")?
        .to_owned();

    // The legitimate load, for the whole run.
    let secs = opts.duration.as_secs().max(10).to_string();
    let mut bench = pg.as_os_user("pgbench");
    bench
        .args(pg.conn_args())
        .args(["-C", "-S", "-R", "100", "-c", "4", "-j", "2", "-T", &secs])
        .arg("postgres")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let bench = bench.spawn().context("pgbench")?;

    let started = Instant::now();
    let mut samples = Vec::new();
    let mut round = 0u32;
    let mut last_flood: Option<Fake> = None;
    let huge = "v".repeat(100_000);
    let mut replica = Fake::start(
        &longhorn,
        "longhorn",
        &["--volume-name", &huge, "replica", "/x"],
        &fakes,
        &[("FAKE_FILE", &file), ("FAKE_READS", "10")],
    )?;
    replica.go_and_wait(1)?;
    // Names with spaces: pgio reads these made-up clusters' catalogs.
    let catalog_reader = |dir: &Path| -> Result<Fake> {
        let mut f = Fake::start(
            &postgres,
            "postgres",
            &["-D", "data", &" ".repeat(100)],
            dir,
            &[
                ("FAKE_CHILDREN", "1"),
                ("FAKE_TITLE", "postgres: u one db one [local] idle"),
            ],
        )?;
        f.wait_done(1)?;
        Ok(f)
    };
    let mut fifo_backend = catalog_reader(&fifo_dir)?;
    let mut link_backend = catalog_reader(&link_dir)?;
    let held_n = opts.held_backends.to_string();
    let mut held = Fake::start(
        &postgres,
        "postgres",
        &["-D", "held"],
        &held_dir,
        &[
            ("FAKE_FILE", &file),
            ("FAKE_READS", "1"),
            ("FAKE_CHILDREN", &held_n),
            ("FAKE_TITLE", "postgres: eve held%d [local] idle"),
        ],
    )?;
    held.wait_done(opts.held_backends)?;
    let stop = Arc::new(AtomicBool::new(false));
    let scraper = scrape_every_second(format!("{url}/metrics"), pid, stop.clone());
    let impostor_title = format!("postgres: {cluster}: postgres postgres [local] idle");
    let mut failures = Vec::new();
    let mut slow: Vec<TcpStream> = Vec::new();
    while started.elapsed() < opts.duration {
        round += 1;
        // Renew the churning inputs.
        let title = format!("postgres: mallory r{round}db%d [local] idle");
        let mut flood = Fake::start(
            &postgres,
            "postgres",
            &["-D", "flood", &" ".repeat(200)],
            &flood_dir,
            &[
                ("FAKE_FILE", &file),
                ("FAKE_READS", "5"),
                ("FAKE_CHILDREN", "100"),
                ("FAKE_TITLE", &title),
            ],
        )?;
        flood.wait_done(100)?;
        if let Some(mut old) = last_flood.replace(flood) {
            old.end();
        }
        let mut impostor = Fake::start(
            &postgres,
            &impostor_title,
            &[],
            &fakes,
            &[("FAKE_FILE", &file), ("FAKE_READS", "1000")],
        )?;
        impostor.go_and_wait(1)?;
        impostor.end();
        slow.clear();
        for _ in 0..50 {
            if let Ok(mut s) = TcpStream::connect(&addr) {
                let _ = s.write_all(b"GET /metr");
                slow.push(s);
            }
        }

        std::thread::sleep(opts.sample_every.saturating_sub(Duration::from_millis(500)));
        let t0 = Instant::now();
        let text = crate::metrics::http_get(&format!("{url}/metrics"), Duration::from_secs(10))
            .context("scraping /metrics during the soak")?;
        let scrape_ms = t0.elapsed().as_millis();
        let m = Metrics::parse(&text)?;
        for role in AUXILIARY {
            let n = m.sum(
                "pgio_tracked_processes",
                &[
                    ("app", "postgres"),
                    ("role", role),
                    ("pg_cluster", &cluster),
                ],
            );
            if n != 1.0 {
                failures.push(format!(
                    "at {} s the real cluster's {role} is tracked {n} times",
                    started.elapsed().as_secs()
                ));
            }
        }
        let dropped: f64 = m
            .matching("pgio_events_dropped_total", &[])
            // Limits on what one process or uid may cost, not lost events of others.
            .filter(|s| {
                !matches!(
                    s.labels.get("reason").map(String::as_str),
                    Some("title_over_budget" | "early_fork_over_budget" | "hist_over_share")
                )
            })
            .map(|s| s.value)
            .sum();
        samples.push(SoakSample {
            secs: started.elapsed().as_secs(),
            rss_kib: status_kib(pid, "VmRSS:"),
            anon_kib: status_kib(pid, "RssAnon:"),
            fds: fds(pid),
            series: m.sum("pgio_series", &[]),
            retired: m.sum("pgio_series_retired_total", &[]),
            refused: m.sum("pgio_series_refused_total", &[]),
            tracked: m.sum("pgio_tracked_processes", &[]),
            dropped,
            map_entries: m.sum("pgio_hist_map_entries", &[]),
            over_share: m.sum(
                "pgio_events_dropped_total",
                &[("reason", "hist_over_share")],
            ),
            exits_missed: m.sum("pgio_exits_missed_total", &[]),
            scrape_ms,
            exposition_bytes: text.len(),
            heap_used_kib: m.sum("pgio_heap_bytes", &[("state", "in_use")]) as u64 / 1024,
            heap_free_kib: m.sum("pgio_heap_bytes", &[("state", "free")]) as u64 / 1024,
            ring_full: m.sum(
                "pgio_events_dropped_total",
                &[("reason", "lifecycle_ring_full")],
            ),
            cpu_secs: cpu_secs(pid),
        });
    }
    stop.store(true, Ordering::Relaxed);
    let (mut scrapes, monotonic, anon_each_second) = scraper
        .join()
        .map_err(|_| anyhow::anyhow!("the scraper thread panicked"))?;
    // The samples' own scrapes too: each comes right after a round's bursts.
    scrapes.0.extend(
        samples
            .iter()
            .map(|s| Duration::from_millis(s.scrape_ms as u64)),
    );
    drop(slow);
    held.end();
    if let Some(mut f) = last_flood.take() {
        f.end();
    }
    replica.end();
    fifo_backend.end();
    link_backend.end();
    let out = bench.wait_with_output().context("pgbench")?;
    let pgbench = String::from_utf8_lossy(&out.stdout).into_owned();
    let report = SoakReport {
        samples,
        anon_each_second,
        scrapes,
        monotonic,
        pgbench,
    };
    daemon.stop()?;
    pg.stop()?;
    if !out.status.success() {
        failures.push(format!(
            "pgbench failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    if let Some(line) = report
        .pgbench
        .lines()
        .find(|l| l.starts_with("number of failed transactions"))
        && !line.contains(": 0 ")
    {
        failures.push(format!("pgbench: {line}"));
    }
    failures.extend(judge(&report.samples));
    failures.extend(judge_anon(&report.anon_each_second));
    if !report.monotonic.clean() {
        failures.push(format!(
            "{} counter samples stepped back, {} series twice in a scrape, in {} scrapes:\n{}",
            report.monotonic.steps_back.len(),
            report.monotonic.duplicates.len(),
            report.monotonic.scrapes,
            report.monotonic.describe(20)
        ));
    }
    let p99 = report.scrapes.quantile(0.99);
    if p99 > opts.scrape_p99 {
        failures.push(format!(
            "scrape p99 {:.1} ms, over the bar of {:.0} ms ({})",
            ms(p99),
            ms(opts.scrape_p99),
            report.scrapes.summary()
        ));
    }
    if failures.is_empty() {
        Ok(report)
    } else {
        bail!(
            "soak failed:\n- {}\n{}",
            failures.join("\n- "),
            report.table()
        )
    }
}

fn median(mut v: Vec<u64>) -> u64 {
    v.sort_unstable();
    v.get(v.len() / 2).copied().unwrap_or(0)
}

/// The two halves of the last half.
fn last_half_halves(v: &[u64]) -> (&[u64], &[u64]) {
    let last_half = &v[v.len() / 2..];
    last_half.split_at(last_half.len() / 2)
}

/// Samples in one of pgio's trim periods (10 s, see `pgio_daemon::heap`).
const TRIM_WINDOW: usize = 10;

/// The least anonymous RSS of each trim window: what pgio holds once malloc's free pages are
/// back with the kernel. Between two trims RSS also holds what the scrapes and passes freed
/// since (5 to 12 MiB a second, measured; how much depends on the round's exposition size);
/// that comes back every 10 s, a leak raises every window's floor.
fn trim_floors(anon_kib: &[u64]) -> Vec<u64> {
    anon_kib
        .chunks(TRIM_WINDOW)
        .filter(|w| w.len() == TRIM_WINDOW)
        .map(|w| w.iter().copied().min().unwrap_or(0))
        .collect()
}

/// Anonymous RSS, sampled once a second: the median of the windows' floors in the last half's
/// second half may be at most 1 MiB over that of its first half.
pub fn judge_anon(anon_kib: &[u64]) -> Vec<String> {
    let floors = trim_floors(anon_kib);
    if floors.len() < 6 {
        return vec![format!(
            "only {} RSS samples: run for longer",
            anon_kib.len()
        )];
    }
    let (early, late) = last_half_halves(&floors);
    let (early, late) = (median(early.to_vec()), median(late.to_vec()));
    if late > early + 1024 {
        return vec![format!(
            "anonymous RSS grew over the last half: its floor after each trim had a median of {early} KiB in its first half, {late} KiB in its second (floors: {floors:?})"
        )];
    }
    Vec::new()
}

/// The flatness rules, on the samples after the first third.
pub fn judge(samples: &[SoakSample]) -> Vec<String> {
    let mut failures = Vec::new();
    if samples.len() < 6 {
        return vec![format!(
            "only {} samples: run longer or sample more often",
            samples.len()
        )];
    }
    let steady = &samples[samples.len() / 3..];
    let last_half = &samples[samples.len() / 2..];
    let fd_range = |s: &[SoakSample]| {
        let max = s.iter().map(|s| s.fds).max().unwrap_or(0);
        let min = s.iter().map(|s| s.fds).min().unwrap_or(0);
        (min, max)
    };
    let (min, max) = fd_range(steady);
    if max > min + 8 {
        failures.push(format!("fds ranged {min}..{max} after warm-up"));
    }
    let most = |s: &[SoakSample]| s.iter().map(|s| s.series).fold(0.0, f64::max);
    let (early, late) = (most(&samples[..samples.len() / 2]), most(last_half));
    if late > early * 1.1 + 5.0 {
        failures.push(format!(
            "series kept growing: at most {early} in the first half, {late} in the last"
        ));
    }
    // The churn's keys (connections not classified yet, each round's new databases) come and
    // go between drains: a sample sees 40 to 280 of them. A leak raises the floor they fall
    // back to, so each half of the steady part is judged by its least sample.
    let floor = |s: &[SoakSample]| {
        s.iter()
            .map(|s| s.map_entries)
            .fold(f64::INFINITY, f64::min)
    };
    let (early, late) = steady.split_at(steady.len() / 2);
    let (early, late) = (floor(early), floor(late));
    if late > early * 1.1 + 64.0 {
        failures.push(format!(
            "histogram map keys kept growing: at least {early} in the first half after warm-up, {late} in the second"
        ));
    }
    let base = &steady[0];
    for s in steady {
        if s.dropped > base.dropped {
            failures.push(format!(
                "at {} s, {} events dropped (was {})",
                s.secs, s.dropped, base.dropped
            ));
            break;
        }
    }
    if let Some(s) = samples.iter().find(|s| s.exits_missed > 0.0) {
        failures.push(format!("at {} s, {} exits missed", s.secs, s.exits_missed));
    }
    failures
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 18 samples 10 s apart whose map keys are `base(t)` plus churn: the first 16 are a
    /// caac4ef soak's samples (37 to 279) less its least, the last two like them.
    fn samples(base: impl Fn(u64) -> f64) -> Vec<SoakSample> {
        let churn = [
            0.0, 52.0, 9.0, 70.0, 242.0, 183.0, 217.0, 85.0, 176.0, 52.0, 119.0, 83.0, 88.0, 108.0,
            120.0, 61.0, 203.0, 19.0,
        ];
        churn
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let secs = 10 * i as u64 + 10;
                SoakSample {
                    secs,
                    series: 83.0,
                    map_entries: base(secs) + c,
                    ..SoakSample::default()
                }
            })
            .collect()
    }

    /// 180 samples a second apart like those of a soak of 25fe713: 4.5 MiB after each trim, then a
    /// plateau between 7.5 and 12.5 MiB that changes with each round, plus `leak` KiB a
    /// second.
    fn anon(leak: f64) -> Vec<u64> {
        (0..180u64)
            .map(|s| {
                let plateau = [7_500, 12_500, 9_000, 11_000][(s / 10 % 4) as usize];
                let v = if s % 10 == 0 { 4_500 } else { plateau };
                v + (leak * s as f64) as u64
            })
            .collect()
    }

    #[test]
    fn a_trim_sawtooth_is_not_a_leak_but_30_kib_a_second_is() {
        assert_eq!(judge_anon(&anon(0.0)), Vec::<String>::new());
        // 40 to 50 s between the two medians: 30 KiB/s is 1.2 to 1.5 MiB.
        let failures = judge_anon(&anon(30.0));
        assert!(
            failures.iter().any(|f| f.contains("anonymous RSS grew")),
            "{failures:?}"
        );
    }

    #[test]
    fn churning_keys_are_not_a_leak() {
        assert_eq!(judge(&samples(|_| 37.0)), Vec::<String>::new());
    }

    #[test]
    fn a_leak_of_two_keys_a_second_fails() {
        let failures = judge(&samples(|secs| 37.0 + 2.0 * secs as f64));
        assert!(
            failures.iter().any(|f| f.contains("map keys kept growing")),
            "{failures:?}"
        );
    }
}
