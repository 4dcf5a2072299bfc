//! Clients for the two workers: deadlines on every call, sessions pinned to the replica
//! that opened them (`crate::pool`), the draft-worker's circuit breaker, and the model
//! facts (tokenizer, context) learnt from the target-worker.

use crate::config::{DraftConfig, TargetConfig};
use crate::pool::{Hold, Pool, Replica, Traced};
use duet_engine::Tokenizer;
use duet_engine::sampling::{Distribution, SamplingParams};
use duet_proto::v1 as pb;
use duet_proto::v1::draft_worker_client::DraftWorkerClient;
use duet_proto::v1::target_worker_client::TargetWorkerClient;
use duet_serving::grpc::{Health, MAX_MESSAGE_BYTES};
use duet_serving::telemetry::{client_span, traced};
use duet_serving::wire::{decode_distribution, sampling_to_wire};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tonic::transport::Channel;
use tonic::{Code, Status};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

/// The coordinator's health service reports its breaker under this name.
pub const DRAFT_HEALTH_NAME: &str = "duet.v1.DraftWorker";

const TARGET_SERVICE: &str = "duet.v1.TargetWorker";
const DRAFT_SERVICE: &str = "duet.v1.DraftWorker";

/// Runs `call` with a deadline; running out is DEADLINE_EXCEEDED naming `what`.
async fn deadline<T>(
    what: &str,
    limit: Duration,
    call: impl Future<Output = Result<T, Status>>,
) -> Result<T, Status> {
    tokio::time::timeout(limit, call).await.unwrap_or_else(|_| {
        Err(Status::deadline_exceeded(format!(
            "{what} took longer than {} ms",
            limit.as_millis()
        )))
    })
}

async fn serving(health: &mut HealthClient<Channel>, limit: Duration) -> Result<bool, Status> {
    let check = health.check(tonic_health::pb::HealthCheckRequest {
        service: String::new(),
    });
    let status = deadline("health check", limit, check)
        .await?
        .into_inner()
        .status;
    Ok(status == ServingStatus::Serving as i32)
}

/// What the coordinator knows about the models, from the target-worker's Describe.
#[derive(Debug)]
pub struct Models {
    pub tokenizer: Tokenizer,
    pub vocabulary_sha256: String,
    pub vocab: usize,
    /// The target's session context; a draft with less lowers it per request.
    pub context: usize,
    pub target_model: String,
}

type CloseCall = Pin<Box<dyn Future<Output = ()> + Send>>;

/// A session open on a worker. Dropping it closes the session in the background (best
/// effort: the worker's idle TTL is the backstop), so every way out of a request frees it.
pub struct Session {
    pub id: u64,
    pub timing: pb::Timing,
    /// The replica that holds the session: every call of the session goes there.
    channel: Traced,
    _hold: Hold,
    /// Makes the CloseSession call, within the given deadline.
    close: Option<(Closer, Duration)>,
}

/// A CloseSession call for (channel, session id, deadline).
type Closer = fn(Traced, u64, Duration) -> CloseCall;

fn close_target(channel: Traced, session_id: u64, limit: Duration) -> CloseCall {
    Box::pin(async move {
        let mut client = target_client(channel);
        let call = client.close_session(pb::CloseSessionRequest { session_id });
        let _ = tokio::time::timeout(limit, call).await;
    })
}

fn close_draft(channel: Traced, session_id: u64, limit: Duration) -> CloseCall {
    Box::pin(async move {
        let mut client = draft_client(channel);
        let call = client.close_session(pb::CloseSessionRequest { session_id });
        let _ = tokio::time::timeout(limit, call).await;
    })
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session").field("id", &self.id).finish()
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        if let (Some((close, limit)), Ok(rt)) =
            (self.close.take(), tokio::runtime::Handle::try_current())
        {
            rt.spawn(close(self.channel.clone(), self.id, limit));
        }
    }
}

/// Opens a session on the least loaded replica of `pool`, trying the next one while a
/// replica cannot be reached (nothing was opened there, so another may take it). `open`
/// makes the OpenSession call on a channel; `close` closes the session when it drops.
async fn open_session<O, F>(
    what: &str,
    pool: &Pool,
    limit: Duration,
    open: O,
    close: (Closer, Duration),
) -> Result<Session, Status>
where
    O: Fn(Traced) -> F,
    F: Future<Output = Result<tonic::Response<pb::OpenSessionResponse>, Status>>,
{
    let mut failure = Status::unavailable(format!("{what}: no replica resolved yet"));
    for replica in pool.by_load() {
        let channel = replica.traced();
        let hold = replica.hold();
        match deadline(what, limit, open(channel.clone())).await {
            Ok(r) => {
                let r = r.into_inner();
                return Ok(Session {
                    id: r.session_id,
                    timing: r.timing.unwrap_or_default(),
                    close: Some(close),
                    channel,
                    _hold: hold,
                });
            }
            // Refused, or the connection broke (a replica that went away answers either way).
            Err(status)
                if matches!(
                    status.code(),
                    Code::Unavailable | Code::Unknown | Code::Cancelled
                ) =>
            {
                tracing::warn!(replica = %replica.addr, error = %status.message(), "{what}: replica unavailable; trying the next");
                failure = status;
            }
            Err(status) => return Err(status),
        }
    }
    Err(failure)
}

/// The first replica whose health check says SERVING, or why none did: FAILED_PRECONDITION
/// when one answered NOT_SERVING (loading, draining), else the last error reaching one.
async fn first_serving(pool: &Pool, limit: Duration) -> Result<Replica, Status> {
    if pool.replicas().is_empty() {
        // Not resolved yet (or nothing was found last time): ask now, not at the next round.
        pool.refresh().await;
    }
    let mut unreachable = Status::unavailable("no replica resolved (yet)");
    let mut not_serving = None;
    for replica in pool.replicas() {
        let mut health = HealthClient::new(replica.channel.clone());
        match serving(&mut health, limit).await {
            Ok(true) => return Ok(replica),
            Ok(false) => {
                not_serving = Some(Status::failed_precondition(format!(
                    "{} is not serving (loading or draining)",
                    replica.addr
                )));
            }
            Err(e) => unreachable = e,
        }
    }
    Err(not_serving.unwrap_or(unreachable))
}

fn target_client(channel: Traced) -> TargetWorkerClient<Traced> {
    TargetWorkerClient::new(channel)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES)
}

fn draft_client(channel: Traced) -> DraftWorkerClient<Traced> {
    DraftWorkerClient::new(channel)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES)
}

/// One Propose answer.
#[derive(Debug)]
pub struct Proposal {
    pub tokens: Vec<u32>,
    /// Empty for greedy sessions.
    pub q: Vec<Distribution>,
    pub timing: pb::Timing,
}

/// One Verify answer.
#[derive(Debug)]
pub struct Verified {
    pub argmax: Vec<u32>,
    /// Empty for greedy sessions.
    pub p: Vec<Distribution>,
    pub timing: pb::Timing,
}

fn decode_all(ds: &[pb::Distribution], what: &str) -> Result<Vec<Distribution>, Status> {
    ds.iter()
        .map(|d| {
            decode_distribution(d)
                .map_err(|e| Status::internal(format!("malformed {what} distribution: {e}")))
        })
        .collect()
}

fn open_request(
    prompt: &[u32],
    capacity: usize,
    sampling: &SamplingParams,
) -> pb::OpenSessionRequest {
    pb::OpenSessionRequest {
        prompt: prompt.to_vec(),
        capacity: capacity as u32,
        sampling: Some(sampling_to_wire(sampling)),
    }
}

#[derive(Debug, Clone)]
pub struct TargetClient {
    pool: Arc<Pool>,
    config: TargetConfig,
}

impl TargetClient {
    /// Starts resolving the target-worker's replicas (in the background, every
    /// `discovery_interval_ms`).
    pub fn new(config: &TargetConfig) -> Self {
        let pool = Pool::new(
            &config.address,
            Duration::from_millis(config.connect_timeout_ms),
        );
        pool.keep_resolving(Duration::from_millis(config.discovery_interval_ms));
        Self {
            pool,
            config: config.clone(),
        }
    }

    pub fn address(&self) -> &str {
        &self.config.address
    }

    fn limit(&self) -> Duration {
        Duration::from_millis(self.config.timeout_ms)
    }

    /// Whether some replica serves (the coordinator's own readiness).
    pub async fn is_serving(&self) -> Result<bool, Status> {
        match first_serving(&self.pool, self.limit()).await {
            Ok(_) => Ok(true),
            Err(e) if e.code() == Code::FailedPrecondition => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Describe, turned into the facts the coordinator needs.
    pub async fn models(&self) -> Result<Models, Status> {
        let replica = first_serving(&self.pool, self.limit()).await?;
        let d = deadline(
            "target Describe",
            self.limit(),
            target_client(replica.traced()).describe(pb::DescribeRequest {}),
        )
        .await?
        .into_inner();
        let tokenizer = Tokenizer::from_gguf_bytes(&d.tokenizer)
            .map_err(|e| Status::internal(format!("the target's tokenizer: {e}")))?;
        Ok(Models {
            tokenizer,
            vocabulary_sha256: d.vocabulary_sha256,
            vocab: d.vocab_size as usize,
            context: d.context_length as usize,
            target_model: d.model,
        })
    }

    pub async fn open(
        &self,
        prompt: &[u32],
        capacity: usize,
        sampling: &SamplingParams,
    ) -> Result<Session, Status> {
        let request = open_request(prompt, capacity, sampling);
        let limit = self.limit();
        let open = open_session(
            "target OpenSession",
            &self.pool,
            limit,
            |channel| {
                let request = request.clone();
                async move { target_client(channel).open_session(request).await }
            },
            (close_target, limit),
        );
        traced(client_span(TARGET_SERVICE, "OpenSession"), open).await
    }

    pub async fn verify(
        &self,
        session: &Session,
        keep: usize,
        append: &[u32],
        draft: &[u32],
    ) -> Result<Verified, Status> {
        let mut client = target_client(session.channel.clone());
        let call = client.verify(pb::VerifyRequest {
            session_id: session.id,
            keep: keep as u32,
            append: append.to_vec(),
            draft: draft.to_vec(),
        });
        let verify = async {
            let r = deadline("target Verify", self.limit(), call)
                .await?
                .into_inner();
            Ok(Verified {
                p: decode_all(&r.p, "target")?,
                argmax: r.argmax,
                timing: r.timing.unwrap_or_default(),
            })
        };
        traced(client_span(TARGET_SERVICE, "Verify"), verify).await
    }
}

/// The draft-worker with its circuit breaker: after a failure (unreachable, too slow, an
/// error) requests skip it, target-only, until its health check reports SERVING again and
/// its vocabulary still matches the target's.
#[derive(Debug)]
pub struct DraftClient {
    pool: Arc<Pool>,
    config: DraftConfig,
    open: AtomicBool,
    probing: AtomicBool,
    reason: Mutex<String>,
    /// The target's vocabulary hash, once known: the draft must match it.
    expected_vocabulary: Mutex<Option<String>>,
    /// Where the breaker's state is published (health service `duet.v1.DraftWorker`).
    health_report: std::sync::OnceLock<Health>,
}

impl DraftClient {
    /// A client whose breaker starts open until the first successful check.
    pub fn new(config: &DraftConfig) -> Arc<Self> {
        let pool = Pool::new(
            &config.address,
            Duration::from_millis(config.connect_timeout_ms),
        );
        pool.keep_resolving(Duration::from_millis(config.discovery_interval_ms));
        Arc::new(Self {
            pool,
            config: config.clone(),
            open: AtomicBool::new(true),
            probing: AtomicBool::new(false),
            reason: Mutex::new("the draft-worker has not been checked yet".into()),
            expected_vocabulary: Mutex::new(None),
            health_report: std::sync::OnceLock::new(),
        })
    }

    fn limit(&self) -> Duration {
        Duration::from_millis(self.config.timeout_ms)
    }

    /// Deadline of health checks, Describe and CloseSession: control calls, not bound by the
    /// tight per-round `timeout_ms`.
    fn control_limit(&self) -> Duration {
        Duration::from_millis(self.config.connect_timeout_ms.max(self.config.timeout_ms))
    }

    /// Publishes the breaker's state on `health` as service `duet.v1.DraftWorker`: SERVING
    /// while requests use the draft-worker.
    pub fn report_to(&self, health: Health) {
        let _ = self.health_report.set(health);
        self.report();
    }

    fn report(&self) {
        if let Some(h) = self.health_report.get().cloned() {
            let closed = !self.open.load(Ordering::Acquire);
            tokio::spawn(async move { h.set_named(DRAFT_HEALTH_NAME, closed).await });
        }
    }

    /// `Err(reason)` while the breaker is open.
    pub fn available(&self) -> Result<(), String> {
        if self.open.load(Ordering::Acquire) {
            Err(self
                .reason
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone())
        } else {
            Ok(())
        }
    }

    /// Checks the draft-worker against the target's vocabulary once now (so a coordinator
    /// that reports ready has tried its draft-worker), then keeps probing while it fails.
    pub async fn expect_vocabulary(self: &Arc<Self>, sha256: String) {
        *self
            .expected_vocabulary
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(sha256);
        if self.check().await.is_ok() && self.open.swap(false, Ordering::AcqRel) {
            self.report();
            tracing::info!("draft-worker healthy; speculation on");
        }
        if self.open.load(Ordering::Acquire) {
            self.probe();
        }
    }

    /// Opens the breaker (requests skip the draft-worker) and starts the health probe.
    pub fn trip(self: &Arc<Self>, reason: String) {
        *self.reason.lock().unwrap_or_else(|e| e.into_inner()) = reason.clone();
        if !self.open.swap(true, Ordering::AcqRel) {
            tracing::warn!(%reason, "draft-worker circuit breaker opened; running target-only");
            self.report();
        }
        self.probe();
    }

    fn probe(self: &Arc<Self>) {
        if self.probing.swap(true, Ordering::AcqRel) {
            return;
        }
        let this = self.clone();
        tokio::spawn(async move {
            let interval = Duration::from_millis(this.config.health_interval_ms);
            loop {
                match this.check().await {
                    Ok(()) => {
                        this.open.store(false, Ordering::Release);
                        this.report();
                        tracing::info!("draft-worker healthy; speculation on");
                        break;
                    }
                    Err(reason) => {
                        let mut last = this.reason.lock().unwrap_or_else(|e| e.into_inner());
                        if *last != reason {
                            tracing::warn!(%reason, "draft-worker unusable; running target-only");
                            *last = reason;
                        }
                    }
                }
                tokio::time::sleep(interval).await;
            }
            this.probing.store(false, Ordering::Release);
        });
    }

    async fn check(&self) -> Result<(), String> {
        let address = &self.config.address;
        let replica = first_serving(&self.pool, self.control_limit())
            .await
            .map_err(|e| format!("draft-worker at {address}: {}", e.message()))?;
        let expected = self
            .expected_vocabulary
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let Some(expected) = expected else {
            return Err("waiting for the target-worker's vocabulary".into());
        };
        let d = deadline(
            "draft Describe",
            self.control_limit(),
            draft_client(replica.traced()).describe(pb::DescribeRequest {}),
        )
        .await
        .map_err(|e| format!("draft-worker at {address}: {}", e.message()))?
        .into_inner();
        if d.vocabulary_sha256 != expected {
            return Err(format!(
                "the draft model {} has a different vocabulary from the target's; speculation needs the same one",
                d.model
            ));
        }
        Ok(())
    }

    pub async fn open(
        &self,
        prompt: &[u32],
        capacity: usize,
        sampling: &SamplingParams,
    ) -> Result<Session, Status> {
        let request = open_request(prompt, capacity, sampling);
        let limit = Duration::from_millis(self.config.open_timeout_ms);
        let close_limit = self.control_limit();
        let open = open_session(
            "draft OpenSession",
            &self.pool,
            limit,
            |channel| {
                let request = request.clone();
                async move { draft_client(channel).open_session(request).await }
            },
            (close_draft, close_limit),
        );
        traced(client_span(DRAFT_SERVICE, "OpenSession"), open).await
    }

    /// Reads the whole Propose stream (K tokens) within the deadline.
    pub async fn propose(
        &self,
        session: &Session,
        keep: usize,
        append: &[u32],
        k: usize,
    ) -> Result<Proposal, Status> {
        let mut client = draft_client(session.channel.clone());
        let request = pb::ProposeRequest {
            session_id: session.id,
            keep: keep as u32,
            append: append.to_vec(),
            k: k as u32,
        };
        let propose = deadline("draft Propose", self.limit(), async move {
            let mut stream = client.propose(request).await?.into_inner();
            let mut tokens = Vec::with_capacity(k);
            let mut q = Vec::new();
            let mut timing = pb::Timing::default();
            while let Some(m) = stream.message().await? {
                tokens.push(m.token);
                if let Some(d) = &m.q {
                    q.extend(decode_all(std::slice::from_ref(d), "draft")?);
                }
                if let Some(t) = m.timing {
                    timing = t;
                }
            }
            if tokens.len() != k {
                return Err(Status::internal(format!(
                    "the draft-worker sent {} tokens, {k} were asked for",
                    tokens.len()
                )));
            }
            Ok(Proposal { tokens, q, timing })
        });
        traced(client_span(DRAFT_SERVICE, "Propose"), propose).await
    }
}

/// Whether a draft-worker failure says the worker itself is in trouble (trip the breaker)
/// rather than this one request being refused (RESOURCE_EXHAUSTED: just skip it this time).
pub fn trips_breaker(status: &Status) -> bool {
    !matches!(
        status.code(),
        Code::ResourceExhausted | Code::InvalidArgument
    )
}
