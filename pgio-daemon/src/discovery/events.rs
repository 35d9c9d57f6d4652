//! What each lifecycle event from the kernel (exec, fork, exit, title) does to the tracked
//! processes, and the later looks a fork or exec schedules while a title settles. Kept apart
//! from the scan and the event loop, which only hand events here.
use pgio_common::{
    SeriesId,
    lifecycle::{LifecycleEvent, LifecycleKind},
};
use tokio::time::Instant;
use tracing::debug;

use super::Discovery;
use crate::{
    classifier::Classifier, key_owners::KeyOwner, lifecycle::Event, lock, proc_scan::read_process,
};

impl Discovery {
    fn handle(&mut self, ev: LifecycleEvent) {
        match LifecycleKind::try_from(ev.kind).ok() {
            Some(LifecycleKind::Exec) => self.exec(ev.pid),
            Some(LifecycleKind::Fork) => self.forked(ev),
            Some(LifecycleKind::Exit) => {
                let mut shared = lock(&self.shared);
                shared.pids.remove(&ev.pid);
                shared.provisional.exited(ev.pid);
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
        if ev.series == SeriesId::UNTRACKED {
            self.adopt(ev);
            return;
        }
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

    /// A process called `postgres` forked `ev.pid` before pgio tracked it: its exec reached
    /// pgio after the fork (a busy node), so the kernel gave the child nothing. If the parent
    /// is tracked now (the exec was handled: it comes first on the ring), the child gets what
    /// the kernel would have given it at its fork, and is looked at as any new child is.
    /// Otherwise the parent is not one pgio tracks, and neither is the child.
    fn adopt(&mut self, ev: LifecycleEvent) {
        let series = {
            let shared = lock(&self.shared);
            let Some(&parent) = shared.pids.get(&ev.ppid) else {
                return;
            };
            let makes_children = shared.provisional.is_open(ev.ppid)
                || shared
                    .registry
                    .labels(parent)
                    .and_then(Classifier::child_labels)
                    .is_some();
            if makes_children {
                SeriesId::provisional(ev.pid)
            } else {
                parent
            }
        };
        // Written before the child is known, as the kernel would have: gone meanwhile, it
        // is untracked again by its first look (`schedule`), which finds no /proc entry.
        if self.kernel.set(ev.pid, series).is_ok() {
            debug!(
                pid = ev.pid,
                ppid = ev.ppid,
                "taken in: forked before its parent was tracked"
            );
            self.forked(LifecycleEvent { series, ..ev });
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

    pub(super) fn run_due(&mut self) {
        let now = Instant::now();
        while let Some(look) = self.schedule.pop_due(now) {
            // A look scheduled before the kernel sent the title can find its process settled.
            let due = {
                let shared = lock(&self.shared);
                shared
                    .pids
                    .get(&look.pid)
                    .is_some_and(|id| !shared.registry.labels(*id).is_some_and(Classifier::settled))
            };
            if due && !self.classify_now(look.pid) {
                if look.has_next() {
                    self.schedule.next_after(look);
                } else {
                    self.give_up(look.pid);
                }
            }
        }
    }

    pub(super) fn dispatch(&mut self, events: Vec<Event>) {
        for ev in events {
            match ev {
                Event::Lifecycle(ev) => self.handle(ev),
                Event::Titled { pid, title } => self.titled(pid, title),
            }
        }
    }
}
