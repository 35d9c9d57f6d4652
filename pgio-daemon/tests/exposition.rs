//! The exposition as a scraper sees it, from fixed readings (no kernel): the families, label
//! names, label sets and values pgio served before its own encoder replaced prometheus-client
//! (`golden/`, written by that encoder), and the label rules of block series.
use pgio_common::{
    SeriesId,
    block_io::{BlockMetric, BlockOp, mkdev},
    drops::DROP_REASONS,
    hist::{Bucket, slot},
    query::{QueryMetric, Wire},
    query_wait::Part,
    relation::{Fork, RelFile},
    syscall::{Cache, Syscall},
};
use std::collections::BTreeMap;

use pgio_daemon::{
    block_io::{BlockIoId, BlockIoSnapshot},
    collector::{self, Snapshot},
    device_info::DeviceInfo,
    devices::Devices,
    exposition::{Encoder, Format},
    heap::Heap,
    hist::{HistSnapshot, Log2Hist},
    http_server::HttpSnapshot,
    io_worker::IoWorkerSnapshot,
    key_quota::{KeyQuotaSnapshot, MapStats},
    labels::Labels,
    lifecycle::PostgresBinaries,
    map_memory::{CgroupMemory, MapMemory},
    probes::ProbeStatus,
    query::{QueryId, QuerySnapshot},
    query_id::{
        QueryIdSnapshot,
        places::{Counts, Qid},
    },
    queue_blame::{Culprit, QueueBlameId},
    relation::{
        RelationId, RelationSnapshot, RelationState,
        book::FileRef,
        names::{Kind, Relation},
    },
    role_wait::RoleWaitId,
    self_metrics::{ProgramStats, SelfSnapshot},
    series::Tracked,
    syscall::{SyscallId, SyscallSnapshot},
    tracked_processes::TrackedProcesses,
    wait_event::WaitEventId,
    web_config::WebSnapshot,
};
use pgio_testkit::metrics::{Metrics, Sample};

/// Fixed readings of every source, in the order `pgio-daemon run` registers them.
#[derive(Default)]
struct Readings {
    block: BlockIoSnapshot,
    syscalls: SyscallSnapshot,
    self_metrics: SelfSnapshot,
    tracked: Tracked,
    names: Vec<(u32, String)>,
    volumes: Vec<(u32, String)>,
    /// Only in `all_families`.
    queries: QuerySnapshot,
    /// Only in `all_families`.
    query_ids: QueryIdSnapshot,
    /// Only in `all_families`.
    relations: RelationSnapshot,
    /// Only in `all_families`.
    io_worker: IoWorkerSnapshot,
    /// Only in `all_families`.
    role_waits: HistSnapshot<RoleWaitId>,
    /// Only in `all_families`.
    wait_events: HistSnapshot<WaitEventId>,
    /// Only in `all_families`.
    queue_blame: HistSnapshot<QueueBlameId>,
    key_quota: KeyQuotaSnapshot,
    http: HttpSnapshot,
    web: WebSnapshot,
    map_memory: MapMemory,
}

fn exposition(r: &Readings, format: Format) -> String {
    String::from_utf8(exposition_bytes(r, format)).expect("text formats are UTF-8")
}

fn exposition_bytes(r: &Readings, format: Format) -> Vec<u8> {
    let mut devices = Devices::fixed(r.names.clone(), r.volumes.clone());
    let mut enc = Encoder::new(format, 0);
    let sources: [&dyn Snapshot; 5] = [
        &r.block,
        &r.syscalls,
        &TrackedProcesses,
        &DeviceInfo,
        &r.self_metrics,
    ];
    collector::encode(sources, &r.tracked, &mut devices, &mut enc);
    enc.finish()
}

/// Every source in the order `pgio-daemon run` registers them, TLS and basic auth on.
fn all_families_bytes(r: &Readings, format: Format) -> Vec<u8> {
    let mut devices = Devices::fixed(r.names.clone(), r.volumes.clone());
    let mut enc = Encoder::new(format, 0);
    let sources: [&dyn Snapshot; 16] = [
        &r.block,
        &r.queue_blame,
        &r.syscalls,
        &r.queries,
        &r.query_ids,
        &r.relations,
        &r.io_worker,
        &r.role_waits,
        &r.wait_events,
        &r.key_quota,
        &TrackedProcesses,
        &DeviceInfo,
        &r.map_memory,
        &r.self_metrics,
        &r.http,
        &r.web,
    ];
    collector::encode(sources, &r.tracked, &mut devices, &mut enc);
    enc.finish()
}

/// `golden_readings` plus every source it leaves out: queries, map shares, HTTP, TLS and
/// basic auth.
fn all_families() -> Readings {
    let mut r = golden_readings();
    let pg = r.tracked.registry.intern(Labels {
        app: "postgres".into(),
        role: "client backend".into(),
        database: "we\"ird\nname\\ x".into(),
        user: "ünï 🐘".into(),
        cluster: "15/main".into(),
        ..Labels::default()
    });
    let ckpt = r.tracked.registry.intern(Labels {
        cluster: "/tmp/d a\"ta".into(),
        ..Labels::app_role("postgres", "checkpointer")
    });
    for (n, (series, metric, wire, misses)) in [
        (pg, QueryMetric::Duration, Wire::Plain, 17),
        (pg, QueryMetric::Io, Wire::Plain, 0),
        (pg, QueryMetric::ReadMiss, Wire::Plain, 0),
        (pg, QueryMetric::Duration, Wire::Encrypted, 2),
        (pg, QueryMetric::MultiSend, Wire::Encrypted, 0),
        (pg, QueryMetric::EncryptedConnections, Wire::Encrypted, 0),
        (ckpt, QueryMetric::Duration, Wire::Plain, 0),
    ]
    .into_iter()
    .enumerate()
    {
        r.queries.0.insert(
            QueryId {
                series,
                metric,
                wire,
                part: Part::Cpu,
            },
            h(n as u64 + 20, misses),
        );
    }
    // Where the plain queries' time went.
    for (part, ns) in [
        (Part::Cpu, 1_250_000_000),
        (Part::Runnable, 30_000_000),
        (Part::Io, 700_000_000),
        (Part::Lock, 2_000_000_000),
    ] {
        let hist = Log2Hist {
            sum_ns: ns,
            ..Log2Hist::default()
        };
        r.queries.0.insert(
            QueryId {
                series: pg,
                metric: QueryMetric::Part,
                wire: Wire::Plain,
                part,
            },
            hist,
        );
    }
    // The checkpointer's waits: its sleeps, its writes and syncs.
    for (n, part) in [Part::Activity, Part::Io, Part::Runnable]
        .into_iter()
        .enumerate()
    {
        r.role_waits
            .0
            .insert(RoleWaitId { series: ckpt, part }, h(n as u64 + 40, 0));
    }
    // By individual event: the checkpointer's sleep (PostgreSQL 17), a client backend's row
    // lock, two LWLock tranches of an extension (one `unknown` line) and a block with none.
    for (n, (series, info, major)) in [
        (ckpt, 0x0500_0004, 17),
        (pg, 0x0300_0005, 15),
        (pg, 0x0100_fff0, 15),
        (pg, 0x0100_fff1, 15),
        (pg, 0, 15),
    ]
    .into_iter()
    .enumerate()
    {
        r.wait_events.0.insert(
            WaitEventId {
                series,
                info,
                major,
            },
            h(n as u64 + 50, 0),
        );
    }
    // The client backend's reads on sdb waited behind the checkpointer's writes, behind the
    // device's `(rest)`, and behind its own: in the queue, and on the device.
    for (n, culprit) in [Culprit::Series(ckpt), Culprit::Rest, Culprit::Series(pg)]
        .into_iter()
        .enumerate()
    {
        for device in [false, true] {
            r.queue_blame.0.insert(
                QueueBlameId {
                    victim: pg,
                    dev: mkdev(8, 16),
                    op: BlockOp::Read,
                    device,
                    culprit,
                },
                Log2Hist {
                    sum_ns: 250_000_000 * (n as u64 + 1) + u64::from(device) * 1_000,
                    ..Log2Hist::default()
                },
            );
        }
    }
    // Query ids: one with a place (pg_stat_statements shows it signed), the rest, a query
    // without id and one pgio could not read.
    for (n, qid) in [
        Qid::Id(0xfedc_ba98_7654_3210),
        Qid::Rest,
        Qid::None,
        Qid::Unknown,
    ]
    .into_iter()
    .enumerate()
    {
        let n = n as u64;
        r.query_ids.exported.insert(
            (pg, qid),
            Counts {
                duration: h(n + 40, 0),
                io: h(n + 44, 0),
                miss_ns: 1_500_000 * n,
                misses: 3 * n,
                parts_ns: core::array::from_fn(
                    |p| if p < 3 { 1_000_000 * (n + p as u64) } else { 0 },
                ),
            },
        );
    }
    r.query_ids
        .in_rest
        .insert(("15/main".into(), "we\"ird\nname\\ x".into()), 7);
    r.query_ids.sources = (2, 1);
    let file = |relfilenode, fork| RelFile::relation(1663, 16384, relfilenode, fork);
    for (series, file, syscall, cache, n) in [
        (
            pg,
            file(16385, Fork::Main),
            Syscall::Pread64,
            Cache::Miss,
            30,
        ),
        (
            pg,
            file(16385, Fork::Main),
            Syscall::Pread64,
            Cache::Hit,
            31,
        ),
        (pg, file(16385, Fork::Vm), Syscall::Pread64, Cache::Hit, 32),
        (
            ckpt,
            file(16385, Fork::Main),
            Syscall::Pwrite64,
            Cache::None,
            33,
        ),
        (
            ckpt,
            file(16385, Fork::Main),
            Syscall::Fsync,
            Cache::None,
            34,
        ),
        (pg, RelFile::OTHER, Syscall::Pread64, Cache::Hit, 35),
    ] {
        let hist = h(n, n * 8192);
        r.relations.hists.insert(
            RelationId {
                series,
                file,
                syscall,
                cache,
            },
            hist,
        );
    }
    // The client backends' cluster has read its catalogs: 16385 is `public.orders`, 16386
    // its index; one place per cluster, so the table is in `(rest)`. The checkpointer's
    // cluster did not find 16385: `(relfilenode 16385)`.
    r.relations.hists.insert(
        RelationId {
            series: pg,
            file: file(16386, Fork::Main),
            syscall: Syscall::Pread64,
            cache: Cache::Miss,
        },
        h(36, 36 * 8192),
    );
    let mut state = RelationState::new(1);
    let in_db = |relfilenode| FileRef {
        db: 16384,
        tablespace: 1663,
        relfilenode,
    };
    for (node, name, kind) in [
        (16385, "orders", Kind::Table),
        (16386, "orders_pkey", Kind::Index),
    ] {
        let relation = Relation {
            schema: "public".into(),
            name: name.into(),
            kind,
        };
        state
            .book
            .remember("15/main", in_db(node), Some((relation, "shop")));
    }
    state.book.remember("/tmp/d a\"ta", in_db(16385), None);
    r.relations.state = std::sync::Arc::new(std::sync::Mutex::new(state));
    r.relations.inconsistent_reads = 3;
    let stats = |entries: u64, owners: &[(&str, u32)], refused: &[(&str, u64)], evicted| MapStats {
        entries,
        max_entries: 65_536,
        evicted_total: evicted,
        by_owner: owners.iter().map(|(o, n)| ((*o).to_owned(), *n)).collect(),
        refused: refused.iter().map(|(o, n)| ((*o).to_owned(), *n)).collect(),
    };
    r.key_quota = KeyQuotaSnapshot(vec![
        (
            "block_io",
            stats(
                1_200,
                &[("exempt", 200), ("provisional", 3), ("999", 997)],
                &[("999", 41)],
                12,
            ),
        ),
        ("syscall", stats(300, &[("0", 300)], &[], 0)),
        (
            "query",
            MapStats {
                max_entries: 16_384,
                ..stats(4, &[("0", 4)], &[("other_uids", 2)], 0)
            },
        ),
    ]);
    r.http = HttpSnapshot {
        open: 3,
        accepted: 1_000,
        rejected: 4,
        closed: [("evicted", 5), ("header_timeout", 6), ("idle_timeout", 7)],
        accept_errors: 1,
    };
    r.web = WebSnapshot {
        tls_handshake_failures: Some(8),
        certificate_reloads: Some((2, 1)),
        auth: Some(([("missing", 9), ("wrong", 10), ("busy", 11)], 12)),
    };
    // A cold scan's 1,767 reads done for a backend, and a few of the workers' own.
    r.io_worker = IoWorkerSnapshot {
        calls: [1_767, 12, 3, 0, 1, 2],
    };
    r.map_memory = MapMemory {
        maps: vec![
            ("BLOCK_IO_HIST".to_owned(), 5_505_024),
            ("SYSCALL_ROWS_MAP".to_owned(), 17_303_552),
        ],
        possible_cpus: 128,
        cgroup: Some(CgroupMemory {
            limit: 134_217_728,
            usage: 96_468_992,
            limit_file: "/sys/fs/cgroup/kubepods/pgio/memory.max".into(),
        }),
    };
    r
}

/// Every family pgio declares, as one scrape with TLS and basic auth on shows it, byte for
/// byte (`golden/all_families.*`, written from this tree with `PGIO_BLESS=1`).
#[test]
fn every_family_is_byte_for_byte_its_golden_file() {
    let r = all_families();
    for (format, file) in [
        (Format::Prometheus, "all_families.txt"),
        (Format::OpenMetrics, "all_families.openmetrics"),
    ] {
        let got = String::from_utf8(all_families_bytes(&r, format)).expect("UTF-8");
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/golden")
            .join(file);
        if std::env::var_os("PGIO_BLESS").is_some() {
            std::fs::write(&path, &got).expect("writing the golden file");
        }
        let want = std::fs::read_to_string(&path).expect("golden file (PGIO_BLESS=1 writes it)");
        assert!(got == want, "{format:?}: differs from {}", path.display());
    }
}

fn block(series: SeriesId, dev: u32, op: BlockOp, metric: BlockMetric) -> BlockIoId {
    BlockIoId {
        series,
        dev,
        op,
        metric,
    }
}

fn h(seed: u64, bytes: u64) -> Log2Hist {
    let mut h = Log2Hist::default();
    for i in 0..5u64 {
        let ns = 700 << ((seed * 3 + i * 5) % 40);
        h.add(
            slot(ns),
            &Bucket {
                count: 1 + i + seed,
                sum: ns * (1 + i + seed),
                bytes,
            },
        );
    }
    h
}

/// Every family with samples, hostile label values, Longhorn volumes, a device seen only as
/// a volume: what `golden/` was written from.
fn golden_readings() -> Readings {
    let mut r = Readings::default();
    let t = &mut r.tracked;
    let pg = t.registry.intern(Labels {
        app: "postgres".into(),
        role: "client backend".into(),
        database: "we\"ird\nname\\ x".into(),
        user: "ünï 🐘".into(),
        cluster: "15/main".into(),
        ..Labels::default()
    });
    let ckpt = t.registry.intern(Labels {
        cluster: "/tmp/d a\"ta".into(),
        ..Labels::app_role("postgres", "checkpointer")
    });
    let rep = t.registry.intern(Labels {
        volume: "pvc-a".into(),
        ..Labels::app_role("longhorn", "replica")
    });
    let kw = t.registry.intern(Labels::app_role("kernel", "kworker"));
    t.registry.refused.insert("postgres".into(), 7);
    t.registry.truncated_total = 2;
    t.kernel_map_errors = 1;
    for (pid, s) in [
        (100, pg),
        (101, pg),
        (102, ckpt),
        (200, rep),
        (201, rep),
        (300, kw),
    ] {
        t.pids.insert(pid, s);
    }
    t.exits_missed = 3;
    // Newer than golden/: one process held provisional.
    t.provisional.forked(400, ckpt);
    let (vda, sdb, loop0) = (mkdev(254, 0), mkdev(8, 16), mkdev(7, 0));
    let mut n = 0;
    for (s, dev, op) in [
        (pg, sdb, BlockOp::Read),
        (pg, sdb, BlockOp::Write),
        (rep, vda, BlockOp::Read),
        (kw, vda, BlockOp::Write),
        (SeriesId::UNTRACKED, loop0, BlockOp::Flush),
        (ckpt, loop0, BlockOp::WriteZeroes),
    ] {
        n += 1;
        let hists = &mut r.block.0;
        hists.insert(block(s, dev, op, BlockMetric::Device), h(n, 8192));
        if n % 2 == 0 {
            hists.insert(block(s, dev, op, BlockMetric::Queue), h(n + 7, 0));
        }
    }
    let unmatched = |count| {
        let mut u = Log2Hist::default();
        u.slots[0] = count;
        u
    };
    let untracked = SeriesId::UNTRACKED;
    let hists = &mut r.block.0;
    hists.insert(
        block(untracked, loop0, BlockOp::Write, BlockMetric::Unmatched),
        unmatched(100),
    );
    hists.insert(
        block(untracked, vda, BlockOp::Flush, BlockMetric::Unmatched),
        unmatched(7),
    );
    // Newer than golden/: the whole time of one series, and its lost completions.
    hists.insert(
        block(pg, sdb, BlockOp::Read, BlockMetric::Total),
        one_request(),
    );
    hists.insert(
        block(pg, sdb, BlockOp::Read, BlockMetric::Lost),
        unmatched(3),
    );
    for (s, sc, cache) in [
        (pg, Syscall::Pread64, Cache::Hit),
        (pg, Syscall::Pread64, Cache::Miss),
        (pg, Syscall::Fsync, Cache::None),
        (pg, Syscall::Futex, Cache::None),
        (rep, Syscall::Pread64, Cache::Miss),
        (rep, Syscall::FutexWaitv, Cache::None),
        (ckpt, Syscall::Pwritev2, Cache::None),
    ] {
        n += 1;
        let id = SyscallId {
            series: s,
            syscall: sc,
            cache,
        };
        r.syscalls.0.insert(id, h(n, 0));
    }
    r.names = [
        (vda, "vda"),
        (sdb, "sdb"),
        (loop0, "loop0"),
        (mkdev(8, 32), "sdc"),
    ]
    .map(|(d, n)| (d, n.to_owned()))
    .to_vec();
    r.volumes = vec![(sdb, "pvc-b".into()), (mkdev(8, 32), "pvc-\"c\"\n".into())];
    r.self_metrics = SelfSnapshot {
        probes: vec![
            ProbeStatus {
                program: "block_io_start".into(),
                attached: true,
            },
            ProbeStatus {
                program: "sys_enter_futex_waitv".into(),
                attached: false,
            },
        ],
        postgres_binaries: PostgresBinaries {
            attached: 2,
            refused: 3,
            detached: 4,
        },
        heap: Some(Heap {
            in_use: 2 << 20,
            free: 5 << 20,
            mmapped: 0,
        }),
        drops: [1, 0, 2, 0, 5, 0, 0, 0, 0, 0],
        programs: vec![
            (
                "block_rq_complete".into(),
                ProgramStats {
                    run_time_ns: 123456789,
                    runs: 1000,
                    recursion_misses: 2,
                },
            ),
            (
                "sys_enter_pread64".into(),
                ProgramStats {
                    run_time_ns: 5,
                    runs: 1,
                    recursion_misses: 0,
                },
            ),
        ],
    };
    const _: () = assert!(DROP_REASONS == 10);
    r
}

/// The exposition cut into families (HELP, TYPE, samples), sorted by name; `# EOF` apart.
fn families(text: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for line in text.lines().filter(|l| *l != "# EOF") {
        if line.starts_with("# HELP ") || out.is_empty() {
            out.push(String::new());
        }
        let f = out.last_mut().expect("a family");
        f.push_str(line);
        f.push('\n');
    }
    out.sort();
    out
}

/// Families newer than `golden/`, with their last sample in `golden_readings`.
const NEWER_FAMILIES: [(&str, &str); 12] = [
    ("pgio_provisional_processes", "pgio_provisional_processes 1"),
    (
        "pgio_series_refused",
        r#"pgio_series_refused_total{app="postgres"} 7"#,
    ),
    (
        "pgio_label_values_truncated",
        "pgio_label_values_truncated_total 2",
    ),
    ("pgio_kernel_map_errors", "pgio_kernel_map_errors_total 1"),
    ("pgio_series", "pgio_series 5"),
    ("pgio_series_retired", "pgio_series_retired_total 0"),
    (
        "pgio_block_io_seconds",
        r#"pgio_block_io_seconds_bucket{le="+Inf",device="sdb",op="read",app="postgres",role="client backend",database="we\"ird\nname\\ x",user="ünï 🐘",pg_cluster="15/main",volume="pvc-b"} 1"#,
    ),
    (
        "pgio_block_io_lost_completions",
        r#"pgio_block_io_lost_completions_total{device="sdb",op="read",app="postgres",role="client backend",database="we\"ird\nname\\ x",user="ünï 🐘",pg_cluster="15/main",volume="pvc-b"} 3"#,
    ),
    (
        "pgio_postgres_binaries_attached",
        "pgio_postgres_binaries_attached 2",
    ),
    (
        "pgio_postgres_binaries_refused",
        "pgio_postgres_binaries_refused_total 3",
    ),
    (
        "pgio_postgres_binaries_detached",
        "pgio_postgres_binaries_detached_total 4",
    ),
    ("pgio_heap_bytes", r#"pgio_heap_bytes{state="mmapped"} 0"#),
];

#[test]
fn both_formats_equal_what_pgio_served_before_family_by_family() {
    let r = golden_readings();
    for (format, golden) in [
        (Format::Prometheus, include_str!("golden/exposition.txt")),
        (
            Format::OpenMetrics,
            include_str!("golden/exposition.openmetrics"),
        ),
    ] {
        let text = exposition(&r, format);
        let (mut got, want) = (families(&text), families(golden));
        // Families added after the golden files were written by the old encoder: their exact
        // text, then the rest compared with the golden files.
        for (name, sample) in NEWER_FAMILIES {
            let at = got
                .iter()
                .position(|f| {
                    // 0.0.4 text names a counter's family with its `_total` suffix.
                    [format!("# HELP {name} "), format!("# HELP {name}_total ")]
                        .iter()
                        .any(|h| f.starts_with(h.as_str()))
                })
                .unwrap_or_else(|| panic!("{format:?}: no family {name}"));
            let family = got.remove(at);
            assert!(
                family.ends_with(&format!("{sample}\n")),
                "{format:?}: {family}"
            );
        }
        assert_eq!(got.len(), 16, "{format:?}: families");
        for (g, w) in got.iter().zip(&want) {
            assert_eq!(g, w, "{format:?}");
        }
        assert_eq!(got, want, "{format:?}");
        assert_eq!(
            text.ends_with("# EOF\n"),
            format == Format::OpenMetrics,
            "{format:?}"
        );
    }
}

/// Label names of a sample line, in order; panics on a malformed line.
fn label_names(line: &str) -> Vec<String> {
    let Some(start) = line.find('{') else {
        return Vec::new();
    };
    let mut names = Vec::new();
    let mut rest = &line[start + 1..];
    loop {
        let (name, after) = rest.split_once("=\"").expect(line);
        names.push(name.to_owned());
        let mut chars = after.char_indices();
        let end = loop {
            match chars.next().expect(line) {
                (_, '\\') => {
                    chars.next();
                }
                (i, '"') => break i,
                _ => {}
            }
        };
        rest = &after[end + 1..];
        if let Some(r) = rest.strip_prefix(',') {
            rest = r;
        } else {
            assert!(rest.starts_with("} "), "{line}");
            return names;
        }
    }
}

fn one_request() -> Log2Hist {
    let mut h = Log2Hist::default();
    h.add(
        slot(100_000),
        &Bucket {
            count: 1,
            sum: 100_000,
            bytes: 4096,
        },
    );
    h
}

/// A replica (volume pvc-a) reads its backing disk vda and, like a Postgres backend
/// (no volume), the Longhorn device sdb of volume pvc-b.
fn longhorn_fixture(replica_volume: &str, device_volume: &str) -> Readings {
    let mut r = Readings::default();
    let replica = r.tracked.registry.intern(Labels {
        volume: replica_volume.into(),
        ..Labels::app_role("longhorn", "replica")
    });
    let backend = r
        .tracked
        .registry
        .intern(Labels::app_role("postgres", "client backend"));
    let (vda, sdb) = (mkdev(253, 0), mkdev(8, 16));
    for (series, dev) in [(replica, vda), (replica, sdb), (backend, sdb)] {
        for metric in [BlockMetric::Device, BlockMetric::Queue] {
            let id = block(series, dev, BlockOp::Read, metric);
            r.block.0.insert(id, one_request());
        }
    }
    r.names = vec![(vda, "vda".into()), (sdb, "sdb".into())];
    r.volumes = vec![(sdb, device_volume.into())];
    r
}

fn samples<'a>(text: &'a str, prefix: &str) -> Vec<&'a str> {
    text.lines()
        .filter(|l| l.starts_with(prefix) && !l.contains("_bucket{"))
        .collect()
}

#[test]
fn block_series_volume_is_the_devices_else_the_submitters() {
    let text = exposition_text_checked(longhorn_fixture("pvc-a", "pvc-b"));
    for family in [
        "pgio_block_io_device_seconds_count",
        "pgio_block_io_queue_seconds_count",
        "pgio_block_io_requests_total",
        "pgio_block_io_bytes_total",
    ] {
        let lines = samples(&text, &format!("{family}{{"));
        assert_eq!(
            lines
                .iter()
                .map(|l| l.rsplit_once(' ').map(|s| s.0))
                .collect::<Vec<_>>(),
            [
                Some(&*format!(
                    "{family}{{device=\"sdb\",op=\"read\",app=\"longhorn\",role=\"replica\",volume=\"pvc-b\"}}"
                )),
                Some(&*format!(
                    "{family}{{device=\"vda\",op=\"read\",app=\"longhorn\",role=\"replica\",volume=\"pvc-a\"}}"
                )),
                Some(&*format!(
                    "{family}{{device=\"sdb\",op=\"read\",app=\"postgres\",role=\"client backend\",volume=\"pvc-b\"}}"
                )),
            ],
            "{text}"
        );
    }
    let info = samples(&text, "pgio_device_info{");
    assert_eq!(
        info,
        [
            "pgio_device_info{device=\"sdb\",major=\"8\",minor=\"16\",volume=\"pvc-b\"} 1",
            "pgio_device_info{device=\"vda\",major=\"253\",minor=\"0\"} 1",
        ],
        "{text}"
    );
}

/// Encodes, and checks every line: a comment or a pgio sample whose label names are
/// unique.
fn exposition_text_checked(r: Readings) -> String {
    let text = exposition(&r, Format::Prometheus);
    for line in text.lines() {
        if line.starts_with("# ") {
            continue;
        }
        assert!(line.starts_with("pgio_"), "{line}");
        let names = label_names(line);
        let mut unique = names.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(names.len(), unique.len(), "duplicate label name: {line}");
    }
    text
}

#[test]
fn no_volume_anywhere_means_no_volume_label() {
    let text = exposition_text_checked(longhorn_fixture("", ""));
    assert!(!text.contains("volume="), "{text}");
}

#[test]
fn hostile_volume_names_stay_escaped_on_one_line() {
    let hostile = "pvc-\"x\"\n# EOF\\ ü} 1";
    let text = exposition_text_checked(longhorn_fixture(hostile, hostile));
    let escaped = r#"volume="pvc-\"x\"\n# EOF\\ ü} 1""#;
    // Every block sample (the replica's on vda too) and sdb's device_info carry it.
    let lines: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("pgio_") && l.contains("device=\""))
        .filter(|l| !l.starts_with("pgio_device_info{device=\"vda\""))
        .collect();
    assert!(lines.len() > 3 * 4, "{text}");
    for line in lines {
        assert!(line.contains(escaped), "{line}");
    }
}

/// The samples a protobuf exposition stands for, named and valued as in the text formats,
/// with `le` normalized to one float notation.
fn protobuf_samples(mut bytes: &[u8]) -> Vec<Sample> {
    use prometheus_client::encoding::prometheus_protobuf::prometheus_data_model as pb;
    use prost::Message;
    let mut out = Vec::new();
    while !bytes.is_empty() {
        let f = pb::MetricFamily::decode_length_delimited(&mut bytes).expect("a family");
        for m in &f.metric {
            let labels: BTreeMap<String, String> = m
                .label
                .iter()
                .map(|l| (l.name.clone(), l.value.clone()))
                .collect();
            let mut push = |suffix: &str, le: Option<f64>, value: f64| {
                let mut labels = labels.clone();
                if let Some(le) = le {
                    labels.insert("le".into(), format!("{le:e}"));
                }
                out.push(Sample {
                    name: format!("{}{suffix}", f.name),
                    labels,
                    value,
                });
            };
            if let Some(c) = &m.counter {
                push("", None, c.value);
            } else if let Some(g) = &m.gauge {
                push("", None, g.value);
            } else {
                let h = m.histogram.as_ref().expect("counter, gauge or histogram");
                push("_sum", None, h.sample_sum);
                push("_count", None, h.sample_count as f64);
                for b in &h.bucket {
                    push("_bucket", Some(b.upper_bound), b.cumulative_count as f64);
                }
                push("_bucket", Some(f64::INFINITY), h.sample_count as f64);
                // The native buckets hold the same observations.
                assert_eq!(h.schema, 0, "{}", f.name);
                assert!(h.zero_threshold > 0.0, "{}: marked native", f.name);
                let mut count = 0i64;
                let native: i64 = h
                    .positive_delta
                    .iter()
                    .map(|d| {
                        count += d;
                        count
                    })
                    .sum();
                assert_eq!(
                    native as u64 + h.zero_count,
                    h.sample_count,
                    "{}: native buckets",
                    f.name
                );
            }
        }
    }
    out
}

fn sorted(mut samples: Vec<Sample>) -> Vec<Sample> {
    for s in &mut samples {
        if let Some(le) = s.labels.get_mut("le") {
            *le = format!("{:e}", le.parse::<f64>().expect("le"));
        }
    }
    samples.sort_by(|a, b| (&a.name, &a.labels).cmp(&(&b.name, &b.labels)));
    samples
}

#[test]
fn protobuf_carries_every_text_sample_plus_native_histograms() {
    let r = golden_readings();
    let text = Metrics::parse(&exposition(&r, Format::Prometheus)).expect("text");
    let proto = sorted(protobuf_samples(&exposition_bytes(&r, Format::Protobuf)));
    let text = sorted(text.all().to_vec());
    assert_eq!(proto.len(), text.len());
    for (p, t) in proto.iter().zip(&text) {
        assert_eq!((&p.name, &p.labels), (&t.name, &t.labels));
        // Text writes a sum in shortest round-trip notation; protobuf carries the f64.
        assert!(
            (p.value - t.value).abs() <= 1e-9 * t.value.abs(),
            "{p:?} vs {t:?}"
        );
    }
    // Hostile values cross unescaped.
    assert!(
        proto
            .iter()
            .any(|s| s.labels.get("database").map(String::as_str) == Some("we\"ird\nname\\ x"))
    );
}

/// Labels of the series label set (`labels::Labels`), written "series" in the catalog.
const SERIES_LABELS: [&str; 9] = [
    "app",
    "role",
    "database",
    "user",
    "pg_cluster",
    "volume",
    "namespace",
    "pod",
    "container",
];

/// `name: "pgio_…"` of every `MetricFamily` static in pgio-daemon/src, tests left out.
fn declared_families() -> Vec<String> {
    fn walk(dir: &std::path::Path, out: &mut Vec<String>) {
        for e in std::fs::read_dir(dir).expect("src dir") {
            let path = e.expect("dir entry").path();
            if path.is_dir() {
                walk(&path, out);
            } else if path.extension().is_some_and(|x| x == "rs") {
                let text = std::fs::read_to_string(&path).expect("source file");
                let code = text.split("#[cfg(test)]").next().unwrap_or_default();
                let mut lines = code.lines();
                while let Some(line) = lines.next() {
                    if line.contains(": MetricFamily = MetricFamily {") {
                        let name = lines.next().expect("name line");
                        let name = name.trim().trim_start_matches("name: \"");
                        out.push(name.trim_end_matches("\",").to_owned());
                    }
                }
            }
        }
    }
    let mut out = Vec::new();
    walk(
        &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src"),
        &mut out,
    );
    out
}

/// One family of the catalog: (name, type, labels in order of first use, help).
fn catalog(openmetrics: &str) -> Vec<(String, String, Vec<String>, String)> {
    let mut out: Vec<(String, String, Vec<String>, String)> = Vec::new();
    for line in openmetrics.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest.split_once(' ').expect("HELP name text");
            out.push((name.into(), String::new(), Vec::new(), help.into()));
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let f = out.last_mut().expect("TYPE after HELP");
            f.1 = rest.split_once(' ').expect("TYPE name type").1.into();
        } else if !line.starts_with('#') {
            let f = out.last_mut().expect("sample after HELP");
            for name in label_names(line) {
                if name != "le" && !f.2.contains(&name) {
                    f.2.push(name);
                }
            }
        }
    }
    out
}

/// docs/metrics.md, from the exposition of every family (`all_families`): names, types,
/// labels and help as pgio serves them. `PGIO_BLESS=1` rewrites it.
#[test]
fn docs_metrics_md_is_the_catalog_of_every_declared_family() {
    let r = all_families();
    let text =
        String::from_utf8(all_families_bytes(&r, Format::OpenMetrics)).expect("UTF-8 exposition");
    let families = catalog(&text);
    let served: Vec<&str> = families.iter().map(|f| f.0.as_str()).collect();
    let declared = declared_families();
    assert!(declared.len() >= 44, "{declared:?}");
    for name in &declared {
        assert!(
            served.contains(&name.as_str()),
            "{name} is declared but all_families() does not show it: give it a reading"
        );
    }
    assert_eq!(served.len(), declared.len(), "{served:?}");
    let mut md = String::from(
        "# Metrics\n\n\
         Every metric family pgio serves, in `/metrics` order. Generated from the code (the \
         exposition test's readings of every family: `PGIO_BLESS=1 cargo test -p pgio-daemon \
         --test exposition` rewrites this file, and the test fails when it is out of date). \
         Histograms are served classic (`_bucket`, `_sum`, `_count`) and, to protobuf \
         scrapers, native. **series** stands for the labels of the process series that did \
         the IO: `app`, `role`, `database`, `user`, `pg_cluster`, `volume`, `namespace`, `pod`, \
         `container`, each left out when empty ([labels and bounds](labels-and-bounds.md)).\n\n\
         | metric | type | labels | help |\n|---|---|---|---|\n",
    );
    for (name, kind, labels, help) in &families {
        let name = if kind == "counter" {
            format!("{name}_total")
        } else {
            name.clone()
        };
        let mut shown: Vec<String> = Vec::new();
        for l in labels {
            let l = if SERIES_LABELS.contains(&l.as_str()) {
                "**series**".to_owned()
            } else {
                format!("`{l}`")
            };
            if !shown.contains(&l) {
                shown.push(l);
            }
        }
        // OpenMetrics escapes `"`, `\` and newlines in HELP; Markdown wants `|` escaped.
        let help = help
            .replace("\\\"", "\"")
            .replace("\\n", " ")
            .replace("\\\\", "\\")
            .replace('|', "\\|");
        md.push_str(&format!(
            "| `{name}` | {kind} | {} | {help} |\n",
            shown.join(", ")
        ));
    }
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/metrics.md");
    if std::env::var_os("PGIO_BLESS").is_some() {
        std::fs::write(&path, &md).expect("writing docs/metrics.md");
    }
    let want = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        md == want,
        "docs/metrics.md is out of date: PGIO_BLESS=1 cargo test -p pgio-daemon --test exposition"
    );
}
