//! The Responses API over HTTP: answers and events as chat completions give them, what
//! stopped a choice, a thought as a reasoning item, a call as a function call item.

use super::*;

/// A response's events, as (type, payload), checking each names its type and they are
/// numbered in order.
fn response_events(stream: &str) -> Vec<(String, Value)> {
    let events = named_events(stream);
    for (i, (_, payload)) in events.iter().enumerate() {
        assert_eq!(payload["sequence_number"], json!(i));
    }
    events
}

/// The Responses API over HTTP: the instructions and input of chat's conversation get
/// gRPC's greedy text for it, whole and as events (`response.created` … the message's
/// text in deltas … `response.incomplete` where `max_output_tokens` cut it).
#[tokio::test]
async fn responses_answer_as_chat_completions_do() {
    let (_m, stack) = tiny_stack().await;
    let (url, http_addr) = (stack.coordinator.url(), stack.coordinator.http_addr);
    let chat = grpc_text(&url, chat_request()).await;
    let body = |stream: bool| {
        json!({"model": "x", "instructions": "Be brief.", "input": "Hi",
               "max_output_tokens": 10, "stream": stream})
        .to_string()
    };
    let (status, answer) = post(http_addr, "/v1/responses", &body(false)).await;
    assert_eq!(status, 200, "{answer}");
    let answer = json_of(&answer);
    assert_eq!(answer["object"], "response");
    assert!(answer["id"].as_str().unwrap().starts_with("resp_"));
    let message = &answer["output"][0];
    assert_eq!(
        (&message["type"], &message["role"]),
        (&json!("message"), &json!("assistant"))
    );
    assert_eq!(message["content"][0]["text"], chat);
    assert_eq!(answer["usage"]["output_tokens"], 10);
    assert_eq!(answer["status"], "incomplete");
    assert_eq!(answer["incomplete_details"]["reason"], "max_output_tokens");

    let (status, stream) = post(http_addr, "/v1/responses", &body(true)).await;
    assert_eq!(status, 200, "{stream}");
    let events = response_events(&stream);
    let kinds: Vec<&str> = events.iter().map(|(k, _)| k.as_str()).collect();
    let deltas = kinds
        .iter()
        .filter(|k| **k == "response.output_text.delta")
        .count();
    let mut want = vec![
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ];
    want.extend(std::iter::repeat_n("response.output_text.delta", deltas));
    want.extend([
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]);
    assert_eq!(kinds, want);
    let text: String = (events.iter())
        .filter_map(|(_, e)| e["delta"].as_str())
        .collect();
    assert_eq!(text, chat);
    let last = &events.last().unwrap().1["response"];
    assert_eq!(last["output"][0]["content"][0]["text"], chat);
    assert_eq!(last["usage"]["output_tokens"], 10);
}

/// vLLM's `stop_reason`: the stop string or the stop token id that ended a choice, whole
/// and in the streamed chunk that finishes it; null at `max_tokens`.
#[tokio::test]
async fn a_choice_names_what_stopped_it() {
    let (_m, stack) = tiny_stack().await;
    let (url, addr) = (stack.coordinator.url(), stack.coordinator.http_addr);
    let free = generate(&url, request("the cat", 12, pb::SpeculationMethod::Auto));
    let free = free.await.unwrap();
    let stop: String = free.text.chars().skip(2).take(2).collect();
    let token = free.token_ids[3];
    let cases = [
        (json!({"stop": [stop]}), json!(stop)),
        (json!({"stop_token_ids": [token]}), json!(token)),
        (json!({}), Value::Null),
    ];
    for (fields, want) in cases {
        let body = |stream: bool| {
            let base = json!({"prompt": "the cat", "max_tokens": 12, "stream": stream});
            with_fields(base, fields.clone())
        };
        let (status, answer) = post(addr, "/v1/completions", &body(false)).await;
        assert_eq!(status, 200, "{answer}");
        assert_eq!(
            json_of(&answer)["choices"][0]["stop_reason"],
            want,
            "{fields}"
        );
        let (status, stream) = post(addr, "/v1/completions", &body(true)).await;
        assert_eq!(status, 200, "{stream}");
        let chunks = chunks(&stream);
        let finished = chunks
            .iter()
            .find(|c| !c["choices"][0]["finish_reason"].is_null());
        assert_eq!(
            finished.unwrap()["choices"][0]["stop_reason"],
            want,
            "{fields}"
        );
    }
}

/// A template that opens the thought in the prompt (DeepSeek-R1's manner): the completion
/// starts inside it, and with no `</think>` in 10 tokens all of it is reasoning: gRPC's
/// `reasoning`, the Responses API's reasoning item before an empty message, whole and as
/// events (the reasoning item done before the message opens).
#[tokio::test]
async fn a_thought_opened_by_the_prompt_is_a_reasoning_item() {
    let opens = "{% if add_generation_prompt %}{{ '<think>\\n' }}{% endif %}";
    let template = format!("{}{opens}", duet_engine::testing::CHATML_TEMPLATE);
    let (_dir, _target, coordinator) = target_with_template(template).await;
    let grpc = generate(&coordinator.url(), chat_request()).await.unwrap();
    assert_eq!(grpc.text, "");
    assert!(!grpc.reasoning.is_empty(), "{grpc:?}");
    assert_eq!(
        (grpc.usage.reasoning_tokens, grpc.usage.completion_tokens),
        (10, 10)
    );
    let body = |stream: bool| {
        json!({"instructions": "Be brief.", "input": "Hi", "max_output_tokens": 10,
               "stream": stream})
        .to_string()
    };
    let addr = coordinator.http_addr;
    let (status, answer) = post(addr, "/v1/responses", &body(false)).await;
    assert_eq!(status, 200, "{answer}");
    let output = &json_of(&answer)["output"];
    assert_eq!(output[0]["type"], "reasoning");
    assert_eq!(output[0]["content"][0]["text"], grpc.reasoning);
    assert_eq!(output[1]["content"][0]["text"], "");
    let usage = &json_of(&answer)["usage"];
    assert_eq!(usage["output_tokens_details"]["reasoning_tokens"], 10);

    let (status, stream) = post(addr, "/v1/responses", &body(true)).await;
    assert_eq!(status, 200, "{stream}");
    let events = response_events(&stream);
    let kinds: Vec<&str> = events.iter().map(|(k, _)| k.as_str()).collect();
    let thought: String = (events.iter())
        .filter(|(k, _)| k == "response.reasoning_text.delta")
        .filter_map(|(_, e)| e["delta"].as_str())
        .collect();
    assert_eq!(thought, grpc.reasoning);
    let done = kinds
        .iter()
        .position(|k| *k == "response.reasoning_text.done");
    let opened = kinds
        .iter()
        .rposition(|k| *k == "response.output_item.added");
    assert!(done.is_some() && done < opened, "{kinds:?}");
    let last = &events.last().unwrap().1["response"];
    let items = |output: &Value| -> Vec<(Value, Value)> {
        let items = output.as_array().unwrap().iter();
        items
            .map(|i| (i["type"].clone(), i["content"].clone()))
            .collect()
    };
    assert_eq!(items(&last["output"]), items(output));
}

/// A required call over the Responses API is a `function_call` item with its arguments,
/// whole and as events; what a server that keeps no responses cannot do is refused,
/// naming the parameter.
#[tokio::test]
async fn a_responses_call_is_a_function_call_item() {
    let (_m, stack) = tiny_stack().await;
    let http_addr = stack.coordinator.http_addr;
    // Short: the tiny model's context is 256 tokens.
    let called = |stream: bool| {
        json!({"input": [{"role": "user", "content": "w?"}], "max_output_tokens": 64,
               "tools": [{"type": "function", "name": "w", "parameters": {"properties":
                   {"c": {"enum": ["P"]}}, "additionalProperties": false}}],
               "tool_choice": "required", "stream": stream})
        .to_string()
    };
    let (status, answer) = post(http_addr, "/v1/responses", &called(false)).await;
    assert_eq!(status, 200, "{answer}");
    let answer = json_of(&answer);
    let call = &answer["output"][0];
    assert_eq!(
        (&call["type"], &call["name"]),
        (&json!("function_call"), &json!("w"))
    );
    assert!(
        json_of(call["arguments"].as_str().unwrap()).is_object(),
        "{answer}"
    );
    assert_eq!(answer["status"], "completed");
    let (status, stream) = post(http_addr, "/v1/responses", &called(true)).await;
    assert_eq!(status, 200, "{stream}");
    let events = response_events(&stream);
    let done = events
        .iter()
        .find(|(k, _)| k == "response.function_call_arguments.done");
    assert_eq!(done.unwrap().1["arguments"], call["arguments"]);
    assert_eq!(events.last().unwrap().0, "response.completed");

    let stateful = json!({"input": "Hi", "previous_response_id": "resp_1"}).to_string();
    let (status, refused) = post(http_addr, "/v1/responses", &stateful).await;
    assert_eq!(status, 400, "{refused}");
    assert_eq!(json_of(&refused)["error"]["param"], "previous_response_id");
}
