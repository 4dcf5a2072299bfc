//! Ollama's API over a real socket, against the tiny stack: a chat's and a prompt's greedy
//! text is gRPC's for the same conversation, whole and as JSON lines; a tool call and a
//! thought come back in Ollama's shapes; the model is described as Ollama lists its own;
//! refusals have Ollama's error body.

use duet_e2e::common::*;
use duet_proto::v1 as pb;
use serde_json::{Value, json};

/// The objects of a JSON-lines answer.
fn lines(body: &str) -> Vec<Value> {
    body.lines().map(json_of).collect()
}

/// The JSON-lines objects' `field` (a path: `message/content`) joined.
fn joined(objects: &[Value], path: &str) -> String {
    let field = |o: &Value| path.split('/').fold(o.clone(), |v, key| v[key].clone());
    objects
        .iter()
        .filter_map(|o| field(o).as_str().map(str::to_string))
        .collect()
}

/// The body of chat_request()'s conversation (greedy, 10 tokens) to `/api/chat`, with
/// `fields` beside it.
fn chat_body(fields: Value) -> String {
    let body = json!({"model": "qwen2.5-coder:1.5b",
                      "messages": [{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": "Hi"}],
                      "options": {"temperature": 0, "num_predict": 10}});
    with_fields(body, fields)
}

/// A chat: gRPC's text of the same conversation, whole and as JSON lines (each not done but
/// the last, which is `done` with why and the figures).
#[tokio::test]
async fn a_chat_answers_as_grpc_does() {
    let (_m, stack) = tiny_stack().await;
    let (url, addr) = (stack.coordinator.url(), stack.coordinator.http_addr);
    let chat = grpc_text(&url, chat_request()).await;
    let (status, answer) = post(addr, "/api/chat", &chat_body(json!({"stream": false}))).await;
    assert_eq!(status, 200, "{answer}");
    let answer = json_of(&answer);
    assert_eq!(
        answer["message"],
        json!({"role": "assistant", "content": chat})
    );
    assert_eq!(
        (
            &answer["done"],
            &answer["done_reason"],
            &answer["eval_count"]
        ),
        (&json!(true), &json!("length"), &json!(10))
    );
    let duet = &answer["duet"];
    let evaluated = answer["prompt_eval_count"].as_u64().unwrap();
    let cached = duet["prompt_tokens_cached"].as_u64().unwrap();
    assert_eq!(json!(evaluated + cached), duet["prompt_tokens"]);
    for figure in ["total_duration", "eval_duration"] {
        assert!(answer[figure].as_u64().unwrap() > 0, "{figure}: {answer}");
    }

    // Streamed unless `stream` is false, and not to be held back by a proxy.
    let (status, head, stream) =
        http_exchange(addr, "POST", "/api/chat", &[], &chat_body(json!({}))).await;
    assert_eq!(status, 200, "{stream}");
    let kind = ["content-type", "x-accel-buffering"].map(|name| header_of(&head, name));
    assert_eq!(kind, [Some("application/x-ndjson"), Some("no")]);
    let objects = lines(&stream);
    let (last, pieces) = objects.split_last().unwrap();
    assert!(pieces.iter().all(|o| o["done"] == false), "{stream}");
    assert_eq!(joined(pieces, "message/content"), chat);
    assert_eq!(
        (
            &last["done"],
            &last["done_reason"],
            &last["message"]["content"]
        ),
        (&json!(true), &json!("length"), &json!(""))
    );
    assert_eq!(last["eval_count"], 10);
}

/// The chat's conversation as a templated prompt with its system prompt: gRPC's chat text; a
/// raw prompt is gRPC's completion of it; an empty request only loads the model.
#[tokio::test]
async fn a_prompt_answers_as_grpc_does() {
    let (_m, stack) = tiny_stack().await;
    let (url, addr) = (stack.coordinator.url(), stack.coordinator.http_addr);
    let chat = grpc_text(&url, chat_request()).await;
    let options = json!({"temperature": 0, "num_predict": 10});
    let prompt = json!({"prompt": "Hi", "system": "Be brief.", "options": options});
    let (status, answer) = post(
        addr,
        "/api/generate",
        &with_fields(prompt, json!({"stream": false})),
    )
    .await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(json_of(&answer)["response"], chat);
    let raw = json!({"prompt": "the cat", "raw": true, "options": options});
    let (status, stream) = post(addr, "/api/generate", &raw.to_string()).await;
    assert_eq!(status, 200, "{stream}");
    let completion = pb::GenerateRequest {
        input: Some(pb::generate_request::Input::Prompt("the cat".into())),
        max_tokens: 10,
        ..Default::default()
    };
    assert_eq!(
        joined(&lines(&stream), "response"),
        grpc_text(&url, completion).await
    );

    for (path, body, reason) in [
        ("/api/generate", json!({"model": "m"}), "load"),
        (
            "/api/generate",
            json!({"model": "m", "keep_alive": 0}),
            "unload",
        ),
        ("/api/chat", json!({"model": "m", "messages": []}), "load"),
    ] {
        let (status, answer) = post(addr, path, &body.to_string()).await;
        assert_eq!(status, 200, "{answer}");
        let answer = json_of(&answer);
        assert_eq!(
            (&answer["done"], &answer["done_reason"]),
            (&json!(true), &json!(reason))
        );
    }
}

/// A required call (duet's `tool_choice`) is the message's `tool_calls`, its arguments an
/// object, whole and streamed (the calls in one object before the last); the call and its
/// result go back as Ollama's messages, answered.
#[tokio::test]
async fn a_tool_call_comes_in_ollamas_shape_and_its_result_goes_back() {
    let (_m, stack) = tiny_stack().await;
    let addr = stack.coordinator.http_addr;
    let schema = json!({"properties": {"c": {"enum": ["P"]}}, "additionalProperties": false});
    let tools = json!([{"type": "function", "function": {"name": "w", "parameters": schema}}]);
    let ask = json!([{"role": "user", "content": "w?"}]);
    let called = |messages: &Value, stream: bool| {
        json!({"messages": messages, "stream": stream, "tools": tools,
               "tool_choice": "required", "options": {"temperature": 0, "num_predict": 64}})
        .to_string()
    };
    let (status, answer) = post(addr, "/api/chat", &called(&ask, false)).await;
    assert_eq!(status, 200, "{answer}");
    let answer = json_of(&answer);
    let calls = &answer["message"]["tool_calls"];
    let call = &calls[0];
    assert_eq!(
        (&call["function"]["index"], &call["function"]["name"]),
        (&json!(0), &json!("w"))
    );
    assert!(call["function"]["arguments"].is_object(), "{answer}");
    assert!(call["id"].as_str().unwrap().starts_with("call"), "{answer}");

    let (status, stream) = post(addr, "/api/chat", &called(&ask, true)).await;
    assert_eq!(status, 200, "{stream}");
    let objects = lines(&stream);
    let with_calls: Vec<&Value> = (objects.iter())
        .filter(|o| o["message"].get("tool_calls").is_some())
        .collect();
    assert_eq!(with_calls.len(), 1, "{stream}");
    let streamed = &with_calls[0]["message"]["tool_calls"];
    assert_eq!(streamed[0]["function"], call["function"]);
    assert_eq!(objects.last().unwrap()["done"], true);

    let answered = json!([ask[0], answer["message"],
                          {"role": "tool", "content": "sunny", "tool_name": "w"}]);
    let next = json!({"messages": answered, "stream": false,
                      "options": {"temperature": 0, "num_predict": 4}});
    let (status, answer) = post(addr, "/api/chat", &next.to_string()).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(json_of(&answer)["eval_count"], 4);
}

/// A thinking model's thought (a template that opens it in the prompt, DeepSeek-R1's
/// manner: 10 tokens of thought and no answer) is the message's `thinking`, whole and
/// streamed; a model whose template writes no thought is not asked to think.
#[tokio::test]
async fn a_thought_is_the_messages_thinking() {
    let (_dir, _target, coordinator, grpc) = thinking_target().await;
    let addr = coordinator.http_addr;
    let (status, answer) = post(addr, "/api/chat", &chat_body(json!({"stream": false}))).await;
    assert_eq!(status, 200, "{answer}");
    let message = json!({"role": "assistant", "content": "", "thinking": grpc.reasoning});
    assert_eq!(json_of(&answer)["message"], message);
    let (status, stream) = post(addr, "/api/chat", &chat_body(json!({}))).await;
    assert_eq!(status, 200, "{stream}");
    let objects = lines(&stream);
    assert_eq!(joined(&objects, "message/thinking"), grpc.reasoning);
    assert_eq!(joined(&objects, "message/content"), "");

    let plain = "{% for message in messages %}{{ message['content'] }}{% endfor %}";
    let (_dir, _target, coordinator) = target_with_template(plain.into()).await;
    let asked = chat_body(json!({"think": true}));
    let (status, refused) = post(coordinator.http_addr, "/api/chat", &asked).await;
    assert_eq!(
        (status, json_of(&refused)),
        (
            400,
            json!({"error": "\"target.gguf\" does not support thinking"})
        )
    );
}

/// The served model as Ollama lists, shows and runs its own: its name as `/v1/models` gives
/// it, its file's size, weights and storage, its architecture, context and capabilities.
#[tokio::test]
async fn the_model_is_described_as_ollama_lists_its_own() {
    let (m, stack) = tiny_stack().await;
    let addr = stack.coordinator.http_addr;
    let get = |path: &'static str| async move {
        let (status, body) = http(addr, "GET", path, &[], "").await;
        assert_eq!(status, 200, "{body}");
        json_of(&body)
    };
    let name = get("/v1/models").await["data"][0]["id"].clone();
    let facts = duet_engine::file_facts(&m.target).unwrap();
    let details = json!({"parent_model": "", "format": "gguf", "family": "qwen2",
                         "families": ["qwen2"], "parameter_size": "129K",
                         "quantization_level": "Q8_0"});
    assert_eq!(
        facts.parameters, 128_640,
        "the tiny target's weights changed: {facts:?}"
    );
    let tags = get("/api/tags").await;
    let listed = &tags["models"][0];
    assert_eq!((&listed["name"], &listed["model"]), (&name, &name));
    assert_eq!(listed["size"], facts.bytes);
    assert_eq!(listed["details"], details);
    assert_eq!(
        listed["capabilities"],
        json!(["completion", "tools", "thinking"])
    );
    assert_eq!(listed["digest"].as_str().unwrap().len(), 64);

    let (status, shown) = post(addr, "/api/show", &json!({"model": "anything"}).to_string()).await;
    assert_eq!(status, 200, "{shown}");
    let shown = json_of(&shown);
    assert_eq!(shown["details"], details);
    let vocab = duet_engine::Tokenizer::load(&m.target)
        .unwrap()
        .vocab_size();
    let info = json!({"general.architecture": "qwen2", "general.parameter_count": 128_640,
                      "qwen2.context_length": 256, "qwen2.vocab_size": vocab});
    assert_eq!(shown["model_info"], info);
    assert_eq!(shown["template"], duet_engine::testing::CHATML_TEMPLATE);

    let running = get("/api/ps").await;
    let running = &running["models"][0];
    assert_eq!(
        (&running["name"], &running["context_length"]),
        (&name, &json!(256))
    );
    // The tiny stack's target runs on the CPU: none of it in a GPU's memory.
    assert_eq!(
        (&running["size"], &running["size_vram"]),
        (&json!(facts.bytes), &json!(0))
    );
    assert_eq!(get("/api/version").await, json!({"version": "0.13.0"}));
    // The root answers as Ollama's does, for its command line's check (`HEAD /`).
    for method in ["GET", "HEAD"] {
        let (status, body) = http(addr, method, "/", &[], "").await;
        assert_eq!(status, 200, "{method}: {body}");
        let want = if method == "GET" {
            "duet is running (Ollama's API: /api/chat, /api/generate, /api/tags)"
        } else {
            ""
        };
        assert_eq!(body, want);
    }
}

/// A POST of `body` to `path` with `headers`: its status and JSON answer.
async fn posted(
    addr: std::net::SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    body: String,
) -> (u16, Value) {
    let (status, answer) = http(addr, "POST", path, headers, &body).await;
    (status, json_of(&answer))
}

const KEY: &[(&str, &str)] = &[("authorization", "Bearer s3cret")];

/// Refusals have Ollama's body (`{"error"}`) and the gRPC code's status: a field duet
/// cannot honour, a body that does not parse, a missing or wrong token.
#[tokio::test]
async fn refusals_have_ollamas_body() {
    let m = tiny_models();
    let target = start_target(worker_config(&m.target));
    let (_dir, coordinator) = locked_coordinator(&target).await;
    let addr = coordinator.http_addr;
    let error = |message: &str| json!({"error": message});
    let penalized = chat_body(json!({"options": {"repeat_penalty": 1.2}}));
    assert_eq!(
        posted(addr, "/api/chat", KEY, penalized).await,
        (400, error("repeat_penalty: duet does not take it"))
    );
    let (status, answer) = posted(addr, "/api/generate", KEY, "{\"prompt\": 3}".into()).await;
    assert_eq!(status, 400, "{answer}");
    assert!(
        answer["error"].as_str().unwrap().contains("invalid type"),
        "{answer}"
    );
    let missing = posted(addr, "/api/chat", &[], chat_body(json!({}))).await;
    assert_eq!(missing.0, 401);
    assert_eq!(
        missing.1.as_object().unwrap().keys().collect::<Vec<_>>(),
        ["error"]
    );
    let (status, _) = http(addr, "GET", "/api/tags", &[], "").await;
    assert_eq!(status, 401);
    // The root tells nothing but that the API serves, and asks for no token.
    assert_eq!(http(addr, "HEAD", "/", &[], "").await.0, 200);
    let (status, answer) =
        posted(addr, "/api/chat", KEY, chat_body(json!({"stream": false}))).await;
    assert_eq!((status, &answer["eval_count"]), (200, &json!(10)));
}

/// The official `ollama` Python package (tests/python/ollama_client.py) against a tiny
/// stack: a whole and a streamed chat and generation, log-probabilities, structured output,
/// the model listed, shown and running, a bad request and the key. `scripts/test` installs
/// the package (pinned) and runs this with `DUET_OLLAMA_PYTHON` set to that Python; `cargo
/// test` alone skips it (ignored).
#[tokio::test]
#[ignore = "needs the ollama package: scripts/test runs it"]
async fn the_ollama_python_client_works() {
    let python = std::env::var("DUET_OLLAMA_PYTHON")
        .expect("DUET_OLLAMA_PYTHON: a Python with the ollama package (scripts/test sets it)");
    let (_m, stack) = tiny_stack().await;
    let (_dir, locked) = locked_coordinator(&stack.target).await;
    let chat = grpc_text(&stack.coordinator.url(), chat_request()).await;
    let addr = stack.coordinator.http_addr;
    let (_, models) = http(addr, "GET", "/v1/models", &[], "").await;
    let args = json!({
        "host": format!("http://{addr}"),
        "key_host": format!("http://{}", locked.http_addr),
        "key": "s3cret",
        "model": json_of(&models)["data"][0]["id"],
        "chat": chat,
    });
    let out = run_python(&python, "ollama_client.py", args).await;
    assert_eq!(out, "ollama client: ok\n");
}
