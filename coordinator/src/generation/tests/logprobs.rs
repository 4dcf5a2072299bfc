//! Log-probabilities: each committed token carries the figures of the target's row that
//! chose it, whichever way the round reached it (a Decode stream, a chain's accepted
//! drafts, a tree's alternative, a lookup, a stream's lookup pass, a failover), and none
//! past the request's end.

use super::super::fakes::figures;
use super::*;

const PROMPT: [u32; 4] = [5, 17, 42, 7];

/// A sampling request (temperature 1, `seed`) of `method` that asks for each token's
/// figures with one alternative.
fn sampled_with_figures(method: Method, seed: u64, max_tokens: usize) -> ValidRequest {
    ValidRequest {
        sampling: SamplingParams {
            temperature: 1.0,
            seed,
            ..SamplingParams::greedy()
        },
        logprobs: Some(1),
        ..request(method, 4, max_tokens)
    }
}

/// The fake target's figures for `tokens` committed after the prompt.
fn expected(tokens: &[u32], top: usize) -> Vec<TokenLogprobs> {
    let places = PROMPT.len()..;
    places
        .zip(tokens)
        .map(|(at, &t)| figures(at, t, top))
        .collect()
}

/// A greedy request's tokens come with their own figures under every method (its last
/// round cut to the 23 tokens asked for), and a request that does not ask gets none.
#[tokio::test]
async fn every_committed_token_carries_the_figures_of_the_row_that_chose_it() {
    let cases = [
        ("none, streamed", Method::NONE, Script::default(), 0),
        (
            "draft model",
            Method::DRAFT_MODEL,
            Script {
                wrong_at: Some(2),
                ..Script::default()
            },
            0,
        ),
        (
            "tree",
            Method::DRAFT_MODEL,
            Script {
                wrong_at: Some(1),
                ..Script::default()
            },
            1,
        ),
        (
            "lookup",
            Method::NGRAM,
            Script {
                target: Target::Cycle(3),
                ..Script::default()
            },
            0,
        ),
        (
            "auto",
            Method::Auto,
            Script {
                target: Target::HashThenCycle(8, 3),
                ..Script::default()
            },
            0,
        ),
    ];
    for (name, method, script, width) in cases {
        let target = script.target;
        let workers = FakeWorkers::new(script);
        let ctx = context_with_trees(&workers, width, 0.5);
        let req = ValidRequest {
            logprobs: Some(2),
            ..request(method, 4, 23)
        };
        let r = run_with(ctx, req).await;
        assert_eq!(r.result, Ok(()), "{name}");
        assert_eq!(r.tokens, generated(target, &PROMPT, 23), "{name}");
        assert_eq!(r.logprobs, expected(&r.tokens, 2), "{name}");
        if width > 0 {
            assert!(workers.verified_parents().iter().any(|p| !p.is_empty()));
        }
        // Without asking, none.
        let r = run(&FakeWorkers::new(Script::default()), request(method, 4, 5)).await;
        assert_eq!((r.tokens.len(), r.logprobs.len()), (5, 0), "{name}");
    }
}

/// A request whose target replica is lost goes on from its committed tokens on another,
/// and the figures go on with them: a Verify's rounds, and a Decode stream's steps.
#[tokio::test]
async fn the_figures_go_on_after_a_failover() {
    for method in [Method::DRAFT_MODEL, Method::NONE] {
        let workers = FakeWorkers::new(Script {
            wrong_at: Some(1),
            verify_fails: vec![(2, Failure::Unreachable("connection reset".into()))],
            ..Script::default()
        });
        let req = ValidRequest {
            logprobs: Some(0),
            ..request(method, 4, 16)
        };
        let r = run(&workers, req).await;
        assert_eq!(r.result, Ok(()), "{method:?}");
        assert_eq!(usage(&r).target_failovers.len(), 1, "{method:?}");
        assert_eq!(r.tokens, target_only(&PROMPT, 16), "{method:?}");
        assert_eq!(r.logprobs, expected(&r.tokens, 0), "{method:?}");
    }
}

/// A request that asks for its prompt's figures gets them once, on its first chunk: each
/// prompt token's after the first, as the target's open answered them, under every method
/// and where the target is lost before the first round. One that does not ask gets none.
#[tokio::test]
async fn the_prompts_figures_come_with_the_first_chunk() {
    let lost_at_once = || Script {
        verify_fails: vec![(0, Failure::Unreachable("connection reset".into()))],
        ..Script::default()
    };
    let cases = [
        (Method::NONE, Script::default()),
        (Method::DRAFT_MODEL, Script::default()),
        (Method::DRAFT_MODEL, lost_at_once()),
        (Method::Auto, Script::default()),
    ];
    for (method, script) in cases {
        let failovers = script.verify_fails.len();
        let workers = FakeWorkers::new(script);
        let req = ValidRequest {
            prompt_logprobs: Some(3),
            ..request(method, 4, 12)
        };
        let r = run(&workers, req).await;
        assert_eq!(r.result, Ok(()), "{method:?}");
        assert_eq!(usage(&r).target_failovers.len(), failovers, "{method:?}");
        assert_eq!(r.tokens, target_only(&PROMPT, 12), "{method:?}");
        let figures = (1..PROMPT.len()).map(|at| figures(at, PROMPT[at], 3));
        let want = PromptFigures {
            tokens: PROMPT.to_vec(),
            logprobs: figures.collect(),
        };
        assert_eq!(r.prompts, vec![(0, want)], "{method:?}");
        assert!(r.logprobs.is_empty());
    }
    let r = run(
        &FakeWorkers::new(Script::default()),
        request(Method::NONE, 4, 3),
    )
    .await;
    assert_eq!((r.tokens.len(), r.prompts.len()), (3, 0));
}

/// Drafts made ahead, while the target verified the round before, are verified as any
/// others: their tokens carry their rows' figures, whatever the draft gets wrong.
#[tokio::test]
async fn drafts_made_ahead_carry_their_figures_too() {
    for wrong_at in [None, Some(0), Some(2)] {
        let workers = FakeWorkers::new(Script {
            wrong_at,
            ..Script::default()
        });
        let mut ctx = context(&workers, true);
        Arc::make_mut(&mut ctx.speculation).overlap_drafting = true;
        let req = ValidRequest {
            logprobs: Some(1),
            ..request(Method::DRAFT_MODEL, 3, 20)
        };
        let r = run_with(ctx, req).await;
        assert_eq!(r.tokens, target_only(&PROMPT, 20), "wrong at {wrong_at:?}");
        assert_eq!(r.logprobs, expected(&r.tokens, 1), "wrong at {wrong_at:?}");
        if wrong_at.is_none() {
            assert!(usage(&r).drafted_ahead_used > 0);
        }
    }
}

/// A sampling request that asks for figures sends its chains alone with each q whole, so
/// the target draws every token it commits (a correction as well) and answers its
/// figures; its trees and its own draws of a correction are left out.
#[tokio::test]
async fn a_sampling_request_leaves_every_draw_to_the_target() {
    let workers = FakeWorkers::new(Script {
        uncertain: true,
        ..Script::default()
    });
    let ctx = context_with_trees(&workers, 1, 0.0);
    let r = run_with(ctx, sampled_with_figures(Method::DRAFT_MODEL, 3, 24)).await;
    assert_eq!(r.result, Ok(()));
    assert_eq!(r.tokens.len(), 24);
    assert_eq!(r.logprobs, expected(&r.tokens, 1));
    assert!(workers.verified_parents().iter().all(Vec::is_empty));
    let (tested, left_to_the_caller) = workers.sampling_tests();
    assert!(tested > 0 && usage(&r).draft_tokens_accepted < usage(&r).draft_tokens_proposed);
    assert_eq!(left_to_the_caller, 0);
}

/// An answer without the figures of every token the round may commit is malformed for a
/// request that asks for them (and fine for one that does not).
#[test]
fn an_answer_short_of_figures_is_malformed() {
    use super::super::target::check_logprobs;
    let argmax = |n: usize| Verified {
        choice: TargetChoice::Argmax(vec![3, 4, 5]),
        logprobs: vec![TokenLogprobs::default(); n],
        timing: WorkerTiming::default(),
        give_way: false,
        pass: None,
    };
    assert_eq!(check_logprobs(&argmax(3), true), Ok(()));
    assert_eq!(check_logprobs(&argmax(0), false), Ok(()));
    let e = check_logprobs(&argmax(0), true).unwrap_err();
    assert!(
        e.to_string()
            .ends_with("no logprobs: the target-worker may predate them"),
        "{e}"
    );
    let e = check_logprobs(&argmax(2), true).unwrap_err();
    assert_eq!(
        e.to_string(),
        "target-worker: malformed answer: logprobs for 2 tokens; 3 chosen"
    );
    let rejected = Verified {
        choice: TargetChoice::Tested {
            accepted: 1,
            next: Next::Rejected(Distribution::point(3)),
            rng_position: 0,
        },
        ..argmax(1)
    };
    let e = check_logprobs(&rejected, true).unwrap_err();
    assert!(e.to_string().contains("no token drawn"), "{e}");
}

/// A stop string that ends the request inside a round ends its figures with its tokens
/// (the token that completes it included, as in `token_ids`).
#[tokio::test]
async fn the_figures_end_where_a_stop_string_ends_the_tokens() {
    let tokens = target_only(&PROMPT, 24);
    let tokenizer = &super::super::fakes::models().tokenizer;
    let pieces: Vec<String> = tokens
        .iter()
        .map(|&t| String::from_utf8_lossy(&tokenizer.token_bytes(t).unwrap()).into_owned())
        .collect();
    // A token past the first round whose text has not come before it.
    let at = (6..20)
        .find(|&i| {
            let before: String = pieces[..i].concat();
            !pieces[i].trim().is_empty() && !before.contains(pieces[i].as_str())
        })
        .expect("a fresh piece of text");
    let req = ValidRequest {
        stop: vec![pieces[at].clone()],
        logprobs: Some(0),
        ..request(Method::DRAFT_MODEL, 4, 24)
    };
    let r = run(&FakeWorkers::new(Script::default()), req).await;
    assert_eq!(r.finished.as_ref().unwrap().reason, FinishReason::Stop);
    assert_eq!(r.tokens, tokens[..=at]);
    assert_eq!(r.logprobs, expected(&r.tokens, 0));
}

/// An AUTO stream that looks up drafts itself (`stream_lookup`), sampling, the target
/// uncertain: each committed token carries its own row's figures whether a pass's accepted
/// draft or its drawn token, lookup's drafts are accepted where the text copies itself,
/// and the seed gives the same text again (each pass's draws where the one before left
/// the random stream).
#[tokio::test(start_paused = true)]
async fn a_sampling_stream_that_looks_up_gives_each_token_its_figures() {
    let run_once = || async {
        let workers = FakeWorkers::new(Script {
            target: Target::HashThenCycle(30, 3),
            uncertain: true,
            draft_unavailable: Some("no draft-worker".into()),
            ..Script::default()
        });
        let mut ctx = context(&workers, false);
        Arc::make_mut(&mut ctx.speculation).stream_lookup = true;
        ctx.metrics.running.set(2);
        let req = ValidRequest {
            k: 8,
            ..sampled_with_figures(Method::Auto, 11, 60)
        };
        let r = run_with(ctx, req).await;
        assert_eq!(r.result, Ok(()));
        assert_eq!(r.logprobs, expected(&r.tokens, 1));
        // Every token came from the streams: lookup's drafts too.
        assert_eq!(workers.decodes().iter().sum::<usize>(), 60);
        assert_eq!(workers.verified_drafts(), Vec::<usize>::new());
        let u = usage(&r);
        let lookup = u.proposers.iter().find(|p| p.proposer == Proposer::Ngram);
        assert!(lookup.is_some_and(|p| p.accepted > 0), "{:?}", u.proposers);
        r.tokens
    };
    let first = run_once().await;
    assert_eq!(first.len(), 60);
    assert_eq!(run_once().await, first);
}
