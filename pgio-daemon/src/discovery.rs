//! Discovery: a /proc scan at start (and periodically, as a safety net), then the kernel's
//! lifecycle events: exec → classify now; fork of a tracked process → the child already
//! inherited its parent's series in the kernel, reclassify it as its title settles
//! (Postgres sets the backend title within milliseconds of fork); exit → forget.
//! What a process is, is the classifier's business; discovery keeps `Tracked` and the
//! kernel's `TRACKED` map in step with it.
use std::time::Duration;

use anyhow::{Context as _, Result};
use aya::maps::{MapData, RingBuf};
use pgio_common::{
    SeriesId,
    lifecycle::{LifecycleEvent, LifecycleKind},
};
use tokio::{
    io::{Interest, unix::AsyncFd},
    time::{Instant, sleep_until},
};
use tracing::{debug, warn};

use crate::{
    classifier::{Classifier, ProcessInfo},
    key_quota::KeyOwner,
    labels::Labels,
    lifecycle::{self, Event, PostgresProbes},
    lock,
    proc_scan::{classify_all, read_process},
    reclassify::Schedule,
    series::{KernelSeries, SharedTracked},
};

pub struct Discovery {
    classifier: Classifier,
    shared: SharedTracked,
    kernel: KernelSeries,
    postgres_probes: Option<PostgresProbes>,
    schedule: Schedule,
    self_pid: u32,
    /// How long a series outlives its last process (see `series`).
    series_retention: Duration,
}

impl Discovery {
    pub fn new(
        classifier: Classifier,
        shared: SharedTracked,
        kernel: KernelSeries,
        postgres_probes: Option<PostgresProbes>,
        series_retention: Duration,
    ) -> Discovery {
        {
            let mut t = lock(&shared);
            t.provisional.orphan = t.intern(Classifier::orphan_child_labels(), KeyOwner::Exempt);
        }
        Discovery {
            classifier,
            shared,
            kernel,
            postgres_probes,
            schedule: Schedule::default(),
            self_pid: std::process::id(),
            series_retention,
        }
    }

    /// Classifies every process in /proc. Returns the tracked processes it did not find:
    /// their exit events, if any, are already in the ring (a process leaves /proc only after
    /// it has exited); see `forget_missed`.
    pub fn scan_all(&mut self) -> Result<Vec<u32>> {
        self.classifier.refresh_pods();
        let classified = classify_all(&self.classifier)?;
        if let Some(p) = self.postgres_probes.as_mut() {
            // Before tracking: a binary detached now leaves room for one refused before.
            p.prune();
        }
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
        let mut shared = lock(&self.shared);
        let gone = shared
            .pids
            .keys()
            .copied()
            .filter(|pid| seen.binary_search(pid).is_err())
            .collect();
        let now = std::time::Instant::now();
        shared.provisional.expire(now);
        for id in shared.retire_idle(now, self.series_retention, Classifier::child_labels) {
            // A reused id must not make anyone's children provisional.
            if self.kernel.set_children(id, SeriesId::UNTRACKED).is_err() {
                shared.kernel_map_errors += 1;
            }
        }
        Ok(gone)
    }

    /// Call after handling the ring's events: processes a scan did not find and that are
    /// still tracked ended without an exit event.
    pub fn forget_missed(&mut self, gone: Vec<u32>) {
        let missed: Vec<u32> = {
            let mut shared = lock(&self.shared);
            let missed: Vec<u32> = gone
                .into_iter()
                .filter(|pid| shared.pids.contains_key(pid))
                .collect();
            shared.exits_missed += missed.len() as u64;
            missed
        };
        for pid in missed {
            self.untrack(pid);
        }
    }

    /// How many processes are tracked now.
    pub fn tracked(&self) -> usize {
        lock(&self.shared).pids.len()
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
        let Some(info) = info else {
            self.untrack(pid);
            return true;
        };
        if info.exiting {
            let labels = self.classifier.classify(&info);
            self.untrack(pid);
            if let Some(labels) = labels {
                self.classified_late(pid, labels);
            }
            return true;
        }
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

    /// Already gone: `labels` only say where its held-back events go.
    fn classified_late(&mut self, pid: u32, labels: Labels) {
        let mut shared = lock(&self.shared);
        let id = shared.intern(labels, KeyOwner::Pid(pid));
        shared.provisional.classified_late(pid, id);
    }

    /// A cluster's label just changed (its first auxiliary process told its cluster_name):
    /// classify again what was labelled with its data directory, and the postmasters that
    /// wait for a cluster label. A postmaster slower to start than its looks (TCG, a loaded
    /// node) would otherwise keep its events held back, or on a label without its cluster,
    /// until the next rescan.
    fn relabel_cluster(&mut self, dir: &str) {
        let pids: Vec<u32> = {
            let shared = lock(&self.shared);
            shared
                .pids
                .iter()
                .filter(|(_, id)| {
                    shared.registry.labels(**id).is_some_and(|l| {
                        Classifier::in_cluster(l, dir) || Classifier::awaits_cluster(l)
                    })
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
                shared.intern(labels.clone(), KeyOwner::Pid(pid)),
                shared.intern(child, KeyOwner::Pid(pid)),
            );
            if let Err(e) = self.kernel.set_children(parent, child) {
                shared.kernel_map_errors += 1;
                warn!(series = parent.0, error = %e, "cannot set a postmaster's child series");
            }
        }
        if Classifier::announces_titles(&labels)
            && let Some(t) = self.postgres_probes.as_mut()
        {
            t.attach_for(pid);
        }
        let provisional = Classifier::is_provisional(&labels);
        let id = shared.intern(labels, KeyOwner::Pid(pid));
        if shared.provisional.is_open(pid) && provisional {
            // Title not set yet: the kernel keeps booking it under its own provisional series.
            debug!(pid, series = id.0, "still provisional");
            shared.pids.insert(pid, id);
            return;
        }
        if shared.pids.get(&pid) == Some(&id) {
            return;
        }
        match self.kernel.set(pid, id) {
            Ok(()) => {
                debug!(pid, series = id.0, "tracked");
                shared.pids.insert(pid, id);
                shared.provisional.resolved(pid, id);
            }
            Err(e) => {
                shared.kernel_map_errors += 1;
                warn!(pid, error = %e, "cannot track process (pid above pid_max?)");
            }
        }
    }

    fn untrack(&mut self, pid: u32) {
        let mut shared = lock(&self.shared);
        shared.provisional.closed(pid);
        if shared.pids.remove(&pid).is_some() {
            // Already cleared when the kernel saw the exit.
            self.kernel.clear(pid);
        }
    }

    fn handle(&mut self, ev: LifecycleEvent) {
        match LifecycleKind::from_u32(ev.kind) {
            Some(LifecycleKind::Exec) => self.exec(ev.pid),
            Some(LifecycleKind::Fork) => self.forked(ev),
            Some(LifecycleKind::Exit) => {
                let mut shared = lock(&self.shared);
                shared.pids.remove(&ev.pid);
                shared.provisional.closed(ev.pid);
                // The kernel cleared it at exit; a classification racing with the exit may
                // have written it again, and the pid will be reused.
                self.kernel.clear(ev.pid);
            }
            // Sent as a TitleEvent; see `titled`.
            Some(LifecycleKind::Titled) => {}
            None => debug!(kind = ev.kind, "unknown lifecycle event"),
        }
    }

    fn forked(&mut self, ev: LifecycleEvent) {
        let mut shared = lock(&self.shared);
        let mut series = ev.series;
        if series.is_provisional() {
            // Shown as its cluster's `starting` process until classified.
            let parent = shared.pids.get(&ev.ppid).copied();
            let starting = parent
                .and_then(|p| shared.registry.labels(p))
                .and_then(Classifier::child_labels);
            series = match starting {
                Some(labels) => shared.intern(labels, KeyOwner::Pid(ev.ppid)),
                None => shared.provisional.orphan,
            };
            shared.provisional.forked(ev.pid, series);
        }
        shared.pids.insert(ev.pid, series);
        drop(shared);
        self.schedule.first(ev.pid);
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
            if let Some(t) = self.postgres_probes.as_mut() {
                t.attach_for(pid);
            }
            let mut shared = lock(&self.shared);
            let id = shared.intern(labels, KeyOwner::Pid(pid));
            if self.kernel.set(pid, SeriesId::provisional(pid)).is_ok() {
                shared.provisional.forked(pid, id);
                shared.pids.insert(pid, id);
            }
        } else if self.apply(pid, info) {
            return;
        }
        self.schedule.first(pid);
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
        // Forked by a tracked postmaster (its provisional labels are its cluster's `starting`
        // ones), not a process that exec'd a binary called postgres.
        let vouched = fallback.as_ref().is_some_and(Classifier::is_starting);
        let info =
            Classifier::with_title(read_process(pid).unwrap_or_default(), pid, title, vouched);
        if let Some(dir) = self.classifier.learn(&info) {
            self.relabel_cluster(&dir);
        }
        let Some(mut labels) = self.classifier.classify(&info) else {
            return;
        };
        if let Some(f) = fallback {
            // Its parent's cluster, whatever its title claims, once the parent's is known; and
            // its pod if it was gone before /proc could tell.
            if !f.cluster.is_empty() {
                labels.cluster = f.cluster.clone();
            }
            if labels.pod.is_empty() {
                labels = labels.in_pod(f.pod_labels());
            }
        }
        if open {
            self.track(pid, labels);
        } else {
            self.classified_late(pid, labels);
        }
    }

    /// Still unclassified after the last look: its events go to the provisional labels'
    /// series from now on (`starting`, or a postmaster without a data directory).
    fn give_up(&mut self, pid: u32) {
        let mut shared = lock(&self.shared);
        if !shared.provisional.is_open(pid) {
            return;
        }
        debug!(pid, "still unclassified after its last look");
        if let Some(&id) = shared.pids.get(&pid)
            && self.kernel.set(pid, id).is_ok()
        {
            shared.provisional.resolved(pid, id);
        }
    }

    fn run_due(&mut self) {
        let now = Instant::now();
        while let Some(look) = self.schedule.pop_due(now) {
            let tracked = lock(&self.shared).pids.contains_key(&look.pid);
            if tracked && !self.classify_now(look.pid) {
                if look.has_next() {
                    self.schedule.next_after(look);
                } else {
                    self.give_up(look.pid);
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
                .schedule
                .next_at()
                .unwrap_or_else(|| Instant::now() + far);
            tokio::select! {
                guard = ring.readable_mut() => {
                    let mut guard = guard.context("lifecycle ring buffer")?;
                    let events = lifecycle::drain(guard.get_inner_mut());
                    guard.clear_ready();
                    self.dispatch(events);
                }
                _ = rescan.tick() => {
                    match self.scan_all() {
                        Ok(gone) => {
                            let events = lifecycle::drain(ring.get_mut());
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
