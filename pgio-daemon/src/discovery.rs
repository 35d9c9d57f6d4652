//! Discovery: a /proc scan at start (and periodically, as a safety net), then the kernel's
//! lifecycle events: exec → classify now; fork of a tracked process → the child already
//! inherited its parent's series in the kernel, reclassify it as its title settles
//! (Postgres sets the backend title within milliseconds of fork); exit → forget.
use std::{
    cmp::Reverse,
    collections::{BinaryHeap, HashMap},
    sync::{Arc, Mutex, MutexGuard},
    time::Duration,
};

use anyhow::{Context as _, Result};
use aya::maps::{Array, MapData, RingBuf};
use pgio_common::{
    PROVISIONAL, SERIES_UNTRACKED,
    lifecycle::{LifecycleEvent, LifecycleKind, TitleEvent},
};
use tokio::{
    io::{Interest, unix::AsyncFd},
    time::{Instant, sleep_until},
};
use tracing::{debug, warn};

use crate::{
    classifier::{Classifier, ProcessInfo},
    labels::Labels,
    probes::TitleProbe,
    provisional::Provisional,
    series::SeriesRegistry,
};

/// After a fork: the pauses between looks at the child's title, until it is settled. Dense
/// at first: a new backend sets its title within about a millisecond and reads right after;
/// tokio's timer cannot wait less than 1 ms.
const RECLASSIFY_AFTER: [Duration; 14] = [
    Duration::ZERO,
    Duration::from_millis(1),
    Duration::from_millis(1),
    Duration::from_millis(1),
    Duration::from_millis(1),
    Duration::from_millis(2),
    Duration::from_millis(2),
    Duration::from_millis(4),
    Duration::from_millis(4),
    Duration::from_millis(10),
    Duration::from_millis(25),
    Duration::from_millis(50),
    Duration::from_millis(400),
    Duration::from_millis(1500),
];

const PF_KTHREAD: u32 = 0x0020_0000;
/// Set on the leader before the kernel reports its exit, and readable in /proc until the parent
/// reaps it (or, for a process with live threads, until they exit).
const PF_EXITING: u32 = 0x0000_0004;

/// What the collector needs from discovery: series labels and who is tracked now.
#[derive(Default, Debug)]
pub struct Tracked {
    pub registry: SeriesRegistry,
    /// tgid → series, mirror of the kernel's `TRACKED` map (a provisional process: its
    /// cluster's `starting` series).
    pub pids: HashMap<u32, u32>,
    pub provisional: Provisional,
    /// Tracked processes a rescan found gone with no exit event handled: lost events, or a
    /// process tracked again after its exit. Stays 0 when discovery is right.
    pub exits_missed: u64,
}

impl Tracked {
    /// Where the readers send each histogram key's series.
    pub fn provisional_routes(&self) -> Provisional {
        self.provisional.clone()
    }
}

pub type SharedTracked = Arc<Mutex<Tracked>>;

pub fn lock(t: &SharedTracked) -> MutexGuard<'_, Tracked> {
    // A panic while holding the lock leaves plain data that is still consistent enough to read.
    t.lock().unwrap_or_else(|e| e.into_inner())
}

pub fn read_process(pid: u32) -> Option<ProcessInfo> {
    let p = procfs::process::Process::new(pid as i32).ok()?;
    let stat = p.stat().ok()?;
    let ppid = stat.ppid;
    let argv = p.cmdline().ok().unwrap_or_default();
    let exe = p.exe().ok().map(|e| e.to_string_lossy().into_owned());
    let mut info = ProcessInfo {
        pid,
        comm: stat.comm,
        cmdline: argv.join(" "),
        argv,
        exe,
        cwd: None,
        parent_comm: None,
        kthread: stat.flags & PF_KTHREAD != 0,
        // The exit event comes after PF_EXITING is set and before the address space (the
        // title) is gone: a read in between must not track a process no event will untrack.
        exiting: stat.flags & PF_EXITING != 0,
    };
    if crate::classifier::postgres::is_postgres(&info) {
        // Only once it is the data directory: a postmaster changes into it after exec.
        let in_data_dir = std::path::Path::new(&format!("/proc/{pid}/cwd/PG_VERSION")).exists();
        info.cwd = p
            .cwd()
            .ok()
            .filter(|_| in_data_dir)
            .map(|c| c.to_string_lossy().into_owned());
        info.parent_comm = procfs::process::Process::new(ppid)
            .and_then(|parent| parent.stat())
            .ok()
            .map(|s| s.comm);
    }
    Some(info)
}

/// Reads and classifies every process in /proc (the start-up scan, and the periodic rescan).
pub fn classify_all(classifier: &Classifier) -> Result<Vec<(u32, Option<Labels>)>> {
    let mut pids = Vec::new();
    for p in procfs::process::all_processes().context("listing /proc")? {
        let Ok(p) = p else { continue };
        pids.push(p.pid as u32);
    }
    Ok(classify_pids(classifier, &pids))
}

/// Reads all processes first and lets the classifier learn from all of them (a postmaster's
/// cluster name is only in its children's titles), then classifies each.
pub fn classify_pids(classifier: &Classifier, pids: &[u32]) -> Vec<(u32, Option<Labels>)> {
    let infos: Vec<(u32, Option<ProcessInfo>)> = pids
        .iter()
        .map(|&pid| (pid, read_process(pid).filter(|i| !i.exiting)))
        .collect();
    for info in infos.iter().filter_map(|(_, i)| i.as_ref()) {
        classifier.learn(info);
    }
    infos
        .into_iter()
        .map(|(pid, info)| (pid, info.and_then(|i| classifier.classify(&i))))
        .collect()
}

pub struct Discovery {
    classifier: Classifier,
    shared: SharedTracked,
    kernel_map: Array<MapData, u32>,
    /// The kernel's `CHILD_SERIES`: series → provisional series of its children.
    child_map: Array<MapData, u32>,
    titles: Option<TitleProbe>,
    pending: BinaryHeap<Reverse<(Instant, u32, usize)>>,
    self_pid: u32,
}

impl Discovery {
    pub fn new(
        classifier: Classifier,
        shared: SharedTracked,
        kernel_map: Array<MapData, u32>,
        child_map: Array<MapData, u32>,
        titles: Option<TitleProbe>,
    ) -> Discovery {
        {
            let mut t = lock(&shared);
            t.provisional.orphan = t.registry.intern(Classifier::orphan_child_labels());
        }
        Discovery {
            classifier,
            shared,
            kernel_map,
            child_map,
            titles,
            pending: BinaryHeap::new(),
            self_pid: std::process::id(),
        }
    }

    /// Classifies every process in /proc. Returns the tracked processes it did not find:
    /// their exit events, if any, are already in the ring (a process leaves /proc only after
    /// it has exited); see `forget_missed`.
    pub fn scan_all(&mut self) -> Result<Vec<u32>> {
        let classified = classify_all(&self.classifier)?;
        let mut seen = Vec::with_capacity(classified.len());
        for (pid, labels) in classified {
            seen.push(pid);
            if pid == self.self_pid {
                continue;
            }
            match labels {
                Some(labels) => self.track(pid, labels),
                None => self.untrack(pid),
            }
        }
        seen.sort_unstable();
        let gone = lock(&self.shared)
            .pids
            .keys()
            .copied()
            .filter(|pid| seen.binary_search(pid).is_err())
            .collect();
        lock(&self.shared)
            .provisional
            .expire(std::time::Instant::now());
        Ok(gone)
    }

    /// Call after handling the ring's events: processes a scan did not find and that are
    /// still tracked ended without an exit event.
    pub fn forget_missed(&mut self, gone: Vec<u32>) {
        let missed: Vec<u32> = {
            let shared = lock(&self.shared);
            gone.into_iter()
                .filter(|pid| shared.pids.contains_key(pid))
                .collect()
        };
        lock(&self.shared).exits_missed += missed.len() as u64;
        for pid in missed {
            self.untrack(pid);
        }
    }

    /// Returns whether the process's labels are final (nothing left to learn from a later
    /// look at its title).
    fn classify_now(&mut self, pid: u32) -> bool {
        if pid == self.self_pid {
            return true;
        }
        let info = read_process(pid);
        self.apply(pid, info)
    }

    fn apply(&mut self, pid: u32, info: Option<ProcessInfo>) -> bool {
        match info {
            Some(info) if info.exiting => {
                let labels = self.classifier.classify(&info);
                self.untrack(pid);
                if let Some(labels) = labels {
                    let mut shared = lock(&self.shared);
                    let id = shared.registry.intern(labels);
                    shared.provisional.classified_late(pid, id);
                }
                true
            }
            Some(info) => {
                if let Some(dir) = self.classifier.learn(&info) {
                    self.relabel_cluster(&dir);
                }
                match self.classifier.classify(&info) {
                    Some(labels) => {
                        let settled = Classifier::settled(&labels);
                        self.track(pid, labels);
                        settled
                    }
                    None => {
                        self.untrack(pid);
                        true
                    }
                }
            }
            None => {
                self.untrack(pid);
                true
            }
        }
    }

    /// A cluster's label just changed (its first auxiliary process told its cluster_name):
    /// classify again what was labelled with its data directory, i.e. the postmaster.
    fn relabel_cluster(&mut self, dir: &str) {
        let pids: Vec<u32> = {
            let shared = lock(&self.shared);
            shared
                .pids
                .iter()
                .filter(|(_, id)| {
                    shared
                        .registry
                        .labels(**id)
                        .is_some_and(|l| l.app == "postgres" && l.cluster == dir)
                })
                .map(|(pid, _)| *pid)
                .collect()
        };
        for pid in pids {
            if let Some(labels) = read_process(pid).and_then(|i| self.classifier.classify(&i)) {
                self.track(pid, labels);
            }
        }
    }

    fn track(&mut self, pid: u32, labels: Labels) {
        let mut shared = lock(&self.shared);
        if let Some(child) = Classifier::child_labels(&labels) {
            let (parent, child) = (
                shared.registry.intern(labels.clone()),
                shared.registry.intern(child),
            );
            // Ids past the array's end just keep inheriting the parent's series.
            let _ = self.child_map.set(parent, child, 0);
        }
        if labels.app == "postgres"
            && labels.role == "postmaster"
            && let Some(t) = self.titles.as_mut()
        {
            t.attach_for(pid);
        }
        let provisional = Classifier::is_provisional(&labels);
        let id = shared.registry.intern(labels);
        if shared.provisional.is_open(pid) && provisional {
            // Title not set yet: the kernel keeps booking it under its own provisional series.
            shared.pids.insert(pid, id);
            return;
        }
        if shared.pids.get(&pid) == Some(&id) {
            return;
        }
        match self.kernel_map.set(pid, id, 0) {
            Ok(()) => {
                shared.pids.insert(pid, id);
                shared.provisional.resolved(pid, id);
            }
            Err(e) => warn!(pid, error = %e, "cannot track process (pid above pid_max?)"),
        }
    }

    fn untrack(&mut self, pid: u32) {
        let mut shared = lock(&self.shared);
        shared.provisional.closed(pid);
        if shared.pids.remove(&pid).is_some() {
            // Already cleared when the kernel saw the exit.
            let _ = self.kernel_map.set(pid, SERIES_UNTRACKED, 0);
        }
    }

    fn handle(&mut self, ev: LifecycleEvent) {
        match LifecycleKind::from_u32(ev.kind) {
            Some(LifecycleKind::Exec) => self.exec(ev.pid),
            Some(LifecycleKind::Fork) => {
                let mut shared = lock(&self.shared);
                let mut series = ev.series;
                if series & PROVISIONAL != 0 {
                    // Shown as its cluster's `starting` process until classified.
                    let parent = shared.pids.get(&ev.ppid).copied();
                    let starting = parent
                        .and_then(|p| shared.registry.labels(p))
                        .and_then(Classifier::child_labels);
                    series = match starting {
                        Some(labels) => shared.registry.intern(labels),
                        None => shared.provisional.orphan,
                    };
                    shared.provisional.forked(ev.pid, series);
                }
                shared.pids.insert(ev.pid, series);
                drop(shared);
                self.schedule(ev.pid, 0);
            }
            Some(LifecycleKind::Exit) => {
                let mut shared = lock(&self.shared);
                shared.pids.remove(&ev.pid);
                shared.provisional.closed(ev.pid);
                // The kernel cleared it at exit; a classification racing with the exit may
                // have written it again, and the pid will be reused.
                let _ = self.kernel_map.set(ev.pid, SERIES_UNTRACKED, 0);
            }
            // Sent as a TitleEvent; see `titled`.
            Some(LifecycleKind::Titled) => {}
            None => debug!(kind = ev.kind, "unknown lifecycle event"),
        }
    }

    fn exec(&mut self, pid: u32) {
        if pid == self.self_pid {
            return;
        }
        let info = read_process(pid);
        let labels = info.as_ref().and_then(|i| self.classifier.classify(i));
        if let Some(labels) = labels.filter(Classifier::is_provisional) {
            // A new postmaster only changes into its data directory (its cluster label) after
            // exec: book it under its own provisional series until then, as a forked child.
            if let Some(t) = self.titles.as_mut() {
                t.attach_for(pid);
            }
            let mut shared = lock(&self.shared);
            let id = shared.registry.intern(labels);
            if self.kernel_map.set(pid, PROVISIONAL | pid, 0).is_ok() {
                shared.provisional.forked(pid, id);
                shared.pids.insert(pid, id);
            }
        } else if self.apply(pid, info) {
            return;
        }
        self.schedule(pid, 0);
    }

    /// A provisional process has just set its title (the kernel sent it): classify it from
    /// that, also when it has already exited. The rest comes from /proc when it is still
    /// there, else from its provisional labels (cluster).
    fn titled(&mut self, pid: u32, title: String) {
        let (open, fallback) = {
            let shared = lock(&self.shared);
            if !shared.provisional.wants_title(pid) {
                return;
            }
            let fallback = shared
                .provisional
                .fallback(pid)
                .and_then(|id| shared.registry.labels(id))
                .cloned();
            (shared.provisional.is_open(pid), fallback)
        };
        let mut info = read_process(pid).unwrap_or_default();
        info.pid = pid;
        info.comm = "postgres".into();
        info.argv = vec![title.clone()];
        info.cmdline = title;
        info.parent_comm = Some("postgres".into());
        if let Some(dir) = self.classifier.learn(&info) {
            self.relabel_cluster(&dir);
        }
        let Some(mut labels) = self.classifier.classify(&info) else {
            return;
        };
        if labels.cluster.is_empty()
            && let Some(f) = fallback
        {
            labels.cluster = f.cluster;
        }
        if open {
            self.track(pid, labels);
        } else {
            // Already gone: only where its held-back events go.
            let mut shared = lock(&self.shared);
            let id = shared.registry.intern(labels);
            shared.provisional.classified_late(pid, id);
        }
    }

    /// Still unclassified after the last look: its events go to the provisional labels'
    /// series from now on (`starting`, or a postmaster without a data directory).
    fn give_up(&mut self, pid: u32) {
        let mut shared = lock(&self.shared);
        if !shared.provisional.is_open(pid) {
            return;
        }
        if let Some(&id) = shared.pids.get(&pid)
            && self.kernel_map.set(pid, id, 0).is_ok()
        {
            shared.provisional.resolved(pid, id);
        }
    }

    fn schedule(&mut self, pid: u32, attempt: usize) {
        if let Some(delay) = RECLASSIFY_AFTER.get(attempt) {
            self.pending
                .push(Reverse((Instant::now() + *delay, pid, attempt)));
        }
    }

    fn run_due(&mut self) {
        let now = Instant::now();
        while let Some(Reverse((at, pid, attempt))) = self.pending.peek().copied() {
            if at > now {
                break;
            }
            self.pending.pop();
            if lock(&self.shared).pids.contains_key(&pid) && !self.classify_now(pid) {
                if attempt + 1 < RECLASSIFY_AFTER.len() {
                    self.schedule(pid, attempt + 1);
                } else {
                    self.give_up(pid);
                }
            }
        }
    }

    fn dispatch(&mut self, events: Vec<Event>) {
        for ev in events {
            match ev {
                Event::Lifecycle(ev) => self.handle(ev),
                Event::Titled { pid, title } => self.titled(pid, title),
            }
        }
    }

    /// Follows lifecycle events until the task is dropped.
    pub async fn run(mut self, ring: RingBuf<MapData>, rescan_every: Duration) -> Result<()> {
        // SAFETY: the RingBuf owns its map fd for as long as the AsyncFd owns the RingBuf.
        let mut ring = unsafe { AsyncFd::register_with_interest(ring, Interest::READABLE) }
            .map_err(|e| anyhow::anyhow!("polling the lifecycle ring buffer: {e}"))?;
        let mut rescan = tokio::time::interval(rescan_every);
        rescan.tick().await; // the first tick is immediate: the caller just scanned
        let far = Duration::from_secs(3600);
        loop {
            let next = self
                .pending
                .peek()
                .map(|Reverse((at, _, _))| *at)
                .unwrap_or_else(|| Instant::now() + far);
            tokio::select! {
                guard = ring.readable_mut() => {
                    let mut guard = guard.context("lifecycle ring buffer")?;
                    let events = drain(guard.get_inner_mut());
                    guard.clear_ready();
                    self.dispatch(events);
                }
                _ = rescan.tick() => {
                    match self.scan_all() {
                        Ok(gone) => {
                            let events = drain(ring.get_mut());
                            self.dispatch(events);
                            self.forget_missed(gone);
                        }
                        Err(e) => warn!(error = format!("{e:#}"), "rescan failed"),
                    }
                }
                _ = sleep_until(next) => self.run_due(),
            }
        }
    }
}

enum Event {
    Lifecycle(LifecycleEvent),
    Titled { pid: u32, title: String },
}

fn drain(ring: &mut RingBuf<MapData>) -> Vec<Event> {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// An exited, not yet reaped child is still in /proc with its comm: it must read as
    /// exiting, or a rescan that runs after its exit event would track it again.
    #[test]
    fn an_exited_process_reads_as_exiting() {
        let mut child = std::process::Command::new("sleep")
            .arg("0")
            .spawn()
            .expect("spawn sleep");
        let pid = child.id();
        let zombie = (0..500).any(|_| {
            std::thread::sleep(Duration::from_millis(2));
            procfs::process::Process::new(pid as i32)
                .and_then(|p| p.stat())
                .is_ok_and(|s| s.state == 'Z')
        });
        assert!(zombie, "sleep 0 did not become a zombie within 1 s");
        let seen = read_process(pid);
        child.wait().expect("reap");
        assert!(
            seen.is_some_and(|i| i.exiting),
            "a zombie must read as exiting"
        );
        assert!(read_process(std::process::id()).is_some_and(|i| !i.exiting));
    }
}
