//! What pgio's block programs cost per request: fio's direct 8 KiB random reads on a loop
//! device (libaio at iodepth 8, then psync), the reader tracked, each program's in-kernel run
//! time (kernel bpf_stats) divided by the reads /proc/diskstats counted. A program that runs
//! for every bio or more than once per request (completions in parts) is charged for it.
//! With queue blame off and on (`queue_blame`), side by side: its cost is the difference.
use std::fmt::Write as _;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result};
use pgio_testkit::{Daemon, LoopDevice, diskstats, fio, temp_dir};

use super::{BpfStats, program_ns};

/// Every program of the block family (the bio ones run on request-based disks too).
const PROGRAMS: &[&str] = &[
    "block_io_start",
    "block_rq_insert",
    "block_rq_issue",
    "block_rq_requeue",
    "block_rq_complete",
    "block_bio_queue",
    "block_bio_complete",
];

const RULE: &str = "[[rule]]\napp = \"bench\"\nrole = \"fio\"\ncomm = \"^fio$\"\n";

/// The configurations compared: (name, config lines before the rule).
const CONFIGS: [(&str, &str); 2] = [
    ("queue blame off", "queue_blame = false\n"),
    ("default", ""),
];

/// One fio engine's run under one configuration.
pub struct EngineCost {
    pub config: &'static str,
    pub engine: &'static str,
    pub iodepth: u32,
    /// Reads /proc/diskstats counted on the device during the run.
    pub requests: u64,
    /// `(program, ns per request)`, in `PROGRAMS` order; programs that never ran are left out.
    pub programs: Vec<(&'static str, f64)>,
}

impl EngineCost {
    pub fn total(&self) -> f64 {
        self.programs.iter().map(|p| p.1).sum()
    }
}

/// ns per request of each program, in one round.
type ProgramCosts = Vec<(&'static str, f64)>;

/// Rounds of each engine, interleaved: this VM's per-request figures move by ±15 % from one
/// minute to the next, so each program's figure is its median over the rounds.
const ROUNDS: usize = 3;

pub fn block_cost(daemon_bin: &Path, secs: u64) -> Result<Vec<EngineCost>> {
    let _stats = BpfStats::enable()?;
    let dir = temp_dir()?;
    let lo = LoopDevice::create(dir.path(), 256 << 20, true).context("loop device")?;
    lo.wait_quiet(Duration::from_secs(5));
    let engines = [("libaio", 8), ("psync", 1)];
    let cases: Vec<(&'static str, &'static str, &'static str, u32)> = CONFIGS
        .iter()
        .flat_map(|(name, lines)| engines.map(|(e, d)| (*name, *lines, e, d)))
        .collect();
    // Per case: requests over all rounds, and each round's ns per request of each program.
    let mut runs: Vec<(u64, Vec<ProgramCosts>)> = vec![(0, Vec::new()); cases.len()];
    for _ in 0..ROUNDS {
        for (name, lines) in CONFIGS {
            let daemon = Daemon::start(daemon_bin, &format!("{lines}{RULE}"))?;
            for (i, _) in cases.iter().enumerate().filter(|(_, c)| c.0 == name) {
                let (_, _, engine, iodepth) = cases[i];
                let before = daemon.scrape()?;
                let disk_before = diskstats(lo.name())?;
                fio::random_reads(
                    lo.path(),
                    engine,
                    iodepth,
                    8192,
                    Duration::from_secs(secs.div_ceil(ROUNDS as u64).max(1)),
                    dir.path(),
                )?;
                let after = daemon.scrape()?;
                let requests = diskstats(lo.name())?.reads_completed - disk_before.reads_completed;
                let programs = PROGRAMS
                    .iter()
                    .filter_map(|p| {
                        let (ns_per_run, runs) = program_ns(&before, &after, p);
                        (runs > 0.0).then(|| (*p, ns_per_run * runs / requests.max(1) as f64))
                    })
                    .collect();
                runs[i].0 += requests;
                runs[i].1.push(programs);
            }
            daemon.stop()?;
        }
    }
    lo.detach()?;
    Ok(cases
        .into_iter()
        .zip(runs)
        .map(
            |((config, _, engine, iodepth), (requests, rounds))| EngineCost {
                config,
                engine,
                iodepth,
                requests,
                programs: PROGRAMS
                    .iter()
                    .filter_map(|p| {
                        let ns: Vec<f64> = rounds
                            .iter()
                            .filter_map(|r| r.iter().find(|(q, _)| q == p).map(|x| x.1))
                            .collect();
                        (!ns.is_empty()).then(|| (*p, median(ns)))
                    })
                    .collect(),
            },
        )
        .collect())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

pub fn report(r: &mut String, costs: &[EngineCost]) {
    let _ = writeln!(
        r,
        "### Block programs per request\n\nfio 8 KiB direct random reads on a loop device \
         (the reader tracked), kernel bpf_stats on, 3 interleaved rounds per engine: each \
         program's run time over a round divided by the reads /proc/diskstats counted, median \
         of the rounds (a program that runs for every bio, or \
         twice for one request, is charged for it). bpf_stats' own two clock reads are in \
         every run.\n"
    );
    let mut header = String::from("| program |");
    let mut rule = String::from("|---|");
    for c in costs {
        let _ = write!(
            header,
            " {}: {} iodepth {} ({} requests), ns/request |",
            c.config, c.engine, c.iodepth, c.requests
        );
        rule.push_str("---:|");
    }
    let _ = writeln!(r, "{header}\n{rule}");
    let mut names: Vec<&str> = Vec::new();
    for c in costs {
        for (p, _) in &c.programs {
            if !names.contains(p) {
                names.push(p);
            }
        }
    }
    for name in names {
        let _ = write!(r, "| `{name}` |");
        for c in costs {
            match c.programs.iter().find(|(p, _)| *p == name) {
                Some((_, ns)) => {
                    let _ = write!(r, " {ns:.0} |");
                }
                None => r.push_str(" – |"),
            }
        }
        r.push('\n');
    }
    r.push_str("| **all** |");
    for c in costs {
        let _ = write!(r, " **{:.0}** |", c.total());
    }
    r.push_str("\n\n");
    let default = costs.iter().filter(|c| c.config == "default");
    let _ = writeln!(
        r,
        "| ratio | measured | target |\n|---|---:|---:|\n| all block programs, ns per request (worst engine) / 800 | {:.2} | ≤ 1.00 |",
        default.map(EngineCost::total).fold(0.0, f64::max) / 800.0
    );
    for c in costs.iter().filter(|c| c.config == "default") {
        let off = costs
            .iter()
            .find(|o| o.config != "default" && o.engine == c.engine)
            .map_or(f64::NAN, EngineCost::total);
        let _ = writeln!(
            r,
            "| {} iodepth {}: all block programs, default / queue blame off | {:.2} (+{:.0} ns) | – |",
            c.engine,
            c.iodepth,
            c.total() / off,
            c.total() - off
        );
    }
    r.push('\n');
}

/// This section's heading in BENCHMARKS.md (`section::rewrite`).
pub const SECTION: &str = "### Block programs per request";
