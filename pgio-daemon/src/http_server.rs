//! The HTTP accept loop: every connection is bounded in time and in number, so clients that
//! connect and stall (slow headers, idle keep-alive, unread responses) cannot take pgio's file
//! descriptors or keep a scraper out.
//!
//! - Header time-out: a connection must send a complete request head within
//!   `header_timeout` of being accepted, or of the first byte of a later request.
//! - Idle time-out: between requests (or while a response goes unread) a connection is kept
//!   `idle_timeout`.
//! - Cap: at `max_connections`, the connection that has waited longest for a request is closed
//!   to make room (evicted); when every one is busy with a request, the new one is closed at
//!   once (rejected). Open connections stay within `max_connections` + 1 at any moment.
//! - TLS (optional): the handshake is part of the request head. It must be done within
//!   `header_timeout` of the accept, and a connection in its handshake counts against the cap
//!   and can be evicted like one waiting for its first request.
mod conn;
mod conn_task;
pub mod listener;
mod metrics;
mod registry;
mod watched;

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::TokioTimer;
use tokio::{net::TcpListener, sync::watch, task::JoinSet, time::Instant};
use tokio_rustls::{TlsAcceptor, rustls::ServerConfig};
use tracing::{info, warn};

pub use self::metrics::{HttpSelfMetrics, HttpSnapshot};
use crate::lock;
use conn::Conn;
use conn_task::serve_connection;
use registry::{Admission, Deregister, Registry};

pub static LISTEN: crate::config::Key = crate::config::Key::addr(
    "listen",
    "[::]:9435",
    "HTTP address of /metrics and /healthz; IPv4 and IPv6 (0.0.0.0 on a node without IPv6); `--listen` overrides it",
);
pub static HTTP_HEADER_TIMEOUT: crate::config::Key = crate::config::Key::at_least(
    "http_header_timeout_secs",
    10,
    1,
    "a connection whose request head has not arrived this long after it was accepted (or after a later request's first byte) is closed: slow-header clients cannot hold file descriptors",
);
pub static HTTP_IDLE_TIMEOUT: crate::config::Key = crate::config::Key::at_least(
    "http_idle_timeout_secs",
    90,
    1,
    "a keep-alive connection with no request this long is closed (longer than Prometheus' 1-minute default interval, so a scraper's connection is reused)",
);
pub static HTTP_MAX_CONNECTIONS: crate::config::Key = crate::config::Key::at_least(
    "http_max_connections",
    128,
    1,
    "open HTTP connections at most; past it the one waiting longest for a request is closed (pgio_http_connections_closed_total)",
);

#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub header_timeout: Duration,
    pub idle_timeout: Duration,
    pub max_connections: usize,
}

/// What the server did with its connections, for `pgio_http_*` self metrics.
#[derive(Debug, Default)]
pub struct HttpStats {
    pub accepted: AtomicU64,
    pub open: AtomicU64,
    /// Closed at once: the cap was reached and every open connection was busy.
    pub rejected: AtomicU64,
    /// Closed to make room for a new connection.
    pub evicted: AtomicU64,
    pub header_timeouts: AtomicU64,
    pub idle_timeouts: AtomicU64,
    /// `accept` failed (e.g. out of file descriptors).
    pub accept_errors: AtomicU64,
    /// The TLS handshake failed (a time-out counts as `header_timeouts`).
    pub tls_handshake_failures: AtomicU64,
}

impl HttpStats {
    fn add(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// How long SIGTERM waits for requests in progress before the connections are dropped.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// Serves `router` on `listener` (over TLS with `tls`) until `shutdown` completes; then
/// requests in progress get `SHUTDOWN_GRACE` to finish.
pub async fn serve(
    listener: TcpListener,
    tls: Option<Arc<ServerConfig>>,
    router: Router,
    limits: Limits,
    stats: Arc<HttpStats>,
    shutdown: impl Future<Output = ()>,
) {
    let tls = tls.map(TlsAcceptor::from);
    let clock = Instant::now();
    let registry = Arc::new(Mutex::new(Registry {
        next_id: 0,
        conns: HashMap::new(),
    }));
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut tasks = JoinSet::new();
    let mut builder = http1::Builder::new();
    // The header time-out is ours (it must not also cut idle keep-alive connections, which
    // hyper's does): see `Conn::deadline`.
    builder.timer(TokioTimer::new()).header_read_timeout(None);
    tokio::pin!(shutdown);
    let mut accept_errors_logged = 0u32;
    loop {
        let stream = tokio::select! {
            _ = &mut shutdown => break,
            Some(_) = tasks.join_next(), if !tasks.is_empty() => continue,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    HttpStats::add(&stats.accept_errors);
                    // The pending connection stays in the backlog: back off, not spin.
                    if accept_errors_logged < 10 {
                        accept_errors_logged += 1;
                        warn!("HTTP accept failed: {e}");
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        HttpStats::add(&stats.accepted);
        let conn = Arc::new(Conn::new(clock));
        let id = {
            let mut reg = lock(&registry);
            match reg.admit(limits.max_connections) {
                Admission::Reject => {
                    HttpStats::add(&stats.rejected);
                    drop(stream);
                    continue;
                }
                Admission::Evicted => HttpStats::add(&stats.evicted),
                Admission::Admit => {}
            }
            reg.next_id += 1;
            let id = reg.next_id;
            reg.conns.insert(id, conn.clone());
            id
        };
        stats.open.fetch_add(1, Ordering::Relaxed);
        let done = Deregister {
            registry: registry.clone(),
            stats: stats.clone(),
            id,
        };
        tasks.spawn(serve_connection(
            stream,
            tls.clone(),
            conn,
            router.clone(),
            builder.clone(),
            limits,
            stats.clone(),
            stop_rx.clone(),
            done,
        ));
    }
    drop(listener);
    let _ = stop_tx.send(true);
    let open = tasks.len();
    if open > 0 {
        info!(open, "HTTP: waiting for requests in progress");
    }
    let drained = tokio::time::timeout(SHUTDOWN_GRACE, async {
        while tasks.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        warn!(
            left = tasks.len(),
            "HTTP: requests still running after {SHUTDOWN_GRACE:?}, dropped"
        );
        tasks.shutdown().await;
    }
}
