//! Trees of tokens in one pass: each node's logits are its path's as a chain, a kept path
//! goes on as the chain does, and a malformed tree is refused with the cache untouched.

use super::*;

/// Feeds `prefix`, then the tree `nodes`/`parents` in one pass beside another session, and
/// checks each node's logits bit for bit against its path fed as a chain; then keeps one
/// path (`KvCache::keep_path`) and checks the next token against the chain too.
fn check_tree(model: &Model, prefix: &[u32], nodes: &[u32], parents: &[u32], keep: &[usize]) {
    let row_bits = |row: &[f32]| row.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let chain_last = |tokens: &[u32]| {
        let mut cache = model.new_cache(prefix.len() + nodes.len() + 2).unwrap();
        model.forward(&mut cache, prefix, LogitsFor::None).unwrap();
        row_bits(
            model
                .forward(&mut cache, tokens, LogitsFor::Last)
                .unwrap()
                .last()
                .unwrap(),
        )
    };
    let mut tree = model.new_cache(prefix.len() + nodes.len() + 2).unwrap();
    let mut other = model.new_cache(16).unwrap();
    model.forward(&mut tree, prefix, LogitsFor::None).unwrap();
    let out = model
        .forward_batch(&mut [
            SequenceInput::chain(&mut other, &[9, 8, 7], LogitsFor::All),
            SequenceInput {
                cache: &mut tree,
                tokens: nodes,
                logits: LogitsFor::All,
                extra: None,
                greedy: false,
                draws: &[],
                parents,
            },
        ])
        .unwrap();
    let path_of = |mut i: usize| {
        let mut path = vec![nodes[i]];
        while i > 0 {
            i = parents[i] as usize;
            path.insert(0, nodes[i]);
        }
        path
    };
    for i in 0..nodes.len() {
        assert!(
            row_bits(out[1].row(i)) == chain_last(&path_of(i)),
            "node {i}"
        );
    }
    // Keep the root and the nodes at `keep` (a path), then go on from there.
    let rows: Vec<usize> = keep.iter().map(|&i| prefix.len() + i).collect();
    tree.keep_path(prefix.len() + 1, &rows).unwrap();
    let mut path: Vec<u32> = std::iter::once(nodes[0])
        .chain(keep.iter().map(|&i| nodes[i]))
        .collect();
    assert_eq!(&tree.tokens()[prefix.len()..], path.as_slice());
    let next = model.forward(&mut tree, &[77], LogitsFor::Last).unwrap();
    path.push(77);
    assert!(
        row_bits(next.last().unwrap()) == chain_last(&path),
        "after the kept path"
    );
}

/// Each token of a tree (one pass, each attending to its own ancestors) gets the logits its
/// path gets as a chain, bit for bit, on both attention kernels and past the context from
/// which host attention groups a chain's rows; a kept path then continues like the chain.
/// On a GPU (`DUET_TEST_DEVICE=cuda`) the CUDA step runs the trees and the chains alike; a
/// model the step cannot take (candle's ops on a GPU verify chains only) refuses a tree.
#[test]
fn a_tree_gives_each_token_the_logits_of_its_path_as_a_chain() {
    // r; a, c after r; b after a; d after c; e after b.
    let nodes = [11, 200, 17, 3, 99, 255];
    let parents = [0, 0, 1, 0, 3, 2];
    let (_dir, _, model) = tiny(Architecture::Qwen2, 3);
    if !model.verifies_trees() {
        let mut cache = model.new_cache(16).unwrap();
        let mut tree = [SequenceInput {
            cache: &mut cache,
            tokens: &nodes,
            logits: LogitsFor::All,
            extra: None,
            greedy: false,
            draws: &[],
            parents: &parents,
        }];
        let err = model.forward_batch(&mut tree).unwrap_err();
        assert!(matches!(err, EngineError::BadTree(_)), "{err}");
        return;
    }
    for model in [
        model.clone(),
        model
            .with_attention_kernel(AttentionKernel::Tensor)
            .unwrap(),
    ] {
        check_tree(&model, &TOKENS, &nodes, &parents, &[3, 4]);
        check_tree(&model, &TOKENS, &nodes, &parents, &[1, 2, 5]);
    }
    let (_dir, _, llama) = tiny(Architecture::Llama, 4);
    check_tree(&llama, &TOKENS, &nodes, &parents, &[3]);

    let (_dir, long) = long_context_model();
    check_tree(&long, &long_text(260), &nodes, &parents, &[1, 2, 5]);
}

#[test]
fn a_malformed_tree_is_refused_and_leaves_the_cache_untouched() {
    let (_dir, _, model) = tiny(Architecture::Qwen2, 1);
    let mut cache = model.new_cache(16).unwrap();
    model.forward(&mut cache, &[1, 2], LogitsFor::None).unwrap();
    for parents in [&[0u32, 1, 1][..], &[0, 0], &[1, 0, 0]] {
        let err = model
            .forward_batch(&mut [SequenceInput {
                cache: &mut cache,
                tokens: &[3, 4, 5],
                logits: LogitsFor::All,
                extra: None,
                greedy: false,
                draws: &[],
                parents,
            }])
            .unwrap_err();
        assert!(matches!(err, EngineError::BadTree(_)), "{parents:?}: {err}");
        assert_eq!(cache.len(), 2);
    }
    assert!(cache.keep_path(2, &[1]).is_err());
}
