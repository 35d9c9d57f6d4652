//! Userspace side of the query family: reads `QUERY_HIST` at scrape time and writes
//! `pgio_query_seconds`, `pgio_query_io_seconds`, `pgio_query_read_miss_seconds`,
//! `pgio_query_cache_misses_total`, and the encrypted connections' flags
//! (`pgio_query_multi_send_total`, `pgio_query_encrypted_connections_total`).
pub mod backend_status;

use anyhow::Result;
use aya::Ebpf;
use pgio_common::{
    SeriesId,
    kernel_offsets::KernelOffsets,
    query::{QUOTA, QueryKey, QueryMetric, QueryRow, ROW_METRICS, Wire},
    query_wait::Part,
};

use crate::{
    classifier::Classifier,
    collector::Scrape,
    config::Config,
    exposition::{Encoder, Kind, MetricFamily},
    family::{Attach, Family, Probe, Setup, Taken},
    hist::{HistId, HistKey, HistMapSpec, HistSnapshot, HistSource, HistValue, Hists},
    labels::WithLabels,
    syscall::SCHED_SWITCH,
};

pub static QUERIES: crate::config::Key = crate::config::Key::flag(
    "queries",
    true,
    "query time and IO share (pgio_query_seconds, …) from the client backends' recvfrom/sendto tracepoints: no uprobe, no extra capability",
);
pub static QUERY_PROBES: crate::config::Key = crate::config::Key::flag(
    "query_probes",
    false,
    "with queries, on a kernel without sched_info only: a uprobe on PostgreSQL 18's pgaio_wref_wait counts io_method = worker waits as query IO time; uprobes need CAP_SYS_ADMIN on kernels ≥ 6.16 and patched stable ones",
);
pub static QUERY_ARGS_AT_ENTRY: crate::config::Key = crate::config::Key::flag(
    "query_args_at_entry",
    false,
    "keep the socket calls' arguments at their entry even where their exits read them from the registers (the path of kernels < 5.15; for tests and comparisons), ~0.2 µs more per query",
);
static CONFIG_KEYS: &[&crate::config::Key] = &[&QUERIES, &QUERY_PROBES, &QUERY_ARGS_AT_ENTRY];

pub static HIST: HistMapSpec = HistMapSpec {
    family: "query",
    map: "QUERY_HIST",
    quota: QUOTA,
};
/// The eBPF global that turns the syscall exits' query bookkeeping on (`queries`).
const ENABLED_GLOBAL: &str = "QUERIES_ON";
/// The eBPF global that turns `query_wait`'s bookkeeping on (with `queries`; the kernel
/// also needs `sched_info`).
const WAIT_GLOBAL: &str = "QUERY_WAIT_ON";

/// The query family (`Family`): tracepoints on the client-socket syscalls, and with
/// `query_probes` uprobes on PostgreSQL 18's AIO wait, attached per binary.
pub struct QueryFamily;

fn queries(config: &Config) -> bool {
    config.flag(&QUERIES)
}

fn args_at_entry(kernel: &KernelOffsets) -> bool {
    kernel.syscall_args_from_regs == 0
}

fn aio_probes(config: &Config) -> bool {
    config.flag(&QUERIES) && config.flag(&QUERY_PROBES)
}

/// A kernel where `query_wait` cannot run (no `sched_info`): only there do the AIO uprobes
/// add anything. Elsewhere the wait events count those waits, and the uprobes' traps would
/// only slow the backend (a cold PostgreSQL 18 scan's IO time fell from 95 % of
/// `pg_stat_io.read_time` to 74-79 % with them attached).
fn no_wait_events(kernel: &KernelOffsets) -> bool {
    kernel.task_run_delay == 0 || kernel.task_state == 0
}

impl Family for QueryFamily {
    fn config_keys(&self) -> &'static [&'static crate::config::Key] {
        CONFIG_KEYS
    }

    fn name(&self) -> &'static str {
        "query"
    }

    fn probes(&self) -> Vec<Probe> {
        // They take the running thread's ids from the syscall family's per-CPU slot, which
        // `sched_switch` resets.
        let socket = |program| {
            Probe::new(program, Attach::TracePoint("syscalls"), true)
                .when(queries)
                .after(SCHED_SWITCH)
        };
        // Where the exits cannot read the call's arguments from the saved registers.
        let keeps_args = |program| socket(program).on_kernels(args_at_entry);
        vec![
            // A client backend reads requests and writes replies on its client socket: the
            // replies' ReadyForQuery (or, encrypted, the rhythm) delimit its queries.
            keeps_args("sys_enter_recvfrom"),
            socket("sys_exit_recvfrom"),
            keeps_args("sys_enter_sendto"),
            socket("sys_exit_sendto"),
            // PostgreSQL 18's wait for an asynchronous IO (with `io_method = worker` an io
            // worker does the read): its time is the query's IO time. Absent before 18; on
            // kernels with wait events (`query_wait`) not needed.
            Probe::new(
                "pgaio_wref_wait",
                Attach::UProbeLater {
                    function: "pgaio_wref_wait",
                },
                true,
            )
            .when(aio_probes)
            .on_kernels(no_wait_events)
            .after(SCHED_SWITCH),
            Probe::new(
                "pgaio_wref_wait_return",
                Attach::URetProbeLater {
                    function: "pgaio_wref_wait",
                },
                true,
            )
            .when(aio_probes)
            .on_kernels(no_wait_events)
            .after(SCHED_SWITCH),
        ]
    }

    fn maps(&self) -> &'static [&'static str] {
        &[
            "QUERY_HIST",
            "QUERY",
            "QUERY_RUNS",
            "CONNECTED",
            "QUERY_WAIT",
        ]
    }

    fn globals(&self) -> &'static [&'static str] {
        &[ENABLED_GLOBAL, WAIT_GLOBAL]
    }

    fn hist_map(&self) -> Option<&'static HistMapSpec> {
        Some(&HIST)
    }

    fn setup(&self, config: &Config) -> Setup {
        Setup {
            map_sizes: vec![(HIST.map, entries(config))],
            globals: vec![
                (ENABLED_GLOBAL, vec![u8::from(config.flag(&QUERIES))]),
                (WAIT_GLOBAL, vec![u8::from(config.flag(&QUERIES))]),
            ],
        }
    }

    fn take(&self, ebpf: &mut Ebpf, config: &Config) -> Result<Taken> {
        let hists = HistSource::<QueryKey>::take(ebpf, &HIST, entries(config))?;
        Ok(Taken {
            balanced: Some(hists.balanced()),
            source: Some(Box::new(hists)),
        })
    }
}

/// Rows of `QUERY_HIST`: one per (series, wire), each holding that key's every histogram
/// (1.5 KiB): a sixty-fourth of `hist_map_max_entries` (1,024 by default, 1.6 MiB), at least
/// 1,024.
fn entries(config: &Config) -> u32 {
    (crate::hist::entries(config) / 64).max(1024)
}

impl HistValue for QueryRow {
    fn merge(&mut self, o: &QueryRow) {
        for (a, b) in self.slots.iter_mut().zip(&o.slots) {
            for (x, y) in a.iter_mut().zip(b) {
                *x = x.wrapping_add(*y);
            }
        }
        for (x, y) in self.sum_ns.iter_mut().zip(&o.sum_ns) {
            *x = x.wrapping_add(*y);
        }
        for (x, y) in self.zeros.iter_mut().zip(&o.zeros) {
            *x = x.wrapping_add(*y);
        }
        self.misses = self.misses.wrapping_add(o.misses);
        self.multi_send = self.multi_send.wrapping_add(o.multi_send);
        self.encrypted_connections = self
            .encrypted_connections
            .wrapping_add(o.encrypted_connections);
        for (x, y) in self.parts_ns.iter_mut().zip(&o.parts_ns) {
            *x = x.wrapping_add(*y);
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct QueryId {
    pub series: SeriesId,
    pub metric: QueryMetric,
    pub wire: Wire,
    /// `QueryMetric::Part`'s part (`Part::Cpu` for the other metrics).
    pub part: Part,
}

impl HistKey for QueryKey {
    type Id = QueryId;
    type Value = QueryRow;

    fn series(&self) -> SeriesId {
        self.series
    }

    /// A histogram for each metric the row has counts of: its duration histogram carries the
    /// misses; the encrypted connections' counters are counts (slot 0).
    fn add_to(&self, series: SeriesId, row: &QueryRow, hists: &mut Hists<QueryId>) -> bool {
        let Ok(wire) = u8::try_from(self.wire)
            .map_err(|_| ())
            .and_then(|w| Wire::try_from(w).map_err(|_| ()))
        else {
            return false;
        };
        let id = |metric| QueryId {
            series,
            metric,
            wire,
            part: Part::Cpu,
        };
        for (m, metric) in ROW_METRICS.into_iter().enumerate() {
            let mut slots = row.slots[m];
            slots[0] = slots[0].wrapping_add(row.zeros[m]);
            if slots.iter().all(|&n| n == 0) {
                continue;
            }
            let h = hists.entry(id(metric)).or_default();
            h.add_row(&slots, row.sum_ns[m]);
            if metric == QueryMetric::Duration {
                h.bytes = h.bytes.wrapping_add(row.misses);
            }
        }
        for (metric, n) in [
            (QueryMetric::MultiSend, row.multi_send),
            (QueryMetric::EncryptedConnections, row.encrypted_connections),
        ] {
            if n != 0 {
                let h = hists.entry(id(metric)).or_default();
                h.slots[0] = h.slots[0].wrapping_add(n);
            }
        }
        for (part, ns) in Part::ALL.into_iter().zip(row.parts_ns) {
            if ns != 0 {
                let h = hists.entry(QueryId {
                    part,
                    ..id(QueryMetric::Part)
                });
                let h = h.or_default();
                h.sum_ns = h.sum_ns.wrapping_add(ns);
            }
        }
        true
    }
}

pub type QuerySnapshot = HistSnapshot<QueryId>;

static QUERY_SECONDS: MetricFamily = MetricFamily {
    name: "pgio_query_seconds",
    help: "PostgreSQL client backends' query duration (seconds). wire=plain: from reading the request (or, without waiting, the previous ReadyForQuery) to writing ReadyForQuery: one per simple Query, per extended sequence up to Sync, per pipelined Sync. wire=encrypted (TLS/GSSAPI): one per request/response cycle.",
    kind: Kind::Histogram,
};
static QUERY_IO_SECONDS: MetricFamily = MetricFamily {
    name: "pgio_query_io_seconds",
    help: "Time each query spent in IO, one observation per query: the backend's own IO syscalls (pread/pwrite/fsync/fdatasync/io_uring_enter, not futex waits), plus each wait under an IO wait event outside them (PostgreSQL 18's io workers reading for it), until the backend ran again (seconds). IO share: rate(pgio_query_io_seconds_sum) / rate(pgio_query_seconds_sum).",
    kind: Kind::Histogram,
};
static QUERY_READ_MISS_SECONDS: MetricFamily = MetricFamily {
    name: "pgio_query_read_miss_seconds",
    help: "Per query, the part of pgio_query_io_seconds spent in reads that missed the page cache (the reading thread submitted block IO), one observation per query (seconds).",
    kind: Kind::Histogram,
};
static QUERY_PART_SECONDS: MetricFamily = MetricFamily {
    name: "pgio_query_part_seconds",
    help: "Where the queries' time went, by part, adding up to pgio_query_seconds_sum: cpu (on CPU), runnable (waiting for a CPU: the backend's run-queue time, /proc/<pid>/schedstat), and PostgreSQL's wait_event_type (IO, Lock, LWLock, BufferPin, IPC, Timeout, Client, Extension, Activity, InjectionPoint): off CPU under the event set when the backend blocked, and on CPU inside an IO syscall under the event set around it (a read served from the page cache is IO); none: blocked with no wait event set; unknown: unreadable (seconds).",
    kind: Kind::Counter,
};
static QUERY_CACHE_MISSES: MetricFamily = MetricFamily {
    name: "pgio_query_cache_misses",
    help: "Reads during queries that submitted block IO (page-cache misses).",
    kind: Kind::Counter,
};
static QUERY_MULTI_SEND: MetricFamily = MetricFamily {
    name: "pgio_query_multi_send",
    help: "Encrypted request/response cycles whose reply took more than one send: a pipeline answered as one cycle (several queries counted as one), or a reply larger than PostgreSQL's 8 KiB send buffer.",
    kind: Kind::Counter,
};
static QUERY_ENCRYPTED_CONNECTIONS: MetricFamily = MetricFamily {
    name: "pgio_query_encrypted_connections",
    help: "Encrypted (TLS/GSSAPI) client connections started: each one's authentication round trips after the handshake count as cycles in pgio_query_seconds{wire=\"encrypted\"}.",
    kind: Kind::Counter,
};

impl HistId for QueryId {
    fn series(&self) -> SeriesId {
        self.series
    }

    fn encode(hists: &Hists<QueryId>, scrape: &mut Scrape<'_>, enc: &mut Encoder) {
        let labels = |id: &QueryId| WithLabels {
            series: scrape.series(id.series),
            extra: [("wire", id.wire.name())],
        };
        // A process the kernel saw as a new connection before pgio classified it, and that
        // turned out not to serve clients (a walsender): its replication commands are not
        // queries.
        let hists: Vec<_> = hists
            .iter()
            .filter(|(id, _)| Classifier::serves_clients(scrape.series(id.series)))
            .collect();
        let hists = hists.iter().copied();
        for (family, metric) in [
            (&QUERY_SECONDS, QueryMetric::Duration),
            (&QUERY_IO_SECONDS, QueryMetric::Io),
            (&QUERY_READ_MISS_SECONDS, QueryMetric::ReadMiss),
        ] {
            let mut f = enc.family(family);
            for (id, h) in hists.clone().filter(|(id, _)| id.metric == metric) {
                f.histogram(labels(id), h);
            }
        }
        let mut f = enc.family(&QUERY_CACHE_MISSES);
        for (id, h) in hists.clone() {
            if id.metric == QueryMetric::Duration {
                f.counter(labels(id), h.bytes);
            }
        }
        let mut f = enc.family(&QUERY_PART_SECONDS);
        for (id, h) in hists
            .clone()
            .filter(|(id, _)| id.metric == QueryMetric::Part)
        {
            let labels = WithLabels {
                series: scrape.series(id.series),
                extra: [("wire", id.wire.name()), ("part", id.part.name())],
            };
            f.counter_f64(labels, h.sum_ns as f64 / 1e9);
        }
        for (family, metric) in [
            (&QUERY_MULTI_SEND, QueryMetric::MultiSend),
            (
                &QUERY_ENCRYPTED_CONNECTIONS,
                QueryMetric::EncryptedConnections,
            ),
        ] {
            let mut f = enc.family(family);
            for (id, h) in hists.clone().filter(|(id, _)| id.metric == metric) {
                f.counter(labels(id), h.count());
            }
        }
    }
}
