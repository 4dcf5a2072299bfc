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
    let rng = rng_for(prompt[0] as u64);
    Arc::new(Mutex::new(Session::plain(cache, sampling, rng)))
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
    for (temperature, stop_below, alternatives) in [(0.0, 0.0, 0), (0.0, 0.5, 2), (1.0, 0.0, 0)] {
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
        let (token, p) = duet_engine::sampling::argmax_probability(logits.last().unwrap()).unwrap();
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
