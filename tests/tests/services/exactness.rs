//! Greedy speculation equals target-only under every method and request option: logprobs,
//! penalties, biases, stops, lengths, fill in the middle.

use super::*;

#[tokio::test]
async fn greedy_speculation_equals_target_only() {
    let (_m, stack) = tiny_stack().await;
    let url = stack.coordinator.url();
    for prompt in ["the cat", "def f(x):\n\treturn", "漢字 and more"] {
        let plain = generate(&url, request(prompt, 40, TargetOnly))
            .await
            .unwrap();
        assert_eq!(plain.usage.draft_tokens_proposed, 0);
        assert_eq!(plain.usage.rounds as usize, plain.token_ids.len());
        for (method, k) in [
            (DraftModel, 0),
            (DraftModel, 1),
            (DraftModel, 3),
            (DraftModel, 8),
            (Ngram, 0),
            (Ngram, 2),
            (Ngram, 8),
            (Auto, 0),
            (Auto, 4),
        ] {
            let mut req = request(prompt, 40, method);
            req.num_speculative_tokens = k;
            let spec = generate(&url, req).await.unwrap();
            let case = format!("prompt {prompt:?}, {method:?} K = {k}");
            assert_eq!(spec.token_ids, plain.token_ids, "{case}");
            assert_eq!(spec.text, plain.text);
            assert_eq!(spec.finish_reason, plain.finish_reason);
            let u = &spec.usage;
            assert!(!u.fell_back_to_target_only, "{}", u.fallback_reason);
            assert_eq!(u.method, method as i32);
            // Without K the controller chooses each round's, up to the server's maximum
            // for the method; AUTO chooses up to the request's K too.
            let most = match (method, k) {
                (DraftModel, 0) => (8, true),
                (_, 0) => (16, true),
                (Auto, k) => (k, true),
                (_, k) => (k, false),
            };
            assert_eq!(
                (u.num_speculative_tokens, u.k_chosen_per_round),
                most,
                "{case}"
            );
            if method == DraftModel {
                assert!(u.draft_tokens_proposed > 0, "{case}");
            }
            assert!(u.draft_tokens_accepted <= u.draft_tokens_proposed);
            assert_eq!(u.completion_tokens as usize, spec.token_ids.len());
            // Each round commits its accepted drafts plus one token of the target's own
            // (the last round may stop early at EOS or the length limit).
            assert!(u.rounds + u.draft_tokens_accepted >= u.completion_tokens);
            // The rounds by proposer add up.
            let by: u32 = u.proposers.iter().map(|p| p.rounds).sum();
            let proposed: u32 = u.proposers.iter().map(|p| p.draft_tokens_proposed).sum();
            assert_eq!(
                (by, proposed),
                (u.rounds, u.draft_tokens_proposed),
                "{case}"
            );
        }
    }
    // Text that repeats: prompt lookup proposes from the first round and the text is still
    // the target's.
    let prompt = "the cat sat. the cat sat. the cat sat. the cat";
    let plain = generate(&url, request(prompt, 30, TargetOnly))
        .await
        .unwrap();
    let mut req = request(prompt, 30, Ngram);
    req.num_speculative_tokens = 4;
    let lookup = generate(&url, req).await.unwrap();
    assert_eq!(lookup.token_ids, plain.token_ids);
    let ngram = lookup
        .usage
        .proposers
        .iter()
        .find(|p| p.method == Ngram as i32);
    assert!(
        ngram.is_some_and(|p| p.rounds > 0 && p.draft_tokens_proposed > 0),
        "{:?}",
        lookup.usage
    );
    // The unary Complete returns what the stream did.
    let streamed = generate(&url, request("the cat", 40, DraftModel))
        .await
        .unwrap();
    let done = client(&url)
        .await
        .complete(request("the cat", 40, DraftModel))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(done.token_ids, streamed.token_ids);
    assert_eq!(done.text, streamed.text);
    assert_eq!(Some(done.finish_reason), streamed.finish_reason);
    assert_eq!(done.usage.unwrap().rounds, streamed.usage.rounds);
    wait_no_sessions(&stack, Duration::from_secs(5)).await;
}

/// Log-probabilities over real gRPC: each committed token's are the target's row's that
/// chose it (the log-softmax of the logits a target-worker computes for that prefix, the
/// most likely tokens first), and a token has the same figures whichever method committed
/// it, streamed or unary; a sampling request's drawn tokens come with theirs.
#[tokio::test]
async fn logprobs_are_the_targets_whichever_method_commits_the_tokens() {
    let (m, stack) = tiny_stack().await;
    let url = stack.coordinator.url();
    let model = reference_model(&m.target);
    let prompt = duet_engine::Tokenizer::load(&m.target)
        .unwrap()
        .encode("def f(x):", true)
        .unwrap();
    // What a target-worker's row gives `token` after `prompt` and `before`.
    let reference = |before: &[u32], token: u32| {
        let ids: Vec<u32> = prompt.iter().chain(before).copied().collect();
        let row = worker_logits(&model, &ids, prompt.len());
        let l = duet_engine::logprobs::token_logprobs(&row, token, 3).unwrap();
        let (ids, logprobs) = l.top.into_iter().unzip();
        pb::TokenLogprobs {
            logprob: l.logprob,
            top_token_ids: ids,
            top_logprobs: logprobs,
        }
    };
    let asking = |method, temperature| pb::GenerateRequest {
        logprobs: true,
        top_logprobs: 3,
        temperature,
        seed: 5,
        ..request("def f(x):", 24, method)
    };
    let plain = generate(&url, asking(TargetOnly, 0.0)).await.unwrap();
    assert_eq!(plain.logprobs.len(), plain.token_ids.len());
    for (i, (l, &token)) in plain.logprobs.iter().zip(&plain.token_ids).enumerate() {
        assert_eq!(*l, reference(&plain.token_ids[..i], token), "token {i}");
        assert_eq!((l.top_token_ids[0], l.top_logprobs[0]), (token, l.logprob));
    }
    for method in [DraftModel, Ngram, Auto] {
        let spec = generate(&url, asking(method, 0.0)).await.unwrap();
        assert_eq!(spec.token_ids, plain.token_ids, "{method:?}");
        assert_eq!(spec.logprobs, plain.logprobs, "{method:?}");
    }
    let unary = client(&url).await.complete(asking(DraftModel, 0.0)).await;
    assert_eq!(unary.unwrap().into_inner().logprobs, plain.logprobs);
    let sampled = generate(&url, asking(DraftModel, 0.8)).await.unwrap();
    assert_eq!(sampled.logprobs.len(), sampled.token_ids.len());
    for (i, (l, &token)) in sampled.logprobs.iter().zip(&sampled.token_ids).enumerate() {
        assert_eq!(
            *l,
            reference(&sampled.token_ids[..i], token),
            "sampled token {i}"
        );
    }
    let without = generate(&url, request("def f(x):", 8, DraftModel)).await;
    assert!(without.unwrap().logprobs.is_empty());
    wait_no_sessions(&stack, Duration::from_secs(5)).await;
}

/// A prompt's figures over real gRPC: a prompt given as token ids (a prompt and the
/// completion target-only generated after it) gets each token's figures after the first on
/// its first chunk, and those of the completion's tokens are the ones the generation
/// answered for them (bit for bit on a CPU: `assert_same_figures`). The target prefills it
/// whole each time (none from its prefix cache), streamed or unary, under any method; an
/// id outside the vocabulary is refused.
#[tokio::test]
async fn a_prompts_figures_are_those_its_tokens_had_when_generated() {
    let (m, stack) = tiny_stack().await;
    let url = stack.coordinator.url();
    let prompt = duet_engine::Tokenizer::load(&m.target)
        .unwrap()
        .encode("def f(x):", true)
        .unwrap();
    let generated = pb::GenerateRequest {
        logprobs: true,
        top_logprobs: 3,
        ..request("def f(x):", 16, TargetOnly)
    };
    let plain = generate(&url, generated).await.unwrap();
    let ids: Vec<u32> = prompt.iter().chain(&plain.token_ids).copied().collect();
    let bound = figures_bound(&m.target, &ids);
    let scoring = |method, ids: Vec<u32>| pb::GenerateRequest {
        input: Some(pb::generate_request::Input::PromptTokenIds(pb::TokenIds {
            ids,
        })),
        prompt_logprobs: Some(3),
        ..request("", 1, method)
    };
    for method in [TargetOnly, DraftModel, Auto] {
        let scored = generate(&url, scoring(method, ids.clone())).await.unwrap();
        let figures = scored.prompt.expect("the prompt's figures");
        assert_eq!(figures.token_ids, ids, "{method:?}");
        assert_eq!(figures.logprobs.len(), ids.len() - 1, "{method:?}");
        let generated = &figures.logprobs[prompt.len() - 1..];
        assert_same_figures(generated, &plain.logprobs, bound);
        assert_eq!(scored.usage.prompt_tokens_cached, 0, "{method:?}");
        assert_eq!(scored.usage.prompt_tokens as usize, ids.len());
    }
    let unary = client(&url)
        .await
        .complete(scoring(Auto, ids.clone()))
        .await;
    let prompt_figures = unary.unwrap().into_inner().prompt.unwrap();
    assert_same_figures(
        &prompt_figures.logprobs[prompt.len() - 1..],
        &plain.logprobs,
        bound,
    );
    let unasked = generate(&url, request("def f(x):", 2, Auto)).await.unwrap();
    assert_eq!(unasked.prompt, None);
    let vocab = duet_engine::Tokenizer::load(&m.target)
        .unwrap()
        .vocab_size() as u32;
    let refused = generate(&url, scoring(Auto, vec![1, vocab]))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument);
    assert_eq!(
        refused.message(),
        format!("prompt_token_ids: {vocab} is outside the target's vocabulary of {vocab}")
    );
    wait_no_sessions(&stack, Duration::from_secs(5)).await;
}

/// Penalties over real gRPC: the target penalizes each position by its own completion so
/// far, so a greedy request's tokens under every method are target-only's with the same
/// penalties (and not those without); a sampling one runs its chains to the end.
#[tokio::test]
async fn penalized_speculation_equals_penalized_target_only() {
    let (_m, stack) = tiny_stack().await;
    let url = stack.coordinator.url();
    let penalized = |method, presence_penalty, temperature| pb::GenerateRequest {
        presence_penalty,
        frequency_penalty: 0.5,
        temperature,
        ..request("the cat sat. the cat", 32, method)
    };
    let plain = generate(&url, penalized(TargetOnly, -2.0, 0.0))
        .await
        .unwrap();
    let unpenalized = generate(&url, request("the cat sat. the cat", 32, TargetOnly)).await;
    assert_ne!(plain.token_ids, unpenalized.unwrap().token_ids);
    for method in [DraftModel, Ngram, Auto] {
        let spec = generate(&url, penalized(method, -2.0, 0.0)).await.unwrap();
        assert_eq!(spec.token_ids, plain.token_ids, "{method:?}");
    }
    let sampled = generate(&url, penalized(DraftModel, 1.0, 0.8))
        .await
        .unwrap();
    assert_eq!(sampled.token_ids.len(), 32);
    // What the coordinator checks before opening a penalized session on a replica.
    assert!(described(&stack.target.url()).await.applies_penalties);
    wait_no_sessions(&stack, Duration::from_secs(5)).await;
}

/// vLLM's repetition penalty and min-p over real gRPC: a greedy request's tokens under
/// every method are target-only's with the same repetition penalty (and not those
/// without); min-p 1 keeps only the most likely token, so a sampled request's tokens are
/// the greedy ones under every method (both workers cut by it), where min-p 0 samples
/// others.
#[tokio::test]
async fn repetition_penalty_and_min_p_hold_under_every_method() {
    let (_m, stack) = tiny_stack().await;
    let url = stack.coordinator.url();
    let prompt = "the cat sat. the cat";
    let repeating = |method, repetition_penalty| pb::GenerateRequest {
        repetition_penalty,
        ..request(prompt, 32, method)
    };
    let plain = generate(&url, repeating(TargetOnly, 1.5)).await.unwrap();
    let unpenalized = generate(&url, request(prompt, 32, TargetOnly)).await;
    assert_ne!(plain.token_ids, unpenalized.unwrap().token_ids);
    for method in [DraftModel, Ngram, Auto] {
        let spec = generate(&url, repeating(method, 1.5)).await.unwrap();
        assert_eq!(spec.token_ids, plain.token_ids, "{method:?}");
    }
    let cut = |method, min_p| pb::GenerateRequest {
        min_p,
        temperature: 1.0,
        seed: 5,
        ..repeating(method, 1.5)
    };
    for method in [TargetOnly, DraftModel, Ngram, Auto] {
        let sampled = generate(&url, cut(method, 1.0)).await.unwrap();
        assert_eq!(sampled.token_ids, plain.token_ids, "{method:?}");
    }
    let free = generate(&url, cut(TargetOnly, 0.0)).await.unwrap();
    assert_ne!(free.token_ids, plain.token_ids);
    let refused = generate(&url, cut(Auto, 1.5)).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument);
    assert_eq!(refused.message(), "min_p: 1.5 is outside [0, 1]");
    let refused = generate(&url, repeating(Auto, -1.0)).await.unwrap_err();
    assert_eq!(
        refused.message(),
        "repetition_penalty: -1 must be a number > 0"
    );
    let target = described(&stack.target.url()).await;
    assert!(target.applies_min_p && target.applies_repetition_penalty);
    wait_no_sessions(&stack, Duration::from_secs(5)).await;
}

/// vLLM's stop_token_ids over real gRPC: the completion ends at the first of them (its
/// text left out, finish EOS) under every method, also where the request ignores the
/// end-of-sequence token; one outside the vocabulary is refused.
#[tokio::test]
async fn a_stop_token_ends_the_completion_under_every_method() {
    let (m, stack) = tiny_stack().await;
    let url = stack.coordinator.url();
    let prompt = "the cat sat. the cat";
    let stopping = |method, stop_token_ids| pb::GenerateRequest {
        stop_token_ids,
        ignore_eos: true,
        ..request(prompt, 24, method)
    };
    let free = generate(&url, stopping(TargetOnly, vec![])).await.unwrap();
    let stop = free.token_ids[5];
    let at = free.token_ids.iter().position(|&t| t == stop).unwrap();
    let tok = duet_engine::Tokenizer::load(&m.target).unwrap();
    let text = tok.decode(&free.token_ids[..at], false).unwrap();
    for method in [TargetOnly, DraftModel, Ngram, Auto] {
        let stopped = generate(&url, stopping(method, vec![stop])).await.unwrap();
        assert_eq!(stopped.token_ids, free.token_ids[..=at], "{method:?}");
        assert_eq!(stopped.text, text, "{method:?}");
        let eos = pb::FinishReason::Eos as i32;
        assert_eq!(stopped.finish_reason, Some(eos), "{method:?}");
        assert_eq!(stopped.stop_token_id, Some(stop), "{method:?}");
    }
    assert_eq!(free.stop_token_id, None);
    let vocab = tok.vocab_size() as u32;
    let refused = generate(&url, stopping(Auto, vec![vocab]))
        .await
        .unwrap_err();
    let why =
        format!("stop_token_ids: token {vocab} is outside the target's vocabulary of {vocab}");
    assert_eq!(refused.message(), why);
    wait_no_sessions(&stack, Duration::from_secs(5)).await;
}

/// vLLM's skip_special_tokens over real gRPC: a control token the model writes (forced by
/// a logit bias) adds no text unless the request keeps them, under every method; the
/// tokens are the same either way.
#[tokio::test]
async fn special_tokens_add_no_text_unless_kept() {
    let (m, stack) = tiny_stack().await;
    let url = stack.coordinator.url();
    let tok = duet_engine::Tokenizer::load(&m.target).unwrap();
    let start = tok.encode("<|im_start|>", false).unwrap()[0];
    let forced = |method, skip_special_tokens| pb::GenerateRequest {
        logit_bias: [(start, 100.0)].into(),
        skip_special_tokens,
        ..request("the cat", 3, method)
    };
    for method in [TargetOnly, DraftModel, Ngram, Auto] {
        for skip in [None, Some(true)] {
            let skipped = generate(&url, forced(method, skip)).await.unwrap();
            assert_eq!(skipped.token_ids, [start; 3], "{method:?}");
            assert_eq!(skipped.text, "", "{method:?}");
        }
        let kept = generate(&url, forced(method, Some(false))).await.unwrap();
        assert_eq!(kept.token_ids, [start; 3], "{method:?}");
        assert_eq!(kept.text, "<|im_start|>".repeat(3), "{method:?}");
    }
    wait_no_sessions(&stack, Duration::from_secs(5)).await;
}

/// vLLM's stop_token_ids with min_tokens over real gRPC: the workers hold the stop token
/// back until then (here a logit bias makes it the target's choice wherever allowed), so
/// it ends the completion right after `min_tokens` under every method, the tokens before
/// it NONE's.
#[tokio::test]
async fn a_stop_token_waits_for_min_tokens_under_every_method() {
    let (m, stack) = tiny_stack().await;
    let url = stack.coordinator.url();
    let stop = duet_engine::Tokenizer::load(&m.target).unwrap();
    let stop = stop.encode("z", false).unwrap()[0];
    assert!(described(&stack.target.url()).await.holds_stop_tokens);
    let held = |method| pb::GenerateRequest {
        logit_bias: [(stop, 100.0)].into(),
        stop_token_ids: vec![stop],
        min_tokens: 3,
        ..request("the cat", 16, method)
    };
    let plain = generate(&url, held(TargetOnly)).await.unwrap();
    assert_eq!(plain.token_ids.len(), 4, "{:?}", plain.token_ids);
    assert!(!plain.token_ids[..3].contains(&stop));
    assert_eq!(plain.token_ids[3], stop);
    assert_eq!(plain.finish_reason, Some(pb::FinishReason::Eos as i32));
    for method in [DraftModel, Ngram, Auto] {
        let got = generate(&url, held(method)).await.unwrap();
        assert_eq!(got.token_ids, plain.token_ids, "{method:?}");
        assert_eq!(got.finish_reason, plain.finish_reason, "{method:?}");
    }
    wait_no_sessions(&stack, Duration::from_secs(5)).await;
}

/// Fill in the middle over real gRPC, with code models' tokens: a prompt and its suffix
/// give the raw prompt in the model's format (its padding and file tokens ending it) under
/// every method, token for token; the model's padding token ends the middle (finish EOS,
/// no text); a chat's suffix is refused.
#[tokio::test]
async fn a_suffix_asks_for_the_middle_under_every_method() {
    let (_m, stack, tok) = code_stack().await;
    let url = stack.coordinator.url();
    let ends = tok.infill().unwrap().ends();
    let raw = pb::GenerateRequest {
        stop_token_ids: ends.clone(),
        ..request(
            "<|fim_prefix|>the cat<|fim_suffix|> sat.<|fim_middle|>",
            16,
            TargetOnly,
        )
    };
    let expected = generate(&url, raw).await.unwrap();
    let plain = generate(&url, request("the cat", 16, TargetOnly)).await;
    assert!(expected.token_ids.len() > 1);
    assert_ne!(expected.token_ids, plain.unwrap().token_ids);
    let infill = |method| pb::GenerateRequest {
        suffix: Some(" sat.".into()),
        ..request("the cat", 16, method)
    };
    for method in [TargetOnly, DraftModel, Ngram, Auto] {
        let middle = generate(&url, infill(method)).await.unwrap();
        assert_eq!(middle.token_ids, expected.token_ids, "{method:?}");
        assert_eq!(middle.text, expected.text, "{method:?}");
        assert_eq!(middle.finish_reason, expected.finish_reason, "{method:?}");
    }
    let padded = pb::GenerateRequest {
        logit_bias: [(ends[0], 100.0)].into(),
        ..infill(Auto)
    };
    let padded = generate(&url, padded).await.unwrap();
    assert_eq!(
        (padded.token_ids, padded.text),
        (vec![ends[0]], String::new())
    );
    assert_eq!(padded.finish_reason, Some(pb::FinishReason::Eos as i32));
    // With min_tokens the padding waits until then.
    let late = pb::GenerateRequest {
        logit_bias: [(ends[0], 100.0)].into(),
        min_tokens: 2,
        ..infill(Auto)
    };
    let late = generate(&url, late).await.unwrap();
    assert_eq!((late.token_ids.len(), late.token_ids[2]), (3, ends[0]));
    let chat = pb::GenerateRequest {
        suffix: Some(" sat.".into()),
        ..chat(&[("user", "the cat")])
    };
    let refused = generate(&url, chat).await.unwrap_err();
    let why = "suffix: with a text prompt only (not messages or prompt_token_ids)";
    assert_eq!(
        (refused.code(), refused.message()),
        (Code::InvalidArgument, why)
    );
    wait_no_sessions(&stack, Duration::from_secs(5)).await;
}

/// Fill in the middle with the repository around it over real gRPC: its name and files
/// come first in the model's repository-level format, token for token the raw prompt's
/// generation under every method; the first files are left out where the context would
/// leave too little room for max_tokens, and the usage says how many.
#[tokio::test]
async fn a_repository_comes_before_the_middle_under_every_method() {
    let (_m, stack, tok) = code_stack().await;
    let url = stack.coordinator.url();
    let ends = tok.infill().unwrap().ends();
    let raw_text = "<|repo_name|>r\n<|file_sep|>a.py\nx = 1\n<|file_sep|>b.py\n\
                    <|fim_prefix|>the cat<|fim_suffix|> sat.<|fim_middle|>";
    let raw = |max_tokens, method| pb::GenerateRequest {
        stop_token_ids: ends.clone(),
        ..request(raw_text, max_tokens, method)
    };
    let file = |text: &str| pb::RepositoryFile {
        path: "a.py".into(),
        text: text.into(),
    };
    let around = |max_tokens, method, files| pb::GenerateRequest {
        suffix: Some(" sat.".into()),
        repository: Some(pb::Repository {
            name: "r".into(),
            path: "b.py".into(),
            files,
        }),
        ..request("the cat", max_tokens, method)
    };
    let expected = generate(&url, raw(16, TargetOnly)).await.unwrap();
    for method in [TargetOnly, DraftModel, Ngram, Auto] {
        let got = generate(&url, around(16, method, vec![file("x = 1")])).await;
        let got = got.unwrap();
        assert_eq!(got.token_ids, expected.token_ids, "{method:?}");
        assert_eq!(got.usage.repository_files_left_out, 0, "{method:?}");
    }
    // A file the room leaves out: as if it were not there.
    let room = 256 - tok.encode(raw_text, true).unwrap().len() as u32;
    let expected = generate(&url, raw(room, TargetOnly)).await.unwrap();
    let files = vec![file(&"old ".repeat(20)), file("x = 1")];
    let got = generate(&url, around(room, Auto, files)).await.unwrap();
    assert_eq!(got.token_ids, expected.token_ids);
    assert_eq!(got.usage.repository_files_left_out, 1);
    assert_eq!(got.usage.prompt_tokens, expected.usage.prompt_tokens);
    wait_no_sessions(&stack, Duration::from_secs(5)).await;
}

/// The draft proposes what the target would choose under the request's penalties,
/// `min_tokens` and structured output: with the target's own model as the draft, every
/// greedy draft is accepted (but those after a format's end), and the tokens are
/// target-only's (penalties that change the text, an end held back until `max_tokens`, a
/// format). Sampled, a draft is rejected only where it falls in the least likely tokens'
/// share its q leaves out.
#[tokio::test]
async fn a_draft_of_the_targets_model_has_every_adjusted_draft_accepted() {
    let m = tiny_models();
    let stack = Stack::start_with(worker_config(&m.target), worker_config(&m.target));
    wait_stack(&stack).await;
    let url = stack.coordinator.url();
    let prompt = "the cat sat. the cat";
    let penalized = |method, temperature| pb::GenerateRequest {
        presence_penalty: 1.5,
        frequency_penalty: 1.5,
        repetition_penalty: 1.5,
        min_tokens: 24,
        temperature,
        seed: 3,
        ..request(prompt, 24, method)
    };
    let format = pb::structured_output::Format::Regex("[a-z]+( [a-z]+){4,6}\\.".into());
    let unadjusted = generate(&url, request(prompt, 24, TargetOnly)).await;
    let plain = generate(&url, penalized(TargetOnly, 0.0)).await.unwrap();
    assert_ne!(plain.token_ids, unadjusted.unwrap().token_ids);
    let constrained_plain = generate(&url, constrained(&format, TargetOnly, 0.0)).await;
    let greedy = generate(&url, penalized(DraftModel, 0.0)).await.unwrap();
    assert_eq!(greedy.token_ids, plain.token_ids);
    let u = &greedy.usage;
    assert!(u.draft_tokens_proposed > 0, "{u:?}");
    assert_eq!(u.draft_tokens_accepted, u.draft_tokens_proposed, "{u:?}");
    let sampled = generate(&url, penalized(DraftModel, 0.9)).await.unwrap();
    let u = &sampled.usage;
    assert!(
        u.draft_tokens_accepted * 10 >= u.draft_tokens_proposed * 9,
        "{u:?}"
    );
    let structured = constrained(&format, DraftModel, 0.0);
    let structured = generate(&url, structured).await.unwrap();
    assert_eq!(structured.token_ids, constrained_plain.unwrap().token_ids);
    let u = &structured.usage;
    // Only the last round's drafts after the end go unaccepted.
    let k = u.num_speculative_tokens;
    assert!(
        u.draft_tokens_accepted + k >= u.draft_tokens_proposed,
        "{u:?}"
    );
    wait_no_sessions(&stack, Duration::from_secs(5)).await;
}

/// A logit bias over real gRPC: a greedy request's tokens under every method are
/// target-only's with the same bias (and not those without); a token raised by 100 is every
/// token, greedy or sampled, and the draft, biased too, has every draft accepted. A token
/// outside the vocabulary or a bias past 100 is refused.
#[tokio::test]
async fn biased_speculation_equals_biased_target_only() {
    let (m, stack) = tiny_stack().await;
    let url = stack.coordinator.url();
    let prompt = "the cat sat. the cat";
    let unbiased = generate(&url, request(prompt, 24, TargetOnly))
        .await
        .unwrap();
    let biased = |method, logit_bias: &[(u32, f32)], temperature| pb::GenerateRequest {
        logit_bias: logit_bias.iter().copied().collect(),
        temperature,
        ..request(prompt, 24, method)
    };
    let some = [
        (unbiased.token_ids[0], -100.0),
        (unbiased.token_ids[2], -3.0),
    ];
    let plain = generate(&url, biased(TargetOnly, &some, 0.0))
        .await
        .unwrap();
    assert_ne!(plain.token_ids, unbiased.token_ids);
    assert!(!plain.token_ids.contains(&unbiased.token_ids[0]));
    for method in [DraftModel, Ngram, Auto] {
        let spec = generate(&url, biased(method, &some, 0.0)).await.unwrap();
        assert_eq!(spec.token_ids, plain.token_ids, "{method:?}");
    }
    let forced = [(unbiased.token_ids[1], 100.0)];
    for temperature in [0.0, 0.8] {
        let all = generate(&url, biased(DraftModel, &forced, temperature))
            .await
            .unwrap();
        assert_eq!(
            all.token_ids, [forced[0].0; 24],
            "temperature {temperature}"
        );
        let u = &all.usage;
        assert_eq!(u.draft_tokens_accepted, u.draft_tokens_proposed);
        assert!(u.draft_tokens_proposed > 0);
    }
    let vocab = duet_engine::Tokenizer::load(&m.target)
        .unwrap()
        .vocab_size() as u32;
    for (bias, message) in [
        (
            [(vocab, 1.0)],
            format!("logit_bias: token {vocab} is outside the target's vocabulary of {vocab}"),
        ),
        (
            [(1, 101.0)],
            "logit_bias: token 1: 101 is outside [-100, 100]".into(),
        ),
    ] {
        let refused = generate(&url, biased(Auto, &bias, 0.0)).await.unwrap_err();
        assert_eq!(
            (refused.code(), refused.message()),
            (Code::InvalidArgument, &message[..])
        );
    }
    wait_no_sessions(&stack, Duration::from_secs(5)).await;
}

/// `ignore_eos` and `min_tokens` over real gRPC, with the end-of-sequence token raised to
/// be every choice: a request ends at its first token; ignoring the end it runs to
/// max_tokens with no text; with min_tokens the target holds the end back until then,
/// under every method alike. min_tokens past max_tokens is refused.
#[tokio::test]
async fn min_tokens_and_ignore_eos_set_the_length() {
    use pb::FinishReason::{Eos, Length};
    let (m, stack) = tiny_stack().await;
    let url = stack.coordinator.url();
    let eos = *duet_engine::Tokenizer::load(&m.target)
        .unwrap()
        .eos_tokens()
        .first()
        .unwrap();
    let ending = |method, ignore_eos, min_tokens| pb::GenerateRequest {
        logit_bias: [(eos, 100.0)].into(),
        ignore_eos,
        min_tokens,
        ..request("the cat", 12, method)
    };
    let ended = generate(&url, ending(TargetOnly, false, 0)).await.unwrap();
    assert_eq!(
        (ended.token_ids, ended.finish_reason),
        (vec![eos], Some(Eos as i32))
    );
    let ignored = generate(&url, ending(DraftModel, true, 0)).await.unwrap();
    assert_eq!(ignored.token_ids, [eos; 12]);
    assert_eq!(
        (ignored.text.as_str(), ignored.finish_reason),
        ("", Some(Length as i32))
    );
    let plain = generate(&url, ending(TargetOnly, false, 5)).await.unwrap();
    assert_eq!(plain.token_ids.len(), 6);
    assert_eq!(plain.token_ids.iter().position(|&t| t == eos), Some(5));
    assert_eq!(plain.finish_reason, Some(Eos as i32));
    for method in [DraftModel, Ngram, Auto] {
        let spec = generate(&url, ending(method, false, 5)).await.unwrap();
        assert_eq!(spec.token_ids, plain.token_ids, "{method:?}");
    }
    let refused = generate(&url, ending(Auto, false, 13)).await.unwrap_err();
    assert_eq!(
        (refused.code(), refused.message()),
        (
            Code::InvalidArgument,
            "min_tokens: 13 is more than max_tokens (12)"
        )
    );
    wait_no_sessions(&stack, Duration::from_secs(5)).await;
}
