//! The controller on synthetic acceptance and costs.

use super::estimate::*;
use super::pass::*;
use super::plan::*;
use super::shared::*;
use crate::method::Proposer;

/// A CPU-like target: 35 ms a pass plus 8 ms a row; a draft step a third of a one-row pass.
fn cpu() -> Costs {
    Costs {
        pass: PassTime::line(35.0, 8.0),
        draft_per_token: 14.0,
        draft_prefill_per_row: 1.5,
        ahead_slowdown: 0.0,
        draft_ahead_per_token: 14.0,
        overhead_draft: 1.0,
        overhead_plain: 0.5,
        tokens_per_round: 1.0,
        draft_ms_per_round: 0.0,
        draft_tried: true,
        draft_prior: DRAFT_PRIOR,
        ngram_prior: NGRAM_PRIOR,
    }
}

/// A controller that has seen `rounds` rounds of `proposed` drafts with `accepted` accepted.
fn seen(source: Source, rounds: usize, proposed: usize, accepted: usize) -> Controller {
    let mut c = Controller::default();
    for _ in 0..rounds {
        c.observe(source, proposed, accepted);
    }
    c
}

/// Prompt lookup only, with a match of `matched` tokens and up to 16 drafts.
fn lookup_only(matched: usize) -> Options {
    Options {
        remaining: 100,
        limit: 16,
        draft: None,
        ngram: Some((ngram_bucket(matched, None), 16)),
        overlap: Overlap::Off,
        stop_early: false,
        trees: false,
        streaming: false,
    }
}

fn draft_only(limit: usize) -> Options {
    Options {
        remaining: 100,
        limit,
        draft: Some(DraftOption {
            max_k: 16,
            catch_up: 0,
            opening: false,
        }),
        ngram: None,
        overlap: Overlap::Off,
        stop_early: false,
        trees: false,
        streaming: false,
    }
}

#[test]
fn expected_tokens_add_each_drafts_chance() {
    let odds = Odds {
        first: 0.5,
        next: 0.5,
    };
    assert_eq!(odds.expected_tokens(0), 1.0);
    assert_eq!(odds.expected_tokens(3), 1.0 + 0.5 + 0.25 + 0.125);
}

#[test]
fn acceptance_counts_reached_positions_only() {
    let mut a = Acceptance::default();
    // 4 drafts, 2 accepted: first hit; positions 2 and 3 reached, position 2 accepted.
    a.observe(4, 2, 1.0);
    assert_eq!(
        a.first,
        Rate {
            hits: 1.0,
            trials: 1.0
        }
    );
    assert_eq!(
        a.next,
        Rate {
            hits: 1.0,
            trials: 2.0
        }
    );
    // All 3 accepted: positions 2 and 3 both reached and accepted.
    a.observe(3, 3, 1.0);
    assert_eq!(
        a.next,
        Rate {
            hits: 3.0,
            trials: 4.0
        }
    );
    // None accepted: the first missed, nothing after it reached.
    a.observe(5, 0, 1.0);
    assert_eq!(
        a.first,
        Rate {
            hits: 2.0,
            trials: 3.0
        }
    );
    assert_eq!(
        a.next,
        Rate {
            hits: 3.0,
            trials: 4.0
        }
    );
}

#[test]
fn low_acceptance_means_no_drafting() {
    let c = seen(Source::DraftModel, 10, 4, 0);
    assert_eq!(c.plan(&cpu(), &draft_only(16)), Plan::TARGET_ONLY);
    // Likewise for prompt lookup that keeps missing.
    let c = seen(Source::Ngram(0), 10, 4, 0);
    let options = lookup_only(2);
    assert_eq!(c.plan(&cpu(), &options), Plan::TARGET_ONLY);
}

#[test]
fn high_acceptance_grows_k() {
    let middling = seen(Source::DraftModel, 10, 4, 2).plan(&cpu(), &draft_only(16));
    let high = seen(Source::DraftModel, 10, 4, 4).plan(&cpu(), &draft_only(16));
    assert_eq!(middling.proposer, Proposer::DraftModel);
    assert_eq!(high.proposer, Proposer::DraftModel);
    assert!(high.k > middling.k, "{high:?} vs {middling:?}");
    // Free drafts that are always right: as many as allowed.
    let options = lookup_only(8);
    let lookup = seen(Source::Ngram(2), 20, 8, 8).plan(&cpu(), &options);
    assert_eq!(lookup, Plan::exactly(Proposer::Ngram, 16));
    // Never past the round's limit.
    let capped = Options {
        remaining: 100,
        limit: 3,
        ..options
    };
    assert_eq!(seen(Source::Ngram(2), 20, 8, 8).plan(&cpu(), &capped).k, 3);
}

#[test]
fn large_verify_batches_shrink_k() {
    let mut c = seen(Source::Ngram(1), 20, 6, 4);
    let options = lookup_only(4);
    let alone = c.plan(&cpu(), &options);
    // Seven other sessions, a row each, in every pass: each row now costs what a decoded
    // token of the batch does.
    for _ in 0..20 {
        c.observe_batch(8, 8 + alone.k, alone.k + 1);
    }
    let batched = c.plan(&cpu(), &options);
    assert_eq!(alone.proposer, Proposer::Ngram);
    assert!(batched.k < alone.k, "{batched:?} vs {alone:?}");
    // On a GPU-like target, where rows are nearly free, the batch changes little.
    let gpu = Costs {
        pass: PassTime::line(20.0, 0.05),
        draft_per_token: 3.0,
        ..cpu()
    };
    assert!(c.plan(&gpu, &options).k >= alone.k);
}

/// In a batch of eight on a CPU a drafted row costs about what a decoded token earns, so a
/// lookup pays only where its first token is nearly sure to hold (here from 0.65 on): one
/// lucky round does not vouch for that, a long record of the same luck does. Alone, where a
/// row costs a fraction of a step, the lucky round is enough.
#[test]
fn in_a_batch_only_drafts_the_evidence_vouches_for_are_made() {
    let options = Options {
        limit: 1,
        ..lookup_only(8)
    };
    let in_batch = |rounds| {
        let mut c = seen(Source::Ngram(2), rounds, 1, 1);
        for _ in 0..20 {
            c.observe_batch(8, 8, 1);
        }
        c
    };
    let floor = |c: &Controller| c.value(&cpu(), None, 0, Overlap::Off, false);
    let lookup = |c: &Controller, odds| {
        c.value(
            &cpu(),
            Some((odds, Proposer::Ngram, 0.0)),
            1,
            Overlap::Off,
            false,
        )
    };
    let lucky = in_batch(1);
    let odds = lucky.ngram[2].odds(NGRAM_PRIOR[2]);
    assert!((odds.first - 0.775).abs() < 1e-9, "{odds:?}");
    assert!(
        lookup(&lucky, odds) > floor(&lucky),
        "by its estimate it would pay"
    );
    assert_eq!(lucky.plan(&cpu(), &options), Plan::TARGET_ONLY);
    let proven = in_batch(30);
    assert_eq!(
        proven.plan(&cpu(), &options),
        Plan::exactly(Proposer::Ngram, 1)
    );
    let alone = seen(Source::Ngram(2), 1, 1, 1);
    assert_eq!(
        alone.plan(&cpu(), &options),
        Plan::exactly(Proposer::Ngram, 1)
    );
}

/// A request whose target-only steps stream pays for a round with drafts a pass more: the
/// pass that runs the stream's step in flight, which gives it nothing. Alone, a match whose
/// rounds commit two tokens pays a round of its own (2 tokens in 51.5 ms against 1 in 43.5)
/// but not that pass as well (2 in 94.5 against 1 in 43); one that copies long runs pays
/// both. In a batch of eight the same holds for a match whose first token is sure.
#[test]
fn a_round_with_drafts_pays_for_the_streams_step_in_flight() {
    let streaming = |o: Options| Options {
        streaming: true,
        ..o
    };
    let short = seen(Source::Ngram(2), 30, 4, 1);
    assert_eq!(
        short.plan(&cpu(), &lookup_only(8)),
        Plan::exactly(Proposer::Ngram, 1)
    );
    assert_eq!(
        short.plan(&cpu(), &streaming(lookup_only(8))),
        Plan::TARGET_ONLY
    );
    let long = seen(Source::Ngram(2), 30, 16, 16);
    assert_eq!(
        long.plan(&cpu(), &streaming(lookup_only(8))),
        Plan::exactly(Proposer::Ngram, 16)
    );
    let in_batch = |mut c: Controller| {
        for _ in 0..20 {
            c.observe_batch(8, 8, 1);
        }
        c
    };
    let one = Options {
        limit: 1,
        ..lookup_only(8)
    };
    let sure = in_batch(seen(Source::Ngram(2), 30, 1, 1));
    assert_eq!(sure.plan(&cpu(), &one), Plan::exactly(Proposer::Ngram, 1));
    assert_eq!(sure.plan(&cpu(), &streaming(one)), Plan::TARGET_ONLY);
    let long = in_batch(long);
    assert_eq!(
        long.plan(&cpu(), &streaming(lookup_only(8))),
        Plan::exactly(Proposer::Ngram, 16)
    );
}

/// A request alone on the target plans on its estimates, not on what it is fairly sure of:
/// costs as measured on this project's machine class for one chat stream (a one-row pass
/// 29.5 ms, 1.5 ms a row more, a draft token 10.4 ms) and the draft model's acceptance on
/// chat (0.70 for a round's first token, 0.91 for each next), where DRAFT_MODEL ran 1.16-1.21x
/// of NONE. The gate, which the same request meets in a batch, would have kept it target-only
/// from its first round, and after one rejected draft for good.
#[test]
fn alone_the_draft_model_drafts_on_its_estimate_and_survives_an_unlucky_round() {
    let costs = Costs {
        pass: PassTime::line(28.0, 1.5),
        draft_per_token: 10.4,
        draft_ahead_per_token: 10.4,
        overhead_draft: 2.8,
        overhead_plain: 1.0,
        draft_prior: Odds {
            first: 0.70,
            next: 0.91,
        },
        ..cpu()
    };
    let options = draft_only(8);
    let mut alone = Controller::default();
    let plan = alone.plan(&costs, &options);
    assert_eq!(plan, Plan::exactly(Proposer::DraftModel, 4));
    let floor = alone.value(&costs, None, 0, Overlap::Off, false);
    let at = |c: &Controller, odds: Odds| {
        c.value(
            &costs,
            Some((odds, Proposer::DraftModel, 0.0)),
            4,
            Overlap::Off,
            false,
        ) / floor
    };
    let mean = at(&alone, alone.draft.odds(costs.draft_prior));
    let sure = at(&alone, alone.draft.sure_odds(costs.draft_prior));
    assert!((1.25..1.35).contains(&mean), "{mean}");
    assert!(sure < 1.0, "the gate would refuse it: {sure}");
    // One round whose one draft was rejected: still the draft model.
    alone.observe(Source::DraftModel, 1, 0);
    assert_eq!(alone.plan(&costs, &options).proposer, Proposer::DraftModel);
    // The same fresh request in a batch of eight meets the gate.
    let mut batched = Controller::default();
    for _ in 0..5 {
        batched.observe_batch(8, 8, 1);
    }
    assert_eq!(batched.plan(&costs, &options), Plan::TARGET_ONLY);
}

/// A request that named its proposer and left K to the server: the controller's K for that
/// proposer, never a target-only step where it can draft, and never the other proposer.
#[test]
fn a_named_proposer_always_drafts_as_many_tokens_as_pay_best() {
    // Where AUTO would not draft at all, the named proposer still drafts, one token.
    let poor = seen(Source::DraftModel, 10, 4, 0);
    assert_eq!(poor.plan(&cpu(), &draft_only(16)), Plan::TARGET_ONLY);
    let plan = poor.plan_for(Proposer::DraftModel, &cpu(), &draft_only(16));
    assert_eq!(plan, Plan::exactly(Proposer::DraftModel, 1));
    // Where drafts hold, as many as AUTO would make, within the round's limit.
    let right = seen(Source::DraftModel, 10, 4, 4);
    let auto = right.plan(&cpu(), &draft_only(16));
    assert_eq!(
        right.plan_for(Proposer::DraftModel, &cpu(), &draft_only(16)),
        auto
    );
    assert!(auto.k > 1, "{auto:?}");
    let capped = right.plan_for(Proposer::DraftModel, &cpu(), &draft_only(2));
    assert_eq!(capped, Plan::exactly(Proposer::DraftModel, 2));
    // In a batch of eight on a CPU, fewer than alone.
    let mut batched = seen(Source::DraftModel, 10, 4, 3);
    let alone = batched.plan_for(Proposer::DraftModel, &cpu(), &draft_only(16));
    for _ in 0..20 {
        batched.observe_batch(8, 8 + alone.k, alone.k + 1);
    }
    let in_batch = batched.plan_for(Proposer::DraftModel, &cpu(), &draft_only(16));
    assert!(in_batch.k < alone.k, "{in_batch:?} vs {alone:?}");
    assert!(in_batch.k >= 1);
    // Prompt lookup named: lookup's rounds only, even beside a draft model that would pay
    // more; with no match, a target-only step.
    let options = Options {
        ngram: Some((ngram_bucket(7, None), 16)),
        ..draft_only(16)
    };
    let lookup = right.plan_for(Proposer::Ngram, &cpu(), &options);
    assert_eq!(lookup.proposer, Proposer::Ngram);
    assert!(lookup.k >= 1);
    let no_match = right.plan_for(Proposer::Ngram, &cpu(), &draft_only(16));
    assert_eq!(no_match, Plan::TARGET_ONLY);
}

#[test]
fn free_lookup_beats_a_costly_draft_at_equal_acceptance() {
    let mut c = seen(Source::DraftModel, 10, 4, 4);
    for _ in 0..10 {
        c.observe(Source::Ngram(2), 4, 4);
    }
    let options = Options {
        remaining: 100,
        limit: 16,
        draft: Some(DraftOption {
            max_k: 16,
            catch_up: 0,
            opening: false,
        }),
        ngram: Some((ngram_bucket(7, None), 16)),
        overlap: Overlap::Off,
        stop_early: false,
        trees: false,
        streaming: false,
    };
    assert_eq!(c.plan(&cpu(), &options).proposer, Proposer::Ngram);
    // Without a match, the draft model.
    let no_match = Options {
        ngram: None,
        ..options
    };
    assert_eq!(c.plan(&cpu(), &no_match).proposer, Proposer::DraftModel);
}

#[test]
fn the_pass_time_is_learnt_from_passes() {
    let shared = Shared::default();
    assert!(shared.costs(Mode::Greedy).is_none());
    for rows in [1, 2, 5, 9, 17, 5, 1] {
        shared.observe_round(&RoundCosts {
            pass_rows: rows,
            pass_ms: 35.0 + 8.0 * rows as f64,
            committed: 1,
            ..RoundCosts::default()
        });
    }
    // At the measured row counts, between them, and past both ends: the line they lie on.
    let p = shared.costs(Mode::Greedy).unwrap().pass;
    for rows in [1.0, 5.0, 17.0, 3.0, 12.5, 0.0, 33.0] {
        let expected = 35.0 + 8.0 * rows;
        assert!(
            (p.ms(rows) - expected).abs() < 1e-9,
            "{rows}: {}",
            p.ms(rows)
        );
    }
    // One row count only: a row is taken to cost a sixth of the pass per row (7 ms at one
    // row of 42 ms), not nothing.
    let once = Shared::default();
    once.observe_round(&RoundCosts {
        pass_rows: 1,
        pass_ms: 42.0,
        ..RoundCosts::default()
    });
    let p = once.costs(Mode::Greedy).unwrap().pass;
    assert!((p.ms(1.0) - 42.0).abs() < 1e-9, "{}", p.ms(1.0));
    assert!((p.row_ms(1.0) - 6.0).abs() < 1e-9, "{}", p.row_ms(1.0));
    // The first of eight reports of a pass of eight calls (an eighth of a pass) prices
    // passes already.
    let batch = Shared::default();
    batch.observe_round(&RoundCosts {
        pass_calls: 8,
        pass_rows: 8,
        pass_ms: 56.0,
        ..RoundCosts::default()
    });
    let p = batch.costs(Mode::Greedy).unwrap().pass;
    assert!((p.ms(8.0) - 56.0).abs() < 1e-9, "{}", p.ms(8.0));
}

/// Noisy passes never make more rows cheaper: a row count whose mean lies below the one
/// before it is pooled with that one.
#[test]
fn more_rows_never_take_less_time() {
    let shared = Shared::default();
    for (rows, ms) in [(1, 40.0), (2, 50.0), (3, 44.0), (4, 60.0)] {
        shared.observe_round(&RoundCosts {
            pass_rows: rows,
            pass_ms: ms,
            ..RoundCosts::default()
        });
    }
    let p = shared.costs(Mode::Greedy).unwrap().pass;
    // 2 and 3 rows pooled into one point, each pass weighed by its age.
    let (w2, w3) = (SHARED_KEEP * SHARED_KEEP, SHARED_KEEP);
    let rows = (2.0 * w2 + 3.0 * w3) / (w2 + w3);
    let ms = (50.0 * w2 + 44.0 * w3) / (w2 + w3);
    assert!((p.ms(rows) - ms).abs() < 1e-9, "{}", p.ms(rows));
    assert!(p.ms(2.0) < 50.0 && p.ms(3.0) > 44.0);
    for rows in 0..8 {
        assert!(p.row_ms(rows as f64) >= 0.0, "{rows}");
    }
}

/// A roofline pass: up to 8 rows reading the weights dominates (30 ms + 1.5 ms a row),
/// past 8 the arithmetic (3.75 ms a row).
fn roofline(rows: usize) -> f64 {
    let rows = rows as f64;
    (30.0 + 1.5 * rows).max(12.0 + 3.75 * rows)
}

fn pass(shared: &Shared, rows: usize) {
    shared.observe_round(&RoundCosts {
        pass_rows: rows,
        pass_ms: roofline(rows),
        committed: 1,
        ..RoundCosts::default()
    });
}

/// The pass time is read at each row count: one stream's small passes give the weights'
/// slope, eight streams' passes of 8 to 14 rows the arithmetic's, each where it holds, and
/// past the largest batch the arithmetic's slope goes on.
#[test]
fn the_pass_time_holds_at_each_row_count() {
    let shared = Shared::default();
    for i in 0..60 {
        pass(&shared, 1 + i % 6);
    }
    for i in 0..40 {
        pass(&shared, 8 + i % 7);
    }
    let p = shared.costs(Mode::Greedy).unwrap().pass;
    for rows in 1..=20 {
        let expected = roofline(rows);
        let rows = rows as f64;
        assert!(
            (p.ms(rows) - expected).abs() < 1e-9,
            "{rows}: {}",
            p.ms(rows)
        );
    }
    assert!((p.row_ms(3.0) - 1.5).abs() < 1e-9);
    assert!((p.row_ms(11.0) - 3.75).abs() < 1e-9);
}

/// A CPU-like target: rows cheap up to four (1.5 ms each), dear past seven (8.6 ms); the
/// shape measured on the reference machine (docs/benchmarks.md), with numbers of its own.
fn cpu_measured(rows: usize) -> f64 {
    let rows = rows as f64;
    (36.0 + 1.5 * rows).max(8.6 * rows - 3.0)
}

/// A lookup whose runs hold for about six tokens drafts 4 where rows past the seventh cost
/// 8.6 ms each; priced by the slope of one stream's small passes (1.5 ms a row), it would
/// draft 10.
#[test]
fn long_lookup_runs_stop_where_rows_get_dear() {
    let shared = Shared::default();
    for i in 0..100 {
        let rows = [1, 1, 2, 3, 4, 1, 5, 9, 17][i % 9];
        shared.observe_round(&RoundCosts {
            pass_rows: rows,
            pass_ms: cpu_measured(rows),
            committed: 1,
            ..RoundCosts::default()
        });
    }
    let costs = shared.costs(Mode::Greedy).unwrap();
    let c = seen(Source::Ngram(2), 20, 16, 6);
    let plan = c.plan(&costs, &lookup_only(8));
    assert_eq!(plan, Plan::exactly(Proposer::Ngram, 4));
    let small_rows = Costs {
        pass: PassTime::line(36.0, 1.5),
        ..costs
    };
    assert_eq!(
        c.plan(&small_rows, &lookup_only(8)),
        Plan::exactly(Proposer::Ngram, 10)
    );
}

/// Roofline passes of one stream (1 to 6 rows), then of eight streams (8 to 14 rows).
fn alone_then_in_batches() -> Shared {
    let shared = Shared::default();
    for i in 0..60 {
        pass(&shared, 1 + i % 6);
    }
    for i in 0..40 {
        pass(&shared, 8 + i % 7);
    }
    shared
}

/// Row counts the latest passes did not run with fade out: after eight streams' batches,
/// 200 passes of one stream leave a 12-row pass priced along one stream's slope, no longer
/// at what the batches measured.
#[test]
fn a_row_count_not_run_lately_fades_out() {
    let shared = alone_then_in_batches();
    assert!((shared.costs(Mode::Greedy).unwrap().pass.ms(12.0) - roofline(12)).abs() < 1e-9);
    for i in 0..200 {
        pass(&shared, 1 + i % 6);
    }
    let p = shared.costs(Mode::Greedy).unwrap().pass;
    let along = roofline(6) + 1.5 * 6.0;
    assert!((p.ms(12.0) - along).abs() < 1e-9, "{}", p.ms(12.0));
}

/// In a batch of eight, a draft token that the target accepts 60% of the time does not pay
/// for its row on the roofline (a row costs 3.75 ms, an average token 5.25 ms: it would
/// need 71%), which only the line read around the batch shows.
#[test]
fn drafts_that_do_not_pay_for_their_rows_in_a_batch_are_not_made() {
    let shared = alone_then_in_batches();
    let local = shared.costs(Mode::Greedy).unwrap();
    let mut c = Controller::default();
    for i in 0..30 {
        c.observe(Source::Ngram(1), 1, usize::from(i % 5 < 3));
    }
    for _ in 0..20 {
        c.observe_batch(8, 8, 1);
    }
    let options = lookup_only(4);
    assert_eq!(c.plan(&local, &options), Plan::TARGET_ONLY);
    // Priced at what a row costs one stream's small passes, they would be made.
    let cheap = Costs {
        pass: PassTime::line(30.0, 1.5),
        ..local
    };
    assert_eq!(c.plan(&cheap, &options).proposer, Proposer::Ngram);
}

/// A coordinator that has seen one target pass: 5 rows in 75 ms.
fn one_pass_seen() -> Shared {
    let shared = Shared::default();
    shared.observe_round(&RoundCosts {
        pass_rows: 5,
        pass_ms: 75.0,
        ..RoundCosts::default()
    });
    shared
}

#[test]
fn requests_start_from_what_all_requests_saw() {
    let shared = one_pass_seen();
    let fresh = Controller::default();
    let before = fresh.plan(&shared.costs(Mode::Greedy).unwrap(), &draft_only(16));
    for _ in 0..50 {
        shared.observe_acceptance(Source::DraftModel, 4, 0);
    }
    let after = fresh.plan(&shared.costs(Mode::Greedy).unwrap(), &draft_only(16));
    assert_eq!(before.proposer, Proposer::DraftModel);
    assert_eq!(after, Plan::TARGET_ONLY);
}

/// A draft model that a request's first rounds made look poor is not shut out for good:
/// the rounds that go by without it fade that verdict, and a later request opens the draft
/// session again (to measure it anew). Fifty poor rounds keep it closed far longer.
#[test]
fn a_draft_model_judged_on_one_round_is_tried_again() {
    let closed = Options {
        draft: Some(DraftOption {
            max_k: 16,
            catch_up: 100,
            opening: true,
        }),
        ..draft_only(16)
    };
    let rounds_until_opened = |bad_rounds: usize| {
        let shared = one_pass_seen();
        let fresh = not_copying();
        assert_eq!(
            fresh
                .plan(&shared.costs(Mode::Greedy).unwrap(), &closed)
                .proposer,
            Proposer::DraftModel
        );
        for _ in 0..bad_rounds {
            shared.observe_acceptance(Source::DraftModel, 3, 0);
        }
        (0..5000)
            .find(|_| {
                let plan = fresh.plan(&shared.costs(Mode::Greedy).unwrap(), &closed);
                shared.round_without_draft();
                plan.proposer == Proposer::DraftModel
            })
            .expect("the draft model is tried again")
    };
    // One poor round does not outweigh what all requests expect of the draft model: a
    // request alone opens it at once. Two are retried within two requests of 128 tokens.
    assert_eq!(rounds_until_opened(1), 0);
    let after_two = rounds_until_opened(2);
    assert!((1..=256).contains(&after_two), "{after_two}");
    assert!(rounds_until_opened(50) > 4 * after_two);
}

/// A call of the draft model: `ms` of draft-worker time for `tokens` tokens.
fn draft_call(ms: f64, tokens: usize) -> RoundCosts {
    RoundCosts {
        draft_ms: ms,
        draft_tokens: tokens,
        ..RoundCosts::default()
    }
}

/// The draft's cost per token starts from a guess that weighs as a call of four tokens:
/// one slow first call (a token at three times the guess) moves the estimate to 1.4 times
/// the guess; the calls after it bring it to what they measure, weighed by their tokens,
/// and rounds without the draft model drift it back toward the guess (slowly), so a draft
/// model that a slow call set aside is opened again.
#[test]
fn one_slow_draft_call_does_not_set_the_draft_cost_alone() {
    let slow_first = one_pass_seen();
    let guess = slow_first.costs(Mode::Greedy).unwrap().draft_per_token;
    let one_row = slow_first.costs(Mode::Greedy).unwrap().pass.ms(1.0);
    assert_eq!(guess, one_row / 3.0, "a third of a one-row pass");
    slow_first.observe_round(&draft_call(3.0 * guess, 1));
    let after_one = slow_first.costs(Mode::Greedy).unwrap().draft_per_token;
    assert!(
        (after_one - 1.4 * guess).abs() < 1e-9,
        "{after_one} vs {guess}"
    );
    for _ in 0..5000 {
        slow_first.round_without_draft();
    }
    let faded = slow_first.costs(Mode::Greedy).unwrap().draft_per_token;
    assert!((faded - guess).abs() < 0.05 * guess, "{faded} vs {guess}");

    // A call of 8 tokens at 10 ms each and one of a token at 30 ms: 110 ms for 9 tokens.
    let shared = one_pass_seen();
    shared.observe_round(&draft_call(3.0 * guess, 1));
    for _ in 0..200 {
        shared.observe_round(&draft_call(80.0, 8));
        shared.observe_round(&draft_call(30.0, 1));
    }
    let measured = shared.costs(Mode::Greedy).unwrap().draft_per_token;
    assert!((measured - 110.0 / 9.0).abs() < 0.5, "{measured}");
}

/// A CPU-like pair, as measured on the reference machine: the target's passes of one to
/// five rows at 40 ms and 2.5 ms a row more, the draft's calls at 20 ms a token (one and a
/// half times the guess, a third of a one-row pass), its prefill 2.4 ms a prompt token.
fn draft_measured() -> Shared {
    let shared = Shared::default();
    for i in 0..50 {
        let rows = 1 + i % 5;
        shared.observe_round(&RoundCosts {
            pass_rows: rows,
            pass_ms: 37.5 + 2.5 * rows as f64,
            committed: 1,
            ..RoundCosts::default()
        });
    }
    for _ in 0..30 {
        shared.observe_round(&draft_call(60.0, 3));
    }
    for _ in 0..3 {
        shared.observe_draft_prefill(250, std::time::Duration::from_millis(600));
    }
    shared
}

/// The draft's costs are the hardware's: requests that leave the draft model unused (a run
/// of code edits, which prompt lookup serves) do not bring them back to the cheaper guess,
/// so the next request does not open a draft session on that belief. After eight requests'
/// worth of rounds without it (128 each) both costs hold within a tenth; faded like
/// acceptance, the per-token cost was back within a tenth of the guess.
#[test]
fn the_draft_costs_measured_outlast_requests_that_do_not_use_it() {
    let shared = draft_measured();
    let before = shared.costs(Mode::Greedy).unwrap();
    let guess = before.pass.ms(1.0) / 3.0;
    assert!((before.draft_per_token - 20.0).abs() < 0.5, "{before:?}");
    assert!(before.draft_per_token > 1.4 * guess, "{before:?}");
    assert!(before.draft_prefill_per_row > 2.2, "{before:?}");
    for _ in 0..8 * 128 {
        shared.round_without_draft();
    }
    let after = shared.costs(Mode::Greedy).unwrap();
    assert!(
        after.draft_per_token > 0.9 * before.draft_per_token,
        "{} vs {}",
        after.draft_per_token,
        before.draft_per_token
    );
    assert!(
        after.draft_prefill_per_row > 0.9 * before.draft_prefill_per_row,
        "{} vs {}",
        after.draft_prefill_per_row,
        before.draft_prefill_per_row
    );
    // A request's first round, no lookup match, a 250-token prompt: whether its draft
    // session opens is the same before and after.
    let first_round = Options {
        remaining: 127,
        limit: 16,
        draft: Some(DraftOption {
            max_k: 8,
            catch_up: 250,
            opening: true,
        }),
        ngram: None,
        overlap: Overlap::Off,
        stop_early: false,
        trees: false,
        streaming: false,
    };
    let c = Controller::default();
    assert_eq!(c.plan(&before, &first_round), Plan::TARGET_ONLY);
    assert_eq!(c.plan(&after, &first_round), Plan::TARGET_ONLY);
    // At the guessed costs it would open the session.
    let at_guess = Costs {
        draft_per_token: guess,
        draft_prefill_per_row: guess / 8.0,
        ..after
    };
    assert_eq!(
        c.plan(&at_guess, &first_round).proposer,
        Proposer::DraftModel
    );
}

/// Opening the draft session costs its prefill, spread over the rounds left: worth it for a
/// long completion, not for the last few tokens.
#[test]
fn the_draft_prefill_is_spread_over_the_rounds_left() {
    let mut c = seen(Source::DraftModel, 10, 4, 4);
    for _ in 0..16 {
        c.observe_copied(0, 1);
    }
    let closed = |remaining| Options {
        limit: 16,
        remaining,
        draft: Some(DraftOption {
            max_k: 8,
            catch_up: 2000,
            opening: true,
        }),
        ngram: None,
        overlap: Overlap::Off,
        stop_early: false,
        trees: false,
        streaming: false,
    };
    assert_eq!(c.plan(&cpu(), &closed(500)).proposer, Proposer::DraftModel);
    assert_eq!(c.plan(&cpu(), &closed(10)), Plan::TARGET_ONLY);
}

/// In a batch, a draft session not yet open is opened only for a clear gain (its
/// acceptance for this request is still a guess, and a row costs about what it earns); once
/// open, any gain is taken, also when its cache lacks the last committed token or two (as
/// after every round whose drafts were all accepted). Alone, any gain opens it.
#[test]
fn opening_the_draft_session_in_a_batch_needs_a_clear_gain() {
    let with = |opening| Options {
        limit: 16,
        remaining: 1000,
        draft: Some(DraftOption {
            max_k: 8,
            catch_up: 1,
            opening,
        }),
        ngram: None,
        overlap: Overlap::Off,
        stop_early: false,
        trees: false,
        streaming: false,
    };
    let alone = seen(Source::DraftModel, 20, 8, 6);
    let mut c = seen(Source::DraftModel, 20, 8, 6);
    c.observe_running(2);
    let mut margin_used = false;
    // Dearer and dearer draft steps: the gain over target-only falls through the margin.
    for per_token in 5..60 {
        let costs = Costs {
            draft_per_token: per_token as f64,
            ..cpu()
        };
        assert_eq!(
            alone.plan(&costs, &with(true)),
            alone.plan(&costs, &with(false)),
            "alone, {per_token} ms"
        );
        let none = c.value(&costs, None, 0, Overlap::Off, false);
        let open = c.plan(&costs, &with(false));
        let closed = c.plan(&costs, &with(true));
        if open.proposer != Proposer::DraftModel {
            assert_eq!(closed, Plan::TARGET_ONLY, "{per_token} ms");
            continue;
        }
        let odds = c.draft.odds(costs.draft_prior);
        let gain = c.value(
            &costs,
            Some((odds, Proposer::DraftModel, 0.0)),
            open.k,
            Overlap::Off,
            false,
        ) / none;
        assert_eq!(
            closed.proposer == Proposer::DraftModel,
            gain >= OPEN_MARGIN,
            "{per_token} ms: gain {gain}"
        );
        margin_used |= closed == Plan::TARGET_ONLY;
    }
    assert!(margin_used, "no draft cost between a gain and a clear gain");
}

/// A new request takes lookup to copy what earlier requests with prompts of about its
/// length copied: a short question opens its draft session at once where requests like it
/// copied nothing, and an edit of a long code prompt does not where requests like it copied
/// most of their answers. Lengths nobody has sent yet start from half.
#[test]
fn what_requests_of_a_prompt_length_copied_is_the_next_ones_guess() {
    let shared = Shared::default();
    // Rounds of four tokens, none copied, of short questions; of nine, eight copied, of
    // long edits.
    for _ in 0..500 {
        shared.observe_copied(40, 0, 4);
        shared.observe_copied(600, 8, 9);
    }
    assert!(
        shared.copied_prior(50) < 0.05,
        "{}",
        shared.copied_prior(50)
    );
    assert!(
        shared.copied_prior(900) > 0.85,
        "{}",
        shared.copied_prior(900)
    );
    for untouched in [64, 127, 128, 300, 1024, 100_000] {
        assert_eq!(shared.copied_prior(untouched), COPIED_PRIOR, "{untouched}");
    }
    let costs = draft_trusted();
    // The same prefill: worth it for the text a question's answer is expected to hold of
    // its own, not for the little an edit's is.
    let question = Controller::expecting_copied(shared.copied_prior(40));
    let edit = Controller::expecting_copied(shared.copied_prior(600));
    assert_eq!(
        question.plan(&costs, &opening(150)).proposer,
        Proposer::DraftModel
    );
    assert_eq!(edit.plan(&costs, &opening(150)), Plan::TARGET_ONLY);
}

/// CPU costs, and a draft model all requests found right nine times in ten.
fn draft_trusted() -> Costs {
    Costs {
        draft_prior: Odds {
            first: 0.9,
            next: 0.9,
        },
        ..cpu()
    }
}

/// A round without a lookup match, 120 tokens to go, the draft session not open: its
/// prefill of `catch_up` tokens comes first.
fn opening(catch_up: usize) -> Options {
    Options {
        remaining: 120,
        limit: 16,
        draft: Some(DraftOption {
            max_k: 8,
            catch_up,
            opening: true,
        }),
        ngram: None,
        overlap: Overlap::Off,
        stop_early: false,
        trees: false,
        streaming: false,
    }
}

/// A request whose first 16 rounds committed a token each, none of them lookup's.
fn not_copying() -> Controller {
    let mut c = Controller::default();
    for _ in 0..16 {
        c.observe_copied(0, 1);
    }
    c
}

/// Whether an answer copies its prompt is not known before it starts: a request's first
/// round opens the draft session only where its prefill would pay with half the text
/// copied, and otherwise once the first rounds copy nothing.
#[test]
fn a_request_shows_whether_it_copies_before_a_dear_draft_prefill() {
    let costs = draft_trusted();
    let first = Controller::default();
    assert_eq!(first.plan(&costs, &opening(600)), Plan::TARGET_ONLY);
    assert_eq!(
        not_copying().plan(&costs, &opening(600)).proposer,
        Proposer::DraftModel
    );
    // A short prompt's prefill pays at once.
    assert_eq!(
        first.plan(&costs, &opening(50)).proposer,
        Proposer::DraftModel
    );
}

/// Where prompt lookup copies most of the text (an edit of given code), the draft model
/// would earn only the rest, so its prefill is worth paying on fewer requests.
#[test]
fn a_draft_prefill_weighs_more_where_lookup_copies_the_text() {
    let costs = draft_trusted();
    // A round without a lookup match, the draft session not open: a 200-token prompt to
    // prefill.
    let options = opening(200);
    let mut c = Controller::default();
    for _ in 0..10 {
        c.observe_copied(0, 1);
    }
    assert_eq!(c.plan(&costs, &options).proposer, Proposer::DraftModel);
    // The same request, had lookup proposed 8 of each round's 9 tokens.
    let mut copying = Controller::default();
    for _ in 0..10 {
        copying.observe_copied(8, 9);
    }
    assert_eq!(copying.plan(&costs, &options), Plan::TARGET_ONLY);
    // Once the draft session is open, the share no longer matters.
    let open = Options {
        draft: Some(DraftOption {
            max_k: 8,
            catch_up: 0,
            opening: false,
        }),
        ..options
    };
    assert_eq!(
        copying.plan(&costs, &open),
        c.plan(&costs, &open),
        "an open draft session"
    );
    // When the text stops copying, the draft model is worth opening again.
    for _ in 0..40 {
        copying.observe_copied(0, 1);
    }
    assert_eq!(
        copying.plan(&costs, &options).proposer,
        Proposer::DraftModel
    );
}

/// A draft model that did badly is set aside, and tried again some rounds later: the text
/// may have changed.
#[test]
fn a_set_aside_draft_model_is_tried_again_later() {
    // Across requests the draft model does well.
    let costs = draft_trusted();
    let mut c = seen(Source::DraftModel, 20, 8, 0);
    let options = draft_only(8);
    assert_eq!(c.plan(&costs, &options), Plan::TARGET_ONLY);
    let mut rounds = 0;
    while c.plan(&costs, &options) == Plan::TARGET_ONLY {
        c.round_without_draft();
        rounds += 1;
        assert!(rounds < 100, "never tried again");
    }
    assert!(rounds >= 5, "tried again after only {rounds} rounds");
    assert_eq!(c.plan(&costs, &options).proposer, Proposer::DraftModel);
}

/// On a fresh coordinator the draft model is tried (a request opens its session) so that its
/// acceptance is measured, not guessed; once measured bad, fresh requests leave it closed.
#[test]
fn an_untried_draft_model_is_tried() {
    let shared = Shared::default();
    shared.observe_round(&RoundCosts {
        pass_rows: 1,
        pass_ms: 42.0,
        overhead_ms: Some(0.5),
        committed: 1,
        ..RoundCosts::default()
    });
    let closed = Options {
        limit: 16,
        remaining: 128,
        draft: Some(DraftOption {
            max_k: 8,
            catch_up: 100,
            opening: true,
        }),
        ngram: None,
        overlap: Overlap::Off,
        stop_early: false,
        trees: false,
        streaming: false,
    };
    let fresh = Controller::default();
    assert_eq!(
        fresh
            .plan(&shared.costs(Mode::Greedy).unwrap(), &closed)
            .proposer,
        Proposer::DraftModel
    );
    for _ in 0..20 {
        shared.observe_acceptance(Source::DraftModel, 4, 0);
    }
    assert_eq!(
        fresh.plan(&shared.costs(Mode::Greedy).unwrap(), &closed),
        Plan::TARGET_ONLY
    );
}

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
