//! Native histograms through a real Prometheus (Debian's 2.42). One server scrapes pgio as
//! before (text: classic buckets only), one with `--enable-feature=native-histograms` (it asks
//! for protobuf and stores the native histogram). Under a known load, each histogram's count
//! is the same in both (and the syscall count is the load's exactly), and `histogram_quantile`
//! over the native series agrees with the classic one within one bucket.
mod common;

use std::time::Duration;

use common::Daemon;
use pgio_testkit::{
    LoadProcess, LoopDevice, Prometheus, pgio_load_bin, require_root, rules_config, temp_dir,
    wait_until,
};

const READS: u64 = 6_000;

#[test]
fn native_histograms_agree_with_the_classic_buckets_in_prometheus() {
    if !require_root("native_histograms_agree_with_the_classic_buckets_in_prometheus") {
        return;
    }
    let dir = temp_dir().expect("temp dir");
    let lo = LoopDevice::create_written(dir.path(), 64 << 20, true).expect("loop device");
    let daemon = Daemon::with_config(&rules_config(&[("test", "direct-read", "^pgio-load$")]))
        .expect("daemon");
    let target = daemon.url().trim_start_matches("http://").to_owned();
    let classic = Prometheus::start("pgio", &[&target]).expect("prometheus");
    let native =
        Prometheus::start_with("pgio", &[&target], &["native-histograms"]).expect("prometheus");
    for p in [&classic, &native] {
        p.wait_up("pgio", Duration::from_secs(20)).expect("scraped");
    }

    let dev = lo.path().to_str().expect("utf-8 path").to_owned();
    let mut load = LoadProcess::spawn(
        &pgio_load_bin().expect("pgio-load"),
        ["direct-read", &dev, &READS.to_string(), "8192"],
    )
    .expect("spawn pgio-load");
    daemon.wait_tracked("test", "direct-read");
    // pgio-load's own setup reads, if pgio saw them.
    let setup = daemon.scrape().sum(
        "pgio_syscall_seconds_count",
        &[
            ("app", "test"),
            ("role", "direct-read"),
            ("syscall", "pread64"),
        ],
    );
    assert_eq!(load.expect_run(), READS);

    let syscall = r#"app="test",role="direct-read",syscall="pread64""#;
    let device = format!(r#"device="{}",op="read",app="test""#, lo.name());
    for (family, selector) in [
        ("pgio_syscall_seconds", syscall.to_owned()),
        ("pgio_block_io_device_seconds", device),
    ] {
        let classic_count = format!("sum({family}_count{{{selector}}})");
        let native_count = format!("histogram_count(sum({family}{{{selector}}}))");
        let value = |p: &Prometheus, q: &str| {
            p.query(q, None)
                .ok()
                .and_then(|r| r.first().map(|s| s.value))
        };
        // Both servers have scraped the finished load, and the counts stopped moving: polls
        // 1.5 s apart, so each server scraped (every 1 s) between two equal readings.
        let mut counts = (None, None);
        let settled = wait_until(Duration::from_secs(45), Duration::from_millis(1500), || {
            let now = (
                value(&classic, &classic_count),
                value(&native, &native_count),
            );
            let same = now.0.is_some() && now.0 == now.1 && now == counts;
            counts = now;
            same
        });
        let (Some(c), Some(n)) = counts else {
            panic!(
                "{family}: no counts (classic {counts:?}); native log:\n{}",
                native.log_text()
            )
        };
        assert!(settled, "{family}: classic count {c}, native count {n}");
        if family == "pgio_syscall_seconds" {
            assert_eq!(c, setup + READS as f64, "{family}: the load's reads");
        } else {
            // Block requests may be lost (issue 13), never invented.
            assert!(
                c >= READS as f64 * 0.99 && c <= READS as f64,
                "{family}: {c}"
            );
        }
        // The native server stored native histograms, not the classic series.
        assert!(
            value(&native, &classic_count).is_none(),
            "{family}: the native server has classic _count series"
        );
        for q in [0.5, 0.9, 0.99] {
            let cq = value(
                &classic,
                &format!("histogram_quantile({q}, sum by (le) ({family}_bucket{{{selector}}}))"),
            )
            .expect("classic quantile");
            let nq = value(
                &native,
                &format!("histogram_quantile({q}, sum({family}{{{selector}}}))"),
            )
            .expect("native quantile");
            let ratio = nq / cq;
            eprintln!(
                "{family} p{}: classic {cq:.9} s, native {nq:.9} s ({ratio:.3})",
                q * 100.0
            );
            // Slot k's native bucket ends at 0.93 × 2^k ns: never above the classic estimate,
            // and less than a bucket (×2) below it.
            assert!(
                (0.45..=1.0001).contains(&ratio),
                "{family} p{q}: classic {cq}, native {nq}"
            );
        }
    }
    drop((classic, native));
    daemon.stop().expect("clean daemon exit");
    lo.detach().expect("detach");
}
