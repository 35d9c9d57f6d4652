//! A real Prometheus server as a child process, to run PromQL (the dashboards' queries) on
//! what it scraped from pgio: the `prometheus` binary from PATH if installed, else from
//! Debian's `prometheus` package, unpacked once next to `promtool` ([`crate::promtool`]).
//! Each server has its own temporary TSDB directory, scrapes its targets every second, listens
//! on a free loopback port, and is stopped (SIGTERM, then SIGKILL) and removed in Drop, also
//! when a test panics.
//! The HTTP API's JSON answers are read with `serde_json`.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use percent_encoding::{AsciiSet, NON_ALPHANUMERIC, PercentEncode, utf8_percent_encode};
use serde_json::Value;

use crate::daemon::free_port;
use crate::metrics::http_get;
use crate::{TempDir, temp_dir, wait_until};

/// The `prometheus` server binary: from PATH if it runs, else Debian's, unpacked on first use.
pub fn prometheus_bin() -> Result<PathBuf> {
    if let Ok(out) = Command::new("prometheus").arg("--version").output()
        && out.status.success()
    {
        return Ok(PathBuf::from("prometheus"));
    }
    Ok(crate::promtool::debian_prometheus_tree()?.join("usr/bin/prometheus"))
}

/// One sample of a query result: a vector element, or the value of a scalar (no labels).
#[derive(Debug, Clone, PartialEq)]
pub struct PromSample {
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

/// A running Prometheus server; see the module docs.
pub struct Prometheus {
    child: Child,
    /// `http://127.0.0.1:<port>`.
    pub url: String,
    log: PathBuf,
    _dir: TempDir,
}

impl Prometheus {
    /// Starts a server that scrapes each `host:port` in `targets` (path `/metrics`, job `job`)
    /// every second, and waits until it is ready (not until the first scrape: see
    /// [`Prometheus::wait_up`]).
    pub fn start(job: &str, targets: &[&str]) -> Result<Prometheus> {
        Prometheus::start_with(job, targets, &[])
    }

    /// [`Prometheus::start`] with `--enable-feature=<f>` for each of `features` (e.g.
    /// `native-histograms`, which makes it ask for the protobuf exposition).
    pub fn start_with(job: &str, targets: &[&str], features: &[&str]) -> Result<Prometheus> {
        let bin = prometheus_bin()?;
        let dir = temp_dir()?;
        let config = dir.path().join("prometheus.yml");
        let list: Vec<String> = targets.iter().map(|t| format!("'{t}'")).collect();
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
                 scrape_configs:\n  - job_name: '{job}'\n    static_configs:\n      - targets: [{}]\n",
                list.join(", ")
            ),
        )?;
        let log = dir.path().join("prometheus.log");
        // The free port may be taken between probing and binding: try a few.
        let mut last_log = String::new();
        for _ in 0..3 {
            let port = free_port()?;
            let mut child = Command::new(&bin)
                .arg(format!("--config.file={}", config.display()))
                .arg(format!(
                    "--storage.tsdb.path={}",
                    dir.path().join("data").display()
                ))
                .arg(format!("--web.listen-address=127.0.0.1:{port}"))
                .arg("--storage.tsdb.retention.time=1d")
                .args(features.iter().map(|f| format!("--enable-feature={f}")))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(&log)?)
                .current_dir(dir.path())
                .spawn()
                .with_context(|| format!("spawning {}", bin.display()))?;
            let url = format!("http://127.0.0.1:{port}");
            let ready = format!("{url}/-/ready");
            wait_until(Duration::from_secs(30), Duration::from_millis(100), || {
                http_get(&ready, Duration::from_secs(2)).is_ok()
                    || matches!(child.try_wait(), Ok(Some(_)))
            });
            if http_get(&ready, Duration::from_secs(2)).is_ok()
                && matches!(child.try_wait(), Ok(None))
            {
                return Ok(Prometheus {
                    child,
                    url,
                    log,
                    _dir: dir,
                });
            }
            stop_child(&mut child);
            last_log = std::fs::read_to_string(&log).unwrap_or_default();
        }
        bail!("prometheus did not come up; log:\n{last_log}")
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until every target of `job` has been scraped successfully (`up == 1`).
    pub fn wait_up(&self, job: &str, timeout: Duration) -> Result<()> {
        let expr = format!("min(up{{job=\"{job}\"}})");
        let ok = wait_until(timeout, Duration::from_millis(200), || {
            self.query(&expr, None)
                .is_ok_and(|r| r.first().is_some_and(|s| s.value == 1.0))
        });
        ensure!(
            ok,
            "prometheus has not scraped job {job} within {timeout:?}; log:\n{}",
            self.log_text()
        );
        Ok(())
    }

    /// `GET /api/v1/query` at `time` (Unix seconds; now if `None`). Vectors give one sample
    /// per series, scalars one sample without labels; matrices and strings are an error.
    /// A query Prometheus rejects is an error with its message.
    pub fn query(&self, expr: &str, time: Option<f64>) -> Result<Vec<PromSample>> {
        let mut path = format!("/api/v1/query?query={}", url_encode(expr));
        if let Some(t) = time {
            write!(path, "&time={t:.3}")?;
        }
        let data = self.api(&path)?;
        let kind = data.get("resultType").and_then(Value::as_str).unwrap_or("");
        let result = data.get("result").context("no result")?;
        match kind {
            "vector" => result
                .as_array()
                .context("vector result is not an array")?
                .iter()
                .map(|s| {
                    let labels = s
                        .get("metric")
                        .and_then(Value::as_object)
                        .context("sample without metric")?
                        .iter()
                        .map(|(k, v)| Ok((k.clone(), v.as_str().context("label")?.to_owned())))
                        .collect::<Result<_>>()?;
                    let value = sample_value(s.get("value").context("sample without value")?)?;
                    Ok(PromSample { labels, value })
                })
                .collect(),
            "scalar" => Ok(vec![PromSample {
                labels: BTreeMap::new(),
                value: sample_value(result)?,
            }]),
            other => bail!("query {expr:?}: unexpected result type {other:?}"),
        }
    }

    /// `GET /api/v1/label/<label>/values` restricted to series matching any of `matchers`
    /// (all series if empty), sorted as Prometheus returns them.
    pub fn label_values(&self, label: &str, matchers: &[&str]) -> Result<Vec<String>> {
        let mut path = format!("/api/v1/label/{}/values", url_encode(label));
        for (i, m) in matchers.iter().enumerate() {
            path.push(if i == 0 { '?' } else { '&' });
            write!(path, "match[]={}", url_encode(m))?;
        }
        self.api(&path)?
            .as_array()
            .context("label values are not an array")?
            .iter()
            .map(|v| Ok(v.as_str().context("label value")?.to_owned()))
            .collect()
    }

    /// The `data` of a successful API answer; Prometheus' own error message otherwise.
    fn api(&self, path: &str) -> Result<Value> {
        let url = format!("{}{path}", self.url);
        let body = http_get(&url, Duration::from_secs(30)).map_err(|e| {
            // http_get puts the body (Prometheus' JSON error) into its error.
            anyhow::anyhow!("GET {path}: {e:#}")
        })?;
        let j: Value =
            serde_json::from_str(&body).with_context(|| format!("GET {path}: answer {body:?}"))?;
        if j.get("status").and_then(Value::as_str) != Some("success") {
            bail!(
                "GET {path}: {}",
                j.get("error").and_then(Value::as_str).unwrap_or(&body)
            );
        }
        j.get("data")
            .cloned()
            .with_context(|| format!("GET {path}: no data"))
    }
}

/// SIGTERM, up to 10 s to exit, then SIGKILL; reaps it.
fn stop_child(child: &mut Child) {
    if let Ok(None) = child.try_wait() {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
        let exited = wait_until(Duration::from_secs(10), Duration::from_millis(50), || {
            matches!(child.try_wait(), Ok(Some(_)))
        });
        if !exited {
            let _ = child.kill();
        }
        let _ = child.wait();
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        stop_child(&mut self.child);
        if std::thread::panicking() {
            let log = self.log_text();
            let tail: Vec<&str> = log.lines().rev().take(30).collect();
            eprintln!(
                "prometheus log tail:\n{}",
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            );
        }
    }
}

/// `[<unix time>, "<value>"]` → value (`NaN`, `+Inf`, `-Inf` as Prometheus writes them).
fn sample_value(v: &Value) -> Result<f64> {
    let s = v
        .as_array()
        .and_then(|a| a.get(1))
        .and_then(Value::as_str)
        .context("sample value is not [time, \"value\"]")?;
    Ok(match s {
        "NaN" => f64::NAN,
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        _ => s.parse().with_context(|| format!("sample value {s:?}"))?,
    })
}

/// Everything but RFC 3986's unreserved characters (`A-Z a-z 0-9 - _ . ~`): safe in a query
/// string's values and in a path segment.
const COMPONENT: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'_')
    .remove(b'.')
    .remove(b'~');

/// Percent-encodes `s` (UTF-8) for a query string or path segment; see [`COMPONENT`].
fn url_encode(s: &str) -> PercentEncode<'_> {
    utf8_percent_encode(s, COMPONENT)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sample_values() {
        let v = |s: &str| sample_value(&serde_json::from_str(s).unwrap()).unwrap();
        assert_eq!(v(r#"[1.5, "0.25"]"#), 0.25);
        assert!(v(r#"[1.5, "NaN"]"#).is_nan());
        assert_eq!(v(r#"[1.5, "+Inf"]"#), f64::INFINITY);
        // The value must be Prometheus' string, not a JSON number.
        assert!(sample_value(&serde_json::json!([1.5, 0.25])).is_err());
    }

    /// A real server scraping a counter that grows by 10 a scrape: up, rate, label values,
    /// a rejected query's message, and nothing left behind after Drop. Needs root like the
    /// other tests that unpack Debian packages (`apt-get download` on first use).
    #[test]
    fn scrapes_and_queries() {
        use std::io::{Read, Write};
        if !crate::require_root("prometheus::scrapes_and_queries") {
            return;
        }
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        std::thread::spawn(move || {
            for (n, conn) in listener.incoming().enumerate() {
                let Ok(mut conn) = conn else { continue };
                let mut req = Vec::new();
                let mut buf = [0u8; 4096];
                while !req.windows(4).any(|w| w == b"\r\n\r\n") {
                    match conn.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(k) => req.extend_from_slice(&buf[..k]),
                    }
                }
                let body = format!(
                    "# TYPE pgio_t_total counter\npgio_t_total{{a=\"x y\"}} {}\n",
                    10 * n
                );
                let _ = write!(
                    conn,
                    "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n\
                     Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
            }
        });
        let p = Prometheus::start("t", &[&addr]).unwrap();
        p.wait_up("t", Duration::from_secs(20)).unwrap();
        let ok = wait_until(Duration::from_secs(20), Duration::from_millis(200), || {
            p.query("rate(pgio_t_total[5s])", None)
                .is_ok_and(|r| r.len() == 1 && r[0].value > 0.0)
        });
        assert!(ok, "no rate; log:\n{}", p.log_text());
        let r = p.query("sum(pgio_t_total) > 0", None).unwrap();
        assert!(r[0].labels.is_empty() && r[0].value >= 10.0, "{r:?}");
        assert_eq!(p.query("scalar(vector(2))", None).unwrap()[0].value, 2.0);
        assert_eq!(
            p.label_values("a", &["pgio_t_total"]).unwrap(),
            vec!["x y".to_owned()]
        );
        assert!(p.label_values("a", &["nothing"]).unwrap().is_empty());
        let err = p.query("rate(pgio_t_total)", None).unwrap_err();
        assert!(format!("{err:#}").contains("range vector"), "{err:#}");
        let pid = p.pid();
        drop(p);
        assert!(!crate::pid_alive(pid), "prometheus {pid} still running");
    }

    #[test]
    fn url_encoding() {
        assert_eq!(
            url_encode("rate(x{a=~\"b|c\"}[15s]) / 2+1&y").to_string(),
            "rate%28x%7Ba%3D~%22b%7Cc%22%7D%5B15s%5D%29%20%2F%202%2B1%26y"
        );
        assert_eq!(url_encode("é").to_string(), "%C3%A9");
    }
}
