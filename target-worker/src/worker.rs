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
    /// A sampling session's chain tested here (`VerifyRequest.sampling_test`).
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
    /// A sampling session's chain tested here (a Verify with a `Test`, or a Decode step,
    /// which has no drafts): the drafts accepted, the token after them where it was drawn
    /// here or else p at the rejected draft (the correction needs the draft's whole q,
    /// which the test did not carry), and where the random stream then stands.
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
        (Kind::DecodeFirst { rng_position } | Kind::DecodeLater { rng_position }, _)
            if job.draft.is_empty() =>
        {
            (rng_position, &[][..])
        }
        (Kind::Verify, Some(t)) if job.parents.is_empty() => {
            (t.rng_position, whole_qs(t, &job.draft)?)
        }
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
        (Kind::Verify, Some(t)) => match &t.whole {
            Some(q) => (Drafted::Whole(q), t.rng_position),
            None => (Drafted::Probabilities(&t.q), t.rng_position),
        },
        (Kind::DecodeFirst { rng_position } | Kind::DecodeLater { rng_position }, _) => {
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
mod tests {
    use super::*;
    use duet_engine::sampling::{SamplingParams, rng_for};
    use duet_engine::testing::TinyModel;
    use duet_engine::verify::verify_sampling_tree;
    use duet_engine::{LoadOptions, Model};

    fn tiny_model(dir: &tempfile::TempDir) -> Model {
        let path = dir.path().join("target.gguf");
        TinyModel::default().write(&path).unwrap();
        Model::load(&path, &LoadOptions::default()).unwrap()
    }

    const PROMPT: [u32; 4] = [1, 2, 3, 4];

    fn session(model: &Model) -> Arc<Mutex<Session>> {
        let mut cache = model.new_cache(64).unwrap();
        model.prefill(&mut cache, &PROMPT, LogitsFor::None).unwrap();
        Arc::new(Mutex::new(Session {
            cache,
            sampling: SamplingParams::greedy(),
            rng: rng_for(0),
            extra: Default::default(),
            tree: Vec::new(),
            last_call: 0,
            logprobs: None,
            penalties: Default::default(),
            completion_from: PROMPT.len(),
            prompt_tokens: Default::default(),
            logit_bias: Default::default(),
            min_tokens: Default::default(),
            constraint: None,
            cache_salt: 0,
            prefilled: 0,
        }))
    }

    /// A job of call `call` on `session` appending `append` and verifying `draft`.
    fn job(
        session: &Arc<Mutex<Session>>,
        (call, kind): (u64, Kind),
        keep: usize,
        append: Vec<u32>,
        draft: Vec<u32>,
    ) -> (
        VerifyJob,
        oneshot::Receiver<Result<Verification, WorkerError>>,
    ) {
        let (reply, rx) = oneshot::channel();
        let job = VerifyJob {
            session: session.clone(),
            call,
            kind,
            keep,
            append,
            draft,
            parents: Vec::new(),
            test: None,
            reply,
            enqueued: Instant::now(),
            masks: Vec::new(),
            trace: CallTrace::queued(tracing::Span::none()),
        };
        (job, rx)
    }

    /// A call whose caller left while it waited gets no rows: its session's cache is as it
    /// was, and the pass holds only the call still wanted.
    #[test]
    fn a_call_whose_caller_left_gets_no_rows() {
        let dir = tempfile::tempdir().unwrap();
        let model = tiny_model(&dir);
        let (wanted, left) = (session(&model), session(&model));
        let n = PROMPT.len();
        let (call, mut answer) = job(&wanted, (1, Kind::Verify), n, vec![5], vec![6, 7]);
        let (gone, rx) = job(&left, (1, Kind::Verify), n, vec![5], vec![6, 7]);
        drop(rx);
        TargetHandler.run(&model, vec![gone, call], &mut |_| Vec::new());
        let answer = answer.try_recv().unwrap().unwrap();
        assert_eq!(
            (answer.timing.batch_calls, answer.timing.batch_rows),
            (1, 3)
        );
        assert_eq!(wanted.lock().unwrap().cache.len(), n + 3);
        assert_eq!(left.lock().unwrap().cache.len(), n);
    }

    /// A Decode stream's step queued after a later call on its session (its caller stopped
    /// reading and went on) gives way: the cache stays as the later call left it. The
    /// steps of a later Decode run.
    #[test]
    fn a_streams_step_gives_way_to_a_later_call() {
        use Kind::Verify;
        let (starts, goes_on) = (
            Kind::DecodeFirst { rng_position: 0 },
            Kind::DecodeLater { rng_position: 0 },
        );
        let dir = tempfile::tempdir().unwrap();
        let model = tiny_model(&dir);
        let s = session(&model);
        let n = PROMPT.len();
        let (first, _f) = job(&s, (1, starts), n, vec![5], vec![]);
        let (verify, mut v) = job(&s, (2, Verify), n, vec![5], vec![6]);
        let (stale, mut st) = job(&s, (1, goes_on), n + 1, vec![9], vec![]);
        let (again, mut a) = job(&s, (3, starts), n + 2, vec![7], vec![]);
        let (on, mut o) = job(&s, (3, goes_on), n + 3, vec![8], vec![]);
        for j in [first, verify, stale, again, on] {
            TargetHandler.run(&model, vec![j], &mut |_| Vec::new());
        }
        let argmax = v.try_recv().unwrap().unwrap().choice;
        assert!(
            matches!(&argmax, Choice::Argmax(a) if a.len() == 2),
            "{argmax:?}"
        );
        let superseded = st.try_recv().unwrap().unwrap_err();
        assert!(
            matches!(superseded, WorkerError::Superseded),
            "{superseded:?}"
        );
        assert!(a.try_recv().unwrap().is_ok() && o.try_recv().unwrap().is_ok());
        assert_eq!(s.lock().unwrap().cache.tokens(), [1, 2, 3, 4, 5, 6, 7, 8]);
    }

    /// A sampling session's Decode step draws its token from the distribution a Verify
    /// answers for the same position, where the caller would draw it: rejection sampling
    /// without drafts, at the step's place in the seed's random stream (one 64-bit draw, two
    /// words on). Other places draw other tokens.
    #[test]
    fn a_sampling_sessions_step_draws_where_the_caller_would() {
        let dir = tempfile::tempdir().unwrap();
        let model = tiny_model(&dir);
        let n = PROMPT.len();
        let sampling = |s: &Arc<Mutex<Session>>| {
            let mut s = s.lock().unwrap();
            s.sampling.temperature = 1.5;
            s.sampling.seed = 11;
        };
        let (verified, stepped) = (session(&model), session(&model));
        sampling(&verified);
        sampling(&stepped);
        let (verify, mut v) = job(&verified, (1, Kind::Verify), n, vec![5], vec![]);
        TargetHandler.run(&model, vec![verify], &mut |_| Vec::new());
        let Choice::P(p) = v.try_recv().unwrap().unwrap().choice else {
            panic!("a sampling session's Verify answers p");
        };
        let mut tokens = std::collections::BTreeSet::new();
        for at in (0..40).step_by(2) {
            let first = Kind::DecodeFirst { rng_position: at };
            let (step, mut d) = job(&stepped, (2, first), n, vec![5], vec![]);
            TargetHandler.run(&model, vec![step], &mut |_| Vec::new());
            let mut rng = rng_at(11, at);
            let (_, expected) = verify_sampling_tree(&[], &[], &[], &p, &mut rng).unwrap();
            let answer = d.try_recv().unwrap().unwrap().choice;
            let sampled = Choice::Tested {
                accepted: 0,
                token: Some(expected),
                p: None,
                rng_position: at + 2,
            };
            assert_eq!(answer, sampled, "at {at}");
            tokens.insert(expected);
        }
        assert!(tokens.len() > 1, "{tokens:?}");
    }

    /// Draws are taken before a pass (so that a GPU can make them) only where their tokens
    /// are all a call reads: a sampling session's Decode step, or its Verify of a chain
    /// under a test with each draft's whole q, with nothing asked of the rows or adjusting
    /// them; from the call's place in the stream, a uniform (two words) a row.
    #[test]
    fn draws_are_taken_ahead_only_where_their_tokens_are_all_a_call_reads() {
        let dir = tempfile::tempdir().unwrap();
        let model = tiny_model(&dir);
        let s = session(&model);
        let step = Kind::DecodeLater { rng_position: 6 };
        let (decode, _d) = job(&s, (1, step), PROMPT.len(), vec![5], vec![]);
        let (mut verify, _v) = job(&s, (1, Kind::Verify), PROMPT.len(), vec![5], vec![8, 9]);
        let drawn = |s: &Arc<Mutex<Session>>, job: &VerifyJob| drawing(&s.lock().unwrap(), job);
        assert!(drawn(&s, &decode).is_none(), "greedy");
        s.lock().unwrap().sampling.temperature = 0.8;
        let d = drawn(&s, &decode).unwrap();
        let mut rng = rng_at(0, 6);
        assert_eq!(d.draws, [Draw::new(s.lock().unwrap().sampling, &mut rng)]);
        assert_eq!((d.tests.len(), d.start), (0, 6));
        assert!(
            drawn(&s, &verify).is_none(),
            "a Verify without a test answers p"
        );
        let test = |whole: Vec<Distribution>| Test {
            q: vec![1.0; 2],
            whole: Some(whole),
            rng_position: 10,
        };
        verify.test = Some(test(vec![Distribution::point(8), Distribution::point(9)]));
        let d = drawn(&s, &verify).unwrap();
        let mut rng = rng_at(0, 10);
        let u: Vec<f64> = (0..3)
            .map(|_| Draw::new(d.draws[0].params, &mut rng).uniform)
            .collect();
        assert_eq!((d.tests.as_slice(), d.start), (&u[..2], 10));
        let made: Vec<_> = d
            .draws
            .iter()
            .map(|d| (d.uniform, d.excluded().cloned()))
            .collect();
        let point = |x| Some(Excluded::point(x));
        assert_eq!(made, [(u[1], point(8)), (u[2], point(9)), (u[2], None)]);
        assert_eq!(d.drafted, [1.0, 1.0]);
        // A draft model's q goes with its draft's correction.
        let spread = Arc::new(Distribution::from_pairs([(8, 0.25), (7, 0.75)]).unwrap());
        verify.test = Some(test(vec![(*spread).clone(), Distribution::point(9)]));
        let d = drawn(&s, &verify).unwrap();
        let from = Some(spread);
        assert_eq!(
            d.draws[0].excluded().cloned(),
            Some(Excluded { token: 8, from })
        );
        assert_eq!(
            (&d.draws[1].excluded().cloned(), &d.drafted[..]),
            (&point(9), &[0.25, 1.0][..])
        );
        verify.test.as_mut().unwrap().whole = None;
        assert!(drawn(&s, &verify).is_none(), "q's probabilities alone");
        s.lock().unwrap().logprobs = Some(2);
        assert!(drawn(&s, &decode).is_none(), "figures read the row");
        s.lock().unwrap().logprobs = None;
        s.lock().unwrap().logit_bias = duet_engine::bias::LogitBias::new([(3, 1.0)]);
        assert!(drawn(&s, &decode).is_none(), "a bias adjusts the row");
    }

    /// A chain tested from the draws taken ahead (here made from whole rows, as a GPU makes
    /// them) chooses what the test of whole rows chooses (`test_sampled`): the same drafts
    /// accepted, the same token after them, the stream left at the same place, for every
    /// seed and place tried, a lookup's drafts (point masses) and a draft model's (each
    /// drawn from a distribution of its own).
    #[test]
    fn a_chain_drawn_ahead_is_tested_as_from_whole_rows() {
        let dir = tempfile::tempdir().unwrap();
        let model = tiny_model(&dir);
        let s = session(&model);
        // Drafts the model is likely to accept: its own greedy continuation.
        let mut fed = vec![5];
        for _ in 0..3 {
            let last = prefilled_rows(&model, &fed, 1);
            fed.push(argmax(last.row(0)).unwrap());
        }
        let logits = prefilled_rows(&model, &fed, 4);
        // A draft model's q's: most of their mass on its draft, the rest on its neighbours.
        let vocab = model.config().vocab as u32;
        let near = |x: u32| [(x, 0.8), ((x + 1) % vocab, 0.15), ((x + 2) % vocab, 0.05)];
        let qs: Vec<Distribution> = (fed[1..].iter())
            .map(|&x| Distribution::from_pairs(near(x)).unwrap())
            .collect();
        let points: Vec<Distribution> = fed[1..].iter().map(|&x| Distribution::point(x)).collect();
        let mut outcomes = std::collections::BTreeSet::new();
        for (seed, at) in (0..48).map(|i| (i % 12, 2 * (i / 12))) {
            let mut guard = s.lock().unwrap();
            guard.sampling.temperature = 0.4;
            guard.sampling.seed = seed;
            drop(guard);
            for whole in [&points, &qs] {
                let draft = fed[1..].to_vec();
                let (mut verify, _v) =
                    job(&s, (1, Kind::Verify), PROMPT.len(), vec![5], draft.clone());
                verify.test = Some(Test {
                    q: draft.iter().zip(whole).map(|(&x, q)| q.prob(x)).collect(),
                    whole: Some(whole.clone()),
                    rng_position: at,
                });
                let session = s.lock().unwrap();
                let d = drawing(&session, &verify).unwrap();
                let ahead = drawn_choice(&logits, &d).unwrap();
                assert_eq!(ahead, choice(&session, &logits, &verify, None).unwrap());
                if let Choice::Tested { accepted, .. } = ahead {
                    outcomes.insert((whole == &qs, accepted));
                }
            }
        }
        // Both kinds of draft accepted and rejected at some place.
        let kinds = |draft_model| outcomes.iter().filter(|o| o.0 == draft_model).count();
        assert!(kinds(false) > 1 && kinds(true) > 1, "{outcomes:?}");
    }

    /// The rows' logits of `tokens` fed after the prompt in one prefill, the last `rows`.
    fn prefilled_rows(model: &Model, tokens: &[u32], rows: usize) -> Logits {
        let mut cache = model.new_cache(64).unwrap();
        let all: Vec<u32> = PROMPT.iter().chain(tokens).copied().collect();
        model
            .prefill(&mut cache, &all, LogitsFor::Tail(rows))
            .unwrap()
    }

    /// A session that asks for them gets each argmax's log-softmax and the most likely
    /// tokens' (the argmax first), the figures of the same rows fed any other way.
    #[test]
    fn a_greedy_sessions_answer_carries_each_argmaxs_figures() {
        let dir = tempfile::tempdir().unwrap();
        let model = tiny_model(&dir);
        let s = session(&model);
        s.lock().unwrap().logprobs = Some(3);
        let (call, mut answer) = job(&s, (1, Kind::Verify), PROMPT.len(), vec![5], vec![6, 7]);
        TargetHandler.run(&model, vec![call], &mut |_| Vec::new());
        let answer = answer.try_recv().unwrap().unwrap();
        let Choice::Argmax(argmax) = &answer.choice else {
            panic!("a greedy session's Verify answers argmaxes");
        };
        let rows = prefilled_rows(&model, &[5, 6, 7], 3);
        assert_eq!(answer.logprobs.len(), 3);
        for (i, (l, &token)) in answer.logprobs.iter().zip(argmax).enumerate() {
            assert_eq!(
                *l,
                token_logprobs(rows.row(i), token, 3).unwrap(),
                "row {i}"
            );
            assert_eq!(l.top[0], (token, l.logprob));
            assert!(l.logprob < 0.0 && l.top.len() == 3);
        }
    }

    /// A sampling session's Decode step answers the figures of the token it drew; a
    /// session that does not ask gets none.
    #[test]
    fn a_drawn_token_comes_with_its_figures_where_asked() {
        let dir = tempfile::tempdir().unwrap();
        let model = tiny_model(&dir);
        let rows = prefilled_rows(&model, &[5], 1);
        for logprobs in [Some(0), None] {
            let s = session(&model);
            {
                let mut s = s.lock().unwrap();
                (s.sampling.temperature, s.logprobs) = (0.8, logprobs);
            }
            let first = Kind::DecodeFirst { rng_position: 0 };
            let (step, mut d) = job(&s, (1, first), PROMPT.len(), vec![5], vec![]);
            TargetHandler.run(&model, vec![step], &mut |_| Vec::new());
            let answer = d.try_recv().unwrap().unwrap();
            let Choice::Tested {
                token: Some(token), ..
            } = answer.choice
            else {
                panic!("a sampling session's step draws its token");
            };
            let expected = logprobs.map(|_| token_logprobs(rows.row(0), token, 0).unwrap());
            assert_eq!(answer.logprobs, Vec::from_iter(expected));
        }
    }

    /// A session with penalties chooses from each position's logits penalized by its own
    /// completion so far (the appended token, then each draft before it) and its prompt:
    /// with a large negative presence penalty every choice is a token already in it.
    #[test]
    fn penalties_count_each_positions_own_completion_so_far() {
        use duet_engine::penalties::{Penalties, PromptTokens};
        let dir = tempfile::tempdir().unwrap();
        let model = tiny_model(&dir);
        let s = session(&model);
        let penalties = Penalties {
            presence: -100.0,
            frequency: 0.5,
            repetition: 1.5,
        };
        let prompt = PromptTokens::of(&PROMPT, &penalties);
        let mut guard = s.lock().unwrap();
        (guard.penalties, guard.prompt_tokens) = (penalties, prompt.clone());
        drop(guard);
        let (call, mut answer) = job(&s, (1, Kind::Verify), PROMPT.len(), vec![5], vec![6, 5]);
        TargetHandler.run(&model, vec![call], &mut |_| Vec::new());
        let Choice::Argmax(chosen) = answer.try_recv().unwrap().unwrap().choice else {
            panic!("a greedy session's Verify answers argmaxes");
        };
        let rows = prefilled_rows(&model, &[5, 6, 5], 3);
        let so_far = [5, 6, 5];
        for (i, &token) in chosen.iter().enumerate() {
            let history = &so_far[..=i];
            let row = penalties.apply(Cow::Borrowed(rows.row(i)), &Counts::of(history), &prompt);
            assert_eq!(token, argmax(&row).unwrap(), "position {i}");
            assert!(history.contains(&token), "position {i}: {token}");
        }
    }

    /// The repetition penalty counts the session's prompt tokens as seen: where they hold
    /// a position's unpenalized choice, a large penalty moves it to another token, the one
    /// the penalized row gives.
    #[test]
    fn the_repetition_penalty_counts_the_prompts_tokens() {
        use duet_engine::penalties::{Penalties, PromptTokens};
        let dir = tempfile::tempdir().unwrap();
        let model = tiny_model(&dir);
        let rows = prefilled_rows(&model, &[5, 6], 2);
        let unpenalized = [argmax(rows.row(0)).unwrap(), argmax(rows.row(1)).unwrap()];
        let penalties = Penalties {
            repetition: 1e3,
            ..Penalties::default()
        };
        let prompt = PromptTokens::of(&unpenalized, &penalties);
        let s = session(&model);
        let mut guard = s.lock().unwrap();
        (guard.penalties, guard.prompt_tokens) = (penalties, prompt.clone());
        drop(guard);
        let (call, mut answer) = job(&s, (1, Kind::Verify), PROMPT.len(), vec![5], vec![6]);
        TargetHandler.run(&model, vec![call], &mut |_| Vec::new());
        let Choice::Argmax(chosen) = answer.try_recv().unwrap().unwrap().choice else {
            panic!("a greedy session's Verify answers argmaxes");
        };
        for (i, so_far) in [&[5][..], &[5, 6]].into_iter().enumerate() {
            let row = Cow::Borrowed(rows.row(i));
            let want = argmax(&penalties.apply(row, &Counts::of(so_far), &prompt)).unwrap();
            assert_eq!(chosen[i], want, "position {i}");
            assert!(!unpenalized.contains(&chosen[i]), "position {i}");
        }
    }

    /// A session whose rows count the drafts before them (penalties, `min_tokens`) refuses
    /// a tree, and its cache stays as it was; a chain goes through.
    #[test]
    fn a_counted_session_verifies_chains_only() {
        use duet_engine::penalties::{MinTokens, Penalties};
        let dir = tempfile::tempdir().unwrap();
        let model = tiny_model(&dir);
        let penalized = session(&model);
        penalized.lock().unwrap().penalties = Penalties {
            presence: 0.5,
            ..Penalties::default()
        };
        let held = session(&model);
        held.lock().unwrap().min_tokens = MinTokens {
            until: 4,
            eos: vec![1],
        };
        for s in [&penalized, &held] {
            let (mut tree, mut refused) =
                job(s, (1, Kind::Verify), PROMPT.len(), vec![5], vec![6, 7]);
            tree.parents = vec![0, 0];
            let (chain, mut answered) =
                job(s, (2, Kind::Verify), PROMPT.len(), vec![5], vec![6, 7]);
            TargetHandler.run(&model, vec![tree], &mut |_| Vec::new());
            let e = refused.try_recv().unwrap().unwrap_err();
            let why = "parents: a session with penalties, min_tokens or a structured output \
                verifies chains only";
            assert_eq!(e.to_string(), why);
            assert_eq!(s.lock().unwrap().cache.len(), PROMPT.len());
            TargetHandler.run(&model, vec![chain], &mut |_| Vec::new());
            assert!(answered.try_recv().unwrap().is_ok());
        }
    }

    /// A session with `min_tokens` chooses no end-of-sequence token at a position whose
    /// completion so far (the appended token, then the drafts before it) is shorter: here
    /// the first position's (one token so far) loses its choice, the second's (two) keeps it.
    #[test]
    fn min_tokens_hold_back_the_end_where_the_completion_is_short() {
        use duet_engine::penalties::MinTokens;
        let dir = tempfile::tempdir().unwrap();
        let model = tiny_model(&dir);
        let rows = prefilled_rows(&model, &[5, 6, 5], 3);
        let unheld: Vec<u32> = (0..3).map(|i| argmax(rows.row(i)).unwrap()).collect();
        let s = session(&model);
        let min_tokens = MinTokens {
            until: 2,
            eos: unheld[..2].to_vec(),
        };
        s.lock().unwrap().min_tokens = min_tokens.clone();
        let (call, mut answer) = job(&s, (1, Kind::Verify), PROMPT.len(), vec![5], vec![6, 5]);
        TargetHandler.run(&model, vec![call], &mut |_| Vec::new());
        let Choice::Argmax(chosen) = answer.try_recv().unwrap().unwrap().choice else {
            panic!("a greedy session's Verify answers argmaxes");
        };
        let held = min_tokens.apply(Cow::Borrowed(rows.row(0)), 1);
        assert_eq!(chosen, [argmax(&held).unwrap(), unheld[1], unheld[2]]);
        assert_ne!(chosen[0], unheld[0]);
    }

    /// A biased session chooses from each row with the bias added: a chain's positions, and
    /// a tree's nodes alike (a bias does not depend on the position).
    #[test]
    fn a_logit_bias_is_added_to_every_row_before_the_choice() {
        use duet_engine::bias::LogitBias;
        let dir = tempfile::tempdir().unwrap();
        let model = tiny_model(&dir);
        let rows = prefilled_rows(&model, &[5, 6, 5], 3);
        let unbiased = argmax(rows.row(0)).unwrap();
        // The unbiased first choice banned, another token raised a little.
        let bias = LogitBias::new([(unbiased, -100.0), (9, 1.5)]);
        let s = session(&model);
        s.lock().unwrap().logit_bias = bias.clone();
        let (call, mut answer) = job(&s, (1, Kind::Verify), PROMPT.len(), vec![5], vec![6, 5]);
        TargetHandler.run(&model, vec![call], &mut |_| Vec::new());
        let Choice::Argmax(chosen) = answer.try_recv().unwrap().unwrap().choice else {
            panic!("a greedy session's Verify answers argmaxes");
        };
        let want: Vec<u32> = (0..3)
            .map(|i| argmax(&bias.apply(Cow::Borrowed(rows.row(i)))).unwrap())
            .collect();
        assert_eq!(chosen, want);
        assert_ne!(chosen[0], unbiased);

        let s = session(&model);
        s.lock().unwrap().logit_bias = LogitBias::new([(9, 100.0)]);
        let (mut call, mut answer) = job(&s, (1, Kind::Verify), PROMPT.len(), vec![5], vec![6, 7]);
        call.parents = vec![0, 0];
        TargetHandler.run(&model, vec![call], &mut |_| Vec::new());
        let Choice::Argmax(chosen) = answer.try_recv().unwrap().unwrap().choice else {
            panic!("a greedy session's Verify answers argmaxes");
        };
        assert_eq!(chosen, [9, 9, 9]);
    }

    /// Under a structured output each position chooses among the tokens the format allows
    /// after the completion so far with the drafts before it: here `ab+` makes the first
    /// two choices `a` and `b` and leaves `b` or an end at the third; the position after a
    /// draft outside the format (never accepted) keeps its own choice.
    #[test]
    fn a_structured_output_chooses_within_its_format() {
        use duet_engine::Tokenizer;
        use duet_engine::structured::{Format, Grammars};
        let dir = tempfile::tempdir().unwrap();
        let model = tiny_model(&dir);
        let tokenizer = Tokenizer::load(&dir.path().join("target.gguf")).unwrap();
        let grammars = Grammars::new(&tokenizer, model.config().vocab).unwrap();
        let [a, b, x] = ["a", "b", "x"].map(|t| tokenizer.encode_literal(t).unwrap()[0]);
        let s = session(&model);
        let mut constraint = grammars.constrain(&Format::Regex("ab+".into())).unwrap();
        let masks = constraint.masks(&[], &[a, b, x]).unwrap();
        {
            let mut held = s.lock().unwrap();
            held.constraint = Some(constraint);
            // The appended token is the prompt's last: the completion starts after it.
            held.completion_from = PROMPT.len() + 1;
        }
        let (call, mut answer) = job(&s, (1, Kind::Verify), PROMPT.len(), vec![5], vec![a, b, x]);
        TargetHandler.run(&model, vec![call], &mut |_| Vec::new());
        let Choice::Argmax(chosen) = answer.try_recv().unwrap().unwrap().choice else {
            panic!("a greedy session's Verify answers argmaxes");
        };
        let rows = prefilled_rows(&model, &[5, a, b, x], 4);
        let within = argmax(&masked(&masks[2], Cow::Borrowed(rows.row(2)))).unwrap();
        assert_eq!(chosen, [a, b, within, argmax(rows.row(3)).unwrap()]);
        assert!(within == b || tokenizer.is_eos(within), "{within}");
    }
}
