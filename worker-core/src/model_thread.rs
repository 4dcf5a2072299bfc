//! The model thread: it loads the model, then takes calls off the one bounded queue, runs the
//! waiting ones together (up to `max_batch`, after a moment's wait for the streams due back:
//! `gather`) and answers each, calls before prefills, which go in chunks (`Waiting`). A
//! panicking job is a bug, but it must not take the thread (and with it every later call)
//! down: its callers see their reply dropped (`WorkerError::Dropped`) and the thread goes on.

use crate::gather::{Gather, SessionKey};
use crate::load::{Loaded, load, warm_up};
use crate::metrics::{KindLabel, WorkerMetrics};
use crate::prefix_cache::Exact;
use crate::sessions::{Reservation, Session, Sessions};
use crate::trace::CallTrace;
use crate::{WorkerConfig, WorkerError};
use duet_engine::logprobs::{TokenLogprobs, token_logprobs};
use duet_engine::{KvCache, LogitsFor, Model};
use duet_serving::busy_poll::BusyPoll;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};

/// Whether the calls of a pass read their rows of `logits` side by side on rayon's threads:
/// only where there are several calls and whole rows of the vocabulary to read. A hand-off
/// to rayon wakes its sleeping threads and then this one, which costs more than reading one
/// call's rows, or every call's greedy summaries, takes here (docs/benchmarks.md, "What a
/// worker call costs outside its pass").
pub fn read_side_by_side(logits: &[duet_engine::Logits]) -> bool {
    logits.len() > 1 && logits.iter().any(|l| !l.summarized())
}

/// Where a call's time went on the worker.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Timing {
    /// Waiting in the queue.
    pub queue: Duration,
    /// In the forward passes the call took part in, reading its rows of logits included.
    pub forward: Duration,
    /// The most calls in one of those passes.
    pub batch_calls: usize,
    /// Token rows of all calls in those passes, summed over the passes.
    pub batch_rows: usize,
    /// Each pass's time split among its calls by their rows, summed: what the call cost.
    pub share: Duration,
}

impl Timing {
    /// A call that ran alone in one pass.
    pub fn alone(queue: Duration, forward: Duration, rows: usize) -> Self {
        Self {
            queue,
            forward,
            batch_calls: 1,
            batch_rows: rows,
            share: forward,
        }
    }
}

/// `more(running)` takes the worker's own jobs that have queued up meanwhile, without
/// waiting, so that at most `max_batch` run at once: a handler that runs several passes per
/// call admits new calls between them.
pub type More<'a, J> = &'a mut dyn FnMut(usize) -> Vec<J>;

/// A worker's own model work, run on the model thread.
pub trait Handler: Send + 'static {
    type Job: Send + 'static;
    /// Runs the jobs the thread took off the queue together (at most `max_batch`).
    fn run(&mut self, model: &Model, jobs: Vec<Self::Job>, more: More<'_, Self::Job>);
}

/// One entry of the queue: a session's prompt prefill, or a job of the worker's own.
pub(crate) enum Work<P, J> {
    Prefill(P),
    Own(Call<J>),
}

/// A job of the worker's own, with the session it is for and when it was queued.
pub(crate) struct Call<J> {
    pub job: J,
    pub session: SessionKey,
    pub queued: Instant,
}

/// The work taken off the queue and not yet run, and the order it runs in: waiting calls
/// first (a call is one short step that a stream is waiting on), then prefill chunks for as
/// long as that run of calls took (at least one chunk), then calls again. While both wait,
/// the model's time is shared about equally: a call waits for prefill chunks of about one
/// run of calls, and a prefill for one run of calls, even where calls never stop coming
/// (Decode streams queue their next step as soon as one answers), while a burst of new
/// requests whose prompts are mostly cached gets its short prefills back to back. A run of
/// calls admits new calls between its passes until a prefill is waiting.
pub(crate) struct Waiting<P, J> {
    prefills: VecDeque<P>,
    calls: VecDeque<Call<J>>,
    /// Prefill time left before the waiting calls run again: the last run of calls' time,
    /// less the prefill chunks run since.
    prefill_budget: Duration,
    /// When the sessions' calls come and are answered, for waiting for the ones due back.
    gather: Gather,
}

impl<P, J> Default for Waiting<P, J> {
    fn default() -> Self {
        Self::new(Duration::ZERO)
    }
}

/// What the model thread does next.
pub(crate) enum Next<P, J> {
    Calls(Vec<Call<J>>),
    Prefill(P),
    Idle,
}

impl<P, J> Waiting<P, J> {
    /// Runs of calls wait up to `batch_wait` for the streams due back (`gather`).
    pub fn new(batch_wait: Duration) -> Self {
        Self {
            prefills: VecDeque::new(),
            calls: VecDeque::new(),
            prefill_budget: Duration::ZERO,
            gather: Gather::new(batch_wait),
        }
    }

    pub fn push(&mut self, work: Work<P, J>) {
        match work {
            Work::Prefill(p) => self.prefills.push_back(p),
            Work::Own(call) => {
                self.gather.arrived(call.session, call.queued);
                self.calls.push_back(call);
            }
        }
    }

    /// A prefill that has chunks left goes on before the other prefills, after the calls
    /// that came meanwhile.
    pub fn resume(&mut self, prefill: P) {
        self.prefills.push_front(prefill);
    }

    /// Whether the work taken off `rx` fills what the queue holds.
    fn full(&self, rx: &mpsc::Receiver<Work<P, J>>) -> bool {
        self.prefills.len() + self.calls.len() >= rx.max_capacity()
    }

    /// Takes what has queued up meanwhile, without waiting; no more than the queue holds, so
    /// the queue's bound still bounds the work waiting.
    pub fn take(&mut self, rx: &mut mpsc::Receiver<Work<P, J>>) {
        while !self.full(rx) {
            match rx.try_recv() {
                Ok(work) => self.push(work),
                Err(_) => break,
            }
        }
    }

    pub fn is_empty(&self) -> bool {
        self.prefills.is_empty() && self.calls.is_empty()
    }

    /// With calls waiting, waits (on `timer`) until the streams due back have called too,
    /// or their window closed (`gather`), or `max_batch` calls or the queue's bound are
    /// reached. Returns how long it waited (zero: not at all).
    pub fn gather(
        &mut self,
        rx: &mut mpsc::Receiver<Work<P, J>>,
        timer: &tokio::runtime::Runtime,
        max_batch: usize,
    ) -> Duration {
        let mut start = None;
        while !self.prefill_next()
            && !self.calls.is_empty()
            && self.calls.len() < max_batch
            && !self.full(rx)
        {
            let calls = &self.calls;
            let due = self
                .gather
                .deadline(Instant::now(), |s| calls.iter().any(|c| c.session == s));
            let Some(until) = due else { break };
            let start = *start.get_or_insert_with(Instant::now);
            let until = tokio::time::Instant::from_std(until.min(start + self.gather.window()));
            // The timeout is made inside the timer's runtime, whose clock it needs.
            let received =
                timer.block_on(async { tokio::time::timeout_at(until, rx.recv()).await });
            match received {
                Ok(Some(work)) => self.push(work),
                // Closed (the worker is going away) or the window closed.
                Ok(None) | Err(_) => break,
            }
        }
        start.map_or(Duration::ZERO, |s| s.elapsed())
    }

    /// The calls of `sessions` were answered now.
    pub fn answered(&mut self, sessions: Vec<SessionKey>) {
        self.gather.answered(sessions, Instant::now());
    }

    /// Whether a prefill chunk goes before the waiting calls, if any.
    fn prefill_next(&self) -> bool {
        !self.prefills.is_empty() && (self.calls.is_empty() || !self.prefill_budget.is_zero())
    }

    pub fn next(&mut self, max_batch: usize) -> Next<P, J> {
        if self.prefill_next() {
            return self.prefills.pop_front().map_or(Next::Idle, Next::Prefill);
        }
        if self.calls.is_empty() {
            return Next::Idle;
        }
        let n = self.calls.len().min(max_batch);
        Next::Calls(self.calls.drain(..n).collect())
    }

    /// A run of calls took `took`: prefill chunks may take as long before calls run again.
    pub fn ran_calls(&mut self, took: Duration) {
        self.prefill_budget = took;
    }

    /// A prefill chunk took `took`.
    pub fn ran_prefill(&mut self, took: Duration) {
        self.prefill_budget = self.prefill_budget.saturating_sub(took);
    }

    /// Calls to join a run that has `running` of them: none once a prefill waits.
    pub fn admit(&mut self, running: usize, max_batch: usize) -> Vec<Call<J>> {
        if !self.prefills.is_empty() {
            return Vec::new();
        }
        let n = self.calls.len().min(max_batch.saturating_sub(running));
        self.calls.drain(..n).collect()
    }
}

/// What the model thread is doing, for health checks that must not trust a gRPC task to
/// know: since when it has been busy with its current step (one prefill chunk, one batch of
/// calls, one pass of a drafting run), or idle.
#[derive(Debug)]
pub(crate) struct Heartbeat {
    epoch: Instant,
    /// Milliseconds since `epoch` + 1 when the current step started; 0 while idle.
    busy_since: AtomicU64,
}

impl Heartbeat {
    pub fn new() -> Self {
        Self {
            epoch: Instant::now(),
            busy_since: AtomicU64::new(0),
        }
    }

    fn now(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64 + 1
    }

    /// A step starts (or the previous one moved on).
    pub fn beat(&self) {
        self.busy_since.store(self.now(), Ordering::Relaxed);
    }

    pub fn idle(&self) {
        self.busy_since.store(0, Ordering::Relaxed);
    }

    /// How long the current step has run; zero while idle.
    pub fn busy_for(&self) -> Duration {
        match self.busy_since.load(Ordering::Relaxed) {
            0 => Duration::ZERO,
            since => Duration::from_millis(self.now().saturating_sub(since)),
        }
    }
}

pub(crate) struct Prefill {
    pub session: Arc<Mutex<Session>>,
    /// The session's KV tokens, released with its memory if nobody takes the reply.
    pub reservation: Reservation,
    pub tokens: Vec<u32>,
    /// Where `tokens` go on as calls fed them (`OpenRequest::generated_after`): `ingest`.
    pub generated_from: usize,
    pub enqueued: Instant,
    pub trace: CallTrace,
    pub reply: oneshot::Sender<Result<Prefilled, WorkerError>>,
    /// How far it got: a long prompt is prefilled a chunk at a time.
    pub progress: Progress,
    /// Where the open answers the prompt's figures (`OpenRequest::prompt_logprobs`).
    pub scoring: Option<Scoring>,
}

/// The most prompt tokens one pass prefills for a session that scores its prompt: each row's
/// logits are read (a vocabulary's worth of floats a row), so a whole long prompt in one
/// pass would hold gigabytes of them.
pub const MAX_SCORED_CHUNK: usize = 512;

/// A prompt's figures, gathered chunk by chunk as its prefill computes each row's logits.
#[derive(Debug)]
pub(crate) struct Scoring {
    /// The most likely tokens' figures beside each token's.
    pub top: usize,
    /// The prompt's last token: the prefill leaves it for the first call, but its last row
    /// gives that token's figures.
    pub last: u32,
    /// One entry for each prompt token after the first, so far.
    pub figures: Vec<TokenLogprobs>,
}

impl Scoring {
    /// The figures of `next`, the token after each row of `logits`.
    fn score(
        &mut self,
        logits: &duet_engine::Logits,
        next: impl Iterator<Item = u32>,
    ) -> Result<(), WorkerError> {
        for (i, token) in next.take(logits.rows()).enumerate() {
            let figures = token_logprobs(logits.row(i), token, self.top)
                .map_err(|e| WorkerError::invalid("logits", e.to_string()))?;
            self.figures.push(figures);
        }
        Ok(())
    }
}

/// A prefill's chunks so far.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Progress {
    /// Prompt tokens in the cache.
    done: usize,
    /// Of those, the tokens copied from the prefix cache.
    cached: usize,
    /// When its first chunk started, and the model time of its chunks.
    started: Option<Instant>,
    forward: Duration,
}

/// A prefilled session, handed back with its reservation.
pub(crate) struct Prefilled {
    pub session: Arc<Mutex<Session>>,
    pub reservation: Reservation,
    pub timing: Timing,
    /// Prompt tokens copied from the prefix cache.
    pub cached: usize,
    /// The session's prompt's place in the prefix cache.
    pub donor: Option<u64>,
    /// Where the open asked for them, the figures of each prompt token after the first.
    pub prompt_logprobs: Vec<TokenLogprobs>,
}

/// What the model thread shares with the rest of the worker.
pub(crate) struct Thread<H: Handler> {
    pub config: WorkerConfig,
    pub handler: H,
    pub loaded: Arc<OnceLock<Loaded>>,
    pub depth: Arc<AtomicUsize>,
    pub metrics: Arc<WorkerMetrics>,
    pub heartbeat: Arc<Heartbeat>,
    pub sessions: Arc<Sessions>,
    /// Busy polling (`runtime.busy_poll_ms`): while calls come and go the thread polls
    /// its queue instead of sleeping on it.
    pub busy: Option<BusyPoll>,
}

impl<H: Handler> Thread<H> {
    /// Loads the model and warms it up (`ready` gets the outcome), then serves `rx` until
    /// every sender is gone.
    pub fn run(
        mut self,
        mut rx: mpsc::Receiver<Work<Prefill, H::Job>>,
        ready: oneshot::Sender<Result<(), String>>,
    ) {
        let loaded = match self.load_and_warm_up() {
            Ok(l) => l,
            Err(message) => {
                tracing::error!("{message}");
                let _ = ready.send(Err(message));
                return;
            }
        };
        let model = loaded.model.clone();
        self.enable_prefix_cache(&model);
        let _ = self.loaded.set(loaded);
        let _ = ready.send(Ok(()));
        let max_batch = self.config.max_batch.max(1);
        let mut waiting = Waiting::new(Duration::from_millis(self.config.batch_wait_ms));
        // A timer for waiting on the queue with a deadline (`Waiting::gather`).
        let timer = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .inspect_err(|e| {
                tracing::warn!("no timer for gathering batches, calls run as they come: {e}")
            });
        loop {
            if waiting.is_empty() {
                self.heartbeat.idle();
                match next_work(&mut rx, self.busy.as_ref()) {
                    Some(work) => waiting.push(work),
                    None => return,
                }
            }
            self.heartbeat.beat();
            waiting.take(&mut rx);
            if let Ok(timer) = &timer {
                let waited = waiting.gather(&mut rx, timer, max_batch);
                if !waited.is_zero() {
                    self.metrics.batch_wait.observe(waited.as_secs_f64());
                }
            }
            match waiting.next(max_batch) {
                Next::Calls(calls) => {
                    self.depth.fetch_sub(calls.len(), Ordering::Relaxed);
                    let mut sessions: Vec<SessionKey> = calls.iter().map(|c| c.session).collect();
                    let jobs = calls.into_iter().map(|c| c.job).collect();
                    let (depth, heartbeat) = (self.depth.clone(), self.heartbeat.clone());
                    let mut more = |running: usize| {
                        heartbeat.beat();
                        waiting.take(&mut rx);
                        let calls = waiting.admit(running, max_batch);
                        depth.fetch_sub(calls.len(), Ordering::Relaxed);
                        sessions.extend(calls.iter().map(|c| c.session));
                        calls.into_iter().map(|c| c.job).collect()
                    };
                    let started = Instant::now();
                    self.run_jobs(&model, jobs, &mut more);
                    waiting.answered(sessions);
                    waiting.ran_calls(started.elapsed());
                }
                Next::Prefill(p) => {
                    let started = Instant::now();
                    let rest = self.prefill(&model, p);
                    waiting.ran_prefill(started.elapsed());
                    match rest {
                        Some(rest) => waiting.resume(rest),
                        None => {
                            self.depth.fetch_sub(1, Ordering::Relaxed);
                        }
                    }
                }
                Next::Idle => {}
            }
        }
    }

    /// The model, loaded and run through the passes a first request would otherwise pay for
    /// (`warm_up`): the worker is ready only then.
    fn load_and_warm_up(&self) -> Result<Loaded, String> {
        let path = self.config.model.display();
        let loaded = load(&self.config).map_err(|e| format!("loading {path}: {e}"))?;
        let took = warm_up(&loaded.model).map_err(|e| format!("warming up {path}: {e}"))?;
        self.metrics.observe_warm_up(took);
        self.metrics.observe_cuda_graphs(loaded.model.cuda_graphs());
        tracing::info!(
            model = %loaded.description.model,
            context = loaded.context,
            cpu_kernels = duet_engine::cpu_kernels(),
            warm_up_ms = took.as_secs_f64() * 1e3,
            "model loaded"
        );
        Ok(loaded)
    }

    /// Turns the prefix cache on where the configuration asks: copying any row where a
    /// token's keys and values do not depend on the pass that computed them, else, with
    /// `DUET_CUDA_PREFIX_CACHE=1`, whole prefill chunks only, which a fresh prefill
    /// computes alike (off by default there until a GPU has run the services' tests of it).
    fn enable_prefix_cache(&self, model: &Model) {
        let cap = self.config.prefix_cache_tokens;
        if cap == 0 {
            return;
        }
        if model.kv_rows_invariant() {
            self.sessions.enable_prefix_cache(cap, Exact::AnyRow);
            tracing::info!(tokens = cap, "prefix cache on");
        } else if !whole_chunks_switched_on() {
            tracing::info!(
                "prefix cache off: on this device a token's keys and values depend on the pass \
                 that computed them (DUET_CUDA_PREFIX_CACHE=1 copies whole prefill chunks)"
            );
        } else {
            let chunk = self.config.prefill_chunk();
            self.sessions
                .enable_prefix_cache(cap, Exact::WholeChunks(chunk));
            tracing::info!(
                tokens = cap,
                chunk,
                "prefix cache on, copying whole prefill chunks: on this device a token's keys \
                 and values depend on the pass that computed them"
            );
        }
    }

    /// Before a prompt's first chunk: copies the longest prefix of it the prefix cache
    /// holds into the session, which then prefills only the rest.
    fn take_cached_prefix(&self, p: &mut Prefill) -> Result<(), WorkerError> {
        let first = p.progress.started.is_none();
        if !first || p.tokens.is_empty() || !self.sessions.prefix_cache_on() {
            return Ok(());
        }
        self.metrics
            .prefix_cache_queried
            .inc_by(p.tokens.len() as u64);
        let salt = p
            .session
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .cache_salt;
        let Some(source) = self.sessions.prefix_source(&p.tokens, salt) else {
            return Ok(());
        };
        let mut s = p.session.lock().unwrap_or_else(|e| e.into_inner());
        let prefill = p.generated_from.min(p.tokens.len());
        let copied = source.copy_into(&mut s.cache, &p.tokens, prefill)?;
        s.prefilled = copied;
        self.metrics.prefix_cache_hit.inc_by(copied as u64);
        p.progress.done = copied;
        p.progress.cached = copied;
        Ok(())
    }

    /// Runs the next chunk of `p` (`prefill_chunk_tokens`; all of it if 0) and answers when
    /// the prompt is in; returns it while chunks are left. Between chunks the calls that
    /// came meanwhile run, so a long prompt holds up the other streams for one chunk at a
    /// time. Every prompt is cut the same way from its first uncached token, so a session's
    /// cache does not depend on the load (candle's own kernels, which prefill uses where
    /// ours do not run, pick their kernel by row count; there the prefix cache copies
    /// whole chunks only).
    fn prefill(&self, model: &Model, mut p: Prefill) -> Option<Prefill> {
        if p.reply.is_closed() {
            // The caller went away while it waited (its deadline passed): no prefill for
            // nobody; the session's memory and reservation go here.
            tracing::debug!("skipped the prefill of a session whose caller went away");
            return None;
        }
        let start = Instant::now();
        let forward = p.trace.forward();
        let outcome =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.chunk(model, &mut p)));
        drop(forward);
        let result = match outcome {
            Ok(Ok(())) => {
                let progress = &mut p.progress;
                let started = *progress.started.get_or_insert(start);
                progress.forward += start.elapsed();
                if progress.done < p.tokens.len() {
                    return Some(p);
                }
                self.metrics
                    .forward_seconds
                    .get_or_create(&KindLabel { kind: "prefill" })
                    .observe(progress.forward.as_secs_f64());
                let rows = progress.done - progress.cached;
                Ok(Timing::alone(started - p.enqueued, progress.forward, rows))
            }
            Ok(Err(e)) => Err(e),
            Err(_) => {
                tracing::error!("a prefill panicked; its call failed");
                return None;
            }
        };
        // Offered before the open answers, so that the next prefill (an open of the same
        // prompt queued behind this one) finds it.
        let donor = match &result {
            Ok(_) => self.sessions.offer_prompt(&p.session, &p.tokens),
            Err(_) => None,
        };
        let prompt_logprobs = p.scoring.map(|s| s.figures).unwrap_or_default();
        let _ = p.reply.send(result.map(|timing| Prefilled {
            donor,
            prompt_logprobs,
            cached: p.progress.cached,
            session: p.session,
            reservation: p.reservation,
            timing,
        }));
        None
    }

    /// Prefills `p`'s next chunk, after taking what the prefix cache holds of it. A prompt
    /// that is scored takes nothing from the cache (copied rows come without logits) and
    /// gets each row's figures.
    fn chunk(&self, model: &Model, p: &mut Prefill) -> Result<(), WorkerError> {
        if p.scoring.is_none() {
            self.take_cached_prefix(p)?;
        }
        let chunk = match (self.config.prefill_chunk(), p.scoring.is_some()) {
            (0, false) => usize::MAX,
            (0, true) => MAX_SCORED_CHUNK,
            (n, false) => n,
            (n, true) => n.min(MAX_SCORED_CHUNK),
        };
        let from = p.progress.done;
        let to = from.saturating_add(chunk).min(p.tokens.len());
        if to > from {
            let mut s = p.session.lock().unwrap_or_else(|e| e.into_inner());
            let tokens = &p.tokens[from..to];
            match &mut p.scoring {
                Some(scoring) => {
                    // A scored prompt has no generated part (`check_open`).
                    let logits = model.prefill(&mut s.cache, tokens, LogitsFor::All)?;
                    let next = p.tokens[from + 1..].iter().copied();
                    scoring.score(&logits, next.chain([scoring.last]))?;
                }
                None => {
                    ingest(model, &mut s.cache, tokens, from, p.generated_from)?;
                    // A scored prompt's chunks are cut otherwise (`MAX_SCORED_CHUNK`).
                    s.prefilled = to.min(p.generated_from);
                }
            }
        }
        p.progress.done = to;
        Ok(())
    }

    fn run_jobs(&mut self, model: &Model, jobs: Vec<H::Job>, more: More<'_, H::Job>) {
        let mut calls = jobs.len();
        let mut counted = |running: usize| {
            let admitted = more(running);
            calls += admitted.len();
            admitted
        };
        let started = Instant::now();
        let run = std::panic::AssertUnwindSafe(|| self.handler.run(model, jobs, &mut counted));
        let outcome = std::panic::catch_unwind(run);
        self.metrics.batch_size.observe(calls as f64);
        self.metrics
            .forward_seconds
            .get_or_create(&KindLabel { kind: "call" })
            .observe(started.elapsed().as_secs_f64());
        self.metrics.observe_cuda_graphs(model.cuda_graphs());
        if outcome.is_err() {
            tracing::error!("a model job panicked; its calls failed, the worker goes on");
        }
    }
}

/// The next work on the queue, or `None` once every sender is gone: while `busy` says
/// calls come and go, looked for without sleeping, so that a call finds the thread awake
/// (waking it costs about what handing it the call does); else waited for.
fn next_work<W>(rx: &mut mpsc::Receiver<W>, busy: Option<&BusyPoll>) -> Option<W> {
    while busy.is_some_and(BusyPoll::recent) {
        match rx.try_recv() {
            Ok(work) => return Some(work),
            Err(mpsc::error::TryRecvError::Empty) => std::hint::spin_loop(),
            Err(mpsc::error::TryRecvError::Disconnected) => return None,
        }
    }
    rx.blocking_recv()
}

/// `DUET_CUDA_PREFIX_CACHE=1`: where rows depend on the pass, the prefix cache copies whole
/// prefill chunks.
pub fn whole_chunks_switched_on() -> bool {
    std::env::var("DUET_CUDA_PREFIX_CACHE").is_ok_and(|v| v == "1")
}

/// Feeds the chunk of a session's prompt that starts at `from` to its cache: what comes
/// before `generated_from` as a prompt's prefill, the rest as calls feed tokens, on the
/// batch-invariant path. A session that takes over a lost one's sequence then holds that
/// session's rows bit for bit: the prompt cut into the same chunks, what it generated
/// computed as it was (on a GPU a prefill computes a row otherwise than a call does).
fn ingest(
    model: &Model,
    cache: &mut KvCache,
    tokens: &[u32],
    from: usize,
    generated_from: usize,
) -> Result<(), duet_engine::EngineError> {
    let split = generated_from.clamp(from, from + tokens.len()) - from;
    let (prompt, generated) = tokens.split_at(split);
    if !prompt.is_empty() {
        model.prefill(cache, prompt, LogitsFor::None)?;
    }
    if !generated.is_empty() {
        model.forward(cache, generated, LogitsFor::None)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests;
