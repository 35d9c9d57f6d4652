//! Query boundaries from the client socket, case by case, on real PostgreSQL (Debian's 15,
//! PyPI's 17 and 18), with pgio's default config (no uprobes). Each case's count is exact:
//! - plain connections, over the unix socket and TCP: one query per ReadyForQuery, which is
//!   what the client's libpq waits for (pgbench's transactions, psql's commands). A
//!   connection's start-up is not a query (`pgbench -C`); a backend connected before pgio
//!   started is timed from its next request; a multi-statement simple query is one; a
//!   pipeline up to its Sync is one, each `\syncpipeline` one more (17+); COPY in and out is
//!   one each; a cancelled query is one; time idle in a transaction is in no query; pg_dump
//!   books one per Query message the server logs (`log_statement = all`);
//! - TLS connections (`sslmode=require`, a certificate made here): one cycle per
//!   request/response, plus the connection's start-up cycles after the handshake (one with
//!   `trust`, or two where the server sends TLS 1.3 session tickets and the client's bytes
//!   come in between: timing, so bounded, not exact), each connection counted in
//!   `pgio_query_encrypted_connections_total`; a pipeline with two Syncs is two cycles or one
//!   flagged in `pgio_query_multi_send_total`;
//! - a walsender's replication commands are not queries of any series.
//!
//! On kernels >= 5.15 the socket calls' exits read their arguments from the saved registers;
//! `pg15_query_protocols_args_at_entry` runs the same cases on the path of older kernels,
//! where `sys_enter_*` programs keep them (`query_args_at_entry = true`).
mod common;

use std::{path::PathBuf, process::Stdio, time::Duration};

use common::{Daemon, delta, delta_by, losses};
use pgio_testkit::{
    Metrics, PgCluster, PgOptions, PsqlSession, pg_bin_dir, require_root, temp_dir, wait_until,
};

const DB: &str = "pdb";

struct Case {
    pg: PgCluster,
    daemon: Option<Daemon>,
    cluster: String,
    major: u32,
    _dir: pgio_testkit::TempDir,
}

impl Case {
    fn daemon(&self) -> &Daemon {
        self.daemon.as_ref().expect("daemon")
    }

    fn labels<'a>(&'a self, wire: &'a str) -> [(&'a str, &'a str); 5] {
        [
            ("role", "client backend"),
            ("database", DB),
            ("user", "postgres"),
            ("pg_cluster", &self.cluster),
            ("wire", wire),
        ]
    }

    fn count(&self, m: &Metrics, wire: &str) -> f64 {
        m.sum("pgio_query_seconds_count", &self.labels(wire))
    }

    /// Waits until the `wire` count grew by `want` since `before` and then holds 300 ms (more
    /// would show up too); returns the scrape.
    fn settle(&self, before: &Metrics, wire: &str, want: f64) -> Metrics {
        wait_until(Duration::from_secs(20), Duration::from_millis(100), || {
            self.count(&self.daemon().scrape(), wire) - self.count(before, wire) >= want
        });
        std::thread::sleep(Duration::from_millis(300));
        self.daemon().scrape()
    }

    /// Runs `f`, then asserts that exactly `want` plain queries were booked on DB, none
    /// encrypted.
    fn expect_plain(&self, what: &str, want: f64, f: impl FnOnce()) -> Metrics {
        let before = self.daemon().scrape();
        f();
        let after = self.settle(&before, "plain", want);
        let got = self.count(&after, "plain") - self.count(&before, "plain");
        eprintln!(
            "PostgreSQL {}: {what}: {got} queries (want {want})",
            self.major
        );
        if got != want {
            // Where the cluster's queries went in the window (a query booked under another
            // role, database or wire shows here; one booked nowhere does not).
            let by = delta_by(
                &before,
                &after,
                "pgio_query_seconds_count",
                &[("pg_cluster", &self.cluster)],
                &["role", "database", "user", "wire"],
            );
            eprintln!(
                "PostgreSQL {}: {what}: the cluster's queries by series {by:?}; provisional \
                 processes {}; {}",
                self.major,
                after.sum("pgio_provisional_processes", &[]),
                losses(&before, &after)
            );
        }
        assert_eq!(got, want, "PostgreSQL {}: {what}", self.major);
        assert_eq!(
            self.count(&after, "encrypted") - self.count(&before, "encrypted"),
            0.0,
            "{what}: nothing encrypted"
        );
        after
    }

    /// A psql session on DB whose first query pgio has counted: nothing of its start is
    /// left to fall into the next window.
    fn warm_session(&self) -> PsqlSession {
        let before = self.daemon().scrape();
        let mut session = self.pg.session(DB, "postgres").expect("session");
        session.send("SELECT 1;").expect("send");
        let counted = wait_until(Duration::from_secs(20), Duration::from_millis(50), || {
            self.count(&self.daemon().scrape(), "plain") - self.count(&before, "plain") >= 1.0
        });
        assert!(counted, "the session's first query was not counted");
        session
    }

    /// pgbench as the OS user with `args` (connection options included); its transactions.
    fn pgbench(&self, args: &[&str], env: &[(&str, &str)]) -> f64 {
        let mut c = self.pg.as_os_user("pgbench");
        c.args(["-n", "-p", &self.pg.port().to_string()]).args(args);
        for (k, v) in env {
            c.env(k, v);
        }
        let out = c.output().expect("pgbench");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "pgbench {args:?}: {stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        stdout
            .lines()
            .find_map(|l| l.strip_prefix("number of transactions actually processed: "))
            .and_then(|v| v.split('/').next()?.trim().parse().ok())
            .unwrap_or_else(|| panic!("no transaction count in {stdout}"))
    }

    fn script(&self, name: &str, body: &str) -> String {
        let path = self.pg.socket_dir().join(name);
        std::fs::write(&path, body).expect("script");
        path.to_string_lossy().into_owned()
    }

    fn socket(&self) -> String {
        self.pg.socket_dir().to_string_lossy().into_owned()
    }

    /// `psql -c sql` on DB over the unix socket, `stdin` as its input.
    fn psql_c(&self, sql: &str, stdin: &str) -> String {
        use std::io::Write;
        let mut c = self.pg.as_os_user("psql");
        c.args(["-X", "-q", "-v", "ON_ERROR_STOP=1", "-h", &self.socket()])
            .args(["-p", &self.pg.port().to_string(), "-d", DB, "-c", sql])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped());
        let mut child = c.spawn().expect("psql");
        let mut input = child.stdin.take().expect("stdin");
        input.write_all(stdin.as_bytes()).expect("psql input");
        drop(input);
        let out = child.wait_with_output().expect("psql");
        assert!(out.status.success(), "psql -c {sql}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

/// A self-signed certificate and key in the data directory, owned by the server's OS user.
fn make_certificate(pg: &PgCluster) {
    let dir: PathBuf = pg.data_dir().to_path_buf();
    let (crt, key) = (dir.join("server.crt"), dir.join("server.key"));
    let st = std::process::Command::new("openssl")
        .args([
            "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
        ])
        .args(["-subj", "/CN=localhost", "-keyout"])
        .arg(&key)
        .arg("-out")
        .arg(&crt)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("openssl");
    assert!(st.success(), "openssl req");
    let (uid, gid) = pg.os_user_ids();
    for f in [&crt, &key] {
        std::os::unix::fs::chown(f, Some(uid), Some(gid)).expect("chown");
    }
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).expect("chmod");
}

fn protocols(major: u32, port: u16, config: &str) {
    if !require_root(&format!("pg{major}_query_protocols")) {
        return;
    }
    let bin = pg_bin_dir(major).unwrap_or_else(|e| panic!("PostgreSQL {major}: {e:#}"));
    let dir = temp_dir().expect("temp dir");
    let data = dir.path().join("data");
    let opts = PgOptions::new(&bin, &data, port)
        .setting("listen_addresses", "'127.0.0.1'")
        .setting("ssl", "on")
        // pg_dump's Query messages, one log line each, by application name.
        .setting("log_statement", "'all'")
        .setting("log_line_prefix", "'%m [%p] %a: '");
    let mut pg = PgCluster::init_with(opts).expect("initdb");
    make_certificate(&pg);
    pg.start().expect("start");
    pg.psql(&format!("CREATE DATABASE {DB}")).expect("database");
    let mut c = Case {
        cluster: data.display().to_string(),
        pg,
        daemon: None,
        major,
        _dir: dir,
    };
    c.psql_c("CREATE TABLE t (i int, s text)", "");

    // A backend connected before pgio started: timed from its next request on.
    let mut early = c.pg.session(DB, "postgres").expect("session");
    early.send("SELECT 1;").expect("send");
    assert!(
        wait_until(Duration::from_secs(20), Duration::from_millis(50), || {
            c.pg.psql(&format!(
                "select count(*) from pg_stat_activity where datname = '{DB}' \
                 and state = 'idle' and query = 'SELECT 1;'"
            ))
            .is_ok_and(|n| n == "1")
        }),
        "the early session's first query did not finish"
    );
    c.daemon = Some(Daemon::with_config(config).expect("daemon"));
    c.daemon().wait_tracked("postgres", "postmaster");
    assert_socket_path(c.daemon(), config);
    assert!(
        wait_until(Duration::from_secs(10), Duration::from_millis(50), || {
            c.daemon()
                .scrape()
                .sum("pgio_tracked_processes", &c.labels("")[..4])
                >= 1.0
        }),
        "the early session's backend is not tracked"
    );
    c.expect_plain("5 statements of a backend older than pgio", 5.0, || {
        for _ in 0..5 {
            early.send("SELECT 1;").expect("send");
        }
    });
    drop(early);

    let select = c.script("select.sql", "SELECT 1;\n");
    let socket = c.socket();
    // pgbench -C: a new connection per transaction; no start-up is a query. 200: a look that
    // caught a title half written once lost about 1 connection's query in 1,000.
    c.expect_plain("pgbench -C, 200 connections", 200.0, || {
        let n = c.pgbench(
            &[
                "-h", &socket, "-C", "-c", "1", "-t", "200", "-f", &select, DB,
            ],
            &[],
        );
        assert_eq!(n, 200.0);
    });
    // Every protocol over TCP.
    for mode in ["simple", "extended", "prepared"] {
        let prepares = if mode == "prepared" { 2.0 } else { 0.0 };
        c.expect_plain(&format!("TCP -M {mode}"), 200.0 + prepares, || {
            let args = [
                "-h",
                "127.0.0.1",
                "-M",
                mode,
                "-c",
                "2",
                "-t",
                "100",
                "-f",
                &select,
                DB,
            ];
            assert_eq!(c.pgbench(&args, &[("PGSSLMODE", "disable")]), 200.0);
        });
    }
    c.expect_plain("3 statements in one simple Query, 3 times", 3.0, || {
        for _ in 0..3 {
            c.psql_c("SELECT 1; SELECT 2; SELECT 3", "");
        }
    });
    let rows: String = (0..5000).map(|i| format!("{i}\tx{i}\n")).collect();
    c.expect_plain("COPY FROM STDIN", 1.0, || {
        c.psql_c("COPY t FROM STDIN", &format!("{rows}\\.\n"));
    });
    c.expect_plain("COPY TO STDOUT", 1.0, || {
        let out = c.psql_c("COPY t TO STDOUT", "");
        assert_eq!(out.lines().count(), 5000);
    });
    // Idle in transaction: 4 queries, and the 0.5 s between them is in none.
    let mut session = c.warm_session();
    let before = c.daemon().scrape();
    let after = c.expect_plain("BEGIN, SELECT, (idle 0.5 s), SELECT, COMMIT", 4.0, || {
        session.send("BEGIN;").expect("send");
        session.send("SELECT 1;").expect("send");
        std::thread::sleep(Duration::from_millis(500));
        session.send("SELECT 2;").expect("send");
        session.send("COMMIT;").expect("send");
    });
    drop(session);
    // The window's 4 only (the run's other queries may take longer under load).
    let short = |m: &Metrics| {
        let h = m
            .histogram("pgio_query_seconds", &c.labels("plain"))
            .expect("histogram");
        (h.count_le(0.268435456), h.count)
    };
    let ((short_before, all_before), (short_after, all_after)) = (short(&before), short(&after));
    assert_eq!(
        short_after - short_before,
        all_after - all_before,
        "no query holds the idle 0.5 s"
    );
    // A cancelled query is a query: active until its error is reported.
    let mut session = c.warm_session();
    let after = c.expect_plain("pg_sleep(30) cancelled", 1.0, || {
        session.send("SELECT pg_sleep(30);").expect("send");
        let pid = wait_for_active(&c.pg);
        c.pg.psql(&format!("select pg_cancel_backend({pid})"))
            .expect("cancel");
    });
    drop(session);
    let h = after
        .histogram("pgio_query_seconds", &c.labels("plain"))
        .expect("histogram");
    assert!(
        h.sum < 30.0,
        "the cancelled query did not run 30 s: {} s",
        h.sum
    );
    // pg_dump: one query per Query message it sends (the server logs each).
    let statements = || {
        std::fs::read_to_string(c.pg.log_file())
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains("] pg_dump: LOG:  statement: "))
            .count() as f64
    };
    let logged = statements();
    let before = c.daemon().scrape();
    let mut dump = c.pg.as_os_user("pg_dump");
    dump.args([
        "-h",
        &socket,
        "-p",
        &c.pg.port().to_string(),
        "-f",
        "/dev/null",
        DB,
    ]);
    assert!(dump.status().expect("pg_dump").success(), "pg_dump");
    let messages = statements() - logged;
    assert!(
        messages > 10.0,
        "pg_dump's statements in the log: {messages}"
    );
    let after = c.settle(&before, "plain", messages);
    let got = c.count(&after, "plain") - c.count(&before, "plain");
    eprintln!("PostgreSQL {major}: pg_dump: {messages} Query messages logged, {got} queries");
    assert_eq!(got, messages, "pg_dump");
    // Pipelines: one query per Sync.
    let pipeline = c.script(
        "pipeline.sql",
        "\\startpipeline\nSELECT 1;\nSELECT 2;\nSELECT 3;\n\\endpipeline\n",
    );
    c.expect_plain("pipeline of 3 statements, one Sync", 50.0, || {
        let args = [
            "-h", &socket, "-M", "extended", "-c", "1", "-t", "50", "-f", &pipeline, DB,
        ];
        assert_eq!(c.pgbench(&args, &[]), 50.0);
    });
    let two_syncs = c.script(
        "two_syncs.sql",
        "\\startpipeline\nSELECT 1;\n\\syncpipeline\nSELECT 2;\n\\endpipeline\n",
    );
    if major >= 17 {
        c.expect_plain("pipeline with \\syncpipeline: two Syncs", 100.0, || {
            let args = [
                "-h", &socket, "-M", "extended", "-c", "1", "-t", "50", "-f", &two_syncs, DB,
            ];
            assert_eq!(c.pgbench(&args, &[]), 50.0);
        });
    }

    // TLS: cycles, start-up cycles, connections.
    let tls = [("PGSSLMODE", "require")];
    let before = c.daemon().scrape();
    let n = c.pgbench(
        &["-h", "127.0.0.1", "-c", "2", "-t", "100", "-f", &select, DB],
        &tls,
    );
    let after = c.settle(&before, "encrypted", n);
    let cycles = c.count(&after, "encrypted") - c.count(&before, "encrypted");
    let conns = delta(
        &before,
        &after,
        "pgio_query_encrypted_connections_total",
        &c.labels("encrypted"),
    );
    eprintln!("PostgreSQL {major}: TLS: {n} transactions, {cycles} cycles, {conns} connections");
    // pgbench's own first connection (it runs no query) and one per client.
    assert_eq!(conns, 3.0, "three TLS connections");
    // With trust authentication, a connection's start-up after the handshake flight is the
    // AuthenticationOk..ReadyForQuery cycle, and a cycle of TLS 1.3 session tickets where
    // the server sends them (Debian's 15 and PyPI's 17 do, PyPI's 18 does not) and the
    // client's next bytes come between them: under load one connection of three had two and
    // the others one (205 cycles on 15). A transaction each, exactly, plus that.
    let startup = cycles - n;
    assert!(
        startup >= conns && startup <= 2.0 * conns,
        "a transaction each, and one or two start-up cycles per connection: {cycles} cycles"
    );
    assert_eq!(c.count(&after, "plain") - c.count(&before, "plain"), 0.0);
    if major >= 17 {
        let before = c.daemon().scrape();
        let args = [
            "-h",
            "127.0.0.1",
            "-M",
            "extended",
            "-c",
            "1",
            "-t",
            "50",
            "-f",
            &two_syncs,
            DB,
        ];
        assert_eq!(c.pgbench(&args, &tls), 50.0);
        let after = c.settle(&before, "encrypted", 50.0);
        let cycles = c.count(&after, "encrypted") - c.count(&before, "encrypted");
        let multi = delta(
            &before,
            &after,
            "pgio_query_multi_send_total",
            &c.labels("encrypted"),
        );
        eprintln!(
            "PostgreSQL {major}: TLS two-Sync pipelines: {cycles} cycles, {multi} multi-send"
        );
        // The one connection's start-up: one or two cycles, each flagged or not (its sends
        // came together under load: 51 cycles, 50 multi-send on 18).
        let extra = cycles + multi - 100.0;
        assert!(
            (1.0..=4.0).contains(&extra),
            "each Sync a cycle, or flagged, + 1 to 4 for the start-up: {cycles} + {multi}"
        );
    }

    // A walsender's commands are no query of any series.
    let before = c.daemon().scrape();
    let mut w = c.pg.as_os_user("psql");
    w.args(["-X", "-q", "-d"])
        .arg(format!(
            "host={} port={} dbname={DB} replication=database",
            c.socket(),
            c.pg.port()
        ))
        .args(["-c", "IDENTIFY_SYSTEM"]);
    for _ in 0..3 {
        assert!(w.status().expect("psql").success(), "IDENTIFY_SYSTEM");
    }
    std::thread::sleep(Duration::from_millis(1500));
    let after = c.daemon().scrape();
    let all = [("pg_cluster", c.cluster.as_str())];
    assert_eq!(
        delta(&before, &after, "pgio_query_seconds_count", &all),
        0.0,
        "replication commands are not queries"
    );

    if let Some(d) = c.daemon.take() {
        d.stop().expect("daemon stop");
    }
    c.pg.stop().expect("stop");
}

#[test]
fn pg15_query_protocols() {
    protocols(15, 56_530, "");
}

#[test]
fn pg15_query_protocols_args_at_entry() {
    protocols(15, 56_533, "query_args_at_entry = true\n");
}

#[test]
fn pg17_query_protocols() {
    protocols(17, 56_531, "");
}

#[test]
fn pg18_query_protocols() {
    protocols(18, 56_532, "");
}

/// The socket calls' entries are attached only where their exits cannot read the arguments
/// from the saved registers (before 5.15, or when the config asks).
fn assert_socket_path(d: &Daemon, config: &str) {
    let m = d.scrape();
    let attached = |p| m.sum("pgio_probe_attached", &[("program", p)]);
    for p in ["sys_exit_recvfrom", "sys_exit_sendto"] {
        assert_eq!(attached(p), 1.0, "{p} attached");
    }
    let kernel = pgio_testkit::kernel_version();
    let regs = cfg!(target_arch = "x86_64")
        && kernel >= (5, 15)
        && !config.contains("query_args_at_entry = true");
    for p in ["sys_enter_recvfrom", "sys_enter_sendto"] {
        assert_eq!(
            attached(p),
            if regs { 0.0 } else { 1.0 },
            "{p} attached on kernel {kernel:?} with {config:?}"
        );
    }
}

/// The pid of the one backend on DB running a query.
fn wait_for_active(pg: &PgCluster) -> String {
    let mut pid = String::new();
    let found = wait_until(Duration::from_secs(10), Duration::from_millis(50), || {
        pid = pg
            .psql(&format!(
                "select pid from pg_stat_activity where datname = '{DB}' and state = 'active'"
            ))
            .unwrap_or_default();
        !pid.is_empty()
    });
    assert!(found, "no active backend on {DB}");
    pid
}
