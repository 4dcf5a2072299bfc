//! The worker core both workers build on: configuration, the loaded model on one thread fed
//! by one bounded queue (candle serialises concurrent forward passes anyway), the session
//! table, and the RPCs the two worker services share (Describe, OpenSession, CloseSession,
//! Stats). A worker adds its own job type through [`Handler`].

mod config;
mod metrics;
mod run;
mod sessions;

pub use config::WorkerConfig;
pub use metrics::{KindLabel, WorkerMetrics};
pub use run::{GrpcService, RunError, WorkerArgs, main, serve_worker};
pub use sessions::{Limits, Reservation, Session, SessionStats, Sessions};

use crate::grpc::Health;
use crate::wire;
use duet_engine::sampling::{SamplingParams, rng_for};
use duet_engine::{EngineError, LoadOptions, LogitsFor, Model, Tokenizer};
use duet_proto::v1 as pb;
use sha2::{Digest, Sha256};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};
use thiserror::Error;
use tokio::sync::{mpsc, oneshot};
use tonic::Status;

/// Why a worker call failed. [`WorkerError::into_status`] is the one mapping to gRPC codes.
#[derive(Debug, Error)]
pub enum WorkerError {
    #[error("the model is still loading")]
    Loading,
    #[error("the worker is shutting down")]
    ShuttingDown,
    #[error("session {0} not found (closed, or expired after the idle TTL)")]
    SessionNotFound(u64),
    #[error("session limit reached ({0} open sessions)")]
    SessionLimit(usize),
    #[error("KV-token budget exhausted: {requested} tokens requested, {free} free")]
    KvBudget { requested: usize, free: usize },
    #[error("{field}: {message}")]
    InvalidArgument {
        field: &'static str,
        message: String,
    },
    #[error("model error: {0}")]
    Engine(#[from] EngineError),
}

impl WorkerError {
    pub fn invalid(field: &'static str, message: impl Into<String>) -> Self {
        Self::InvalidArgument {
            field,
            message: message.into(),
        }
    }

    pub fn into_status(self) -> Status {
        let message = self.to_string();
        match self {
            Self::Loading | Self::ShuttingDown => Status::unavailable(message),
            Self::SessionNotFound(_) => Status::not_found(message),
            Self::SessionLimit(_) | Self::KvBudget { .. } => Status::resource_exhausted(message),
            Self::InvalidArgument { .. } => Status::invalid_argument(message),
            Self::Engine(EngineError::TokenOutOfRange { .. })
            | Self::Engine(EngineError::EmptyInput)
            | Self::Engine(EngineError::CacheFull { .. }) => Status::invalid_argument(message),
            Self::Engine(_) => Status::internal(message),
        }
    }
}

impl From<WorkerError> for Status {
    fn from(e: WorkerError) -> Self {
        e.into_status()
    }
}

/// Queue wait and forward time of one call.
#[derive(Debug, Clone, Copy, Default)]
pub struct Timing {
    pub queue: Duration,
    pub forward: Duration,
}

impl Timing {
    pub fn to_wire(self) -> pb::Timing {
        pb::Timing {
            queue_us: self.queue.as_micros() as u64,
            forward_us: self.forward.as_micros() as u64,
        }
    }
}

/// A call's trace on the worker: its server span, and a `queue` span from submission until
/// the model thread takes the call.
#[derive(Debug)]
pub struct CallTrace {
    pub span: tracing::Span,
    queued: Option<tracing::Span>,
}

impl CallTrace {
    /// Starts the `queue` span under `span` (the call's server span).
    pub fn queued(span: tracing::Span) -> Self {
        let queued = tracing::info_span!(parent: &span, "queue");
        Self {
            span,
            queued: Some(queued),
        }
    }

    /// The model thread took the call: the `queue` span ends and a `forward` span starts.
    /// Both it and the call's span (which ends at its last exit, and a streaming call's
    /// handler has long returned) end when the returned guard is dropped.
    pub fn forward(&mut self) -> Forward {
        self.queued = None;
        let call = self.span.clone().entered();
        Forward {
            span: tracing::info_span!(parent: &self.span, "forward"),
            _call: call,
        }
    }

    /// Records how many cached tokens the call's `keep` dropped (the rollback).
    pub fn rewound(&self, cached: usize, keep: usize) {
        use tracing_opentelemetry::OpenTelemetrySpanExt;
        self.span
            .set_attribute("duet.rewound_tokens", cached.saturating_sub(keep) as i64);
    }
}

/// A call's model work in progress; see [`CallTrace::forward`].
#[derive(Debug)]
pub struct Forward {
    /// Dropped first: the `forward` span ends inside the call's span.
    pub span: tracing::Span,
    _call: tracing::span::EnteredSpan,
}

/// A worker's own model work, run on the model thread.
pub trait Handler: Send + 'static {
    type Job: Send + 'static;
    /// Runs the jobs the thread took off the queue together (at most `max_batch`).
    fn run(&mut self, model: &Model, jobs: Vec<Self::Job>);
}

enum Work<J> {
    Prefill {
        session: Arc<Mutex<Session>>,
        tokens: Vec<u32>,
        enqueued: Instant,
        trace: CallTrace,
        reply: oneshot::Sender<Result<Timing, WorkerError>>,
    },
    Own(J),
}

/// What is known once the model has loaded.
#[derive(Debug)]
struct Loaded {
    model: Model,
    description: pb::ModelDescription,
    context: usize,
}

/// The shared part of a worker service.
pub struct WorkerCore<J> {
    config: WorkerConfig,
    loaded: OnceLock<Loaded>,
    sessions: Sessions,
    queue: mpsc::Sender<Work<J>>,
    depth: Arc<AtomicUsize>,
    draining: std::sync::atomic::AtomicBool,
    metrics: Arc<WorkerMetrics>,
}

impl<J> std::fmt::Debug for WorkerCore<J> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerCore")
            .field("model", &self.config.model)
            .field("sessions", &self.sessions.stats())
            .finish()
    }
}

impl<J: Send + 'static> WorkerCore<J> {
    /// Starts the model thread, which loads the model and then serves the queue. `ready`
    /// receives the load result; health turns SERVING on success.
    pub fn start<H: Handler<Job = J>>(
        config: WorkerConfig,
        health: Health,
        handler: H,
    ) -> (Arc<Self>, oneshot::Receiver<Result<(), String>>) {
        // Every session has at most one call in flight, so this bound is never the limit in
        // normal use; it stops a misbehaving client from queueing without end.
        let (tx, rx) = mpsc::channel(config.max_sessions.max(1) * 2);
        let core = Arc::new(Self {
            metrics: Arc::new(WorkerMetrics::new(config.kv_token_budget)),
            sessions: Sessions::new(Limits {
                max_sessions: config.max_sessions,
                kv_token_budget: config.kv_token_budget,
                ttl: Duration::from_millis(config.session_ttl_ms),
            }),
            config,
            loaded: OnceLock::new(),
            queue: tx,
            depth: Arc::new(AtomicUsize::new(0)),
            draining: false.into(),
        });
        let (ready_tx, ready_rx) = oneshot::channel();
        let thread_core = core.clone();
        let runtime = tokio::runtime::Handle::current();
        // The model thread's spans and logs go where this service's do.
        let dispatch = tracing::dispatcher::get_default(|d| d.clone());
        std::thread::Builder::new()
            .name("duet-model".into())
            .spawn(move || {
                tracing::dispatcher::with_default(&dispatch, || {
                    thread_core.model_thread(rx, handler, health, runtime, ready_tx)
                })
            })
            .expect("spawning the model thread");
        let reaper = Arc::downgrade(&core);
        let period = (core.sessions.limits().ttl / 4)
            .clamp(Duration::from_millis(10), Duration::from_secs(5));
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(period).await;
                match reaper.upgrade() {
                    Some(core) => {
                        let n = core.sessions.expire_idle();
                        if n > 0 {
                            tracing::info!(sessions = n, "closed idle sessions (TTL)");
                        }
                    }
                    None => return,
                }
            }
        });
        (core, ready_rx)
    }

    fn model_thread<H: Handler<Job = J>>(
        self: Arc<Self>,
        mut rx: mpsc::Receiver<Work<J>>,
        mut handler: H,
        health: Health,
        runtime: tokio::runtime::Handle,
        ready: oneshot::Sender<Result<(), String>>,
    ) {
        let loaded = match load(&self.config) {
            Ok(l) => l,
            Err(e) => {
                let message = format!("loading {}: {e}", self.config.model.display());
                tracing::error!("{message}");
                let _ = ready.send(Err(message));
                return;
            }
        };
        tracing::info!(
            model = %loaded.description.model,
            context = loaded.context,
            "model loaded"
        );
        let _ = self.loaded.set(loaded);
        runtime.block_on(health.set(true));
        let _ = ready.send(Ok(()));
        let model = self.loaded.get().expect("set above").model.clone();
        let model = &model;
        let max_batch = self.config.max_batch.max(1);
        let depth = self.depth.clone();
        let metrics = self.metrics.clone();
        // The loop ends when the core (the only sender) is dropped, so do not hold it here.
        drop(self);
        while let Some(first) = rx.blocking_recv() {
            let mut batch = vec![first];
            while batch.len() < max_batch {
                match rx.try_recv() {
                    Ok(w) => batch.push(w),
                    Err(_) => break,
                }
            }
            depth.fetch_sub(batch.len(), Ordering::Relaxed);
            let mut own = Vec::new();
            for work in batch {
                match work {
                    Work::Prefill {
                        session,
                        tokens,
                        enqueued,
                        mut trace,
                        reply,
                    } => {
                        let forward = trace.forward();
                        let run = std::panic::AssertUnwindSafe(|| {
                            prefill(model, &session, &tokens, enqueued)
                        });
                        match std::panic::catch_unwind(run) {
                            Ok(result) => {
                                if let Ok(t) = &result {
                                    metrics
                                        .forward_seconds
                                        .get_or_create(&KindLabel { kind: "prefill" })
                                        .observe(t.forward.as_secs_f64());
                                }
                                let _ = reply.send(result);
                            }
                            Err(_) => tracing::error!("a prefill panicked; its call failed"),
                        }
                        drop(forward);
                    }
                    Work::Own(job) => own.push(job),
                }
            }
            if own.is_empty() {
                continue;
            }
            // A panic is a bug, but it must not take the model thread (and with it every
            // later call) down: the failed calls see their reply channels dropped.
            metrics.batch_size.observe(own.len() as f64);
            let started = Instant::now();
            let run = std::panic::AssertUnwindSafe(|| handler.run(model, own));
            let outcome = std::panic::catch_unwind(run);
            metrics
                .forward_seconds
                .get_or_create(&KindLabel { kind: "call" })
                .observe(started.elapsed().as_secs_f64());
            if outcome.is_err() {
                tracing::error!("a model job panicked; its calls failed, the worker goes on");
            }
        }
    }

    fn loaded(&self) -> Result<&Loaded, WorkerError> {
        self.loaded.get().ok_or(WorkerError::Loading)
    }

    pub fn sessions(&self) -> &Sessions {
        &self.sessions
    }

    /// The model's vocabulary size (once loaded).
    pub fn vocab(&self) -> Result<usize, WorkerError> {
        Ok(self.loaded()?.model.config().vocab)
    }

    /// Refuses new sessions from now on; existing ones finish (graceful drain).
    pub fn drain(&self) {
        self.draining.store(true, Ordering::Relaxed);
    }

    /// Queues a job for the handler.
    pub fn submit(&self, job: J) -> Result<(), WorkerError> {
        self.loaded()?;
        self.send(Work::Own(job))
    }

    fn send(&self, work: Work<J>) -> Result<(), WorkerError> {
        self.depth.fetch_add(1, Ordering::Relaxed);
        let sent = self.queue.try_send(work);
        if sent.is_err() {
            self.depth.fetch_sub(1, Ordering::Relaxed);
        }
        sent.map_err(|e| match e {
            mpsc::error::TrySendError::Full(_) => {
                WorkerError::SessionLimit(self.config.max_sessions)
            }
            mpsc::error::TrySendError::Closed(_) => WorkerError::ShuttingDown,
        })
    }

    /// Checks that `tokens` (the field named `field`) is non-empty and inside the vocabulary.
    pub fn check_tokens(&self, field: &'static str, tokens: &[u32]) -> Result<(), WorkerError> {
        let vocab = self.vocab()?;
        if tokens.is_empty() {
            return Err(WorkerError::invalid(field, "must not be empty"));
        }
        match tokens.iter().find(|&&t| t as usize >= vocab) {
            Some(t) => Err(WorkerError::invalid(
                field,
                format!("token {t} is outside the vocabulary of {vocab}"),
            )),
            None => Ok(()),
        }
    }

    pub fn describe(&self) -> Result<pb::ModelDescription, WorkerError> {
        Ok(self.loaded()?.description.clone())
    }

    /// The OpenSession RPC of the worker service `service`, traced as its server span.
    pub async fn open_rpc(
        &self,
        request: tonic::Request<pb::OpenSessionRequest>,
        service: &'static str,
    ) -> Result<tonic::Response<pb::OpenSessionResponse>, Status> {
        let span = crate::telemetry::server_span(&request, service, "OpenSession");
        let open = self.open(request.into_inner(), span.clone());
        crate::telemetry::traced(span, async { Ok(tonic::Response::new(open.await?)) }).await
    }

    /// Opens a session: checks, reserves its KV tokens, prefills the prompt on the model
    /// thread (traced under `span`, the call's server span).
    pub async fn open(
        &self,
        req: pb::OpenSessionRequest,
        span: tracing::Span,
    ) -> Result<pb::OpenSessionResponse, WorkerError> {
        if self.draining.load(Ordering::Relaxed) {
            return Err(WorkerError::ShuttingDown);
        }
        let loaded = self.loaded()?;
        self.check_tokens("prompt", &req.prompt)?;
        let capacity = req.capacity as usize;
        if capacity < req.prompt.len() + 1 || capacity > loaded.context {
            return Err(WorkerError::invalid(
                "capacity",
                format!(
                    "{capacity} must be in [prompt length + 1 = {}, context {}]",
                    req.prompt.len() + 1,
                    loaded.context
                ),
            ));
        }
        let sampling = req
            .sampling
            .as_ref()
            .map_or_else(SamplingParams::greedy, wire::sampling_from_wire);
        sampling
            .validate()
            .map_err(|e| WorkerError::invalid("sampling", e.to_string()))?;
        let reservation = self.sessions.reserve(capacity)?;
        let session = Arc::new(Mutex::new(Session {
            cache: loaded.model.new_cache(capacity)?,
            sampling,
            // A stream of its own, distinct from the coordinator's rng for the same seed.
            rng: rng_for(sampling.seed ^ 0x6472_6166_7400_0000),
        }));
        let (reply, answer) = oneshot::channel();
        let head = req.prompt[..req.prompt.len() - 1].to_vec();
        self.send(Work::Prefill {
            session: session.clone(),
            tokens: head,
            enqueued: Instant::now(),
            trace: CallTrace::queued(span),
            reply,
        })?;
        let timing = answer.await.map_err(|_| WorkerError::ShuttingDown)??;
        let cache_len = session.lock().map(|s| s.cache.len()).unwrap_or(0) as u32;
        let session_id = reservation.insert(session);
        Ok(pb::OpenSessionResponse {
            session_id,
            cache_len,
            timing: Some(timing.to_wire()),
        })
    }

    pub fn close(&self, id: u64) -> pb::CloseSessionResponse {
        pb::CloseSessionResponse {
            closed: self.sessions.close(id),
        }
    }

    /// The Prometheus text exposition of this worker.
    pub fn render_metrics(&self) -> String {
        self.metrics
            .render(self.sessions.stats(), self.depth.load(Ordering::Relaxed))
    }

    pub fn stats(&self) -> pb::WorkerStats {
        let s = self.sessions.stats();
        pb::WorkerStats {
            active_sessions: s.active as u32,
            max_sessions: self.config.max_sessions as u32,
            kv_tokens_reserved: s.reserved_tokens as u64,
            kv_token_budget: self.config.kv_token_budget as u64,
            queue_depth: self.depth.load(Ordering::Relaxed) as u32,
            sessions_expired: s.expired,
        }
    }
}

fn prefill(
    model: &Model,
    session: &Mutex<Session>,
    tokens: &[u32],
    enqueued: Instant,
) -> Result<Timing, WorkerError> {
    let start = Instant::now();
    let mut s = session.lock().unwrap_or_else(|e| e.into_inner());
    if !tokens.is_empty() {
        model.prefill(&mut s.cache, tokens, LogitsFor::None)?;
    }
    Ok(Timing {
        queue: start - enqueued,
        forward: start.elapsed(),
    })
}

/// Where `scripts/fetch-models` puts `file`: `$DUET_MODEL_DIR`, else `~/.cache/duet/models`.
pub fn default_model_path(file: &str) -> String {
    let dir = std::env::var_os("DUET_MODEL_DIR")
        .map(std::path::PathBuf::from)
        .or_else(|| {
            std::env::var_os("XDG_CACHE_HOME")
                .map(std::path::PathBuf::from)
                .or_else(|| {
                    std::env::var_os("HOME").map(|h| std::path::PathBuf::from(h).join(".cache"))
                })
                .map(|c| c.join("duet").join("models"))
        })
        .unwrap_or_default();
    dir.join(file).to_string_lossy().into_owned()
}

/// Hash of every token's bytes in id order, each prefixed by its length.
fn vocabulary_sha256(tokenizer: &Tokenizer) -> String {
    let mut h = Sha256::new();
    for id in 0..tokenizer.vocab_size() as u32 {
        let bytes = tokenizer.token_bytes(id).unwrap_or_default();
        h.update((bytes.len() as u32).to_le_bytes());
        h.update(&bytes);
    }
    format!("{:x}", h.finalize())
}

fn load(config: &WorkerConfig) -> Result<Loaded, EngineError> {
    let device = duet_engine::select_device(&config.device)?;
    let model = Model::load(
        &config.model,
        &LoadOptions {
            device,
            ..LoadOptions::default()
        },
    )?;
    let tokenizer = duet_engine::tokenizer::tokenizer_gguf(&config.model)?;
    // Fail at load, not at the first request, if the tokenizer cannot be built.
    let vocabulary = vocabulary_sha256(&Tokenizer::from_gguf_bytes(&tokenizer)?);
    let model_context = model.config().context_length;
    let context = match config.max_context {
        0 => model_context,
        n => n.min(model_context),
    };
    let description = pb::ModelDescription {
        model: config
            .model
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        architecture: format!("{:?}", model.config().architecture).to_lowercase(),
        vocab_size: model.config().vocab as u32,
        context_length: context as u32,
        vocabulary_sha256: vocabulary,
        tokenizer,
    };
    Ok(Loaded {
        model,
        description,
        context,
    })
}
