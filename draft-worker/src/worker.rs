//! The draft model's work: every waiting Propose call steps together, one batched forward
//! pass per draft position. A call's first pass feeds the committed tokens its session lacks,
//! each later pass its previous draft token; each token goes to its caller as soon as it is
//! sampled, and a call leaves the batch after its K-th token while calls that arrived
//! meanwhile join it at the next pass (continuous batching).

use duet_engine::sampling::{Distribution, process_logits};
use duet_engine::{LogitsFor, Model, SequenceInput};
use duet_worker_core::{CallTrace, Forward, Handler, More, Session, Timing, WorkerError};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;
use tokio::sync::mpsc;
use tracing_opentelemetry::OpenTelemetrySpanExt;

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

/// A call in the batch: what its next pass feeds and where its time went so far.
struct Drafting {
    job: ProposeJob,
    input: Vec<u32>,
    drafted: usize,
    timing: Timing,
    _forward: Forward,
}

impl Handler for DraftHandler {
    type Job = ProposeJob;

    fn run(&mut self, model: &Model, jobs: Vec<ProposeJob>, more: More<'_, ProposeJob>) {
        let mut waiting = jobs;
        let mut running: Vec<Drafting> = Vec::new();
        loop {
            // Admit waiting calls, one per session (a second call of a session, which a
            // well-behaved coordinator never sends, waits for the first to finish).
            let mut later = Vec::new();
            for job in waiting.drain(..) {
                let busy = running
                    .iter()
                    .any(|r| Arc::ptr_eq(&r.job.session, &job.session));
                if busy {
                    later.push(job);
                } else if let Some(d) = start(job) {
                    running.push(d);
                }
            }
            waiting = later;
            if running.is_empty() && waiting.is_empty() {
                return;
            }
            if !running.is_empty() {
                step(model, &mut running);
            }
            let admitted = more(running.len() + waiting.len());
            waiting.extend(admitted);
        }
    }
}

fn fail(job: &ProposeJob, e: WorkerError) {
    let _ = job.out.blocking_send(Err(e));
}

/// Takes a call into the batch: cuts its session's cache back to `keep` and checks that
/// `append` and the K - 1 draft tokens it will feed fit.
fn start(mut job: ProposeJob) -> Option<Drafting> {
    let queue = job.enqueued.elapsed();
    let forward = job.trace.forward();
    let rewound = {
        let mut session = job.session.lock().unwrap_or_else(|e| e.into_inner());
        job.trace.rewound(session.cache.len(), job.keep);
        // dK is sampled but never fed, so the cache grows by append + K - 1.
        session.rewind(job.keep, job.append.len(), job.k - 1)
    };
    if let Err(e) = rewound {
        fail(&job, e);
        return None;
    }
    Some(Drafting {
        input: std::mem::take(&mut job.append),
        job,
        drafted: 0,
        timing: Timing {
            queue,
            ..Timing::default()
        },
        _forward: forward,
    })
}

/// One batched pass: every running call feeds its input and samples its next draft token,
/// which goes to its caller at once. Calls that have all their tokens, whose caller went
/// away, or that failed leave the batch.
fn step(model: &Model, running: &mut Vec<Drafting>) {
    let sessions: Vec<Arc<Mutex<Session>>> =
        running.iter().map(|r| r.job.session.clone()).collect();
    let mut guards: Vec<MutexGuard<'_, Session>> = sessions
        .iter()
        .map(|s| s.lock().unwrap_or_else(|e| e.into_inner()))
        .collect();
    let started = Instant::now();
    let mut seqs: Vec<SequenceInput<'_>> = guards
        .iter_mut()
        .zip(running.iter())
        .map(|(session, r)| SequenceInput {
            cache: &mut session.cache,
            tokens: &r.input,
            logits: LogitsFor::Last,
        })
        .collect();
    let result = model.forward_batch(&mut seqs);
    drop(seqs);
    let logits = match result {
        Ok(logits) => logits,
        Err(e) => {
            // Every call of the pass fails with the engine's own error.
            let e = WorkerError::from(e);
            for r in running.drain(..) {
                fail(&r.job, e.clone());
            }
            return;
        }
    };
    let took = started.elapsed();
    let rows: usize = running.iter().map(|r| r.input.len()).sum();
    let calls = running.len();
    let mut keep = Vec::with_capacity(calls);
    for ((mut r, session), logits) in running.drain(..).zip(guards.iter_mut()).zip(&logits) {
        let t = &mut r.timing;
        t.forward += took;
        t.batch_calls = t.batch_calls.max(calls);
        t.batch_rows += rows;
        t.share += took.mul_f64(r.input.len() as f64 / rows as f64);
        r._forward
            .span
            .set_attribute("duet.batch_size", t.batch_calls as i64);
        let sampled = logits
            .last()
            .ok_or_else(|| WorkerError::invalid("append", "no logits for an empty input"))
            .and_then(|row| {
                process_logits(row, &session.sampling)
                    .map_err(|e| WorkerError::invalid("sampling", e.to_string()))
            });
        let dist = match sampled {
            Ok(d) => d,
            Err(e) => {
                fail(&r.job, e);
                continue;
            }
        };
        let (token, q) = if session.sampling.is_greedy() {
            (dist.argmax(), None)
        } else {
            (dist.sample(&mut session.rng), Some(dist))
        };
        r.drafted += 1;
        let last = r.drafted == r.job.k;
        let drafted = Drafted {
            token,
            q,
            timing: last.then_some(r.timing),
        };
        // A caller that went away (cancelled, timed out) stops its drafting.
        if r.job.out.blocking_send(Ok(drafted)).is_ok() && !last {
            r.input = vec![token];
            keep.push(r);
        }
    }
    *running = keep;
}

#[cfg(test)]
mod tests {
    use super::*;
    use duet_engine::sampling::{SamplingParams, rng_for};
    use duet_engine::testing::TinyModel;
    use duet_engine::{LoadOptions, Model};

    fn tiny() -> (tempfile::TempDir, Model) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("draft.gguf");
        TinyModel::default().write(&path).unwrap();
        let model = Model::load(&path, &LoadOptions::default()).unwrap();
        (dir, model)
    }

    /// A session holding `prompt` but its last token, sampling with `temperature`.
    fn session(model: &Model, prompt: &[u32], temperature: f32) -> Arc<Mutex<Session>> {
        let mut cache = model.new_cache(64).unwrap();
        model
            .prefill(&mut cache, &prompt[..prompt.len() - 1], LogitsFor::None)
            .unwrap();
        let sampling = SamplingParams {
            temperature,
            top_k: 8,
            ..SamplingParams::greedy()
        };
        Arc::new(Mutex::new(Session {
            cache,
            sampling,
            rng: rng_for(prompt[0] as u64),
        }))
    }

    fn job(
        session: &Arc<Mutex<Session>>,
        prompt: &[u32],
        k: usize,
    ) -> (ProposeJob, mpsc::Receiver<Result<Drafted, WorkerError>>) {
        let (out, rx) = mpsc::channel(k);
        let job = ProposeJob {
            session: session.clone(),
            keep: prompt.len() - 1,
            append: vec![prompt[prompt.len() - 1]],
            k,
            out,
            enqueued: Instant::now(),
            trace: CallTrace::queued(tracing::Span::none()),
        };
        (job, rx)
    }

    fn drained(mut rx: mpsc::Receiver<Result<Drafted, WorkerError>>) -> (Vec<u32>, Timing) {
        let mut tokens = Vec::new();
        let mut timing = None;
        while let Ok(d) = rx.try_recv() {
            let d = d.unwrap();
            tokens.push(d.token);
            timing = timing.or(d.timing);
        }
        (tokens, timing.expect("the last token carries the timing"))
    }

    /// Calls stepping together, with different K and one joining half-way, draft exactly
    /// what each drafts alone (greedy and sampled), and say they shared passes.
    #[test]
    fn batched_calls_draft_what_each_drafts_alone() {
        let (_dir, model) = tiny();
        let prompts: [&[u32]; 4] = [&[1, 2, 3, 4], &[9, 8, 7], &[40, 41, 42, 43, 44], &[5, 6]];
        let ks = [4, 2, 5, 3];
        for temperature in [0.0, 1.0] {
            let alone: Vec<Vec<u32>> = prompts
                .iter()
                .zip(ks)
                .map(|(p, k)| {
                    let (job, rx) = job(&session(&model, p, temperature), p, k);
                    DraftHandler.run(&model, vec![job], &mut |_| Vec::new());
                    drained(rx).0
                })
                .collect();
            let sessions: Vec<_> = prompts
                .iter()
                .map(|p| session(&model, p, temperature))
                .collect();
            let (jobs, rxs): (Vec<_>, Vec<_>) = prompts
                .iter()
                .zip(ks)
                .zip(&sessions)
                .map(|((p, k), s)| job(s, p, k))
                .unzip();
            let mut jobs = jobs.into_iter();
            let first: Vec<_> = jobs.by_ref().take(3).collect();
            let mut late = jobs.collect::<Vec<_>>();
            let mut polls = 0;
            // The fourth call arrives after the first pass.
            DraftHandler.run(&model, first, &mut |_| {
                polls += 1;
                std::mem::take(&mut late)
            });
            assert!(polls >= 5, "admission asked after every pass");
            for (i, rx) in rxs.into_iter().enumerate() {
                let (tokens, timing) = drained(rx);
                assert_eq!(tokens, alone[i], "call {i}, temperature {temperature}");
                assert!(timing.batch_calls >= 3, "call {i}: {timing:?}");
                assert!(timing.share < timing.forward, "call {i}: {timing:?}");
            }
            // Each cache holds the prompt, the appended token and K - 1 drafts.
            for ((s, p), k) in sessions.iter().zip(prompts).zip(ks) {
                assert_eq!(s.lock().unwrap().cache.len(), p.len() + k - 1);
            }
        }
    }
}
