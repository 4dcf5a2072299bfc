//! The DraftWorker gRPC service: wire ↔ domain at the edge, errors mapped by
//! `WorkerError::into_status`.

use crate::worker::ProposeJob;
use duet_proto::v1 as pb;
use duet_proto::v1::draft_worker_server::{DraftWorker, DraftWorkerServer};
use duet_serving::grpc::MAX_MESSAGE_BYTES;
use duet_serving::worker::{WorkerCore, WorkerError};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

/// Draft tokens one Propose may ask for.
pub const MAX_K: u32 = 64;

#[derive(Debug, Clone)]
pub struct DraftService {
    core: Arc<WorkerCore<ProposeJob>>,
}

impl DraftService {
    pub fn server(core: Arc<WorkerCore<ProposeJob>>) -> DraftWorkerServer<Self> {
        DraftWorkerServer::new(Self { core })
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES)
    }
}

#[tonic::async_trait]
impl DraftWorker for DraftService {
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

    type ProposeStream = ReceiverStream<Result<pb::ProposeResponse, Status>>;

    async fn propose(
        &self,
        request: Request<pb::ProposeRequest>,
    ) -> Result<Response<Self::ProposeStream>, Status> {
        let req = request.into_inner();
        if req.k == 0 || req.k > MAX_K {
            return Err(
                WorkerError::invalid("k", format!("{} is not in 1..={MAX_K}", req.k)).into(),
            );
        }
        self.core.check_tokens("append", &req.append)?;
        let session = self.core.sessions().get(req.session_id)?;
        let (out, rx) = mpsc::channel(req.k as usize);
        self.core.submit(ProposeJob {
            session,
            keep: req.keep as usize,
            append: req.append,
            k: req.k as usize,
            out,
            enqueued: Instant::now(),
        })?;
        Ok(Response::new(ReceiverStream::new(rx)))
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
