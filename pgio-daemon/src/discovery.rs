//! Discovery: a /proc scan at start (and periodically, as a safety net), then the kernel's
//! lifecycle events: exec → classify now; fork of a tracked process → the child already
//! inherited its parent's series in the kernel, reclassify it as its title settles
//! (Postgres sets the backend title within milliseconds of fork); exit → forget.
//! What a process is, is the classifier's business; discovery keeps `Tracked` and the
//! kernel's `TRACKED` map in step with it.
mod events;
mod tracking;

use std::time::Duration;

use anyhow::{Context as _, Result};
use aya::maps::{MapData, RingBuf};
use pgio_common::SeriesId;
use tokio::{
    io::{Interest, unix::AsyncFd},
    time::{Instant, sleep_until},
};
use tracing::warn;

use crate::{
    classifier::Classifier,
    key_owners::KeyOwner,
    lifecycle::{self, PostgresProbes},
    lock,
    proc_scan::classify_all,
    reclassify::Schedule,
    series::{KernelSeries, SharedTracked},
};

pub static RESCAN_INTERVAL: crate::config::Key = crate::config::Key::at_least(
    "rescan_interval_secs",
    10,
    1,
    "full /proc rescan, a safety net behind the fork/exec/exit events",
);

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
            // A reused id must not make anyone's children provisional, nor its processes
            // client backends.
            let children = self.kernel.set_children(id, SeriesId::UNTRACKED);
            let clients = self.kernel.set_serves_clients(id, false);
            let files = self.kernel.set_names_files(id, false);
            if children.is_err() || clients.is_err() || files.is_err() {
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
                    let drained = std::time::Instant::now();
                    guard.clear_ready();
                    self.dispatch(events);
                    lock(&self.shared).provisional.ring_drained(drained);
                }
                _ = rescan.tick() => {
                    match self.scan_all() {
                        Ok(gone) => {
                            let events = lifecycle::drain(ring.get_mut());
                            let drained = std::time::Instant::now();
                            self.dispatch(events);
                            lock(&self.shared).provisional.ring_drained(drained);
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
