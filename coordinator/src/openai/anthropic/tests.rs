use super::*;

fn request(body: Value) -> Result<pb::GenerateRequest, Unsupported> {
    serde_json::from_value::<MessagesRequest>(body)
        .unwrap()
        .to_request()
}

fn chat(body: Value) -> pb::GenerateRequest {
    serde_json::from_value::<ChatRequest>(body)
        .unwrap()
        .to_request()
        .unwrap()
}

/// A Messages request is the chat request of the same conversation: the system prompt a
/// system message, an assistant turn's text and `tool_use` blocks one message with its
/// calls (its thinking left out), a user turn's `tool_result` blocks tool messages before
/// its text, custom tools as functions, `tool_choice` and `thinking` as chat's, `model` as
/// chat's (an adapter's name where it is one).
#[test]
fn a_messages_request_is_the_chat_request_of_its_conversation() {
    let schema = json!({"type": "object", "properties": {"city": {"type": "string"}}});
    let messages = request(json!({
        "model": "claude-x", "max_tokens": 20, "temperature": 0.5, "top_p": 0.9, "top_k": 7,
        "stop_sequences": ["\n\nHuman:"], "metadata": {"user_id": "u"}, "seed": 3,
        "system": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief.",
                    "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Call w.", "signature": "x"},
                {"type": "text", "text": "Looking."},
                {"type": "tool_use", "id": "toolu_1", "name": "w", "input": {"city": "Paris"}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1",
                 "content": [{"type": "text", "text": "sunny"}]},
                {"type": "text", "text": "And tomorrow?"},
            ]},
        ],
        "tools": [{"name": "w", "description": "weather", "input_schema": schema}],
        "tool_choice": {"type": "tool", "name": "w", "disable_parallel_tool_use": true},
        "thinking": {"type": "disabled"},
        "output_config": {"effort": "low", "format": {"type": "json_schema", "schema": schema}},
    }));
    let as_chat = chat(json!({
        "model": "claude-x",
        "max_tokens": 20, "temperature": 0.5, "top_p": 0.9, "top_k": 7, "seed": 3,
        "stop": ["\n\nHuman:"],
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "Looking.", "tool_calls": [{"id": "toolu_1",
             "type": "function",
             "function": {"name": "w", "arguments": "{\"city\":\"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
            {"role": "user", "content": "And tomorrow?"},
        ],
        "tools": [{"type": "function", "function": {"name": "w", "description": "weather",
                   "parameters": schema}}],
        "tool_choice": {"type": "function", "function": {"name": "w"}},
        "parallel_tool_calls": false,
        "chat_template_kwargs": {"enable_thinking": false},
        "response_format": {"type": "json_schema", "json_schema": {"schema": schema}},
    }));
    assert_eq!(messages, Ok(as_chat));
    let plain = request(
        json!({"max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}],
                               "tool_choice": {"type": "any"}, "thinking": {"type": "enabled",
                               "budget_tokens": 1024}}),
    );
    let user = json!({"max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}],
                      "tool_choice": "required",
                      "chat_template_kwargs": {"enable_thinking": true}});
    assert_eq!(plain, Ok(chat(user)));
    let adaptive = request(
        json!({"max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}],
                                  "thinking": {"type": "adaptive"}}),
    );
    let user = json!({"max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}]});
    assert_eq!(adaptive, Ok(chat(user)));
}

/// What the Messages API asks of a text server it cannot do is refused, naming the
/// parameter: images, Anthropic's own tools, MCP servers; and `max_tokens` is required.
#[test]
fn what_a_text_server_cannot_do_is_refused_naming_it() {
    let hi = json!([{"role": "user", "content": "Hi"}]);
    let refused = |mut body: Value| {
        body["messages"] = body.get("messages").cloned().unwrap_or(hi.clone());
        body["max_tokens"] = body.get("max_tokens").cloned().unwrap_or(json!(5));
        request(body).unwrap_err().message
    };
    assert_eq!(
        refused(json!({"max_tokens": null})),
        "max_tokens: is required"
    );
    let image = json!({"type": "image", "source": {"type": "base64", "data": "x"}});
    assert_eq!(
        refused(json!({"messages": [{"role": "user", "content": [image]}]})),
        "messages: user turns hold text and tool_result blocks, not image"
    );
    assert_eq!(
        refused(json!({"messages": [{"role": "assistant", "content": [
            {"type": "tool_result", "tool_use_id": "t", "content": "x"}]}, hi[0]]})),
        "messages: assistant turns hold text, tool_use and thinking blocks, not tool_result"
    );
    assert_eq!(
        refused(json!({"messages": [{"role": "system", "content": "Be brief."}]})),
        "messages: roles are user and assistant"
    );
    let prefill = json!([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "("}]);
    assert_eq!(
        refused(json!({"messages": prefill})),
        "messages: the last turn is the user's: continuing an assistant turn is not supported"
    );
    assert_eq!(
        refused(json!({"messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t", "content": [image]}]}]})),
        "messages: a text or text blocks"
    );
    assert_eq!(
        refused(json!({"tools": [{"type": "web_search_20250305", "name": "web_search"}]})),
        "tools: custom tools only, each with a name (this server runs none of Anthropic's)"
    );
    assert_eq!(
        refused(json!({"tool_choice": {"type": "tool"}})),
        r#"tool_choice: {"type": "auto" | "any" | "none"} or {"type": "tool", "name"}"#
    );
    assert_eq!(
        refused(json!({"thinking": {"type": "sometimes"}})),
        "thinking: type enabled, disabled, adaptive or between_tools"
    );
    assert_eq!(
        refused(json!({"output_config": {"format": {"type": "regex"}}})),
        "output_config: format of type json_schema, with its schema"
    );
    assert_eq!(
        refused(json!({"mcp_servers": [{"type": "url", "url": "http://x"}]})),
        "mcp_servers: this server reaches no MCP server"
    );
}

/// A finished message's content: a thinking model's thought, the text before any calls,
/// then each call with its input as JSON; why it stopped; Anthropic's usage, whose input
/// tokens leave out those read from the cache.
#[test]
fn a_message_object_has_anthropics_shape() {
    let reply = Reply::new("m.gguf".into());
    assert!(reply.id.starts_with("msg_"));
    let call = pb::ToolCall {
        id: "call_1".into(),
        name: "w".into(),
        arguments: r#"{"city": "Paris"}"#.into(),
    };
    let calls = std::slice::from_ref(&call);
    let content = reply.content("Sure. <tool_call>{...}</tool_call>", "Use w.", calls);
    assert_eq!(
        content,
        [
            json!({"type": "thinking", "thinking": "Use w.", "signature": ""}),
            json!({"type": "text", "text": "Sure."}),
            json!({"type": "tool_use", "id": "call_1", "name": "w",
                   "input": {"city": "Paris"}}),
        ]
    );
    assert_eq!(
        reply.content("", "", &[]),
        [json!({"type": "text", "text": ""})]
    );
    let ends = [
        (pb::FinishReason::Eos, "", &[][..], ("end_turn", None)),
        (pb::FinishReason::Stop, "", &[], ("end_turn", None)),
        (
            pb::FinishReason::Stop,
            "##",
            &[],
            ("stop_sequence", Some("##")),
        ),
        (pb::FinishReason::Length, "", &[], ("max_tokens", None)),
        (pb::FinishReason::Cancelled, "", &[], ("pause_turn", None)),
        (pb::FinishReason::Eos, "", calls, ("tool_use", None)),
        (pb::FinishReason::Length, "", calls, ("max_tokens", None)),
    ];
    for (finish, stop, calls, (reason, sequence)) in ends {
        let end = End::of(Some(finish as i32), stop, calls);
        let want = (Some(reason), sequence.map(String::from));
        assert_eq!((end.reason, end.sequence), want, "{finish:?}");
    }
    let usage = pb::Usage {
        prompt_tokens: 40,
        prompt_tokens_cached: 32,
        completion_tokens: 3,
        ..Default::default()
    };
    let end = End::of(Some(pb::FinishReason::Stop as i32), "##", &[]);
    let message = reply.message(reply.content("abc", "", &[]), end, super::usage(&usage));
    let figures = ["input_tokens", "cache_read_input_tokens", "output_tokens"]
        .map(|key| message["usage"][key].as_u64().unwrap());
    assert_eq!(figures, [8, 32, 3]);
    assert_eq!(
        message["usage"]["output_tokens_details"]["thinking_tokens"],
        0
    );
    let head = ["type", "role", "model", "stop_reason", "stop_sequence"]
        .map(|key| message[key].as_str().unwrap());
    assert_eq!(
        head,
        ["message", "assistant", "m.gguf", "stop_sequence", "##"]
    );
}

/// Each refusal's status keeps its code, with Anthropic's error type.
#[test]
fn refusals_have_anthropics_error_body() {
    for (code, http, kind) in [
        (tonic::Code::InvalidArgument, 400, "invalid_request_error"),
        (tonic::Code::OutOfRange, 413, "request_too_large"),
        (tonic::Code::Unauthenticated, 401, "authentication_error"),
        (tonic::Code::ResourceExhausted, 429, "rate_limit_error"),
        (tonic::Code::Unavailable, 503, "overloaded_error"),
        (tonic::Code::DeadlineExceeded, 504, "timeout_error"),
        (tonic::Code::Internal, 500, "api_error"),
    ] {
        let (status, body) = error_body(&tonic::Status::new(code, "why"));
        assert_eq!(status.as_u16(), http, "{code:?}");
        let want = json!({"type": "error", "error": {"type": kind, "message": "why"}});
        assert_eq!(anthropic_error(status, &body), want, "{code:?}");
    }
}
