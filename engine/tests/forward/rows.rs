//! A pass's rows on the CUDA step and where they are read: the step against candle's ops,
//! an adapted session's deltas, graphs replaying the eager step (on a GPU), and the greedy
//! and drawn choices made where the rows are against those of the full rows.

use super::*;

/// On a GPU, the CUDA step (our kernels over preallocated buffers) and candle's ops compute
/// the same model: logits within rounding of each other (they differ in how attention sums
/// and norms reduce), and each bitwise the same across chunkings (the other tests).
#[cfg(feature = "cuda")]
#[test]
fn the_cuda_step_agrees_with_candles_ops() {
    for arch in [
        Architecture::Qwen2,
        Architecture::Qwen3,
        Architecture::Llama,
    ] {
        let (_dir, _, model) = tiny(arch, 5);
        if !model.device().is_cuda() {
            eprintln!("skipped: the models are not on CUDA (DUET_TEST_DEVICE)");
            return;
        }
        let step = logits_in_chunks(&model, &TOKENS, 4);
        let candle = logits_in_chunks(&model.with_cuda_step(false), &TOKENS, 4);
        let scale = candle.iter().flatten().fold(0f32, |m, x| m.max(x.abs()));
        let diff = max_abs_diff(&step, &candle);
        eprintln!("{arch:?}: largest difference {diff} (largest logit {scale})");
        assert!(
            diff <= 0.01 * scale,
            "{arch:?}: {diff} against logits up to {scale}"
        );
        assert!(model.cuda_graphs().is_some(), "the step ran");
    }
}

/// On a GPU, a LoRA adapter's session runs on the CUDA step with its deltas: its logits are
/// the CPU's adapted session's within rounding (and not the model's without them), bit for
/// bit the same fed a row at a time, four at a time and whole, from the passes' graphs
/// too; a session without the adapter gets bit for bit in a shared pass what it gets
/// alone; and a prompt's prefill (candle's matmuls with the adapter's copies on the GPU)
/// comes within rounding of the step's.
#[cfg(feature = "cuda")]
#[test]
fn an_adapted_session_on_the_gpu_keeps_its_deltas_and_batch_invariance() {
    use duet_engine::testing::{TinyAdapter, chunked_logits};
    let (dir, path, model) = tiny(Architecture::Qwen2, 5);
    if !model.device().is_cuda() {
        eprintln!("skipped: the models are not on CUDA (DUET_TEST_DEVICE)");
        return;
    }
    let at = dir.path().join("adapter");
    TinyAdapter::default().write(&at, model.config()).unwrap();
    let cpu = Model::load(&path, &LoadOptions::default()).unwrap();
    let adapted = |model: &Model, chunk: usize| -> Vec<Vec<f32>> {
        let adapter = model.load_adapter("a", &at).unwrap();
        let mut cache = model
            .new_adapted_cache(TOKENS.len(), Some(adapter))
            .unwrap();
        chunked_logits(model, &mut cache, &TOKENS, chunk)
    };
    let ones = adapted(&model, 1);
    for chunk in [4, 13, 1, 4, 13] {
        assert!(
            bits(&adapted(&model, chunk)) == bits(&ones),
            "chunk {chunk}"
        );
    }
    let want = adapted(&cpu, 4);
    let scale = want.iter().flatten().fold(0f32, |m, x| m.max(x.abs()));
    let diff = max_abs_diff(&ones, &want);
    eprintln!("adapted: largest difference from the CPU's {diff} (largest logit {scale})");
    assert!(diff <= 0.01 * scale, "{diff} against logits up to {scale}");
    let plain = logits_in_chunks(&model, &TOKENS, 4);
    assert!(
        max_abs_diff(&plain, &ones) > 0.1,
        "the adapter moves the logits"
    );

    let adapter = model.load_adapter("a", &at).unwrap();
    let mut a = model
        .new_adapted_cache(TOKENS.len(), Some(adapter))
        .unwrap();
    let mut b = model.new_cache(TOKENS.len()).unwrap();
    let input = |cache| SequenceInput::chain(cache, &TOKENS, LogitsFor::All);
    let out = model
        .forward_batch(&mut [input(&mut a), input(&mut b)])
        .unwrap();
    assert!(
        bits(&out[0].to_rows()) == bits(&ones),
        "beside a session of no adapter"
    );
    assert!(
        bits(&out[1].to_rows()) == bits(&plain),
        "beside an adapted session"
    );

    let adapter = model.load_adapter("a", &at).unwrap();
    let mut cache = model
        .new_adapted_cache(TOKENS.len(), Some(adapter))
        .unwrap();
    let prefilled = model.prefill(&mut cache, &TOKENS, LogitsFor::All).unwrap();
    let prefilled = prefilled.to_rows();
    let diff = max_abs_diff(&prefilled, &ones);
    assert!(
        diff <= 0.01 * scale,
        "prefill: {diff} against logits up to {scale}"
    );
    assert!(model.cuda_graphs().is_some_and(|g| g.failure.is_none()));
}

/// On a GPU, each row bucket's CUDA graph (captured at the bucket's first pass, replayed
/// after) gives the logits the same launches give one by one, bit for bit.
#[cfg(feature = "cuda")]
#[test]
fn cuda_graphs_replay_the_eager_step_bit_for_bit() {
    let (_dir, path, _) = tiny(Architecture::Qwen2, 9);
    let load = |cuda_graphs| {
        let options = LoadOptions {
            cuda_graphs,
            ..test_load_options()
        };
        Model::load(&path, &options).unwrap()
    };
    let (graphs, eager) = (load(true), load(false));
    if !graphs.device().is_cuda() {
        eprintln!("skipped: the models are not on CUDA (DUET_TEST_DEVICE)");
        return;
    }
    // Chunks of 1, 3 and 13 rows: buckets 1, 4 (and 1 for the last token) and 16, each run
    // twice, so every bucket's graph is captured and then replayed.
    for chunk in [1, 3, 13, 1, 3, 13] {
        let replayed = bits(&logits_in_chunks(&graphs, &TOKENS, chunk));
        assert!(
            replayed == bits(&logits_in_chunks(&eager, &TOKENS, chunk)),
            "chunk {chunk}"
        );
    }
    let captured = duet_engine::GraphReport {
        captured: 3,
        failure: None,
    };
    assert_eq!(graphs.cuda_graphs(), Some(captured));
    assert_eq!(
        eager.cuda_graphs(),
        Some(duet_engine::GraphReport::default())
    );
}

/// A greedy sequence's rows give the greedy choice its full rows give (on CUDA the GPU
/// makes it and the logits stay there), for the whole vocabulary and for a shortlist with a
/// session's extra ids merged in.
#[test]
fn greedy_rows_choose_what_the_full_rows_choose() {
    let (_dir, path, full) = tiny(Architecture::Qwen2, 11);
    let options = LoadOptions {
        shortlist: Some(100),
        ..test_load_options()
    };
    let short = Model::load(&path, &options).unwrap();
    let mut extra = ExtraLogits::default();
    short.extend_shortlist(&mut extra, &[150, 200, 5]).unwrap();
    for (model, extra) in [(&full, None), (&short, Some(&extra))] {
        // Each row's choice, and its token as `greedy_token` reads it alone.
        let run = |greedy: bool| -> Vec<(duet_engine::Greedy, u32)> {
            let mut cache = model.new_cache(64).unwrap();
            let mut choices = Vec::new();
            for part in TOKENS.chunks(5) {
                let mut seqs = [SequenceInput {
                    cache: &mut cache,
                    tokens: part,
                    logits: LogitsFor::All,
                    extra,
                    greedy,
                    draws: &[],
                    parents: &[],
                }];
                let logits = model.forward_batch(&mut seqs).unwrap().remove(0);
                assert_eq!(logits.rows(), part.len());
                for i in 0..logits.rows() {
                    choices.push((logits.greedy(i).unwrap(), logits.greedy_token(i).unwrap()));
                }
            }
            choices
        };
        let (summarised, from_rows) = (run(true), run(false));
        assert_eq!(summarised.len(), TOKENS.len());
        // The summaries' choices (CUDA: made on the device) against the rows' (read on the
        // host from a pass that returned every logit).
        for (i, ((a, token_alone), (b, _))) in summarised.iter().zip(&from_rows).enumerate() {
            assert_eq!(a.token, b.token, "row {i}, extra ids: {}", extra.is_some());
            assert_eq!(*token_alone, b.token, "row {i}: greedy_token");
            let close = (a.probability - b.probability).abs() <= 1e-5 * b.probability;
            assert!(
                close,
                "row {i}: {} against {}",
                a.probability, b.probability
            );
        }
    }
}

/// A sequence that reads only the tokens drawn from its rows (`SequenceInput::draws`) gets
/// the tokens its whole rows give the host's sampler at the same uniform draws, with their
/// probabilities; where a draw corrects a rejected draft (a lookup's, a draft model's), the
/// correction and the draft's probability; for a draft model's step, the proposal it drew
/// from (`proposal_distribution`) too: on CUDA with `DUET_CUDA_DRAW=1` the GPU draws
/// them (the rows stay there, and its running sums round otherwise than the host's, so a
/// uniform within rounding of a token's edge may take the next token); elsewhere the rows
/// come back and are drawn from.
#[test]
fn drawn_rows_give_the_tokens_their_whole_rows_give() {
    use duet_engine::sampling::{Distribution, Draw, DrawFrom, Excluded};
    let (_dir, _path, model) = tiny(Architecture::Qwen2, 11);
    let vocab = model.config().vocab as u32;
    let on_gpu = !test_load_options().device.is_cpu()
        && std::env::var("DUET_CUDA_DRAW").is_ok_and(|v| v == "1");
    // The last three tokens up to `end` in one pass, a row each.
    let pass = |end: usize, draws: &[Draw]| {
        let mut cache = model.new_cache(64).unwrap();
        let (before, fed) = TOKENS[..end].split_at(end - 3);
        model.forward(&mut cache, before, LogitsFor::None).unwrap();
        let mut seqs = [SequenceInput {
            cache: &mut cache,
            tokens: fed,
            logits: LogitsFor::All,
            extra: None,
            greedy: false,
            draws,
            parents: &[],
        }];
        model.forward_batch(&mut seqs).unwrap().remove(0)
    };
    for end in [4, 8, 13] {
        let whole = pass(end, &[]);
        // Row 0 as a lookup's rejected draft would be drawn (its greedy token left out),
        // row 1 as a draft model's (its greedy token, drawn from a q with its neighbours),
        // row 2 as a bonus token, then as a draft model's step (from its proposal).
        let lookup = DrawFrom::After(Excluded::point(argmax(whole.row(0))));
        let x = argmax(whole.row(1));
        let near = [(x, 0.6), ((x + 1) % vocab, 0.3), ((x + 7) % vocab, 0.1)];
        let q = std::sync::Arc::new(Distribution::from_pairs(near).unwrap());
        let drafted = DrawFrom::After(Excluded {
            token: x,
            from: Some(q),
        });
        for params in draw_settings() {
            let uniforms = [0.0, 0.03, 0.2, 0.5, 0.77, 0.95, 1.0 - 1e-9];
            let last = [DrawFrom::Row, DrawFrom::Proposal];
            for (uniform, last) in uniforms
                .into_iter()
                .flat_map(|u| last.clone().map(|l| (u, l)))
            {
                let draws: Vec<Draw> = [lookup.clone(), drafted.clone(), last]
                    .into_iter()
                    .map(|from| Draw {
                        params,
                        uniform,
                        from,
                    })
                    .collect();
                let drawn = pass(end, &draws);
                assert_eq!(drawn.summarized(), on_gpu, "where the draws are made");
                for (i, draw) in draws.iter().enumerate() {
                    let row = whole.row(i);
                    let got = drawn.drawn(i, draw).unwrap();
                    let at = format!("end {end}, row {i}, {draw:?}");
                    // A lookup's token only where it holds all the mass (no residual).
                    let left_out = draw.excluded() == Some(&Excluded::point(got.token));
                    assert!(!left_out || got.excluded == 1.0, "{at}: {got:?}");
                    let at_an_edge = check_drawn(row, draw, got, 1e-5, &at);
                    assert!(on_gpu || !at_an_edge, "{at}: the host's own draw parts");
                }
            }
        }
    }
}
