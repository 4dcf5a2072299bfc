//! Forward-pass and KV-cache behaviour on tiny random-weight GGUF models written by the test.

use duet_engine::testing::{
    TinyModel, check_drawn, draw_settings, logits_after_prefix, test_load_options,
};
use duet_engine::{
    Architecture, AttentionKernel, EngineError, ExtraLogits, KvCache, LoadOptions, LogitsFor,
    Model, SequenceInput,
};
use std::path::PathBuf;

mod rows;
mod trees;

fn tiny(arch: Architecture, seed: u64) -> (tempfile::TempDir, PathBuf, Model) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    TinyModel {
        architecture: arch,
        seed,
        // Qwen3's heads are wider than the model's width over their count (0.6B: 16 of 128
        // in 1,024).
        head_dim: (arch == Architecture::Qwen3).then_some(32),
        ..TinyModel::default()
    }
    .write(&path)
    .unwrap();
    let model = Model::load(&path, &test_load_options()).unwrap();
    (dir, path, model)
}

const TOKENS: [u32; 13] = [5, 200, 17, 3, 99, 255, 260, 1, 42, 42, 7, 150, 268];

/// Logits for every position of `tokens`, fed in chunks of `chunk`.
fn logits_in_chunks(model: &Model, tokens: &[u32], chunk: usize) -> Vec<Vec<f32>> {
    logits_after_prefix(model, tokens, 0, chunk)
}

/// Logits for every position of `TOKENS`, prefilled in one pass (the throughput path).
fn prefill_logits(model: &Model) -> Vec<Vec<f32>> {
    let mut cache = model.new_cache(TOKENS.len()).unwrap();
    let logits = model.prefill(&mut cache, &TOKENS, LogitsFor::All).unwrap();
    logits.to_rows()
}

fn argmax(row: &[f32]) -> u32 {
    duet_engine::sampling::argmax(row).unwrap()
}

/// Each logit's bits, row by row.
fn bits(rows: &[Vec<f32>]) -> Vec<Vec<u32>> {
    rows.iter()
        .map(|r| r.iter().map(|x| x.to_bits()).collect())
        .collect()
}

fn max_abs_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// A tiny model with a 512-token context and two key/value heads of three query heads each:
/// long enough for host attention to group a chain's rows (from 256 positions).
fn long_context_model() -> (tempfile::TempDir, Model) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("long.gguf");
    TinyModel {
        hidden: 96,
        heads: 6,
        kv_heads: 2,
        context_length: 512,
        ..TinyModel::default()
    }
    .write(&path)
    .unwrap();
    let model = Model::load(&path, &test_load_options()).unwrap();
    (dir, model)
}

/// `n` tokens of a fixed text spread over the tiny vocabulary.
fn long_text(n: u32) -> Vec<u32> {
    let vocab = duet_engine::testing::tiny_vocab_size() as u32;
    (0..n).map(|i| (i * 37 + 11) % vocab).collect()
}

/// `Tail(n)` gives exactly the last `n` rows of `All` (and all of them when the pass has
/// fewer): verification projects only the rows it reads.
#[test]
fn tail_logits_are_the_last_rows_of_all() {
    let (_dir, _, model) = tiny(Architecture::Qwen2, 11);
    let all = logits_in_chunks(&model, &TOKENS, TOKENS.len());
    for n in [1, 3, TOKENS.len(), TOKENS.len() + 5] {
        let mut cache = model.new_cache(64).unwrap();
        let tail = model
            .forward(&mut cache, &TOKENS, LogitsFor::Tail(n))
            .unwrap();
        let n = n.min(TOKENS.len());
        assert_eq!(tail.rows(), n);
        let rows = tail.to_rows();
        assert_eq!(rows, all[TOKENS.len() - n..], "tail {n}");
        assert_eq!(cache.len(), TOKENS.len());
    }
}

#[test]
fn batch_invariance_one_token_chunks_and_whole_sequence() {
    for arch in [
        Architecture::Qwen2,
        Architecture::Qwen3,
        Architecture::Llama,
    ] {
        let (_dir, _, model) = tiny(arch, 11);
        let single = logits_in_chunks(&model, &TOKENS, 1);
        for chunk in [2, 4, 5, TOKENS.len()] {
            let chunked = logits_in_chunks(&model, &TOKENS, chunk);
            let argmax_a: Vec<_> = single.iter().map(|r| argmax(r)).collect();
            let argmax_b: Vec<_> = chunked.iter().map(|r| argmax(r)).collect();
            assert_eq!(argmax_a, argmax_b, "{arch:?} chunk {chunk}");
            let diff = max_abs_diff(&single, &chunked);
            assert!(
                diff < 1e-4,
                "{arch:?} chunk {chunk}: logits differ by {diff}"
            );
        }
    }
}

#[test]
fn tensor_kernel_matches_host_kernel() {
    let (_dir, _, model) = tiny(Architecture::Qwen2, 3);
    if !model.device().is_cpu() {
        return; // the host kernel runs on the CPU only
    }
    let portable = model
        .with_attention_kernel(AttentionKernel::Tensor)
        .unwrap();
    for chunk in [1, 4, TOKENS.len()] {
        let a = logits_in_chunks(&model, &TOKENS, chunk);
        let b = logits_in_chunks(&portable, &TOKENS, chunk);
        let diff = max_abs_diff(&a, &b);
        assert!(diff < 1e-3, "chunk {chunk}: kernels differ by {diff}");
    }
    // Prefill (the throughput path) takes the tensor kernel's masked form: all rows at once.
    let diff = max_abs_diff(&prefill_logits(&model), &prefill_logits(&portable));
    assert!(diff < 1e-3, "prefill: kernels differ by {diff}");
}

/// A session that starts from rows another session computed (`copy_prefix` of a cache that
/// prefilled in chunks, then decoded, drafted and rolled back) and prefills only the rest
/// holds bitwise what a session that prefilled the whole prompt holds: the workers' prefix
/// cache is exact wherever `kv_rows_invariant` says so, and that is every CPU run.
#[test]
fn a_copied_prefix_continues_exactly_like_a_whole_prefill() {
    let (_dir, _, model) = tiny(Architecture::Qwen2, 9);
    assert_eq!(model.kv_rows_invariant(), model.device().is_cpu());
    if !model.kv_rows_invariant() {
        return;
    }
    let mut whole = model.new_cache(64).unwrap();
    let want = model.prefill(&mut whole, &TOKENS, LogitsFor::All).unwrap();
    let mut donor = model.new_cache(64).unwrap();
    for chunk in [&TOKENS[..2], &TOKENS[2..5]] {
        model.prefill(&mut donor, chunk, LogitsFor::None).unwrap();
    }
    model
        .forward(&mut donor, &TOKENS[5..10], LogitsFor::All)
        .unwrap();
    model
        .forward(&mut donor, &[1, 2, 3], LogitsFor::All)
        .unwrap();
    donor.truncate(10).unwrap();
    assert_eq!(donor.tokens(), &TOKENS[..10]);
    for split in [1, 3, 5, 8, 10] {
        let mut cache = model.new_cache(64).unwrap();
        cache.copy_prefix(&donor, split).unwrap();
        let rest = model
            .prefill(&mut cache, &TOKENS[split..], LogitsFor::All)
            .unwrap();
        for i in 0..rest.rows() {
            assert_eq!(rest.row(i), want.row(split + i), "split {split}, row {i}");
        }
        assert_eq!(cache.tokens(), &TOKENS);
    }
    // candle's portable attention is not row-invariant on the throughput path.
    let portable = model
        .with_attention_kernel(AttentionKernel::Tensor)
        .unwrap();
    assert!(!portable.kv_rows_invariant());
}

/// A session that copies whole prefill chunks of a donor's prompt, or all of the same
/// prompt prefilled to the same end, and prefills the rest cut from there holds bitwise
/// what a fresh prefill cut from the first token holds, on every device and path: what the
/// workers' prefix cache copies where rows depend on the pass
/// (`prefix_cache::Exact::WholeChunks`). On a GPU (gpu-check's engine-tiny) this is the
/// premise of that cache; on this CPU rows match in any chunks, the portable attention's
/// too at this size, so a partial chunk copied would pass here as well.
#[test]
fn whole_prefill_chunks_copied_continue_exactly_on_every_path() {
    let (_dir, _, model) = tiny(Architecture::Qwen2, 9);
    let portable = model
        .with_attention_kernel(AttentionKernel::Tensor)
        .unwrap();
    let prefill_in = |model: &Model, cache: &mut duet_engine::KvCache, tokens: &[u32]| {
        let mut rows = Vec::new();
        for chunk in tokens.chunks(4) {
            let logits = model.prefill(cache, chunk, LogitsFor::All).unwrap();
            rows.extend(logits.to_rows());
        }
        rows
    };
    for model in [&model, &portable] {
        let mut fresh = model.new_cache(64).unwrap();
        let want = prefill_in(model, &mut fresh, &TOKENS);
        // The donor: a shorter prompt (chunks [0, 4), [4, 7)), then calls, rolled back.
        let mut donor = model.new_cache(64).unwrap();
        prefill_in(model, &mut donor, &TOKENS[..7]);
        model.forward(&mut donor, &[1, 2], LogitsFor::All).unwrap();
        donor.truncate(7).unwrap();
        let mut cache = model.new_cache(64).unwrap();
        cache.copy_prefix(&donor, 4).unwrap();
        let rest = prefill_in(model, &mut cache, &TOKENS[4..]);
        assert_eq!(rest, want[4..], "whole chunks copied");
        // The same prompt prefilled to the same end: all of it, then a call alike.
        let mut again = model.new_cache(64).unwrap();
        again.copy_prefix(&donor, 7).unwrap();
        let mut first = model.new_cache(64).unwrap();
        prefill_in(model, &mut first, &TOKENS[..7]);
        let next = |cache: &mut duet_engine::KvCache| {
            let logits = model.forward(cache, &TOKENS[7..9], LogitsFor::All).unwrap();
            logits.to_rows()
        };
        assert_eq!(next(&mut again), next(&mut first), "the same prompt");
    }
}

#[test]
fn truncate_and_replay_equals_a_fresh_run() {
    let (_dir, _, model) = tiny(Architecture::Qwen2, 5);
    let fresh = logits_in_chunks(&model, &TOKENS, TOKENS.len());

    let mut cache = model.new_cache(64).unwrap();
    model
        .forward(&mut cache, &TOKENS[..6], LogitsFor::None)
        .unwrap();
    // A rejected draft: four wrong tokens, then roll back and replay the real ones.
    model
        .forward(&mut cache, &[1, 2, 3, 4], LogitsFor::All)
        .unwrap();
    cache.truncate(6).unwrap();
    let replay = model
        .forward(&mut cache, &TOKENS[6..], LogitsFor::All)
        .unwrap();
    for (i, row) in fresh[6..].iter().enumerate() {
        assert_eq!(replay.row(i), row.as_slice(), "position {}", i + 6);
    }
}

#[test]
fn interleaved_sessions_and_batched_sessions_match_running_alone() {
    let (_dir, _, model) = tiny(Architecture::Llama, 9);
    let other: Vec<u32> = TOKENS.iter().rev().copied().collect();
    let alone_a = logits_in_chunks(&model, &TOKENS, 3);
    let alone_b = logits_in_chunks(&model, &other, 3);

    let (mut a, mut b) = (model.new_cache(64).unwrap(), model.new_cache(64).unwrap());
    let (mut got_a, mut got_b) = (Vec::new(), Vec::new());
    for (pa, pb) in TOKENS.chunks(3).zip(other.chunks(3)) {
        let logits = model.forward(&mut a, pa, LogitsFor::All).unwrap();
        got_a.extend(logits.to_rows());
        let logits = model.forward(&mut b, pb, LogitsFor::All).unwrap();
        got_b.extend(logits.to_rows());
    }
    assert_eq!(got_a, alone_a);
    assert_eq!(got_b, alone_b);

    // Both sessions in one forward pass, with different lengths and positions.
    let (mut a, mut b) = (model.new_cache(64).unwrap(), model.new_cache(64).unwrap());
    model
        .forward(&mut a, &TOKENS[..5], LogitsFor::None)
        .unwrap();
    let out = model
        .forward_batch(&mut [
            SequenceInput::chain(&mut a, &TOKENS[5..], LogitsFor::All),
            SequenceInput::chain(&mut b, &other[..4], LogitsFor::Last),
        ])
        .unwrap();
    assert_eq!((a.len(), b.len()), (TOKENS.len(), 4));
    for i in 0..out[0].rows() {
        assert_eq!(out[0].row(i), alone_a[5 + i].as_slice());
    }
    assert_eq!(out[1].rows(), 1);
    let diff = max_abs_diff(&[out[1].row(0).to_vec()], &[alone_b[3].clone()]);
    assert!(diff < 1e-4, "batched session differs by {diff}");
}

#[test]
fn errors_leave_the_cache_untouched() {
    let (_dir, _, model) = tiny(Architecture::Qwen2, 1);
    let mut cache = model.new_cache(8).unwrap();
    model
        .forward(&mut cache, &[1, 2, 3], LogitsFor::Last)
        .unwrap();

    let full = model
        .forward(&mut cache, &[1; 6], LogitsFor::All)
        .unwrap_err();
    assert!(
        matches!(
            full,
            EngineError::CacheFull {
                needed: 9,
                capacity: 8
            }
        ),
        "{full}"
    );
    let bad = model
        .forward(&mut cache, &[1, 100_000], LogitsFor::All)
        .unwrap_err();
    assert!(
        matches!(bad, EngineError::TokenOutOfRange { token: 100_000, .. }),
        "{bad}"
    );
    let empty = model.forward(&mut cache, &[], LogitsFor::All).unwrap_err();
    assert!(matches!(empty, EngineError::EmptyInput));
    assert_eq!(cache.len(), 3);
    assert!(matches!(
        cache.truncate(4),
        Err(EngineError::TruncateBeyondEnd {
            requested: 4,
            len: 3
        })
    ));
    assert!(matches!(
        model.new_cache(100_000),
        Err(EngineError::CapacityTooLarge { max: 256, .. })
    ));
}

#[test]
fn a_cache_from_another_model_is_rejected() {
    let (_dir, _, model) = tiny(Architecture::Qwen2, 1);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("wide.gguf");
    TinyModel {
        hidden: 128,
        ..TinyModel::default()
    }
    .write(&path)
    .unwrap();
    let wide = Model::load(&path, &test_load_options()).unwrap();
    let mut cache: KvCache = wide.new_cache(8).unwrap();
    let err = model
        .forward(&mut cache, &[1], LogitsFor::Last)
        .unwrap_err();
    assert!(matches!(err, EngineError::CacheMismatch), "{err}");
}

#[test]
fn weights_are_shared_between_clones_and_threads() {
    let (_dir, _, model) = tiny(Architecture::Qwen2, 2);
    let expected = logits_in_chunks(&model, &TOKENS, 4);
    let handles: Vec<_> = (0..3)
        .map(|_| {
            let model = model.clone();
            std::thread::spawn(move || logits_in_chunks(&model, &TOKENS, 4))
        })
        .collect();
    for h in handles {
        assert_eq!(h.join().unwrap(), expected);
    }
}

/// Random appends and rollbacks, as speculation makes them: after every step, the logits
/// of the new tokens equal those of a fresh session fed the same committed sequence.
#[test]
fn random_appends_and_rollbacks_match_fresh_sessions() {
    use rand::{Rng, SeedableRng};
    let (_dir, _, model) = tiny(Architecture::Qwen2, 4);
    let vocab = model.config().vocab as u32;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(42);
    let mut cache = model.new_cache(48).unwrap();
    let mut sequence: Vec<u32> = Vec::new();
    for step in 0..60 {
        if !sequence.is_empty() && rng.random_bool(0.4) {
            let keep = rng.random_range(0..=sequence.len());
            cache.truncate(keep).unwrap();
            sequence.truncate(keep);
            continue;
        }
        let n = rng.random_range(1..=5).min(48 - sequence.len());
        if n == 0 {
            continue;
        }
        let tokens: Vec<u32> = (0..n).map(|_| rng.random_range(0..vocab)).collect();
        let got = model.forward(&mut cache, &tokens, LogitsFor::All).unwrap();
        sequence.extend_from_slice(&tokens);
        assert_eq!(cache.len(), sequence.len());

        let mut fresh = model.new_cache(48).unwrap();
        let want = model
            .forward(&mut fresh, &sequence, LogitsFor::All)
            .unwrap();
        for i in 0..n {
            assert_eq!(
                got.row(i),
                want.row(sequence.len() - n + i),
                "step {step}, new token {i}"
            );
        }
    }
}

/// A vocabulary shortlist (a draft-worker's `vocab_shortlist`) computes the same logits for
/// the ids it keeps, the first `n` and the special tokens, and for a session's extra ids,
/// bit for bit (the same rows of the same weights), and `-inf` for every other id, which is
/// then never drafted.
#[test]
fn a_shortlist_keeps_its_ids_logits_and_rules_out_the_rest() {
    let (_dir, path, full) = tiny(Architecture::Qwen2, 11);
    let options = LoadOptions {
        shortlist: Some(100),
        ..test_load_options()
    };
    let short = Model::load(&path, &options).unwrap();
    let vocab = duet_engine::testing::tiny_vocab_size();
    let specials = vocab - 3..vocab;
    let (a, b) = (
        logits_in_chunks(&full, &TOKENS, 4),
        logits_in_chunks(&short, &TOKENS, 4),
    );
    for (wide, narrow) in a.iter().zip(&b) {
        assert_eq!(narrow.len(), vocab);
        for (id, (x, y)) in wide.iter().zip(narrow).enumerate() {
            if id < 100 || specials.contains(&id) {
                assert_eq!(x.to_bits(), y.to_bits(), "id {id}");
            } else {
                assert_eq!(*y, f32::NEG_INFINITY, "id {id}");
            }
        }
    }
    // A session's extra ids (the rare tokens of its text) get their logits too, the same
    // bits; ids the shortlist has, and repeats, are not added again.
    let mut extra = ExtraLogits::default();
    short.extend_shortlist(&mut extra, &[150, 5, 200]).unwrap();
    short
        .extend_shortlist(&mut extra, &[200, 267, 150])
        .unwrap();
    assert_eq!(extra.ids(), [150, 200]);
    let mut cache = short.new_cache(64).unwrap();
    let mut rows = Vec::new();
    for part in TOKENS.chunks(4) {
        let mut seqs = [SequenceInput {
            cache: &mut cache,
            tokens: part,
            logits: LogitsFor::All,
            extra: Some(&extra),
            greedy: false,
            draws: &[],
            parents: &[],
        }];
        let logits = short.forward_batch(&mut seqs).unwrap().remove(0);
        rows.extend(logits.to_rows());
    }
    for (wide, with_extra) in a.iter().zip(&rows) {
        for (id, (x, y)) in wide.iter().zip(with_extra).enumerate() {
            if id < 100 || specials.contains(&id) || id == 150 || id == 200 {
                assert_eq!(x.to_bits(), y.to_bits(), "id {id}");
            } else {
                assert_eq!(*y, f32::NEG_INFINITY, "id {id}");
            }
        }
    }
    // The whole model has no shortlist to extend.
    let mut none = ExtraLogits::default();
    full.extend_shortlist(&mut none, &[150]).unwrap();
    assert!(none.ids().is_empty());
    // A shortlist as long as the vocabulary is the whole of it.
    let whole = LoadOptions {
        shortlist: Some(vocab),
        ..test_load_options()
    };
    let whole = Model::load(&path, &whole).unwrap();
    assert_eq!(logits_in_chunks(&whole, &TOKENS, 4), a);
}

/// Past 256 cached positions host attention groups rows and heads that share a key/value
/// head: a long sequence fed one token at a time, in chunks across that point, and in one
/// pass beside a short session still gives the same logits, bit for bit.
#[test]
fn long_contexts_stay_batch_invariant() {
    let (_dir, model) = long_context_model();
    let tokens = long_text(300);
    let prefix = 240;
    let run = |chunk: usize| bits(&logits_after_prefix(&model, &tokens, prefix, chunk));
    let single = run(1);
    for chunk in [3, 7, 60] {
        assert!(run(chunk) == single, "chunk {chunk}");
    }

    // Rows 250..266 of the long session (across 256) in one pass with a short session.
    let mut long = model.new_cache(512).unwrap();
    model
        .forward(&mut long, &tokens[..250], LogitsFor::None)
        .unwrap();
    let mut short = model.new_cache(512).unwrap();
    let out = model
        .forward_batch(&mut [
            SequenceInput::chain(&mut short, &tokens[..5], LogitsFor::All),
            SequenceInput::chain(&mut long, &tokens[250..266], LogitsFor::All),
        ])
        .unwrap();
    let rows = out[1].to_rows();
    assert!(
        bits(&rows) == single[250 - prefix..266 - prefix],
        "beside a short session"
    );
}

/// Projections loaded as one weight a launch (`LoadOptions::fuse_projections`: the tiny
/// models' q, k and v, and gate and up, share a type) give every row of the invariant path
/// the logits of separate projections bit for bit, on both architectures (Qwen2's q, k and v
/// have biases). A prompt's prefill too on the CPU; on a GPU, where candle picks its prefill
/// kernels by shape, within rounding.
#[test]
fn fused_projections_give_the_logits_of_separate_ones() {
    for arch in [
        Architecture::Qwen2,
        Architecture::Qwen3,
        Architecture::Llama,
    ] {
        let (_dir, path, _) = tiny(arch, 11);
        let load = |fuse| {
            let options = LoadOptions {
                fuse_projections: Some(fuse),
                ..test_load_options()
            };
            Model::load(&path, &options).unwrap()
        };
        let (fused, separate) = (load(true), load(false));
        for chunk in [1, 4] {
            let want = logits_in_chunks(&separate, &TOKENS, chunk);
            assert_eq!(logits_in_chunks(&fused, &TOKENS, chunk), want, "{arch:?}");
        }
        let (got, want) = (prefill_logits(&fused), prefill_logits(&separate));
        match separate.device().is_cpu() {
            true => assert_eq!(got, want, "{arch:?}"),
            false => assert!(max_abs_diff(&got, &want) < 1e-3, "{arch:?}"),
        }
    }
}
