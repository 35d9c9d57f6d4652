//! The alerts and recording rules of `deploy/mixin/`: `promtool check rules` accepts them,
//! `promtool test rules` proves each alert fires on the input that should fire it and not on
//! its neighbour, and the recording rules give known answers (`deploy/mixin/tests/`); every
//! pgio metric they read is one pgio serves (docs/metrics.md, generated from the code), and
//! every alert has a runbook section in docs/alerts.md.
use std::{
    collections::BTreeSet,
    path::{Path, PathBuf},
    process::Command,
};

use pgio_testkit::promtool;

const RULE_FILES: [&str; 2] = ["pgio-alerts.yaml", "pgio-rules.yaml"];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn mixin() -> PathBuf {
    root().join("deploy/mixin")
}

fn promtool_ok(args: &[&str]) -> String {
    let out = Command::new(promtool().expect("promtool"))
        .args(args)
        .current_dir(mixin())
        .output()
        .expect("running promtool");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "promtool {args:?}:\n{text}");
    text
}

#[test]
fn promtool_checks_and_tests_the_rules() {
    let mut args = vec!["check", "rules"];
    args.extend(RULE_FILES);
    let checked = promtool_ok(&args);
    assert!(checked.contains("SUCCESS: 9 rules found"), "{checked}");
    assert!(checked.contains("SUCCESS: 6 rules found"), "{checked}");
    let tested = promtool_ok(&["test", "rules", "tests/pgio-rules-test.yaml"]);
    assert!(tested.contains("SUCCESS"), "{tested}");
}

/// `pgio_…` names in a text, histogram series (`_bucket`, `_sum`, `_count`) as their family.
fn metric_names(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for (i, _) in text.match_indices("pgio_") {
        // A recording rule's name (`pgio:…`) has no underscore here; a label value is quoted.
        if i > 0 && text.as_bytes()[i - 1].is_ascii_alphanumeric() {
            continue;
        }
        let name: String = text[i..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        out.insert(name);
    }
    out
}

#[test]
fn every_metric_the_rules_read_is_served() {
    let catalog = std::fs::read_to_string(root().join("docs/metrics.md")).expect("metrics.md");
    let served = metric_names(&catalog);
    for file in RULE_FILES {
        let rules = std::fs::read_to_string(mixin().join(file)).expect("rule file");
        let used = metric_names(&rules);
        assert!(!used.is_empty(), "{file} reads no pgio metric");
        for name in used {
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s).filter(|f| served.contains(*f)))
                .unwrap_or(&name);
            assert!(
                served.contains(family),
                "{file} reads {name}, which pgio does not serve (docs/metrics.md)"
            );
        }
    }
}

#[test]
fn every_alert_has_its_runbook() {
    let rules = std::fs::read_to_string(mixin().join("pgio-alerts.yaml")).expect("alerts");
    let runbooks = std::fs::read_to_string(root().join("docs/alerts.md")).expect("alerts.md");
    let alerts: Vec<&str> = rules
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- alert: "))
        .collect();
    assert_eq!(alerts.len(), 9, "{alerts:?}");
    for alert in alerts {
        let anchor = alert.to_lowercase();
        assert!(
            rules.contains(&format!("runbook: \"docs/alerts.md#{anchor}\"")),
            "{alert} has no runbook annotation"
        );
        assert!(
            runbooks.contains(&format!("\n## {alert}\n")),
            "docs/alerts.md has no section ## {alert}"
        );
    }
}
