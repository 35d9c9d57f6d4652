//! Userspace side of the lifecycle probes: decodes the `LIFECYCLE` ring buffer (fork, exec,
//! exit, and titles from the `init_ps_display` uretprobe) for discovery, and attaches that
//! uretprobe to each postgres binary.
use std::{
    collections::HashSet,
    sync::{Arc, Mutex},
};

use anyhow::{Context as _, Result};
use aya::{
    Ebpf,
    maps::{MapData, RingBuf},
    programs::{UProbe, uprobe::UProbeScope},
};
use pgio_common::lifecycle::{LifecycleEvent, LifecycleKind, TitleEvent};
use tracing::{debug, info, warn};

use crate::{
    lock,
    maps::take_map,
    probes::{Attach, POSTGRES_BINARY, ProbeFamily},
};

const RING_MAP: &str = "LIFECYCLE";

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
        if kind == Some(LifecycleKind::Titled as u32)
            && item.len() >= std::mem::size_of::<TitleEvent>()
        {
            // SAFETY: the kernel wrote a TitleEvent (repr(C), integers and bytes); unaligned read.
            let ev = unsafe { std::ptr::read_unaligned(item.as_ptr() as *const TitleEvent) };
            let len = (ev.len as usize).min(ev.title.len());
            let bytes = &ev.title[..len];
            let bytes = bytes.split(|&b| b == 0).next().unwrap_or_default();
            out.push(Event::Titled {
                pid: ev.pid,
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

/// Attaches the probes on PostgreSQL's own functions (the title uretprobe, the query uprobe:
/// `probes::POSTGRES_BINARY`) to each distinct postgres executable, the first time one of its
/// postmasters is seen (by inode: the same binary under several paths or in several
/// containers is attached once).
pub struct PostgresProbes {
    ebpf: Arc<Mutex<Ebpf>>,
    attached: HashSet<(u64, u64)>,
    /// `query_probes` in the config.
    queries: bool,
}

impl PostgresProbes {
    pub fn new(ebpf: Arc<Mutex<Ebpf>>, queries: bool) -> PostgresProbes {
        PostgresProbes {
            ebpf,
            attached: HashSet::new(),
            queries,
        }
    }

    /// Attaches to the executable of process `pid` unless already done. `/proc/<pid>/exe`
    /// reaches the binary also inside another mount namespace.
    pub fn attach_for(&mut self, pid: u32) {
        use std::os::unix::{fs::MetadataExt, io::AsRawFd};
        // Opened once: the process may exit between two attaches, its binary stays open here.
        let Ok(file) = std::fs::File::open(format!("/proc/{pid}/exe")) else {
            return;
        };
        let Ok(meta) = file.metadata() else {
            return;
        };
        if !self.attached.insert((meta.dev(), meta.ino())) {
            return;
        }
        let exe = format!("/proc/self/fd/{}", file.as_raw_fd());
        let binary = std::fs::read_link(&exe)
            .map(|p| p.display().to_string())
            .unwrap_or_default();
        let mut ebpf = lock(&self.ebpf);
        for probe in POSTGRES_BINARY {
            if probe.family == ProbeFamily::Query && !self.queries {
                continue;
            }
            let (Attach::URetProbeLater { function } | Attach::UProbeLater { function }) =
                probe.attach
            else {
                continue;
            };
            let result = ebpf
                .program_mut(&probe.program)
                .context("program missing")
                .and_then(|p| <&mut UProbe>::try_from(p).map_err(Into::into))
                .and_then(|p| {
                    p.attach(function, &exe, UProbeScope::AllProcesses)
                        .map_err(Into::into)
                });
            match result {
                Ok(_) => info!(pid, binary, function, "uprobe attached"),
                // PostgreSQL before 18 has no AIO: nothing is missing.
                Err(e) if function == "pgaio_wref_wait" => debug!(
                    pid,
                    binary,
                    function,
                    error = format!("{e:#}"),
                    "uprobe not attached"
                ),
                // Without the title: classification from /proc a few ms after fork; without
                // the query probe: no query metrics for this binary.
                Err(e) => warn!(
                    pid,
                    binary,
                    function,
                    error = format!("{e:#}"),
                    "uprobe not attached"
                ),
            }
        }
    }
}
