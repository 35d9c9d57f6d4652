//! `pgio-daemon top` against a running daemon under a known load: `--once --json` counts equal
//! the /metrics text deltas of the same interval, bucket by bucket; the live mode in a real
//! terminal (tmux) draws the histogram, reports a daemon that went away and quits on `q`; a
//! wrong URL is a clear error, never a panic. (Over HTTPS with basic auth: `web_config`.)
mod common;

use std::io::{Read, Write};
use std::net::TcpListener;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use common::{Daemon, delta};
use pgio_testkit::{
    LoadProcess, LoopDevice, Metrics, pgio_load_bin, require_root, serde_json, temp_dir, wait_until,
};
use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_pgio-daemon");
const READS: u64 = 4_000;

fn top(args: &[&str]) -> Command {
    let mut c = Command::new(BIN);
    c.arg("top").args(args);
    c
}

/// A daemon, and a load on `lo` it tracks as app `test`, role `role`. Tests run at once: the
/// rule also matches the load's device, so each daemon puts the other test's load elsewhere.
fn daemon_with_load(lo: &LoopDevice, reads: u64, role: &str) -> (Daemon, LoadProcess) {
    let daemon = Daemon::with_config(&format!(
        "[[rule]]\napp = \"test\"\nrole = \"{role}\"\ncomm = \"^pgio-load$\"\ncmdline = \"{} \"\n",
        lo.path().display()
    ))
    .expect("daemon");
    let load = LoadProcess::spawn(
        &pgio_load_bin().expect("pgio-load"),
        [
            "direct-read",
            lo.path().to_str().expect("utf-8"),
            &reads.to_string(),
            "8192",
        ],
    )
    .expect("spawn pgio-load");
    daemon.wait_tracked("test", role);
    lo.wait_quiet(Duration::from_secs(5));
    (daemon, load)
}

/// Non-cumulative text bucket deltas of one histogram, `+Inf` last, as `(le, count)`.
fn text_buckets(
    before: &Metrics,
    after: &Metrics,
    family: &str,
    labels: &[(&str, &str)],
) -> Vec<(f64, u64)> {
    let h = after
        .histogram(family, labels)
        .expect("histogram")
        .since(&before.histogram(family, labels).expect("histogram"));
    let mut last = 0.0;
    h.buckets
        .iter()
        .map(|(le, cum)| {
            let n = cum - last;
            last = *cum;
            (*le, n as u64)
        })
        .filter(|(_, n)| *n > 0)
        .collect()
}

fn json_buckets(row: &Value) -> Vec<(f64, u64)> {
    row["buckets"]
        .as_array()
        .expect("buckets")
        .iter()
        .map(|b| {
            let le = match &b["le_seconds"] {
                Value::String(s) if s == "+Inf" => f64::INFINITY,
                v => v.as_f64().expect("le"),
            };
            (le, b["count"].as_u64().expect("count"))
        })
        .collect()
}

#[test]
fn once_json_counts_equal_the_metrics_deltas_of_its_interval() {
    if !require_root("once_json_counts_equal_the_metrics_deltas_of_its_interval") {
        return;
    }
    let dir = temp_dir().expect("temp dir");
    let lo = LoopDevice::create_written(dir.path(), 64 << 20, true).expect("loop device");
    let (daemon, mut load) = daemon_with_load(&lo, READS, "once");
    let url = format!("{}/metrics", daemon.url());

    let before = daemon.scrape();
    let child = top(&[
        "--once",
        "--json",
        "--interval",
        "6",
        "--url",
        &url,
        "--app",
        "test",
        "--metric",
        "syscall,device",
    ])
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .expect("spawn top");
    // top scrapes at once, then after 6 s: the load runs in between.
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(load.expect_run(), READS);
    let out = child.wait_with_output().expect("top");
    let after = daemon.scrape();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let j: Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    let rows = j["rows"].as_array().expect("rows");
    let row = |metric: &str, label: &str, value: &str| {
        rows.iter()
            .find(|r| r["metric"] == metric && r["labels"][label] == value)
            .unwrap_or_else(|| panic!("no {metric} {label}={value} row: {j}"))
    };

    let syscall = row("syscall", "syscall", "pread64");
    let sel = [("app", "test"), ("role", "once"), ("syscall", "pread64")];
    let text = delta(&before, &after, "pgio_syscall_seconds_count", &sel);
    eprintln!("pread64: top {}, /metrics delta {text}", syscall["count"]);
    assert_eq!(syscall["count"].as_u64(), Some(READS));
    assert_eq!(text, READS as f64);
    assert_eq!(
        json_buckets(syscall),
        text_buckets(&before, &after, "pgio_syscall_seconds", &sel)
    );

    let device = row("device", "device", lo.name());
    let sel = [("app", "test"), ("device", lo.name()), ("op", "read")];
    let text = delta(&before, &after, "pgio_block_io_device_seconds_count", &sel);
    eprintln!(
        "{} reads: top {}, /metrics delta {text}",
        lo.name(),
        device["count"]
    );
    assert_eq!(device["count"].as_f64(), Some(text));
    // The kernel skips a completion program now and then (issue 13: up to ~1 % under load);
    // pgio counts those lost 1 s after their issue, on the same device and app.
    std::thread::sleep(Duration::from_millis(1500));
    let lost = delta(
        &before,
        &daemon.scrape(),
        "pgio_block_io_lost_completions_total",
        &sel,
    );
    eprintln!("{} reads lost: {lost}", lo.name());
    assert!(text + lost >= READS as f64 * 0.99, "{text} + {lost} lost");
    assert!(lost <= READS as f64 * 0.02, "{lost} lost");
    assert_eq!(
        json_buckets(device),
        text_buckets(&before, &after, "pgio_block_io_device_seconds", &sel)
    );
    // p50 and p99 lie in the busiest buckets' range.
    let p50 = device["p50_seconds"].as_f64().expect("p50");
    let p99 = device["p99_seconds"].as_f64().expect("p99");
    assert!(0.0 < p50 && p50 <= p99, "{p50} {p99}");
    let interval = j["interval_seconds"].as_f64().expect("interval");
    assert!((5.9..8.0).contains(&interval), "{interval}");
    daemon.stop().expect("clean daemon exit");
    lo.detach().expect("detach");
}

/// A tmux server on its own socket, killed (with its panes' processes) in Drop.
struct Tmux(String);

impl Tmux {
    fn new(command: &str) -> Tmux {
        let t = Tmux(format!("pgio-top-test-{}", std::process::id()));
        let ok = t
            .cmd(&["new-session", "-d", "-x", "80", "-y", "40", command])
            .status
            .success();
        assert!(ok, "tmux new-session");
        t
    }

    fn cmd(&self, args: &[&str]) -> Output {
        Command::new("tmux")
            .args(["-L", &self.0])
            .args(args)
            .env("TERM", "xterm")
            .output()
            .expect("tmux")
    }

    fn screen(&self) -> String {
        String::from_utf8_lossy(&self.cmd(&["capture-pane", "-p"]).stdout).into_owned()
    }

    fn wait_for(&self, what: &str, timeout: Duration) -> String {
        let mut screen = String::new();
        wait_until(timeout, Duration::from_millis(200), || {
            screen = self.screen();
            screen.contains(what)
        });
        assert!(screen.contains(what), "{what:?} not on screen:\n{screen}");
        screen
    }

    fn alive(&self) -> bool {
        self.cmd(&["has-session"]).status.success()
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = self.cmd(&["kill-server"]);
    }
}

#[test]
fn live_view_in_a_terminal_draws_reports_a_dead_daemon_and_quits_on_q() {
    if !require_root("live_view_in_a_terminal_draws_reports_a_dead_daemon_and_quits_on_q") {
        return;
    }
    let dir = temp_dir().expect("temp dir");
    let lo = LoopDevice::create_written(dir.path(), 64 << 20, true).expect("loop device");
    // Reads enough for the whole test; killed with the LoadProcess.
    let (daemon, mut load) = daemon_with_load(&lo, 10_000_000, "live");
    load.go().expect("start the load");
    let url = format!("{}/metrics", daemon.url());
    let tmux = Tmux::new(&format!(
        "{BIN} top --url {url} --interval 1 --app test --metric device"
    ));
    let screen = tmux.wait_for("|@", Duration::from_secs(15));
    eprintln!("{screen}");
    assert!(screen.starts_with("pgio top  http://"), "{screen}");
    assert!(
        screen.contains(&format!(
            "device device={} op=read | app=test role=live",
            lo.name()
        )),
        "{screen}"
    );
    assert!(screen.contains(" p99 "), "{screen}");
    for line in screen.lines() {
        assert!(line.chars().count() <= 80, "{line:?}");
    }

    daemon.stop().expect("clean daemon exit");
    let screen = tmux.wait_for("error: cannot reach", Duration::from_secs(10));
    // The last picture stays under the error.
    assert!(screen.contains("|@"), "{screen}");

    tmux.cmd(&["send-keys", "q"]);
    assert!(
        wait_until(Duration::from_secs(5), Duration::from_millis(100), || !tmux
            .alive()),
        "top still running after q:\n{}",
        tmux.screen()
    );
    drop(load);
    lo.detach().expect("detach");
}

fn stderr_of(args: &[&str]) -> (Option<i32>, String) {
    let out = top(args).stdin(Stdio::null()).output().expect("top");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn a_wrong_url_is_a_clear_error() {
    // Nothing listens on a port just freed.
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("port")
        .port();
    let url = format!("http://127.0.0.1:{port}/metrics");
    let (code, err) = stderr_of(&["--once", "--url", &url]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains(&format!("cannot reach {url}")), "{err}");
    assert!(err.contains("Connection refused"), "{err}");

    let (code, err) = stderr_of(&["--once", "--url", "ftp://127.0.0.1:9435/metrics"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("not an http:// or https:// URL"), "{err}");

    // A web server that is not pgio, over HTTP and then HTTPS.
    let server = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = server.local_addr().expect("addr");
    let serve = std::thread::spawn(move || {
        for _ in 0..2 {
            if let Ok((mut s, _)) = server.accept() {
                let mut buf = [0u8; 4096];
                let _ = s.read(&mut buf);
                let _ = s.write_all(
                    b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello",
                );
            }
        }
    });
    let url = format!("http://{addr}/metrics");
    let (code, err) = stderr_of(&["--once", "--url", &url]);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("is not a pgio daemon's /metrics") && err.contains("text/html"),
        "{err}"
    );
    let url = format!("https://{addr}/metrics");
    let (code, err) = stderr_of(&["--once", "--insecure", "--url", &url]);
    let _ = serve.join();
    eprintln!("https:// to a plain HTTP server: {}", err.trim());
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains(&format!("{url}: the TLS handshake failed"))
            && err.contains("is it serving plain HTTP? try http://"),
        "{err}"
    );

    let (code, err) = stderr_of(&["--once", "--interval", "0"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("between 0.1 and 3600"), "{err}");
    let (code, err) = stderr_of(&["--once", "--url", "http://[::1"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("cannot reach http://[::1"), "{err}");
}
