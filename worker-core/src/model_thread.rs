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

/// Queue wait and forward time of one call.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Timing {
    pub queue: Duration,
    pub forward: Duration,
}

/// A worker's own model work, run on the model thread.
pub trait Handler: Send + 'static {
    type Job: Send + 'static;
    /// Runs the jobs the thread took off the queue together (at most `max_batch`).
    fn run(&mut self, model: &Model, jobs: Vec<Self::Job>);
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
            if !own.is_empty() {
                self.run_jobs(&model, own);
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
            Ok(Timing {
                queue: start - p.enqueued,
                forward: start.elapsed(),
            })
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

    fn run_jobs(&mut self, model: &Model, jobs: Vec<H::Job>) {
        self.metrics.batch_size.observe(jobs.len() as f64);
        let started = Instant::now();
        let run = std::panic::AssertUnwindSafe(|| self.handler.run(model, jobs));
        let outcome = std::panic::catch_unwind(run);
        self.metrics
            .forward_seconds
            .get_or_create(&KindLabel { kind: "call" })
            .observe(started.elapsed().as_secs_f64());
        if outcome.is_err() {
            tracing::error!("a model job panicked; its calls failed, the worker goes on");
        }
    }
}
