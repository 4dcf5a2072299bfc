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
    let mut session = Session::plain(cache, SamplingParams::greedy(), rng_for(0));
    session.completion_from = PROMPT.len();
    Arc::new(Mutex::new(session))
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
            let (mut verify, _v) = job(&s, (1, Kind::Verify), PROMPT.len(), vec![5], draft.clone());
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
        let (mut tree, mut refused) = job(s, (1, Kind::Verify), PROMPT.len(), vec![5], vec![6, 7]);
        tree.parents = vec![0, 0];
        let (chain, mut answered) = job(s, (2, Kind::Verify), PROMPT.len(), vec![5], vec![6, 7]);
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
