//! When the draft session opens: its prefill spread over the rounds left, a clear gain in a
//! batch, and what lookup will copy of the text, guessed from requests before and shown by
//! the request's first rounds; a set-aside or untried draft model tried.

use super::*;

/// Opening the draft session costs its prefill, spread over the rounds left: worth it for a
/// long completion, not for the last few tokens.
#[test]
fn the_draft_prefill_is_spread_over_the_rounds_left() {
    let mut c = seen(Source::DraftModel, 10, 4, 4);
    for _ in 0..16 {
        c.observe_copied(0, 1);
    }
    let closed = |remaining| Options {
        remaining,
        ..opening(2000)
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
        remaining: 128,
        ..opening(100)
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
