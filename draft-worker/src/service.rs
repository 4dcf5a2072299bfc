//! The DraftWorker gRPC service: wire ↔ domain at the edge, errors mapped by
//! `WorkerError::into_status`.

use crate::worker::ProposeJob;
use duet_proto::v1 as pb;
use duet_proto::v1::draft_worker_server::{DraftWorker, DraftWorkerServer};
use duet_serving::grpc::MAX_MESSAGE_BYTES;
use duet_serving::telemetry::{server_span, traced};
use duet_serving::worker::{CallTrace, WorkerCore, WorkerError};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// Draft tokens one Propose may ask for.
pub const MAX_K: u32 = 64;

const SERVICE: &str = "duet.v1.DraftWorker";

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

impl DraftService {
    /// Checks a Propose and queues it for the model thread; tokens arrive on the receiver.
    fn start_propose(
        &self,
        req: pb::ProposeRequest,
        span: tracing::Span,
    ) -> Result<mpsc::Receiver<Result<pb::ProposeResponse, Status>>, Status> {
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
            trace: CallTrace::queued(span),
        })?;
        Ok(rx)
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
        self.core.open_rpc(request, SERVICE).await
    }

    type ProposeStream = ReceiverStream<Result<pb::ProposeResponse, Status>>;

    async fn propose(
        &self,
        request: Request<pb::ProposeRequest>,
    ) -> Result<Response<Self::ProposeStream>, Status> {
        let span = server_span(&request, SERVICE, "Propose");
        let req = request.into_inner();
        span.set_attribute("duet.session_id", req.session_id as i64);
        span.set_attribute("duet.keep", req.keep as i64);
        span.set_attribute("duet.append_tokens", req.append.len() as i64);
        span.set_attribute("duet.k", req.k as i64);
        let stream = self.start_propose(req, span.clone());
        traced(span, async {
            stream.map(|rx| Response::new(ReceiverStream::new(rx)))
        })
        .await
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
