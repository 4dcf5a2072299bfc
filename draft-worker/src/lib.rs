//! duet's draft-worker: a gRPC service around the small model that proposes K draft tokens
//! per call, streaming each as it is sampled (protocol: `proto/duet/v1/worker.proto`). Its
//! sessions are the shared `duet.v1.Worker` service of `duet-worker-core`.

mod service;
mod worker;

pub use service::DraftService;
pub use worker::DraftHandler;

use duet_serving::metrics::Listeners;
use duet_serving::startup::Service;
use duet_worker_core::{RunError, WorkerConfig, serve_worker};
use std::future::Future;

/// The draft-worker's name, environment prefix and defaults.
pub fn service() -> Service<WorkerConfig> {
    let mut defaults = WorkerConfig::with(
        "127.0.0.1:50062",
        "127.0.0.1:50072",
        &duet_worker_core::default_model_path("qwen2.5-coder-0.5b-instruct.gguf"),
    );
    // Drafting is sequential per session; batching across sessions is not implemented.
    defaults.max_batch = 1;
    Service {
        name: "duet-draft-worker",
        env_prefix: "DUET_DRAFT_WORKER",
        defaults,
        // The model has its own thread; the runtime only moves messages.
        runtime_threads: Some(2),
    }
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
