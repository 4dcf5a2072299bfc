//! The target model's work: one forward pass over `append ++ draft` per session, several
//! sessions per pass, returning the target's choice at each of the last K + 1 positions.

use duet_engine::sampling::{argmax, process_logits};
use duet_engine::{Logits, LogitsFor, Model, SequenceInput};
use duet_proto::v1 as pb;
use duet_serving::wire::encode_distribution;
use duet_serving::worker::{CallTrace, Handler, Session, Timing, WorkerError};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;
use tokio::sync::oneshot;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// One Verify call, validated.
#[derive(Debug)]
pub struct VerifyJob {
    pub session: Arc<Mutex<Session>>,
    pub keep: usize,
    pub append: Vec<u32>,
    pub draft: Vec<u32>,
    pub reply: oneshot::Sender<Result<pb::VerifyResponse, WorkerError>>,
    pub enqueued: Instant,
    pub trace: CallTrace,
}

#[derive(Debug, Clone, Copy, Default)]
pub struct TargetHandler;

impl Handler for TargetHandler {
    type Job = VerifyJob;

    fn run(&mut self, model: &Model, mut jobs: Vec<VerifyJob>) {
        // A pass may hold each session once; a second call for the same session (which a
        // well-behaved coordinator never sends) waits for the next pass.
        while !jobs.is_empty() {
            let mut pass = Vec::new();
            let mut later = Vec::new();
            for job in jobs {
                if pass
                    .iter()
                    .any(|p: &VerifyJob| Arc::ptr_eq(&p.session, &job.session))
                {
                    later.push(job);
                } else {
                    pass.push(job);
                }
            }
            verify_pass(model, pass);
            jobs = later;
        }
    }
}

fn verify_pass(model: &Model, jobs: Vec<VerifyJob>) {
    let start = Instant::now();
    let sessions: Vec<_> = jobs.iter().map(|j| j.session.clone()).collect();
    let mut ready: Vec<(VerifyJob, MutexGuard<'_, Session>)> = Vec::new();
    let batch = jobs.len();
    let mut forwards = Vec::with_capacity(batch);
    for (mut job, session) in jobs.into_iter().zip(&sessions) {
        let forward = job.trace.forward();
        forward.span.set_attribute("duet.batch_size", batch as i64);
        forwards.push(forward);
        let mut guard = session.lock().unwrap_or_else(|e| e.into_inner());
        job.trace.rewound(guard.cache.len(), job.keep);
        match guard.rewind(job.keep, job.append.len(), job.draft.len()) {
            Ok(()) => ready.push((job, guard)),
            Err(e) => {
                let _ = job.reply.send(Err(e));
            }
        }
    }
    if ready.is_empty() {
        return;
    }
    let inputs: Vec<Vec<u32>> = ready
        .iter()
        .map(|(j, _)| j.append.iter().chain(&j.draft).copied().collect())
        .collect();
    let mut seqs: Vec<SequenceInput<'_>> = ready
        .iter_mut()
        .zip(&inputs)
        .map(|((_, guard), tokens)| SequenceInput {
            cache: &mut guard.cache,
            tokens,
            logits: LogitsFor::All,
        })
        .collect();
    let result = model.forward_batch(&mut seqs);
    drop(seqs);
    match result {
        Ok(all) => {
            // Reading the answers (argmax or distributions over the vocabulary) is model
            // time too: measure it with the forward pass, then reply to everyone at once.
            let answers: Vec<_> = ready
                .iter()
                .zip(&all)
                .map(|((job, guard), logits)| answer(guard, logits, job.draft.len()))
                .collect();
            let forward = start.elapsed();
            drop(forwards);
            for ((job, _), answer) in ready.into_iter().zip(answers) {
                let timing = Timing {
                    queue: start.saturating_duration_since(job.enqueued),
                    forward,
                }
                .to_wire();
                let _ = job.reply.send(answer.map(|mut a| {
                    a.timing = Some(timing);
                    a
                }));
            }
        }
        Err(e) => {
            drop(forwards);
            let message = e.to_string();
            for (job, _) in ready {
                let _ = job
                    .reply
                    .send(Err(WorkerError::Engine(duet_engine::EngineError::Device(
                        "forward".into(),
                        message.clone(),
                    ))));
            }
        }
    }
}

/// The target's choice at the last `k + 1` positions: argmaxes when greedy, else p.
fn answer(session: &Session, logits: &Logits, k: usize) -> Result<pb::VerifyResponse, WorkerError> {
    let first = logits.rows() - (k + 1);
    let rows = (first..logits.rows()).map(|i| logits.row(i));
    let mut response = pb::VerifyResponse::default();
    let bad =
        |e: duet_engine::sampling::SamplingError| WorkerError::invalid("sampling", e.to_string());
    if session.sampling.is_greedy() {
        response.argmax = rows.map(argmax).collect::<Result<_, _>>().map_err(bad)?;
    } else {
        response.p = rows
            .map(|row| {
                process_logits(row, &session.sampling)
                    .map(|d| encode_distribution(&d, logits.vocab()))
            })
            .collect::<Result<_, _>>()
            .map_err(bad)?;
    }
    Ok(response)
}
