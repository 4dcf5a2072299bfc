//! Sampled tokens follow the target's distribution under every method.

use super::*;

/// With temperature > 0 the committed tokens must follow the target's distribution even
/// though a different draft model proposes them: the first token over many seeds, compared
/// with the target's own distribution computed in process.
#[tokio::test]
async fn sampled_tokens_follow_the_target_distribution() {
    sampled_first_token_follows_the_target(DraftModel, "the cat", 0, false, None).await;
}

/// The same with three more draws from the draft's q verified beside its token (a tree of
/// candidates, multi-candidate rejection sampling).
#[tokio::test]
async fn sampled_tokens_follow_the_target_distribution_with_a_tree_of_candidates() {
    sampled_first_token_follows_the_target(DraftModel, "the cat", 0, true, None).await;
}

/// The same with a draft that drafts only among the first 128 ids and the special tokens
/// (`vocab_shortlist`): its q leaves out what the target may still sample.
#[tokio::test]
async fn sampled_tokens_follow_the_target_distribution_with_a_shortlisted_draft() {
    sampled_first_token_follows_the_target(DraftModel, "the cat", 128, false, None).await;
}

/// The same with prompt lookup: its draft is a point mass (accepted with the target's own
/// probability of it, else the target samples from the rest), on a prompt whose last
/// tokens occurred before, so that the first token is always drafted.
#[tokio::test]
async fn sampled_tokens_follow_the_target_distribution_with_prompt_lookup() {
    sampled_first_token_follows_the_target(Ngram, "", 0, false, None).await;
}

/// The same under a structured output (letters only): the target samples from its rows
/// without the tokens the format leaves out, and the unconstrained draft's proposals
/// outside it are all rejected.
#[tokio::test]
async fn sampled_tokens_follow_the_constrained_target_distribution() {
    sampled_first_token_follows_the_target(DraftModel, "the cat", 0, false, Some("[a-z]+")).await;
}

/// Over 600 seeds, the first token of `prompt` (for NGRAM: of the first candidate prompt
/// whose looked-up token the target gives a fair chance, so that both acceptance and
/// correction happen) is distributed as the target's own first token; the draft-worker's
/// `vocab_shortlist` is `shortlist`; with `trees`, three alternatives beside each draft;
/// with `regex`, the target's under that structured output.
async fn sampled_first_token_follows_the_target(
    method: pb::SpeculationMethod,
    prompt: &str,
    shortlist: usize,
    trees: bool,
    regex: Option<&str>,
) {
    let (m, stack) = tiny_stack_with(shortlist).await;
    // The draft model drafts the first token only where its session opens with the
    // target's (separate devices); on shared cores the first token is a target-only step.
    let separate = (method == DraftModel).then(|| {
        let mut c = coordinator_config(&stack.target.url(), Some(&stack.draft.url()));
        c.speculation.concurrent_prefill = true;
        c.speculation.take_turns = false;
        if trees {
            c.speculation.adaptive.tree_alternatives = 3;
            c.speculation.adaptive.tree_alternatives_above = 0.001;
        }
        start_coordinator(c)
    });
    let url = separate
        .as_ref()
        .map_or_else(|| stack.coordinator.url(), |c| c.url());
    wait_serving(&url, "duet.v1.DraftWorker").await;
    let sampling = duet_engine::sampling::SamplingParams {
        temperature: 1.0,
        top_k: 6,
        top_p: 1.0,
        min_p: 0.0,
        seed: 0,
    };
    let model = reference_model(&m.target);
    let tok = duet_engine::Tokenizer::load(&m.target).unwrap();
    let format = regex.map(|r| duet_engine::structured::Format::Regex(r.into()));
    let first_mask = format.as_ref().map(|f| first_mask(&tok, &model, f));
    let target_p = |text: &str| {
        let ids = tok.encode(text, true).unwrap();
        let mut logits = worker_logits(&model, &ids, ids.len());
        if let Some(mask) = &first_mask {
            let masked = duet_engine::structured::masked(mask, logits.as_slice().into());
            logits = masked.into_owned();
        }
        let p = duet_engine::sampling::process_logits(&logits, &sampling);
        (ids, p.unwrap())
    };
    let (prompt, p) = if method == Ngram {
        // "the cat? sat. the cat" for each printable character: the lookup proposes what
        // followed the first "the cat"; the random target must give it a fair chance.
        (b'!'..=b'~')
            .map(|c| format!("the cat{} sat. the cat", c as char))
            .find_map(|text| {
                let (ids, p) = target_p(&text);
                let mut index = duet_engine::ngram::NgramIndex::new(2, 8);
                index.extend(&ids);
                let drafted = index.lookup(&ids, 1)?.tokens[0];
                (0.1..0.9).contains(&p.prob(drafted)).then_some((text, p))
            })
            .expect("a candidate prompt whose lookup the target may accept")
    } else {
        (prompt.to_string(), target_p(prompt).1)
    };
    let prompt = prompt.as_str();
    if let Some(mask) = &first_mask {
        // The format matters here: the unconstrained target would sample a token outside it.
        let ids = tok.encode(prompt, true).unwrap();
        let raw = worker_logits(&model, &ids, ids.len());
        let raw = duet_engine::sampling::process_logits(&raw, &sampling).unwrap();
        assert!(raw.iter().any(|(id, _)| !mask.is_allowed(id)), "{raw:?}");
    }
    let verifies = verifies_trees(&stack.target.url()).await;

    let n = 600;
    let mut counts = std::collections::BTreeMap::<u32, usize>::new();
    let (mut accepted, mut rejected) = (0, 0);
    for seed in 0..n {
        let req = pb::GenerateRequest {
            temperature: 1.0,
            top_k: 6,
            seed,
            num_speculative_tokens: 1,
            structured_output: format.as_ref().map(duet_serving::wire::format_to_wire),
            // Room for the alternatives too (a round drafts no more than the completion's).
            ..request(prompt, if trees { 4 } else { 2 }, method)
        };
        let g = generate(&url, req).await.unwrap();
        assert!(!g.usage.fell_back_to_target_only);
        // The first round drafted one token (and three alternatives with trees, where the
        // target verifies them: on a CPU).
        let first = if trees && verifies { 4 } else { 1 };
        assert!(g.usage.draft_tokens_proposed >= first, "{:?}", g.usage);
        *counts.entry(g.token_ids[0]).or_default() += 1;
        match g.usage.draft_tokens_accepted {
            0 => rejected += 1,
            _ => accepted += 1,
        }
    }
    // Corrections happened; and acceptances, where the draft had a chance (the random draft
    // model's top tokens may all lie outside the target's top 6).
    assert!(rejected > 0, "{accepted} accepted, {rejected} rejected");
    if method == Ngram {
        assert!(accepted > 0, "{accepted} accepted, {rejected} rejected");
    }
    let tv: f64 = p
        .iter()
        .map(|(id, prob)| {
            (f64::from(prob) - *counts.get(&id).unwrap_or(&0) as f64 / n as f64).abs()
        })
        .sum::<f64>()
        / 2.0;
    assert!(counts.keys().all(|id| p.prob(*id) > 0.0), "{counts:?}");
    assert!(tv < 0.08, "total variation {tv}: {counts:?} vs {p:?}");
}

/// The tokens `format` allows first, over `model`'s logits.
fn first_mask(
    tok: &duet_engine::Tokenizer,
    model: &duet_engine::Model,
    format: &duet_engine::structured::Format,
) -> duet_engine::structured::Mask {
    let grammars = duet_engine::structured::Grammars::new(tok, model.config().vocab);
    let mut constraint = grammars.unwrap().constrain(format).unwrap();
    constraint.masks(&[], &[]).unwrap().remove(0)
}

/// Sampling with drafts made ahead: with the target as its own draft, the third token of a
/// 4-token request is, whenever the first round's guess held, a draft made ahead (with q =
/// p every draft is accepted). Given the two tokens before it, it must follow the target's
/// own distribution: over the runs that used drafts made ahead, the rank of that token in
/// the target's distribution after the run's first two tokens (computed here with the
/// engine) is distributed as that distribution says.
#[tokio::test]
async fn sampled_tokens_drafted_ahead_follow_the_target_distribution() {
    let m = tiny_models();
    let stack = Stack::start(&m.target, &m.target);
    wait_stack(&stack).await;
    let ahead = start_drafting_ahead(&stack).await;
    let top_k = 6;
    let sampling = duet_engine::sampling::SamplingParams {
        temperature: 1.0,
        top_k,
        top_p: 1.0,
        min_p: 0.0,
        seed: 0,
    };
    let model = reference_model(&m.target);
    let prompt = duet_engine::Tokenizer::load(&m.target)
        .unwrap()
        .encode("the cat", true)
        .unwrap();
    // The target's distribution after `after`, most likely token first.
    let target_p = |after: &[u32]| {
        let ids: Vec<u32> = prompt.iter().chain(after).copied().collect();
        let logits = worker_logits(&model, &ids, prompt.len());
        let p = duet_engine::sampling::process_logits(&logits, &sampling);
        let mut p: Vec<(u32, f32)> = p.unwrap().iter().collect();
        p.sort_by(|a, b| b.1.total_cmp(&a.1));
        p
    };

    let mut observed = vec![0.0; top_k];
    let mut expected = vec![0.0; top_k];
    let mut used = 0;
    for seed in 0..2000 {
        let req = pb::GenerateRequest {
            temperature: 1.0,
            top_k: top_k as u32,
            seed,
            num_speculative_tokens: 1,
            ..request("the cat", 4, DraftModel)
        };
        let g = generate(&ahead.url(), req).await.unwrap();
        assert!(!g.usage.fell_back_to_target_only);
        // One draft per round, so the first round drafted ahead (the guess, then one draft).
        assert_eq!(g.usage.drafted_ahead, 1, "{:?}", g.usage);
        if g.usage.drafted_ahead_used == 0 || g.token_ids.len() < 3 {
            continue;
        }
        used += 1;
        let p = target_p(&g.token_ids[..2]);
        let rank = p.iter().position(|&(id, _)| id == g.token_ids[2]);
        let rank = rank.unwrap_or_else(|| panic!("{} is not in {p:?}", g.token_ids[2]));
        observed[rank] += 1.0;
        for (r, (_, prob)) in p.iter().enumerate() {
            expected[r] += f64::from(*prob);
        }
    }
    assert!(used > 300, "only {used} runs used drafts made ahead");
    let tv = observed
        .iter()
        .zip(&expected)
        .map(|(o, e)| (o - e).abs())
        .sum::<f64>()
        / (2.0 * used as f64);
    assert!(
        tv < 0.08,
        "total variation {tv} over {used} runs: ranks {observed:?} vs {expected:?}"
    );
}
