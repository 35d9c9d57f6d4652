//! `cargo xtask bench`: pgio's cost, side by side with its baselines in one run, interleaved
//! rounds, medians; printed and written to BENCHMARKS.md.
//!
//! 1. per-call cost of cached 8 KiB pread64: nothing attached / empty programs on the same
//!    tracepoints (the floor) / pgio tracking the process / pgio not tracking it / bpftrace;
//! 2. `pgbench -S` TPS with and without pgio (PostgreSQL 15 on a loop device);
//! 3. the daemon's RSS and CPU, idle and scraped every second;
//! 4. criterion benches of the userspace hot spots.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use pgio_testkit::{
    Daemon, Ext4Mount, LoadProcess, LoopDevice, PG15_BIN_DIR, PgCluster, PgOptions, temp_dir,
};

use crate::util::{fmt_duration, run, step, target_dir, which};

mod big_node;
mod block;
mod profile;
mod section;
mod switched;

pub struct BenchOptions {
    /// Interleaved rounds of the per-call measurement.
    pub rounds: usize,
    /// pread64 calls per measurement.
    pub calls: u64,
    /// pgbench pairs (with / without pgio).
    pub pairs: usize,
    /// Seconds per pgbench run.
    pub pgbench_secs: u32,
    /// pgbench's clients in section 2 (`-c N -j N`): as many as the CPUs to load them all.
    pub clients: u32,
    /// Smoke run: tiny counts, no BENCHMARKS.md.
    pub quick: bool,
    /// Only section 1, printed.
    pub per_call_only: bool,
    /// Only the in-kernel run time of the programs; BENCHMARKS.md untouched.
    pub programs_only: bool,
    /// Only the block programs' cost per request, rewritten in place in BENCHMARKS.md.
    pub block_only: bool,
    /// Seconds of each fio run of the block section.
    pub block_secs: u64,
    /// Only section 2 (pgbench -S), printed, and rewritten in BENCHMARKS.md at 2 clients.
    pub pgbench_only: bool,
    /// Only section 2's profile (`profile`), rewritten in place in BENCHMARKS.md.
    pub profile_only: bool,
    /// Rounds of the profile's runs.
    pub profile_rounds: usize,
    /// Seconds of the switched pgbench run (`switched`).
    pub switched_secs: u32,
    /// Its slices.
    pub slice: Duration,
}

impl BenchOptions {
    pub fn quick() -> BenchOptions {
        BenchOptions {
            rounds: 1,
            calls: 20_000,
            pairs: 1,
            pgbench_secs: 2,
            clients: 2,
            quick: true,
            per_call_only: false,
            programs_only: false,
            block_only: false,
            block_secs: 2,
            pgbench_only: false,
            profile_only: false,
            profile_rounds: 1,
            switched_secs: 4,
            slice: Duration::from_millis(100),
        }
    }

    pub fn full(
        per_call_only: bool,
        programs_only: bool,
        block_only: bool,
        pgbench_only: bool,
    ) -> BenchOptions {
        BenchOptions {
            rounds: 15,
            calls: 1_000_000,
            pairs: 8,
            pgbench_secs: 10,
            clients: 2,
            quick: false,
            per_call_only,
            programs_only,
            block_only,
            block_secs: 15,
            pgbench_only,
            profile_only: false,
            profile_rounds: 3,
            switched_secs: 600,
            slice: Duration::from_millis(100),
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Tracer {
    Baseline,
    Floor,
    Pgio,
    PgioUntracked,
    Bpftrace,
}

impl Tracer {
    fn name(self) -> &'static str {
        match self {
            Tracer::Baseline => "baseline (nothing attached)",
            Tracer::Floor => "floor (empty programs)",
            Tracer::Pgio => "pgio, process tracked",
            Tracer::PgioUntracked => "pgio, process untracked",
            Tracer::Bpftrace => "bpftrace",
        }
    }
}

const BPFTRACE_SCRIPT: &str = "tracepoint:syscalls:sys_enter_pread64 { @start[tid] = nsecs; } \
     tracepoint:syscalls:sys_exit_pread64 /@start[tid]/ { @us = hist((nsecs - @start[tid]) / 1000); delete(@start[tid]); }";

/// Whatever is attached while one measurement runs; Drop detaches it.
enum Attached {
    Nothing,
    Daemon(Daemon),
    Child(Tracing),
}

impl Tracing {
    /// SIGINT (bpftrace prints its maps, `pgio-daemon floor` its stats), wait, and return
    /// what it printed.
    fn stop(&mut self) -> Vec<String> {
        let c = &mut self.child;
        if let Ok(None) = c.try_wait() {
            // SAFETY: signalling our own child.
            unsafe { libc::kill(c.id() as libc::pid_t, libc::SIGINT) };
            let deadline = Instant::now() + Duration::from_secs(20);
            while Instant::now() < deadline && matches!(c.try_wait(), Ok(None)) {
                std::thread::sleep(Duration::from_millis(50));
            }
            if let Ok(None) = c.try_wait() {
                let _ = c.kill();
            }
            let _ = c.wait();
        }
        let mut out = Vec::new();
        while let Ok(l) = self.lines.recv_timeout(Duration::from_millis(200)) {
            out.push(l);
        }
        out
    }
}

impl Drop for Attached {
    fn drop(&mut self) {
        if let Attached::Child(t) = self {
            t.stop();
        }
    }
}

/// A tracer process; its stdout lines after the start marker arrive on `lines`.
struct Tracing {
    child: Child,
    lines: mpsc::Receiver<String>,
}

/// Spawns `cmd` and waits for a stdout line containing `marker` (the tracer is attached).
fn spawn_until(mut cmd: Command, marker: &str) -> Result<Tracing> {
    cmd.stderr(Stdio::null());
    spawn_marked(cmd, marker)
}

/// `spawn_until` with the stderr `cmd` was given.
fn spawn_marked(mut cmd: Command, marker: &str) -> Result<Tracing> {
    let mut child = cmd
        .stdout(Stdio::piped())
        .spawn()
        .with_context(|| format!("spawning {cmd:?}"))?;
    let stdout = child.stdout.take().context("stdout")?;
    let mut lines = BufReader::new(stdout).lines();
    loop {
        match lines.next() {
            Some(Ok(l)) if l.contains(marker) => break,
            Some(Ok(_)) => continue,
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                bail!("{cmd:?} exited before printing {marker:?}");
            }
        }
    }
    // Keep draining stdout so the tracer never blocks on a full pipe.
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for l in lines.map_while(Result::ok) {
            let _ = tx.send(l);
        }
    });
    Ok(Tracing { child, lines: rx })
}

struct Bins {
    daemon: PathBuf,
    load: PathBuf,
}

fn attach(t: Tracer, bins: &Bins, config: &str) -> Result<Attached> {
    Ok(match t {
        Tracer::Baseline => Attached::Nothing,
        Tracer::Floor => {
            let mut c = Command::new(&bins.daemon);
            c.arg("floor");
            Attached::Child(spawn_until(c, "ready")?)
        }
        Tracer::Pgio | Tracer::PgioUntracked => {
            Attached::Daemon(Daemon::start(&bins.daemon, config)?)
        }
        Tracer::Bpftrace => {
            let mut c = Command::new("bpftrace");
            c.args(["-e", BPFTRACE_SCRIPT]);
            let child = spawn_until(c, "Attaching")?;
            // "Attaching 2 probes..." is printed before the attach completes.
            std::thread::sleep(Duration::from_millis(500));
            Attached::Child(child)
        }
    })
}

/// The daemon's config for the per-call runs: it tracks `pgio-load` reading `traced.dat`,
/// not the same binary reading `plain.dat`, so one daemon serves both configurations.
const PER_CALL_CONFIG: &str = "[[rule]]\napp = \"bench\"\nrole = \"pread\"\ncomm = \"^pgio-load$\"\ncmdline = \"traced\\\\.dat\"\n\
     [[rule]]\napp = \"bench\"\nrole = \"futex-wake\"\ncomm = \"^pgio-load$\"\ncmdline = \"futex-wake\"\n";

/// CPU ns per pread64 call of one `pgio-load pread` run on `file`.
fn load_run(bins: &Bins, file: &Path, calls: u64, tracked_by: Option<&Daemon>) -> Result<f64> {
    load_run_with(bins, file, calls, tracked_by, false)
}

/// `reopen`: the load opens its file again once told to go, i.e. once tracked, so that pgio's
/// relation family sees the open and counts every read under the file.
fn load_run_with(
    bins: &Bins,
    file: &Path,
    calls: u64,
    tracked_by: Option<&Daemon>,
    reopen: bool,
) -> Result<f64> {
    let file = file.to_str().context("utf-8 path")?;
    // Pinned to one CPU: no migrations in the middle of the loop (env and taskset exec: the
    // same pid).
    let load_bin = bins.load.to_str().context("utf-8 path")?;
    let n = calls.to_string();
    let reopen_env = if reopen {
        "PGIO_LOAD_REOPEN=1"
    } else {
        "PGIO_LOAD_NO_REOPEN=1"
    };
    let mut load = LoadProcess::spawn(
        Path::new("env"),
        [
            reopen_env, "taskset", "-c", "1", load_bin, "pread", file, &n, "0",
        ],
    )?;
    if let Some(d) = tracked_by {
        // The relations row labels the load as PostgreSQL's (the family follows only those).
        d.wait_tracked(if reopen { "postgres" } else { "bench" }, "pread")?;
    }
    load.go()?;
    load.wait_done()?;
    let cpu = load.cpu_ns().context("pgio-load reported no CPU time")?;
    Ok(cpu as f64 / calls as f64)
}

/// One attachment and the measurements taken under it: (tracer, ns/call).
fn per_call_group(
    group: &[Tracer],
    bins: &Bins,
    files: &(PathBuf, PathBuf),
    calls: u64,
    flip: bool,
) -> Result<Vec<(Tracer, f64)>> {
    let attached = attach(group[0], bins, PER_CALL_CONFIG)?;
    let mut out = Vec::new();
    let mut order = group.to_vec();
    if flip {
        order.reverse();
    }
    for t in order {
        let ns = match (t, &attached) {
            (Tracer::Pgio, Attached::Daemon(d)) => load_run(bins, &files.0, calls, Some(d))?,
            _ => load_run(bins, &files.1, calls, None)?,
        };
        out.push((t, ns));
    }
    drop(attached);
    Ok(out)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Per tracer: median ns/call, the rounds, and the median of the per-round differences to
/// the baseline of the same round (rounds drift on a shared VM; pairing cancels the drift).
struct PerCall {
    tracers: Vec<(Tracer, f64, Vec<f64>)>,
}

impl PerCall {
    fn rounds(&self, t: Tracer) -> Option<&[f64]> {
        self.tracers
            .iter()
            .find(|x| x.0 == t)
            .map(|x| x.2.as_slice())
    }
    fn added(&self, t: Tracer) -> Option<f64> {
        let (r, b) = (self.rounds(t)?, self.rounds(Tracer::Baseline)?);
        let mut d: Vec<f64> = r.iter().zip(b).map(|(x, y)| x - y).collect();
        Some(median(&mut d))
    }
}

fn per_call(bins: &Bins, o: &BenchOptions) -> Result<PerCall> {
    let dir = temp_dir()?;
    let files = (dir.path().join("traced.dat"), dir.path().join("plain.dat"));
    for f in [&files.0, &files.1] {
        std::fs::write(f, vec![1u8; 8 << 20])?; // just written: in the page cache
    }
    let mut groups = vec![
        vec![Tracer::Baseline],
        vec![Tracer::Floor],
        vec![Tracer::Pgio, Tracer::PgioUntracked],
    ];
    if which("bpftrace").is_some() {
        groups.push(vec![Tracer::Bpftrace]);
    } else {
        step("bpftrace not installed: its column is left out");
    }
    let all: Vec<Tracer> = groups.iter().flatten().copied().collect();
    let mut samples: Vec<Vec<f64>> = vec![Vec::new(); all.len()];
    for round in 0..o.rounds {
        // Rotate the order each round so no tracer always runs first or last.
        for k in 0..groups.len() {
            let g = &groups[(k + round) % groups.len()];
            for (t, ns) in per_call_group(g, bins, &files, o.calls, round % 2 == 1)? {
                step(format!(
                    "per-call round {}/{}: {:<28} {ns:7.1} ns/call",
                    round + 1,
                    o.rounds,
                    t.name()
                ));
                if let Some(i) = all.iter().position(|x| *x == t) {
                    samples[i].push(ns);
                }
            }
        }
    }
    Ok(PerCall {
        tracers: all
            .into_iter()
            .zip(samples)
            .map(|(t, s)| {
                let m = median(&mut s.clone());
                (t, m, s)
            })
            .collect(),
    })
}

/// `kernel.bpf_stats_enabled` on while alive, restored on drop.
pub(crate) struct BpfStats(String);

const BPF_STATS: &str = "/proc/sys/kernel/bpf_stats_enabled";

impl BpfStats {
    pub(crate) fn enable() -> Result<BpfStats> {
        let prev = std::fs::read_to_string(BPF_STATS).context("reading bpf_stats_enabled")?;
        std::fs::write(BPF_STATS, "1").context("enabling kernel.bpf_stats_enabled")?;
        Ok(BpfStats(prev.trim().to_owned()))
    }
}

impl Drop for BpfStats {
    fn drop(&mut self) {
        let _ = std::fs::write(BPF_STATS, &self.0);
    }
}

/// In-kernel run time of the pread64 programs (ns per run: enter, exit), from
/// kernel.bpf_stats_enabled: the empty floor programs, and pgio's with the process tracked
/// and untracked. This leaves out the cost of reaching a program, common to all three, so it
/// isolates what pgio's code itself adds; and it is far less noisy than CPU time per call.
struct ProgramCost {
    floor: (f64, f64),
    tracked: (f64, f64),
    /// pgio's `sched_switch` program (every context switch on the node): ns per run, and
    /// switches per second during the tracked load.
    sched_switch: (f64, f64),
    /// Tracked, with `syscall_rows = false` (every histogram in the hash map).
    tracked_hash: (f64, f64),
    /// Tracked as PostgreSQL's (`app = "postgres"`, the default `relations = true`) with the
    /// file opened while tracked: every read also counted under its file.
    tracked_relations: (f64, f64),
    untracked: (f64, f64),
    /// `sys_{enter,exit}_futex` for a tracked process' futex wakes (not timed).
    futex_wake: (f64, f64),
    /// Empty programs on the other hooks pgio could time pread64 with (`floor --hooks`):
    /// (enter, exit) ns per run, or why they cannot load here.
    hooks: Vec<(&'static str, HookCost<(f64, f64)>)>,
    /// `part_*` programs: ns per run of each piece of the syscall timing, alone.
    parts: Vec<(String, f64)>,
    /// The running daemon's maps and their kernel memory (markdown).
    maps: String,
}

/// The BPF maps `pid` holds, from `/proc/<pid>/fdinfo` (the kernel's `memlock` estimate of
/// each map's memory), largest first, as a markdown table.
fn map_memory(pid: u32) -> Result<String> {
    let mut maps = Vec::new();
    for e in std::fs::read_dir(format!("/proc/{pid}/fdinfo"))? {
        let Ok(text) = std::fs::read_to_string(e?.path()) else {
            continue;
        };
        let field = |k: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(k)?.trim().parse::<u64>().ok())
        };
        let (Some(t), Some(k), Some(v), Some(n), Some(mem)) = (
            field("map_type:"),
            field("key_size:"),
            field("value_size:"),
            field("max_entries:"),
            field("memlock:"),
        ) else {
            continue;
        };
        maps.push((mem, t, k, v, n));
    }
    maps.sort_by(|a, b| b.cmp(a));
    let cpus = std::fs::read_to_string("/sys/devices/system/cpu/possible").unwrap_or_default();
    let mut r = format!(
        "The loaded daemon's {} maps take {:.1} MiB of kernel memory (possible CPUs: {}); \
         the largest:\n\n| map type | key, value bytes | max entries | memory |\n|---|---:|---:|---:|\n",
        maps.len(),
        maps.iter().map(|m| m.0).sum::<u64>() as f64 / 1048576.0,
        cpus.trim()
    );
    for (mem, t, k, v, n) in maps.iter().take(10) {
        let kind = match t {
            1 => "hash",
            2 => "array",
            5 => "per-CPU hash",
            6 => "per-CPU array",
            9 => "LRU hash",
            27 => "ring buffer",
            _ => "other",
        };
        let _ = writeln!(
            r,
            "| {kind} ({t}) | {k}, {v} | {n} | {:.1} KiB |",
            *mem as f64 / 1024.0
        );
    }
    Ok(r)
}

/// The maps' kernel memory on nodes of 2, 64, 128 and 192 possible CPUs, as `pgio-daemon check
/// --possible-cpus` estimates it (the kernel's formulas; `tests/map_memory.rs` holds them to
/// the kernel's own account here, the `big_node` guest test at 128).
fn map_estimates(daemon: &Path) -> Result<String> {
    let mut r = String::from(
        "\nEstimated for other nodes (`pgio-daemon check --possible-cpus N`, default config):\n\n\
         | possible CPUs | maps' kernel memory |\n|---:|---:|\n",
    );
    for cpus in [2, 64, 128, 192] {
        let out = Command::new(daemon)
            .args(["check", "--possible-cpus", &cpus.to_string()])
            .output()
            .context("pgio-daemon check")?;
        let text = String::from_utf8_lossy(&out.stdout);
        let mib = text
            .lines()
            .find_map(|l| {
                l.split_once("eBPF maps: ")?
                    .1
                    .split_once(" of kernel")?
                    .0
                    .into()
            })
            .with_context(|| format!("no eBPF maps line in pgio-daemon check:\n{text}"))?;
        let _ = writeln!(r, "| {cpus} possible CPUs | {mib} |");
    }
    Ok(r)
}

/// A hook's (enter, exit) run time, or why its programs cannot load on this kernel.
type HookCost<T> = std::result::Result<T, String>;

/// Runs `pgio-daemon floor --hooks <hooks>` over one load run; each program's ns per run.
fn floor_stats(bins: &Bins, hooks: &str, file: &Path, calls: u64) -> Result<Vec<(String, f64)>> {
    let err = temp_dir()?;
    let err_file = err.path().join("stderr");
    let mut c = Command::new(&bins.daemon);
    c.args(["floor", "--hooks", hooks])
        .stderr(std::fs::File::create(&err_file)?);
    let mut floor = match spawn_marked(c, "ready") {
        Ok(f) => f,
        Err(e) => {
            let why = std::fs::read_to_string(&err_file).unwrap_or_default();
            bail!(
                "{}",
                why.trim()
                    .lines()
                    .last()
                    .map_or(e.to_string(), str::to_owned)
            );
        }
    };
    load_run(bins, file, calls, None)?;
    Ok(floor
        .stop()
        .iter()
        .filter_map(|l| {
            let mut f = l.strip_prefix("stats ")?.split(' ');
            let name = f.next()?.to_owned();
            let ns: f64 = f.next()?.parse().ok()?;
            let runs: f64 = f.next()?.parse().ok()?;
            (runs > 0.0).then(|| (name, ns / runs))
        })
        .collect())
}

/// ns per run of pgio's program `p` and its runs, between two scrapes.
pub(crate) fn program_ns(
    before: &pgio_testkit::Metrics,
    after: &pgio_testkit::Metrics,
    p: &str,
) -> (f64, f64) {
    let l = [("program", p)];
    let secs = after.sum("pgio_bpf_program_run_seconds_total", &l)
        - before.sum("pgio_bpf_program_run_seconds_total", &l);
    let runs = after.sum("pgio_bpf_program_runs_total", &l)
        - before.sum("pgio_bpf_program_runs_total", &l);
    (secs * 1e9 / runs.max(1.0), runs)
}

fn pgio_program_ns(before: &pgio_testkit::Metrics, after: &pgio_testkit::Metrics) -> (f64, f64) {
    (
        program_ns(before, after, "sys_enter_pread64").0,
        program_ns(before, after, "sys_exit_pread64").0,
    )
}

fn program_cost(bins: &Bins, o: &BenchOptions) -> Result<ProgramCost> {
    let _stats = BpfStats::enable()?;
    let dir = temp_dir()?;
    let files = (dir.path().join("traced.dat"), dir.path().join("plain.dat"));
    for f in [&files.0, &files.1] {
        std::fs::write(f, vec![1u8; 8 << 20])?;
    }
    let (mut fe, mut fx, mut te, mut tx, mut ue, mut ux) = Default::default();
    let (mut he, mut hx) = (Vec::new(), Vec::new());
    let (mut re, mut rx) = (Vec::new(), Vec::new());
    let (mut se, mut sr) = (Vec::new(), Vec::new());
    let (mut we, mut wx) = (Vec::new(), Vec::new());
    let push = |v: &mut Vec<f64>, x: f64| v.push(x);
    type Runs = Vec<(f64, f64)>;
    let mut hook_runs: Vec<(&'static str, HookCost<Runs>)> = [
        ("fentry/fexit", "fentry"),
        ("tp_btf sys_enter/sys_exit", "tp-btf"),
    ]
    .into_iter()
    .map(|(name, _)| (name, Ok(Vec::new())))
    .collect();
    let mut part_runs: std::collections::BTreeMap<String, Vec<f64>> = Default::default();
    let mut maps = String::new();
    for _ in 0..o.rounds.clamp(1, 5) {
        for ((_, runs), hooks) in hook_runs.iter_mut().zip(["fentry", "tp-btf"]) {
            let Ok(v) = runs else { continue };
            match floor_stats(bins, hooks, &files.1, o.calls) {
                Ok(stats) => {
                    let ns = |dir: &str| {
                        stats
                            .iter()
                            .find(|(n, _)| n.contains(dir))
                            .map_or(f64::NAN, |(_, ns)| *ns)
                    };
                    v.push((ns("enter"), ns("exit")));
                }
                Err(e) => *runs = Err(format!("{e:#}")),
            }
        }
        for (name, ns) in floor_stats(bins, "parts", &files.1, o.calls)? {
            part_runs.entry(name).or_default().push(ns);
        }
        let mut c = Command::new(&bins.daemon);
        c.arg("floor");
        let mut floor = spawn_until(c, "ready")?;
        load_run(bins, &files.1, o.calls, None)?;
        let stats = floor.stop();
        let per_run = |name: &str| {
            stats.iter().find_map(|l| {
                let mut f = l.strip_prefix("stats ")?.split(' ');
                (f.next()? == name).then_some(())?;
                let ns: f64 = f.next()?.parse().ok()?;
                let runs: f64 = f.next()?.parse().ok()?;
                Some(ns / runs.max(1.0))
            })
        };
        push(
            &mut fe,
            per_run("floor_sys_enter_pread64").context("floor enter stats")?,
        );
        push(
            &mut fx,
            per_run("floor_sys_exit_pread64").context("floor exit stats")?,
        );

        let daemon = Daemon::start(&bins.daemon, PER_CALL_CONFIG)?;
        if maps.is_empty() {
            maps = map_memory(daemon.pid())?;
            maps.push_str(&map_estimates(&bins.daemon)?);
        }
        let before = daemon.scrape()?;
        let t = Instant::now();
        load_run(bins, &files.0, o.calls, Some(&daemon))?;
        let load_secs = t.elapsed().as_secs_f64();
        let mid = daemon.scrape()?;
        load_run(bins, &files.1, o.calls, None)?;
        let after = daemon.scrape()?;
        let (e, x) = pgio_program_ns(&before, &mid);
        push(&mut te, e);
        push(&mut tx, x);
        let (ns, runs) = program_ns(&before, &mid, "sched_switch");
        push(&mut se, ns);
        push(&mut sr, runs / load_secs.max(1e-9));
        let (e, x) = pgio_program_ns(&mid, &after);
        push(&mut ue, e);
        push(&mut ux, x);
        // A tracked process' futex calls that do not wait (wakes): not timed.
        let mut wakes = LoadProcess::spawn(
            Path::new("taskset"),
            [
                "-c",
                "1",
                bins.load.to_str().context("utf-8 path")?,
                "futex-wake",
                &o.calls.to_string(),
            ],
        )?;
        daemon.wait_tracked("bench", "futex-wake")?;
        let before_wakes = daemon.scrape()?;
        wakes.go()?;
        wakes.wait_done()?;
        let after_wakes = daemon.scrape()?;
        push(
            &mut we,
            program_ns(&before_wakes, &after_wakes, "sys_enter_futex").0,
        );
        push(
            &mut wx,
            program_ns(&before_wakes, &after_wakes, "sys_exit_futex").0,
        );
        daemon.stop()?;

        let daemon = Daemon::start(
            &bins.daemon,
            &format!("syscall_rows = false\n{PER_CALL_CONFIG}"),
        )?;
        let before = daemon.scrape()?;
        load_run(bins, &files.0, o.calls, Some(&daemon))?;
        let after = daemon.scrape()?;
        daemon.stop()?;
        let (e, x) = pgio_program_ns(&before, &after);
        push(&mut he, e);
        push(&mut hx, x);

        // The relation family books only PostgreSQL's processes: the load is labelled as one.
        let daemon = Daemon::start(
            &bins.daemon,
            &PER_CALL_CONFIG.replacen("app = \"bench\"", "app = \"postgres\"", 1),
        )?;
        let before = daemon.scrape()?;
        load_run_with(bins, &files.0, o.calls, Some(&daemon), true)?;
        let after = daemon.scrape()?;
        let counted = after.sum("pgio_relation_io_seconds_count", &[("syscall", "pread64")])
            - before.sum("pgio_relation_io_seconds_count", &[("syscall", "pread64")]);
        daemon.stop()?;
        ensure!(
            counted >= o.calls as f64,
            "relations = true counted {counted} of the load's {} reads under its file",
            o.calls
        );
        let (e, x) = pgio_program_ns(&before, &after);
        push(&mut re, e);
        push(&mut rx, x);
    }
    Ok(ProgramCost {
        floor: (median(&mut fe), median(&mut fx)),
        tracked: (median(&mut te), median(&mut tx)),
        tracked_hash: (median(&mut he), median(&mut hx)),
        tracked_relations: (median(&mut re), median(&mut rx)),
        sched_switch: (median(&mut se), median(&mut sr)),
        untracked: (median(&mut ue), median(&mut ux)),
        futex_wake: (median(&mut we), median(&mut wx)),
        hooks: hook_runs
            .into_iter()
            .map(|(name, runs)| {
                (
                    name,
                    runs.map(|v| {
                        let (mut e, mut x): (Vec<f64>, Vec<f64>) = v.into_iter().unzip();
                        (median(&mut e), median(&mut x))
                    }),
                )
            })
            .collect(),
        parts: part_runs
            .into_iter()
            .map(|(name, mut v)| (name, median(&mut v)))
            .collect(),
        maps,
    })
}

/// utime + stime of `pid` in seconds, and VmRSS in KiB.
fn cpu_and_rss(pid: u32) -> Result<(f64, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let after_comm = stat.rsplit_once(')').context("stat")?.1;
    let f: Vec<&str> = after_comm.split_whitespace().collect();
    // Fields 14 and 15 (utime, stime) are at 11 and 12 after the comm.
    let ticks: u64 =
        f.get(11).context("utime")?.parse::<u64>()? + f.get(12).context("stime")?.parse::<u64>()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let rss = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .context("VmRSS")?;
    Ok((ticks as f64 / hz, rss))
}

struct Footprint {
    idle_cpu_pct: f64,
    idle_rss_kib: u64,
    scraped_cpu_pct: f64,
    scraped_rss_kib: u64,
    metrics_bytes: usize,
}

fn footprint(bins: &Bins, secs: u64) -> Result<Footprint> {
    let daemon = Daemon::start(&bins.daemon, "")?;
    std::thread::sleep(Duration::from_secs(2)); // start-up scan done
    let pid = daemon.pid();
    let (c0, _) = cpu_and_rss(pid)?;
    std::thread::sleep(Duration::from_secs(secs));
    let (c1, idle_rss_kib) = cpu_and_rss(pid)?;
    let mut metrics_bytes = 0;
    let mut rss_max = idle_rss_kib;
    for _ in 0..secs {
        let t = Instant::now();
        let text = pgio_testkit::metrics::http_get(
            &format!("{}/metrics", daemon.url),
            Duration::from_secs(10),
        )?;
        metrics_bytes = text.len();
        rss_max = rss_max.max(cpu_and_rss(pid)?.1);
        std::thread::sleep(Duration::from_secs(1).saturating_sub(t.elapsed()));
    }
    let (c2, rss) = cpu_and_rss(pid)?;
    daemon.stop()?;
    Ok(Footprint {
        idle_cpu_pct: 100.0 * (c1 - c0) / secs as f64,
        idle_rss_kib,
        scraped_cpu_pct: 100.0 * (c2 - c1) / secs as f64,
        scraped_rss_kib: rss_max.max(rss),
        metrics_bytes,
    })
}

/// The configurations `pgbench -S` runs under, one run each per round, in rotating order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum PgbenchRun {
    Without,
    /// `pgio-daemon floor --hooks pgio`: empty programs on pgio's hooks.
    Floor,
    /// pgio with `queries = false`.
    NoQueries,
    /// pgio with `query_ids = false` (the profile's only: what the ids cost).
    NoQueryIds,
    /// pgio with its default config (query metrics on).
    Default,
}

impl PgbenchRun {
    const ALL: [PgbenchRun; 4] = [
        PgbenchRun::Without,
        PgbenchRun::Floor,
        PgbenchRun::NoQueries,
        PgbenchRun::Default,
    ];

    fn name(self) -> &'static str {
        match self {
            PgbenchRun::Without => "without pgio",
            PgbenchRun::Floor => "empty programs on pgio's hooks (the floor)",
            PgbenchRun::NoQueries => "with pgio, `queries = false`",
            PgbenchRun::NoQueryIds => "with pgio, `query_ids = false`",
            PgbenchRun::Default => "with pgio, default config (query metrics on)",
        }
    }
}

struct Tps {
    /// Per configuration, one tps per round.
    runs: BTreeMap<PgbenchRun, Vec<f64>>,
    /// Per configuration, one CPU time per transaction per round (µs): everything in the
    /// bench's cgroup (PostgreSQL, pgbench, pgio or the floor, and the kernel's work in their
    /// context, eBPF programs included). With every CPU busy it is CPUs / tps; it says more on
    /// a node with idle CPUs.
    cpu_us: BTreeMap<PgbenchRun, Vec<f64>>,
    /// Each pgio program's (run seconds, runs) in one more default run, with bpf_stats on,
    /// and its wall seconds: where the CPU that pgio takes from pgbench goes.
    with_programs: BTreeMap<String, (f64, f64)>,
    with_secs: f64,
    /// That run's transactions and the daemon's own CPU seconds in it.
    with_transactions: f64,
    with_daemon_cpu_s: f64,
    /// The floor under bpf_stats over the same load: (run seconds, runs) of its programs.
    floor_programs: (f64, f64),
    floor_transactions: f64,
    /// The configurations alternated every 100 ms in one pgbench run.
    switched: Option<switched::Switched>,
    /// Where the CPU goes, by perf (or why not measured).
    profile: Option<std::result::Result<profile::Profile, String>>,
}

fn pgbench_tps(pg: &PgCluster, secs: u32, clients: u32) -> Result<f64> {
    Ok(pgbench_run(pg, secs, clients)?.0)
}

/// `pgbench -S -c clients -j clients` for `secs`: (tps, transactions).
fn pgbench_run(pg: &PgCluster, secs: u32, clients: u32) -> Result<(f64, f64)> {
    let c = clients.to_string();
    let out = pg.pgbench_ok(&["-S", "-n", "-c", &c, "-j", &c, "-T", &secs.to_string()])?;
    let tps = out
        .lines()
        .find_map(|l| l.strip_prefix("tps = "))
        .and_then(|l| l.split_whitespace().next()?.parse().ok())
        .context("no tps line in pgbench output")?;
    let transactions = out
        .lines()
        .find_map(|l| l.strip_prefix("number of transactions actually processed: "))
        .and_then(|v| v.split('/').next()?.trim().parse().ok())
        .context("no transaction count in pgbench output")?;
    Ok((tps, transactions))
}

/// A cgroup v2 holding this process and all it starts from now on, for their CPU time
/// (`cpu.stat` `usage_usec`, kept in every v2 cgroup, also on a hybrid host). Dropped, the
/// process moves back and the cgroup goes.
struct BenchCgroup {
    dir: PathBuf,
    root: PathBuf,
}

impl BenchCgroup {
    fn enter() -> Result<BenchCgroup> {
        let root = pgio_testkit::kubepods::cgroup2_root()?;
        let dir = root.join(format!("pgio-bench-{}", std::process::id()));
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        std::fs::write(dir.join("cgroup.procs"), std::process::id().to_string())
            .with_context(|| format!("joining {}", dir.display()))?;
        Ok(BenchCgroup { dir, root })
    }

    fn usage_us(&self) -> Result<f64> {
        let stat = std::fs::read_to_string(self.dir.join("cpu.stat"))?;
        stat.lines()
            .find_map(|l| l.strip_prefix("usage_usec "))
            .and_then(|v| v.trim().parse().ok())
            .context("no usage_usec in cpu.stat")
    }
}

impl Drop for BenchCgroup {
    fn drop(&mut self) {
        let _ = std::fs::write(
            self.root.join("cgroup.procs"),
            std::process::id().to_string(),
        );
        if let Err(e) = std::fs::remove_dir(&self.dir) {
            eprintln!("bench: cannot remove {}: {e}", self.dir.display());
        }
    }
}

/// What runs beside pgbench in one configuration: nothing, the floor, or pgio.
enum Beside {
    Nothing,
    Floor(Tracing),
    Pgio(Daemon),
}

impl Beside {
    fn start(bins: &Bins, run: PgbenchRun) -> Result<Beside> {
        Ok(match run {
            PgbenchRun::Without => Beside::Nothing,
            PgbenchRun::Floor => {
                let mut c = Command::new(&bins.daemon);
                c.args(["floor", "--hooks", "pgio"]);
                Beside::Floor(spawn_until(c, "ready")?)
            }
            PgbenchRun::NoQueries | PgbenchRun::NoQueryIds | PgbenchRun::Default => {
                let config = match run {
                    PgbenchRun::NoQueries => "queries = false\n",
                    PgbenchRun::NoQueryIds => "query_ids = false\n",
                    _ => "",
                };
                let d = Daemon::start(&bins.daemon, config)?;
                d.wait_tracked("postgres", "postmaster")?;
                Beside::Pgio(d)
            }
        })
    }

    fn stop(self) -> Result<()> {
        match self {
            Beside::Nothing => {}
            Beside::Floor(mut f) => {
                f.stop();
            }
            Beside::Pgio(d) => d.stop()?,
        }
        Ok(())
    }
}

/// Section 2's PostgreSQL: scale 10 on ext4 on a direct-IO loop device, its cache warm, all
/// in the bench's cgroup. Dropped in field order: the server stops before its disk goes.
struct BenchCluster {
    pg: PgCluster,
    _fs: Ext4Mount,
    _lo: LoopDevice,
    _dir: pgio_testkit::TempDir,
    cgroup: BenchCgroup,
}

impl BenchCluster {
    fn start(clients: u32) -> Result<BenchCluster> {
        // Before PostgreSQL starts, so that its processes are in it too.
        let cgroup = BenchCgroup::enter()?;
        let dir = temp_dir()?;
        let lo = LoopDevice::create(dir.path(), 1 << 30, true)?;
        let fs = Ext4Mount::new(&lo, &dir.path().join("mnt"))?;
        let opts = PgOptions::new(PG15_BIN_DIR, fs.path().join("pgdata"), 55_433)
            .setting("autovacuum", "off");
        let mut pg = PgCluster::init_with(opts)?;
        pg.start()?;
        pg.pgbench_ok(&["-i", "-q", "-s", "10"])?;
        pgbench_tps(&pg, 3, clients)?; // warm the cache: the data set fits in shared_buffers + page cache
        Ok(BenchCluster {
            pg,
            _fs: fs,
            _lo: lo,
            _dir: dir,
            cgroup,
        })
    }
}

/// Section 2's profile alone (`--profile-only`).
fn profile_only(bins: &Bins, o: &BenchOptions) -> Result<profile::Profile> {
    let mut c = BenchCluster::start(o.clients)?;
    let p = profile::run(bins, &c.pg, o.pgbench_secs, o.clients, o.profile_rounds)?;
    c.pg.stop()?;
    Ok(p)
}

fn pgbench_pairs(bins: &Bins, o: &BenchOptions) -> Result<Tps> {
    let mut c = BenchCluster::start(o.clients)?;
    let (pg, cgroup) = (&mut c.pg, &c.cgroup);
    let mut tps = Tps {
        runs: BTreeMap::new(),
        cpu_us: BTreeMap::new(),
        with_programs: BTreeMap::new(),
        with_secs: 0.0,
        with_transactions: 0.0,
        with_daemon_cpu_s: 0.0,
        floor_programs: (0.0, 0.0),
        floor_transactions: 0.0,
        switched: None,
        profile: None,
    };
    let n = PgbenchRun::ALL.len();
    for round in 0..o.pairs {
        for k in 0..n {
            let run = PgbenchRun::ALL[(round + k) % n];
            let beside = Beside::start(bins, run)?;
            let cpu0 = cgroup.usage_us()?;
            let (t, transactions) = pgbench_run(pg, o.pgbench_secs, o.clients)?;
            let cpu = (cgroup.usage_us()? - cpu0) / transactions.max(1.0);
            beside.stop()?;
            step(format!(
                "pgbench round {}/{}: {}: {t:.0} tps, {cpu:.2} µs of CPU per transaction",
                round + 1,
                o.pairs,
                run.name()
            ));
            tps.runs.entry(run).or_default().push(t);
            tps.cpu_us.entry(run).or_default().push(cpu);
        }
    }
    tps.switched = Some(switched::run(
        bins,
        pg,
        o.switched_secs,
        o.slice,
        o.clients,
    )?);
    tps.profile = Some(
        profile::run(bins, pg, o.pgbench_secs, o.clients, o.profile_rounds)
            .map_err(|e| format!("{e:#}")),
    );
    // Apart from the rounds: bpf_stats costs two clock reads per program run.
    let stats = BpfStats::enable()?;
    let d = Daemon::start(&bins.daemon, "")?;
    d.wait_tracked("postgres", "postmaster")?;
    let before = d.scrape()?;
    let (cpu0, _) = cpu_and_rss(d.pid())?;
    let started = Instant::now();
    tps.with_transactions = pgbench_run(pg, o.pgbench_secs, o.clients)?.1;
    tps.with_secs = started.elapsed().as_secs_f64();
    tps.with_daemon_cpu_s = cpu_and_rss(d.pid())?.0 - cpu0;
    let after = d.scrape()?;
    d.stop()?;
    // The floor's programs over the same load: how many hook hits a transaction makes, and
    // what bpf_stats' own clock reads add to each run.
    let mut c = Command::new(&bins.daemon);
    c.args(["floor", "--hooks", "pgio"]);
    let mut floor = spawn_until(c, "ready")?;
    tps.floor_transactions = pgbench_run(pg, o.pgbench_secs, o.clients)?.1;
    for l in floor.stop() {
        let mut f = l.split(' ');
        if f.next() != Some("stats") || f.next().is_none() {
            continue;
        }
        let (Some(Ok(ns)), Some(Ok(runs))) = (
            f.next().map(str::parse::<f64>),
            f.next().map(str::parse::<f64>),
        ) else {
            continue;
        };
        tps.floor_programs.0 += ns / 1e9;
        tps.floor_programs.1 += runs;
    }
    drop(stats);
    for s in after.samples("pgio_bpf_program_runs_total") {
        let Some(p) = s.labels.get("program") else {
            continue;
        };
        let l = [("program", p.as_str())];
        let secs = after.sum("pgio_bpf_program_run_seconds_total", &l)
            - before.sum("pgio_bpf_program_run_seconds_total", &l);
        let runs = s.value - before.sum("pgio_bpf_program_runs_total", &l);
        tps.with_programs.insert(p.clone(), (secs, runs));
    }
    pg.stop()?;
    Ok(tps)
}

/// Median of the per-round ratios `a[i] / b[i]` and its 95 % interval: a percentile
/// bootstrap over rounds (10,000 resamples, a fixed seed so a report can be rerun).
fn ratio_with_interval(a: &[f64], b: &[f64]) -> (f64, f64, f64) {
    let ratios: Vec<f64> = a.iter().zip(b).map(|(x, y)| x / y).collect();
    let point = median(&mut ratios.clone());
    if ratios.len() < 2 {
        return (point, point, point);
    }
    let (lo, hi) = bootstrap_interval(ratios.len(), 10_000, |pick| {
        median(&mut pick.iter().map(|&i| ratios[i]).collect::<Vec<_>>())
    });
    (point, lo, hi)
}

/// The 95 % percentile-bootstrap interval of `stat` over `n` items: `resamples` draws of `n`
/// indices with replacement (xorshift64*, a fixed seed, so a report can be rerun).
fn bootstrap_interval(n: usize, resamples: usize, stat: impl Fn(&[usize]) -> f64) -> (f64, f64) {
    let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = move || {
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        state.wrapping_mul(0x2545_f491_4f6c_dd1d)
    };
    let mut values: Vec<f64> = (0..resamples)
        .map(|_| {
            let pick: Vec<usize> = (0..n).map(|_| (next() % n as u64) as usize).collect();
            stat(&pick)
        })
        .collect();
    values.sort_by(|x, y| x.total_cmp(y));
    let at = |q: f64| values[((values.len() - 1) as f64 * q).round() as usize];
    (at(0.025), at(0.975))
}

/// pgio-daemon's criterion benches (`exe`, from the shared release build), run as `cargo
/// bench` would run them; mean ns of each from criterion's JSON.
fn criterion(root: &Path, exe: &Path, quick: bool) -> Result<Vec<(String, f64)>> {
    let mut cmd = Command::new(exe);
    cmd.current_dir(root.join("pgio-daemon"))
        .env("CRITERION_HOME", target_dir(root).join("criterion"))
        .arg("--bench");
    if quick {
        cmd.args(["--quick", "metrics_5000_series|classify|proc_scan"]);
    }
    run(&mut cmd)?;
    let mut out = Vec::new();
    for name in [
        "metrics_5000_series_openmetrics",
        "metrics_5000_series_openmetrics_prometheus_client",
        "metrics_5000_series_text",
        "metrics_5000_series_text_prometheus_client",
        "metrics_5000_label_sets_openmetrics",
        "metrics_5000_label_sets_openmetrics_prometheus_client",
        "classify_10000_titles",
        "proc_scan",
    ] {
        let path = target_dir(root).join(format!("criterion/{name}/new/estimates.json"));
        let Ok(text) = std::fs::read_to_string(&path) else {
            continue;
        };
        let v: serde_json::Value = serde_json::from_str(&text)?;
        if let Some(ns) = v["mean"]["point_estimate"].as_f64() {
            out.push((name.to_owned(), ns));
        }
    }
    Ok(out)
}

fn ratio(a: Option<f64>, b: Option<f64>) -> String {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => format!("{:.2}", a / b),
        _ => "n/a".into(),
    }
}

pub fn bench(root: &Path, o: &BenchOptions) -> Result<()> {
    let started = Instant::now();
    step("building pgio-daemon and pgio-load (release, with the tests: one build)");
    let built = crate::test_build::build(root, crate::cross::Arch::host())?;
    let bins = Bins {
        daemon: built.bin("pgio-daemon")?,
        load: built.bin("pgio-load")?,
    };

    if o.pgbench_only {
        let mut r = String::new();
        let pgbench = pgbench_pairs(&bins, o)?;
        // The dispatch cost per hook hit: a short per-call run of the floor.
        let pc = per_call(
            &bins,
            &BenchOptions {
                rounds: 5,
                calls: 300_000,
                ..BenchOptions::quick()
            },
        )?;
        pgbench_report(
            &mut r,
            o,
            &pgbench,
            pc.added(Tracer::Floor).map(|ns| ns / 2.0),
        );
        println!("{}\n{r}", cpu_description());
        // Another node's clients are another table: only this node's default is written.
        if !o.quick && o.clients == 2 {
            let file = root.join("BENCHMARKS.md");
            section::rewrite(&file, PGBENCH_SECTION, "--pgbench-only", &r)?;
            step(format!("rewrote its section of {}", file.display()));
        }
        return Ok(());
    }
    if o.profile_only {
        let mut r = String::new();
        profile::report_section(&mut r, &profile_only(&bins, o)?);
        println!("{}\n{r}", cpu_description());
        if !o.quick && o.clients == 2 {
            let file = root.join("BENCHMARKS.md");
            section::rewrite(&file, profile::SECTION, "--profile-only", &r)?;
            step(format!("rewrote its section of {}", file.display()));
        }
        return Ok(());
    }
    if o.block_only {
        let mut r = String::new();
        block::report(&mut r, &block::block_cost(&bins.daemon, o.block_secs)?);
        println!("{}\n{r}", cpu_description());
        if !o.quick {
            let file = root.join("BENCHMARKS.md");
            section::rewrite(&file, block::SECTION, "--block-only", &r)?;
            step(format!("rewrote its section of {}", file.display()));
        }
        return Ok(());
    }
    if o.programs_only {
        let programs = program_cost(&bins, o)?;
        let mut r = String::new();
        programs_report(&mut r, o, &programs);
        println!("{}\n{r}", cpu_description());
        if !o.quick {
            let file = root.join("BENCHMARKS.md");
            section::rewrite(&file, PROGRAMS_SECTION, "--programs-only", &r)?;
            step(format!("rewrote its section of {}", file.display()));
        }
        return Ok(());
    }
    let per_call = per_call(&bins, o)?;
    if o.per_call_only {
        let mut r = String::new();
        per_call_report(&mut r, o, &per_call);
        println!("{}\n{r}", cpu_description());
        return Ok(());
    }
    let programs = program_cost(&bins, o)?;
    let block = block::block_cost(&bins.daemon, o.block_secs)?;
    let footprint = footprint(&bins, if o.quick { 2 } else { 10 })?;
    let tps = pgbench_pairs(&bins, o)?;
    let crit = criterion(root, &built.bench("userspace")?, o.quick)?;

    let mut report = report(o, &per_call, &programs, &block, &footprint, &tps, &crit);
    if !o.quick {
        // Guests, last: their TCG threads would load both CPUs under the timed sections.
        match big_node::big_node_cost(root) {
            Ok(nodes) => big_node::report(&mut report, &nodes),
            Err(e) => {
                let _ = writeln!(report, "\n## 5. A big node\n\nNot measured: {e:#}");
            }
        }
    }
    println!("{report}");
    if o.quick {
        step("quick run: BENCHMARKS.md left as it is");
    } else {
        std::fs::write(root.join("BENCHMARKS.md"), &report).context("writing BENCHMARKS.md")?;
        step("wrote BENCHMARKS.md");
    }
    step(format!(
        "bench: done in {}",
        fmt_duration(started.elapsed())
    ));
    Ok(())
}

/// Section 2's heading in BENCHMARKS.md (`section::rewrite`).
const PGBENCH_SECTION: &str = "## 2. Database impact: pgbench -S";

/// Section 2's table: each configuration's tps and its per-round ratio to without pgio; then
/// pgio's cost per transaction as the kernel and /proc account it. `dispatch_ns`: what a hook
/// hit costs before its program runs (section 1's floor, per tracepoint hit).
fn pgbench_report(r: &mut String, o: &BenchOptions, tps: &Tps, dispatch_ns: Option<f64>) {
    let _ = writeln!(r, "\n{PGBENCH_SECTION}\n");
    let _ = writeln!(
        r,
        "PostgreSQL 15, scale 10 on ext4 on a direct-IO loop device, warm cache (the worst case \
         for relative overhead: every transaction is CPU and syscalls), `pgbench -S -c {} -j {} -T \
         {}`, {} interleaved rounds of {} runs (the order rotates each round); pgio tracks every \
         Postgres process.\n",
        o.clients,
        o.clients,
        o.pgbench_secs,
        o.pairs,
        PgbenchRun::ALL.len()
    );
    let _ = writeln!(
        r,
        "Two measures per run: tps, and the CPU time per transaction of everything in the \
         bench's cgroup (PostgreSQL, pgbench, pgio or the floor; eBPF programs run in the \
         context of the process they trace, so their time is in it). On this shared VM tps \
         wanders by ±20 % between rounds, and with both CPUs saturated CPU time per \
         transaction is 2 / tps and wanders as much (no hardware counters here to count \
         instructions instead): the accounted figure below is the steady one. The CPU ratio is \
         without / with: the throughput left at equal CPU. Each ratio is the median of the per-round ratios, with \
         its 95 % interval (percentile bootstrap over rounds).\n"
    );
    let _ = writeln!(
        r,
        "| | median µs of CPU per transaction | CPU ratio (without / with) | 95 % interval | \
         median tps | tps ratio (with / without) | 95 % interval |\n\
         |---|---:|---:|---:|---:|---:|---:|"
    );
    let runs = |run| tps.runs.get(&run).cloned().unwrap_or_default();
    let cpu = |run| tps.cpu_us.get(&run).cloned().unwrap_or_default();
    let (without, cpu_without) = (runs(PgbenchRun::Without), cpu(PgbenchRun::Without));
    for run in PgbenchRun::ALL {
        let (v, c) = (runs(run), cpu(run));
        let (m, mc) = (median(&mut v.clone()), median(&mut c.clone()));
        if run == PgbenchRun::Without {
            let _ = writeln!(r, "| {} | {mc:.2} | | | {m:.0} | | |", run.name());
            continue;
        }
        let (cr, clo, chi) = ratio_with_interval(&cpu_without, &c);
        let (tr, tlo, thi) = ratio_with_interval(&v, &without);
        let _ = writeln!(
            r,
            "| {} | {mc:.2} | **{cr:.3}** | {clo:.3} – {chi:.3} | {m:.0} | {tr:.3} | {tlo:.3} – \
             {thi:.3} |",
            run.name(),
        );
    }
    if let Some(s) = &tps.switched {
        switched::report(r, s);
    }
    let (queries, qlo, qhi) =
        ratio_with_interval(&cpu(PgbenchRun::NoQueries), &cpu(PgbenchRun::Default));
    let (own, lo, hi) = ratio_with_interval(&cpu(PgbenchRun::Floor), &cpu(PgbenchRun::Default));
    let target = match tps.switched.as_ref().map(|s| s.ratio(PgbenchRun::Default)) {
        Some((p, lo, hi, _)) => format!(
            "{p:.3} ({lo:.3} – {hi:.3}) in the pairs above: {}",
            if lo >= 0.98 {
                "met"
            } else if hi < 0.98 {
                "not met"
            } else {
                "not resolved"
            }
        ),
        None => "not measured (no switched run)".into(),
    };
    let _ = writeln!(
        r,
        "\nTarget: the default config ≥ 0.98 of without pgio: {target}. In the rounds of \
         seconds, by CPU time per transaction, the query metrics alone (`queries = false` / \
         default, per round): {queries:.3} ({qlo:.3} – {qhi:.3}); pgio's programs beyond their \
         hooks' floor (floor / default): {own:.3} ({lo:.3} – {hi:.3}).\n\nRuns (tps; µs of CPU \
         per transaction), in round order:\n"
    );
    let fmt = |v: &[f64], digits: usize| {
        v.iter()
            .map(|x| format!("{x:.digits$}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    for run in PgbenchRun::ALL {
        let _ = writeln!(
            r,
            "- {}: {}; {}",
            run.name(),
            fmt(&runs(run), 0),
            fmt(&cpu(run), 2)
        );
    }
    let _ = writeln!(
        r,
        "\nWhere pgio's programs spend CPU under pgbench: one more default run of {:.0} s \
         after the rounds, with kernel bpf_stats on (which the pairs are not, as it adds two \
         clock reads to every program run: an empty program measures {:.1} ns per run, so most \
         of a short program's figure is bpf_stats' own); the programs that ran most:\n\n| \
         program | runs a second | ns per run | CPU (% of one core) |\n|---|---:|---:|---:|",
        tps.with_secs,
        tps.floor_programs.0 * 1e9 / tps.floor_programs.1.max(1.0)
    );
    let mut progs: Vec<_> = tps.with_programs.iter().collect();
    progs.sort_by(|a, b| b.1.0.total_cmp(&a.1.0));
    let secs = tps.with_secs.max(1e-9);
    for (p, (run_secs, runs)) in progs.iter().take(8) {
        let _ = writeln!(
            r,
            "| `{p}` | {:.0} | {:.1} | {:.2} % |",
            runs / secs,
            run_secs * 1e9 / runs.max(1.0),
            run_secs / secs * 100.0
        );
    }
    let total: f64 = progs.iter().map(|(_, (s, _))| s).sum();
    let _ = writeln!(
        r,
        "| all of pgio's programs | | | {:.2} % |",
        total / secs * 100.0
    );
    accounted_report(r, tps, &cpu_without, dispatch_ns);
    match &tps.profile {
        Some(Ok(p)) => profile::report_section(r, p),
        Some(Err(e)) => {
            let _ = writeln!(r, "\n{}\n\nNot measured: {e}", profile::SECTION);
        }
        None => {}
    }
}

/// pgio's cost per transaction from what the kernel and /proc account, against the CPU time
/// of a transaction without pgio: steadier than any difference of two noisy runs.
fn accounted_report(r: &mut String, tps: &Tps, cpu_without: &[f64], dispatch_ns: Option<f64>) {
    let tx = tps.with_transactions.max(1.0);
    let (prog_s, runs) = tps
        .with_programs
        .values()
        .fold((0.0, 0.0), |(s, n), (ps, pn)| (s + ps, n + pn));
    // bpf_stats' own two clock reads per run, as an empty program measures them.
    let empty_ns = tps.floor_programs.0 * 1e9 / tps.floor_programs.1.max(1.0);
    let programs_ns = (prog_s * 1e9 - runs * empty_ns).max(0.0) / tx;
    let hits = runs / tx;
    let floor_hits = tps.floor_programs.1 / tps.floor_transactions.max(1.0);
    let daemon_ns = tps.with_daemon_cpu_s * 1e9 / tx;
    let dispatch = dispatch_ns.map(|d| d * hits);
    let total = programs_ns + daemon_ns + dispatch.unwrap_or(0.0);
    let ratio = |base_us: f64| base_us * 1e3 / (base_us * 1e3 + total);
    let base = median(&mut cpu_without.to_vec());
    let mut ratios: Vec<f64> = cpu_without.iter().map(|b| ratio(*b)).collect();
    ratios.sort_by(|a, b| a.total_cmp(b));
    let (lo, hi) = (
        ratios.first().copied().unwrap_or(f64::NAN),
        ratios.last().copied().unwrap_or(f64::NAN),
    );
    let _ = writeln!(
        r,
        "\nAccounted (one more default run with kernel bpf_stats on, and one of the floor): per \
         transaction, pgio's programs ran {hits:.1} times (the floor's hooks fired {floor_hits:.1} \
         times) for **{programs_ns:.0} ns** (bpf_stats' own {empty_ns:.1} ns per run taken \
         out), the hooks' dispatch {} and the daemon used {daemon_ns:.0} ns: **{total:.0} ns** \
         against {base:.2} µs of CPU per transaction without pgio: **{:.3}** of the throughput \
         left at equal CPU ({lo:.3} – {hi:.3} over the rounds' CPU per transaction).",
        match (dispatch_ns, dispatch) {
            (Some(d), Some(t)) => format!("{d:.1} ns per hit (section 1's floor), {t:.0} ns"),
            _ => "(not measured in this run)".to_owned(),
        },
        ratio(base)
    );
}

fn per_call_report(r: &mut String, o: &BenchOptions, pc: &PerCall) {
    let _ = writeln!(r, "## 1. Per-call cost: cached 8 KiB pread64\n");
    let _ = writeln!(
        r,
        "`pgio-load pread` does {} pread64 calls of 8 KiB on a file in the page cache; CPU time \
         of the loop (user + system, so the BPF programs on its syscalls included) per call. \
         {} rounds; round order rotates; the process is pinned to CPU 1.\n",
        o.calls, o.rounds
    );
    let _ = writeln!(
        r,
        "| configuration | ns/call (median) | added ns/call (median of per-round differences) | rounds |"
    );
    let _ = writeln!(r, "|---|---:|---:|---|");
    for (t, m, s) in &pc.tracers {
        let added = pc.added(*t).map_or("".into(), |a| format!("{a:+.1}"));
        let rounds: Vec<String> = s.iter().map(|x| format!("{x:.0}")).collect();
        let _ = writeln!(
            r,
            "| {} | {m:.1} | {added} | {} |",
            t.name(),
            rounds.join(", ")
        );
    }
    let _ = writeln!(
        r,
        "\nReading these numbers: this is a 2-vCPU VM on a shared host. Rounds of the same \
         configuration differ by up to ±25 %, more than the effects measured, and interleaving \
         with paired differences only tames it: three full runs on this machine gave \
         tracked/floor 1.74, 2.14 and 0.83. The in-kernel run times below (kernel \
         bpf_stats) vary by a few ns between runs and are the figure to trust for what pgio's \
         programs add.\n"
    );
    let floor = pc.added(Tracer::Floor);
    let _ = writeln!(r, "\n| ratio of added cost | measured | target |");
    let _ = writeln!(r, "|---|---:|---:|");
    let _ = writeln!(
        r,
        "| pgio tracked / floor | {} | ≤ 1.25 |",
        ratio(pc.added(Tracer::Pgio), floor)
    );
    let _ = writeln!(
        r,
        "| pgio untracked / floor | {} | ≤ 1.10 |",
        ratio(pc.added(Tracer::PgioUntracked), floor)
    );
    let _ = writeln!(
        r,
        "| pgio tracked / bpftrace | {} | ≤ 0.50 |",
        ratio(pc.added(Tracer::Pgio), pc.added(Tracer::Bpftrace))
    );
}

/// `programs_report`'s heading in BENCHMARKS.md (`section::rewrite`).
const PROGRAMS_SECTION: &str = "### In-kernel run time of the programs (kernel.bpf_stats_enabled)";

fn programs_report(r: &mut String, o: &BenchOptions, programs: &ProgramCost) {
    let _ = writeln!(
        r,
        "\n{PROGRAMS_SECTION}\n\n\
         ns per program run, median of {} rounds of {} calls. This leaves out the cost of \
         reaching a program (the same for all three), so it shows what pgio's own code adds \
         over an empty program, without the CPU-time noise above.\n",
        o.rounds.clamp(1, 5),
        o.calls
    );
    let _ = writeln!(
        r,
        "| programs | enter | exit | enter + exit |\n|---|---:|---:|---:|"
    );
    let row = |r: &mut String, name: &str, (e, x): (f64, f64)| {
        let _ = writeln!(r, "| {name} | {e:.1} | {x:.1} | {:.1} |", e + x);
    };
    row(
        r,
        "empty, `syscalls/sys_{enter,exit}_pread64` (floor)",
        programs.floor,
    );
    for (name, cost) in &programs.hooks {
        match cost {
            Ok(c) => row(r, &format!("empty, {name}"), *c),
            Err(e) => {
                let _ = writeln!(r, "| empty, {name} | cannot load here: {e} | | |");
            }
        }
    }
    row(r, "pgio, process tracked", programs.tracked);
    row(
        r,
        "pgio, process tracked, `syscall_rows = false` (hash only, as before)",
        programs.tracked_hash,
    );
    row(
        r,
        "pgio, process tracked as PostgreSQL's (each read also under its file: `relations`)",
        programs.tracked_relations,
    );
    row(r, "pgio, process untracked", programs.untracked);
    row(
        r,
        "pgio, tracked process' `futex` wakes (not timed; `sys_{enter,exit}_futex`)",
        programs.futex_wake,
    );
    let _ = writeln!(
        r,
        "\npgio's `tp_btf/sched_switch` program (it moves a switched-out thread's pending \
         syscall start off its CPU and forgets who ran) runs at every context switch on the node: {:.1} ns per run, \
         at {:.0} switches a second during the tracked load.",
        programs.sched_switch.0, programs.sched_switch.1
    );
    let floor = programs.floor.0 + programs.floor.1;
    let _ = writeln!(
        r,
        "\n| ratio of run time (same hooks) | measured | target |\n|---|---:|---:|"
    );
    let _ = writeln!(
        r,
        "| pgio tracked / floor, enter + exit | {:.2} | ≤ 1.6 |",
        (programs.tracked.0 + programs.tracked.1) / floor
    );
    let _ = writeln!(
        r,
        "| pgio untracked / floor, enter + exit | {:.2} | ≤ 1.05 |",
        (programs.untracked.0 + programs.untracked.1) / floor
    );
    let _ = writeln!(
        r,
        "\n#### What each piece costs\n\nEach `part_*` program does one piece of the timing \
         alone, all on `syscalls/sys_enter_pread64` in one run (`pgio-daemon floor --hooks \
         parts`); the floor is the empty program's {:.1} ns on the same hook. The first \
         program in the chain pays a few ns more for cold caches.\n",
        programs.floor.0
    );
    let _ = writeln!(
        r,
        "| piece | ns per run | over the floor |\n|---|---:|---:|"
    );
    for (name, ns) in &programs.parts {
        let what = match name.as_str() {
            "part_pid_tgid" => "`bpf_get_current_pid_tgid`",
            "part_tracked" => "`bpf_get_current_pid_tgid` + `TRACKED` lookup (the untracked path)",
            "part_tracked_big_frame" => {
                "the same in a program with a stack frame of 64 bytes or more (a private stack)"
            }
            "part_read_user" => {
                "`bpf_probe_read_user` of 8 bytes (`query`: ReadyForQuery, the query id)"
            }
            "part_pt_regs" => {
                "`bpf_task_pt_regs` + 3 registers (`query`: a socket call's arguments)"
            }
            "part_ktime" => "`bpf_ktime_get_ns` (twice per timed syscall)",
            "part_tid_hash" => {
                "a per-thread value in a preallocated hash by tid (`QUERY`, `SYSCALL_SPILLED`)"
            }
            "part_tid_array" => "a per-thread value in a tid-indexed array instead",
            "part_hash" => "per-CPU hash lookup + add (what the histogram maps were, a known key)",
            "part_shared_hash" => {
                "shared hash lookup + 2 atomic adds (`SYSCALL_HIST`, a known key)"
            }
            "part_array" => "per-CPU array lookup + add (`SYSCALL_ROWS_MAP`)",
            _ => name.as_str(),
        };
        let _ = writeln!(r, "| {what} | {ns:.1} | {:+.1} |", ns - programs.floor.0);
    }
    targets_explained(r, programs);
    let _ = writeln!(r, "\n#### Map memory\n");
    let _ = writeln!(r, "{}", programs.maps);
}

/// Issue 50's two in-kernel targets against the pieces: what the untracked and the tracked
/// `pread64` cost over the floor, and what of it each call cannot do without.
fn targets_explained(r: &mut String, programs: &ProgramCost) {
    let piece = |name: &str| {
        programs
            .parts
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, ns)| ns - programs.floor.0)
    };
    let (Some(check), Some(clock), Some(slot), Some(row)) = (
        piece("part_tracked"),
        piece("part_ktime"),
        piece("part_tid_array"),
        piece("part_array"),
    ) else {
        return;
    };
    let floor = programs.floor.0 + programs.floor.1;
    let untracked = programs.untracked.0 + programs.untracked.1 - floor;
    let tracked = programs.tracked.0 + programs.tracked.1 - floor;
    let needed = 2.0 * check + slot + row;
    let _ = writeln!(
        r,
        "\nThe targets against the pieces. Untracked ≤ 1.05 × the floor leaves {:.1} ns a \
         call (enter + exit) for asking whether the process is tracked; the cheapest way to \
         ask, one helper and one inlined array read, is {check:.1} ns a program, {:.1} ns a \
         call: the untracked path measures {untracked:+.1} ns, so the target means no check \
         at all, which a node-wide tracepoint cannot skip. A tracked `pread64` measures \
         {tracked:+.1} ns over the floor: its two clock reads are {:+.1}, and of the rest \
         ({:+.1}, for a target of +10) the tracked check at enter and exit, its start kept in \
         a per-thread place and the row added to are {needed:+.1}.",
        floor * 0.05,
        2.0 * check,
        2.0 * clock,
        tracked - 2.0 * clock,
    );
}

/// The CPU model and the return-stack mitigations: eBPF's cost per hook hit depends on them
/// (with AMD's "Safe RET" every return of a program and its helpers takes a detour).
fn cpu_description() -> String {
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find_map(|l| l.strip_prefix("model name"))
                .map(|m| m.trim_start_matches([' ', '\t', ':']).to_owned())
        })
        .unwrap_or_else(|| "CPU model unknown".into());
    let mut out = model;
    for v in ["spectre_v2", "retbleed", "spec_rstack_overflow"] {
        let path = format!("/sys/devices/system/cpu/vulnerabilities/{v}");
        if let Ok(state) = std::fs::read_to_string(path) {
            let _ = write!(out, "; {v}: {}", state.trim());
        }
    }
    out
}

fn report(
    o: &BenchOptions,
    pc: &PerCall,
    programs: &ProgramCost,
    block: &[block::EngineCost],
    fp: &Footprint,
    tps: &Tps,
    crit: &[(String, f64)],
) -> String {
    let mut r = String::new();
    let uname = Command::new("uname")
        .arg("-r")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default();
    let _ = writeln!(r, "# pgio benchmarks\n");
    let _ = writeln!(
        r,
        "Measured by `cargo xtask bench` (this file is its output) on kernel {uname}, {} cores \
         ({}). Every figure below comes from one run, configurations interleaved, medians of \
         rounds.\n",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        cpu_description()
    );
    per_call_report(&mut r, o, pc);
    programs_report(&mut r, o, programs);
    block::report(&mut r, block);
    pgbench_report(&mut r, o, tps, pc.added(Tracer::Floor).map(|ns| ns / 2.0));
    let _ = writeln!(r, "\n## 3. Daemon footprint\n");
    let _ = writeln!(r, "| state | CPU (% of one core) | RSS |\n|---|---:|---:|");
    let _ = writeln!(
        r,
        "| idle | {:.2} % | {:.1} MiB |",
        fp.idle_cpu_pct,
        fp.idle_rss_kib as f64 / 1024.0
    );
    let _ = writeln!(
        r,
        "| scraped every second ({} KiB of /metrics) | {:.2} % | {:.1} MiB |",
        fp.metrics_bytes / 1024,
        fp.scraped_cpu_pct,
        fp.scraped_rss_kib as f64 / 1024.0
    );
    let _ = writeln!(r, "\nTarget: RSS ≤ 40 MiB.");

    let _ = writeln!(r, "\n## 4. Userspace hot spots (criterion, mean)\n");
    let _ = writeln!(r, "| bench | time |\n|---|---:|");
    for (name, ns) in crit {
        let _ = writeln!(r, "| `{name}` | {:.3} ms |", ns / 1e6);
    }
    let mean = |name: &str| crit.iter().find(|(n, _)| n == name).map(|(_, ns)| *ns);
    let _ = writeln!(
        r,
        "\n| /metrics encoding, pgio / prometheus-client (same run) | ratio |\n|---|---:|"
    );
    for name in [
        "metrics_5000_series_openmetrics",
        "metrics_5000_series_text",
        "metrics_5000_label_sets_openmetrics",
    ] {
        let baseline = mean(&format!("{name}_prometheus_client"));
        let _ = writeln!(r, "| `{name}` | {} |", ratio(mean(name), baseline));
    }
    let _ = writeln!(
        r,
        "\n`metrics_5000_series_*`: 5,004 sample lines (52 label sets × pread64 hit/miss + futex \
         histograms, block histograms on 4 devices); target ≤ 5 ms. `_openmetrics` is what \
         Prometheus asks for, `_text` the 0.0.4 text format other scrapers get. \
         `_prometheus_client`: the same families encoded as pgio did before its own encoder \
         (prometheus-client's OpenMetrics, rewritten into 0.0.4 text for `_text`), the baseline. \
         `metrics_5000_label_sets_*`: 5,000 label sets (483,004 lines, 78 MB) for scale.\n"
    );
    let _ = writeln!(r, "Reproduce: `cargo xtask bench` (as root; ~35 minutes).");
    r
}
