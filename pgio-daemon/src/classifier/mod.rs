//! Process → labels. User rules from the config come first, then the built-in rules
//! (PostgreSQL by process title, Longhorn by argv, kernel threads by name). `None` = not tracked.
pub mod kernel;
pub mod longhorn;
pub mod postgres;
pub mod rules;

use crate::labels::Labels;

/// What the classifier looks at, read from /proc.
#[derive(Clone, Debug, Default)]
pub struct ProcessInfo {
    /// `/proc/<pid>/comm` (15 bytes at most).
    pub comm: String,
    /// `/proc/<pid>/cmdline`, arguments joined by single spaces (Postgres overwrites argv with
    /// its process title, so this is the title).
    pub cmdline: String,
    /// The same arguments, one per element (Longhorn's flags and subcommand).
    pub argv: Vec<String>,
    /// Target of `/proc/<pid>/cwd`; read for Postgres only (the postmaster and every child
    /// run in the data directory).
    pub cwd: Option<String>,
    /// Target of `/proc/<pid>/exe`, when readable.
    pub exe: Option<String>,
    /// PF_KTHREAD set in `/proc/<pid>/stat`.
    pub kthread: bool,
}

pub struct Classifier {
    rules: Vec<rules::Rule>,
}

impl Classifier {
    pub fn new(rules: Vec<rules::Rule>) -> Classifier {
        Classifier { rules }
    }

    pub fn classify(&self, p: &ProcessInfo) -> Option<Labels> {
        if let Some(labels) = self.rules.iter().find_map(|r| r.apply(p)) {
            return Some(labels);
        }
        if p.kthread {
            return Some(kernel::classify(&p.comm));
        }
        postgres::classify(p).or_else(|| longhorn::classify(p))
    }
}
