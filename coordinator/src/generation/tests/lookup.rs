//! Prompt lookup through fake workers: matches drafted as many tokens as pay, the target's
//! text kept, a predicted output drafted from, and the proposal cache's earlier text
//! proposed to its own tenant only, winning over a shorter match.

use super::*;

/// NGRAM with K left to the server (`choose_k`): every round with a match drafts, as many
/// of the match's tokens as the controller finds pay: on text that repeats, more each round
/// as its lookups hold, up to the limit of 16 (then the completion's room). The tokens stay
/// the target's.
#[tokio::test(start_paused = true)]
async fn prompt_lookup_without_k_drafts_each_match_as_many_tokens_as_pay() {
    let prompt = [5, 17, 42, 7, 9, 11];
    let target = Target::Cycle(4);
    let workers = FakeWorkers::new(Script {
        target,
        ..Script::default()
    });
    let mut req = request(Method::NGRAM, 16, 60);
    req.prompt = prompt.to_vec();
    req.choose_k = true;
    let r = run(&workers, req).await;
    assert_eq!(r.result, Ok(()));
    assert_eq!(r.tokens, generated(target, &prompt, 60));
    // Two plain steps until the text has a match of two tokens.
    assert_eq!(workers.verified_drafts(), vec![0, 0, 1, 2, 5, 15, 16, 13]);
    let u = usage(&r);
    assert_eq!(u.draft_tokens_accepted, 52);
    assert_eq!((u.method, u.num_speculative_tokens), (Method::NGRAM, 16));
}

/// Prompt lookup proposes nothing on text it cannot predict and long runs on text that
/// repeats; either way the tokens are the target's own.
#[tokio::test]
async fn prompt_lookup_keeps_the_target_text() {
    let prompt = [5, 17, 42, 7, 9, 11];
    for (target, k) in [
        (Target::Hash, 4),
        (Target::Cycle(3), 4),
        (Target::Cycle(4), 16),
    ] {
        let workers = FakeWorkers::new(Script {
            target,
            ..Script::default()
        });
        let mut req = request(Method::NGRAM, k, 40);
        req.prompt = prompt.to_vec();
        let r = run(&workers, req).await;
        assert_eq!(r.result, Ok(()), "{target:?}");
        assert_eq!(r.tokens, generated(target, &prompt, 40), "{target:?}");
        let u = usage(&r);
        if let Target::Cycle(_) = target {
            // Two plain steps until the text has a match of two tokens, then every lookup
            // is right: K accepted plus the bonus per round.
            assert_eq!(
                u.draft_tokens_accepted, u.draft_tokens_proposed,
                "{target:?}"
            );
            assert_eq!(u.rounds, 2 + 38_usize.div_ceil(k + 1), "{target:?}");
            let p = u.proposers.iter().find(|p| p.proposer == Proposer::Ngram);
            assert_eq!(p.map(|p| p.rounds), Some(u.rounds - 2));
        }
        // No draft-worker is involved.
        assert!(workers.appended(Party::Draft).is_empty());
        assert_eq!(u.fallback, None);
    }
}

/// A predicted output (`prediction`) is drafted from as the prompt is, its start where the
/// completion starts: right, every round commits K + 1 tokens from the first (where the
/// prompt alone gives no match for the target's hashed text: one token a round); half
/// right, the output is the target's all the same. DRAFT_MODEL ignores it.
#[tokio::test]
async fn a_predicted_output_is_drafted_from_where_the_completion_starts() {
    let prompt = [5, 17, 42, 7];
    let text = generated(Target::Hash, &prompt, 30);
    let mut half = text.clone();
    half[15..].iter_mut().for_each(|t| *t += 1);
    let plain = run(
        &FakeWorkers::new(Script::default()),
        request(Method::NGRAM, 4, 30),
    )
    .await;
    assert_eq!(usage(&plain).rounds, 30);
    // Right: K + 1 a round. Half right: three such rounds, then one token a round.
    for (prediction, rounds) in [(&text, 6), (&half, 3 + 15)] {
        let req = ValidRequest {
            prediction: prediction.clone(),
            ..request(Method::NGRAM, 4, 30)
        };
        let r = run(&FakeWorkers::new(Script::default()), req).await;
        assert_eq!(r.tokens, text);
        assert_eq!(usage(&r).rounds, rounds);
    }
    let req = ValidRequest {
        prediction: text.clone(),
        ..request(Method::DRAFT_MODEL, 4, 30)
    };
    let r = run(&FakeWorkers::new(Script::default()), req).await;
    let looked_up = usage(&r)
        .proposers
        .iter()
        .any(|p| p.proposer == Proposer::Ngram);
    assert_eq!((r.tokens, looked_up), (text, false));
}

/// The proposal cache: a request's text teaches it, and the same prompt again (text prompt
/// lookup cannot predict) has its continuation proposed by the cache and accepted round
/// after round; a request of another tenant gets nothing from it. The tokens are the
/// target's own throughout.
#[tokio::test]
async fn the_proposal_cache_proposes_a_tenants_earlier_text_to_that_tenant_only() {
    use crate::proposals::{ProposalCache, Tenant};
    let prompt = [5, 17, 42, 7, 9, 11, 3, 8];
    let workers = FakeWorkers::new(Script::default());
    let cache = Arc::new(ProposalCache::new(10_000));
    let run_as = |tenant| {
        let mut ctx = context(&workers, false);
        ctx.proposals = Some((cache.clone(), Tenant(tenant)));
        let metrics = ctx.metrics.clone();
        let mut req = request(Method::NGRAM, 4, 40);
        req.prompt = prompt.to_vec();
        async move { (run_with(ctx, req).await, metrics.proposal_cache_hits.get()) }
    };
    let want = generated(Target::Hash, &prompt, 40);
    let (first, hits) = run_as(1).await;
    assert_eq!((first.tokens.clone(), hits), (want.clone(), 0));
    assert!(!cache.is_empty());

    let (other, hits) = run_as(2).await;
    assert_eq!((other.tokens.clone(), hits), (want.clone(), 0));
    assert_eq!(
        usage(&other).draft_tokens_proposed,
        usage(&first).draft_tokens_proposed
    );

    let (again, hits) = run_as(1).await;
    assert_eq!(again.tokens, want);
    let u = usage(&again);
    assert_eq!(u.draft_tokens_accepted, u.draft_tokens_proposed);
    assert!(u.draft_tokens_accepted >= 30, "{u:?}");
    assert_eq!(
        hits, u.rounds as u64,
        "every round's proposal came from the cache"
    );
}

/// A prompt that holds two tokens of the output here and there, each followed by something
/// else (a tool's schema beside the JSON the model writes): the request's own text matches
/// those two tokens and proposes what its prompt went on with, where the cache matched the
/// eight before them and holds what the output went on with. The longer match is proposed:
/// every proposal is taken. The same request with nothing cached proposes the prompt's
/// continuations, and none is taken.
#[tokio::test]
async fn the_cache_wins_over_a_shorter_match_in_the_requests_own_text() {
    use crate::proposals::{ProposalCache, Tenant};
    let prompt: Vec<u32> = (0..30).map(|i| (i * 7 + 3) % 200).collect();
    let out = generated(Target::Hash, &prompt, 40);
    // Output pairs 8..17, each followed by a token the output does not go on with.
    let mut decoyed: Vec<u32> = (8..17)
        .flat_map(|i| [out[i], out[i + 1], (out[i + 2] + 1) % FAKE_TOKENS])
        .collect();
    decoyed.extend_from_slice(&prompt[27..]);
    // The hash target reads the length and the last three tokens: the same output.
    assert_eq!(generated(Target::Hash, &decoyed, 40), out);

    let workers = FakeWorkers::new(Script::default());
    let cache = Arc::new(ProposalCache::new(10_000));
    let run_as = |tenant, prompt: &[u32]| {
        let mut ctx = context(&workers, false);
        ctx.proposals = Some((cache.clone(), Tenant(tenant)));
        let mut req = request(Method::NGRAM, 4, 40);
        req.prompt = prompt.to_vec();
        run_with(ctx, req)
    };
    assert_eq!(run_as(1, &prompt).await.tokens, out);

    let alone = run_as(2, &decoyed).await;
    assert_eq!(alone.tokens, out);
    let u = usage(&alone);
    assert_eq!(u.draft_tokens_accepted, 0);
    assert!(u.draft_tokens_proposed >= 4, "{u:?}");

    let cached = run_as(1, &decoyed).await;
    assert_eq!(cached.tokens, out);
    let u = usage(&cached);
    assert_eq!(u.draft_tokens_accepted, u.draft_tokens_proposed);
    assert!(u.draft_tokens_accepted >= 24, "{u:?}");
}
