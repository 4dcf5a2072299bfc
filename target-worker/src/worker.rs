//! The target model's work: one forward pass over `append ++ draft` per session, several
//! sessions per pass, returning the target's choice at each of the last K + 1 positions.

use duet_engine::logprobs::{TokenLogprobs, token_logprobs};
use duet_engine::penalties::Counts;
use duet_engine::sampling::{
    Distribution, Draw, DrawFrom, Excluded, SamplingError, argmax, process_logits, rng_at,
    rng_position,
};
use duet_engine::structured::{Mask, masked};
use duet_engine::verify::{Drafted, test_sampled};
use duet_engine::{Logits, LogitsFor, Model, SequenceInput};
use duet_worker_core::{
    CallTrace, Forward, Handler, More, Session, Timing, WorkerError, read_side_by_side,
};
use rayon::prelude::*;
use std::borrow::Cow;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;
use tokio::sync::oneshot;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// One Verify call, validated.
#[derive(Debug)]
pub struct VerifyJob {
    pub session: Arc<Mutex<Session>>,
    /// The worker numbers its calls as they arrive; a Decode call's steps share its number.
    pub call: u64,
    pub kind: Kind,
    pub keep: usize,
    pub append: Vec<u32>,
    pub draft: Vec<u32>,
    /// Empty: the drafts are a chain; else each draft's parent (`VerifyRequest.parents`).
    pub parents: Vec<u32>,
    /// A sampling session's chain tested here (`VerifyRequest.sampling_test`, or a Decode
    /// step's test of its lookup's drafts, each q a point mass).
    pub test: Option<Test>,
    pub reply: oneshot::Sender<Result<Verification, WorkerError>>,
    pub enqueued: Instant,
    /// Under a structured output, the mask of each verified position the constraint reads
    /// (set when the call's session is rewound, `constrain`); else empty.
    pub masks: Vec<Mask>,
    pub trace: CallTrace,
}

/// Which call a job serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Verify,
    /// A Decode call's first step. A sampling session's step draws its token at
    /// `rng_position` of the random stream of the session's seed
    /// (`DecodeRequest.rng_position`).
    DecodeFirst {
        rng_position: u64,
    },
    /// A Decode call's later step: skipped where a later call has run on the session since
    /// (its caller stopped reading the stream and went on).
    DecodeLater {
        rng_position: u64,
    },
}

impl Kind {
    /// Where a Decode step draws in the random stream (0 for a Verify, whose test says).
    pub fn rng_position(self) -> u64 {
        match self {
            Kind::Verify => 0,
            Kind::DecodeFirst { rng_position } | Kind::DecodeLater { rng_position } => rng_position,
        }
    }
}

/// What a sampling session's chain is tested with (`SamplingTest`): the draft's
/// probability of each draft, each draft's whole q where the test has them (given, or
/// the point masses on a lookup's drafts), and where the first draw comes in the random
/// stream of the session's seed.
#[derive(Debug, Clone, PartialEq)]
pub struct Test {
    pub q: Vec<f32>,
    pub whole: Option<Vec<Distribution>>,
    pub rng_position: u64,
}

/// The target's choice at the K + 1 verified positions.
#[derive(Debug, Clone, PartialEq)]
pub enum Choice {
    /// Greedy sessions: the argmax at each position.
    Argmax(Vec<u32>),
    /// Sampling sessions: the distribution at each position, with the session's sampling
    /// parameters applied.
    P(Vec<Distribution>),
    /// A sampling session's chain tested here (a Verify with a `Test`, or a Decode step:
    /// its lookup's drafts, or none): the drafts accepted, the token after them where it
    /// was drawn here or else p at the rejected draft (the correction needs the draft's
    /// whole q, which the test did not carry), and where the random stream then stands.
    Tested {
        accepted: usize,
        token: Option<u32>,
        p: Option<Distribution>,
        rng_position: u64,
    },
}

/// One Verify answer.
#[derive(Debug)]
pub struct Verification {
    pub choice: Choice,
    /// For a session that asks for them, the figures of each token the target chose
    /// (`VerifyResponse.logprobs`); else empty.
    pub logprobs: Vec<TokenLogprobs>,
    pub timing: Timing,
}

#[derive(Debug, Clone, Copy, Default)]
pub struct TargetHandler;

impl Handler for TargetHandler {
    type Job = VerifyJob;

    fn run(&mut self, model: &Model, mut jobs: Vec<VerifyJob>, _: More<'_, VerifyJob>) {
        // A call whose caller went away while it waited (deadline passed, request ended)
        // gets no rows in the pass; its session stays as it was.
        jobs.retain(|job| !job.reply.is_closed());
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
        match rewind(&mut job, &mut guard) {
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
    let trees: Vec<Vec<u32>> = ready.iter().map(|(j, _)| tree_parents(j)).collect();
    // Draws taken ahead serve only a pass that makes them where the rows are.
    let ahead = model.draws_where_rows_are();
    let drawings: Vec<Option<Drawing>> = (ready.iter())
        .map(|(j, g)| ahead.then(|| drawing(g, j)).flatten())
        .collect();
    let mut seqs: Vec<SequenceInput<'_>> = ready
        .iter_mut()
        .zip(&inputs)
        .zip(&trees)
        .zip(&drawings)
        .map(
            |((((job, guard), tokens), parents), drawing)| SequenceInput {
                // A greedy session reads each row's argmax alone (on a GPU, 12 bytes a row come
                // back instead of the vocabulary's logits), unless it wants their figures or
                // adjusts them.
                greedy: guard.sampling.is_greedy() && reads_choice_alone(guard),
                draws: drawing.as_ref().map_or(&[], |d| &d.draws),
                cache: &mut guard.cache,
                tokens,
                // Only the rows verification reads: the last appended token's and the drafts'.
                logits: LogitsFor::Tail(job.draft.len() + 1),
                extra: None,
                parents,
            },
        )
        .collect();
    let result = model.forward_batch(&mut seqs);
    drop(seqs);
    match result {
        Ok(all) => answer(ready, &all, (&inputs, &trees, &drawings), start, forwards),
        Err(e) => {
            drop(forwards);
            // Every call of the pass fails with the engine's own error.
            let e = WorkerError::from(e);
            for (job, _) in ready {
                let _ = job.reply.send(Err(e.clone()));
            }
        }
    }
}

/// Each call's tokens in the pass, its tree's parents and its draws taken ahead.
type CallInputs<'a> = (&'a [Vec<u32>], &'a [Vec<u32>], &'a [Option<Drawing>]);

/// Each call's choice from its rows of the pass's logits, then the replies, all at once.
/// Reading the answers (argmax or distributions over the vocabulary) is model time too:
/// it is measured with the pass (`start`), and the calls' forward spans end after it. Each
/// call reads its own rows, so the calls read side by side on the cores the pass used
/// where that pays (`read_side_by_side`).
fn answer(
    mut ready: Vec<(VerifyJob, MutexGuard<'_, Session>)>,
    all: &[Logits],
    (inputs, trees, drawings): CallInputs<'_>,
    start: Instant,
    forwards: Vec<Forward>,
) {
    let read = |(i, (job, guard)): (usize, &(VerifyJob, MutexGuard<'_, Session>))| {
        let choice = choice(guard, &all[i], job, drawings[i].as_ref())?;
        let logprobs = chosen_logprobs(guard, &all[i], job, &choice)?;
        Ok((choice, logprobs))
    };
    let choices: Vec<_> = match read_side_by_side(all) {
        true => ready.par_iter().enumerate().map(read).collect(),
        false => ready.iter().enumerate().map(read).collect(),
    };
    let forward = start.elapsed();
    drop(forwards);
    for ((job, guard), parents) in ready.iter_mut().zip(trees) {
        remember_tree(guard, job.append.len(), parents);
    }
    let rows: usize = inputs.iter().map(Vec::len).sum();
    let calls = ready.len();
    for (((job, _), choice), input) in ready.into_iter().zip(choices).zip(inputs) {
        let timing = Timing {
            queue: start.saturating_duration_since(job.enqueued),
            forward,
            batch_calls: calls,
            batch_rows: rows,
            share: forward.mul_f64(input.len() as f64 / rows as f64),
        };
        let _ = job
            .reply
            .send(choice.map(|(choice, logprobs)| Verification {
                choice,
                logprobs,
                timing,
            }));
    }
}

/// Cuts the session back to the call's `keep` and checks that the call fits. The rows of
/// a tree's path that the last call verified and this one's leading appended tokens take
/// (an accepted alternative) are kept, not computed again: they leave `append` for `keep`.
fn rewind(job: &mut VerifyJob, session: &mut Session) -> Result<(), WorkerError> {
    if matches!(job.kind, Kind::DecodeLater { .. }) && session.last_call > job.call {
        return Err(WorkerError::Superseded);
    }
    let counted = !session.penalties.is_none()
        || session.min_tokens.applies()
        || session.constraint.is_some();
    if counted && !job.parents.is_empty() {
        // A row's penalties, min_tokens and format read the drafts before it: a chain's,
        // in order.
        let why =
            "a session with penalties, min_tokens or a structured output verifies chains only";
        return Err(WorkerError::invalid("parents", why));
    }
    session.last_call = session.last_call.max(job.call);
    job.trace.rewound(session.cache.len(), job.keep);
    let reused = session.reuse_tree(job.keep, &job.append);
    job.keep += reused;
    job.append.drain(..reused);
    session.rewind(job.keep, job.append.len(), job.draft.len())?;
    constrain(job, session)
}

/// Under a structured output, the masks of the call's verified positions: the first after
/// the completion so far (the session's tokens after its prompt, then the appended ones),
/// one after each draft up to the first the format does not allow.
fn constrain(job: &mut VerifyJob, session: &mut Session) -> Result<(), WorkerError> {
    let Some(constraint) = session.constraint.as_mut() else {
        return Ok(());
    };
    // The completion's tokens alone: those the cache holds after the prompt, then the
    // appended ones after it (the first call appends the prompt's last token).
    let (held, from) = (session.cache.tokens(), session.completion_from);
    let appended = &job.append[from.saturating_sub(held.len()).min(job.append.len())..];
    let so_far: Vec<u32> = held
        .get(from..)
        .unwrap_or_default()
        .iter()
        .chain(appended)
        .copied()
        .collect();
    job.masks = constraint
        .masks(&so_far, &job.draft)
        .map_err(WorkerError::of_format)?;
    Ok(())
}

/// The pass's parents for `append ++ draft` (`SequenceInput::parents`): the appended
/// tokens in a row, then each draft after its parent (0: the last appended token). Empty
/// for a chain.
fn tree_parents(job: &VerifyJob) -> Vec<u32> {
    if job.parents.is_empty() {
        return Vec::new();
    }
    let last = job.append.len() as u32 - 1;
    let appended = (0..=last).map(|i| i.saturating_sub(1));
    appended
        .chain(job.parents.iter().map(|&p| last + p))
        .collect()
}

/// After a tree's pass, each draft's cache row and its parent's, for the next call.
fn remember_tree(session: &mut Session, appended: usize, parents: &[u32]) {
    let first = session.cache.len() - parents.len();
    session.tree = parents
        .iter()
        .enumerate()
        .skip(appended)
        .map(|(i, &p)| (first + i, first + p as usize))
        .collect();
}

/// For a session with penalties, a logit bias, `min_tokens` or a structured output, each
/// verified position's logits so adjusted: biased, penalized by its completion so far (the
/// session's tokens after its prompt, up to that position: the committed ones and the
/// drafts before it, a chain's, which the pass has fed) and its prompt, without
/// end-of-sequence tokens while that completion is short of `min_tokens`, and without the
/// tokens the format does not allow there (`masks`; a position past them is never read).
/// `None` without any.
fn adjusted_rows<'a>(
    session: &Session,
    logits: &'a Logits,
    drafts: usize,
    masks: &[Mask],
) -> Option<Vec<Cow<'a, [f32]>>> {
    if !adjusts_rows(session) {
        return None;
    }
    let tokens = session.cache.tokens();
    // The first verified position's completion so far ends with the last appended token.
    let end = tokens.len() - drafts;
    // Only penalties count the tokens themselves.
    let counting = !session.penalties.is_none();
    let so_far = &tokens[session.completion_from.min(end)..end];
    let mut counts = Counts::of(if counting { so_far } else { &[] });
    let first = logits.rows() - (drafts + 1);
    let rows = (0..=drafts).map(|i| {
        if i > 0 && counting {
            counts.add(tokens[end + i - 1]);
        }
        let biased = session
            .logit_bias
            .apply(Cow::Borrowed(logits.row(first + i)));
        let penalized = session
            .penalties
            .apply(biased, &counts, &session.prompt_tokens);
        let adjusted = session.min_tokens.apply(penalized, so_far.len() + i);
        match masks.get(i) {
            Some(mask) => masked(mask, adjusted),
            None => adjusted,
        }
    });
    Some(rows.collect())
}

/// For a session that asks for them, the figures of each token the target chose, from the
/// first verified position: every argmax; a tested chain's accepted drafts and the token
/// drawn after them (none past a rejected draft whose correction the caller draws); none
/// beside distributions alone.
fn chosen_logprobs(
    session: &Session,
    logits: &Logits,
    job: &VerifyJob,
    choice: &Choice,
) -> Result<Vec<TokenLogprobs>, WorkerError> {
    let Some(top) = session.logprobs else {
        return Ok(Vec::new());
    };
    let chosen: Vec<u32> = match choice {
        Choice::Argmax(argmax) => argmax.clone(),
        Choice::Tested {
            accepted, token, ..
        } => job.draft[..*accepted]
            .iter()
            .copied()
            .chain(*token)
            .collect(),
        Choice::P(_) => Vec::new(),
    };
    let first = logits.rows() - (job.draft.len() + 1);
    let of = |(i, &token): (usize, &u32)| {
        token_logprobs(logits.row(first + i), token, top)
            .map_err(|e| WorkerError::invalid("logits", e.to_string()))
    };
    chosen.iter().enumerate().map(of).collect()
}

/// Whether something adjusts the session's rows before its choice: penalties, a bias,
/// `min_tokens` or a format ([`adjusted_rows`]).
fn adjusts_rows(session: &Session) -> bool {
    !session.penalties.is_none()
        || !session.logit_bias.is_empty()
        || session.min_tokens.applies()
        || session.constraint.is_some()
}

/// Whether the session reads a row for its choice alone: it asks for no figures of it and
/// nothing adjusts it.
fn reads_choice_alone(session: &Session) -> bool {
    session.logprobs.is_none() && !adjusts_rows(session)
}

/// A sampling call's draws taken before its pass, so that the pass can make them where the
/// rows are ([`SequenceInput::draws`]): a Decode step's one draw, or a chain of drafts
/// tested as `test_sampled` tests them with each draft's whole q: the test's uniform for
/// each draft (`tests`) and q's probability of it (`drafted`: 1 for a lookup's point
/// mass), each draft's row drawn after it at the uniform after its test (its correction,
/// from the residual after q), the last row at the uniform after the last test (the bonus).
#[derive(Debug)]
struct Drawing {
    draws: Vec<Draw>,
    tests: Vec<f64>,
    drafted: Vec<f32>,
    /// Where the draws start in the seed's random stream.
    start: u64,
}

/// The draws of a call that reads its rows for the tokens drawn from them alone: a sampling
/// session's Decode step, or its Verify of a chain with a `Test` holding each draft's
/// whole q (a lookup's point masses, a draft model's proposals).
fn drawing(session: &Session, job: &VerifyJob) -> Option<Drawing> {
    if session.sampling.is_greedy() || !reads_choice_alone(session) {
        return None;
    }
    let (start, drafted) = match (job.kind, &job.test) {
        (Kind::DecodeFirst { rng_position } | Kind::DecodeLater { rng_position }, None)
            if job.draft.is_empty() =>
        {
            (rng_position, &[][..])
        }
        // A Verify's test, or a Decode step's of its lookup's drafts.
        (_, Some(t)) if job.parents.is_empty() => (t.rng_position, whole_qs(t, &job.draft)?),
        _ => return None,
    };
    let mut rng = rng_at(session.sampling.seed, start);
    let k = job.draft.len();
    let uniforms: Vec<f64> = (0..=k)
        .map(|_| Draw::new(session.sampling, &mut rng).uniform)
        .collect();
    let excluded = |(&token, q): (&u32, &Distribution)| Excluded {
        token,
        // A point mass goes as itself: the GPU takes it without a copy.
        from: (q.ids() != [token]).then(|| Arc::new(q.clone())),
    };
    let mut excludes = job.draft.iter().zip(drafted).map(excluded);
    let draws = (0..=k).map(|i| Draw {
        params: session.sampling,
        uniform: uniforms[(i + 1).min(k)],
        from: excludes.next().map_or(DrawFrom::Row, DrawFrom::After),
    });
    Some(Drawing {
        draws: draws.collect(),
        tests: uniforms[..k].to_vec(),
        drafted: job
            .draft
            .iter()
            .zip(drafted)
            .map(|(&x, q)| q.prob(x))
            .collect(),
        start,
    })
}

/// A test's whole q of each draft, where it holds them.
fn whole_qs<'t>(test: &'t Test, draft: &[u32]) -> Option<&'t [Distribution]> {
    let whole = test.whole.as_deref()?;
    (whole.len() == draft.len()).then_some(whole)
}

/// The choice `test_sampled` makes with whole q's, from the rows' draws: each draft
/// accepted where its test's uniform times its q falls under its probability, the first
/// rejected one's correction, else the bonus token; the stream's place after them (a
/// uniform, two words, for each test made and one for the token).
fn drawn_choice(logits: &Logits, d: &Drawing) -> Result<Choice, SamplingError> {
    let tested = |accepted: usize, token: u32| {
        let tests = d.tests.len().min(accepted + 1) as u64;
        Choice::Tested {
            accepted,
            token: Some(token),
            p: None,
            rng_position: d.start + 2 * (tests + 1),
        }
    };
    for (i, (&uniform, &q)) in d.tests.iter().zip(&d.drafted).enumerate() {
        let row = logits.drawn(i, &d.draws[i])?;
        if uniform * f64::from(q) >= f64::from(row.excluded) {
            return Ok(tested(i, row.token));
        }
    }
    let k = d.tests.len();
    Ok(tested(k, logits.drawn(k, &d.draws[k])?.token))
}

/// The target's choice at the job's last `k + 1` positions: argmaxes when greedy, else p;
/// for a sampling session's chain with a `Test` and a Decode step (no drafts), the
/// acceptance tests and the draws the caller would make, at the job's place in the seed's
/// random stream, with p computed only for the positions the tests reach; where the pass
/// made the draws taken before it (`drawing`) where the rows are (a GPU's), the choice
/// their tokens make. Rows that came back whole are read as above: drawing from each would
/// build every tested position's correction too, where the tests need only p.
fn choice(
    session: &Session,
    logits: &Logits,
    job: &VerifyJob,
    drawing: Option<&Drawing>,
) -> Result<Choice, WorkerError> {
    let bad = |e: SamplingError| WorkerError::invalid("sampling", e.to_string());
    if let Some(d) = drawing.filter(|_| logits.summarized()) {
        return drawn_choice(logits, d).map_err(bad);
    }
    let first = logits.rows() - (job.draft.len() + 1);
    let adjusted = adjusted_rows(session, logits, job.draft.len(), &job.masks);
    let row = |i: usize| match &adjusted {
        Some(rows) => &rows[i][..],
        None => logits.row(first + i),
    };
    if session.sampling.is_greedy() {
        let argmax = |i: usize| match &adjusted {
            Some(_) => argmax(row(i)),
            None => logits.greedy_token(first + i),
        };
        return Ok(Choice::Argmax(
            (0..=job.draft.len())
                .map(argmax)
                .collect::<Result<_, _>>()
                .map_err(bad)?,
        ));
    }
    let p = |i: usize| process_logits(row(i), &session.sampling).map_err(bad);
    let (drafted, at) = match (job.kind, &job.test) {
        (Kind::Verify, None) => {
            let all = (0..=job.draft.len()).map(p).collect::<Result<_, _>>()?;
            return Ok(Choice::P(all));
        }
        // A Verify's test, or a Decode step's of its lookup's drafts (point masses).
        (_, Some(t)) => match &t.whole {
            Some(q) => (Drafted::Whole(q), t.rng_position),
            None => (Drafted::Probabilities(&t.q), t.rng_position),
        },
        (Kind::DecodeFirst { rng_position } | Kind::DecodeLater { rng_position }, None) => {
            (Drafted::Probabilities(&[]), rng_position)
        }
    };
    let mut rng = rng_at(session.sampling.seed, at);
    let lazily = |i| p(i).map(Cow::Owned);
    let (tested, last) = test_sampled(&job.draft, drafted, lazily, &mut rng)?;
    Ok(Choice::Tested {
        accepted: tested.accepted,
        token: tested.token,
        p: tested.token.is_none().then(|| last.into_owned()),
        rng_position: rng_position(&rng),
    })
}

#[cfg(test)]
mod tests;
