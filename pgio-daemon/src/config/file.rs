//! The config file as written (every field optional, each checked value with its place)
//! and its checks: errors name the file, the line and what was expected.
use std::net::SocketAddr;

use regex::Regex;
use serde::Deserialize;
use toml::Spanned;

use super::{Config, ConfigError, MAX_SERIES_LIMIT, RuleConfig};

/// The file as written: every field optional, and where the checked values stand, for
/// `file:line:` errors.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    listen: Option<SocketAddr>,
    rescan_interval_secs: Option<Spanned<u64>>,
    bpf_stats: Option<bool>,
    longhorn_device_dir: Option<Spanned<String>>,
    pod_labels: Option<bool>,
    pod_log_dir: Option<Spanned<String>>,
    container_log_dir: Option<Spanned<String>>,
    #[serde(alias = "pod_series_retention_secs")]
    series_retention_secs: Option<Spanned<u64>>,
    max_series: Option<Spanned<u64>>,
    max_series_per_app: Option<Spanned<u64>>,
    max_series_per_group: Option<Spanned<u64>>,
    max_label_len: Option<Spanned<u64>>,
    hist_map_max_entries: Option<Spanned<u64>>,
    syscall_rows: Option<bool>,
    block_inflight_timeout_secs: Option<Spanned<u64>>,
    queries: Option<bool>,
    query_probes: Option<bool>,
    relations: Option<bool>,
    max_relations: Option<Spanned<usize>>,
    max_query_ids: Option<Spanned<usize>>,
    query_args_at_entry: Option<bool>,
    max_postgres_binaries: Option<usize>,
    http_header_timeout_secs: Option<Spanned<u64>>,
    http_idle_timeout_secs: Option<Spanned<u64>>,
    http_max_connections: Option<Spanned<usize>>,
    #[serde(default)]
    rule: Vec<RuleConfig>,
}

/// `text`, read from `path`, as a `Config`.
pub(super) fn parse(text: &str, path: &str) -> Result<Config, ConfigError> {
    let invalid = |offset: usize, message: String| ConfigError::Invalid {
        path: path.to_owned(),
        line: line_of(text, offset),
        message,
    };
    let file: File = toml::from_str(text).map_err(|e| {
        let offset = e.span().map(|s| s.start).unwrap_or(0);
        invalid(offset, e.message().to_owned())
    })?;
    for rule in &file.rule {
        if rule.comm.is_none() && rule.exe.is_none() && rule.cmdline.is_none() {
            return Err(invalid(
                rule.app.span().start,
                format!(
                    "rule for app {:?} needs at least one of `comm`, `exe`, `cmdline`",
                    rule.app.get_ref()
                ),
            ));
        }
        for r in [&rule.comm, &rule.exe, &rule.cmdline].into_iter().flatten() {
            Regex::new(r.get_ref())
                .map_err(|e| invalid(r.span().start, format!("invalid regex: {e}")))?;
        }
    }
    if let Some(s) = &file.rescan_interval_secs
        && *s.get_ref() == 0
    {
        return Err(invalid(
            s.span().start,
            "rescan_interval_secs must be at least 1".into(),
        ));
    }
    if let Some(dir) = &file.longhorn_device_dir
        && !dir.get_ref().is_empty()
        && !dir.get_ref().starts_with('/')
    {
        return Err(invalid(
            dir.span().start,
            format!(
                "longhorn_device_dir must be an absolute path (or \"\" to turn it off), not {:?}",
                dir.get_ref()
            ),
        ));
    }
    for (key, dir) in [
        ("pod_log_dir", &file.pod_log_dir),
        ("container_log_dir", &file.container_log_dir),
    ] {
        if let Some(dir) = dir
            && !dir.get_ref().starts_with('/')
        {
            return Err(invalid(
                dir.span().start,
                format!("{key} must be an absolute path, not {:?}", dir.get_ref()),
            ));
        }
    }
    for (key, secs) in [
        ("series_retention_secs", &file.series_retention_secs),
        ("max_series", &file.max_series),
        ("max_series_per_app", &file.max_series_per_app),
        ("max_series_per_group", &file.max_series_per_group),
        (
            "block_inflight_timeout_secs",
            &file.block_inflight_timeout_secs,
        ),
        ("http_header_timeout_secs", &file.http_header_timeout_secs),
        ("http_idle_timeout_secs", &file.http_idle_timeout_secs),
    ] {
        if let Some(s) = secs
            && *s.get_ref() == 0
        {
            return Err(invalid(s.span().start, format!("{key} must be at least 1")));
        }
    }
    for (key, value, range) in [
        ("max_series", &file.max_series, 1..=MAX_SERIES_LIMIT),
        ("max_label_len", &file.max_label_len, 16..=4096),
        (
            "hist_map_max_entries",
            &file.hist_map_max_entries,
            1024..=1 << 20,
        ),
    ] {
        if let Some(v) = value
            && !range.contains(v.get_ref())
        {
            return Err(invalid(
                v.span().start,
                format!(
                    "{key} must be between {} and {}, not {}",
                    range.start(),
                    range.end(),
                    v.get_ref()
                ),
            ));
        }
    }
    if let Some(n) = &file.http_max_connections
        && *n.get_ref() == 0
    {
        return Err(invalid(
            n.span().start,
            "http_max_connections must be at least 1".into(),
        ));
    }
    if let Some(n) = &file.max_relations
        && !(1..=10_000).contains(n.get_ref())
    {
        return Err(invalid(
            n.span().start,
            format!(
                "max_relations must be between 1 and 10000, not {}",
                n.get_ref()
            ),
        ));
    }
    if let Some(n) = &file.max_query_ids
        && *n.get_ref() > 1_000
    {
        return Err(invalid(
            n.span().start,
            format!(
                "max_query_ids must be between 0 (off) and 1000, not {}",
                n.get_ref()
            ),
        ));
    }
    let default = Config::default();
    let or = |v: &Option<Spanned<u64>>, d: u64| v.as_ref().map_or(d, |v| *v.get_ref());
    Ok(Config {
        listen: file.listen.unwrap_or(default.listen),
        rescan_interval_secs: file
            .rescan_interval_secs
            .map_or(default.rescan_interval_secs, Spanned::into_inner),
        bpf_stats: file.bpf_stats.unwrap_or(default.bpf_stats),
        longhorn_device_dir: file
            .longhorn_device_dir
            .map_or(default.longhorn_device_dir, Spanned::into_inner),
        pod_labels: file.pod_labels.unwrap_or(default.pod_labels),
        pod_log_dir: file
            .pod_log_dir
            .map_or(default.pod_log_dir, Spanned::into_inner),
        container_log_dir: file
            .container_log_dir
            .map_or(default.container_log_dir, Spanned::into_inner),
        series_retention_secs: or(&file.series_retention_secs, default.series_retention_secs),
        max_series: or(&file.max_series, default.max_series),
        max_series_per_app: or(&file.max_series_per_app, default.max_series_per_app),
        max_series_per_group: or(&file.max_series_per_group, default.max_series_per_group),
        max_label_len: or(&file.max_label_len, default.max_label_len),
        hist_map_max_entries: or(&file.hist_map_max_entries, default.hist_map_max_entries),
        syscall_rows: file.syscall_rows.unwrap_or(default.syscall_rows),
        possible_cpus: default.possible_cpus,
        block_inflight_timeout_secs: file
            .block_inflight_timeout_secs
            .map_or(default.block_inflight_timeout_secs, Spanned::into_inner),
        queries: file.queries.unwrap_or(default.queries),
        query_probes: file.query_probes.unwrap_or(default.query_probes),
        relations: file.relations.unwrap_or(default.relations),
        max_relations: file
            .max_relations
            .map_or(default.max_relations, Spanned::into_inner),
        max_query_ids: file
            .max_query_ids
            .map_or(default.max_query_ids, Spanned::into_inner),
        query_args_at_entry: file
            .query_args_at_entry
            .unwrap_or(default.query_args_at_entry),
        max_postgres_binaries: file
            .max_postgres_binaries
            .unwrap_or(default.max_postgres_binaries),
        rules: file.rule,
        http_header_timeout_secs: file
            .http_header_timeout_secs
            .map_or(default.http_header_timeout_secs, Spanned::into_inner),
        http_idle_timeout_secs: file
            .http_idle_timeout_secs
            .map_or(default.http_idle_timeout_secs, Spanned::into_inner),
        http_max_connections: file
            .http_max_connections
            .map_or(default.http_max_connections, Spanned::into_inner),
    })
}

fn line_of(text: &str, offset: usize) -> usize {
    text[..offset.min(text.len())].matches('\n').count() + 1
}
