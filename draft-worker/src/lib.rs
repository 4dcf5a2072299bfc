//! duet's draft-worker: a gRPC service around the small model that proposes K draft tokens
//! per call, streaming each as it is sampled (protocol: `proto/duet/v1/worker.proto`).

mod service;
mod worker;

pub use service::DraftService;
pub use worker::DraftHandler;

use duet_serving::metrics::Listeners;
use duet_serving::worker::{RunError, WorkerConfig, serve_worker};
use std::future::Future;

/// Environment prefix of the draft-worker's configuration keys.
pub const ENV_PREFIX: &str = "DUET_DRAFT_WORKER";

/// OpenTelemetry `service.name`.
pub const SERVICE_NAME: &str = "duet-draft-worker";

/// The draft-worker's defaults.
pub fn default_config() -> WorkerConfig {
    let mut c = WorkerConfig::with(
        "127.0.0.1:50062",
        "127.0.0.1:50072",
        &duet_serving::worker::default_model_path("qwen2.5-coder-0.5b-instruct.gguf"),
    );
    // Drafting is sequential per session; batching across sessions is not implemented.
    c.max_batch = 1;
    c
}

/// Serves the draft-worker on `listeners` until `shutdown` completes (then drains).
pub async fn run(
    listeners: Listeners,
    config: WorkerConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), RunError> {
    serve_worker(
        listeners,
        config,
        DraftHandler,
        DraftService::server,
        shutdown,
    )
    .await
}
