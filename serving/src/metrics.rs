//! Prometheus metrics over HTTP: each service renders its registry at `GET /metrics` on its
//! own port (`metrics_listen`), in the Prometheus text format.

use axum::Router;
use axum::http::header::CONTENT_TYPE;
use axum::routing::get;
use prometheus_client::registry::Registry;
use std::future::Future;
use std::sync::Arc;
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

/// Serves `GET /metrics` on `listener` until `shutdown` completes.
pub async fn serve(
    listener: TcpListener,
    render: Render,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = Router::new().route(
        "/metrics",
        get(move || {
            let render = render.clone();
            async move { ([(CONTENT_TYPE, CONTENT_TYPE_TEXT)], render()) }
        }),
    );
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
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
}

impl Listeners {
    /// Binds `grpc` and, unless empty, `metrics`.
    pub async fn bind(grpc: &str, metrics: &str) -> std::io::Result<Self> {
        Ok(Self {
            grpc: TcpListener::bind(grpc).await?,
            metrics: match metrics {
                "" => None,
                addr => Some(TcpListener::bind(addr).await?),
            },
        })
    }

    /// Serves `/metrics` (if a listener was given) until the returned guard is dropped.
    pub fn spawn_metrics(&mut self, render: Render) -> MetricsGuard {
        let stop = crate::shutdown::Shutdown::new();
        if let Some(listener) = self.metrics.take() {
            let wait = stop.wait();
            tokio::spawn(async move {
                if let Err(e) = serve(listener, render, wait).await {
                    tracing::error!(error = %e, "metrics endpoint failed");
                }
            });
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
