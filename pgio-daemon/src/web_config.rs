//! `--web-config-file`: TLS and basic auth for the HTTP server, in the YAML of the Prometheus
//! exporter-toolkit, so one file serves pgio and the node's other exporters:
//!
//! ```yaml
//! tls_server_config:
//!   cert_file: /etc/pgio/tls/tls.crt
//!   key_file: /etc/pgio/tls/tls.key
//!   client_auth_type: RequireAndVerifyClientCert   # optional
//!   client_ca_file: /etc/pgio/tls/ca.crt           # with a verifying client_auth_type
//!   min_version: TLS12                               # optional: TLS12 (default) or TLS13
//!   max_version: TLS13                               # optional
//!   cipher_suites: [TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256]  # optional, TLS 1.2 only
//!   curve_preferences: [X25519, CurveP256]           # optional
//! http_server_config: {http2: false}                 # optional; pgio is HTTP/1.1 only
//! basic_auth_users:
//!   prometheus: $2y$10$...                           # bcrypt hash
//! ```
//!
//! Read at start, as root: the key file may be readable by root only. The certificate and key
//! are read again when their files change (`cert_reload`); the rest needs a restart. Relative
//! paths are relative to the web config file's directory.
//! Anything pgio does not do (other keys, TLS 1.0/1.1, client certificates without
//! verification, HTTP/2, extra headers) is an error naming the file, not silently ignored.
pub mod basic_auth;
pub mod cert_reload;
pub mod toolkit_keys;

use std::{
    collections::{BTreeMap, HashMap},
    path::{Path, PathBuf},
    str::FromStr as _,
    sync::{Arc, atomic::Ordering},
};

use rustls::{
    RootCertStore, ServerConfig, SupportedProtocolVersion,
    pki_types::{CertificateDer, pem::PemObject as _},
    server::WebPkiClientVerifier,
};
use serde::Deserialize;

pub use basic_auth::{BasicAuth, Verdict};
pub use cert_reload::ReloadingCert;

use crate::{
    collector::{Scrape, Snapshot, Source},
    exposition::{Encoder, Kind, MetricFamily},
    http_server::HttpStats,
    provisional::Provisional,
};

/// What the web config file asks for; `Default` is plain HTTP without auth.
#[derive(Debug, Default, Clone)]
pub struct WebConfig {
    pub tls: Option<Arc<ServerConfig>>,
    /// The certificate `tls` serves, read again when its files change.
    pub certificate: Option<Arc<ReloadingCert>>,
    pub auth: Option<Arc<BasicAuth>>,
}

#[derive(Debug, thiserror::Error)]
#[error("{path}: {message}")]
pub struct WebConfigError {
    pub path: String,
    pub message: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    tls_server_config: Option<TlsFile>,
    basic_auth_users: Option<BTreeMap<String, String>>,
    http_server_config: Option<toolkit_keys::HttpServerConfig>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TlsFile {
    cert_file: PathBuf,
    key_file: PathBuf,
    client_auth_type: Option<String>,
    client_ca_file: Option<PathBuf>,
    min_version: Option<String>,
    max_version: Option<String>,
    cipher_suites: Option<Vec<String>>,
    curve_preferences: Option<Vec<String>>,
    prefer_server_cipher_suites: Option<bool>,
}

impl WebConfig {
    pub fn load(path: &Path) -> Result<WebConfig, WebConfigError> {
        let fail = |message: String| WebConfigError {
            path: path.display().to_string(),
            message,
        };
        let text = std::fs::read_to_string(path).map_err(|e| fail(format!("cannot read: {e}")))?;
        // An empty file (or only comments) is allowed, as in exporter-toolkit: no TLS, no auth.
        let file: Option<File> = serde_yaml_ng::from_str(&text).map_err(|e| fail(e.to_string()))?;
        let Some(file) = file else {
            return Ok(WebConfig::default());
        };
        let dir = path.parent().unwrap_or(Path::new("."));
        if let Some(h) = &file.http_server_config {
            toolkit_keys::check_http_server_config(h, &text)
                .map_err(|m| fail(format!("http_server_config: {m}")))?;
        }
        let (tls, certificate) = match file.tls_server_config {
            Some(t) => {
                let (config, cert) = tls_config(&t, dir, &text)
                    .map_err(|m| fail(format!("tls_server_config: {m}")))?;
                (Some(Arc::new(config)), Some(cert))
            }
            None => (None, None),
        };
        let auth = match file.basic_auth_users {
            Some(users) if !users.is_empty() => Some(Arc::new(
                basic_auth(users).map_err(|m| fail(format!("basic_auth_users: {m}")))?,
            )),
            _ => None,
        };
        Ok(WebConfig {
            tls,
            certificate,
            auth,
        })
    }

    pub fn is_plain(&self) -> bool {
        self.tls.is_none() && self.auth.is_none()
    }
}

fn basic_auth(users: BTreeMap<String, String>) -> Result<BasicAuth, String> {
    for (user, hash) in &users {
        if user.contains(':') {
            return Err(format!("user {user:?}: a user name cannot contain ':'"));
        }
        bcrypt::HashParts::from_str(hash)
            .map_err(|e| format!("user {user:?}: not a bcrypt hash ({e})"))?;
    }
    Ok(BasicAuth::new(users.into_iter().collect::<HashMap<_, _>>()))
}

fn version(name: &str, key: &str) -> Result<&'static SupportedProtocolVersion, String> {
    match name {
        "TLS12" => Ok(&rustls::version::TLS12),
        "TLS13" => Ok(&rustls::version::TLS13),
        "TLS10" | "TLS11" => Err(format!(
            "{key}: {name} is not supported (pgio offers TLS12 and TLS13)"
        )),
        _ => Err(format!("{key}: unknown version {name:?} (TLS12 or TLS13)")),
    }
}

fn tls_config(
    t: &TlsFile,
    dir: &Path,
    text: &str,
) -> Result<(ServerConfig, Arc<ReloadingCert>), String> {
    let provider = Arc::new(toolkit_keys::provider(
        t.cipher_suites.as_deref(),
        t.curve_preferences.as_deref(),
        text,
    )?);
    let all = [&rustls::version::TLS12, &rustls::version::TLS13];
    let min = t
        .min_version
        .as_deref()
        .map(|v| version(v, "min_version"))
        .transpose()?
        .unwrap_or(&rustls::version::TLS12);
    let max = t
        .max_version
        .as_deref()
        .map(|v| version(v, "max_version"))
        .transpose()?
        .unwrap_or(&rustls::version::TLS13);
    let rank = |v: &SupportedProtocolVersion| all.iter().position(|a| a.version == v.version);
    let versions: Vec<&'static SupportedProtocolVersion> = all
        .into_iter()
        .filter(|v| rank(v) >= rank(min) && rank(v) <= rank(max))
        .collect();
    if versions.is_empty() {
        return Err("min_version is above max_version".into());
    }
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&versions)
        .map_err(|e| e.to_string())?;

    let client_ca = t.client_ca_file.as_ref().map(|p| dir.join(p));
    let client_auth = t.client_auth_type.as_deref().unwrap_or("NoClientCert");
    let verifier = match client_auth {
        "NoClientCert" => None,
        "VerifyClientCertIfGiven" | "RequireAndVerifyClientCert" => {
            let Some(ca) = &client_ca else {
                return Err(format!(
                    "client_auth_type {client_auth} needs client_ca_file"
                ));
            };
            let mut roots = RootCertStore::empty();
            for cert in certificates(ca, "client_ca_file")? {
                roots
                    .add(cert)
                    .map_err(|e| format!("client_ca_file {}: {e}", ca.display()))?;
            }
            let verifier =
                WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone());
            let verifier = if client_auth == "VerifyClientCertIfGiven" {
                verifier.allow_unauthenticated()
            } else {
                verifier
            };
            Some(
                verifier
                    .build()
                    .map_err(|e| format!("client_ca_file {}: {e}", ca.display()))?,
            )
        }
        "RequestClientCert" | "RequireAnyClientCert" => {
            return Err(format!(
                "client_auth_type {client_auth} (client certificates taken unverified) is not \
                 supported; use VerifyClientCertIfGiven or RequireAndVerifyClientCert"
            ));
        }
        other => {
            return Err(format!(
                "unknown client_auth_type {other:?} (NoClientCert, VerifyClientCertIfGiven or \
                 RequireAndVerifyClientCert)"
            ));
        }
    };
    if verifier.is_none() && client_ca.is_some() {
        return Err("client_ca_file is set but client_auth_type does not verify clients".into());
    }
    let builder = match verifier {
        Some(v) => builder.with_client_cert_verifier(v),
        None => builder.with_no_client_auth(),
    };

    let certificate = Arc::new(ReloadingCert::new(
        dir.join(&t.cert_file),
        dir.join(&t.key_file),
        provider,
    )?);
    let mut config = builder.with_cert_resolver(certificate.clone());
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    // exporter-toolkit's default, as Go's servers: the server's order of suites wins.
    config.ignore_client_order = t.prefer_server_cipher_suites.unwrap_or(true);
    Ok((config, certificate))
}

fn certificates(path: &Path, key: &str) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| format!("{key} {}: {}", path.display(), pem_error(e, "certificate")))?;
    if certs.is_empty() {
        return Err(format!(
            "{key} {}: no PEM certificate in it",
            path.display()
        ));
    }
    Ok(certs)
}

fn pem_error(e: rustls::pki_types::pem::Error, what: &str) -> String {
    use rustls::pki_types::pem::Error;
    match e {
        Error::Io(e) => format!("cannot read: {e}"),
        Error::NoItemsFound => format!("no PEM {what} in it"),
        e => format!("not valid PEM: {e}"),
    }
}

/// `pgio_http_tls_*` and `pgio_http_auth_*`, registered only when the web config turns TLS or
/// basic auth on (without it the exposition is unchanged).
pub struct WebSelfMetrics {
    pub http: Arc<HttpStats>,
    pub certificate: Option<Arc<ReloadingCert>>,
    pub auth: Option<Arc<BasicAuth>>,
}

#[derive(Debug, Default)]
pub struct WebSnapshot {
    pub tls_handshake_failures: Option<u64>,
    /// The certificate read again: (ok, failed).
    pub certificate_reloads: Option<(u64, u64)>,
    /// By reason; verifications.
    pub auth: Option<([(&'static str, u64); 3], u64)>,
}

impl Source for WebSelfMetrics {
    fn read(&self, _: &Provisional) -> Box<dyn Snapshot> {
        let tls_handshake_failures = self
            .certificate
            .as_ref()
            .map(|_| self.http.tls_handshake_failures.load(Ordering::Relaxed));
        let auth = self.auth.as_ref().map(|a| {
            let v = |c: &std::sync::atomic::AtomicU64| c.load(Ordering::Relaxed);
            let s = &a.stats;
            (
                [
                    ("missing", v(&s.missing)),
                    ("wrong", v(&s.wrong)),
                    ("busy", v(&s.busy)),
                ],
                v(&s.verifications),
            )
        });
        Box::new(WebSnapshot {
            tls_handshake_failures,
            certificate_reloads: self.certificate.as_ref().map(|c| c.counts()),
            auth,
        })
    }
}

static TLS_HANDSHAKE_FAILURES: MetricFamily = MetricFamily {
    name: "pgio_http_tls_handshake_failures",
    help: "HTTPS connections closed because the TLS handshake failed (not TLS, no common version or cipher, client certificate refused). Handshakes not done within http_header_timeout_secs count as header_timeout in pgio_http_connections_closed_total.",
    kind: Kind::Counter,
};
static AUTH_FAILURES: MetricFamily = MetricFamily {
    name: "pgio_http_auth_failures",
    help: "Requests answered without their content because of basic auth, by reason: missing (no or undecodable credentials, 401), wrong (unknown user or wrong password, 401), busy (too many password verifications in progress, 429).",
    kind: Kind::Counter,
};
static AUTH_VERIFICATIONS: MetricFamily = MetricFamily {
    name: "pgio_http_auth_verifications",
    help: "bcrypt password verifications run (a password that verified is remembered and needs none again).",
    kind: Kind::Counter,
};

impl Snapshot for WebSnapshot {
    fn encode(&self, _: &mut Scrape<'_>, enc: &mut Encoder) {
        if let Some(n) = self.tls_handshake_failures {
            enc.family(&TLS_HANDSHAKE_FAILURES).counter((), n);
        }
        if let Some(counts) = self.certificate_reloads {
            cert_reload::encode(counts, enc);
        }
        if let Some((failures, verifications)) = self.auth {
            let mut f = enc.family(&AUTH_FAILURES);
            for (reason, n) in failures {
                f.counter([("reason", reason)], n);
            }
            enc.family(&AUTH_VERIFICATIONS).counter((), verifications);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Removed with its directory when done, also when the load fails.
    fn load(yaml: &str) -> Result<WebConfig, String> {
        let dir = pgio_testkit::temp_dir().map_err(|e| e.to_string())?;
        let path = dir.path().join("web.yml");
        std::fs::write(&path, yaml).map_err(|e| e.to_string())?;
        WebConfig::load(&path).map_err(|e| e.to_string())
    }

    #[test]
    fn empty_means_plain() {
        assert!(load("").expect("empty").is_plain());
        assert!(load("# nothing\n").expect("comment").is_plain());
        assert!(load("basic_auth_users: {}\n").expect("no users").is_plain());
    }

    #[test]
    fn errors_name_what_is_wrong() {
        let e = load("tls_server_config:\n  cert_file: a\n  key_file: b\n  ciphers: []\n")
            .expect_err("unknown key");
        assert!(e.contains("unknown field `ciphers`"), "{e}");
        assert!(e.contains("line 4"), "{e}");
        let e = load("tls_server_config:\n  cert_file: /nonexistent/c.pem\n  key_file: k\n")
            .expect_err("no cert");
        assert!(
            e.contains("cert_file /nonexistent/c.pem: cannot read: No such file"),
            "{e}"
        );
        let e = load("basic_auth_users:\n  scraper: secret\n").expect_err("plain password");
        assert!(e.contains("user \"scraper\": not a bcrypt hash"), "{e}");
        let e = load("tls_server_config:\n  cert_file: c\n  key_file: k\n  min_version: TLS10\n")
            .expect_err("TLS 1.0");
        assert!(e.contains("min_version: TLS10 is not supported"), "{e}");
        let e = load(
            "tls_server_config:\n  cert_file: c\n  key_file: k\n  client_auth_type: RequireAndVerifyClientCert\n",
        )
        .expect_err("no CA");
        assert!(e.contains("needs client_ca_file"), "{e}");
    }
}
