//! The OpenAI request and reply shapes against duet's: fields taken, refused and answered.

use super::*;
use serde_json::json;

fn chat(body: Value) -> Result<pb::GenerateRequest, Unsupported> {
    serde_json::from_value::<ChatRequest>(body)
        .unwrap()
        .to_request()
}

#[test]
fn json_values_are_counted_outside_strings() {
    assert_eq!(json_values(b"0"), 1);
    assert_eq!(json_values(br#"{"stop": ["", "", ""], "n": 1}"#), 6);
    // Commas and brackets inside strings, escaped quotes included, are text.
    assert_eq!(json_values(br#"{"prompt": "a, [b] {c} \", d"}"#), 2);
    let many = format!("[{}0]", "0,".repeat(5000));
    assert_eq!(json_values(many.as_bytes()), 5002);
}

#[test]
fn a_chat_request_becomes_duets_request() {
    let r = chat(json!({
        "model": "any",
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}]},
        ],
        "max_completion_tokens": 12,
        "max_tokens": 99,
        "temperature": 0.5,
        "top_p": 0.9,
        "seed": 7,
        "stop": "\n\n",
        "speculation": "ngram",
        "num_speculative_tokens": 3,
        "user": "ignored",
    }))
    .unwrap();
    let pb::generate_request::Input::Messages(m) = r.input.unwrap() else {
        panic!("not messages")
    };
    assert_eq!(m.messages[0].role, "system");
    assert_eq!(m.messages[1].content, "Hi!");
    assert_eq!(r.max_tokens, 12);
    assert_eq!((r.temperature, r.top_p, r.seed), (0.5, Some(0.9), 7));
    assert_eq!(r.stop, ["\n\n"]);
    assert_eq!(r.speculation, pb::SpeculationMethod::Ngram as i32);
    assert_eq!(r.num_speculative_tokens, 3);
}

/// OpenAI's response formats and vLLM's guided decoding become duet's structured
/// output; `guided_choice`'s strings are matched literally; two at once are refused.
#[test]
fn response_formats_and_guided_decoding_are_structured_outputs() {
    use pb::structured_output::Format;
    let messages = json!([{"role": "user", "content": "x"}]);
    let format = |extra: Value| {
        let mut body = json!({"messages": messages});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        chat(body).map(|r| r.structured_output.and_then(|s| s.format))
    };
    let schema = json!({"type": "object", "required": ["a"]});
    for (asked, want) in [
        (json!({"response_format": {"type": "text"}}), None),
        (
            json!({"response_format": {"type": "json_object"}}),
            Some(Format::JsonObject(true)),
        ),
        (
            json!({"response_format": {"type": "json_schema",
                                       "json_schema": {"name": "a", "schema": schema}}}),
            Some(Format::JsonSchema(schema.to_string())),
        ),
        (
            json!({"guided_json": schema}),
            Some(Format::JsonSchema(schema.to_string())),
        ),
        (
            json!({"guided_json": "{}"}),
            Some(Format::JsonSchema("{}".into())),
        ),
        (
            json!({"guided_regex": "[0-9]+"}),
            Some(Format::Regex("[0-9]+".into())),
        ),
        (
            json!({"guided_choice": ["a.b", "c|d"]}),
            Some(Format::Regex("a\\.b|c\\|d".into())),
        ),
        (
            json!({"guided_grammar": "start: \"yes\" | \"no\""}),
            Some(Format::Lark("start: \"yes\" | \"no\"".into())),
        ),
        (
            json!({"structured_outputs": {"json": schema, "disable_fallback": false}}),
            Some(Format::JsonSchema(schema.to_string())),
        ),
        (
            json!({"structured_outputs": {"choice": ["x"]}}),
            Some(Format::Regex("x".into())),
        ),
        (
            json!({"structured_outputs": {"regex": "a+"}}),
            Some(Format::Regex("a+".into())),
        ),
        (
            json!({"structured_outputs": {"grammar": "start: \"a\""}}),
            Some(Format::Lark("start: \"a\"".into())),
        ),
        (
            json!({"structured_outputs": {"json_object": true}}),
            Some(Format::JsonObject(true)),
        ),
    ] {
        assert_eq!(format(asked.clone()).unwrap(), want, "{asked}");
    }
    let both = json!({"response_format": {"type": "json_object"}, "guided_regex": "a"});
    assert_eq!(format(both).unwrap_err().param, "response_format");
    let none = json!({"guided_choice": []});
    assert_eq!(format(none).unwrap_err().param, "guided_choice");
    let two = json!({"structured_outputs": {"regex": "a", "grammar": "start: \"a\""}});
    assert_eq!(format(two).unwrap_err().param, "response_format");
    let tag = json!({"structured_outputs": {"structural_tag": "{}"}});
    let refused = format(tag).unwrap_err();
    assert_eq!(refused.param, "structured_outputs");
    assert!(
        refused.message.contains("structural_tag is not supported"),
        "{}",
        refused.message
    );
    let number = json!({"structured_outputs": {"regex": 5}});
    assert_eq!(format(number).unwrap_err().param, "structured_outputs");
}

/// A chat's tools, tool_choice and the messages of a conversation with calls become
/// duet's; a completion with tools is refused.
#[test]
fn tools_and_their_messages_become_duets() {
    let body = json!({
        "messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c1",
              "type": "function", "function": {"name": "get", "arguments": "{\"q\":1}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ],
        "tools": [{"type": "function", "function": {"name": "get", "description": "d",
                   "parameters": {"type": "object"}}}],
        "tool_choice": {"type": "function", "function": {"name": "get"}},
        "parallel_tool_calls": false,
    });
    let r = chat(body).unwrap();
    assert_eq!(r.parallel_tool_calls, Some(false));
    assert_eq!(
        r.tools,
        [pb::Tool {
            name: "get".into(),
            description: "d".into(),
            parameters: r#"{"type":"object"}"#.into(),
        }]
    );
    assert_eq!(r.tool_choice, "get");
    let Some(pb::generate_request::Input::Messages(m)) = r.input else {
        panic!("not messages");
    };
    let call = pb::ToolCall {
        id: "c1".into(),
        name: "get".into(),
        arguments: r#"{"q":1}"#.into(),
    };
    assert_eq!(
        (
            m.messages[1].content.as_str(),
            &m.messages[1].tool_calls[..]
        ),
        ("", &[call][..])
    );
    assert_eq!(
        (
            m.messages[2].role.as_str(),
            m.messages[2].tool_call_id.as_str()
        ),
        ("tool", "c1")
    );
    for choice in ["auto", "none", "required"] {
        let body = json!({"messages": [], "tool_choice": choice});
        assert_eq!(chat(body).unwrap().tool_choice, choice);
    }
    let completion = json!({"prompt": "x", "tools": [{"type": "function",
                            "function": {"name": "f"}}]});
    let request: CompletionRequest = serde_json::from_value(completion).unwrap();
    assert_eq!(request.to_requests().unwrap_err().param, "tools");
}

#[test]
fn what_duet_does_not_do_is_refused_naming_the_parameter() {
    let base = json!({"messages": [{"role": "user", "content": "x"}]});
    let with = |k: &str, v: Value| {
        let mut b = base.clone();
        b[k] = v;
        chat(b).unwrap_err()
    };
    assert_eq!(with("n", json!(17)).param, "n");
    assert_eq!(with("n", json!(0)).param, "n");
    assert_eq!(with("best_of", json!(2)).param, "best_of");
    // An image the model cannot read, rather than an answer that seems to have read it.
    let image = json!({"type": "image_url", "image_url": {"url": "data:image/png;base64,"}});
    let seen = json!([{"role": "user", "content": [{"type": "text", "text": "What is it?"},
                                                   image]}]);
    let refused = with("messages", seen);
    assert_eq!(
        (refused.param, refused.message.as_str()),
        (
            "messages",
            "messages: text content only, not a part of type image_url"
        )
    );
    for (param, value) in [
        ("logit_bias", json!({"a token": -100})),
        ("logit_bias", json!({"50256": "high"})),
        ("logit_bias", json!([1, 2])),
        ("response_format", json!({"type": "xml"})),
        (
            "response_format",
            json!({"type": "json_schema", "json_schema": {"name": "a"}}),
        ),
        (
            "tools",
            json!([{"type": "code_interpreter", "function": {"name": "f"}}]),
        ),
        ("tool_choice", json!({"type": "function"})),
        ("tool_choice", json!("sometimes")),
    ] {
        assert_eq!(with(param, value).param, param);
    }
    // What changes nothing passes, and what duet does is taken.
    let mut neutral = base.clone();
    for (k, v) in [
        ("presence_penalty", json!(0.5)),
        ("frequency_penalty", json!(-1.0)),
        ("logit_bias", json!({})),
        ("response_format", json!({"type": "text"})),
        ("tools", json!([])),
        ("top_k", json!(5)),
        ("ignore_eos", json!(true)),
        ("min_tokens", json!(3)),
    ] {
        neutral[k] = v;
    }
    let r = chat(neutral).unwrap();
    assert_eq!((r.ignore_eos, r.min_tokens), (true, 3));
    assert!(r.logit_bias.is_empty());
    let predicted =
        |prediction: Value| chat(json!({"messages": base["messages"], "prediction": prediction}));
    let text = json!({"type": "content", "content": "fn main() {}"});
    assert_eq!(predicted(text).unwrap().prediction, "fn main() {}");
    let part = |text: &str| json!({"type": "text", "text": text});
    let parts = json!({"type": "content", "content": [part("a"), part("b")]});
    assert_eq!(predicted(parts).unwrap().prediction, "ab");
    assert_eq!(
        predicted(json!({"type": "audio"})).unwrap_err().param,
        "prediction"
    );
    assert_eq!(predicted(json!("text")).unwrap_err().param, "prediction");
    let biased = chat(json!({"messages": base["messages"], "logit_bias": {"7": -100, "3": 2.5}}));
    assert_eq!(
        biased.unwrap().logit_bias,
        HashMap::from([(7, -100.0), (3, 2.5)])
    );
    assert_eq!(
        (r.top_k, r.presence_penalty, r.frequency_penalty),
        (5, 0.5, -1.0)
    );
    assert_eq!(with("logprobs", json!(3)).param, "logprobs");
    assert_eq!(
        with("speculation", json!("fastest")).message,
        "speculation: unknown method \"fastest\" (auto, draft_model, ngram, none)"
    );
    assert!(chat(base.clone()).is_ok());
    assert_eq!(with("echo", json!(true)).message, "echo: completions only");
}

/// vLLM's parameters duet does not take are refused away from their defaults
/// (`unhonoured`), on either endpoint.
#[test]
fn vllms_parameters_duet_does_not_take_are_refused() {
    let body = |k: &str, v: Value| json!({"messages": [{"role": "user", "content": "x"}], k: v});
    let e = chat(body("use_beam_search", json!(true))).unwrap_err();
    assert_eq!(e.param, "use_beam_search");
    assert!(chat(body("add_generation_prompt", json!(true))).is_ok());
    let e = completions(json!({"prompt": "x", "bad_words": ["y"]})).unwrap_err();
    assert_eq!(e.param, "bad_words");
}

/// vLLM's sampling parameters duet takes: `min_p`, `repetition_penalty` (unset: 1,
/// none), `stop_token_ids`, `include_stop_str_in_output`, `skip_special_tokens` (unset:
/// unset, which the coordinator reads as true), `cache_salt` and `priority`.
#[test]
fn vllms_sampling_parameters_are_taken() {
    let messages = json!([{"role": "user", "content": "x"}]);
    let r = chat(
        json!({"messages": messages, "min_p": 0.05, "repetition_penalty": 1.1,
                        "stop_token_ids": [7, 9], "include_stop_str_in_output": true,
                        "skip_special_tokens": false, "cache_salt": "s", "priority": -2}),
    );
    let r = r.unwrap();
    assert_eq!((r.min_p, r.repetition_penalty), (0.05, 1.1));
    assert_eq!(r.stop_token_ids, [7, 9]);
    assert!(r.include_stop_str_in_output);
    assert_eq!(r.skip_special_tokens, Some(false));
    assert_eq!((r.cache_salt.as_str(), r.priority), ("s", -2));
    let plain = chat(json!({"messages": messages})).unwrap();
    assert_eq!((plain.min_p, plain.repetition_penalty), (0.0, 1.0));
    assert!(plain.stop_token_ids.is_empty());
    assert_eq!(plain.skip_special_tokens, None);
    assert_eq!((plain.cache_salt.as_str(), plain.priority), ("", 0));
}

/// A completion's `suffix` goes to each prompt's request (the coordinator checks it); not
/// with `echo`.
#[test]
fn a_suffix_goes_to_each_prompt() {
    let each = completions(json!({"prompt": ["a", "b"], "suffix": "z"})).unwrap();
    let suffixes: Vec<_> = each.iter().map(|r| r.suffix.as_deref()).collect();
    assert_eq!(suffixes, [Some("z"), Some("z")]);
    let plain = completions(json!({"prompt": "a"})).unwrap();
    assert_eq!(plain[0].suffix, None);
    let e = completions(json!({"prompt": "a", "suffix": "z", "echo": true})).unwrap_err();
    assert_eq!(
        (e.param, e.message.as_str()),
        ("suffix", "suffix: not with echo")
    );
}

fn completions(body: Value) -> Result<Vec<pb::GenerateRequest>, Unsupported> {
    serde_json::from_value::<CompletionRequest>(body)
        .unwrap()
        .to_requests()
}

/// A completions prompt is text or token ids, or a list of either: one request each, in
/// order, up to 64 generations (prompts times `n`), and no more than the server runs at
/// once. An echoed prompt with `logprobs`
/// asks for the prompt's figures, with as many most likely tokens'.
#[test]
fn each_prompt_of_a_completions_request_is_a_request_of_its_own() {
    use pb::generate_request::Input;
    let tokens = |ids: &[u32]| Some(Input::PromptTokenIds(pb::TokenIds { ids: ids.to_vec() }));
    let inputs = |body| -> Vec<_> {
        let requests = completions(body).unwrap();
        requests.into_iter().map(|r| r.input).collect()
    };
    let text = |t: &str| Some(Input::Prompt(t.into()));
    assert_eq!(inputs(json!({"prompt": "a"})), [text("a")]);
    assert_eq!(
        inputs(json!({"prompt": ["a", "b"]})),
        [text("a"), text("b")]
    );
    assert_eq!(inputs(json!({"prompt": [1, 2]})), [tokens(&[1, 2])]);
    let lists = inputs(json!({"prompt": [[1, 2], [3]]}));
    assert_eq!(lists, [tokens(&[1, 2]), tokens(&[3])]);
    let echoed = completions(json!({"prompt": "a", "echo": true, "logprobs": 2})).unwrap();
    assert_eq!(
        (echoed[0].top_logprobs, echoed[0].prompt_logprobs),
        (2, Some(2))
    );
    let echoed = completions(json!({"prompt": "a", "echo": true})).unwrap();
    assert_eq!(echoed[0].prompt_logprobs, None);
    let unechoed = completions(json!({"prompt": "a", "logprobs": 1})).unwrap();
    assert_eq!(unechoed[0].prompt_logprobs, None);
    let e = too_many(9, 8, 256).unwrap();
    let why = "prompt: 72 generations (prompts times n); at most 64 at once";
    assert_eq!((e.param, e.message.as_str()), ("prompt", why));
    let e = too_many(1, 16, 8).unwrap();
    assert_eq!(
        e.message,
        "n: 16 generations (prompts times n); at most 8 at once"
    );
    assert_eq!((too_many(8, 8, 64), too_many(1, 8, 8)), (None, None));
}

/// A chat choice's thought is its message's `reasoning_content`, unless the request left it
/// out (vLLM's `include_reasoning` false).
#[test]
fn a_thought_is_answered_unless_left_out() {
    let mut h = Header {
        kind: Kind::Chat,
        id: "chatcmpl-1".into(),
        created: 5,
        model: "m".into(),
        include_reasoning: true,
    };
    let choice = |h: &Header| h.choice(0, ("ok", "hm"), (Some("stop"), &[]), Value::Null);
    let message = json!({"role": "assistant", "content": "ok", "reasoning_content": "hm"});
    assert_eq!(choice(&h)["message"], message);
    h.include_reasoning = false;
    let message = json!({"role": "assistant", "content": "ok"});
    assert_eq!(choice(&h)["message"], message);
    assert_eq!(h.thought("hm"), "");
    let body = json!({"messages": [], "include_reasoning": false});
    let read = serde_json::from_value::<ChatRequest>(body).unwrap();
    assert_eq!(read.common.include_reasoning, Some(false));
}

#[test]
fn answers_have_openais_shapes() {
    let h = Header {
        kind: Kind::Chat,
        id: "chatcmpl-1".into(),
        created: 5,
        model: "m".into(),
        include_reasoning: true,
    };
    assert_eq!(
        h.chunk(0, "Hel", true, None, Value::Null),
        json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 5, "model": "m",
               "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hel"}, "logprobs": null, "finish_reason": null}]})
    );
    assert_eq!(
        h.chunk(0, "", false, Some("stop"), Value::Null)["choices"][0]["delta"],
        json!({})
    );
    assert_eq!(
        h.usage_chunk(json!({"total_tokens": 3}))["choices"],
        json!([])
    );
    let c = Header {
        kind: Kind::Completion,
        ..h
    };
    let choices = vec![
        c.choice(0, ("hi", ""), (Some("length"), &[]), json!({"tokens": []})),
        c.choice(1, ("ho", ""), (Some("stop"), &[]), Value::Null),
    ];
    let r = c.response(choices, json!({}));
    assert_eq!(r["choices"][0]["logprobs"], json!({"tokens": []}));
    assert_eq!(r["choices"][1]["index"], 1);
    assert_eq!(
        c.chunk(2, "x", false, None, Value::Null)["choices"][0]["index"],
        2
    );
    assert_eq!(r["object"], "text_completion");
    assert_eq!(r["choices"][0]["text"], "hi");
    assert_eq!(r["choices"][0]["finish_reason"], "length");
    assert_eq!(
        finish_reason(Some(pb::FinishReason::Eos as i32)),
        Some("stop")
    );
    assert_eq!(
        finish_reason(Some(pb::FinishReason::Cancelled as i32)),
        Some("abort")
    );
}

/// vLLM's `stop_reason`: the stop string where one ended the choice, else the stop token,
/// else null.
#[test]
fn the_stop_reason_is_the_stop_string_or_token() {
    assert_eq!(stop_reason("##", None), json!("##"));
    assert_eq!(stop_reason("", Some(7)), json!(7));
    assert_eq!(stop_reason("", None), Value::Null);
}
