//! Config file (TOML). Every key is declared once, as a `Key`, by the module it configures (a
//! family's `Family::config_keys`, or the daemon's own rooms: `settings` lists them all); its
//! type, bounds, default and doc come from there, and so do docs/configuration.md's table and
//! the checks of deploy/'s copies. No file at all is a working config. Errors name the file,
//! the line and what was expected.
use std::{collections::BTreeMap, net::SocketAddr, path::Path, time::Duration};

use regex::Regex;
use serde::Deserialize;
use toml::{Spanned, de::DeTable};

mod key;

pub use key::{Key, Kind, Value};

#[derive(Clone, Debug)]
pub struct Config {
    /// The keys the file sets, by name; every other key has its declared default.
    set: BTreeMap<&'static str, Value>,
    /// Not from the file: the node's possible CPUs, which the per-CPU maps' sizes follow
    /// (`check --possible-cpus` estimates for another node).
    pub possible_cpus: u32,
    /// User rules, checked before the built-in ones.
    pub rules: Vec<RuleConfig>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuleConfig {
    pub app: Spanned<String>,
    #[serde(default)]
    pub role: String,
    pub comm: Option<Spanned<String>>,
    pub exe: Option<Spanned<String>>,
    pub cmdline: Option<Spanned<String>>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            set: BTreeMap::new(),
            // `map_memory::possible_cpus` reports why it cannot tell; here 1 will do.
            possible_cpus: aya::util::nr_cpus()
                .ok()
                .and_then(|n| u32::try_from(n).ok())
                .unwrap_or(1),
            rules: Vec::new(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}:{line}: {message}")]
    Invalid {
        path: String,
        line: usize,
        message: String,
    },
}

impl Config {
    /// The file at `path`, whose keys may be `keys` (`settings::all`).
    pub fn load(path: &Path, keys: &[&'static Key]) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Config::parse(&text, &path.display().to_string(), keys)
    }

    /// `text`, read from `path`: each key checked against its declaration in `keys`.
    pub fn parse(text: &str, path: &str, keys: &[&'static Key]) -> Result<Config, ConfigError> {
        let invalid = |offset: usize, message: String| ConfigError::Invalid {
            path: path.to_owned(),
            line: line_of(text, offset),
            message,
        };
        let table = DeTable::parse(text)
            .map_err(|e| invalid(e.span().map_or(0, |s| s.start), e.message().to_owned()))?;
        let mut config = Config::default();
        for (name, value) in table.get_ref() {
            let name_str: &str = name.get_ref();
            if name_str == RULE {
                continue;
            }
            let Some(key) = keys.iter().find(|k| k.answers_to(name_str)) else {
                return Err(invalid(
                    name.span().start,
                    format!("unknown key `{name_str}` (docs/configuration.md lists the keys)"),
                ));
            };
            let checked = key
                .check(value.get_ref())
                .map_err(|message| invalid(value.span().start, message))?;
            config.set.insert(key.name, checked);
        }
        config.rules = rules(text).map_err(|(offset, message)| invalid(offset, message))?;
        Ok(config)
    }

    /// The value of a `Kind::Flag` key.
    pub fn flag(&self, key: &Key) -> bool {
        match (self.set.get(key.name), key.kind) {
            (Some(Value::Bool(b)), _) => *b,
            (_, Kind::Flag(default)) => default,
            _ => false,
        }
    }

    /// The value of a `Kind::Count` key.
    pub fn count(&self, key: &Key) -> u64 {
        match (self.set.get(key.name), key.kind) {
            (Some(Value::Int(n)), _) => *n,
            (_, Kind::Count { default, .. }) => default,
            _ => 0,
        }
    }

    /// A `Kind::Count` key as a size (its bounds keep it far below `usize::MAX`).
    pub fn size(&self, key: &Key) -> usize {
        usize::try_from(self.count(key)).unwrap_or(usize::MAX)
    }

    /// A `Kind::Count` key in seconds.
    pub fn secs(&self, key: &Key) -> Duration {
        Duration::from_secs(self.count(key))
    }

    /// The value of a `Kind::Path` or `Kind::Addr` key, as written.
    pub fn text(&self, key: &Key) -> &str {
        match (self.set.get(key.name), key.kind) {
            (Some(Value::Text(s)), _) => s,
            (_, Kind::Path { default, .. } | Kind::Addr(default)) => default,
            _ => "",
        }
    }

    /// The value of a `Kind::Addr` key (checked by `parse`; its default otherwise).
    pub fn addr(&self, key: &Key) -> SocketAddr {
        let default = match key.kind {
            Kind::Addr(d) => d.parse().ok(),
            _ => None,
        };
        self.text(key)
            .parse()
            .ok()
            .or(default)
            .unwrap_or(SocketAddr::from(([0, 0, 0, 0], 0)))
    }

    /// This config with `key` set to `value` (tools and tests; the file's keys go through
    /// `parse`).
    pub fn with(mut self, key: &'static Key, value: Value) -> Config {
        self.set.insert(key.name, value);
        self
    }
}

/// The rules' table: `[[rule]]`, read with serde (each field with its place).
const RULE: &str = "rule";

/// The `[[rule]]` tables of `text`, checked; errors at their byte offset.
fn rules(text: &str) -> Result<Vec<RuleConfig>, (usize, String)> {
    #[derive(Deserialize)]
    struct Rules {
        #[serde(default)]
        rule: Vec<RuleConfig>,
    }
    let rules: Rules = toml::from_str(text)
        .map_err(|e| (e.span().map_or(0, |s| s.start), e.message().to_owned()))?;
    for rule in &rules.rule {
        if rule.comm.is_none() && rule.exe.is_none() && rule.cmdline.is_none() {
            return Err((
                rule.app.span().start,
                format!(
                    "rule for app {:?} needs at least one of `comm`, `exe`, `cmdline`",
                    rule.app.get_ref()
                ),
            ));
        }
        for r in [&rule.comm, &rule.exe, &rule.cmdline].into_iter().flatten() {
            Regex::new(r.get_ref()).map_err(|e| (r.span().start, format!("invalid regex: {e}")))?;
        }
    }
    Ok(rules.rule)
}

fn line_of(text: &str, offset: usize) -> usize {
    text[..offset.min(text.len())].matches('\n').count() + 1
}
