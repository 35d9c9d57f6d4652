//! The kustomize render with HTTPS (components/web-tls, which deploy-check proves equal to the
//! chart's `webConfig.enabled`) runs: the daemon from its args and mounts, probed and scraped
//! as the kubelet and the PodMonitor would. (The shipped pgio.toml's keys: `config_keys`.)
use std::{
    collections::BTreeMap,
    io::{ErrorKind, Read, Write},
    net::TcpStream,
    os::unix::fs::PermissionsExt,
    path::{Component, Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::Arc,
    time::{Duration, Instant},
};

use base64::Engine as _;
use pgio_testkit::{
    Metrics, daemon::free_port, daemonset::Manifest, require_root, serde_json::Value, temp_dir,
    wait_until,
};
use rustls::{
    ClientConfig, ClientConnection, RootCertStore, StreamOwned,
    pki_types::{CertificateDer, ServerName, pem::PemObject as _},
};

// ---- HTTPS: the kustomize render with components/web-tls, run ---------------------------------

const BIN: &str = env!("CARGO_BIN_EXE_pgio-daemon");
const COMPONENTS: [&str; 3] = ["podmonitor", "web-tls", "web-basic-auth"];
const SCRAPE_USER: &str = "prometheus";
const SCRAPE_PASSWORD: &str = "s3cret scraper";

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_owned()
}

/// `to` relative to the directory `from` (kustomize takes no absolute paths in an overlay).
fn relative(from: &Path, to: &Path) -> PathBuf {
    let from = from.canonicalize().expect("canonical overlay dir");
    let to = to.canonicalize().expect("canonical deploy dir");
    let f: Vec<Component> = from.components().collect();
    let t: Vec<Component> = to.components().collect();
    let common = f.iter().zip(&t).take_while(|(a, b)| a == b).count();
    let mut rel: PathBuf = (common..f.len()).map(|_| "..").collect();
    rel.extend(&t[common..]);
    rel
}

/// `kubectl kustomize` of the base with `COMPONENTS`, from an overlay in a scratch directory.
fn render_web_overlay(scratch: &Path) -> Manifest {
    let overlay = scratch.join("overlay");
    std::fs::create_dir_all(&overlay).expect("overlay dir");
    let base = relative(&overlay, &workspace().join("deploy/kustomize"));
    let mut text = format!(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n  - {}\n\
         components:\n",
        base.display()
    );
    for c in COMPONENTS {
        text.push_str(&format!(
            "  - {}\n",
            base.join("components").join(c).display()
        ));
    }
    std::fs::write(overlay.join("kustomization.yaml"), text).expect("write overlay");
    Manifest::kustomize(&overlay).expect("kubectl kustomize of the web-tls overlay")
}

/// The Secrets the docs (components/web-tls and web-basic-auth) tell an operator to create,
/// with a certificate made now for `server_name` and a basic auth user in web.yml.
fn documented_secrets(server_name: &str) -> BTreeMap<String, BTreeMap<String, Vec<u8>>> {
    let ck = rcgen::generate_simple_self_signed(vec![server_name.to_owned()])
        .expect("self-signed certificate");
    let shipped = workspace().join("deploy/kustomize/components/web-tls/web.yml");
    let mut web_yml = std::fs::read_to_string(&shipped).expect("the shipped web.yml");
    // What its comment says to add for basic auth (a low bcrypt cost: this is a test).
    let hash = bcrypt::hash(SCRAPE_PASSWORD, 4).expect("bcrypt");
    web_yml.push_str(&format!("basic_auth_users:\n  {SCRAPE_USER}: '{hash}'\n"));
    let web: BTreeMap<String, Vec<u8>> = [
        ("web.yml", web_yml.into_bytes()),
        ("tls.crt", ck.cert.pem().into_bytes()),
        ("tls.key", ck.signing_key.serialize_pem().into_bytes()),
        // Self-signed: its own CA.
        ("ca.crt", ck.cert.pem().into_bytes()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect();
    let auth: BTreeMap<String, Vec<u8>> = [
        ("username", SCRAPE_USER.as_bytes().to_vec()),
        ("password", SCRAPE_PASSWORD.as_bytes().to_vec()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect();
    BTreeMap::from([
        ("pgio-web-config".to_owned(), web),
        ("pgio-scrape-auth".to_owned(), auth),
    ])
}

/// A key of one of `secrets`, as a `{name, key}` reference in the PodMonitor names it.
fn secret_key<'a>(
    secrets: &'a BTreeMap<String, BTreeMap<String, Vec<u8>>>,
    r: &Value,
    what: &str,
) -> &'a [u8] {
    let (name, key) = (r["name"].as_str(), r["key"].as_str());
    name.and_then(|n| secrets.get(n))
        .and_then(|s| s.get(key?))
        .unwrap_or_else(|| {
            panic!("the PodMonitor's {what} refers to {r}, which no documented Secret holds")
        })
}

/// pgio-daemon started from the rendered container: its args and env, each mount's files in a
/// directory of its own (the path mapped in the args), listening on a free port for the
/// container port. SIGTERM when dropped.
struct RenderedDaemon {
    child: Child,
    port: u16,
    log: PathBuf,
}

impl RenderedDaemon {
    fn start(
        manifest: &Manifest,
        secrets: &BTreeMap<String, BTreeMap<String, Vec<u8>>>,
        node: &Path,
    ) -> RenderedDaemon {
        let pod = manifest.daemonset_pod_spec().expect("DaemonSet");
        let c = &pod["containers"][0];
        let volumes = pod["volumes"].as_array().expect("volumes");
        let mut mapped: Vec<(String, PathBuf)> = Vec::new();
        for m in c["volumeMounts"].as_array().expect("volumeMounts") {
            let name = m["name"].as_str().expect("mount name");
            let mount_path = m["mountPath"].as_str().expect("mountPath");
            let v = volumes
                .iter()
                .find(|v| v["name"] == name)
                .unwrap_or_else(|| panic!("volumeMount {name} has no volume"));
            let (files, mode): (BTreeMap<String, Vec<u8>>, u32) =
                if let Some(cm) = v["configMap"]["name"].as_str() {
                    let data = manifest.config_map_data(cm).expect("ConfigMap");
                    let files = data.into_iter().map(|(k, v)| (k, v.into_bytes())).collect();
                    (files, 0o644)
                } else if let Some(s) = v["secret"]["secretName"].as_str() {
                    let files = secrets.get(s).unwrap_or_else(|| {
                        panic!("volume {name} mounts the Secret {s}, which the docs do not create")
                    });
                    let mode = v["secret"]["defaultMode"].as_u64().unwrap_or(0o644);
                    (files.clone(), mode as u32)
                } else if v["hostPath"].is_object() {
                    // The host's path, at the same path.
                    continue;
                } else {
                    panic!("volume {name}: no mapping for {v}");
                };
            let dir = node.join(name);
            std::fs::create_dir_all(&dir).expect("mount dir");
            for (file, content) in files {
                let path = dir.join(&file);
                std::fs::write(&path, content).expect("write mounted file");
                std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode))
                    .expect("chmod");
            }
            mapped.push((mount_path.to_owned(), dir));
        }
        let args: Vec<String> = c["args"]
            .as_array()
            .expect("args")
            .iter()
            .map(|a| {
                let a = a.as_str().expect("arg");
                if !a.starts_with('/') {
                    return a.to_owned();
                }
                let (mount, dir) = mapped
                    .iter()
                    .find(|(m, _)| {
                        a.strip_prefix(m.as_str())
                            .is_some_and(|r| r.starts_with('/'))
                    })
                    .unwrap_or_else(|| {
                        panic!("arg {a}: no ConfigMap or Secret is mounted above it")
                    });
                format!("{}{}", dir.display(), &a[mount.len()..])
            })
            .collect();
        let port = free_port().expect("port");
        let log = node.join("pgio.log");
        let mut cmd = Command::new(BIN);
        cmd.args(&args)
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log file"));
        for e in c["env"].as_array().into_iter().flatten() {
            cmd.env(
                e["name"].as_str().expect("env name"),
                e["value"].as_str().expect("env value"),
            );
        }
        eprintln!("pgio-daemon {}", args.join(" "));
        let child = cmd.spawn().expect("spawn pgio-daemon");
        RenderedDaemon { child, port, log }
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for RenderedDaemon {
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

/// The container port a probe or endpoint names (by name or number) must be the metrics one.
fn check_port(c: &Value, port: &Value, what: &str) {
    let metrics = c["ports"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["name"] == "metrics")
        .expect("a port named metrics");
    assert!(
        *port == metrics["name"] || *port == metrics["containerPort"],
        "{what} uses port {port}, not the metrics port {metrics}"
    );
}

/// What the kubelet does for an httpGet probe: HTTP or HTTPS by `scheme`, the certificate not
/// verified, no credentials. The status, or the error.
fn kubelet_probe(probe: &Value, port: u16) -> Result<u16, String> {
    let get = &probe["httpGet"];
    let scheme = get["scheme"]
        .as_str()
        .unwrap_or("HTTP")
        .to_ascii_lowercase();
    let path = get["path"].as_str().unwrap_or("/");
    let tls = ureq::tls::TlsConfig::builder()
        .provider(ureq::tls::TlsProvider::Rustls)
        .unversioned_rustls_crypto_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .disable_verification(true)
        .build();
    let agent = ureq::Agent::new_with_config(
        ureq::Agent::config_builder()
            .timeout_global(Some(Duration::from_secs(5)))
            .http_status_as_error(false)
            .tls_config(tls)
            .build(),
    );
    agent
        .get(&format!("{scheme}://127.0.0.1:{port}{path}"))
        .call()
        .map(|r| r.status().as_u16())
        .map_err(|e| e.to_string())
}

/// What Prometheus does for a PodMonitor endpoint: its scheme, tlsConfig (CA from a Secret,
/// serverName) and basic auth from Secrets. Status and body.
fn prometheus_scrape(
    endpoint: &Value,
    secrets: &BTreeMap<String, BTreeMap<String, Vec<u8>>>,
    port: u16,
    with_auth: bool,
) -> (u16, String) {
    assert_eq!(endpoint["scheme"], "https", "{endpoint}");
    let tls = &endpoint["tlsConfig"];
    let ca = secret_key(secrets, &tls["ca"]["secret"], "tlsConfig.ca");
    let server_name = tls["serverName"].as_str().expect("tlsConfig.serverName");
    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca) {
        roots.add(cert.expect("CA PEM")).expect("trust the CA");
    }
    let client = Arc::new(
        ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_root_certificates(roots)
            .with_no_client_auth(),
    );
    let authorization = if with_auth {
        let auth = &endpoint["basicAuth"];
        let user = secret_key(secrets, &auth["username"], "basicAuth.username");
        let password = secret_key(secrets, &auth["password"], "basicAuth.password");
        let mut pair = user.to_vec();
        pair.push(b':');
        pair.extend_from_slice(password);
        format!(
            "Authorization: Basic {}\r\n",
            base64::engine::general_purpose::STANDARD.encode(pair)
        )
    } else {
        String::new()
    };
    let tcp = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    tcp.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let name = ServerName::try_from(server_name.to_owned()).expect("server name");
    let mut s = StreamOwned::new(
        ClientConnection::new(client, name).expect("TLS client"),
        tcp,
    );
    let path = endpoint["path"].as_str().unwrap_or("/metrics");
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {server_name}\r\nConnection: close\r\n{authorization}\r\n"
    )
    .expect("TLS handshake and request (the certificate verified against the PodMonitor's CA)");
    let mut raw = Vec::new();
    if let Err(e) = s.read_to_end(&mut raw) {
        assert!(
            !raw.is_empty() && e.kind() == ErrorKind::UnexpectedEof,
            "reading the answer: {e}"
        );
    }
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").expect("an HTTP answer");
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("status");
    (status, body.to_owned())
}

/// The kustomize render with components/podmonitor, web-tls and web-basic-auth, run as the
/// pod would be (mount paths mapped to directories holding the documented Secrets' keys): the
/// args it passes are ones pgio-daemon takes, the shipped web.yml finds the certificate and key
/// at the mount, the kubelet's probes (HTTPS, no password) get 200 where plain HTTP would fail,
/// and the PodMonitor's scrape (https, its CA and serverName, basic auth from its Secret) gets
/// the metrics, 401 without its credentials.
#[test]
fn web_tls_render_serves_https_to_its_probes_and_podmonitor() {
    if !require_root("web_tls_render_serves_https_to_its_probes_and_podmonitor") {
        return;
    }
    let scratch = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("deploy-web-tls-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&scratch);
    let _cleanup = RemoveOnDrop(scratch.clone());
    let manifest = render_web_overlay(&scratch);
    let pm = manifest.only("PodMonitor").expect("PodMonitor");
    let endpoint = &pm["spec"]["podMetricsEndpoints"][0];
    let server_name = endpoint["tlsConfig"]["serverName"]
        .as_str()
        .expect("the PodMonitor's tlsConfig.serverName");
    let secrets = documented_secrets(server_name);

    let node = temp_dir().expect("temp dir");
    let mut d = RenderedDaemon::start(&manifest, &secrets, node.path());
    let pod = manifest.daemonset_pod_spec().expect("DaemonSet");
    let c = &pod["containers"][0];
    let annotations = &manifest.only("DaemonSet").expect("DaemonSet")["spec"]["template"]["metadata"]
        ["annotations"];
    assert_eq!(annotations["prometheus.io/scheme"], "https");

    // The startup probe's budget: failureThreshold × periodSeconds.
    let startup = &c["startupProbe"];
    check_port(c, &startup["httpGet"]["port"], "startupProbe");
    let budget = startup["failureThreshold"].as_u64().unwrap_or(3)
        * startup["periodSeconds"].as_u64().unwrap_or(10);
    let t = Instant::now();
    let mut last = Err(String::new());
    let mut exited = None;
    let port = d.port;
    let started = wait_until(
        Duration::from_secs(budget),
        Duration::from_millis(200),
        || {
            exited = d.child.try_wait().ok().flatten();
            last = kubelet_probe(startup, port);
            last == Ok(200) || exited.is_some()
        },
    );
    assert!(
        started && exited.is_none(),
        "startupProbe not passed (budget {budget} s, last {last:?}), pgio-daemon exited: {exited:?}; \
         log:\n{}",
        d.log_text()
    );
    eprintln!("startupProbe passed after {:?}", t.elapsed());
    for kind in ["livenessProbe", "readinessProbe"] {
        let probe = &c[kind];
        check_port(c, &probe["httpGet"]["port"], kind);
        assert_eq!(kubelet_probe(probe, d.port), Ok(200), "{kind}: {probe}");
        // The same probe without its scheme: plain HTTP to a TLS port fails.
        let mut plain = probe.clone();
        plain["httpGet"]
            .as_object_mut()
            .expect("httpGet")
            .remove("scheme");
        let answer = kubelet_probe(&plain, d.port);
        assert!(answer != Ok(200), "{kind} over plain HTTP: {answer:?}");
    }

    check_port(c, &endpoint["port"], "the PodMonitor");
    let (status, body) = prometheus_scrape(endpoint, &secrets, d.port, true);
    assert_eq!(status, 200, "{body}");
    let metrics = Metrics::parse(&body).expect("parse /metrics");
    assert_eq!(
        metrics.metric_type("pgio_http_auth_verifications_total"),
        Some("counter"),
        "basic auth is on"
    );
    assert_eq!(metrics.sum("pgio_http_auth_verifications_total", &[]), 1.0);
    let (status, _) = prometheus_scrape(endpoint, &secrets, d.port, false);
    assert_eq!(
        status, 401,
        "the scrape without the PodMonitor's credentials"
    );
    eprintln!(
        "probes HTTPS 200 (plain HTTP refused), PodMonitor scrape 200 with {} families, 401 \
         without credentials",
        body.lines().filter(|l| l.starts_with("# TYPE ")).count()
    );
}

struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
