//! The draft model's costs: set aside on a poor start and tried again, its per-token cost
//! moved by what its calls measure and kept by the hardware's.

use super::*;

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
        ..opening(250)
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
