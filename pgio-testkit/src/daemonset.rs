//! A DaemonSet's pod spec, as `kubectl kustomize` renders it, translated into `podman run`
//! flags, so a test runs the image with exactly the permissions the manifest asks for.
//!
//! Every field of the pod spec and of its container is either translated, or listed as having
//! no effect on one node's container (scheduling, the API server), or refused: a field this
//! module does not know fails the translation, so the test cannot drift from the manifest
//! without anyone noticing.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail, ensure};
use serde_json::{Map, Value};

/// The rendered manifest: every document of a multi-document YAML stream.
pub struct Manifest {
    pub docs: Vec<Value>,
}

impl Manifest {
    /// `kubectl kustomize <dir>`, parsed.
    pub fn kustomize(dir: &Path) -> Result<Manifest> {
        let mut c = std::process::Command::new("kubectl");
        c.arg("kustomize").arg(dir);
        let yaml = crate::cmd::run(&mut c)?;
        Manifest::parse(&yaml)
    }

    pub fn parse(yaml: &str) -> Result<Manifest> {
        use serde::Deserialize;
        let mut docs = Vec::new();
        for doc in serde_yaml_ng::Deserializer::from_str(yaml) {
            let v = Value::deserialize(doc).context("parsing the rendered manifest")?;
            if !v.is_null() {
                docs.push(v);
            }
        }
        Ok(Manifest { docs })
    }

    /// The one object of `kind`; an error if there is none or more than one.
    pub fn only(&self, kind: &str) -> Result<&Value> {
        let mut found = self.docs.iter().filter(|d| d["kind"] == kind);
        let first = found
            .next()
            .with_context(|| format!("the manifest has no {kind}"))?;
        ensure!(
            found.next().is_none(),
            "the manifest has more than one {kind}"
        );
        Ok(first)
    }

    /// `spec.template.spec` of the one DaemonSet.
    pub fn daemonset_pod_spec(&self) -> Result<&Value> {
        let pod = &self.only("DaemonSet")?["spec"]["template"]["spec"];
        ensure!(pod.is_object(), "the DaemonSet has no spec.template.spec");
        Ok(pod)
    }

    /// `data` of the ConfigMap named `name` (file name → content).
    pub fn config_map_data(&self, name: &str) -> Result<BTreeMap<String, String>> {
        let cm = self
            .docs
            .iter()
            .find(|d| d["kind"] == "ConfigMap" && d["metadata"]["name"] == name)
            .with_context(|| format!("the manifest has no ConfigMap {name}"))?;
        let data = cm["data"]
            .as_object()
            .with_context(|| format!("ConfigMap {name} has no data"))?;
        data.iter()
            .map(|(k, v)| {
                let text = v
                    .as_str()
                    .with_context(|| format!("ConfigMap {name}: {k} is not a string"))?;
                Ok((k.clone(), text.to_owned()))
            })
            .collect()
    }
}

/// What the node provides, for the fields that name things on it.
pub struct Node<'a> {
    /// The host directory standing for `hostPath.path` on this machine: usually the path itself;
    /// a test substitutes a temporary directory for one this machine does not have (as the
    /// kubelet would create it for `DirectoryOrCreate`) rather than creating it on the host.
    pub host_path: &'a dyn Fn(&str, &str) -> Result<PathBuf>,
    /// Directory holding the files of ConfigMap `name` (the test writes them).
    pub config_map_dir: &'a dyn Fn(&str) -> Result<PathBuf>,
    /// Stands for `<kubelet root>/seccomp`, where `Localhost` profiles are found.
    pub seccomp_root: &'a Path,
    /// The profile standing for the runtime's `RuntimeDefault` (see
    /// [`containerd_like_default_profile`]).
    pub runtime_default_seccomp: &'a Path,
    /// Host port to publish the container's port on when the pod is not on the host network.
    pub host_port: u16,
    /// Value of `fieldRef: spec.nodeName`.
    pub node_name: &'a str,
}

/// An HTTP probe of the container (`httpGet`).
#[derive(Debug, Clone, PartialEq)]
pub struct HttpProbe {
    pub kind: String,
    pub path: String,
    pub port: u16,
}

/// The translation: `podman run` flags (besides `--name`, `-d` and the machine's ulimits),
/// the container's arguments, and where to reach it.
#[derive(Debug, Clone, Default)]
pub struct PodmanRun {
    pub flags: Vec<String>,
    /// `command` of the container, as `--entrypoint` JSON (already in `flags`); kept for messages.
    pub entrypoint: Option<Vec<String>>,
    pub args: Vec<String>,
    pub host_network: bool,
    /// The container's (first) TCP port.
    pub container_port: Option<u16>,
    /// Where the container's port is reached from the host.
    pub url_port: Option<u16>,
    pub probes: Vec<HttpProbe>,
    /// `securityContext.capabilities.add` of the container, as written (`BPF`, `PERFMON`, …).
    pub cap_add: Vec<String>,
    /// Fields that had nothing to translate on one node, with why (for the test's log).
    pub ignored: Vec<String>,
}

/// Pod spec fields that only matter to the scheduler or the API server.
const POD_IGNORED: &[(&str, &str)] = &[
    ("tolerations", "scheduling"),
    ("nodeSelector", "scheduling"),
    ("affinity", "scheduling"),
    ("priorityClassName", "scheduling"),
    ("schedulerName", "scheduling"),
    (
        "serviceAccountName",
        "API access (there is no API server here)",
    ),
    ("serviceAccount", "API access (there is no API server here)"),
    (
        "automountServiceAccountToken",
        "API access (there is no API server here)",
    ),
    ("imagePullSecrets", "registry access"),
    ("dnsPolicy", "cluster DNS"),
    ("enableServiceLinks", "service environment variables"),
    ("restartPolicy", "the kubelet restarts; the test does not"),
];

const CONTAINER_IGNORED: &[(&str, &str)] = &[
    ("name", "naming"),
    ("image", "the test runs the image it built"),
    ("imagePullPolicy", "registry access"),
    ("terminationMessagePath", "kubelet bookkeeping"),
    ("terminationMessagePolicy", "kubelet bookkeeping"),
];

/// Translates the pod spec of a DaemonSet (one container) into `podman run` flags.
pub fn to_podman(pod: &Value, node: &Node) -> Result<PodmanRun> {
    let pod = obj(pod, "spec.template.spec")?;
    let mut run = PodmanRun::default();
    let mut pod_security = None;
    let mut volumes = BTreeMap::new();
    let mut container = None;
    for (key, value) in pod {
        let at = format!("spec.template.spec.{key}");
        match key.as_str() {
            "containers" => {
                let list = value
                    .as_array()
                    .with_context(|| format!("{at}: not a list"))?;
                ensure!(
                    list.len() == 1,
                    "{at}: {} containers; only one can be translated",
                    list.len()
                );
                container = Some(&list[0]);
            }
            "initContainers" => ensure!(
                value.as_array().is_some_and(|l| l.is_empty()),
                "{at}: init containers cannot be translated"
            ),
            "hostPID" => {
                if bool_at(value, &at)? {
                    run.flags.push("--pid=host".into());
                }
            }
            "hostIPC" => {
                if bool_at(value, &at)? {
                    run.flags.push("--ipc=host".into());
                }
            }
            "hostNetwork" => run.host_network = bool_at(value, &at)?,
            "securityContext" => pod_security = Some(obj(value, &at)?),
            "terminationGracePeriodSeconds" => {
                let secs = value
                    .as_u64()
                    .with_context(|| format!("{at}: not a number"))?;
                run.flags.push(format!("--stop-timeout={secs}"));
            }
            "volumes" => {
                for v in value
                    .as_array()
                    .with_context(|| format!("{at}: not a list"))?
                {
                    let name = str_at(&v["name"], &format!("{at}[].name"))?;
                    volumes.insert(name.to_owned(), v);
                }
            }
            other => match POD_IGNORED.iter().find(|(k, _)| *k == other) {
                Some((k, why)) => run.ignored.push(format!("{k}: {why}")),
                None => bail!("{at}: no podman translation for this field"),
            },
        }
    }
    let container = container.context("spec.template.spec.containers is missing")?;
    translate_container(container, pod_security, &volumes, node, &mut run)?;
    // procMount Default: the runtime's masked paths. Podman also masks /sys/dev/block (with an
    // empty tmpfs), containerd and CRI-O do not: unmask it to see what a pod sees.
    run.flags
        .push("--security-opt=unmask=/sys/dev/block".into());
    if run.host_network {
        run.flags.push("--network=host".into());
        run.url_port = run.container_port;
    } else if let Some(port) = run.container_port {
        run.flags
            .push(format!("--publish=127.0.0.1:{}:{port}", node.host_port));
        run.url_port = Some(node.host_port);
    }
    Ok(run)
}

fn translate_container(
    c: &Value,
    pod_security: Option<&Map<String, Value>>,
    volumes: &BTreeMap<String, &Value>,
    node: &Node,
    run: &mut PodmanRun,
) -> Result<()> {
    let c = obj(c, "containers[0]")?;
    let mut security = Map::new();
    let mut named_ports = BTreeMap::new();
    let mut probes = Vec::new();
    for (key, value) in c {
        let at = format!("containers[0].{key}");
        match key.as_str() {
            "command" => {
                let cmd = strings(value, &at)?;
                run.flags
                    .push(format!("--entrypoint={}", serde_json::to_string(&cmd)?));
                run.entrypoint = Some(cmd);
            }
            "args" => run.args = strings(value, &at)?,
            "env" => {
                for e in value
                    .as_array()
                    .with_context(|| format!("{at}: not a list"))?
                {
                    run.flags.push(format!("--env={}", env_var(e, node, &at)?));
                }
            }
            "ports" => {
                for p in value
                    .as_array()
                    .with_context(|| format!("{at}: not a list"))?
                {
                    let p = obj(p, &format!("{at}[]"))?;
                    let port = port_at(&p["containerPort"], &format!("{at}[].containerPort"))?;
                    run.container_port.get_or_insert(port);
                    for (k, v) in p {
                        match k.as_str() {
                            "containerPort" => {}
                            "name" => {
                                named_ports.insert(str_at(v, &format!("{at}[].name"))?, port);
                            }
                            "protocol" => ensure!(v == "TCP", "{at}[].protocol: only TCP"),
                            other => bail!("{at}[].{other}: no podman translation"),
                        }
                    }
                }
            }
            "resources" => resources(obj(value, &at)?, &at, run)?,
            "livenessProbe" | "readinessProbe" | "startupProbe" => {
                probes.push(http_probe(key, obj(value, &at)?, &at)?)
            }
            "volumeMounts" => {
                for m in value
                    .as_array()
                    .with_context(|| format!("{at}: not a list"))?
                {
                    run.flags.push(mount(m, volumes, node, &at)?);
                }
            }
            "securityContext" => security = obj(value, &at)?.clone(),
            other => match CONTAINER_IGNORED.iter().find(|(k, _)| *k == other) {
                Some((k, why)) => run.ignored.push(format!("container {k}: {why}")),
                None => bail!("{at}: no podman translation for this field"),
            },
        }
    }
    for (kind, path, port) in probes {
        let port = match &port {
            Value::String(name) => *named_ports
                .get(name.as_str())
                .with_context(|| format!("{kind}: no container port named {name}"))?,
            other => port_at(other, &format!("{kind}.httpGet.port"))?,
        };
        run.probes.push(HttpProbe { kind, path, port });
    }
    security_context(pod_security, &security, node, run)
}

/// Pod-level fields first, then the container's (which win), as the kubelet merges them.
fn security_context(
    pod: Option<&Map<String, Value>>,
    container: &Map<String, Value>,
    node: &Node,
    run: &mut PodmanRun,
) -> Result<()> {
    let mut merged: Map<String, Value> = Map::new();
    if let Some(pod) = pod {
        for (k, v) in pod {
            match k.as_str() {
                "runAsUser" | "runAsGroup" | "runAsNonRoot" | "seccompProfile"
                | "appArmorProfile" => {
                    merged.insert(k.clone(), v.clone());
                }
                "supplementalGroups" => ensure!(
                    v.as_array().is_some_and(|l| l.is_empty()),
                    "securityContext.supplementalGroups: no podman translation"
                ),
                other => bail!("spec.template.spec.securityContext.{other}: no podman translation"),
            }
        }
    }
    for (k, v) in container {
        merged.insert(k.clone(), v.clone());
    }
    let at = "securityContext";
    let mut user = None;
    let mut group = None;
    let mut non_root = false;
    let mut seccomp = None;
    for (k, v) in &merged {
        match k.as_str() {
            "privileged" => ensure!(
                !bool_at(v, "securityContext.privileged")?,
                "{at}.privileged: true is refused (pgio must run unprivileged)"
            ),
            "allowPrivilegeEscalation" => {
                if !bool_at(v, "securityContext.allowPrivilegeEscalation")? {
                    run.flags.push("--security-opt=no-new-privileges".into());
                }
            }
            "readOnlyRootFilesystem" => {
                if bool_at(v, "securityContext.readOnlyRootFilesystem")? {
                    // Kubernetes mounts no tmpfs on /tmp, /run, /var/tmp; podman would.
                    run.flags.push("--read-only".into());
                    run.flags.push("--read-only-tmpfs=false".into());
                }
            }
            "runAsUser" => user = Some(v.as_u64().context("securityContext.runAsUser")?),
            "runAsGroup" => group = Some(v.as_u64().context("securityContext.runAsGroup")?),
            "runAsNonRoot" => non_root = bool_at(v, "securityContext.runAsNonRoot")?,
            "seccompProfile" => seccomp = Some(obj(v, "securityContext.seccompProfile")?),
            "appArmorProfile" => {
                if let Some(flag) = apparmor_flag(obj(v, "securityContext.appArmorProfile")?)? {
                    run.flags.push(flag);
                }
            }
            "procMount" => ensure!(v == "Default", "{at}.procMount: only Default"),
            "capabilities" => {
                let caps = obj(v, "securityContext.capabilities")?;
                if let Some(other) = caps.keys().find(|k| !matches!(k.as_str(), "add" | "drop")) {
                    bail!("{at}.capabilities.{other}: no podman translation");
                }
                // Drop first, as the runtime applies them (podman takes `ALL` in any order).
                if let Some(drop) = caps.get("drop") {
                    let list = strings(drop, "securityContext.capabilities.drop")?;
                    run.flags
                        .extend(list.iter().map(|c| format!("--cap-drop={c}")));
                }
                if let Some(add) = caps.get("add") {
                    let list = strings(add, "securityContext.capabilities.add")?;
                    run.flags
                        .extend(list.iter().map(|c| format!("--cap-add={c}")));
                    run.cap_add = list;
                }
            }
            other => bail!("{at}.{other}: no podman translation"),
        }
    }
    // The kubelet refuses to start a runAsNonRoot container whose user is 0 (or unknown).
    ensure!(
        !non_root || user.is_some_and(|u| u != 0),
        "{at}: runAsNonRoot with user {user:?} would not start"
    );
    match (user, group) {
        (Some(u), Some(g)) => run.flags.push(format!("--user={u}:{g}")),
        (Some(u), None) => run.flags.push(format!("--user={u}")),
        (None, Some(_)) => bail!("{at}: runAsGroup without runAsUser"),
        (None, None) => {}
    }
    match seccomp {
        // Without a profile the kubelet runs the container Unconfined (before 1.27's
        // SeccompDefault became the default) or with RuntimeDefault: refuse the ambiguity.
        None => bail!("{at}.seccompProfile: not set; say RuntimeDefault, Localhost or Unconfined"),
        Some(p) => run.flags.push(seccomp_flag(p, node)?),
    }
    Ok(())
}

/// Podman applies its default AppArmor profile where the host has AppArmor, as the runtime would.
fn apparmor_flag(p: &Map<String, Value>) -> Result<Option<String>> {
    let kind = str_at(&p["type"], "appArmorProfile.type")?;
    for k in p.keys() {
        ensure!(
            k == "type" || (k == "localhostProfile" && kind == "Localhost"),
            "appArmorProfile.{k}: no podman translation"
        );
    }
    Ok(match kind {
        "RuntimeDefault" => None,
        "Unconfined" => Some("--security-opt=apparmor=unconfined".into()),
        "Localhost" => Some(format!(
            "--security-opt=apparmor={}",
            str_at(&p["localhostProfile"], "appArmorProfile.localhostProfile")?
        )),
        other => bail!("appArmorProfile.type {other}: no podman translation"),
    })
}

fn seccomp_flag(p: &Map<String, Value>, node: &Node) -> Result<String> {
    let kind = str_at(&p["type"], "seccompProfile.type")?;
    for k in p.keys() {
        ensure!(
            k == "type" || (k == "localhostProfile" && kind == "Localhost"),
            "seccompProfile.{k}: no podman translation"
        );
    }
    Ok(match kind {
        // Podman's own default profile stands for the runtime's.
        "RuntimeDefault" => format!(
            "--security-opt=seccomp={}",
            node.runtime_default_seccomp.display()
        ),
        "Unconfined" => "--security-opt=seccomp=unconfined".into(),
        "Localhost" => {
            let rel = str_at(&p["localhostProfile"], "seccompProfile.localhostProfile")?;
            let file = node.seccomp_root.join(rel);
            ensure!(
                file.is_file(),
                "seccompProfile.localhostProfile {rel}: {} does not exist",
                file.display()
            );
            format!("--security-opt=seccomp={}", file.display())
        }
        other => bail!("seccompProfile.type {other}: no podman translation"),
    })
}

fn resources(r: &Map<String, Value>, at: &str, run: &mut PodmanRun) -> Result<()> {
    for (k, v) in r {
        match k.as_str() {
            "requests" => run.ignored.push("resources.requests: scheduling".into()),
            "limits" => {
                for (lk, lv) in obj(v, &format!("{at}.limits"))? {
                    let q = quantity(lv, &format!("{at}.limits.{lk}"))?;
                    match lk.as_str() {
                        "memory" => run.flags.push(format!("--memory={}b", memory_bytes(&q)?)),
                        "cpu" => run.flags.push(format!("--cpus={}", cpus(&q)?)),
                        other => bail!("{at}.limits.{other}: no podman translation"),
                    }
                }
            }
            other => bail!("{at}.{other}: no podman translation"),
        }
    }
    Ok(())
}

fn quantity(v: &Value, at: &str) -> Result<String> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Number(n) => Ok(n.to_string()),
        _ => bail!("{at}: not a quantity"),
    }
}

/// `128Mi`, `1G`, `134217728` → bytes.
pub fn memory_bytes(q: &str) -> Result<u64> {
    const UNITS: &[(&str, u64)] = &[
        ("Ki", 1 << 10),
        ("Mi", 1 << 20),
        ("Gi", 1 << 30),
        ("Ti", 1 << 40),
        ("k", 1_000),
        ("M", 1_000_000),
        ("G", 1_000_000_000),
        ("T", 1_000_000_000_000),
    ];
    let (num, mult) = UNITS
        .iter()
        .find_map(|(u, m)| q.strip_suffix(u).map(|n| (n, *m)))
        .unwrap_or((q, 1));
    let n: u64 = num
        .parse()
        .with_context(|| format!("memory quantity {q:?}"))?;
    Ok(n * mult)
}

/// `500m`, `1`, `0.5` → CPUs.
pub fn cpus(q: &str) -> Result<f64> {
    match q.strip_suffix('m') {
        Some(milli) => Ok(milli
            .parse::<f64>()
            .with_context(|| format!("cpu quantity {q:?}"))?
            / 1000.0),
        None => q.parse().with_context(|| format!("cpu quantity {q:?}")),
    }
}

/// (kind, path, port as written: a number or a container port's name).
fn http_probe(kind: &str, p: &Map<String, Value>, at: &str) -> Result<(String, String, Value)> {
    let mut probe = None;
    for (k, v) in p {
        match k.as_str() {
            "httpGet" => {
                let g = obj(v, &format!("{at}.httpGet"))?;
                let mut path = "/".to_owned();
                let mut port = None;
                for (gk, gv) in g {
                    match gk.as_str() {
                        "path" => path = str_at(gv, &format!("{at}.httpGet.path"))?.to_owned(),
                        "port" => port = Some(gv.clone()),
                        "scheme" => ensure!(gv == "HTTP", "{at}.httpGet.scheme: only HTTP"),
                        other => bail!("{at}.httpGet.{other}: no podman translation"),
                    }
                }
                let port = port.with_context(|| format!("{at}.httpGet.port missing"))?;
                probe = Some((kind.to_owned(), path, port));
            }
            // Timing only: the test checks the endpoint once the daemon is up.
            "initialDelaySeconds"
            | "periodSeconds"
            | "timeoutSeconds"
            | "failureThreshold"
            | "successThreshold"
            | "terminationGracePeriodSeconds" => {}
            other => bail!("{at}.{other}: only httpGet probes can be checked"),
        }
    }
    probe.with_context(|| format!("{at}: no httpGet"))
}

fn mount(m: &Value, volumes: &BTreeMap<String, &Value>, node: &Node, at: &str) -> Result<String> {
    let m = obj(m, &format!("{at}[]"))?;
    let mut name = None;
    let mut target = None;
    let mut read_only = false;
    let mut propagation = "rprivate";
    for (k, v) in m {
        match k.as_str() {
            "name" => name = Some(str_at(v, &format!("{at}[].name"))?),
            "mountPath" => target = Some(str_at(v, &format!("{at}[].mountPath"))?),
            "readOnly" => read_only = bool_at(v, &format!("{at}[].readOnly"))?,
            "mountPropagation" => {
                propagation = match str_at(v, &format!("{at}[].mountPropagation"))? {
                    "None" => "rprivate",
                    "HostToContainer" => "rslave",
                    other => bail!(
                        "{at}[].mountPropagation {other}: refused (Bidirectional needs a privileged container)"
                    ),
                }
            }
            other => bail!("{at}[].{other}: no podman translation"),
        }
    }
    let name = name.with_context(|| format!("{at}[]: no name"))?;
    let target = target.with_context(|| format!("{at}[] {name}: no mountPath"))?;
    let volume = obj(
        volumes
            .get(name)
            .with_context(|| format!("{at}[] {name}: no such volume"))?,
        "volume",
    )?;
    let vat = format!("volumes[{name}]");
    let mut source = None;
    for (k, v) in volume {
        match k.as_str() {
            "name" => {}
            "hostPath" => {
                let hp = obj(v, &format!("{vat}.hostPath"))?;
                let mut path = None;
                let mut kind = "";
                for (hk, hv) in hp {
                    match hk.as_str() {
                        "path" => path = Some(str_at(hv, &format!("{vat}.hostPath.path"))?),
                        "type" => kind = str_at(hv, &format!("{vat}.hostPath.type"))?,
                        other => bail!("{vat}.hostPath.{other}: no podman translation"),
                    }
                }
                let path = path.with_context(|| format!("{vat}.hostPath.path missing"))?;
                source = Some((node.host_path)(path, kind)?);
            }
            "configMap" => {
                let cm = obj(v, &format!("{vat}.configMap"))?;
                for ck in cm.keys() {
                    ensure!(
                        matches!(ck.as_str(), "name" | "defaultMode"),
                        "{vat}.configMap.{ck}: no podman translation"
                    );
                }
                let cm_name = str_at(&cm["name"], &format!("{vat}.configMap.name"))?;
                // The kubelet mounts ConfigMaps read-only whatever the mount says.
                read_only = true;
                source = Some((node.config_map_dir)(cm_name)?);
            }
            other => bail!("{vat}.{other}: no podman translation for this volume type"),
        }
    }
    let source = source.with_context(|| format!("{vat}: no source"))?;
    let src = source.to_str().context("non-UTF-8 host path")?;
    ensure!(
        !src.contains([':', ',']) && !target.contains([':', ',']),
        "{vat}: ':' or ',' in a path cannot be passed to podman -v"
    );
    Ok(format!(
        "--volume={src}:{target}:{},{propagation}",
        if read_only { "ro" } else { "rw" }
    ))
}

fn env_var(e: &Value, node: &Node, at: &str) -> Result<String> {
    let e = obj(e, &format!("{at}[]"))?;
    let name = str_at(&e["name"], &format!("{at}[].name"))?;
    for k in e.keys() {
        ensure!(
            matches!(k.as_str(), "name" | "value" | "valueFrom"),
            "{at}[].{k}: no podman translation"
        );
    }
    if let Some(v) = e.get("value") {
        return Ok(format!(
            "{name}={}",
            str_at(v, &format!("{at}[{name}].value"))?
        ));
    }
    let path = &e["valueFrom"]["fieldRef"]["fieldPath"];
    match path.as_str() {
        Some("spec.nodeName") => Ok(format!("{name}={}", node.node_name)),
        _ => bail!("{at}[{name}].valueFrom: only fieldRef spec.nodeName is translated"),
    }
}

fn obj<'v>(v: &'v Value, at: &str) -> Result<&'v Map<String, Value>> {
    v.as_object()
        .with_context(|| format!("{at}: not an object"))
}

fn str_at<'v>(v: &'v Value, at: &str) -> Result<&'v str> {
    v.as_str().with_context(|| format!("{at}: not a string"))
}

fn bool_at(v: &Value, at: &str) -> Result<bool> {
    v.as_bool().with_context(|| format!("{at}: not a boolean"))
}

fn port_at(v: &Value, at: &str) -> Result<u16> {
    v.as_u64()
        .and_then(|p| u16::try_from(p).ok())
        .with_context(|| format!("{at}: not a port number (named ports are not translated)"))
}

fn strings(v: &Value, at: &str) -> Result<Vec<String>> {
    v.as_array()
        .with_context(|| format!("{at}: not a list"))?
        .iter()
        .map(|s| str_at(s, at).map(str::to_owned))
        .collect()
}

/// Podman's default seccomp profile (`/usr/share/containers/seccomp.json`) made to stand for
/// the `RuntimeDefault` of containerd >= 1.6.9 / 1.7 and Docker >= 22.06: `bpf` allowed with
/// CAP_BPF and `perf_event_open` with CAP_PERFMON, not only with CAP_SYS_ADMIN (containerd
/// PR 7301, moby PR 43987). Debian 12's podman (containers-common 0.50.1) lacks exactly that
/// rule; nothing else is changed.
pub fn containerd_like_default_profile(podman_default: &str) -> Result<String> {
    let mut profile: Value =
        serde_json::from_str(podman_default).context("parsing podman's seccomp profile")?;
    let syscalls = profile["syscalls"]
        .as_array_mut()
        .context("seccomp profile without syscalls")?;
    const GATED: [(&str, &str); 2] = [("bpf", "CAP_BPF"), ("perf_event_open", "CAP_PERFMON")];
    // The "EPERM unless CAP_SYS_ADMIN" entry would shadow the new ones: take them out of it.
    for entry in syscalls.iter_mut() {
        let denies = entry["action"] == "SCMP_ACT_ERRNO";
        if let (true, Some(names)) = (denies, entry["names"].as_array_mut()) {
            names.retain(|n| !GATED.iter().any(|(s, _)| n == s));
        }
    }
    syscalls.retain(|e| e["names"].as_array().is_none_or(|n| !n.is_empty()));
    for (syscall, cap) in GATED {
        syscalls.push(serde_json::json!({
            "names": [syscall],
            "action": "SCMP_ACT_ALLOW",
            "args": [],
            "comment": format!("containerd RuntimeDefault: {syscall} with {cap}"),
            "includes": {"caps": [cap]},
            "excludes": {}
        }));
    }
    Ok(serde_json::to_string_pretty(&profile)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    const POD: &str = r#"
apiVersion: apps/v1
kind: DaemonSet
metadata: {name: pgio}
spec:
  template:
    spec:
      hostPID: true
      tolerations: [{operator: Exists}]
      securityContext:
        runAsUser: 0
        seccompProfile: {type: Localhost, localhostProfile: pgio.json}
      containers:
        - name: pgio
          image: localhost/pgio:0.1.0
          args: [run, --config, /etc/pgio/pgio.toml]
          ports: [{name: metrics, containerPort: 9435, protocol: TCP}]
          env:
            - {name: NODE_NAME, valueFrom: {fieldRef: {fieldPath: spec.nodeName}}}
          resources: {requests: {cpu: 50m}, limits: {memory: 256Mi, cpu: 500m}}
          readinessProbe: {httpGet: {path: /healthz, port: metrics}, periodSeconds: 10}
          livenessProbe: {httpGet: {path: /healthz, port: 9435}}
          securityContext:
            allowPrivilegeEscalation: false
            readOnlyRootFilesystem: true
            capabilities: {drop: [ALL], add: [BPF, PERFMON]}
            appArmorProfile: {type: Unconfined}
          volumeMounts:
            - {name: tracefs, mountPath: /sys/kernel/tracing, readOnly: true}
            - {name: longhorn, mountPath: /dev/longhorn, readOnly: true, mountPropagation: HostToContainer}
            - {name: config, mountPath: /etc/pgio}
      volumes:
        - {name: tracefs, hostPath: {path: /sys/kernel/tracing, type: Directory}}
        - {name: longhorn, hostPath: {path: /dev/longhorn, type: DirectoryOrCreate}}
        - {name: config, configMap: {name: pgio-config-abc}}
"#;

    fn translate(yaml: &str) -> Result<PodmanRun> {
        let m = Manifest::parse(yaml)?;
        let host_path = |p: &str, _: &str| Ok(PathBuf::from(p));
        let config_map_dir = |n: &str| Ok(PathBuf::from(format!("/tmp/cm/{n}")));
        let dir = tempfile::tempdir()?;
        std::fs::write(dir.path().join("pgio.json"), "{}")?;
        let node = Node {
            host_path: &host_path,
            config_map_dir: &config_map_dir,
            seccomp_root: dir.path(),
            runtime_default_seccomp: Path::new("/default.json"),
            host_port: 40000,
            node_name: "n1",
        };
        let mut run = to_podman(m.daemonset_pod_spec()?, &node)?;
        // The temp dir's name varies.
        for f in &mut run.flags {
            if f.starts_with("--security-opt=seccomp=") {
                *f = "--security-opt=seccomp=<root>/pgio.json".into();
            }
        }
        Ok(run)
    }

    #[test]
    fn translates_a_daemonset() {
        let run = translate(POD).unwrap();
        assert_eq!(
            run.flags,
            [
                "--pid=host",
                "--env=NODE_NAME=n1",
                "--cpus=0.5",
                "--memory=268435456b",
                "--volume=/sys/kernel/tracing:/sys/kernel/tracing:ro,rprivate",
                "--volume=/dev/longhorn:/dev/longhorn:ro,rslave",
                "--volume=/tmp/cm/pgio-config-abc:/etc/pgio:ro,rprivate",
                "--security-opt=no-new-privileges",
                "--security-opt=apparmor=unconfined",
                "--cap-drop=ALL",
                "--cap-add=BPF",
                "--cap-add=PERFMON",
                "--read-only",
                "--read-only-tmpfs=false",
                "--user=0",
                "--security-opt=seccomp=<root>/pgio.json",
                "--security-opt=unmask=/sys/dev/block",
                "--publish=127.0.0.1:40000:9435",
            ]
        );
        assert_eq!(run.args, ["run", "--config", "/etc/pgio/pgio.toml"]);
        assert_eq!(run.cap_add, ["BPF", "PERFMON"]);
        assert_eq!(run.url_port, Some(40000));
        assert_eq!(
            run.probes,
            ["livenessProbe", "readinessProbe"].map(|kind| HttpProbe {
                kind: kind.into(),
                path: "/healthz".into(),
                port: 9435
            })
        );
    }

    #[test]
    fn unknown_fields_fail() {
        for (from, to, needle) in [
            (
                "hostPID: true",
                "hostPID: true\n      hostUsers: false",
                "hostUsers",
            ),
            (
                "readOnlyRootFilesystem: true",
                "readOnlyRootFilesystem: true\n            seLinuxOptions: {level: s0}",
                "seLinuxOptions",
            ),
            (
                "readOnlyRootFilesystem: true",
                "privileged: true",
                "privileged",
            ),
            (
                "type: DirectoryOrCreate}",
                "type: DirectoryOrCreate}, emptyDir: {}",
                "emptyDir",
            ),
            (
                "mountPropagation: HostToContainer",
                "mountPropagation: Bidirectional",
                "Bidirectional",
            ),
            ("cpu: 500m}", "cpu: 500m, hugepages-2Mi: 1Mi}", "hugepages"),
        ] {
            assert!(POD.contains(from), "{from}");
            let err = translate(&POD.replacen(from, to, 1)).unwrap_err();
            assert!(format!("{err:#}").contains(needle), "{needle}: {err:#}");
        }
        let err = translate(&POD.replace(
            "seccompProfile: {type: Localhost, localhostProfile: pgio.json}",
            "fsGroup: 0",
        ))
        .unwrap_err();
        assert!(format!("{err:#}").contains("fsGroup"), "{err:#}");
    }

    #[test]
    fn quantities() {
        assert_eq!(memory_bytes("128Mi").unwrap(), 128 << 20);
        assert_eq!(memory_bytes("1G").unwrap(), 1_000_000_000);
        assert_eq!(memory_bytes("4096").unwrap(), 4096);
        assert!(memory_bytes("1.5Gi").is_err());
        assert_eq!(cpus("250m").unwrap(), 0.25);
        assert_eq!(cpus("2").unwrap(), 2.0);
    }
}
