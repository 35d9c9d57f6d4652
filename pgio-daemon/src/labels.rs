//! The label set of a series: who did the IO. Bounded cardinality by construction: no pid,
//! no backend state, no query text.
use prometheus_client::encoding::{EncodeLabel, EncodeLabelSet, LabelSetEncoder};

#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Labels {
    /// `postgres`, `kernel`, a user rule's app, or `other` for untracked processes.
    pub app: String,
    /// Postgres: `pg_stat_activity.backend_type` names plus `postmaster`; kernel: thread kind.
    pub role: String,
    /// Postgres client backends (and autovacuum workers).
    pub database: String,
    pub user: String,
    /// Postgres: cluster_name from the process title, else empty.
    pub cluster: String,
}

impl Labels {
    pub fn app_role(app: &str, role: &str) -> Labels {
        Labels {
            app: app.to_owned(),
            role: role.to_owned(),
            ..Labels::default()
        }
    }

    /// Pairs in exposition order; empty values are left out (Prometheus treats an empty label
    /// as absent, so writing it only costs bytes).
    pub fn pairs(&self) -> impl Iterator<Item = (&'static str, &str)> {
        [
            ("app", self.app.as_str()),
            ("role", self.role.as_str()),
            ("database", self.database.as_str()),
            ("user", self.user.as_str()),
            ("cluster", self.cluster.as_str()),
        ]
        .into_iter()
        .filter(|(_, v)| !v.is_empty())
    }
}

impl EncodeLabelSet for Labels {
    fn encode(&self, encoder: &mut LabelSetEncoder) -> Result<(), std::fmt::Error> {
        for pair in self.pairs() {
            pair.encode(encoder.encode_label())?;
        }
        Ok(())
    }
}

impl EncodeLabelSet for &Labels {
    fn encode(&self, encoder: &mut LabelSetEncoder) -> Result<(), std::fmt::Error> {
        (*self).encode(encoder)
    }
}

/// A series' labels followed by metric-specific ones (device, op, syscall, ...).
pub struct WithLabels<'a, const N: usize> {
    pub series: &'a Labels,
    pub extra: [(&'static str, &'a str); N],
}

impl<const N: usize> EncodeLabelSet for WithLabels<'_, N> {
    fn encode(&self, encoder: &mut LabelSetEncoder) -> Result<(), std::fmt::Error> {
        for (k, v) in self.extra {
            if !v.is_empty() {
                (k, v).encode(encoder.encode_label())?;
            }
        }
        self.series.encode(encoder)
    }
}
