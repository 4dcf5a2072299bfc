//! The TargetWorker gRPC service: wire ↔ domain at the edge, errors mapped by
//! `WorkerError::into_status`.

use crate::worker::VerifyJob;
use duet_proto::v1 as pb;
use duet_proto::v1::target_worker_server::{TargetWorker, TargetWorkerServer};
use duet_serving::grpc::MAX_MESSAGE_BYTES;
use duet_serving::worker::{WorkerCore, WorkerError};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::oneshot;
use tonic::{Request, Response, Status};

/// Draft tokens one Verify may carry.
pub const MAX_DRAFT: usize = 64;

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
        Ok(Response::new(self.core.open(request.into_inner()).await?))
    }

    async fn verify(
        &self,
        request: Request<pb::VerifyRequest>,
    ) -> Result<Response<pb::VerifyResponse>, Status> {
        let req = request.into_inner();
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
        })?;
        let response = answer.await.map_err(|_| WorkerError::ShuttingDown)??;
        Ok(Response::new(response))
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
