//! Section 2's profile: where the CPU of a `pgbench -S` transaction goes without pgio, with
//! the floor's empty programs, and with pgio (also with its query family, then its query ids,
//! off: what each costs, by difference) (`perf record -a -e cpu-clock`: a software clock,
//! which a VM without a PMU has too; the JIT'd programs show by name, through the kernel's
//! ksymbol events). The programs' own run time is a small part of what pgio costs: this finds
//! the rest (the kernel's dispatch to them, their helpers, what everything else loses).
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::os::unix::process::ExitStatusExt as _;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail, ensure};
use pgio_testkit::PgCluster;

use super::{Beside, Bins, PgbenchRun, pgbench_run};
use crate::util::{step, which};

/// This section's heading in BENCHMARKS.md (`section::rewrite`).
pub const SECTION: &str = "### Where the CPU goes: a profile (perf, cpu-clock)";

/// Samples a second per CPU: a sample every 0.5 ms, ~1 % of a CPU for perf's interrupts,
/// the same in every configuration.
const HZ: u32 = 1999;

/// The configurations profiled, each once per round (order rotating): pgio with its query
/// family off and with its query ids off too, so that the cost of each shows by difference.
const RUNS: [PgbenchRun; 5] = [
    PgbenchRun::Without,
    PgbenchRun::Floor,
    PgbenchRun::NoQueries,
    PgbenchRun::NoQueryIds,
    PgbenchRun::Default,
];

/// Where a sample fell.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Part {
    /// pgio's (or the floor's) JIT'd programs.
    Programs,
    /// The kernel's BPF side: running a program, its helpers and maps.
    BpfKernel,
    /// The syscall tracepoints' dispatch, which every process pays once one is attached.
    TracepointDispatch,
    PostgresUser,
    PostgresKernel,
    Pgbench,
    /// pgio-daemon's (or the floor's) own threads.
    Daemon,
    Idle,
    Other,
}

impl Part {
    const ALL: [Part; 9] = [
        Part::Programs,
        Part::BpfKernel,
        Part::TracepointDispatch,
        Part::PostgresUser,
        Part::PostgresKernel,
        Part::Pgbench,
        Part::Daemon,
        Part::Idle,
        Part::Other,
    ];

    fn name(self) -> &'static str {
        match self {
            Part::Programs => "the programs (JIT'd, `bpf_prog_*`)",
            Part::BpfKernel => {
                "running them: `trace_call_bpf`, helpers (user reads, the clock), maps"
            }
            Part::TracepointDispatch => {
                "syscall tracepoints' dispatch (`syscall_trace_enter`, `perf_syscall_*`)"
            }
            Part::PostgresUser => "PostgreSQL, user space",
            Part::PostgresKernel => "PostgreSQL, kernel (the rest)",
            Part::Pgbench => "pgbench",
            Part::Daemon => "pgio-daemon's threads",
            Part::Idle => "idle",
            Part::Other => "other",
        }
    }
}

/// The kernel's functions that run BPF programs or serve them (prefixes).
const BPF_KERNEL: &[&str] = &[
    "trace_call_bpf",
    "perf_call_bpf_",
    "bpf_trace_run",
    "__bpf_trace_",
    "__bpf_prog_enter",
    "__bpf_prog_exit",
    "bpf_probe_read",
    "bpf_get_",
    "bpf_ktime_",
    "bpf_jiffies",
    "bpf_task_pt_regs",
    "bpf_map_",
    "htab_",
    "__htab_",
    "array_map_",
    "percpu_array_",
    "copy_from_user_nofault",
    "copy_from_kernel_nofault",
    // `bpf_ktime_get_ns`' clock (none in the runs without programs).
    "ktime_get_mono_fast_ns",
    "read_tsc",
];

/// The syscall tracepoints' path (prefixes).
const DISPATCH: &[&str] = &[
    "syscall_trace_enter",
    "syscall_exit_work",
    "trace_sys_",
    "__traceiter_",
    "perf_syscall_",
    "perf_trace_buf",
    "perf_swevent_get_recursion_context",
    "perf_swevent_put_recursion_context",
];

/// A sample's part, from perf's comm, dso and symbol.
pub fn part(comm: &str, dso: &str, sym: &str) -> Part {
    let kernel = dso.starts_with('[') || dso.starts_with("bpf_prog_");
    if sym.starts_with("bpf_prog_") {
        return Part::Programs;
    }
    if kernel && BPF_KERNEL.iter().any(|p| sym.starts_with(p)) {
        return Part::BpfKernel;
    }
    if kernel && DISPATCH.iter().any(|p| sym.starts_with(p)) {
        return Part::TracepointDispatch;
    }
    match comm {
        "postgres" if kernel => Part::PostgresKernel,
        "postgres" => Part::PostgresUser,
        "pgbench" => Part::Pgbench,
        c if c.starts_with("pgio-daemon") || c.starts_with("tokio-runtime") => Part::Daemon,
        c if c.starts_with("swapper") => Part::Idle,
        _ => Part::Other,
    }
}

/// Counted by `perf stat -a` beside the samples: the switches and migrations anywhere; the
/// hardware's counts where the machine has a PMU (cache and TLB misses: whether pgio's writes
/// cost other CPUs, the open question of issue 50), "n/a" where not.
const COUNTED: [&str; 7] = [
    "context-switches",
    "cpu-migrations",
    "cycles",
    "instructions",
    "cache-misses",
    "dTLB-load-misses",
    "iTLB-load-misses",
];

/// One configuration's samples and transactions, over its runs.
#[derive(Default)]
pub struct Sampled {
    pub transactions: f64,
    /// Samples by (part, symbol).
    pub samples: BTreeMap<(Part, String), u64>,
    /// `COUNTED`'s events, summed over the runs; absent where not supported.
    pub counts: BTreeMap<String, f64>,
}

impl Sampled {
    /// ns of CPU per transaction that `samples` stand for.
    fn ns(&self, samples: u64) -> f64 {
        samples as f64 / f64::from(HZ) * 1e9 / self.transactions.max(1.0)
    }

    fn part_ns(&self, part: Part) -> f64 {
        self.ns(self
            .samples
            .iter()
            .filter(|((p, _), _)| *p == part)
            .map(|(_, n)| n)
            .sum())
    }

    /// The parts that are BPF's: the programs, running them, and the syscall tracepoints'
    /// dispatch (the least noisy figures: the rest is what PostgreSQL and pgbench did).
    fn bpf_ns(&self) -> f64 {
        [Part::Programs, Part::BpfKernel, Part::TracepointDispatch]
            .map(|p| self.part_ns(p))
            .iter()
            .sum()
    }

    fn all_ns(&self) -> f64 {
        Part::ALL.map(|p| self.part_ns(p)).iter().sum()
    }

    /// The JIT'd subprograms of one name (`bpf_prog_<tag>_<name>`), over every program.
    fn subprogram_ns(&self, name: &str) -> f64 {
        let suffix = format!("_{name}");
        self.ns(self
            .samples
            .iter()
            .filter(|((p, sym), _)| *p == Part::Programs && sym.ends_with(&suffix))
            .map(|(_, n)| n)
            .sum())
    }

    fn symbol_ns(&self, key: &(Part, String)) -> f64 {
        self.ns(self.samples.get(key).copied().unwrap_or(0))
    }
}

pub struct Profile {
    pub secs: u32,
    pub rounds: usize,
    pub clients: u32,
    pub runs: BTreeMap<PgbenchRun, Sampled>,
}

/// `rounds` rounds of a `secs` pgbench run per configuration, each under `perf record`.
pub fn run(bins: &Bins, pg: &PgCluster, secs: u32, clients: u32, rounds: usize) -> Result<Profile> {
    let perf = which("perf").context("perf is not installed (Debian: linux-perf)")?;
    let dir = pgio_testkit::temp_dir()?;
    let mut runs: BTreeMap<PgbenchRun, Sampled> = BTreeMap::new();
    for round in 0..rounds {
        for k in 0..RUNS.len() {
            let config = RUNS[(round + k) % RUNS.len()];
            let data = dir.path().join(format!("{round}-{k}.data"));
            let stat = dir.path().join(format!("{round}-{k}.stat"));
            let beside = Beside::start(bins, config)?;
            let recording = Recording::start(&perf, &data, &stat)?;
            let transactions = pgbench_run(pg, secs, clients);
            recording.stop()?;
            beside.stop()?;
            let s = runs.entry(config).or_default();
            s.transactions += transactions?.1;
            for ((part, sym), n) in report(&perf, &data)? {
                *s.samples.entry((part, sym)).or_insert(0) += n;
            }
            let text = std::fs::read_to_string(&stat).context("reading perf stat's output")?;
            for (event, n) in counted(&text) {
                *s.counts.entry(event.to_owned()).or_insert(0.0) += n;
            }
            std::fs::remove_file(&data).ok();
            step(format!(
                "profile round {}/{rounds}: {}",
                round + 1,
                config.name()
            ));
        }
    }
    Ok(Profile {
        secs,
        rounds,
        clients,
        runs,
    })
}

/// A system-wide `perf record` (samples into `data`) and `perf stat` (counts into `stat`);
/// stopped by SIGINT, as perf expects.
struct Recording {
    child: Child,
    stat: Child,
}

impl Recording {
    fn start(perf: &Path, data: &Path, stat: &Path) -> Result<Recording> {
        let spawn = |c: &mut Command| {
            c.stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .with_context(|| format!("spawning {}", perf.display()))
        };
        let child = spawn(
            Command::new(perf)
                .args(["record", "-q", "-a", "-e", "cpu-clock", "-F"])
                .arg(HZ.to_string())
                .arg("-o")
                .arg(data),
        )?;
        let stat = spawn(
            Command::new(perf)
                .args(["stat", "-a", "-x", ",", "-e", &COUNTED.join(","), "-o"])
                .arg(stat),
        )?;
        let mut r = Recording { child, stat };
        // perf opens an event per CPU before it writes the header: the file's first bytes.
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::fs::metadata(data).map_or(0, |m| m.len()) == 0 {
            if let Ok(Some(status)) = r.child.try_wait() {
                bail!("perf record exited at once ({status}): perf_event_open refused?");
            }
            ensure!(
                Instant::now() < deadline,
                "perf record did not start in 10 s"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        std::thread::sleep(Duration::from_millis(200));
        Ok(r)
    }

    fn stop(mut self) -> Result<()> {
        for c in [&mut self.child, &mut self.stat] {
            // SAFETY: signalling our own child.
            unsafe { libc::kill(c.id() as libc::pid_t, libc::SIGINT) };
            let status = c.wait().context("waiting for perf")?;
            // perf writes its file out, then raises the signal it stopped for again.
            ensure!(
                status.success() || status.signal() == Some(libc::SIGINT),
                "perf: {status}"
            );
        }
        Ok(())
    }
}

impl Drop for Recording {
    fn drop(&mut self) {
        for c in [&mut self.child, &mut self.stat] {
            if let Ok(None) = c.try_wait() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

/// `perf stat -x ,`'s counts: `value,unit,event,…` lines; `<not supported>` and
/// `<not counted>` values left out.
fn counted(text: &str) -> impl Iterator<Item = (&str, f64)> {
    text.lines().filter_map(|l| {
        let mut f = l.split(',');
        let value = f.next()?.parse::<f64>().ok()?;
        let _unit = f.next()?;
        Some((f.next()?, value))
    })
}

/// Samples by (part, symbol) in `data`: `perf report` by comm, dso and symbol.
fn report(perf: &Path, data: &Path) -> Result<BTreeMap<(Part, String), u64>> {
    let out = Command::new(perf)
        .args([
            "report",
            "--stdio",
            "-q",
            "-n",
            "--sort",
            "comm,dso,sym",
            "-t",
            "\t",
            "-i",
        ])
        .arg(data)
        .stderr(Stdio::null())
        .output()
        .context("running perf report")?;
    ensure!(out.status.success(), "perf report: {}", out.status);
    let text = String::from_utf8_lossy(&out.stdout);
    let mut by = BTreeMap::new();
    for (comm, dso, sym, n) in text.lines().filter_map(line) {
        *by.entry((part(comm, dso, sym), sym.to_owned()))
            .or_insert(0) += n;
    }
    ensure!(!by.is_empty(), "perf report gave no samples");
    Ok(by)
}

/// `perf report -n -t '\t' --sort comm,dso,sym`'s line: overhead, samples, comm, dso, and
/// `[k] symbol` or `[.] symbol`.
fn line(l: &str) -> Option<(&str, &str, &str, u64)> {
    let mut f = l.split('\t').map(str::trim);
    let _overhead = f.next()?;
    let n = f.next()?.parse().ok()?;
    let (comm, dso, sym) = (f.next()?, f.next()?, f.next()?);
    let sym = sym
        .strip_prefix("[k] ")
        .or_else(|| sym.strip_prefix("[.] "))
        .unwrap_or(sym);
    Some((comm, dso, sym, n))
}

/// The section: ns per transaction by part, then the symbols that grew most with pgio over
/// the floor.
pub fn report_section(r: &mut String, p: &Profile) {
    let _ = writeln!(
        r,
        "\n{SECTION}\n\n`perf record -a -e cpu-clock -F {HZ}` (a software clock, which a VM without a \
         PMU has too) over `pgbench -S -c {c} -j {c} -T {}`, each configuration \
         in {} round(s), in rotating order; every sample is {:.0} µs of one CPU, here divided by \
         the configuration's transactions: ns of CPU per transaction, on both CPUs, where it \
         went. A sample due while interrupts are off lands where they come back on: the \
         context switch's, the `sched_switch` program's with it, land in \
         `finish_task_switch`.\n",
        p.secs,
        p.rounds,
        1e6 / f64::from(HZ),
        c = p.clients,
    );
    let get = |run| p.runs.get(&run);
    let (Some(without), Some(floor), Some(pgio)) = (
        get(PgbenchRun::Without),
        get(PgbenchRun::Floor),
        get(PgbenchRun::Default),
    ) else {
        let _ = writeln!(r, "Not measured: a configuration has no samples.");
        return;
    };
    let _ = writeln!(
        r,
        "| part | without pgio | the floor | pgio, default | pgio − floor |\n\
         |---|---:|---:|---:|---:|"
    );
    let mut totals = [0.0; 3];
    for part in Part::ALL {
        let v = [without, floor, pgio].map(|s| s.part_ns(part));
        for (t, x) in totals.iter_mut().zip(v) {
            *t += x;
        }
        let _ = writeln!(
            r,
            "| {} | {:.0} | {:.0} | {:.0} | {:+.0} |",
            part.name(),
            v[0],
            v[1],
            v[2],
            v[2] - v[1]
        );
    }
    let _ = writeln!(
        r,
        "| **all** | **{:.0}** | **{:.0}** | **{:.0}** | **{:+.0}** |",
        totals[0],
        totals[1],
        totals[2],
        totals[2] - totals[1]
    );
    let _ = writeln!(
        r,
        "\nCounted beside the samples (`perf stat -a`), per transaction:\n\n\
         | event | without pgio | the floor | pgio, default | pgio / floor |\n\
         |---|---:|---:|---:|---:|"
    );
    for event in COUNTED {
        let per = |s: &Sampled| s.counts.get(event).map(|n| n / s.transactions.max(1.0));
        let cell = |v: Option<f64>| v.map_or_else(|| "n/a".to_owned(), |v| format!("{v:.2}"));
        let ratio = match (per(pgio), per(floor)) {
            (Some(a), Some(b)) if b > 0.0 => format!("{:.3}", a / b),
            _ => "n/a".to_owned(),
        };
        let _ = writeln!(
            r,
            "| `{event}` | {} | {} | {} | {ratio} |",
            cell(per(without)),
            cell(per(floor)),
            cell(per(pgio))
        );
    }
    features_table(r, p, floor, pgio);
    let mut keys: Vec<&(Part, String)> = pgio.samples.keys().chain(floor.samples.keys()).collect();
    keys.sort();
    keys.dedup();
    let mut grew: Vec<(f64, &(Part, String))> = keys
        .into_iter()
        .map(|k| (pgio.symbol_ns(k) - floor.symbol_ns(k), k))
        .collect();
    grew.sort_by(|a, b| b.0.total_cmp(&a.0));
    let _ = writeln!(
        r,
        "\nThe 15 symbols that grew most from the floor to pgio (ns per transaction):\n\n\
         | symbol | part | without pgio | the floor | pgio | pgio − floor |\n\
         |---|---|---:|---:|---:|---:|"
    );
    for (d, k) in grew.iter().take(15) {
        let _ = writeln!(
            r,
            "| `{}` | {} | {:.1} | {:.1} | {:.1} | {d:+.1} |",
            k.1,
            k.0.name(),
            without.symbol_ns(k),
            floor.symbol_ns(k),
            pgio.symbol_ns(k),
        );
    }
}

/// What each of pgio's families costs a transaction, by difference between configurations
/// that turn them off one after the other: the BPF side (the programs, running them, the
/// dispatch; the figures least touched by the runs' noise), and everything.
fn features_table(r: &mut String, p: &Profile, floor: &Sampled, pgio: &Sampled) {
    let (Some(no_queries), Some(no_ids)) = (
        p.runs.get(&PgbenchRun::NoQueries),
        p.runs.get(&PgbenchRun::NoQueryIds),
    ) else {
        return;
    };
    let _ = writeln!(
        r,
        "\nWhat each family costs a transaction (ns per transaction; the BPF side: the \
         programs, running them, the dispatch; \"all\" moves by several hundred ns between \
         runs of the same configuration):\n\n\
         | configuration | the BPF side | more than the row above | all |\n\
         |---|---:|---:|---:|"
    );
    let rows = [
        ("pgio, `queries = false`", no_queries),
        ("pgio, `query_ids = false`", no_ids),
        ("pgio, default", pgio),
    ];
    let mut above: Option<&Sampled> = None;
    for (name, s) in rows {
        let more = above.map_or_else(String::new, |a| format!("{:+.0}", s.bpf_ns() - a.bpf_ns()));
        let _ = writeln!(
            r,
            "| {name} | {:.0} | {more} | {:.0} |",
            s.bpf_ns(),
            s.all_ns()
        );
        above = Some(s);
    }
    let _ = writeln!(
        r,
        "| the floor (empty programs on all of pgio's hooks) | {:.0} | | {:.0} |",
        floor.bpf_ns(),
        floor.all_ns()
    );
    let _ = writeln!(
        r,
        "\nOf pgio's {:.0} ns: {:.0} without the query family (the tracked check at every \
         syscall of every process, the IO syscalls' latency, `sched_switch`), {:+.0} the \
         query family (its programs on every process' `recvfrom` and `sendto`, and at each \
         query: its time, IO time and wait parts, one user read of the reply's last 6 bytes \
         for ReadyForQuery), {:+.0} its query ids (one more user read a query, the backend's \
         `st_query_id`). The floor's empty programs on the same hooks take {:.0} ns; pgio's own \
         work is the other {:.0}.",
        pgio.bpf_ns(),
        no_queries.bpf_ns(),
        no_ids.bpf_ns() - no_queries.bpf_ns(),
        pgio.bpf_ns() - no_ids.bpf_ns(),
        floor.bpf_ns(),
        pgio.bpf_ns() - floor.bpf_ns(),
    );
    let _ = writeln!(
        r,
        "\nThe only cache lines shared between CPUs that the query family writes are its \
         rows', when `flush` moves a CPU's run of queries into them (at a query that does not \
         fit the run, when the run is a second old, or when the CPU goes idle): {:.1} ns a \
         transaction here (`bpf_prog_*_flush`). Everything else a query writes is its own \
         thread's or its CPU's, so at more busy CPUs a transaction's cost should stay what it \
         is here.",
        pgio.subprogram_ns("flush"),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn perf_report_lines_parse() {
        let l =
            " 1.91%  \t 119        \tpgio-load      \t[kernel.kallsyms]    \t[k] trace_call_bpf";
        assert_eq!(
            line(l),
            Some(("pgio-load", "[kernel.kallsyms]", "trace_call_bpf", 119))
        );
        assert_eq!(line("# comment"), None);
    }

    #[test]
    fn perf_stat_counts_parse() {
        let text = "# started on Mon Nov 30 20:59:44 2026\n\n1677,,context-switches,2003872667,100.00,,\n<not supported>,,cycles,0,100.00,,\n";
        assert_eq!(
            counted(text).collect::<Vec<_>>(),
            vec![("context-switches", 1677.0)]
        );
    }

    #[test]
    fn parts() {
        let k = "[kernel.kallsyms]";
        assert_eq!(
            part(
                "postgres",
                "bpf_prog_59f4_sys_exit_sendto",
                "bpf_prog_59f4_sys_exit_sendto"
            ),
            Part::Programs
        );
        assert_eq!(part("postgres", k, "trace_call_bpf"), Part::BpfKernel);
        assert_eq!(
            part("pgbench", k, "syscall_trace_enter"),
            Part::TracepointDispatch
        );
        assert_eq!(part("postgres", k, "tcp_sendmsg"), Part::PostgresKernel);
        assert_eq!(
            part("postgres", "postgres", "hash_search"),
            Part::PostgresUser
        );
        assert_eq!(part("swapper", k, "default_idle"), Part::Idle);
        // An LSM hook's stub is not a BPF program's cost.
        assert_eq!(
            part("postgres", k, "bpf_lsm_file_permission"),
            Part::PostgresKernel
        );
    }
}
