//! duet's target-worker: a gRPC service around the large model that verifies draft tokens
//! (or decodes one token) in one forward pass per call, running the calls of several
//! sessions in one batched pass (protocol: `proto/duet/v1/worker.proto`).

mod service;
mod worker;

pub use service::TargetService;
pub use worker::TargetHandler;

use duet_serving::metrics::Listeners;
use duet_serving::worker::{RunError, WorkerConfig, serve_worker};
use std::future::Future;

/// Environment prefix of the target-worker's configuration keys.
pub const ENV_PREFIX: &str = "DUET_TARGET_WORKER";

/// OpenTelemetry `service.name`.
pub const SERVICE_NAME: &str = "duet-target-worker";

/// The target-worker's defaults.
pub fn default_config() -> WorkerConfig {
    WorkerConfig::with(
        "127.0.0.1:50063",
        "127.0.0.1:50073",
        &duet_serving::worker::default_model_path("qwen2.5-coder-1.5b-instruct.gguf"),
    )
}

/// Serves the target-worker on `listeners` until `shutdown` completes (then drains).
pub async fn run(
    listeners: Listeners,
    config: WorkerConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), RunError> {
    serve_worker(
        listeners,
        config,
        TargetHandler,
        TargetService::server,
        shutdown,
    )
    .await
}
