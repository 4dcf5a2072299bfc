//! The loop's bookkeeping through fake workers: target-only steps and streams, rejections
//! at every position, and AUTO's choices and when it opens the draft session. Failures
//! (draft, target, caller) are in `tests/failures.rs`, prompt lookup in `tests/lookup.rs`,
//! the draft model's drafting ahead and early stops in `tests/draft.rs`.

use super::fakes::{FAKE_TOKENS, FakeWorkers, Malformed, Script, Target, next_token};

mod draft;
mod failures;
mod logprobs;
mod lookup;
mod preemption;
mod turns;
use super::target::check_verified;
use super::*;
use crate::controller::{self, Mode, Source};
use crate::output::{Finished, PromptFigures, Usage};
use crate::workers::{Failure, Next, Party, TargetChoice, Verify, WorkerTiming};
use duet_engine::sampling::{Distribution, SamplingParams};
use std::time::Duration;

pub(crate) fn request(method: Method, k: usize, max_tokens: usize) -> ValidRequest {
    ValidRequest {
        prompt: vec![5, 17, 42, 7],
        max_tokens,
        sampling: SamplingParams::greedy(),
        stop: Vec::new(),
        method,
        k,
        choose_k: method == Method::Auto,
        logprobs: None,
        penalties: Default::default(),
        prompt_logprobs: None,
        logit_bias: Default::default(),
        ignore_eos: false,
        stop_token_ids: Vec::new(),
        include_stop_str_in_output: false,
        skip_special_tokens: true,
        cache_salt: 0,
        min_tokens: 0,
        prediction: Vec::new(),
        format: None,
        finds_tool_calls: false,
        tool_names: Vec::new(),
        parallel_tool_calls: true,
        thought: None,
        repository_files_left_out: 0,
        min_line_indent: 0,
        max_predict: None,
        priority: 0,
        request_id: None,
        adapter: None,
    }
}

fn context(workers: &Arc<FakeWorkers>, concurrent_prefill: bool) -> Context<FakeWorkers> {
    let mut speculation = crate::CoordinatorConfig::default().speculation;
    speculation.concurrent_prefill = concurrent_prefill;
    Context {
        workers: workers.clone(),
        models: super::fakes::models(),
        speculation: Arc::new(speculation),
        shared: Arc::default(),
        metrics: Arc::default(),
        stopping: Shutdown::new(),
        stall_timeout: Duration::from_secs(30),
        max_failovers: 2,
        lease: Lease::default(),
        room: Arc::new(crate::room::RoomQueue::new(
            Duration::from_secs(30),
            Default::default(),
            true,
        )),
        proposals: None,
    }
}

/// `context(workers, true)` with trees of drafts: `width` alternatives a draft token at
/// most, each verified from the probability `above` on (`speculation.adaptive`).
fn context_with_trees(workers: &Arc<FakeWorkers>, width: u32, above: f32) -> Context<FakeWorkers> {
    let mut ctx = context(workers, true);
    let adaptive = &mut Arc::make_mut(&mut ctx.speculation).adaptive;
    adaptive.tree_alternatives = width;
    adaptive.tree_alternatives_above = above;
    ctx
}

/// What one generation sent, and how it ended.
#[derive(Debug)]
struct Run {
    tokens: Vec<u32>,
    logprobs: Vec<TokenLogprobs>,
    /// The prompt's figures, with the chunk that carried them.
    prompts: Vec<(usize, PromptFigures)>,
    chunks: usize,
    finished: Option<Finished>,
    result: Result<(), Abort>,
}

async fn run(workers: &Arc<FakeWorkers>, req: ValidRequest) -> Run {
    run_with(context(workers, false), req).await
}

async fn run_with<W: Workers>(ctx: Context<W>, req: ValidRequest) -> Run {
    let (tx, mut rx) = mpsc::channel(4);
    let task = tokio::spawn(async move { generate(ctx, req, Arrival::now(), &tx).await });
    let mut out = Run {
        tokens: Vec::new(),
        logprobs: Vec::new(),
        prompts: Vec::new(),
        chunks: 0,
        finished: None,
        result: Ok(()),
    };
    while let Some(event) = rx.recv().await {
        match event {
            Event::Chunk(c) => {
                out.prompts.extend(c.prompt.map(|p| (out.chunks, p)));
                out.chunks += 1;
                assert!(c.logprobs.is_empty() || c.logprobs.len() == c.tokens.len());
                out.tokens.extend(c.tokens);
                out.logprobs.extend(c.logprobs);
            }
            Event::Finished(f) => out.finished = Some(*f),
        }
    }
    if let Err(abort) = task.await.unwrap() {
        out.result = Err(abort);
    }
    out
}

/// The fake target's own greedy output.
fn target_only(prompt: &[u32], n: usize) -> Vec<u32> {
    generated(Target::Hash, prompt, n)
}

fn generated(target: Target, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut seq = prompt.to_vec();
    for _ in 0..n {
        seq.push(target.next(&seq, prompt.len()));
    }
    seq[prompt.len()..].to_vec()
}

fn usage(r: &Run) -> &Usage {
    &r.finished.as_ref().expect("a final message").usage
}

/// A greedy NONE request takes its 20 tokens, a round each, from one Decode stream asked
/// for 20 (`target_streams`), or from 20 Verify calls without drafts.
#[tokio::test]
async fn target_only_commits_one_token_per_round() {
    for streams in [true, false] {
        let workers = FakeWorkers::new(Script::default());
        let mut ctx = context(&workers, false);
        Arc::make_mut(&mut ctx.speculation).target_streams = streams;
        let r = run_with(ctx, request(Method::NONE, 4, 20)).await;
        assert_eq!(r.result, Ok(()));
        assert_eq!(r.tokens, target_only(&[5, 17, 42, 7], 20));
        let u = usage(&r);
        assert_eq!((u.rounds, u.draft_tokens_proposed), (20, 0));
        assert_eq!(r.finished.as_ref().unwrap().reason, FinishReason::Length);
        let (decodes, verifies) = match streams {
            true => (vec![20], vec![]),
            false => (vec![], vec![0; 20]),
        };
        assert_eq!(workers.decodes(), decodes);
        assert_eq!(workers.verified_drafts(), verifies);
        assert_eq!(
            workers.open_sessions(),
            0,
            "sessions close with the generation"
        );
    }
}

/// The fakes' target that writes 30 tokens of prose, then copies itself (a cycle of 3),
/// 50 ms a pass (43 reported: 7 ms of each round are overhead), without a draft model.
fn prose_then_copy() -> (Target, Script) {
    let target = Target::HashThenCycle(30, 3);
    let script = Script {
        target,
        verify_time: Duration::from_millis(50),
        draft_unavailable: Some("no draft-worker".into()),
        ..Script::default()
    };
    (target, script)
}

/// AUTO streams its target-only steps once they have run long enough to pay for the step
/// a stream leaves in flight (here 43 ms a pass against 7 ms of overhead a round: seven
/// steps); where its stream looks up nothing itself (`stream_lookup` off, or a target
/// that cannot), it ends the stream where prompt lookup starts to match (the prose turns
/// into a copy): the text stays the target's.
#[tokio::test(start_paused = true)]
async fn auto_streams_a_long_run_of_target_only_steps() {
    for cannot in [false, true] {
        let (target, script) = prose_then_copy();
        let workers = FakeWorkers::new(Script {
            no_stream_lookup: cannot,
            ..script
        });
        let mut ctx = context(&workers, false);
        Arc::make_mut(&mut ctx.speculation).stream_lookup = cannot;
        let r = run_with(ctx, request(Method::Auto, 8, 60)).await;
        ended_for_lookup(&workers, &r, target);
    }
}

/// The run of [`auto_streams_a_long_run_of_target_only_steps`]: streamed, then lookup
/// rounds of Verify calls.
fn ended_for_lookup(workers: &FakeWorkers, r: &Run, target: Target) {
    assert_eq!(r.result, Ok(()));
    assert_eq!(r.tokens, generated(target, &[5, 17, 42, 7], 60));
    let verified = workers.verified_drafts();
    assert_eq!(verified[..7], [0; 7], "{verified:?}");
    let decodes = workers.decodes();
    assert!(!decodes.is_empty() && decodes[0] > 10, "{decodes:?}");
    let drafted = verified.iter().filter(|&&k| k > 0).count();
    assert!(drafted > 0, "{verified:?}");
    let lookup = usage(r)
        .proposers
        .iter()
        .find(|p| p.proposer == Proposer::Ngram);
    assert!(
        lookup.is_some_and(|p| p.accepted > 0),
        "{:?}",
        usage(r).proposers
    );
}

/// Where its stream looks up drafts itself (`stream_lookup`), AUTO's stream goes on where
/// the prose turns into a copy: from then on its steps verify the copy's drafts, every
/// call after the first seven steps is that one stream, the drafts it accepted count as
/// lookup's, and the text stays the target's.
#[tokio::test(start_paused = true)]
async fn an_auto_stream_looks_up_drafts_itself() {
    let (target, script) = prose_then_copy();
    let workers = FakeWorkers::new(script);
    let mut ctx = context(&workers, false);
    Arc::make_mut(&mut ctx.speculation).stream_lookup = true;
    let r = run_with(ctx, request(Method::Auto, 8, 60)).await;
    assert_eq!(r.result, Ok(()));
    assert_eq!(r.tokens, generated(target, &[5, 17, 42, 7], 60));
    assert_eq!(workers.verified_drafts(), [0; 7]);
    assert_eq!(workers.decodes(), [60 - 7]);
    let u = usage(&r);
    let lookup = u.proposers.iter().find(|p| p.proposer == Proposer::Ngram);
    let lookup = lookup.expect("lookup rounds");
    assert!(lookup.accepted >= 20, "{:?}", u.proposers);
    assert_eq!(u.rounds, 60 - lookup.accepted);
}

/// An NGRAM request's stream looks up drafts itself too (`stream_lookup`, on a target that
/// can): one stream from its first step to its end, every lookup round a step of it, the
/// request's own K for every match. Without it (off, streams off, or a target that cannot),
/// each lookup and each target-only step is a Verify call, as before streams. The text is
/// the target's.
#[tokio::test(start_paused = true)]
async fn an_ngram_request_looks_up_inside_one_stream() {
    // (stream_lookup, target_streams, a target that cannot look up in a stream)
    let cases = [
        (true, true, false),
        (true, true, true),
        (false, true, false),
        (true, false, false),
    ];
    for (stream_lookup, streams, cannot) in cases {
        let (target, script) = prose_then_copy();
        let workers = FakeWorkers::new(Script {
            no_stream_lookup: cannot,
            ..script
        });
        let mut ctx = context(&workers, false);
        let speculation = Arc::make_mut(&mut ctx.speculation);
        (speculation.stream_lookup, speculation.target_streams) = (stream_lookup, streams);
        let r = run_with(ctx, request(Method::NGRAM, 8, 60)).await;
        assert_eq!(r.result, Ok(()));
        assert_eq!(r.tokens, generated(target, &[5, 17, 42, 7], 60));
        let u = usage(&r);
        let lookup = u.proposers.iter().find(|p| p.proposer == Proposer::Ngram);
        let accepted = lookup.expect("lookup rounds").accepted;
        assert!(accepted >= 20, "{:?}", u.proposers);
        assert_eq!(u.rounds, 60 - accepted);
        let verified = workers.verified_drafts();
        match stream_lookup && streams && !cannot {
            true => {
                assert_eq!(workers.decodes(), [60]);
                assert_eq!(verified, [0; 0]);
            }
            false => {
                assert_eq!(workers.decodes(), [0; 0]);
                assert_eq!(verified.len(), u.rounds as usize);
                assert!(verified.iter().all(|&k| k <= 8), "{verified:?}");
            }
        }
    }
}

/// With max_predict, the generation ends (finish LENGTH) at the first round that ends past
/// the limit once the text holds a newline; a text without one goes on to max_tokens.
#[tokio::test(start_paused = true)]
async fn a_time_limit_ends_the_completion_once_it_holds_a_line() {
    let tok = &super::fakes::models().tokenizer;
    for (prompt, tokens) in [("a\nb", 4), ("abc", 20)] {
        let workers = FakeWorkers::new(Script {
            target: Target::Cycle(3),
            verify_time: Duration::from_millis(10),
            ..Script::default()
        });
        let mut ctx = context(&workers, false);
        Arc::make_mut(&mut ctx.speculation).target_streams = false;
        let req = ValidRequest {
            prompt: tok.encode(prompt, false).unwrap(),
            max_predict: Some(Duration::from_millis(35)),
            ..request(Method::NONE, 4, 20)
        };
        assert_eq!(req.prompt.len(), 3);
        let r = run_with(ctx, req.clone()).await;
        assert_eq!(r.result, Ok(()));
        assert_eq!(r.tokens, generated(Target::Cycle(3), &req.prompt, tokens));
        assert_eq!(r.finished.unwrap().reason, FinishReason::Length);
    }
}

/// In a batch (another request running) AUTO streams its target-only steps from the first.
/// A finished request writes one line to `duet_coordinator::requests`: its id, method,
/// finish, tokens, rounds and times, for an SRE without a trace collector.
#[tokio::test]
async fn a_finished_request_logs_one_line_with_its_id_and_figures() {
    let file = tempfile::NamedTempFile::new().unwrap();
    let logs = tracing_subscriber::fmt()
        .with_writer(std::sync::Mutex::new(file.reopen().unwrap()))
        .with_ansi(false)
        .finish();
    let _logging = tracing::subscriber::set_default(logs);
    let workers = FakeWorkers::new(Script::default());
    let req = ValidRequest {
        request_id: Some("gw-7f3a".into()),
        ..request(Method::NONE, 4, 20)
    };
    assert_eq!(run(&workers, req).await.result, Ok(()));
    let text = std::fs::read_to_string(file.path()).unwrap();
    let finished: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("request finished"))
        .collect();
    assert_eq!(finished.len(), 1, "{text}");
    let want = " INFO duet_coordinator::requests: request finished request_id=gw-7f3a \
                method=none finish_reason=length prompt_tokens=4 cached_tokens=0 \
                completion_tokens=20 rounds=20 draft_tokens=0 accepted_tokens=0 \
                fallback=false queue_ms=0 ttft_ms=";
    assert!(finished[0].contains(want), "{}", finished[0]);
    assert!(finished[0].contains(" ms="), "{}", finished[0]);
}

#[tokio::test]
async fn auto_in_a_batch_streams_from_the_first_target_only_step() {
    let workers = FakeWorkers::new(Script {
        draft_unavailable: Some("no draft-worker".into()),
        ..Script::default()
    });
    let ctx = context(&workers, false);
    ctx.metrics.running.set(2);
    let r = run_with(ctx, request(Method::Auto, 8, 20)).await;
    assert_eq!(r.tokens, target_only(&[5, 17, 42, 7], 20));
    assert_eq!(workers.decodes(), vec![20]);
    assert_eq!(workers.verified_drafts(), Vec::<usize>::new());
}

/// A stream that started before the costs were known (in a batch, from the first step)
/// looks up nothing; weighed again after 16 tokens, once lookup pays, it ends for one that
/// looks up drafts itself, and that one runs to the end, through the prose and then the
/// copy: two streams, the text the target's.
#[tokio::test(start_paused = true)]
async fn a_stream_started_before_the_costs_restarts_to_look_up() {
    let (target, script) = prose_then_copy();
    let workers = FakeWorkers::new(script);
    let mut ctx = context(&workers, false);
    ctx.metrics.running.set(2);
    Arc::make_mut(&mut ctx.speculation).stream_lookup = true;
    let r = run_with(ctx, request(Method::Auto, 8, 60)).await;
    assert_eq!(r.tokens, generated(target, &[5, 17, 42, 7], 60));
    assert_eq!(workers.decodes(), [16, 60 - 16]);
    assert_eq!(workers.verified_drafts(), Vec::<usize>::new());
    let u = usage(&r);
    let lookup = u.proposers.iter().find(|p| p.proposer == Proposer::Ngram);
    assert!(lookup.is_some_and(|p| p.accepted > 0), "{:?}", u.proposers);
}

/// A target-worker that refuses Decode (one from before it, in a rolling upgrade): the
/// request goes on with a Verify a step, the same text.
#[tokio::test]
async fn a_target_without_decode_gets_a_verify_a_step() {
    let workers = FakeWorkers::new(Script {
        no_decode: true,
        ..Script::default()
    });
    let r = run(&workers, request(Method::NONE, 0, 20)).await;
    assert_eq!(r.result, Ok(()));
    assert_eq!(r.tokens, target_only(&[5, 17, 42, 7], 20));
    assert_eq!(workers.verified_drafts(), vec![0; 20]);
}

/// A sampling NONE request streams too: the target draws each token where the request's
/// random stream stands, so a seed gives the same text as a Verify a step (the target
/// uncertain: 0.6 on its token, 0.4 on the next id, so the draws decide the text). A
/// stream broken by a failed step restarts from the request's own position. Speculating
/// methods verify each step.
#[tokio::test]
async fn a_sampling_request_streams_the_same_text_as_a_verify_a_step() {
    let sampling = |seed| {
        let mut req = request(Method::NONE, 0, 40);
        req.sampling = SamplingParams {
            temperature: 0.8,
            seed,
            ..SamplingParams::greedy()
        };
        req
    };
    let script = |verify_fails| Script {
        uncertain: true,
        verify_fails,
        ..Script::default()
    };
    let mut texts = std::collections::BTreeSet::new();
    for seed in [3, 4] {
        let mut ctx = context(&FakeWorkers::new(script(vec![])), false);
        Arc::make_mut(&mut ctx.speculation).target_streams = false;
        let stepped = run_with(ctx, sampling(seed)).await;
        let workers = FakeWorkers::new(script(vec![]));
        let ctx = context(&workers, false);
        let metrics = ctx.metrics.clone();
        let streamed = run_with(ctx, sampling(seed)).await;
        assert_eq!(streamed.result, Ok(()));
        assert_eq!(streamed.tokens, stepped.tokens, "seed {seed}");
        assert_eq!(workers.decodes(), vec![40]);
        assert_eq!(metrics.target_streamed_tokens.get(), 40);
        let busy = FakeWorkers::new(script(vec![(17, Failure::Busy("full".into()))]));
        let broken = run(&busy, sampling(seed)).await;
        assert_eq!(broken.tokens, stepped.tokens, "seed {seed}");
        assert_eq!(busy.decodes(), vec![17, 23]);
        texts.insert(stepped.tokens);
    }
    assert_eq!(texts.len(), 2, "two seeds, two texts");
    let workers = FakeWorkers::new(Script::default());
    let r = run(&workers, request(Method::DRAFT_MODEL, 4, 12)).await;
    assert_eq!(r.tokens, target_only(&[5, 17, 42, 7], 12));
    assert_eq!(workers.decodes(), Vec::<usize>::new());
}

/// A rejection at each position in turn: the tokens stay the target's own, every round
/// accepts exactly the drafts before the wrong one (so both caches were rolled back
/// right), and the rounds shorten as the last ones run into `max_tokens`. On shared cores
/// the first round is a target-only step: the first token goes out before the draft's
/// prefill.
#[tokio::test]
async fn a_rejection_at_each_position_keeps_the_target_text() {
    let (k, n) = (4, 23);
    let want = target_only(&[5, 17, 42, 7], n);
    for wrong_at in 0..=k {
        let workers = FakeWorkers::new(Script {
            wrong_at: (wrong_at < k).then_some(wrong_at),
            ..Script::default()
        });
        let r = run(&workers, request(Method::DRAFT_MODEL, k, n)).await;
        assert_eq!(r.result, Ok(()), "wrong at {wrong_at}");
        assert_eq!(r.tokens, want, "wrong at {wrong_at}");
        // The expected rounds: one without drafts, then K drafts (fewer near the end),
        // `wrong_at` of them accepted.
        let (mut left, mut rounds, mut proposed, mut accepted, mut drafts) =
            (n - 1, 1, 0, 0, vec![0]);
        while left > 0 {
            let kr = k.min(left - 1);
            let a = wrong_at.min(kr);
            drafts.push(kr);
            rounds += 1;
            proposed += kr;
            accepted += a;
            left -= (a + 1).min(left);
        }
        let u = usage(&r);
        assert_eq!(
            (u.rounds, u.draft_tokens_proposed, u.draft_tokens_accepted),
            (rounds, proposed, accepted),
            "wrong at {wrong_at}"
        );
        assert_eq!(workers.verified_drafts(), drafts, "wrong at {wrong_at}");
        // Each call re-feeds nothing its worker holds: the target gets the one token it has
        // not seen (the prompt's last, then each round's correction or bonus); the draft
        // also its own last draft token after a round it got all right.
        assert_eq!(workers.appended(Party::Target), vec![1; rounds]);
        let draft_appends: Vec<usize> = drafts
            .iter()
            .enumerate()
            .filter(|(_, kr)| **kr > 0)
            .map(|(i, _)| {
                if drafts[i - 1] > 0 && wrong_at >= drafts[i - 1] {
                    2
                } else {
                    1
                }
            })
            .collect();
        assert_eq!(
            workers.appended(Party::Draft),
            draft_appends,
            "wrong at {wrong_at}"
        );
        assert_eq!(u.fallback, None);
        assert!(workers.trips().is_empty());
        assert_eq!(r.chunks, rounds);
        assert_eq!(workers.open_sessions(), 0);
    }
}

/// AUTO on text that turns from unpredictable to a copy: the same tokens as target-only,
/// and once costs are known it drafts, more and more by lookup once the copy starts.
#[tokio::test]
async fn auto_keeps_the_target_text_and_uses_lookup_where_it_pays() {
    let prompt = [5, 17, 42, 7, 9, 11];
    let target = Target::HashThenCycle(12, 3);
    let workers = FakeWorkers::new(Script {
        target,
        wrong_at: Some(1),
        ..Script::default()
    });
    let mut req = request(Method::Auto, 16, 60);
    req.prompt = prompt.to_vec();
    let r = run(&workers, req).await;
    assert_eq!(r.result, Ok(()));
    assert_eq!(r.tokens, generated(target, &prompt, 60));
    let u = usage(&r);
    let by = |p: Proposer| u.proposers.iter().find(|x| x.proposer == p).copied();
    let lookup = by(Proposer::Ngram).unwrap_or_else(|| panic!("no lookup rounds: {u:?}"));
    assert!(lookup.accepted >= 30, "{:?}", u.proposers);
    assert!(
        u.rounds < 30,
        "{} rounds for 60 tokens: {:?}",
        u.rounds,
        u.proposers
    );
    assert_eq!(u.method, Method::Auto);
    assert_eq!(workers.open_sessions(), 0);
}

/// An AUTO request of 60 tokens on a coordinator whose earlier requests found the draft
/// model always right; its tokens are checked to be the target's own.
async fn auto_after_a_right_draft(ctx: Context<FakeWorkers>) -> Run {
    for _ in 0..50 {
        ctx.shared.observe_acceptance(Source::DraftModel, 8, 8);
    }
    let prompt = [5, 17, 42, 7, 9, 11];
    let mut req = request(Method::Auto, 16, 60);
    req.prompt = prompt.to_vec();
    let r = run_with(ctx, req).await;
    assert_eq!(r.result, Ok(()));
    assert_eq!(r.tokens, generated(Target::Hash, &prompt, 60));
    r
}

/// AUTO opens the draft session once the controller wants the draft model: on shared cores
/// the request waits for its prefill (no target step runs meanwhile, as two forward passes
/// at once on the same cores only slow each other), a wait the draft rounds' overhead does
/// not count, and that usage counts as prefill, with or without `take_turns` (alone, a step
/// would only wait for the prefill's turn). On separate devices (`concurrent_prefill`)
/// target steps go on while it prefills, and so they do in a batch with `take_turns`
/// (`draft_model_in_a_batch_steps_on_while_its_draft_opens`).
#[tokio::test(start_paused = true)]
async fn auto_waits_for_the_draft_prefill_only_where_steps_could_not_go_on() {
    for (concurrent_prefill, take_turns) in [(false, true), (false, false), (true, false)] {
        let workers = FakeWorkers::new(Script {
            draft_open: Duration::from_millis(500),
            ..Script::default()
        });
        let mut ctx = context(&workers, concurrent_prefill);
        Arc::make_mut(&mut ctx.speculation).take_turns = take_turns;
        // Alone on the coordinator.
        ctx.metrics.running.set(1);
        let shared = ctx.shared.clone();
        let r = auto_after_a_right_draft(ctx).await;
        // The wait for the draft's prefill is not a draft round's overhead.
        let overhead = shared.costs(Mode::Greedy).unwrap().overhead_draft;
        assert!(overhead < 10.0, "{overhead} ms");
        let u = usage(&r);
        let draft = u
            .proposers
            .iter()
            .find(|p| p.proposer == Proposer::DraftModel);
        let waited = workers.verifies_while_draft_opens();
        if concurrent_prefill {
            assert!(waited > 0, "{:?}", u.proposers);
            assert!(u.timings.prefill < 1.0, "{:?}", u.timings);
        } else {
            assert_eq!(waited, 0);
            assert!(draft.is_some_and(|d| d.accepted > 30), "{:?}", u.proposers);
            // Usage counts the wait as prefill, not as the time of the round it was in.
            assert!((u.timings.prefill - 500.0).abs() < 1.0, "{:?}", u.timings);
            assert!(u.timings.rounds < 1.0, "{:?}", u.timings);
        }
        assert_eq!(workers.open_sessions(), 0);
    }
}

/// With other generations running and `take_turns`, a DRAFT_MODEL request takes target steps
/// while its draft session opens (after the first token), and drafts once it is open; alone,
/// it waits for the open.
#[tokio::test(start_paused = true)]
async fn draft_model_in_a_batch_steps_on_while_its_draft_opens() {
    for others in [false, true] {
        let workers = FakeWorkers::new(Script {
            draft_open: Duration::from_millis(500),
            verify_time: Duration::from_millis(30),
            ..Script::default()
        });
        let ctx = context(&workers, false);
        assert!(ctx.speculation.take_turns, "the default");
        ctx.metrics.running.set(if others { 3 } else { 1 });
        let r = run_with(ctx, request(Method::DRAFT_MODEL, 4, 60)).await;
        assert_eq!(r.result, Ok(()));
        assert_eq!(r.tokens, target_only(&[5, 17, 42, 7], 60));
        let u = usage(&r);
        let drafted = u
            .proposers
            .iter()
            .find(|p| p.proposer == Proposer::DraftModel)
            .map_or(0, |p| p.rounds);
        let stepped = workers.verifies_while_draft_opens();
        // In a batch: 500 ms of prefill, a 30 ms target step after another meanwhile, then
        // draft rounds of 5 tokens for the rest. Alone: the first token, then draft rounds.
        let (want_stepped, want_drafted) = if others { (16, 9) } else { (0, 12) };
        assert_eq!(stepped, want_stepped, "steps while the draft opened");
        assert_eq!(drafted, want_drafted, "{:?}", u.proposers);
        assert_eq!(workers.open_sessions(), 0);
    }
}

/// On separate devices (`concurrent_prefill`) AUTO opens the draft session at once, beside
/// the target's prefill, so that the draft model is ready when the controller first wants
/// it; on shared cores only once the controller wants it: with a draft model every request
/// has seen fail, never.
#[tokio::test(start_paused = true)]
async fn auto_opens_the_draft_session_at_once_only_on_separate_devices() {
    for concurrent_prefill in [false, true] {
        let workers = FakeWorkers::new(Script {
            draft_open: Duration::from_millis(100),
            verify_time: Duration::from_millis(30),
            ..Script::default()
        });
        let ctx = context(&workers, concurrent_prefill);
        for _ in 0..50 {
            ctx.shared.observe_acceptance(Source::DraftModel, 8, 0);
        }
        let r = run_with(ctx, request(Method::Auto, 16, 20)).await;
        assert_eq!(r.result, Ok(()));
        assert_eq!(r.tokens, target_only(&[5, 17, 42, 7], 20));
        let opens = usize::from(concurrent_prefill);
        assert_eq!(
            workers.draft_opens(),
            opens,
            "concurrent_prefill {concurrent_prefill}"
        );
        // The first rounds' Verify calls went on while it prefilled (100 ms, 30 ms a pass).
        assert_eq!(workers.verifies_while_draft_opens(), 3 * opens);
        assert_eq!(workers.open_sessions(), 0);
    }
}

/// A request that ends before its draft session has opened in the background abandons the
/// open (its OpenSession call goes away, so a draft-worker skips the rest of the prefill,
/// and one that opened all the same is closed by the id the call named): the fake's
/// one-second prefill is dropped, not finished after the three-token request.
#[tokio::test(start_paused = true)]
async fn a_request_that_ends_first_abandons_its_draft_sessions_open() {
    let workers = FakeWorkers::new(Script {
        draft_open: Duration::from_secs(1),
        verify_time: Duration::from_millis(10),
        ..Script::default()
    });
    let r = run_with(context(&workers, true), request(Method::Auto, 16, 3)).await;
    assert_eq!(r.tokens, target_only(&[5, 17, 42, 7], 3));
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(workers.draft_opens(), 1);
    assert_eq!(workers.draft_opens_dropped(), 1);
    assert_eq!(workers.open_sessions(), 0);
}

/// A draft session that proposes by the completion so far (a structured output's, a
/// penalized one's, one with `min_tokens`) counts it from where it starts: opened after the
/// first token (shared cores), its prompt holds that token, which the draft-worker is told
/// is generated; an unadjusted draft's is all prompt.
#[tokio::test(start_paused = true)]
async fn a_draft_session_that_reads_the_completion_knows_where_it_starts() {
    let plain = request(Method::DRAFT_MODEL, 4, 12);
    let structured = ValidRequest {
        format: Some(duet_engine::structured::Format::Regex("[0-9]+".into())),
        ..plain.clone()
    };
    let penalized = ValidRequest {
        penalties: duet_engine::penalties::Penalties {
            presence: 0.5,
            ..Default::default()
        },
        ..plain.clone()
    };
    let at_least = ValidRequest {
        min_tokens: 3,
        ..plain.clone()
    };
    for (req, from) in [(plain, 0), (structured, 4), (penalized, 4), (at_least, 4)] {
        let workers = FakeWorkers::new(Script::default());
        let structured = req.format.is_some();
        let r = run_with(context(&workers, false), req).await;
        assert_eq!(r.tokens, target_only(&[5, 17, 42, 7], 12));
        assert_eq!(workers.draft_opened(), [(5, from, structured)]);
    }
}

/// On shared cores the first token goes out before the draft's prefill, as soon as a
/// target-only request's would: DRAFT_MODEL makes a target-only step first and opens its
/// draft session after it, and so does AUTO when it wants the draft model from the start;
/// the round after it drafts. On separate devices DRAFT_MODEL opens both sessions at once.
#[tokio::test(start_paused = true)]
async fn the_first_token_does_not_wait_for_the_draft_prefill_on_shared_cores() {
    for (method, concurrent_prefill, first_after) in [
        (Method::DRAFT_MODEL, false, 30),
        (Method::Auto, false, 30),
        (Method::DRAFT_MODEL, true, 500 + 30),
    ] {
        let case = format!("{method:?}, concurrent_prefill {concurrent_prefill}");
        let workers = FakeWorkers::new(Script {
            draft_open: Duration::from_millis(500),
            verify_time: Duration::from_millis(30),
            ..Script::default()
        });
        let ctx = context(&workers, concurrent_prefill);
        // A coordinator that knows its passes and a draft model that is always right: AUTO
        // wants the draft model from the first round.
        ctx.shared.observe_round(&controller::RoundCosts {
            pass_calls: 1,
            pass_rows: 1,
            pass_ms: 30.0,
            committed: 1,
            ..Default::default()
        });
        for _ in 0..50 {
            ctx.shared.observe_acceptance(Source::DraftModel, 8, 8);
        }
        let (tx, mut rx) = mpsc::channel(64);
        let started = tokio::time::Instant::now();
        let req = request(method, 4, 40);
        let task = tokio::spawn(async move { generate(ctx, req, Arrival::now(), &tx).await });
        let Some(Event::Chunk(first)) = rx.recv().await else {
            panic!("{case}: no first chunk");
        };
        assert_eq!(
            started.elapsed(),
            Duration::from_millis(first_after),
            "{case}"
        );
        let mut tokens = first.tokens;
        let mut finished = None;
        while let Some(event) = rx.recv().await {
            match event {
                Event::Chunk(c) => tokens.extend(c.tokens),
                Event::Finished(f) => finished = Some(*f),
            }
        }
        assert_eq!(task.await.unwrap(), Ok(()), "{case}");
        assert_eq!(tokens, target_only(&[5, 17, 42, 7], 40), "{case}");
        assert_eq!(workers.draft_opens(), 1, "{case}");
        let drafts = workers.verified_drafts();
        assert_eq!(drafts[0] == 0, !concurrent_prefill, "{case}: {drafts:?}");
        assert!(drafts[1] > 0, "{case}: {drafts:?}");
        assert!(
            finished.is_some_and(|f| f.usage.draft_tokens_accepted > 20),
            "{case}"
        );
        assert_eq!(workers.open_sessions(), 0, "{case}");
    }
}
