//! deploy-check beyond the default renders: every Kubernetes minor the chart claims, what must
//! be refused (values the schema rejects, components in an order that would mismatch the
//! scrape scheme), and the optional pieces (NetworkPolicy, debugfs tracefs, the Namespace, an
//! image digest) rendered alike by Helm and kustomize.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, bail, ensure};

use super::{
    APPARMOR_FIELD_MINOR, HELM_WEB, NAMESPACE, NEWEST_MINOR, OLDEST_MINOR, Paths, Render, agree,
    helm_cmd, helm_template, invariants, kube_version, kubeconform_check, kustomize, labels_match,
    only, rules, write_overlay,
};
use crate::util::{describe, step};

pub(super) struct Tools<'a> {
    pub helm: &'a Path,
    pub kubectl: &'a Path,
    pub kubeconform: &'a Path,
    pub schemas: &'a Path,
    pub crd_schemas: &'a Path,
}

impl Tools<'_> {
    pub(super) fn kubeconform(&self, version: &str, r: &Render) -> Result<()> {
        kubeconform_check(self.kubeconform, self.schemas, self.crd_schemas, version, r)
    }
}

const APPARMOR_ANNOTATION: &str = "container.apparmor.security.beta.kubernetes.io/pgio";

/// Values `helm lint --strict` must refuse (`--set`, or `--set-json` for `=[`), with what its
/// message must say.
const LINT_REFUSALS: &[(&[&str], &str)] = &[
    (&["port=abc"], "at '/port': got string, want integer"),
    (
        &["config.rules[0].app=pg", "config.rules[0].comn=^postgres$"],
        "additional properties 'comn' not allowed",
    ),
    (
        &["config.rules[0].app=pg"],
        "at '/config/rules/0': 'anyOf' failed",
    ),
    (&["config.max_label_len=8"], "at '/config/max_label_len'"),
    (&["image.digest=sha256:abc"], "at '/image/digest'"),
    (&["appArmorProfile.type=Unconfind"], "at '/appArmorProfile"),
    (
        &["tracefsHostPath=sys/kernel/tracing"],
        "at '/tracefsHostPath'",
    ),
    (
        &["prometheusScrapeAnnotation=false"],
        "additional properties 'prometheusScrapeAnnotation' not allowed",
    ),
    (
        &["networkPolicy.enabled=true", "networkPolicy.from=[]"],
        "at '/networkPolicy/from'",
    ),
];

/// Component orders kustomize must refuse: each would render a PodMonitor whose scheme or
/// credentials do not match the pods.
const ORDER_REFUSALS: &[&[&str]] = &[
    &["web-tls", "podmonitor"],
    &["web-tls", "web-basic-auth", "podmonitor"],
    &["podmonitor", "web-basic-auth", "web-tls"],
    &["web-basic-auth", "podmonitor", "web-tls"],
];

/// Helm at every minor (default and HTTPS values), kustomize's base from the first minor with
/// the AppArmor field and base + components/apparmor-annotation before it, each through
/// kubeconform for that minor. Returns the Helm default render of the oldest minor.
pub(super) fn every_minor(t: &Tools, p: &Paths) -> Result<Render> {
    let base = kustomize(t.kubectl, p, &p.kustomize, "kustomize-default")?;
    let overlay = write_overlay(p, "kustomize-apparmor-annotation", &["apparmor-annotation"])?;
    let annotated = kustomize(t.kubectl, p, &overlay, "kustomize-apparmor-annotation")?;
    let mut oldest = None;
    for minor in OLDEST_MINOR..=NEWEST_MINOR {
        let v = kube_version(minor);
        let field = minor >= APPARMOR_FIELD_MINOR;
        for (set, name) in [(&[][..], "default"), (&HELM_WEB[..], "web")] {
            let r = helm_template(t.helm, p, &v, set, &[], &format!("helm-{name}-{v}"))?;
            t.kubeconform(&v, &r)?;
            apparmor_form(&r, field)?;
            if name == "default" && minor == APPARMOR_FIELD_MINOR - 1 {
                agree(&r, &annotated)?;
            }
            if name == "default" && oldest.is_none() {
                oldest = Some(r);
            }
        }
        if field {
            t.kubeconform(&v, &base)?;
        } else {
            t.kubeconform(&v, &annotated)?;
            // Why the component exists: this minor's schema has no appArmorProfile field.
            let refused = t.kubeconform(&v, &base);
            ensure!(
                refused
                    .as_ref()
                    .is_err_and(|e| format!("{e:#}").contains("appArmorProfile")),
                "kubeconform for Kubernetes {v} should refuse the base's appArmorProfile field: \
                 {refused:?}"
            );
        }
    }
    apparmor_form(&base, true)?;
    apparmor_form(&annotated, false)?;
    step(format!(
        "Kubernetes 1.{OLDEST_MINOR}-1.{NEWEST_MINOR}: every Helm render valid (AppArmor as the \
         field from 1.{APPARMOR_FIELD_MINOR}, as the annotation before); kustomize's base valid \
         from 1.{APPARMOR_FIELD_MINOR}, refused before, and valid there with \
         components/apparmor-annotation"
    ));
    oldest.context("no Kubernetes minor rendered")
}

/// AppArmor unconfined, as the securityContext field or as the pre-1.30 annotation, never both.
fn apparmor_form(r: &Render, field: bool) -> Result<()> {
    let tmpl = &only(r, "DaemonSet")?["spec"]["template"];
    let in_field = &tmpl["spec"]["containers"][0]["securityContext"]["appArmorProfile"];
    let in_annotation = &tmpl["metadata"]["annotations"][APPARMOR_ANNOTATION];
    let ok = if field {
        in_field["type"] == "Unconfined" && in_annotation.is_null()
    } else {
        in_field.is_null() && in_annotation == "unconfined"
    };
    ensure!(
        ok,
        "{}: AppArmor should be unconfined {}, found field {in_field} and annotation \
         {in_annotation}",
        r.what,
        if field {
            "in securityContext.appArmorProfile"
        } else {
            "by the annotation"
        }
    );
    Ok(())
}

/// `helm lint --strict` refuses each of [`LINT_REFUSALS`] with its message; kustomize refuses
/// each of [`ORDER_REFUSALS`] and renders web-tls + web-basic-auth without a PodMonitor.
pub(super) fn refusals(t: &Tools, p: &Paths) -> Result<()> {
    for (set, needle) in LINT_REFUSALS {
        let mut lint = helm_cmd(t.helm, p);
        lint.args(["lint", "--strict"])
            .arg(&p.chart)
            .args(["--namespace", NAMESPACE]);
        for s in *set {
            lint.args([
                if s.contains("=[") {
                    "--set-json"
                } else {
                    "--set"
                },
                s,
            ]);
        }
        let (ok, text) = combined(&mut lint)?;
        ensure!(
            !ok && text.contains(needle),
            "`{}` should fail saying {needle:?}; it {}:\n{text}",
            describe(&lint),
            if ok { "passed" } else { "failed otherwise" }
        );
        step(format!(
            "refused as it should be: --set {}",
            set.join(" --set ")
        ));
    }
    for (i, order) in ORDER_REFUSALS.iter().enumerate() {
        let overlay = write_overlay(p, &format!("kustomize-wrong-order-{i}"), order)?;
        let mut cmd = Command::new(t.kubectl);
        cmd.arg("kustomize").arg(&overlay).current_dir(&p.root);
        let (ok, text) = combined(&mut cmd)?;
        ensure!(
            !ok && text.contains("test failed"),
            "kustomize with components {order:?} should fail at a component's test; it {}:\n{text}",
            if ok { "rendered" } else { "failed otherwise" }
        );
        step(format!("components in the order {order:?} refused"));
    }
    let overlay = write_overlay(
        p,
        "kustomize-web-no-podmonitor",
        &["web-tls", "web-basic-auth"],
    )?;
    let r = kustomize(t.kubectl, p, &overlay, "kustomize-web-no-podmonitor")?;
    ensure!(
        !r.docs.iter().any(|d| d["kind"] == "PodMonitor"),
        "{}: web-tls + web-basic-auth should not create a PodMonitor",
        r.what
    );
    Ok(())
}

/// Exit status and stdout + stderr of a command expected to fail.
fn combined(cmd: &mut Command) -> Result<(bool, String)> {
    let out = cmd
        .output()
        .with_context(|| format!("failed to start `{}`", describe(cmd)))?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok((out.status.success(), text))
}

/// The optional pieces: NetworkPolicy and the debugfs tracefs (Helm values against kustomize
/// components, agreeing), the Namespace component, an image by digest.
pub(super) fn extras(t: &Tools, p: &Paths, newest: &str, version: &str) -> Result<()> {
    let helm = helm_template(
        t.helm,
        p,
        newest,
        &[
            "networkPolicy.enabled=true",
            "tracefsHostPath=/sys/kernel/debug/tracing",
            "prometheusRule.enabled=true",
            "prometheusRule.labels.release=prometheus",
        ],
        &[],
        "helm-extras",
    )?;
    let overlay = write_overlay(
        p,
        "kustomize-extras-overlay",
        &["network-policy", "tracefs-debugfs", "prometheusrule"],
    )?;
    let kust = kustomize(t.kubectl, p, &overlay, "kustomize-extras")?;
    let groups = rules::mixin_groups(p)?;
    rules::check_render(&helm, &groups, &[("release", "prometheus")])?;
    rules::check_render(&kust, &groups, &[])?;
    for r in [&helm, &kust] {
        t.kubeconform(newest, r)?;
        invariants::check(r, version)
            .with_context(|| format!("{} ({})", r.what, r.file.display()))?;
        network_policy(r)?;
        let ds = only(r, "DaemonSet")?;
        let tracefs = ds["spec"]["template"]["spec"]["volumes"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|v| v["name"] == "tracefs")
            .with_context(|| format!("{}: no tracefs volume", r.what))?;
        ensure!(
            tracefs["hostPath"]["path"] == "/sys/kernel/debug/tracing",
            "{}: the tracefs volume should be the host's /sys/kernel/debug/tracing: {tracefs}",
            r.what
        );
    }
    agree(&helm, &kust)?;

    let overlay = write_overlay(p, "kustomize-namespace-overlay", &["namespace"])?;
    let with_ns = kustomize(t.kubectl, p, &overlay, "kustomize-namespace")?;
    t.kubeconform(newest, &with_ns)?;
    let ns = only(&with_ns, "Namespace")?;
    ensure!(
        ns["metadata"]["name"] == NAMESPACE
            && ["enforce", "warn", "audit"].iter().all(|mode| {
                ns["metadata"]["labels"][format!("pod-security.kubernetes.io/{mode}")]
                    == "privileged"
            }),
        "components/namespace should create {NAMESPACE} enforcing Pod Security privileged: {ns}"
    );
    let base = kustomize(t.kubectl, p, &p.kustomize, "kustomize-default")?;
    ensure!(
        !base.docs.iter().any(|d| d["kind"] == "Namespace"),
        "the kustomize base must not create a Namespace (an overlay's namespace would get its \
         labels, and `kubectl delete -k` would delete it): components/namespace does"
    );

    scrape_limits(t, p, newest)?;

    let digest = format!("sha256:{}", "0123456789abcdef".repeat(4));
    let r = helm_template(
        t.helm,
        p,
        newest,
        &[&format!("image.digest={digest}")],
        &[],
        "helm-digest",
    )?;
    let image = &only(&r, "DaemonSet")?["spec"]["template"]["spec"]["containers"][0]["image"];
    ensure!(
        *image == format!("localhost/pgio@{digest}").as_str(),
        "image.digest should pull localhost/pgio@{digest}, the render says {image}"
    );
    step(format!(
        "NetworkPolicy and debugfs tracefs: Helm and kustomize agree; components/namespace \
         labels {NAMESPACE} privileged; image.digest renders {image}"
    ));
    Ok(())
}

/// podMonitor.sampleLimit, relabelings (after pgio's own) and metricRelabelings reach the
/// PodMonitor as given.
fn scrape_limits(t: &Tools, p: &Paths, newest: &str) -> Result<()> {
    let r = helm_template(
        t.helm,
        p,
        newest,
        &[
            "podMonitor.enabled=true",
            "podMonitor.sampleLimit=20000",
            "podMonitor.relabelings[0].action=replace",
            "podMonitor.relabelings[0].targetLabel=cluster",
            "podMonitor.relabelings[0].replacement=prod-eu",
            "podMonitor.metricRelabelings[0].action=drop",
            "podMonitor.metricRelabelings[0].sourceLabels[0]=__name__",
            "podMonitor.metricRelabelings[0].regex=pgio_(relation_io|query_id|query_id_io)_seconds_bucket",
        ],
        &[],
        "helm-scrape-limits",
    )?;
    t.kubeconform(newest, &r)?;
    let pm = only(&r, "PodMonitor")?;
    let ep = &pm["spec"]["podMetricsEndpoints"][0];
    let relabelings = ep["relabelings"].as_array().cloned().unwrap_or_default();
    ensure!(
        pm["spec"]["sampleLimit"] == 20000
            && relabelings.len() == 3
            && relabelings[0]["action"] == "labeldrop"
            && relabelings[2]["targetLabel"] == "cluster"
            && ep["metricRelabelings"][0]["sourceLabels"][0] == "__name__",
        "{}: sampleLimit, relabelings (pgio's two, then the value's) or metricRelabelings not \
         as set: {pm}",
        r.what
    );
    step("podMonitor.sampleLimit, relabelings and metricRelabelings render as set");
    Ok(())
}

/// Ingress only to the metrics port, from configured peers; no egress; pgio's pods selected.
fn network_policy(r: &Render) -> Result<()> {
    let np = only(r, "NetworkPolicy")?;
    let spec = &np["spec"];
    let pod_labels = &only(r, "DaemonSet")?["spec"]["template"]["metadata"]["labels"];
    let ingress = spec["ingress"].as_array().cloned().unwrap_or_default();
    let ok = labels_match(&spec["podSelector"]["matchLabels"], pod_labels)
        && spec["policyTypes"] == serde_json::json!(["Ingress", "Egress"])
        && spec["egress"].as_array().is_some_and(Vec::is_empty)
        && ingress.len() == 1
        && ingress[0]["ports"] == serde_json::json!([{"port": "metrics", "protocol": "TCP"}])
        && ingress[0]["from"].as_array().is_some_and(|f| !f.is_empty());
    if !ok {
        bail!(
            "{}: the NetworkPolicy should select pgio's pods, allow ingress to the metrics port \
             only from configured peers and no egress: {spec}",
            r.what
        );
    }
    Ok(())
}
