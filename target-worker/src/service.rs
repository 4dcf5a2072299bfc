//! The TargetWorker gRPC service: wire ↔ domain at the edge, errors mapped by
//! `WorkerError::into_status`.

use crate::worker::VerifyJob;
use duet_proto::v1 as pb;
use duet_proto::v1::target_worker_server::{TargetWorker, TargetWorkerServer};
use duet_serving::grpc::MAX_MESSAGE_BYTES;
use duet_serving::telemetry::{server_span, traced};
use duet_serving::worker::{CallTrace, WorkerCore, WorkerError};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::oneshot;
use tonic::{Request, Response, Status};
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// Draft tokens one Verify may carry.
pub const MAX_DRAFT: usize = 64;

const SERVICE: &str = "duet.v1.TargetWorker";

#[derive(Debug, Clone)]
pub struct TargetService {
    core: Arc<WorkerCore<VerifyJob>>,
}

impl TargetService {
    pub fn server(core: Arc<WorkerCore<VerifyJob>>) -> TargetWorkerServer<Self> {
        TargetWorkerServer::new(Self { core })
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES)
    }
}

impl TargetService {
    /// Checks a Verify, queues it for the model thread (batched with others) and waits.
    async fn verify_call(
        &self,
        req: pb::VerifyRequest,
        span: tracing::Span,
    ) -> Result<Response<pb::VerifyResponse>, Status> {
        self.core.check_tokens("append", &req.append)?;
        if req.draft.len() > MAX_DRAFT {
            return Err(WorkerError::invalid(
                "draft",
                format!("{} tokens; at most {MAX_DRAFT}", req.draft.len()),
            )
            .into());
        }
        if !req.draft.is_empty() {
            self.core.check_tokens("draft", &req.draft)?;
        }
        let session = self.core.sessions().get(req.session_id)?;
        let (reply, answer) = oneshot::channel();
        self.core.submit(VerifyJob {
            session,
            keep: req.keep as usize,
            append: req.append,
            draft: req.draft,
            reply,
            enqueued: Instant::now(),
            trace: CallTrace::queued(span),
        })?;
        let response = answer.await.map_err(|_| WorkerError::ShuttingDown)??;
        Ok(Response::new(response))
    }
}

#[tonic::async_trait]
impl TargetWorker for TargetService {
    async fn describe(
        &self,
        _: Request<pb::DescribeRequest>,
    ) -> Result<Response<pb::ModelDescription>, Status> {
        Ok(Response::new(self.core.describe()?))
    }

    async fn open_session(
        &self,
        request: Request<pb::OpenSessionRequest>,
    ) -> Result<Response<pb::OpenSessionResponse>, Status> {
        self.core.open_rpc(request, SERVICE).await
    }

    async fn verify(
        &self,
        request: Request<pb::VerifyRequest>,
    ) -> Result<Response<pb::VerifyResponse>, Status> {
        let span = server_span(&request, SERVICE, "Verify");
        let req = request.into_inner();
        span.set_attribute("duet.session_id", req.session_id as i64);
        span.set_attribute("duet.keep", req.keep as i64);
        span.set_attribute("duet.append_tokens", req.append.len() as i64);
        span.set_attribute("duet.draft_tokens", req.draft.len() as i64);
        traced(span.clone(), self.verify_call(req, span)).await
    }

    async fn close_session(
        &self,
        request: Request<pb::CloseSessionRequest>,
    ) -> Result<Response<pb::CloseSessionResponse>, Status> {
        Ok(Response::new(
            self.core.close(request.into_inner().session_id),
        ))
    }

    async fn stats(
        &self,
        _: Request<pb::StatsRequest>,
    ) -> Result<Response<pb::WorkerStats>, Status> {
        Ok(Response::new(self.core.stats()))
    }
}
