//! Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`), which
//! Anthropic's SDKs and the agents built on them (Claude Code among them) speak, as vLLM's
//! and llama.cpp's servers do. A request becomes a chat request (`ChatRequest`), so it is
//! checked, templated and generated as a chat completion is; the answer is a `message`
//! object, or with `stream: true` its events (`message_start` … `message_stop`), and a
//! refusal Anthropic's error body. The key comes in `x-api-key` (Anthropic's header) or as
//! a bearer token.

use super::wire::{
    CalledFunction, ChatMessage, ChatRequest, Common, Content, Function, OneOrMany, Tool, ToolCall,
    Unsupported, unsupported,
};
use super::{
    App, Choice, Gone, Refusal, bad_request, begin_chat, error_body, in_server_span, json_response,
};
use crate::proposals::Tenant;
use crate::service::{GenerateStream, Started};
use crate::workers::Models;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::header::AUTHORIZATION;
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use duet_proto::v1 as pb;
use futures::StreamExt;
use pb::generate_response::Event as Generated;
use serde::Deserialize;
use serde_json::{Value, json};
use std::sync::Arc;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

pub const ROUTE: &str = "/v1/messages";
pub const COUNT_TOKENS: &str = "/v1/messages/count_tokens";

/// `POST /v1/messages`, in the request's server span (from its `traceparent`).
pub async fn messages(
    State(app): State<App>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let answer = |headers, span| respond(app, headers, body, span);
    in_server_span(headers, ROUTE, answer).await
}

/// Checked as a chat completion is, answered whole or as events.
async fn respond(
    app: App,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
    span: tracing::Span,
) -> Response {
    let (tenant, request) = match accepted(&app, &headers, body) {
        Ok(both) => both,
        Err(refused) => return refuse(refused),
    };
    let one = match request.to_request() {
        Ok(one) => one,
        Err(u) => return refuse(bad_request(&u.message, Some(u.param))),
    };
    let (model, choice, started) = match begin_chat(&app, one, tenant, &span).await {
        Ok(started) => started,
        Err(status) => return refuse(error_body(&status)),
    };
    let reply = Reply::new(model);
    match request.stream {
        true => streamed(started, reply, choice),
        false => whole(started.stream, reply).await,
    }
}

/// `POST /v1/messages/count_tokens`: the prompt's tokens as a generation of the same
/// request would prefill them (its template, its tools), `{"input_tokens": n}`; its
/// `max_tokens`, where sent, is not read.
pub async fn count_tokens(
    State(app): State<App>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let request = match accepted(&app, &headers, body) {
        Ok((_, request)) => MessagesRequest {
            max_tokens: None,
            ..request
        }
        .to_chat()
        .and_then(|chat| chat.to_request()),
        Err(refused) => return refuse(refused),
    };
    let (request, models) = match (request, super::served_models(&app).await) {
        (Ok(request), Ok(models)) => (request, models),
        (Err(u), _) => return refuse(bad_request(&u.message, Some(u.param))),
        (_, Err(refused)) => return refuse(refused),
    };
    let config = app.coord.config.clone();
    let count = move || {
        let prompt = super::tokenize::prefilled(request, &config, &models)?;
        Ok(json!({"input_tokens": prompt.len()}))
    };
    match super::tokenize::tokenized(&app, count).await {
        Ok(body) => json_response(StatusCode::OK, &body),
        Err(refused) => refuse(refused),
    }
}

/// The served models, for a caller whose key (as for messages) lets it in; else why not.
pub(super) async fn served(app: &App, headers: &HeaderMap) -> Result<Arc<Models>, Refusal> {
    authorized(app, headers)?;
    super::served_models(app).await
}

/// The caller's tenant and its request, where the key lets it in and the body reads.
fn accepted(
    app: &App,
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<(Option<Tenant>, MessagesRequest), Refusal> {
    let tenant = authorized(app, headers)?;
    Ok((tenant, super::read(app, body)?))
}

/// The caller's tenant by its bearer token, or where it sends none its `x-api-key`.
fn authorized(app: &App, headers: &HeaderMap) -> Result<Option<Tenant>, Refusal> {
    let bearer = match (headers.get(AUTHORIZATION), headers.get("x-api-key")) {
        (Some(header), _) => Some(header.as_bytes().to_vec()),
        (None, Some(key)) => Some([b"Bearer ", key.as_bytes()].concat()),
        (None, None) => None,
    };
    let checked = app.auth.check(bearer.as_deref());
    checked.map_err(|status| match bearer {
        Some(_) => error_body(&status),
        None => error_body(&tonic::Status::unauthenticated(
            "this server needs a key: send `x-api-key: <key>` or `authorization: Bearer <key>`",
        )),
    })
}

/// The message object once the generation has ended.
async fn whole(stream: GenerateStream, reply: Reply) -> Response {
    let done = match duet_proto::Completion::read(stream, |_| {}).await {
        Ok(done) => done,
        Err(status) => return refuse(error_body(&status)),
    };
    let content = reply.content(&done.text, &done.reasoning, &done.tool_calls);
    let end = End::of(done.finish_reason, &done.stop_string, &done.tool_calls);
    let message = reply.message(content, end, usage(&done.usage));
    json_response(StatusCode::OK, &message)
}

/// The message's events: `message_start` (its usage: the prompt's tokens) and a `ping`; a
/// content block for each run of thought (`thinking`) or of text as it comes (with tools, no
/// text from where a call may start); each call a `tool_use` block with its input in one
/// piece; `message_delta` with why it stopped and the usage, and `message_stop`. A failure
/// is an `error` event, and ends the stream; a caller that goes away ends the generation.
fn streamed(started: Started, reply: Reply, mut choice: Choice) -> Response {
    let Started {
        mut stream,
        prompt_tokens,
    } = started;
    let (tx, rx) = mpsc::channel(8);
    tokio::spawn(async move {
        let mut blocks = Blocks {
            tx,
            started: 0,
            open: None,
            text: false,
        };
        // What the prefix cache holds of the prompt is known once the target has read it:
        // here the whole prompt counts as input, and `message_delta`'s usage splits it.
        let so_far = json!({"input_tokens": prompt_tokens, "cache_creation_input_tokens": 0,
                            "cache_read_input_tokens": 0, "output_tokens": 0});
        let unended = reply.message(Vec::new(), End::default(), so_far);
        blocks
            .send("message_start", json!({"message": unended}))
            .await?;
        blocks.send("ping", json!({})).await?;
        while let Some(message) = stream.next().await {
            match message.map(|m| m.event) {
                Ok(Some(Generated::Chunk(c))) => {
                    blocks.piece(Block::Thinking, &c.reasoning).await?;
                    blocks.piece(Block::Text, &choice.release(c.text)).await?;
                }
                Ok(Some(Generated::Finished(mut f))) => {
                    blocks.piece(Block::Thinking, &f.reasoning).await?;
                    let last = choice.last(std::mem::take(&mut f.text), &f.tool_calls);
                    blocks.piece(Block::Text, &last).await?;
                    return blocks.finish(&f).await;
                }
                Ok(None) => {}
                Err(status) => {
                    let (http, body) = error_body(&status);
                    return blocks.send("error", anthropic_error(http, &body)).await;
                }
            }
        }
        Ok::<(), Gone>(())
    });
    Sse::new(ReceiverStream::new(rx))
        .keep_alive(KeepAlive::default())
        .into_response()
}

/// The kinds of block streamed piece by piece.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Block {
    Thinking,
    Text,
}

/// A message's event stream, numbering its content blocks.
struct Blocks {
    tx: mpsc::Sender<Result<Event, std::convert::Infallible>>,
    /// Blocks started so far.
    started: usize,
    /// The kind of the last block, while it is open.
    open: Option<Block>,
    /// Whether a text block was started.
    text: bool,
}

impl Blocks {
    async fn send(&mut self, kind: &str, mut body: Value) -> Result<(), Gone> {
        body["type"] = json!(kind);
        let event = Event::default().event(kind).data(body.to_string());
        self.tx.send(Ok(event)).await.map_err(|_| Gone)
    }

    /// A piece of thought or text, in a block of its kind: the one open, or a new one.
    async fn piece(&mut self, kind: Block, piece: &str) -> Result<(), Gone> {
        if piece.is_empty() {
            return Ok(());
        }
        if self.open != Some(kind) {
            self.start(kind).await?;
        }
        let delta = match kind {
            Block::Thinking => json!({"type": "thinking_delta", "thinking": piece}),
            Block::Text => json!({"type": "text_delta", "text": piece}),
        };
        let delta = json!({"index": self.started - 1, "delta": delta});
        self.send("content_block_delta", delta).await
    }

    /// A new block of `kind`, empty, the one open before it stopped.
    async fn start(&mut self, kind: Block) -> Result<(), Gone> {
        self.stop().await?;
        let block = match kind {
            Block::Thinking => thinking(""),
            Block::Text => text(""),
        };
        self.text |= kind == Block::Text;
        self.open = Some(kind);
        let started = json!({"index": self.started, "content_block": block});
        self.started += 1;
        self.send("content_block_start", started).await
    }

    /// The open block stopped, if one is.
    async fn stop(&mut self) -> Result<(), Gone> {
        match self.open.take() {
            Some(_) => {
                let index = json!({"index": self.started - 1});
                self.send("content_block_stop", index).await
            }
            None => Ok(()),
        }
    }

    /// The end: the open block stopped (an empty text block where there was no text and
    /// no call), each call's block, why the message stopped, and its usage.
    async fn finish(&mut self, f: &pb::Finished) -> Result<(), Gone> {
        if !self.text && f.tool_calls.is_empty() {
            self.start(Block::Text).await?;
        }
        self.stop().await?;
        for call in &f.tool_calls {
            let opened = json!({"index": self.started, "content_block": tool_use(call, json!({}))});
            self.send("content_block_start", opened).await?;
            let input = json!({"type": "input_json_delta", "partial_json": call.arguments});
            let delta = json!({"index": self.started, "delta": input});
            self.send("content_block_delta", delta).await?;
            self.send("content_block_stop", json!({"index": self.started}))
                .await?;
            self.started += 1;
        }
        let end = End::of(Some(f.finish_reason), &f.stop_string, &f.tool_calls);
        let usage = f.usage.as_ref().map(usage);
        let delta = json!({"delta": {"stop_reason": end.reason, "stop_sequence": end.sequence},
                           "usage": usage});
        self.send("message_delta", delta).await?;
        self.send("message_stop", json!({})).await
    }
}

/// A Messages request. Fields clients send that change nothing here (`metadata`,
/// `service_tier`, `cache_control`: duet caches every prompt's prefix; a tool's `strict`;
/// `output_config.effort`, which a model without effort levels has no use for) are
/// ignored.
#[derive(Debug, Clone, Deserialize)]
pub struct MessagesRequest {
    /// `user` and `assistant` turns, each a text or a list of content blocks.
    pub messages: Vec<Message>,
    /// A system prompt: a text or text blocks.
    pub system: Option<Value>,
    /// Required by `/v1/messages` (not by `count_tokens`).
    pub max_tokens: Option<u32>,
    pub stop_sequences: Option<Vec<String>>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<u32>,
    #[serde(default)]
    pub stream: bool,
    /// Custom tools: `{"name", "description", "input_schema"}`.
    pub tools: Option<Vec<Value>>,
    /// `{"type": "auto" | "any" | "none"}` or `{"type": "tool", "name"}`, each with
    /// `disable_parallel_tool_use`.
    pub tool_choice: Option<Value>,
    /// `{"type": "enabled", "budget_tokens"}`, `{"type": "disabled"}`, `adaptive` or
    /// `between_tools`.
    pub thinking: Option<Value>,
    /// `{"format": {"type": "json_schema", "schema"}}`: structured output.
    pub output_config: Option<Value>,
    /// What this server cannot reach: refused where set.
    pub mcp_servers: Option<Value>,
    pub container: Option<Value>,
    /// duet's and vLLM's own, as in chat completions.
    pub seed: Option<u64>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub cache_salt: Option<String>,
    /// A LoRA adapter's name selects it (`Common::model`).
    pub model: Option<String>,
    pub priority: Option<i32>,
    pub speculation: Option<String>,
    pub num_speculative_tokens: Option<u32>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: Value,
}

impl MessagesRequest {
    /// duet's request: the chat completion request this one is.
    pub fn to_request(&self) -> Result<pb::GenerateRequest, Unsupported> {
        if self.max_tokens.is_none() {
            return Err(unsupported("max_tokens", "is required"));
        }
        self.to_chat()?.to_request()
    }

    fn to_chat(&self) -> Result<ChatRequest, Unsupported> {
        if self.mcp_servers.as_ref().is_some_and(|v| !v.is_null()) {
            return Err(unsupported(
                "mcp_servers",
                "this server reaches no MCP server",
            ));
        }
        if self.container.as_ref().is_some_and(|v| !v.is_null()) {
            return Err(unsupported("container", "this server runs no code"));
        }
        let system = match &self.system {
            None | Some(Value::Null) => None,
            Some(system) => Some(ChatMessage::text("system", &texts(system, "system")?)),
        };
        // Anthropic continues a last assistant turn (a prefill); a template renders it whole
        // and opens the next, so the answer would not continue it.
        if self.messages.last().is_some_and(|m| m.role == "assistant") {
            let why = "the last turn is the user's: continuing an assistant turn is not supported";
            return Err(unsupported("messages", why));
        }
        let mut messages: Vec<ChatMessage> = system.into_iter().collect();
        for m in &self.messages {
            turn(m, &mut messages)?;
        }
        let (tool_choice, parallel) = match &self.tool_choice {
            None | Some(Value::Null) => (None, None),
            Some(choice) => tool_choice(choice)?,
        };
        let common = Common {
            max_tokens: self.max_tokens,
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            stop: self.stop_sequences.clone().map(OneOrMany::Many),
            seed: self.seed,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            cache_salt: self.cache_salt.clone(),
            model: self.model.clone(),
            priority: self.priority,
            tools: self.tools.as_deref().map(tools).transpose()?,
            tool_choice,
            parallel_tool_calls: parallel,
            chat_template_kwargs: self.thinking()?,
            response_format: self.format()?,
            speculation: self.speculation.clone(),
            num_speculative_tokens: self.num_speculative_tokens,
            ..Common::default()
        };
        Ok(ChatRequest { messages, common })
    }

    /// `thinking` as the template's `enable_thinking` (Qwen3's switch); unset, `adaptive`
    /// or `between_tools`, the model's own default. The thought counts in `max_tokens`,
    /// which bounds it as `budget_tokens` would.
    fn thinking(&self) -> Result<Option<Value>, Unsupported> {
        let Some(thinking) = self.thinking.as_ref().filter(|t| !t.is_null()) else {
            return Ok(None);
        };
        let enabled = match thinking["type"].as_str() {
            Some("enabled") => true,
            Some("disabled") => false,
            Some("adaptive" | "between_tools") => return Ok(None),
            _ => {
                let why = "type enabled, disabled, adaptive or between_tools";
                return Err(unsupported("thinking", why));
            }
        };
        Ok(Some(json!({"enable_thinking": enabled})))
    }

    /// `output_config.format` as chat's `response_format`.
    fn format(&self) -> Result<Option<Value>, Unsupported> {
        let config = self.output_config.as_ref();
        match config.map(|c| &c["format"]).filter(|f| !f.is_null()) {
            None => Ok(None),
            Some(f) if f["type"] == "json_schema" => Ok(Some(json!({"type": "json_schema",
                "json_schema": {"schema": f["schema"]}}))),
            Some(_) => Err(unsupported(
                "output_config",
                "format of type json_schema, with its schema",
            )),
        }
    }
}

/// One turn's chat messages added to `messages`: a user turn's tool results are tool
/// messages (in their order, its text after them a user message); an assistant turn is one
/// message with its text and its calls. Thinking blocks handed back are left out, as
/// thinking models' templates render past turns without their thought.
fn turn(m: &Message, messages: &mut Vec<ChatMessage>) -> Result<(), Unsupported> {
    if !["user", "assistant"].contains(&m.role.as_str()) {
        return Err(unsupported("messages", "roles are user and assistant"));
    }
    let blocks = match &m.content {
        Value::String(text) => {
            messages.push(ChatMessage::text(&m.role, text));
            return Ok(());
        }
        Value::Array(blocks) => blocks,
        _ => {
            return Err(unsupported(
                "messages",
                "content is a text or a list of blocks",
            ));
        }
    };
    let mut said = String::new();
    let mut calls = Vec::new();
    for block in blocks {
        let field = |name: &str| block[name].as_str().unwrap_or_default().to_string();
        match (m.role.as_str(), block["type"].as_str()) {
            (_, Some("text")) => said.push_str(&field("text")),
            (_, Some("thinking" | "redacted_thinking")) => {}
            ("assistant", Some("tool_use")) => calls.push(ToolCall {
                id: field("id"),
                function: CalledFunction {
                    name: field("name"),
                    arguments: block["input"].to_string(),
                },
            }),
            ("user", Some("tool_result")) => messages.push(ChatMessage {
                tool_call_id: Some(field("tool_use_id")),
                ..ChatMessage::text("tool", &texts(&block["content"], "messages")?)
            }),
            (_, kind) => {
                let why = format!(
                    "{} turns hold text{} blocks, not {}",
                    m.role,
                    match m.role.as_str() {
                        "user" => " and tool_result",
                        _ => ", tool_use and thinking",
                    },
                    kind.unwrap_or("untyped ones"),
                );
                return Err(unsupported("messages", &why));
            }
        }
    }
    if !said.is_empty() || !calls.is_empty() || blocks.is_empty() {
        let content = (!said.is_empty() || calls.is_empty()).then_some(Content::Text(said));
        messages.push(ChatMessage {
            content,
            tool_calls: calls,
            ..ChatMessage::text(&m.role, "")
        });
    }
    Ok(())
}

/// A text, or text blocks joined (a system prompt, a tool result); `param` names it.
fn texts(value: &Value, param: &'static str) -> Result<String, Unsupported> {
    let refused = || unsupported(param, "a text or text blocks");
    match value {
        Value::Null => Ok(String::new()),
        Value::String(text) => Ok(text.clone()),
        Value::Array(blocks) => blocks
            .iter()
            .map(|b| match (b["type"].as_str(), b["text"].as_str()) {
                (Some("text"), Some(text)) => Ok(text),
                _ => Err(refused()),
            })
            .collect(),
        _ => Err(refused()),
    }
}

/// Custom tools as chat's functions.
fn tools(tools: &[Value]) -> Result<Vec<Tool>, Unsupported> {
    let tool = |t: &Value| match (t["type"].as_str(), t["name"].as_str()) {
        (None | Some("custom"), Some(name)) => Ok(Tool {
            kind: "function".into(),
            function: Function {
                name: name.into(),
                description: t["description"].as_str().unwrap_or_default().into(),
                parameters: Some(t["input_schema"].clone()).filter(|p| !p.is_null()),
            },
        }),
        _ => Err(unsupported(
            "tools",
            "custom tools only, each with a name (this server runs none of Anthropic's)",
        )),
    };
    tools.iter().map(tool).collect()
}

/// `tool_choice` as chat's, and whether calls may come several at once.
fn tool_choice(choice: &Value) -> Result<(Option<Value>, Option<bool>), Unsupported> {
    let chat = match (choice["type"].as_str(), choice["name"].as_str()) {
        (Some("auto"), _) => json!("auto"),
        (Some("any"), _) => json!("required"),
        (Some("none"), _) => json!("none"),
        (Some("tool"), Some(name)) => json!({"type": "function", "function": {"name": name}}),
        _ => {
            let why = r#"{"type": "auto" | "any" | "none"} or {"type": "tool", "name"}"#;
            return Err(unsupported("tool_choice", why));
        }
    };
    let one_at_a_time = choice["disable_parallel_tool_use"].as_bool();
    Ok((Some(chat), one_at_a_time.map(|one| !one)))
}

/// Why a message stopped: `stop_reason`, and the stop sequence where one ended it.
#[derive(Debug, Default, Clone, PartialEq)]
struct End {
    reason: Option<&'static str>,
    sequence: Option<String>,
}

impl End {
    /// A generation's end: `max_tokens` (a cut answer, whatever calls it holds, as
    /// Anthropic's), its calls (`tool_use`), a stop sequence, the model's end of turn, or,
    /// where the server stopped it while draining, `pause_turn`.
    fn of(finish: Option<i32>, stop_string: &str, calls: &[pb::ToolCall]) -> Self {
        let finish = finish.and_then(|f| pb::FinishReason::try_from(f).ok());
        let (reason, sequence) = match finish {
            Some(pb::FinishReason::Length) => ("max_tokens", None),
            _ if !calls.is_empty() => ("tool_use", None),
            Some(pb::FinishReason::Stop) if !stop_string.is_empty() => {
                ("stop_sequence", Some(stop_string.to_string()))
            }
            Some(pb::FinishReason::Cancelled) => ("pause_turn", None),
            _ => ("end_turn", None),
        };
        Self {
            reason: Some(reason),
            sequence,
        }
    }
}

/// What a message object says besides its content: its id and model.
#[derive(Debug, Clone)]
struct Reply {
    id: String,
    model: String,
}

impl Reply {
    fn new(model: String) -> Self {
        let id: u128 = rand::random();
        Self {
            id: format!("msg_{id:032x}"),
            model,
        }
    }

    /// The message object: its `content` blocks, why it stopped (none yet: `end`'s
    /// default) and its `usage`.
    fn message(&self, content: Vec<Value>, end: End, usage: Value) -> Value {
        json!({
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": end.reason,
            "stop_sequence": end.sequence,
            "usage": usage,
        })
    }

    /// The content blocks of a finished text with its thought and `calls`: the thinking
    /// block (where there is a thought), the text before the calls (none where that is
    /// empty and there are calls), then one `tool_use` block a call.
    fn content(&self, said: &str, thought: &str, calls: &[pb::ToolCall]) -> Vec<Value> {
        let said = match calls.is_empty() {
            true => said,
            false => crate::tools::content_before_calls(said),
        };
        let thinking = (!thought.is_empty()).then(|| thinking(thought));
        let said = (!said.is_empty() || calls.is_empty()).then(|| text(said));
        let input = |c: &pb::ToolCall| serde_json::from_str(&c.arguments).unwrap_or(json!({}));
        let calls = calls.iter().map(|c| tool_use(c, input(c)));
        thinking.into_iter().chain(said).chain(calls).collect()
    }
}

fn text(text: &str) -> Value {
    json!({"type": "text", "text": text})
}

/// A thought's block. Its `signature` is empty: duet hands back no thought to check.
fn thinking(thought: &str) -> Value {
    json!({"type": "thinking", "thinking": thought, "signature": ""})
}

fn tool_use(call: &pb::ToolCall, input: Value) -> Value {
    json!({"type": "tool_use", "id": call.id, "name": call.name, "input": input})
}

/// Anthropic's usage: `input_tokens` are the prompt's tokens not read from the prefix
/// cache (`cache_read_input_tokens`), as Anthropic counts them; duet's own figures under
/// `duet` as chat's has them.
fn usage(u: &pb::Usage) -> Value {
    let duet = super::wire::usage(std::slice::from_ref(u), 1)["duet"].take();
    json!({
        "input_tokens": u.prompt_tokens - u.prompt_tokens_cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": u.prompt_tokens_cached,
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"thinking_tokens": u.reasoning_tokens},
        "duet": duet,
    })
}

/// A refusal in Anthropic's shape: the same status, `{"type": "error", "error": {"type",
/// "message"}}`.
pub(super) fn refuse((status, body): Refusal) -> Response {
    json_response(status, &anthropic_error(status, &body))
}

/// Anthropic's error body of an OpenAI one with `status`.
fn anthropic_error(status: StatusCode, body: &Value) -> Value {
    let kind = match (status.as_u16(), body["error"]["type"].as_str()) {
        (413, _) => "request_too_large",
        (404, _) => "not_found_error",
        (_, Some(kind @ ("invalid_request_error" | "authentication_error"))) => kind,
        (_, Some(kind @ ("permission_error" | "rate_limit_error" | "timeout_error"))) => kind,
        (503, _) => "overloaded_error",
        _ => "api_error",
    };
    let message = &body["error"]["message"];
    json!({"type": "error", "error": {"type": kind, "message": message}})
}

#[cfg(test)]
mod tests;
