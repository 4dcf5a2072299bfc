//! The TargetWorker gRPC service: a Verify call off the wire is checked, queued (batched with
//! other sessions' calls) and answered. Errors map through the worker core's one table
//! (`duet_worker_core::status`).

use crate::worker::{Choice, VerifyJob};
use duet_proto::v1 as pb;
use duet_proto::v1::target_worker_server::{SERVICE_NAME, TargetWorker, TargetWorkerServer};
use duet_serving::grpc::MAX_MESSAGE_BYTES;
use duet_serving::telemetry::{server_span, traced};
use duet_serving::wire::encode_distribution;
use duet_worker_core::{CallTrace, SessionKey, WorkerCore, WorkerError, timing_to_wire};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::oneshot;
use tonic::{Request, Response, Status};
use tracing_opentelemetry::OpenTelemetrySpanExt;

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

    /// Checks a Verify, queues it for the model thread (batched with others) and waits.
    async fn verify_call(
        &self,
        req: pb::VerifyRequest,
        span: tracing::Span,
    ) -> Result<pb::VerifyResponse, WorkerError> {
        let vocab = self.core.describe()?.vocab_size;
        self.core.check_tokens("append", &req.append)?;
        let limit = duet_proto::MAX_VERIFY_APPEND;
        if req.append.len() > limit {
            return Err(WorkerError::invalid(
                "append",
                format!(
                    "{} tokens; at most {limit} (open a session for a longer prompt)",
                    req.append.len()
                ),
            ));
        }
        let max = duet_proto::MAX_DRAFT_TOKENS;
        if req.draft.len() > max {
            return Err(WorkerError::invalid(
                "draft",
                format!("{} tokens; at most {max}", req.draft.len()),
            ));
        }
        if !req.draft.is_empty() {
            self.core.check_tokens("draft", &req.draft)?;
        }
        check_tree(&req, self.core.describe()?.verifies_trees)?;
        let session = self.core.session(&req.session_id, req.instance_id)?;
        let (reply, answer) = oneshot::channel();
        self.core.submit(
            SessionKey::of(&session),
            VerifyJob {
                session,
                keep: req.keep as usize,
                append: req.append,
                draft: req.draft,
                parents: req.parents,
                reply,
                enqueued: Instant::now(),
                trace: CallTrace::queued(span),
            },
        )?;
        let verification = answer.await.map_err(|_| WorkerError::Dropped)??;
        let mut response = pb::VerifyResponse {
            timing: Some(timing_to_wire(verification.timing)),
            ..pb::VerifyResponse::default()
        };
        match verification.choice {
            Choice::Argmax(argmax) => response.argmax = argmax,
            Choice::P(p) => {
                response.p = p.iter().map(|d| encode_distribution(d, vocab)).collect();
            }
        }
        Ok(response)
    }
}

/// `parents`, when given, describe a tree of the drafts (`VerifyRequest.parents`).
fn check_tree(req: &pb::VerifyRequest, verifies_trees: bool) -> Result<(), WorkerError> {
    let bad = |why: String| Err(WorkerError::invalid("parents", why));
    if req.parents.is_empty() {
        return Ok(());
    }
    if !verifies_trees {
        return bad("this worker verifies chains of drafts only (see Describe)".into());
    }
    if req.parents.len() != req.draft.len() {
        let (p, d) = (req.parents.len(), req.draft.len());
        return bad(format!("{p} parents for {d} drafts"));
    }
    match req
        .parents
        .iter()
        .enumerate()
        .find(|&(j, &p)| p as usize > j)
    {
        Some((j, p)) => bad(format!(
            "draft {} follows draft {p}, not one before it",
            j + 1
        )),
        None => Ok(()),
    }
}

#[tonic::async_trait]
impl TargetWorker for TargetService {
    async fn verify(
        &self,
        request: Request<pb::VerifyRequest>,
    ) -> Result<Response<pb::VerifyResponse>, Status> {
        let span = server_span(&request, SERVICE_NAME, "Verify");
        let req = request.into_inner();
        span.set_attribute("duet.session_id", duet_serving::wire::hex(&req.session_id));
        span.set_attribute("duet.keep", req.keep as i64);
        span.set_attribute("duet.append_tokens", req.append.len() as i64);
        span.set_attribute("duet.draft_tokens", req.draft.len() as i64);
        let call = async { Ok(Response::new(self.verify_call(req, span.clone()).await?)) };
        traced(span.clone(), call).await
    }
}
