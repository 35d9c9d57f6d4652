//! `pgbench -S` in pairs of adjacent slices of `slice`, the first without any program, the
//! second with pgio's or the floor's, within one `pgbench` run (issue 29: the bench must
//! resolve 1 %).
//!
//! Why: on this 2-vCPU VM the speed of each CPU wanders by ±10 % from one second to the next,
//! independently of the other CPU (measured: pinning does not help, a loop on one CPU does not
//! predict the other). Runs of seconds, however interleaved, compare different machine
//! speeds; slices of 100 ms next to each other share most of it. pgbench logs a sample of its
//! transactions with their end times (`-l --sampling-rate`), and each slice's throughput is
//! the sampled transactions that ended in it over its length. Both program sets stay loaded
//! for the whole run (pgio's daemon keeps running beside every slice); only their hooks are
//! attached and detached (`--bench-switch`), and the time a switch takes belongs to no slice.
use std::io::{BufRead as _, BufReader, Read, Write as _};
use std::os::unix::fs::PermissionsExt as _;
use std::process::{ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail, ensure};
use pgio_testkit::{Daemon, PgCluster, temp_dir, wait_until};

use super::{Bins, PgbenchRun, spawn_until};
use crate::util::step;

/// The configurations of the switched run; a pair's first slice is the first.
pub(super) const STATES: [PgbenchRun; 3] =
    [PgbenchRun::Without, PgbenchRun::Floor, PgbenchRun::Default];

/// The share of transactions pgbench logs: ~1,000 per 100 ms slice at 40,000 tps.
const SAMPLING_RATE: f64 = 0.25;

/// One process' switch: `on`/`off` lines to its stdin, the same word back when done.
struct Switch {
    stdin: ChildStdin,
    answers: mpsc::Receiver<String>,
}

impl Switch {
    fn new(stdin: ChildStdin, answers: mpsc::Receiver<String>) -> Switch {
        Switch { stdin, answers }
    }

    fn set(&mut self, on: bool) -> Result<()> {
        let word = if on { "on" } else { "off" };
        writeln!(self.stdin, "{word}").context("writing to the bench switch")?;
        self.stdin.flush()?;
        loop {
            match self.answers.recv_timeout(Duration::from_secs(10)) {
                Ok(l) if l == word => return Ok(()),
                Ok(l) if l.starts_with("error") => bail!("bench switch: {l}"),
                Ok(_) => continue,
                Err(_) => bail!("the bench switch did not answer {word:?} within 10 s"),
            }
        }
    }
}

/// A reader's lines on a channel, from a thread of their own.
fn lines_of(r: impl Read + Send + 'static) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for l in BufReader::new(r).lines().map_while(Result::ok) {
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    rx
}

/// One slice: its configuration and its span (Unix seconds, pgbench's log clock).
struct Slice {
    state: usize,
    from: f64,
    to: f64,
}

/// A slice without programs and the slice right after it with one set attached: (sampled
/// transactions, seconds) of each.
pub(super) struct Pair {
    /// Index in `STATES` of the set attached in the second slice.
    with: usize,
    without: (f64, f64),
    with_rate: (f64, f64),
}

/// What the switched run measured.
pub(super) struct Switched {
    pub secs: u32,
    /// pgbench's clients (`-c`, and as many threads).
    pub clients: u32,
    pub slice: Duration,
    pub pairs: Vec<Pair>,
    /// Median milliseconds attaching a set took, and detaching it.
    pub attach_ms: f64,
    pub detach_ms: f64,
    pub sampled: usize,
}

/// The pause after a detach before the next slice: the kernel frees the links' memory in
/// RCU callbacks that should not fall into a slice.
const SETTLE: Duration = Duration::from_millis(50);

fn now_unix() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Runs `pgbench -S -c N -j N` (`clients`) for about `secs` in pairs of `slice`s: without
/// programs, then with pgio's (three pairs in four) or the floor's.
pub(super) fn run(
    bins: &Bins,
    pg: &PgCluster,
    secs: u32,
    slice: Duration,
    clients: u32,
) -> Result<Switched> {
    let log_dir = temp_dir()?;
    // pgbench runs as the cluster's OS user.
    std::fs::set_permissions(log_dir.path(), std::fs::Permissions::from_mode(0o777))?;
    let (daemon, stdin, stdout) = Daemon::start_switched(&bins.daemon, "")?;
    daemon.wait_tracked("postgres", "postmaster")?;
    let mut pgio = Switch::new(stdin, lines_of(stdout));
    let mut c = Command::new(&bins.daemon);
    c.args(["floor", "--hooks", "pgio", "--bench-switch"])
        .stdin(Stdio::piped());
    let mut floor_process = spawn_until(c, "ready")?;
    let floor_stdin = floor_process
        .child
        .stdin
        .take()
        .context("the floor's stdin")?;
    let (_, keep) = mpsc::channel();
    let answers = std::mem::replace(&mut floor_process.lines, keep);
    let mut floor = Switch::new(floor_stdin, answers);
    floor.set(false)?;

    // pgio stays on until it tracks pgbench's two backends: a process that starts while its
    // hooks are off is found only by the next /proc rescan.
    let lead = 3;
    let total = secs + lead + 2;
    let prefix = log_dir.path().join("pgbench_log");
    let mut slices = Vec::new();
    let mut switch_ms = Vec::new();
    let mut detach_ms = Vec::new();
    let out = std::thread::scope(|scope| -> Result<()> {
        let bench = scope.spawn(|| {
            pg.pgbench_ok(&[
                "-S".to_string(),
                "-n".into(),
                "-c".into(),
                clients.to_string(),
                "-j".into(),
                clients.to_string(),
                "-T".into(),
                total.to_string(),
                "-l".into(),
                format!("--sampling-rate={SAMPLING_RATE}"),
                format!("--log-prefix={}", prefix.display()),
            ])
        });
        let tracked = wait_until(Duration::from_secs(10), Duration::from_millis(50), || {
            daemon.scrape().is_ok_and(|m| {
                m.sum(
                    "pgio_tracked_processes",
                    &[("app", "postgres"), ("role", "client backend")],
                ) >= f64::from(clients)
            })
        });
        ensure!(
            tracked,
            "pgio did not track pgbench's {clients} backends within 10 s"
        );
        let t = Instant::now();
        pgio.set(false)?;
        std::thread::sleep(Duration::from_secs(lead.into()).saturating_sub(t.elapsed()));
        let started = Instant::now();
        let mut cycle = 0usize;
        while started.elapsed() < Duration::from_secs(secs.into()) {
            // Three pairs of four with pgio: its row is the target.
            let with = if cycle % 4 == 3 { 1 } else { 2 };
            std::thread::sleep(SETTLE);
            let from = now_unix();
            std::thread::sleep(slice);
            slices.push(Slice {
                state: 0,
                from,
                to: now_unix(),
            });
            let t = Instant::now();
            set(&mut pgio, &mut floor, STATES[with], true)?;
            switch_ms.push(t.elapsed().as_secs_f64() * 1e3);
            let from = now_unix();
            std::thread::sleep(slice);
            slices.push(Slice {
                state: with,
                from,
                to: now_unix(),
            });
            let t = Instant::now();
            set(&mut pgio, &mut floor, STATES[with], false)?;
            detach_ms.push(t.elapsed().as_secs_f64() * 1e3);
            cycle += 1;
        }
        bench
            .join()
            .map_err(|_| anyhow::anyhow!("the pgbench thread panicked"))??;
        Ok(())
    });
    out?;
    drop(floor);
    floor_process.stop();
    daemon.stop()?;

    let mut ends = read_log(log_dir.path())?;
    ends.sort_by(|a, b| a.total_cmp(b));
    let count = |from: f64, to: f64| {
        (ends.partition_point(|t| *t < to) - ends.partition_point(|t| *t < from)) as f64
    };
    let pairs: Vec<Pair> = slices
        .chunks_exact(2)
        .map(|p| Pair {
            with: p[1].state,
            without: (count(p[0].from, p[0].to), p[0].to - p[0].from),
            with_rate: (count(p[1].from, p[1].to), p[1].to - p[1].from),
        })
        .collect();
    let median_of = |mut v: Vec<f64>| {
        v.sort_by(|a, b| a.total_cmp(b));
        v.get(v.len() / 2).copied().unwrap_or(0.0)
    };
    let switched = Switched {
        secs,
        clients,
        slice,
        sampled: ends.len(),
        attach_ms: median_of(switch_ms),
        detach_ms: median_of(detach_ms),
        pairs,
    };
    step(format!(
        "switched pgbench: {} pairs of {} ms slices, {} sampled transactions, attaching takes \
         {:.1} ms, detaching {:.0} ms",
        switched.pairs.len(),
        slice.as_millis(),
        switched.sampled,
        switched.attach_ms,
        switched.detach_ms
    ));
    let mut table = String::new();
    report(&mut table, &switched);
    println!("{table}");
    Ok(switched)
}

/// Turns `state`'s programs on or off (the configuration without pgio has none).
fn set(pgio: &mut Switch, floor: &mut Switch, state: PgbenchRun, on: bool) -> Result<()> {
    match state {
        PgbenchRun::Floor => floor.set(on),
        PgbenchRun::Default => pgio.set(on),
        _ => Ok(()),
    }
}

/// The end times (Unix seconds) of the transactions pgbench logged: fields 5 and 6 of each
/// line of every `pgbench_log.*` file.
fn read_log(dir: &std::path::Path) -> Result<Vec<f64>> {
    let mut ends = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        for line in text.lines() {
            let f: Vec<&str> = line.split_whitespace().collect();
            let (Some(Ok(s)), Some(Ok(us))) = (
                f.get(4).map(|v| v.parse::<f64>()),
                f.get(5).map(|v| v.parse::<f64>()),
            ) else {
                bail!("{}: not a pgbench log line: {line:?}", path.display());
            };
            ends.push(s + us / 1e6);
        }
    }
    ensure!(!ends.is_empty(), "pgbench logged no transaction");
    Ok(ends)
}

impl Switched {
    /// The throughput with set `with` over the throughput without, over the pairs `pick`.
    fn pooled(&self, pick: &[usize]) -> f64 {
        let (mut ca, mut sa, mut cb, mut sb) = (0.0, 0.0, 0.0, 0.0);
        for &i in pick {
            let p = &self.pairs[i];
            ca += p.with_rate.0;
            sa += p.with_rate.1;
            cb += p.without.0;
            sb += p.without.1;
        }
        (ca / sa) / (cb / sb)
    }

    /// `run`'s throughput over the slices right before it without programs, with its 95 %
    /// interval (percentile bootstrap over pairs, 2,000 resamples, a fixed seed) and the
    /// number of pairs.
    pub fn ratio(&self, run: PgbenchRun) -> (f64, f64, f64, usize) {
        let with = STATES.iter().position(|s| *s == run).unwrap_or(0);
        let own: Vec<usize> = (0..self.pairs.len())
            .filter(|i| self.pairs[*i].with == with)
            .collect();
        let n = own.len();
        let point = self.pooled(&own);
        if n < 2 {
            return (point, point, point, n);
        }
        let (lo, hi) = super::bootstrap_interval(n, 2_000, |pick| {
            self.pooled(&pick.iter().map(|&i| own[i]).collect::<Vec<_>>())
        });
        (point, lo, hi, n)
    }
}

/// Section 2's switched table.
pub(super) fn report(r: &mut String, s: &Switched) {
    use std::fmt::Write as _;
    let _ = writeln!(
        r,
        "\n### Pairs of adjacent {} ms slices within one pgbench run (the 2 % resolution)\n\n\
         One `pgbench -S -c {} -j {}` run of {} s with pgio (default config) and the floor both \
         loaded throughout; their hooks are attached and detached (`--bench-switch`) so that a \
         slice without any program is followed at once by a slice with one set (pgio's in three \
         pairs of four, the floor's in the fourth). Attaching takes {:.1} ms (median), \
         detaching {:.0} ms: the kernel waits for an RCU grace period per tracepoint, one at a \
         time (so a pair is without, then with: never the other way round), then {} ms to \
         settle. Throughput per slice from pgbench's log of {:.0} % of its transactions ({} \
         logged). Each ratio is the throughput over all of a set's slices against the slices \
         right before them, with its 95 % interval (percentile bootstrap over pairs). pgio's \
         daemon runs beside every slice (its programs detached in the others), so its userspace \
         CPU is in both sides.\n\n\
         | | pairs | throughput with / without | 95 % interval | width |\n|---|---:|---:|---:|---:|",
        s.slice.as_millis(),
        s.clients,
        s.clients,
        s.secs,
        s.attach_ms,
        s.detach_ms,
        SETTLE.as_millis(),
        SAMPLING_RATE * 100.0,
        s.sampled
    );
    for run in [PgbenchRun::Floor, PgbenchRun::Default] {
        let (p, lo, hi, n) = s.ratio(run);
        let _ = writeln!(
            r,
            "| {} | {n} | **{p:.3}** | {lo:.3} – {hi:.3} | ±{:.1} % |",
            run.name(),
            (hi - lo) / 2.0 * 100.0
        );
    }
}
