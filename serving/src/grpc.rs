//! The gRPC server frame every duet service runs in: `grpc.health.v1` (NOT_SERVING until the
//! service says it is ready), server reflection v1 and v1alpha (grpcurl 1.8 speaks only
//! v1alpha), TCP_NODELAY, bounds on what one client's connections may hold
//! ([`Http2Limits`]), and a graceful drain when the shutdown future completes.

use crate::busy_poll::{BusyPoll, BusyPollLayer};
use crate::tls_files::ServerConfigFiles;
use serde::{Deserialize, Serialize};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tonic::service::{InterceptorLayer, Routes, RoutesBuilder};
use tonic::transport::server::TcpIncoming;
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;
use tower_http::timeout::RequestBodyTimeoutLayer;

/// Largest message a duet service accepts or sends. Sampling sessions exchange full-vocabulary
/// distributions (151,936 floats each for Qwen), K + 1 of them per Verify answer.
pub const MAX_MESSAGE_BYTES: usize = 64 << 20;

/// Health name that is SERVING while the server runs, whatever the service's readiness: for
/// liveness probes (a coordinator whose target-worker is down is alive, just not ready).
pub const LIVENESS: &str = "liveness";

/// Health of one server: the overall status ("") and its named gRPC services move together.
/// The same readiness and liveness are also kept for HTTP probes ([`Probes`]).
#[derive(Clone)]
pub struct Health {
    reporter: HealthReporter,
    services: std::sync::Arc<[&'static str]>,
    probes: Probes,
}

/// Readiness and liveness as plain flags, for `GET /readyz` and `/livez` on the metrics
/// port: Kubernetes' gRPC probes speak plaintext only, so a TLS server is probed there.
#[derive(Debug, Clone, Default)]
pub struct Probes {
    pub ready: std::sync::Arc<std::sync::atomic::AtomicBool>,
    pub live: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl std::fmt::Debug for Health {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Health")
            .field("services", &self.services)
            .finish()
    }
}

fn status(serving: bool) -> ServingStatus {
    if serving {
        ServingStatus::Serving
    } else {
        ServingStatus::NotServing
    }
}

impl Health {
    /// The flags behind `/readyz` and `/livez`.
    pub fn probes(&self) -> Probes {
        self.probes.clone()
    }

    pub async fn set(&self, serving: bool) {
        use std::sync::atomic::Ordering;
        self.probes.ready.store(serving, Ordering::Relaxed);
        self.reporter.set_service_status("", status(serving)).await;
        for service in self.services.iter() {
            self.reporter
                .set_service_status(service, status(serving))
                .await;
        }
    }

    /// Reports a dependency's state under its own name, apart from the service's readiness.
    pub async fn set_named(&self, name: &str, serving: bool) {
        if name == LIVENESS {
            self.probes
                .live
                .store(serving, std::sync::atomic::Ordering::Relaxed);
        }
        self.reporter
            .set_service_status(name, status(serving))
            .await;
    }
}

/// Routes with health and reflection for the named services (full gRPC names, such as
/// `duet.v1.TargetWorker`), starting NOT_SERVING. Add the services themselves and serve.
pub async fn frame(services: &[&'static str]) -> (Health, RoutesBuilder) {
    let (reporter, health_service) = tonic_health::server::health_reporter();
    let health = Health {
        reporter,
        services: services.into(),
        probes: Probes::default(),
    };
    health.set(false).await;
    health.set_named(LIVENESS, true).await;
    let mut routes = RoutesBuilder::default();
    routes.add_service(health_service);
    // The descriptor sets hold every duet service; list only the ones served here.
    let reflection = || {
        services.iter().fold(
            tonic_reflection::server::Builder::configure()
                .register_encoded_file_descriptor_set(duet_proto::FILE_DESCRIPTOR_SET)
                .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
                .with_service_name(tonic_health::pb::health_server::SERVICE_NAME),
            |builder, service| builder.with_service_name(*service),
        )
    };
    // Both builds only fail on a malformed descriptor set, which is compiled in.
    routes.add_service(
        reflection()
            .build_v1()
            .expect("compiled-in descriptor sets are valid"),
    );
    routes.add_service(
        reflection()
            .build_v1alpha()
            .expect("compiled-in descriptor sets are valid"),
    );
    (health, routes)
}

/// What a gRPC server lets its clients' connections hold: every duet server (health,
/// reflection and Watch streams included) takes its bounds from here, so that one client
/// cannot hold unbounded streams, resets or connections.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Http2Limits {
    /// Calls one connection may have open at once (HTTP/2 `SETTINGS_MAX_CONCURRENT_STREAMS`):
    /// a client's HTTP/2 holds back the rest until one ends. A coordinator holds one
    /// connection to each worker replica with up to two calls per request on it: on the
    /// workers keep this above twice the coordinators' `max_concurrent_requests`.
    pub max_concurrent_streams: u32,
    /// Connections held at once; one more is closed as it arrives.
    pub max_connections: usize,
    /// Streams a client may open and reset before the server has taken them, per
    /// connection; past it the connection is closed (the HTTP/2 "rapid reset" flood).
    pub max_pending_reset_streams: usize,
    /// Streams the server may reset for a client's protocol errors, per connection, before
    /// it closes the connection.
    pub max_local_error_reset_streams: usize,
    /// Bytes of headers one call may send.
    pub max_header_list_size: u32,
    /// A TLS client has this long for its handshake.
    pub tls_handshake_timeout_ms: u64,
    /// The HTTP servers (the HTTP API, the metrics port): a client has this long to send a
    /// request's headers.
    pub header_timeout_ms: u64,
    /// A call's request body (and an HTTP request's) must deliver each part within this; a
    /// body that stalls ends the call, freeing its stream.
    pub body_timeout_ms: u64,
    /// An idle connection is pinged this often.
    pub keepalive_interval_ms: u64,
    /// A connection whose ping is not answered within this long is closed.
    pub keepalive_timeout_ms: u64,
}

impl Default for Http2Limits {
    fn default() -> Self {
        Self {
            max_concurrent_streams: 256,
            max_connections: 1024,
            max_pending_reset_streams: 20,
            max_local_error_reset_streams: 256,
            max_header_list_size: 16 << 10,
            tls_handshake_timeout_ms: 10_000,
            header_timeout_ms: 10_000,
            body_timeout_ms: 10_000,
            keepalive_interval_ms: 20_000,
            keepalive_timeout_ms: 10_000,
        }
    }
}

impl Http2Limits {
    /// Every bound must be at least 1: a zero would refuse every call or end it at once.
    pub fn validate(&self) -> Result<(), crate::config::ConfigError> {
        let l = self;
        for (key, value) in [
            (
                "max_concurrent_streams",
                u64::from(l.max_concurrent_streams),
            ),
            ("max_connections", l.max_connections as u64),
            ("max_header_list_size", u64::from(l.max_header_list_size)),
            ("tls_handshake_timeout_ms", l.tls_handshake_timeout_ms),
            ("header_timeout_ms", l.header_timeout_ms),
            ("body_timeout_ms", l.body_timeout_ms),
            ("keepalive_interval_ms", l.keepalive_interval_ms),
            ("keepalive_timeout_ms", l.keepalive_timeout_ms),
        ] {
            if value == 0 {
                let key = format!("http2.{key}");
                return Err(crate::config::ConfigError::invalid(
                    &key,
                    "must be at least 1",
                ));
            }
        }
        Ok(())
    }
}

/// Serves `routes` on `listener` (over TLS when `tls` is set) within `limits`, its calls
/// touching `busy_poll`, until `shutdown` completes, then stops accepting connections and
/// waits for in-flight calls (streams included) to finish.
pub async fn serve(
    listener: TcpListener,
    tls: Option<crate::tls::LoadedTls>,
    routes: Routes,
    limits: &Http2Limits,
    busy_poll: Option<BusyPoll>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), tonic::transport::Error> {
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let ms = Duration::from_millis;
    let client_names = tls.as_ref().map(|t| t.client_names.clone());
    let client_names = client_names.unwrap_or_default();
    let router = tonic::transport::Server::builder()
        .max_concurrent_streams(limits.max_concurrent_streams)
        .http2_max_pending_accept_reset_streams(Some(limits.max_pending_reset_streams))
        .http2_max_local_error_reset_streams(Some(limits.max_local_error_reset_streams))
        .http2_max_header_list_size(limits.max_header_list_size)
        .http2_keepalive_interval(Some(ms(limits.keepalive_interval_ms)))
        .http2_keepalive_timeout(Some(ms(limits.keepalive_timeout_ms)))
        .layer(RequestBodyTimeoutLayer::new(ms(limits.body_timeout_ms)))
        .layer(InterceptorLayer::new(move |r| client_names.check(r)))
        .layer(BusyPollLayer::new(busy_poll))
        .add_routes(routes);
    match tls {
        None => {
            let incoming = TcpIncoming::from(listener)
                .with_nodelay(Some(true))
                .with_keepalive(Some(Duration::from_secs(30)));
            // Past the cap a connection is dropped as it arrives: closed before any HTTP/2.
            let incoming = incoming.filter_map(move |accepted| match accepted {
                Ok(tcp) => counted(&slots, tcp).map(Ok),
                Err(e) => Some(Err(e)),
            });
            router
                .serve_with_incoming_shutdown(incoming, shutdown)
                .await
        }
        Some(tls) => {
            let handshake = ms(limits.tls_handshake_timeout_ms);
            let incoming = tls_incoming(listener, slots, tls.config, handshake);
            router
                .serve_with_incoming_shutdown(incoming, shutdown)
                .await
        }
    }
}

/// The next connection on `listener`. A failed accept (out of file descriptors, a
/// connection reset before it was taken) is logged and, after a short pause, tried again.
pub(crate) async fn accept(listener: &TcpListener) -> (TcpStream, std::net::SocketAddr) {
    loop {
        match listener.accept().await {
            Ok(accepted) => return accepted,
            Err(e) => {
                tracing::debug!(error = %e, "accepting a connection");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
}

/// `tcp` holding one of `slots`, or `None` (dropped, so closed) when all are taken.
fn counted(slots: &Arc<Semaphore>, tcp: TcpStream) -> Option<Counted> {
    match slots.clone().try_acquire_owned() {
        Ok(slot) => Some(Counted { tcp, _slot: slot }),
        Err(_) => {
            tracing::debug!("connection refused: max_connections reached");
            None
        }
    }
}

/// The TLS connections of `listener`: each TLS handshake (with the configuration of the
/// time, so renewed files apply to the next connection) runs in a task of its own within
/// `handshake`, so a client that connects and sends nothing holds up no one else. Accepting
/// stops when the server stops taking connections.
fn tls_incoming(
    listener: TcpListener,
    slots: Arc<Semaphore>,
    tls: ServerConfigFiles,
    handshake: Duration,
) -> ReceiverStream<std::io::Result<TlsStream<Counted>>> {
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(async move {
        loop {
            let (tcp, peer) = tokio::select! {
                accepted = accept(&listener) => accepted,
                () = tx.closed() => return,
            };
            let _ = tcp.set_nodelay(true);
            let Some(tcp) = counted(&slots, tcp) else {
                continue;
            };
            let (acceptor, tx) = (TlsAcceptor::from(tls.current()), tx.clone());
            tokio::spawn(async move {
                match tokio::time::timeout(handshake, acceptor.accept(tcp)).await {
                    Ok(Ok(stream)) => {
                        let _ = tx.send(Ok(stream)).await;
                    }
                    Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                    Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                }
            });
        }
    });
    ReceiverStream::new(rx)
}

/// A connection holding one of the server's `max_connections` slots until it closes.
struct Counted {
    tcp: TcpStream,
    _slot: OwnedSemaphorePermit,
}

impl tonic::transport::server::Connected for Counted {
    type ConnectInfo = tonic::transport::server::TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.tcp.connect_info()
    }
}

impl AsyncRead for Counted {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().tcp).poll_read(cx, buf)
    }
}

impl AsyncWrite for Counted {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().tcp).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().tcp).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().tcp).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().tcp).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.tcp.is_write_vectored()
    }
}
