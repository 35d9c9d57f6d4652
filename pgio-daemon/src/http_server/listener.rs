//! The HTTP listening socket.
use anyhow::Result;
use tracing::warn;

/// Binds `listen`. `[::]` (the default) takes IPv4 too: `IPV6_V6ONLY` off, whatever the node's
/// `net.ipv6.bindv6only`, so one default serves IPv4-only, IPv6-only and dual-stack clusters.
/// A node booted without IPv6 (`ipv6.disable=1`) gets `0.0.0.0` on the same port.
pub fn bind(listen: std::net::SocketAddr) -> Result<std::net::TcpListener> {
    let dual_stack = listen.is_ipv6() && listen.ip().is_unspecified();
    match listen_on(listen, dual_stack) {
        Err(e) if dual_stack && e.raw_os_error() == Some(libc::EAFNOSUPPORT) => {
            let v4 = std::net::SocketAddr::from(([0, 0, 0, 0], listen.port()));
            warn!(%listen, instead = %v4, "no IPv6 on this node");
            Ok(listen_on(v4, false)?)
        }
        bound => Ok(bound?),
    }
}

/// A listening socket with room for 1,024 connections not yet accepted, on every address
/// (std's `TcpListener::bind` gives 128: a connection flood overflowed that, and each SYN the
/// kernel drops costs its client a 1 s retransmit).
fn listen_on(
    addr: std::net::SocketAddr,
    dual_stack: bool,
) -> std::io::Result<std::net::TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    if dual_stack {
        socket.set_only_v6(false)?;
    }
    socket.set_reuse_address(true)?;
    socket.bind(&addr.into())?;
    socket.listen(1024)?;
    Ok(socket.into())
}

#[cfg(test)]
mod tests {
    use std::{net::TcpStream, time::Duration};

    use super::*;

    /// 600 connections nobody accepts yet all complete at once: with std's backlog of 128
    /// the 130th SYN is dropped and its `connect` waits for the retransmit (1 s).
    #[test]
    fn the_backlog_holds_a_burst_of_connections() {
        for addr in ["127.0.0.1:0", "[::]:0"] {
            let listener = bind(addr.parse().expect("address")).expect("bind");
            let port = listener.local_addr().expect("address").port();
            let to = std::net::SocketAddr::from(([127, 0, 0, 1], port));
            let held: Vec<TcpStream> = (0..600)
                .map(|i| {
                    TcpStream::connect_timeout(&to, Duration::from_millis(500))
                        .unwrap_or_else(|e| panic!("{addr}: connection {i}: {e}"))
                })
                .collect();
            assert_eq!(held.len(), 600);
        }
    }
}
