//! The invariants of one render, whatever the other tool renders: [`check`] for the pod, its
//! container, its mounts, pgio.toml and the objects around them; [`web`] for HTTPS
//! (`--web-config-file`) and everything that must agree with it.

use std::path::Path;

use anyhow::{Context, Result, bail, ensure};
use serde_json::Value;

use super::{Render, SHIPPED_WEB_YML, config_of, labels_match, only, str_of};
use crate::util::step;

/// Capabilities that would make the DaemonSet as good as privileged.
const FORBIDDEN_CAPS: [&str; 3] = ["ALL", "SYS_ADMIN", "CAP_SYS_ADMIN"];

// ---- every render ------------------------------------------------------------------------

/// What must hold in every render, whatever the other tool renders.
pub(super) fn check(r: &Render, version: &str) -> Result<()> {
    let ds = only(r, "DaemonSet")?;
    let tmpl = &ds["spec"]["template"];
    let pod = &tmpl["spec"];
    let pod_labels = &tmpl["metadata"]["labels"];
    ensure!(
        labels_match(&ds["spec"]["selector"]["matchLabels"], pod_labels),
        "the DaemonSet's selector does not match its pod labels"
    );
    host_namespaces(pod)?;
    let c = the_container(pod)?;
    image_tagged(c, version)?;
    container_security(pod, c)?;
    let volumes = pod["volumes"].as_array().context("no volumes")?;
    let host_mounts = read_only_host_mounts(c, volumes)?;
    config_fits_pod(r, tmpl, c, &host_mounts)?;
    config_map_mounted(r, volumes)?;
    service_account(r, pod)?;
    headless_service(r, pod_labels)?;
    for pm in r.docs.iter().filter(|d| d["kind"] == "PodMonitor") {
        pod_monitor(pm, pod_labels)?;
    }
    linux_nodes(r)
}

/// The pod shares the host's PID namespace and no other, and carries no service account token.
fn host_namespaces(pod: &Value) -> Result<()> {
    ensure!(pod["hostPID"] == true, "hostPID must be true");
    for k in ["hostNetwork", "hostIPC"] {
        ensure!(pod[k] != true, "{k} must not be set");
    }
    ensure!(
        pod["automountServiceAccountToken"] == false,
        "the pod must not mount a service account token"
    );
    Ok(())
}

/// The pod's one container (and no init containers).
fn the_container(pod: &Value) -> Result<&Value> {
    let containers = pod["containers"]
        .as_array()
        .filter(|c| c.len() == 1)
        .context("the DaemonSet must have exactly one container")?;
    ensure!(
        pod.get("initContainers").is_none(),
        "no init containers expected"
    );
    Ok(&containers[0])
}

/// The image is this workspace's version.
fn image_tagged(c: &Value, version: &str) -> Result<()> {
    let image = str_of(&c["image"], "the image")?;
    ensure!(
        image.ends_with(&format!(":{version}")),
        "image {image} should be tagged with the workspace version {version}"
    );
    Ok(())
}

/// Not privileged, no escalation, a read-only root, only the capabilities needed, and the
/// seccomp profile in one place.
fn container_security(pod: &Value, c: &Value) -> Result<()> {
    let sc = &c["securityContext"];
    ensure!(sc["privileged"] != true, "privileged must not be true");
    ensure!(
        sc["allowPrivilegeEscalation"] == false,
        "allowPrivilegeEscalation must be false"
    );
    ensure!(
        sc["readOnlyRootFilesystem"] == true,
        "readOnlyRootFilesystem must be true"
    );
    capabilities(sc)?;
    ensure!(
        pod["securityContext"]["seccompProfile"].is_null() && sc["seccompProfile"].is_object(),
        "the seccomp profile belongs in the container's securityContext (one place)"
    );
    Ok(())
}

/// All dropped, some added back, none of [`FORBIDDEN_CAPS`] among them.
fn capabilities(sc: &Value) -> Result<()> {
    let caps = |k: &str| -> Vec<&str> {
        sc["capabilities"][k]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .collect()
    };
    ensure!(
        caps("drop") == ["ALL"],
        "capabilities.drop must be [ALL], is {:?}",
        caps("drop")
    );
    let add = caps("add");
    ensure!(
        !add.is_empty() && !add.iter().any(|a| FORBIDDEN_CAPS.contains(a)),
        "capabilities.add must list the needed capabilities and none of {FORBIDDEN_CAPS:?}: \
         {add:?}"
    );
    Ok(())
}

/// Every mount has its volume; host paths are read-only, with no propagation back to the host.
/// Returns each host path with where it is mounted.
fn read_only_host_mounts<'a>(
    c: &'a Value,
    volumes: &'a [Value],
) -> Result<Vec<(&'a str, &'a str)>> {
    let mounts = c["volumeMounts"].as_array().context("no volumeMounts")?;
    let mut host_mounts = Vec::new();
    for m in mounts {
        let name = str_of(&m["name"], "volumeMounts[].name")?;
        let vol = volumes
            .iter()
            .find(|v| v["name"] == name)
            .with_context(|| format!("volumeMount {name} has no volume"))?;
        ensure!(
            m["mountPropagation"] != "Bidirectional",
            "volumeMount {name}: Bidirectional propagation needs a privileged container"
        );
        if let Some(host) = vol["hostPath"]["path"].as_str() {
            ensure!(
                m["readOnly"] == true,
                "volumeMount {name} (host {host}) must be readOnly"
            );
            host_mounts.push((host, str_of(&m["mountPath"], "mountPath")?));
        }
    }
    Ok(host_mounts)
}

// ---- pgio.toml and the pod ---------------------------------------------------------------

/// pgio.toml agrees with the pod: the port, and the directories it reads are the host's,
/// mounted at the same paths.
fn config_fits_pod(
    r: &Render,
    tmpl: &Value,
    c: &Value,
    host_mounts: &[(&str, &str)],
) -> Result<()> {
    let config = config_of(r)?;
    let port = metrics_port(c)?;
    let listen = str_of(&config["listen"], "pgio.toml listen")?;
    ensure!(
        listen.rsplit(':').next() == Some(&port.to_string()),
        "pgio.toml listen = {listen:?} but the metrics port is {port}"
    );
    scrape_annotations(&tmpl["metadata"]["annotations"], port)?;
    host_dirs_mounted(&config, host_mounts)
}

/// The container's port named metrics.
fn metrics_port(c: &Value) -> Result<u64> {
    c["ports"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["name"] == "metrics")
        .and_then(|p| p["containerPort"].as_u64())
        .context("the container has no port named metrics")
}

/// The pod's prometheus.io annotations point at the metrics port.
fn scrape_annotations(ann: &Value, port: u64) -> Result<()> {
    ensure!(
        ann["prometheus.io/scrape"] == "true"
            && ann["prometheus.io/port"] == port.to_string().as_str()
            && ann["prometheus.io/path"] == "/metrics",
        "the pod's prometheus.io annotations should point at port {port}, /metrics: {ann}"
    );
    Ok(())
}

/// The directories pgio.toml reads (the pod log directories only with pod labels on) are the
/// host's, mounted read-only at the same path.
fn host_dirs_mounted(config: &Value, host_mounts: &[(&str, &str)]) -> Result<()> {
    let mut dirs = vec!["longhorn_device_dir"];
    if config["pod_labels"] != false {
        dirs.extend(["pod_log_dir", "container_log_dir"]);
    }
    for key in dirs {
        let Some(dir) = config[key].as_str().filter(|d| !d.is_empty()) else {
            continue;
        };
        ensure!(
            host_mounts.contains(&(dir, dir)),
            "pgio.toml {key} = {dir:?}, but the host's {dir} is not mounted there read-only"
        );
    }
    Ok(())
}

// ---- the objects around the pod ---------------------------------------------------------

/// A volume mounts this render's ConfigMap (by name: kustomize adds a content hash).
fn config_map_mounted(r: &Render, volumes: &[Value]) -> Result<()> {
    let cm_name = str_of(&only(r, "ConfigMap")?["metadata"]["name"], "ConfigMap name")?;
    ensure!(
        volumes.iter().any(|v| v["configMap"]["name"] == cm_name),
        "no volume mounts the ConfigMap {cm_name}"
    );
    Ok(())
}

/// The pod runs as this render's ServiceAccount, which mounts no token either.
fn service_account(r: &Render, pod: &Value) -> Result<()> {
    let sa = only(r, "ServiceAccount")?;
    ensure!(
        pod["serviceAccountName"] == sa["metadata"]["name"],
        "the pod's serviceAccountName is not the ServiceAccount {}",
        sa["metadata"]["name"]
    );
    ensure!(
        sa["automountServiceAccountToken"] == false,
        "the ServiceAccount must set automountServiceAccountToken: false"
    );
    Ok(())
}

/// The Service is headless and selects the pods.
fn headless_service(r: &Render, pod_labels: &Value) -> Result<()> {
    let svc = only(r, "Service")?;
    ensure!(
        svc["spec"]["clusterIP"] == "None",
        "the Service must be headless"
    );
    ensure!(
        labels_match(&svc["spec"]["selector"], pod_labels),
        "the Service's selector does not match the pod labels"
    );
    Ok(())
}

/// A PodMonitor scrapes the pods' metrics port and keeps pgio's own labels.
fn pod_monitor(pm: &Value, pod_labels: &Value) -> Result<()> {
    ensure!(
        labels_match(&pm["spec"]["selector"]["matchLabels"], pod_labels),
        "the PodMonitor's selector does not match the pod labels"
    );
    let endpoint = &pm["spec"]["podMetricsEndpoints"][0];
    ensure!(
        endpoint["port"] == "metrics",
        "the PodMonitor should scrape the port named metrics"
    );
    // Without honorLabels, Prometheus renames pgio's namespace/pod/container labels to
    // exported_* and the dashboards see only pgio's own namespace; without the labeldrop,
    // series with no pod labels (host processes) get pgio's own pod.
    let relabelings = endpoint["relabelings"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    ensure!(
        endpoint["honorLabels"] == true
            && relabelings
                .iter()
                .any(|r| r["action"] == "labeldrop" && r["regex"] == "namespace|pod|container")
            && relabelings.iter().any(|r| r["targetLabel"] == "node"
                && r["sourceLabels"][0] == "__meta_kubernetes_pod_node_name"),
        "the PodMonitor should honour pgio's labels, drop the target's namespace/pod/container \
         and add node: {endpoint}"
    );
    Ok(())
}

/// The DaemonSet runs on Linux nodes only.
fn linux_nodes(r: &Render) -> Result<()> {
    let ds = only(r, "DaemonSet")?;
    ensure!(
        ds["spec"]["template"]["spec"]["nodeSelector"]["kubernetes.io/os"] == "linux",
        "the DaemonSet should select Linux nodes (it tolerates every taint)"
    );
    Ok(())
}

// ---- HTTPS -------------------------------------------------------------------------------

/// `--web-config-file`: whether the render serves HTTPS, and that its pieces fit together: the
/// file sits in a read-only 0400 mount of Secrets only; the web.yml it will find there (the
/// chart's inline one, else the one shipped for the Secret) names its certificate and key as
/// keys of that mount; the probes, the pod's `prometheus.io/scheme` and each PodMonitor
/// endpoint say HTTPS, the latter with a tlsConfig. Plain HTTP: none of them does.
pub(super) fn web(r: &Render, shipped_web_yml: &str) -> Result<bool> {
    let tmpl = &only(r, "DaemonSet")?["spec"]["template"];
    let pod = &tmpl["spec"];
    let c = &pod["containers"][0];
    let schemes = Schemes::of(r, tmpl, c);
    let Some(web) = WebConfigFile::of(c)? else {
        schemes.plain_http()?;
        return Ok(false);
    };
    let mount_name = web_mount(c, &web)?;
    let secrets = secret_volume(pod, mount_name)?;
    let (text, from) = web_yml(r, &secrets, &web, shipped_web_yml)?;
    tls_files_in_mount(text, &from, web.dir)?;
    schemes.https()?;
    step(format!(
        "{}: HTTPS from {} in Secret {} (0400, read-only), certificate and key as keys next to \
         it, probes HTTPS, {} PodMonitor endpoint(s) https",
        r.what,
        web.file.display(),
        secrets.join(" + "),
        schemes.endpoints.len()
    ));
    Ok(true)
}

/// What says which scheme the daemon serves: the probes, the pod's annotations and the
/// PodMonitor endpoints.
struct Schemes<'a> {
    probes: Vec<(&'static str, &'a Value)>,
    annotations: &'a Value,
    endpoints: Vec<&'a Value>,
}

impl<'a> Schemes<'a> {
    fn of(r: &'a Render, tmpl: &'a Value, c: &'a Value) -> Self {
        let probes = ["startupProbe", "livenessProbe", "readinessProbe"]
            .into_iter()
            .map(|k| (k, &c[k]["httpGet"]["scheme"]))
            .collect();
        let endpoints = r
            .docs
            .iter()
            .filter(|d| d["kind"] == "PodMonitor")
            .flat_map(|d| {
                d["spec"]["podMetricsEndpoints"]
                    .as_array()
                    .into_iter()
                    .flatten()
            })
            .collect();
        Schemes {
            probes,
            annotations: &tmpl["metadata"]["annotations"],
            endpoints,
        }
    }

    fn annotation(&self) -> &'a Value {
        &self.annotations["prometheus.io/scheme"]
    }

    /// No `--web-config-file`: nothing says HTTPS.
    fn plain_http(&self) -> Result<()> {
        for (probe, scheme) in &self.probes {
            ensure!(
                scheme.is_null() || *scheme == "HTTP",
                "no --web-config-file (plain HTTP), but {probe} uses scheme {scheme}"
            );
        }
        let annotation = self.annotation();
        ensure!(
            annotation.is_null() || annotation == "http",
            "no --web-config-file (plain HTTP), but prometheus.io/scheme is {annotation}"
        );
        for e in &self.endpoints {
            ensure!(
                (e["scheme"].is_null() || e["scheme"] == "http") && e["tlsConfig"].is_null(),
                "no --web-config-file (plain HTTP), but the PodMonitor scrapes with scheme {} \
                 and tlsConfig {}",
                e["scheme"],
                e["tlsConfig"]
            );
        }
        Ok(())
    }

    /// `--web-config-file`: everything says HTTPS, the PodMonitor with a tlsConfig.
    fn https(&self) -> Result<()> {
        for (probe, scheme) in &self.probes {
            ensure!(
                *scheme == "HTTPS",
                "--web-config-file is set, but {probe} uses scheme {scheme} (the kubelet would \
                 speak plain HTTP to the TLS port)"
            );
        }
        let annotation = self.annotation();
        if !annotation.is_null() || self.annotations["prometheus.io/scrape"] == "true" {
            ensure!(
                annotation == "https",
                "--web-config-file is set, but prometheus.io/scheme is {annotation}"
            );
        }
        for e in &self.endpoints {
            ensure!(
                e["scheme"] == "https" && e["tlsConfig"].as_object().is_some_and(|t| !t.is_empty()),
                "--web-config-file is set, but the PodMonitor scrapes with scheme {} and \
                 tlsConfig {}",
                e["scheme"],
                e["tlsConfig"]
            );
        }
        Ok(())
    }
}

/// The path `--web-config-file` gives: the file, its directory (the mount) and its name.
struct WebConfigFile<'a> {
    file: &'a Path,
    dir: &'a Path,
    name: &'a str,
}

impl<'a> WebConfigFile<'a> {
    /// None without `--web-config-file` (plain HTTP); an error unless it names an absolute path.
    fn of(c: &'a Value) -> Result<Option<Self>> {
        let args: Vec<&str> = c["args"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .collect();
        let flag = args
            .iter()
            .position(|a| *a == "--web-config-file" || a.starts_with("--web-config-file="));
        let Some(i) = flag else {
            return Ok(None);
        };
        let file = match args[i].split_once('=') {
            Some((_, v)) => Some(v),
            None => args.get(i + 1).copied(),
        }
        .context("--web-config-file without a path")?;
        let file = Path::new(file);
        let (Some(dir), Some(name)) = (
            file.parent().filter(|_| file.is_absolute()),
            file.file_name().and_then(|n| n.to_str()),
        ) else {
            bail!(
                "--web-config-file {}: not an absolute file path",
                file.display()
            );
        };
        Ok(Some(WebConfigFile { file, dir, name }))
    }
}

/// The mount holding the web config: read-only, whole (no subPath). Returns its name.
fn web_mount<'a>(c: &'a Value, web: &WebConfigFile) -> Result<&'a str> {
    let mount = c["volumeMounts"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|m| m["mountPath"].as_str().map(Path::new) == Some(web.dir))
        .with_context(|| {
            format!(
                "--web-config-file {}: nothing is mounted at {}",
                web.file.display(),
                web.dir.display()
            )
        })?;
    let mount_name = str_of(&mount["name"], "volumeMounts[].name")?;
    ensure!(
        mount["readOnly"] == true && mount.get("subPath").is_none(),
        "the web config mount {mount_name} must be readOnly, without subPath: {mount}"
    );
    Ok(mount_name)
}

/// The volume of the web config mount: whole Secrets only, mode 0400. Returns their names.
fn secret_volume<'a>(pod: &'a Value, mount_name: &str) -> Result<Vec<&'a str>> {
    let volume = pod["volumes"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|v| v["name"] == mount_name)
        .with_context(|| format!("volumeMount {mount_name} has no volume"))?;
    let (secrets, mode) = secrets_and_mode(volume, mount_name)?;
    ensure!(
        mode == 0o400,
        "volume {mount_name}: defaultMode should be 256 (0400: the key is for pgio alone), is {mode}"
    );
    Ok(secrets)
}

/// The Secrets of a `secret` or `projected` volume, and its defaultMode.
fn secrets_and_mode<'a>(volume: &'a Value, mount_name: &str) -> Result<(Vec<&'a str>, &'a Value)> {
    if volume["secret"].is_object() {
        return Ok((
            vec![str_of(
                &volume["secret"]["secretName"],
                "secret.secretName",
            )?],
            &volume["secret"]["defaultMode"],
        ));
    }
    let Some(sources) = volume["projected"]["sources"].as_array() else {
        bail!("volume {mount_name} holds the web config and key: it must be a Secret, is {volume}");
    };
    let mut names = Vec::new();
    for s in sources {
        ensure!(
            s.as_object().is_some_and(|o| o.len() == 1) && s["secret"]["items"].is_null(),
            "volume {mount_name}: every projected source must be a whole Secret, not {s}"
        );
        names.push(str_of(&s["secret"]["name"], "projected secret name")?);
    }
    Ok((names, &volume["projected"]["defaultMode"]))
}

/// The web.yml pgio will read, and where it comes from: the chart's own Secret's, or what the
/// docs put in the user's.
fn web_yml<'a>(
    r: &'a Render,
    secrets: &[&str],
    web: &WebConfigFile,
    shipped_web_yml: &'a str,
) -> Result<(&'a str, String)> {
    let name = web.name;
    let inline = r
        .docs
        .iter()
        .find(|d| d["kind"] == "Secret" && secrets.iter().any(|s| d["metadata"]["name"] == *s));
    Ok(match inline {
        Some(secret) => (
            str_of(&secret["stringData"][name], "the inline web.yml").with_context(|| {
                format!("the Secret {} has no {name}", secret["metadata"]["name"])
            })?,
            format!("the Secret {}", secret["metadata"]["name"]),
        ),
        None => {
            ensure!(
                name == "web.yml",
                "--web-config-file {}: the Secret's documented key is web.yml",
                web.file.display()
            );
            (shipped_web_yml, SHIPPED_WEB_YML.to_owned())
        }
    })
}

/// web.yml names its certificate and key as the Secret's keys tls.crt and tls.key, in the mount.
fn tls_files_in_mount(text: &str, from: &str, dir: &Path) -> Result<()> {
    let web: Value = serde_yaml_ng::from_str(text).with_context(|| format!("parsing {from}"))?;
    for (key, secret_key) in [("cert_file", "tls.crt"), ("key_file", "tls.key")] {
        let f = str_of(
            &web["tls_server_config"][key],
            &format!("{from}: tls_server_config.{key}"),
        )?;
        // Relative to web.yml's directory (the mount), as pgio resolves it.
        let resolved = dir.join(f);
        ensure!(
            resolved == dir.join(secret_key),
            "{from}: tls_server_config.{key} = {f:?} is {} in the pod, but the Secret's key \
             {secret_key} is mounted at {}",
            resolved.display(),
            dir.join(secret_key).display()
        );
    }
    Ok(())
}
