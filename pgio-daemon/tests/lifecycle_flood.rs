//! A fake postmaster run by `nobody` whose children call `init_ps_display` in a loop while
//! they are provisional (a postmaster's fresh children are) cannot flood the lifecycle ring:
//! each process sends at most two titles, the rest is counted as
//! `pgio_events_dropped_total{reason="title_over_budget"}`, no event is lost to a full ring
//! (`lifecycle_ring_full` stays put) and the fork/exit events of a tracked process forking
//! alongside all arrive (`pgio_exits_missed_total` stays put after two rescans).
mod common;
mod fake_postgres;

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{Daemon, delta};
use fake_postgres::{NOBODY, copy_as, start_postmaster};
use pgio_testkit::{require_root, temp_dir};

const DROPPED: &str = "pgio_events_dropped_total";
/// Children of the fake postmaster, one after another, each calling `init_ps_display` for
/// `FLOOD_SECS` (pgio gives up waiting for a child's title after 2 s: it stays provisional
/// that long).
const FLOOD_CHILDREN: u32 = 4;
const FLOOD_SECS: f64 = 1.5;
/// Forks of the tracked process meanwhile.
const CHURN: u32 = 5_000;

#[test]
fn titles_in_a_loop_neither_fill_the_ring_nor_hide_forks_and_exits() {
    if !require_root("titles_in_a_loop_neither_fill_the_ring_nor_hide_forks_and_exits") {
        return;
    }
    let tmp = temp_dir().expect("temp dir");
    let (fake, data, postgres) = fake_postgres::setup(tmp.path());
    let churn = copy_as(&fake, &tmp.path().join("churn"), "pgio-churn", NOBODY);

    let daemon = Daemon::with_config(
        "rescan_interval_secs = 1\n\
         [[rule]]\napp = \"churn\"\nrole = \"driver\"\ncomm = \"^pgio-churn$\"\n",
    )
    .expect("daemon");
    let mut postmaster = start_postmaster(
        &daemon,
        &postgres,
        &[
            "flood",
            &FLOOD_SECS.to_string(),
            &FLOOD_CHILDREN.to_string(),
        ],
        &data,
    );

    let before = daemon.scrape();
    let churner = Command::new(&churn)
        .args(["churn", &CHURN.to_string()])
        .stdout(Stdio::piped())
        .spawn()
        .expect("churn");
    postmaster
        .stdin
        .take()
        .expect("stdin")
        .write_all(b"g")
        .expect("go");
    let flood = postmaster.wait_with_output().expect("fake postmaster");
    let churned = churner.wait_with_output().expect("churn");
    assert!(flood.status.success() && churned.status.success());
    let calls: u64 = String::from_utf8_lossy(&flood.stdout)
        .trim()
        .parse()
        .expect("calls");
    // Two rescans: a fork or exit event lost shows up as a missed exit by then.
    std::thread::sleep(Duration::from_millis(2500));
    let after = daemon.scrape();

    let ring_full = delta(
        &before,
        &after,
        DROPPED,
        &[("reason", "lifecycle_ring_full")],
    );
    let over_budget = delta(&before, &after, DROPPED, &[("reason", "title_over_budget")]);
    let missed = delta(&before, &after, "pgio_exits_missed_total", &[]);
    let churn_left = after.sum("pgio_tracked_processes", &[("app", "churn")]);
    eprintln!(
        "{calls} init_ps_display calls by {FLOOD_CHILDREN} children, {CHURN} forks: \
         ring full {ring_full}, over budget {over_budget}, exits missed {missed}, \
         churn processes still tracked {churn_left}"
    );
    assert_eq!(ring_full, 0.0, "lifecycle events lost to a full ring");
    assert_eq!(missed, 0.0, "exits pgio missed");
    assert_eq!(
        churn_left, 0.0,
        "churn processes still tracked after they exited"
    );
    // Each child sends two titles, the rest is counted: all its calls fall while it is
    // provisional (pgio gives up on its title only 2 s after its fork).
    assert_eq!(
        over_budget,
        (calls - 2 * u64::from(FLOOD_CHILDREN)) as f64,
        "titles counted over budget of {calls} calls"
    );
    daemon.stop().expect("daemon stop");
}
