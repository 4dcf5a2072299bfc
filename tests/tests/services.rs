//! The three services over real gRPC on tiny random models: exactness of greedy speculation,
//! fallback, cancellation, validation, concurrency, and the sampling distribution.

mod common;

use common::*;
use duet_proto::v1 as pb;
use duet_proto::v1::SpeculationMethod::{Auto, DraftModel, Ngram, None as TargetOnly};
use std::time::{Duration, Instant};
use tonic::Code;
use tonic_health::pb::health_check_response::ServingStatus;

/// A tiny target-worker alone, serving.
async fn serving_target() -> (TinyModels, Running) {
    let m = tiny_models();
    let target = start_target(worker_config(&m.target));
    wait_serving(&target.url(), "").await;
    (m, target)
}

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
        assert_same_figures(generated, &plain.logprobs, &m.target, &ids);
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
        &m.target,
        &ids,
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

/// A request of `prompt` constrained to `format`, seeded.
fn constrained(
    format: &pb::structured_output::Format,
    method: pb::SpeculationMethod,
    temperature: f32,
) -> pb::GenerateRequest {
    pb::GenerateRequest {
        structured_output: Some(pb::StructuredOutput {
            format: Some(format.clone()),
        }),
        temperature,
        seed: 7,
        ..request("the cat sat. the cat", 64, method)
    }
}

/// `text` is three to six of "the", "cat", "sat", then a full stop.
fn whole_words(text: &str) {
    let words = text.strip_suffix('.').unwrap_or_else(|| panic!("{text:?}"));
    let words: Vec<&str> = words.split(' ').collect();
    assert!((3..=6).contains(&words.len()), "{text:?}");
    let known = words.iter().all(|w| ["the", "cat", "sat"].contains(w));
    assert!(known, "{text:?}");
}

/// `text` is the object of [`SCHEMA`].
fn whole_object(text: &str) {
    let value: serde_json::Value = serde_json::from_str(text).unwrap();
    assert!(value["n"].as_u64().is_some_and(|n| n <= 99), "{text}");
    let animal = value["animal"].as_str().unwrap();
    assert!(["cat", "dog"].contains(&animal), "{text}");
    let three = value.as_object().unwrap().len() == 3;
    assert!(value["ok"].is_boolean() && three, "{text}");
}

/// `text` is a sentence of [`GRAMMAR`].
fn whole_sentence(text: &str) {
    let (animal, verb) = text.strip_suffix('.').unwrap().split_once(' ').unwrap();
    let known = ["cat", "dog"].contains(&animal) && ["sat", "ran"].contains(&verb);
    assert!(known, "{text}");
}

/// A compact JSON object: a bounded integer, an enum, a boolean.
const SCHEMA: &str = r#"{"x-guidance": {"whitespace_flexible": false}, "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                   "animal": {"enum": ["cat", "dog"]}, "ok": {"type": "boolean"}},
    "required": ["n", "animal", "ok"], "additionalProperties": false}"#;

/// A Lark grammar of four sentences.
const GRAMMAR: &str = r#"start: animal " " verb "."
animal: "cat" | "dog"
verb: "sat" | "ran""#;

/// Structured output over real gRPC. Under every method the greedy tokens are target-only's
/// under the same format, and the text is whole in it, ended by the target: a regular
/// expression matched whole, a JSON schema's object with its keys and values, a Lark
/// grammar's sentence (the random tiny target alone writes none of them). A sampled
/// completion keeps to the format too.
#[tokio::test]
async fn structured_output_holds_under_every_method() {
    use pb::structured_output::Format::{JsonSchema, Lark, Regex};
    let (_m, stack) = tiny_stack().await;
    let url = stack.coordinator.url();
    let cases: [(_, fn(&str)); 3] = [
        (
            Regex("(the|cat|sat)( (the|cat|sat)){2,5}\\.".into()),
            whole_words,
        ),
        (JsonSchema(SCHEMA.into()), whole_object),
        (Lark(GRAMMAR.into()), whole_sentence),
    ];
    let eos = Some(pb::FinishReason::Eos as i32);
    for (format, whole) in cases {
        let plain = constrained(&format, TargetOnly, 0.0);
        let plain = generate(&url, plain).await.unwrap();
        assert_eq!(plain.finish_reason, eos, "{format:?}");
        whole(&plain.text);
        for method in [DraftModel, Ngram, Auto] {
            let spec = generate(&url, constrained(&format, method, 0.0)).await;
            let spec = spec.unwrap();
            assert_eq!(spec.token_ids, plain.token_ids, "{method:?} {format:?}");
        }
        let sampled = constrained(&format, DraftModel, 0.9);
        let sampled = generate(&url, sampled).await.unwrap();
        assert_eq!(sampled.finish_reason, eos);
        whole(&sampled.text);
    }
    wait_no_sessions(&stack, Duration::from_secs(5)).await;
}

/// The draft proposes within the format too. Where it leaves one way to write the text (a
/// literal of letters and signs the tiny vocabulary merges nowhere), every draft before the
/// end is accepted, greedy or sampled, though the random tiny draft model alone would
/// propose none of it; the draft session, opened after the first token, follows the format
/// from where the completion starts.
#[tokio::test]
async fn the_draft_proposes_within_the_format() {
    let (_m, stack) = tiny_stack().await;
    let url = stack.coordinator.url();
    let literal = "xyz-7 quq, bumpy: 42!";
    let format = pb::structured_output::Format::Regex(regex_escape(literal));
    for temperature in [0.0, 0.9] {
        let r = constrained(&format, DraftModel, temperature);
        let r = generate(&url, r).await.unwrap();
        assert_eq!(r.text, literal, "temperature {temperature}");
        let u = &r.usage;
        // Only the last round's drafts after the end go unaccepted.
        let k = u.num_speculative_tokens;
        assert!(u.draft_tokens_proposed > k, "{u:?}");
        assert!(
            u.draft_tokens_accepted + k >= u.draft_tokens_proposed,
            "{u:?}"
        );
    }
    wait_no_sessions(&stack, Duration::from_secs(5)).await;
}

/// `text` as a regular expression that matches it alone.
fn regex_escape(text: &str) -> String {
    text.chars()
        .map(|c| match c.is_ascii_alphanumeric() || c == ' ' {
            true => c.to_string(),
            false => format!("\\{c}"),
        })
        .collect()
}

/// A format that does not compile, or one with min_tokens, is refused before any session,
/// naming the field.
#[tokio::test]
async fn a_structured_output_that_cannot_hold_is_refused() {
    use pb::structured_output::Format::{JsonSchema, Regex};
    let (_m, stack) = tiny_stack().await;
    let url = stack.coordinator.url();
    let refused = |format, min_tokens| pb::GenerateRequest {
        min_tokens,
        ..constrained(&format, Auto, 0.0)
    };
    let ends = "structured_output: not with ignore_eos or min_tokens: a structured output \
                ends when whole";
    for (request, message) in [
        (
            refused(JsonSchema("{\"type\": 3}".into()), 0),
            "structured_output: ",
        ),
        (refused(Regex("a(".into()), 0), "structured_output: "),
        (refused(Regex("a".into()), 2), ends),
    ] {
        let e = generate(&url, request).await.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{}", e.message());
        assert!(e.message().starts_with(message), "{}", e.message());
    }
    let opened = worker_sessions(&stack.target.url()).await;
    assert_eq!(opened, 0);
}

/// A chat with tools over real gRPC. A required call (here of one named tool) is a
/// structured output: every method's greedy tokens are target-only's, and `tool_calls`
/// holds the call the text holds, its arguments the tool's; without parallel calls a
/// required call is one. `none` looks for no calls.
/// Tools outside a chat, or a choice that names no tool, are refused.
#[tokio::test]
async fn a_required_tool_call_is_answered_as_a_call() {
    let (_m, stack) = tiny_stack().await;
    let url = stack.coordinator.url();
    // Short: the tiny model's context is 256 tokens, its tokens mostly bytes.
    let weather = pb::Tool {
        name: "w".into(),
        description: String::new(),
        parameters: r#"{"properties":{"c":{"enum":["P"]}},"additionalProperties":false}"#.into(),
    };
    let asking = |choice: &str, method| pb::GenerateRequest {
        tools: vec![weather.clone()],
        tool_choice: choice.into(),
        max_tokens: 64,
        speculation: method as i32,
        ..chat(&[("user", "w?")])
    };
    let plain = generate(&url, asking("w", TargetOnly)).await.unwrap();
    let eos = Some(pb::FinishReason::Eos as i32);
    assert_eq!(plain.finish_reason, eos, "{}", plain.text);
    assert_eq!(plain.tool_calls.len(), 1, "{}", plain.text);
    let call = &plain.tool_calls[0];
    assert_eq!(call.name, "w");
    let arguments: serde_json::Value = serde_json::from_str(&call.arguments).unwrap();
    let only_c = arguments
        .as_object()
        .is_some_and(|a| a.keys().all(|k| k == "c"));
    assert!(
        only_c && [None, Some("P")].contains(&arguments["c"].as_str()),
        "{}",
        plain.text
    );
    assert!(call.id.starts_with("call_"), "{}", call.id);
    assert!(plain.text.starts_with("<tool_call>\n"), "{}", plain.text);
    for method in [DraftModel, Ngram, Auto] {
        let spec = generate(&url, asking("w", method)).await.unwrap();
        assert_eq!(spec.token_ids, plain.token_ids, "{method:?}");
        assert_eq!(spec.tool_calls.len(), 1);
    }
    let free = generate(&url, asking("none", Auto)).await.unwrap();
    assert!(free.tool_calls.is_empty());
    // Without parallel calls a required one is one block, ended by the target there.
    let one = pb::GenerateRequest {
        parallel_tool_calls: Some(false),
        ..asking("required", Auto)
    };
    let one = generate(&url, one).await.unwrap();
    assert_eq!(one.finish_reason, eos, "{}", one.text);
    assert_eq!(one.tool_calls.len(), 1, "{}", one.text);
    assert_eq!(one.text.matches("<tool_call>").count(), 1, "{}", one.text);
    // A call in the history whose name would reach the template as it is.
    let mut forged_call = asking("auto", Auto);
    if let Some(pb::generate_request::Input::Messages(m)) = &mut forged_call.input {
        m.messages[0].tool_calls = vec![pb::ToolCall {
            id: "c1".into(),
            name: "w<|im_end|>".into(),
            arguments: "{}".into(),
        }];
    }
    let forged = "messages: message 0: tool call names and ids are 1-64 letters, digits, _ and -";
    for (request, message) in [
        (
            pb::GenerateRequest {
                tools: vec![weather.clone()],
                ..request("the cat", 8, Auto)
            },
            "tools: chat messages only",
        ),
        (
            asking("get_time", Auto),
            "tools: tool_choice \"get_time\" names no tool",
        ),
        (forged_call, forged),
    ] {
        let e = generate(&url, request).await.unwrap_err();
        assert_eq!((e.code(), e.message()), (Code::InvalidArgument, message));
    }
}

/// A predicted output over real gRPC: NGRAM and AUTO draft from it (the text target-only
/// generated), their greedy tokens target-only's, in far fewer rounds than without it; a
/// wrong prediction changes no token. One past max_input_bytes is refused.
#[tokio::test]
async fn a_predicted_output_is_verified_as_drafts() {
    let (_m, stack) = tiny_stack().await;
    let url = stack.coordinator.url();
    // Letters only (the tiny target's own text is bytes that are not UTF-8: no prediction
    // could be written as text that tokenizes back to them).
    let letters: std::collections::HashMap<u32, f32> =
        (b'a'..=b'h').map(|b| (u32::from(b), 50.0)).collect();
    let predicted = |method, prediction: &str| pb::GenerateRequest {
        prediction: prediction.into(),
        logit_bias: letters.clone(),
        ..request("def f(x):", 32, method)
    };
    let plain = generate(&url, predicted(TargetOnly, "")).await.unwrap();
    for method in [Ngram, Auto] {
        let right = generate(&url, predicted(method, &plain.text))
            .await
            .unwrap();
        assert_eq!(right.token_ids, plain.token_ids, "{method:?}");
        let wrong = generate(&url, predicted(method, "hgfedcbahgfedcba"))
            .await
            .unwrap();
        assert_eq!(wrong.token_ids, plain.token_ids, "{method:?}");
    }
    // Eight drafts a round: with the prediction 27 of 28 drafts are right and 32 tokens take
    // 5 rounds; from the text alone 11 of 38, in 21 rounds. (Counts of the CPU's greedy
    // text: a GPU's rounds otherwise, so its text, and what prompt lookup finds in it,
    // differ; there the prediction's drafts are at least nine in ten right, in fewer rounds.)
    let fixed = |prediction: &str| pb::GenerateRequest {
        num_speculative_tokens: 8,
        ..predicted(Ngram, prediction)
    };
    let mut counts = vec![];
    for p in [plain.text.as_str(), ""] {
        let u = generate(&url, fixed(p)).await.unwrap().usage;
        counts.push((u.rounds, u.draft_tokens_proposed, u.draft_tokens_accepted));
    }
    if duet_engine::testing::test_device() == "cpu" {
        assert_eq!(counts, [(5, 28, 27), (21, 38, 11)]);
    } else {
        let [(rounds, proposed, accepted), (rounds_alone, ..)] = counts[..] else {
            unreachable!()
        };
        assert!(
            accepted * 10 >= proposed * 9 && rounds < rounds_alone,
            "{counts:?}"
        );
    }
    let huge = "x".repeat((1 << 20) + 1);
    let refused = generate(&url, predicted(Auto, &huge)).await.unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument);
    assert_eq!(
        refused.message(),
        "prediction: 1048577 bytes; at most 1048576"
    );
    wait_no_sessions(&stack, Duration::from_secs(5)).await;
}

/// Drafting ahead (`speculation.overlap_drafting`) over real gRPC: a second coordinator on
/// the same workers drafts ahead; its greedy tokens are the target's own for every K and for
/// AUTO, and with the target as its own draft (every guess right) the rounds after the
/// first find their drafts ready.
#[tokio::test]
async fn drafting_ahead_equals_target_only() {
    let m = tiny_models();
    for draft_model in [&m.draft, &m.target] {
        let stack = Stack::start(draft_model, &m.target);
        wait_stack(&stack).await;
        let ahead = start_drafting_ahead(&stack).await;
        let mut counted = false;
        for prompt in ["the cat", "def f(x):\n\treturn"] {
            let plain = generate(&stack.coordinator.url(), request(prompt, 40, TargetOnly))
                .await
                .unwrap();
            for (method, k) in [(DraftModel, 1), (DraftModel, 3), (DraftModel, 8), (Auto, 4)] {
                let mut req = request(prompt, 40, method);
                req.num_speculative_tokens = k;
                let g = generate(&ahead.url(), req).await.unwrap();
                let case = format!("{draft_model:?}, prompt {prompt:?}, {method:?} K = {k}");
                assert_eq!(g.token_ids, plain.token_ids, "{case}");
                let u = &g.usage;
                assert!(!u.fell_back_to_target_only, "{case}: {}", u.fallback_reason);
                assert!(u.drafted_ahead_used <= u.drafted_ahead, "{case}");
                if method == DraftModel {
                    assert!(u.drafted_ahead > 0, "{case}: {u:?}");
                }
                let whole = g.finish_reason == Some(pb::FinishReason::Length as i32);
                if method == DraftModel && draft_model == &m.target && k == 3 && whole {
                    // 40 tokens in rounds of 4; all but the first round's drafts made ahead
                    // (the last round, 4 tokens short of the end, drafts none ahead).
                    assert_eq!((u.rounds, u.drafted_ahead_used), (10, 9), "{case}");
                    assert_eq!(u.drafted_ahead, 9, "{case}");
                    counted = true;
                }
            }
        }
        assert_eq!(
            counted,
            draft_model == &m.target,
            "a whole 40-token run was counted"
        );
        wait_no_sessions(&stack, Duration::from_secs(5)).await;
    }
}

#[tokio::test]
async fn identical_draft_accepts_everything() {
    let m = tiny_models();
    let stack = Stack::start(&m.target, &m.target);
    wait_stack(&stack).await;
    let mut req = request("the cat", 30, DraftModel);
    req.num_speculative_tokens = 4;
    let g = generate(&stack.coordinator.url(), req).await.unwrap();
    assert_eq!(g.usage.draft_tokens_accepted, g.usage.draft_tokens_proposed);
    // The tiny target does not stop early on this prompt, so the count below is exact:
    // a target-only first step (the draft session opens after it on shared cores), then 29
    // tokens in rounds of 5 (4 drafts + bonus) and a last one of 4.
    assert_eq!(g.finish_reason, Some(pb::FinishReason::Length as i32));
    assert_eq!(g.usage.rounds, 7);
}

#[tokio::test]
async fn chat_messages_and_stop_strings() {
    let (_m, stack) = tiny_stack().await;
    let url = stack.coordinator.url();
    let chat = pb::GenerateRequest {
        input: Some(pb::generate_request::Input::Messages(pb::Messages {
            messages: vec![pb::ChatMessage {
                role: "user".into(),
                content: "hi".into(),
                ..Default::default()
            }],
        })),
        max_tokens: 20,
        ..Default::default()
    };
    let g = generate(&url, chat).await.unwrap();
    // "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n" in the tiny vocabulary.
    assert!(g.usage.prompt_tokens >= 8, "{}", g.usage.prompt_tokens);

    // A stop string taken from the unconstrained output cuts it right before it, and is
    // the one the answer names (not the first given, which never comes).
    let free = generate(&url, request("the cat", 60, TargetOnly))
        .await
        .unwrap();
    assert_eq!(free.stop_string, "");
    let chars: Vec<char> = free.text.chars().collect();
    assert!(chars.len() >= 12, "too little text to cut: {:?}", free.text);
    let stop: String = chars[8..11].iter().collect();
    let mut req = request("the cat", 60, DraftModel);
    req.stop = vec!["never\u{7}".into(), stop.clone()];
    let cut = generate(&url, req.clone()).await.unwrap();
    let at = free.text.find(&stop).unwrap();
    assert_eq!(cut.text, free.text[..at]);
    assert_eq!(cut.finish_reason, Some(pb::FinishReason::Stop as i32));
    assert_eq!(cut.stop_string, stop);
    // vLLM's include_stop_str_in_output: the same cut after the stop string.
    req.include_stop_str_in_output = true;
    let kept = generate(&url, req).await.unwrap();
    assert_eq!(kept.text, free.text[..at + stop.len()]);
    assert_eq!(kept.finish_reason, Some(pb::FinishReason::Stop as i32));
}

fn chat(messages: &[(&str, &str)]) -> pb::GenerateRequest {
    pb::GenerateRequest {
        input: Some(pb::generate_request::Input::Messages(pb::Messages {
            messages: messages
                .iter()
                .map(|(role, content)| pb::ChatMessage {
                    role: role.to_string(),
                    content: content.to_string(),
                    ..Default::default()
                })
                .collect(),
        })),
        ..request("", 8, TargetOnly)
    }
}

#[tokio::test]
async fn invalid_requests_name_the_field() {
    let (_m, stack) = tiny_stack().await;
    let url = stack.coordinator.url();
    let base = request("the cat", 8, DraftModel);
    let cases: Vec<(&str, pb::GenerateRequest)> = vec![
        (
            "input",
            pb::GenerateRequest {
                input: None,
                ..base.clone()
            },
        ),
        ("prompt", request("", 8, DraftModel)),
        (
            "temperature",
            pb::GenerateRequest {
                temperature: -0.5,
                ..base.clone()
            },
        ),
        (
            "temperature",
            pb::GenerateRequest {
                temperature: f32::NAN,
                ..base.clone()
            },
        ),
        (
            "top_p",
            pb::GenerateRequest {
                top_p: Some(0.0),
                ..base.clone()
            },
        ),
        (
            "top_p",
            pb::GenerateRequest {
                top_p: Some(1.5),
                ..base.clone()
            },
        ),
        (
            "speculation",
            pb::GenerateRequest {
                speculation: 42,
                ..base.clone()
            },
        ),
        (
            "num_speculative_tokens",
            pb::GenerateRequest {
                num_speculative_tokens: 1000,
                ..base.clone()
            },
        ),
        (
            "top_logprobs",
            pb::GenerateRequest {
                logprobs: true,
                top_logprobs: 21,
                ..base.clone()
            },
        ),
        (
            "presence_penalty",
            pb::GenerateRequest {
                presence_penalty: 3.0,
                ..base.clone()
            },
        ),
        (
            "max_tokens",
            pb::GenerateRequest {
                max_tokens: 10_000,
                ..base.clone()
            },
        ),
        ("prompt", request(&"the cat ".repeat(400), 8, DraftModel)),
        (
            "stop",
            pb::GenerateRequest {
                stop: vec![String::new()],
                ..base.clone()
            },
        ),
        (
            "messages",
            pb::GenerateRequest {
                input: Some(pb::generate_request::Input::Messages(
                    pb::Messages::default(),
                )),
                ..base.clone()
            },
        ),
        ("messages", chat(&[("wizard", "hi")])),
        // A role-less message: the error must not copy its content.
        ("messages", chat(&[("", &"secret ".repeat(10_000))])),
        (
            "messages",
            chat(&vec![
                ("user", "hi");
                duet_coordinator::CoordinatorConfig::default()
                    .limits
                    .max_messages
                    + 1
            ]),
        ),
        // Over the byte limits: refused before tokenizing.
        ("prompt", request(&"x".repeat((1 << 20) + 1), 8, DraftModel)),
        (
            "messages",
            chat(&[
                ("system", &"x".repeat(1 << 19)),
                ("user", &"y".repeat((1 << 19) + 1)),
            ]),
        ),
        (
            "stop",
            pb::GenerateRequest {
                stop: vec!["z".repeat(257)],
                ..base.clone()
            },
        ),
    ];
    for (field, req) in cases {
        let err = generate(&url, req).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{field}: {err:?}");
        assert!(
            err.message().starts_with(field) && err.message().len() < 200,
            "{field}: {}",
            err.message()
        );
    }
    // Within the byte limit, yet each entry two bytes that decode to a whole struct: the
    // entries are counted, and the request refused, before it is decoded.
    let empty_messages = pb::GenerateRequest {
        input: Some(pb::generate_request::Input::Messages(pb::Messages {
            messages: vec![pb::ChatMessage::default(); 500_000],
        })),
        ..base.clone()
    };
    let empty_stops = pb::GenerateRequest {
        stop: vec![String::new(); 500_000],
        ..base.clone()
    };
    for (req, message) in [
        (empty_messages, "messages: more than 4096 messages"),
        (empty_stops, "stop: more than 16 strings"),
    ] {
        let err = generate(&url, req).await.unwrap_err();
        assert_eq!(
            (err.code(), err.message()),
            (Code::InvalidArgument, message)
        );
    }
    // Larger than any request the limits allow: refused before it is decoded.
    let huge = generate(&url, request(&"x".repeat(2 << 20), 8, DraftModel))
        .await
        .unwrap_err();
    assert_eq!(huge.code(), Code::OutOfRange, "{huge:?}");
    // Still serving.
    let g = generate(&url, base).await.unwrap();
    assert_eq!(g.usage.completion_tokens as usize, g.token_ids.len());
}

#[tokio::test]
async fn target_down_is_unavailable_quickly() {
    // A port that was just free: nothing listens there.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let coordinator = start_coordinator(coordinator_config(&format!("http://{port}"), None));
    let started = Instant::now();
    let err = generate(&coordinator.url(), request("the cat", 8, TargetOnly))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert!(err.message().contains("target-worker"), "{}", err.message());
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    // Not ready, yet alive: a liveness probe must not restart it for its dependency.
    let mut health = tonic_health::pb::health_client::HealthClient::new(
        tonic::transport::Channel::from_shared(coordinator.url())
            .unwrap()
            .connect()
            .await
            .unwrap(),
    );
    let check = |service: &str| tonic_health::pb::HealthCheckRequest {
        service: service.into(),
    };
    let status = |r: tonic::Response<tonic_health::pb::HealthCheckResponse>| r.into_inner().status;
    let serving = tonic_health::pb::health_check_response::ServingStatus::Serving as i32;
    assert_ne!(status(health.check(check("")).await.unwrap()), serving);
    assert_eq!(
        status(health.check(check("liveness")).await.unwrap()),
        serving
    );
    // The same on the metrics port, for HTTP probes.
    assert_eq!(http_status(&coordinator, "/readyz").await, 503);
    assert_eq!(http_status(&coordinator, "/livez").await, 200);
}

/// A ready stack answers its HTTP probes 200 on every service.
#[tokio::test]
async fn http_probes_follow_health() {
    let (_m, stack) = tiny_stack().await;
    for service in [&stack.draft, &stack.target, &stack.coordinator] {
        assert_eq!(http_status(service, "/readyz").await, 200);
        assert_eq!(http_status(service, "/livez").await, 200);
    }
}

#[tokio::test]
async fn draft_down_falls_back_and_recovers() {
    let m = tiny_models();
    let mut draft = start_draft(worker_config(&m.draft));
    let addr = draft.addr;
    let target = start_target(worker_config(&m.target));
    let coordinator = start_coordinator(coordinator_config(&target.url(), Some(&draft.url())));
    wait_serving(&coordinator.url(), "duet.v1.DraftWorker").await;
    let url = coordinator.url();
    let plain = generate(&url, request("the cat", 30, TargetOnly))
        .await
        .unwrap();

    draft.kill();
    let g = generate(&url, request("the cat", 30, DraftModel))
        .await
        .unwrap();
    assert_eq!(g.token_ids, plain.token_ids);
    assert!(g.usage.fell_back_to_target_only);
    assert!(!g.usage.fallback_reason.is_empty());
    // The failure tripped the breaker once; the probe's failing checks are no more trips.
    let scraped = scrape(&coordinator).await;
    assert_eq!(sample(&scraped, "duet_draft_breaker_open"), 1.0);
    assert_eq!(sample(&scraped, "duet_draft_breaker_trips_total"), 1.0);

    // A draft-worker back on the same address: once its health check passes the breaker
    // is half-open, the next request is the trial, and the trial's success closes it.
    let mut config = worker_config(&m.draft);
    config.listen = addr.to_string();
    let draft = start_draft_at(config, addr);
    wait_serving(&draft.url(), "").await;
    let deadline = Instant::now() + Duration::from_secs(10);
    let trial = loop {
        let g = generate(&url, request("the cat", 30, DraftModel))
            .await
            .unwrap();
        if !g.usage.fell_back_to_target_only {
            break g;
        }
        assert!(Instant::now() < deadline, "no trial request: {:?}", g.usage);
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(trial.token_ids, plain.token_ids);
    wait_serving(&url, "duet.v1.DraftWorker").await;
    assert_eq!(
        sample(&scrape(&coordinator).await, "duet_draft_breaker_open"),
        0.0
    );
    let g = generate(&url, request("the cat", 30, DraftModel))
        .await
        .unwrap();
    assert!(
        !g.usage.fell_back_to_target_only,
        "{}",
        g.usage.fallback_reason
    );
    assert_eq!(g.token_ids, plain.token_ids);
}

#[tokio::test]
async fn draft_killed_mid_stream_completes_target_only() {
    let (_m, mut stack) = tiny_stack().await;
    let url = stack.coordinator.url();
    let plain = generate(&url, request("the cat", 200, TargetOnly))
        .await
        .unwrap();
    let mut req = request("the cat", 200, DraftModel);
    req.num_speculative_tokens = 2;
    let mut stream = open_stream(&url, req).await;
    let mut out = Completion::default();
    // The first message is a target-only step (the draft session opens after it on shared
    // cores), the second a drafted round.
    for _ in 0..2 {
        out.add(stream.message().await.unwrap().unwrap());
    }
    stack.draft.kill();
    out.read_rest(&mut stream, |_| {}).await.unwrap();
    assert_eq!(out.token_ids, plain.token_ids);
    let usage = out.usage;
    // Speculation ran before the kill...
    assert!(usage.draft_tokens_proposed > 0);
    // ...and the stream was at most 9 rounds ahead of the reader when the draft died, with
    // 200 tokens to go (the tiny target does not stop early here), so the rest ran
    // target-only.
    assert_eq!(plain.finish_reason, Some(pb::FinishReason::Length as i32));
    assert!(usage.fell_back_to_target_only);
}

/// A client of `url` whose HTTP/2 windows are a few bytes: the server can send almost
/// nothing it has not read.
async fn narrow_window_client(
    url: &str,
) -> duet_proto::v1::generation_client::GenerationClient<tonic::transport::Channel> {
    let channel = tonic::transport::Endpoint::from_shared(url.to_string())
        .unwrap()
        .initial_stream_window_size(Some(16))
        .initial_connection_window_size(Some(16))
        .connect()
        .await
        .unwrap();
    duet_proto::v1::generation_client::GenerationClient::new(channel)
}

/// A client that stops reading (its HTTP/2 window full, the stream still open) loses its
/// generation after `limits.stream_stall_timeout_ms`: both sessions are freed and the
/// metric counts it.
#[tokio::test]
async fn a_client_that_stops_reading_is_cut_off() {
    let m = tiny_models();
    let draft = start_draft(worker_config(&m.draft));
    let target = start_target(worker_config(&m.target));
    let mut config = coordinator_config(&target.url(), Some(&draft.url()));
    config.limits.stream_stall_timeout_ms = 300;
    let coordinator = start_coordinator(config);
    for url in [draft.url(), target.url(), coordinator.url()] {
        wait_serving(&url, "").await;
    }
    let mut client = narrow_window_client(&coordinator.url()).await;
    let mut stream = client
        .generate(request("the cat", 200, DraftModel))
        .await
        .unwrap()
        .into_inner();
    stream.message().await.unwrap().unwrap();
    // Reads no more.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let stalled = sample(&scrape(&coordinator).await, "duet_stalled_streams_total");
        if stalled == 1.0 {
            break;
        }
        assert!(Instant::now() < deadline, "never cut off");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    wait_sessions_closed(&target.url(), Duration::from_secs(5)).await;
    wait_sessions_closed(&draft.url(), Duration::from_secs(5)).await;
    drop(stream);
}

/// A client that reads one message every 200 ms never stalls, yet its request ends at
/// `limits.request_timeout_ms` (here 1 s): `DEADLINE_EXCEEDED` after what it read, and its
/// sessions freed.
#[tokio::test]
async fn a_slow_reader_is_cut_off_at_the_request_deadline() {
    let m = tiny_models();
    let target = start_target(worker_config(&m.target));
    let mut config = coordinator_config(&target.url(), None);
    config.limits.request_timeout_ms = 1000;
    let coordinator = start_coordinator(config);
    wait_serving(&coordinator.url(), "").await;
    let mut client = narrow_window_client(&coordinator.url()).await;
    let started = Instant::now();
    let mut stream = client
        .generate(request("the cat", 200, TargetOnly))
        .await
        .unwrap()
        .into_inner();
    let mut read = 0;
    let ended = loop {
        match stream.message().await {
            Ok(Some(_)) => read += 1,
            Ok(None) => panic!("finished whole after {read} messages"),
            Err(status) => break status,
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(ended.code(), Code::DeadlineExceeded, "{ended:?}");
    assert!(
        ended
            .message()
            .contains("limits.request_timeout_ms (1000 ms)"),
        "{ended:?}"
    );
    assert!(
        read < 50 && started.elapsed() < Duration::from_secs(10),
        "{read}"
    );
    wait_sessions_closed(&target.url(), Duration::from_secs(5)).await;
}

#[tokio::test]
async fn cancelling_frees_the_sessions() {
    let (_m, stack) = tiny_stack().await;
    let url = stack.coordinator.url();
    let mut stream = open_stream(&url, request("the cat", 200, DraftModel)).await;
    stream.message().await.unwrap().unwrap();
    assert_eq!(worker_sessions(&stack.target.url()).await, 1);
    drop(stream);
    wait_no_sessions(&stack, Duration::from_secs(5)).await;
}

#[tokio::test]
async fn concurrent_streams_are_independent() {
    let (_m, stack) = tiny_stack().await;
    let url = stack.coordinator.url();
    let prompts = ["the cat", "def f(x):", "hello world", "12345"];
    let mut expected = Vec::new();
    for p in prompts {
        expected.push(
            generate(&url, request(p, 30, TargetOnly))
                .await
                .unwrap()
                .token_ids,
        );
    }
    // Every method at once: target passes and draft passes batch calls of several sessions.
    let methods = [DraftModel, TargetOnly, Ngram, Auto];
    let runs = prompts.iter().flat_map(|&p| {
        let url = url.clone();
        methods.map(move |m| {
            let url = url.clone();
            tokio::spawn(async move { generate(&url, request(p, 30, m)).await })
        })
    });
    let results = futures::future::join_all(runs).await;
    for (i, r) in results.into_iter().enumerate() {
        let (p, m) = (i / methods.len(), methods[i % methods.len()]);
        assert_eq!(
            r.unwrap().unwrap().token_ids,
            expected[p],
            "stream {i}: {m:?}"
        );
    }
}

/// A burst of long prompts, every one prefilled in chunks of 8 tokens on both workers (no
/// prefix cache to skip them), while the others' Verify and Propose calls run between the
/// chunks: every stream says what it said alone, and no session is left open.
#[tokio::test]
async fn a_burst_of_long_prompts_prefilled_in_chunks_says_what_each_says_alone() {
    let m = tiny_models();
    let [mut draft, mut target] = [&m.draft, &m.target].map(|model| worker_config(model));
    for c in [&mut draft, &mut target] {
        (c.prefill_chunk_tokens, c.prefix_cache_tokens) = (Some(8), 0);
    }
    let stack = Stack::start_with(draft, target);
    wait_stack(&stack).await;
    let url = stack.coordinator.url();
    let body = "def f(x): return x + 1 # the cat sat\n".repeat(4);
    let prompts: Vec<String> = (0..5).map(|i| format!("{i}: {body}")).collect();
    let mut expected = Vec::new();
    for p in &prompts {
        let alone = generate(&url, request(p, 32, TargetOnly)).await.unwrap();
        let prompt_tokens = alone.usage.prompt_tokens;
        assert!(prompt_tokens > 100, "{prompt_tokens} prompt tokens");
        expected.push(alone.token_ids);
    }
    let methods = [TargetOnly, DraftModel, Ngram, Auto];
    let runs = prompts.iter().flat_map(|p| {
        methods.map(|m| {
            let (url, p) = (url.clone(), p.clone());
            tokio::spawn(async move { generate(&url, request(&p, 32, m)).await })
        })
    });
    let results = futures::future::join_all(runs).await;
    for (i, r) in results.into_iter().enumerate() {
        let (p, m) = (i / methods.len(), methods[i % methods.len()]);
        let got = r.unwrap().unwrap().token_ids;
        assert_eq!(got, expected[p], "stream {i}: {m:?}");
    }
    wait_no_sessions(&stack, Duration::from_secs(10)).await;
}

/// Streams whose next call comes back quickly share the target's passes: four identical
/// target-only streams, once their return gaps are known, run every round in one pass.
/// Only the streams' start may run apart: a stream opened late (on a loaded machine, by
/// tens of passes of this tiny model) leaves the others to run alone until it joins. That
/// lag is time, not rounds, so the streams are long and the bound is half their rounds
/// more (without the wait, passes are nearly twice the rounds). The window is generous so
/// that a loaded machine does not make a stream late.
#[tokio::test]
async fn streams_due_back_share_the_target_passes() {
    let (_m, target, coordinator) = target_only(|c| c.batch_wait_ms = 2_000).await;
    let url = coordinator.url();
    let runs = (0..4).map(|_| {
        let url = url.clone();
        tokio::spawn(async move { generate(&url, request("the cat", 200, TargetOnly)).await })
    });
    let results = futures::future::join_all(runs).await;
    let rounds: Vec<u32> = results
        .into_iter()
        .map(|r| r.unwrap().unwrap().usage.rounds)
        .collect();
    assert!(rounds.iter().all(|&r| r == rounds[0]), "{rounds:?}");
    let want = f64::from(4 * rounds[0]);
    let t = scrape_until(&target, "duet_worker_batch_size_sum", want).await;
    let calls = sample(&t, "duet_worker_batch_size_sum");
    let passes = sample(&t, "duet_worker_batch_size_count");
    assert_eq!(calls, want);
    assert!(
        passes <= f64::from(rounds[0] + rounds[0] / 2),
        "{calls} calls in {passes} passes for {} rounds",
        rounds[0]
    );
    assert!(sample(&t, "duet_worker_batch_wait_seconds_count") > 0.0);
}

/// A short target-only Generate call of its own.
fn spawn_generate(url: &str) -> tokio::task::JoinHandle<Result<Completion, tonic::Status>> {
    let url = url.to_string();
    tokio::spawn(async move { generate(&url, request("the cat", 4, TargetOnly)).await })
}

/// A stream that holds its place until dropped: its HTTP/2 window of 64 bytes fills after a
/// few messages, and with it the coordinator's stream buffer, so the generation waits for
/// a reader that does not come (for `limits.stream_stall_timeout_ms`).
async fn held_stream(url: &str) -> tonic::Streaming<pb::GenerateResponse> {
    held_stream_as(url, None).await
}

/// [`held_stream`] under bearer `token`.
async fn held_stream_as(url: &str, token: Option<&str>) -> tonic::Streaming<pb::GenerateResponse> {
    let channel = tonic::transport::Endpoint::from_shared(url.to_string())
        .unwrap()
        .initial_stream_window_size(64)
        .connect()
        .await
        .unwrap();
    let mut client = pb::generation_client::GenerationClient::new(channel);
    let mut req = tonic::Request::new(request("the cat", 200, TargetOnly));
    if let Some(token) = token {
        let bearer = format!("Bearer {token}").parse().unwrap();
        req.metadata_mut().insert("authorization", bearer);
    }
    let mut stream = client.generate(req).await.unwrap().into_inner();
    stream.message().await.unwrap().unwrap();
    stream
}

/// `max_concurrent_requests_per_token` over real gRPC, with two bearer tokens and a bound
/// of one place each: team-a's stream holds its place, so its next request waits in the
/// queue though places are free, while team-b's goes past it at once; team-a's runs once
/// its stream ends.
#[tokio::test]
async fn a_tokens_requests_hold_at_most_its_bound_and_others_go_past() {
    let m = tiny_models();
    let target = start_target(worker_config(&m.target));
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("tokens"), "team-a\nteam-b\n").unwrap();
    let mut config = coordinator_config(&target.url(), None);
    config.auth_token_file = dir.path().join("tokens").to_string_lossy().into_owned();
    config.max_concurrent_requests_per_token = 1;
    let coordinator = start_coordinator(config);
    let url = coordinator.url();
    wait_serving(&url, "").await;
    let held = held_stream_as(&url, Some("team-a")).await;
    let waiting = tokio::spawn({
        let url = url.clone();
        async move { cached_as(&url, "team-a", "", "a dog").await }
    });
    wait_queued(&coordinator, 1.0).await;
    let passing = cached_as(&url, "team-b", "", "a dog").await;
    assert_eq!(passing.token_ids.len(), 8);
    assert!(!waiting.is_finished());
    assert_eq!(
        sample(&scrape(&coordinator).await, "duet_num_requests_waiting"),
        1.0
    );
    drop(held);
    assert_eq!(waiting.await.unwrap().token_ids, passing.token_ids);
}

/// A target-worker and a coordinator with `places` and a wait queue of `queued`, serving.
async fn queue_stack(places: usize, queued: usize) -> (TinyModels, Running, Running) {
    let m = tiny_models();
    let target = start_target(worker_config(&m.target));
    let mut config = coordinator_config(&target.url(), None);
    (config.max_concurrent_requests, config.max_queued) = (places, queued);
    let coordinator = start_coordinator(config);
    wait_serving(&coordinator.url(), "").await;
    (m, target, coordinator)
}

/// Waits until the coordinator's wait queue holds `n` requests.
async fn wait_queued(coordinator: &Running, n: f64) {
    for _ in 0..400 {
        if sample(&scrape(coordinator).await, "duet_num_requests_waiting") == n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("the wait queue never held {n} requests");
}

/// With every place taken, a request waits in the queue and runs when a place frees (its
/// wait in its usage, within its time to first token); one more than the queue holds is
/// refused at once; a queued request whose caller goes away leaves the queue at once.
#[tokio::test]
async fn requests_wait_for_a_place_in_a_bounded_queue() {
    let (_m, _target, coordinator) = queue_stack(1, 1).await;
    let url = coordinator.url();
    let held = held_stream(&url).await;

    let waiter = spawn_generate(&url);
    wait_queued(&coordinator, 1.0).await;
    let refused = generate(&url, request("the cat", 4, TargetOnly)).await;
    let refused = refused.unwrap_err();
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
    assert_eq!(
        refused.message(),
        "too many generations running (max_concurrent_requests = 1) and the wait queue is full (max_queued = 1)"
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    drop(held);
    let done = waiter.await.unwrap().unwrap();
    assert_eq!(done.usage.completion_tokens, 4);
    let t = done.usage.timings.unwrap();
    assert!(t.admission_wait_ms >= 200.0, "{t:?}");
    assert!(t.time_to_first_token_ms >= t.admission_wait_ms, "{t:?}");

    // A queued caller that goes away frees its place in the queue at once.
    let held = held_stream(&url).await;
    let gone = spawn_generate(&url);
    wait_queued(&coordinator, 1.0).await;
    gone.abort();
    wait_queued(&coordinator, 0.0).await;
    let next = spawn_generate(&url);
    wait_queued(&coordinator, 1.0).await;
    drop(held);
    assert_eq!(next.await.unwrap().unwrap().usage.completion_tokens, 4);
    let c = scrape(&coordinator).await;
    assert_eq!(sample(&c, "duet_num_requests_waiting"), 0.0);
    assert!(sample(&c, "duet_request_queue_time_seconds_count") >= 4.0);
}

/// vLLM's priority over real gRPC, where the coordinator schedules by priority: with the
/// one place taken, a request of priority -1 that comes after one of priority 5 runs first
/// when the place frees.
#[tokio::test]
async fn a_lower_priority_waits_less() {
    let m = tiny_models();
    let target = start_target(worker_config(&m.target));
    let mut config = coordinator_config(&target.url(), None);
    (config.max_concurrent_requests, config.max_queued) = (1, 4);
    config.scheduling_policy = duet_coordinator::config::SchedulingPolicy::Priority;
    let coordinator = start_coordinator(config);
    let url = coordinator.url();
    wait_serving(&url, "").await;
    let held = held_stream(&url).await;
    let (done, mut finished) = tokio::sync::mpsc::unbounded_channel();
    let spawn = |priority: i32| {
        let (url, done) = (url.clone(), done.clone());
        let req = pb::GenerateRequest {
            priority,
            ..request("the cat", 4, TargetOnly)
        };
        tokio::spawn(async move {
            let got = generate(&url, req).await.unwrap();
            done.send((priority, got.usage.completion_tokens)).unwrap();
        })
    };
    let late = spawn(5);
    wait_queued(&coordinator, 1.0).await;
    let urgent = spawn(-1);
    wait_queued(&coordinator, 2.0).await;
    drop(held);
    let (urgent, late) = (urgent.await, late.await);
    assert!(urgent.is_ok() && late.is_ok());
    assert_eq!(finished.recv().await, Some((-1, 4)));
    assert_eq!(finished.recv().await, Some((5, 4)));
}

/// Preemption over real gRPC: the target-worker has room for one session, held by a
/// request of priority 5 drafting with the draft model; one of priority -1 takes the room
/// (the first closes its sessions at its next round), finishes first, and the first then
/// goes on from its committed tokens on a new session, its text token for token what it is
/// alone. The usage says where it gave way, and the metric counts it.
#[tokio::test]
async fn a_lower_priority_takes_a_running_requests_room_and_its_text_stays_the_same() {
    urgent_takes_the_room(false).await;
}

/// The same with the urgent request on another coordinator: the target-worker that refuses
/// it asks the running session to give way, and holds the room for it.
#[tokio::test]
async fn a_lower_priority_takes_the_room_of_another_coordinators_request() {
    urgent_takes_the_room(true).await;
}

async fn urgent_takes_the_room(from_another_coordinator: bool) {
    let m = tiny_models();
    let draft = start_draft(worker_config(&m.draft));
    let mut worker = worker_config(&m.target);
    worker.max_sessions = 1;
    let target = start_target(worker);
    let mut config = coordinator_config(&target.url(), Some(&draft.url()));
    config.scheduling_policy = duet_coordinator::config::SchedulingPolicy::Priority;
    let coordinator = start_coordinator(config.clone());
    let other = from_another_coordinator.then(|| start_coordinator(config));
    let url = coordinator.url();
    let urgent_url = other.as_ref().map_or(url.clone(), |c| c.url());
    wait_serving(&url, "").await;
    wait_serving(&urgent_url, "").await;
    let low = pb::GenerateRequest {
        priority: 5,
        ignore_eos: true,
        ..request("the cat", 200, DraftModel)
    };
    let high = pb::GenerateRequest {
        priority: -1,
        ..request("a dog", 16, TargetOnly)
    };
    let alone = (generate(&url, low.clone()).await).unwrap();
    let high_alone = (generate(&url, high.clone()).await).unwrap();
    wait_sessions_closed(&target.url(), Duration::from_secs(5)).await;

    let (ended, mut order) = tokio::sync::mpsc::unbounded_channel();
    let (started, first_text) = tokio::sync::oneshot::channel();
    let running = tokio::spawn({
        let (url, ended) = (url.clone(), ended.clone());
        async move {
            let mut stream = client(&url).await.generate(low).await?.into_inner();
            let mut got = Completion::default();
            while got.chunks == 0 {
                got.add(stream.message().await?.expect("a chunk"));
            }
            started.send(()).unwrap();
            got.read_rest(&mut stream, |_| {}).await?;
            ended.send("low").unwrap();
            Ok::<_, tonic::Status>(got)
        }
    });
    first_text.await.unwrap();
    let urgent = generate(&urgent_url, high).await.unwrap();
    ended.send("high").unwrap();
    let low = running.await.unwrap().unwrap();
    assert_eq!(
        (order.recv().await, order.recv().await),
        (Some("high"), Some("low"))
    );
    assert_eq!(urgent.token_ids, high_alone.token_ids);
    assert_eq!(low.token_ids, alone.token_ids);
    assert_eq!(low.token_ids.len(), 200);
    let at = low.usage.preempted_at.clone();
    assert_eq!(at.len(), 1, "{at:?}");
    assert!((1..200).contains(&at[0]), "{at:?}");
    assert_eq!(urgent.usage.preempted_at, Vec::<u32>::new());
    let c = scrape(&coordinator).await;
    assert_eq!(sample(&c, "duet_preemptions_total"), 1.0);
}

/// At full size: 64 places and a queue of 64. 64 streams hold the places, 64 more wait,
/// and of 72 more each is refused at once; when the places free, the 64 waiting complete.
/// Prints the slowest refusal (the issue asks for 50 ms; a loaded CI machine is allowed a
/// second).
#[tokio::test]
async fn a_full_queue_refuses_the_excess_at_once_and_the_queued_complete() {
    let (_m, _target, coordinator) = queue_stack(64, 64).await;
    let url = coordinator.url();
    let held = futures::future::join_all((0..64).map(|_| held_stream(&url))).await;
    let queued: Vec<_> = (0..64).map(|_| spawn_generate(&url)).collect();
    wait_queued(&coordinator, 64.0).await;
    let refusals = (0..72).map(|_| {
        let url = url.clone();
        async move {
            let started = Instant::now();
            let refused = generate(&url, request("the cat", 4, TargetOnly)).await;
            (refused.map(|_| ()).map_err(|e| e.code()), started.elapsed())
        }
    });
    let refusals = futures::future::join_all(refusals).await;
    assert!(
        refusals
            .iter()
            .all(|(r, _)| *r == Err(Code::ResourceExhausted)),
        "{refusals:?}"
    );
    let slowest = refusals.iter().map(|(_, t)| *t).max().unwrap();
    println!(
        "72 refusals, the slowest in {:.1} ms",
        slowest.as_secs_f64() * 1e3
    );
    assert!(slowest < Duration::from_secs(1), "{slowest:?}");
    drop(held);
    for q in queued {
        assert_eq!(q.await.unwrap().unwrap().usage.completion_tokens, 4);
    }
}

/// An open that finds one replica busy (its session limit reached, here by a session
/// another client holds) goes to the next replica instead of failing the request.
#[tokio::test]
async fn an_open_refused_by_a_busy_replica_tries_the_next() {
    let m = tiny_models();
    let mut one_session = worker_config(&m.target);
    one_session.max_sessions = 1;
    let busy = start_target(one_session);
    let free = start_target(worker_config(&m.target));
    for url in [busy.url(), free.url()] {
        wait_serving(&url, "").await;
    }
    let _taken = open_session(&busy.url(), 16).await;
    let replicas = format!("{}, {}", busy.url(), free.url());
    let coordinator = start_coordinator(coordinator_config(&replicas, None));
    wait_serving(&coordinator.url(), "").await;
    // The coordinator holds no session on either, so each request tries them in turn: every
    // one that starts on the busy replica moves on to the free one.
    for _ in 0..4 {
        let done = generate(&coordinator.url(), request("the cat", 4, TargetOnly)).await;
        assert_eq!(done.unwrap().usage.completion_tokens, 4);
    }
    assert_eq!(prefills(&free).await, 4.0);
}

/// Three conversations of three turns, interleaved, over two target replicas: with prefix
/// routing every later turn (its history most of its prompt) goes where its conversation
/// went and finds at least its last prompt in that replica's cache; by load alone, turns
/// land on the other replica and miss.
#[tokio::test]
async fn prefix_routing_sends_a_conversation_back_to_its_cache() {
    let m = tiny_models();
    if !prefix_cache_works(&m.target) {
        // No cache to route to (`later_turns_take_their_prefix_...` checks it stays off).
        return;
    }
    let replicas: Vec<Running> = (0..2)
        .map(|_| start_target(worker_config(&m.target)))
        .collect();
    for r in &replicas {
        wait_serving(&r.url(), "").await;
    }
    let urls = format!("{}, {}", replicas[0].url(), replicas[1].url());
    let mut by_load = coordinator_config(&urls, None);
    by_load.routing.prefix_aware = false;
    let coordinators = [
        start_coordinator(coordinator_config(&urls, None)),
        start_coordinator(by_load),
    ];
    let mut missed = Vec::new();
    for (run, coordinator) in coordinators.iter().enumerate() {
        wait_serving(&coordinator.url(), "").await;
        let mut prompts: Vec<String> = (0..3)
            .map(|c| {
                format!(
                    "{run}{c} {}",
                    "the dog ran to the cat and then the cat ran away. ".repeat(3)
                )
            })
            .collect();
        let mut heads = [0; 3];
        let mut misses = 0;
        for turn in 0..3 {
            for (c, prompt) in prompts.iter_mut().enumerate() {
                let done = generate(&coordinator.url(), request(prompt, 8, TargetOnly))
                    .await
                    .unwrap();
                let cached = done.usage.prompt_tokens_cached;
                if turn > 0 && cached < heads[c] {
                    misses += 1;
                }
                heads[c] = done.usage.prompt_tokens - 1;
                prompt.push_str(&format!("{}\nturn {turn} of {c}: ", done.text));
            }
        }
        missed.push(misses);
    }
    assert_eq!(missed[0], 0, "prefix routing");
    assert!(missed[1] > 0, "by load: {missed:?}");
}

/// Two target replicas serving different models (the tiny target's and the tiny draft's):
/// the coordinator checks each replica's model against the first one it described, so every
/// request goes to the replica of that model, however the load would alternate them.
#[tokio::test]
async fn a_replica_serving_another_model_gets_no_session() {
    let m = tiny_models();
    let replicas = [&m.target, &m.draft].map(|model| start_target(worker_config(model)));
    for r in &replicas {
        wait_serving(&r.url(), "").await;
    }
    let urls = format!("{}, {}", replicas[0].url(), replicas[1].url());
    let coordinator = start_coordinator(coordinator_config(&urls, None));
    wait_serving(&coordinator.url(), "").await;
    for prompt in ["the cat", "a dog", "the end", "one more"] {
        let done = generate(&coordinator.url(), request(prompt, 6, TargetOnly)).await;
        assert_eq!(done.unwrap().usage.completion_tokens, 6, "{prompt}");
    }
    let counts = [prefills(&replicas[0]).await, prefills(&replicas[1]).await];
    assert!(counts == [4.0, 0.0] || counts == [0.0, 4.0], "{counts:?}");
}

/// A target replica replaced at the same address by a worker serving another model (a pod
/// rescheduled with the wrong image): the coordinator sees a session open on a new worker
/// instance there, asks its model again, closes the session and fails the request; the
/// next request opens nothing there.
#[tokio::test]
async fn a_replaced_replica_is_asked_its_model_again() {
    let m = tiny_models();
    let first = start_target(worker_config(&m.target));
    wait_serving(&first.url(), "").await;
    let coordinator = start_coordinator(coordinator_config(&first.url(), None));
    wait_serving(&coordinator.url(), "").await;
    let done = generate(&coordinator.url(), request("the cat", 6, TargetOnly)).await;
    assert_eq!(done.unwrap().usage.completion_tokens, 6);
    let addr = first.addr;
    drop(first);
    let replaced = start_target_at(worker_config(&m.draft), addr);
    wait_serving(&replaced.url(), "").await;
    for _ in 0..2 {
        let err = generate(&coordinator.url(), request("the cat", 6, TargetOnly))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::Internal, "{err:?}");
        assert!(err.message().contains("draft.gguf"), "{err:?}");
    }
    wait_sessions_closed(&replaced.url(), Duration::from_secs(5)).await;
    assert_eq!(prefills(&replaced).await, 1.0);
}

/// The proposal cache over real gRPC, with two bearer tokens (two tenants): a request
/// teaches it, the same request under the other token gets nothing from it, and under the
/// same token again its rounds take their proposals from it. Without tokens (the default
/// `per_token` sharing) it stays off.
#[tokio::test]
async fn the_proposal_cache_is_shared_within_a_token_only() {
    let m = tiny_models();
    let target = start_target(worker_config(&m.target));
    let dir = tempfile::tempdir().unwrap();
    let coordinator = start_coordinator_with_tokens(&target.url(), dir.path(), "team-a\nteam-b\n");
    let url = coordinator.url();
    wait_serving(&url, "").await;
    let prompt = "qx zv wk jb fp";
    let as_team = |token: &str| {
        let mut req = tonic::Request::new(request(prompt, 24, Ngram));
        let bearer = format!("Bearer {token}").parse().unwrap();
        req.metadata_mut().insert("authorization", bearer);
        req
    };
    let hits = || async {
        sample(
            &scrape(&coordinator).await,
            "duet_proposal_cache_hits_total",
        )
    };
    let first = generate(&url, as_team("team-a")).await.unwrap();
    assert_eq!(hits().await, 0.0);
    let other = generate(&url, as_team("team-b")).await.unwrap();
    assert_eq!(other.token_ids, first.token_ids);
    assert_eq!(hits().await, 0.0, "team-b was proposed team-a's text");
    let again = generate(&url, as_team("team-a")).await.unwrap();
    assert_eq!(again.token_ids, first.token_ids);
    assert!(hits().await >= 1.0);
    assert!(again.usage.draft_tokens_accepted > first.usage.draft_tokens_accepted);

    let (_m, _target, open) = target_only(|_| {}).await;
    for _ in 0..2 {
        generate(&open.url(), request(prompt, 24, Ngram))
            .await
            .unwrap();
    }
    let scraped = scrape(&open).await;
    assert_eq!(sample(&scraped, "duet_proposal_cache_hits_total"), 0.0);
    assert_eq!(sample(&scraped, "duet_proposal_cache_entries"), 0.0);
}

/// The prefix cache over real gRPC: a second turn (the first's prompt, its answer and a
/// new line) and a repeated request take their prompts' prefixes from earlier sessions on
/// both workers, and every token is what a target-worker without the cache gives (on a
/// GPU, where the workers keep the cache off: the same tokens, nothing taken from it).
#[tokio::test]
async fn later_turns_take_their_prefix_from_the_cache_and_say_the_same() {
    let (m, stack) = tiny_stack().await;
    let (_m2, _plain_target, plain) = target_only(|c| c.prefix_cache_tokens = 0).await;
    let (cached, plain) = (stack.coordinator.url(), plain.url());
    let first = "the cat sat on the mat and then the dog came in. ".repeat(2);
    let turn = |prompt: &str| request(prompt, 24, DraftModel);
    let a = generate(&cached, turn(&first)).await.unwrap();
    assert_eq!(a.usage.prompt_tokens_cached, 0);
    let second = format!("{first}{}\nand then?", a.text);
    let mut prompt_cached = Vec::new();
    for prompt in [&first, &second, &second] {
        let got = generate(&cached, turn(prompt)).await.unwrap();
        let want = generate(&plain, request(prompt, 24, TargetOnly))
            .await
            .unwrap();
        assert_eq!(got.token_ids, want.token_ids, "{prompt:?}");
        assert_eq!(want.usage.prompt_tokens_cached, 0);
        prompt_cached.push((got.usage.prompt_tokens_cached, got.usage.prompt_tokens - 1));
    }
    if !prefix_cache_works(&m.target) {
        assert!(prompt_cached.iter().all(|c| c.0 == 0), "{prompt_cached:?}");
        return;
    }
    // A repeated prompt finds all of it but its last token (which the first call feeds);
    // the second turn finds at least the first turn's prompt.
    assert_eq!(prompt_cached[0].0, prompt_cached[0].1);
    assert!(
        prompt_cached[1].0 >= prompt_cached[0].1,
        "{prompt_cached:?}"
    );
    assert_eq!(prompt_cached[2].0, prompt_cached[2].1);
    wait_no_sessions(&stack, Duration::from_secs(5)).await;
    for worker in [&stack.target, &stack.draft] {
        let metrics = scrape(worker).await;
        let hit = sample(&metrics, "duet_worker_prefix_cache_hit_tokens_total");
        assert!(hit >= (prompt_cached[0].0 * 2) as f64, "{metrics}");
        assert!(sample(&metrics, "duet_worker_prefix_cache_tokens") > 0.0);
    }
}

/// The workers' prefix caches kept apart over real gRPC: with two bearer tokens (the
/// default `per_token` sharing), a prompt cached under one token is taken again under it
/// only, and under vLLM's `cache_salt` only with the same salt; where
/// `prefix_cache_sharing` is `everyone`, under either token. The tokens are the same
/// either way.
#[tokio::test]
async fn a_cached_prefix_is_taken_under_its_token_and_salt_only() {
    let m = tiny_models();
    if !prefix_cache_works(&m.target) {
        return; // No cache to keep apart (a GPU's workers keep it off).
    }
    let target = start_target(worker_config(&m.target));
    let dir = tempfile::tempdir().unwrap();
    let tokens = "team-a\nteam-b\n";
    let per_token = start_coordinator_with_tokens(&target.url(), dir.path(), tokens);
    wait_serving(&per_token.url(), "").await;
    let prompt = "the cat sat on the mat and then the dog came in. ".repeat(2);
    let first = cached_as(&per_token.url(), "team-a", "", &prompt).await;
    let whole = first.prompt_tokens - 1;
    let mut taken = Vec::new();
    for (token, salt) in [
        ("team-b", ""),
        ("team-a", "s"),
        ("team-a", ""),
        ("team-a", "s"),
    ] {
        let got = cached_as(&per_token.url(), token, salt, &prompt).await;
        assert_eq!(got.token_ids, first.token_ids, "{token} {salt}");
        taken.push(got.prompt_tokens_cached);
    }
    assert_eq!(taken, [0, 0, whole, whole]);
    let mut config = coordinator_config(&target.url(), None);
    config.auth_token_file = dir.path().join("tokens").to_string_lossy().into_owned();
    config.prefix_cache_sharing = duet_coordinator::config::PrefixSharing::Everyone;
    let everyone = start_coordinator(config);
    wait_serving(&everyone.url(), "").await;
    let mut taken = Vec::new();
    for token in ["team-a", "team-b"] {
        let got = cached_as(&everyone.url(), token, "", &prompt).await;
        assert_eq!(got.token_ids, first.token_ids, "{token}");
        taken.push(got.prompt_tokens_cached);
    }
    assert_eq!(taken, [0, whole]);
}

/// A greedy target-only request of `prompt` under bearer `token` with `cache_salt` `salt`:
/// its tokens, and how many of its prompt's came from a prefix cache.
async fn cached_as(url: &str, token: &str, salt: &str, prompt: &str) -> Cached {
    let mut req = tonic::Request::new(pb::GenerateRequest {
        cache_salt: salt.into(),
        ..request(prompt, 8, TargetOnly)
    });
    let bearer = format!("Bearer {token}").parse().unwrap();
    req.metadata_mut().insert("authorization", bearer);
    let got = generate(url, req).await.unwrap();
    Cached {
        token_ids: got.token_ids,
        prompt_tokens: got.usage.prompt_tokens,
        prompt_tokens_cached: got.usage.prompt_tokens_cached,
    }
}

struct Cached {
    token_ids: Vec<u32>,
    prompt_tokens: u32,
    prompt_tokens_cached: u32,
}

/// A target-worker with room for one session (`max_sessions` = 1), held by another client
/// (as another coordinator would): a request waits for room
/// (`duet_num_requests_waiting_for_kv` counts it), trying again as it backs off, and runs
/// once the session is closed. With no room within `queue_timeout_ms` it answers
/// RESOURCE_EXHAUSTED.
#[tokio::test]
async fn a_request_without_room_waits_for_it() {
    let m = tiny_models();
    let mut worker = worker_config(&m.target);
    worker.max_sessions = 1;
    let target = start_target(worker);
    let mut config = coordinator_config(&target.url(), None);
    config.queue_timeout_ms = 2_000;
    let coordinator = start_coordinator(config);
    let url = coordinator.url();
    wait_serving(&url, "").await;
    let held = open_session(&target.url(), 16).await;
    let waiting = tokio::spawn({
        let url = url.clone();
        async move { generate(&url, request("a dog", 8, TargetOnly)).await }
    });
    let kv_waiting = "duet_num_requests_waiting_for_kv";
    let scraped = scrape_until(&coordinator, kv_waiting, 1.0).await;
    assert_eq!(sample(&scraped, kv_waiting), 1.0);
    let mut worker = duet_proto::v1::worker_client::WorkerClient::connect(target.url())
        .await
        .unwrap();
    let close = pb::CloseSessionRequest {
        session_id: held.session_id,
        instance_id: held.instance_id,
    };
    worker.close_session(close).await.unwrap();
    let done = waiting.await.unwrap().unwrap();
    assert_eq!(done.usage.completion_tokens, 8);
    assert_eq!(sample(&scrape(&coordinator).await, kv_waiting), 0.0);

    // The finished request's session closes in the background: its room first.
    wait_sessions_closed(&target.url(), Duration::from_secs(5)).await;
    let _held = open_session(&target.url(), 16).await;
    let started = Instant::now();
    let err = generate(&url, request("a dog", 8, TargetOnly))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
    assert!(err.message().contains("queue_timeout_ms = 2000"), "{err:?}");
    assert!(started.elapsed() >= Duration::from_millis(1_900));
}

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
                let mut index = duet_coordinator::ngram::NgramIndex::new(2, 8);
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

/// The Describe answer of the worker at `url`.
async fn described(url: &str) -> pb::ModelDescription {
    duet_proto::v1::worker_client::WorkerClient::connect(url.to_string())
        .await
        .unwrap()
        .describe(pb::DescribeRequest::default())
        .await
        .unwrap()
        .into_inner()
}

/// Whether the worker at `url` verifies trees of drafts (its Describe: on a CPU, not on a
/// GPU).
async fn verifies_trees(url: &str) -> bool {
    described(url).await.verifies_trees
}

/// Whether the workers turn their prefix caches on for `model` on the test device: only
/// where a token's keys and values do not depend on the pass (the CPU; on a GPU they stay
/// off, and a request's prompt is prefilled whole).
fn prefix_cache_works(model: &std::path::Path) -> bool {
    reference_model(model).kv_rows_invariant()
}

/// The target model for a test's reference distributions, on the workers' device
/// (`DUET_TEST_DEVICE`).
fn reference_model(path: &std::path::Path) -> duet_engine::Model {
    duet_engine::Model::load(path, &duet_engine::testing::test_load_options()).unwrap()
}

/// The target's logits after `ids` computed as a target-worker computes them: the prompt's
/// head (`ids[..prompt_len - 1]`) prefilled, the rest fed on the invariant path. On a CPU
/// this equals one forward pass bitwise; on a GPU prefill rounds differently, and a
/// reference computed otherwise would not be the distribution the workers sample from.
fn worker_logits(model: &duet_engine::Model, ids: &[u32], prompt_len: usize) -> Vec<f32> {
    let mut cache = model.new_cache(64).unwrap();
    let head = &ids[..prompt_len - 1];
    if !head.is_empty() {
        model
            .prefill(&mut cache, head, duet_engine::LogitsFor::None)
            .unwrap();
    }
    let logits = model
        .forward(&mut cache, &ids[head.len()..], duet_engine::LogitsFor::Last)
        .unwrap();
    logits.last().unwrap().to_vec()
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

#[tokio::test]
async fn shutdown_drains_running_streams() {
    let (_m, stack) = tiny_stack().await;
    let url = stack.coordinator.url();
    let mut stream = open_stream(&url, request("the cat", 120, DraftModel)).await;
    stream.message().await.unwrap().unwrap();
    stack.coordinator.shutdown.trigger();
    let mut finish = None;
    while let Some(m) = stream.message().await.unwrap() {
        if let Some(pb::generate_response::Event::Finished(f)) = m.event {
            finish = Some(f.finish_reason);
        }
    }
    // The running stream ended normally, not with CANCELLED or an error.
    let finish = finish.expect("a final message");
    assert_ne!(finish, pb::FinishReason::Cancelled as i32);
    // New connections are refused once the stream is done.
    let again = duet_proto::v1::generation_client::GenerationClient::connect(url).await;
    assert!(again.is_err());
}

/// While running streams drain, the coordinator's health stays NOT_SERVING: its checks of
/// the target-worker (every 50 ms here) must not turn it back to SERVING.
#[tokio::test]
async fn health_stays_not_serving_while_draining() {
    let (_m, stack) = tiny_stack().await;
    let url = stack.coordinator.url();
    // Opened before the signal: the draining server takes no new calls.
    let mut health = watch_health(&url).await;
    let first = health.message().await.unwrap().unwrap();
    assert_eq!(first.status, ServingStatus::Serving as i32);
    // A stream left unread keeps the drain going (its generation waits on it).
    let mut stream = open_stream(&url, request("the cat", 200, DraftModel)).await;
    stream.message().await.unwrap().unwrap();
    stack.coordinator.shutdown.trigger();
    // (Each target health check reports again, so SERVING may repeat until the signal.)
    wait_not_serving(&mut health, Duration::from_secs(5)).await;
    // Ten target health checks later, never SERVING again.
    let serving_again = async {
        while let Some(m) = health.message().await.unwrap() {
            assert_eq!(
                m.status,
                ServingStatus::NotServing as i32,
                "SERVING while draining"
            );
        }
    };
    let _ = tokio::time::timeout(Duration::from_millis(500), serving_again).await;
    drop(stream);
}

/// grpcurl 1.8 speaks reflection v1alpha only, newer tools v1: both list what is served.
#[tokio::test]
async fn reflection_v1_and_v1alpha_list_the_services() {
    use tonic_reflection::pb::{v1, v1alpha};
    let (_m, stack) = tiny_stack().await;
    for (url, service) in [
        (stack.coordinator.url(), "duet.v1.Generation"),
        (stack.draft.url(), "duet.v1.DraftWorker"),
        (stack.target.url(), "duet.v1.TargetWorker"),
    ] {
        let channel = tonic::transport::Channel::from_shared(url.clone())
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut c = v1::server_reflection_client::ServerReflectionClient::new(channel.clone());
        let request = v1::ServerReflectionRequest {
            host: String::new(),
            message_request: Some(v1::server_reflection_request::MessageRequest::ListServices(
                String::new(),
            )),
        };
        let mut answers = c
            .server_reflection_info(tokio_stream::once(request))
            .await
            .unwrap()
            .into_inner();
        let Some(v1::server_reflection_response::MessageResponse::ListServicesResponse(list)) =
            answers.message().await.unwrap().unwrap().message_response
        else {
            panic!("no service list from {url}");
        };
        let names: Vec<_> = list.service.into_iter().map(|s| s.name).collect();
        assert!(names.contains(&service.to_string()), "{names:?}");
        assert!(
            names.contains(&"grpc.health.v1.Health".to_string()),
            "{names:?}"
        );

        let mut c = v1alpha::server_reflection_client::ServerReflectionClient::new(channel);
        let request = v1alpha::ServerReflectionRequest {
            host: String::new(),
            message_request: Some(
                v1alpha::server_reflection_request::MessageRequest::FileContainingSymbol(
                    service.to_string(),
                ),
            ),
        };
        let mut answers = c
            .server_reflection_info(tokio_stream::once(request))
            .await
            .unwrap()
            .into_inner();
        let answer = answers.message().await.unwrap().unwrap().message_response;
        assert!(
            matches!(
                answer,
                Some(
                    v1alpha::server_reflection_response::MessageResponse::FileDescriptorResponse(_)
                )
            ),
            "{url}: {answer:?}"
        );
    }
}

/// A coordinator that vanishes leaves sessions behind; the worker's idle TTL closes them.
#[tokio::test]
async fn idle_sessions_expire_on_the_worker() {
    use duet_proto::v1::target_worker_client::TargetWorkerClient;
    use duet_proto::v1::worker_client::WorkerClient;
    let m = tiny_models();
    let mut config = worker_config(&m.target);
    config.session_ttl_ms = 100;
    let target = start_target(config);
    wait_serving(&target.url(), "").await;
    let mut c = WorkerClient::connect(target.url()).await.unwrap();
    let opened = open_session(&target.url(), 16).await;
    assert_eq!(opened.cache_len, 2);
    let stats = c.stats(pb::StatsRequest {}).await.unwrap().into_inner();
    assert_eq!((stats.active_sessions, stats.kv_tokens_reserved), (1, 16));
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let stats = c.stats(pb::StatsRequest {}).await.unwrap().into_inner();
        if stats.active_sessions == 0 {
            assert_eq!(stats.sessions_expired, 1);
            assert_eq!(stats.kv_tokens_reserved, 0);
            break;
        }
        assert!(Instant::now() < deadline, "session not expired: {stats:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut verify = TargetWorkerClient::connect(target.url()).await.unwrap();
    let err = verify
        .verify(pb::VerifyRequest {
            session_id: opened.session_id,
            instance_id: opened.instance_id,
            keep: 2,
            append: vec![3],
            draft: vec![],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
}

/// A session that takes over another's sequence (a failover's reopen: `generated_after`, the
/// first session's prompt length) answers as that session does, bit for bit: its prompt
/// prefilled as the first one's was, the generated tokens fed as its calls fed them. On a GPU,
/// where a prefill computes a row otherwise than a call does, this keeps a failover's text
/// the target's. A `generated_after` past the prompt is refused, naming the field, and so
/// are more than 20 most likely tokens' log-probabilities.
#[tokio::test]
async fn a_session_taking_over_a_sequence_answers_as_the_one_that_generated_it() {
    use duet_proto::v1::target_worker_client::TargetWorkerClient;
    use duet_proto::v1::worker_client::WorkerClient;
    let (_m, target) = serving_target().await;
    let mut w = WorkerClient::connect(target.url()).await.unwrap();
    let mut v = TargetWorkerClient::connect(target.url()).await.unwrap();
    let open = |prompt: Vec<u32>, generated_after: u32| pb::OpenSessionRequest {
        prompt,
        capacity: 64,
        sampling: Some(pb::SamplingParams {
            temperature: 1.0,
            top_p: 1.0,
            ..Default::default()
        }),
        generated_after,
        ..Default::default()
    };
    let call = |s: &pb::OpenSessionResponse, keep: usize, append: &[u32]| pb::VerifyRequest {
        session_id: s.session_id.clone(),
        instance_id: s.instance_id,
        keep: keep as u32,
        append: append.to_vec(),
        ..Default::default()
    };
    let prompt: Vec<u32> = (1..=24).collect();
    let seq: Vec<u32> = prompt.iter().copied().chain(40..52).collect();
    // The first session: its prompt, then calls appending three tokens each, up to all but
    // the last generated token.
    let first = w.open_session(open(prompt.clone(), 0)).await.unwrap();
    let first = first.into_inner();
    for keep in (prompt.len() - 1..seq.len() - 1).step_by(3) {
        v.verify(call(&first, keep, &seq[keep..keep + 3]))
            .await
            .unwrap();
    }
    let taken = w.open_session(open(seq.clone(), 24)).await.unwrap();
    let taken = taken.into_inner();
    assert_eq!(taken.cache_len as usize, seq.len() - 1);
    let keep = seq.len() - 1;
    let want = v.verify(call(&first, keep, &seq[keep..])).await.unwrap();
    let got = v.verify(call(&taken, keep, &seq[keep..])).await.unwrap();
    assert_eq!(got.into_inner().p, want.into_inner().p);

    let err = w.open_session(open(seq.clone(), 37)).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(
        err.message().starts_with("generated_after: 37 is past"),
        "{err:?}"
    );
    let too_many = pb::OpenSessionRequest {
        top_logprobs: Some(21),
        ..open(prompt, 0)
    };
    let err = w.open_session(too_many).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert_eq!(err.message(), "top_logprobs: 21 is over 20");
}

/// A Verify may append only what a round commits (at most 64 tokens): a longer one would be
/// a prefill inside a batched verification pass.
#[tokio::test]
async fn verify_appends_are_bounded() {
    use duet_proto::v1::target_worker_client::TargetWorkerClient;
    let (_m, target) = serving_target().await;
    let s = open_session(&target.url(), 200).await;
    let mut verify = TargetWorkerClient::connect(target.url()).await.unwrap();
    let call = |append: usize| pb::VerifyRequest {
        session_id: s.session_id.clone(),
        instance_id: s.instance_id,
        keep: 2,
        append: vec![3; append],
        draft: vec![],
        ..Default::default()
    };
    let err = verify.verify(call(65)).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(
        err.message().starts_with("append: 65 tokens; at most 64"),
        "{err:?}"
    );
    let ok = verify.verify(call(64)).await.unwrap().into_inner();
    assert_eq!(ok.argmax.len(), 1);
}

/// A Decode stream answers what Verify calls without drafts answer, one token per step
/// (each fed before the next is answered); it ends after `max_tokens` or a stop token. A
/// caller that stops reading goes on with a Verify whose `keep` drops what the stream fed
/// beyond what it took. `max_tokens` 0 is refused, naming the field. A sampling session's
/// tokens are drawn ([`decode_draws_as_the_caller_would`]).
#[tokio::test]
async fn a_decode_stream_answers_as_verify_steps_do() {
    use duet_proto::v1::target_worker_client::TargetWorkerClient;
    let (_m, target) = serving_target().await;
    let mut c = TargetWorkerClient::connect(target.url()).await.unwrap();
    // The reference: eight Verify steps without drafts from the prompt [1, 2, 3].
    let s = open_session(&target.url(), 64).await;
    let verify = |keep: usize, append: Vec<u32>| pb::VerifyRequest {
        session_id: s.session_id.clone(),
        instance_id: s.instance_id,
        keep: keep as u32,
        append,
        ..Default::default()
    };
    let mut seq = vec![1u32, 2, 3];
    for _ in 0..8 {
        let keep = seq.len() - 1;
        let answer = c.verify(verify(keep, vec![seq[keep]])).await.unwrap();
        seq.push(answer.into_inner().argmax[0]);
    }
    let want = seq[3..].to_vec();

    let d = open_session(&target.url(), 64).await;
    let decode = |max_tokens: u32, stop_tokens: Vec<u32>| pb::DecodeRequest {
        session_id: d.session_id.clone(),
        instance_id: d.instance_id,
        keep: 2,
        append: vec![3],
        max_tokens,
        stop_tokens,
        rng_position: 0,
    };
    let read = async |stream: &mut tonic::Streaming<pb::DecodeResponse>| {
        let mut tokens = Vec::new();
        while let Some(m) = stream.message().await.unwrap() {
            assert!(m.timing.unwrap().forward_us > 0);
            assert_eq!(m.rng_position, None, "a greedy session draws nothing");
            tokens.push(m.token);
        }
        tokens
    };
    let mut all = c.decode(decode(8, vec![])).await.unwrap().into_inner();
    assert_eq!(read(&mut all).await, want);
    let mut stopped = c
        .decode(decode(8, vec![want[4]]))
        .await
        .unwrap()
        .into_inner();
    let upto = want.iter().position(|&t| t == want[4]).unwrap();
    assert_eq!(read(&mut stopped).await, want[..=upto]);

    // Three tokens read, the stream dropped: a Verify from the three goes on as the
    // reference did, whatever the steps queued meanwhile fed.
    let mut cut = c.decode(decode(8, vec![])).await.unwrap().into_inner();
    for want in &want[..3] {
        assert_eq!(cut.message().await.unwrap().unwrap().token, *want);
    }
    drop(cut);
    let keep = 3 + 2;
    let on = pb::VerifyRequest {
        session_id: d.session_id.clone(),
        instance_id: d.instance_id,
        keep: keep as u32,
        append: vec![want[2]],
        draft: want[3..6].to_vec(),
        ..Default::default()
    };
    let argmax = c.verify(on).await.unwrap().into_inner().argmax;
    assert_eq!(argmax, want[3..7]);

    let err = c.decode(decode(0, vec![])).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().starts_with("max_tokens:"), "{err:?}");
    decode_draws_as_the_caller_would(&mut c, &target.url()).await;
}

/// A sampling session's Decode tokens are drawn where a caller of Verify would draw them
/// from each step's p (rejection sampling without drafts, the seed's random stream), and
/// each answer says where the stream then stands: two words on a token. A stream dropped
/// after three tokens and started again from there (with the position the third answer
/// gave) goes on with the same tokens.
async fn decode_draws_as_the_caller_would(
    c: &mut duet_proto::v1::target_worker_client::TargetWorkerClient<tonic::transport::Channel>,
    url: &str,
) {
    use duet_engine::sampling::rng_for;
    use duet_engine::verify::verify_sampling_tree;
    let s = open_sampling_session(url, 64).await;
    let mut rng = rng_for(0);
    let mut seq = vec![1u32, 2, 3];
    for _ in 0..8 {
        let keep = seq.len() - 1;
        let step = pb::VerifyRequest {
            session_id: s.session_id.clone(),
            instance_id: s.instance_id,
            keep: keep as u32,
            append: vec![seq[keep]],
            ..Default::default()
        };
        let p = c.verify(step).await.unwrap().into_inner().p;
        let p = [duet_serving::wire::decode_distribution(&p[0]).unwrap()];
        seq.push(verify_sampling_tree(&[], &[], &[], &p, &mut rng).unwrap().1);
    }
    let want = seq[3..].to_vec();
    let d = open_sampling_session(url, 64).await;
    let decode = |keep: usize, rng_position: u64| pb::DecodeRequest {
        session_id: d.session_id.clone(),
        instance_id: d.instance_id,
        keep: keep as u32,
        append: vec![seq[keep]],
        max_tokens: (seq.len() - 1 - keep) as u32,
        rng_position,
        ..Default::default()
    };
    let mut all = c.decode(decode(2, 0)).await.unwrap().into_inner();
    let mut got = Vec::new();
    while let Some(m) = all.message().await.unwrap() {
        got.push((m.token, m.rng_position));
    }
    let drawn: Vec<_> = (1..=8).map(|i| Some(2 * i)).collect();
    assert_eq!(got, want.iter().copied().zip(drawn).collect::<Vec<_>>());
    let mut cut = c.decode(decode(2, 0)).await.unwrap().into_inner();
    for _ in 0..3 {
        cut.message().await.unwrap().unwrap();
    }
    drop(cut);
    let mut on = c.decode(decode(5, 6)).await.unwrap().into_inner();
    let mut rest = Vec::new();
    while let Some(m) = on.message().await.unwrap() {
        rest.push(m.token);
    }
    assert_eq!(rest, want[3..]);
}

/// A Verify with a `SamplingTest` answers what the caller would decide from the whole
/// answer (every p): the engine's `test_sampled` on the p a Verify without the test gives
/// for the same call, at the stream position given, and p at the rejected draft where the
/// correction is the caller's (not for point masses or q's sent whole, whose correction is
/// drawn there). Over the cases: drafts all accepted (q half of p), one rejected (q 1,
/// alone, as point masses, or whole). A test that does not fit its chain is refused,
/// naming the field; a greedy session ignores it.
#[tokio::test]
async fn a_verify_tests_a_sampling_chain_as_the_caller_would() {
    use duet_engine::sampling::{Distribution, rng_at};
    use duet_engine::verify::{Drafted, rows, test_sampled};
    use duet_proto::v1::target_worker_client::TargetWorkerClient;
    use duet_serving::wire::{decode_distribution, encode_sparse};
    let (_m, target) = serving_target().await;
    let mut c = TargetWorkerClient::connect(target.url()).await.unwrap();
    let s = open_sampling_session(&target.url(), 64).await;
    let draft = vec![7u32, 9, 11];
    let verify = |sampling_test| pb::VerifyRequest {
        session_id: s.session_id.clone(),
        instance_id: s.instance_id,
        keep: 2,
        append: vec![3],
        draft: draft.clone(),
        sampling_test,
        ..Default::default()
    };
    let p = c.verify(verify(None)).await.unwrap().into_inner().p;
    let p: Vec<_> = p.iter().map(|d| decode_distribution(d).unwrap()).collect();
    let half: Vec<f32> = draft
        .iter()
        .zip(&p)
        .map(|(&x, p)| p.prob(x) / 2.0)
        .collect();
    let points: Vec<_> = draft.iter().map(|&x| Distribution::point(x)).collect();
    let whole: Vec<_> = (draft.iter())
        .map(|&x| Distribution::from_pairs([(x, 0.75), (x + 1, 0.25)]).unwrap())
        .collect();
    let (mut all_accepted, mut left_to_us, mut drawn_there) = (0, 0, 0);
    let cases = [
        (Drafted::Probabilities(&half), false),
        (Drafted::Probabilities(&[1.0; 3]), false),
        (Drafted::Whole(&points), true),
        (Drafted::Whole(&whole), false),
    ];
    for (drafted, point_masses) in cases {
        let (q, whole_q): (Vec<f32>, _) = match drafted {
            Drafted::Probabilities(q) => (q.to_vec(), Vec::new()),
            Drafted::Whole(_) if point_masses => (vec![1.0; 3], Vec::new()),
            Drafted::Whole(qs) => {
                let q = draft.iter().zip(qs).map(|(&x, q)| q.prob(x)).collect();
                (q, qs.iter().map(encode_sparse).collect())
            }
        };
        for rng_position in [0, 2, 10] {
            let test = pb::SamplingTest {
                q: q.clone(),
                point_masses,
                rng_position,
                whole_q: whole_q.clone(),
            };
            let answer = c.verify(verify(Some(test))).await.unwrap().into_inner();
            let mut rng = rng_at(0, rng_position);
            let (want, _) = test_sampled(&draft, drafted, rows(&p), &mut rng).unwrap();
            let verdict = pb::SamplingVerdict {
                accepted: want.accepted as u32,
                token: want.token,
                rng_position: duet_engine::sampling::rng_position(&rng),
            };
            assert_eq!(answer.verdict, Some(verdict), "{q:?} at {rng_position}");
            let rejected_p: Vec<_> = answer
                .p
                .iter()
                .map(|d| decode_distribution(d).unwrap())
                .collect();
            match want.token {
                Some(_) => assert!(rejected_p.is_empty()),
                None => assert_eq!(rejected_p, [p[want.accepted].clone()]),
            }
            assert!(answer.argmax.is_empty());
            all_accepted += usize::from(want.accepted == 3);
            left_to_us += usize::from(want.token.is_none());
            drawn_there += usize::from(!whole_q.is_empty() && want.accepted < 3);
        }
    }
    assert_eq!((all_accepted, left_to_us, drawn_there), (3, 3, 3));

    let refused = |q: Vec<f32>| pb::SamplingTest {
        q,
        ..Default::default()
    };
    let with_whole = |q: Vec<f32>, whole_q: Vec<pb::Distribution>| pb::SamplingTest {
        q,
        whole_q,
        ..Default::default()
    };
    let wire: Vec<_> = whole.iter().map(encode_sparse).collect();
    let beyond = pb::Distribution {
        ids: vec![7, 1 << 30],
        probs: vec![0.75, 0.25],
    };
    for (test, why) in [
        (refused(vec![0.5; 2]), "2 probabilities for 3 drafts"),
        (refused(vec![0.5, 1.5, 0.5]), "1.5, not in [0, 1]"),
        (
            with_whole(vec![0.75; 3], wire[..2].to_vec()),
            "2 distributions for 3 drafts",
        ),
        (
            with_whole(vec![0.5; 3], wire.clone()),
            "draft 0: gives token 7 0.75, not q's 0.5",
        ),
        (
            with_whole(
                vec![0.75; 3],
                vec![beyond, wire[1].clone(), wire[2].clone()],
            ),
            "draft 0: beyond the vocabulary",
        ),
        (
            pb::SamplingTest {
                point_masses: true,
                ..with_whole(vec![0.75; 3], wire.clone())
            },
            "whole_q and point_masses both given",
        ),
    ] {
        let err = c.verify(verify(Some(test))).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument);
        assert!(err.message().starts_with("sampling_test"), "{err:?}");
        assert!(err.message().contains(why), "{err:?}");
    }
    let greedy = open_session(&target.url(), 64).await;
    let call = pb::VerifyRequest {
        session_id: greedy.session_id.clone(),
        instance_id: greedy.instance_id,
        sampling_test: Some(refused(vec![1.0; 3])),
        ..verify(None)
    };
    let answer = c.verify(call).await.unwrap().into_inner();
    assert_eq!((answer.argmax.len(), answer.verdict), (4, None));
}

/// A sampling NONE request streams its tokens from the target (drawn there where the
/// coordinator would draw them): each seed gives the text it gives a coordinator that
/// verifies a token a call (`target_streams = false`), on the same workers.
#[tokio::test]
async fn a_sampling_request_streamed_gives_its_seeds_text() {
    let (_m, stack) = tiny_stack().await;
    let mut config = coordinator_config(&stack.target.url(), Some(&stack.draft.url()));
    config.speculation.target_streams = false;
    let stepped = start_coordinator(config);
    wait_serving(&stepped.url(), "duet.v1.DraftWorker").await;
    let mut texts = std::collections::BTreeSet::new();
    for seed in 0..4 {
        let req = pb::GenerateRequest {
            temperature: 1.0,
            seed,
            ..request("the cat", 24, TargetOnly)
        };
        let streamed = generate(&stack.coordinator.url(), req.clone()).await;
        let verified = generate(&stepped.url(), req).await.unwrap();
        assert_eq!(
            streamed.unwrap().token_ids,
            verified.token_ids,
            "seed {seed}"
        );
        texts.insert(verified.token_ids);
    }
    assert_eq!(texts.len(), 4, "each seed its own text");
    let streamed = "duet_target_streamed_tokens_total";
    assert_eq!(sample(&scrape(&stack.coordinator).await, streamed), 96.0);
    assert_eq!(sample(&scrape(&stepped).await, streamed), 0.0);
}

/// A Propose may append at most 64 tokens (the coordinator feeds a draft that fell further
/// behind in pieces): a longer one would be a prefill inside a batched drafting pass.
#[tokio::test]
async fn propose_appends_are_bounded() {
    use duet_proto::v1::draft_worker_client::DraftWorkerClient;
    let m = tiny_models();
    let draft = start_draft(worker_config(&m.draft));
    wait_serving(&draft.url(), "").await;
    let s = open_session(&draft.url(), 200).await;
    let mut c = DraftWorkerClient::connect(draft.url()).await.unwrap();
    let call = |append: usize| pb::ProposeRequest {
        session_id: s.session_id.clone(),
        instance_id: s.instance_id,
        keep: 2,
        append: vec![3; append],
        k: 1,
        stop_below: 0.0,
        ..Default::default()
    };
    let err = c.propose(call(65)).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(
        err.message().starts_with("append: 65 tokens; at most 64"),
        "{err:?}"
    );
    let mut ok = c.propose(call(64)).await.unwrap().into_inner();
    assert!(ok.message().await.unwrap().is_some());
}

/// A Propose with `stop_below` may answer fewer tokens than asked: at 1.0 one token (no
/// draft of the tiny model is that sure), at 0 all of them; a value outside 0..=1 is
/// refused, naming the field.
#[tokio::test]
async fn a_propose_may_stop_early_below_a_joint_probability() {
    use duet_proto::v1::draft_worker_client::DraftWorkerClient;
    let m = tiny_models();
    let draft = start_draft(worker_config(&m.draft));
    wait_serving(&draft.url(), "").await;
    let mut c = DraftWorkerClient::connect(draft.url()).await.unwrap();
    // Five tokens after a fresh session's prompt.
    let call = |s: pb::OpenSessionResponse, stop_below| pb::ProposeRequest {
        session_id: s.session_id,
        instance_id: s.instance_id,
        keep: 2,
        append: vec![3],
        k: 5,
        stop_below,
        ..Default::default()
    };
    for (stop_below, want) in [(0.0, 5), (1.0, 1)] {
        let s = open_session(&draft.url(), 64).await;
        let mut stream = c.propose(call(s, stop_below)).await.unwrap().into_inner();
        let mut got = Vec::new();
        while let Some(m) = stream.message().await.unwrap() {
            got.push(m);
        }
        assert_eq!(got.len(), want, "stop_below {stop_below}");
        assert!(
            got[want - 1].timing.is_some(),
            "the last one carries the timing"
        );
    }
    for bad in [1.5, -0.1, f32::NAN] {
        let s = open_session(&draft.url(), 64).await;
        let err = c.propose(call(s, bad)).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{bad}");
        assert!(err.message().starts_with("stop_below: "), "{err:?}");
    }
}

/// A draft-worker with `vocab_shortlist` drafts only the first ids, the special tokens (the
/// tiny vocabulary's last three) and its session's own tokens, and greedy speculation with
/// it still gives the target's own tokens. A target-worker refuses a shortlist: its tokens
/// are the output.
#[tokio::test]
async fn a_shortlisted_draft_drafts_its_ids_and_output_stays_exact() {
    use duet_proto::v1::draft_worker_client::DraftWorkerClient;
    let (m, stack) = tiny_stack_with(64).await;
    let vocab = duet_engine::testing::tiny_vocab_size() as u32;
    let kept = |t: u32| t < 64 || t >= vocab - 3;
    let mut c = DraftWorkerClient::connect(stack.draft.url()).await.unwrap();
    let mut drafted = 0;
    for start in [3, 100, 200, 265] {
        // The session's own tokens (its prompt, [1, 2, 3], and `append`) are its extra ids.
        let own = |t: u32| kept(t) || t == start;
        let s = open_session(&stack.draft.url(), 64).await;
        let call = pb::ProposeRequest {
            session_id: s.session_id,
            instance_id: s.instance_id,
            keep: 2,
            append: vec![start],
            k: 12,
            stop_below: 0.0,
            ..Default::default()
        };
        let mut stream = c.propose(call).await.unwrap().into_inner();
        while let Some(m) = stream.message().await.unwrap() {
            assert!(own(m.token), "after {start}: {}", m.token);
            drafted += 1;
        }
    }
    assert_eq!(drafted, 48);

    let url = stack.coordinator.url();
    for prompt in ["the cat", "def f(x):\n\treturn"] {
        let plain = generate(&url, request(prompt, 30, TargetOnly))
            .await
            .unwrap();
        // The target's own text leaves the shortlist, so some drafts must fail.
        assert!(plain.token_ids.iter().any(|&t| !kept(t)), "{prompt:?}");
        for (method, k) in [(DraftModel, 3), (Auto, 4)] {
            let mut req = request(prompt, 30, method);
            req.num_speculative_tokens = k;
            let spec = generate(&url, req).await.unwrap();
            assert_eq!(spec.token_ids, plain.token_ids, "{prompt:?} {method:?}");
            assert!(!spec.usage.fell_back_to_target_only);
        }
    }

    let mut target = worker_config(&m.target);
    target.vocab_shortlist = 64;
    assert_eq!(
        refused_start::<duet_target_worker::Verifier>(target).await,
        "configuration key `vocab_shortlist`: only a draft-worker may shortlist its \
         vocabulary: the target's tokens are the output"
    );
}

/// A caller that gives up on an OpenSession closes the session by the id it named, on any
/// instance: an open that arrives after that close fails, an id in use is refused, and a
/// close so named of an open session closes it.
#[tokio::test]
async fn an_open_named_by_its_caller_can_be_closed_before_it_answers() {
    use duet_proto::v1::worker_client::WorkerClient;
    let (_m, target) = serving_target().await;
    let mut c = WorkerClient::connect(target.url()).await.unwrap();
    let open = |session_id: Vec<u8>| pb::OpenSessionRequest {
        session_id,
        prompt: vec![1, 2, 3],
        capacity: 16,
        sampling: None,
        generated_after: 0,
        ..Default::default()
    };
    let close = |session_id: Vec<u8>| pb::CloseSessionRequest {
        session_id,
        instance_id: 0,
    };
    let early = vec![7; 16];
    let closed = c.close_session(close(early.clone())).await.unwrap();
    assert!(!closed.into_inner().closed);
    let err = c.open_session(open(early.clone())).await.unwrap_err();
    assert_eq!(err.code(), Code::Aborted, "{err:?}");
    assert_eq!(worker_sessions(&target.url()).await, 0);
    // The close is spent on the open it stopped.
    let opened = c.open_session(open(early.clone())).await.unwrap();
    assert_eq!(opened.into_inner().session_id, early);
    let err = c.open_session(open(early.clone())).await.unwrap_err();
    assert_eq!(err.code(), Code::AlreadyExists, "{err:?}");
    assert_eq!(worker_sessions(&target.url()).await, 1);
    let closed = c.close_session(close(early)).await.unwrap();
    assert!(closed.into_inner().closed);
    assert_eq!(worker_sessions(&target.url()).await, 0);
    // Both closes by name count as opens given up on.
    let scraped = scrape(&target).await;
    assert_eq!(sample(&scraped, "duet_worker_opens_abandoned_total"), 2.0);
    let err = c.open_session(open(vec![1; 8])).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
}

/// An open's deadline grows with the prompt it prefills: a prompt that takes a wide target
/// longer than the base deadline to prefill opens when the prefill is allowed its time per
/// token, and times out, naming the deadline and the tokens, when it is not.
#[tokio::test]
async fn an_open_is_allowed_time_for_its_prompt() {
    use duet_coordinator::workers::{CallError, Deadlines, Failure, Open, Party, WorkerClient};
    let m = tiny_models();
    // Wide and deep enough that 200 prompt tokens take well over 1 ms to prefill.
    duet_engine::testing::TinyModel {
        layers: 8,
        hidden: 512,
        heads: 8,
        kv_heads: 4,
        ffn_hidden: 2048,
        ..Default::default()
    }
    .write(&m.target)
    .unwrap();
    let target = start_target(worker_config(&m.target));
    wait_serving(&target.url(), "").await;
    let prompt: Vec<u32> = (1..=200).collect();
    let sampling = duet_engine::sampling::SamplingParams::greedy();
    let open = |prefill_per_token| {
        let client = WorkerClient::new(
            Party::Target,
            &target.url(),
            None,
            Duration::from_secs(5),
            Duration::from_secs(60),
            Deadlines {
                call: Duration::from_secs(5),
                call_floor: Duration::from_secs(5),
                open: Duration::from_millis(1),
                prefill_per_token,
                control: Duration::from_secs(5),
            },
            None,
        );
        let prompt = &prompt;
        let sampling = &sampling;
        async move {
            // Resolves the replica.
            client.describe(false).await.unwrap();
            let lease = duet_coordinator::workers::Lease::default();
            let open = Open::plain(prompt, 256, sampling, &lease);
            client.open(open, None).await.map(|(session, ..)| session)
        }
    };
    let err = open(Duration::ZERO).await.unwrap_err();
    let CallError {
        party: Party::Target,
        failure: Failure::TimedOut(why),
        ..
    } = err
    else {
        panic!("{err:?}");
    };
    assert_eq!(
        why,
        "OpenSession (200 prompt tokens, 0 more prefilling before it on the replica for this \
         coordinator) took longer than 1 ms"
    );
    // 1 ms, and 100 ms for each of the 200 tokens.
    let session = open(Duration::from_millis(100)).await.unwrap();
    drop(session);
    wait_sessions_closed(&target.url(), Duration::from_secs(5)).await;
}

/// The coordinator's OpenSession call dropped at any moment (before it is sent, while the
/// worker prefills, as its answer comes back) leaves no session open on the worker: the
/// call names the session, and dropping it closes that name.
#[tokio::test]
async fn an_open_dropped_at_any_moment_leaves_nothing_open() {
    use duet_coordinator::workers::{Open, WorkerClient};
    let (_m, target) = serving_target().await;
    let deadlines = duet_coordinator::workers::Deadlines {
        call: Duration::from_secs(5),
        call_floor: Duration::from_secs(5),
        open: Duration::from_secs(5),
        prefill_per_token: Duration::ZERO,
        control: Duration::from_secs(5),
    };
    let client = WorkerClient::new(
        duet_coordinator::workers::Party::Target,
        &target.url(),
        None,
        Duration::from_secs(5),
        Duration::from_secs(60),
        deadlines,
        None,
    );
    let prompt: Vec<u32> = (1..40).collect();
    let sampling = duet_engine::sampling::SamplingParams::greedy();
    let lease = duet_coordinator::workers::Lease::default();
    let open = || client.open(Open::plain(&prompt, 64, &sampling, &lease), None);
    // Resolve the replica and warm the connection.
    client.describe(false).await.unwrap();
    drop(open().await.unwrap());
    wait_sessions_closed(&target.url(), Duration::from_secs(5)).await;
    // From no poll at all up to as many as an open takes on this machine, whatever its
    // speed: one more poll each time, 5% more from 400 on, until twenty opens finished.
    let (mut finished, mut dropped, mut polls) = (0, 0, 0usize);
    while finished < 20 {
        assert!(polls < 1_000_000, "no open finished; {dropped} dropped");
        // The open runs beside `polls` yields of this task, then goes away if not done.
        let give_up = async {
            for _ in 0..polls {
                tokio::task::yield_now().await;
            }
        };
        tokio::select! {
            biased;
            opened = open() => {
                drop(opened.unwrap());
                finished += 1;
            }
            () = give_up => dropped += 1,
        }
        // Paced like a coordinator's calls: the worker's HTTP/2 server takes a burst of
        // streams reset before it accepted them for an attack (rapid reset) and refuses more.
        tokio::time::sleep(Duration::from_millis(1)).await;
        polls = if polls < 400 {
            polls + 1
        } else {
            polls * 21 / 20
        };
    }
    // Far below the worker's 60 s TTL.
    wait_sessions_closed(&target.url(), Duration::from_secs(5)).await;
}

/// Reaching a worker is not enough to drive or close someone else's session: ids are 16
/// random bytes, and a call must name the worker instance that opened the session.
#[tokio::test]
async fn sessions_cannot_be_guessed_or_reached_across_instances() {
    use duet_proto::v1::target_worker_client::TargetWorkerClient;
    use duet_proto::v1::worker_client::WorkerClient;
    let (_m, target) = serving_target().await;
    let mut c = WorkerClient::connect(target.url()).await.unwrap();
    let a = open_session(&target.url(), 16).await;
    let b = open_session(&target.url(), 16).await;
    assert_eq!((a.session_id.len(), b.session_id.len()), (16, 16));
    assert_ne!(a.session_id, b.session_id);
    assert_eq!(a.instance_id, b.instance_id);
    let mut verify = TargetWorkerClient::connect(target.url()).await.unwrap();
    let call = |session_id: Vec<u8>, instance_id: u64| pb::VerifyRequest {
        session_id,
        instance_id,
        keep: 2,
        append: vec![3],
        draft: vec![],
        ..Default::default()
    };
    // Its neighbour's id plus one, as sequential ids would have been.
    let mut guessed = a.session_id.clone();
    guessed[15] = guessed[15].wrapping_add(1);
    let err = verify
        .verify(call(guessed, a.instance_id))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound, "{err:?}");
    let err = verify
        .verify(call(a.session_id.clone(), a.instance_id ^ 1))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
    assert!(err.message().contains("the worker restarted"), "{err:?}");
    let closed = c
        .close_session(pb::CloseSessionRequest {
            session_id: a.session_id.clone(),
            instance_id: a.instance_id ^ 1,
        })
        .await
        .unwrap()
        .into_inner();
    assert!(!closed.closed);
    verify
        .verify(call(a.session_id, a.instance_id))
        .await
        .expect("the right id and instance reach the session");
}

/// A draft-worker slower than `draft.timeout_ms` is treated as failed: the request goes on
/// target-only with the same tokens and says why.
#[tokio::test]
async fn slow_draft_worker_falls_back() {
    let m = tiny_models();
    // A draft of the same vocabulary but wide and deep enough that drafting 8 tokens takes
    // well over the 1 ms the coordinator allows.
    duet_engine::testing::TinyModel {
        layers: 8,
        hidden: 512,
        heads: 8,
        kv_heads: 4,
        ffn_hidden: 2048,
        ..Default::default()
    }
    .write(&m.draft)
    .unwrap();
    let draft = start_draft(worker_config(&m.draft));
    let target = start_target(worker_config(&m.target));
    let mut config = coordinator_config(&target.url(), Some(&draft.url()));
    config.draft.timeout_ms = 1;
    config.speculation.num_speculative_tokens = 8;
    let coordinator = start_coordinator(config);
    wait_serving(&coordinator.url(), "duet.v1.DraftWorker").await;
    let url = coordinator.url();
    let plain = generate(&url, request("the cat", 30, TargetOnly))
        .await
        .unwrap();
    let g = generate(&url, request("the cat", 30, DraftModel))
        .await
        .unwrap();
    assert_eq!(g.token_ids, plain.token_ids);
    assert!(g.usage.fell_back_to_target_only);
    assert!(
        g.usage.fallback_reason.contains("longer than 1 ms"),
        "{}",
        g.usage.fallback_reason
    );
}

/// Each service's `/metrics`, scraped over HTTP after a request, agrees with its usage; the
/// workers' warm-up at start shows apart from it.
#[tokio::test]
async fn metrics_agree_with_the_usage() {
    let (_m, stack) = tiny_stack().await;
    let url = stack.coordinator.url();
    let mut req = request("the cat", 40, DraftModel);
    req.num_speculative_tokens = 3;
    let g = generate(&url, req).await.unwrap();
    let u = &g.usage;
    let bad = generate(&url, request("", 4, DraftModel))
        .await
        .unwrap_err();
    assert_eq!(bad.code(), Code::InvalidArgument);

    let c = scrape(&stack.coordinator).await;
    let n = |name: &str| sample(&c, name);
    assert_eq!(
        n("duet_spec_decode_num_draft_tokens_total"),
        f64::from(u.draft_tokens_proposed)
    );
    assert_eq!(
        n("duet_spec_decode_num_accepted_tokens_total"),
        f64::from(u.draft_tokens_accepted)
    );
    let per_position: f64 = (0..3)
        .map(|p| {
            n(&format!(
                "duet_spec_decode_num_accepted_tokens_per_pos_total{{position=\"{p}\"}}"
            ))
        })
        .sum();
    assert_eq!(per_position, f64::from(u.draft_tokens_accepted));
    let drafts = n("duet_spec_decode_num_drafts_total");
    assert!(
        drafts > 0.0 && drafts <= f64::from(u.rounds),
        "{drafts} vs {}",
        u.rounds
    );
    assert_eq!(
        n("duet_generation_tokens_total"),
        f64::from(u.completion_tokens)
    );
    assert_eq!(n("duet_prompt_tokens_total"), f64::from(u.prompt_tokens));
    let finish = duet_proto::finish_reason_name(g.finish_reason.unwrap());
    assert_eq!(
        n(&format!(
            "duet_requests_total{{finish_reason=\"{finish}\",code=\"OK\"}}"
        )),
        1.0,
        "{c}"
    );
    assert_eq!(
        n("duet_requests_total{finish_reason=\"\",code=\"INVALID_ARGUMENT\"}"),
        1.0,
        "{c}"
    );
    assert_eq!(n("duet_time_to_first_token_seconds_count"), 1.0);
    assert_eq!(n("duet_e2e_request_latency_seconds_count"), 1.0);
    assert_eq!(
        n("duet_inter_token_latency_seconds_count"),
        f64::from(u.completion_tokens) - 1.0
    );
    assert_eq!(n("duet_spec_decode_fallbacks_total"), 0.0);
    // The limits and states beside them: the defaults, a serving target, a closed breaker.
    assert_eq!(n("duet_max_concurrent_requests"), 64.0);
    assert_eq!(n("duet_target_serving"), 1.0);
    assert_eq!(n("duet_draft_breaker_open"), 0.0);
    assert_eq!(n("duet_draft_breaker_trips_total"), 0.0);

    wait_no_sessions(&stack, Duration::from_secs(5)).await;
    let t = scrape_until(
        &stack.target,
        "duet_worker_forward_seconds_count{kind=\"call\"}",
        f64::from(u.rounds),
    )
    .await;
    // One model call per round (no other session to batch with), plus the prompt prefill.
    assert_eq!(
        sample(&t, "duet_worker_forward_seconds_count{kind=\"call\"}"),
        f64::from(u.rounds)
    );
    assert_eq!(
        sample(&t, "duet_worker_forward_seconds_count{kind=\"prefill\"}"),
        1.0
    );
    assert_eq!(sample(&t, "duet_worker_active_sessions"), 0.0);
    assert_eq!(sample(&t, "duet_worker_kv_tokens_reserved"), 0.0);
    assert_eq!(sample(&t, "duet_worker_max_sessions"), 64.0);
    assert_eq!(sample(&t, "duet_worker_kv_token_budget"), 65_536.0);
    // The draft-worker served each Propose call once; calls that arrive while others
    // draft join their passes, so a model run may serve several.
    let d = scrape(&stack.draft).await;
    assert_eq!(sample(&d, "duet_worker_batch_size_sum"), drafts);
    let runs = sample(&d, "duet_worker_forward_seconds_count{kind=\"call\"}");
    assert!(
        runs > 0.0 && runs <= drafts,
        "{runs} runs for {drafts} calls"
    );
    // Both workers ran their warm-up passes before they were ready, none of it counted
    // above; on a GPU those captured the graphs of 1, 2, 4 and 8 rows.
    let gpu = duet_engine::testing::test_device() == "cuda";
    for scraped in [&t, &d] {
        assert!(
            sample(scraped, "duet_worker_warm_up_seconds") > 0.0,
            "{scraped}"
        );
        let graphs = sample(scraped, "duet_worker_cuda_graphs");
        match gpu {
            true => assert!(graphs >= 4.0, "{graphs} graphs"),
            false => assert_eq!(graphs, 0.0),
        }
    }
}

/// Two target-worker replicas behind one address: sessions spread over both, each stays on
/// its replica (the tokens are exactly target-only's), and when one goes away new requests
/// open their sessions on the other.
#[tokio::test]
async fn sessions_spread_over_replicas_and_survive_one_leaving() {
    let m = tiny_models();
    let draft = start_draft(worker_config(&m.draft));
    let first = start_target(worker_config(&m.target));
    let mut second = start_target(worker_config(&m.target));
    let replicas = format!("{}, {}", first.url(), second.url());
    let mut config = coordinator_config(&replicas, Some(&draft.url()));
    // Each DRAFT_MODEL request opens its draft session beside the target's and waits for
    // both. On shared cores, with other streams running, a request goes on with target-only
    // steps while its draft session opens, and on a loaded machine a short request can end
    // before it is open, having drafted nothing: by design, but not what this test counts.
    config.speculation.concurrent_prefill = true;
    config.speculation.take_turns = false;
    let coordinator = start_coordinator(config);
    for url in [draft.url(), first.url(), second.url(), coordinator.url()] {
        wait_serving(&url, "").await;
    }
    wait_serving(&coordinator.url(), "duet.v1.DraftWorker").await;
    let url = coordinator.url();
    let prompts = ["the cat", "a b c d", "def f(x):", "once upon"];
    let mut expected = Vec::new();
    for p in prompts {
        let plain = generate(&url, request(p, 30, TargetOnly)).await.unwrap();
        expected.push(plain.token_ids);
    }
    let runs = prompts
        .iter()
        .map(|p| generate(&url, request(p, 30, DraftModel)));
    for (out, want) in futures::future::join_all(runs)
        .await
        .into_iter()
        .zip(&expected)
    {
        let out = out.unwrap();
        assert!(out.usage.draft_tokens_proposed > 0);
        assert_eq!(&out.token_ids, want);
    }
    let (a, b) = (prefills(&first).await, prefills(&second).await);
    assert_eq!(a + b, 8.0, "one session per request");
    assert!(a >= 2.0 && b >= 2.0, "sessions not spread: {a} and {b}");

    second.kill();
    for (p, want) in prompts.iter().zip(&expected) {
        let out = generate(&url, request(p, 30, DraftModel))
            .await
            .unwrap_or_else(|e| panic!("{p:?} after a replica left: {e:?}"));
        assert_eq!(&out.token_ids, want);
    }
}

/// A replica that accepts connections but never answers (a wedged process) delays the
/// coordinator's health checks by at most the control deadline: replicas are checked at
/// once, so the healthy one makes the coordinator ready.
#[tokio::test]
async fn a_stuck_replica_does_not_hold_up_readiness() {
    let m = tiny_models();
    // Replicas are ordered by address: the stuck one (127.0.0.1) comes first.
    let target = start_target_at(worker_config(&m.target), "127.0.0.2:0".parse().unwrap());
    wait_serving(&target.url(), "").await;
    // The kernel completes the TCP handshake; nothing ever speaks HTTP/2.
    let stuck = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let stuck_url = format!("http://{}", stuck.local_addr().unwrap());
    let mut config = coordinator_config(&format!("{stuck_url}, {}", target.url()), None);
    config.target.control_timeout_ms = 300;
    let started = Instant::now();
    let coordinator = start_coordinator(config);
    tokio::time::timeout(Duration::from_secs(5), wait_serving(&coordinator.url(), ""))
        .await
        .expect("the coordinator waited on the stuck replica");
    assert!(started.elapsed() < Duration::from_secs(5));
}

/// The target replica serving a request dies mid-stream: the coordinator reopens the
/// session on the other replica from the committed tokens, the client sees no error, the
/// tokens are exactly an undisturbed run's, and `usage` records the failover. A structured
/// output's constraint picks up where the completion stands on the new replica.
#[tokio::test]
async fn a_target_replica_dying_mid_stream_loses_nothing() {
    let m = tiny_models();
    let draft = start_draft(worker_config(&m.draft));
    let mut targets = [
        start_target(worker_config(&m.target)),
        start_target(worker_config(&m.target)),
    ];
    let replicas = format!("{}, {}", targets[0].url(), targets[1].url());
    let coordinator = start_coordinator(coordinator_config(&replicas, Some(&draft.url())));
    for url in [&draft, &targets[0], &targets[1], &coordinator].map(|s| s.url()) {
        wait_serving(&url, "").await;
    }
    wait_serving(&coordinator.url(), "duet.v1.DraftWorker").await;
    let url = coordinator.url();
    let letters = pb::StructuredOutput {
        format: Some(pb::structured_output::Format::Regex("[a-z ]{400}".into())),
    };
    for (method, k, format) in [
        (TargetOnly, 0, None),
        (DraftModel, 3, None),
        (DraftModel, 3, Some(letters)),
    ] {
        let mut req = request("the cat", 200, method);
        req.num_speculative_tokens = k;
        req.structured_output = format;
        let want = generate(&url, req.clone()).await.unwrap();
        let mut stream = open_stream(&url, req).await;
        let mut out = Completion::default();
        // Not reading holds the generation a few rounds ahead of the reader.
        out.add(stream.message().await.unwrap().unwrap());
        let mut serving = None;
        for (i, t) in targets.iter().enumerate() {
            if worker_sessions(&t.url()).await == 1 {
                serving = Some(i);
            }
        }
        let serving = serving.expect("one replica holds the session");
        targets[serving].kill();
        out.read_rest(&mut stream, |_| {})
            .await
            .unwrap_or_else(|e| panic!("{method:?}: {e:?}"));
        assert_eq!(out.token_ids, want.token_ids, "{method:?}");
        assert_eq!(out.finish_reason, want.finish_reason);
        let failovers = &out.usage.target_failovers;
        assert_eq!(failovers.len(), 1, "{method:?}: {failovers:?}");
        assert!(
            failovers[0].at_completion_tokens > 0
                && failovers[0].at_completion_tokens < out.usage.completion_tokens,
            "{failovers:?}"
        );
        assert!(
            failovers[0]
                .reason
                .starts_with(&format!("target-worker at {}: ", targets[serving].addr)),
            "{failovers:?}"
        );
        // The next request runs on the survivor; bring the dead one back for the next case.
        let survivor = &targets[1 - serving];
        wait_sessions_closed(&survivor.url(), Duration::from_secs(5)).await;
        targets[serving] = start_target_at(worker_config(&m.target), targets[serving].addr);
        wait_serving(&targets[serving].url(), "").await;
    }
    let scraped = scrape(&coordinator).await;
    assert_eq!(sample(&scraped, "duet_target_failovers_total"), 3.0);
}

/// SIGTERM on a target-worker mid-request: it stops taking new sessions but serves the open
/// one to the end (a rolling update loses no request), then stops.
#[tokio::test]
async fn a_draining_target_worker_finishes_its_running_requests() {
    let (_m, stack) = tiny_stack().await;
    let url = stack.coordinator.url();
    let want = generate(&url, request("the cat", 120, DraftModel))
        .await
        .unwrap();
    let mut stream = open_stream(&url, request("the cat", 120, DraftModel)).await;
    let mut out = Completion::default();
    // Not reading fills the stream's buffer and holds the generation mid-way.
    out.add(stream.message().await.unwrap().unwrap());
    stack.target.shutdown.trigger();
    wait_health(&stack.target.url(), "", ServingStatus::NotServing).await;
    let refused = generate(&url, request("a b", 5, TargetOnly))
        .await
        .expect_err("a draining worker took a new session");
    assert_eq!(refused.code(), Code::Unavailable, "{refused:?}");
    assert!(
        refused.message().starts_with("target-worker at ")
            && refused.message().contains("shutting down"),
        "{refused:?}"
    );
    out.read_rest(&mut stream, |_| {}).await.unwrap();
    assert_eq!(out.finish_reason, Some(pb::FinishReason::Length as i32));
    assert_eq!(out.token_ids, want.token_ids);
    // Its last session closed: the worker stops.
    let deadline = Instant::now() + Duration::from_secs(10);
    while tokio::net::TcpStream::connect(stack.target.addr)
        .await
        .is_ok()
    {
        assert!(
            Instant::now() < deadline,
            "the drained worker is still listening"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

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
    let m = tiny_models();
    let draft = start_draft(worker_config(&m.draft));
    wait_serving(&draft.url(), "").await;
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
