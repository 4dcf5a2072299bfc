//! The draft model's part through fake workers: drafting ahead beside Verify (the tokens,
//! the rounds that find their drafts ready, the timing, failures, AUTO's choice), early
//! stops where the draft is unsure (AUTO's plans, what answers fit, exact sampling).

use super::*;
use crate::generation::draft::check_proposal;

/// A draft answer of fewer tokens than asked fits only a call that let the draft stop
/// early, and never an empty one; its q count follows its tokens; alternatives come one
/// list per token where they were asked for, within the number asked, never repeating a
/// token.
#[test]
fn a_short_draft_answer_fits_only_a_call_that_may_stop() {
    let p = |n: usize, q: usize| Proposal {
        tokens: vec![7; n],
        q: vec![Distribution::point(7); q],
        alternatives: Vec::new(),
        timing: WorkerTiming::default(),
    };
    let with = |others: Vec<Vec<u32>>| Proposal {
        alternatives: others,
        ..p(2, 0)
    };
    assert!(check_proposal(p(4, 0), (4, false), 0, 100, true).is_ok());
    assert!(check_proposal(p(2, 0), (4, true), 0, 100, true).is_ok());
    assert!(check_proposal(p(2, 2), (4, true), 0, 100, false).is_ok());
    assert!(check_proposal(with(vec![vec![], vec![8, 9]]), (2, false), 2, 100, true).is_ok());
    for (answer, k, may_stop, greedy, what) in [
        (p(2, 0), 4, false, true, "2 tokens, 4 were asked for"),
        (p(0, 0), 4, true, true, "0 tokens, 4 were asked for"),
        (p(5, 0), 4, true, true, "5 tokens, 4 were asked for"),
        (p(2, 4), 4, true, false, "4 distributions for 2 tokens"),
    ] {
        let e = check_proposal(answer, (k, may_stop), 0, 100, greedy).unwrap_err();
        assert_eq!(e.party, Party::Draft);
        assert!(e.to_string().contains(what), "{e}");
    }
    for (answer, what) in [
        (p(2, 0), "0 alternatives for 2 tokens"),
        (with(vec![vec![8]]), "1 alternatives for 2 tokens"),
        (
            with(vec![vec![8, 9, 10], vec![]]),
            "alternatives [8, 9, 10] of draft token 0",
        ),
        (
            with(vec![vec![], vec![7]]),
            "alternatives [7] of draft token 1",
        ),
        (
            with(vec![vec![8, 8], vec![]]),
            "alternatives [8, 8] of draft token 0",
        ),
        (
            with(vec![vec![100], vec![]]),
            "alternatives [100] of draft token 0",
        ),
    ] {
        let e = check_proposal(answer, (2, false), 2, 100, true).unwrap_err();
        assert!(e.to_string().contains(what), "{e}");
    }
}

/// With `overlap_drafting`: the workers on separate devices.
fn context_overlapping(workers: &Arc<FakeWorkers>) -> Context<FakeWorkers> {
    let mut ctx = context(workers, true);
    Arc::make_mut(&mut ctx.speculation).overlap_drafting = true;
    ctx
}

/// Drafting ahead while the target verifies: with a draft that is always right, every
/// round after the first finds its drafts ready (no Propose before its Verify); the last
/// rounds shrink to the completion's room, and no call drafts past it.
#[tokio::test]
async fn drafting_ahead_readies_the_next_rounds_drafts() {
    let workers = FakeWorkers::new(Script::default());
    let r = run_with(
        context_overlapping(&workers),
        request(Method::DRAFT_MODEL, 4, 23),
    )
    .await;
    assert_eq!(r.result, Ok(()));
    assert_eq!(r.tokens, target_only(&[5, 17, 42, 7], 23));
    let u = usage(&r);
    // 5 + 5 + 5 + 5 + 3 tokens; the ahead calls draft the guess and then 4, 4, 4, 2.
    assert_eq!(workers.verified_drafts(), vec![4, 4, 4, 4, 2]);
    assert_eq!((u.drafted_ahead, u.drafted_ahead_used), (4, 4));
    assert_eq!(
        (u.rounds, u.draft_tokens_proposed, u.draft_tokens_accepted),
        (5, 18, 18)
    );
    // One Propose for the first round, then one beside each Verify but the last, each
    // feeding only the round's last draft.
    assert_eq!(workers.appended(Party::Draft), vec![1; 5]);
    assert_eq!(workers.open_sessions(), 0);
}

/// Whatever the draft gets wrong (a draft token, or its guess of the target's token after
/// the drafts), the tokens are the target's own, for every K, up to completions shorter
/// than a round; both caches roll back right (the fakes check every `keep`).
#[tokio::test]
async fn drafting_ahead_keeps_the_target_text() {
    for wrong_at in [None, Some(0), Some(1), Some(3)] {
        for k in [1, 2, 4, 7] {
            for n in [1, 2, 3, 6, 23, 40] {
                let workers = FakeWorkers::new(Script {
                    wrong_at,
                    ..Script::default()
                });
                let ctx = context_overlapping(&workers);
                let r = run_with(ctx, request(Method::DRAFT_MODEL, k, n)).await;
                let case = format!("wrong at {wrong_at:?}, K {k}, {n} tokens");
                assert_eq!(r.result, Ok(()), "{case}");
                assert_eq!(r.tokens, target_only(&[5, 17, 42, 7], n), "{case}");
                let u = usage(&r);
                assert_eq!(u.fallback, None, "{case}");
                if wrong_at == Some(0) {
                    // Its guess after the drafts is always wrong: nothing made ahead is used.
                    assert_eq!(u.drafted_ahead_used, 0, "{case}");
                }
                if wrong_at.is_none() && n >= 2 * (k + 1) + 2 {
                    assert!(u.drafted_ahead_used > 0, "{case}: {u:?}");
                }
                assert_eq!(workers.open_sessions(), 0, "{case}");
            }
        }
    }
}

/// Sampling sessions: the drafts made ahead carry their q (the fakes' point masses), so the
/// sampled text is the target's own and drafts are used ahead as in greedy sessions.
#[tokio::test]
async fn drafting_ahead_keeps_each_drafts_distribution() {
    let workers = FakeWorkers::new(Script::default());
    let mut req = request(Method::DRAFT_MODEL, 3, 30);
    req.sampling = SamplingParams {
        temperature: 1.0,
        ..SamplingParams::greedy()
    };
    let r = run_with(context_overlapping(&workers), req).await;
    assert_eq!(r.result, Ok(()));
    assert_eq!(r.tokens, target_only(&[5, 17, 42, 7], 30));
    assert!(usage(&r).drafted_ahead_used >= 5, "{:?}", usage(&r));
}

/// The Propose made ahead runs while the target verifies: with a 50 ms pass, every ahead
/// call starts inside a Verify call; without `overlap_drafting` none does.
#[tokio::test(start_paused = true)]
async fn drafting_ahead_runs_beside_verify() {
    for overlap in [false, true] {
        let workers = FakeWorkers::new(Script {
            verify_time: Duration::from_millis(50),
            ..Script::default()
        });
        let ctx = match overlap {
            true => context_overlapping(&workers),
            false => context(&workers, true),
        };
        let r = run_with(ctx, request(Method::DRAFT_MODEL, 4, 23)).await;
        assert_eq!(r.tokens, target_only(&[5, 17, 42, 7], 23));
        let ahead = usage(&r).drafted_ahead;
        assert_eq!(ahead, if overlap { 4 } else { 0 });
        assert_eq!(workers.proposes_while_verifying(), ahead);
    }
}

/// A greedy round that rejects a draft drops the Propose made ahead beside its Verify as
/// soon as the target answers: with a draft wrong at the second token of every round, a
/// 100 ms Propose and a 40 ms Verify, every round takes its own Propose and Verify (140
/// ms), not the Propose made ahead on top (200 ms). A sampling round waits for the call made
/// ahead whatever the verdict (the draft's random draws must not depend on when a call
/// stops). The tokens stay the target's.
#[tokio::test(start_paused = true)]
async fn a_rejection_drops_the_call_made_ahead_in_greedy_rounds() {
    for greedy in [true, false] {
        let workers = FakeWorkers::new(Script {
            wrong_at: Some(1),
            verify_time: Duration::from_millis(40),
            propose_time: Duration::from_millis(100),
            ..Script::default()
        });
        let mut req = request(Method::DRAFT_MODEL, 4, 20);
        if !greedy {
            req.sampling = SamplingParams {
                temperature: 1.0,
                ..SamplingParams::greedy()
            };
        }
        let started = tokio::time::Instant::now();
        let r = run_with(context_overlapping(&workers), req).await;
        let took = started.elapsed();
        assert_eq!(r.tokens, target_only(&[5, 17, 42, 7], 20));
        let u = usage(&r);
        // Two tokens a round; the last three rounds have no room to draft ahead.
        assert_eq!(
            (u.rounds, u.drafted_ahead, u.drafted_ahead_used),
            (10, 7, 0)
        );
        let (dropped, per_ahead_round) = match greedy {
            true => (7, 140),
            false => (0, 200),
        };
        assert_eq!(workers.proposes_dropped(), dropped, "greedy {greedy}");
        assert_eq!(
            took,
            Duration::from_millis(3 * 140 + 7 * per_ahead_round),
            "greedy {greedy}"
        );
        assert_eq!(workers.open_sessions(), 0);
    }
}

/// The draft-worker failing, or answering what does not fit, on a call made ahead: the
/// request goes on target-only with the same text, and the breaker trips.
#[tokio::test]
async fn a_failed_ahead_call_falls_back() {
    let scripts = [
        Script {
            propose_fails: Some((1, Failure::Failed("out of memory".into()))),
            ..Script::default()
        },
        Script {
            propose_malformed: Some((2, Malformed::ExtraToken)),
            ..Script::default()
        },
    ];
    for script in scripts {
        let workers = FakeWorkers::new(script.clone());
        let r = run_with(
            context_overlapping(&workers),
            request(Method::DRAFT_MODEL, 4, 30),
        )
        .await;
        assert_eq!(r.result, Ok(()), "{script:?}");
        assert_eq!(r.tokens, target_only(&[5, 17, 42, 7], 30), "{script:?}");
        let u = usage(&r);
        assert!(u.fallback.is_some(), "{script:?}");
        assert_eq!(workers.trips().len(), 1, "{script:?}");
        assert_eq!(workers.open_sessions(), 0);
    }
}

/// AUTO drafts ahead in its draft-model rounds where it pays: with passes that do not slow
/// beside the draft and guesses that hold (the fakes' draft is always right), round after
/// round; with passes that report themselves 4x as long beside a Propose (shared cores),
/// the first call made ahead measures it and AUTO drafts no more ahead. The tokens stay the
/// target's. (Passes take time, so the draft session opens in the background meanwhile.)
#[tokio::test(start_paused = true)]
async fn auto_drafts_ahead_only_where_the_target_does_not_slow_beside_it() {
    for (contention, ahead) in [(0.0, 11), (3.0, 1)] {
        let workers = FakeWorkers::new(Script {
            verify_time: Duration::from_millis(30),
            contention,
            ..Script::default()
        });
        let r = auto_after_a_right_draft(context_overlapping(&workers)).await;
        let u = usage(&r);
        assert_eq!(u.drafted_ahead, ahead, "contention {contention}: {u:?}");
        if contention == 0.0 {
            assert!(u.drafted_ahead_used >= 3, "{u:?}");
        }
        assert_eq!(workers.open_sessions(), 0);
    }
}

/// Sampling stays exact with drafts made ahead. Uncertain fakes: the target gives its token
/// 0.6 and the next id 0.4, the draft samples the two at 0.5 each. In 4-token requests with
/// K = 1, the third token comes from a draft made ahead whenever the first round's guess
/// held; over those runs it must be the target's 0.6 token 60% of the time (rejection
/// sampling turns the draft's 50% into the target's 60%), as it is for the first token.
#[tokio::test]
async fn drafts_made_ahead_keep_the_sampled_distribution() {
    let workers = FakeWorkers::new(Script {
        uncertain: true,
        ..Script::default()
    });
    let prompt = [5, 17, 42, 7];
    let (mut used, mut likely, mut first_likely) = (0, 0, 0);
    let runs = 3000;
    for seed in 0..runs {
        let mut req = request(Method::DRAFT_MODEL, 1, 4);
        req.sampling = SamplingParams {
            temperature: 1.0,
            seed,
            ..SamplingParams::greedy()
        };
        let r = run_with(context_overlapping(&workers), req).await;
        assert_eq!(r.result, Ok(()));
        let t = &r.tokens;
        first_likely += usize::from(t[0] == next_token(&[&prompt[..], &t[..0]].concat()));
        if usage(&r).drafted_ahead_used == 0 {
            continue;
        }
        used += 1;
        likely += usize::from(t[2] == next_token(&[&prompt[..], &t[..2]].concat()));
    }
    let share = |n: usize, of: usize| n as f64 / of as f64;
    // About half the runs: the first draft accepted (0.9) and the guess right (0.5).
    assert!(
        used > runs as usize / 3,
        "{used} of {runs} runs used drafts made ahead"
    );
    // Three standard errors.
    let first = share(first_likely, runs as usize);
    assert!((first - 0.6).abs() < 0.03, "first token: {first}");
    let ahead = share(likely, used);
    assert!(
        (ahead - 0.6).abs() < 0.04,
        "third token, drafted ahead: {ahead} over {used}"
    );
}

/// AUTO lets the draft model stop a round early where it is unsure of its drafts
/// (`speculation.adaptive.stop_early`): with the draft unsure of each round's third token,
/// every Propose answers three tokens at most (K where fewer were asked), where without
/// the setting it answers the controller's K, more than three; the tokens stay the target's.
#[tokio::test]
async fn auto_lets_an_unsure_draft_stop_its_round_early() {
    for stop_early in [true, false] {
        let workers = FakeWorkers::new(Script {
            unsure_at: Some(2),
            ..Script::default()
        });
        let mut ctx = context(&workers, false);
        Arc::make_mut(&mut ctx.speculation).adaptive.stop_early = stop_early;
        let r = auto_after_a_right_draft(ctx).await;
        let proposals = workers.proposals();
        assert!(proposals.len() >= 5, "{proposals:?}");
        let stopped = proposals.iter().filter(|&&(k, n)| n < k).count();
        if stop_early {
            assert!(
                proposals.iter().all(|&(k, n)| n == k.min(3)),
                "{proposals:?}"
            );
            assert!(stopped >= proposals.len() - 1, "{proposals:?}");
        } else {
            assert_eq!(stopped, 0, "{proposals:?}");
            assert!(proposals.iter().any(|&(_, n)| n > 3), "{proposals:?}");
        }
        let u = usage(&r);
        assert_eq!(u.fallback, None);
        assert_eq!(u.draft_tokens_accepted, u.draft_tokens_proposed);
        assert_eq!(workers.open_sessions(), 0);
    }
}

/// Sampling stays exact when the draft stops early: the uncertain draft samples the
/// target's token at 0.85 and the other at 0.15, so whether a call stops after a token
/// depends on which one it drew. Every position of the completion must still be the
/// target's 0.6 token 60% of the time, over 2000 seeds (three standard errors), while
/// calls did stop early.
#[tokio::test]
async fn early_stops_keep_the_sampled_distribution() {
    let prompt = [5, 17, 42, 7, 9, 11];
    let (runs, n) = (2000, 6);
    let mut likely = vec![0usize; n];
    // One set of workers: the draft's draws go on from run to run.
    let workers = FakeWorkers::new(Script {
        uncertain: true,
        draft_odds: Some(0.85),
        ..Script::default()
    });
    for seed in 0..runs {
        let ctx = context(&workers, false);
        for _ in 0..50 {
            ctx.shared.observe_acceptance(Source::DraftModel, 8, 8);
        }
        let mut req = request(Method::Auto, 16, n);
        req.prompt = prompt.to_vec();
        req.sampling = SamplingParams {
            temperature: 1.0,
            seed,
            ..SamplingParams::greedy()
        };
        let r = run_with(ctx, req).await;
        assert_eq!(r.result, Ok(()));
        for (i, &t) in r.tokens.iter().enumerate() {
            let seq = [&prompt[..], &r.tokens[..i]].concat();
            likely[i] += usize::from(t == next_token(&seq));
        }
    }
    let proposals = workers.proposals();
    let stopped = proposals.iter().filter(|&&(k, n)| n < k).count();
    let whole = proposals.iter().filter(|&&(k, n)| n == k && k > 1).count();
    assert!(
        stopped > 1000 && whole > 100,
        "{stopped} stopped, {whole} whole"
    );
    for (i, &l) in likely.iter().enumerate() {
        let share = l as f64 / runs as f64;
        assert!((share - 0.6).abs() < 0.033, "token {i}: {share}");
    }
}

/// DRAFT_MODEL with K left to the server (`choose_k`): every round that has room drafts,
/// with the controller's K: up to the whole limit of 8 (past the configured 4) with a draft
/// that is always right, one token with a draft that gets every round's first token wrong.
/// On shared cores the first token is a target-only step (before the draft's prefill); on
/// separate devices the first round drafts the configured 4, as no cost is known yet. The
/// tokens stay the target's.
#[tokio::test(start_paused = true)]
async fn draft_model_without_k_drafts_every_round_as_many_tokens_as_pay() {
    let want = target_only(&[5, 17, 42, 7], 40);
    let ones = |n: usize| std::iter::repeat_n(1, n);
    for (wrong_at, concurrent_prefill, drafts) in [
        (None, false, vec![0, 3, 6, 8, 8, 8, 0]),
        (None, true, vec![4, 8, 8, 8, 7]),
        (
            Some(0),
            false,
            [0, 3].into_iter().chain(ones(37)).chain([0]).collect(),
        ),
    ] {
        let case = format!("wrong at {wrong_at:?}, concurrent prefill {concurrent_prefill}");
        let workers = FakeWorkers::new(Script {
            wrong_at,
            ..Script::default()
        });
        let mut req = request(Method::DRAFT_MODEL, 8, 40);
        req.choose_k = true;
        let r = run_with(context(&workers, concurrent_prefill), req).await;
        assert_eq!(r.result, Ok(()), "{case}");
        assert_eq!(r.tokens, want, "{case}");
        assert_eq!(workers.verified_drafts(), drafts, "{case}");
        let u = usage(&r);
        assert_eq!(
            (u.method, u.num_speculative_tokens),
            (Method::DRAFT_MODEL, 8)
        );
        assert_eq!(workers.open_sessions(), 0);
    }
}

/// A draft that falls far behind (its session opened while, other streams running, the
/// request went on with target-only steps) catches up in Proposes of at most
/// `MAX_PROPOSE_APPEND` tokens, not in one long prefill inside a batched pass; the text
/// stays the target's.
#[tokio::test(start_paused = true)]
async fn a_draft_far_behind_catches_up_in_bounded_pieces() {
    let workers = FakeWorkers::new(Script {
        draft_open: Duration::from_millis(300),
        verify_time: Duration::from_millis(1),
        ..Script::default()
    });
    let ctx = context(&workers, false);
    // Other generations run: the request does not wait for its draft session.
    ctx.metrics.running.inc();
    ctx.metrics.running.inc();
    let r = run_with(ctx, request(Method::DRAFT_MODEL, 4, 400)).await;
    assert_eq!(r.result, Ok(()));
    assert_eq!(r.tokens, target_only(&[5, 17, 42, 7], 400));
    let appended = workers.appended(Party::Draft);
    let max = duet_proto::MAX_PROPOSE_APPEND;
    assert!(appended.iter().all(|&n| n <= max), "{appended:?}");
    // Some 300 target-only steps while it opened: at least four full pieces.
    assert!(
        appended.iter().filter(|&&n| n == max).count() >= 4,
        "{appended:?}"
    );
    assert!(usage(&r).draft_tokens_accepted > 0);
    assert_eq!(workers.open_sessions(), 0);
}

/// Trees of drafts (a greedy request, a target that verifies them): with the draft wrong at
/// each round's second token and the target's token among its alternatives there, a round
/// commits three tokens (the first draft, that alternative, the target's next) where a
/// chain commits two. Each Verify carries the chain and one alternative beside each of its
/// tokens, as far as the session has room; the next one appends the alternative and the
/// target's token (the worker holds the alternative's row). The tokens stay the target's.
#[tokio::test]
async fn a_tree_commits_the_alternative_the_target_takes() {
    let want = target_only(&[5, 17, 42, 7], 24);
    for (width, rounds) in [(1, 9), (0, 12)] {
        let workers = FakeWorkers::new(Script {
            wrong_at: Some(1),
            ..Script::default()
        });
        let ctx = context_with_trees(&workers, width, 0.5);
        let metrics = ctx.metrics.clone();
        let r = run_with(ctx, request(Method::DRAFT_MODEL, 4, 24)).await;
        assert_eq!(r.result, Ok(()));
        assert_eq!(r.tokens, want, "width {width}");
        let u = usage(&r);
        assert_eq!(u.rounds, rounds, "width {width}");
        if width == 0 {
            assert!(workers.verified_parents().iter().all(Vec::is_empty));
            continue;
        }
        // Seven rounds of three tokens (the seventh, six tokens from the end, with room
        // for two alternatives); with three to go, room for two drafts and the first one's
        // alternative (two tokens), then a plain step.
        assert_eq!(workers.verified_drafts(), vec![8, 8, 8, 8, 8, 8, 6, 3, 0]);
        let parents = workers.verified_parents();
        assert_eq!(parents[0], vec![0, 1, 2, 3, 0, 1, 2, 3]);
        assert_eq!(parents[7], vec![0, 1, 0]);
        assert_eq!(
            workers.appended(Party::Target),
            vec![1, 2, 2, 2, 2, 2, 2, 2, 1]
        );
        assert_eq!((u.draft_tokens_proposed, u.draft_tokens_accepted), (57, 15));
        assert_eq!(metrics.tree_alternatives.get(), 27);
        assert_eq!(metrics.tree_alternatives_accepted.get(), 7);
    }
}

/// A request with penalties sends chains only (a position's penalties count the drafts
/// before it, in order), and its text is the target's.
#[tokio::test]
async fn a_request_with_penalties_sends_chains_only() {
    let workers = FakeWorkers::new(Script {
        wrong_at: Some(1),
        ..Script::default()
    });
    let ctx = context_with_trees(&workers, 1, 0.5);
    let mut req = request(Method::DRAFT_MODEL, 4, 24);
    req.penalties.frequency = 0.5;
    let r = run_with(ctx, req).await;
    assert_eq!(r.tokens, target_only(&[5, 17, 42, 7], 24));
    let parents = workers.verified_parents();
    assert!(
        !parents.is_empty() && parents.iter().all(Vec::is_empty),
        "{parents:?}"
    );
}

/// Replicas of one model may differ in what they verify (a CPU replica takes trees, a GPU
/// replica chains): a request whose session a failover moves to a replica that verifies
/// chains only sends it chains from then on (a tree there would be refused), and its text
/// stays the target's.
#[tokio::test]
async fn a_failover_to_a_replica_that_verifies_chains_only_sends_it_chains() {
    let workers = FakeWorkers::new(Script {
        wrong_at: Some(1),
        verify_fails: vec![(2, Failure::Unreachable("connection reset".into()))],
        reopened_chains_only: true,
        ..Script::default()
    });
    let ctx = context_with_trees(&workers, 1, 0.5);
    let r = run_with(ctx, request(Method::DRAFT_MODEL, 4, 24)).await;
    assert_eq!(r.result, Ok(()));
    assert_eq!(r.tokens, target_only(&[5, 17, 42, 7], 24));
    assert_eq!(usage(&r).target_failovers.len(), 1);
    // The two Verify calls answered before the lost one verified trees; every one after
    // it, chains.
    let parents = workers.verified_parents();
    assert!(parents.len() > 2);
    assert!(parents[..2].iter().all(|p| !p.is_empty()), "{parents:?}");
    assert!(parents[2..].iter().all(Vec::is_empty), "{parents:?}");
}

/// A sampling request's alternatives are more draws from the draft's q, verified by
/// multi-candidate rejection sampling: with point masses (the draft's wrong token drawn
/// again) they add nothing, and the text is the target's. A target-worker that verifies
/// chains only (on a GPU) gets chains.
#[tokio::test]
async fn sampling_trees_draw_from_q_and_chains_go_where_trees_are_not_verified() {
    for (sampling, verifies_trees) in [(true, true), (false, false)] {
        let workers = FakeWorkers::new(Script {
            wrong_at: Some(1),
            chains_only: !verifies_trees,
            ..Script::default()
        });
        let ctx = context_with_trees(&workers, 1, 0.5);
        let mut req = request(Method::DRAFT_MODEL, 4, 24);
        if sampling {
            // Point masses throughout: the sampled output is the target's greedy text.
            req.sampling = SamplingParams {
                temperature: 1.0,
                ..SamplingParams::greedy()
            };
        }
        let r = run_with(ctx, req).await;
        assert_eq!(r.result, Ok(()));
        assert_eq!(r.tokens, target_only(&[5, 17, 42, 7], 24));
        let parents = workers.verified_parents();
        assert!(!parents.is_empty());
        assert_eq!(parents.iter().all(Vec::is_empty), !verifies_trees);
        assert_eq!(usage(&r).rounds, 12);
    }
}

/// A sampling session's chain is tested on the target (`SamplingTest`: each draft's q(x),
/// each q whole, and where the request's random stream stands), and a seed gives the same
/// text as where the target answers every p and the tests run here (a target-worker from
/// before them), and as where the target ignores the whole q's (one from before those):
/// the draft model's drafts (a rejection's correction drawn on the target, or here from p
/// there and the draft's q where the target ignores them), a lookup's (point masses: the
/// target draws it) and target-only steps. The fakes are uncertain (0.6 on the target's
/// token), so drafts are rejected.
#[tokio::test]
async fn a_chain_tested_on_the_target_samples_the_text_tested_here() {
    let cases = [
        (Method::DRAFT_MODEL, Target::Hash),
        (Method::NGRAM, Target::Cycle(3)),
        (Method::NONE, Target::Hash),
    ];
    for (method, target) in cases {
        let (mut tests, mut left_here, mut texts) = (0, 0, std::collections::BTreeSet::new());
        let (mut proposed, mut accepted) = (0, 0);
        for seed in 0..12 {
            let mut req = request(method, 3, 24);
            req.sampling = SamplingParams {
                temperature: 1.0,
                seed,
                ..SamplingParams::greedy()
            };
            let script = |no_sampling_test, no_whole_q| Script {
                uncertain: true,
                target,
                no_sampling_test,
                no_whole_q,
                ..Script::default()
            };
            let (before, no_whole, workers) = (
                FakeWorkers::new(script(true, false)),
                FakeWorkers::new(script(false, true)),
                FakeWorkers::new(script(false, false)),
            );
            let mut runs = Vec::new();
            for w in [&before, &no_whole, &workers] {
                let mut ctx = context(w, false);
                Arc::make_mut(&mut ctx.speculation).target_streams = false;
                runs.push(run_with(ctx, req.clone()).await);
            }
            assert_eq!(runs[2].result, Ok(()), "{method:?}, seed {seed}");
            assert_eq!(runs[1].tokens, runs[0].tokens, "{method:?}, seed {seed}");
            assert_eq!(runs[2].tokens, runs[0].tokens, "{method:?}, seed {seed}");
            assert_eq!(before.sampling_tests(), (0, 0));
            let (t, here) = no_whole.sampling_tests();
            assert_eq!(
                workers.sampling_tests(),
                (t, 0),
                "{method:?}: none left here"
            );
            assert_eq!(
                t,
                workers.verified_drafts().len(),
                "{method:?}: every Verify tested"
            );
            (tests, left_here) = (tests + t, left_here + here);
            let u = usage(&runs[2]);
            (proposed, accepted) = (
                proposed + u.draft_tokens_proposed,
                accepted + u.draft_tokens_accepted,
            );
            texts.insert(runs[2].tokens.clone());
        }
        if method != Method::NONE {
            // Drafts were proposed, and rejected too.
            assert!(
                accepted > 10 && proposed > accepted + 10,
                "{method:?}: {accepted} of {proposed}"
            );
        }
        assert!(
            texts.len() > 6,
            "{method:?}: {} texts of 12 seeds",
            texts.len()
        );
        match method {
            Method::DRAFT_MODEL => assert!(left_here > 10, "{left_here} of {tests}"),
            _ => assert_eq!(left_here, 0, "{method:?}"),
        }
    }
}
