//! The kernel memory of pgio's maps: the estimate `check` and `run` make before loading matches
//! what the kernel accounts to each map once loaded (fdinfo `memlock`, exported as
//! `pgio_bpf_map_memory_bytes`); no map but the small per-CPU ones grows with the possible CPUs,
//! so a 128-CPU node stays under 64 MiB; and a memory cgroup too small for the maps gets a
//! refusal that names it, not an OOM kill.
mod common;

use std::{path::Path, process::Command, time::Duration};

use common::Daemon;
use pgio_daemon::{config::Config, map_memory};
use pgio_testkit::{require_root, temp_dir};

const MIB: f64 = 1024.0 * 1024.0;

#[test]
fn each_map_takes_what_the_estimate_says() {
    if !require_root("each_map_takes_what_the_estimate_says") {
        return;
    }
    let daemon = Daemon::start(&[]).expect("daemon");
    let m = daemon.scrape();
    let cpus = map_memory::possible_cpus().expect("possible CPUs");
    assert_eq!(m.sum("pgio_possible_cpus", &[]), f64::from(cpus));
    let shapes = map_memory::shapes(&Config::default()).expect("map shapes");
    let mut measured_total = 0.0;
    for (name, shape) in &shapes {
        let measured = m.sum("pgio_bpf_map_memory_bytes", &[("map", name)]);
        let estimated = shape.bytes(cpus) as f64;
        eprintln!("{name}: measured {measured:.0}, estimated {estimated:.0} ({shape:?})");
        // The kernel adds its map header (a few hundred bytes) and rounds small arrays to a
        // page; every map of more than 64 KiB is within 1 %.
        let slack = 8192.0 + estimated * 0.01;
        assert!(
            (measured - estimated).abs() <= slack,
            "{name}: the kernel accounts {measured} bytes, the estimate says {estimated}"
        );
        measured_total += measured;
    }
    assert!(
        m.samples("pgio_bpf_map_memory_bytes").count() == shapes.len(),
        "one series per map of the object"
    );
    let (estimated_total, _) = map_memory::estimate(&Config::default(), cpus).expect("estimate");
    eprintln!(
        "all maps: measured {:.1} MiB, estimated {:.1} MiB, {cpus} possible CPUs",
        measured_total / MIB,
        estimated_total as f64 / MIB
    );
    daemon.stop().expect("stop");
}

#[test]
fn a_big_node_costs_what_a_small_one_does_but_for_small_per_cpu_maps() {
    // No root: the formulas the test above holds against this kernel, at 2 and 128 CPUs.
    let Ok(shapes) = map_memory::shapes(&Config::default()) else {
        eprintln!("skipped: built without the eBPF object");
        return;
    };
    let total = |cpus| shapes.iter().map(|(_, s)| s.bytes(cpus)).sum::<u64>() as f64 / MIB;
    let (small, big) = (total(2), total(128));
    eprintln!("maps at 2 possible CPUs {small:.1} MiB, at 128: {big:.1} MiB");
    let mut largest: Vec<_> = shapes.iter().map(|(n, s)| (s.bytes(128), n)).collect();
    largest.sort_unstable_by(|a, b| b.cmp(a));
    for (bytes, name) in largest.iter().take(12) {
        eprintln!("  {name}: {:.2} MiB at 128", *bytes as f64 / MIB);
    }
    for (name, s) in &shapes {
        let grows = (s.bytes(128) - s.bytes(2)) as f64 / MIB;
        assert!(
            grows < 18.0,
            "{name} grows by {grows:.1} MiB from 2 to 128 CPUs"
        );
    }
    // 64 MiB until relations and query ids were on by default (+15.4 MiB).
    assert!(big <= 80.0, "{big:.1} MiB of maps at 128 possible CPUs");
    // On a node whose pid_max is the 4194304 systemd sets (this host's is likely lower): the
    // tgid-indexed TRACKED grows to reach it.
    let systemd = shapes
        .iter()
        .map(|(name, s)| {
            let s = match name.as_str() {
                "TRACKED" => map_memory::MapShape {
                    max_entries: pgio_common::tracked_entries(4_194_304),
                    ..*s
                },
                _ => *s,
            };
            s.bytes(128)
        })
        .sum::<u64>() as f64
        / MIB;
    eprintln!("at 128 possible CPUs and pid_max 4194304: {systemd:.1} MiB");
    assert!(
        shapes.iter().any(|(name, _)| name == "TRACKED"),
        "no TRACKED map in the object"
    );
    assert!(
        systemd <= 80.0,
        "{systemd:.1} MiB of maps at 128 possible CPUs and pid_max 4194304"
    );
}

/// The hybrid host's v1 memory controller (cgroup v2 nodes are covered by the guest's
/// big-node case).
const MEMORY_V1: &str = "/sys/fs/cgroup/memory";

#[test]
fn a_memory_cgroup_too_small_for_the_maps_is_refused_by_name() {
    if !require_root("a_memory_cgroup_too_small_for_the_maps_is_refused_by_name") {
        return;
    }
    if !Path::new(MEMORY_V1).join("memory.limit_in_bytes").exists() {
        eprintln!("skipped: no cgroup v1 memory controller at {MEMORY_V1}");
        return;
    }
    let (maps, _) = map_memory::estimate(&Config::default(), map_memory::possible_cpus().unwrap())
        .expect("estimate");
    let cg = Path::new(MEMORY_V1).join(format!("pgio-test-{}", std::process::id()));
    std::fs::create_dir(&cg).expect("memory cgroup");
    let _cleanup = RemoveCgroup(&cg);
    // Room for the daemon's own start (~10 MB resident) but not for its maps as well.
    let limit = 24 << 20;
    assert!(maps > limit, "the maps ({maps} bytes) fit the test's limit");
    std::fs::write(cg.join("memory.limit_in_bytes"), limit.to_string()).expect("limit");
    let dir = temp_dir().expect("temp dir");
    std::fs::write(dir.path().join("pgio.toml"), "").expect("config");
    let port = pgio_testkit::daemon::free_port().expect("port");
    let out = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "echo $$ > {}/cgroup.procs && exec \"$0\" run --listen 127.0.0.1:{port} --config \"$1\"",
            cg.display()
        ))
        .arg(env!("CARGO_BIN_EXE_pgio-daemon"))
        .arg(dir.path().join("pgio.toml"))
        .output()
        .expect("running pgio-daemon");
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("{stderr}");
    assert_eq!(out.status.code(), Some(1), "exit status {:?}", out.status);
    assert!(
        stderr.contains("but the memory cgroup has") && stderr.contains("memory.limit_in_bytes"),
        "no refusal naming the cgroup: {stderr}"
    );
}

struct RemoveCgroup<'a>(&'a Path);

impl Drop for RemoveCgroup<'_> {
    fn drop(&mut self) {
        // Its one process has exited; the kernel may take a moment to let the directory go.
        for _ in 0..50 {
            if std::fs::remove_dir(self.0).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}
