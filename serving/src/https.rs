//! The HTTP server under the OpenAI-compatible API, plaintext or TLS (from the same PEM
//! files and mutual-TLS CA as the gRPC server's), within the bounds the gRPC servers keep
//! (`http2.*`): a cap on connections, deadlines for a TLS handshake, for a request's headers
//! and for each part of its body, and a bound on header bytes. Each connection runs in a
//! task of its own, so a client that connects and sends nothing holds up no one else.

use crate::busy_poll::{BusyPoll, BusyPollLayer};
use crate::grpc::Http2Limits;
use crate::tls_files::ServerConfigFiles;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::{GracefulShutdown, Watcher};
use hyper_util::service::TowerToHyperService;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_rustls::TlsAcceptor;
use tower_http::timeout::RequestBodyTimeoutLayer;

/// Serves `app` on `listener` (over TLS with `tls`) within `limits`, its requests touching
/// `busy_poll`, until `shutdown` completes; then it takes no new connection, and returns
/// once every request in flight (streams included) has ended.
pub async fn serve(
    listener: TcpListener,
    tls: Option<ServerConfigFiles>,
    app: axum::Router,
    limits: &Http2Limits,
    busy_poll: Option<BusyPoll>,
    shutdown: impl Future<Output = ()>,
) {
    let ms = Duration::from_millis;
    let app = app
        .layer(RequestBodyTimeoutLayer::new(ms(limits.body_timeout_ms)))
        .layer(BusyPollLayer::new(busy_poll));
    let mut http = http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(ms(limits.header_timeout_ms))
        // hyper's read buffer bounds a request's headers (it takes no less than 8 KiB).
        .max_buf_size((limits.max_header_list_size as usize).max(8 << 10));
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let handshake = ms(limits.tls_handshake_timeout_ms);
    let graceful = GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        let (tcp, peer) = tokio::select! {
            accepted = crate::grpc::accept(&listener) => accepted,
            () = &mut shutdown => break,
        };
        // Past the cap a connection is dropped as it arrives, before any TLS or HTTP.
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            tracing::debug!(%peer, "connection refused: max_connections reached");
            continue;
        };
        let _ = tcp.set_nodelay(true);
        // Each connection takes the configuration of its time: renewed files apply to the next.
        let tls = tls.as_ref().map(|t| TlsAcceptor::from(t.current()));
        let (http, app, watcher) = (http.clone(), app.clone(), graceful.watcher());
        tokio::spawn(async move {
            let _slot = slot;
            let Some(tls) = tls else {
                return connection(&http, app, watcher, tcp).await;
            };
            match tokio::time::timeout(handshake, tls.accept(tcp)).await {
                Ok(Ok(tls)) => connection(&http, app, watcher, tls).await,
                Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
            }
        });
    }
    drop(listener);
    graceful.shutdown().await;
}

/// One connection's requests, until the client closes it or the server shuts down.
async fn connection<S>(http: &http1::Builder, app: axum::Router, watcher: Watcher, io: S)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let served = http.serve_connection(TokioIo::new(io), TowerToHyperService::new(app));
    if let Err(e) = watcher.watch(served).await {
        tracing::debug!(error = %e, "HTTP connection ended");
    }
}
