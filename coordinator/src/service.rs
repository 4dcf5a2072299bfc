//! The public Generation service: validation at the edge, one error → Status table, a task
//! per generation streaming into a bounded channel.

use crate::Coordinator;
use crate::generate::{Abort, generate};
use crate::request::{InvalidField, validate};
use duet_proto::v1 as pb;
use duet_proto::v1::generation_server::{Generation, GenerationServer};
use duet_serving::grpc::MAX_MESSAGE_BYTES;
use duet_serving::telemetry::{server_span, set_error, traced};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Code, Request, Response, Status};
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// Why a Generate call failed.
#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    #[error(transparent)]
    Invalid(#[from] InvalidField),
    #[error("not ready: {0}")]
    NotReady(String),
    #[error("too many generations running (max_concurrent_requests = {0})")]
    Overloaded(usize),
    #[error("target-worker at {address}: {status}")]
    Target { address: String, status: Status },
}

impl GenerateError {
    fn into_status(self) -> Status {
        let message = self.to_string();
        match self {
            Self::Invalid(_) => Status::invalid_argument(message),
            Self::NotReady(_) => Status::unavailable(message),
            Self::Overloaded(_) => Status::resource_exhausted(message),
            // The worker's code says what happened (UNAVAILABLE stays retryable); its
            // validation errors are ours to own, since the coordinator built the call.
            Self::Target { status, .. } => match status.code() {
                Code::InvalidArgument | Code::NotFound | Code::FailedPrecondition => {
                    Status::internal(message)
                }
                Code::Cancelled | Code::Unknown => Status::unavailable(message),
                code => Status::new(code, message),
            },
        }
    }
}

#[derive(Debug, Clone)]
pub struct GenerationService {
    coord: Arc<Coordinator>,
}

impl GenerationService {
    pub const NAME: &'static str = "duet.v1.Generation";

    pub fn server(coord: Arc<Coordinator>) -> GenerationServer<Self> {
        GenerationServer::new(Self { coord })
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES)
    }

    /// Validates and starts a generation; the stream ends with its final message.
    async fn start(
        &self,
        req: pb::GenerateRequest,
        span: tracing::Span,
    ) -> Result<mpsc::Receiver<Result<pb::GenerateResponse, Status>>, Status> {
        let arrived = Instant::now();
        let c = &self.coord;
        let checked = async {
            let models = c.models().await.map_err(GenerateError::NotReady)?;
            let valid = validate(&req, &c.config, &models)?;
            let permit = c
                .permits
                .clone()
                .try_acquire_owned()
                .map_err(|_| GenerateError::Overloaded(c.config.max_concurrent_requests))?;
            Ok::<_, GenerateError>((models, valid, permit))
        };
        let (models, valid, permit) = match checked.await {
            Ok(ok) => ok,
            Err(e) => {
                let status = e.into_status();
                c.metrics.request_ended("", status.code());
                return Err(status);
            }
        };
        span.set_attribute("duet.method", valid.method.name());
        span.set_attribute("duet.num_speculative_tokens", valid.k as i64);
        span.set_attribute("duet.max_tokens", valid.max_tokens as i64);
        span.set_attribute("duet.prompt_tokens", valid.prompt.len() as i64);
        // Room for a few rounds: a slow reader delays generation rather than buffering it all.
        let (tx, rx) = mpsc::channel(8);
        let coord = c.clone();
        let task_span = span.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let address = coord.target.address().to_string();
            coord.metrics.running.inc();
            match generate(coord.clone(), models, valid, arrived, tx.clone()).await {
                Ok(()) => {}
                Err(Abort::Cancelled) => {
                    tracing::debug!("caller went away; generation stopped");
                    span.set_attribute("duet.finish_reason", "cancelled");
                    coord.metrics.request_ended("", Code::Cancelled);
                }
                Err(Abort::Target(status)) => {
                    tracing::warn!(error = %status.message(), "generation failed at the target-worker");
                    let status = GenerateError::Target { address, status }.into_status();
                    set_error(&span, &status);
                    coord.metrics.request_ended("", status.code());
                    let _ = tx.send(Err(status)).await;
                }
            }
            coord.metrics.running.dec();
        }.instrument(task_span));
        Ok(rx)
    }
}

#[tonic::async_trait]
impl Generation for GenerationService {
    type GenerateStream = ReceiverStream<Result<pb::GenerateResponse, Status>>;

    async fn generate(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let span = server_span(&request, Self::NAME, "Generate");
        let rx = traced(span.clone(), self.start(request.into_inner(), span)).await?;
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn complete(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> Result<Response<pb::CompleteResponse>, Status> {
        let span = server_span(&request, Self::NAME, "Complete");
        let mut rx = traced(span.clone(), self.start(request.into_inner(), span)).await?;
        let mut done = pb::CompleteResponse::default();
        while let Some(message) = rx.recv().await {
            match message?.event {
                Some(pb::generate_response::Event::Chunk(c)) => {
                    done.text.push_str(&c.text);
                    done.token_ids.extend(c.token_ids);
                }
                Some(pb::generate_response::Event::Finished(f)) => {
                    done.text.push_str(&f.text);
                    done.finish_reason = f.finish_reason;
                    done.usage = f.usage;
                }
                None => {}
            }
        }
        Ok(Response::new(done))
    }
}
