//! A connection storm, as an attacker (`nobody`) can make one: a made-up postmaster forks
//! 4,000 children at once, each sends its title from `init_ps_display` (272 bytes on the
//! lifecycle ring while it is provisional) and then execs, with rescans every second meanwhile.
//! Every fork, title and exec event reaches pgio: `lifecycle_ring_full` stays put, each child
//! is tracked exactly once, and once they end no exit is missed.
mod common;
mod fake_postgres;

use std::io::{BufRead, BufReader, Write};
use std::time::Duration;

use common::{Daemon, delta};
use fake_postgres::start_postmaster;
use pgio_testkit::{require_root, temp_dir, wait_until};

const BURST: u32 = 4_000;

#[test]
fn a_burst_of_new_backends_loses_no_lifecycle_event() {
    if !require_root("a_burst_of_new_backends_loses_no_lifecycle_event") {
        return;
    }
    let tmp = temp_dir().expect("temp dir");
    let (_, data, postgres) = fake_postgres::setup(tmp.path());
    let daemon = Daemon::with_config("rescan_interval_secs = 1\n").expect("daemon");
    let mut postmaster =
        start_postmaster(&daemon, &postgres, &["burst", &BURST.to_string()], &data);

    let before = daemon.scrape();
    let mut stdin = postmaster.stdin.take().expect("stdin");
    stdin.write_all(b"g").expect("go");
    let mut line = String::new();
    BufReader::new(postmaster.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("the burst's count");
    assert_eq!(line.trim(), BURST.to_string(), "children forked");
    let postgres_tracked =
        |m: &pgio_testkit::Metrics| m.sum("pgio_tracked_processes", &[("app", "postgres")]);
    let all = wait_until(Duration::from_secs(20), Duration::from_millis(200), || {
        postgres_tracked(&daemon.scrape()) - postgres_tracked(&before) >= f64::from(BURST)
    });
    let during = daemon.scrape();
    // The children end with their parent's stdin; two rescans find any exit event lost.
    drop(stdin);
    let _ = postmaster.wait();
    std::thread::sleep(Duration::from_millis(2500));
    let after = daemon.scrape();

    let ring_full = delta(
        &before,
        &after,
        "pgio_events_dropped_total",
        &[("reason", "lifecycle_ring_full")],
    );
    let missed = delta(&before, &after, "pgio_exits_missed_total", &[]);
    let new = postgres_tracked(&during) - postgres_tracked(&before);
    eprintln!(
        "{BURST} children forked at once: {new} new postgres processes tracked, ring full \
         {ring_full}, exits missed {missed}, {} still tracked after they ended",
        postgres_tracked(&after) - postgres_tracked(&before) + 1.0
    );
    assert_eq!(ring_full, 0.0, "lifecycle events lost to a full ring");
    assert!(
        all && new == f64::from(BURST),
        "{new} of {BURST} children tracked"
    );
    assert_eq!(missed, 0.0, "exits pgio missed");
    daemon.stop().expect("daemon stop");
}
