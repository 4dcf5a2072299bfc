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
            extra: Default::default(),
            tree: Vec::new(),
            last_call: 0,
            logprobs: None,
            penalties: Default::default(),
            completion_from: 0,
            prompt_tokens: Default::default(),
            logit_bias: Default::default(),
            min_tokens: Default::default(),
            constraint: None,
            cache_salt: 0,
            prefilled: 0,
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
            stop_below: 0.0,
            alternatives: (0.0, 0),
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

    /// A biased session drafts from its rows with the bias added, greedy or sampled, with
    /// early stopping and alternatives too: a token raised by 100 is every draft and every
    /// sampled q's one token, a banned one never drafted.
    #[test]
    fn a_biased_session_drafts_what_the_biased_target_chooses() {
        use duet_engine::bias::LogitBias;
        let (_dir, model) = tiny();
        let prompt = [1, 2, 3, 4];
        let (job0, rx) = job(&session(&model, &prompt, 0.0), &prompt, 3);
        DraftHandler.run(&model, vec![job0], &mut |_| Vec::new());
        let unbiased = drained(rx).0;
        for (temperature, stop_below, alternatives) in [(0.0, 0.0, 0), (0.0, 0.5, 2), (1.0, 0.0, 0)]
        {
            let s = session(&model, &prompt, temperature);
            s.lock().unwrap().logit_bias = LogitBias::new([(9, 100.0), (unbiased[0], -100.0)]);
            let (mut call, mut rx) = job(&s, &prompt, 3);
            (call.stop_below, call.alternatives) = (stop_below, (0.01, alternatives));
            DraftHandler.run(&model, vec![call], &mut |_| Vec::new());
            let mut drafted = Vec::new();
            while let Ok(d) = rx.try_recv() {
                let d = d.unwrap();
                assert!(
                    d.q.as_ref().is_none_or(|q| q.prob(9) > 0.99),
                    "{temperature}"
                );
                assert!(!d.alternatives.contains(&unbiased[0]));
                drafted.push(d.token);
            }
            assert_eq!(drafted, [9, 9, 9], "temperature {temperature}");
        }
    }

    /// The tiny draft's tokenizer.
    fn tokenizer(dir: &tempfile::TempDir) -> duet_engine::Tokenizer {
        duet_engine::Tokenizer::load(&dir.path().join("draft.gguf")).unwrap()
    }

    /// A session constrained by the regular expression `format`, its completion starting
    /// after `prompt`.
    fn constrained(
        dir: &tempfile::TempDir,
        model: &Model,
        prompt: &[u32],
        temperature: f32,
        format: &str,
    ) -> Arc<Mutex<Session>> {
        use duet_engine::structured::{Format, Grammars};
        let grammars = Grammars::new(&tokenizer(dir), model.config().vocab).unwrap();
        let s = session(model, prompt, temperature);
        let mut guard = s.lock().unwrap();
        guard.constraint = Some(grammars.constrain(&Format::Regex(format.into())).unwrap());
        guard.completion_from = prompt.len();
        drop(guard);
        s
    }

    /// The ids of one-token `texts`.
    fn ids<const N: usize>(dir: &tempfile::TempDir, texts: [&str; N]) -> [u32; N] {
        let tokenizer = tokenizer(dir);
        texts.map(|t| match tokenizer.encode_literal(t).unwrap()[..] {
            [id] => id,
            ref ids => panic!("{t:?} is {ids:?}"),
        })
    }

    /// A constrained session drafts only what its format allows after its completion so
    /// far and its drafts, greedy or sampled; where the format leaves one token, the draft
    /// is sure of it (q gives it all the mass; a call stopping below any joint probability
    /// goes on). The next call rolls the format back with the cache: after the other
    /// branch, it drafts that branch's token. Tokens outside the format (never the
    /// target's constrained choices) leave the draft unconstrained, not failed.
    #[test]
    fn a_constrained_session_drafts_within_its_format() {
        let (dir, model) = tiny();
        let [a, b, c, d, x] = ids(&dir, ["a", "b", "c", "d", "x"]);
        let prompt = [1, 2, 3, 4];
        for temperature in [0.0, 1.0] {
            let s = constrained(&dir, &model, &prompt, temperature, "(ab|cd)x*");
            let (call, mut rx) = job(&s, &prompt, 3);
            DraftHandler.run(&model, vec![call], &mut |_| Vec::new());
            let mut drafted = Vec::new();
            while let Ok(draft) = rx.try_recv() {
                let draft = draft.unwrap();
                let sure = draft.q.as_ref().map(|q| q.prob(draft.token));
                drafted.push((draft.token, sure));
            }
            let first = drafted[0].0;
            let (then, other, after) = match first == a {
                true => (b, c, d),
                false => (d, a, b),
            };
            assert!([a, c].contains(&first), "{drafted:?}");
            let forced = temperature > 0.0;
            assert_eq!(drafted[1], (then, forced.then_some(1.0)), "{drafted:?}");
            assert_eq!(drafted.len(), 3, "{drafted:?}");
            let ends = tokenizer(&dir).eos_tokens().contains(&drafted[2].0);
            assert!(drafted[2].0 == x || ends, "{drafted:?}");
            // The target chose the other branch: the drafts after it are rolled back.
            let (mut call, rx) = job(&s, &prompt, 1);
            call.append = vec![prompt[3], other];
            DraftHandler.run(&model, vec![call], &mut |_| Vec::new());
            assert_eq!(drained(rx).0, [after], "temperature {temperature}");
            // After `a`, `b` is certain: a call stopping below 0.99 drafts past it.
            let (mut call, rx) = job(&s, &prompt, 3);
            (call.append, call.stop_below) = (vec![prompt[3], a], 0.99);
            DraftHandler.run(&model, vec![call], &mut |_| Vec::new());
            let sure = drained(rx).0;
            assert!(sure.len() >= 2 && sure[0] == b, "{sure:?}");
        }
        let s = constrained(&dir, &model, &prompt, 0.0, "(ab|cd)x*");
        let (mut call, rx) = job(&s, &prompt, 2);
        call.append = vec![prompt[3], x];
        DraftHandler.run(&model, vec![call], &mut |_| Vec::new());
        assert_eq!(drained(rx).0.len(), 2);
    }

    /// A session with penalties and `min_tokens` drafts what the target chooses under them:
    /// each row penalized by the completion so far (the call's drafts with it) and the
    /// prompt, no end token before `min_tokens`, as a reference computes it row by row.
    #[test]
    fn a_penalized_session_drafts_what_the_penalized_target_chooses() {
        use duet_engine::penalties::{MinTokens, Penalties, PromptTokens};
        let (_dir, model) = tiny();
        let prompt = [1, 2, 3, 4];
        let (plain, rx) = job(&session(&model, &prompt, 0.0), &prompt, 6);
        DraftHandler.run(&model, vec![plain], &mut |_| Vec::new());
        let unadjusted = drained(rx).0;
        let penalties = Penalties {
            presence: 2.0,
            frequency: 2.0,
            repetition: 1.3,
        };
        let prompt_tokens = PromptTokens::of(&prompt, &penalties);
        // The first unadjusted draft, as an end token, may not come first.
        let min_tokens = MinTokens {
            until: 3,
            eos: vec![unadjusted[0]],
        };
        let s = session(&model, &prompt, 0.0);
        let mut guard = s.lock().unwrap();
        (guard.penalties, guard.min_tokens) = (penalties, min_tokens.clone());
        guard.prompt_tokens = prompt_tokens.clone();
        guard.completion_from = prompt.len();
        drop(guard);
        let (call, rx) = job(&s, &prompt, 6);
        DraftHandler.run(&model, vec![call], &mut |_| Vec::new());
        let drafted = drained(rx).0;
        let probe = session(&model, &prompt, 0.0);
        let mut probe = probe.lock().unwrap();
        let (mut want, mut input) = (Vec::new(), prompt[3]);
        for _ in 0..6 {
            let logits = model
                .forward(&mut probe.cache, &[input], LogitsFor::Last)
                .unwrap();
            let row = Cow::Borrowed(logits.last().unwrap());
            let row = penalties.apply(row, &Counts::of(&want), &prompt_tokens);
            input = argmax(&min_tokens.apply(row, want.len())).unwrap();
            want.push(input);
        }
        assert_eq!(drafted, want);
        assert_ne!(drafted[0], unadjusted[0]);
    }

    /// A session's repetition penalty counts its prompt's tokens as seen: with a large one
    /// and the unpenalized first draft among them, the first draft is the penalized row's
    /// choice instead.
    #[test]
    fn the_repetition_penalty_counts_the_prompts_tokens() {
        use duet_engine::penalties::{Penalties, PromptTokens};
        let (_dir, model) = tiny();
        let prompt = [1, 2, 3, 4];
        let (plain, rx) = job(&session(&model, &prompt, 0.0), &prompt, 1);
        DraftHandler.run(&model, vec![plain], &mut |_| Vec::new());
        let unpenalized = drained(rx).0[0];
        let penalties = Penalties {
            repetition: 1e3,
            ..Penalties::default()
        };
        let seen = PromptTokens::of(&[unpenalized], &penalties);
        let s = session(&model, &prompt, 0.0);
        let mut guard = s.lock().unwrap();
        (guard.penalties, guard.prompt_tokens) = (penalties, seen.clone());
        guard.completion_from = prompt.len();
        drop(guard);
        let (call, rx) = job(&s, &prompt, 1);
        DraftHandler.run(&model, vec![call], &mut |_| Vec::new());
        let drafted = drained(rx).0[0];
        let probe = session(&model, &prompt, 0.0);
        let mut probe = probe.lock().unwrap();
        let logits = model
            .forward(&mut probe.cache, &[prompt[3]], LogitsFor::Last)
            .unwrap();
        let row = Cow::Borrowed(logits.last().unwrap());
        let want = argmax(&penalties.apply(row, &Counts::default(), &seen)).unwrap();
        assert_eq!(drafted, want);
        assert_ne!(drafted, unpenalized);
    }

    /// A sampling call draws each draft from its proposal (`proposal_distribution` of the
    /// row) at its session's next uniform, taken before the pass (so that a GPU can make
    /// the proposal), and sends that proposal as the draft's q: the drafts and q's a session
    /// of the same stream draws from the same rows.
    #[test]
    fn a_sampling_call_drafts_from_its_proposals_at_its_streams_draws() {
        let (_dir, model) = tiny();
        let prompt = [3, 14, 15, 92];
        let s = session(&model, &prompt, 1.0);
        let (call, mut rx) = job(&s, &prompt, 3);
        DraftHandler.run(&model, vec![call], &mut |_| Vec::new());
        let probe = session(&model, &prompt, 1.0);
        let mut probe = probe.lock().unwrap();
        let mut next = prompt[3];
        let mut distinct = std::collections::BTreeSet::new();
        while let Ok(drafted) = rx.try_recv() {
            let drafted = drafted.unwrap();
            let Session {
                cache,
                sampling,
                rng,
                ..
            } = &mut *probe;
            let logits = model.forward(cache, &[next], LogitsFor::Last).unwrap();
            let q = proposal_distribution(logits.last().unwrap(), sampling).unwrap();
            next = q.sample(rng);
            assert_eq!((drafted.token, drafted.q.as_ref()), (next, Some(&q)));
            distinct.insert(next);
        }
        assert_eq!(probe.cache.len(), prompt.len() + 2);
        assert!(distinct.len() > 1, "{distinct:?}");
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

    /// A call with `stop_below` drafts what it drafts without, up to the first token whose
    /// running product of probabilities falls below it, and its cache holds what a call of
    /// that many tokens leaves; at 1.0 every call (greedy or sampled) stops after one token.
    #[test]
    fn a_call_stops_where_its_drafts_joint_probability_runs_low() {
        let (_dir, model) = tiny();
        let prompt: &[u32] = &[3, 1, 4, 1, 5];
        let (whole, rx) = job(&session(&model, prompt, 0.0), prompt, 6);
        DraftHandler.run(&model, vec![whole], &mut |_| Vec::new());
        let all = drained(rx).0;
        // Each draft token's probability, fed as the call feeds them.
        let probe = session(&model, prompt, 0.0);
        let mut sure = Vec::new();
        let mut product = 1.0f32;
        let mut input = vec![prompt[prompt.len() - 1]];
        for &t in &all {
            let mut s = probe.lock().unwrap();
            let logits = model
                .forward(&mut s.cache, &input, LogitsFor::Last)
                .unwrap();
            let (token, p) =
                duet_engine::sampling::argmax_probability(logits.last().unwrap()).unwrap();
            assert_eq!(token, t);
            product *= p;
            sure.push(product);
            input = vec![t];
        }
        assert!(sure[1] > sure[2], "a token of probability 1: {sure:?}");
        let s = session(&model, prompt, 0.0);
        let (mut early, rx) = job(&s, prompt, 6);
        early.stop_below = (sure[1] + sure[2]) / 2.0;
        DraftHandler.run(&model, vec![early], &mut |_| Vec::new());
        let (tokens, timing) = drained(rx);
        assert_eq!(tokens, all[..3]);
        assert_eq!(timing.batch_rows, 3, "three passes of one row");
        assert_eq!(s.lock().unwrap().cache.len(), prompt.len() + 3 - 1);
        for temperature in [0.0, 1.0] {
            let s = session(&model, prompt, temperature);
            let (mut once, rx) = job(&s, prompt, 6);
            once.stop_below = 1.0;
            DraftHandler.run(&model, vec![once], &mut |_| Vec::new());
            assert_eq!(drained(rx).0.len(), 1, "temperature {temperature}");
            assert_eq!(s.lock().unwrap().cache.len(), prompt.len());
        }
    }

    /// Calls whose caller went away get no pass: one that left while queued leaves its
    /// session as it was, one that leaves after a pass gets no second pass, and the call
    /// beside them drafts what it drafts alone in passes of the calls still wanted.
    #[test]
    fn calls_whose_caller_left_get_no_more_passes() {
        let (_dir, model) = tiny();
        let prompts: [&[u32]; 3] = [&[1, 2, 3, 4], &[9, 8, 7], &[40, 41, 42]];
        let (alone, rx) = job(&session(&model, prompts[0], 0.0), prompts[0], 4);
        DraftHandler.run(&model, vec![alone], &mut |_| Vec::new());
        let alone = drained(rx).0;
        let sessions: Vec<_> = prompts.iter().map(|p| session(&model, p, 0.0)).collect();
        let (wanted, rx) = job(&sessions[0], prompts[0], 4);
        let (queued, gone) = job(&sessions[1], prompts[1], 4);
        drop(gone);
        let (leaving, leaves) = job(&sessions[2], prompts[2], 4);
        let mut leaves = Some(leaves);
        DraftHandler.run(&model, vec![wanted, queued, leaving], &mut |_| {
            // After the first pass the third caller goes away.
            leaves.take();
            Vec::new()
        });
        let (tokens, timing) = drained(rx);
        assert_eq!(tokens, alone);
        assert_eq!(timing.batch_calls, 2);
        // 1 + 1 rows in the first pass, then the wanted call's 3 alone.
        assert_eq!(timing.batch_rows, 5);
        let len = |i: usize| sessions[i].lock().unwrap().cache.len();
        assert_eq!(len(1), prompts[1].len() - 1, "never started");
        assert_eq!(len(2), prompts[2].len(), "one pass: its appended token");
    }
}
