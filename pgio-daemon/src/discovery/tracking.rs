//! Classifying one process and recording the answer: `Tracked` and the kernel's `TRACKED` map
//! change together here, so a process's series in userspace and in the kernel cannot drift
//! apart whichever path (scan, exec, title, later look) classified it.
use tracing::{debug, warn};

use super::Discovery;
use crate::{
    classifier::{Classifier, ProcessInfo},
    key_owners::KeyOwner,
    labels::Labels,
    lock,
    proc_scan::read_process,
};

impl Discovery {
    /// Returns whether the process's labels are final (nothing left to learn from a later
    /// look at its title).
    pub(super) fn classify_now(&mut self, pid: u32) -> bool {
        if pid == self.self_pid {
            return true;
        }
        let info = read_process(pid);
        self.apply(pid, info)
    }

    pub(super) fn apply(&mut self, pid: u32, info: Option<ProcessInfo>) -> bool {
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
    pub(super) fn classified_late(&mut self, pid: u32, labels: Labels) {
        let mut shared = lock(&self.shared);
        let id = shared.intern(labels, KeyOwner::Pid(pid));
        shared.provisional.classified_late(pid, id);
    }

    /// A cluster's label just changed (its first auxiliary process told its cluster_name):
    /// classify again what was labelled with its data directory, and the postmasters that
    /// wait for a cluster label. A postmaster slower to start than its looks (TCG, a loaded
    /// node) would otherwise keep its events held back, or on a label without its cluster,
    /// until the next rescan.
    pub(super) fn relabel_cluster(&mut self, dir: &str) {
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

    pub(super) fn track(&mut self, pid: u32, labels: Labels) {
        let mut shared = lock(&self.shared);
        if Classifier::is_starting(&labels)
            && let Some(now) = shared
                .pids
                .get(&pid)
                .and_then(|id| shared.registry.labels(*id))
            && now.app == "postgres"
            && !Classifier::is_provisional(now)
        {
            // Titled already: this look caught PostgreSQL rewriting its title (see
            // `classifier::postgres`), which takes nothing back.
            return;
        }
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
        let serves_clients = Classifier::serves_clients(&labels);
        let serves_backends = Classifier::serves_backends(&labels);
        let names_files = labels.app == "postgres";
        let id = shared.intern(labels, KeyOwner::Pid(pid));
        if let Err(e) = self.kernel.set_serves_clients(id, serves_clients) {
            shared.kernel_map_errors += 1;
            warn!(series = id.0, error = %e, "cannot mark a client-backend series");
        }
        if let Err(e) = self.kernel.set_names_files(id, names_files) {
            shared.kernel_map_errors += 1;
            warn!(series = id.0, error = %e, "cannot mark a PostgreSQL series");
        }
        if let Err(e) = self.kernel.set_serves_backends(id, serves_backends) {
            shared.kernel_map_errors += 1;
            warn!(series = id.0, error = %e, "cannot mark an io worker's series");
        }
        // PostgreSQL's processes but client backends (whose time is their queries'): their
        // waits per role.
        let books_waits = names_files && !serves_clients && !provisional;
        if let Err(e) = self.kernel.set_books_waits(id, books_waits) {
            shared.kernel_map_errors += 1;
            warn!(series = id.0, error = %e, "cannot mark a series for its waits");
        }
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

    pub(super) fn untrack(&mut self, pid: u32) {
        let mut shared = lock(&self.shared);
        shared.provisional.closed(pid);
        if shared.pids.remove(&pid).is_some() {
            // Already cleared when the kernel saw the exit.
            self.kernel.clear(pid);
        }
    }
}
