//! `--web-config-file` against the real daemon, with a self-signed certificate made at test
//! time (rcgen) and a rustls client that trusts only it:
//! - /metrics over TLS answers 200 with pgio's metrics; plain HTTP on the TLS port gets no HTTP
//!   answer and is counted as a failed handshake;
//! - a connection that never sends a ClientHello, or stops within one, is closed after
//!   `http_header_timeout_secs`, and such connections count against `http_max_connections`;
//! - basic auth: no, wrong or unknown credentials 401 with `WWW-Authenticate: Basic`, right
//!   ones 200, one bcrypt per distinct password (not per scrape), /healthz open; a flood of
//!   wrong passwords is turned away with 429 while a known scraper still gets in at once;
//! - bad web configs (missing key file, unknown key, key of another certificate, plain password)
//!   exit 2 naming the file and what is wrong.
use std::{
    io::{ErrorKind, Read, Write},
    net::TcpStream,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::Arc,
    time::{Duration, Instant},
};

use base64::Engine as _;
use pgio_testkit::{Metrics, TempDir, daemon::free_port, require_root, temp_dir, wait_until};
use rustls::{
    ClientConfig, ClientConnection, RootCertStore, StreamOwned,
    pki_types::{CertificateDer, ServerName, pem::PemObject as _},
};

const BIN: &str = env!("CARGO_BIN_EXE_pgio-daemon");

/// A self-signed certificate for 127.0.0.1 and its key, as PEM files in `dir`.
struct Cert {
    cert: PathBuf,
    key: PathBuf,
}

fn make_cert(dir: &Path, name: &str) -> Cert {
    let ck = rcgen::generate_simple_self_signed(vec!["127.0.0.1".into(), "localhost".into()])
        .expect("self-signed certificate");
    let cert = dir.join(format!("{name}.crt"));
    let key = dir.join(format!("{name}.key"));
    std::fs::write(&cert, ck.cert.pem()).expect("write cert");
    std::fs::write(&key, ck.signing_key.serialize_pem()).expect("write key");
    Cert { cert, key }
}

fn tls_client(cert: &Path) -> Arc<ClientConfig> {
    let mut roots = RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_file(cert).expect("read cert"))
        .expect("trust cert");
    Arc::new(
        ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_root_certificates(roots)
            .with_no_client_auth(),
    )
}

struct Response {
    status: u16,
    headers: String,
    body: String,
}

/// One GET over its own TLS connection (`Connection: close`).
fn https_get(
    client: &Arc<ClientConfig>,
    port: u16,
    path: &str,
    auth: Option<(&str, &str)>,
) -> anyhow::Result<Response> {
    let tcp = TcpStream::connect(("127.0.0.1", port))?;
    tcp.set_read_timeout(Some(Duration::from_secs(10)))?;
    tcp.set_write_timeout(Some(Duration::from_secs(10)))?;
    let name = ServerName::try_from("127.0.0.1")?;
    let mut tls = StreamOwned::new(ClientConnection::new(client.clone(), name)?, tcp);
    let authorization = auth
        .map(|(u, p)| {
            let b64 = base64::engine::general_purpose::STANDARD.encode(format!("{u}:{p}"));
            format!("Authorization: Basic {b64}\r\n")
        })
        .unwrap_or_default();
    write!(
        tls,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n{authorization}\r\n"
    )?;
    let mut raw = Vec::new();
    if let Err(e) = tls.read_to_end(&mut raw) {
        // A peer that closes without close_notify: keep what arrived.
        if raw.is_empty() || e.kind() != ErrorKind::UnexpectedEof {
            return Err(e.into());
        }
    }
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| anyhow::anyhow!("no HTTP head in {text:?}"))?;
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no status in {head:?}"))?;
    Ok(Response {
        status,
        headers: head.to_ascii_lowercase(),
        body: body.to_owned(),
    })
}

/// The daemon with a web config, stopped with SIGTERM (killed if it lingers) when dropped.
struct WebDaemon {
    child: Child,
    port: u16,
    client: Arc<ClientConfig>,
    auth: Option<(&'static str, &'static str)>,
    log: PathBuf,
}

impl WebDaemon {
    fn start(
        dir: &Path,
        config_toml: &str,
        web_yaml: &str,
        cert: &Path,
        auth: Option<(&'static str, &'static str)>,
    ) -> WebDaemon {
        let config = dir.join("pgio.toml");
        let web = dir.join("web.yml");
        std::fs::write(&config, config_toml).expect("write config");
        std::fs::write(&web, web_yaml).expect("write web config");
        let port = free_port().expect("port");
        let log = dir.join("pgio.log");
        let child = Command::new(BIN)
            .args(["run", "--listen", &format!("127.0.0.1:{port}"), "--config"])
            .arg(&config)
            .arg("--web-config-file")
            .arg(&web)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log file"))
            .spawn()
            .expect("spawn daemon");
        let mut d = WebDaemon {
            child,
            port,
            client: tls_client(cert),
            auth,
            log,
        };
        // /healthz is open even with basic auth: no credentials here.
        let up = wait_until(Duration::from_secs(60), Duration::from_millis(100), || {
            https_get(&d.client, port, "/healthz", None).is_ok_and(|r| r.status == 200)
        });
        if !up {
            let status = d.child.try_wait();
            panic!(
                "daemon not up over TLS ({status:?}); log:\n{}",
                d.log_text()
            );
        }
        d
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn get(&self, path: &str, auth: Option<(&str, &str)>) -> Response {
        https_get(&self.client, self.port, path, auth).expect("HTTPS GET")
    }

    fn scrape(&self) -> Metrics {
        let r = self.get("/metrics", self.auth);
        assert_eq!(r.status, 200, "{}", r.body);
        Metrics::parse(&r.body).expect("parse /metrics")
    }
}

impl Drop for WebDaemon {
    fn drop(&mut self) {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        let exited = wait_until(Duration::from_secs(20), Duration::from_millis(50), || {
            matches!(self.child.try_wait(), Ok(Some(_)))
        });
        if !exited {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        if std::thread::panicking() {
            eprintln!("pgio-daemon log:\n{}", self.log_text());
        }
    }
}

/// Sockets among the daemon's fds.
fn sockets(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| {
            d.filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
                .filter(|l| l.to_string_lossy().starts_with("socket:"))
                .count()
        })
        .unwrap_or(0)
}

/// Whether the peer closed `s` (EOF or reset); false if nothing happens within `wait`.
fn closed_by_peer(s: &mut TcpStream, wait: Duration) -> bool {
    s.set_read_timeout(Some(wait)).expect("read timeout");
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return false;
            }
            Err(_) => return true,
        }
    }
}

const CAP: usize = 4;

#[test]
fn tls_serves_metrics_and_cuts_silent_handshakes() {
    if !require_root("tls_serves_metrics_and_cuts_silent_handshakes") {
        return;
    }
    let dir = temp_dir().expect("temp dir");
    let cert = make_cert(dir.path(), "tls");
    // Relative paths: relative to the web config's directory.
    let d = WebDaemon::start(
        dir.path(),
        &format!("http_header_timeout_secs = 1\nhttp_max_connections = {CAP}\n"),
        "tls_server_config:\n  cert_file: tls.crt\n  key_file: tls.key\n",
        &cert.cert,
        None,
    );
    let m = d.scrape();
    assert_eq!(m.metric_type("pgio_http_connections"), Some("gauge"));
    assert_eq!(m.sum("pgio_http_tls_handshake_failures_total", &[]), 0.0);

    // Plain HTTP on the TLS port: no HTTP answer, the connection closed, counted.
    let mut plain = TcpStream::connect(("127.0.0.1", d.port)).expect("connect");
    plain
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        .expect("write");
    plain
        .set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let mut answer = Vec::new();
    let _ = plain.read_to_end(&mut answer);
    assert!(
        !answer.starts_with(b"HTTP/"),
        "plain HTTP answered: {:?}",
        String::from_utf8_lossy(&answer)
    );
    let failures = d
        .scrape()
        .sum("pgio_http_tls_handshake_failures_total", &[]);
    assert_eq!(failures, 1.0, "handshake failures after one plain request");

    // Connections that never finish a handshake: half send nothing, half stop inside the
    // TLS record header of a ClientHello. Twice the cap of them.
    let pid = d.child.id();
    let before = sockets(pid);
    let timeouts_before = d.scrape().sum(
        "pgio_http_connections_closed_total",
        &[("reason", "header_timeout")],
    );
    let opened = Instant::now();
    let mut stalled: Vec<TcpStream> = (0..2 * CAP)
        .map(|i| {
            let mut s = TcpStream::connect(("127.0.0.1", d.port)).expect("connect");
            if i % 2 == 1 {
                s.write_all(&[0x16, 0x03, 0x01, 0x02])
                    .expect("partial record");
            }
            s
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let during = sockets(pid);
    let mut closed_at = vec![None; stalled.len()];
    let all_closed = wait_until(Duration::from_secs(5), Duration::from_millis(20), || {
        for (s, at) in stalled.iter_mut().zip(closed_at.iter_mut()) {
            if at.is_none() && closed_by_peer(s, Duration::from_millis(1)) {
                *at = Some(opened.elapsed());
            }
        }
        closed_at.iter().all(Option::is_some)
    });
    let last = closed_at.iter().flatten().max().copied();
    let m = d.scrape();
    let timeouts = m.sum(
        "pgio_http_connections_closed_total",
        &[("reason", "header_timeout")],
    ) - timeouts_before;
    let evicted = m.sum(
        "pgio_http_connections_closed_total",
        &[("reason", "evicted")],
    );
    let rejected = m.sum("pgio_http_connections_rejected_total", &[]);
    eprintln!(
        "sockets {before} before, {during} with {} stalled (cap {CAP}); all closed {all_closed}, \
         last after {last:?}; header time-outs {timeouts}, evicted {evicted}, rejected {rejected}",
        stalled.len()
    );
    assert!(
        during <= before + CAP + 1,
        "{during} sockets (cap {CAP}, {before} before)"
    );
    assert!(all_closed, "stalled handshakes still open: {closed_at:?}");
    let last = last.unwrap_or_default();
    assert!(
        last >= Duration::from_millis(900) && last < Duration::from_millis(2500),
        "last stalled handshake closed after {last:?}, header time-out 1 s"
    );
    // Past the cap they were evicted or refused; the rest timed out.
    assert!(
        evicted + rejected >= CAP as f64,
        "evicted {evicted} + rejected {rejected}"
    );
    assert!(
        (1.0..=CAP as f64 + 1.0).contains(&timeouts),
        "{timeouts} header time-outs"
    );
    assert!(sockets(pid) <= before, "sockets left open");
}

#[test]
fn basic_auth_over_tls() {
    if !require_root("basic_auth_over_tls") {
        return;
    }
    let dir = temp_dir().expect("temp dir");
    let cert = make_cert(dir.path(), "tls");
    // Cost 12 (~0.25 s per check): a bcrypt per scrape would show in the timings below.
    let hash = bcrypt::hash("s3cret", 12).expect("bcrypt");
    let right = ("prometheus", "s3cret");
    let d = WebDaemon::start(
        dir.path(),
        "",
        &format!(
            "tls_server_config:\n  cert_file: {}\n  key_file: {}\n  min_version: TLS12\nbasic_auth_users:\n  prometheus: '{hash}'\n",
            cert.cert.display(),
            cert.key.display()
        ),
        &cert.cert,
        Some(right),
    );

    let unauthorized = |r: &Response, what: &str| {
        assert_eq!(r.status, 401, "{what}: {}", r.body);
        assert!(
            r.headers.contains("\r\nwww-authenticate: basic"),
            "{what}: {}",
            r.headers
        );
        assert!(!r.body.contains("pgio_"), "{what}: metrics leaked");
    };
    unauthorized(&d.get("/metrics", None), "no credentials");
    unauthorized(&d.get("/metrics", Some(("prometheus", "wrong"))), "wrong");
    unauthorized(
        &d.get("/metrics", Some(("nobody", "s3cret"))),
        "unknown user",
    );
    unauthorized(&d.get("/other", None), "unknown path");
    assert_eq!(d.get("/other", Some(right)).status, 404);
    assert_eq!(d.get("/healthz", None).status, 200);

    let t = Instant::now();
    let m = d.scrape();
    let first = t.elapsed();
    let t = Instant::now();
    for _ in 0..20 {
        d.scrape();
    }
    let twenty = t.elapsed();
    let m2 = d.scrape();
    let verifications = m2.sum("pgio_http_auth_verifications_total", &[]);
    eprintln!("first authorized scrape {first:?}, 20 more {twenty:?}; {verifications} bcrypt runs");
    assert!(m.metric_type("pgio_http_connections").is_some());
    // wrong, unknown user, and the right password once (/other with credentials came first).
    assert_eq!(verifications, 3.0, "bcrypt runs");
    assert_eq!(
        m2.sum("pgio_http_auth_failures_total", &[("reason", "missing")]),
        2.0
    );
    assert_eq!(
        m2.sum("pgio_http_auth_failures_total", &[("reason", "wrong")]),
        2.0
    );
    assert!(
        twenty < Duration::from_secs(3),
        "20 scrapes with a remembered password took {twenty:?}"
    );

    // A flood of wrong passwords: most are turned away at once (429), bcrypt runs stay few,
    // and the remembered scraper gets in meanwhile.
    const FLOOD: usize = 24;
    let flood: Vec<_> = (0..FLOOD)
        .map(|i| {
            let client = d.client.clone();
            let port = d.port;
            std::thread::spawn(move || {
                https_get(
                    &client,
                    port,
                    "/metrics",
                    Some(("prometheus", &format!("x{i}"))),
                )
                .map(|r| r.status)
                .unwrap_or(0)
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(100));
    let t = Instant::now();
    let during = d.get("/metrics", Some(right));
    let scrape_during = t.elapsed();
    let statuses: Vec<u16> = flood
        .into_iter()
        .map(|h| h.join().expect("flood thread"))
        .collect();
    let busy = statuses.iter().filter(|&&s| s == 429).count();
    let denied = statuses.iter().filter(|&&s| s == 401).count();
    let m3 = d.scrape();
    let ran = m3.sum("pgio_http_auth_verifications_total", &[]) - verifications;
    eprintln!(
        "flood of {FLOOD}: {denied} × 401, {busy} × 429, {ran} bcrypt runs; \
         remembered scraper answered {} in {scrape_during:?}",
        during.status
    );
    assert_eq!(during.status, 200);
    assert!(scrape_during < Duration::from_secs(1), "{scrape_during:?}");
    assert_eq!(busy + denied, FLOOD, "{statuses:?}");
    assert!(busy >= 1, "no request turned away: {statuses:?}");
    assert_eq!(ran as usize, denied, "one bcrypt per 401");
    assert_eq!(
        m3.sum("pgio_http_auth_failures_total", &[("reason", "busy")]),
        busy as f64
    );
}

/// `pgio-daemon run` with this web config (path, or env when `via_env`): exit code and stderr.
fn run_with_web_config(dir: &TempDir, yaml: &str, via_env: bool) -> (Option<i32>, String) {
    let web = dir.path().join("web.yml");
    std::fs::write(&web, yaml).expect("write web config");
    let err = dir.path().join("stderr");
    let mut cmd = Command::new(BIN);
    cmd.args(["run", "--listen", "127.0.0.1:0"]);
    if via_env {
        cmd.env("PGIO_WEB_CONFIG_FILE", &web);
    } else {
        cmd.arg("--web-config-file").arg(&web);
    }
    let mut child = cmd
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&err).expect("stderr file"))
        .spawn()
        .expect("spawn");
    // A daemon that took the config would run until stopped.
    let exited = wait_until(Duration::from_secs(10), Duration::from_millis(20), || {
        matches!(child.try_wait(), Ok(Some(_)))
    });
    if !exited {
        let _ = child.kill();
    }
    let status = child.wait().expect("wait");
    (
        status.code(),
        std::fs::read_to_string(&err).unwrap_or_default(),
    )
}

#[test]
fn bad_web_configs_exit_2_naming_the_file() {
    let dir = temp_dir().expect("temp dir");
    let a = make_cert(dir.path(), "a");
    let b = make_cert(dir.path(), "b");
    let web = dir.path().join("web.yml").display().to_string();
    let cases = [
        (
            format!(
                "tls_server_config:\n  cert_file: {}\n  key_file: missing.key\n",
                a.cert.display()
            ),
            false,
            format!(
                "key_file {}: cannot read: No such file",
                dir.path().join("missing.key").display()
            ),
        ),
        (
            "tls_server_config:\n  cert_file: a.crt\n  key_file: a.key\n  cipher_suites: [TLS_AES_128_GCM_SHA256]\n"
                .to_owned(),
            false,
            "unknown field `cipher_suites`".to_owned(),
        ),
        (
            format!(
                "tls_server_config:\n  cert_file: {}\n  key_file: {}\n",
                a.cert.display(),
                b.key.display()
            ),
            false,
            "does not match the certificate".to_owned(),
        ),
        (
            "basic_auth_users:\n  prometheus: s3cret\n".to_owned(),
            true,
            "user \"prometheus\": not a bcrypt hash".to_owned(),
        ),
    ];
    for (yaml, via_env, want) in cases {
        let (code, stderr) = run_with_web_config(&dir, &yaml, via_env);
        eprintln!("{want}: exit {code:?}: {}", stderr.trim());
        assert_eq!(code, Some(2), "{yaml}: {stderr}");
        assert!(
            stderr.contains(&format!("invalid web config: {web}: ")),
            "{yaml}: {stderr}"
        );
        assert!(stderr.contains(&want), "{yaml}: want {want:?}: {stderr}");
    }
}
