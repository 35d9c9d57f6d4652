//! `--web-config-file` against the real daemon, with a self-signed certificate made at test
//! time (rcgen) and a rustls client that trusts only it:
//! - /metrics over TLS answers 200 with pgio's metrics; plain HTTP on the TLS port gets no HTTP
//!   answer and is counted as a failed handshake;
//! - a connection that never sends a ClientHello, or stops within one, is closed after
//!   `http_header_timeout_secs`, and such connections count against `http_max_connections`;
//! - basic auth: no, wrong or unknown credentials 401 with `WWW-Authenticate: Basic`, right
//!   ones 200, one bcrypt per distinct password (not per scrape), /healthz open; a flood of
//!   wrong passwords is turned away with 429 while a known scraper still gets in at once;
//! - exporter-toolkit's `cipher_suites`, `curve_preferences`, `prefer_server_cipher_suites`
//!   are honoured (the handshake negotiates the one suite and curve allowed), `http2: false`
//!   accepted, `http2: true` refused;
//! - the certificate and key, swapped under the running daemon the way a Kubernetes secret
//!   volume swaps them (one symlink renamed), are served from the next handshakes; a broken
//!   pair swapped in is counted and the last good one still served;
//! - bad web configs (missing key file, unknown key, key of another certificate, plain password)
//!   exit 2 naming the file and what is wrong;
//! - `pgio-daemon top` over HTTPS with basic auth counts a load's reads exactly; a CA that did
//!   not sign the certificate, a host the certificate is not for, no or a wrong password each
//!   fail naming the problem.
use std::{
    io::{ErrorKind, Read, Write},
    net::TcpStream,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::Arc,
    time::{Duration, Instant},
};

use base64::Engine as _;
use pgio_testkit::{
    LoadProcess, Metrics, TempDir, daemon::free_port, pgio_load_bin, require_root, serde_json,
    temp_dir, wait_until,
};
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
    make_cert_for(dir, name, &["127.0.0.1", "localhost"])
}

fn make_cert_for(dir: &Path, name: &str, names: &[&str]) -> Cert {
    let names = names.iter().map(|n| n.to_string()).collect::<Vec<_>>();
    let ck = rcgen::generate_simple_self_signed(names).expect("self-signed certificate");
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

/// `link` (a symlink) now points at `target`, in one rename, as the kubelet swaps a secret
/// volume's `..data`.
fn swap_symlink(link: &Path, target: &str) {
    let tmp = link.with_extension("new");
    let _ = std::fs::remove_file(&tmp);
    std::os::unix::fs::symlink(target, &tmp).expect("symlink");
    std::fs::rename(&tmp, link).expect("rename over the symlink");
}

#[test]
fn certificate_is_read_again_when_its_files_change() {
    if !require_root("certificate_is_read_again_when_its_files_change") {
        return;
    }
    let dir = temp_dir().expect("temp dir");
    for d in ["a", "b", "broken"] {
        std::fs::create_dir(dir.path().join(d)).expect("mkdir");
    }
    let a = make_cert(&dir.path().join("a"), "tls");
    let b = make_cert(&dir.path().join("b"), "tls");
    // A pair whose key is not the certificate's: the certificate of b, the key of a.
    std::fs::copy(&b.cert, dir.path().join("broken/tls.crt")).expect("copy");
    std::fs::copy(&a.key, dir.path().join("broken/tls.key")).expect("copy");
    let current = dir.path().join("current");
    swap_symlink(&current, "a");
    // With exporter-toolkit's other keys, honoured: one TLS 1.2 suite, one curve.
    let d = WebDaemon::start(
        dir.path(),
        "",
        "tls_server_config:\n  cert_file: current/tls.crt\n  key_file: current/tls.key\n  \
         max_version: TLS12\n  cipher_suites: [TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305]\n  \
         curve_preferences: [CurveP384]\n  prefer_server_cipher_suites: true\n\
         http_server_config:\n  http2: false\n",
        &a.cert,
        None,
    );
    let (trusts_a, trusts_b) = (tls_client(&a.cert), tls_client(&b.cert));
    let tcp = TcpStream::connect(("127.0.0.1", d.port)).expect("connect");
    let name = ServerName::try_from("127.0.0.1").expect("name");
    let mut tls = StreamOwned::new(
        ClientConnection::new(trusts_a.clone(), name).expect("client"),
        tcp,
    );
    tls.write_all(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        .expect("request");
    let mut answer = Vec::new();
    let _ = tls.read_to_end(&mut answer);
    let suite = tls
        .conn
        .negotiated_cipher_suite()
        .and_then(|s| s.suite().as_str());
    let group = tls.conn.negotiated_key_exchange_group().map(|g| g.name());
    eprintln!("negotiated {suite:?} over {group:?}");
    assert_eq!(suite, Some("TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256"));
    assert_eq!(group, Some(rustls::NamedGroup::secp384r1));
    let serves = |client: &Arc<ClientConfig>| {
        https_get(client, d.port, "/healthz", None).is_ok_and(|r| r.status == 200)
    };
    // Scraped with the client that trusts the certificate served at that point.
    let reloads_by = |client: &Arc<ClientConfig>, result: &str| {
        let r = https_get(client, d.port, "/metrics", None).expect("/metrics");
        Metrics::parse(&r.body).expect("parse /metrics").sum(
            "pgio_http_tls_certificate_reloads_total",
            &[("result", result)],
        )
    };
    assert!(
        serves(&trusts_a) && !serves(&trusts_b),
        "serving a at start"
    );
    let reloads = |result: &str| reloads_by(&trusts_a, result);
    assert_eq!((reloads("ok"), reloads("failed")), (0.0, 0.0));
    let reloads = |result: &str| reloads_by(&trusts_b, result);

    swap_symlink(&current, "b");
    let t = Instant::now();
    let swapped = wait_until(Duration::from_secs(5), Duration::from_millis(100), || {
        serves(&trusts_b)
    });
    eprintln!("certificate b served {:?} after the swap", t.elapsed());
    assert!(swapped, "still not serving b 5 s after the swap");
    // A new client: one that has talked to the server before resumes its TLS session without
    // a certificate.
    assert!(!serves(&tls_client(&a.cert)), "a served after b");
    assert_eq!((reloads("ok"), reloads("failed")), (1.0, 0.0));

    // A broken pair: counted, logged, and b still served.
    swap_symlink(&current, "broken");
    let counted = wait_until(Duration::from_secs(5), Duration::from_millis(100), || {
        serves(&trusts_b) && reloads("failed") == 1.0
    });
    assert!(
        counted,
        "a broken pair swapped in: failed {}",
        reloads("failed")
    );
    assert!(serves(&trusts_b), "b no longer served after a broken pair");
    assert_eq!(reloads("ok"), 1.0);
    assert!(
        d.log_text().contains("does not match the certificate"),
        "the log does not say why: {}",
        d.log_text()
    );
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
    // The daemon closes the last scrape's connection a moment after the client read it.
    let settled = wait_until(Duration::from_secs(3), Duration::from_millis(20), || {
        sockets(pid) <= before
    });
    assert!(settled, "sockets left open: {} > {before}", sockets(pid));
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
            "cipher_suites (line 4): TLS_AES_128_GCM_SHA256 is not a TLS 1.2 suite pgio offers"
                .to_owned(),
        ),
        (
            "http_server_config:\n  http2: true\n".to_owned(),
            false,
            "http_server_config: http2 (line 2): pgio serves HTTP/1.1 only".to_owned(),
        ),
        (
            "tls_server_config:\n  cert_file: a.crt\n  key_file: a.key\n  ciphers: []\n"
                .to_owned(),
            false,
            "unknown field `ciphers`".to_owned(),
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

/// `pgio-daemon top` with these args (and `PGIO_TOP_PASSWORD` when given).
fn top(args: &[&str], password: Option<&str>) -> Command {
    let mut c = Command::new(BIN);
    c.arg("top").args(args).stdin(Stdio::null());
    c.env_remove("PGIO_TOP_PASSWORD");
    if let Some(p) = password {
        c.env("PGIO_TOP_PASSWORD", p);
    }
    c
}

/// Exit code and stderr of a `top --once` that should fail.
fn top_fails(args: &[&str], password: Option<&str>) -> (Option<i32>, String) {
    let out = top(args, password).output().expect("top");
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    eprintln!(
        "top {}: {:?}: {}",
        args.join(" "),
        out.status.code(),
        err.trim()
    );
    (out.status.code(), err)
}

#[test]
fn top_over_tls_with_basic_auth() {
    if !require_root("top_over_tls_with_basic_auth") {
        return;
    }
    const READS: u64 = 2_000;
    let dir = temp_dir().expect("temp dir");
    // For the address only: https://localhost/ is then a name it does not hold.
    let cert = make_cert_for(dir.path(), "tls", &["127.0.0.1"]);
    let stranger = make_cert(dir.path(), "stranger");
    let named_ca = {
        let mut params =
            rcgen::CertificateParams::new(vec!["127.0.0.1".to_owned()]).expect("params");
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "some other CA");
        let key = rcgen::KeyPair::generate().expect("key");
        let cert = params.self_signed(&key).expect("self-signed CA");
        let path = dir.path().join("other-ca.crt");
        std::fs::write(&path, cert.pem()).expect("write CA");
        path
    };
    let data = dir.path().join("data");
    std::fs::write(&data, vec![7u8; 1 << 20]).expect("data file");
    let hash = bcrypt::hash("s3cret", 4).expect("bcrypt");
    let d = WebDaemon::start(
        dir.path(),
        &format!(
            "[[rule]]\napp = \"test\"\nrole = \"tls\"\ncomm = \"^pgio-load$\"\ncmdline = \"{} \"\n",
            data.display()
        ),
        &format!(
            "tls_server_config:\n  cert_file: tls.crt\n  key_file: tls.key\nbasic_auth_users:\n  prometheus: '{hash}'\n"
        ),
        &cert.cert,
        Some(("prometheus", "s3cret")),
    );
    let url = format!("https://127.0.0.1:{}/metrics", d.port);
    let ca = cert.cert.display().to_string();

    let mut load = LoadProcess::spawn(
        &pgio_load_bin().expect("pgio-load"),
        [
            "pread",
            data.to_str().expect("utf-8"),
            &READS.to_string(),
            "0",
        ],
    )
    .expect("spawn pgio-load");
    let tracked = wait_until(Duration::from_secs(10), Duration::from_millis(50), || {
        d.scrape().sum(
            "pgio_tracked_processes",
            &[("app", "test"), ("role", "tls")],
        ) >= 1.0
    });
    assert!(tracked, "pgio-load not tracked; log:\n{}", d.log_text());
    let child = top(
        &[
            "--once",
            "--json",
            "--interval",
            "3",
            "--url",
            &url,
            "--ca-file",
            &ca,
            "--user",
            "prometheus",
            "--app",
            "test",
            "--metric",
            "syscall",
        ],
        Some("s3cret"),
    )
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .expect("spawn top");
    // top scrapes at once, then after 3 s: the reads run in between.
    std::thread::sleep(Duration::from_millis(1000));
    assert_eq!(load.expect_run(), READS);
    let out = child.wait_with_output().expect("top");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    let pread = j["rows"]
        .as_array()
        .expect("rows")
        .iter()
        .find(|r| r["metric"] == "syscall" && r["labels"]["syscall"] == "pread64")
        .unwrap_or_else(|| panic!("no pread64 row: {j}"));
    eprintln!(
        "top over https + basic auth: pread64 count {}",
        pread["count"]
    );
    assert_eq!(pread["count"].as_u64(), Some(READS));

    // --insecure: no verification, still the password.
    let out = top(
        &[
            "--once",
            "--json",
            "--interval",
            "0.2",
            "--url",
            &url,
            "--insecure",
            "--user",
            "prometheus",
        ],
        Some("s3cret"),
    )
    .output()
    .expect("top --insecure");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // CAs that did not sign the daemon's certificate: one of another name, one of the same
    // name (rcgen names every simple self-signed certificate alike).
    for (ca_pem, problem) in [
        (
            named_ca.display().to_string(),
            "it is not signed by a trusted CA (unknown issuer)",
        ),
        (
            stranger.cert.display().to_string(),
            "the trusted CA of its issuer's name did not sign it (bad signature)",
        ),
    ] {
        let (code, err) = top_fails(
            &[
                "--once",
                "--url",
                &url,
                "--ca-file",
                &ca_pem,
                "--user",
                "prometheus",
            ],
            Some("s3cret"),
        );
        assert_eq!(code, Some(1), "{err}");
        assert!(
            err.contains(&format!(
                "{url}: the server's TLS certificate is refused: {problem}; pass --ca-file with \
                 the CA that signed it"
            )),
            "{err}"
        );
    }
    // The right CA, a host name in the URL that the certificate does not hold.
    let (code, err) = top_fails(
        &[
            "--once",
            "--url",
            &format!("https://localhost:{}/metrics", d.port),
            "--ca-file",
            &ca,
        ],
        None,
    );
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("it is not valid for the URL's host"), "{err}");
    // No password, a wrong one, a user without one.
    let (code, err) = top_fails(&["--once", "--url", &url, "--ca-file", &ca], None);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains(&format!("{url} answered HTTP 401")) && err.contains("--user"),
        "{err}"
    );
    let (code, err) = top_fails(
        &[
            "--once",
            "--url",
            &url,
            "--ca-file",
            &ca,
            "--user",
            "prometheus",
        ],
        Some("wrong"),
    );
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("answered HTTP 401 (wrong user or password"),
        "{err}"
    );
    let (code, err) = top_fails(
        &[
            "--once",
            "--url",
            &url,
            "--ca-file",
            &ca,
            "--user",
            "prometheus",
        ],
        None,
    );
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("the password goes in PGIO_TOP_PASSWORD"),
        "{err}"
    );
    // Plain HTTP to the TLS port.
    let plain = format!("http://127.0.0.1:{}/metrics", d.port);
    let (code, err) = top_fails(&["--once", "--url", &plain], None);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains(&format!(
            "{plain} did not answer HTTP (a daemon serving HTTPS? try https://)"
        )),
        "{err}"
    );
    // The bcrypt runs: the right password once, "wrong" once.
    let verifications = d.scrape().sum("pgio_http_auth_verifications_total", &[]);
    eprintln!("bcrypt runs: {verifications}");
    assert_eq!(verifications, 2.0);
}
