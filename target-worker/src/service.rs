//! The TargetWorker gRPC service: a Verify call off the wire is checked, queued (batched with
//! other sessions' calls) and answered. Errors map through the worker core's one table
//! (`duet_worker_core::status`).

use crate::decode::{Decoding, StreamLookup};
use crate::worker::{Choice, Kind, Test, VerifyJob};
use duet_engine::sampling::Distribution;
use duet_proto::v1 as pb;
use duet_proto::v1::target_worker_server::{SERVICE_NAME, TargetWorker, TargetWorkerServer};
use duet_serving::grpc::MAX_MESSAGE_BYTES;
use duet_serving::telemetry::{server_span, set_error, traced};
use duet_serving::wire::{decode_distribution, encode_distribution, logprobs_to_wire};
use duet_worker_core::{CallTrace, SessionKey, WorkerCore, WorkerError, status, timing_to_wire};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status};
use tracing_opentelemetry::OpenTelemetrySpanExt;

#[derive(Debug, Clone)]
pub struct TargetService {
    core: Arc<WorkerCore<VerifyJob>>,
    /// Calls so far: each call's number (`VerifyJob::call`).
    calls: Arc<AtomicU64>,
}

impl TargetService {
    pub fn server(core: Arc<WorkerCore<VerifyJob>>) -> TargetWorkerServer<Self> {
        TargetWorkerServer::new(Self {
            core,
            calls: Arc::default(),
        })
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES)
    }

    /// Checks a Verify, queues it for the model thread (batched with others) and waits.
    async fn verify_call(
        &self,
        mut req: pb::VerifyRequest,
        span: tracing::Span,
    ) -> Result<pb::VerifyResponse, WorkerError> {
        let vocab = self.core.describe()?.vocab_size;
        self.check_append(&req.append)?;
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
        let test = req.sampling_test.take();
        let test = test.map(|t| check_test(t, &req, vocab)).transpose()?;
        let session = self.core.session(&req.session_id, req.instance_id)?;
        let (reply, answer) = oneshot::channel();
        self.core.submit(
            SessionKey::of(&session),
            VerifyJob {
                session,
                call: self.next_call(),
                kind: Kind::Verify,
                keep: req.keep as usize,
                append: req.append,
                draft: req.draft,
                parents: req.parents,
                test,
                reply,
                enqueued: Instant::now(),
                masks: Vec::new(),
                trace: CallTrace::queued(span),
            },
        )?;
        let verification = answer.await.map_err(|_| WorkerError::Dropped)??;
        let mut response = pb::VerifyResponse {
            timing: Some(timing_to_wire(verification.timing)),
            logprobs: verification.logprobs.iter().map(logprobs_to_wire).collect(),
            give_way: self.core.gives_way(&req.session_id),
            ..pb::VerifyResponse::default()
        };
        match verification.choice {
            Choice::Argmax(argmax) => response.argmax = argmax,
            Choice::P(p) => {
                response.p = p.iter().map(|d| encode_distribution(d, vocab)).collect();
            }
            Choice::Tested {
                accepted,
                token,
                p,
                rng_position,
            } => {
                response.p = p.iter().map(|d| encode_distribution(d, vocab)).collect();
                response.verdict = Some(pb::SamplingVerdict {
                    accepted: accepted as u32,
                    token,
                    rng_position,
                });
            }
        }
        Ok(response)
    }

    /// A number for a call arriving now: later calls get larger ones.
    fn next_call(&self) -> u64 {
        self.calls.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// `append` is not empty, inside the vocabulary, and short (`MAX_VERIFY_APPEND`).
    fn check_append(&self, append: &[u32]) -> Result<(), WorkerError> {
        self.core.check_tokens("append", append)?;
        let limit = duet_proto::MAX_VERIFY_APPEND;
        if append.len() > limit {
            return Err(WorkerError::invalid(
                "append",
                format!(
                    "{} tokens; at most {limit} (open a session for a longer prompt)",
                    append.len()
                ),
            ));
        }
        Ok(())
    }

    /// Checks a Decode and queues its first step; the tokens arrive on the receiver.
    fn start_decode(
        &self,
        req: pb::DecodeRequest,
        span: tracing::Span,
    ) -> Result<mpsc::Receiver<Result<pb::DecodeResponse, WorkerError>>, WorkerError> {
        self.check_append(&req.append)?;
        if req.max_tokens == 0 {
            return Err(WorkerError::invalid("max_tokens", "must be at least 1"));
        }
        let most = duet_proto::MAX_STOP_TOKENS;
        if req.stop_tokens.len() > most {
            let why = format!("{} tokens; at most {most}", req.stop_tokens.len());
            return Err(WorkerError::invalid("stop_tokens", why));
        }
        let session = self.core.session(&req.session_id, req.instance_id)?;
        let (keep, fed) = (req.keep as usize, req.append.len());
        let seq = match &req.lookup {
            // The session's tokens once the first step has fed its own.
            Some(_) => {
                let held = session.lock().unwrap_or_else(|e| e.into_inner());
                let kept = held.cache.tokens().get(..keep).unwrap_or_default();
                kept.iter().chain(&req.append).copied().collect()
            }
            None => Vec::new(),
        };
        let mut decoding = Decoding {
            core: self.core.clone(),
            session,
            call: self.next_call(),
            id: req.session_id,
            instance: req.instance_id,
            max_tokens: req.max_tokens as usize,
            stop: req.stop_tokens,
            lookup: StreamLookup::of(req.lookup, seq)?,
            span,
        };
        let kind = Kind::DecodeFirst {
            rng_position: req.rng_position,
        };
        let room = decoding.max_tokens;
        let first = decoding.queue(keep, req.append, kind, room)?;
        // A token in flight or two: the steps run ahead of a slow reader by no more.
        let (out, rx) = mpsc::channel(2);
        tokio::spawn(decoding.run(keep + fed, first, out));
        Ok(rx)
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

/// A sampling test fits its chain: one probability in [0, 1] a draft, no `parents`, and
/// where it carries the q's whole, one a draft inside the vocabulary, each giving its
/// draft that probability.
fn check_test(
    t: pb::SamplingTest,
    req: &pb::VerifyRequest,
    vocab: usize,
) -> Result<Test, WorkerError> {
    let bad = |why: String| Err(WorkerError::invalid("sampling_test", why));
    if !req.parents.is_empty() {
        return bad("for a chain of drafts only (no parents)".into());
    }
    if t.q.len() != req.draft.len() {
        let (q, d) = (t.q.len(), req.draft.len());
        return bad(format!("{q} probabilities for {d} drafts"));
    }
    if let Some(q) = t.q.iter().find(|q| !(0.0..=1.0).contains(*q)) {
        return bad(format!("a draft's probability of {q}, not in [0, 1]"));
    }
    let whole = match (t.point_masses, t.whole_q.is_empty()) {
        (true, true) => Some(req.draft.iter().map(|&x| Distribution::point(x)).collect()),
        (false, true) => None,
        (true, false) => return bad("whole_q and point_masses both given".into()),
        (false, false) => Some(whole_q(&t, &req.draft, vocab)?),
    };
    Ok(Test {
        q: t.q,
        whole,
        rng_position: t.rng_position,
    })
}

/// Each draft's q off the wire (`SamplingTest.whole_q`).
fn whole_q(
    t: &pb::SamplingTest,
    draft: &[u32],
    vocab: usize,
) -> Result<Vec<Distribution>, WorkerError> {
    let bad = |why: String| WorkerError::invalid("sampling_test.whole_q", why);
    if t.whole_q.len() != draft.len() {
        let (q, d) = (t.whole_q.len(), draft.len());
        return Err(bad(format!("{q} distributions for {d} drafts")));
    }
    let mut whole = Vec::with_capacity(draft.len());
    for (i, d) in t.whole_q.iter().enumerate() {
        let q = decode_distribution(d).map_err(|e| bad(format!("draft {i}: {e}")))?;
        if q.ids().last().is_some_and(|&id| id as usize >= vocab) {
            return Err(bad(format!("draft {i}: beyond the vocabulary of {vocab}")));
        }
        let (x, q_x, got) = (draft[i], t.q[i], q.prob(draft[i]));
        if got != q_x {
            return Err(bad(format!(
                "draft {i}: gives token {x} {got}, not q's {q_x}"
            )));
        }
        whole.push(q);
    }
    Ok(whole)
}

type DecodeStream = Pin<Box<dyn Stream<Item = Result<pb::DecodeResponse, Status>> + Send>>;

#[tonic::async_trait]
impl TargetWorker for TargetService {
    type DecodeStream = DecodeStream;

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

    async fn decode(
        &self,
        request: Request<pb::DecodeRequest>,
    ) -> Result<Response<DecodeStream>, Status> {
        let span = server_span(&request, SERVICE_NAME, "Decode");
        let req = request.into_inner();
        span.set_attribute("duet.session_id", duet_serving::wire::hex(&req.session_id));
        span.set_attribute("duet.keep", req.keep as i64);
        span.set_attribute("duet.append_tokens", req.append.len() as i64);
        span.set_attribute("duet.max_tokens", i64::from(req.max_tokens));
        let started = self.start_decode(req, span.clone());
        traced(span.clone(), async move {
            let stream = ReceiverStream::new(started?).map(move |step| {
                step.map_err(|e| {
                    let s = status(&e);
                    set_error(&span, &s);
                    s
                })
            });
            Ok(Response::new(Box::pin(stream) as DecodeStream))
        })
        .await
    }
}
