//! The draft model's work: feed the committed tokens the session lacks, then sample K tokens
//! one forward pass at a time, sending each to the caller as soon as it exists.

use duet_engine::sampling::{Distribution, process_logits};
use duet_engine::{LogitsFor, Model};
use duet_worker_core::{CallTrace, Handler, Session, Timing, WorkerError};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tokio::sync::mpsc;

/// One Propose call, validated.
#[derive(Debug)]
pub struct ProposeJob {
    pub session: Arc<Mutex<Session>>,
    pub keep: usize,
    pub append: Vec<u32>,
    pub k: usize,
    pub out: mpsc::Sender<Result<Drafted, WorkerError>>,
    pub enqueued: Instant,
    pub trace: CallTrace,
}

/// One draft token, as soon as it is sampled.
#[derive(Debug)]
pub struct Drafted {
    pub token: u32,
    /// The distribution it was sampled from; `None` for greedy sessions.
    pub q: Option<Distribution>,
    /// On the last token of the call.
    pub timing: Option<Timing>,
}

#[derive(Debug, Clone, Copy, Default)]
pub struct DraftHandler;

impl Handler for DraftHandler {
    type Job = ProposeJob;

    fn run(&mut self, model: &Model, jobs: Vec<ProposeJob>) {
        for job in jobs {
            let out = job.out.clone();
            if let Err(e) = propose(model, job) {
                let _ = out.blocking_send(Err(e));
            }
        }
    }
}

fn propose(model: &Model, mut job: ProposeJob) -> Result<(), WorkerError> {
    let start = Instant::now();
    let queue = start - job.enqueued;
    let _forward = job.trace.forward();
    let mut session = job.session.lock().unwrap_or_else(|e| e.into_inner());
    job.trace.rewound(session.cache.len(), job.keep);
    // dK is sampled but never fed, so the cache grows by append + K - 1.
    session.rewind(job.keep, job.append.len(), job.k - 1)?;
    let mut input = job.append;
    for i in 0..job.k {
        let logits = model.forward(&mut session.cache, &input, LogitsFor::Last)?;
        let row = logits
            .last()
            .ok_or_else(|| WorkerError::invalid("append", "no logits for an empty input"))?;
        let s: &mut Session = &mut session;
        let dist = process_logits(row, &s.sampling)
            .map_err(|e| WorkerError::invalid("sampling", e.to_string()))?;
        let (token, q) = if s.sampling.is_greedy() {
            (dist.argmax(), None)
        } else {
            (dist.sample(&mut s.rng), Some(dist))
        };
        let last = i + 1 == job.k;
        let drafted = Drafted {
            token,
            q,
            timing: last.then(|| Timing {
                queue,
                forward: start.elapsed(),
            }),
        };
        if job.out.blocking_send(Ok(drafted)).is_err() {
            // The caller went away (cancelled or timed out): stop drafting.
            return Ok(());
        }
        input = vec![token];
    }
    Ok(())
}
