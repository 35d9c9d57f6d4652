//! OpenShift's SecurityContextConstraints both tools render (the chart's `openshift.scc`, the
//! kustomize component `openshift-scc`): it must admit exactly what the DaemonSet asks for,
//! `use` of it must be granted to the DaemonSet's ServiceAccount, and the container must run as
//! SELinux type spc_t. No OpenShift cluster here: the fields are checked against the pod.
use std::{collections::BTreeSet, fs, path::Path};

use anyhow::{Context, Result, ensure};
use serde_json::{Value, json};

use super::{
    Paths, Render, agree, cases::Tools, helm_template, invariants, kustomize, only, write_overlay,
};
use crate::util::step;

/// A closed schema of the SCC fields the renders use (security.openshift.io/v1).
pub(super) fn write_schema(dir: &Path) -> Result<()> {
    let strings = json!({"type": "array", "items": {"type": "string", "minLength": 1}});
    let strategy = json!({"type": "object", "additionalProperties": false, "required": ["type"],
        "properties": {"type": {"enum": ["RunAsAny", "MustRunAs", "MustRunAsRange",
                                          "MustRunAsNonRoot"]}}});
    let labels = json!({"type": "object", "additionalProperties": {"type": "string"}});
    let mut props = serde_json::Map::new();
    for b in [
        "allowHostDirVolumePlugin",
        "allowHostIPC",
        "allowHostNetwork",
        "allowHostPID",
        "allowHostPorts",
        "allowPrivilegeEscalation",
        "allowPrivilegedContainer",
        "readOnlyRootFilesystem",
    ] {
        props.insert(b.into(), json!({"type": "boolean"}));
    }
    for s in [
        "allowedCapabilities",
        "defaultAddCapabilities",
        "requiredDropCapabilities",
        "seccompProfiles",
        "volumes",
        "users",
        "groups",
    ] {
        props.insert(s.into(), strings.clone());
    }
    for s in [
        "runAsUser",
        "seLinuxContext",
        "fsGroup",
        "supplementalGroups",
    ] {
        props.insert(s.into(), strategy.clone());
    }
    props.insert(
        "apiVersion".into(),
        json!({"enum": ["security.openshift.io/v1"]}),
    );
    props.insert(
        "kind".into(),
        json!({"enum": ["SecurityContextConstraints"]}),
    );
    props.insert(
        "metadata".into(),
        json!({"type": "object", "additionalProperties": false, "required": ["name"],
               "properties": {"name": {"type": "string"}, "labels": labels}}),
    );
    let schema = json!({"type": "object", "additionalProperties": false,
        "required": ["apiVersion", "kind", "metadata", "allowHostPID", "allowedCapabilities",
                     "runAsUser", "seLinuxContext", "volumes"],
        "properties": props});
    let file = dir.join("securitycontextconstraints-security-v1.json");
    fs::write(&file, serde_json::to_vec_pretty(&schema)?)
        .with_context(|| format!("writing {}", file.display()))
}

/// Both renders with the SCC: schema-valid, the same pod, and an SCC fitting that pod.
pub(super) fn check(t: &Tools, p: &Paths, newest: &str, version: &str) -> Result<()> {
    let helm = helm_template(
        t.helm,
        p,
        newest,
        &["openshift.scc=true"],
        &[],
        "helm-openshift",
    )?;
    let overlay = write_overlay(p, "kustomize-openshift-overlay", &["openshift-scc"])?;
    let kust = kustomize(t.kubectl, p, &overlay, "kustomize-openshift")?;
    for r in [&helm, &kust] {
        t.kubeconform(newest, r)?;
        invariants::check(r, version)
            .with_context(|| format!("{} ({})", r.what, r.file.display()))?;
        fits(r).with_context(|| format!("{} ({})", r.what, r.file.display()))?;
    }
    agree(&helm, &kust)?;
    step("OpenShift SCC: admits exactly the DaemonSet's pod, bound to its ServiceAccount, spc_t");
    Ok(())
}

fn strings(v: &Value) -> BTreeSet<String> {
    v.as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| s.as_str().map(str::to_owned))
        .collect()
}

/// The SCC admits the DaemonSet's pod and no more than it asks; the Role and RoleBinding let
/// its ServiceAccount use it.
fn fits(r: &Render) -> Result<()> {
    let ds = only(r, "DaemonSet")?;
    let pod = &ds["spec"]["template"]["spec"];
    let c = &pod["containers"][0];
    let scc = only(r, "SecurityContextConstraints")?;
    let name = &scc["metadata"]["name"];
    ensure!(
        strings(&scc["allowedCapabilities"])
            == strings(&c["securityContext"]["capabilities"]["add"]),
        "allowedCapabilities {} should be the container's capabilities.add {}",
        scc["allowedCapabilities"],
        c["securityContext"]["capabilities"]["add"]
    );
    ensure!(
        scc["allowHostPID"] == pod["hostPID"] && scc["allowPrivilegedContainer"] == false,
        "the SCC should allow hostPID as the pod has it, and no privileged container"
    );
    let kinds: BTreeSet<String> = pod["volumes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| v.as_object()?.keys().find(|k| *k != "name").cloned())
        .collect();
    ensure!(
        kinds.is_subset(&strings(&scc["volumes"])),
        "the pod's volume types {kinds:?} are not all in the SCC's {}",
        scc["volumes"]
    );
    ensure!(
        c["securityContext"]["seLinuxOptions"]["type"] == "spc_t",
        "the container should run as SELinux type spc_t: {}",
        c["securityContext"]
    );
    let role = only(r, "Role")?;
    let rule = &role["rules"][0];
    ensure!(
        rule["apiGroups"][0] == "security.openshift.io"
            && rule["resources"][0] == "securitycontextconstraints"
            && rule["resourceNames"][0] == *name
            && rule["verbs"][0] == "use",
        "the Role should grant `use` of the SCC {name}: {role}"
    );
    let binding = only(r, "RoleBinding")?;
    let subject = &binding["subjects"][0];
    ensure!(
        binding["roleRef"]["name"] == role["metadata"]["name"]
            && binding["metadata"]["namespace"] == ds["metadata"]["namespace"]
            && subject["kind"] == "ServiceAccount"
            && subject["name"] == pod["serviceAccountName"]
            && subject["namespace"] == ds["metadata"]["namespace"],
        "the RoleBinding should bind the Role to the DaemonSet's ServiceAccount: {binding}"
    );
    Ok(())
}
