//! The controller on synthetic acceptance and costs: here its choice of proposer and K;
//! the pass time, the draft's costs, the draft session's opening and a round's other
//! choices in `tests/`.

use super::estimate::*;
use super::pass::*;
use super::plan::*;
use super::shared::*;
use crate::method::Proposer;

mod draft_costs;
mod opening;
mod pass_times;
mod rounds;

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

/// A round without a lookup match, 120 tokens to go, the draft session not open: its
/// prefill of `catch_up` tokens comes first (the draft model at most 8 tokens a round).
fn opening(catch_up: usize) -> Options {
    Options {
        remaining: 120,
        draft: Some(DraftOption {
            max_k: 8,
            catch_up,
            opening: true,
        }),
        ..draft_only(16)
    }
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

/// `shared` sees a roofline pass of `rows` rows that committed a token.
fn pass(shared: &Shared, rows: usize) {
    shared.observe_round(&RoundCosts {
        pass_rows: rows,
        pass_ms: roofline(rows),
        committed: 1,
        ..RoundCosts::default()
    });
}

/// A roofline pass: up to 8 rows reading the weights dominates (30 ms + 1.5 ms a row),
/// past 8 the arithmetic (3.75 ms a row).
fn roofline(rows: usize) -> f64 {
    let rows = rows as f64;
    (30.0 + 1.5 * rows).max(12.0 + 3.75 * rows)
}

/// A request whose first 16 rounds committed a token each, none of them lookup's.
fn not_copying() -> Controller {
    let mut c = Controller::default();
    for _ in 0..16 {
        c.observe_copied(0, 1);
    }
    c
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
