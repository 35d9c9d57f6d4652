//! Test b: a process doing exactly N pread64 and M preadv calls is counted exactly.
mod common;

use common::{Daemon, delta};
use pgio_testkit::{LoadProcess, pgio_load_bin, require_root, temp_dir};

const PREAD64: u64 = 5_000;
const PREADV: u64 = 3_000;

#[test]
fn exact_pread64_and_preadv_counts() {
    if !require_root("exact_pread64_and_preadv_counts") {
        return;
    }
    let dir = temp_dir().expect("temp dir");
    let file = dir.path().join("data");
    std::fs::write(&file, vec![7u8; 1 << 20]).expect("data file");
    let daemon = Daemon::start(&[("test", "pread", "^pgio-load$")]).expect("daemon");
    let path = file.to_str().expect("utf-8").to_owned();
    let mut load = LoadProcess::spawn(
        &pgio_load_bin().expect("pgio-load"),
        ["pread", &path, &PREAD64.to_string(), &PREADV.to_string()],
    )
    .expect("spawn");
    daemon.wait_tracked("test", "pread");
    let before = daemon.scrape();
    assert_eq!(load.expect_run(), PREAD64 + PREADV);
    let after = daemon.scrape();
    let count = |syscall: &str| {
        delta(
            &before,
            &after,
            "pgio_syscall_seconds_count",
            &[("app", "test"), ("role", "pread"), ("syscall", syscall)],
        )
    };
    eprintln!(
        "pid {}: pread64 {}, preadv {}, preadv2 {}",
        load.pid(),
        count("pread64"),
        count("preadv"),
        count("preadv2")
    );
    assert_eq!(count("pread64"), PREAD64 as f64);
    assert_eq!(count("preadv"), PREADV as f64);
    assert_eq!(count("preadv2"), 0.0);
    // The file was just written: every read is served from the page cache.
    let hits = delta(
        &before,
        &after,
        "pgio_syscall_seconds_count",
        &[("app", "test"), ("role", "pread"), ("cache", "hit")],
    );
    assert_eq!(
        hits,
        (PREAD64 + PREADV) as f64,
        "cache=hit for page-cache reads"
    );
    daemon.stop().expect("clean daemon exit");
}
