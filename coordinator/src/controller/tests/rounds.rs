//! A round's other choices: drafting ahead (guesses that hold, a draft that fits beside the
//! pass, the slowdown it causes), passes shared in a batch, where the draft stops, verified
//! alternatives, and the overheads learnt apart by mode and paid off by streaming.

use super::*;

/// Drafting ahead pays when the draft's guesses usually hold, or when drafting ahead fits
/// inside the target's pass (a miss then costs nothing); not when the guesses fail and the
/// target would wait for a long draft.
#[test]
fn drafting_ahead_needs_guesses_that_hold_or_a_draft_that_fits() {
    let good = seen(Source::DraftModel, 30, 4, 4);
    let bad = seen(Source::DraftModel, 30, 4, 0);
    // A slow draft: 5 tokens ahead take 100 ms, the pass 75 ms.
    let slow = Costs {
        draft_per_token: 20.0,
        draft_ahead_per_token: 20.0,
        ..cpu()
    };
    assert!(good.draft_ahead(&slow, 4, Overlap::Waited));
    assert!(!bad.draft_ahead(&slow, 4, Overlap::Waited));
    // A fast draft: 5 tokens ahead (25 ms) fit in the pass; even bad guesses cost nothing.
    let fast = Costs {
        draft_per_token: 5.0,
        draft_ahead_per_token: 5.0,
        ..cpu()
    };
    assert!(good.draft_ahead(&fast, 4, Overlap::Waited));
    assert!(bad.draft_ahead(&fast, 4, Overlap::Waited));
    // No drafts this round: nothing to go on from.
    assert!(!good.draft_ahead(&fast, 0, Overlap::Waited));
}

/// Where a rejection drops the call made ahead (greedy requests), a round waits for a draft
/// slower than the pass only when it accepts all its drafts (otherwise for the draft step
/// under way): with guesses that hold about a third of the time, 9 tokens ahead (180 ms)
/// beside a 107 ms pass pay then, and do not where every round waits for them.
#[test]
fn a_call_made_ahead_that_a_rejection_drops_costs_the_rounds_that_use_it() {
    let c = seen(Source::DraftModel, 30, 8, 7);
    let slow = Costs {
        draft_per_token: 20.0,
        draft_ahead_per_token: 20.0,
        ..cpu()
    };
    let odds = c.draft.odds(slow.draft_prior);
    let all = odds.first * odds.next.powi(7);
    assert!((0.3..0.4).contains(&all), "{odds:?}");
    let waited = c.ahead(&slow, odds, 8, Overlap::Waited);
    let dropped = c.ahead(&slow, odds, 8, Overlap::Dropped);
    assert!((waited.extra - 73.0).abs() < 1e-9, "{}", waited.extra);
    let expected = all * 73.0 + (1.0 - all) * 20.0;
    assert!((dropped.extra - expected).abs() < 1e-9, "{}", dropped.extra);
    assert!(!c.draft_ahead(&slow, 8, Overlap::Waited));
    assert!(c.draft_ahead(&slow, 8, Overlap::Dropped));
}

/// On shared cores the target's pass slows beside the draft, and every round drafted ahead
/// pays that: drafting ahead is declined once it costs more than the drafting it saves, even
/// with guesses that always hold.
#[test]
fn drafting_ahead_is_declined_where_it_slows_the_target() {
    let good = seen(Source::DraftModel, 30, 4, 4);
    // The next round's 4 drafts (57 ms) are ready 95% of the time: 54 ms saved a round. The
    // pass (5 rows) takes 75 ms; the 5 tokens drafted ahead 70 ms, inside it.
    let slowed = |ahead_slowdown| Costs {
        ahead_slowdown,
        ..cpu()
    };
    // Separate devices, or a pass half as slow again (37.5 ms more): it pays.
    assert!(good.draft_ahead(&slowed(0.0), 4, Overlap::Waited));
    assert!(good.draft_ahead(&slowed(0.5), 4, Overlap::Waited));
    // Twice as slow (75 ms more): it does not.
    assert!(!good.draft_ahead(&slowed(1.0), 4, Overlap::Waited));
}

/// Where the draft model drafts ahead, its drafting is paid only on the rounds whose drafts
/// were not made ahead: a draft as slow as a target pass does not pay for itself on its own
/// rounds, but does when its drafting hides behind the passes, unless they slow beside it.
#[test]
fn drafting_that_hides_behind_the_pass_makes_the_draft_model_pay() {
    let c = seen(Source::DraftModel, 30, 4, 4);
    // On shared cores both slow: the pass, and the draft beside it.
    let slow_draft = |ahead_slowdown: f64| Costs {
        draft_per_token: 40.0,
        draft_ahead_per_token: 40.0 * (1.0 + ahead_slowdown),
        ahead_slowdown,
        ..cpu()
    };
    let overlap = |overlap| Options {
        overlap,
        ..draft_only(16)
    };
    assert_eq!(
        c.plan(&slow_draft(0.0), &overlap(Overlap::Off)),
        Plan::TARGET_ONLY
    );
    assert_eq!(
        c.plan(&slow_draft(0.0), &overlap(Overlap::Waited)),
        Plan::exactly(Proposer::DraftModel, 1)
    );
    assert_eq!(
        c.plan(&slow_draft(1.0), &overlap(Overlap::Waited)),
        Plan::TARGET_ONLY
    );
}

/// Passes beside a Propose made ahead measure the slowdown (against the line fitted to the
/// passes without one) and the draft's time per token ahead, and leave the line alone;
/// declined chances to draft ahead fade the slowdown toward none.
#[test]
fn passes_beside_drafting_ahead_measure_the_slowdown() {
    let shared = Shared::default();
    for rows in [1, 2, 5, 9] {
        shared.observe_round(&RoundCosts {
            pass_rows: rows,
            pass_ms: 35.0 + 8.0 * rows as f64,
            ..RoundCosts::default()
        });
    }
    for i in 0..20 {
        shared.observe_round(&RoundCosts {
            pass_rows: 5,
            pass_ms: 1.5 * 75.0,
            // One call failed: its pass counts, its time does not.
            beside_ahead: Some(if i == 0 { (0.0, 0) } else { (30.0, 3) }),
            ..RoundCosts::default()
        });
    }
    let c = shared.costs(Mode::Greedy).unwrap();
    for rows in [1.0, 5.0, 9.0] {
        let ms = c.pass.ms(rows);
        assert!((ms - (35.0 + 8.0 * rows)).abs() < 1e-9, "{rows}: {ms}");
    }
    assert!((c.draft_ahead_per_token - 10.0).abs() < 1e-9);
    // 20 passes at 0.5 against the prior, a quarter of a pass at none.
    let weight: f64 = (0..20).map(|i| SHARED_KEEP.powi(i)).sum();
    let measured = 0.5 * weight / (weight + AHEAD_PRIOR_WEIGHT);
    assert!(
        (c.ahead_slowdown - measured).abs() < 1e-9,
        "{}",
        c.ahead_slowdown
    );
    for _ in 0..100 {
        shared.ahead_declined();
    }
    let faded = weight * SHARED_KEEP.powi(100);
    let expected = 0.5 * faded / (faded + AHEAD_PRIOR_WEIGHT);
    let c = shared.costs(Mode::Greedy).unwrap();
    assert!(
        (c.ahead_slowdown - expected).abs() < 1e-9,
        "{}",
        c.ahead_slowdown
    );
    assert!(c.ahead_slowdown < measured - 0.04);
}

/// Every request in a pass reports it: eight reports of a pass of eight calls weigh what one
/// report of a pass alone does, so the pass time is a mean over passes, whatever the batch.
#[test]
fn a_pass_shared_by_eight_requests_counts_once() {
    let (by_each, once) = (Shared::default(), Shared::default());
    for shared in [&by_each, &once] {
        for i in 0..60 {
            pass(shared, 1 + i % 6);
        }
    }
    let report = |shared: &Shared, calls: usize, rows: usize| {
        shared.observe_round(&RoundCosts {
            pass_calls: calls,
            pass_rows: rows,
            pass_ms: roofline(rows),
            committed: 1,
            ..RoundCosts::default()
        })
    };
    for i in 0..10 {
        let rows = 8 + i % 7;
        for _ in 0..8 {
            report(&by_each, 8, rows);
        }
        report(&once, 1, rows);
    }
    let weight = |s: &Shared| s.lock().passes.weight();
    let (w8, w1) = (weight(&by_each), weight(&once));
    assert!((w8 - w1).abs() < 0.01 * w1, "{w8} {w1}");
    let (p8, p1) = (
        by_each.costs(Mode::Greedy).unwrap().pass,
        once.costs(Mode::Greedy).unwrap().pass,
    );
    for rows in 1..=14 {
        let (a, b) = (p8.ms(rows as f64), p1.ms(rows as f64));
        assert!((a - b).abs() < 0.01 * b, "{rows}: {a} {b}");
    }
}

/// A request whose first rounds ran alone (the other streams still prefilling) does not
/// judge the draft model as if alone when seven more generations run on its coordinator:
/// each is a row of the batch to come, in which the draft does not pay on the roofline.
#[test]
fn generations_running_beside_count_before_their_passes_are_seen() {
    let shared = alone_then_in_batches();
    for _ in 0..10 {
        pass(&shared, 1);
    }
    let mut c = Controller::default();
    c.observe_batch(1, 1, 1);
    let costs = shared.costs(Mode::Greedy).unwrap();
    assert_eq!(
        c.plan(&costs, &draft_only(8)).proposer,
        Proposer::DraftModel
    );
    c.observe_running(8);
    assert_eq!(c.plan(&costs, &draft_only(8)), Plan::TARGET_ONLY);
    c.observe_running(1);
    assert_eq!(
        c.plan(&costs, &draft_only(8)).proposer,
        Proposer::DraftModel
    );
}

/// With `stop_early`, a draft-model round stops drafting where one more token is worth
/// less than the round's own rate: after drafts the draft believes all right with
/// probability `sure`, when `sure < value * (draft step + verified row)`. A cheap draft and
/// nearly free rows (a GPU) draft on through more doubt; the rows of a batch make each
/// token dearer and stop sooner. Target-only, lookup and exact plans never stop early.
#[test]
fn the_draft_stops_where_one_more_token_is_worth_less_than_the_round() {
    let c = seen(Source::DraftModel, 10, 4, 4);
    let options = Options {
        stop_early: true,
        trees: false,
        streaming: false,
        ..draft_only(8)
    };
    let alone = c.plan(&cpu(), &options);
    assert_eq!(alone.proposer, Proposer::DraftModel);
    let odds = c.draft.odds(cpu().draft_prior);
    let value = c.value(
        &cpu(),
        Some((odds, Proposer::DraftModel, 0.0)),
        alone.k,
        Overlap::Off,
        false,
    );
    assert_eq!(alone.stop_below, (value * (14.0 + 8.0)) as f32);
    assert!(
        alone.stop_below > 0.5 && alone.stop_below < 1.0,
        "{alone:?}"
    );
    assert_eq!(c.plan(&cpu(), &draft_only(8)).stop_below, 0.0);
    let gpu = Costs {
        pass: PassTime::line(20.0, 0.05),
        draft_per_token: 3.0,
        ..cpu()
    };
    let on_gpu = c.plan(&gpu, &options);
    assert_eq!(on_gpu.proposer, Proposer::DraftModel);
    assert!(
        on_gpu.stop_below < alone.stop_below,
        "{on_gpu:?} vs {alone:?}"
    );
    // Three other sessions on the GPU, a row each in every pass.
    let mut batched = seen(Source::DraftModel, 10, 4, 4);
    for _ in 0..20 {
        batched.observe_batch(4, 3 + on_gpu.k + 1, on_gpu.k + 1);
    }
    let in_batch = batched.plan(&gpu, &options);
    assert_eq!(in_batch.proposer, Proposer::DraftModel);
    assert!(
        in_batch.stop_below > on_gpu.stop_below,
        "{in_batch:?} vs {on_gpu:?}"
    );
    let lookup = Options {
        stop_early: true,
        trees: false,
        streaming: false,
        ..lookup_only(8)
    };
    let l = seen(Source::Ngram(2), 20, 8, 8).plan(&cpu(), &lookup);
    assert_eq!((l.proposer, l.stop_below), (Proposer::Ngram, 0.0));
}

/// With `trees`, a draft-model round verifies the draft's other likely tokens where one
/// more verified row costs less than what the alternative is likely to add: its
/// probability (times its drafts' before it) above `value * row_ms`. Nearly free rows (a
/// GPU) take far less likely alternatives than a CPU's; without `trees`, and for rounds
/// that are not the draft model's, none.
#[test]
fn alternatives_are_verified_where_a_row_costs_less_than_they_add() {
    let c = seen(Source::DraftModel, 10, 4, 2);
    let options = Options {
        trees: true,
        streaming: false,
        ..draft_only(8)
    };
    let on_cpu = c.plan(&cpu(), &options);
    assert_eq!(on_cpu.proposer, Proposer::DraftModel);
    let odds = c.draft.odds(cpu().draft_prior);
    let value = c.value(
        &cpu(),
        Some((odds, Proposer::DraftModel, 0.0)),
        on_cpu.k,
        Overlap::Off,
        false,
    );
    assert_eq!(on_cpu.alternatives_above, (value * 8.0) as f32);
    assert!(on_cpu.alternatives_above > 0.1, "{on_cpu:?}");
    assert_eq!(c.plan(&cpu(), &draft_only(8)).alternatives_above, 0.0);
    let gpu = Costs {
        pass: PassTime::line(20.0, 0.05),
        draft_per_token: 3.0,
        ..cpu()
    };
    let on_gpu = c.plan(&gpu, &options);
    assert!(
        on_gpu.alternatives_above < on_cpu.alternatives_above / 10.0,
        "{on_gpu:?} vs {on_cpu:?}"
    );
    let lookup = seen(Source::Ngram(ngram_bucket(8, None)), 10, 8, 8);
    let plan = lookup.plan(
        &cpu(),
        &Options {
            trees: true,
            streaming: false,
            ..lookup_only(8)
        },
    );
    assert_eq!(
        (plan.proposer, plan.alternatives_above),
        (Proposer::Ngram, 0.0)
    );
}

/// Greedy and sampling requests learn their rounds' overheads apart: a sampling round's
/// answers carry whole distributions (here 6 ms against 0.3 ms a target-only round, 22 ms
/// against 6 ms a draft-model round), and a mean of both would make each plan with the
/// other's. Before any round of its own a mode starts from the guesses.
#[test]
fn greedy_and_sampling_overheads_are_learnt_apart() {
    let shared = Shared::default();
    let round = |mode, draft_tokens, overhead| RoundCosts {
        pass_calls: 1,
        pass_rows: 1,
        pass_ms: 40.0,
        draft_tokens,
        overhead_ms: Some(overhead),
        committed: 1,
        mode,
        ..Default::default()
    };
    for _ in 0..30 {
        shared.observe_round(&round(Mode::Greedy, 0, 0.3));
    }
    let sampling = shared.costs(Mode::Sampling).unwrap();
    assert_eq!(
        (sampling.overhead_plain, sampling.overhead_draft),
        (0.5, 1.0)
    );
    for _ in 0..30 {
        shared.observe_round(&round(Mode::Sampling, 0, 6.0));
        shared.observe_round(&round(Mode::Sampling, 4, 22.0));
        shared.observe_round(&round(Mode::Greedy, 4, 6.0));
    }
    let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
    let greedy = shared.costs(Mode::Greedy).unwrap();
    assert!(close(greedy.overhead_plain, 0.3), "{greedy:?}");
    assert!(close(greedy.overhead_draft, 6.0), "{greedy:?}");
    let sampling = shared.costs(Mode::Sampling).unwrap();
    assert!(close(sampling.overhead_plain, 6.0), "{sampling:?}");
    assert!(close(sampling.overhead_draft, 22.0), "{sampling:?}");
    // A stream pays after 134 greedy steps (40 ms against 0.3), 7 sampling ones.
    assert!(!shared.streaming_pays(133, Mode::Greedy));
    assert!(shared.streaming_pays(134, Mode::Greedy));
    assert!(!shared.streaming_pays(6, Mode::Sampling));
    assert!(shared.streaming_pays(7, Mode::Sampling));
}

/// A run of target-only steps pays for a stream once its overheads add up to a one-row
/// pass: 42 ms against 2 ms a round, 21 steps; nothing before a pass is measured.
#[test]
fn streaming_pays_once_the_overheads_add_up_to_a_pass() {
    let shared = Shared::default();
    assert!(!shared.streaming_pays(1_000, Mode::Greedy));
    for _ in 0..10 {
        shared.observe_round(&RoundCosts {
            pass_rows: 1,
            pass_ms: 42.0,
            overhead_ms: Some(2.0),
            committed: 1,
            ..RoundCosts::default()
        });
    }
    assert!(!shared.streaming_pays(20, Mode::Greedy));
    assert!(shared.streaming_pays(21, Mode::Greedy));
}
