//! Every copy of pgio.toml's keys outside the daemon is held to their one declaration
//! (`pgio_daemon::settings`): docs/configuration.md's table and the chart's `_config.tpl` are
//! generated from it (`PGIO_BLESS=1` rewrites them), and the chart's values and schema and
//! the kustomize pgio.toml must name every key, with its default, type and bounds. A key
//! added, renamed or re-bounded in its family fails here until deploy/ and docs/ follow.
use std::{
    collections::BTreeSet,
    path::{Path, PathBuf},
};

use pgio_daemon::{
    config::{Config, Key, Kind},
    settings,
};
use pgio_testkit::serde_json::{Value, json};

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn read(rel: &str) -> String {
    let path = workspace().join(rel);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// The keys the chart's `config` holds: all but `listen`, which comes from `.Values.port`.
fn chart_keys() -> Vec<&'static Key> {
    settings::all()
        .into_iter()
        .filter(|k| k.name != "listen")
        .collect()
}

/// The default of `key` as YAML/JSON reads it.
fn default_json(key: &Key) -> Value {
    match key.kind {
        Kind::Flag(b) => json!(b),
        Kind::Count { default, .. } => json!(default),
        Kind::Path { default, .. } | Kind::Addr(default) => json!(default),
    }
}

/// Every name in `names` (but `rules`) is a declared key.
fn assert_all_declared<'a>(names: impl Iterator<Item = &'a String>, what: &str) {
    let declared: BTreeSet<&str> = chart_keys().iter().map(|k| k.name).collect();
    let extra: Vec<&String> = names
        .filter(|k| *k != "rules" && !declared.contains(k.as_str()))
        .collect();
    assert!(extra.is_empty(), "{what} has undeclared keys {extra:?}");
}

/// `text` with the part between `begin` and `end` replaced by `generated`, or a failure
/// naming the file when it differs (rewritten instead with `PGIO_BLESS=1`).
fn generated_part(rel: &str, begin: &str, end: &str, generated: &str) {
    let text = read(rel);
    let start = text
        .find(begin)
        .unwrap_or_else(|| panic!("{rel}: no {begin:?}"))
        + begin.len();
    let stop = start
        + text[start..]
            .find(end)
            .unwrap_or_else(|| panic!("{rel}: no {end:?} after {begin:?}"));
    let want = format!("\n{generated}");
    if text[start..stop] == want {
        return;
    }
    if std::env::var_os("PGIO_BLESS").is_some() {
        let new = format!("{}{want}{}", &text[..start], &text[stop..]);
        std::fs::write(workspace().join(rel), new).expect("writing the generated part");
        return;
    }
    panic!(
        "{rel} between {begin:?} and {end:?} is not what the keys' declarations give \
         (PGIO_BLESS=1 cargo test --test config_keys rewrites it):\n{want}"
    );
}

#[test]
fn docs_table_is_generated_from_the_declarations() {
    generated_part(
        "docs/configuration.md",
        "<!-- config-keys:begin (generated: tests/config_keys.rs) -->",
        "<!-- config-keys:end -->",
        &settings::markdown(),
    );
}

#[test]
fn chart_template_is_generated_from_the_declarations() {
    generated_part(
        "deploy/helm/pgio/templates/_config.tpl",
        "{{- $c := .Values.config -}}",
        "{{- range $rule := $c.rules }}",
        &settings::helm_template(),
    );
}

#[test]
fn kustomize_pgio_toml_spells_out_every_key_at_its_default() {
    let rel = "deploy/kustomize/pgio.toml";
    let text = read(rel);
    let shipped = settings::parse(&text, rel)
        .unwrap_or_else(|e| panic!("the daemon rejects the shipped config: {e}"));
    let d = Config::default();
    for key in settings::all() {
        assert!(
            text.lines()
                .any(|l| l.starts_with(&format!("{} = ", key.name))),
            "{rel} does not set {}",
            key.name
        );
        match key.kind {
            Kind::Flag(_) => assert_eq!(shipped.flag(key), d.flag(key), "{}", key.name),
            Kind::Count { .. } => assert_eq!(shipped.count(key), d.count(key), "{}", key.name),
            Kind::Path { .. } | Kind::Addr(_) => {
                assert_eq!(shipped.text(key), d.text(key), "{}", key.name)
            }
        }
    }
    assert!(shipped.rules.is_empty(), "no rules by default");
}

#[test]
fn chart_values_hold_every_key_at_its_default() {
    let values: Value =
        pgio_testkit::serde_yaml_ng::from_str(&read("deploy/helm/pgio/values.yaml"))
            .expect("values.yaml");
    let config = values["config"]
        .as_object()
        .expect("values.yaml has a config map");
    for key in chart_keys() {
        assert_eq!(
            config.get(key.name),
            Some(&default_json(key)),
            "values.yaml config.{}",
            key.name
        );
    }
    assert_all_declared(config.keys(), "values.yaml's config");
}

#[test]
fn chart_schema_types_and_bounds_are_the_declarations() {
    let schema: Value =
        pgio_testkit::serde_json::from_str(&read("deploy/helm/pgio/values.schema.json"))
            .expect("values.schema.json");
    let props = schema["properties"]["config"]["properties"]
        .as_object()
        .expect("the schema's config properties");
    for key in chart_keys() {
        let p = &props
            .get(key.name)
            .unwrap_or_else(|| panic!("the schema lacks config.{}", key.name));
        let (ty, min, max, pattern) = match key.kind {
            Kind::Flag(_) => ("boolean", None, None, None),
            Kind::Count { min, max, .. } => {
                ("integer", Some(min), (max != u64::MAX).then_some(max), None)
            }
            Kind::Path {
                may_be_off: true, ..
            } => ("string", None, None, Some("^(/.*)?$")),
            Kind::Path { .. } => ("string", None, None, Some("^/")),
            Kind::Addr(_) => ("string", None, None, None),
        };
        let name = key.name;
        assert_eq!(p["type"], json!(ty), "schema config.{name}.type");
        assert_eq!(
            p.get("minimum"),
            min.map(|m| json!(m)).as_ref(),
            "{name}.minimum"
        );
        assert_eq!(
            p.get("maximum"),
            max.map(|m| json!(m)).as_ref(),
            "{name}.maximum"
        );
        assert_eq!(
            p.get("pattern"),
            pattern.map(|m| json!(m)).as_ref(),
            "{name}.pattern"
        );
    }
    assert_all_declared(props.keys(), "the schema's config");
}

#[test]
fn an_unknown_key_names_its_line_and_a_family_key_its_bounds() {
    let e =
        settings::parse("queries = true\n\nmax_query_id = 3\n", "p.toml").expect_err("unknown key");
    assert!(
        e.to_string()
            .starts_with("p.toml:3: unknown key `max_query_id`"),
        "{e}"
    );
    let e = settings::parse("max_query_ids = 0\n", "p.toml").expect_err("0 places");
    assert_eq!(
        e.to_string(),
        "p.toml:1: max_query_ids must be between 1 and 1000, not 0"
    );
    let c = settings::parse("query_ids = false\n", "p.toml").expect("off");
    assert!(!c.flag(&pgio_daemon::query_id::QUERY_IDS));
}
