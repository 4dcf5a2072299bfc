/// A greedy sampling, a lease, and a bias banning token 3.
fn what_opens_borrow() -> (
    duet_engine::sampling::SamplingParams,
    Lease,
    duet_engine::bias::LogitBias,
) {
    let bias = duet_engine::bias::LogitBias::new([(3, -100.0)]);
    let greedy = duet_engine::sampling::SamplingParams::greedy();
    (greedy, Lease::default(), bias)
}

/// `unfit`'s answer for a replica that predates `field`.
fn predates(field: &str) -> Option<String> {
    Some(format!(
        "the worker predates {field}: it would leave them out"
    ))
}

/// A replica's check as its Describe gives it, from before or after each field.
fn model_check(applies_penalties: bool, scores_prompts: bool, newest: bool) -> ModelCheck {
    ModelCheck {
        instance: 1,
        verdict: Ok(()),
        verifies_trees: false,
        decodes_with_lookup: newest,
        applies_penalties,
        scores_prompts,
        // The newest fields: a replica from before them has none.
        applies_logit_bias: newest,
        applies_min_tokens: newest,
        applies_structured_output: newest,
        applies_min_p: newest,
        applies_repetition_penalty: newest,
        holds_stop_tokens: newest,
        adapters: vec!["sql".into()],
        adapters_from_dir: false,
    }
}

/// A draft session gets all of the open it comes from that changes the target's choices
/// (the prompt and where its completion starts, the sampling, the penalties, the bias,
/// `min_tokens`, the structured output) and none of the figures, which are the target's
/// alone. No draft replica is refused for a field it predates (it proposes without it),
/// and one that does not take the structured output is sent the session without it.
#[test]
fn a_draft_open_carries_what_the_draft_takes() {
    let (sampling, lease, bias) = what_opens_borrow();
    let target = Open {
        generated_after: 2,
        logprobs: Some(1),
        penalties: duet_engine::penalties::Penalties {
            presence: 0.5,
            repetition: 1.2,
            ..Default::default()
        },
        prompt_logprobs: Some(0),
        logit_bias: &bias,
        min_tokens: 3,
        format: Some(&duet_engine::structured::Format::JsonObject),
        adapter: Some("sql"),
        ..Open::plain(&[1, 2, 3], 8, &sampling, &lease)
    };
    let draft = target.for_draft();
    assert_eq!(
        (draft.prompt, draft.capacity, draft.logit_bias),
        (&[1, 2, 3][..], 8, &bias)
    );
    let carried = |o: Open<'_>| {
        (
            o.generated_after,
            o.penalties,
            o.min_tokens,
            o.format.cloned(),
            o.adapter.map(str::to_string),
        )
    };
    assert_eq!(carried(draft), carried(target));
    assert_eq!((draft.logprobs, draft.prompt_logprobs), (None, None));
    let old = model_check(false, false, false);
    assert_eq!(unfit(Some(&old), &draft, Party::Draft), None);
    let request = pb::OpenSessionRequest {
        prompt: vec![1, 2, 3],
        structured_output: draft.format.map(format_to_wire),
        ..Default::default()
    };
    let sent = |check: &ModelCheck, party| for_replica(&request, Some(check), party);
    let new = model_check(true, true, true);
    assert_eq!(sent(&new, Party::Draft).as_ref(), &request);
    assert_eq!(sent(&old, Party::Target).as_ref(), &request);
    let unconstrained = sent(&old, Party::Draft);
    assert_eq!(unconstrained.structured_output, None);
    assert_eq!(unconstrained.prompt, request.prompt);
    // An adapter goes to a draft replica that lists it or reads a directory only.
    let adapted = |name: &str| pb::OpenSessionRequest {
        adapter: name.into(),
        ..request.clone()
    };
    let adapter = |name, check: Option<&ModelCheck>| {
        for_replica(&adapted(name), check, Party::Draft)
            .adapter
            .clone()
    };
    let from_dir = ModelCheck {
        adapters_from_dir: true,
        ..new.clone()
    };
    assert_eq!(adapter("sql", Some(&new)), "sql");
    assert_eq!(adapter("chat", Some(&new)), "");
    assert_eq!(adapter("chat", Some(&from_dir)), "chat");
    assert_eq!(adapter("sql", None), "");
    let undescribed = for_replica(&request, None, Party::Draft);
    assert_eq!(undescribed.as_ref(), &request);
    let chat = adapted("chat");
    assert_eq!(
        for_replica(&chat, Some(&new), Party::Target).adapter,
        "chat"
    );
}

/// A target replica from before a field an open sets gets no session that sets it (it
/// would leave it out): penalties and log-probabilities (they came together), the
/// prompt's figures, the logit bias, `min_tokens`, a structured output; every other
/// session goes there, and anywhere to one not yet described. A draft replica from
/// before any of them gets such a session: it only proposes without it.
#[test]
fn a_replica_from_before_a_field_gets_no_session_that_sets_it() {
    use Party::{Draft, Target};
    let (sampling, lease, bias) = what_opens_borrow();
    let plain = Open::plain(&[1, 2], 8, &sampling, &lease);
    let penalized = Open {
        penalties: duet_engine::penalties::Penalties {
            frequency: 0.5,
            ..Default::default()
        },
        ..plain
    };
    let logprobs = Open {
        logprobs: Some(0),
        ..plain
    };
    let scored = Open {
        prompt_logprobs: Some(1),
        ..plain
    };
    let biased = Open {
        logit_bias: &bias,
        ..plain
    };
    let at_least = Open {
        min_tokens: 4,
        ..plain
    };
    let structured = Open {
        format: Some(&duet_engine::structured::Format::JsonObject),
        ..plain
    };
    let check = model_check;
    let oldest = check(false, false, false);
    let penalties = "presence_penalty and frequency_penalty";
    assert_eq!(
        unfit(Some(&oldest), &penalized, Target),
        predates(penalties)
    );
    assert_eq!(
        unfit(Some(&oldest), &logprobs, Target),
        predates("logprobs")
    );
    assert_eq!(
        unfit(Some(&oldest), &scored, Target),
        predates("prompt_logprobs")
    );
    assert_eq!(
        unfit(Some(&oldest), &biased, Target),
        predates("logit_bias")
    );
    for open in [&penalized, &biased, &at_least, &structured] {
        assert_eq!(unfit(Some(&oldest), open, Draft), None);
    }
    assert_eq!(
        unfit(Some(&oldest), &at_least, Target),
        predates("min_tokens")
    );
    let e = unfit(Some(&oldest), &structured, Target);
    assert_eq!(e, predates("structured_output"));
    assert_eq!(unfit(Some(&oldest), &plain, Target), None);
    let before_scoring = check(true, false, false);
    let e = unfit(Some(&before_scoring), &scored, Target);
    assert_eq!(e, predates("prompt_logprobs"));
    for open in [&plain, &penalized, &logprobs] {
        assert_eq!(unfit(Some(&before_scoring), open, Target), None);
    }
    let newest = check(true, true, true);
    for open in [
        &plain,
        &penalized,
        &logprobs,
        &scored,
        &biased,
        &at_least,
        &structured,
    ] {
        assert_eq!(unfit(Some(&newest), open, Target), None);
    }
    assert_eq!(unfit(None, &scored, Target), None);
}

/// Likewise `min_p`, the repetition penalty and stop tokens held until `min_tokens`,
/// which came later: a target replica from before them gets no session that sets them,
/// a draft replica does.
#[test]
fn a_replica_from_before_min_p_the_repetition_penalty_or_held_stop_tokens_gets_none() {
    use Party::{Draft, Target};
    let (sampling, lease, _) = what_opens_borrow();
    let plain = Open::plain(&[1, 2], 8, &sampling, &lease);
    let repeating = Open {
        penalties: duet_engine::penalties::Penalties {
            repetition: 1.1,
            ..Default::default()
        },
        ..plain
    };
    let min_p = duet_engine::sampling::SamplingParams {
        temperature: 1.0,
        min_p: 0.1,
        ..sampling
    };
    let cut = Open {
        sampling: &min_p,
        ..plain
    };
    // A replica from before them, though after penalties and scoring.
    let before = model_check(true, true, false);
    assert_eq!(
        unfit(Some(&before), &repeating, Target),
        predates("repetition_penalty")
    );
    assert_eq!(unfit(Some(&before), &cut, Target), predates("min_p"));
    let greedy = duet_engine::sampling::SamplingParams {
        temperature: 0.0,
        ..min_p
    };
    let greedy_cut = Open {
        sampling: &greedy,
        ..plain
    };
    assert_eq!(unfit(Some(&before), &greedy_cut, Target), None);
    // Stop tokens held back until min_tokens came later still.
    let held = Open {
        min_tokens: 2,
        stop_token_ids: &[5],
        ..plain
    };
    let no_hold = ModelCheck {
        holds_stop_tokens: false,
        ..model_check(true, true, true)
    };
    let why_held = predates("stop_token_ids with min_tokens");
    assert_eq!(unfit(Some(&no_hold), &held, Target), why_held);
    assert_eq!(unfit(Some(&no_hold), &held, Draft), None);
    let newest = model_check(true, true, true);
    for open in [&repeating, &cut] {
        assert_eq!(unfit(Some(&before), open, Draft), None);
        assert_eq!(unfit(Some(&newest), open, Target), None);
    }
    // A replica gets sessions of the adapters it loads only, or of any where it reads
    // them from a directory.
    let adapted = |adapter| Open {
        adapter: Some(adapter),
        ..plain
    };
    assert_eq!(unfit(Some(&newest), &adapted("sql"), Target), None);
    let why = "the worker loads no adapter `chat`";
    assert_eq!(
        unfit(Some(&newest), &adapted("chat"), Target).as_deref(),
        Some(why)
    );
    let from_dir = ModelCheck {
        adapters_from_dir: true,
        ..newest
    };
    assert_eq!(unfit(Some(&from_dir), &adapted("chat"), Target), None);
}

#[test]
fn an_opens_deadline_counts_a_bounded_queue_before_it() {
    let d = Deadlines {
        call: Duration::from_secs(60),
        call_floor: Duration::from_secs(5),
        open: Duration::from_secs(10),
        prefill_per_token: Duration::from_millis(20),
        control: Duration::from_secs(5),
    };
    assert_eq!(d.open_for(100, 0), Duration::from_secs(12));
    assert_eq!(d.open_for(100, 400), Duration::from_secs(20));
    let most = Duration::from_millis(10_000 + 20 * (100 + MAX_QUEUED_PREFILL as u64));
    assert_eq!(d.open_for(100, MAX_QUEUED_PREFILL), most);
    assert_eq!(d.open_for(100, 1_000_000), most);
}
use super::*;

const MS: Duration = Duration::from_millis(1);

#[test]
fn a_calls_deadline_follows_the_slowest_recent_call_within_its_bounds() {
    let pace = Pace::default();
    let (floor, ceiling) = (1000 * MS, 60_000 * MS);
    // Nothing timed yet: the ceiling.
    assert_eq!(pace.deadline(floor, ceiling), ceiling);
    pace.record(50 * MS);
    assert_eq!(pace.deadline(floor, ceiling), floor);
    pace.record(500 * MS);
    assert_eq!(pace.deadline(floor, ceiling), 4000 * MS);
    // A slow call is remembered, decaying 1% a call.
    for _ in 0..100 {
        pace.record(50 * MS);
    }
    let after = pace.deadline(floor, ceiling);
    assert!((1460 * MS..1480 * MS).contains(&after), "{after:?}");
    pace.record(20_000 * MS);
    assert_eq!(pace.deadline(floor, ceiling), ceiling);
}
