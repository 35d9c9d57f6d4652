//! The connection cap: which connections are open, and whom to close when one more arrives.
//! Kept apart from the accept loop so the choice can be tested without sockets.
use std::{
    collections::HashMap,
    sync::{Arc, Mutex, atomic::Ordering},
};

use super::{HttpStats, conn::Conn};
use crate::lock;

/// Counts the connections and picks whom to close at the cap.
pub(super) struct Registry {
    pub(super) next_id: u64,
    pub(super) conns: HashMap<u64, Arc<Conn>>,
}

pub(super) enum Admission {
    Admit,
    /// Admitted after closing another.
    Evicted,
    Reject,
}

impl Registry {
    pub(super) fn admit(&mut self, max: usize) -> Admission {
        if self.conns.len() < max {
            return Admission::Admit;
        }
        // One eviction at a time: while a victim is still closing, a flood is refused instead
        // of growing the fd count.
        if self
            .conns
            .values()
            .any(|c| c.evicted.load(Ordering::Acquire))
        {
            return Admission::Reject;
        }
        let victim = self
            .conns
            .values()
            .filter(|c| !c.busy())
            .min_by_key(|c| c.waiting_since.load(Ordering::Acquire));
        match victim {
            Some(v) => {
                v.evicted.store(true, Ordering::Release);
                v.close.notify_one();
                Admission::Evicted
            }
            None => Admission::Reject,
        }
    }
}

/// Removes a connection from the count when its task ends, however it ends.
pub(super) struct Deregister {
    pub(super) registry: Arc<Mutex<Registry>>,
    pub(super) stats: Arc<HttpStats>,
    pub(super) id: u64,
}

impl Drop for Deregister {
    fn drop(&mut self) {
        lock(&self.registry).conns.remove(&self.id);
        self.stats.open.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http_server::conn::tests::conn_at;

    #[test]
    fn the_cap_evicts_the_longest_waiting_then_rejects() {
        let mut reg = Registry {
            next_id: 0,
            conns: HashMap::new(),
        };
        assert!(matches!(reg.admit(2), Admission::Admit));
        let (old, young) = (conn_at(5), conn_at(50));
        reg.conns.insert(1, young.clone());
        reg.conns.insert(2, old.clone());
        assert!(matches!(reg.admit(2), Admission::Evicted));
        assert!(old.evicted.load(Ordering::Relaxed));
        assert!(!young.evicted.load(Ordering::Relaxed));
        // The victim has not gone yet: the next one is refused, not a third fd.
        assert!(matches!(reg.admit(2), Admission::Reject));
        reg.conns.remove(&2);
        reg.conns.insert(3, conn_at(60));
        // Busy connections are never evicted.
        young.request_started();
        assert!(matches!(reg.admit(2), Admission::Evicted));
        assert!(!young.evicted.load(Ordering::Relaxed));
        reg.conns.clear();
        reg.conns.insert(1, young.clone());
        let busy = conn_at(1);
        busy.request_started();
        reg.conns.insert(2, busy);
        assert!(matches!(reg.admit(2), Admission::Reject));
    }
}
