//! Map memory and scrape cost on a big node, against a small one: the `big_node` test of
//! `cargo xtask integration` in the Debian 6.1 guest started with 2 and with 128 possible CPUs
//! (`-smp 2,maxcpus=N`), read from the figures it prints.
use std::fmt::Write as _;
use std::path::Path;

use anyhow::{Context, Result};

use crate::integration;
use crate::util::target_dir;

pub struct NodeCost {
    pub cpus: u32,
    pub maps_mib: f64,
    pub mem_available_drop_mib: f64,
    pub rss_mib: f64,
    pub cgroup_mib: f64,
    pub scrape_ms: f64,
}

pub fn big_node_cost(root: &Path) -> Result<Vec<NodeCost>> {
    let mut out = Vec::new();
    for cpus in [2, 128] {
        let mut opts = integration::ci_options(&["big_node"])?;
        opts.max_cpus = cpus;
        integration::integration(root, true, &opts)?;
        let path = target_dir(root).join("integration/runs/6.1/results/big_node.log");
        let log = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        out.push(parse(cpus, &log).with_context(|| {
            format!("big_node at {cpus} possible CPUs printed no figures: {log}")
        })?);
    }
    Ok(out)
}

/// The rest of the test's line that starts `"{cpus} possible CPUs: "` and contains `what`.
fn line<'a>(log: &'a str, cpus: u32, what: &str) -> Option<&'a str> {
    let head = format!("{cpus} possible CPUs: ");
    log.lines()
        .filter_map(|l| l.find(&head).map(|i| &l[i + head.len()..]))
        .find(|l| l.contains(what))
}

/// The number right after `label` in `line`.
fn after(line: &str, label: &str) -> Option<f64> {
    let rest = line[line.find(label)? + label.len()..].trim_start();
    let n: String = rest
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '.')
        .collect();
    n.parse().ok()
}

fn parse(cpus: u32, log: &str) -> Option<NodeCost> {
    let mem = line(log, cpus, "MemAvailable")?;
    let scrape = line(log, cpus, "ms of daemon CPU per scrape")?;
    Some(NodeCost {
        cpus,
        maps_mib: after(mem, "maps")?,
        mem_available_drop_mib: after(mem, "MemAvailable -")?,
        rss_mib: after(mem, "daemon RSS")?,
        cgroup_mib: after(mem, "memory.current")?,
        scrape_ms: after(scrape, "")?,
    })
}

pub fn report(r: &mut String, nodes: &[NodeCost]) {
    let _ = writeln!(
        r,
        "\n## 5. A big node: 2 and 128 possible CPUs\n\n`cargo xtask integration`'s `big_node` \
         test in the Debian 6.1 guest started with 2, then 128 possible CPUs (qemu TCG, \
         `-smp 2,maxcpus=N`: 2 online), pgio in a memory cgroup of the DaemonSet's limit, \
         default config, 4,000 block reads counted exactly; the figures it prints. TCG runs \
         code ~16× slower than this host: compare the rows, not with the host's figures.\n"
    );
    let _ = writeln!(
        r,
        "| possible CPUs | maps (fdinfo memlock) | node MemAvailable drop at start | daemon RSS | \
         pod cgroup memory.current | daemon CPU per scrape |\n|---|---:|---:|---:|---:|---:|"
    );
    for n in nodes {
        let _ = writeln!(
            r,
            "| {} possible CPUs | {:.1} MiB | {:.1} MiB | {:.1} MiB | {:.1} MiB | {:.1} ms |",
            n.cpus, n.maps_mib, n.mem_available_drop_mib, n.rss_mib, n.cgroup_mib, n.scrape_ms
        );
    }
    let find = |cpus| nodes.iter().find(|n| n.cpus == cpus);
    if let (Some(small), Some(big)) = (find(2), find(128)) {
        let _ = writeln!(
            r,
            "\n| ratio | measured | target |\n|---|---:|---:|\n\
             | maps at 128 possible CPUs, MiB / 80 | {:.2} | ≤ 1.00 |\n\
             | daemon CPU per scrape at 128 possible CPUs (under TCG) / 1 s | {:.2} | ≤ 1.00 |\n\n\
             A scrape at 128 possible CPUs takes {:.1}× the CPU of one at 2: the per-CPU \
             `SYSCALL_ROWS_MAP` (256 rows of 528 bytes per CPU, 17 MiB at 128) is read whole; \
             the histogram maps are shared and cost the same at any size.",
            big.maps_mib / 80.0,
            big.scrape_ms / 1e3,
            big.scrape_ms / small.scrape_ms.max(1e-9)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_tests_own_lines() {
        let log = "test a_big_node_starts_in_the_daemonset_limit_and_counts_exactly ... 128 \
                   possible CPUs: maps 39.6 MiB (fdinfo memlock), MemAvailable -57.4 MiB, \
                   daemon RSS 21.6 MiB, cgroup memory.current 44.6 MiB of 128 MiB\n\
                   128 possible CPUs: 421.0 ms of daemon CPU per scrape\nok\n";
        let n = parse(128, log).expect("figures");
        assert_eq!(
            (
                n.maps_mib,
                n.mem_available_drop_mib,
                n.rss_mib,
                n.cgroup_mib,
                n.scrape_ms
            ),
            (39.6, 57.4, 21.6, 44.6, 421.0)
        );
        assert!(parse(2, log).is_none());
    }
}
