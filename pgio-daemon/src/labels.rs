//! The label set of a series: who did the IO. Bounded cardinality by construction: no pid,
//! no backend state, no query text.
use crate::{
    exposition::{LabelSet, LabelWriter},
    pods::PodLabels,
};

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
    /// Longhorn: the volume (PV name) an engine, replica or sync agent serves.
    pub volume: String,
    /// Kubernetes: the pod the process runs in (see `pods`), empty outside any pod.
    pub namespace: String,
    pub pod: String,
    pub container: String,
}

impl Labels {
    pub fn app_role(app: &str, role: &str) -> Labels {
        Labels {
            app: app.to_owned(),
            role: role.to_owned(),
            ..Labels::default()
        }
    }

    /// The same labels in the pod `p` (or in none).
    pub fn in_pod(mut self, p: Option<PodLabels>) -> Labels {
        let p = p.unwrap_or_default();
        (self.namespace, self.pod, self.container) = (p.namespace, p.pod, p.container);
        self
    }

    /// Cuts every value at `max` bytes (on a character boundary). Returns whether any was
    /// longer: argv, titles and pod names are anyone's to choose.
    pub fn truncate_values(&mut self, max: usize) -> bool {
        let mut cut = false;
        for v in [
            &mut self.app,
            &mut self.role,
            &mut self.database,
            &mut self.user,
            &mut self.cluster,
            &mut self.volume,
            &mut self.namespace,
            &mut self.pod,
            &mut self.container,
        ] {
            if v.len() > max {
                let end = (0..=max)
                    .rev()
                    .find(|&i| v.is_char_boundary(i))
                    .unwrap_or(0);
                v.truncate(end);
                cut = true;
            }
        }
        cut
    }

    /// The pod these labels carry (children of a process run in its pod).
    pub fn pod_labels(&self) -> Option<PodLabels> {
        (!self.pod.is_empty()).then(|| PodLabels {
            namespace: self.namespace.clone(),
            pod: self.pod.clone(),
            container: self.container.clone(),
        })
    }

    /// Pairs in exposition order; empty values are left out (Prometheus treats an empty label
    /// as absent, so writing it only costs bytes).
    pub fn pairs(&self) -> impl Iterator<Item = (&'static str, &str)> {
        self.pairs_with_volume(&self.volume)
    }

    /// The same with `volume` replaced (block series: the device's volume wins).
    pub fn pairs_with_volume<'a>(
        &'a self,
        volume: &'a str,
    ) -> impl Iterator<Item = (&'static str, &'a str)> {
        [
            ("app", self.app.as_str()),
            ("role", self.role.as_str()),
            ("database", self.database.as_str()),
            ("user", self.user.as_str()),
            ("pg_cluster", self.cluster.as_str()),
            ("volume", volume),
            ("namespace", self.namespace.as_str()),
            ("pod", self.pod.as_str()),
            ("container", self.container.as_str()),
        ]
        .into_iter()
        .filter(|(_, v)| !v.is_empty())
    }
}

impl LabelSet for Labels {
    fn write(&self, w: &mut LabelWriter<'_>) {
        for (name, value) in self.pairs() {
            w.label(name, value);
        }
    }
}

/// A series' labels followed by metric-specific ones (device, op, syscall, ...).
pub struct WithLabels<'a, const N: usize> {
    pub series: &'a Labels,
    pub extra: [(&'static str, &'a str); N],
}

impl<const N: usize> LabelSet for WithLabels<'_, N> {
    fn write(&self, w: &mut LabelWriter<'_>) {
        self.extra.write(w);
        self.series.write(w);
    }
}

/// Labels of a block series (`pgio_block_io_*`): `device`, `op`, then the submitting process'
/// series labels, with one rule for `volume` so that no label name appears twice:
///
/// - the device's volume when the device is a Longhorn volume (`/dev/longhorn/<volume>` has
///   its major:minor), whoever submitted the request;
/// - else the submitting process' volume (a Longhorn replica's IO on its backing disk carries
///   the replica's volume: with the engine's device above it, one volume's whole stack);
/// - else none.
pub struct BlockLabels<'a> {
    pub series: &'a Labels,
    pub device: &'a str,
    pub op: &'a str,
    /// The device's Longhorn volume, if it is one.
    pub device_volume: Option<&'a str>,
}

impl BlockLabels<'_> {
    /// The `volume` value this series is exported with (empty: no label).
    pub fn volume(&self) -> &str {
        self.device_volume
            .filter(|v| !v.is_empty())
            .unwrap_or(&self.series.volume)
    }
}

impl LabelSet for BlockLabels<'_> {
    fn write(&self, w: &mut LabelWriter<'_>) {
        [("device", self.device), ("op", self.op)].write(w);
        for (name, value) in self.series.pairs_with_volume(self.volume()) {
            w.label(name, value);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(it: impl Iterator<Item = (&'static str, impl AsRef<str>)>) -> Vec<&'static str> {
        it.map(|(k, _)| k).collect()
    }

    #[test]
    fn long_values_are_cut_on_a_character_boundary() {
        let mut l = Labels {
            database: "é".repeat(100),
            volume: "v".repeat(300),
            ..Labels::app_role("longhorn", "replica")
        };
        assert!(l.truncate_values(128));
        assert_eq!(l.database, "é".repeat(64));
        assert_eq!(l.volume.len(), 128);
        assert_eq!(l.role, "replica");
        assert!(!l.truncate_values(128), "already short enough");
    }

    #[test]
    fn volume_comes_after_cluster_and_empty_is_left_out() {
        let mut l = Labels::app_role("longhorn", "replica");
        assert_eq!(names(l.pairs()), ["app", "role"]);
        l.volume = "pvc-a".into();
        l.cluster = "c".into();
        assert_eq!(names(l.pairs()), ["app", "role", "pg_cluster", "volume"]);
    }

    #[test]
    fn block_volume_is_the_devices_else_the_submitters() {
        let replica = Labels {
            volume: "pvc-a".into(),
            ..Labels::app_role("longhorn", "replica")
        };
        let backend = Labels::app_role("postgres", "client backend");
        let block = |series, device_volume| BlockLabels {
            series,
            device: "sdb",
            op: "read",
            device_volume,
        };
        assert_eq!(block(&replica, Some("pvc-b")).volume(), "pvc-b");
        assert_eq!(block(&replica, None).volume(), "pvc-a");
        assert_eq!(block(&replica, Some("")).volume(), "pvc-a");
        assert_eq!(block(&backend, Some("pvc-b")).volume(), "pvc-b");
        assert_eq!(block(&backend, None).volume(), "");
        let b = block(&replica, Some("pvc-b"));
        let pairs: Vec<_> = b.series.pairs_with_volume(b.volume()).collect();
        assert_eq!(
            pairs,
            [
                ("app", "longhorn"),
                ("role", "replica"),
                ("volume", "pvc-b")
            ]
        );
    }
}
