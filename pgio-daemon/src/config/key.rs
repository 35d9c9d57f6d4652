//! One key of pgio.toml as its owner declares it, and the check of a written value.
use toml::de::DeValue;

/// A key: its name, what it holds, and one line on what it does (docs/configuration.md's
/// table, the Helm values' and kustomize pgio.toml's comments say the same).
#[derive(Debug)]
pub struct Key {
    pub name: &'static str,
    pub kind: Kind,
    pub doc: &'static str,
    /// Older names that still work.
    pub aliases: &'static [&'static str],
}

/// What a key holds, with its default.
#[derive(Clone, Copy, Debug)]
pub enum Kind {
    /// On or off: a family, or one of its parts.
    Flag(bool),
    /// A whole number within `min..=max` (`u64::MAX`: no bound above); `places` counts.
    Count { default: u64, min: u64, max: u64 },
    /// An absolute path; `""` turns it off where `may_be_off`.
    Path {
        default: &'static str,
        may_be_off: bool,
    },
    /// An address and port.
    Addr(&'static str),
}

/// A checked value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Value {
    Bool(bool),
    Int(u64),
    Text(String),
}

impl Key {
    pub const fn flag(name: &'static str, default: bool, doc: &'static str) -> Key {
        Key::new(name, Kind::Flag(default), doc)
    }

    /// A number of at least `min`, with no bound above.
    pub const fn at_least(name: &'static str, default: u64, min: u64, doc: &'static str) -> Key {
        Key::count(name, default, min, u64::MAX, doc)
    }

    pub const fn count(
        name: &'static str,
        default: u64,
        min: u64,
        max: u64,
        doc: &'static str,
    ) -> Key {
        Key::new(name, Kind::Count { default, min, max }, doc)
    }

    pub const fn path(
        name: &'static str,
        default: &'static str,
        may_be_off: bool,
        doc: &'static str,
    ) -> Key {
        Key::new(
            name,
            Kind::Path {
                default,
                may_be_off,
            },
            doc,
        )
    }

    pub const fn addr(name: &'static str, default: &'static str, doc: &'static str) -> Key {
        Key::new(name, Kind::Addr(default), doc)
    }

    const fn new(name: &'static str, kind: Kind, doc: &'static str) -> Key {
        Key {
            name,
            kind,
            doc,
            aliases: &[],
        }
    }

    pub const fn alias(mut self, aliases: &'static [&'static str]) -> Key {
        self.aliases = aliases;
        self
    }

    pub fn answers_to(&self, name: &str) -> bool {
        self.name == name || self.aliases.contains(&name)
    }

    /// The default as TOML writes it.
    pub fn default_toml(&self) -> String {
        match self.kind {
            Kind::Flag(b) => b.to_string(),
            Kind::Count { default, .. } => default.to_string(),
            Kind::Path { default, .. } | Kind::Addr(default) => format!("{default:?}"),
        }
    }

    /// What a value may be, in words (`1 to 10000`, `≥ 1`, `true or false`, …).
    pub fn allowed(&self) -> String {
        match self.kind {
            Kind::Flag(_) => "true or false".into(),
            Kind::Count { min, max, .. } if max == u64::MAX => format!("≥ {min}"),
            Kind::Count { min, max, .. } => format!("{min} to {max}"),
            Kind::Path {
                may_be_off: true, ..
            } => "absolute path, or \"\" (off)".into(),
            Kind::Path { .. } => "absolute path".into(),
            Kind::Addr(_) => "address:port".into(),
        }
    }

    /// `value` as this key takes it, or the error to show (without its place).
    pub fn check(&self, value: &DeValue<'_>) -> Result<Value, String> {
        let name = self.name;
        match (self.kind, value) {
            (Kind::Flag(_), DeValue::Boolean(b)) => Ok(Value::Bool(*b)),
            (Kind::Flag(_), v) => Err(format!(
                "{name} must be true or false (a boolean), not {}",
                what(v)
            )),
            (Kind::Count { min, max, .. }, DeValue::Integer(i)) => {
                let n = i128::from_str_radix(i.as_str(), i.radix()).unwrap_or(i128::MAX);
                if (i128::from(min)..=i128::from(max)).contains(&n) {
                    Ok(Value::Int(n as u64))
                } else if max == u64::MAX {
                    Err(format!("{name} must be at least {min}"))
                } else {
                    Err(format!("{name} must be between {min} and {max}, not {n}"))
                }
            }
            (Kind::Count { .. }, v) => {
                Err(format!("{name} must be a whole number, not {}", what(v)))
            }
            (Kind::Path { may_be_off, .. }, DeValue::String(s)) => {
                if s.starts_with('/') || (may_be_off && s.is_empty()) {
                    Ok(Value::Text(s.to_string()))
                } else if may_be_off {
                    Err(format!(
                        "{name} must be an absolute path (or \"\" to turn it off), not {s:?}"
                    ))
                } else {
                    Err(format!("{name} must be an absolute path, not {s:?}"))
                }
            }
            (Kind::Addr(example), DeValue::String(s)) => match s.parse::<std::net::SocketAddr>() {
                Ok(_) => Ok(Value::Text(s.to_string())),
                Err(e) => Err(format!(
                    "{name} must be an address and port like {example:?}, not {s:?}: {e}"
                )),
            },
            (Kind::Path { .. } | Kind::Addr(_), v) => {
                Err(format!("{name} must be a string, not {}", what(v)))
            }
        }
    }
}

/// What a TOML value is, for errors.
fn what(value: &DeValue<'_>) -> &'static str {
    match value {
        DeValue::String(_) => "a string",
        DeValue::Integer(_) => "an integer",
        DeValue::Float(_) => "a float",
        DeValue::Boolean(_) => "a boolean",
        DeValue::Datetime(_) => "a date",
        DeValue::Array(_) => "an array",
        DeValue::Table(_) => "a table",
    }
}
