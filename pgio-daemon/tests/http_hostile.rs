//! HTTP clients that connect and stall, and what pgio keeps of root:
//! - slow headers (half a request head) and silent connections are closed after
//!   `http_header_timeout_secs`; past `http_max_connections` the longest-waiting one is evicted
//!   or the new one refused, counted; the daemon's socket count stays bounded and /metrics
//!   answers during the flood; SIGTERM does not wait for stalled clients;
//! - an idle keep-alive connection outlives the header time-out and is closed after
//!   `http_idle_timeout_secs`;
//! - /healthz says 503 with the reason when pgio is out of file descriptors, and 200 while an
//!   attacker holds more connections than pgio may have fds (the cap keeps pgio's bounded);
//! - after start, every thread of the daemon holds exactly the capabilities it still needs,
//!   and a PostgreSQL started afterwards still gets its uprobe and its labels.
mod common;

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::Daemon;
use pgio_testkit::{
    PgCluster, PgOptions,
    fake::{Fake, compile},
    metrics::http_get,
    pg_bin_dir, require_root, temp_dir, wait_until,
};

/// Sockets among the daemon's fds (uprobe links of other tests' binaries come and go).
fn sockets(pid: u32) -> usize {
    // TCP only: each tokio runtime with IO dups the signal driver's unix socket, and the
    // discovery thread's runtime may start after the count before the flood (measured in CI:
    // 4 sockets before, 5 after).
    let tcp: std::collections::HashSet<String> = ["tcp", "tcp6"]
        .iter()
        .filter_map(|t| std::fs::read_to_string(format!("/proc/{pid}/net/{t}")).ok())
        .flat_map(|table| {
            table
                .lines()
                .skip(1)
                .filter_map(|l| l.split_whitespace().nth(9).map(str::to_owned))
                .collect::<Vec<_>>()
        })
        .collect();
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| {
            d.filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
                .filter_map(|l| {
                    let l = l.to_string_lossy().into_owned();
                    Some(l.strip_prefix("socket:[")?.strip_suffix(']')?.to_owned())
                })
                .filter(|inode| tcp.contains(inode))
                .count()
        })
        .unwrap_or(0)
}

fn addr(daemon: &Daemon) -> String {
    daemon.url().trim_start_matches("http://").to_owned()
}

/// Whether the peer closed `s`: EOF or reset within `wait`; still open if the read times out.
fn closed_by_peer(s: &mut TcpStream, wait: Duration) -> bool {
    s.set_read_timeout(Some(wait)).expect("read timeout");
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return false;
            }
            Err(_) => return true,
        }
    }
}

fn counter(daemon: &Daemon, name: &str, labels: &[(&str, &str)]) -> f64 {
    daemon.scrape().sum(name, labels)
}

const SLOW: usize = 300;
const SILENT: usize = 10;
const CAP: usize = 32;

#[test]
fn slow_clients_are_cut_and_bounded() {
    if !require_root("slow_clients_are_cut_and_bounded") {
        return;
    }
    let daemon = Daemon::with_config(&format!(
        "http_header_timeout_secs = 3\nhttp_idle_timeout_secs = 60\nhttp_max_connections = {CAP}\n"
    ))
    .expect("daemon");
    let pid = daemon.0.pid();
    let addr = addr(&daemon);
    let before = sockets(pid);
    assert!(
        before >= 1,
        "pgio's listening socket not found among its TCP sockets"
    );

    let start = Instant::now();
    let mut attackers = Vec::new();
    for i in 0..SLOW + SILENT {
        let mut s = TcpStream::connect(&addr).expect("connect");
        if i < SLOW {
            s.write_all(b"GET /metrics HTTP/1.1\r\nHost: pgio\r\nAccept: text/pl")
                .expect("half a head");
        }
        attackers.push(s);
    }
    let opened = start.elapsed();
    // Let the daemon accept what is still in its backlog.
    std::thread::sleep(Duration::from_millis(300));
    let during = sockets(pid);
    let t = Instant::now();
    let body = http_get(&format!("{}/metrics", daemon.url()), Duration::from_secs(2))
        .expect("/metrics during the flood");
    let scrape_time = t.elapsed();
    let m = daemon.scrape();
    let evicted = m.sum(
        "pgio_http_connections_closed_total",
        &[("reason", "evicted")],
    );
    let rejected = m.sum("pgio_http_connections_rejected_total", &[]);
    eprintln!(
        "{} connections opened in {opened:?}; daemon sockets {before} before, {during} during; \
         /metrics in {scrape_time:?}; evicted {evicted}, rejected {rejected}",
        SLOW + SILENT
    );
    assert!(
        during <= before + CAP + 1,
        "{during} sockets during the flood (cap {CAP}, {before} before)"
    );
    assert!(scrape_time < Duration::from_secs(1), "{scrape_time:?}");
    assert!(body.contains("pgio_http_connections_rejected_total"));
    // Every connection past the cap was evicted or refused (the scrapes evicted a few more).
    let past_cap = (SLOW + SILENT - CAP) as f64;
    assert!(
        evicted + rejected >= past_cap && evicted + rejected <= past_cap + 3.0,
        "evicted {evicted} + rejected {rejected}, want {past_cap} (+ the scrapes)"
    );
    assert!(rejected >= 1.0 || evicted >= past_cap);

    // The header time-out closes the rest: every attacker socket sees EOF.
    let all_closed = wait_until(Duration::from_secs(6), Duration::from_millis(100), || {
        attackers
            .iter_mut()
            .all(|s| closed_by_peer(s, Duration::from_millis(1)))
    });
    let waited = start.elapsed();
    // A scrape's connection closes on the daemon's side a moment after the client read it.
    wait_until(Duration::from_secs(3), Duration::from_millis(20), || {
        sockets(pid) <= before
    });
    let after = sockets(pid);
    let timeouts = counter(
        &daemon,
        "pgio_http_connections_closed_total",
        &[("reason", "header_timeout")],
    );
    eprintln!(
        "all closed {all_closed} after {waited:?}; sockets {after}; header time-outs {timeouts}"
    );
    assert!(
        all_closed,
        "connections still open {waited:?} after the flood"
    );
    assert!(after <= before, "{after} sockets after, {before} before");
    assert!(
        (1.0..=CAP as f64).contains(&timeouts),
        "{timeouts} header time-outs"
    );
    drop(attackers);

    // SIGTERM with stalled clients connected: no waiting for them.
    let stalled: Vec<TcpStream> = (0..10)
        .map(|_| {
            let mut s = TcpStream::connect(&addr).expect("connect");
            s.write_all(b"GET / HTTP/1.1\r\n").expect("write");
            s
        })
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    let t = Instant::now();
    // SAFETY: signalling our own child.
    unsafe { libc::kill(pid as libc::pid_t, libc::SIGTERM) };
    // Logged once the HTTP server has returned (tearing the probes down comes after).
    let served = wait_until(Duration::from_secs(10), Duration::from_millis(10), || {
        daemon.0.log_text().contains("HTTP server done")
    });
    let took = t.elapsed();
    let log = daemon.0.log_text();
    eprintln!("SIGTERM with 10 stalled clients: HTTP server done in {took:?}");
    assert!(
        served,
        "HTTP server still running 10 s after SIGTERM:\n{log}"
    );
    assert!(took < Duration::from_secs(2), "{took:?}");
    assert!(!log.contains("requests still running"), "{log}");
    daemon.stop().expect("stop");
    drop(stalled);
}

#[test]
fn idle_keepalive_outlives_the_header_timeout_then_closes() {
    if !require_root("idle_keepalive_outlives_the_header_timeout_then_closes") {
        return;
    }
    let daemon = Daemon::with_config("http_header_timeout_secs = 1\nhttp_idle_timeout_secs = 3\n")
        .expect("daemon");
    let mut s = TcpStream::connect(addr(&daemon)).expect("connect");
    // The daemon's idle time starts when it has sent the response: after this, and before
    // this side has read it all (`served`).
    let sent = Instant::now();
    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: pgio\r\n\r\n")
        .expect("request");
    let mut got = Vec::new();
    s.set_read_timeout(Some(Duration::from_secs(2)))
        .expect("timeout");
    let mut buf = [0u8; 1024];
    while !got.ends_with(b"ok\n") {
        let n = s.read(&mut buf).expect("response");
        assert!(n > 0, "closed before the response");
        got.extend_from_slice(&buf[..n]);
    }
    assert!(got.starts_with(b"HTTP/1.1 200"), "{got:?}");
    let served = Instant::now();
    // Past the header time-out (1 s), still open: idle is not a slow header.
    assert!(
        !closed_by_peer(&mut s, Duration::from_millis(2000)),
        "closed {:?} after the response",
        served.elapsed()
    );
    assert!(
        closed_by_peer(&mut s, Duration::from_millis(2500)),
        "still open {:?} after the response",
        served.elapsed()
    );
    let (closed_after, since_sent) = (served.elapsed(), sent.elapsed());
    eprintln!(
        "idle connection closed {closed_after:?} after its response was read, {since_sent:?} \
         after the request was sent"
    );
    // CI once read 2.9994 s from `served`: the response left the daemon 0.6 ms before.
    assert!(
        since_sent >= Duration::from_secs(3) && closed_after < Duration::from_millis(4500),
        "{since_sent:?} after the request, {closed_after:?} after the response"
    );
    assert_eq!(
        counter(
            &daemon,
            "pgio_http_connections_closed_total",
            &[("reason", "idle_timeout")]
        ),
        1.0
    );
    daemon.stop().expect("stop");
}

/// GET /healthz on an open keep-alive connection: (status line, body).
fn healthz_on(s: &mut TcpStream) -> (String, String) {
    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: pgio\r\n\r\n")
        .expect("request");
    s.set_read_timeout(Some(Duration::from_secs(2)))
        .expect("timeout");
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    loop {
        let n = s.read(&mut buf).expect("response");
        assert!(n > 0, "closed before the response");
        got.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&got).into_owned();
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length: "))
                .and_then(|v| v.trim().parse().ok())
                .expect("content-length");
            if body.len() >= len {
                let status = head.lines().next().unwrap_or_default().to_owned();
                return (status, body.to_owned());
            }
        }
    }
}

fn set_nofile(pid: u32, soft: u64) -> u64 {
    let old = nofile(pid);
    let new = libc::rlimit {
        rlim_cur: soft,
        rlim_max: old.rlim_max,
    };
    // SAFETY: lowering or restoring our child's soft limit.
    let r = unsafe {
        libc::prlimit(
            pid as libc::pid_t,
            libc::RLIMIT_NOFILE,
            &new,
            std::ptr::null_mut(),
        )
    };
    assert_eq!(r, 0, "prlimit: {}", std::io::Error::last_os_error());
    old.rlim_cur
}

/// RLIMIT_NOFILE of `pid` (0: this process).
fn nofile(pid: u32) -> libc::rlimit {
    let mut old = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: reading our child's limit.
    let r = unsafe {
        libc::prlimit(
            pid as libc::pid_t,
            libc::RLIMIT_NOFILE,
            std::ptr::null(),
            &mut old,
        )
    };
    assert_eq!(r, 0, "prlimit: {}", std::io::Error::last_os_error());
    old
}

#[test]
fn healthz_fails_when_pgio_is_out_of_file_descriptors() {
    if !require_root("healthz_fails_when_pgio_is_out_of_file_descriptors") {
        return;
    }
    let daemon = Daemon::with_config("").expect("daemon");
    let pid = daemon.0.pid();
    let mut s = TcpStream::connect(addr(&daemon)).expect("connect");
    let (status, body) = healthz_on(&mut s);
    assert!(status.starts_with("HTTP/1.1 200"), "{status} {body}");
    assert_eq!(body, "ok\n");
    // No new fd can be opened (0, 1, 2 are taken): the state the check reached.
    let soft = set_nofile(pid, 3);
    let (status, body) = healthz_on(&mut s);
    set_nofile(pid, soft);
    eprintln!("out of fds: {status} {body:?}");
    assert!(status.starts_with("HTTP/1.1 503"), "{status} {body}");
    assert!(
        body.starts_with("cannot read /proc/1/stat: Too many open files") && body.ends_with('\n'),
        "{body:?}"
    );
    assert_eq!(body.lines().count(), 1, "{body:?}");
    let (status, body) = healthz_on(&mut s);
    assert!(status.starts_with("HTTP/1.1 200"), "{status} {body}");
    daemon.stop().expect("stop");
}

/// pgio's fd limit for the test: what it raises its soft limit to on this host (the hard
/// limit), at most. An attacker must hold more connections than this to exhaust pgio's fds
/// through HTTP.
const PGIO_NOFILE: u64 = 20_000;
const HTTP_CAP: usize = 128;

/// More connections than pgio may have file descriptors, held by attackers as `nobody` (one
/// process may not hold that many either): the connection cap closes all but `HTTP_CAP` of
/// them, so pgio's sockets stay bounded, /healthz on a new connection answers 200 during the
/// flood, and every socket is given back once the attackers let go.
#[test]
fn healthz_answers_while_connections_outnumber_pgio_fds() {
    if !require_root("healthz_answers_while_connections_outnumber_pgio_fds") {
        return;
    }
    let tmp = temp_dir().expect("temp dir");
    std::fs::set_permissions(
        tmp.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .expect("chmod temp dir");
    let holder = compile(tmp.path(), "holder").expect("cc");

    let daemon =
        Daemon::with_config(&format!("http_max_connections = {HTTP_CAP}\n")).expect("daemon");
    let pid = daemon.0.pid();
    let limit = PGIO_NOFILE.min(nofile(pid).rlim_max);
    set_nofile(pid, limit);
    let attackers = limit as usize + 1_000;
    // Each attacker holds as many as its own fd limit (ours, inherited) lets it.
    let per_holder = (nofile(0).rlim_cur as usize).saturating_sub(16).max(1_000);
    let holders_n = attackers.div_ceil(per_holder).max(2);
    let addr = addr(&daemon);
    let before = sockets(pid);
    assert!(
        before >= 1,
        "pgio's listening socket not found among its TCP sockets"
    );

    let start = Instant::now();
    let each = (attackers / holders_n + 1).to_string();
    let mut holders: Vec<Fake> = (0..holders_n)
        .map(|_| {
            Fake::start(
                &holder,
                "holder",
                &[],
                tmp.path(),
                &[("FAKE_CONNECT", &addr), ("FAKE_CONNECTIONS", &each)],
            )
            .expect("attacker")
        })
        .collect();
    let held: usize = holders
        .iter_mut()
        .map(|h| h.line().expect("count").parse::<usize>().expect("a count"))
        .sum();
    let opened = start.elapsed();
    std::thread::sleep(Duration::from_millis(500));
    let during = sockets(pid);
    let t = Instant::now();
    let mut s = TcpStream::connect(&addr).expect("connect for /healthz");
    let (status, body) = healthz_on(&mut s);
    let healthz_time = t.elapsed();
    drop(s);
    // Every connection past the cap is closed or refused: evicted, or, while the attackers
    // are slow to open the rest, closed at the header time-out first (CI: 20,668 and 20,682
    // evicted or refused of 20,874). The attackers took 46-106 s for 21,002 while pgio's
    // explicit addresses had std's backlog of 128 (each SYN dropped is a 1 s retransmit),
    // 6-11 s with 1,024.
    let closed_now = || {
        let m = daemon.scrape();
        m.sum("pgio_http_connections_closed_total", &[])
            + m.sum("pgio_http_connections_rejected_total", &[])
    };
    let past_cap = held.saturating_sub(HTTP_CAP) as f64;
    wait_until(Duration::from_secs(10), Duration::from_millis(100), || {
        closed_now() >= past_cap
    });
    let closed = closed_now();
    eprintln!(
        "{held} connections established by {holders_n} attackers in {opened:?} (pgio's limit \
         {limit} fds); pgio's sockets {before} before, {during} during; /healthz \
         {status:?} in {healthz_time:?}; {closed} closed or refused"
    );
    assert!(
        held > limit as usize,
        "only {held} connections established: not more than pgio's {limit} fds"
    );
    assert!(
        during <= before + HTTP_CAP + 1,
        "{during} sockets during the flood (cap {HTTP_CAP}, {before} before)"
    );
    assert!(status.starts_with("HTTP/1.1 200"), "{status} {body}");
    assert_eq!(body, "ok\n");
    assert!(healthz_time < Duration::from_secs(2), "{healthz_time:?}");
    assert!(
        closed >= (held - HTTP_CAP) as f64,
        "{closed} connections closed or refused of {} past the cap",
        held - HTTP_CAP
    );

    for h in &mut holders {
        h.end();
    }
    let back = wait_until(Duration::from_secs(5), Duration::from_millis(100), || {
        sockets(pid) <= before
    });
    let after = sockets(pid);
    assert!(
        back,
        "pgio holds {after} sockets after the flood, {before} before"
    );
    daemon.stop().expect("stop");
}

/// CAP_DAC_READ_SEARCH, CAP_SYS_PTRACE, CAP_PERFMON, CAP_BPF, and CAP_SYS_ADMIN where the
/// kernel wants it for uprobes (6.16 and its stable backports, deploy/CAPABILITIES.md).
fn expected_caps() -> u64 {
    let mut caps = 1 << 2 | 1 << 19 | 1 << 38 | 1 << 39;
    if pgio_testkit::kernel_version() >= (6, 16) {
        caps |= 1 << 21;
    }
    caps
}

fn status_field(status: &str, name: &str) -> u64 {
    status
        .lines()
        .find_map(|l| l.strip_prefix(name))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .unwrap_or_else(|| panic!("{name} missing:\n{status}"))
}

#[test]
fn capabilities_are_dropped_and_uprobes_still_attach() {
    if !require_root("capabilities_are_dropped_and_uprobes_still_attach") {
        return;
    }
    let bin = pg_bin_dir(15).expect("PostgreSQL 15");
    let dir = temp_dir().expect("temp dir");
    let data = dir.path().join("data");
    let mut pg = PgCluster::init_with(PgOptions::new(&bin, &data, 56_620)).expect("initdb");
    let daemon = Daemon::with_config("").expect("daemon");
    let pid = daemon.0.pid();
    let want = expected_caps();
    let mut threads = 0;
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).expect("tasks") {
        let task = task.expect("task").path();
        let status = std::fs::read_to_string(task.join("status")).expect("status");
        for (field, expected) in [
            ("CapEff:", want),
            ("CapPrm:", want),
            ("CapBnd:", want),
            ("CapInh:", 0),
            ("CapAmb:", 0),
            ("NoNewPrivs:", 1),
        ] {
            let got = status_field(&status, field);
            assert_eq!(
                got,
                expected,
                "{} {field} {got:016x}, want {expected:016x}",
                task.display()
            );
        }
        threads += 1;
    }
    eprintln!("{threads} threads, each with capabilities {want:016x}");
    assert!(
        threads >= 3,
        "runtime workers and the fold thread: {threads}"
    );

    // Started after the drop: the uprobe is attached now, and the labels need /proc of the
    // postgres user's processes and its 0700 data directory.
    pg.start().expect("start");
    daemon.wait_tracked("postgres", "postmaster");
    let cluster = std::fs::canonicalize(&data).expect("data directory");
    let cluster = cluster.to_str().expect("UTF-8");
    let labelled = wait_until(Duration::from_secs(10), Duration::from_millis(100), || {
        daemon.scrape().sum(
            "pgio_tracked_processes",
            &[("role", "checkpointer"), ("pg_cluster", cluster)],
        ) >= 1.0
    });
    let log = daemon.0.log_text();
    let binary = std::fs::canonicalize(bin.join("postgres")).expect("postgres binary");
    assert!(
        log.lines().any(|l| l.contains("uprobe attached")
            && l.contains("init_ps_display")
            && l.contains(binary.to_str().expect("UTF-8"))),
        "no uprobe attached to {}:\n{log}",
        binary.display()
    );
    assert!(labelled, "no checkpointer with cluster={cluster}:\n{log}");
    assert!(!log.contains("WARN pgio_daemon::privileges"), "{log}");
    daemon.stop().expect("stop");
    pg.stop().expect("pg stop");
}
