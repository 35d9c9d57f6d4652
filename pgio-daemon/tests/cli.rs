//! The daemon's command line on bad input: clear errors, right exit codes.
mod common;

use prometheus_client::encoding::prometheus_protobuf::prometheus_data_model as pb;
use prost::Message;
use std::{net::TcpListener, process::Command};

use pgio_testkit::{require_root, temp_dir};

fn daemon() -> Command {
    Command::new(env!("CARGO_BIN_EXE_pgio-daemon"))
}

#[test]
fn invalid_config_names_file_line_and_field() {
    let dir = temp_dir().expect("temp dir");
    let path = dir.path().join("bad.toml");
    std::fs::write(
        &path,
        "listen = \"127.0.0.1:0\"\n\n[[rule]]\napp = \"x\"\ncomm = \"(\"\n",
    )
    .expect("write config");
    let out = daemon()
        .args(["run", "--config"])
        .arg(&path)
        .output()
        .expect("run daemon");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains(&format!("{}:5: invalid regex", path.display())),
        "{stderr}"
    );

    std::fs::write(&path, "bpf_stats = true\nlisten_addr = \"x\"\n").expect("write config");
    let out = daemon()
        .args(["run", "--config"])
        .arg(&path)
        .output()
        .expect("run");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains(&format!("{}:2: unknown key `listen_addr`", path.display())),
        "{stderr}"
    );
}

#[test]
fn port_in_use_is_named() {
    if !require_root("port_in_use_is_named") {
        return;
    }
    let busy = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = busy.local_addr().expect("addr");
    let out = daemon()
        .args(["run", "--listen", &addr.to_string()])
        .output()
        .expect("run daemon");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert_eq!(
        stderr.matches(&format!("cannot listen on {addr}")).count(),
        1,
        "said once: {stderr}"
    );
    assert!(
        stderr.contains("Address in use") || stderr.contains("in use"),
        "{stderr}"
    );
}

/// As an unprivileged user, `check` and `run` fail and name the missing capabilities.
#[test]
fn unprivileged_user_is_told_which_capability_is_missing() {
    if !require_root("unprivileged_user_is_told_which_capability_is_missing") {
        return;
    }
    // The binary lives under root's target dir: copy it where `nobody` can execute it.
    let dir = temp_dir().expect("temp dir");
    let bin = dir.path().join("pgio-daemon");
    std::fs::copy(env!("CARGO_BIN_EXE_pgio-daemon"), &bin).expect("copy binary");
    let as_nobody = |args: &[&str]| {
        Command::new("runuser")
            .args(["-u", "nobody", "--"])
            .arg(&bin)
            .args(args)
            .output()
            .expect("runuser")
    };
    let out = as_nobody(&["check"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(stdout.contains("FAIL CAP_BPF missing"), "{stdout}");
    assert!(stdout.contains("FAIL CAP_PERFMON missing"), "{stdout}");
    assert!(
        stdout.contains("pgio cannot run on this node; missing: CAP_BPF"),
        "{stdout}"
    );

    let out = as_nobody(&["run", "--listen", "127.0.0.1:0"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("insufficient privileges: CAP_BPF missing"),
        "{stderr}"
    );
}

#[test]
fn check_passes_as_root_here() {
    if !require_root("check_passes_as_root_here") {
        return;
    }
    let out = daemon().arg("check").output().expect("check");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    for tp in [
        "tp_btf/block_rq_complete",
        "tracepoint/syscalls/sys_enter_pread64",
        "tracepoint/sched/sched_process_exec",
    ] {
        assert!(stdout.contains(&format!("ok   {tp}")), "{tp}: {stdout}");
    }
}

/// Prometheus text by default, OpenMetrics or protobuf when the Accept header prefers it.
#[test]
fn content_negotiation() {
    if !require_root("content_negotiation") {
        return;
    }
    let d = common::Daemon::start(&[]).expect("daemon");
    let curl = |accept: Option<&str>| {
        let mut c = Command::new("curl");
        c.args(["-s", "-i"]);
        if let Some(a) = accept {
            c.args(["-H", &format!("Accept: {a}")]);
        }
        let out = c
            .arg(format!("{}/metrics", d.url()))
            .output()
            .expect("curl");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let plain = curl(None);
    assert!(
        plain.contains("content-type: text/plain; version=0.0.4"),
        "{}",
        &plain[..300.min(plain.len())]
    );
    assert!(plain.contains("# TYPE pgio_block_io_requests_total counter"));
    assert!(!plain.contains("# EOF"));
    let om = curl(Some(
        "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5",
    ));
    assert!(
        om.contains("content-type: application/openmetrics-text; version=1.0.0"),
        "{}",
        &om[..300.min(om.len())]
    );
    assert!(om.contains("# TYPE pgio_block_io_requests counter"));
    assert!(om.trim_end().ends_with("# EOF"));
    // What Prometheus 2.42 sends with native histograms enabled.
    let accept = "application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=delimited,application/openmetrics-text;version=1.0.0;q=0.8,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
    let out = Command::new("curl")
        .args([
            "-s",
            "-D",
            "/dev/stderr",
            "-H",
            &format!("Accept: {accept}"),
        ])
        .arg(format!("{}/metrics", d.url()))
        .output()
        .expect("curl");
    let headers = String::from_utf8_lossy(&out.stderr);
    assert!(
        headers.contains(
            "content-type: application/vnd.google.protobuf; proto=io.prometheus.client.MetricFamily; encoding=delimited"
        ),
        "{headers}"
    );
    let mut body = &out.stdout[..];
    let mut names = Vec::new();
    while !body.is_empty() {
        let f = pb::MetricFamily::decode_length_delimited(&mut body).expect("a family");
        names.push(f.name);
    }
    for family in ["pgio_block_io_requests_total", "pgio_syscall_seconds"] {
        assert!(names.iter().any(|n| n == family), "{family}: {names:?}");
    }
    d.stop().expect("clean exit");
}

/// Waits for the daemon's log at `log` to say it serves /metrics: (whether it did, the log).
fn wait_serving(log: &std::path::Path) -> (bool, String) {
    let mut text = String::new();
    let up = pgio_testkit::wait_until(
        std::time::Duration::from_secs(20),
        std::time::Duration::from_millis(100),
        || {
            text = std::fs::read_to_string(log).unwrap_or_default();
            text.contains("serving /metrics")
        },
    );
    (up, text)
}

/// With stderr not a terminal the log has no colour codes, and `--listen 127.0.0.1:0` logs the
/// port the kernel picked.
#[test]
fn log_is_plain_and_names_the_bound_port() {
    if !require_root("log_is_plain_and_names_the_bound_port") {
        return;
    }
    let dir = temp_dir().expect("temp dir");
    let log = dir.path().join("log");
    let mut child = daemon()
        .args(["run", "--listen", "127.0.0.1:0"])
        .stderr(std::fs::File::create(&log).expect("log"))
        .spawn()
        .expect("run daemon");
    let (up, text) = wait_serving(&log);
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let _ = child.wait();
    assert!(up, "{text}");
    assert!(
        !text.contains('\x1b'),
        "colour codes in a log file: {text:?}"
    );
    let line = text
        .lines()
        .find(|l| l.contains("serving /metrics"))
        .unwrap_or_default();
    let port: u16 = line
        .rsplit_once("listen=127.0.0.1:")
        .and_then(|(_, p)| p.split_whitespace().next()?.parse().ok())
        .unwrap_or(0);
    assert_ne!(port, 0, "{line}");
}

/// A network namespace of the test's own, deleted on drop.
struct NetNs(String);

impl NetNs {
    fn create(name: String) -> NetNs {
        let ok = Command::new("ip")
            .args(["netns", "add", &name])
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "ip netns add {name}");
        let ns = NetNs(name);
        ns.run(&["ip", "link", "set", "lo", "up"]);
        ns
    }

    fn command(&self, argv: &[&str]) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.0]).args(argv);
        c
    }

    fn run(&self, argv: &[&str]) -> String {
        let out = self.command(argv).output().expect("ip netns exec");
        assert!(
            out.status.success(),
            "{argv:?} in {}: {}",
            self.0,
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "delete", &self.0])
            .status();
    }
}

/// The default `[::]` listener answers on IPv4 and IPv6 even where the node makes IPv6 sockets
/// IPv6-only (`net.ipv6.bindv6only = 1`, set in a network namespace of the test's own).
#[test]
fn default_listener_serves_ipv4_and_ipv6() {
    if !require_root("default_listener_serves_ipv4_and_ipv6") {
        return;
    }
    let ns = NetNs::create(format!("pgio-test-{}", std::process::id()));
    ns.run(&["sysctl", "-q", "-w", "net.ipv6.bindv6only=1"]);
    let dir = temp_dir().expect("temp dir");
    let log = dir.path().join("log");
    let mut child = ns
        .command(&[
            env!("CARGO_BIN_EXE_pgio-daemon"),
            "run",
            "--listen",
            "[::]:0",
        ])
        .stderr(std::fs::File::create(&log).expect("log"))
        .spawn()
        .expect("run daemon");
    let (up, text) = wait_serving(&log);
    let port: u16 = text
        .lines()
        .find(|l| l.contains("serving /metrics"))
        .and_then(|l| l.rsplit_once("listen=[::]:"))
        .and_then(|(_, p)| p.split_whitespace().next()?.parse().ok())
        .unwrap_or(0);
    let get = |host: &str| {
        ns.command(&[
            "curl",
            "-s",
            "-m",
            "5",
            &format!("http://{host}:{port}/healthz"),
        ])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default()
    };
    let (v4, v6) = (get("127.0.0.1"), get("[::1]"));
    // SAFETY: signalling our own child (`ip netns exec` execs the daemon: the same pid).
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let _ = child.wait();
    assert!(up && port != 0, "{text}");
    assert!(v4.starts_with("ok"), "IPv4 /healthz: {v4:?}\n{text}");
    assert!(v6.starts_with("ok"), "IPv6 /healthz: {v6:?}\n{text}");
}
