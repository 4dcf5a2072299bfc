//! A worker's Prometheus metrics: model time per kind of call, sessions, KV tokens, queue.

use crate::SessionStats;
use duet_engine::GraphReport;
use duet_serving::metrics::{Mirrored, encode, latency_buckets};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Metric, Registry};
use std::sync::atomic::AtomicU64;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    /// `prefill` (a session's prompt) or `call` (one model run: a batch of Verify calls, or
    /// Propose calls stepping together).
    pub kind: &'static str,
}

#[derive(Debug)]
pub struct WorkerMetrics {
    registry: Registry,
    pub forward_seconds: Family<KindLabel, Histogram>,
    pub batch_size: Histogram,
    pub batch_wait: Histogram,
    active_sessions: Gauge,
    kv_tokens_reserved: Gauge,
    prefix_cache_tokens: Gauge,
    /// Prompt tokens opens looked up in the prefix cache, and those they found there.
    pub prefix_cache_queried: Counter,
    pub prefix_cache_hit: Counter,
    queue_depth: Gauge,
    sessions_expired: Mirrored,
    opens_abandoned: Mirrored,
    lora_adapters_loaded: Gauge,
    lora_adapter_reads: Mirrored,
    cuda_graphs: Gauge,
    cuda_graph_failed: Gauge,
    busy_polling: Gauge,
    cuda_graph_failure_logged: std::sync::atomic::AtomicBool,
    warm_up_seconds: Gauge<f64, AtomicU64>,
}

const CUDA_GRAPHS: &str =
    "Row buckets whose CUDA step replays from a captured CUDA graph (cuda_graphs)";
const CUDA_GRAPH_FAILED: &str =
    "1 once a CUDA graph capture failed: the CUDA step then runs its kernels one by one";
const ADAPTERS_LOADED: &str =
    "Adapters of lora_adapter_dir loaded now (at most max_loaded_adapters)";
const ADAPTER_READS: &str = "Adapters read from lora_adapter_dir: a first ask, changed files, or one given up before (past max_loaded_adapters) and asked for again";

/// `metric`, registered under `name`.
fn registered<M: Metric + Clone>(registry: &mut Registry, name: &str, help: &str, metric: M) -> M {
    registry.register(name, help, metric.clone());
    metric
}

/// A gauge registered under `name`.
fn gauge(registry: &mut Registry, name: &str, help: &str) -> Gauge {
    registered(registry, name, help, Gauge::default())
}

/// A gauge set once, to a limit from the configuration (the registry keeps it).
fn constant(registry: &mut Registry, name: &str, help: &str, value: usize) {
    gauge(registry, name, help).set(value as i64);
}

/// The configuration's limits, as gauges set once.
fn limits(registry: &mut Registry, kv_token_budget: usize, max_sessions: usize) {
    constant(
        registry,
        "kv_token_budget",
        "KV-cache tokens all sessions may reserve",
        kv_token_budget,
    );
    constant(
        registry,
        "max_sessions",
        "Sessions this worker may hold open (max_sessions): one more open is refused",
        max_sessions,
    );
}

impl WorkerMetrics {
    pub fn new(kv_token_budget: usize, max_sessions: usize) -> Self {
        let mut registry = Registry::with_prefix("duet_worker");
        let r = &mut registry;
        limits(r, kv_token_budget, max_sessions);
        // The export counters of the subscriber this service runs under.
        duet_serving::telemetry::ExportStats::current().register(r);
        Self {
            forward_seconds: registered(
                r,
                "forward_seconds",
                "Model time per run: a prompt prefill, or a batch of calls (Verify calls in one pass, Propose calls stepping together)",
                Family::<KindLabel, Histogram>::new_with_constructor(|| {
                    Histogram::new(latency_buckets())
                }),
            ),
            batch_size: registered(
                r,
                "batch_size",
                "Calls served by one model run (Verify calls in one pass, Propose calls that stepped together)",
                Histogram::new([1.0, 2.0, 4.0, 8.0, 16.0, 32.0]),
            ),
            batch_wait: registered(
                r,
                "batch_wait_seconds",
                "Time a run of calls waited for the streams due back before starting (batch_wait_ms), when it waited",
                Histogram::new(exponential_buckets(0.0001, 2.0, 12)),
            ),
            active_sessions: gauge(r, "active_sessions", "Open sessions"),
            kv_tokens_reserved: gauge(
                r,
                "kv_tokens_reserved",
                "KV-cache tokens reserved by open sessions",
            ),
            prefix_cache_tokens: gauge(
                r,
                "prefix_cache_tokens",
                "KV-cache tokens the prefix cache holds for later sessions (finished sessions' caches, within kv_token_budget)",
            ),
            prefix_cache_queried: registered(
                r,
                "prefix_cache_queried_tokens",
                "Prompt tokens session opens looked up in the prefix cache",
                Counter::default(),
            ),
            prefix_cache_hit: registered(
                r,
                "prefix_cache_hit_tokens",
                "Prompt tokens session opens copied from the prefix cache instead of prefilling them",
                Counter::default(),
            ),
            queue_depth: gauge(r, "queue_depth", "Calls waiting for the model"),
            sessions_expired: Mirrored::register(
                r,
                "sessions_expired",
                "Sessions closed by the idle TTL",
            ),
            opens_abandoned: Mirrored::register(
                r,
                "opens_abandoned",
                "Session opens whose caller gave up on them and closed them by the id it named (the session closed on the spot, or its open failed)",
            ),
            lora_adapters_loaded: gauge(r, "lora_adapters_loaded", ADAPTERS_LOADED),
            lora_adapter_reads: Mirrored::register(r, "lora_adapter_reads", ADAPTER_READS),
            cuda_graphs: gauge(r, "cuda_graphs", CUDA_GRAPHS),
            busy_polling: gauge(
                r,
                "busy_polling_threads",
                duet_serving::busy_poll::BUSY_POLLING,
            ),
            cuda_graph_failed: gauge(r, "cuda_graph_failed", CUDA_GRAPH_FAILED),
            cuda_graph_failure_logged: Default::default(),
            warm_up_seconds: registered(
                r,
                "warm_up_seconds",
                "How long the passes the worker ran at start, before it was ready, took (a prefill and passes of 1 to 8 rows: on a GPU, building the CUDA step and capturing its graphs)",
                Gauge::<f64, AtomicU64>::default(),
            ),
            registry,
        }
    }

    /// The start's warm-up passes took `took` (`load::warm_up`).
    pub fn observe_warm_up(&self, took: std::time::Duration) {
        self.warm_up_seconds.set(took.as_secs_f64());
    }

    /// Follows what the model's CUDA step did with graphs; a failed capture is logged once.
    /// How many async threads poll now (`runtime.busy_poll_ms`).
    pub fn observe_busy_polling(&self, threads: usize) {
        self.busy_polling.set(threads as i64);
    }

    pub fn observe_cuda_graphs(&self, report: Option<GraphReport>) {
        let Some(report) = report else { return };
        self.cuda_graphs.set(report.captured as i64);
        if let Some(reason) = report.failure {
            self.cuda_graph_failed.set(1);
            if !self
                .cuda_graph_failure_logged
                .swap(true, std::sync::atomic::Ordering::Relaxed)
            {
                tracing::warn!(%reason, "CUDA graph capture failed: the CUDA step runs eagerly");
            }
        }
    }

    /// `loaded` adapters of the adapter directory are loaded, after `reads` reads of them.
    pub fn observe_adapters(&self, loaded: usize, reads: u64) {
        self.lora_adapters_loaded.set(loaded as i64);
        self.lora_adapter_reads.follow(reads);
    }

    /// The text exposition, with the gauges read now.
    pub fn render(&self, sessions: SessionStats, queue_depth: usize) -> String {
        self.active_sessions.set(sessions.active as i64);
        self.kv_tokens_reserved.set(sessions.reserved_tokens as i64);
        self.prefix_cache_tokens
            .set(sessions.prefix_cached_tokens as i64);
        self.queue_depth.set(queue_depth as i64);
        self.sessions_expired.follow(sessions.expired);
        self.opens_abandoned.follow(sessions.abandoned_opens);
        encode(&self.registry)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line<'a>(text: &'a str, name: &str) -> Option<&'a str> {
        text.lines().find(|l| l.starts_with(name))
    }

    /// The CUDA step's graph report becomes two gauges: buckets captured, and 1 once a
    /// capture failed (which stays, as the step stays eager).
    #[test]
    fn cuda_graph_reports_become_gauges() {
        let metrics = WorkerMetrics::new(100, 4);
        let stats = SessionStats {
            active: 0,
            reserved_tokens: 0,
            prefix_cached_tokens: 0,
            expired: 0,
            abandoned_opens: 0,
        };
        let render = |m: &WorkerMetrics| m.render(stats, 0);
        metrics.observe_cuda_graphs(None);
        let text = render(&metrics);
        assert_eq!(
            line(&text, "duet_worker_cuda_graphs "),
            Some("duet_worker_cuda_graphs 0")
        );
        metrics.observe_cuda_graphs(Some(GraphReport {
            captured: 3,
            failure: None,
        }));
        let text = render(&metrics);
        assert_eq!(
            line(&text, "duet_worker_cuda_graphs "),
            Some("duet_worker_cuda_graphs 3")
        );
        assert_eq!(
            line(&text, "duet_worker_cuda_graph_failed "),
            Some("duet_worker_cuda_graph_failed 0")
        );
        metrics.observe_cuda_graphs(Some(GraphReport {
            captured: 3,
            failure: Some("capturing 8 rows: out of memory".into()),
        }));
        let text = render(&metrics);
        assert_eq!(
            line(&text, "duet_worker_cuda_graph_failed "),
            Some("duet_worker_cuda_graph_failed 1")
        );
    }
}
