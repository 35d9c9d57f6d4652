//! Debian's fio as the independent check of block request counts and latencies: one job of
//! direct random reads on a device, its JSON report parsed.

use std::{path::Path, process::Command, time::Duration};

use anyhow::{Context, Result, bail};

use crate::cmd::run;

/// The `fio` binary (Debian's package; `cargo xtask test` installs it).
pub fn fio_bin() -> Result<&'static str> {
    const BIN: &str = "/usr/bin/fio";
    if !Path::new(BIN).is_file() {
        bail!("{BIN} not found: install Debian's fio (`cargo xtask test` does)");
    }
    Ok(BIN)
}

/// What one fio job reports for its reads.
#[derive(Debug, Clone, PartialEq)]
pub struct FioReads {
    /// Read IOs completed (`read.total_ios`).
    pub ios: u64,
    /// Completion latency percentiles (`read.clat_ns.percentile`): p50, p90, p99, in ns.
    /// fio's clat runs from submission to completion as the engine sees them.
    pub clat_p50_ns: u64,
    pub clat_p90_ns: u64,
    pub clat_p99_ns: u64,
}

/// Runs `fio` to completion: `bs` random direct reads of `device` with `engine` at `iodepth`
/// for `runtime`, reporting to `<out_dir>/fio-<engine>.json`.
pub fn random_reads(
    device: &Path,
    engine: &str,
    iodepth: u32,
    bs: u32,
    runtime: Duration,
    out_dir: &Path,
) -> Result<FioReads> {
    let report = out_dir.join(format!("fio-{engine}.json"));
    let mut cmd = Command::new(fio_bin()?);
    cmd.arg("--name=pgio")
        .arg(format!("--filename={}", device.display()))
        .args(["--direct=1", "--rw=randread", "--time_based"])
        .arg(format!("--bs={bs}"))
        .arg(format!("--ioengine={engine}"))
        .arg(format!("--iodepth={iodepth}"))
        .arg(format!("--runtime={}s", runtime.as_secs().max(1)))
        .args(["--output-format=json", "--output"])
        .arg(&report);
    run(&mut cmd)?;
    let text = std::fs::read_to_string(&report)
        .with_context(|| format!("reading {}", report.display()))?;
    parse_report(&text).with_context(|| format!("parsing {}", report.display()))
}

/// The first job's reads from a fio JSON report.
pub fn parse_report(text: &str) -> Result<FioReads> {
    let v: serde_json::Value = serde_json::from_str(text)?;
    let read = &v["jobs"][0]["read"];
    let ios = read["total_ios"]
        .as_u64()
        .context("no jobs[0].read.total_ios")?;
    let pct = |p: &str| {
        read["clat_ns"]["percentile"][p]
            .as_u64()
            .with_context(|| format!("no jobs[0].read.clat_ns.percentile.{p}"))
    };
    Ok(FioReads {
        ios,
        clat_p50_ns: pct("50.000000")?,
        clat_p90_ns: pct("90.000000")?,
        clat_p99_ns: pct("99.000000")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_first_jobs_reads() {
        let text = r#"{"fio version":"fio-3.33","jobs":[{"jobname":"pgio","read":{
            "io_bytes":8192,"total_ios":4242,
            "clat_ns":{"min":1,"percentile":{"50.000000":168960,"90.000000":473088,
            "99.000000":1089536,"99.900000":2000000}}}}]}"#;
        assert_eq!(
            parse_report(text).expect("report"),
            FioReads {
                ios: 4242,
                clat_p50_ns: 168960,
                clat_p90_ns: 473088,
                clat_p99_ns: 1089536,
            }
        );
        assert!(parse_report(r#"{"jobs":[{"read":{"total_ios":1}}]}"#).is_err());
        assert!(parse_report("not json").is_err());
    }
}
