//! Every key of pgio.toml: the daemon's own, each declared by the module it configures, then
//! each family's (`Family::config_keys`). The parser takes them from here, and so do the
//! generated table of docs/configuration.md and the Helm chart's `_config.tpl`, which
//! `tests/config_keys.rs` holds to this list along with the chart's values, its schema and
//! the kustomize pgio.toml.
use std::path::Path;

use crate::{
    config::{Config, ConfigError, Key, Kind},
    devices, discovery,
    families::FAMILIES,
    hist, http_server, pods, self_metrics, series,
};

/// The keys outside the families, in the order of the docs, each with its room.
static DAEMON: &[(&str, &Key)] = &[
    ("http_server", &http_server::LISTEN),
    ("discovery", &discovery::RESCAN_INTERVAL),
    ("self_metrics", &self_metrics::BPF_STATS),
    ("devices", &devices::LONGHORN_DEVICE_DIR),
    ("pods", &pods::POD_LABELS),
    ("pods", &pods::POD_LOG_DIR),
    ("pods", &pods::CONTAINER_LOG_DIR),
    ("series", &series::SERIES_RETENTION),
    ("series", &series::MAX_SERIES),
    ("series", &series::MAX_SERIES_PER_APP),
    ("series", &series::MAX_SERIES_PER_GROUP),
    ("series", &series::MAX_LABEL_LEN),
    ("hist", &hist::HIST_MAP_MAX_ENTRIES),
    ("http_server", &http_server::HTTP_HEADER_TIMEOUT),
    ("http_server", &http_server::HTTP_IDLE_TIMEOUT),
    ("http_server", &http_server::HTTP_MAX_CONNECTIONS),
];

/// Every key with the module that declares it (a family's name for the families').
pub fn owned() -> Vec<(&'static str, &'static Key)> {
    let mut keys = DAEMON.to_vec();
    for family in FAMILIES {
        keys.extend(family.config_keys().iter().map(|k| (family.name(), *k)));
    }
    keys
}

/// Every key.
pub fn all() -> Vec<&'static Key> {
    owned().into_iter().map(|(_, k)| k).collect()
}

pub fn load(path: &Path) -> Result<Config, ConfigError> {
    Config::load(path, &all())
}

pub fn parse(text: &str, path: &str) -> Result<Config, ConfigError> {
    Config::parse(text, path, &all())
}

/// docs/configuration.md's table of the keys.
pub fn markdown() -> String {
    let mut out =
        String::from("| key | default | values | declared in | what |\n|---|---|---|---|---|\n");
    for (room, key) in owned() {
        let aliases = if key.aliases.is_empty() {
            String::new()
        } else {
            format!(" (old name: `{}`)", key.aliases.join("`, `"))
        };
        out.push_str(&format!(
            "| `{}` | `{}` | {} | `{room}` | {}{aliases} |\n",
            key.name,
            key.default_toml(),
            key.allowed(),
            key.doc.replace('|', "\\|"),
        ));
    }
    out
}

/// The Helm chart's lines of pgio.toml from `.Values.config` (`$c`), one per key, in the
/// order of `owned`. `listen` comes from `.Values.port`; numbers go through `int` because
/// Helm reads numbers in values as floats.
pub fn helm_template() -> String {
    let mut out = String::new();
    for key in all() {
        let line = match (key.name, key.kind) {
            ("listen", _) => {
                "listen = {{ include \"pgio.tomlString\" (printf \"[::]:%d\" (int .Values.port)) }}"
                    .to_owned()
            }
            (name, Kind::Flag(_)) => format!("{name} = {{{{ $c.{name} }}}}"),
            (name, Kind::Count { .. }) => format!("{name} = {{{{ int $c.{name} }}}}"),
            (name, Kind::Path { .. } | Kind::Addr(_)) => {
                format!("{name} = {{{{ include \"pgio.tomlString\" $c.{name} }}}}")
            }
        };
        out.push_str(&line);
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use std::{path::PathBuf, time::Duration};

    use super::*;

    #[test]
    fn each_key_is_declared_once_and_answers_to_its_names_only() {
        let keys = all();
        for (i, k) in keys.iter().enumerate() {
            for other in &keys[i + 1..] {
                for name in std::iter::once(&k.name).chain(k.aliases) {
                    assert!(!other.answers_to(name), "{name} declared twice");
                }
            }
        }
    }

    #[test]
    fn each_default_is_a_value_its_key_takes() {
        for key in all() {
            let text = format!("{} = {}\n", key.name, key.default_toml());
            let c = parse(&text, "d.toml").unwrap_or_else(|e| panic!("{text}: {e}"));
            match key.kind {
                Kind::Flag(d) => assert_eq!(c.flag(key), d),
                Kind::Count { default, .. } => assert_eq!(c.count(key), default),
                Kind::Path { default, .. } | Kind::Addr(default) => {
                    assert_eq!(c.text(key), default)
                }
            }
        }
    }

    #[test]
    fn empty_config_is_the_default() {
        let c = parse("", "x.toml").expect("empty config");
        assert_eq!(c.addr(&http_server::LISTEN).to_string(), "[::]:9435");
        assert!(c.rules.is_empty());
    }

    #[test]
    fn rules_parse_and_compile() {
        let c = parse(
            "listen = \"127.0.0.1:9999\"\n[[rule]]\napp = \"fio\"\nrole = \"bench\"\ncomm = \"^fio$\"\n",
            "x.toml",
        )
        .expect("valid");
        assert_eq!(c.addr(&http_server::LISTEN).port(), 9999);
        let rules = crate::classifier::rules::compile(&c.rules);
        assert_eq!(rules.len(), 1);
        assert!(rules[0].comm.is_some());
    }

    #[test]
    fn unknown_field_names_file_line_and_field() {
        let e = parse(
            "listen = \"127.0.0.1:1\"\n\nlisten_port = 3\n",
            "/etc/pgio.toml",
        )
        .expect_err("unknown field");
        let msg = e.to_string();
        assert!(msg.starts_with("/etc/pgio.toml:3: "), "{msg}");
        assert!(msg.contains("listen_port"), "{msg}");
    }

    #[test]
    fn wrong_type_names_line() {
        let e = parse("bpf_stats = \"yes\"\n", "c.toml").expect_err("wrong type");
        let msg = e.to_string();
        assert!(msg.starts_with("c.toml:1: "), "{msg}");
        assert!(msg.contains("bool") || msg.contains("boolean"), "{msg}");
    }

    #[test]
    fn bad_listen_address() {
        let e = parse("\nlisten = \"nowhere\"\n", "c.toml").expect_err("bad addr");
        assert!(e.to_string().starts_with("c.toml:2: "), "{e}");
    }

    #[test]
    fn bad_regex_names_its_line() {
        let e = parse("[[rule]]\napp = \"a\"\n\ncomm = \"(unclosed\"\n", "c.toml")
            .expect_err("bad regex");
        let msg = e.to_string();
        assert!(msg.starts_with("c.toml:4: invalid regex"), "{msg}");
    }

    #[test]
    fn longhorn_device_dir_default_set_and_off() {
        let c = parse("", "c.toml").expect("default");
        assert_eq!(c.text(&devices::LONGHORN_DEVICE_DIR), "/dev/longhorn");
        assert_eq!(
            devices::longhorn_dir(&c),
            Some(PathBuf::from("/dev/longhorn"))
        );
        let c = parse("longhorn_device_dir = \"/host/dev/longhorn\"\n", "c.toml").expect("set");
        assert_eq!(
            devices::longhorn_dir(&c),
            Some(PathBuf::from("/host/dev/longhorn"))
        );
        let c = parse("longhorn_device_dir = \"\"\n", "c.toml").expect("off");
        assert_eq!(devices::longhorn_dir(&c), None);
    }

    #[test]
    fn longhorn_device_dir_errors_name_their_line() {
        let e = parse(
            "# longhorn_device_dir = \"/dev/longhorn\"\nbpf_stats = true\n  longhorn_device_dir = \"dev/longhorn\"\n",
            "c.toml",
        )
        .expect_err("relative");
        let msg = e.to_string();
        assert!(
            msg.starts_with("c.toml:3: longhorn_device_dir must be an absolute path"),
            "{msg}"
        );
        let e = parse("\nlonghorn_device_dir = 3\n", "c.toml").expect_err("wrong type");
        let msg = e.to_string();
        assert!(msg.starts_with("c.toml:2: "), "{msg}");
        assert!(msg.contains("string"), "{msg}");
    }

    #[test]
    fn pod_settings_default_set_and_errors() {
        let c = Config::default();
        assert!(c.flag(&pods::POD_LABELS));
        assert_eq!(c.text(&pods::POD_LOG_DIR), "/var/log/pods");
        assert_eq!(c.text(&pods::CONTAINER_LOG_DIR), "/var/log/containers");
        assert_eq!(c.secs(&series::SERIES_RETENTION), Duration::from_secs(300));
        assert_eq!(series::limits(&c), series::Limits::default());
        let c = parse(
            "pod_labels = false\npod_log_dir = \"/host/pods\"\npod_series_retention_secs = 5\n",
            "c.toml",
        )
        .expect("valid");
        assert!(!c.flag(&pods::POD_LABELS) && pods::from_config(&c).is_none());
        assert_eq!(c.text(&pods::POD_LOG_DIR), "/host/pods");
        assert_eq!(
            c.count(&series::SERIES_RETENTION),
            5,
            "the old key still works"
        );
        for (text, want) in [
            (
                "\n\ncontainer_log_dir = \"logs\"\n",
                "c.toml:3: container_log_dir must be an absolute path",
            ),
            (
                "pod_series_retention_secs = 0\n",
                "c.toml:1: series_retention_secs must be at least 1",
            ),
            ("\npod_labels = \"yes\"\n", "c.toml:2: "),
            (
                "max_series = 70000\n",
                "c.toml:1: max_series must be between 1 and 64512, not 70000",
            ),
            (
                "\nmax_label_len = 3\n",
                "c.toml:2: max_label_len must be between 16 and 4096, not 3",
            ),
            (
                "max_series_per_group = 0\n",
                "c.toml:1: max_series_per_group must be at least 1",
            ),
        ] {
            let msg = parse(text, "c.toml").expect_err(text).to_string();
            assert!(msg.starts_with(want), "{text:?}: {msg}");
        }
    }

    #[test]
    fn block_inflight_timeout_default_set_and_zero_refused() {
        assert_eq!(
            Config::default().secs(&crate::block_io::INFLIGHT_TIMEOUT),
            Duration::from_secs(180)
        );
        let c = parse("block_inflight_timeout_secs = 2\n", "c.toml").expect("valid");
        assert_eq!(
            c.secs(&crate::block_io::INFLIGHT_TIMEOUT),
            Duration::from_secs(2)
        );
        let msg = parse("\nblock_inflight_timeout_secs = 0\n", "c.toml")
            .expect_err("zero")
            .to_string();
        assert_eq!(
            msg,
            "c.toml:2: block_inflight_timeout_secs must be at least 1"
        );
    }

    #[test]
    fn http_limits_default_set_and_zero_refused() {
        let c = Config::default();
        assert_eq!(
            c.secs(&http_server::HTTP_HEADER_TIMEOUT),
            Duration::from_secs(10)
        );
        assert_eq!(
            c.secs(&http_server::HTTP_IDLE_TIMEOUT),
            Duration::from_secs(90)
        );
        assert_eq!(c.count(&http_server::HTTP_MAX_CONNECTIONS), 128);
        let c = parse(
            "http_header_timeout_secs = 1\nhttp_idle_timeout_secs = 2\nhttp_max_connections = 8\n",
            "c.toml",
        )
        .expect("valid");
        assert_eq!(
            c.secs(&http_server::HTTP_HEADER_TIMEOUT),
            Duration::from_secs(1)
        );
        assert_eq!(
            c.secs(&http_server::HTTP_IDLE_TIMEOUT),
            Duration::from_secs(2)
        );
        assert_eq!(c.count(&http_server::HTTP_MAX_CONNECTIONS), 8);
        for (text, want) in [
            (
                "\nhttp_header_timeout_secs = 0\n",
                "c.toml:2: http_header_timeout_secs must be at least 1",
            ),
            (
                "http_idle_timeout_secs = 0\n",
                "c.toml:1: http_idle_timeout_secs must be at least 1",
            ),
            (
                "\n\nhttp_max_connections = 0\n",
                "c.toml:3: http_max_connections must be at least 1",
            ),
            ("http_max_connections = -1\n", "c.toml:1: "),
        ] {
            let msg = parse(text, "c.toml").expect_err(text).to_string();
            assert!(msg.starts_with(want), "{text:?}: {msg}");
        }
    }

    #[test]
    fn rule_without_matcher_is_refused() {
        let e = parse("[[rule]]\napp = \"a\"\n", "c.toml").expect_err("no matcher");
        assert!(e.to_string().contains("at least one of"), "{e}");
    }
}
