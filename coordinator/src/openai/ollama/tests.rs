use super::*;

fn request(endpoint: Endpoint, body: Value) -> Result<Option<pb::GenerateRequest>, Unsupported> {
    serde_json::from_value::<Request>(body)
        .unwrap()
        .to_request(endpoint)
}

fn one(endpoint: Endpoint, body: Value) -> pb::GenerateRequest {
    request(endpoint, body).unwrap().unwrap()
}

fn chat(body: Value) -> pb::GenerateRequest {
    serde_json::from_value::<ChatRequest>(body)
        .unwrap()
        .to_request()
        .unwrap()
}

/// A chat is the chat request of the same conversation: an assistant message's calls with
/// their arguments as JSON text (its thought left out), a tool message with the call it
/// answers, the options as chat's fields, `format` and `think` as `response_format` and
/// `enable_thinking`.
#[test]
fn a_chat_is_the_chat_request_of_its_conversation() {
    let schema = json!({"type": "object", "properties": {"city": {"type": "string"}}});
    let tools = json!([{"type": "function", "function": {"name": "w", "description": "weather",
                                                          "parameters": schema}}]);
    let ollama = one(
        Endpoint::Chat,
        json!({
            "model": "qwen2.5-coder:1.5b", "keep_alive": "5m", "stream": false,
            "options": {"temperature": 0.5, "top_p": 0.95, "top_k": 7, "min_p": 0.1, "seed": 3,
                        "num_predict": 20, "stop": ["\n\n"], "num_ctx": 8192,
                        "draft_num_predict": 6, "repeat_penalty": 1.0},
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "thinking": "Call w.",
                 "tool_calls": [{"function": {"name": "w", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "content": "sunny", "tool_name": "w"},
            ],
            "tools": tools, "format": schema, "think": false,
            "logprobs": true, "top_logprobs": 2,
        }),
    );
    let as_chat = chat(json!({
        "model": "qwen2.5-coder:1.5b",
        "max_tokens": 20, "temperature": 0.5, "top_p": 0.95, "top_k": 7, "min_p": 0.1,
        "seed": 3, "stop": ["\n\n"], "num_speculative_tokens": 6,
        "logprobs": true, "top_logprobs": 2,
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
             "function": {"name": "w", "arguments": "{\"city\":\"Paris\"}"}}]},
            {"role": "tool", "content": "sunny"},
        ],
        "tools": tools,
        "response_format": {"type": "json_schema", "json_schema": {"schema": schema}},
        "chat_template_kwargs": {"enable_thinking": false},
    }));
    assert_eq!(ollama, as_chat);
}

/// Unset, Ollama's defaults hold: temperature 0.8, top_k 40, top_p 0.9, the server's
/// completion length, a fresh seed; `think` unset leaves the template's default.
#[test]
fn ollamas_defaults_hold() {
    let messages = json!([{"role": "user", "content": "Hi", "tool_calls": null}]);
    // Null fields read as unset, as Ollama reads them.
    let first = one(
        Endpoint::Chat,
        json!({"messages": messages, "options": null}),
    );
    assert_eq!(
        (first.temperature, first.top_k, first.top_p, first.min_p),
        (0.8, 40, Some(0.9), 0.0)
    );
    assert_eq!((first.max_tokens, &*first.chat_template_kwargs), (0, ""));
    let second = one(Endpoint::Chat, json!({"messages": messages}));
    assert_ne!(first.seed, second.seed);
    let off = json!({"messages": messages,
                     "options": {"top_k": -1, "top_p": 1.0, "num_predict": -2, "seed": -1}});
    let off = one(Endpoint::Chat, off);
    assert_eq!((off.top_k, off.top_p, off.max_tokens), (0, None, 0));
    let levels = json!({"messages": messages, "think": "high", "format": "json"});
    let levels = one(Endpoint::Chat, levels);
    assert_eq!(levels.chat_template_kwargs, r#"{"enable_thinking":true}"#);
    let json_object = pb::structured_output::Format::JsonObject(true);
    assert_eq!(levels.structured_output.unwrap().format, Some(json_object));
}

/// A templated prompt is the chat of its system and user message; a raw one, or one with
/// a suffix, a completion (fill in the middle), whose `think` has nothing to switch.
#[test]
fn a_prompt_is_a_chat_unless_raw_or_with_a_suffix() {
    let options = json!({"temperature": 0, "num_predict": 5, "seed": 1});
    let templated = json!({"prompt": "Hi", "system": "Be brief.", "options": options});
    let as_chat = chat(
        json!({"max_tokens": 5, "top_k": 40, "top_p": 0.9, "seed": 1,
        "messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": "Hi"}]}),
    );
    assert_eq!(one(Endpoint::Generate, templated), as_chat);
    let raw = json!({"prompt": "def f(", "raw": true, "system": "unread", "think": true,
                     "options": options});
    let completion = serde_json::from_value::<CompletionRequest>(
        json!({"prompt": "def f(", "max_tokens": 5, "top_k": 40, "top_p": 0.9, "seed": 1}),
    );
    let completion = completion.unwrap().to_requests().unwrap().pop().unwrap();
    assert_eq!(one(Endpoint::Generate, raw), completion);
    let middle = json!({"prompt": "def f(", "suffix": "\n", "options": options});
    let want = pb::GenerateRequest {
        suffix: Some("\n".into()),
        ..completion
    };
    assert_eq!(one(Endpoint::Generate, middle), want);
}

/// No messages, or an empty prompt without a suffix, asks only for the model to be loaded
/// (with `keep_alive` 0, unloaded): no generation, and an answer that names which.
#[test]
fn an_empty_request_loads_the_model() {
    assert_eq!(request(Endpoint::Chat, json!({"model": "m"})), Ok(None));
    let unload = json!({"model": "m", "keep_alive": 0});
    assert_eq!(request(Endpoint::Generate, unload), Ok(None));
    let unloads = |keep_alive: Value| {
        let r: Request = serde_json::from_value(json!({"keep_alive": keep_alive})).unwrap();
        r.unloads()
    };
    let kept = [
        json!(0),
        json!("0"),
        json!("0s"),
        json!(300),
        json!("5m"),
        json!(null),
    ];
    let unloaded: Vec<bool> = kept.into_iter().map(unloads).collect();
    assert_eq!(unloaded, [true, true, true, false, false, false]);
    let reply = Reply {
        endpoint: Endpoint::Generate,
        model: "m".into(),
    };
    let mut loaded = reply.loaded(true);
    assert!(loaded["created_at"].as_str().unwrap().ends_with('Z'));
    loaded["created_at"] = json!("t");
    let want = json!({"model": "m", "created_at": "t", "response": "", "done": true,
                      "done_reason": "unload"});
    assert_eq!(loaded, want);
}

/// What duet cannot do is refused by name: images, a Go template, an earlier answer's
/// tokens, Ollama's penalties and samplers away from their defaults, a bad format or think.
#[test]
fn what_duet_cannot_honour_is_refused_by_name() {
    let messages = json!([{"role": "user", "content": "Hi"}]);
    let refused = |endpoint, body: Value| request(endpoint, body).unwrap_err().message;
    let with_image = json!([{"role": "user", "content": "Hi", "images": ["iVBOR"]}]);
    let cases = [
        (
            Endpoint::Chat,
            json!({"messages": with_image}),
            "images: this model reads text only",
        ),
        (
            Endpoint::Generate,
            json!({"prompt": "Hi", "images": ["iVBOR"]}),
            "images: this model reads text only",
        ),
        (
            Endpoint::Generate,
            json!({"prompt": "Hi", "template": "{{ .Prompt }}"}),
            "template: the model's own chat template renders every prompt",
        ),
        (
            Endpoint::Generate,
            json!({"prompt": "Hi", "context": [1, 2]}),
            "context: an earlier answer's tokens are not taken: send the conversation to \
             /api/chat",
        ),
        (
            Endpoint::Chat,
            json!({"messages": messages, "options": {"repeat_penalty": 1.1}}),
            "repeat_penalty: duet does not take it",
        ),
        (
            Endpoint::Chat,
            json!({"messages": messages, "options": {"mirostat": 2}}),
            "mirostat: duet does not take it",
        ),
        (
            Endpoint::Chat,
            json!({"messages": messages, "format": "yaml"}),
            "format: \"json\" or a JSON schema",
        ),
        (
            Endpoint::Chat,
            json!({"messages": messages, "think": "very"}),
            "think: true, false, or low, medium, high or max",
        ),
        (
            Endpoint::Generate,
            json!({"prompt": "a", "raw": true, "suffix": "b"}),
            "suffix: not with raw",
        ),
        (
            Endpoint::Generate,
            json!({"prompt": "a", "options": {"num_predict": -3}}),
            "num_predict: -1 (as many as the server gives) or a count",
        ),
    ];
    for (endpoint, body, why) in cases {
        assert_eq!(refused(endpoint, body.clone()), why, "{body}");
    }
    // At their defaults they pass, as clients send them so.
    let defaults = json!({"messages": messages, "template": "", "context": [],
        "options": {"repeat_penalty": 1, "presence_penalty": 0, "frequency_penalty": 0,
                    "typical_p": 1.0, "mirostat": 0, "repeat_last_n": 64}});
    assert!(request(Endpoint::Chat, defaults).is_ok());
}

/// The answer's objects: a chat's message with its thought and calls (each call's id, index
/// and arguments as an object), a prompt's `response` and `thinking`, logprobs as chat's
/// entries; the last with why it ended, Ollama's figures in nanoseconds and duet's own.
#[test]
fn answers_have_ollamas_shape() {
    let reply = |endpoint| Reply {
        endpoint,
        model: "m".into(),
    };
    let call = pb::ToolCall {
        id: "call_1".into(),
        name: "w".into(),
        arguments: r#"{"city":"Paris"}"#.into(),
    };
    let mut object = reply(Endpoint::Chat).object("", "Hmm.", &[call], Value::Null);
    object["created_at"] = json!("t");
    let calls = json!([{"id": "call_1",
                        "function": {"index": 0, "name": "w", "arguments": {"city": "Paris"}}}]);
    let message = json!({"role": "assistant", "content": "", "thinking": "Hmm.",
                         "tool_calls": calls});
    let want = json!({"model": "m", "created_at": "t", "message": message, "done": false});
    assert_eq!(object, want);

    let figures = json!({"content": [{"token": "a", "logprob": -0.5}], "refusal": null});
    let generated = reply(Endpoint::Generate).object("a", "", &[], figures);
    assert_eq!(
        (&generated["response"], &generated["logprobs"]),
        (&json!("a"), &json!([{"token": "a", "logprob": -0.5}]))
    );
    assert!(generated.get("thinking").is_none());

    let usage = pb::Usage {
        prompt_tokens: 30,
        prompt_tokens_cached: 16,
        completion_tokens: 7,
        timings: Some(pb::Timings {
            total_ms: 12.5,
            prefill_ms: 2.0,
            rounds_ms: 9.25,
            ..Default::default()
        }),
        ..Default::default()
    };
    let length = Some(pb::FinishReason::Length as i32);
    let done = reply(Endpoint::Generate).done(generated, length, &usage);
    let want = json!({"done": true, "done_reason": "length", "total_duration": 12_500_000,
                      "prompt_eval_count": 14, "prompt_eval_duration": 2_000_000,
                      "eval_count": 7, "eval_duration": 9_250_000});
    for (key, value) in want.as_object().unwrap() {
        assert_eq!(&done[key], value, "{key}");
    }
    assert_eq!(
        (
            &done["duet"]["prompt_tokens"],
            &done["duet"]["prompt_tokens_cached"]
        ),
        (&json!(30), &json!(16))
    );
}

#[test]
fn parameter_sizes_read_as_ollamas() {
    let sizes = [
        (1_543_714_304, "1.5B"),
        (7_000_000_000, "7B"),
        (494_032_768, "494.03M"),
        (135_000_000, "135M"),
        (4_096, "4K"),
        (12, "12"),
    ];
    for (n, want) in sizes {
        assert_eq!(human_number(n), want);
    }
}
