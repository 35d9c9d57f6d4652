//! One connection's request cycle as lock-free state, shared by the accept loop (which picks
//! whom to evict), the socket wrapper (which sees bytes arrive) and the requests; the
//! deadlines derive from it.
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

use tokio::{sync::Notify, time::Instant};

use super::Limits;

/// Milliseconds on the server's clock; `NONE` for "not set".
const NONE: u64 = u64::MAX;

/// One connection as the accept loop, its I/O and its requests see it.
pub(super) struct Conn {
    pub(super) clock: Instant,
    in_flight: AtomicU32,
    /// Requests whose head was complete.
    served: AtomicU64,
    /// Accept, or the end of the last request.
    pub(super) waiting_since: AtomicU64,
    /// First byte of a request head not complete yet.
    head_started: AtomicU64,
    /// Bytes arrived while a request was in progress (a pipelined next head).
    read_while_busy: AtomicBool,
    /// Chosen to make room: not chosen again, and on its way out.
    pub(super) evicted: AtomicBool,
    pub(super) close: Notify,
}

impl Conn {
    pub(super) fn new(clock: Instant) -> Conn {
        let now = ms(clock);
        Conn {
            clock,
            in_flight: AtomicU32::new(0),
            served: AtomicU64::new(0),
            waiting_since: AtomicU64::new(now),
            head_started: AtomicU64::new(NONE),
            read_while_busy: AtomicBool::new(false),
            evicted: AtomicBool::new(false),
            close: Notify::new(),
        }
    }

    pub(super) fn busy(&self) -> bool {
        self.in_flight.load(Ordering::Acquire) > 0
    }

    pub(super) fn on_read(&self) {
        if self.busy() {
            self.read_while_busy.store(true, Ordering::Relaxed);
        } else {
            let _ = self.head_started.compare_exchange(
                NONE,
                ms(self.clock),
                Ordering::AcqRel,
                Ordering::Relaxed,
            );
        }
    }

    pub(super) fn request_started(&self) {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        self.served.fetch_add(1, Ordering::Relaxed);
        self.head_started.store(NONE, Ordering::Release);
    }

    pub(super) fn request_done(&self) {
        let now = ms(self.clock);
        self.waiting_since.store(now, Ordering::Release);
        if self.read_while_busy.swap(false, Ordering::AcqRel) {
            self.head_started.store(now, Ordering::Release);
        }
        self.in_flight.fetch_sub(1, Ordering::AcqRel);
    }

    /// When this connection is to be closed if nothing changes; None while a request runs.
    pub(super) fn deadline(&self, limits: &Limits) -> Option<(u64, Expiry)> {
        if self.busy() {
            return None;
        }
        let header = limits.header_timeout.as_millis() as u64;
        let head_started = self.head_started.load(Ordering::Acquire);
        let waiting_since = self.waiting_since.load(Ordering::Acquire);
        Some(if head_started != NONE {
            (head_started.saturating_add(header), Expiry::Header)
        } else if self.served.load(Ordering::Relaxed) == 0 {
            // Nothing sent since the accept: the head is late, not idle.
            (waiting_since.saturating_add(header), Expiry::Header)
        } else {
            let idle = limits.idle_timeout.as_millis() as u64;
            (waiting_since.saturating_add(idle), Expiry::Idle)
        })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Expiry {
    Header,
    Idle,
}

pub(super) fn ms(clock: Instant) -> u64 {
    clock.elapsed().as_millis() as u64
}

#[cfg(test)]
pub(super) mod tests {
    use std::{sync::Arc, time::Duration};

    use super::*;

    fn limits() -> Limits {
        Limits {
            header_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(90),
            max_connections: 2,
        }
    }

    pub(in crate::http_server) fn conn_at(waiting_since: u64) -> Arc<Conn> {
        let c = Conn::new(Instant::now());
        c.waiting_since.store(waiting_since, Ordering::Relaxed);
        Arc::new(c)
    }

    #[test]
    fn deadlines_follow_the_request_cycle() {
        let l = limits();
        let c = conn_at(1_000);
        // Fresh: the head is due 10 s after the accept, even with no byte sent.
        assert_eq!(c.deadline(&l), Some((11_000, Expiry::Header)));
        c.head_started.store(3_000, Ordering::Relaxed);
        assert_eq!(c.deadline(&l), Some((13_000, Expiry::Header)));
        c.request_started();
        assert_eq!(
            c.deadline(&l),
            None,
            "a request in progress has no deadline"
        );
        c.request_done();
        let done = c.waiting_since.load(Ordering::Relaxed);
        // Between requests: idle time-out.
        assert_eq!(c.deadline(&l), Some((done + 90_000, Expiry::Idle)));
        c.head_started.store(done + 5, Ordering::Relaxed);
        assert_eq!(c.deadline(&l), Some((done + 10_005, Expiry::Header)));
        // A pipelined head that arrived during the request is due from the request's end.
        c.request_started();
        c.on_read();
        c.request_done();
        let done = c.waiting_since.load(Ordering::Relaxed);
        assert_eq!(c.deadline(&l), Some((done + 10_000, Expiry::Header)));
    }
}
