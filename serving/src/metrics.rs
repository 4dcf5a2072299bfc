//! Prometheus metrics over HTTP: each service renders its registry at `GET /metrics` on its
//! own port (`metrics_listen`), in the Prometheus text format. The same port answers
//! `GET /readyz` and `/livez` (200 or 503) for HTTP probes.

use crate::grpc::{Health, Probes};
use axum::Router;
use axum::http::StatusCode;
use axum::http::header::CONTENT_TYPE;
use axum::routing::get;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::registry::Registry;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use tokio::net::TcpListener;

/// Content type of the Prometheus text format (OpenMetrics flavour, as prometheus-client
/// writes it).
pub const CONTENT_TYPE_TEXT: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Renders the current metrics; services refresh their gauges inside it.
pub type Render = Arc<dyn Fn() -> String + Send + Sync>;

/// Encodes `registry` in the text format.
pub fn encode(registry: &Registry) -> String {
    let mut out = String::new();
    // Writing into a String cannot fail.
    let _ = prometheus_client::encoding::text::encode(&mut out, registry);
    out
}

/// A counter that follows a count kept elsewhere (a session table, a breaker): raised, at
/// each render, by what the count grew since the last one, so the owner of the count needs
/// no handle on the registry.
#[derive(Debug, Default)]
pub struct Mirrored {
    counter: Counter<u64, AtomicU64>,
    seen: AtomicU64,
}

impl Mirrored {
    /// A mirrored counter registered as `name` (the text format adds `_total`).
    pub fn register(registry: &mut Registry, name: &str, help: &str) -> Self {
        let m = Self::default();
        registry.register(name, help, m.counter.clone());
        m
    }

    /// Takes the count as it is now.
    pub fn follow(&self, count: u64) {
        let seen = self.seen.swap(count, Ordering::Relaxed);
        self.counter.inc_by(count.saturating_sub(seen));
    }
}

/// 200 `SERVING` or 503 `NOT_SERVING`.
fn probe(flag: &AtomicBool) -> (StatusCode, &'static str) {
    match flag.load(Ordering::Relaxed) {
        true => (StatusCode::OK, "SERVING\n"),
        false => (StatusCode::SERVICE_UNAVAILABLE, "NOT_SERVING\n"),
    }
}

/// Serves `GET /metrics`, `/readyz` and `/livez` on `listener` within the service's `limits`
/// until `shutdown` completes.
pub async fn serve(
    listener: TcpListener,
    render: Render,
    probes: Probes,
    limits: crate::grpc::Http2Limits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    let Probes { ready, live } = probes;
    let app = Router::new()
        .route(
            "/metrics",
            get(move || {
                let render = render.clone();
                async move { ([(CONTENT_TYPE, CONTENT_TYPE_TEXT)], render()) }
            }),
        )
        .route("/readyz", get(move || std::future::ready(probe(&ready))))
        .route("/livez", get(move || std::future::ready(probe(&live))));
    // Scrapers and probes: the gRPC server's deadlines, and far fewer connections.
    let limits = crate::grpc::Http2Limits {
        max_connections: limits.max_connections.min(64),
        ..limits
    };
    crate::https::serve(listener, None, app, &limits, None, shutdown).await;
}

/// Bucket bounds in seconds from 1 ms to ~65 s (doubling), for latencies.
pub fn latency_buckets() -> impl Iterator<Item = f64> {
    prometheus_client::metrics::histogram::exponential_buckets(0.001, 2.0, 17)
}

/// The sockets one service listens on: gRPC, and optionally `/metrics`.
#[derive(Debug)]
pub struct Listeners {
    pub grpc: TcpListener,
    pub metrics: Option<TcpListener>,
    /// The coordinator's HTTP API (`http_listen`); none for the workers.
    pub http: Option<TcpListener>,
}

async fn bind_unless_empty(addr: &str) -> std::io::Result<Option<TcpListener>> {
    match addr {
        "" => Ok(None),
        addr => Ok(Some(TcpListener::bind(addr).await?)),
    }
}

impl Listeners {
    /// Binds `grpc` and, unless empty, `metrics` and `http`.
    pub async fn bind(grpc: &str, metrics: &str, http: &str) -> std::io::Result<Self> {
        Ok(Self {
            grpc: TcpListener::bind(grpc).await?,
            metrics: bind_unless_empty(metrics).await?,
            http: bind_unless_empty(http).await?,
        })
    }

    /// Serves `/metrics` and the probes of `health` (if a listener was given) within the
    /// service's `limits` until the returned guard is dropped.
    pub fn spawn_metrics(
        &mut self,
        render: Render,
        health: &Health,
        limits: &crate::grpc::Http2Limits,
    ) -> MetricsGuard {
        let stop = crate::shutdown::Shutdown::new();
        if let Some(listener) = self.metrics.take() {
            let (wait, probes) = (stop.wait(), health.probes());
            tokio::spawn(serve(listener, render, probes, limits.clone(), wait));
        }
        MetricsGuard(stop)
    }
}

/// Stops the metrics endpoint when dropped.
#[derive(Debug)]
pub struct MetricsGuard(crate::shutdown::Shutdown);

impl Drop for MetricsGuard {
    fn drop(&mut self) {
        self.0.trigger();
    }
}
