//! Scraping and querying a Prometheus / OpenMetrics text exposition.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};

/// One sample line: `name{labels} value`.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

impl Sample {
    /// True if every `(label, value)` pair is present with exactly that value.
    pub fn matches(&self, labels: &[(&str, &str)]) -> bool {
        labels
            .iter()
            .all(|(k, v)| self.labels.get(*k).map(String::as_str) == Some(*v))
    }
}

/// A histogram summed over all series matching a label filter.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Histogram {
    /// (upper bound `le`, cumulative count), sorted by bound; the last bound is +Inf.
    pub buckets: Vec<(f64, f64)>,
    pub sum: f64,
    pub count: f64,
}

impl Histogram {
    /// What was observed between `before` and `self` (buckets matched by bound).
    pub fn since(&self, before: &Histogram) -> Histogram {
        let prior = |le: f64| {
            before
                .buckets
                .iter()
                .find(|(b, _)| *b == le)
                .map_or(0.0, |(_, c)| *c)
        };
        Histogram {
            buckets: self
                .buckets
                .iter()
                .map(|(le, c)| (*le, c - prior(*le)))
                .collect(),
            sum: self.sum - before.sum,
            count: self.count - before.count,
        }
    }

    /// The `q` quantile interpolated linearly inside its bucket, as PromQL's
    /// `histogram_quantile` does (the first bucket starts at 0). `None` without observations
    /// or when it falls in `+Inf`.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        let total = self.buckets.last()?.1;
        if total <= 0.0 {
            return None;
        }
        let rank = q * total;
        let (mut lower, mut below) = (0.0, 0.0);
        for (le, c) in &self.buckets {
            if *c >= rank {
                if le.is_infinite() {
                    return None;
                }
                let inside = c - below;
                return Some(if inside > 0.0 {
                    lower + (le - lower) * (rank - below) / inside
                } else {
                    *le
                });
            }
            (lower, below) = (*le, *c);
        }
        None
    }

    /// Cumulative count of the largest bucket whose bound is <= `bound` (0 if none).
    pub fn count_le(&self, bound: f64) -> f64 {
        self.buckets
            .iter()
            .take_while(|(le, _)| *le <= bound)
            .last()
            .map_or(0.0, |(_, c)| *c)
    }
}

/// A parsed exposition.
#[derive(Debug, Clone, Default)]
pub struct Metrics {
    samples: Vec<Sample>,
    types: BTreeMap<String, String>,
}

/// GETs `url` (plain `http://host:port/path`, HTTP/1.1) and parses the body.
pub fn scrape(url: &str) -> Result<Metrics> {
    let body = http_get(url, Duration::from_secs(10))?;
    Metrics::parse(&body).with_context(|| format!("parsing metrics from {url}"))
}

impl Metrics {
    /// Parses Prometheus text format 0.0.4 or OpenMetrics text (exemplars, `# EOF`).
    pub fn parse(text: &str) -> Result<Self> {
        let mut m = Metrics::default();
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() {
                continue;
            }
            if let Some(comment) = line.strip_prefix('#') {
                let mut parts = comment.split_whitespace();
                if parts.next() == Some("TYPE")
                    && let (Some(name), Some(ty)) = (parts.next(), parts.next())
                {
                    m.types.insert(name.to_owned(), ty.to_owned());
                }
                continue;
            }
            m.samples
                .push(parse_sample(line).with_context(|| format!("line {}: {line:?}", i + 1))?);
        }
        Ok(m)
    }

    /// Every sample, in exposition order.
    pub fn all(&self) -> &[Sample] {
        &self.samples
    }

    /// Samples with exactly this name (e.g. `pgio_block_io_latency_seconds_bucket`).
    pub fn samples<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a Sample> + 'a {
        self.samples.iter().filter(move |s| s.name == name)
    }

    /// Samples of this name whose labels include all the given pairs.
    pub fn matching<'a>(
        &'a self,
        name: &'a str,
        labels: &'a [(&'a str, &'a str)],
    ) -> impl Iterator<Item = &'a Sample> + 'a {
        self.samples(name).filter(move |s| s.matches(labels))
    }

    /// Sum of the values of `matching(name, labels)` (0 if none).
    pub fn sum(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.matching(name, labels).map(|s| s.value).sum()
    }

    /// The `# TYPE` of a metric family, if declared.
    pub fn metric_type(&self, family: &str) -> Option<&str> {
        self.types.get(family).map(String::as_str)
    }

    /// The histogram `<family>_bucket/_sum/_count`, summed over all series whose labels
    /// include the given pairs (buckets are added per `le`).
    pub fn histogram(&self, family: &str, labels: &[(&str, &str)]) -> Result<Histogram> {
        let bucket_name = format!("{family}_bucket");
        let mut by_le: Vec<(f64, f64)> = Vec::new();
        for s in self.matching(&bucket_name, labels) {
            let le_str = s
                .labels
                .get("le")
                .with_context(|| format!("{bucket_name} sample without le"))?;
            let le = parse_value(le_str).with_context(|| format!("bad le {le_str:?}"))?;
            match by_le.iter_mut().find(|(b, _)| *b == le) {
                Some(entry) => entry.1 += s.value,
                None => by_le.push((le, s.value)),
            }
        }
        by_le.sort_by(|a, b| a.0.total_cmp(&b.0));
        Ok(Histogram {
            buckets: by_le,
            sum: self.sum(&format!("{family}_sum"), labels),
            count: self.sum(&format!("{family}_count"), labels),
        })
    }
}

fn parse_sample(line: &str) -> Result<Sample> {
    let name_end = line
        .find(|c: char| c == '{' || c.is_whitespace())
        .context("no value")?;
    let name = &line[..name_end];
    ensure!(
        !name.is_empty()
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':'),
        "bad metric name {name:?}"
    );
    let mut rest = &line[name_end..];
    let mut labels = BTreeMap::new();
    if let Some(after_brace) = rest.strip_prefix('{') {
        rest = parse_labels(after_brace, &mut labels)?;
    }
    // Drop an OpenMetrics exemplar (` # {...} v ts`); then "value [timestamp]".
    let rest = rest.split(" #").next().unwrap_or("");
    let value_str = rest.split_whitespace().next().context("no value")?;
    let value = parse_value(value_str).with_context(|| format!("bad value {value_str:?}"))?;
    Ok(Sample {
        name: name.to_owned(),
        labels,
        value,
    })
}

/// Parses `a="x",b="y"}` (after the `{`); returns the text after the `}`.
fn parse_labels<'a>(mut s: &'a str, out: &mut BTreeMap<String, String>) -> Result<&'a str> {
    loop {
        s = s.trim_start();
        if let Some(rest) = s.strip_prefix('}') {
            return Ok(rest);
        }
        let eq = s.find('=').context("label without '='")?;
        let key = s[..eq].trim();
        ensure!(
            !key.is_empty() && key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'),
            "bad label name {key:?}"
        );
        s = s[eq + 1..]
            .trim_start()
            .strip_prefix('"')
            .context("label value must be quoted")?;
        let mut value = String::new();
        let mut chars = s.char_indices();
        let end = loop {
            match chars.next() {
                None => bail!("unterminated label value"),
                Some((i, '"')) => break i,
                Some((_, '\\')) => match chars.next() {
                    Some((_, 'n')) => value.push('\n'),
                    Some((_, '\\')) => value.push('\\'),
                    Some((_, '"')) => value.push('"'),
                    Some((_, c)) => {
                        value.push('\\');
                        value.push(c);
                    }
                    None => bail!("unterminated label value"),
                },
                Some((_, c)) => value.push(c),
            }
        };
        out.insert(key.to_owned(), value);
        s = s[end + 1..].trim_start();
        if let Some(rest) = s.strip_prefix(',') {
            s = rest;
        } else if !s.starts_with('}') {
            bail!("expected ',' or '}}' after label {key}");
        }
    }
}

fn parse_value(s: &str) -> Result<f64> {
    Ok(match s {
        "+Inf" | "Inf" | "inf" | "+inf" => f64::INFINITY,
        "-Inf" | "-inf" => f64::NEG_INFINITY,
        "NaN" | "nan" => f64::NAN,
        _ => s.parse()?,
    })
}

/// HTTP GET of a plain `http://` URL (`Accept: text/plain`); returns the body.
/// Fails unless the status is 200 (the error names the status and starts with the body),
/// when the body is not UTF-8, or when the whole request (connect, send, read the body)
/// takes longer than `timeout`. Redirects are not followed and proxies are not used.
pub fn http_get(url: &str, timeout: Duration) -> Result<String> {
    http_get_accept(url, "text/plain", timeout)
}

/// `http_get` with this `Accept` header (e.g. OpenMetrics).
pub fn http_get_accept(url: &str, accept: &str, timeout: Duration) -> Result<String> {
    ensure!(
        url.starts_with("http://"),
        "only http:// URLs are supported: {url}"
    );
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(timeout))
        // 4xx/5xx come back as responses so that their body can go into the error.
        .http_status_as_error(false)
        .max_redirects(0)
        .proxy(None)
        .build()
        .into();
    let get = || -> Result<String> {
        let mut resp = agent.get(url).header("Accept", accept).call()?;
        let status = resp.status();
        // Not `Body::read_to_string`: that one replaces invalid UTF-8 and stops at 10 MB.
        let body = resp
            .body_mut()
            .with_config()
            .read_to_string()
            .context("reading the body")?;
        ensure!(
            status == 200,
            "HTTP status {status}: {}",
            body.chars().take(500).collect::<String>()
        );
        Ok(body)
    };
    get().with_context(|| format!("GET {url}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = r#"# HELP pgio_block_io_latency_seconds Block IO latency.
# TYPE pgio_block_io_latency_seconds histogram
pgio_block_io_latency_seconds_bucket{device="loop3",op="read",le="0.001"} 10
pgio_block_io_latency_seconds_bucket{device="loop3",op="read",le="0.01"} 25
pgio_block_io_latency_seconds_bucket{device="loop3",op="read",le="+Inf"} 30
pgio_block_io_latency_seconds_sum{device="loop3",op="read"} 0.25
pgio_block_io_latency_seconds_count{device="loop3",op="read"} 30
pgio_block_io_latency_seconds_bucket{device="loop4",op="read",le="0.001"} 1
pgio_block_io_latency_seconds_bucket{device="loop4",op="read",le="0.01"} 2
pgio_block_io_latency_seconds_bucket{device="loop4",op="read",le="+Inf"} 2 # {trace_id="x"} 0.002 1.7e9
pgio_block_io_latency_seconds_sum{device="loop4",op="read"} 0.01
pgio_block_io_latency_seconds_count{device="loop4",op="read"} 2
odd{path="a\\b \"q\"\nz", empty="",} 1.5e3 1712345678000
up 1
# EOF
"#;

    #[test]
    fn parses_and_queries() {
        let m = Metrics::parse(TEXT).unwrap();
        assert_eq!(
            m.metric_type("pgio_block_io_latency_seconds"),
            Some("histogram")
        );
        let name = "pgio_block_io_latency_seconds_count";
        assert_eq!(m.sum(name, &[]), 32.0);
        assert_eq!(m.sum(name, &[("device", "loop3")]), 30.0);
        assert_eq!(m.sum(name, &[("device", "loop3"), ("op", "write")]), 0.0);
        assert_eq!(m.samples("up").count(), 1);
        let odd = m.samples("odd").next().unwrap();
        assert_eq!(odd.labels["path"], "a\\b \"q\"\nz");
        assert_eq!(odd.labels["empty"], "");
        assert_eq!(odd.value, 1500.0);
        let inf = m.matching("pgio_block_io_latency_seconds_bucket", &[("le", "+Inf")]);
        assert_eq!(inf.map(|s| s.value).sum::<f64>(), 32.0);
    }

    #[test]
    fn aggregates_histograms() {
        let m = Metrics::parse(TEXT).unwrap();
        let h = m
            .histogram("pgio_block_io_latency_seconds", &[("op", "read")])
            .unwrap();
        assert_eq!(
            h.buckets,
            vec![(0.001, 11.0), (0.01, 27.0), (f64::INFINITY, 32.0)]
        );
        assert_eq!((h.sum, h.count), (0.26, 32.0));
        assert_eq!(h.count_le(0.005), 11.0);
        assert_eq!(h.count_le(0.0001), 0.0);
    }

    #[test]
    fn quantile_interpolates_like_promql() {
        let h = Histogram {
            buckets: vec![(1.0, 0.0), (2.0, 10.0), (4.0, 20.0), (f64::INFINITY, 20.0)],
            sum: 0.0,
            count: 20.0,
        };
        assert_eq!(h.quantile(0.5), Some(2.0));
        assert_eq!(h.quantile(0.25), Some(1.5));
        assert_eq!(h.quantile(0.75), Some(3.0));
        let before = Histogram {
            buckets: vec![(1.0, 0.0), (2.0, 10.0), (4.0, 10.0), (f64::INFINITY, 10.0)],
            sum: 0.0,
            count: 10.0,
        };
        let d = h.since(&before);
        assert_eq!(d.count, 10.0);
        assert_eq!(d.quantile(0.5), Some(3.0));
        assert_eq!(Histogram::default().quantile(0.5), None);
    }

    #[test]
    fn rejects_garbage() {
        assert!(Metrics::parse("foo{a=\"x} 1").is_err());
        assert!(Metrics::parse("foo{a=x} 1").is_err());
        assert!(Metrics::parse("foo bar").is_err());
        assert!(Metrics::parse("foo").is_err());
    }

    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};
    use std::thread::JoinHandle;
    use std::time::Instant;

    /// Reads a request up to its blank line (it may arrive in several segments).
    fn read_request(conn: &mut TcpStream) -> String {
        let mut req = Vec::new();
        let mut buf = [0u8; 1024];
        while !req.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = conn.read(&mut buf).unwrap();
            assert!(n > 0, "client closed before the end of its request");
            req.extend_from_slice(&buf[..n]);
        }
        String::from_utf8(req).unwrap()
    }

    /// A server on 127.0.0.1 answering one request with `response`, then closing;
    /// joining it gives the request head.
    fn serve_once(response: &'static [u8]) -> (String, JoinHandle<String>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (mut conn, _) = listener.accept().unwrap();
            let req = read_request(&mut conn);
            conn.write_all(response).unwrap();
            req
        });
        (format!("http://{addr}"), server)
    }

    #[test]
    fn scrapes_a_local_server() {
        let (url, server) = serve_once(
            b"HTTP/1.1 200 OK\r\nContent-Length: 34\r\n\r\nx_total{a=\"1\"} 3\nx_total{a=\"2\"} 4\n",
        );
        let m = scrape(&format!("{url}/metrics")).unwrap();
        let req = server.join().unwrap();
        assert!(req.starts_with("GET /metrics HTTP/1.1\r\n"), "{req:?}");
        assert!(
            req.to_ascii_lowercase()
                .contains("\r\naccept: text/plain\r\n"),
            "{req:?}"
        );
        assert_eq!(m.sum("x_total", &[]), 7.0);
    }

    #[test]
    fn reads_chunked_bodies_with_the_asked_accept() {
        let (url, server) = serve_once(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nup 1\r\n1;ext=1\r\n\n\r\n6\r\n# EOF\n\r\n0\r\n\r\n",
        );
        let om = "application/openmetrics-text; version=1.0.0";
        let body = http_get_accept(&format!("{url}/metrics"), om, Duration::from_secs(5)).unwrap();
        let req = server.join().unwrap();
        assert_eq!(body, "up 1\n# EOF\n");
        assert!(
            req.to_ascii_lowercase()
                .contains(&format!("\r\naccept: {om}\r\n")),
            "{req:?}"
        );
    }

    #[test]
    fn fails_on_other_statuses_with_the_body() {
        let (url, server) = serve_once(
            b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\n\r\n{\"status\":\"error\",\"error\":\"bad query\"}",
        );
        let e = http_get(&format!("{url}/api/v1/query"), Duration::from_secs(5)).unwrap_err();
        server.join().unwrap();
        let msg = format!("{e:#}");
        assert!(msg.contains("400"), "{msg}");
        assert!(msg.contains("bad query"), "{msg}");
        // Redirects are reported, not followed.
        let (url, server) =
            serve_once(b"HTTP/1.1 302 Found\r\nLocation: /elsewhere\r\nContent-Length: 0\r\n\r\n");
        let e = http_get(&url, Duration::from_secs(5)).unwrap_err();
        server.join().unwrap();
        assert!(format!("{e:#}").contains("302"), "{e:#}");
    }

    #[test]
    fn fails_on_non_utf8_bodies() {
        let (url, server) = serve_once(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: 4\r\n\r\nup \xff");
        let e = http_get(&url, Duration::from_secs(5)).unwrap_err();
        server.join().unwrap();
        assert!(format!("{e:#}").contains("UTF-8"), "{e:#}");
    }

    #[test]
    fn the_timeout_covers_the_whole_request() {
        // Headers at once, then a byte every 50 ms: no single read waits long, but the
        // request as a whole does not finish.
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (mut conn, _) = listener.accept().unwrap();
            read_request(&mut conn);
            conn.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n")
                .unwrap();
            for _ in 0..200 {
                if conn.write_all(b"x").is_err() {
                    break; // the client gave up and closed
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        let t = Instant::now();
        let r = http_get(&format!("http://{addr}/"), Duration::from_millis(300));
        let took = t.elapsed();
        let msg = format!("{:#}", r.unwrap_err());
        assert!(msg.contains("timeout"), "{msg}");
        assert!(took < Duration::from_secs(3), "took {took:?}");
        server.join().unwrap();
    }
}
