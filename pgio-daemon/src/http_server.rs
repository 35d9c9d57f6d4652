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
use std::{
    collections::HashMap,
    io,
    pin::Pin,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering},
    },
    task::{Context, Poll},
    time::Duration,
};

use axum::Router;
use hyper::{body::Incoming, server::conn::http1, service::service_fn};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    net::{TcpListener, TcpStream},
    sync::{Notify, watch},
    task::JoinSet,
    time::Instant,
};
use tokio_rustls::{TlsAcceptor, rustls::ServerConfig};
use tower_service::Service as _;
use tracing::{debug, info, warn};

use crate::lock;

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

/// Milliseconds on the server's clock; `NONE` for "not set".
const NONE: u64 = u64::MAX;
/// How long SIGTERM waits for requests in progress before the connections are dropped.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// One connection as the accept loop, its I/O and its requests see it.
struct Conn {
    clock: Instant,
    in_flight: AtomicU32,
    /// Requests whose head was complete.
    served: AtomicU64,
    /// Accept, or the end of the last request.
    waiting_since: AtomicU64,
    /// First byte of a request head not complete yet.
    head_started: AtomicU64,
    /// Bytes arrived while a request was in progress (a pipelined next head).
    read_while_busy: AtomicBool,
    /// Chosen to make room: not chosen again, and on its way out.
    evicted: AtomicBool,
    close: Notify,
}

impl Conn {
    fn new(clock: Instant) -> Conn {
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

    fn busy(&self) -> bool {
        self.in_flight.load(Ordering::Acquire) > 0
    }

    fn on_read(&self) {
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

    fn request_started(&self) {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        self.served.fetch_add(1, Ordering::Relaxed);
        self.head_started.store(NONE, Ordering::Release);
    }

    fn request_done(&self) {
        let now = ms(self.clock);
        self.waiting_since.store(now, Ordering::Release);
        if self.read_while_busy.swap(false, Ordering::AcqRel) {
            self.head_started.store(now, Ordering::Release);
        }
        self.in_flight.fetch_sub(1, Ordering::AcqRel);
    }

    /// When this connection is to be closed if nothing changes; None while a request runs.
    fn deadline(&self, limits: &Limits) -> Option<(u64, Expiry)> {
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
enum Expiry {
    Header,
    Idle,
}

fn ms(clock: Instant) -> u64 {
    clock.elapsed().as_millis() as u64
}

/// Counts the connections and picks whom to close at the cap.
struct Registry {
    next_id: u64,
    conns: HashMap<u64, Arc<Conn>>,
}

enum Admission {
    Admit,
    /// Admitted after closing another.
    Evicted,
    Reject,
}

impl Registry {
    fn admit(&mut self, max: usize) -> Admission {
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

/// Removes a connection from the count when its task ends, however it ends.
struct Deregister {
    registry: Arc<Mutex<Registry>>,
    stats: Arc<HttpStats>,
    id: u64,
}

impl Drop for Deregister {
    fn drop(&mut self) {
        lock(&self.registry).conns.remove(&self.id);
        self.stats.open.fetch_sub(1, Ordering::Relaxed);
    }
}

#[allow(clippy::too_many_arguments)]
async fn serve_connection(
    stream: TcpStream,
    tls: Option<TlsAcceptor>,
    conn: Arc<Conn>,
    router: Router,
    builder: http1::Builder,
    limits: Limits,
    stats: Arc<HttpStats>,
    mut stop: watch::Receiver<bool>,
    done: Deregister,
) {
    let Some(tls) = tls else {
        return serve_http(stream, conn, router, builder, limits, stats, stop, done).await;
    };
    // `Conn::deadline` would give a fresh connection the same time: accept + header time-out.
    let deadline = Instant::now() + limits.header_timeout;
    let handshake = tokio::select! {
        r = tokio::time::timeout_at(deadline, tls.accept(stream)) => r,
        _ = conn.close.notified() => return,
        _ = stop.changed() => return,
    };
    match handshake {
        Ok(Ok(stream)) => {
            serve_http(stream, conn, router, builder, limits, stats, stop, done).await
        }
        Ok(Err(e)) => {
            debug!("TLS handshake failed: {e}");
            HttpStats::add(&stats.tls_handshake_failures);
        }
        Err(_) => {
            debug!(why = ?Expiry::Header, "HTTP connection timed out in the TLS handshake");
            HttpStats::add(&stats.header_timeouts);
        }
    }
}

/// The requests of one connection (plain, or TLS once the handshake is done).
#[allow(clippy::too_many_arguments)]
async fn serve_http<S>(
    stream: S,
    conn: Arc<Conn>,
    router: Router,
    builder: http1::Builder,
    limits: Limits,
    stats: Arc<HttpStats>,
    mut stop: watch::Receiver<bool>,
    _done: Deregister,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let io = TokioIo::new(Watched {
        inner: stream,
        conn: conn.clone(),
    });
    let requests = conn.clone();
    let service = service_fn(move |req: hyper::Request<Incoming>| {
        requests.request_started();
        let guard = RequestGuard(requests.clone());
        let response = router.clone().call(req);
        async move {
            let r = response.await;
            drop(guard);
            r
        }
    });
    let http = builder.serve_connection(io, service);
    tokio::pin!(http);
    // Checks at least this often, so a deadline brought forward (a head started while the
    // idle deadline was far) is never overslept by more than half a header time-out.
    let tick = (limits.header_timeout / 2).max(Duration::from_millis(10));
    let mut stopping = false;
    loop {
        let now = ms(conn.clock);
        let wake = match conn.deadline(&limits) {
            Some((at, why)) if at <= now => {
                debug!(?why, "HTTP connection timed out");
                HttpStats::add(match why {
                    Expiry::Header => &stats.header_timeouts,
                    Expiry::Idle => &stats.idle_timeouts,
                });
                return;
            }
            Some((at, _)) => Duration::from_millis(at - now).min(tick),
            None => tick,
        };
        tokio::select! {
            r = http.as_mut() => {
                if let Err(e) = r {
                    debug!("HTTP connection: {e}");
                }
                return;
            }
            _ = conn.close.notified() => return,
            _ = stop.changed(), if !stopping => {
                stopping = true;
                if !conn.busy() {
                    return;
                }
                // Let the request in progress finish, then close.
                http.as_mut().graceful_shutdown();
            }
            _ = tokio::time::sleep(wake) => {}
        }
    }
}

struct RequestGuard(Arc<Conn>);

impl Drop for RequestGuard {
    fn drop(&mut self) {
        self.0.request_done();
    }
}

/// The connection's socket (or its TLS stream: plaintext bytes), telling `Conn` when request
/// bytes arrive.
struct Watched<S> {
    inner: S,
    conn: Arc<Conn>,
}

impl<S: AsyncRead + Unpin> AsyncRead for Watched<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.conn.on_read();
        }
        r
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Watched<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> Limits {
        Limits {
            header_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(90),
            max_connections: 2,
        }
    }

    fn conn_at(waiting_since: u64) -> Arc<Conn> {
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
