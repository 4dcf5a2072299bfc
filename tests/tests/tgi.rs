//! Hugging Face TGI's own API over a real socket, against the tiny stack: a prompt's
//! greedy text, tokens and figures are gRPC's for the same completion, whole (`/generate`,
//! `POST /` in a list with the prompt before) and as a token's events; a stop sequence
//! stays in the text; a seeded sample draws as gRPC's; refusals have TGI's error body.

use duet_e2e::common::*;
use duet_proto::v1 as pb;
use serde_json::{Value, json};

const PROMPT: &str = "the cat sat on";

/// gRPC's completion of `PROMPT`: `max_tokens` tokens, greedy, each with its figures and
/// its two most likely tokens'.
async fn grpc_completion(url: &str, max_tokens: u32) -> duet_proto::Completion {
    let req = pb::GenerateRequest {
        logprobs: true,
        top_logprobs: 2,
        ..request(PROMPT, max_tokens, pb::SpeculationMethod::Auto)
    };
    generate(url, req).await.unwrap()
}

/// TGI's finish reason of gRPC's.
fn finish_reason(done: &duet_proto::Completion) -> &'static str {
    match pb::FinishReason::try_from(done.finish_reason.unwrap()).unwrap() {
        pb::FinishReason::Length => "length",
        pb::FinishReason::Eos => "eos_token",
        other => panic!("{other:?}"),
    }
}

/// `field` of each of `tokens`.
fn each(tokens: &Value, field: &str) -> Vec<Value> {
    let tokens = tokens.as_array().unwrap_or_else(|| panic!("{tokens}"));
    tokens.iter().map(|t| t[field].clone()).collect()
}

/// `POST /generate`: gRPC's text, alone unless `details` asks for why it ended, the seed
/// (none: greedy), each token (id, text, log-probability, special) and with `top_n_tokens`
/// each place's most likely; `POST /`'s is the same in a list, the prompt before the text
/// unless `return_full_text` is false.
#[tokio::test]
async fn generate_answers_as_grpc_does() {
    let (_m, stack) = tiny_stack().await;
    let (url, addr) = (stack.coordinator.url(), stack.coordinator.http_addr);
    let want = grpc_completion(&url, 8).await;
    let body = json!({"inputs": PROMPT, "parameters": {"max_new_tokens": 8}});
    let (status, head, answer) =
        http_exchange(addr, "POST", "/generate", &[], &body.to_string()).await;
    assert_eq!(
        (status, json_of(&answer)),
        (200, json!({"generated_text": want.text}))
    );
    assert_figures(&head, &want);

    let parameters = json!({"max_new_tokens": 8, "details": true, "top_n_tokens": 2});
    let body = json!({"inputs": PROMPT, "parameters": parameters});
    let (status, answer) = post(addr, "/generate", &body.to_string()).await;
    assert_eq!(status, 200, "{answer}");
    let details = &json_of(&answer)["details"];
    let end = [
        &details["finish_reason"],
        &details["generated_tokens"],
        &details["seed"],
        &details["prefill"],
    ];
    let n = want.token_ids.len();
    assert_eq!(
        end,
        [
            &json!(finish_reason(&want)),
            &json!(n),
            &json!(null),
            &json!([])
        ]
    );
    let tokens = &details["tokens"];
    assert_eq!(
        each(tokens, "id"),
        want.token_ids
            .iter()
            .map(|&id| json!(id))
            .collect::<Vec<_>>()
    );
    let logprobs: Vec<Value> = want.logprobs.iter().map(|f| json!(f.logprob)).collect();
    assert_eq!(each(tokens, "logprob"), logprobs);
    assert_eq!(each(tokens, "special"), vec![json!(false); n]);
    let text: String = each(tokens, "text")
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    assert_eq!(text, want.text);
    let top = details["top_tokens"].as_array().unwrap();
    let top_ids: Vec<Vec<Value>> = top.iter().map(|t| each(t, "id")).collect();
    let want_top: Vec<Vec<Value>> = (want.logprobs.iter())
        .map(|f| f.top_token_ids.iter().map(|&id| json!(id)).collect())
        .collect();
    assert_eq!(top_ids, want_top);

    for (parameters, text) in [
        (
            json!({"max_new_tokens": 8}),
            format!("{PROMPT}{}", want.text),
        ),
        (
            json!({"max_new_tokens": 8, "return_full_text": false}),
            want.text.clone(),
        ),
    ] {
        let body = json!({"inputs": PROMPT, "parameters": parameters});
        let (status, answer) = post(addr, "/", &body.to_string()).await;
        assert_eq!(
            (status, json_of(&answer)),
            (200, json!([{"generated_text": text}]))
        );
    }
}

/// TGI's headers of a whole answer of `want`'s: the device (the tiny stack's CPU), the
/// prompt's characters and tokens, the answer's tokens, and times that add up (each in
/// whole milliseconds, so to within one each), the request having waited for no place;
/// and not buffered as a stream's are not.
fn assert_figures(head: &[(String, String)], want: &duet_proto::Completion) {
    let header = |name| header_of(head, name).unwrap_or_else(|| panic!("{name}: {head:?}"));
    let ms = |name| header(name).parse::<u64>().unwrap();
    let n = want.token_ids.len();
    let counts = [
        "x-compute-type",
        "x-compute-characters",
        "x-prompt-tokens",
        "x-generated-tokens",
        "x-queue-time",
    ]
    .map(header);
    let prompt_tokens = want.usage.prompt_tokens.to_string();
    assert_eq!(
        counts,
        [
            "cpu",
            "14",
            prompt_tokens.as_str(),
            n.to_string().as_str(),
            "0"
        ]
    );
    let (total, validation, inference) = (
        ms("x-total-time"),
        ms("x-validation-time"),
        ms("x-inference-time"),
    );
    assert!(total.abs_diff(validation + inference) <= 2, "{head:?}");
    assert!(
        ms("x-time-per-token").abs_diff(inference / n as u64) <= 1,
        "{head:?}"
    );
    let seconds: f64 = header("x-compute-time").parse().unwrap();
    assert!((seconds * 1e3 - total as f64).abs() < 1.0, "{head:?}");
    assert_eq!(header_of(head, "x-accel-buffering"), None);
}

/// `POST /generate_stream` (and `POST /` with `stream`): an event a token, counted from 1,
/// each with its text; the last also with the whole text and, with `details`, why it
/// ended; no `[DONE]`.
#[tokio::test]
async fn a_stream_sends_an_event_a_token() {
    let (_m, stack) = tiny_stack().await;
    let (url, addr) = (stack.coordinator.url(), stack.coordinator.http_addr);
    let want = grpc_completion(&url, 8).await;
    let n = want.token_ids.len();
    let parameters = json!({"max_new_tokens": 8, "details": true});
    for (path, stream, text) in [
        ("/generate_stream", json!(null), want.text.clone()),
        ("/", json!(true), format!("{PROMPT}{}", want.text)),
    ] {
        let body = json!({"inputs": PROMPT, "parameters": parameters, "stream": stream});
        let (status, head, answer) =
            http_exchange(addr, "POST", path, &[], &body.to_string()).await;
        assert_eq!(status, 200, "{answer}");
        // What TGI's stream says before any token; no proxy is to hold it back.
        let said = [
            "x-compute-type",
            "x-compute-characters",
            "x-accel-buffering",
            "x-total-time",
        ];
        let said = said.map(|name| header_of(&head, name));
        assert_eq!(said, [Some("cpu"), Some("14"), Some("no"), None]);
        let events: Vec<Value> = events(&answer).iter().map(|e| json_of(e)).collect();
        let (last, before) = events.split_last().unwrap();
        let indices: Vec<Value> = events.iter().map(|e| e["index"].clone()).collect();
        assert_eq!(
            indices,
            (1..=n).map(|i| json!(i)).collect::<Vec<_>>(),
            "{path}"
        );
        let ids: Vec<Value> = events.iter().map(|e| e["token"]["id"].clone()).collect();
        assert_eq!(
            ids,
            want.token_ids
                .iter()
                .map(|&id| json!(id))
                .collect::<Vec<_>>()
        );
        let pieces: String = (events.iter())
            .map(|e| e["token"]["text"].as_str().unwrap())
            .collect();
        assert_eq!(pieces, want.text);
        for event in before {
            assert_eq!(
                (&event["generated_text"], &event["details"]),
                (&json!(null), &json!(null))
            );
        }
        let details = json!({"finish_reason": finish_reason(&want), "generated_tokens": n,
                             "seed": null, "input_length": want.usage.prompt_tokens});
        assert_eq!(
            (&last["generated_text"], &last["details"]),
            (&json!(text), &details)
        );
    }
}

/// A stop sequence ends the text with it, as TGI's does; a seeded sample draws gRPC's
/// tokens for the same seed, and names the seed.
#[tokio::test]
async fn stop_sequences_and_seeds_answer_as_tgi_does() {
    let (_m, stack) = tiny_stack().await;
    let (url, addr) = (stack.coordinator.url(), stack.coordinator.http_addr);
    let want = grpc_completion(&url, 12).await;
    let chars: Vec<char> = want.text.chars().collect();
    let stop: String = chars[3..5].iter().collect();
    let until = want.text.find(&stop).unwrap() + stop.len();
    let parameters = json!({"max_new_tokens": 12, "stop": [stop], "details": true});
    let body = json!({"inputs": PROMPT, "parameters": parameters});
    let (status, answer) = post(addr, "/generate", &body.to_string()).await;
    assert_eq!(status, 200, "{answer}");
    let answer = json_of(&answer);
    assert_eq!(answer["generated_text"], want.text[..until]);
    assert_eq!(answer["details"]["finish_reason"], "stop_sequence");

    // Target-only, so that both draw each token from the same place of the seed's stream
    // (a speculative round's draws depend on what it drafted).
    let sampled = pb::GenerateRequest {
        temperature: 1.0,
        seed: 5,
        ..request(PROMPT, 12, pb::SpeculationMethod::None)
    };
    let sampled = generate(&url, sampled).await.unwrap();
    let parameters = json!({"max_new_tokens": 12, "do_sample": true, "seed": 5, "details": true,
                            "speculation": "none"});
    let body = json!({"inputs": PROMPT, "parameters": parameters});
    let (status, answer) = post(addr, "/generate", &body.to_string()).await;
    assert_eq!(status, 200, "{answer}");
    let answer = json_of(&answer);
    assert_eq!(
        (&answer["generated_text"], &answer["details"]["seed"]),
        (&json!(sampled.text), &json!(5))
    );
}

/// TGI's `/tokenize`: each token of `inputs` with the characters it completes and their
/// span, in order, adding up to the input (a character split across tokens goes to the
/// token that completes it), after a beginning-of-sequence token the model adds.
#[tokio::test]
async fn tokenize_answers_tgis_spans() {
    let (m, stack) = tiny_stack().await;
    let tokenizer = duet_engine::Tokenizer::load(&m.target).unwrap();
    let inputs = "the café sat";
    let body = json!({"inputs": inputs}).to_string();
    let (status, answer) = post(stack.coordinator.http_addr, "/tokenize", &body).await;
    assert_eq!(status, 200, "{answer}");
    let tokens = json_of(&answer);
    let tokens = tokens.as_array().unwrap();
    let ids: Vec<u32> = tokens
        .iter()
        .map(|t| t["id"].as_u64().unwrap() as u32)
        .collect();
    assert_eq!(ids, tokenizer.encode(inputs, true).unwrap());
    let chars: Vec<char> = inputs.chars().collect();
    let (mut at, mut text) = (0, String::new());
    for token in tokens {
        let (start, stop) = (
            token["start"].as_u64().unwrap(),
            token["stop"].as_u64().unwrap(),
        );
        assert_eq!(start, at, "{tokens:?}");
        let span: String = chars[start as usize..stop as usize].iter().collect();
        assert_eq!(token["text"], json!(span), "{tokens:?}");
        (at, text) = (stop, text + &span);
    }
    assert_eq!(text, inputs);
    let split = tokens.iter().any(|t| t["start"] == t["stop"]);
    assert!(
        split,
        "the test needs a character split across tokens: {tokens:?}"
    );
}

/// Refusals in TGI's shape: what duet cannot take 422 `validation`, naming the field; a
/// missing token 401; `/info` the served model and its limits.
#[tokio::test]
async fn refusals_and_info_have_tgis_shapes() {
    let (_m, stack) = tiny_stack().await;
    let addr = stack.coordinator.http_addr;
    for (body, error) in [
        (
            json!({"inputs": PROMPT, "parameters": {"max_new_tokens": 0}}).to_string(),
            "max_new_tokens: must be strictly positive",
        ),
        (
            json!({"inputs": PROMPT, "parameters": {"adapter_id": "nope"}}).to_string(),
            "adapter_id: `nope`: the target-workers load no adapters",
        ),
        (json!({"inputs": ""}).to_string(), "inputs: cannot be empty"),
    ] {
        let (status, answer) = post(addr, "/generate", &body).await;
        let want = json!({"error": error, "error_type": "validation"});
        assert_eq!((status, json_of(&answer)), (422, want));
    }
    for body in ["{", "{}"] {
        let (status, answer) = post(addr, "/generate_stream", body).await;
        assert_eq!(
            (status, &json_of(&answer)["error_type"]),
            (422, &json!("validation"))
        );
    }
    let (status, info) = http(addr, "GET", "/info", &[], "").await;
    assert_eq!(status, 200, "{info}");
    let info = json_of(&info);
    let limits = [
        &info["model_id"],
        &info["max_total_tokens"],
        &info["max_input_tokens"],
        &info["max_best_of"],
        &info["router"],
    ];
    assert_eq!(
        limits,
        [
            &json!("target.gguf"),
            &json!(256),
            &json!(255),
            &json!(1),
            &json!("duet")
        ]
    );

    let (_dir, locked) = locked_coordinator(&stack.target).await;
    let body = json!({"inputs": PROMPT}).to_string();
    let (status, answer) = post(locked.http_addr, "/generate", &body).await;
    assert_eq!(
        (status, &json_of(&answer)["error_type"]),
        (401, &json!("authentication"))
    );
    let (status, _) = http(locked.http_addr, "GET", "/info", &[], "").await;
    assert_eq!(status, 401);
}

/// The official `huggingface_hub` client's `InferenceClient.text_generation` (at the
/// server's root, as TGI's) and `get_endpoint_info` (tests/python/tgi_client.py) against a
/// tiny stack. `scripts/test` installs the package (pinned) and runs this with
/// `DUET_TGI_PYTHON` set to that Python; `cargo test` alone skips it (ignored).
#[tokio::test]
#[ignore = "needs the huggingface_hub package: scripts/test runs it"]
async fn the_huggingface_hub_client_works() {
    let python = std::env::var("DUET_TGI_PYTHON").expect(
        "DUET_TGI_PYTHON: a Python with the huggingface_hub package (scripts/test sets it)",
    );
    let (_m, stack) = tiny_stack().await;
    let want = grpc_completion(&stack.coordinator.url(), 8).await;
    let args = json!({
        "base_url": format!("http://{}", stack.coordinator.http_addr),
        "prompt": PROMPT,
        "text": want.text,
        "token_ids": want.token_ids,
        "finish_reason": finish_reason(&want),
    });
    let out = run_python(&python, "tgi_client.py", args).await;
    assert_eq!(out.trim(), "huggingface_hub client: ok");
}
