//! One scrape of a pgio daemon's /metrics, in the protobuf exposition: the same samples as
//! the text (see `exposition`), already structured, so nothing here parses text. Over plain
//! HTTP, or HTTPS and basic auth for a daemon run with `--web-config-file`.
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use base64::Engine as _;
use prometheus_client::encoding::prometheus_protobuf::prometheus_data_model as pb;
use prost::Message;
use rustls::CertificateError;
use rustls_pki_types::{CertificateDer, pem::PemObject as _};
use ureq::tls::{Certificate, RootCerts, TlsConfig, TlsProvider};

use crate::http::PROTOBUF;

/// A /metrics larger than this is not a pgio daemon's (a busy node's is a few MB).
const MAX_BODY: u64 = 256 << 20;

#[derive(Debug, thiserror::Error)]
pub enum ScrapeError {
    #[error("{url}: not an http:// or https:// URL (e.g. http://127.0.0.1:9435/metrics)")]
    BadUrl { url: String },
    #[error(
        "{url}: credentials in the URL are not taken (they would show in `ps` and in the \
         header line); give the user with --user and the password in PGIO_TOP_PASSWORD"
    )]
    CredentialsInUrl { url: String },
    #[error("{url}: {flag} applies to https:// URLs only")]
    TlsFlagWithHttp { url: String, flag: &'static str },
    #[error("--ca-file {}: {message}", path.display())]
    CaFile { path: PathBuf, message: String },
    #[error("no trusted CA certificates in the system's store ({message}); pass --ca-file")]
    SystemRoots { message: String },
    #[error("cannot reach {url}")]
    Unreachable { url: String, source: ureq::Error },
    #[error("{url} did not answer HTTP (a daemon serving HTTPS? try https://)")]
    NotHttp { url: String, source: ureq::Error },
    #[error("{url}: the server's TLS certificate is refused: {problem}")]
    Certificate { url: String, problem: String },
    #[error("{url}: the TLS handshake failed{hint}")]
    Tls {
        url: String,
        hint: &'static str,
        source: rustls::Error,
    },
    #[error("{url} answered HTTP {status}{hint}")]
    Status {
        url: String,
        status: u16,
        hint: &'static str,
    },
    #[error(
        "{url} is not a pgio daemon's /metrics: it answered {content_type:?}, not the protobuf exposition"
    )]
    NotPgio { url: String, content_type: String },
    #[error("{url}: the protobuf exposition does not decode")]
    Decode {
        url: String,
        source: prost::DecodeError,
    },
}

/// How to check the server's certificate on an https:// URL.
#[derive(Debug, Clone, Default)]
pub enum Trust {
    /// The system's CA certificates (as curl does).
    #[default]
    System,
    /// Only the CA certificates in this PEM file (a private CA, or a self-signed certificate).
    CaFile(PathBuf),
    /// No verification at all (`--insecure`).
    Insecure,
}

/// A user and password for basic auth.
pub struct Credentials {
    pub user: String,
    pub password: String,
}

pub struct Scrape {
    pub at: Instant,
    pub families: Vec<pb::MetricFamily>,
}

pub struct Scraper {
    agent: ureq::Agent,
    pub url: String,
    /// `Authorization` header value.
    authorization: Option<String>,
}

impl Scraper {
    pub fn new(
        url: &str,
        timeout: Duration,
        trust: &Trust,
        credentials: Option<&Credentials>,
    ) -> Result<Scraper, ScrapeError> {
        let https = if url.starts_with("https://") {
            true
        } else if url.starts_with("http://") {
            false
        } else {
            return Err(ScrapeError::BadUrl { url: url.into() });
        };
        let authority = url
            .split_once("://")
            .map(|(_, rest)| rest.split(['/', '?', '#']).next().unwrap_or(""))
            .unwrap_or("");
        if authority.contains('@') {
            return Err(ScrapeError::CredentialsInUrl { url: url.into() });
        }
        let mut config = ureq::Agent::config_builder()
            .timeout_global(Some(timeout))
            .http_status_as_error(false);
        match (https, trust) {
            (true, trust) => config = config.tls_config(tls_config(trust)?),
            (false, Trust::System) => {}
            (false, Trust::CaFile(_)) => {
                return Err(ScrapeError::TlsFlagWithHttp {
                    url: url.into(),
                    flag: "--ca-file",
                });
            }
            (false, Trust::Insecure) => {
                return Err(ScrapeError::TlsFlagWithHttp {
                    url: url.into(),
                    flag: "--insecure",
                });
            }
        }
        let authorization = credentials.map(|c| {
            let pair = format!("{}:{}", c.user, c.password);
            format!(
                "Basic {}",
                base64::engine::general_purpose::STANDARD.encode(pair)
            )
        });
        Ok(Scraper {
            agent: ureq::Agent::new_with_config(config.build()),
            url: url.to_owned(),
            authorization,
        })
    }

    pub fn fetch(&self) -> Result<Scrape, ScrapeError> {
        let url = || self.url.clone();
        let mut request = self.agent.get(&self.url).header("Accept", PROTOBUF);
        if let Some(a) = &self.authorization {
            request = request.header("Authorization", a);
        }
        let mut response = request.call().map_err(|e| self.call_error(e))?;
        let at = Instant::now();
        let status = response.status().as_u16();
        if status != 200 {
            let hint = match (status, self.authorization.is_some()) {
                (401, false) => {
                    " (it wants basic auth: give the user with --user and the password in \
                     PGIO_TOP_PASSWORD)"
                }
                (401, true) => " (wrong user or password: --user, PGIO_TOP_PASSWORD)",
                (429, _) => " (too many password checks at once: retry)",
                _ => "",
            };
            return Err(ScrapeError::Status {
                url: url(),
                status,
                hint,
            });
        }
        let content_type = response
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_owned();
        if !content_type.starts_with("application/vnd.google.protobuf")
            || !content_type.contains("io.prometheus.client.MetricFamily")
        {
            return Err(ScrapeError::NotPgio {
                url: url(),
                content_type,
            });
        }
        let body = response
            .body_mut()
            .with_config()
            .limit(MAX_BODY)
            .read_to_vec()
            .map_err(|e| self.call_error(e))?;
        let mut rest = &body[..];
        let mut families = Vec::new();
        while !rest.is_empty() {
            families.push(
                pb::MetricFamily::decode_length_delimited(&mut rest)
                    .map_err(|source| ScrapeError::Decode { url: url(), source })?,
            );
        }
        Ok(Scrape { at, families })
    }

    /// A failed request, TLS problems named as such.
    fn call_error(&self, e: ureq::Error) -> ScrapeError {
        let url = self.url.clone();
        let Some(tls) = rustls_error(&e) else {
            // A TLS server's alert, where an HTTP status line should be.
            if url.starts_with("http://") && matches!(e, ureq::Error::Protocol(_)) {
                return ScrapeError::NotHttp { url, source: e };
            }
            return ScrapeError::Unreachable { url, source: e };
        };
        if let rustls::Error::InvalidCertificate(c) = tls {
            return ScrapeError::Certificate {
                problem: certificate_problem(c),
                url,
            };
        }
        let hint = match tls {
            rustls::Error::InvalidMessage(_) => {
                " (the server does not speak TLS: is it serving plain HTTP? try http://)"
            }
            _ => "",
        };
        ScrapeError::Tls {
            url,
            hint,
            source: tls.clone(),
        }
    }
}

/// The rustls error behind a ureq error: ureq reports a handshake's as `Io` around it.
fn rustls_error(e: &ureq::Error) -> Option<&rustls::Error> {
    match e {
        ureq::Error::Rustls(r) => Some(r),
        ureq::Error::Io(io) => io.get_ref()?.downcast_ref::<rustls::Error>(),
        _ => None,
    }
}

fn certificate_problem(e: &CertificateError) -> String {
    let fix = "pass --ca-file with the CA that signed it (for a self-signed certificate, the \
               certificate itself), or --insecure to skip verification";
    match e {
        CertificateError::UnknownIssuer => {
            format!("it is not signed by a trusted CA (unknown issuer); {fix}")
        }
        CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. } => {
            format!(
                "it is not valid for the URL's host ({e}); use a URL with a name or address the \
                 certificate holds, or --insecure"
            )
        }
        CertificateError::Expired | CertificateError::ExpiredContext { .. } => {
            format!("it has expired ({e})")
        }
        CertificateError::NotValidYet | CertificateError::NotValidYetContext { .. } => {
            format!("it is not valid yet ({e})")
        }
        CertificateError::BadSignature => {
            format!("the trusted CA of its issuer's name did not sign it (bad signature); {fix}")
        }
        e => format!("{e}"),
    }
}

fn tls_config(trust: &Trust) -> Result<TlsConfig, ScrapeError> {
    let builder = TlsConfig::builder()
        .provider(TlsProvider::Rustls)
        // The provider pgio's server uses: ring (no cmake, no download at build time).
        .unversioned_rustls_crypto_provider(Arc::new(rustls::crypto::ring::default_provider()));
    Ok(match trust {
        Trust::Insecure => builder.disable_verification(true),
        Trust::CaFile(path) => builder.root_certs(RootCerts::new_with_certs(&ca_file(path)?)),
        Trust::System => builder.root_certs(RootCerts::new_with_certs(&system_roots()?)),
    }
    .build())
}

fn ca_file(path: &Path) -> Result<Vec<Certificate<'static>>, ScrapeError> {
    let fail = |message: String| ScrapeError::CaFile {
        path: path.to_owned(),
        message,
    };
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| {
            use rustls_pki_types::pem::Error;
            fail(match e {
                Error::Io(e) => format!("cannot read: {e}"),
                e => format!("not valid PEM: {e}"),
            })
        })?;
    if certs.is_empty() {
        return Err(fail("no PEM certificate in it".into()));
    }
    // A certificate webpki cannot use as a trust anchor would be dropped silently by ureq.
    let mut roots = rustls::RootCertStore::empty();
    for (i, der) in certs.iter().enumerate() {
        roots
            .add(der.clone())
            .map_err(|e| fail(format!("certificate {} of {}: {e}", i + 1, certs.len())))?;
    }
    Ok(certs
        .iter()
        .map(|der| Certificate::from_der(der.as_ref()).to_owned())
        .collect())
}

fn system_roots() -> Result<Vec<Certificate<'static>>, ScrapeError> {
    let found = rustls_native_certs::load_native_certs();
    if found.certs.is_empty() {
        let message = match found.errors.first() {
            Some(e) => e.to_string(),
            None => "none found".to_owned(),
        };
        return Err(ScrapeError::SystemRoots { message });
    }
    Ok(found
        .certs
        .iter()
        .map(|der| Certificate::from_der(der.as_ref()).to_owned())
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn new(url: &str, trust: Trust) -> Result<Scraper, String> {
        Scraper::new(url, Duration::from_secs(1), &trust, None).map_err(|e| e.to_string())
    }

    #[test]
    fn urls_and_flags_that_cannot_work_are_refused_up_front() {
        assert!(new("http://127.0.0.1:9435/metrics", Trust::System).is_ok());
        assert!(new("https://127.0.0.1:9435/metrics", Trust::Insecure).is_ok());
        let e = new("ftp://127.0.0.1/metrics", Trust::System)
            .err()
            .unwrap_or_default();
        assert!(e.contains("not an http:// or https:// URL"), "{e}");
        let e = new("https://u:p@127.0.0.1:9435/metrics", Trust::Insecure)
            .err()
            .unwrap_or_default();
        assert!(e.contains("credentials in the URL are not taken"), "{e}");
        // An @ in the path is not userinfo.
        assert!(new("http://127.0.0.1:9435/metrics?x=a@b", Trust::System).is_ok());
        let e = new("http://127.0.0.1:9435/metrics", Trust::Insecure)
            .err()
            .unwrap_or_default();
        assert!(
            e.contains("--insecure applies to https:// URLs only"),
            "{e}"
        );
        let e = new(
            "https://127.0.0.1:9435/metrics",
            Trust::CaFile("/nonexistent/ca.crt".into()),
        )
        .err()
        .unwrap_or_default();
        assert!(
            e.contains("--ca-file /nonexistent/ca.crt: cannot read"),
            "{e}"
        );
    }
}
