//! Config file (TOML). Every field has a default, so no file at all is a working config.
//! Errors name the file, the line and what was expected.
use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    time::Duration,
};

use regex::Regex;
use serde::Deserialize;
use toml::Spanned;

mod file;

use crate::{classifier::rules::Rule, pods::Pods, series::Limits};

/// Series ids index the kernel's `CHILD_SERIES` array: the cap leaves room below its size for
/// the overflow series (one per app).
const MAX_SERIES_LIMIT: u64 = pgio_common::CHILD_SERIES_MAX as u64 - 1024;

#[derive(Clone, Debug)]
pub struct Config {
    /// Address of the HTTP server (`/metrics`, `/healthz`).
    pub listen: SocketAddr,
    /// Full /proc rescan period, a safety net behind the fork/exec/exit events.
    pub rescan_interval_secs: u64,
    /// Turn on `kernel.bpf_stats_enabled` while pgio runs, for per-program run time metrics
    /// (costs ~20 ns per program run).
    pub bpf_stats: bool,
    /// Directory of Longhorn's volume device nodes, one block device per attached volume,
    /// named after the volume (the PV name). Read at every scrape; a missing directory means
    /// no volumes. Its devices' block series get `volume="<name>"`, and so does block IO of
    /// Longhorn processes (replicas) on other devices: a block series' `volume` is the
    /// device's volume when the device is one, else the submitting process' volume. Set to
    /// `""` to turn the lookup off; in a container, point it at the host's `/dev/longhorn`.
    pub longhorn_device_dir: String,
    /// Kubernetes labels `namespace`, `pod`, `container` on the series of processes in a pod,
    /// from their cgroup and the kubelet's log directories (see `pods`).
    pub pod_labels: bool,
    /// The kubelet's `/var/log/pods` (`<namespace>_<pod>_<uid>/<container>/`).
    pub pod_log_dir: String,
    /// The kubelet's `/var/log/containers` (`<pod>_<namespace>_<container>-<id>.log`).
    pub container_log_dir: String,
    /// A series whose processes are all gone is exported this long, then dropped (its kernel
    /// map entries deleted, its id reused): connections, pods and hostile titles churn,
    /// series must not pile up. The old key `pod_series_retention_secs` means the same.
    pub series_retention_secs: u64,
    /// Caps on label sets (see `series`): in total, per app, per group (one cluster, volume
    /// or pod), and the bytes of a label value. Past a cap, new label sets go to their app's
    /// `role="overflow"` series.
    pub max_series: u64,
    pub max_series_per_app: u64,
    pub max_series_per_group: u64,
    pub max_label_len: u64,
    /// Keys of the block and syscall histogram maps (the query map gets a quarter). Each key
    /// holds 24 bytes per possible CPU, allocated at start: 65,536 keys are 1.5 MiB per CPU
    /// per map. No owner (uid) may hold more than its share of a map while others need keys
    /// (see `key_quota`).
    pub hist_map_max_entries: u64,
    /// The busiest syscall histograms are counted in up to 256 dense rows per CPU (135 KiB
    /// each) with no hashing: a timed syscall's exit costs ~60 ns less (BENCHMARKS.md). The
    /// rows take 16 MiB at most on all CPUs (128 possible CPUs: 128 rows). Off: every
    /// histogram in the hash map, under its owner's share.
    pub syscall_rows: bool,
    /// Not from the file: the node's possible CPUs, which the per-CPU maps' sizes follow
    /// (`check --possible-cpus` estimates for another node).
    pub possible_cpus: u32,
    /// A block request issued this long ago whose completion pgio has not seen is counted in
    /// `pgio_block_io_lost_completions_total` and forgotten. SCSI's default command timeout is
    /// 30 s and it retries up to 5 times, so the default leaves room for a slow device.
    pub block_inflight_timeout_secs: u64,
    /// Query time and IO share (`pgio_query_seconds`, `pgio_query_io_seconds`, …) from the
    /// client backends' socket syscalls (tracepoints on `recvfrom`/`sendto`): no uprobes, no
    /// extra capability.
    pub queries: bool,
    /// With `queries`, a uprobe on PostgreSQL 18's `pgaio_wref_wait` (attached per postgres
    /// binary): a backend's wait for an IO an io worker performs (`io_method = worker`)
    /// counts as its query's IO time. Off by default: uprobes need CAP_SYS_ADMIN on patched
    /// kernels (CVE-2025-38466), and each hit costs a few microseconds.
    pub query_probes: bool,
    /// IO time per PostgreSQL relation file (`pgio_relation_io_seconds`): tracepoints on
    /// `openat` and `close` (~0.25 µs in-kernel per `open` + `close` of any process on the
    /// node, docs/architecture.md),
    /// +15 ns at a tracked read's exit, 9.3 MiB of kernel memory.
    pub relations: bool,
    /// Relations with series of their own per cluster: the ones with the most IO time over the
    /// last minute; the others are booked as `relation="(rest)"` of their database.
    pub max_relations: usize,
    /// Query ids with series of their own per database (`pgio_query_id_seconds`): the ones
    /// with the most IO time over the last minute; the others are booked as
    /// `queryid="(rest)"`. It costs ~0.3-0.45 µs per query (BENCHMARKS.md); 0 turns the
    /// family off.
    pub max_query_ids: usize,
    /// Attach `sys_enter_recvfrom`/`sys_enter_sendto` to keep the socket calls' arguments for
    /// their exits even where the exits can read them from the saved registers (Linux >= 5.15
    /// on x86_64): the path older kernels take, for tests and comparisons; it costs ~0.2 µs
    /// more per query.
    pub query_args_at_entry: bool,
    /// At most this many distinct postgres binaries carry pgio's uprobes at once (each costs
    /// one or more fds and kernel uprobes); past it a binary is refused
    /// (`pgio_postgres_binaries_refused_total`) until another one's processes are all gone.
    /// Binaries not owned by root get at most three quarters of the places. 0 attaches none.
    pub max_postgres_binaries: usize,
    /// User rules, checked before the built-in ones.
    pub rules: Vec<RuleConfig>,
    /// A connection that has not sent a complete request head this long after it was accepted
    /// (or after the first byte of a later request) is closed: slow-header clients cannot hold
    /// file descriptors.
    pub http_header_timeout_secs: u64,
    /// A keep-alive connection with no request for this long is closed. Longer than
    /// Prometheus' default 1-minute scrape interval, so a scraper's connection is reused
    /// between scrapes instead of being closed just as the next scrape starts.
    pub http_idle_timeout_secs: u64,
    /// Open HTTP connections at most. Past it, the one that has waited longest for a request
    /// is closed to make room (a scraper keeps getting in); when all are busy, the new one is
    /// closed at once. Either way `pgio_http_connections_closed_total` says so.
    pub http_max_connections: usize,
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
        let limits = Limits::default();
        Config {
            // Both IPv4 and IPv6 (`run::bind`).
            listen: SocketAddr::from((std::net::Ipv6Addr::UNSPECIFIED, 9435)),
            rescan_interval_secs: 10,
            bpf_stats: false,
            longhorn_device_dir: DEFAULT_LONGHORN_DEVICE_DIR.to_owned(),
            pod_labels: true,
            pod_log_dir: "/var/log/pods".to_owned(),
            container_log_dir: "/var/log/containers".to_owned(),
            series_retention_secs: 300,
            max_series: limits.total as u64,
            max_series_per_app: limits.per_app as u64,
            max_series_per_group: limits.per_group as u64,
            max_label_len: limits.label_len as u64,
            hist_map_max_entries: 65_536,
            syscall_rows: true,
            // `map_memory::possible_cpus` reports why it cannot tell; here 1 will do.
            possible_cpus: aya::util::nr_cpus()
                .ok()
                .and_then(|n| u32::try_from(n).ok())
                .unwrap_or(1),
            block_inflight_timeout_secs: 180,
            queries: true,
            query_probes: false,
            relations: true,
            max_relations: 50,
            max_query_ids: 20,
            query_args_at_entry: false,
            max_postgres_binaries: 64,
            rules: Vec::new(),
            http_header_timeout_secs: 10,
            http_idle_timeout_secs: 90,
            http_max_connections: 128,
        }
    }
}

pub const DEFAULT_LONGHORN_DEVICE_DIR: &str = "/dev/longhorn";

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
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Config::parse(&text, &path.display().to_string())
    }

    pub fn parse(text: &str, path: &str) -> Result<Config, ConfigError> {
        file::parse(text, path)
    }

    /// The Longhorn device directory, None when turned off.
    pub fn longhorn_device_dir(&self) -> Option<PathBuf> {
        (!self.longhorn_device_dir.is_empty()).then(|| PathBuf::from(&self.longhorn_device_dir))
    }

    /// Where pod names come from; `None` when pod labels are off.
    pub fn pods(&self) -> Option<Pods> {
        self.pod_labels
            .then(|| Pods::new(&self.pod_log_dir, &self.container_log_dir))
    }

    pub fn series_retention(&self) -> Duration {
        Duration::from_secs(self.series_retention_secs)
    }

    pub fn series_limits(&self) -> Limits {
        let n = |v: u64| usize::try_from(v).unwrap_or(usize::MAX);
        Limits {
            total: n(self.max_series),
            per_app: n(self.max_series_per_app),
            per_group: n(self.max_series_per_group),
            label_len: n(self.max_label_len),
        }
    }

    /// `hist_map_max_entries` (checked to fit a u32 by `parse`): each family sizes its
    /// histogram map from it.
    pub fn hist_map_entries(&self) -> u32 {
        u32::try_from(self.hist_map_max_entries).unwrap_or(1 << 20)
    }

    pub fn block_inflight_timeout(&self) -> Duration {
        Duration::from_secs(self.block_inflight_timeout_secs)
    }

    pub fn http_header_timeout(&self) -> Duration {
        Duration::from_secs(self.http_header_timeout_secs)
    }

    pub fn http_idle_timeout(&self) -> Duration {
        Duration::from_secs(self.http_idle_timeout_secs)
    }

    pub fn rescan_interval(&self) -> Duration {
        Duration::from_secs(self.rescan_interval_secs)
    }

    /// Compiled rules (regexes were validated by `parse`).
    pub fn compiled_rules(&self) -> Vec<Rule> {
        let re =
            |s: &Option<Spanned<String>>| s.as_ref().and_then(|s| Regex::new(s.get_ref()).ok());
        self.rules
            .iter()
            .map(|r| Rule {
                app: r.app.get_ref().clone(),
                role: r.role.clone(),
                comm: re(&r.comm),
                exe: re(&r.exe),
                cmdline: re(&r.cmdline),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_config_is_the_default() {
        let c = Config::parse("", "x.toml").expect("empty config");
        assert_eq!(c.listen.to_string(), "[::]:9435");
        assert!(c.rules.is_empty());
    }

    #[test]
    fn rules_parse_and_compile() {
        let c = Config::parse(
            "listen = \"127.0.0.1:9999\"\n[[rule]]\napp = \"fio\"\nrole = \"bench\"\ncomm = \"^fio$\"\n",
            "x.toml",
        )
        .expect("valid");
        assert_eq!(c.listen.port(), 9999);
        let rules = c.compiled_rules();
        assert_eq!(rules.len(), 1);
        assert!(rules[0].comm.is_some());
    }

    #[test]
    fn unknown_field_names_file_line_and_field() {
        let e = Config::parse(
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
        let e = Config::parse("bpf_stats = \"yes\"\n", "c.toml").expect_err("wrong type");
        let msg = e.to_string();
        assert!(msg.starts_with("c.toml:1: "), "{msg}");
        assert!(msg.contains("bool") || msg.contains("boolean"), "{msg}");
    }

    #[test]
    fn bad_listen_address() {
        let e = Config::parse("\nlisten = \"nowhere\"\n", "c.toml").expect_err("bad addr");
        assert!(e.to_string().starts_with("c.toml:2: "), "{e}");
    }

    #[test]
    fn bad_regex_names_its_line() {
        let e = Config::parse("[[rule]]\napp = \"a\"\n\ncomm = \"(unclosed\"\n", "c.toml")
            .expect_err("bad regex");
        let msg = e.to_string();
        assert!(msg.starts_with("c.toml:4: invalid regex"), "{msg}");
    }

    #[test]
    fn longhorn_device_dir_default_set_and_off() {
        let c = Config::parse("", "c.toml").expect("default");
        assert_eq!(c.longhorn_device_dir, "/dev/longhorn");
        assert_eq!(
            c.longhorn_device_dir(),
            Some(PathBuf::from("/dev/longhorn"))
        );
        let c =
            Config::parse("longhorn_device_dir = \"/host/dev/longhorn\"\n", "c.toml").expect("set");
        assert_eq!(
            c.longhorn_device_dir(),
            Some(PathBuf::from("/host/dev/longhorn"))
        );
        let c = Config::parse("longhorn_device_dir = \"\"\n", "c.toml").expect("off");
        assert_eq!(c.longhorn_device_dir(), None);
    }

    #[test]
    fn longhorn_device_dir_errors_name_their_line() {
        let e = Config::parse(
            "# longhorn_device_dir = \"/dev/longhorn\"\nbpf_stats = true\n  longhorn_device_dir = \"dev/longhorn\"\n",
            "c.toml",
        )
        .expect_err("relative");
        let msg = e.to_string();
        assert!(
            msg.starts_with("c.toml:3: longhorn_device_dir must be an absolute path"),
            "{msg}"
        );
        let e = Config::parse("\nlonghorn_device_dir = 3\n", "c.toml").expect_err("wrong type");
        let msg = e.to_string();
        assert!(msg.starts_with("c.toml:2: "), "{msg}");
        assert!(msg.contains("string"), "{msg}");
    }

    #[test]
    fn pod_settings_default_set_and_errors() {
        let c = Config::default();
        assert!(c.pod_labels);
        assert_eq!(c.pod_log_dir, "/var/log/pods");
        assert_eq!(c.container_log_dir, "/var/log/containers");
        assert_eq!(c.series_retention(), Duration::from_secs(300));
        assert_eq!(c.series_limits(), Limits::default());
        let c = Config::parse(
            "pod_labels = false\npod_log_dir = \"/host/pods\"\npod_series_retention_secs = 5\n",
            "c.toml",
        )
        .expect("valid");
        assert!(!c.pod_labels && c.pods().is_none());
        assert_eq!(c.pod_log_dir, "/host/pods");
        assert_eq!(c.series_retention_secs, 5, "the old key still works");
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
            let msg = Config::parse(text, "c.toml").expect_err(text).to_string();
            assert!(msg.starts_with(want), "{text:?}: {msg}");
        }
    }

    #[test]
    fn block_inflight_timeout_default_set_and_zero_refused() {
        assert_eq!(
            Config::default().block_inflight_timeout(),
            Duration::from_secs(180)
        );
        let c = Config::parse("block_inflight_timeout_secs = 2\n", "c.toml").expect("valid");
        assert_eq!(c.block_inflight_timeout(), Duration::from_secs(2));
        let msg = Config::parse("\nblock_inflight_timeout_secs = 0\n", "c.toml")
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
        assert_eq!(c.http_header_timeout(), Duration::from_secs(10));
        assert_eq!(c.http_idle_timeout(), Duration::from_secs(90));
        assert_eq!(c.http_max_connections, 128);
        let c = Config::parse(
            "http_header_timeout_secs = 1\nhttp_idle_timeout_secs = 2\nhttp_max_connections = 8\n",
            "c.toml",
        )
        .expect("valid");
        assert_eq!(c.http_header_timeout(), Duration::from_secs(1));
        assert_eq!(c.http_idle_timeout(), Duration::from_secs(2));
        assert_eq!(c.http_max_connections, 8);
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
            let msg = Config::parse(text, "c.toml").expect_err(text).to_string();
            assert!(msg.starts_with(want), "{text:?}: {msg}");
        }
    }

    #[test]
    fn rule_without_matcher_is_refused() {
        let e = Config::parse("[[rule]]\napp = \"a\"\n", "c.toml").expect_err("no matcher");
        assert!(e.to_string().contains("at least one of"), "{e}");
    }
}
