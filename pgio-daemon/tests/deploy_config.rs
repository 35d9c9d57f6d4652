//! The pgio.toml that deploy/ ships (the kustomize base's file; `cargo xtask deploy-check`
//! checks that the Helm chart renders the same TOML) is one the daemon accepts, and it spells
//! out the daemon's defaults: a new or renamed key fails here, not in a cluster.
use std::path::Path;

use pgio_daemon::config::Config;

#[test]
fn deploy_config_is_accepted_and_holds_the_defaults() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/kustomize/pgio.toml");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let shipped = Config::parse(&text, &path.display().to_string())
        .unwrap_or_else(|e| panic!("the daemon rejects the shipped config: {e}"));
    let d = Config::default();
    assert_eq!(shipped.listen, d.listen, "listen");
    assert_eq!(shipped.rescan_interval_secs, d.rescan_interval_secs);
    assert_eq!(shipped.bpf_stats, d.bpf_stats);
    assert_eq!(shipped.longhorn_device_dir, d.longhorn_device_dir);
    assert_eq!(shipped.pod_labels, d.pod_labels);
    assert_eq!(shipped.pod_log_dir, d.pod_log_dir);
    assert_eq!(shipped.container_log_dir, d.container_log_dir);
    assert_eq!(shipped.series_retention_secs, d.series_retention_secs);
    assert_eq!(
        shipped.block_inflight_timeout_secs,
        d.block_inflight_timeout_secs
    );
    assert_eq!(shipped.query_probes, d.query_probes);
    assert_eq!(shipped.series_limits(), d.series_limits());
    assert_eq!(shipped.max_postgres_binaries, d.max_postgres_binaries);
    assert_eq!(shipped.http_header_timeout_secs, d.http_header_timeout_secs);
    assert_eq!(shipped.http_idle_timeout_secs, d.http_idle_timeout_secs);
    assert_eq!(shipped.http_max_connections, d.http_max_connections);
    assert!(shipped.rules.is_empty(), "no rules by default");
}
