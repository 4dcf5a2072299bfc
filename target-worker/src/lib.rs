//! duet's target-worker: a gRPC service around the large model that verifies draft tokens
//! (or decodes one token) in one forward pass per call, running the calls of several
//! sessions in one batched pass (protocol: `proto/duet/v1/worker.proto`). Its sessions are
//! the shared `duet.v1.Worker` service of `duet-worker-core`.

mod decode;
mod service;
mod worker;

pub use service::TargetService;
pub use worker::TargetHandler;

use duet_serving::startup::Service;
use duet_worker_core::{Worker, WorkerConfig, WorkerCore};
use std::sync::Arc;

/// The target-worker, for `duet_worker_core::serve` and `main`.
#[derive(Debug)]
pub struct Verifier;

impl Worker for Verifier {
    type Handler = TargetHandler;
    type Grpc = duet_proto::v1::target_worker_server::TargetWorkerServer<TargetService>;

    const DRAFTS: bool = false;

    fn service() -> Service<WorkerConfig> {
        Service {
            name: "duet-target-worker",
            env_prefix: "DUET_TARGET_WORKER",
            defaults: WorkerConfig::with(
                "127.0.0.1:50063",
                "127.0.0.1:50073",
                &duet_worker_core::default_model_path("qwen2.5-coder-1.5b-instruct.gguf"),
            ),
            prepare: WorkerConfig::apply_process_settings,
        }
    }

    fn grpc(core: Arc<WorkerCore<worker::VerifyJob>>) -> Self::Grpc {
        TargetService::server(core)
    }
}
