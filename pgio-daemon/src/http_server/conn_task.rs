//! The task spawned per accepted connection: the TLS handshake if any, then hyper serving its
//! requests while this task closes it at its header or idle deadline, on eviction or at
//! shutdown (hyper itself only knows the request in progress).
use std::{sync::Arc, time::Duration};

use axum::Router;
use hyper::{body::Incoming, server::conn::http1, service::service_fn};
use hyper_util::rt::TokioIo;
use tokio::{
    io::{AsyncRead, AsyncWrite},
    net::TcpStream,
    sync::watch,
    time::Instant,
};
use tokio_rustls::TlsAcceptor;
use tower_service::Service as _;
use tracing::debug;

use super::{
    HttpStats, Limits,
    conn::{Conn, Expiry, ms},
    registry::Deregister,
    watched::Watched,
};

#[allow(clippy::too_many_arguments)]
pub(super) async fn serve_connection(
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
