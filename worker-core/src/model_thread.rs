//! The model thread: it loads the model, then takes calls off the one bounded queue, runs the
//! waiting ones together (up to `max_batch`) and answers each. A panicking job is a bug, but it
//! must not take the thread (and with it every later call) down: its callers see their reply
//! dropped (`WorkerError::Dropped`) and the thread goes on.

use crate::load::{Loaded, load};
use crate::metrics::{KindLabel, WorkerMetrics};
use crate::sessions::Session;
use crate::trace::CallTrace;
use crate::{WorkerConfig, WorkerError};
use duet_engine::{LogitsFor, Model};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};

/// Where a call's time went on the worker.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Timing {
    /// Waiting in the queue.
    pub queue: Duration,
    /// In the forward passes the call took part in.
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
pub(crate) enum Work<J> {
    Prefill(Prefill),
    Own(J),
}

pub(crate) struct Prefill {
    pub session: Arc<Mutex<Session>>,
    pub tokens: Vec<u32>,
    pub enqueued: Instant,
    pub trace: CallTrace,
    pub reply: oneshot::Sender<Result<Timing, WorkerError>>,
}

/// What the model thread shares with the rest of the worker.
pub(crate) struct Thread<H: Handler> {
    pub config: WorkerConfig,
    pub handler: H,
    pub loaded: Arc<OnceLock<Loaded>>,
    pub depth: Arc<AtomicUsize>,
    pub metrics: Arc<WorkerMetrics>,
}

impl<H: Handler> Thread<H> {
    /// Loads the model (`ready` gets the outcome), then serves `rx` until every sender is gone.
    pub fn run(
        mut self,
        mut rx: mpsc::Receiver<Work<H::Job>>,
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
        let model = loaded.model.clone();
        let _ = self.loaded.set(loaded);
        let _ = ready.send(Ok(()));
        let max_batch = self.config.max_batch.max(1);
        while let Some(first) = rx.blocking_recv() {
            let mut batch = vec![first];
            while batch.len() < max_batch {
                match rx.try_recv() {
                    Ok(w) => batch.push(w),
                    Err(_) => break,
                }
            }
            self.depth.fetch_sub(batch.len(), Ordering::Relaxed);
            let mut own = Vec::new();
            for work in batch {
                match work {
                    Work::Prefill(p) => self.prefill(&model, p),
                    Work::Own(job) => own.push(job),
                }
            }
            if own.is_empty() {
                continue;
            }
            // Calls admitted while the jobs run; prefills met on the way wait until after.
            let mut deferred = Vec::new();
            let depth = self.depth.clone();
            let mut more = |running: usize| {
                let mut jobs = Vec::new();
                while running + jobs.len() < max_batch {
                    match rx.try_recv() {
                        Ok(Work::Own(job)) => jobs.push(job),
                        Ok(Work::Prefill(p)) => deferred.push(p),
                        Err(_) => break,
                    }
                    depth.fetch_sub(1, Ordering::Relaxed);
                }
                jobs
            };
            self.run_jobs(&model, own, &mut more);
            for p in deferred {
                self.prefill(&model, p);
            }
        }
    }

    fn prefill(&self, model: &Model, mut p: Prefill) {
        let forward = p.trace.forward();
        let run = std::panic::AssertUnwindSafe(|| -> Result<Timing, WorkerError> {
            let start = Instant::now();
            let mut s = p.session.lock().unwrap_or_else(|e| e.into_inner());
            if !p.tokens.is_empty() {
                model.prefill(&mut s.cache, &p.tokens, LogitsFor::None)?;
            }
            Ok(Timing::alone(
                start - p.enqueued,
                start.elapsed(),
                p.tokens.len(),
            ))
        });
        match std::panic::catch_unwind(run) {
            Ok(result) => {
                if let Ok(t) = &result {
                    self.metrics
                        .forward_seconds
                        .get_or_create(&KindLabel { kind: "prefill" })
                        .observe(t.forward.as_secs_f64());
                }
                let _ = p.reply.send(result);
            }
            Err(_) => tracing::error!("a prefill panicked; its call failed"),
        }
        drop(forward);
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
        if outcome.is_err() {
            tracing::error!("a model job panicked; its calls failed, the worker goes on");
        }
    }
}
