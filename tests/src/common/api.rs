//! The HTTP APIs' test helpers: requests over a real socket, their JSON and event streams,
//! the chat the HTTP tests send, and a target with a chat template of the test's.

use super::*;
use serde_json::Value;

pub fn json_of(body: &str) -> Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}"))
}

/// The `data:` payloads of a server-sent event stream.
pub fn events(body: &str) -> Vec<String> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: ").or_else(|| l.strip_prefix("data:")))
        .map(str::to_string)
        .collect()
}

/// The events of a stream whose events have names (`event:`): each name with its JSON
/// payload, whose `type` is the name.
pub fn named_events(stream: &str) -> Vec<(String, Value)> {
    let names = stream.lines().filter_map(|l| l.strip_prefix("event: "));
    let events: Vec<(String, Value)> = names
        .map(str::to_string)
        .zip(events(stream).iter().map(|e| json_of(e)))
        .collect();
    for (name, payload) in &events {
        assert_eq!(payload["type"], serde_json::json!(name), "{stream}");
    }
    events
}

/// What `tests/python/<script>` prints, run by `python` with `args` (JSON) as its
/// argument; it must succeed.
pub async fn run_python(python: &str, script: &str, args: Value) -> String {
    let script = format!("{}/python/{script}", env!("CARGO_MANIFEST_DIR"));
    let out = tokio::process::Command::new(python)
        .arg(script)
        .arg(args.to_string())
        .output()
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `body`, a JSON object, with `fields` set on it, as text.
pub fn with_fields(mut body: Value, fields: Value) -> String {
    for (key, value) in fields.as_object().unwrap() {
        body[key] = value.clone();
    }
    body.to_string()
}

/// The gRPC request of the chat the HTTP tests send: a system and a user message, AUTO, 10
/// tokens.
pub fn chat_request() -> pb::GenerateRequest {
    let message = |role: &str, content: &str| pb::ChatMessage {
        role: role.into(),
        content: content.into(),
        ..Default::default()
    };
    let messages = vec![message("system", "Be brief."), message("user", "Hi")];
    pb::GenerateRequest {
        input: Some(pb::generate_request::Input::Messages(pb::Messages {
            messages,
        })),
        max_tokens: 10,
        ..Default::default()
    }
}

/// A POST of `body` to `path`: its status and body.
pub async fn post(addr: std::net::SocketAddr, path: &str, body: &str) -> (u16, String) {
    http(addr, "POST", path, &[], body).await
}

pub async fn grpc_text(url: &str, req: pb::GenerateRequest) -> String {
    generate(url, req).await.unwrap().text
}

/// A tiny target whose chat template is `template`, and a coordinator on it alone (no
/// draft: the tiny draft's template, hashed with its vocabulary, would not match), serving.
pub async fn target_with_template(template: String) -> (tempfile::TempDir, Running, Running) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("target.gguf");
    let model = duet_engine::testing::TinyModel {
        chat_template: Some(template),
        ..Default::default()
    };
    model.write(&path).unwrap();
    let target = start_target(worker_config(&path));
    let coordinator = start_coordinator(coordinator_config(&target.url(), None));
    wait_serving(&coordinator.url(), "").await;
    (dir, target, coordinator)
}

/// A tiny target whose template opens a thought in the prompt (DeepSeek-R1's manner), a
/// coordinator on it, and gRPC's completion of `chat_request()` there: 10 tokens of thought
/// and no answer.
pub async fn thinking_target() -> (tempfile::TempDir, Running, Running, duet_proto::Completion) {
    let opens = "{% if add_generation_prompt %}{{ '<think>\\n' }}{% endif %}";
    let template = format!("{}{opens}", duet_engine::testing::CHATML_TEMPLATE);
    let (dir, target, coordinator) = target_with_template(template).await;
    let grpc = generate(&coordinator.url(), chat_request()).await.unwrap();
    assert!(
        grpc.text.is_empty() && !grpc.reasoning.is_empty(),
        "{grpc:?}"
    );
    (dir, target, coordinator, grpc)
}

/// A coordinator on `target` that asks for the bearer token `s3cret`, serving, and the
/// folder of its tokens' file.
pub async fn locked_coordinator(target: &Running) -> (tempfile::TempDir, Running) {
    let dir = tempfile::tempdir().unwrap();
    let coordinator = start_coordinator_with_tokens(&target.url(), dir.path(), "s3cret\n");
    wait_serving(&coordinator.url(), "").await;
    (dir, coordinator)
}
