//! Traces and logs. Every service builds one [`Telemetry`]: a `tracing` subscriber that
//! writes log lines (human-readable or JSON, each carrying the current `trace_id` and
//! `span_id`) and turns duet's spans into OpenTelemetry spans, exported over OTLP/gRPC when an
//! endpoint is configured. W3C trace context travels in gRPC metadata ([`inject`],
//! [`extract`]), so one request is one trace across the three services.
//!
//! Export never holds up serving: finished spans go into a bounded queue that a background
//! thread sends in batches; when the queue is full (collector slow or down) spans are
//! dropped and counted (`*_otel_spans_dropped_total` on `/metrics`).

use crate::config::ConfigError;
use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::{TraceContextExt, TracerProvider as _};
use opentelemetry::{Context, KeyValue};
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, Sampler, SdkTracerProvider, Span as SdkSpan, SpanData,
    SpanExporter, SpanProcessor,
};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::registry::Registry;
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tracing::dispatcher::WeakDispatch;
use tracing::{Dispatch, Level, Subscriber};
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::filter::{FilterExt, Targets, filter_fn};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::{EnvFilter, Layer};

/// The `[telemetry]` section of every service's configuration.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TelemetryConfig {
    /// OTLP/gRPC collector URL (Jaeger, the OpenTelemetry Collector…), e.g.
    /// `http://otel-collector:4317`. Empty: no exporter (trace ids still reach the logs and
    /// travel on to the workers).
    pub otlp_endpoint: String,
    /// Fraction of new traces recorded, 0 to 1. Parent-based: a trace started by a caller
    /// (`traceparent` on `Generate`) keeps the caller's decision.
    pub sampling_ratio: f64,
    /// `service.name` on the exported spans; empty: the service's own name.
    pub service_name: String,
    /// Finished spans waiting for export at most; more are dropped and counted.
    pub max_queue_size: usize,
    /// How often queued spans are sent.
    pub export_interval_ms: u64,
    /// One export call may take this long.
    pub export_timeout_ms: u64,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        Self {
            otlp_endpoint: String::new(),
            sampling_ratio: 1.0,
            service_name: String::new(),
            max_queue_size: 4096,
            export_interval_ms: 1000,
            export_timeout_ms: 10_000,
        }
    }
}

impl TelemetryConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !(0.0..=1.0).contains(&self.sampling_ratio) {
            return Err(ConfigError::invalid(
                "telemetry.sampling_ratio",
                format!("{} is not in [0, 1]", self.sampling_ratio),
            ));
        }
        if !self.otlp_endpoint.is_empty() {
            let ok = self
                .otlp_endpoint
                .parse::<http::Uri>()
                .is_ok_and(|u| u.scheme_str() == Some("http") && u.host().is_some());
            if !ok {
                return Err(ConfigError::invalid(
                    "telemetry.otlp_endpoint",
                    format!(
                        "{:?} is not an http://host:port URL (OTLP over gRPC, plaintext)",
                        self.otlp_endpoint
                    ),
                ));
            }
        }
        if self.max_queue_size == 0 {
            return Err(ConfigError::invalid(
                "telemetry.max_queue_size",
                "must be at least 1",
            ));
        }
        if self.export_interval_ms == 0 || self.export_timeout_ms == 0 {
            return Err(ConfigError::invalid(
                "telemetry.export_interval_ms",
                "export_interval_ms and export_timeout_ms must be positive",
            ));
        }
        Ok(())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("OTLP exporter for {endpoint}: {message}")]
    Exporter { endpoint: String, message: String },
    #[error("starting the export thread: {0}")]
    Runtime(#[from] std::io::Error),
}

/// How span export went; rendered on each service's `/metrics`.
#[derive(Debug, Clone, Default)]
pub struct ExportStats {
    exported: Counter,
    dropped: Counter,
    failed: Counter,
    queued: Arc<AtomicUsize>,
    failing: Arc<AtomicBool>,
}

impl ExportStats {
    /// Registers the three counters (`otel_spans_{exported,dropped,failed}_total`).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "otel_spans_exported",
            "Spans sent to the OTLP collector",
            self.exported.clone(),
        );
        registry.register(
            "otel_spans_dropped",
            "Spans dropped because the export queue was full (collector slow or down)",
            self.dropped.clone(),
        );
        registry.register(
            "otel_spans_failed",
            "Spans whose export call failed",
            self.failed.clone(),
        );
    }

    /// The export counters of the current subscriber (zeros when it exports nothing).
    pub fn current() -> Self {
        tracing::dispatcher::get_default(|d| {
            d.downcast_ref::<StatsLayer>()
                .map(|l| l.0.clone())
                .unwrap_or_default()
        })
    }
}

/// Carries [`ExportStats`] inside the subscriber so a service finds them from its dispatcher.
struct StatsLayer(ExportStats);

impl<S: Subscriber> Layer<S> for StatsLayer {}

/// Counts what leaves the queue, and how the export went.
#[derive(Debug)]
struct CountingExporter<E> {
    inner: E,
    stats: ExportStats,
}

impl<E: SpanExporter> SpanExporter for CountingExporter<E> {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let n = batch.len();
        self.stats.queued.fetch_sub(n, Ordering::Relaxed);
        let result = self.inner.export(batch).await;
        match &result {
            Ok(()) => {
                self.stats.exported.inc_by(n as u64);
                if self.stats.failing.swap(false, Ordering::Relaxed) {
                    tracing::info!("span export to the collector works again");
                }
            }
            Err(e) => {
                self.stats.failed.inc_by(n as u64);
                if !self.stats.failing.swap(true, Ordering::Relaxed) {
                    tracing::warn!(error = %e, "span export failed; serving goes on, spans are counted in otel_spans_failed_total");
                }
            }
        }
        result
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

/// Admits a finished span only while fewer than `capacity` wait for export, so the batch
/// processor's own queue (as large) never overflows and every drop is counted here.
#[derive(Debug)]
struct BoundedProcessor {
    inner: BatchSpanProcessor,
    stats: ExportStats,
    capacity: usize,
}

impl SpanProcessor for BoundedProcessor {
    fn on_start(&self, span: &mut SdkSpan, cx: &Context) {
        self.inner.on_start(span, cx);
    }

    fn on_end(&self, span: SpanData) {
        if self.stats.queued.fetch_add(1, Ordering::Relaxed) >= self.capacity {
            self.stats.queued.fetch_sub(1, Ordering::Relaxed);
            self.stats.dropped.inc();
            return;
        }
        self.inner.on_end(span);
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

/// Log line format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    Text,
    Json,
}

impl LogFormat {
    pub fn from_json(json: bool) -> Self {
        if json { Self::Json } else { Self::Text }
    }
}

/// One service's traces and logs. Keep it for the life of the service; [`Telemetry::shutdown`]
/// sends what is still queued.
pub struct Telemetry {
    dispatch: Dispatch,
    provider: SdkTracerProvider,
    /// Drives the OTLP channel, apart from the service's runtime.
    runtime: Option<tokio::runtime::Runtime>,
}

impl std::fmt::Debug for Telemetry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Telemetry")
            .field("exporting", &self.runtime.is_some())
            .finish()
    }
}

/// The crates whose spans become OpenTelemetry spans (not the libraries' own, and never
/// the exporter's: exporting its spans would feed itself).
const TRACED_CRATES: [&str; 5] = [
    "duet_coordinator",
    "duet_serving",
    "duet_worker_core",
    "duet_draft_worker",
    "duet_target_worker",
];

fn resource(service: &str) -> Resource {
    let mut attributes = vec![KeyValue::new(
        "service.version",
        env!("CARGO_PKG_VERSION").to_string(),
    )];
    // Set by the Helm chart from the downward API; OTEL_RESOURCE_ATTRIBUTES works as well.
    for (var, key) in [
        ("K8S_POD_NAME", "k8s.pod.name"),
        ("K8S_NAMESPACE_NAME", "k8s.namespace.name"),
        ("K8S_NODE_NAME", "k8s.node.name"),
    ] {
        if let Ok(value) = std::env::var(var)
            && !value.is_empty()
        {
            attributes.push(KeyValue::new(key, value));
        }
    }
    Resource::builder()
        .with_service_name(service.to_string())
        .with_attributes(attributes)
        .build()
}

impl Telemetry {
    /// Builds the subscriber for `service` (e.g. `duet-coordinator`). `log_filter` applies
    /// when `RUST_LOG` is unset. Does not install it: see [`Telemetry::install`].
    pub fn new(
        service: &str,
        config: &TelemetryConfig,
        log_format: LogFormat,
        log_filter: &str,
    ) -> Result<Self, TelemetryError> {
        let traces = !config.otlp_endpoint.is_empty();
        Self::build(
            service,
            config,
            traces,
            log_format,
            log_filter,
            std::io::stderr,
        )
    }

    /// `traces`: build OpenTelemetry spans (exported when the config names an endpoint).
    /// Without, duet's spans are disabled callsites: no cost per request.
    fn build<W>(
        service: &str,
        config: &TelemetryConfig,
        traces: bool,
        log_format: LogFormat,
        log_filter: &str,
        writer: W,
    ) -> Result<Self, TelemetryError>
    where
        W: for<'w> tracing_subscriber::fmt::MakeWriter<'w> + Send + Sync + 'static,
    {
        let stats = ExportStats::default();
        let service = if config.service_name.is_empty() {
            service
        } else {
            &config.service_name
        };
        let mut builder = SdkTracerProvider::builder()
            .with_resource(resource(service))
            .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
                config.sampling_ratio,
            ))));
        let runtime = match config.otlp_endpoint.is_empty() {
            true => None,
            false => {
                let (processor, rt) = export_pipeline(config, &stats)?;
                builder = builder.with_span_processor(processor);
                Some(rt)
            }
        };
        let provider = builder.build();
        // Traces off: a filter that enables nothing, so no span is ever built (an absent
        // layer would enable every span instead).
        let traced = TRACED_CRATES
            .iter()
            .filter(|_| traces)
            .fold(Targets::new(), |t, c| t.with_target(*c, Level::INFO));
        let otel = tracing_opentelemetry::layer()
            .with_tracer(provider.tracer("duet"))
            // Per-poll busy/idle timing and code locations: cost on every poll of every
            // traced future, and nothing an SRE reads here.
            .with_tracked_inactivity(false)
            .with_location(false)
            .with_threads(false)
            .with_filter(traced);
        // The formatter reads span contexts through the finished subscriber.
        let own = Arc::new(OnceLock::new());
        let logs = log_layer(log_format, log_filter, writer, &own);
        let subscriber = tracing_subscriber::registry()
            .with(logs)
            .with(otel)
            // Found by downcasting; it takes no part in filtering.
            .with(StatsLayer(stats).with_filter(filter_fn(|_| false)));
        let dispatch = Dispatch::new(subscriber);
        let _ = own.set(dispatch.downgrade());
        Ok(Self {
            dispatch,
            provider,
            runtime,
        })
    }

    /// The subscriber, to install per thread (several services in one process, as in tests).
    pub fn dispatch(&self) -> &Dispatch {
        &self.dispatch
    }

    /// Installs the subscriber for the whole process (a service's `main`).
    pub fn install(&self) -> Result<(), tracing::dispatcher::SetGlobalDefaultError> {
        tracing::dispatcher::set_global_default(self.dispatch.clone())
    }

    /// Sends the finished spans still queued (blocks up to the export timeout).
    pub fn flush(&self) {
        if let Err(e) = self.provider.force_flush() {
            tracing::warn!(error = %e, "flushing spans");
        }
    }

    /// Flushes and stops the exporter.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        if let Some(rt) = self.runtime.take() {
            let _ = self.provider.shutdown_with_timeout(Duration::from_secs(5));
            rt.shutdown_background();
        }
    }
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Puts `trace_id` and `span_id` on each log line written inside a span.
struct WithTraceIds<F> {
    inner: F,
    json: bool,
    /// The subscriber this formatter is part of: inside its callbacks the current default
    /// dispatcher reads as none, so it is kept here (weakly: it owns this formatter).
    dispatch: Arc<OnceLock<WeakDispatch>>,
}

impl<S, N, F> FormatEvent<S, N> for WithTraceIds<F>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
    F: FormatEvent<S, N>,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &tracing::Event<'_>,
    ) -> std::fmt::Result {
        let ids = self
            .dispatch
            .get()
            .and_then(|d| d.upgrade())
            .and_then(|dispatch| {
                // The log layer sees no spans (`ctx` would find none): ask the subscriber.
                let id = match event.parent() {
                    Some(id) => id.clone(),
                    None => dispatch.current_span().id()?.clone(),
                };
                let cx = tracing_opentelemetry::get_otel_context(&id, &dispatch)?;
                let sc = cx.span().span_context().clone();
                sc.is_valid()
                    .then(|| (sc.trace_id().to_string(), sc.span_id().to_string()))
            });
        let Some((trace_id, span_id)) = ids else {
            return self.inner.format_event(ctx, writer, event);
        };
        let mut line = String::new();
        self.inner
            .format_event(ctx, Writer::new(&mut line), event)?;
        if self.json {
            return match line.strip_prefix('{') {
                Some(rest) => write!(
                    writer,
                    "{{\"trace_id\":\"{trace_id}\",\"span_id\":\"{span_id}\",{rest}"
                ),
                None => writer.write_str(&line),
            };
        }
        // At the end of the line, logfmt style.
        let body = line.strip_suffix('\n').unwrap_or(&line);
        writeln!(writer, "{body} trace_id={trace_id} span_id={span_id}")
    }
}

/// Writes the current span's trace context into outgoing gRPC metadata (`traceparent`).
pub fn inject(metadata: &mut tonic::metadata::MetadataMap) {
    let cx = tracing::Span::current().context();
    TraceContextPropagator::new().inject_context(&cx, &mut MetadataInjector(metadata));
}

/// Makes `span` a child of the caller's span when the call carries `traceparent`. Call it
/// before the span is first entered.
pub fn extract(metadata: &tonic::metadata::MetadataMap, span: &tracing::Span) {
    let cx = TraceContextPropagator::new().extract(&MetadataExtractor(metadata));
    if cx.span().span_context().is_valid() {
        let _ = span.set_parent(cx);
    }
}

/// A tonic interceptor for clients: every call carries the caller's trace context.
pub fn inject_interceptor(
    mut request: tonic::Request<()>,
) -> Result<tonic::Request<()>, tonic::Status> {
    inject(request.metadata_mut());
    Ok(request)
}

struct MetadataInjector<'a>(&'a mut tonic::metadata::MetadataMap);

impl Injector for MetadataInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(k), Ok(v)) = (
            tonic::metadata::MetadataKey::from_bytes(key.as_bytes()),
            tonic::metadata::MetadataValue::try_from(&value),
        ) {
            self.0.insert(k, v);
        }
    }
}

struct MetadataExtractor<'a>(&'a tonic::metadata::MetadataMap);

impl Extractor for MetadataExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0
            .keys()
            .filter_map(|k| match k {
                tonic::metadata::KeyRef::Ascii(k) => Some(k.as_str()),
                tonic::metadata::KeyRef::Binary(_) => None,
            })
            .collect()
    }
}

/// The server span of one gRPC call, a child of the caller's span when the call carries
/// `traceparent`.
pub fn server_span<T>(
    request: &tonic::Request<T>,
    service: &'static str,
    method: &'static str,
) -> tracing::Span {
    let span = rpc_span("server", service, method);
    extract(request.metadata(), &span);
    span
}

/// A gRPC server span's attribute of the caller's `x-request-id`, as OpenTelemetry's RPC
/// conventions name a request's metadata: the coordinator's public service records it
/// (the workers' calls carry none).
pub const REQUEST_ID_METADATA: &str = "rpc.grpc.request.metadata.x-request-id";

/// The server span of one HTTP request, a child of the caller's span when the request
/// carries `traceparent`; named `{method} {route}` as OpenTelemetry's HTTP conventions
/// have it, with the request's `x-request-id` (`request_id`) as they name a header.
pub fn http_server_span(
    headers: &axum::http::HeaderMap,
    method: &'static str,
    route: &'static str,
) -> tracing::Span {
    let request_id = headers.get(crate::request_id::HEADER);
    let span = tracing::info_span!(
        "http",
        otel.name = format!("{method} {route}"),
        otel.kind = "server",
        http.request.method = method,
        http.route = route,
        "http.request.header.x-request-id" = request_id.and_then(|id| id.to_str().ok()),
    );
    extract(
        &tonic::metadata::MetadataMap::from_headers(headers.clone()),
        &span,
    );
    span
}

/// A span named `{service}/{method}` as OpenTelemetry's RPC conventions have it, with room
/// for the caller's request id ([`REQUEST_ID_METADATA`]; left empty unless recorded).
fn rpc_span(kind: &'static str, service: &'static str, method: &'static str) -> tracing::Span {
    tracing::info_span!(
        "rpc",
        otel.name = format!("{service}/{method}"),
        otel.kind = kind,
        rpc.system = "grpc",
        rpc.service = service,
        rpc.method = method,
        "rpc.grpc.request.metadata.x-request-id" = tracing::field::Empty,
    )
}

/// Runs `call` inside `span`; a failure sets the span's status to error with its message.
pub async fn traced<T>(
    span: tracing::Span,
    call: impl std::future::Future<Output = Result<T, tonic::Status>>,
) -> Result<T, tonic::Status> {
    use tracing::Instrument;
    let result = call.instrument(span.clone()).await;
    if let Err(status) = &result {
        set_error(&span, status);
    }
    result
}

/// Marks `span` failed with `status`'s code and message.
pub fn set_error(span: &tracing::Span, status: &tonic::Status) {
    span.set_attribute("rpc.grpc.status_code", status.code() as i64);
    set_failed(span, &format!("{:?}: {}", status.code(), status.message()));
}

/// Marks `span` failed with `message` (a failure that is not a gRPC status).
pub fn set_failed(span: &tracing::Span, message: &str) {
    span.set_status(opentelemetry::trace::Status::error(message.to_string()));
}

/// The client span of one outgoing gRPC call; [`inject_interceptor`] sends its context on.
pub fn client_span(service: &'static str, method: &'static str) -> tracing::Span {
    rpc_span("client", service, method)
}

/// The log layer: events as text or JSON lines with their trace ids, filtered by
/// `RUST_LOG` (else `log_filter`).
fn log_layer<W>(
    format: LogFormat,
    log_filter: &str,
    writer: W,
    own: &Arc<OnceLock<WeakDispatch>>,
) -> Box<dyn Layer<tracing_subscriber::Registry> + Send + Sync>
where
    W: for<'w> tracing_subscriber::fmt::MakeWriter<'w> + Send + Sync + 'static,
{
    // Log lines are events; spans only give them their trace ids (looked up in the
    // OpenTelemetry layer), so the log layer neither sees nor formats spans.
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new(log_filter))
        .and(filter_fn(|meta| meta.is_event()));
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(writer)
        // Plain text: log pipelines read these lines, and trace ids are spliced in.
        .with_ansi(false);
    match format {
        LogFormat::Text => fmt
            .event_format(WithTraceIds {
                inner: tracing_subscriber::fmt::format().compact(),
                json: false,
                dispatch: own.clone(),
            })
            .with_filter(filter)
            .boxed(),
        LogFormat::Json => fmt
            .json()
            .event_format(WithTraceIds {
                inner: tracing_subscriber::fmt::format().json(),
                json: true,
                dispatch: own.clone(),
            })
            .with_filter(filter)
            .boxed(),
    }
}

/// The OTLP exporter behind a bounded batch processor that counts what it drops and sends,
/// and the one-thread runtime its gRPC client runs on: telemetry starts before the service's
/// runtime and outlives it, to flush the last spans.
fn export_pipeline(
    config: &TelemetryConfig,
    stats: &ExportStats,
) -> Result<(BoundedProcessor, tokio::runtime::Runtime), TelemetryError> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("duet-otlp")
        .enable_all()
        .build()?;
    let exporter = {
        let _inside = rt.enter();
        opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_endpoint(config.otlp_endpoint.clone())
            .with_timeout(Duration::from_millis(config.export_timeout_ms))
            .build()
            .map_err(|e| TelemetryError::Exporter {
                endpoint: config.otlp_endpoint.clone(),
                message: e.to_string(),
            })?
    };
    let batch = BatchConfigBuilder::default()
        .with_max_queue_size(config.max_queue_size)
        .with_scheduled_delay(Duration::from_millis(config.export_interval_ms))
        .build();
    let processor = BatchSpanProcessor::builder(CountingExporter {
        inner: exporter,
        stats: stats.clone(),
    })
    .with_batch_config(batch)
    .build();
    let bounded = BoundedProcessor {
        inner: processor,
        stats: stats.clone(),
        capacity: config.max_queue_size,
    };
    Ok((bounded, rt))
}

#[cfg(test)]
mod tests;
