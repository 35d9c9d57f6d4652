//! `cargo xtask deploy-check`: the Kubernetes manifests in `deploy/`, checked offline.
//!
//! - `helm lint --strict` and `helm template` of `deploy/helm/pgio`, `kubectl kustomize` of
//!   `deploy/kustomize`, each with its defaults, with its options (PodMonitor, Localhost
//!   seccomp profile), and with those and HTTPS + basic auth (`--web-config-file` from a
//!   Secret); the chart also with web.yml inline;
//! - kubeconform `-strict` on every render against the JSON schemas PyPI `kubernetes-validate`
//!   ships (no network at validation time), for every minor from the oldest Kubernetes the
//!   chart claims to the newest (`cases::every_minor`);
//! - what must be refused is (`cases::refusals`: `helm lint --strict` on values the schema
//!   rejects, kustomize components in an order that would mismatch the scrape scheme), the
//!   optional pieces render alike in both tools (`cases::extras`), and the Pod Security
//!   admission rules admit the pod at "privileged" only, for the documented reasons (`psa`);
//! - the Helm and kustomize renders agree on everything that matters on a node (pod spec,
//!   container, volumes, probes, resources, pgio.toml as parsed TOML, Service, ServiceAccount,
//!   PodMonitor), and each keeps the security invariants (no privileged, no SYS_ADMIN, read-only
//!   root and host mounts, ...). A difference fails with the path of each differing field.
//! - with HTTPS on, the pieces agree with each other: `--web-config-file` names a file in a
//!   read-only 0400 Secret mount, the web.yml shipped for that Secret names its certificate and
//!   key inside the mount, the probes and the pod annotation say HTTPS, the PodMonitor scrapes
//!   https with a tlsConfig (and basic auth); with it off none of them does. (`tests/
//!   deploy_config.rs` runs the daemon from the kustomize render, over HTTPS.)
//!
//! helm and kubeconform are built once per clone with `go install` (Go module proxy) into
//! `<target>/deploy-tools/`, the schemas unpacked there too; later runs reuse them.

use std::collections::BTreeSet;
use std::env;
use std::fs;
use std::path::{Component, Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail, ensure};
use serde::Deserialize;
use serde_json::{Map, Value, json};

use crate::util::{describe, fmt_duration, output, run, step, target_dir};

mod cases;
mod invariants;
mod openshift;
mod psa;
mod rules;

/// A Go program installed with `go install <package>@<version>`.
pub(crate) struct GoTool {
    pub(crate) name: &'static str,
    pub(crate) package: &'static str,
    pub(crate) version: &'static str,
}

pub(crate) const HELM: GoTool = GoTool {
    name: "helm",
    package: "helm.sh/helm/v3/cmd/helm",
    version: "v3.22.0",
};

const KUBECONFORM: GoTool = GoTool {
    name: "kubeconform",
    package: "github.com/yannh/kubeconform/cmd/kubeconform",
    version: "v0.8.0",
};

/// PyPI `kubernetes-validate`: its wheel carries strict JSON schemas for Kubernetes 1.25-1.37.
const KUBERNETES_VALIDATE: &str = "1.37.0";

/// Validated against every minor from the oldest Kubernetes the chart accepts (Chart.yaml
/// `kubeVersion`, checked) to the newest the schemas know.
const OLDEST_MINOR: u32 = 25;
pub(crate) const NEWEST_MINOR: u32 = 37;
/// The first minor with `securityContext.appArmorProfile`; older ones take the annotation
/// (the chart picks by version, kustomize by components/apparmor-annotation).
const APPARMOR_FIELD_MINOR: u32 = 30;

pub(crate) fn kube_version(minor: u32) -> String {
    format!("1.{minor}.0")
}

/// Release name and namespace of the Helm renders, the same as the kustomize base's.
const RELEASE: &str = "pgio";
const NAMESPACE: &str = "pgio";

/// The Helm values that match the kustomize components `podmonitor` and `seccomp-localhost`.
const HELM_OPTIONS: [&str; 3] = [
    "podMonitor.enabled=true",
    "securityContext.seccompProfile.type=Localhost",
    "securityContext.seccompProfile.localhostProfile=pgio.json",
];
const KUSTOMIZE_COMPONENTS: [&str; 2] = ["podmonitor", "seccomp-localhost"];

/// The options and HTTPS with basic auth: the Helm values that match the kustomize components
/// below.
const HELM_WEB: [&str; 8] = [
    "podMonitor.enabled=true",
    "securityContext.seccompProfile.type=Localhost",
    "securityContext.seccompProfile.localhostProfile=pgio.json",
    "webConfig.enabled=true",
    "podMonitor.basicAuth.username.name=pgio-scrape-auth",
    "podMonitor.basicAuth.username.key=username",
    "podMonitor.basicAuth.password.name=pgio-scrape-auth",
    "podMonitor.basicAuth.password.key=password",
];
const KUSTOMIZE_WEB_COMPONENTS: [&str; 4] = [
    "podmonitor",
    "seccomp-localhost",
    "web-tls",
    "web-basic-auth",
];

/// The web.yml shipped for the Secret `pgio-web-config` (also given inline to the chart here).
const SHIPPED_WEB_YML: &str = "deploy/kustomize/components/web-tls/web.yml";

struct Paths {
    root: PathBuf,
    chart: PathBuf,
    kustomize: PathBuf,
    seccomp: PathBuf,
    tools: PathBuf,
    out: PathBuf,
}

/// One rendered manifest: every document of the YAML stream.
struct Render {
    what: String,
    file: PathBuf,
    docs: Vec<Value>,
}

pub fn check(root: &Path) -> Result<()> {
    let started = Instant::now();
    let target = target_dir(root);
    let p = Paths {
        root: root.to_path_buf(),
        chart: root.join("deploy/helm/pgio"),
        kustomize: root.join("deploy/kustomize"),
        seccomp: root.join("deploy/seccomp/pgio.json"),
        tools: target.join("deploy-tools"),
        out: target.join("deploy-check"),
    };
    make_dir(&p.tools)?;
    if p.out.exists() {
        fs::remove_dir_all(&p.out).with_context(|| format!("removing {}", p.out.display()))?;
    }
    make_dir(&p.out)?;

    let version = workspace_version(root)?;
    check_chart_version(&p, &version)?;
    check_seccomp_profile(&p)?;

    let kubectl = crate::util::which("kubectl").context(
        "kubectl not found on PATH: deploy-check renders deploy/kustomize with `kubectl \
         kustomize` (the client alone is enough)",
    )?;
    let helm = ensure_go_tool(&p.tools, &HELM)?;
    let kubeconform = ensure_go_tool(&p.tools, &KUBECONFORM)?;
    let schemas = ensure_schemas(&p.tools)?;

    let newest = &kube_version(NEWEST_MINOR);
    for (v, set) in (OLDEST_MINOR..=NEWEST_MINOR)
        .map(kube_version)
        .flat_map(|v| [(v.clone(), &[][..]), (v, &HELM_WEB[..])])
    {
        let mut lint = helm_cmd(&helm, &p);
        lint.args(["lint", "--strict", "--kube-version", &v])
            .arg(&p.chart)
            .args(["--namespace", NAMESPACE]);
        for s in set {
            lint.args(["--set", s]);
        }
        step(describe(&lint));
        let out = output(&mut lint)?;
        ensure!(
            out.contains("0 chart(s) failed"),
            "helm lint --strict did not pass:\n{out}"
        );
    }
    let helm_default = helm_template(&helm, &p, newest, &[], &[], "helm-default")?;
    let helm_options = helm_template(&helm, &p, newest, &HELM_OPTIONS, &[], "helm-options")?;
    let helm_web = helm_template(&helm, &p, newest, &HELM_WEB, &[], "helm-web")?;
    let helm_web_inline = helm_template(
        &helm,
        &p,
        newest,
        &["webConfig.enabled=true", "webConfig.secretName=pgio-tls"],
        &[&format!("webConfig.webYml={SHIPPED_WEB_YML}")],
        "helm-web-inline",
    )?;
    let kust_default = kustomize(&kubectl, &p, &p.kustomize, "kustomize-default")?;
    let overlay = write_overlay(&p, "kustomize-overlay", &KUSTOMIZE_COMPONENTS)?;
    let kust_options = kustomize(&kubectl, &p, &overlay, "kustomize-options")?;
    let web_overlay = write_overlay(&p, "kustomize-web-overlay", &KUSTOMIZE_WEB_COMPONENTS)?;
    let kust_web = kustomize(&kubectl, &p, &web_overlay, "kustomize-web")?;

    let crd_schemas = write_crd_schemas(&p.out)?;
    let renders = [
        &helm_default,
        &helm_options,
        &helm_web,
        &helm_web_inline,
        &kust_default,
        &kust_options,
        &kust_web,
    ];
    for r in renders {
        kubeconform_check(&kubeconform, &schemas, &crd_schemas, newest, r)?;
    }
    let tools = cases::Tools {
        helm: &helm,
        kubectl: &kubectl,
        kubeconform: &kubeconform,
        schemas: &schemas,
        crd_schemas: &crd_schemas,
    };
    let helm_oldest = cases::every_minor(&tools, &p)?;

    let shipped_web_yml = fs::read_to_string(p.root.join(SHIPPED_WEB_YML))
        .with_context(|| format!("reading {SHIPPED_WEB_YML}"))?;
    for r in renders {
        invariants::check(r, &version)
            .with_context(|| format!("{} ({})", r.what, r.file.display()))?;
        let https = invariants::web(r, &shipped_web_yml)
            .with_context(|| format!("{} ({})", r.what, r.file.display()))?;
        let want = [&helm_web, &helm_web_inline, &kust_web]
            .iter()
            .any(|w| w.what == r.what);
        ensure!(
            https == want,
            "{}: HTTPS is {} but should be {} ({})",
            r.what,
            if https { "on" } else { "off" },
            if want { "on" } else { "off" },
            r.file.display()
        );
    }
    for r in [&helm_options, &kust_options, &helm_web, &kust_web] {
        let ds = only(r, "DaemonSet")?;
        let sp =
            &ds["spec"]["template"]["spec"]["containers"][0]["securityContext"]["seccompProfile"];
        ensure!(
            sp["type"] == "Localhost" && sp["localhostProfile"] == "pgio.json",
            "{}: the options should select the Localhost seccomp profile pgio.json, got {sp}",
            r.what
        );
    }
    ensure!(
        !helm_default.docs.iter().any(|d| d["kind"] == "PodMonitor"),
        "helm template with the default values renders a PodMonitor (podMonitor.enabled should \
         default to false)"
    );

    agree(&helm_default, &kust_default)?;
    agree(&helm_options, &kust_options)?;
    agree(&helm_web, &kust_web)?;
    cases::refusals(&tools, &p)?;
    cases::extras(&tools, &p, newest, &version)?;
    openshift::check(&tools, &p, newest, &version)?;
    psa::check(
        &p,
        &[
            (&helm_default, newest),
            (&kust_default, newest),
            (&helm_web, newest),
            (&helm_oldest, &kube_version(OLDEST_MINOR)),
        ],
    )?;
    step(format!(
        "deploy-check: the Helm and kustomize renders agree (defaults, with {}, and with {}); \
         {} in {}",
        KUSTOMIZE_COMPONENTS.join(" + "),
        KUSTOMIZE_WEB_COMPONENTS.join(" + "),
        p.out.display(),
        fmt_duration(started.elapsed())
    ));
    Ok(())
}

// ---- tools -------------------------------------------------------------------------------

/// `<tools>/<name>-<version>/<name>`, built with `go install` unless it is there.
pub(crate) fn ensure_go_tool(tools: &Path, t: &GoTool) -> Result<PathBuf> {
    let dir = tools.join(format!("{}-{}", t.name, t.version));
    let bin = dir.join(t.name);
    if bin.is_file() {
        step(format!("{} {}: {}", t.name, t.version, bin.display()));
        return Ok(bin);
    }
    let go = crate::build::go_bin()?;
    let staging = tools.join(format!(".{}-{}.partial", t.name, t.version));
    remove_if_exists(&staging)?;
    make_dir(&staging)?;
    let started = Instant::now();
    let mut cmd = Command::new(&go);
    cmd.args(["install", &format!("{}@{}", t.package, t.version)])
        .env("GOBIN", &staging)
        .env("GOFLAGS", "-mod=mod")
        .env("GOTOOLCHAIN", "local");
    step(format!(
        "building {} {} from the Go module proxy, once per clone (a few minutes for helm): \
         GOBIN={} {}",
        t.name,
        t.version,
        staging.display(),
        describe(&cmd)
    ));
    run(&mut cmd)?;
    ensure!(
        staging.join(t.name).is_file(),
        "`{}` succeeded but left no {} in {}",
        describe(&cmd),
        t.name,
        staging.display()
    );
    remove_if_exists(&dir)?;
    fs::rename(&staging, &dir)
        .with_context(|| format!("renaming {} to {}", staging.display(), dir.display()))?;
    step(format!(
        "{} {} built in {}",
        t.name,
        t.version,
        fmt_duration(started.elapsed())
    ));
    Ok(bin)
}

/// `<tools>/kubernetes-validate-<v>/`, holding `v<kube>-local-strict/` for each minor from
/// [`OLDEST_MINOR`] to [`NEWEST_MINOR`], unpacked from the PyPI wheel unless they are there.
///
/// The wheel's schemas name each other by URL (`$id` https://kubernetes.io/api/..., `$ref`
/// `/api/_definitions.json#...`), which a validator would fetch: they are rewritten to refer to
/// the `_definitions.json` next to them, so nothing is fetched.
fn ensure_schemas(tools: &Path) -> Result<PathBuf> {
    let dir = tools.join(format!("kubernetes-validate-{KUBERNETES_VALIDATE}"));
    let stamp = dir.join(".complete");
    let versions: Vec<String> = (OLDEST_MINOR..=NEWEST_MINOR).map(kube_version).collect();
    let wanted = versions.join(" ");
    if fs::read_to_string(&stamp).is_ok_and(|s| s.trim() == wanted) {
        step(format!("Kubernetes {wanted} schemas: {}", dir.display()));
        return Ok(dir);
    }
    let started = Instant::now();
    let staging = tools.join(format!(
        ".kubernetes-validate-{KUBERNETES_VALIDATE}.partial"
    ));
    remove_if_exists(&staging)?;
    let wheel_dir = staging.join("wheel");
    make_dir(&wheel_dir)?;
    let python = env::var("PGIO_PYTHON").unwrap_or_else(|_| "python3".into());
    let mut pip = Command::new(&python);
    pip.args(["-m", "pip", "download", "--disable-pip-version-check", "-q"])
        .args(["--no-deps", "--only-binary=:all:", "-d"])
        .arg(&wheel_dir)
        .arg(format!("kubernetes-validate=={KUBERNETES_VALIDATE}"));
    step(describe(&pip));
    run(&mut pip)?;
    let wheel = fs::read_dir(&wheel_dir)
        .with_context(|| format!("reading {}", wheel_dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|e| e == "whl"))
        .with_context(|| format!("pip download left no wheel in {}", wheel_dir.display()))?;

    // Only the versions wanted (the wheel holds 26 directories, 110 MB unpacked).
    let unzipped = staging.join("unzipped");
    let prefixes: Vec<String> = versions
        .iter()
        .map(|v| format!("kubernetes_validate/kubernetes-json-schema/v{v}-local-strict/"))
        .collect();
    let mut unzip = Command::new(&python);
    unzip
        .args([
            "-c",
            "import sys, zipfile\n\
             z = zipfile.ZipFile(sys.argv[1])\n\
             for n in z.namelist():\n    \
                 if n.startswith(tuple(sys.argv[3:])): z.extract(n, sys.argv[2])\n",
        ])
        .arg(&wheel)
        .arg(&unzipped)
        .args(&prefixes);
    step(format!(
        "unpacking the strict schemas of Kubernetes {wanted}"
    ));
    run(&mut unzip)?;

    let schemas = staging.join("schemas");
    for (v, prefix) in versions.iter().zip(&prefixes) {
        let src = unzipped.join(prefix);
        ensure!(
            src.join("_definitions.json").is_file(),
            "kubernetes-validate {KUBERNETES_VALIDATE} has no strict schemas for Kubernetes {v} \
             ({} is missing)",
            src.join("_definitions.json").display()
        );
        let dst = schemas.join(format!("v{v}-local-strict"));
        make_dir(&dst)?;
        let mut n = 0;
        for entry in fs::read_dir(&src).with_context(|| format!("reading {}", src.display()))? {
            let path = entry
                .with_context(|| format!("reading {}", src.display()))?
                .path();
            let Some(name) = path.file_name() else {
                continue;
            };
            if path.extension().is_none_or(|e| e != "json") {
                continue;
            }
            let text =
                fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
            let mut schema: Value = serde_json::from_str(&text)
                .with_context(|| format!("parsing {}", path.display()))?;
            localize_refs(&mut schema);
            let out = dst.join(name);
            fs::write(&out, serde_json::to_vec(&schema)?)
                .with_context(|| format!("writing {}", out.display()))?;
            n += 1;
        }
        step(format!("Kubernetes {v}: {n} schemas"));
    }
    fs::write(schemas.join(".complete"), format!("{wanted}\n"))
        .with_context(|| format!("writing {}", schemas.join(".complete").display()))?;
    remove_if_exists(&dir)?;
    fs::rename(&schemas, &dir)
        .with_context(|| format!("renaming {} to {}", schemas.display(), dir.display()))?;
    remove_if_exists(&staging)?;
    step(format!(
        "Kubernetes schemas ready in {}",
        fmt_duration(started.elapsed())
    ));
    Ok(dir)
}

/// Drops `$id` and points `$ref`s to `/api/_definitions.json#...` at the sibling file.
fn localize_refs(v: &mut Value) {
    match v {
        Value::Object(map) => {
            map.remove("$id");
            for (k, child) in map.iter_mut() {
                match child {
                    Value::String(s) if k == "$ref" => {
                        if let Some(rest) = s.strip_prefix("/api/_definitions.json") {
                            *s = format!("_definitions.json{rest}");
                        }
                    }
                    _ => localize_refs(child),
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(localize_refs),
        _ => {}
    }
}

/// Schemas for the PodMonitor and the PrometheusRule (Prometheus Operator CRDs, not in
/// kubernetes-validate): only the fields the chart and the components use, every level closed,
/// so a misspelt field fails.
fn write_crd_schemas(out: &Path) -> Result<PathBuf> {
    let dir = out.join("crd-schemas");
    make_dir(&dir)?;
    let closed = |props: Value, required: &[&str]| {
        json!({"type": "object", "additionalProperties": false,
               "properties": props, "required": required})
    };
    let labels = json!({"type": "object", "additionalProperties": {"type": "string"}});
    let key_ref = closed(
        json!({"name": {"type": "string", "minLength": 1}, "key": {"type": "string", "minLength": 1},
               "optional": {"type": "boolean"}}),
        &["name", "key"],
    );
    let secret_or_config_map = json!({
        "type": "object", "additionalProperties": false, "minProperties": 1, "maxProperties": 1,
        "properties": {"secret": key_ref, "configMap": key_ref},
    });
    // The operator's SafeTLSConfig (what a PodMonitor endpoint takes).
    let tls_config = json!({
        "type": "object", "additionalProperties": false, "minProperties": 1,
        "properties": {
            "ca": secret_or_config_map,
            "cert": secret_or_config_map,
            "keySecret": key_ref,
            "serverName": {"type": "string", "minLength": 1},
            "insecureSkipVerify": {"type": "boolean"},
            "minVersion": {"enum": ["TLS10", "TLS11", "TLS12", "TLS13"]},
            "maxVersion": {"enum": ["TLS10", "TLS11", "TLS12", "TLS13"]},
        },
    });
    // The operator's RelabelConfig (no field required; `required` may not be empty).
    let relabel_config = json!({"type": "object", "additionalProperties": false,
    "properties": {
        "sourceLabels": {"type": "array", "items": {"type": "string", "minLength": 1}},
        "separator": {"type": "string"},
        "targetLabel": {"type": "string", "minLength": 1},
        "regex": {"type": "string"},
        "modulus": {"type": "integer", "minimum": 1},
        "replacement": {"type": "string"},
        "action": {"enum": ["replace", "keep", "drop", "hashmod", "labelmap", "labeldrop",
                            "labelkeep", "lowercase", "uppercase", "keepequal", "dropequal"]},
    }});
    let endpoint = closed(
        json!({
            "port": {"type": "string"},
            "path": {"type": "string"},
            "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
            "scrapeTimeout": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
            "scheme": {"enum": ["http", "https"]},
            "tlsConfig": tls_config,
            "basicAuth": closed(json!({"username": key_ref, "password": key_ref}),
                                &["username", "password"]),
            "honorLabels": {"type": "boolean"},
            "relabelings": {"type": "array", "items": relabel_config},
            "metricRelabelings": {"type": "array", "items": relabel_config},
        }),
        &["port"],
    );
    let schema = closed(
        json!({
            "apiVersion": {"enum": ["monitoring.coreos.com/v1"]},
            "kind": {"enum": ["PodMonitor"]},
            "metadata": closed(json!({
                "name": {"type": "string"},
                "namespace": {"type": "string"},
                "labels": labels,
                "annotations": labels,
            }), &["name"]),
            "spec": closed(json!({
                "selector": closed(json!({"matchLabels": labels}), &["matchLabels"]),
                "podMetricsEndpoints": {"type": "array", "minItems": 1, "items": endpoint},
                "sampleLimit": {"type": "integer", "minimum": 1},
            }), &["selector", "podMetricsEndpoints"]),
        }),
        &["apiVersion", "kind", "metadata", "spec"],
    );
    let file = dir.join("podmonitor-monitoring-v1.json");
    fs::write(&file, serde_json::to_vec_pretty(&schema)?)
        .with_context(|| format!("writing {}", file.display()))?;
    rules::write_schema(&dir)?;
    openshift::write_schema(&dir)?;
    Ok(dir)
}

// ---- renders -----------------------------------------------------------------------------

/// helm with its cache, config and data directories under the output directory.
fn helm_cmd(helm: &Path, p: &Paths) -> Command {
    let mut cmd = Command::new(helm);
    let home = p.out.join("helm-home");
    cmd.current_dir(&p.root)
        .env("HELM_CACHE_HOME", home.join("cache"))
        .env("HELM_CONFIG_HOME", home.join("config"))
        .env("HELM_DATA_HOME", home.join("data"));
    cmd
}

fn helm_template(
    helm: &Path,
    p: &Paths,
    kube_version: &str,
    set: &[&str],
    set_file: &[&str],
    name: &str,
) -> Result<Render> {
    let mut cmd = helm_cmd(helm, p);
    cmd.args(["template", RELEASE]).arg(&p.chart).args([
        "--namespace",
        NAMESPACE,
        "--kube-version",
        kube_version,
    ]);
    for s in set {
        cmd.args(["--set", s]);
    }
    for s in set_file {
        cmd.args(["--set-file", s]);
    }
    render(&mut cmd, p, name)
}

fn kustomize(kubectl: &Path, p: &Paths, dir: &Path, name: &str) -> Result<Render> {
    let mut cmd = Command::new(kubectl);
    cmd.arg("kustomize").arg(dir).current_dir(&p.root);
    render(&mut cmd, p, name)
}

fn render(cmd: &mut Command, p: &Paths, name: &str) -> Result<Render> {
    step(describe(cmd));
    let text = output(cmd)?;
    let file = p.out.join(format!("{name}.yaml"));
    fs::write(&file, &text).with_context(|| format!("writing {}", file.display()))?;
    let mut docs = Vec::new();
    for doc in serde_yaml_ng::Deserializer::from_str(&text) {
        let v = Value::deserialize(doc)
            .with_context(|| format!("parsing the YAML `{}` printed", describe(cmd)))?;
        if !v.is_null() {
            docs.push(v);
        }
    }
    ensure!(!docs.is_empty(), "`{}` rendered nothing", describe(cmd));
    Ok(Render {
        what: name.to_owned(),
        file,
        docs,
    })
}

/// An overlay of the base with these components, in the output directory. kustomize wants
/// relative paths to what an overlay includes.
fn write_overlay(p: &Paths, name: &str, components: &[&str]) -> Result<PathBuf> {
    let dir = p.out.join(name);
    make_dir(&dir)?;
    let base = relative(&dir, &p.kustomize)?;
    let mut text = format!(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n  - {}\n\
         components:\n",
        base.display()
    );
    for c in components {
        text.push_str(&format!(
            "  - {}\n",
            base.join("components").join(c).display()
        ));
    }
    let file = dir.join("kustomization.yaml");
    fs::write(&file, text).with_context(|| format!("writing {}", file.display()))?;
    Ok(dir)
}

/// `to` relative to the directory `from` (both made absolute and free of symlinks first).
fn relative(from: &Path, to: &Path) -> Result<PathBuf> {
    let from = from
        .canonicalize()
        .with_context(|| format!("resolving {}", from.display()))?;
    let to = to
        .canonicalize()
        .with_context(|| format!("resolving {}", to.display()))?;
    let f: Vec<Component> = from.components().collect();
    let t: Vec<Component> = to.components().collect();
    let common = f.iter().zip(&t).take_while(|(a, b)| a == b).count();
    let mut rel = PathBuf::new();
    for _ in common..f.len() {
        rel.push("..");
    }
    for c in &t[common..] {
        rel.push(c);
    }
    Ok(rel)
}

fn kubeconform_check(
    kubeconform: &Path,
    schemas: &Path,
    crd_schemas: &Path,
    kube_version: &str,
    r: &Render,
) -> Result<()> {
    let mut cmd = Command::new(kubeconform);
    cmd.args(["-strict", "-summary", "-output", "json"])
        .args(["-kubernetes-version", kube_version])
        .arg("-schema-location")
        .arg(format!(
            "{}/{{{{ .NormalizedKubernetesVersion }}}}-local{{{{ .StrictSuffix }}}}/\
             {{{{ .ResourceKind }}}}{{{{ .KindSuffix }}}}.json",
            schemas.display()
        ))
        .arg("-schema-location")
        .arg(format!(
            "{}/{{{{ .ResourceKind }}}}{{{{ .KindSuffix }}}}.json",
            crd_schemas.display()
        ))
        .arg(&r.file);
    let what = describe(&cmd);
    let out = cmd
        .output()
        .with_context(|| format!("failed to start `{what}`"))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let report: Value = serde_json::from_str(&stdout).with_context(|| {
        format!(
            "`{what}` printed no JSON report ({}): {}{}",
            out.status,
            stdout.trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        )
    })?;
    let count = |k: &str| report["summary"][k].as_u64().unwrap_or(u64::MAX);
    let (valid, invalid, errors, skipped) = (
        count("valid"),
        count("invalid"),
        count("errors"),
        count("skipped"),
    );
    let summary = format!(
        "kubeconform -strict, Kubernetes {kube_version}, {}: {valid} valid, {invalid} invalid, \
         {errors} errors, {skipped} skipped",
        r.what
    );
    if !out.status.success() || invalid != 0 || errors != 0 || skipped != 0 {
        let mut msg = format!("{summary} ({})", r.file.display());
        for res in report["resources"].as_array().into_iter().flatten() {
            msg.push_str(&format!(
                "\n  {} {}: {}",
                res["kind"].as_str().unwrap_or("?"),
                res["name"].as_str().unwrap_or("?"),
                res["msg"].as_str().unwrap_or("?")
            ));
        }
        bail!(msg);
    }
    ensure!(
        valid == r.docs.len() as u64,
        "{summary}, but the render has {} documents",
        r.docs.len()
    );
    step(summary);
    Ok(())
}

// ---- reading a render (the checks on one render are in invariants.rs) --------------------

fn only<'a>(r: &'a Render, kind: &str) -> Result<&'a Value> {
    let mut found = r.docs.iter().filter(|d| d["kind"] == kind);
    let first = found
        .next()
        .with_context(|| format!("{} ({}) has no {kind}", r.what, r.file.display()))?;
    ensure!(
        found.next().is_none(),
        "{} ({}) has more than one {kind}",
        r.what,
        r.file.display()
    );
    Ok(first)
}

fn str_of<'a>(v: &'a Value, what: &str) -> Result<&'a str> {
    v.as_str()
        .with_context(|| format!("{what} is not a string: {v}"))
}

/// The parsed pgio.toml of the render's ConfigMap, as JSON.
fn config_of(r: &Render) -> Result<Value> {
    let cm = only(r, "ConfigMap")?;
    let text = str_of(&cm["data"]["pgio.toml"], "ConfigMap data.pgio.toml")?;
    let table: toml::Table = toml::from_str(text)
        .with_context(|| format!("{}: ConfigMap pgio.toml is not valid TOML", r.what))?;
    Ok(serde_json::to_value(table)?)
}

fn labels_match(selector: &Value, labels: &Value) -> bool {
    selector.as_object().is_some_and(|s| {
        !s.is_empty() && s.iter().all(|(k, v)| labels.get(k).is_some_and(|l| l == v))
    })
}

// ---- Helm vs kustomize -------------------------------------------------------------------

/// What each tool must render alike: names, labels and Helm's own annotations aside.
fn view(r: &Render) -> Result<Value> {
    let ds = only(r, "DaemonSet")?;
    let tmpl = &ds["spec"]["template"];
    let mut pod = tmpl["spec"].clone();
    let pod_map = pod
        .as_object_mut()
        .context("DaemonSet spec.template.spec is not a map")?;
    // Names differ by tool (release name, kustomize's content hash); invariants::check() checked
    // that they refer to this render's ServiceAccount and ConfigMap.
    pod_map.remove("serviceAccountName");
    for v in pod_map
        .get_mut("volumes")
        .and_then(Value::as_array_mut)
        .into_iter()
        .flatten()
    {
        if let Some(name) = v.pointer_mut("/configMap/name") {
            *name = json!("<the ConfigMap>");
        }
    }
    let annotations: Map<String, Value> = tmpl["metadata"]["annotations"]
        .as_object()
        .into_iter()
        .flatten()
        .filter(|(k, _)| !k.starts_with("checksum/"))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let svc = only(r, "Service")?;
    let mut svc_spec = svc["spec"].clone();
    if let Some(m) = svc_spec.as_object_mut() {
        m.remove("selector");
    }
    let pod_monitors: Vec<Value> = r
        .docs
        .iter()
        .filter(|d| d["kind"] == "PodMonitor")
        .map(|d| d["spec"]["podMetricsEndpoints"].clone())
        .collect();
    Ok(json!({
        "DaemonSet": {
            "namespace": ds["metadata"]["namespace"],
            "updateStrategy": ds["spec"]["updateStrategy"],
            "template.annotations": annotations,
            "template.spec": pod,
        },
        "pgio.toml": config_of(r)?,
        "Service": {"namespace": svc["metadata"]["namespace"], "spec": svc_spec},
        "ServiceAccount": {
            "automountServiceAccountToken": only(r, "ServiceAccount")?["automountServiceAccountToken"],
        },
        "PodMonitor.podMetricsEndpoints": pod_monitors,
        "PrometheusRule.groups": r
            .docs
            .iter()
            .filter(|d| d["kind"] == "PrometheusRule")
            .map(|d| d["spec"]["groups"].clone())
            .collect::<Vec<_>>(),
        "NetworkPolicy": r
            .docs
            .iter()
            .filter(|d| d["kind"] == "NetworkPolicy")
            .map(|d| d["spec"].clone())
            .collect::<Vec<_>>(),
    }))
}

fn agree(helm: &Render, kust: &Render) -> Result<()> {
    let (h, k) = (view(helm)?, view(kust)?);
    let mut diffs = Vec::new();
    diff(&mut String::new(), &h, &k, &mut diffs);
    if !diffs.is_empty() {
        bail!(
            "the Helm chart and the kustomize base render different pods ({} vs {}):\n  {}\n\
             (left: helm, right: kustomize; fix deploy/helm/pgio or deploy/kustomize so they \
             agree)",
            helm.file.display(),
            kust.file.display(),
            diffs.join("\n  ")
        );
    }
    step(format!("{} and {} agree", helm.what, kust.what));
    Ok(())
}

/// Every path where `a` and `b` differ, as `path: a ≠ b`.
fn diff(path: &mut String, a: &Value, b: &Value, out: &mut Vec<String>) {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let keys: BTreeSet<&String> = x.keys().chain(y.keys()).collect();
            for k in keys {
                let len = path.len();
                if !path.is_empty() {
                    path.push('.');
                }
                path.push_str(k);
                diff(
                    path,
                    x.get(k).unwrap_or(&Value::Null),
                    y.get(k).unwrap_or(&Value::Null),
                    out,
                );
                path.truncate(len);
            }
        }
        (Value::Array(x), Value::Array(y)) => {
            for i in 0..x.len().max(y.len()) {
                let len = path.len();
                path.push_str(&format!("[{i}]"));
                diff(
                    path,
                    x.get(i).unwrap_or(&Value::Null),
                    y.get(i).unwrap_or(&Value::Null),
                    out,
                );
                path.truncate(len);
            }
        }
        _ if a == b => {}
        _ => out.push(format!("{path}: {} ≠ {}", shown(a), shown(b))),
    }
}

fn shown(v: &Value) -> String {
    if v.is_null() {
        "(absent)".to_owned()
    } else {
        v.to_string()
    }
}

// ---- versions and files ------------------------------------------------------------------

/// `[workspace.package] version` of the root Cargo.toml.
fn workspace_version(root: &Path) -> Result<String> {
    let file = root.join("Cargo.toml");
    let text = fs::read_to_string(&file).with_context(|| format!("reading {}", file.display()))?;
    let t: toml::Table =
        toml::from_str(&text).with_context(|| format!("parsing {}", file.display()))?;
    t.get("workspace")
        .and_then(|w| w.get("package"))
        .and_then(|p| p.get("version"))
        .and_then(|v| v.as_str())
        .map(str::to_owned)
        .with_context(|| format!("{} has no [workspace.package] version", file.display()))
}

fn check_chart_version(p: &Paths, version: &str) -> Result<()> {
    let file = p.chart.join("Chart.yaml");
    let text = fs::read_to_string(&file).with_context(|| format!("reading {}", file.display()))?;
    let chart: Value =
        serde_yaml_ng::from_str(&text).with_context(|| format!("parsing {}", file.display()))?;
    for key in ["version", "appVersion"] {
        ensure!(
            chart[key] == version,
            "{}: {key} is {}, the workspace version (Cargo.toml) is {version}",
            file.display(),
            chart[key]
        );
    }
    let claimed = format!(">=1.{OLDEST_MINOR}.0-0");
    ensure!(
        chart["kubeVersion"] == claimed.as_str(),
        "{}: kubeVersion is {}, but deploy-check validates from Kubernetes 1.{OLDEST_MINOR} \
         ({claimed}): change both together",
        file.display(),
        chart["kubeVersion"]
    );
    step(format!(
        "Chart.yaml version and appVersion = workspace version {version}; kubeVersion {claimed}"
    ));
    Ok(())
}

/// deploy/seccomp/pgio.json is valid, denies by default, allows bpf and perf_event_open, and
/// the chart's copy is the same file.
fn check_seccomp_profile(p: &Paths) -> Result<()> {
    let text = fs::read_to_string(&p.seccomp)
        .with_context(|| format!("reading {}", p.seccomp.display()))?;
    let profile: Value =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", p.seccomp.display()))?;
    ensure!(
        profile["defaultAction"] == "SCMP_ACT_ERRNO",
        "{}: defaultAction should be SCMP_ACT_ERRNO (deny by default)",
        p.seccomp.display()
    );
    let allowed: BTreeSet<&str> = profile["syscalls"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|s| s["action"] == "SCMP_ACT_ALLOW" && s.get("args").is_none())
        .flat_map(|s| s["names"].as_array().into_iter().flatten())
        .filter_map(Value::as_str)
        .collect();
    for needed in ["bpf", "perf_event_open"] {
        ensure!(
            allowed.contains(needed),
            "{}: {needed} is not allowed",
            p.seccomp.display()
        );
    }
    for never in [
        "mount",
        "ptrace",
        "unshare",
        "setns",
        "init_module",
        "kexec_load",
    ] {
        ensure!(
            !allowed.contains(never),
            "{}: {never} should not be allowed",
            p.seccomp.display()
        );
    }
    same_copy(&p.seccomp, &text, &p.chart.join("files/seccomp-pgio.json"))?;
    step(format!(
        "seccomp profile {}: {} syscalls allowed, bpf and perf_event_open among them; the \
         chart's copy is identical",
        p.seccomp.display(),
        allowed.len()
    ));
    Ok(())
}

/// The chart's `copy` (Helm reads only files inside the chart) holds `text`, the file at
/// `original`, byte for byte.
fn same_copy(original: &Path, text: &str, copy: &Path) -> Result<()> {
    let copy_text =
        fs::read_to_string(copy).with_context(|| format!("reading {}", copy.display()))?;
    ensure!(
        copy_text == text,
        "{} differs from {}: copy it (`cp {} {}`)",
        copy.display(),
        original.display(),
        original.display(),
        copy.display()
    );
    Ok(())
}

fn make_dir(dir: &Path) -> Result<()> {
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))
}

fn remove_if_exists(p: &Path) -> Result<()> {
    match fs::remove_dir_all(p) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e).with_context(|| format!("removing {}", p.display())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn diff_names_every_differing_path() {
        let a = json!({"c": [{"r": {"m": "128Mi"}, "x": 1}], "k": true});
        let b = json!({"c": [{"r": {"m": "256Mi"}}], "k": true, "n": "y"});
        let mut out = Vec::new();
        diff(&mut String::new(), &a, &b, &mut out);
        assert_eq!(
            out,
            [
                "c[0].r.m: \"128Mi\" ≠ \"256Mi\"",
                "c[0].x: 1 ≠ (absent)",
                "n: (absent) ≠ \"y\""
            ]
        );
    }

    #[test]
    fn refs_point_at_the_sibling_definitions() {
        let mut s = json!({"$id": "https://kubernetes.io/api/x", "properties": {
            "a": {"$ref": "/api/_definitions.json#/$defs/A"},
            "b": {"items": [{"$ref": "#/$defs/B"}]}}});
        localize_refs(&mut s);
        assert_eq!(
            s,
            json!({"properties": {
                "a": {"$ref": "_definitions.json#/$defs/A"},
                "b": {"items": [{"$ref": "#/$defs/B"}]}}})
        );
    }

    #[test]
    fn relative_paths_climb_to_the_common_ancestor() {
        let tmp = std::env::temp_dir().join(format!("xtask-rel-{}", std::process::id()));
        let (a, b) = (tmp.join("t/d/o"), tmp.join("deploy/k"));
        make_dir(&a).unwrap();
        make_dir(&b).unwrap();
        assert_eq!(
            relative(&a, &b).unwrap(),
            PathBuf::from("../../../deploy/k")
        );
        fs::remove_dir_all(&tmp).unwrap();
    }
}
