//! Fill in the middle and llama.cpp's endpoints over HTTP: a completion's suffix, `/infill`
//! and `/completion` as llama.cpp answers them, a caller that goes away, Llama-style calls.

use super::*;

/// A completion's `suffix` over HTTP, with code models' tokens: gRPC's middle for the same
/// prompt and suffix; with `echo`, and on models without such tokens, refused.
#[tokio::test]
async fn a_completions_suffix_asks_for_the_middle() {
    let (_m, stack, _) = code_stack().await;
    let (url, http_addr) = (stack.coordinator.url(), stack.coordinator.http_addr);
    let body = json!({"prompt": "def f(", "suffix": "):\n", "max_tokens": 12});
    let (status, answer) = post(http_addr, "/v1/completions", &body.to_string()).await;
    assert_eq!(status, 200, "{answer}");
    let infill = pb::GenerateRequest {
        suffix: Some("):\n".into()),
        ..request("def f(", 12, pb::SpeculationMethod::Auto)
    };
    let text = json_of(&answer)["choices"][0]["text"].clone();
    assert_eq!(text, grpc_text(&url, infill).await);
    let echoed = json!({"prompt": "def f(", "suffix": "):", "echo": true});
    let (status, answer) = post(http_addr, "/v1/completions", &echoed.to_string()).await;
    assert_eq!(status, 400, "{answer}");
    assert_eq!(json_of(&answer)["error"]["param"], "suffix");
    let (_plain, plain) = tiny_stack().await;
    let (status, answer) = post(
        plain.coordinator.http_addr,
        "/v1/completions",
        &body.to_string(),
    )
    .await;
    assert_eq!(status, 400, "{answer}");
    let why = "suffix: the target model has no fill-in-the-middle tokens";
    assert_eq!(json_of(&answer)["error"]["message"], why);
}

/// llama.cpp's `/infill` over HTTP, as llama.vim calls it, with code models' tokens:
/// gRPC's middle for the same prefix (and text typed after it), suffix and repository, in
/// llama.cpp's shape, whole (every field, or those `response_fields` names) and streamed;
/// a warm-up (`n_predict` 0) answers no text.
#[tokio::test]
async fn infill_answers_as_llama_cpp_does() {
    let (_m, stack, _) = code_stack().await;
    let (url, http_addr) = (stack.coordinator.url(), stack.coordinator.http_addr);
    let body = json!({"input_prefix": "def f(", "input_suffix": "):\n", "prompt": "a",
                      "input_extra": [{"filename": "a.py", "text": "x = 1\n"}],
                      "n_predict": 12, "temperature": 0, "samplers": ["top_k", "temperature"]});
    let (status, answer) = post(http_addr, "/infill", &body.to_string()).await;
    assert_eq!(status, 200, "{answer}");
    let answer = json_of(&answer);
    let infill = pb::GenerateRequest {
        suffix: Some("):\n".into()),
        repository: Some(pb::Repository {
            files: vec![pb::RepositoryFile {
                path: "a.py".into(),
                text: "x = 1\n".into(),
            }],
            ..Default::default()
        }),
        ..request("def f(a", 12, pb::SpeculationMethod::Auto)
    };
    let grpc = generate(&url, infill).await.unwrap();
    assert_eq!(answer["content"], grpc.text);
    let counts = (&answer["tokens_predicted"], &answer["tokens_evaluated"]);
    let usage = &grpc.usage;
    assert_eq!(
        counts,
        (&json!(usage.completion_tokens), &json!(usage.prompt_tokens))
    );
    let stop_type = match grpc.finish_reason {
        Some(f) if f == pb::FinishReason::Eos as i32 => "eos",
        _ => "limit",
    };
    assert_eq!(
        (&answer["stop_type"], &answer["stop"]),
        (&json!(stop_type), &json!(true))
    );
    assert_eq!(answer["truncated"], false);
    assert_eq!(answer["timings"]["predicted_n"], usage.completion_tokens);
    // Streamed: the same text, then the final object.
    let streamed = json!({"stream": true, "response_fields": ["content"]});
    let mut streamed_body = body.clone();
    streamed_body
        .as_object_mut()
        .unwrap()
        .extend(streamed.as_object().unwrap().clone());
    let (status, stream) = post(http_addr, "/infill", &streamed_body.to_string()).await;
    assert_eq!(status, 200, "{stream}");
    let events: Vec<Value> = events(&stream).iter().map(|e| json_of(e)).collect();
    let (last, pieces) = events.split_last().unwrap();
    let text: String = pieces
        .iter()
        .map(|p| p["content"].as_str().unwrap())
        .collect();
    assert_eq!(text, grpc.text);
    assert!(pieces.iter().all(|p| p["stop"] == false));
    assert_eq!(last, &json!({"content": ""}));
    // Picked fields; a warm-up.
    let picked = json!({"input_prefix": "x", "n_predict": 0, "samplers": [],
                        "response_fields": ["content", "timings/predicted_n", "stop_type"]});
    let (status, answer) = post(http_addr, "/infill", &picked.to_string()).await;
    assert_eq!(status, 200, "{answer}");
    let expected = json!({"content": "", "timings/predicted_n": 0, "stop_type": "limit"});
    assert_eq!(json_of(&answer), expected);
}

/// llama.cpp's `n_cmpl` (a list, each completion drawn from the seed plus its index) and
/// `/completion` answer gRPC's generations; parameters duet does not take, and a model
/// without fill-in-the-middle tokens, are refused.
#[tokio::test]
async fn llama_cpps_endpoints_draw_as_grpc_does_and_refuse_by_name() {
    let (_m, stack, _) = code_stack().await;
    let (url, http_addr) = (stack.coordinator.url(), stack.coordinator.http_addr);
    // n_cmpl: a list, each drawn from the seed plus its index.
    let sampled = json!({"input_prefix": "def f(", "n_predict": 8, "n_cmpl": 2, "seed": 7,
                         "temperature": 1, "speculation": "none"});
    let (status, answer) = post(http_addr, "/infill", &sampled.to_string()).await;
    assert_eq!(status, 200, "{answer}");
    let answer = json_of(&answer);
    let second = pb::GenerateRequest {
        suffix: Some(String::new()),
        temperature: 1.0,
        top_k: 40,
        top_p: Some(0.95),
        min_p: 0.05,
        seed: 8,
        ..request("def f(", 8, pb::SpeculationMethod::None)
    };
    assert_eq!(answer.as_array().map(Vec::len), Some(2));
    assert_eq!(
        (&answer[0]["index"], &answer[1]["index"]),
        (&json!(0), &json!(1))
    );
    assert_eq!(answer[1]["content"], grpc_text(&url, second).await);
    // /completion.
    let completion = json!({"prompt": "the cat", "n_predict": 8, "temperature": 0});
    let (status, answer) = post(http_addr, "/completion", &completion.to_string()).await;
    assert_eq!(status, 200, "{answer}");
    let grpc = grpc_text(&url, request("the cat", 8, pb::SpeculationMethod::Auto)).await;
    assert_eq!(json_of(&answer)["content"], grpc);
    // A stop string ends it right before, named as `stopping_word`.
    let stop: String = grpc.chars().skip(2).take(2).collect();
    let stopped = json!({"prompt": "the cat", "n_predict": 8, "temperature": 0, "stop": [stop]});
    let (status, answer) = post(http_addr, "/completion", &stopped.to_string()).await;
    assert_eq!(status, 200, "{answer}");
    let fields = ["content", "stop_type", "stopping_word"].map(|f| json_of(&answer)[f].clone());
    let cut = &grpc[..grpc.find(&stop).unwrap()];
    assert_eq!(fields, [json!(cut), json!("word"), json!(stop)]);
    // Refused.
    let penalized = json!({"input_prefix": "x", "repeat_penalty": 1.3});
    let (status, answer) = post(http_addr, "/infill", &penalized.to_string()).await;
    assert_eq!(status, 400, "{answer}");
    assert_eq!(json_of(&answer)["error"]["param"], "repeat_penalty");
    let (_plain, plain) = tiny_stack().await;
    let body = json!({"input_prefix": "x"});
    let (status, answer) = post(plain.coordinator.http_addr, "/infill", &body.to_string()).await;
    assert_eq!(status, 400, "{answer}");
    let why = "suffix: the target model has no fill-in-the-middle tokens";
    assert_eq!(json_of(&answer)["error"]["message"], why);
}

/// A streamed answer whose caller goes away after its first event ends its generations
/// (counted `CANCELLED`) and frees their sessions: OpenAI's completions and llama.cpp's
/// `/infill` with two completions.
#[tokio::test]
async fn a_streamed_caller_that_goes_away_ends_its_generations() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (_m, stack, _) = code_stack().await;
    let cancelled = "duet_requests_total{finish_reason=\"\",code=\"CANCELLED\"}";
    let completion = json!({"prompt": "the cat", "max_tokens": 240, "stream": true,
                            "ignore_eos": true, "speculation": "none"});
    let infill = json!({"input_prefix": "x", "n_predict": 240, "n_cmpl": 2, "stream": true,
                        "ignore_eos": true, "speculation": "none"});
    let mut ended = 0.0;
    for (path, body, n) in [
        ("/v1/completions", completion, 1.0),
        ("/infill", infill, 2.0),
    ] {
        let body = body.to_string();
        let mut stream = tokio::net::TcpStream::connect(stack.coordinator.http_addr)
            .await
            .unwrap();
        let request = format!(
            "POST {path} HTTP/1.1\r\nHost: duet\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n{body}",
            body.len()
        );
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut first = vec![0; 512];
        let read = stream.read(&mut first).await.unwrap();
        assert!(String::from_utf8_lossy(&first[..read]).contains(" 200 "));
        drop(stream);
        ended += n;
        let scraped = scrape_until(&stack.coordinator, cancelled, ended).await;
        assert_eq!(sample(&scraped, cancelled), ended, "{path}");
        wait_no_sessions(&stack, std::time::Duration::from_secs(5)).await;
    }
}

/// A model whose template teaches Llama 3's calls (the answer is the call's JSON, with
/// `parameters`): a required call is that JSON, answered in OpenAI's shape whole and
/// streamed, and gRPC's Finished names the same call.
#[tokio::test]
async fn llama_style_calls_come_in_openais_shape() {
    let (_dir, _target, coordinator) = target_with_template(LLAMA_TOOLS_TEMPLATE.into()).await;
    let call = a_required_call(coordinator.http_addr).await;
    let req = pb::GenerateRequest {
        input: Some(pb::generate_request::Input::Messages(pb::Messages {
            messages: vec![pb::ChatMessage {
                role: "user".into(),
                content: "w?".into(),
                ..Default::default()
            }],
        })),
        max_tokens: 64,
        tools: vec![pb::Tool {
            name: "w".into(),
            description: String::new(),
            parameters: weather_tool()["function"]["parameters"].to_string(),
        }],
        tool_choice: "required".into(),
        ..Default::default()
    };
    let grpc = generate(&coordinator.url(), req).await.unwrap();
    assert!(
        grpc.text.starts_with(r#"{"name": "w", "parameters": "#),
        "{}",
        grpc.text
    );
    assert_eq!(grpc.tool_calls.len(), 1);
    assert_eq!(
        json!(grpc.tool_calls[0].arguments),
        call["function"]["arguments"]
    );
}

/// llama.cpp's tokenizer bodies and descriptions: `/tokenize` of `content` (no
/// beginning-of-sequence token unless `add_special`; `with_pieces`: each id's text, its
/// bytes where they are not UTF-8), `/detokenize`'s `content`, `/apply-template` the text of
/// the prompt gRPC prefills for the same chat, `/props` the context, places and defaults.
#[tokio::test]
async fn llama_cpps_tokenizer_and_props_answer_in_its_shapes() {
    let (m, stack) = tiny_stack().await;
    let (url, addr) = (stack.coordinator.url(), stack.coordinator.http_addr);
    let tokenizer = duet_engine::Tokenizer::load(&m.target).unwrap();
    let text = "the café";
    for (add_special, fields) in [(false, json!({})), (true, json!({"add_special": true}))] {
        let body = with_fields(json!({"content": text}), fields);
        let (status, answer) = post(addr, "/tokenize", &body).await;
        let ids = tokenizer.encode(text, add_special).unwrap();
        assert_eq!((status, json_of(&answer)), (200, json!({"tokens": ids})));
    }
    let ids = tokenizer.encode(text, false).unwrap();
    let body = json!({"content": text, "with_pieces": true}).to_string();
    let (status, answer) = post(addr, "/tokenize", &body).await;
    assert_eq!(status, 200, "{answer}");
    let pieces: Vec<Value> = (ids.iter())
        .map(|&id| {
            let bytes = tokenizer.token_bytes(id).unwrap();
            match String::from_utf8(bytes.clone()) {
                Ok(piece) => json!({"id": id, "piece": piece}),
                Err(_) => json!({"id": id, "piece": bytes}),
            }
        })
        .collect();
    assert_eq!(json_of(&answer), json!({"tokens": pieces}));
    let body = json!({"tokens": ids}).to_string();
    let (status, answer) = post(addr, "/detokenize", &body).await;
    assert_eq!(
        (status, json_of(&answer)["content"].clone()),
        (200, json!(text))
    );

    let scored = pb::GenerateRequest {
        prompt_logprobs: Some(0),
        ..chat_request()
    };
    let prompt = generate(&url, scored).await.unwrap().prompt.unwrap();
    let (status, answer) = post(addr, "/apply-template", &chat_body(json!({}))).await;
    let rendered = tokenizer.decode(&prompt.token_ids, false).unwrap();
    assert_eq!(
        (status, json_of(&answer)),
        (200, json!({"prompt": rendered}))
    );

    let (status, answer) = http(addr, "GET", "/props", &[], "").await;
    assert_eq!(status, 200, "{answer}");
    let props = json_of(&answer);
    let settings = &props["default_generation_settings"];
    assert_eq!(settings["n_ctx"], 256);
    let params = &settings["params"];
    assert_eq!(
        [
            &params["temperature"],
            &params["top_k"],
            &params["top_p"],
            &params["min_p"]
        ],
        [&json!(0.8f32), &json!(40), &json!(0.95f32), &json!(0.05f32)]
    );
    assert_eq!(props["total_slots"], 64);
    assert_eq!(props["chat_template"], json!(tokenizer.chat_template()));
    assert_eq!(props["eos_token"], tokenizer.special_texts().0);
    let build = format!("duet {}", env!("CARGO_PKG_VERSION"));
    assert_eq!(props["build_info"], build);
}
