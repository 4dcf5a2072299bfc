//! Anthropic's Messages API over a real socket, against the tiny stack: its greedy text is
//! gRPC's for the same conversation, whole and as events; a stop sequence, a tool call and a
//! thought come back in Anthropic's shapes; `count_tokens` counts what a generation
//! prefills; the models are listed in Anthropic's shape; the key comes in `x-api-key`;
//! refusals have Anthropic's error body.

use duet_e2e::common::*;
use duet_proto::v1 as pb;
use serde_json::{Value, json};

/// The events' names, in order.
fn names(events: &[(String, Value)]) -> Vec<&str> {
    events.iter().map(|(name, _)| name.as_str()).collect()
}

/// The streamed deltas' `field` (`text`, `thinking`, `partial_json`) joined.
fn deltas(events: &[(String, Value)], field: &str) -> String {
    (events.iter())
        .filter_map(|(_, e)| e["delta"][field].as_str())
        .collect()
}

/// The body of chat_request()'s conversation, 10 tokens at most, with `fields` beside it.
fn body(fields: Value) -> String {
    let body = json!({"model": "claude-sonnet-4-5", "max_tokens": 10, "system": "Be brief.",
                      "messages": [{"role": "user", "content": "Hi"}]});
    with_fields(body, fields)
}

/// A whole message and a streamed one: gRPC's text of the same chat, cut by max_tokens;
/// the stream's events in Anthropic's order, its `message_start` counting the prompt;
/// `count_tokens` the prompt's tokens the generation reported (read from the cache or not).
#[tokio::test]
async fn messages_answer_as_chat_completions_do() {
    let (_m, stack) = tiny_stack().await;
    let (url, addr) = (stack.coordinator.url(), stack.coordinator.http_addr);
    let chat = generate(&url, chat_request()).await.unwrap().text;
    let (status, answer) = post(addr, "/v1/messages", &body(json!({}))).await;
    assert_eq!(status, 200, "{answer}");
    let answer = json_of(&answer);
    assert!(answer["id"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(
        (&answer["type"], &answer["role"]),
        (&json!("message"), &json!("assistant"))
    );
    assert_eq!(answer["content"], json!([{"type": "text", "text": chat}]));
    assert_eq!(
        (&answer["stop_reason"], &answer["stop_sequence"]),
        (&json!("max_tokens"), &Value::Null)
    );
    assert_eq!(answer["usage"]["output_tokens"], 10);

    let (status, stream) = post(addr, "/v1/messages", &body(json!({"stream": true}))).await;
    assert_eq!(status, 200, "{stream}");
    let events = named_events(&stream);
    let kinds = names(&events);
    let mut want = vec!["message_start", "ping", "content_block_start"];
    want.extend(std::iter::repeat_n("content_block_delta", kinds.len() - 6));
    want.extend(["content_block_stop", "message_delta", "message_stop"]);
    assert_eq!(kinds, want);
    let started = &events[0].1["message"];
    assert_eq!(
        (&started["content"], &started["stop_reason"]),
        (&json!([]), &Value::Null)
    );
    assert_eq!(
        events[2].1["content_block"],
        json!({"type": "text", "text": ""})
    );
    assert_eq!(deltas(&events, "text"), chat);
    let end = &events[kinds.len() - 2].1;
    assert_eq!(end["delta"]["stop_reason"], "max_tokens");
    assert_eq!(end["usage"]["output_tokens"], 10);

    let counted = body(json!({"max_tokens": null}));
    let (status, count) = post(addr, "/v1/messages/count_tokens", &counted).await;
    assert_eq!(status, 200, "{count}");
    let usage = &answer["usage"];
    let prompt = usage["input_tokens"].as_u64().unwrap()
        + usage["cache_read_input_tokens"].as_u64().unwrap();
    assert_eq!(json_of(&count), json!({"input_tokens": prompt}));
    // Before any token, the stream's message counts the whole prompt as input.
    assert_eq!(
        started["usage"],
        json!({"input_tokens": prompt, "cache_creation_input_tokens": 0,
               "cache_read_input_tokens": 0, "output_tokens": 0})
    );
}

/// A stop sequence that comes ends the text right before it, and the message names it,
/// whole and streamed (not the first given, which never comes).
#[tokio::test]
async fn a_stop_sequence_is_named_where_it_ends_the_message() {
    let (_m, stack) = tiny_stack().await;
    let (url, addr) = (stack.coordinator.url(), stack.coordinator.http_addr);
    let free = pb::GenerateRequest {
        max_tokens: 30,
        ..chat_request()
    };
    let free = generate(&url, free).await.unwrap().text;
    let chars: Vec<char> = free.chars().collect();
    assert!(chars.len() >= 8, "too little text to cut: {free:?}");
    let stop: String = chars[5..8].iter().collect();
    let at = free.find(&stop).unwrap();
    let fields = |stream: bool| {
        body(json!({"max_tokens": 30, "stop_sequences": ["never\u{7}", stop], "stream": stream}))
    };
    let (status, answer) = post(addr, "/v1/messages", &fields(false)).await;
    assert_eq!(status, 200, "{answer}");
    let answer = json_of(&answer);
    assert_eq!(answer["content"][0]["text"], free[..at]);
    assert_eq!(
        (&answer["stop_reason"], &answer["stop_sequence"]),
        (&json!("stop_sequence"), &json!(stop))
    );
    let (status, stream) = post(addr, "/v1/messages", &fields(true)).await;
    assert_eq!(status, 200, "{stream}");
    let events = named_events(&stream);
    assert_eq!(deltas(&events, "text"), free[..at]);
    let end = &events[events.len() - 2].1["delta"];
    assert_eq!(
        *end,
        json!({"stop_reason": "stop_sequence", "stop_sequence": stop})
    );
}

/// A required call is a `tool_use` block with its input, whole and streamed (the input in
/// one `input_json_delta`); the call and its result go back as `tool_use` and
/// `tool_result` blocks, counted and answered.
#[tokio::test]
async fn a_tool_call_is_a_tool_use_block_and_its_result_goes_back() {
    let (_m, stack) = tiny_stack().await;
    let addr = stack.coordinator.http_addr;
    let schema = json!({"properties": {"c": {"enum": ["P"]}}, "additionalProperties": false});
    let ask = json!([{"role": "user", "content": "w?"}]);
    let called = |messages: &Value, stream: bool| {
        json!({"messages": messages, "max_tokens": 64, "stream": stream,
               "tools": [{"name": "w", "input_schema": schema}],
               "tool_choice": {"type": "any"}})
        .to_string()
    };
    let (status, answer) = post(addr, "/v1/messages", &called(&ask, false)).await;
    assert_eq!(status, 200, "{answer}");
    let answer = json_of(&answer);
    let call = answer["content"]
        .as_array()
        .unwrap()
        .last()
        .unwrap()
        .clone();
    assert_eq!(
        (&call["type"], &call["name"]),
        (&json!("tool_use"), &json!("w"))
    );
    assert!(call["input"].is_object(), "{answer}");
    assert_eq!(answer["stop_reason"], "tool_use");

    let (status, stream) = post(addr, "/v1/messages", &called(&ask, true)).await;
    assert_eq!(status, 200, "{stream}");
    let events = named_events(&stream);
    let opened = events
        .iter()
        .find(|(_, e)| e["content_block"]["type"] == "tool_use");
    let opened = &opened.unwrap().1["content_block"];
    assert_eq!(
        (&opened["name"], &opened["input"]),
        (&json!("w"), &json!({}))
    );
    assert_eq!(json_of(&deltas(&events, "partial_json")), call["input"]);
    assert_eq!(
        events[events.len() - 2].1["delta"]["stop_reason"],
        "tool_use"
    );

    let result = json!({"type": "tool_result", "tool_use_id": call["id"], "content": "sunny"});
    let answered = json!([ask[0], {"role": "assistant", "content": answer["content"]},
                          {"role": "user", "content": [result]}]);
    // Without the tools, which would not leave the tiny context room for the turns.
    let count = |messages: &Value| {
        let body = json!({"messages": messages}).to_string();
        async move {
            let (status, count) = post(addr, "/v1/messages/count_tokens", &body).await;
            assert_eq!(status, 200, "{count}");
            json_of(&count)["input_tokens"].as_u64().unwrap()
        }
    };
    assert!(count(&answered).await > count(&ask).await);
    let next = json!({"messages": answered, "max_tokens": 4}).to_string();
    let (status, answer) = post(addr, "/v1/messages", &next).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(json_of(&answer)["usage"]["output_tokens"], 4);
}

/// A thinking model's thought (a template that opens it in the prompt, DeepSeek-R1's
/// manner: 10 tokens of thought and no answer) is a thinking block before an empty text
/// block, whole and streamed (the thinking block stopped before the text block starts).
#[tokio::test]
async fn a_thought_is_a_thinking_block() {
    let (_dir, _target, coordinator, grpc) = thinking_target().await;
    let addr = coordinator.http_addr;
    let (status, answer) = post(addr, "/v1/messages", &body(json!({}))).await;
    assert_eq!(status, 200, "{answer}");
    let thinking = json!({"type": "thinking", "thinking": grpc.reasoning, "signature": ""});
    let empty = json!({"type": "text", "text": ""});
    assert_eq!(json_of(&answer)["content"], json!([thinking, empty]));

    let (status, stream) = post(addr, "/v1/messages", &body(json!({"stream": true}))).await;
    assert_eq!(status, 200, "{stream}");
    let events = named_events(&stream);
    assert_eq!(deltas(&events, "thinking"), grpc.reasoning);
    let blocks: Vec<(&str, &Value)> = (events.iter())
        .filter(|(name, _)| name.starts_with("content_block_s"))
        .map(|(name, e)| (name.as_str(), &e["index"]))
        .collect();
    let want = [
        ("content_block_start", &json!(0)),
        ("content_block_stop", &json!(0)),
        ("content_block_start", &json!(1)),
        ("content_block_stop", &json!(1)),
    ];
    assert_eq!(blocks, want);
}

/// With tokens set, the key comes in `x-api-key` (or as a bearer token); a missing or
/// wrong one, and a request the server refuses, get Anthropic's error body. Each call is
/// counted on the coordinator's `/metrics` by route and status.
#[tokio::test]
async fn the_key_comes_in_x_api_key_and_refusals_have_anthropics_body() {
    let m = tiny_models();
    let target = start_target(worker_config(&m.target));
    let (_dir, coordinator) = locked_coordinator(&target).await;
    let addr = coordinator.http_addr;
    let send = |key: &'static [(&'static str, &'static str)], body: String| async move {
        let (status, answer) = http(addr, "POST", "/v1/messages", key, &body).await;
        (status, json_of(&answer))
    };
    let error = |kind: &str, message: &str| {
        let error = json!({"type": kind, "message": message});
        json!({"type": "error", "error": error})
    };
    let why = "this server needs a key: send `x-api-key: <key>` or `authorization: Bearer <key>`";
    let missing = error("authentication_error", why);
    assert_eq!(send(&[], body(json!({}))).await, (401, missing));
    let wrong = send(&[("x-api-key", "wrong")], body(json!({}))).await;
    assert_eq!(
        wrong,
        (
            401,
            error("authentication_error", "the bearer token is not valid")
        )
    );
    let (status, answer) = send(&[("x-api-key", "s3cret")], body(json!({}))).await;
    assert_eq!(
        (status, &answer["usage"]["output_tokens"]),
        (200, &json!(10))
    );
    let bearer = send(&[("authorization", "Bearer s3cret")], body(json!({}))).await;
    assert_eq!(bearer.0, 200);
    let refused = send(
        &[("x-api-key", "s3cret")],
        body(json!({"max_tokens": null})),
    )
    .await;
    let required = error("invalid_request_error", "max_tokens: is required");
    assert_eq!(refused, (400, required));
    // Each call counted by its route and status; a route not served as `unmatched`.
    assert_eq!(http(addr, "GET", "/v1/nothing", &[], "").await.0, 404);
    let scrape = scrape(&coordinator).await;
    let calls = |route: &str, status: u16| {
        let name = format!("duet_http_requests_total{{route=\"{route}\",status=\"{status}\"}}");
        sample(&scrape, &name)
    };
    let counted = [401, 200, 400].map(|status| calls("/v1/messages", status));
    assert_eq!(counted, [2.0, 2.0, 1.0]);
    assert_eq!(calls("unmatched", 404), 1.0);
}

/// `GET /v1/models` and `GET /v1/models/{id}` from an Anthropic client (it sends
/// `anthropic-version`): Anthropic's list and card of the served model, the key as for
/// messages; without the header, OpenAI's list.
#[tokio::test]
async fn models_are_listed_in_anthropics_shape_to_its_clients() {
    let m = tiny_models();
    let target = start_target(worker_config(&m.target));
    let (_dir, coordinator) = locked_coordinator(&target).await;
    let get = |headers: &'static [(&'static str, &'static str)]| async move {
        let (status, answer) = http(coordinator.http_addr, "GET", "/v1/models", headers, "").await;
        (status, json_of(&answer))
    };
    let (status, openai) = get(&[("authorization", "Bearer s3cret")]).await;
    assert_eq!((status, &openai["object"]), (200, &json!("list")));
    let id = &openai["data"][0]["id"];
    let (status, refused) = get(&[("anthropic-version", "2023-06-01")]).await;
    assert_eq!(
        (status, &refused["error"]["type"]),
        (401, &json!("authentication_error"))
    );
    let (status, mut page) =
        get(&[("anthropic-version", "2023-06-01"), ("x-api-key", "s3cret")]).await;
    assert_eq!(status, 200, "{page}");
    let created = page["data"][0]["created_at"].take();
    assert!(
        created.as_str().is_some_and(|t| t.ends_with('Z')),
        "{created}"
    );
    let card = json!({"type": "model", "id": id, "display_name": id, "created_at": null});
    let want = json!({"data": [card], "has_more": false, "first_id": id, "last_id": id});
    assert_eq!(page, want);

    // Retrieved by its id, in the same shape; an unknown one is Anthropic's 404.
    let path = format!("/v1/models/{}", id.as_str().unwrap());
    let anthropic = [("anthropic-version", "2023-06-01"), ("x-api-key", "s3cret")];
    let (status, answer) = http(coordinator.http_addr, "GET", &path, &anthropic, "").await;
    let mut retrieved = json_of(&answer);
    assert_eq!(retrieved["created_at"].take(), created, "{answer}");
    assert_eq!((status, retrieved), (200, card));
    let (status, answer) = http(coordinator.http_addr, "GET", &path, &anthropic[..1], "").await;
    assert_eq!(
        (status, &json_of(&answer)["error"]["type"]),
        (401, &json!("authentication_error"))
    );
    let (status, answer) = http(
        coordinator.http_addr,
        "GET",
        "/v1/models/nope",
        &anthropic,
        "",
    )
    .await;
    let error = json!({"type": "not_found_error",
                       "message": "the model \"nope\" is not served here"});
    assert_eq!(
        (status, json_of(&answer)),
        (404, json!({"type": "error", "error": error}))
    );
}

/// The official `anthropic` Python package (tests/python/anthropic_client.py) against a
/// tiny stack: a whole and a streamed message, a stop sequence, a tool call and its
/// result, `count_tokens`, a bad request and the key. `scripts/test` installs the package
/// (pinned) and runs this with `DUET_ANTHROPIC_PYTHON` set to that Python; `cargo test`
/// alone skips it (ignored).
#[tokio::test]
#[ignore = "needs the anthropic package: scripts/test runs it"]
async fn the_anthropic_python_client_works() {
    let python = std::env::var("DUET_ANTHROPIC_PYTHON").expect(
        "DUET_ANTHROPIC_PYTHON: a Python with the anthropic package (scripts/test sets it)",
    );
    let (_m, stack) = tiny_stack().await;
    let (_dir, locked) = locked_coordinator(&stack.target).await;
    let chat = generate(&stack.coordinator.url(), chat_request()).await;
    let args = json!({
        "base_url": format!("http://{}", stack.coordinator.http_addr),
        "key_url": format!("http://{}", locked.http_addr),
        "key": "s3cret",
        "chat": chat.unwrap().text,
    });
    let out = run_python(&python, "anthropic_client.py", args).await;
    assert_eq!(out, "anthropic client: ok\n");
}
