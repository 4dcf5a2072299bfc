//! The public Generation service: requests are validated at the edge, each generation runs
//! in a task of its own streaming domain events into a bounded channel, and this module puts
//! them on the wire. Every way a call fails goes through one table, [`status`].

use crate::admission::{Admitted, Refused};
use crate::auth::Auth;
use crate::generation::{Abort, Arrival, generate};
use crate::output::{Event, FinishReason, Usage};
use crate::proposals::Tenant;
use crate::request::{InvalidField, ValidRequest, check};
use crate::workers::{CallError, Failure, Lease, Party};
use crate::{Coordinator, Models};
use duet_proto::v1 as pb;
use duet_proto::v1::generation_server::{Generation, GenerationServer};
use duet_serving::grpc::MAX_MESSAGE_BYTES;
use duet_serving::request_id;
use duet_serving::telemetry::{REQUEST_ID_METADATA, server_span, set_error, traced};
use duet_serving::wire::logprobs_to_wire;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::{Stream, StreamExt};
use tonic::service::interceptor::InterceptedService;
use tonic::{Request, Response, Status};
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// Why a Generate call failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GenerateError {
    #[error(transparent)]
    Invalid(#[from] InvalidField),
    #[error("not ready: {0}")]
    NotReady(String),
    #[error(transparent)]
    Overloaded(#[from] Refused),
    #[error(transparent)]
    Aborted(#[from] Abort),
}

/// The one mapping from a failed call to its gRPC status. A worker's failure keeps what it
/// means for the caller (unreachable or a lost session stay UNAVAILABLE: retrying may
/// work); calls the worker refused as malformed, and malformed answers, are the service's
/// own fault (INTERNAL). The message names the party: the field, the worker and its
/// address, or the coordinator.
pub fn status(e: &GenerateError) -> Status {
    let message = e.to_string();
    match e {
        GenerateError::Invalid(_) => Status::invalid_argument(message),
        GenerateError::NotReady(_) => Status::unavailable(message),
        GenerateError::Overloaded(_) => Status::resource_exhausted(message),
        GenerateError::Aborted(Abort::CallerGone) => Status::cancelled(message),
        GenerateError::Aborted(Abort::Stalled(_) | Abort::TimedOut(_)) => {
            Status::deadline_exceeded(message)
        }
        GenerateError::Aborted(Abort::Internal(_)) => Status::internal(message),
        GenerateError::Aborted(Abort::Worker(CallError { failure, .. })) => match failure {
            Failure::Unreachable(_) | Failure::SessionLost(_) => Status::unavailable(message),
            Failure::TimedOut(_) => Status::deadline_exceeded(message),
            Failure::Busy(_) => Status::resource_exhausted(message),
            Failure::Refused(_) | Failure::Failed(_) | Failure::Malformed(_) => {
                Status::internal(message)
            }
        },
    }
}

/// What a generation's failure means for its caller. A target-worker's refusal of the
/// session of a request naming an adapter is the request's fault where the adapter has
/// gone from the target-workers since this coordinator listed them: their list is asked
/// for again, and an adapter no longer on it is an invalid one (not the coordinator's
/// INTERNAL).
async fn explained(
    coord: &Coordinator,
    models: &Models,
    adapter: Option<&str>,
    abort: Abort,
) -> GenerateError {
    let refused =
        |e: &CallError| e.party == Party::Target && matches!(e.failure, Failure::Refused(_));
    if let (Some(name), Abort::Worker(e)) = (adapter, &abort)
        && refused(e)
    {
        let workers = &coord.workers.inner;
        models.adapters.refresh_now(|| workers.adapters()).await;
        if !models.adapters.contains(name) {
            let names = models.adapters.joined();
            let message = format!("`{name}` is no longer one of the target-workers' ({names})");
            return InvalidField {
                field: "adapter",
                message,
            }
            .into();
        }
    }
    abort.into()
}

fn finish_to_wire(f: FinishReason) -> pb::FinishReason {
    match f {
        FinishReason::Length => pb::FinishReason::Length,
        FinishReason::Stop => pb::FinishReason::Stop,
        FinishReason::Eos => pb::FinishReason::Eos,
        FinishReason::Cancelled => pb::FinishReason::Cancelled,
    }
}

fn usage_to_wire(u: Usage) -> pb::Usage {
    let t = u.timings;
    pb::Usage {
        prompt_tokens: u.prompt_tokens as u32,
        prompt_tokens_cached: u.prompt_tokens_cached as u32,
        completion_tokens: u.completion_tokens as u32,
        reasoning_tokens: u.reasoning_tokens as u32,
        repository_files_left_out: u.repository_files_left_out as u32,
        draft_tokens_proposed: u.draft_tokens_proposed as u32,
        draft_tokens_accepted: u.draft_tokens_accepted as u32,
        rounds: u.rounds as u32,
        method: pb::SpeculationMethod::from(u.method) as i32,
        num_speculative_tokens: u.num_speculative_tokens as u32,
        k_chosen_per_round: u.k_chosen_per_round,
        fell_back_to_target_only: u.fallback.is_some(),
        fallback_reason: u.fallback.unwrap_or_default(),
        timings: Some(pb::Timings {
            time_to_first_token_ms: t.time_to_first_token,
            total_ms: t.total,
            prefill_ms: t.prefill,
            rounds_ms: t.rounds,
            draft_forward_ms: t.draft_forward,
            target_forward_ms: t.target_forward,
            queue_ms: t.queue,
            admission_wait_ms: t.admission_wait,
            draft_ahead_ms: t.draft_ahead,
        }),
        proposers: u
            .proposers
            .iter()
            .map(|p| pb::ProposerUsage {
                method: pb::SpeculationMethod::from(p.proposer) as i32,
                rounds: p.rounds as u32,
                draft_tokens_proposed: p.proposed as u32,
                draft_tokens_accepted: p.accepted as u32,
            })
            .collect(),
        target_failovers: u
            .target_failovers
            .into_iter()
            .map(|(at, reason)| pb::TargetFailover {
                at_completion_tokens: at as u32,
                reason,
            })
            .collect(),
        preempted_at: u.preempted_at.iter().map(|&at| at as u32).collect(),
        drafted_ahead: u.drafted_ahead as u32,
        drafted_ahead_used: u.drafted_ahead_used as u32,
    }
}

fn tool_call_to_wire(c: duet_engine::ToolCall) -> pb::ToolCall {
    pb::ToolCall {
        id: c.id,
        name: c.name,
        arguments: c.arguments,
    }
}

/// One stream message on the wire.
fn to_wire(event: Event) -> pb::GenerateResponse {
    use pb::generate_response::Event as Wire;
    let event = match event {
        Event::Chunk(c) => Wire::Chunk(pb::Chunk {
            text: c.text,
            reasoning: c.reasoning,
            token_ids: c.tokens,
            logprobs: c.logprobs.iter().map(logprobs_to_wire).collect(),
            prompt: c.prompt.map(|p| pb::PromptLogprobs {
                token_ids: p.tokens,
                logprobs: p.logprobs.iter().map(logprobs_to_wire).collect(),
            }),
        }),
        Event::Finished(f) => Wire::Finished(pb::Finished {
            usage: Some(usage_to_wire(f.usage)),
            finish_reason: finish_to_wire(f.reason) as i32,
            text: f.text,
            reasoning: f.reasoning,
            tool_calls: f.tool_calls.into_iter().map(tool_call_to_wire).collect(),
            stop_string: f.stop_string.unwrap_or_default(),
            stop_token_id: f.stop_token_id,
        }),
    };
    pb::GenerateResponse { event: Some(event) }
}

pub(crate) type GenerateStream =
    Pin<Box<dyn Stream<Item = Result<pb::GenerateResponse, Status>> + Send>>;

/// A generation under way: its stream, and the length of its prompt in tokens as the target
/// reads it (chat template applied), which Anthropic's `message_start` reports before any
/// token comes.
pub(crate) struct Started {
    pub(crate) stream: GenerateStream,
    pub(crate) prompt_tokens: usize,
}

/// The log target of the requests' own lines (one as each ends): `RUST_LOG` can quiet
/// them (`duet_coordinator::requests=warn`) apart from the rest.
pub(crate) const REQUEST_LOG: &str = "duet_coordinator::requests";

/// Who sent a request: its tenant (by its bearer token) and its own id, a caller's or a
/// gateway's `x-request-id`.
#[derive(Debug, Clone, Default)]
pub(crate) struct Caller {
    pub(crate) tenant: Option<Tenant>,
    pub(crate) request_id: Option<String>,
}

impl Caller {
    /// A gRPC call's: its `x-request-id` metadata where that fits (recorded on its server
    /// `span`), else a fresh id, as the HTTP API's.
    fn of<T>(request: &Request<T>, span: &tracing::Span) -> Self {
        let own = request_id::of_call(request.metadata());
        if let Some(id) = &own {
            span.record(REQUEST_ID_METADATA, id.as_str());
        }
        Self {
            tenant: request.extensions().get::<Tenant>().copied(),
            request_id: Some(own.unwrap_or_else(request_id::fresh)),
        }
    }
}

/// `answer` with the call's id in its metadata (`x-request-id`), as the HTTP API's answers
/// carry it.
fn with_id<T>(mut answer: Response<T>, id: Option<String>) -> Response<T> {
    put_id(answer.metadata_mut(), id.as_deref());
    answer
}

/// A refusal or failure with the call's id in its metadata too, as the HTTP API's errors
/// carry it: the id its trace and log lines name.
pub(crate) fn refused_with_id(mut status: Status, id: Option<&str>) -> Status {
    put_id(status.metadata_mut(), id);
    status
}

/// The call's id as `x-request-id` metadata, where it has one.
fn put_id(metadata: &mut tonic::metadata::MetadataMap, id: Option<&str>) {
    if let Some(id) = id.and_then(|id| id.parse().ok()) {
        metadata.insert("x-request-id", id);
    }
}

#[derive(Debug, Clone)]
pub struct GenerationService {
    coord: Arc<Coordinator>,
}

impl GenerationService {
    pub const NAME: &'static str = duet_proto::v1::generation_server::SERVICE_NAME;

    pub(crate) fn new(coord: Arc<Coordinator>) -> Self {
        Self { coord }
    }

    /// The service, each call checked by `auth` first.
    pub fn server(
        coord: Arc<Coordinator>,
        auth: Auth,
    ) -> InterceptedService<GenerationServer<Self>, Auth> {
        // A larger request could only be refused after decoding it.
        let limit = coord.config.limits.max_request_bytes();
        let server = GenerationServer::new(Self::new(coord))
            .max_decoding_message_size(limit)
            .max_encoding_message_size(MAX_MESSAGE_BYTES);
        InterceptedService::new(server, auth)
    }

    /// The request checked, given a place (it may wait in the queue) and tokenized.
    async fn admit(
        &self,
        req: pb::GenerateRequest,
        tenant: Option<Tenant>,
    ) -> Result<(Arc<Models>, ValidRequest, Admitted), GenerateError> {
        let c = &self.coord;
        let models = c.models().await.map_err(GenerateError::NotReady)?;
        if !req.adapter.is_empty() {
            c.learn_adapter(&models, &req.adapter).await;
        }
        let priority = req.priority;
        let checked = check(req, &c.config)?;
        let tenant = tenant.map_or(0, |t| t.0);
        let admitted = c.admission.admit(priority, tenant).await?;
        // Tokenizing costs CPU in proportion to the input: off the async threads, and only
        // for requests that hold a place, which goes with the work.
        let (m, default_max_tokens) = (models.clone(), c.config.default_max_tokens);
        let (valid, admitted) = admitted
            .run_blocking(move || checked.tokenize(&m, default_max_tokens))
            .await
            .map_err(|e| Abort::Internal(format!("tokenizing: {e}")))?;
        Ok((models, valid?, admitted))
    }

    /// Validates and starts a generation; its stream ends with the final message or the
    /// status of its failure.
    pub(crate) async fn start(
        &self,
        req: pb::GenerateRequest,
        Caller { tenant, request_id }: Caller,
        span: tracing::Span,
    ) -> Result<Started, Status> {
        let arrived = Instant::now();
        let c = &self.coord;
        let (models, mut valid, admitted) = match self.admit(req, tenant).await {
            Ok(ok) => ok,
            Err(e) => {
                let status = status(&e);
                c.metrics.request_ended("", status.code());
                let (id, code) = (request_id.as_deref().unwrap_or("-"), status.code());
                tracing::debug!(target: REQUEST_LOG, request_id = %id, ?code, "request refused");
                return Err(status);
            }
        };
        valid.request_id = request_id;
        let salt = c.prefix_salt(tenant, valid.cache_salt);
        valid.cache_salt = duet_engine::adapter_salt(salt, valid.adapter.as_deref());
        record_request(&span, &valid);
        let prompt_tokens = valid.prompt.len();
        // Room for a few rounds: a slow reader delays generation rather than buffering it
        // all. A failure ends the stream after what was sent, through a channel of its
        // own (the stream's may be full: the caller stopped reading).
        let (tx, rx) = mpsc::channel(8);
        let (failed, failure) = oneshot::channel::<GenerateError>();
        let (coord, adapter) = (c.clone(), valid.adapter.clone());
        let task_span = span.clone();
        tokio::spawn(
            async move {
                let arrival = Arrival {
                    at: arrived,
                    queued: admitted.waited,
                };
                coord.metrics.running.inc();
                let ctx = coord.context(models.clone(), Lease::new(admitted), tenant);
                // The whole request, its queueing included, within the limit: a caller that
                // reads slowly enough never to stall still gives its place back.
                let limit = coord.config.limits.request_timeout_ms;
                let deadline =
                    tokio::time::Instant::from_std(arrived) + Duration::from_millis(limit);
                let id = valid.request_id.clone().unwrap_or_else(|| "-".into());
                let run = generate(ctx, valid, arrival, &tx);
                let ended = tokio::time::timeout_at(deadline, run).await;
                if let Err(abort) = ended.unwrap_or(Err(Abort::TimedOut(limit))) {
                    let error = explained(&coord, &models, adapter.as_deref(), abort).await;
                    let status = status(&error);
                    coord.metrics.request_ended("", status.code());
                    match error {
                        GenerateError::Aborted(Abort::CallerGone) => {
                            let gone = "caller went away; generation stopped";
                            tracing::debug!(request_id = %id, "{gone}");
                            span.set_attribute("duet.finish_reason", "cancelled");
                        }
                        error => {
                            tracing::warn!(request_id = %id, %error, "generation failed");
                            set_error(&span, &status);
                            let _ = failed.send(error);
                        }
                    }
                }
                coord.metrics.running.dec();
            }
            .instrument(task_span),
        );
        let failure = futures::stream::once(failure)
            .filter_map(|ended| ended.ok().map(|error| Err(status(&error))));
        let stream = ReceiverStream::new(rx)
            .map(|event| Ok(to_wire(event)))
            .chain(failure);
        Ok(Started {
            stream: Box::pin(stream),
            prompt_tokens,
        })
    }
}

/// What a request asks for, on its server span.
fn record_request(span: &tracing::Span, valid: &ValidRequest) {
    span.set_attribute("duet.method", valid.method.name());
    span.set_attribute("duet.num_speculative_tokens", valid.k as i64);
    span.set_attribute("duet.max_tokens", valid.max_tokens as i64);
    span.set_attribute("duet.prompt_tokens", valid.prompt.len() as i64);
    if let Some(adapter) = &valid.adapter {
        span.set_attribute("duet.adapter", adapter.clone());
    }
    if let Some(format) = &valid.format {
        span.set_attribute("duet.structured_output", format.name());
    }
}

#[tonic::async_trait]
impl Generation for GenerationService {
    type GenerateStream = GenerateStream;

    async fn generate(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> Result<Response<GenerateStream>, Status> {
        let span = server_span(&request, Self::NAME, "Generate");
        let caller = Caller::of(&request, &span);
        let id = caller.request_id.clone();
        let started = traced(span.clone(), self.start(request.into_inner(), caller, span))
            .await
            .map_err(|s| refused_with_id(s, id.as_deref()))?;
        Ok(with_id(Response::new(started.stream), id))
    }

    async fn complete(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> Result<Response<pb::CompleteResponse>, Status> {
        let span = server_span(&request, Self::NAME, "Complete");
        let caller = Caller::of(&request, &span);
        let id = caller.request_id.clone();
        let started = traced(span.clone(), self.start(request.into_inner(), caller, span))
            .await
            .map_err(|s| refused_with_id(s, id.as_deref()))?;
        let done = duet_proto::Completion::read(started.stream, |_| {})
            .await
            .map_err(|s| refused_with_id(s, id.as_deref()))?;
        Ok(with_id(Response::new(done.into_response()), id))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::method::Method;
    use crate::workers::Party;
    use tonic::Code;

    fn worker(party: Party, failure: Failure) -> GenerateError {
        GenerateError::Aborted(Abort::Worker(CallError {
            party,
            at: Some("10.0.0.7:50063".into()),
            failure,
        }))
    }

    /// Each failure → its code, with a message naming the right party.
    #[test]
    fn every_failure_has_its_code_and_names_its_party() {
        use Party::{Draft, Target};
        let m = |s: &str| s.to_string();
        let cases = [
            (
                GenerateError::Invalid(InvalidField {
                    field: "temperature",
                    message: m("-1 must be a number >= 0"),
                }),
                Code::InvalidArgument,
                "temperature: -1",
            ),
            (
                GenerateError::NotReady(m("the target-worker is loading")),
                Code::Unavailable,
                "not ready: the target-worker",
            ),
            (
                GenerateError::Overloaded(Refused::QueueFull {
                    limit: 64,
                    max_queued: 64,
                }),
                Code::ResourceExhausted,
                "too many generations running (max_concurrent_requests = 64) and the wait queue",
            ),
            (
                GenerateError::Overloaded(Refused::TimedOut {
                    limit: 64,
                    waited_ms: 30000,
                }),
                Code::ResourceExhausted,
                "too many generations running (max_concurrent_requests = 64): waited 30000 ms",
            ),
            (
                GenerateError::Overloaded(Refused::TenantTimedOut {
                    limit: 4,
                    waited_ms: 30000,
                }),
                Code::ResourceExhausted,
                "this token's requests hold all the places one token may \
                 (max_concurrent_requests_per_token = 4): waited 30000 ms",
            ),
            (
                GenerateError::Aborted(Abort::CallerGone),
                Code::Cancelled,
                "the caller went away",
            ),
            (
                GenerateError::Aborted(Abort::Stalled(30_000)),
                Code::DeadlineExceeded,
                "the caller took no stream message for 30000 ms",
            ),
            (
                GenerateError::Aborted(Abort::TimedOut(900_000)),
                Code::DeadlineExceeded,
                "the request ran past limits.request_timeout_ms (900000 ms)",
            ),
            (
                GenerateError::Aborted(Abort::Internal(m("detokenizing 7: unknown id"))),
                Code::Internal,
                "coordinator: detokenizing 7",
            ),
            (
                worker(Target, Failure::Unreachable(m("connection refused"))),
                Code::Unavailable,
                "target-worker at 10.0.0.7:50063: unreachable: connection refused",
            ),
            (
                worker(Target, Failure::SessionLost(m("session 9 not found"))),
                Code::Unavailable,
                "target-worker at 10.0.0.7:50063: session lost",
            ),
            (
                worker(
                    Target,
                    Failure::TimedOut(m("target Verify took longer than 60000 ms")),
                ),
                Code::DeadlineExceeded,
                "target-worker at 10.0.0.7:50063: target Verify took longer",
            ),
            (
                worker(Target, Failure::Busy(m("session limit reached"))),
                Code::ResourceExhausted,
                "target-worker at 10.0.0.7:50063: busy",
            ),
            (
                worker(Target, Failure::Refused(m("keep: 9 exceeds"))),
                Code::Internal,
                "target-worker at 10.0.0.7:50063: refused the call",
            ),
            (
                worker(Target, Failure::Failed(m("model error"))),
                Code::Internal,
                "target-worker at 10.0.0.7:50063: failed",
            ),
            (
                worker(Target, Failure::Malformed(m("3 positions for 4 drafts"))),
                Code::Internal,
                "target-worker at 10.0.0.7:50063: malformed answer",
            ),
            (
                worker(Draft, Failure::Failed(m("model error"))),
                Code::Internal,
                "draft-worker at 10.0.0.7:50063: failed",
            ),
        ];
        for (error, code, message) in cases {
            let s = status(&error);
            assert_eq!(s.code(), code, "{error}");
            assert!(
                s.message().starts_with(message),
                "{:?} vs {message:?}",
                s.message()
            );
        }
    }

    #[test]
    fn events_go_on_the_wire_whole() {
        let usage = Usage {
            prompt_tokens: 5,
            completion_tokens: 2,
            rounds: 1,
            method: Method::DRAFT_MODEL,
            num_speculative_tokens: 4,
            fallback: Some("draft-worker: gone".into()),
            ..Usage::default()
        };
        let finished = to_wire(Event::Finished(Box::new(crate::output::Finished {
            reason: FinishReason::Eos,
            text: "!".into(),
            reasoning: String::new(),
            usage,
            tool_calls: Vec::new(),
            stop_string: None,
            stop_token_id: None,
        })));
        let Some(pb::generate_response::Event::Finished(f)) = finished.event else {
            panic!("{finished:?}");
        };
        assert_eq!(f.finish_reason, pb::FinishReason::Eos as i32);
        let u = f.usage.unwrap();
        assert_eq!(
            (
                u.prompt_tokens,
                u.completion_tokens,
                u.rounds,
                u.num_speculative_tokens
            ),
            (5, 2, 1, 4)
        );
        assert_eq!(u.method, pb::SpeculationMethod::DraftModel as i32);
        assert!(u.fell_back_to_target_only);
        assert_eq!(u.fallback_reason, "draft-worker: gone");
    }
}
