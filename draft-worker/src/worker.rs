//! The draft model's work: every waiting Propose call steps together, one batched forward
//! pass per draft position. A call's first pass feeds the committed tokens its session lacks,
//! each later pass its previous draft token; each token goes to its caller as soon as it is
//! sampled, and a call leaves the batch after its K-th token (or earlier, when its drafts'
//! joint probability falls below the call's `stop_below`) while calls that arrived
//! meanwhile join it at the next pass (continuous batching). A call whose caller went away
//! (its deadline passed, its request ended) gets no further pass, queued or running.

use duet_engine::penalties::Counts;
use duet_engine::sampling::{
    Distribution, Draw, SamplingError, argmax, argmax_probability, likely_others,
    proposal_distribution,
};
use duet_engine::structured::{Mask, masked};
use duet_engine::{Logits, LogitsFor, Model, SequenceInput};
use duet_worker_core::{
    CallTrace, Forward, Handler, More, Session, Timing, WorkerError, read_side_by_side,
};
use rayon::prelude::*;
use std::borrow::Cow;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// One Propose call, validated.
#[derive(Debug)]
pub struct ProposeJob {
    pub session: Arc<Mutex<Session>>,
    pub keep: usize,
    pub append: Vec<u32>,
    pub k: usize,
    /// Stop after the token that brings the product of this call's draft probabilities
    /// below this (0: never; see `ProposeRequest.stop_below`).
    pub stop_below: f32,
    /// `(alternatives_above, max_alternatives)` of the request; `(0, 0)`: none.
    pub alternatives: (f32, usize),
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
    /// Other likely tokens at this position (greedy sessions that asked for them).
    pub alternatives: Vec<u32>,
}

#[derive(Debug, Clone, Copy, Default)]
pub struct DraftHandler;

/// A call in the batch: what its next pass feeds and where its time went so far.
struct Drafting {
    job: ProposeJob,
    input: Vec<u32>,
    drafted: usize,
    /// The product of the drafted tokens' probabilities so far.
    sure: f32,
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
                if job.out.is_closed() {
                    // Its caller went away while it waited (deadline passed, request
                    // cancelled): it gets no pass.
                    continue;
                }
                let busy = running
                    .iter()
                    .any(|r| Arc::ptr_eq(&r.job.session, &job.session));
                if busy {
                    later.push(job);
                } else if let Some(d) = start(model, job) {
                    running.push(d);
                }
            }
            waiting = later;
            if running.is_empty() && waiting.is_empty() {
                return;
            }
            // A caller that went away since the last pass stops its drafting before this one.
            running.retain(|r| !r.job.out.is_closed());
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

/// Takes a call into the batch: cuts its session's cache back to `keep`, checks that
/// `append` and the K - 1 draft tokens it will feed fit, and takes the rare ids of `append`
/// into a shortlisted draft's extra ids.
fn start(model: &Model, mut job: ProposeJob) -> Option<Drafting> {
    let queue = job.enqueued.elapsed();
    let forward = job.trace.forward();
    let rewound = {
        let mut session = job.session.lock().unwrap_or_else(|e| e.into_inner());
        job.trace.rewound(session.cache.len(), job.keep);
        // dK is sampled but never fed, so the cache grows by append + K - 1.
        session
            .rewind(job.keep, job.append.len(), job.k - 1)
            .and_then(|()| Ok(model.extend_shortlist(&mut session.extra, &job.append)?))
    };
    if let Err(e) = rewound {
        fail(&job, e);
        return None;
    }
    Some(Drafting {
        input: std::mem::take(&mut job.append),
        job,
        drafted: 0,
        sure: 1.0,
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
    let draws: Vec<Option<Draw>> = guards.iter_mut().map(|s| proposal_draw(s)).collect();
    let mut seqs: Vec<SequenceInput<'_>> = guards
        .iter_mut()
        .zip(running.iter().zip(&draws))
        .map(|(session, (r, draw))| {
            let own_rows = adjusts(session);
            let Session {
                cache,
                extra,
                sampling,
                ..
            } = &mut **session;
            SequenceInput {
                cache,
                tokens: &r.input,
                logits: LogitsFor::Last,
                extra: Some(extra),
                // A greedy session reads the row's argmax (and its probability) alone: on a
                // GPU that comes back instead of the vocabulary's logits.
                // Alternatives, and a choice from a row of the session's own, are read off
                // the row's logits.
                greedy: sampling.is_greedy() && r.job.alternatives.1 == 0 && !own_rows,
                draws: draw.as_slice(),
                parents: &[],
            }
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
    // Each call reads its own row and draws from its own session's stream, so the calls
    // read side by side on the cores the pass used, where that pays.
    let sessions: Vec<&mut Session> = guards.iter_mut().map(|g| &mut **g).collect();
    let read_one =
        |((r, session), (logits, draw)): Reading<'_>| read(r, session, logits, draw.as_ref());
    let reads: Vec<_> = match read_side_by_side(&logits) {
        true => running
            .par_iter()
            .zip(sessions)
            .zip(logits.par_iter().zip(&draws))
            .map(read_one)
            .collect(),
        false => running
            .iter()
            .zip(sessions)
            .zip(logits.iter().zip(&draws))
            .map(read_one)
            .collect(),
    };
    for (r, read) in running.drain(..).zip(reads) {
        match read {
            Ok(read) => keep.extend(send_draft(r, read, took, (calls, rows))),
            Err(e) => fail(&r.job, e),
        }
    }
    *running = keep;
}

/// What a call reads its draft from: the call, its session, its rows and its draw.
type Reading<'a> = (
    (&'a Drafting, &'a mut Session),
    (&'a Logits, &'a Option<Draw>),
);

/// A sampling call's draw taken before its pass, where its row is its model's own (nothing
/// adjusts it), so that the pass can make its proposal where the row is (on a GPU, the few
/// hundred tokens that matter come back instead of the vocabulary's logits): the uniform
/// its token is drawn at, from the session's stream as `sample` would take it.
fn proposal_draw(session: &mut Session) -> Option<Draw> {
    let takes = !session.sampling.is_greedy() && !adjusts(session);
    takes.then(|| Draw::proposal(session.sampling, &mut session.rng))
}

/// Sends a call's draft token of a pass that took `took` (with `calls` calls and `rows`
/// rows in all) to its caller; returns the call while it drafts on.
fn send_draft(
    mut r: Drafting,
    read: Read,
    took: Duration,
    (calls, rows): (usize, usize),
) -> Option<Drafting> {
    let Read {
        token,
        q,
        p,
        alternatives,
        took: own,
    } = read;
    // Reading its row (a softmax over the vocabulary, for a sampling call) is the call's
    // own step time, as much as its share of the pass.
    let t = &mut r.timing;
    t.forward += took + own;
    t.batch_calls = t.batch_calls.max(calls);
    t.batch_rows += rows;
    t.share += took.mul_f64(r.input.len() as f64 / rows as f64) + own;
    r._forward
        .span
        .set_attribute("duet.batch_size", t.batch_calls as i64);
    r.drafted += 1;
    r.sure *= p;
    let last = r.drafted == r.job.k || r.sure < r.job.stop_below;
    let drafted = Drafted {
        token,
        q,
        timing: last.then_some(r.timing),
        alternatives,
    };
    // A caller that went away (cancelled, timed out) stops its drafting.
    if r.job.out.blocking_send(Ok(drafted)).is_ok() && !last {
        r.input = vec![token];
        return Some(r);
    }
    None
}

/// A call's next draft token read off its row: the token, its q (sampling sessions), its
/// probability, the other candidates worth verifying beside it, and how long reading took.
struct Read {
    token: u32,
    q: Option<Distribution>,
    p: f32,
    alternatives: Vec<u32>,
    took: Duration,
}

fn read(
    r: &Drafting,
    session: &mut Session,
    logits: &Logits,
    draw: Option<&Draw>,
) -> Result<Read, WorkerError> {
    let started = Instant::now();
    let sure = r.job.stop_below > 0.0 || r.job.alternatives.1 > 0;
    let own = adjusted(session, logits)?;
    let (token, q, p) = match draw {
        Some(draw) => drawn(logits, draw)?,
        None => sample(logits, own.as_deref(), session, sure)?,
    };
    let drafted = (token, q.as_ref(), p);
    let row = own.as_deref();
    let alternatives = alternatives(logits, row, drafted, r.sure, &r.job, session);
    Ok(Read {
        token,
        q,
        p,
        alternatives,
        took: started.elapsed(),
    })
}

/// Whether a session proposes from rows of its own rather than the model's ([`adjusted`]).
fn adjusts(session: &Session) -> bool {
    !session.penalties.is_none()
        || !session.logit_bias.is_empty()
        || session.min_tokens.applies()
        || session.constraint.is_some()
}

/// The row a session proposes from where it is not the model's own, as the target will
/// choose there: with the request's logit bias added, penalized by its completion so far
/// (the committed tokens, then this call's drafts) and its prompt, no end token before
/// `min_tokens`, and the tokens its structured output does not allow next at -inf. `None`:
/// the model's row.
fn adjusted<'a>(
    session: &mut Session,
    logits: &'a Logits,
) -> Result<Option<Cow<'a, [f32]>>, WorkerError> {
    if !adjusts(session) {
        return Ok(None);
    }
    let mask = allowed_next(session);
    let so_far = session.cache.tokens();
    let so_far = so_far.get(session.completion_from..).unwrap_or_default();
    // Only penalties count the tokens themselves.
    let counted = if session.penalties.is_none() {
        &[]
    } else {
        so_far
    };
    let biased = session
        .logit_bias
        .apply(Cow::Borrowed(logits.row(last(logits)?)));
    let row = session
        .penalties
        .apply(biased, &Counts::of(counted), &session.prompt_tokens);
    let row = session.min_tokens.apply(row, so_far.len());
    let Some(mask) = mask else {
        return Ok(Some(row));
    };
    // A shortlisted draft has no logit for the tokens outside its shortlist: where the
    // format allows none of those it has, it proposes as if unconstrained (the target
    // rejects the draft; acceptance, not exactness).
    let masked = masked(&mask, row.clone());
    Ok(Some(match masked.iter().any(|l| l.is_finite()) {
        true => masked,
        false => row,
    }))
}

/// The tokens a constrained session's format allows after the tokens its cache holds (its
/// completion so far, then this call's drafts). `None` for a session without a structured
/// output, or where those tokens leave the format (they came from the target's constrained
/// choices and the draft's masked proposals, so only a proposal made unconstrained does
/// that): the draft then proposes unconstrained until the next call rolls back past it.
fn allowed_next(session: &mut Session) -> Option<Mask> {
    let Session {
        constraint,
        cache,
        completion_from,
        ..
    } = session;
    let so_far = cache.tokens().get(*completion_from..).unwrap_or_default();
    match constraint.as_mut()?.masks(so_far, &[]) {
        Ok(mut masks) => masks.pop(),
        Err(e) => {
            tracing::debug!(error = %e, "the draft proposes unconstrained");
            None
        }
    }
}

/// Other candidates worth verifying beside `drafted` (its token, q and probability) after
/// drafts of joint probability `sure`: a greedy draft's next most likely tokens; a sampling
/// draft's independent draws from q (what multi-candidate rejection sampling needs). None
/// where even all of the other tokens' probability falls short (most positions: the
/// vocabulary is not scanned there). `own`: the session's own row ([`adjusted`]), if any.
fn alternatives(
    logits: &Logits,
    own: Option<&[f32]>,
    drafted: (u32, Option<&Distribution>, f32),
    sure: f32,
    job: &ProposeJob,
    session: &mut Session,
) -> Vec<u32> {
    let ((token, q, p), (above, most)) = (drafted, job.alternatives);
    match q {
        _ if most == 0 || sure * (1.0 - p) < above => Vec::new(),
        None => {
            let row = own.unwrap_or_else(|| logits.row(0));
            likely_others(row, token, above / sure, most)
        }
        Some(q) => (0..most).map(|_| q.sample(&mut session.rng)).collect(),
    }
}

/// The row of the call's last position (the one its next draft follows).
fn last(logits: &Logits) -> Result<usize, WorkerError> {
    let last = logits.rows().checked_sub(1);
    last.ok_or_else(|| WorkerError::invalid("append", "no logits for an empty input"))
}

/// The draft token drawn at the draw taken before the pass ([`proposal_draw`]): from the
/// proposal the pass made where the row is, else from the row as [`sample`] draws.
fn drawn(logits: &Logits, draw: &Draw) -> Result<(u32, Option<Distribution>, f32), WorkerError> {
    let invalid = |e: SamplingError| WorkerError::invalid("sampling", e.to_string());
    let drawn = logits.drawn(last(logits)?, draw).map_err(invalid)?;
    Ok((drawn.token, drawn.proposal, drawn.probability))
}

/// The next draft token from its position's logits (`own`: the session's own row, where it
/// has one: [`adjusted`]): the token, the distribution it was drawn from
/// (sampling sessions: the request's without its long tail, which the verification's tests
/// and residuals take as the draft's) and its probability. Greedy sessions compute the
/// probability (a softmax, on a CPU) only when the call may stop early (`sure`); otherwise
/// it is 1.
fn sample(
    logits: &Logits,
    own: Option<&[f32]>,
    session: &mut Session,
    sure: bool,
) -> Result<(u32, Option<Distribution>, f32), WorkerError> {
    let last = last(logits)?;
    let invalid = |e: SamplingError| WorkerError::invalid("sampling", e.to_string());
    if let (true, Some(row)) = (session.sampling.is_greedy(), own) {
        return match sure {
            true => argmax_probability(row).map(|(t, p)| (t, None, p)),
            false => argmax(row).map(|t| (t, None, 1.0)),
        }
        .map_err(invalid);
    }
    if session.sampling.is_greedy() {
        return match sure {
            true => logits
                .greedy(last)
                .map(|g| (g.token, None, g.probability))
                .map_err(invalid),
            false => logits
                .greedy_token(last)
                .map(|t| (t, None, 1.0))
                .map_err(invalid),
        };
    }
    let row = own.unwrap_or_else(|| logits.row(last));
    let q = proposal_distribution(row, &session.sampling).map_err(invalid)?;
    let token = q.sample(&mut session.rng);
    let p = q.prob(token);
    Ok((token, Some(q), p))
}

#[cfg(test)]
mod tests;
