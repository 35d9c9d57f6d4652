//! The PrometheusRule both tools render (the chart's `prometheusRule.enabled`, the kustomize
//! component `prometheusrule`): its groups must be deploy/mixin's, which `tests/mixin.rs`
//! runs through `promtool`; the chart's copies of the mixin files must be the files.
use std::{fs, path::Path};

use anyhow::{Context, Result, ensure};
use serde_json::{Value, json};

use super::{Paths, Render};
use crate::util::step;

/// The mixin's files, recording rules first (the order both renders keep).
const MIXIN: [&str; 2] = ["pgio-rules.yaml", "pgio-alerts.yaml"];

/// deploy/mixin's groups, in the order of `MIXIN`, after checking that the chart's `files/`
/// hold the same files.
pub(super) fn mixin_groups(p: &Paths) -> Result<Vec<Value>> {
    let mut groups = Vec::new();
    for name in MIXIN {
        let file = p.root.join("deploy/mixin").join(name);
        let text =
            fs::read_to_string(&file).with_context(|| format!("reading {}", file.display()))?;
        super::same_copy(&file, &text, &p.chart.join("files").join(name))?;
        let doc: Value = serde_yaml_ng::from_str(&text)
            .with_context(|| format!("parsing {}", file.display()))?;
        groups.extend(doc["groups"].as_array().cloned().unwrap_or_default());
    }
    ensure!(!groups.is_empty(), "deploy/mixin holds no rule groups");
    Ok(groups)
}

/// The render's one PrometheusRule holds `groups`, and the labels `labels` among its own.
pub(super) fn check_render(r: &Render, groups: &[Value], labels: &[(&str, &str)]) -> Result<()> {
    let rule = super::only(r, "PrometheusRule")?;
    ensure!(
        rule["spec"]["groups"].as_array().map(Vec::as_slice) == Some(groups),
        "{}: the PrometheusRule's groups are not deploy/mixin's ({}; the kustomize component's \
         file is generated from the mixin: rewrite it from pgio-rules.yaml then pgio-alerts.yaml)",
        r.what,
        r.file.display()
    );
    for (k, v) in labels {
        ensure!(
            rule["metadata"]["labels"][k] == *v,
            "{}: the PrometheusRule lacks the label {k}={v}",
            r.what
        );
    }
    let rules: usize = groups
        .iter()
        .map(|g| g["rules"].as_array().map_or(0, Vec::len))
        .sum();
    step(format!(
        "{}: a PrometheusRule with deploy/mixin's {} groups, {rules} rules",
        r.what,
        groups.len()
    ));
    Ok(())
}

/// A closed schema of the PrometheusRule fields pgio uses, for kubeconform.
pub(super) fn write_schema(dir: &Path) -> Result<()> {
    let labels = json!({"type": "object", "additionalProperties": {"type": "string"}});
    let duration = json!({"type": "string", "pattern": "^[0-9]+(ms|s|m|h|d)$"});
    let rule = json!({
        "type": "object", "additionalProperties": false, "required": ["expr"],
        "oneOf": [{"required": ["record"]}, {"required": ["alert"]}],
        "properties": {
            "record": {"type": "string", "minLength": 1},
            "alert": {"type": "string", "minLength": 1},
            "expr": {"type": "string", "minLength": 1},
            "for": duration,
            "keep_firing_for": duration,
            "labels": labels,
            "annotations": labels,
        },
    });
    let group = json!({
        "type": "object", "additionalProperties": false, "required": ["name", "rules"],
        "properties": {
            "name": {"type": "string", "minLength": 1},
            "interval": duration,
            "rules": {"type": "array", "minItems": 1, "items": rule},
        },
    });
    let schema = json!({
        "type": "object", "additionalProperties": false,
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"enum": ["monitoring.coreos.com/v1"]},
            "kind": {"enum": ["PrometheusRule"]},
            "metadata": {
                "type": "object", "additionalProperties": false, "required": ["name"],
                "properties": {
                    "name": {"type": "string"},
                    "namespace": {"type": "string"},
                    "labels": labels,
                    "annotations": labels,
                },
            },
            "spec": {
                "type": "object", "additionalProperties": false, "required": ["groups"],
                "properties": {"groups": {"type": "array", "minItems": 1, "items": group}},
            },
        },
    });
    let file = dir.join("prometheusrule-monitoring-v1.json");
    fs::write(&file, serde_json::to_vec_pretty(&schema)?)
        .with_context(|| format!("writing {}", file.display()))
}
