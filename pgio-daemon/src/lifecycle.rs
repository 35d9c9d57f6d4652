//! Userspace side of the lifecycle probes: decodes the `LIFECYCLE` ring buffer (fork, exec,
//! exit, and titles from the `init_ps_display` uretprobe) for discovery, and attaches the
//! uprobes on PostgreSQL's functions to each postgres binary while a postmaster runs it.
use std::{
    borrow::Cow,
    collections::{HashMap, HashSet},
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
};

use anyhow::{Context as _, Result};
use aya::{
    Ebpf,
    maps::{MapData, RingBuf},
    programs::{
        UProbe,
        uprobe::{UProbeLinkId, UProbeScope},
    },
};
use pgio_common::lifecycle::{LifecycleEvent, LifecycleKind, TITLE_HEAD};
use tracing::{debug, info, warn};

use crate::{
    exposition::{Encoder, Kind, MetricFamily},
    family::{Attach, Family, Probe, Taken},
    lock,
    maps::take_map,
};

pub static MAX_POSTGRES_BINARIES: crate::config::Key = crate::config::Key::at_least(
    "max_postgres_binaries",
    64,
    0,
    "postgres binaries carrying pgio's uprobes at once (binaries not owned by root: three quarters of it); past it a binary is refused until another's processes are gone; 0 attaches none",
);
static CONFIG_KEYS: &[&crate::config::Key] = &[&MAX_POSTGRES_BINARIES];

const RING_MAP: &str = "LIFECYCLE";

/// The lifecycle family (`Family`): fork, exec, exit and PostgreSQL's titles, for discovery
/// (which takes the ring itself: `take_ring`).
pub struct LifecycleFamily;

impl Family for LifecycleFamily {
    fn config_keys(&self) -> &'static [&'static crate::config::Key] {
        CONFIG_KEYS
    }

    fn name(&self) -> &'static str {
        "lifecycle"
    }

    fn probes(&self) -> Vec<Probe> {
        vec![
            Probe::new("sched_process_fork", Attach::BtfTracePoint, false),
            Probe::new("sched_process_exec", Attach::TracePoint("sched"), false),
            Probe::new("sched_process_exit", Attach::TracePoint("sched"), false),
            // PostgreSQL's `init_ps_display` returns with the title written (program and
            // function share the name). Without it, a new backend is classified from /proc
            // a few ms after fork.
            Probe::new(
                "init_ps_display",
                Attach::URetProbeLater {
                    function: "init_ps_display",
                },
                true,
            ),
        ]
    }

    fn maps(&self) -> &'static [&'static str] {
        &[RING_MAP, "TITLES_SENT", "EARLY_FORKS"]
    }

    fn take(&self, _: &mut Ebpf, _: &crate::config::Config) -> Result<Taken> {
        Ok(Taken::default())
    }
}

pub fn take_ring(ebpf: &mut Ebpf) -> Result<RingBuf<MapData>> {
    take_map(ebpf, RING_MAP)
}

pub enum Event {
    Lifecycle(LifecycleEvent),
    Titled { pid: u32, title: String },
}

/// Everything the ring holds now.
pub fn drain(ring: &mut RingBuf<MapData>) -> Vec<Event> {
    let mut out = Vec::new();
    while let Some(item) = ring.next() {
        let kind = item
            .get(..4)
            .map(|b| u32::from_ne_bytes([b[0], b[1], b[2], b[3]]));
        if kind == Some(LifecycleKind::Titled as u32) && item.len() > TITLE_HEAD {
            // Only the title's bytes were sent (`TITLE_HEAD` + its `len`).
            let word = |at: usize| {
                u32::from_ne_bytes([item[at], item[at + 1], item[at + 2], item[at + 3]])
            };
            let (pid, len) = (word(4), word(8) as usize);
            let title = &item[TITLE_HEAD..];
            let bytes = &title[..len.min(title.len())];
            let bytes = bytes.split(|&b| b == 0).next().unwrap_or_default();
            out.push(Event::Titled {
                pid,
                title: String::from_utf8_lossy(bytes).into_owned(),
            });
        } else if item.len() >= std::mem::size_of::<LifecycleEvent>() {
            // SAFETY: the kernel wrote a LifecycleEvent (repr(C), plain integers); unaligned read.
            out.push(Event::Lifecycle(unsafe {
                std::ptr::read_unaligned(item.as_ptr() as *const LifecycleEvent)
            }));
        }
    }
    out
}

/// Counts of [`PostgresProbes`], shared with `/metrics` (`self_metrics`).
#[derive(Debug, Default)]
pub struct PostgresProbeStats {
    /// Binaries with probes attached now.
    pub binaries_attached: AtomicU64,
    /// Binaries not attached because the cap was reached: once per binary and run (a binary
    /// whose processes all went and that comes back counts again).
    pub binaries_refused: AtomicU64,
    /// Binaries detached because no process ran them any more.
    pub binaries_detached: AtomicU64,
}

impl PostgresProbeStats {
    /// The counts now, for a scrape.
    pub fn read(&self) -> PostgresBinaries {
        PostgresBinaries {
            attached: self.binaries_attached.load(Ordering::Relaxed),
            refused: self.binaries_refused.load(Ordering::Relaxed),
            detached: self.binaries_detached.load(Ordering::Relaxed),
        }
    }
}

/// `lifecycle::PostgresProbeStats` read at a scrape.
#[derive(Clone, Copy, Debug, Default)]
pub struct PostgresBinaries {
    pub attached: u64,
    pub refused: u64,
    pub detached: u64,
}

static POSTGRES_BINARIES_ATTACHED: MetricFamily = MetricFamily {
    name: "pgio_postgres_binaries_attached",
    help: "Postgres binaries carrying pgio's uprobes now (at most max_postgres_binaries); a binary's uprobes are detached at the first rescan after no postmaster runs it.",
    kind: Kind::Gauge,
};
static POSTGRES_BINARIES_REFUSED: MetricFamily = MetricFamily {
    name: "pgio_postgres_binaries_refused",
    help: "Postgres binaries not given uprobes because max_postgres_binaries were attached (binaries not owned by root: three quarters of it); tried again at each rescan. Their backends are classified from /proc, without titles from the kernel or query metrics.",
    kind: Kind::Counter,
};
static POSTGRES_BINARIES_DETACHED: MetricFamily = MetricFamily {
    name: "pgio_postgres_binaries_detached",
    help: "Postgres binaries whose uprobes were detached because no postmaster ran them any more.",
    kind: Kind::Counter,
};
impl PostgresBinaries {
    /// Writes the families above (in `self_metrics`' order).
    pub fn encode(&self, enc: &mut Encoder) {
        let b = self;
        enc.family(&POSTGRES_BINARIES_ATTACHED)
            .gauge((), b.attached as i64);
        enc.family(&POSTGRES_BINARIES_REFUSED)
            .counter((), b.refused);
        enc.family(&POSTGRES_BINARIES_DETACHED)
            .counter((), b.detached);
    }
}

/// A binary by `(st_dev, st_ino)`: the same file under several paths, or in several
/// containers of one image layer on one mount, is one binary.
type BinaryId = (u64, u64);

struct Binary {
    /// Postmasters seen running it: when none is left, its probes go.
    pids: HashSet<u32>,
    probes: BinaryProbes,
}

enum BinaryProbes {
    /// (program name, link) of each program attached; none when the binary has none of the
    /// functions (not PostgreSQL): not tried again while its processes run.
    Attached(Vec<(&'static str, UProbeLinkId)>),
    /// Not attached because the cap was reached: tried again at its next `attach_for`.
    Refused,
}

/// Attaches the probes on PostgreSQL's own functions (the title uretprobe, the query uprobes:
/// `probes::per_binary`) to each distinct postgres executable the first time one of its
/// postmasters is seen, and detaches them (closing their fds) once no postmaster runs it
/// (`prune`, at each rescan). At most `max_binaries` binaries hold probes at once; binaries
/// not owned by root get at most three quarters of them, so that processes of unprivileged
/// users cannot take every place from an installed PostgreSQL.
pub struct PostgresProbes {
    ebpf: Arc<Mutex<Ebpf>>,
    binaries: HashMap<BinaryId, Binary>,
    /// The programs attached to each binary.
    probes: Vec<Probe>,
    /// `max_postgres_binaries` in the config.
    max_binaries: usize,
    stats: Arc<PostgresProbeStats>,
}

impl PostgresProbes {
    pub fn new(
        ebpf: Arc<Mutex<Ebpf>>,
        probes: Vec<Probe>,
        max_binaries: usize,
        stats: Arc<PostgresProbeStats>,
    ) -> PostgresProbes {
        PostgresProbes {
            ebpf,
            binaries: HashMap::new(),
            probes,
            max_binaries,
            stats,
        }
    }

    /// Attaches to the executable of postmaster `pid` unless already done (or refused, and
    /// still no room). `/proc/<pid>/exe` reaches the binary also inside another mount
    /// namespace.
    pub fn attach_for(&mut self, pid: u32) {
        use std::os::unix::fs::MetadataExt;
        // Opened once: the process may exit between two attaches, its binary stays open here.
        let Ok(file) = std::fs::File::open(format!("/proc/{pid}/exe")) else {
            return;
        };
        let Ok(meta) = file.metadata() else {
            return;
        };
        let id = (meta.dev(), meta.ino());
        let refused_before = match self.binaries.get_mut(&id) {
            Some(binary) => {
                binary.pids.insert(pid);
                match binary.probes {
                    BinaryProbes::Attached(_) => return,
                    BinaryProbes::Refused => true,
                }
            }
            None => false,
        };
        let probes = if self.has_room(meta.uid()) {
            let links = attach_binary(&self.ebpf, &self.probes, &file, pid);
            if !links.is_empty() {
                self.stats.binaries_attached.fetch_add(1, Ordering::Relaxed);
            }
            BinaryProbes::Attached(links)
        } else {
            if !refused_before {
                self.stats.binaries_refused.fetch_add(1, Ordering::Relaxed);
                debug!(
                    pid,
                    max_postgres_binaries = self.max_binaries,
                    "postgres binary not attached: too many binaries attached"
                );
            }
            BinaryProbes::Refused
        };
        let binary = self.binaries.entry(id).or_insert_with(|| Binary {
            pids: HashSet::new(),
            probes: BinaryProbes::Refused,
        });
        binary.pids.insert(pid);
        binary.probes = probes;
    }

    /// Forgets the postmasters that exited (or exec'd another binary), and detaches the
    /// binaries none of them runs any more: their links (and fds) are closed.
    pub fn prune(&mut self) {
        use std::os::unix::fs::MetadataExt;
        let mut gone = Vec::new();
        for (id, binary) in &mut self.binaries {
            binary.pids.retain(|pid| {
                std::fs::metadata(format!("/proc/{pid}/exe"))
                    .is_ok_and(|m| (m.dev(), m.ino()) == *id)
            });
            if binary.pids.is_empty() {
                gone.push(*id);
            }
        }
        for id in gone {
            let Some(Binary {
                probes: BinaryProbes::Attached(links),
                ..
            }) = self.binaries.remove(&id)
            else {
                continue;
            };
            if links.is_empty() {
                continue;
            }
            detach_binary(&self.ebpf, links);
            self.stats.binaries_attached.fetch_sub(1, Ordering::Relaxed);
            self.stats.binaries_detached.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Whether a binary owned by `owner` may be attached now.
    fn has_room(&self, owner: u32) -> bool {
        let attached = self.stats.binaries_attached.load(Ordering::Relaxed) as usize;
        let limit = if owner == 0 {
            self.max_binaries
        } else {
            self.max_binaries - self.max_binaries / 4
        };
        attached < limit
    }
}

/// Attaches `probes` to the executable open as `file`; returns the links.
fn attach_binary(
    ebpf: &Mutex<Ebpf>,
    probes: &[Probe],
    file: &std::fs::File,
    pid: u32,
) -> Vec<(&'static str, UProbeLinkId)> {
    use std::os::unix::io::AsRawFd;
    let exe = format!("/proc/self/fd/{}", file.as_raw_fd());
    let binary = std::fs::read_link(&exe)
        .map(|p| p.display().to_string())
        .unwrap_or_default();
    let mut links = Vec::new();
    let mut ebpf = lock(ebpf);
    for probe in probes {
        let (Attach::URetProbeLater { function } | Attach::UProbeLater { function }) = probe.attach
        else {
            continue;
        };
        let Cow::Borrowed(program) = probe.program else {
            continue;
        };
        let result = ebpf
            .program_mut(program)
            .context("program missing")
            .and_then(|p| <&mut UProbe>::try_from(p).map_err(Into::into))
            .and_then(|p| {
                p.attach(function, &exe, UProbeScope::AllProcesses)
                    .map_err(Into::into)
            });
        match result {
            Ok(link) => {
                info!(pid, binary, function, "uprobe attached");
                links.push((program, link));
            }
            // PostgreSQL before 18 has no AIO: nothing is missing.
            Err(e) if function == "pgaio_wref_wait" => debug!(
                pid,
                binary,
                function,
                error = format!("{e:#}"),
                "uprobe not attached"
            ),
            // Without the title: classification from /proc a few ms after fork.
            Err(e) => warn!(
                pid,
                binary,
                function,
                error = format!("{e:#}"),
                "uprobe not attached"
            ),
        }
    }
    links
}

fn detach_binary(ebpf: &Mutex<Ebpf>, links: Vec<(&'static str, UProbeLinkId)>) {
    let mut ebpf = lock(ebpf);
    for (program, link) in links {
        let result = ebpf
            .program_mut(program)
            .context("program missing")
            .and_then(|p| <&mut UProbe>::try_from(p).map_err(Into::into))
            .and_then(|p| p.detach(link).map_err(Into::into));
        match result {
            Ok(()) => info!(program, "uprobe detached: no postmaster runs its binary"),
            Err(e) => warn!(program, error = format!("{e:#}"), "cannot detach uprobe"),
        }
    }
}
