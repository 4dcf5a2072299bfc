//! Trees of drafts: verified as their paths, proposed beside the chain, equal to target-only.

use super::*;

/// A Verify of a tree of drafts over gRPC answers each draft as a chain of its path would,
/// and the next call keeps the accepted path's rows (its pass computes only the token after
/// them); a sampling session's tree answers p for each; malformed parents are refused,
/// naming the field.
#[tokio::test]
async fn a_tree_verify_answers_each_draft_as_its_path_and_keeps_the_accepted_one() {
    use duet_proto::v1::target_worker_client::TargetWorkerClient;
    let (_m, target) = serving_target().await;
    let mut c = TargetWorkerClient::connect(target.url()).await.unwrap();
    let (tree, chain) = (
        open_session(&target.url(), 64).await,
        open_session(&target.url(), 64).await,
    );
    if !verifies_trees(&target.url()).await {
        // A worker that verifies chains only (candle's ops on a GPU, without the CUDA step):
        // a tree is refused, naming the field.
        let err = c
            .verify(pb::VerifyRequest {
                session_id: tree.session_id,
                instance_id: tree.instance_id,
                keep: 2,
                append: vec![3],
                draft: vec![10, 11],
                parents: vec![0, 0],
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument);
        assert!(
            err.message()
                .starts_with("parents: this worker verifies chains"),
            "{err:?}"
        );
        return;
    }
    let call =
        |s: &pb::OpenSessionResponse, keep, append: &[u32], draft: &[u32]| pb::VerifyRequest {
            session_id: s.session_id.clone(),
            instance_id: s.instance_id,
            keep,
            append: append.to_vec(),
            draft: draft.to_vec(),
            ..Default::default()
        };
    // 10, 11 in a chain; 20 beside 11 (after 10). The prompt's cache holds [1, 2].
    let mut t = call(&tree, 2, &[3], &[10, 11, 20]);
    t.parents = vec![0, 1, 1];
    let tree_answer = c.verify(t).await.unwrap().into_inner().argmax;
    assert_eq!(tree_answer.len(), 4);
    let mut verify = async |req| c.verify(req).await.unwrap().into_inner();
    let chained = verify(call(&chain, 2, &[3], &[10, 11])).await.argmax;
    assert_eq!(tree_answer[..3], chained[..]);
    let beside = verify(call(&chain, 4, &[20], &[])).await.argmax;
    assert_eq!(tree_answer[3], beside[0], "20 after 10");
    // The tree's path 10, 20 accepted: the next call keeps 10, appends 20 and one more.
    let next = verify(call(&tree, 4, &[20, 30], &[])).await;
    let want = verify(call(&chain, 5, &[30], &[])).await.argmax;
    assert_eq!(next.argmax, want);
    assert_eq!(next.timing.unwrap().batch_rows, 1, "20's row was kept");

    let sampling = open_sampling_session(&target.url(), 64).await;
    // A sampling session's tree: p after each draft's path.
    let mut t = call(&sampling, 2, &[3], &[10, 11, 20]);
    t.parents = vec![0, 1, 1];
    let answer = c.verify(t).await.unwrap().into_inner();
    assert_eq!((answer.p.len(), answer.argmax.len()), (4, 0));
    for (parents, why) in [
        (vec![0], "parents: 1 parents for 2 drafts"),
        (vec![0, 2], "parents: draft 2 follows draft 2"),
    ] {
        let mut bad = call(&tree, 2, &[3], &[10, 11]);
        bad.parents = parents;
        let err = c.verify(bad).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument);
        assert!(err.message().starts_with(why), "{err:?}");
    }
}

/// A Propose asked for alternatives answers, beside each token, up to that many other
/// tokens, never its own, and drafts the chain it drafts without them; more than 7 a
/// position is refused.
#[tokio::test]
async fn a_propose_offers_alternatives_beside_its_chain() {
    use duet_proto::v1::draft_worker_client::DraftWorkerClient;
    let (_m, draft) = serving_draft().await;
    let mut c = DraftWorkerClient::connect(draft.url()).await.unwrap();
    let call = |s: pb::OpenSessionResponse, above, most| pb::ProposeRequest {
        session_id: s.session_id,
        instance_id: s.instance_id,
        keep: 2,
        append: vec![3],
        k: 5,
        alternatives_above: above,
        max_alternatives: most,
        ..Default::default()
    };
    let mut drafted = Vec::new();
    for (above, most) in [(0.0, 0), (1e-6, 2)] {
        let s = open_session(&draft.url(), 64).await;
        let mut stream = c.propose(call(s, above, most)).await.unwrap().into_inner();
        let mut got = Vec::new();
        while let Some(m) = stream.message().await.unwrap() {
            got.push((m.token, m.alternatives));
        }
        drafted.push(got);
    }
    let tokens = |got: &[(u32, Vec<u32>)]| got.iter().map(|g| g.0).collect::<Vec<_>>();
    assert_eq!(tokens(&drafted[0]), tokens(&drafted[1]));
    assert!(drafted[0].iter().all(|(_, others)| others.is_empty()));
    for (token, others) in &drafted[1] {
        assert_eq!(others.len(), 2, "{token}: {others:?}");
        assert!(!others.contains(token));
    }
    let err = c
        .propose(call(open_session(&draft.url(), 64).await, 0.5, 8))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(
        err.message()
            .starts_with("max_alternatives: 8 is more than 7"),
        "{err:?}"
    );
}

/// Through the coordinator, with alternatives verified beside the draft model's chains
/// (a fixed threshold low enough that every round carries some), greedy output is the
/// target's own for named K, the controller's K and AUTO; the alternatives show in the
/// metrics, and sampling requests (their trees: more draws from q) are served too.
#[tokio::test]
async fn trees_of_drafts_equal_target_only() {
    // The draft: the target's embeddings and first two layers (its seed, one layer fewer),
    // so where its first choice is not the target's its runner-ups often are, whatever the
    // device's rounding (the other tests' draft, of another seed, agrees by chance only).
    let m = tiny_models();
    duet_engine::testing::TinyModel::default()
        .write(&m.draft)
        .unwrap();
    let stack = Stack::start_with(worker_config(&m.draft), worker_config(&m.target));
    wait_stack(&stack).await;
    let mut config = coordinator_config(&stack.target.url(), Some(&stack.draft.url()));
    config.speculation.adaptive.tree_alternatives = 3;
    config.speculation.adaptive.tree_alternatives_above = 0.001;
    let trees = start_coordinator(config);
    wait_serving(&trees.url(), "").await;
    for prompt in ["the cat", "def f(x):\n\treturn"] {
        let plain = generate(&stack.coordinator.url(), request(prompt, 40, TargetOnly))
            .await
            .unwrap();
        for (method, k) in [(DraftModel, 4), (DraftModel, 0), (Auto, 0)] {
            let mut req = request(prompt, 40, method);
            req.num_speculative_tokens = k;
            let g = generate(&trees.url(), req).await.unwrap();
            let case = format!("prompt {prompt:?}, {method:?} K = {k}");
            assert_eq!(g.token_ids, plain.token_ids, "{case}");
            let u = &g.usage;
            assert!(!u.fell_back_to_target_only, "{case}: {}", u.fallback_reason);
            assert!(u.rounds + u.draft_tokens_accepted >= u.completion_tokens);
        }
    }
    let mut req = request("the cat", 20, DraftModel);
    req.temperature = 1.0;
    req.seed = 7;
    let sampled = generate(&trees.url(), req).await.unwrap();
    assert_eq!(sampled.usage.completion_tokens, 20);
    let scraped = scrape(&trees).await;
    let verified = sample(&scraped, "duet_tree_alternatives_total");
    let taken = sample(&scraped, "duet_tree_alternatives_accepted_total");
    eprintln!("tree alternatives: {taken} of {verified} accepted");
    if !verifies_trees(&stack.target.url()).await {
        // A worker that verifies chains only: the coordinator sends it none.
        assert_eq!(verified, 0.0);
        return;
    }
    assert!(verified > 0.0, "{verified}");
    assert!(taken > 0.0 && taken < verified, "{taken} of {verified}");
    wait_no_sessions(&stack, Duration::from_secs(5)).await;
}
