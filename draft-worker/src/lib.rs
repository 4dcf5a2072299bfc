//! duet's draft-worker: a gRPC service around the small model that proposes K draft tokens
//! per call, streaming each as it is sampled (protocol: `proto/duet/v1/worker.proto`). Its
//! sessions are the shared `duet.v1.Worker` service of `duet-worker-core`.

mod service;
mod worker;

pub use service::DraftService;
pub use worker::DraftHandler;

use duet_serving::startup::Service;
use duet_worker_core::{Worker, WorkerConfig, WorkerCore};
use std::sync::Arc;

/// The draft-worker, for `duet_worker_core::serve` and `main`.
#[derive(Debug)]
pub struct Drafter;

impl Worker for Drafter {
    type Handler = DraftHandler;
    type Grpc = duet_proto::v1::draft_worker_server::DraftWorkerServer<DraftService>;

    const DRAFTS: bool = true;

    fn service() -> Service<WorkerConfig> {
        Service {
            name: "duet-draft-worker",
            env_prefix: "DUET_DRAFT_WORKER",
            defaults: WorkerConfig {
                // The first 64k ids (docs/benchmarks.md, "Draft vocabulary shortlist").
                vocab_shortlist: 65_536,
                ..WorkerConfig::with(
                    "127.0.0.1:50062",
                    "127.0.0.1:50072",
                    &duet_worker_core::default_model_path("qwen2.5-coder-0.5b-instruct.gguf"),
                )
            },
            prepare: WorkerConfig::apply_process_settings,
        }
    }

    fn grpc(core: Arc<WorkerCore<worker::ProposeJob>>) -> Self::Grpc {
        DraftService::server(core)
    }
}
