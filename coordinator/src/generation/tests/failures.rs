//! Failures through fake workers: the draft-worker failing or answering what does not fit
//! (target-only from there, same text; its breaker), the target failing, busy or lost
//! (asked again, failed over, bounded), and the caller going away, stalling or outliving
//! the drain deadline.

use super::*;

/// The draft-worker failing mid-stream: the rest runs target-only with the same tokens, the
/// usage says why, and the breaker is tripped, except when the worker was only busy.
#[tokio::test]
async fn a_draft_failure_mid_stream_turns_the_request_target_only() {
    let want = target_only(&[5, 17, 42, 7], 30);
    for (failure, trips) in [
        (Failure::Unreachable("connection reset".into()), 1),
        (
            Failure::TimedOut("draft Propose took longer than 50 ms".into()),
            1,
        ),
        (Failure::Busy("the model queue is full".into()), 0),
    ] {
        let workers = FakeWorkers::new(Script {
            wrong_at: Some(2),
            propose_fails: Some((3, failure.clone())),
            ..Script::default()
        });
        let r = run(&workers, request(Method::DRAFT_MODEL, 4, 30)).await;
        assert_eq!(r.result, Ok(()));
        assert_eq!(r.tokens, want, "{failure}");
        let u = usage(&r);
        // Three rounds of 4 drafts with 2 accepted, then one token per round.
        assert_eq!((u.draft_tokens_proposed, u.draft_tokens_accepted), (12, 6));
        assert_eq!(u.rounds, 3 + (30 - 9));
        let reason = u.fallback.as_deref().unwrap_or_default();
        assert!(reason.starts_with("draft-worker: "), "{reason}");
        assert!(reason.contains(&failure.to_string()), "{reason}");
        assert_eq!(workers.trips().len(), trips, "{failure}");
        assert_eq!(workers.open_sessions(), 0);
    }
}

/// A draft answer that does not fit the call is a failure of the draft-worker: fallback
/// and breaker, never a failed request.
#[tokio::test]
async fn a_malformed_draft_answer_falls_back_and_trips_the_breaker() {
    for (how, sampling, what) in [
        (Malformed::ExtraToken, false, "5 tokens, 4 were asked for"),
        (
            Malformed::OutOfVocabulary,
            false,
            "token 1000000 is outside the vocabulary",
        ),
        (
            Malformed::NoDistributions,
            true,
            "0 distributions for 4 tokens",
        ),
    ] {
        let workers = FakeWorkers::new(Script {
            propose_malformed: Some((1, how)),
            ..Script::default()
        });
        let mut req = request(Method::DRAFT_MODEL, 4, 30);
        if sampling {
            // Point masses throughout: the sampled output is the target's greedy text.
            req.sampling = SamplingParams {
                temperature: 1.0,
                ..SamplingParams::greedy()
            };
        }
        let r = run(&workers, req).await;
        assert_eq!(r.result, Ok(()), "{how:?}");
        assert_eq!(r.tokens, target_only(&[5, 17, 42, 7], 30), "{how:?}");
        let u = usage(&r);
        assert_eq!((u.draft_tokens_proposed, u.draft_tokens_accepted), (4, 4));
        let reason = u.fallback.as_deref().unwrap_or_default();
        assert!(
            reason.contains("malformed answer") && reason.contains(what),
            "{reason}"
        );
        assert_eq!(workers.trips(), vec![reason.to_string()], "{how:?}");
    }
}

#[tokio::test]
async fn an_open_breaker_skips_the_draft_worker() {
    let workers = FakeWorkers::new(Script {
        draft_unavailable: Some("draft-worker skipped (circuit open): slow".into()),
        ..Script::default()
    });
    let r = run(&workers, request(Method::DRAFT_MODEL, 4, 10)).await;
    assert_eq!(r.tokens, target_only(&[5, 17, 42, 7], 10));
    let u = usage(&r);
    assert_eq!((u.rounds, u.draft_tokens_proposed), (10, 0));
    assert_eq!(
        u.fallback.as_deref(),
        Some("draft-worker skipped (circuit open): slow")
    );
    // Asked for, so reported: the method and K the request ran with.
    assert_eq!(
        (u.method, u.num_speculative_tokens),
        (Method::DRAFT_MODEL, 4)
    );
}

/// The target-worker failing (not losing the session: failing on it) ends the request
/// with its error, and both sessions close.
#[tokio::test]
async fn a_target_failure_ends_the_request() {
    let workers = FakeWorkers::new(Script {
        verify_fails: vec![(2, Failure::Failed("model error".into()))],
        ..Script::default()
    });
    let r = run(&workers, request(Method::DRAFT_MODEL, 4, 30)).await;
    assert_eq!(
        r.result,
        Err(Abort::Worker(CallError::new(
            Party::Target,
            Failure::Failed("model error".into())
        )))
    );
    assert_eq!(r.chunks, 2, "the rounds before the failure were sent");
    assert!(r.finished.is_none());
    assert_eq!(workers.open_sessions(), 0);
}

/// A target that answers "busy" (its queue full: nothing was run) is asked again after a
/// pause: the request goes on with the target's own tokens and no failover. Busy past the
/// retries (16, about 2 s), it ends with that failure.
#[tokio::test(start_paused = true)]
async fn a_busy_target_is_asked_again() {
    let busy = Failure::Busy("the model queue is full".into());
    let want = target_only(&[5, 17, 42, 7], 30);
    let workers = FakeWorkers::new(Script {
        verify_fails: vec![(2, busy.clone()), (3, busy.clone()), (4, busy.clone())],
        ..Script::default()
    });
    let r = run(&workers, request(Method::DRAFT_MODEL, 4, 30)).await;
    assert_eq!(r.result, Ok(()));
    assert_eq!(r.tokens, want);
    assert_eq!(usage(&r).target_failovers.len(), 0);
    assert_eq!(workers.target_opens(), vec![(4, 0)]);

    let workers = FakeWorkers::new(Script {
        verify_fails: (2..2 + 17).map(|n| (n, busy.clone())).collect(),
        ..Script::default()
    });
    let r = run(&workers, request(Method::NONE, 0, 30)).await;
    assert_eq!(
        r.result,
        Err(Abort::Worker(CallError::new(Party::Target, busy)))
    );
    assert_eq!(workers.open_sessions(), 0);
}

/// The target replica lost mid-stream (gone, stuck, or restarted without the session), at
/// any round, with or without rejected drafts: the request reopens its target session from
/// the committed tokens and the output is the target's own, the failover in `usage`.
#[tokio::test]
async fn a_lost_target_replica_costs_a_failover_not_the_request() {
    let prompt = [5, 17, 42, 7];
    let want = target_only(&prompt, 30);
    let lost = [
        Failure::Unreachable("connection reset".into()),
        Failure::TimedOut("target Verify took longer than 60000 ms".into()),
        Failure::SessionLost("session 9 not found".into()),
    ];
    for (method, k, wrong_at) in [
        (Method::NONE, 0, None),
        (Method::DRAFT_MODEL, 4, None),
        (Method::DRAFT_MODEL, 4, Some(1)),
        (Method::Auto, 8, None),
    ] {
        for (at, failure) in [0, 1, 3].into_iter().zip(lost.iter().cycle()) {
            let workers = FakeWorkers::new(Script {
                wrong_at,
                verify_fails: vec![(at, failure.clone())],
                ..Script::default()
            });
            let r = run(&workers, request(method, k, 30)).await;
            let case = format!("{method:?} wrong at {wrong_at:?}, lost at verify {at}");
            assert_eq!(r.result, Ok(()), "{case}");
            assert_eq!(r.tokens, want, "{case}");
            let u = usage(&r);
            assert_eq!(u.target_failovers.len(), 1, "{case}");
            let (committed, reason) = &u.target_failovers[0];
            assert_eq!(reason, &format!("target-worker: {failure}"), "{case}");
            // Reopened with the prompt and everything committed before the lost call, the
            // committed tokens marked generated (fed as the lost session's calls fed them).
            assert_eq!(
                workers.target_opens(),
                vec![(prompt.len(), 0), (prompt.len() + committed, prompt.len())],
                "{case}"
            );
            assert_eq!(workers.open_sessions(), 0, "{case}");
        }
    }
}

/// A replica lost while every other one is full: the failover waits for room (backing off
/// 50 then 100 ms) instead of failing the request, and the wait shows as admission wait.
#[tokio::test(start_paused = true)]
async fn a_failover_waits_for_room_on_the_other_replicas() {
    let prompt = [5, 17, 42, 7];
    let workers = FakeWorkers::new(Script {
        verify_fails: vec![(2, Failure::Unreachable("connection reset".into()))],
        reopen_busy: 2,
        ..Script::default()
    });
    let r = run(&workers, request(Method::NONE, 0, 30)).await;
    assert_eq!(r.result, Ok(()));
    assert_eq!(r.tokens, target_only(&prompt, 30));
    let u = usage(&r);
    assert_eq!(u.target_failovers.len(), 1);
    assert_eq!(u.timings.admission_wait, 150.0);
    assert_eq!(workers.open_sessions(), 0);
}

/// A replica lost again and again: `max_failovers` (2) rebuilds, then the request ends
/// with the failure.
#[tokio::test]
async fn failovers_are_bounded() {
    let gone = Failure::Unreachable("connection refused".into());
    let workers = FakeWorkers::new(Script {
        verify_fails: (2..5).map(|n| (n, gone.clone())).collect(),
        ..Script::default()
    });
    let r = run(&workers, request(Method::NONE, 0, 30)).await;
    assert_eq!(
        r.result,
        Err(Abort::Worker(CallError::new(Party::Target, gone)))
    );
    assert_eq!(workers.target_opens(), vec![(4, 0), (6, 4), (6, 4)]);
    assert_eq!(workers.open_sessions(), 0);
}

/// The caller dropping its stream stops the generation and frees both sessions.
#[tokio::test]
async fn the_caller_going_away_stops_it() {
    let workers = FakeWorkers::new(Script::default());
    let ctx = context(&workers, true);
    let (tx, mut rx) = mpsc::channel(1);
    let req = request(Method::DRAFT_MODEL, 2, 200);
    let task = tokio::spawn(async move { generate(ctx, req, Arrival::now(), &tx).await });
    assert!(matches!(rx.recv().await, Some(Event::Chunk(_))));
    drop(rx);
    assert_eq!(task.await.unwrap(), Err(Abort::CallerGone));
    assert_eq!(workers.open_sessions(), 0);
}

/// A caller that stops reading (its stream full, the stream still open) loses the
/// generation after `stall_timeout`: both sessions close and the metric counts it.
#[tokio::test(start_paused = true)]
async fn a_caller_that_stops_reading_is_cut_off() {
    let workers = FakeWorkers::new(Script::default());
    let ctx = context(&workers, false);
    let metrics = ctx.metrics.clone();
    let (tx, mut rx) = mpsc::channel(2);
    let req = request(Method::DRAFT_MODEL, 2, 200);
    let started = tokio::time::Instant::now();
    let task = tokio::spawn(async move { generate(ctx, req, Arrival::now(), &tx).await });
    assert!(matches!(rx.recv().await, Some(Event::Chunk(_))));
    // Reads no more.
    assert_eq!(task.await.unwrap(), Err(Abort::Stalled(30_000)));
    assert_eq!(started.elapsed(), Duration::from_secs(30));
    assert_eq!(workers.open_sessions(), 0);
    assert_eq!(metrics.stalled_streams.get(), 1);
    drop(rx);
}

/// Past the drain deadline a generation ends as `cancelled`, and its final message still
/// goes to a caller that reads (the deadline only cuts off sends that cannot go through).
#[tokio::test]
async fn past_the_drain_deadline_the_final_message_still_goes() {
    for _ in 0..20 {
        let workers = FakeWorkers::new(Script::default());
        let ctx = context(&workers, false);
        ctx.stopping.trigger();
        let r = run_with(ctx, request(Method::NONE, 0, 200)).await;
        assert_eq!(r.result, Ok(()));
        assert_eq!(r.finished.unwrap().reason, FinishReason::Cancelled);
    }
}

/// A stalled caller does not hold up the drain: at its deadline the send gives up.
#[tokio::test(start_paused = true)]
async fn the_drain_deadline_cuts_off_a_stalled_caller() {
    let workers = FakeWorkers::new(Script::default());
    let ctx = context(&workers, false);
    let stopping = ctx.stopping.clone();
    let (tx, _rx) = mpsc::channel(1);
    let req = request(Method::NONE, 0, 200);
    let task = tokio::spawn(async move { generate(ctx, req, Arrival::now(), &tx).await });
    tokio::time::sleep(Duration::from_secs(5)).await;
    stopping.trigger();
    assert_eq!(task.await.unwrap(), Err(Abort::Stalled(5_000)));
    assert_eq!(workers.open_sessions(), 0);
}

#[test]
fn a_target_answer_that_does_not_fit_is_malformed() {
    let vocab = 100;
    let v = |choice| Verified {
        choice,
        logprobs: Vec::new(),
        timing: WorkerTiming::default(),
        give_way: false,
        pass: None,
    };
    let tested = |accepted, next| {
        v(TargetChoice::Tested {
            accepted,
            next,
            rng_position: 8,
        })
    };
    let ok = v(TargetChoice::Argmax(vec![1, 2, 3]));
    let two = Tree::chain(&[1, 2]);
    assert_eq!(check_verified(&ok, &two, vocab, true), Ok(()));
    for ok in [
        tested(2, Next::Drawn(3)),
        tested(1, Next::Rejected(Distribution::point(1))),
    ] {
        assert_eq!(check_verified(&ok, &two, vocab, false), Ok(()));
    }
    for (answer, greedy, what) in [
        (
            v(TargetChoice::Argmax(vec![1, 2])),
            true,
            "2 positions for 2 drafts",
        ),
        (
            v(TargetChoice::Argmax(vec![1, 2, 300])),
            true,
            "token 300 is outside",
        ),
        (
            v(TargetChoice::Argmax(vec![1, 2, 3])),
            false,
            "argmaxes for a sampling session",
        ),
        (
            v(TargetChoice::P(vec![Distribution::point(1); 3])),
            true,
            "a sampling answer for a greedy session",
        ),
        (
            tested(0, Next::Drawn(1)),
            true,
            "a sampling answer for a greedy session",
        ),
        (tested(3, Next::Drawn(1)), false, "3 of 2 accepted"),
        (
            tested(2, Next::Rejected(Distribution::point(1))),
            false,
            "all 2 accepted and no token",
        ),
        (tested(1, Next::Drawn(300)), false, "token 300 is outside"),
        (
            tested(0, Next::Rejected(Distribution::point(500))),
            false,
            "beyond the vocabulary",
        ),
        (
            v(TargetChoice::P(vec![Distribution::point(500); 3])),
            false,
            "beyond the vocabulary",
        ),
    ] {
        let e = check_verified(&answer, &two, vocab, greedy).unwrap_err();
        assert_eq!(e.party, Party::Target);
        assert!(e.to_string().contains(what), "{e}");
    }
    // A tree's Verify carries no test: a verdict for one does not fit it.
    let tree = Tree::of(&[1], &[vec![2]], 8);
    let e = check_verified(&tested(1, Next::Drawn(3)), &tree, vocab, false).unwrap_err();
    assert!(
        e.to_string().contains("a sampling verdict for a tree"),
        "{e}"
    );
}

/// A Decode stream's lookup pass fits where its tokens are its accepted drafts and then
/// at most the target's own (the last, its choice), with a figure a token where the
/// request asks for them; otherwise the answer is malformed.
#[test]
fn a_lookup_pass_that_does_not_fit_is_malformed() {
    use super::super::target::check_pass;
    use crate::workers::LookupPass;
    let pass = |drafts: &[u32], accepted, tokens: &[u32], figures| Verified {
        choice: TargetChoice::Argmax(vec![*tokens.last().unwrap()]),
        logprobs: vec![TokenLogprobs::default(); figures],
        timing: WorkerTiming::default(),
        give_way: false,
        pass: Some(LookupPass {
            drafts: drafts.to_vec(),
            matched: 3,
            accepted,
            tokens: tokens.to_vec(),
        }),
    };
    let plain = request(Method::Auto, 8, 20);
    let figures = ValidRequest {
        logprobs: Some(0),
        ..plain.clone()
    };
    let check = |v: &Verified, req| check_pass(v.pass.as_ref().unwrap(), v, 100, req);
    for (v, req) in [
        (pass(&[4, 5, 6], 2, &[4, 5, 9], 0), &plain),
        (pass(&[4, 5, 6], 0, &[9], 0), &plain),
        // A stop token among the drafts ended the stream after them.
        (pass(&[4, 5, 6], 2, &[4, 5], 0), &plain),
        (pass(&[4, 5, 6], 3, &[4, 5, 6, 9], 4), &figures),
    ] {
        assert_eq!(check(&v, req), Ok(()));
    }
    for (v, req, what) in [
        (
            pass(&[4, 5, 6], 4, &[4, 5, 6, 9], 0),
            &plain,
            "4 of 3 drafts",
        ),
        (
            pass(&[4, 5, 6], 1, &[4, 5, 6], 0),
            &plain,
            "3 tokens, 1 of 3",
        ),
        (
            pass(&[4, 5, 6], 2, &[4, 7, 9], 0),
            &plain,
            "not its accepted drafts",
        ),
        (
            pass(&[4, 500], 1, &[4, 9], 0),
            &plain,
            "token 500 is outside",
        ),
        (
            pass(&[4, 5], 1, &[4, 9], 1),
            &figures,
            "logprobs for 1 tokens; 2",
        ),
    ] {
        let e = check(&v, req).unwrap_err();
        assert_eq!(e.party, Party::Target);
        assert!(e.to_string().contains(what), "{e}");
    }
}
