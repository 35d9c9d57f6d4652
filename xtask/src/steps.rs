//! The steps of `cargo xtask test`: each is announced, run and timed, a failing one does not
//! stop the ones after it (one flaky test must not hide the rest of the suite), and the run
//! ends with a table of every step, its time and outcome, then every failure by name.
use std::io::{BufRead, BufReader};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::util::{describe, fmt_duration, step};

struct Row {
    name: String,
    took: Duration,
    /// `None`: passed; else why it failed.
    failed: Option<String>,
}

#[derive(Default)]
pub struct Steps {
    rows: Vec<Row>,
    /// Failing tests by name (`tests/query.rs: pg15_pgbench_query_counts`), from the test
    /// runner's output.
    failed_tests: Vec<String>,
}

impl Steps {
    /// Runs step `name`; returns whether it passed.
    pub fn run(&mut self, name: &str, f: impl FnOnce() -> Result<()>) -> bool {
        let started = Instant::now();
        step(name);
        let result = f();
        let took = started.elapsed();
        let failed = result.err().map(|e| format!("{e:#}"));
        match &failed {
            None => step(format!("{name}: ok ({})", fmt_duration(took))),
            Some(e) => step(format!("{name}: FAILED ({}): {e}", fmt_duration(took))),
        }
        let ok = failed.is_none();
        self.rows.push(Row {
            name: name.to_owned(),
            took,
            failed,
        });
        ok
    }

    /// Runs a `cargo test` command as step `name`, its output passed through and read for
    /// the names of failing tests.
    pub fn run_tests(&mut self, name: &str, cmd: &mut Command) -> bool {
        let mut failed_tests = Vec::new();
        let ok = self.run(name, || run_reading_failures(cmd, &mut failed_tests));
        self.failed_tests.extend(failed_tests);
        ok
    }

    pub fn all_passed(&self) -> bool {
        self.rows.iter().all(|r| r.failed.is_none())
    }

    /// The table printed at the end: every step with its time, then the failures.
    pub fn report(&self, total: Duration) -> String {
        let width = self.rows.iter().map(|r| r.name.len()).max().unwrap_or(4);
        let mut out = format!("{:<width$}  {:>8}  result\n", "step", "time");
        for r in &self.rows {
            let result = if r.failed.is_some() { "FAILED" } else { "ok" };
            out += &format!(
                "{:<width$}  {:>8}  {result}\n",
                r.name,
                fmt_duration(r.took)
            );
        }
        out += &format!("{:<width$}  {:>8}\n", "total", fmt_duration(total));
        let failed: Vec<&Row> = self.rows.iter().filter(|r| r.failed.is_some()).collect();
        if !failed.is_empty() {
            out += "\nfailures:\n";
            for r in failed {
                out += &format!("- {}: {}\n", r.name, r.failed.as_deref().unwrap_or(""));
            }
            for t in &self.failed_tests {
                out += &format!("  - {t}\n");
            }
        }
        out
    }
}

/// Runs `cmd` with its stdout and stderr through one pipe (so that each failing test is read
/// after the `Running <binary>` line that names its binary), copied to stderr as it comes.
fn run_reading_failures(cmd: &mut Command, failed: &mut Vec<String>) -> Result<()> {
    let (reader, writer) = std::io::pipe().context("a pipe for the test output")?;
    cmd.stdout(writer.try_clone().context("cloning the pipe")?)
        .stderr(writer);
    let mut child = cmd
        .spawn()
        .with_context(|| format!("failed to start `{}`", describe(cmd)))?;
    // Our copies of the write end must go, or the read below never ends.
    cmd.stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    let mut binary = String::new();
    for line in BufReader::new(reader).lines() {
        let line = line.context("reading the test output")?;
        // eprintln!, not a write to the stderr handle: under `cargo test` the harness
        // captures it, so this module's own test does not print a failing test.
        eprintln!("{line}");
        if let Some(b) = running_binary(&line) {
            binary = b.to_owned();
        } else if let Some(t) = failed_test(&line) {
            failed.push(format!("{binary}: {t}"));
        }
    }
    let status = child.wait().context("waiting for the tests")?;
    if !status.success() {
        bail!("{status}; {} failing test(s)", failed.len());
    }
    Ok(())
}

/// `     Running tests/query.rs (target/release/deps/query-…)` → `tests/query.rs`.
fn running_binary(line: &str) -> Option<&str> {
    let rest = line.trim_start().strip_prefix("Running ")?;
    Some(rest.split(" (").next().unwrap_or(rest))
}

/// `test pg15_x ... FAILED` → `pg15_x`.
fn failed_test(line: &str) -> Option<&str> {
    line.strip_prefix("test ")?.strip_suffix(" ... FAILED")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_binaries_and_failing_tests() {
        assert_eq!(
            running_binary("     Running tests/query.rs (target/release/deps/query-de5a)"),
            Some("tests/query.rs")
        );
        assert_eq!(
            running_binary("     Running unittests src/lib.rs (target/release/deps/x-1)"),
            Some("unittests src/lib.rs")
        );
        assert_eq!(
            failed_test("test pg15_pgbench_query_counts ... FAILED"),
            Some("pg15_pgbench_query_counts")
        );
        assert_eq!(failed_test("test pg15_pgbench_query_counts ... ok"), None);
        assert_eq!(failed_test("test result: FAILED. 6 passed; 2 failed"), None);
    }

    #[test]
    fn a_failing_command_names_its_failing_tests() {
        let mut steps = Steps::default();
        let mut cmd = Command::new("sh");
        cmd.args([
            "-c",
            "echo '     Running tests/a.rs (x)'; echo 'test one ... ok' >&2; \
             echo 'test two ... FAILED'; exit 101",
        ]);
        assert!(!steps.run_tests("cargo test", &mut cmd));
        assert!(steps.run("after it", || Ok(())), "later steps still run");
        assert!(!steps.all_passed());
        let report = steps.report(Duration::from_secs(61));
        assert!(report.contains("tests/a.rs: two"), "{report}");
        assert!(report.contains("after it"), "{report}");
        assert!(report.contains("1 failing test(s)"), "{report}");
        assert!(report.contains("1m 01s"), "{report}");
    }
}
