//! `pgio_http_connections*`: what the HTTP server did with its connections, at a scrape.
use std::sync::{
    Arc,
    atomic::{AtomicU64, Ordering},
};

use super::HttpStats;
use crate::{
    collector::{Scrape, Snapshot, Source},
    exposition::{Encoder, Kind, MetricFamily},
    provisional::Provisional,
};

/// What the HTTP server did with its connections (`http_server`).
pub struct HttpSelfMetrics(pub Arc<HttpStats>);

#[derive(Debug, Default)]
pub struct HttpSnapshot {
    pub open: u64,
    pub accepted: u64,
    pub rejected: u64,
    /// By reason.
    pub closed: [(&'static str, u64); 3],
    pub accept_errors: u64,
}

impl Source for HttpSelfMetrics {
    fn read(&self, _: &Provisional) -> Box<dyn Snapshot> {
        let h = &self.0;
        let v = |c: &AtomicU64| c.load(Ordering::Relaxed);
        Box::new(HttpSnapshot {
            open: v(&h.open),
            accepted: v(&h.accepted),
            rejected: v(&h.rejected),
            closed: [
                ("evicted", v(&h.evicted)),
                ("header_timeout", v(&h.header_timeouts)),
                ("idle_timeout", v(&h.idle_timeouts)),
            ],
            accept_errors: v(&h.accept_errors),
        })
    }
}

static HTTP_OPEN: MetricFamily = MetricFamily {
    name: "pgio_http_connections",
    help: "HTTP connections open now (at most http_max_connections, + 1 for a moment).",
    kind: Kind::Gauge,
};
static HTTP_ACCEPTED: MetricFamily = MetricFamily {
    name: "pgio_http_connections_accepted",
    help: "HTTP connections accepted, including those closed at once.",
    kind: Kind::Counter,
};
static HTTP_REJECTED: MetricFamily = MetricFamily {
    name: "pgio_http_connections_rejected",
    help: "HTTP connections closed at once: http_max_connections were open and none could be evicted (all busy with a request, or one already closing).",
    kind: Kind::Counter,
};
static HTTP_CLOSED: MetricFamily = MetricFamily {
    name: "pgio_http_connections_closed",
    help: "HTTP connections pgio closed, by reason: evicted (the one waiting longest for a request, to make room at http_max_connections), header_timeout (no complete request head within http_header_timeout_secs), idle_timeout (no request within http_idle_timeout_secs).",
    kind: Kind::Counter,
};
static HTTP_ACCEPT_ERRORS: MetricFamily = MetricFamily {
    name: "pgio_http_accept_errors",
    help: "Failed accept() calls on the HTTP socket (e.g. out of file descriptors).",
    kind: Kind::Counter,
};

impl Snapshot for HttpSnapshot {
    fn encode(&self, _: &mut Scrape<'_>, enc: &mut Encoder) {
        enc.family(&HTTP_OPEN).gauge((), self.open as i64);
        enc.family(&HTTP_ACCEPTED).counter((), self.accepted);
        enc.family(&HTTP_REJECTED).counter((), self.rejected);
        let mut f = enc.family(&HTTP_CLOSED);
        for (reason, n) in self.closed {
            f.counter([("reason", reason)], n);
        }
        enc.family(&HTTP_ACCEPT_ERRORS)
            .counter((), self.accept_errors);
    }
}
