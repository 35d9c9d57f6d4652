//! The server certificate and key, read again when their files change: cert-manager (and a
//! Kubernetes secret volume, by swapping a symlink) replaces them before they expire, and a
//! certificate read once at start would expire under a running pgio.
//!
//! Checked at a handshake at most once a second (a `stat` of each file); a changed pair is read
//! and used for the handshakes after it. A pair that cannot be used (half written, a key that
//! does not match) keeps the last good one, is logged and counted, and is tried again when a
//! file changes again.
use std::{
    fmt,
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use rustls::{
    crypto::CryptoProvider,
    pki_types::{PrivateKeyDer, pem::PemObject as _},
    server::{ClientHello, ResolvesServerCert},
    sign::CertifiedKey,
};
use tracing::{info, warn};

use super::{certificates, pem_error};
use crate::{
    exposition::{Encoder, Kind, MetricFamily},
    lock,
};

/// How often a handshake looks at the files.
const CHECK_EVERY: Duration = Duration::from_secs(1);

/// What identifies a file's content without reading it.
type Stamp = Option<(u64, u64, u64, i64, i64)>;

fn stamp(path: &Path) -> Stamp {
    let m = std::fs::metadata(path).ok()?;
    Some((m.dev(), m.ino(), m.size(), m.mtime(), m.mtime_nsec()))
}

/// The certificate chain and key in `cert_file` and `key_file`, checked to match.
pub fn load(
    cert_file: &Path,
    key_file: &Path,
    provider: &CryptoProvider,
) -> Result<CertifiedKey, String> {
    let certs = certificates(cert_file, "cert_file")?;
    let key = PrivateKeyDer::from_pem_file(key_file).map_err(|e| {
        format!(
            "key_file {}: {}",
            key_file.display(),
            pem_error(e, "private key")
        )
    })?;
    CertifiedKey::from_der(certs, key, provider).map_err(|e| match e {
        rustls::Error::InconsistentKeys(_) => format!(
            "key_file {} does not match the certificate in cert_file {}",
            key_file.display(),
            cert_file.display()
        ),
        e => format!(
            "cert_file {} / key_file {}: {e}",
            cert_file.display(),
            key_file.display()
        ),
    })
}

struct State {
    current: Arc<CertifiedKey>,
    stamps: (Stamp, Stamp),
    checked: Instant,
}

pub struct ReloadingCert {
    cert_file: PathBuf,
    key_file: PathBuf,
    provider: Arc<CryptoProvider>,
    state: Mutex<State>,
    reloaded: AtomicU64,
    failed: AtomicU64,
}

impl fmt::Debug for ReloadingCert {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReloadingCert")
            .field("cert_file", &self.cert_file)
            .field("key_file", &self.key_file)
            .finish_non_exhaustive()
    }
}

impl ReloadingCert {
    /// Reads the pair now: an error here stops pgio at start, naming the file.
    pub fn new(
        cert_file: PathBuf,
        key_file: PathBuf,
        provider: Arc<CryptoProvider>,
    ) -> Result<ReloadingCert, String> {
        let stamps = (stamp(&cert_file), stamp(&key_file));
        let current = Arc::new(load(&cert_file, &key_file, &provider)?);
        Ok(ReloadingCert {
            cert_file,
            key_file,
            provider,
            state: Mutex::new(State {
                current,
                stamps,
                checked: Instant::now(),
            }),
            reloaded: AtomicU64::new(0),
            failed: AtomicU64::new(0),
        })
    }

    /// The pair to serve now, read again first if a file changed since the last look.
    fn current(&self) -> Arc<CertifiedKey> {
        let mut s = lock(&self.state);
        if s.checked.elapsed() >= CHECK_EVERY {
            s.checked = Instant::now();
            let stamps = (stamp(&self.cert_file), stamp(&self.key_file));
            if stamps != s.stamps {
                s.stamps = stamps;
                match load(&self.cert_file, &self.key_file, &self.provider) {
                    Ok(key) => {
                        s.current = Arc::new(key);
                        self.reloaded.fetch_add(1, Ordering::Relaxed);
                        info!(cert_file = %self.cert_file.display(), "TLS certificate read again");
                    }
                    Err(e) => {
                        self.failed.fetch_add(1, Ordering::Relaxed);
                        warn!(error = %e, "TLS certificate changed but cannot be used; serving the previous one");
                    }
                }
            }
        }
        s.current.clone()
    }

    /// (read again, failed).
    pub fn counts(&self) -> (u64, u64) {
        (
            self.reloaded.load(Ordering::Relaxed),
            self.failed.load(Ordering::Relaxed),
        )
    }
}

impl ResolvesServerCert for ReloadingCert {
    fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current())
    }
}

static CERTIFICATE_RELOADS: MetricFamily = MetricFamily {
    name: "pgio_http_tls_certificate_reloads",
    help: "Times the TLS certificate or key file changed and pgio read the pair again, by result: ok (served from the next handshake), failed (unreadable, or a key that does not match: the previous pair is still served; see the log).",
    kind: Kind::Counter,
};

pub fn encode(counts: (u64, u64), enc: &mut Encoder) {
    let mut f = enc.family(&CERTIFICATE_RELOADS);
    f.counter([("result", "ok")], counts.0);
    f.counter([("result", "failed")], counts.1);
}
