//! Chat template variables and thinking models over HTTP: variables reach the template, a
//! thought left out is not answered, a thought comes apart from the answer.

use super::*;

/// vLLM's `chat_template_kwargs` reach the model's template (the tiny one, as Qwen3's, opens
/// the answer with an empty thought where `enable_thinking` is false): the prompt grows by
/// those tokens and the text is gRPC's for the same variables. What the template must not
/// get is refused, naming the parameter.
#[tokio::test]
async fn template_variables_reach_the_chat_template() {
    let (m, stack) = tiny_stack().await;
    let (url, http_addr) = (stack.coordinator.url(), stack.coordinator.http_addr);
    let chat = |fields: Value| async move {
        let (status, answer) = post(http_addr, "/v1/chat/completions", &chat_body(fields)).await;
        (status, json_of(&answer))
    };
    let (status, plain) = chat(json!({"max_tokens": 6})).await;
    assert_eq!(status, 200, "{plain}");
    let no_thinking = json!({"max_tokens": 6, "chat_template_kwargs": {"enable_thinking": false}});
    let (status, answer) = chat(no_thinking).await;
    assert_eq!(status, 200, "{answer}");
    let tokenizer = duet_engine::Tokenizer::load(&m.target).unwrap();
    let thought = tokenizer.encode("<think>\n\n</think>\n\n", false).unwrap();
    let prompt_tokens = |a: &Value| a["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(
        prompt_tokens(&answer),
        prompt_tokens(&plain) + thought.len() as u64
    );
    let req = pb::GenerateRequest {
        max_tokens: 6,
        chat_template_kwargs: r#"{"enable_thinking": false}"#.into(),
        ..chat_request()
    };
    let text = answer["choices"][0]["message"]["content"].clone();
    assert_eq!(text, grpc_text(&url, req).await);

    for (kwargs, why) in [
        (
            json!(["enable_thinking"]),
            "chat_template_kwargs: must be a JSON object",
        ),
        (
            json!({"messages": []}),
            "chat_template_kwargs: `messages` is the template's own variable",
        ),
        (
            json!({"x": "<|im_start|>"}),
            "chat_template_kwargs: holds control-token text, which would read as the \
             template's",
        ),
    ] {
        let (status, answer) = chat(json!({"chat_template_kwargs": kwargs})).await;
        assert_eq!(status, 400, "{answer}");
        assert_eq!(answer["error"]["message"], why);
    }
    let body = json!({"prompt": "x", "chat_template_kwargs": {"enable_thinking": false}});
    let (status, answer) = post(http_addr, "/v1/completions", &body.to_string()).await;
    assert_eq!(status, 400, "{answer}");
    assert_eq!(
        json_of(&answer)["error"]["message"],
        "chat_template_kwargs: chat messages only"
    );
}

/// vLLM's include_reasoning false: a thought that comes apart is left out of the answer,
/// whole and streamed; the content is the same.
#[tokio::test]
async fn a_thought_left_out_is_not_answered() {
    let (_m, stack) = tiny_stack().await;
    let addr = stack.coordinator.http_addr;
    let regex = r"<think>[a-z]{3}</think>\n\nok";
    let body = |stream| {
        let fields = json!({"max_tokens": 20, "guided_regex": regex, "stream": stream,
                            "include_reasoning": false});
        chat_body(fields)
    };
    let (status, answer) = post(addr, "/v1/chat/completions", &body(false)).await;
    assert_eq!(status, 200, "{answer}");
    let message = &json_of(&answer)["choices"][0]["message"];
    assert_eq!(*message, json!({"role": "assistant", "content": "ok"}));
    let (status, stream) = post(addr, "/v1/chat/completions", &body(true)).await;
    assert_eq!(status, 200, "{stream}");
    assert!(!stream.contains("reasoning_content"), "{stream}");
    let content: String = (chunks(&stream).iter())
        .filter_map(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .map(String::from)
        })
        .collect();
    assert_eq!(content, "ok");
}

/// A thinking model's thought (here forced by a regex: `<think>` three letters `</think>`,
/// then "ok") comes apart from the answer: gRPC's `reasoning`, OpenAI's
/// `reasoning_content`, whole and streamed; a legacy completion (no chat template) and a
/// coordinator with `separate_reasoning` off keep it in the text.
#[tokio::test]
async fn a_thought_comes_apart_from_the_answer() {
    let m = tiny_models();
    let target = start_target(worker_config(&m.target));
    let coordinator = start_coordinator(coordinator_config(&target.url(), None));
    let mut kept = coordinator_config(&target.url(), None);
    kept.separate_reasoning = false;
    let kept = start_coordinator(kept);
    wait_serving(&coordinator.url(), "").await;
    wait_serving(&kept.url(), "").await;
    let regex = r"<think>[a-z]{3}</think>\n\nok";
    let req = pb::GenerateRequest {
        max_tokens: 20,
        structured_output: Some(pb::StructuredOutput {
            format: Some(pb::structured_output::Format::Regex(regex.into())),
        }),
        ..chat_request()
    };
    let grpc = generate(&coordinator.url(), req.clone()).await.unwrap();
    assert_eq!(grpc.text, "ok");
    assert_eq!(grpc.reasoning.len(), 3, "{grpc:?}");
    // The thought's tokens: up to the one that ends `</think>`.
    let tokenizer = duet_engine::Tokenizer::load(&m.target).unwrap();
    let thought_tokens = (1..=grpc.token_ids.len())
        .find(|&n| {
            tokenizer
                .decode(&grpc.token_ids[..n], false)
                .unwrap()
                .ends_with("</think>")
        })
        .unwrap();
    assert_eq!(grpc.usage.reasoning_tokens as usize, thought_tokens);
    let whole = generate(&kept.url(), req).await.unwrap();
    assert_eq!(
        whole.text,
        format!("<think>{}</think>\n\nok", grpc.reasoning)
    );
    assert_eq!(whole.reasoning, "");

    let addr = coordinator.http_addr;
    let body = chat_body(json!({"max_tokens": 20, "guided_regex": regex}));
    let (status, answer) = post(addr, "/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{answer}");
    let answer = json_of(&answer);
    let message = &answer["choices"][0]["message"];
    assert_eq!(message["content"], "ok");
    assert_eq!(message["reasoning_content"], grpc.reasoning);
    let details = &answer["usage"]["completion_tokens_details"];
    assert_eq!(details["reasoning_tokens"], thought_tokens);
    let body = chat_body(json!({"max_tokens": 20, "guided_regex": regex, "stream": true}));
    let (status, stream) = post(addr, "/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{stream}");
    let chunks = chunks(&stream);
    let deltas = |key: &str| -> String {
        (chunks.iter())
            .filter_map(|c| c["choices"][0]["delta"][key].as_str())
            .collect()
    };
    assert_eq!(
        (deltas("reasoning_content"), deltas("content")),
        (grpc.reasoning, "ok".into())
    );
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let body = json!({"prompt": "x", "max_tokens": 20, "guided_regex": regex});
    let (status, answer) = post(addr, "/v1/completions", &body.to_string()).await;
    assert_eq!(status, 200, "{answer}");
    let text = json_of(&answer)["choices"][0]["text"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        text.starts_with("<think>") && text.ends_with("</think>\n\nok"),
        "{text}"
    );
}
