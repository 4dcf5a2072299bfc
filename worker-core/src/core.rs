//! The worker core: the loaded model behind its queue, the session table, and the calls both
//! workers answer the same way (describe, open, close, stats). A worker adds its own job type
//! through [`Handler`] and queues its jobs with [`WorkerCore::submit`].

use crate::gather::SessionKey;
use crate::load::{Loaded, ModelDescription};
use crate::metrics::WorkerMetrics;
use crate::model_thread::{Call, Handler, Heartbeat, Prefill, Scoring, Thread, Timing, Work};
use crate::sessions::{Limits, Session, SessionId, SessionStats, Sessions};
use crate::trace::CallTrace;
use crate::{WorkerConfig, WorkerError};
use duet_engine::Adapter;
use duet_engine::bias::LogitBias;
use duet_engine::logprobs::{MAX_TOP_LOGPROBS, TokenLogprobs};
use duet_engine::penalties::{MinTokens, Penalties, PromptTokens};
use duet_engine::sampling::{SamplingParams, rng_for};
use duet_engine::structured::{Constraint, Format};
use duet_serving::busy_poll::BusyPoll;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};

/// The session `req` opens, before its prompt is prefilled: its cache (with `adapter`), its
/// sampling and what adjusts its rows, its own random stream, and where its completion
/// starts.
fn new_session(
    loaded: &Loaded,
    req: &OpenRequest,
    adapter: Option<Arc<Adapter>>,
    constraint: Option<Constraint>,
) -> Result<Session, WorkerError> {
    let mut extra = duet_engine::ExtraLogits::default();
    loaded.model.extend_shortlist(&mut extra, &req.prompt)?;
    // A lost session's completion starts after its prompt, not after `prompt`.
    let completion_from = match req.generated_after {
        0 => req.prompt.len(),
        n => n,
    };
    let cache_salt = adapter.as_ref().map(|a| a.salt(req.cache_salt));
    let cache = loaded.model.new_adapted_cache(req.capacity, adapter)?;
    // A stream of its own, distinct from the coordinator's rng for the same seed.
    let rng = rng_for(req.sampling.seed ^ 0x6472_6166_7400_0000);
    Ok(Session {
        extra,
        logprobs: req.logprobs,
        penalties: req.penalties,
        logit_bias: req.logit_bias.clone(),
        min_tokens: MinTokens {
            until: req.min_tokens,
            eos: held_until_min_tokens(&loaded.eos, &req.stop_token_ids),
        },
        constraint,
        completion_from,
        prompt_tokens: PromptTokens::of(&req.prompt[..completion_from], &req.penalties),
        cache_salt: cache_salt.unwrap_or(req.cache_salt),
        ..Session::plain(cache, req.sampling, rng)
    })
}

/// The adapter `req`'s session runs with: the one it names, none where it names none, or
/// where the worker has none of that name and the session may go without
/// (`adapter_if_loaded`: a draft's); else why not.
async fn session_adapter(
    loaded: &Loaded,
    req: &OpenRequest,
) -> Result<Option<Arc<Adapter>>, WorkerError> {
    let Some(name) = req.adapter.as_deref() else {
        return Ok(None);
    };
    match loaded.adapters.get(&loaded.model, name).await {
        Ok(Some(adapter)) => Ok(Some(adapter)),
        // A draft session drafts without it: the target checks its proposals.
        Ok(None) if req.adapter_if_loaded => Ok(None),
        Ok(None) => Err(loaded.adapters.unknown(name)),
        Err(e) if req.adapter_if_loaded => {
            tracing::warn!(error = %e, "drafting without an adapter that did not load");
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

/// An OpenSession call, off the wire.
#[derive(Debug, Clone)]
pub struct OpenRequest {
    /// The caller's name for the session, or none for a random one.
    pub session_id: Option<SessionId>,
    pub prompt: Vec<u32>,
    pub capacity: usize,
    pub sampling: SamplingParams,
    /// A session taking over another's sequence: that session's prompt length, after which
    /// `prompt` holds what it generated (fed as calls feed tokens). 0: all of it is prompt.
    pub generated_after: usize,
    /// The figures each chosen token's answer carries: its log-probability and this many
    /// most likely tokens' (`OpenSessionRequest.top_logprobs`); `None`: none.
    pub logprobs: Option<usize>,
    /// The request's penalties.
    pub penalties: Penalties,
    /// The open answers each prompt token's figures after the first, with this many most
    /// likely tokens' (`OpenSessionRequest.prompt_logprobs`); `None`: none.
    pub prompt_logprobs: Option<usize>,
    /// The request's logit bias (`OpenSessionRequest.logit_bias`).
    pub logit_bias: LogitBias,
    /// No end-of-sequence token before this many completion tokens
    /// (`OpenSessionRequest.min_tokens`).
    pub min_tokens: usize,
    /// The completion's structured output (`OpenSessionRequest.structured_output`).
    pub format: Option<Format>,
    /// The prefix cache's salt (`OpenSessionRequest.cache_salt`; 0: none).
    pub cache_salt: u64,
    /// The request's own end tokens, held back as the end-of-sequence tokens are until
    /// `min_tokens` (`OpenSessionRequest.stop_token_ids`).
    pub stop_token_ids: Vec<u32>,
    /// Preemption: the request's priority (`OpenSessionRequest.priority`; `None`: its
    /// session never gives way), and whether a refusal for room asks a session of a higher
    /// number to give way (`ask_for_room`).
    pub priority: Option<i32>,
    pub ask_for_room: bool,
    /// The LoRA adapter the session runs with, by its name (`lora_adapters`); `None`: the
    /// model alone.
    pub adapter: Option<String>,
    /// Without the adapter where the worker has none of that name
    /// (`OpenSessionRequest.adapter_if_loaded`).
    pub adapter_if_loaded: bool,
}

/// A session that was opened and prefilled.
#[derive(Debug, Clone)]
pub struct Opened {
    pub session_id: SessionId,
    /// This worker process.
    pub instance_id: u64,
    /// Tokens in its cache (the prompt but its last token).
    pub cache_len: usize,
    /// Of those, the tokens copied from the prefix cache instead of prefilled.
    pub cached_tokens: usize,
    pub timing: Timing,
    /// Where the open asked for them, the figures of each prompt token after the first.
    pub prompt_logprobs: Vec<TokenLogprobs>,
}

/// A worker's counters, for Stats.
#[derive(Debug, Clone, Copy)]
pub struct WorkerStats {
    pub sessions: SessionStats,
    pub max_sessions: usize,
    pub kv_token_budget: usize,
    pub queue_depth: usize,
}

/// The shared part of a worker service.
pub struct WorkerCore<J> {
    config: WorkerConfig,
    loaded: Arc<OnceLock<Loaded>>,
    sessions: Arc<Sessions>,
    queue: mpsc::Sender<Work<Prefill, J>>,
    queue_capacity: usize,
    depth: Arc<AtomicUsize>,
    draining: AtomicBool,
    metrics: Arc<WorkerMetrics>,
    heartbeat: Arc<Heartbeat>,
    busy: Option<BusyPoll>,
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
    /// Starts the model thread, which loads the model and then serves the queue, polling it
    /// while `busy` says calls come and go. The returned receiver gets the load's outcome.
    pub fn start<H: Handler<Job = J>>(
        config: WorkerConfig,
        handler: H,
        busy: Option<BusyPoll>,
    ) -> (Arc<Self>, oneshot::Receiver<Result<(), String>>) {
        // Every session has at most one call in flight, so this bound is never the limit in
        // normal use; it stops a misbehaving client from queueing without end.
        let queue_capacity = config.max_sessions.max(1) * 2;
        let (tx, rx) = mpsc::channel(queue_capacity);
        let loaded = Arc::new(OnceLock::new());
        let depth = Arc::new(AtomicUsize::new(0));
        let metrics = Arc::new(WorkerMetrics::new(
            config.kv_token_budget,
            config.max_sessions,
        ));
        let heartbeat = Arc::new(Heartbeat::new());
        let sessions = Arc::new(Sessions::new(Limits {
            max_sessions: config.max_sessions,
            kv_token_budget: config.kv_token_budget,
            ttl: Duration::from_millis(config.session_ttl_ms),
        }));
        let thread = Thread {
            config: config.clone(),
            handler,
            loaded: loaded.clone(),
            depth: depth.clone(),
            metrics: metrics.clone(),
            heartbeat: heartbeat.clone(),
            sessions: sessions.clone(),
            busy: busy.clone(),
        };
        let core = Arc::new(Self {
            sessions,
            config,
            loaded,
            queue: tx,
            queue_capacity,
            depth,
            draining: AtomicBool::new(false),
            metrics,
            heartbeat,
            busy,
        });
        let (ready_tx, ready_rx) = oneshot::channel();
        // The model thread's spans and logs go where this service's do.
        let dispatch = tracing::dispatcher::get_default(|d| d.clone());
        std::thread::Builder::new()
            .name("duet-model".into())
            .spawn(move || {
                tracing::dispatcher::with_default(&dispatch, || thread.run(rx, ready_tx))
            })
            .expect("spawning the model thread");
        core.expire_idle_sessions();
        (core, ready_rx)
    }

    /// Closes idle sessions every quarter TTL while the core is alive.
    fn expire_idle_sessions(self: &Arc<Self>) {
        let core = Arc::downgrade(self);
        let period = (self.sessions.limits().ttl / 4)
            .clamp(Duration::from_millis(10), Duration::from_secs(5));
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(period).await;
                let Some(core) = core.upgrade() else { return };
                let n = core.sessions.expire_idle();
                if n > 0 {
                    tracing::info!(sessions = n, "closed idle sessions (TTL)");
                }
            }
        });
    }

    fn loaded(&self) -> Result<&Loaded, WorkerError> {
        self.loaded.get().ok_or(WorkerError::Loading)
    }

    pub fn sessions(&self) -> &Sessions {
        &self.sessions
    }

    /// Refuses new sessions from now on; existing ones finish (graceful drain).
    pub fn drain(&self) {
        self.draining.store(true, Ordering::Relaxed);
    }

    pub fn config(&self) -> &WorkerConfig {
        &self.config
    }

    /// `Some(for how long)` when the model thread has been busy with one step for longer
    /// than `model_stall_timeout_ms`: stuck, whatever the gRPC tasks still answer.
    pub fn model_stalled(&self) -> Option<Duration> {
        let busy = self.heartbeat.busy_for();
        (busy > Duration::from_millis(self.config.model_stall_timeout_ms)).then_some(busy)
    }

    /// Queues a job of `session` for the handler.
    pub fn submit(&self, session: SessionKey, job: J) -> Result<(), WorkerError> {
        self.loaded()?;
        self.send(Work::Own(Call {
            job,
            session,
            queued: Instant::now(),
        }))
    }

    fn send(&self, work: Work<Prefill, J>) -> Result<(), WorkerError> {
        self.depth.fetch_add(1, Ordering::Relaxed);
        let sent = self.queue.try_send(work);
        if sent.is_err() {
            self.depth.fetch_sub(1, Ordering::Relaxed);
        }
        sent.map_err(|e| match e {
            mpsc::error::TrySendError::Full(_) => WorkerError::QueueFull(self.queue_capacity),
            mpsc::error::TrySendError::Closed(_) => WorkerError::ShuttingDown,
        })
    }

    /// Checks that `tokens` (the field named `field`) is non-empty and inside the vocabulary.
    pub fn check_tokens(&self, field: &'static str, tokens: &[u32]) -> Result<(), WorkerError> {
        let vocab = self.loaded()?.description.vocab_size;
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

    /// The loaded model's description, borrowed: it carries the tokenizer's few MB, which
    /// a copy on every call would cost about a millisecond.
    pub fn describe(&self) -> Result<&ModelDescription, WorkerError> {
        Ok(&self.loaded()?.description)
    }

    /// The LoRA adapters a session may ask for now, and whether they are read from a
    /// directory (whose adapters come and go).
    pub fn adapters(&self) -> Result<(Vec<String>, bool), WorkerError> {
        let adapters = &self.loaded()?.adapters;
        Ok((adapters.names(), adapters.reads_dir()))
    }

    /// This process's instance id: sessions name it, and a restart changes it.
    pub fn instance(&self) -> u64 {
        self.sessions.instance()
    }

    /// Opens a session: checks, reserves its KV tokens, prefills the prompt on the model
    /// thread (traced under `span`, the call's server span).
    pub async fn open(&self, req: OpenRequest, span: tracing::Span) -> Result<Opened, WorkerError> {
        if self.draining.load(Ordering::Relaxed) {
            return Err(WorkerError::ShuttingDown);
        }
        let loaded = self.loaded()?;
        self.check_open(&req, loaded.context)?;
        let adapter = session_adapter(loaded, &req).await?;
        let capacity = req.capacity;
        let reserved = (self.sessions).reserve_ranked(capacity, req.session_id, req.priority);
        let reservation = match reserved {
            Err(e @ (WorkerError::KvBudget { .. } | WorkerError::SessionLimit(_))) => {
                if let (Some(priority), true) = (req.priority, req.ask_for_room) {
                    self.sessions.ask_to_give_way(priority, capacity);
                }
                return Err(e);
            }
            reserved => reserved?,
        };
        let constraint = self.constraint(loaded, req.format.clone()).await?;
        let session = Arc::new(Mutex::new(new_session(loaded, &req, adapter, constraint)?));
        let (reply, answer) = oneshot::channel();
        let head = req.prompt[..req.prompt.len() - 1].to_vec();
        // The queued prefill owns the session's memory and its reservation: a caller that
        // goes away frees neither before the model thread lets go of them.
        self.send(Work::Prefill(Prefill {
            session,
            reservation,
            // The lost session's last prompt token came with its first call, as the rest.
            generated_from: req.generated_after.checked_sub(1).unwrap_or(head.len()),
            tokens: head,
            enqueued: Instant::now(),
            trace: CallTrace::queued(span),
            reply,
            progress: Default::default(),
            scoring: req.prompt_logprobs.map(|top| Scoring {
                top,
                last: req.prompt[req.prompt.len() - 1],
                figures: Vec::with_capacity(req.prompt.len() - 1),
            }),
        }))?;
        let prefilled = answer.await.map_err(|_| WorkerError::Dropped)??;
        let cache_len = prefilled.session.lock().map(|s| s.cache.len()).unwrap_or(0);
        let session_id =
            (prefilled.reservation).insert(prefilled.session, prefilled.donor, req.priority)?;
        Ok(Opened {
            session_id,
            instance_id: self.sessions.instance(),
            cache_len,
            cached_tokens: prefilled.cached,
            timing: prefilled.timing,
            prompt_logprobs: prefilled.prompt_logprobs,
        })
    }

    /// The open's structured output compiled for this model, off the async threads (a large
    /// schema takes milliseconds).
    async fn constraint(
        &self,
        loaded: &Loaded,
        format: Option<Format>,
    ) -> Result<Option<Constraint>, WorkerError> {
        let Some(format) = format else {
            return Ok(None);
        };
        let Some(grammars) = loaded.grammars.clone() else {
            let why = "this worker's vocabulary is not one llguidance reads";
            return Err(WorkerError::invalid("structured_output", why));
        };
        let compiled = tokio::task::spawn_blocking(move || grammars.constrain(&format));
        let compiled = compiled.await.map_err(|_| WorkerError::Dropped)?;
        compiled.map(Some).map_err(WorkerError::of_format)
    }

    /// An OpenSession call's checks against this worker (the model's `context`).
    fn check_open(&self, req: &OpenRequest, context: usize) -> Result<(), WorkerError> {
        self.check_tokens("prompt", &req.prompt)?;
        if !req.stop_token_ids.is_empty() {
            self.check_tokens("stop_token_ids", &req.stop_token_ids)?;
        }
        if req.generated_after > req.prompt.len() {
            let why = format!(
                "{} is past the prompt's {} tokens",
                req.generated_after,
                req.prompt.len()
            );
            return Err(WorkerError::invalid("generated_after", why));
        }
        let capacity = req.capacity;
        if capacity < req.prompt.len() + 1 || capacity > context {
            return Err(WorkerError::invalid(
                "capacity",
                format!(
                    "{capacity} must be in [prompt length + 1 = {}, context {}]",
                    req.prompt.len() + 1,
                    context
                ),
            ));
        }
        req.sampling
            .validate()
            .map_err(|e| WorkerError::invalid("sampling", e.to_string()))?;
        let most = MAX_TOP_LOGPROBS;
        for (name, asked) in [
            ("top_logprobs", req.logprobs),
            ("prompt_logprobs", req.prompt_logprobs),
        ] {
            if let Some(n) = asked.filter(|&n| n > most) {
                return Err(WorkerError::invalid(name, format!("{n} is over {most}")));
            }
        }
        req.logit_bias
            .check()
            .map_err(|why| WorkerError::invalid("logit_bias", why))?;
        let biased: Vec<u32> = req.logit_bias.entries().iter().map(|&(id, _)| id).collect();
        if !biased.is_empty() {
            self.check_tokens("logit_bias", &biased)?;
        }
        if req.prompt_logprobs.is_some() && req.generated_after > 0 {
            return Err(WorkerError::invalid(
                "prompt_logprobs",
                "a session taking over another's sequence has no prompt to score",
            ));
        }
        if let Err((name, why)) = req.penalties.check() {
            return Err(WorkerError::invalid(name, why));
        }
        Ok(())
    }

    /// The session a call names (its id and worker instance, off the wire).
    pub fn session(&self, id: &[u8], instance: u64) -> Result<Arc<Mutex<Session>>, WorkerError> {
        self.sessions.get(SessionId::from_wire(id)?, instance)
    }

    /// Whether an open of a lower priority number asked session `id` to give its room up
    /// (`VerifyResponse.give_way`).
    pub fn gives_way(&self, id: &[u8]) -> bool {
        SessionId::from_wire(id).is_ok_and(|id| self.sessions.gives_way(id))
    }

    /// Closes a session; false when it did not exist.
    pub fn close(&self, id: &[u8], instance: u64) -> bool {
        SessionId::from_wire(id).is_ok_and(|id| self.sessions.close(id, instance))
    }

    /// The Prometheus text exposition of this worker.
    pub fn render_metrics(&self) -> String {
        let polling = self.busy.as_ref().map_or(0, BusyPoll::polling);
        self.metrics.observe_busy_polling(polling);
        if let Some(adapters) = self.loaded.get().map(|l| &l.adapters) {
            let reads = adapters.reads.load(Ordering::Relaxed);
            self.metrics.observe_adapters(adapters.loaded(), reads);
        }
        self.metrics
            .render(self.sessions.stats(), self.depth.load(Ordering::Relaxed))
    }

    pub fn stats(&self) -> WorkerStats {
        WorkerStats {
            sessions: self.sessions.stats(),
            max_sessions: self.config.max_sessions,
            kv_token_budget: self.config.kv_token_budget,
            queue_depth: self.depth.load(Ordering::Relaxed),
        }
    }
}

/// The tokens no row may take before `min_tokens`: the model's end tokens and the request's
/// own, each once.
fn held_until_min_tokens(eos: &[u32], stops: &[u32]) -> Vec<u32> {
    let mut held = eos.to_vec();
    held.extend(stops.iter().filter(|id| !eos.contains(id)));
    held
}

#[cfg(test)]
mod tests;
