//! The `duet.v1.Worker` gRPC service both workers serve (Describe, OpenSession, CloseSession,
//! Stats), the wire forms of the core's values, and the one table from [`WorkerError`] to a
//! gRPC status that both workers' services use.

use crate::WorkerError;
use crate::core::{OpenRequest, WorkerCore};
use crate::load::ModelDescription;
use crate::model_thread::Timing;
use crate::sessions::SessionId;
use duet_engine::EngineError;
use duet_engine::bias::LogitBias;
use duet_engine::sampling::SamplingParams;
use duet_proto::v1 as pb;
use duet_proto::v1::worker_server::{SERVICE_NAME, Worker, WorkerServer};
use duet_serving::grpc::MAX_MESSAGE_BYTES;
use duet_serving::telemetry::{server_span, traced};
use duet_serving::wire;
use std::sync::Arc;
use tonic::{Request, Response, Status};

/// The one mapping from a worker's errors to gRPC codes. Refusals the caller can act on keep
/// their own code (UNAVAILABLE stays retryable, RESOURCE_EXHAUSTED means "not now");
/// malformed calls name the field; the worker's own failures are INTERNAL.
pub fn status(e: &WorkerError) -> Status {
    let message = e.to_string();
    match e {
        WorkerError::Loading | WorkerError::ShuttingDown => Status::unavailable(message),
        WorkerError::SessionNotFound(_) | WorkerError::OtherInstance { .. } => {
            Status::not_found(message)
        }
        WorkerError::SessionLimit(_)
        | WorkerError::KvBudget { .. }
        | WorkerError::QueueFull(_)
        | WorkerError::RoomClaimed(_) => Status::resource_exhausted(message),
        WorkerError::InvalidArgument { .. } => Status::invalid_argument(message),
        WorkerError::SessionExists(_) => Status::already_exists(message),
        WorkerError::ClosedWhileOpening(_) | WorkerError::Superseded => Status::aborted(message),
        WorkerError::Dropped => Status::internal(message),
        WorkerError::Engine(engine) => match **engine {
            // What the caller sent does not fit the model or the session.
            EngineError::TokenOutOfRange { .. }
            | EngineError::EmptyInput
            | EngineError::CacheFull { .. }
            | EngineError::CapacityTooLarge { .. }
            | EngineError::TruncateBeyondEnd { .. }
            | EngineError::BadTree(_)
            | EngineError::Grammar(_) => Status::invalid_argument(message),
            // Adapters load at start, where an error fails it.
            EngineError::Adapter { .. }
            | EngineError::Io { .. }
            | EngineError::Gguf { .. }
            | EngineError::UnsupportedArchitecture(_)
            | EngineError::Metadata { .. }
            | EngineError::Tensor { .. }
            | EngineError::CacheMismatch
            | EngineError::Device(..)
            | EngineError::Tokenizer(_)
            | EngineError::ChatTemplate(_)
            | EngineError::Sampling(_)
            | EngineError::Verify(_)
            | EngineError::Candle(_) => Status::internal(message),
        },
    }
}

impl From<WorkerError> for Status {
    fn from(e: WorkerError) -> Self {
        status(&e)
    }
}

pub fn timing_to_wire(t: Timing) -> pb::Timing {
    pb::Timing {
        queue_us: t.queue.as_micros() as u64,
        forward_us: t.forward.as_micros() as u64,
        batch_calls: t.batch_calls as u32,
        batch_rows: t.batch_rows as u32,
        share_us: t.share.as_micros() as u64,
    }
}

/// `d` on the wire, with the tokenizer where `tokenizer` and the adapters named now.
fn description_to_wire(
    d: &ModelDescription,
    tokenizer: bool,
    (adapters, adapters_from_dir): (Vec<String>, bool),
) -> pb::ModelDescription {
    pb::ModelDescription {
        model: d.model.clone(),
        architecture: d.architecture.clone(),
        vocab_size: d.vocab_size as u32,
        context_length: d.context_length as u32,
        vocabulary_sha256: d.vocabulary_sha256.clone(),
        tokenizer: if tokenizer {
            d.tokenizer.clone()
        } else {
            Vec::new()
        },
        instance_id: 0,
        verifies_trees: d.verifies_trees,
        applies_penalties: true,
        scores_prompts: true,
        applies_logit_bias: true,
        applies_min_tokens: true,
        applies_structured_output: d.applies_structured_output,
        applies_min_p: true,
        applies_repetition_penalty: true,
        holds_stop_tokens: true,
        // Only a target-worker serves Decode; a caller asks this of one alone.
        decodes_with_lookup: true,
        parameter_count: d.file.parameters,
        quantization: d.file.quantization.clone(),
        file_bytes: d.file.bytes,
        size_label: d.file.size_label.clone(),
        adapters,
        adapters_from_dir,
        device: d.device.to_string(),
    }
}

fn open_from_wire(req: pb::OpenSessionRequest) -> Result<OpenRequest, WorkerError> {
    let session_id = match req.session_id.is_empty() {
        true => None,
        false => Some(SessionId::from_wire(&req.session_id)?),
    };
    Ok(OpenRequest {
        session_id,
        prompt: req.prompt,
        capacity: req.capacity as usize,
        generated_after: req.generated_after as usize,
        logprobs: req.top_logprobs.map(|n| n as usize),
        prompt_logprobs: req.prompt_logprobs.map(|n| n as usize),
        logit_bias: LogitBias::new(req.logit_bias),
        min_tokens: req.min_tokens as usize,
        cache_salt: req.cache_salt,
        stop_token_ids: req.stop_token_ids,
        priority: req.priority,
        ask_for_room: req.ask_for_room,
        adapter: Some(req.adapter).filter(|name| !name.is_empty()),
        adapter_if_loaded: req.adapter_if_loaded,
        format: req
            .structured_output
            .as_ref()
            .and_then(wire::format_from_wire),
        penalties: wire::penalties_from_wire(
            req.presence_penalty,
            req.frequency_penalty,
            req.repetition_penalty,
        ),
        sampling: req
            .sampling
            .as_ref()
            .map_or_else(SamplingParams::greedy, wire::sampling_from_wire),
    })
}

/// `duet.v1.Worker` over a worker's core.
#[derive(Debug)]
pub struct WorkerService<J> {
    core: Arc<WorkerCore<J>>,
}

impl<J: Send + 'static> WorkerService<J> {
    pub fn server(core: Arc<WorkerCore<J>>) -> WorkerServer<Self> {
        WorkerServer::new(Self { core })
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES)
    }
}

#[tonic::async_trait]
impl<J: Send + 'static> Worker for WorkerService<J> {
    async fn describe(
        &self,
        request: Request<pb::DescribeRequest>,
    ) -> Result<Response<pb::ModelDescription>, Status> {
        let tokenizer = !request.into_inner().without_tokenizer;
        let adapters = self.core.adapters()?;
        let mut described = description_to_wire(self.core.describe()?, tokenizer, adapters);
        described.instance_id = self.core.instance();
        Ok(Response::new(described))
    }

    async fn open_session(
        &self,
        request: Request<pb::OpenSessionRequest>,
    ) -> Result<Response<pb::OpenSessionResponse>, Status> {
        let span = server_span(&request, SERVICE_NAME, "OpenSession");
        let open = open_from_wire(request.into_inner());
        let core = &self.core;
        traced(span.clone(), async {
            let opened = core.open(open?, span).await?;
            Ok(Response::new(pb::OpenSessionResponse {
                session_id: opened.session_id.0.to_vec(),
                instance_id: opened.instance_id,
                cache_len: opened.cache_len as u32,
                cached_tokens: opened.cached_tokens as u32,
                timing: Some(timing_to_wire(opened.timing)),
                prompt_logprobs: opened
                    .prompt_logprobs
                    .iter()
                    .map(wire::logprobs_to_wire)
                    .collect(),
            }))
        })
        .await
    }

    async fn close_session(
        &self,
        request: Request<pb::CloseSessionRequest>,
    ) -> Result<Response<pb::CloseSessionResponse>, Status> {
        let r = request.into_inner();
        let closed = self.core.close(&r.session_id, r.instance_id);
        Ok(Response::new(pb::CloseSessionResponse { closed }))
    }

    async fn stats(
        &self,
        _: Request<pb::StatsRequest>,
    ) -> Result<Response<pb::WorkerStats>, Status> {
        let s = self.core.stats();
        Ok(Response::new(pb::WorkerStats {
            active_sessions: s.sessions.active as u32,
            max_sessions: s.max_sessions as u32,
            kv_tokens_reserved: s.sessions.reserved_tokens as u64,
            kv_token_budget: s.kv_token_budget as u64,
            queue_depth: s.queue_depth as u32,
            sessions_expired: s.sessions.expired,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::Code;

    #[test]
    fn each_worker_error_has_its_code() {
        let engine = |e| WorkerError::from(e);
        for (error, code) in [
            (WorkerError::Loading, Code::Unavailable),
            (WorkerError::ShuttingDown, Code::Unavailable),
            (
                WorkerError::SessionNotFound(crate::SessionId([7; 16])),
                Code::NotFound,
            ),
            (
                WorkerError::OtherInstance { asked: 1, this: 2 },
                Code::NotFound,
            ),
            (WorkerError::SessionLimit(4), Code::ResourceExhausted),
            (
                WorkerError::KvBudget {
                    requested: 9,
                    free: 1,
                },
                Code::ResourceExhausted,
            ),
            (WorkerError::QueueFull(8), Code::ResourceExhausted),
            (WorkerError::RoomClaimed(-1), Code::ResourceExhausted),
            (
                WorkerError::invalid("keep", "too far"),
                Code::InvalidArgument,
            ),
            (
                WorkerError::SessionExists(crate::SessionId([7; 16])),
                Code::AlreadyExists,
            ),
            (
                WorkerError::ClosedWhileOpening(crate::SessionId([7; 16])),
                Code::Aborted,
            ),
            (WorkerError::Dropped, Code::Internal),
            (
                engine(EngineError::TokenOutOfRange { token: 9, vocab: 4 }),
                Code::InvalidArgument,
            ),
            (
                engine(EngineError::Device("forward".into(), "boom".into())),
                Code::Internal,
            ),
        ] {
            let s = status(&error);
            assert_eq!(s.code(), code, "{error}");
            assert_eq!(s.message(), error.to_string());
        }
        // A full queue is not a session limit: the message says which.
        assert!(
            status(&WorkerError::QueueFull(8))
                .message()
                .contains("queue is full")
        );
    }
}
