//! Ollama's API, which the Ollama libraries and the many tools built on them speak (LangChain's
//! `ChatOllama`, Open WebUI, editor assistants): `POST /api/chat` and `POST /api/generate`,
//! streamed as JSON lines unless `stream` is false, and the model's description (`/api/tags`,
//! `/api/show`, `/api/ps`, `/api/version`). A chat becomes a chat request (`ChatRequest`), a
//! templated prompt the chat of its system and user message, a raw prompt or one with a
//! `suffix` a completion (fill in the middle), so each is checked and generated as those are.
//! Ollama's sampling defaults hold (temperature 0.8, top_k 40, top_p 0.9); its options that
//! change an answer and that duet does not take are refused away from their defaults.

use super::unhonoured::differs;
use super::wire::{
    ChatMessage, ChatRequest, Common, CompletionRequest, Content, OneOrMany, Prompts, Tool,
    ToolCall, Unsupported, null_as_default, unsupported,
};
use super::{App, Choice, Gone, Refusal, authorized, bad_request, begin_chat, error_body};
use super::{in_server_span, json_response, served};
use crate::service::GenerateStream;
use crate::workers::Models;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::header::CONTENT_TYPE;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use duet_proto::v1 as pb;
use futures::StreamExt;
use pb::generate_response::Event as Generated;
use serde::Deserialize;
use serde_json::{Map, Value, json};
use std::time::SystemTime;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

pub const CHAT: &str = "/api/chat";
pub const GENERATE: &str = "/api/generate";
pub const SHOW: &str = "/api/show";
pub const TAGS: &str = "/api/tags";
pub const PS: &str = "/api/ps";
pub const VERSION: &str = "/api/version";
/// Ollama's server answers here, as Ollama's command line checks first (`HEAD /`).
pub const ROOT: &str = "/";

/// The Ollama release whose API these endpoints follow, as `/api/version` answers it:
/// clients gate features on it (thinking, tool calls streamed, log-probabilities).
const FOLLOWS: &str = "0.13.0";

/// Which of the two generating endpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Endpoint {
    Chat,
    Generate,
}

/// A request to either endpoint. `model` is not read (one is served); `keep_alive`,
/// `truncate` and `shift` (how Ollama manages its runners and an over-long context) change
/// nothing here: the models stay loaded, and a prompt the context cannot hold is refused,
/// not cut.
#[derive(Debug, Clone, Default, Deserialize)]
struct Request {
    /// `/api/chat`'s conversation.
    #[serde(default, deserialize_with = "null_as_default")]
    messages: Vec<Message>,
    /// Functions, in OpenAI's shape.
    tools: Option<Vec<Tool>>,
    /// `/api/generate`'s prompt, the text after the completion (fill in the middle), the
    /// system prompt, and whether the prompt goes to the model as it is (no template).
    #[serde(default, deserialize_with = "null_as_default")]
    prompt: String,
    suffix: Option<String>,
    system: Option<String>,
    #[serde(default)]
    raw: bool,
    /// Refused where set: a Go template, and the tokens of an earlier answer (deprecated).
    template: Option<String>,
    context: Option<Vec<u32>>,
    images: Option<Vec<Value>>,
    /// `"json"` or a JSON schema.
    format: Option<Value>,
    #[serde(default, deserialize_with = "null_as_default")]
    options: Options,
    /// Unset: true.
    stream: Option<bool>,
    /// `true`, `false`, or a level (`"low"` … `"max"`: thinking on).
    think: Option<Value>,
    /// Read for `/api/generate`'s unload answer only.
    keep_alive: Option<Value>,
    #[serde(default)]
    logprobs: bool,
    top_logprobs: Option<u32>,
    /// duet's and vLLM's own, as in chat completions (Ollama's chat has no `tool_choice`:
    /// unset, the model chooses).
    tool_choice: Option<Value>,
    speculation: Option<String>,
    cache_salt: Option<String>,
    priority: Option<i32>,
    /// A LoRA adapter's name selects it, as chat completions' `model`; any other name is
    /// the target.
    model: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize)]
struct Message {
    role: String,
    #[serde(default, deserialize_with = "null_as_default")]
    content: String,
    images: Option<Vec<Value>>,
    /// An assistant message's calls, each `{"function": {"name", "arguments": {…}}}`.
    #[serde(default, deserialize_with = "null_as_default")]
    tool_calls: Vec<Call>,
    /// A tool message: the call whose result it holds.
    tool_call_id: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
struct Call {
    #[serde(default)]
    id: String,
    function: CalledFunction,
}

#[derive(Debug, Clone, Deserialize)]
struct CalledFunction {
    name: String,
    /// An object (Ollama's), or its JSON text.
    #[serde(default)]
    arguments: Value,
}

/// Ollama's model options. How Ollama runs the model (`num_ctx`, `num_batch`, `num_gpu`,
/// `num_thread`, `num_keep`, `use_mmap`, …) changes no answer here and is not read.
#[derive(Debug, Clone, Default, Deserialize)]
struct Options {
    /// -1 (the default) or -2: as many as the server gives (`default_max_tokens`).
    num_predict: Option<i64>,
    temperature: Option<f32>,
    /// 0 or less: off.
    top_k: Option<i64>,
    top_p: Option<f32>,
    min_p: Option<f32>,
    /// Unset or negative: a fresh seed.
    seed: Option<i64>,
    stop: Option<Vec<String>>,
    /// Draft tokens a round: duet's `num_speculative_tokens`.
    draft_num_predict: Option<u32>,
    #[serde(flatten)]
    rest: Map<String, Value>,
}

/// Ollama's options that change an answer and that duet does not take, with their
/// defaults: refused where set otherwise. Its penalties count the last `repeat_last_n`
/// tokens, where duet's count the whole completion.
fn unhonoured() -> [(&'static str, Value); 5] {
    [
        ("repeat_penalty", json!(1.0)),
        ("presence_penalty", json!(0.0)),
        ("frequency_penalty", json!(0.0)),
        ("typical_p", json!(1.0)),
        ("mirostat", json!(0)),
    ]
}

impl Request {
    /// duet's request for `endpoint`; `None` where it asks only for the model to be loaded
    /// (no messages; an empty prompt without a suffix).
    fn to_request(&self, endpoint: Endpoint) -> Result<Option<pb::GenerateRequest>, Unsupported> {
        self.refuse_what_duet_cannot_honour()?;
        let common = self.common()?;
        let chat = |messages, common| ChatRequest { messages, common }.to_request().map(Some);
        match endpoint {
            Endpoint::Chat if self.messages.is_empty() => Ok(None),
            Endpoint::Chat => chat(self.messages()?, common),
            Endpoint::Generate if self.prompt.is_empty() && self.suffix.is_none() => Ok(None),
            Endpoint::Generate if self.raw || self.suffix.is_some() => {
                if self.raw && self.suffix.is_some() {
                    return Err(unsupported("suffix", "not with raw"));
                }
                let completion = CompletionRequest {
                    prompt: Prompts::Text(self.prompt.clone()),
                    suffix: self.suffix.clone(),
                    // A completion's prompt is not templated: nothing to switch thinking in.
                    common: Common {
                        chat_template_kwargs: None,
                        ..common
                    },
                };
                Ok(completion.to_requests()?.pop())
            }
            Endpoint::Generate => {
                let system = self.system.as_deref().filter(|s| !s.is_empty());
                let system = system.map(|s| ChatMessage::text("system", s));
                let user = ChatMessage::text("user", &self.prompt);
                chat(system.into_iter().chain([user]).collect(), common)
            }
        }
    }

    /// The fields chat and completion requests share, Ollama's defaults where unset.
    fn common(&self) -> Result<Common, Unsupported> {
        let o = &self.options;
        let max_tokens = match o.num_predict {
            None | Some(-2..=0) => None,
            Some(n) => Some(u32::try_from(n).map_err(|_| {
                unsupported("num_predict", "-1 (as many as the server gives) or a count")
            })?),
        };
        let seed = match o.seed {
            Some(seed) if seed >= 0 => seed as u64,
            _ => rand::random(),
        };
        Ok(Common {
            max_tokens,
            temperature: Some(o.temperature.unwrap_or(0.8).max(0.0)),
            top_k: Some(o.top_k.unwrap_or(40).clamp(0, i64::from(u32::MAX)) as u32),
            top_p: Some(o.top_p.unwrap_or(0.9)).filter(|&p| p < 1.0),
            min_p: o.min_p,
            seed: Some(seed),
            stop: o.stop.clone().map(OneOrMany::Many),
            num_speculative_tokens: o.draft_num_predict,
            logprobs: self.logprobs.then_some(json!(true)),
            top_logprobs: self.top_logprobs.filter(|_| self.logprobs),
            response_format: self.format()?,
            chat_template_kwargs: self.thinking()?.map(|on| json!({"enable_thinking": on})),
            tools: self.tools.clone(),
            tool_choice: self.tool_choice.clone(),
            speculation: self.speculation.clone(),
            cache_salt: self.cache_salt.clone(),
            priority: self.priority,
            model: self.model.clone(),
            ..Common::default()
        })
    }

    /// The conversation as chat messages: an assistant message's calls with their
    /// arguments as JSON text, a tool message with the call it answers. A message's
    /// `thinking` is left out, as thinking models' templates render past turns without it.
    fn messages(&self) -> Result<Vec<ChatMessage>, Unsupported> {
        let call = |c: &Call| ToolCall {
            id: c.id.clone(),
            function: super::wire::CalledFunction {
                name: c.function.name.clone(),
                arguments: match &c.function.arguments {
                    Value::String(text) => text.clone(),
                    Value::Null => "{}".into(),
                    arguments => arguments.to_string(),
                },
            },
        };
        let message = |m: &Message| {
            if m.images.as_ref().is_some_and(|i| !i.is_empty()) {
                return Err(unsupported("images", "this model reads text only"));
            }
            Ok(ChatMessage {
                role: m.role.clone(),
                content: Some(Content::Text(m.content.clone())),
                tool_calls: m.tool_calls.iter().map(call).collect(),
                tool_call_id: m.tool_call_id.clone(),
            })
        };
        self.messages.iter().map(message).collect()
    }

    /// `think` as the template's `enable_thinking`: unset, the model's own default; a level
    /// (`low` … `max`, which gpt-oss reads) turns it on.
    fn thinking(&self) -> Result<Option<bool>, Unsupported> {
        match &self.think {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Bool(on)) => Ok(Some(*on)),
            Some(Value::String(level)) if ["low", "medium", "high", "max"].contains(&&**level) => {
                Ok(Some(true))
            }
            Some(_) => Err(unsupported(
                "think",
                "true, false, or low, medium, high or max",
            )),
        }
    }

    /// `format` as chat's `response_format`: `"json"` any JSON object, an object a schema.
    fn format(&self) -> Result<Option<Value>, Unsupported> {
        match &self.format {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) if s.is_empty() => Ok(None),
            Some(Value::String(s)) if s == "json" => Ok(Some(json!({"type": "json_object"}))),
            Some(schema @ Value::Object(_)) => Ok(Some(
                json!({"type": "json_schema", "json_schema": {"schema": schema}}),
            )),
            Some(_) => Err(unsupported("format", "\"json\" or a JSON schema")),
        }
    }

    /// What duet cannot do is refused, naming the field, rather than left out of an answer
    /// that would look like one that did it.
    fn refuse_what_duet_cannot_honour(&self) -> Result<(), Unsupported> {
        if self.images.as_ref().is_some_and(|i| !i.is_empty()) {
            return Err(unsupported("images", "this model reads text only"));
        }
        if self.template.as_ref().is_some_and(|t| !t.is_empty()) {
            let why = "the model's own chat template renders every prompt";
            return Err(unsupported("template", why));
        }
        if self.context.as_ref().is_some_and(|c| !c.is_empty()) {
            let why =
                "an earlier answer's tokens are not taken: send the conversation to /api/chat";
            return Err(unsupported("context", why));
        }
        for (option, default) in unhonoured() {
            if differs(&self.options.rest.get(option).cloned(), &default) {
                return Err(unsupported(option, "duet does not take it"));
            }
        }
        Ok(())
    }

    /// Where an empty request unloads the model (`keep_alive` 0), which Ollama's answer names.
    fn unloads(&self) -> bool {
        match &self.keep_alive {
            Some(Value::Number(seconds)) => seconds.as_f64() == Some(0.0),
            // A duration: "0", "0s", "0m".
            Some(Value::String(d)) => d.trim_end_matches(|c: char| c.is_alphabetic()) == "0",
            _ => false,
        }
    }
}

/// `POST /api/chat`, in the request's server span.
pub async fn chat(
    State(app): State<App>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let answer = |headers, span| respond(app, headers, body, Endpoint::Chat, span);
    in_server_span(headers, CHAT, answer).await
}

/// `POST /api/generate`, in the request's server span.
pub async fn generate(
    State(app): State<App>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let answer = |headers, span| respond(app, headers, body, Endpoint::Generate, span);
    in_server_span(headers, GENERATE, answer).await
}

/// Checked as a chat or a completion is, answered whole or as JSON lines.
async fn respond(
    app: App,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
    endpoint: Endpoint,
    span: tracing::Span,
) -> Response {
    let (tenant, models, request) = match super::accepted::<Request>(&app, &headers, body).await {
        Ok(all) => all,
        Err(refused) => return refuse(refused),
    };
    if let Some(name) = &request.model {
        app.coord.learn_adapter(&models, name).await;
    }
    let reply = Reply {
        endpoint,
        model: models.answering(request.model.as_deref()).to_string(),
    };
    let one = match request.to_request(endpoint) {
        Ok(Some(one)) => one,
        Ok(None) => return json_response(StatusCode::OK, &reply.loaded(request.unloads())),
        Err(u) => return refuse(bad_request(&u.message, Some(u.param))),
    };
    // As Ollama: a model whose template writes no thought cannot be asked to think.
    if request.thinking() == Ok(Some(true)) && !models.writes_thoughts {
        let why = format!("{:?} does not support thinking", models.target_model);
        return refuse(bad_request(&why, Some("think")));
    }
    let (choice, stream) = match begin_chat(&app, one, tenant, &span).await {
        Ok((_, choice, started)) => (choice, started.stream),
        Err(status) => return refuse(error_body(&status)),
    };
    match request.stream.unwrap_or(true) {
        true => streamed(stream, reply, choice),
        false => whole(stream, reply, choice).await,
    }
}

/// The answer in one object once the generation has ended.
async fn whole(stream: GenerateStream, reply: Reply, mut choice: Choice) -> Response {
    let done = match duet_proto::Completion::read(stream, |_| {}).await {
        Ok(done) => done,
        Err(status) => return refuse(error_body(&status)),
    };
    let (text, logprobs) = choice.piece(&done.text, &done.token_ids, &done.logprobs, None);
    let said = match done.tool_calls.is_empty() {
        true => text.as_str(),
        false => crate::tools::content_before_calls(&text),
    };
    let object = reply.object(said, &done.reasoning, &done.tool_calls, logprobs);
    let answer = reply.done(object, done.finish_reason, &done.usage);
    json_response(StatusCode::OK, &answer)
}

/// The answer as JSON lines (`application/x-ndjson`): an object per round's thought and
/// text as they come (with tools, no text from where a call may start), the calls in one
/// object, and the last, `done`, with why it ended and the figures. A failure is an
/// `{"error"}` line, and ends the answer; a caller that goes away ends the generation.
fn streamed(mut stream: GenerateStream, reply: Reply, mut choice: Choice) -> Response {
    let (tx, rx) = mpsc::channel::<Result<Bytes, std::convert::Infallible>>(8);
    tokio::spawn(async move {
        let send = |object: Value| {
            let line = Bytes::from(object.to_string() + "\n");
            let tx = tx.clone();
            async move { tx.send(Ok(line)).await.map_err(|_| Gone) }
        };
        while let Some(message) = stream.next().await {
            match message.map(|m| m.event) {
                Ok(Some(Generated::Chunk(c))) => {
                    let (text, logprobs) = choice.piece(&c.text, &c.token_ids, &c.logprobs, None);
                    let text = choice.release(text);
                    if !(text.is_empty() && c.reasoning.is_empty() && logprobs.is_null()) {
                        send(reply.object(&text, &c.reasoning, &[], logprobs)).await?;
                    }
                }
                Ok(Some(Generated::Finished(mut f))) => {
                    let last = choice.last(std::mem::take(&mut f.text), &f.tool_calls);
                    if !(last.is_empty() && f.reasoning.is_empty()) {
                        send(reply.object(&last, &f.reasoning, &[], Value::Null)).await?;
                    }
                    if !f.tool_calls.is_empty() {
                        send(reply.object("", "", &f.tool_calls, Value::Null)).await?;
                    }
                    let last = reply.object("", "", &[], Value::Null);
                    let usage = f.usage.unwrap_or_default();
                    return send(reply.done(last, Some(f.finish_reason), &usage)).await;
                }
                Ok(None) => {}
                Err(status) => return send(ollama_error(&error_body(&status).1)).await,
            }
        }
        Ok::<(), Gone>(())
    });
    let body = Body::from_stream(ReceiverStream::new(rx));
    ([(CONTENT_TYPE, "application/x-ndjson")], body).into_response()
}

/// What every object of one answer carries, and how its pieces are written.
#[derive(Debug, Clone)]
struct Reply {
    endpoint: Endpoint,
    model: String,
}

impl Reply {
    /// An object of the answer, not done: text `said`, a `thought`, `calls`, and the tokens'
    /// `logprobs` (chat's shape, or null).
    fn object(&self, said: &str, thought: &str, calls: &[pb::ToolCall], logprobs: Value) -> Value {
        let mut object = json!({"model": self.model, "created_at": now()});
        match self.endpoint {
            Endpoint::Chat => {
                let mut message = json!({"role": "assistant", "content": said});
                if !thought.is_empty() {
                    message["thinking"] = json!(thought);
                }
                if !calls.is_empty() {
                    message["tool_calls"] = tool_calls(calls);
                }
                object["message"] = message;
            }
            Endpoint::Generate => {
                object["response"] = json!(said);
                if !thought.is_empty() {
                    object["thinking"] = json!(thought);
                }
            }
        }
        object["done"] = json!(false);
        if let Some(figures) = logprobs.get("content") {
            object["logprobs"] = figures.clone();
        }
        object
    }

    /// `object` as the answer's last: done, why (`length`, `stop`; `abort` where the server
    /// stopped it while draining), Ollama's figures (durations in nanoseconds; the prompt's
    /// tokens evaluated, not read from the prefix cache) and duet's own under `duet`.
    fn done(&self, mut object: Value, finish: Option<i32>, usage: &pb::Usage) -> Value {
        let t = usage.timings.unwrap_or_default();
        let nanos = |ms: f64| (ms * 1e6).round() as u64;
        let mut duet = super::wire::usage(std::slice::from_ref(usage), 1);
        duet["duet"]["prompt_tokens"] = json!(usage.prompt_tokens);
        duet["duet"]["prompt_tokens_cached"] = json!(usage.prompt_tokens_cached);
        let figures = json!({
            "done": true,
            "done_reason": super::wire::finish_reason(finish),
            "total_duration": nanos(t.total_ms),
            "prompt_eval_count": usage.prompt_tokens - usage.prompt_tokens_cached,
            "prompt_eval_duration": nanos(t.prefill_ms),
            "eval_count": usage.completion_tokens,
            "eval_duration": nanos(t.rounds_ms),
            "duet": duet["duet"].take(),
        });
        for (key, value) in figures.as_object().into_iter().flatten() {
            object[key] = value.clone();
        }
        object
    }

    /// The answer to a request for the model to be loaded (or with `keep_alive` 0, unloaded):
    /// the served models stay loaded either way.
    fn loaded(&self, unload: bool) -> Value {
        let mut object = self.object("", "", &[], Value::Null);
        object["done"] = json!(true);
        object["done_reason"] = json!(if unload { "unload" } else { "load" });
        object
    }
}

/// Calls in Ollama's shape: each with its id, and its arguments as an object.
fn tool_calls(calls: &[pb::ToolCall]) -> Value {
    let call = |(i, c): (usize, &pb::ToolCall)| {
        let arguments: Value = serde_json::from_str(&c.arguments).unwrap_or(json!({}));
        json!({"id": c.id, "function": {"index": i, "name": c.name, "arguments": arguments}})
    };
    Value::Array(calls.iter().enumerate().map(call).collect())
}

fn now() -> String {
    super::rfc3339(SystemTime::now())
}

/// `GET /` (and `HEAD /`): 200 while the API serves, as Ollama's command line checks
/// before its calls. It asks for no token, as `/health` does not, and tells nothing but
/// that.
pub async fn root() -> &'static str {
    "duet is running (Ollama's API: /api/chat, /api/generate, /api/tags)"
}

/// `GET /api/version`.
pub async fn version(State(app): State<App>, headers: HeaderMap) -> Response {
    match authorized(&app, &headers) {
        Ok(_) => json_response(StatusCode::OK, &json!({"version": FOLLOWS})),
        Err(refused) => refuse(refused),
    }
}

/// `GET /api/tags`: the model this coordinator serves, then its LoRA adapters (each with
/// the target as its `details.parent_model`), as Ollama lists its local models.
pub async fn tags(State(app): State<App>, headers: HeaderMap) -> Response {
    let models = match served(&app, &headers).await {
        Ok(models) => models,
        Err(refused) => return refuse(refused),
    };
    let target = listed(&models, app.started);
    let names = app.coord.adapters(&models).await;
    let adapters = names.iter().map(|name| {
        let mut adapter = target.clone();
        adapter["name"] = json!(name);
        adapter["model"] = json!(name);
        adapter["details"]["parent_model"] = json!(models.target_model);
        adapter
    });
    let listed: Vec<Value> = std::iter::once(target.clone()).chain(adapters).collect();
    json_response(StatusCode::OK, &json!({"models": listed}))
}

/// `GET /api/ps`: the model as Ollama lists those loaded, kept loaded while duet serves.
pub async fn ps(State(app): State<App>, headers: HeaderMap) -> Response {
    let models = match served(&app, &headers).await {
        Ok(models) => models,
        Err(refused) => return refuse(refused),
    };
    let mut model = listed(&models, app.started);
    if let Some(fields) = model.as_object_mut() {
        fields.remove("modified_at");
        fields.remove("capabilities");
    }
    // Kept loaded: an expiry far ahead. `size_vram` (what `ollama ps` reads as GPU or CPU)
    // is as the target's worker says; left out where it does not say.
    model["expires_at"] = json!("9999-12-31T23:59:59Z");
    if let Some(gpu) = models.on_gpu() {
        model["size_vram"] = json!(if gpu { models.file.bytes } else { 0 });
    }
    model["context_length"] = json!(models.context);
    json_response(StatusCode::OK, &json!({"models": [model]}))
}

/// `POST /api/show`: the served model whatever the body names (one is served): its details,
/// chat template, facts (`model_info`, which clients read its context from) and what it
/// can do.
pub async fn show(State(app): State<App>, headers: HeaderMap) -> Response {
    let models = match served(&app, &headers).await {
        Ok(models) => models,
        Err(refused) => return refuse(refused),
    };
    let file = &models.file;
    let arch = &models.architecture;
    let info = json!({
        "general.architecture": arch,
        "general.parameter_count": file.parameters,
        format!("{arch}.context_length"): models.context,
        format!("{arch}.vocab_size"): models.vocab,
    });
    let template = models.tokenizer.chat_template().unwrap_or_default();
    let body = json!({
        "modelfile": "",
        "parameters": "",
        "template": template,
        "details": details(&models),
        "model_info": info,
        "capabilities": capabilities(&models),
        "modified_at": super::rfc3339(app.started),
    });
    json_response(StatusCode::OK, &body)
}

/// The served model as `/api/tags` lists it: its name (as `/v1/models` gives it), when
/// this coordinator `started`, its file's size, the vocabulary's SHA-256 as its digest
/// (duet does not hash the weights), its details and capabilities.
fn listed(models: &Models, started: SystemTime) -> Value {
    json!({
        "name": models.target_model,
        "model": models.target_model,
        "modified_at": super::rfc3339(started),
        "size": models.file.bytes,
        "digest": models.vocabulary_sha256,
        "details": details(models),
        "capabilities": capabilities(models),
    })
}

fn details(models: &Models) -> Value {
    let file = &models.file;
    json!({
        "parent_model": "",
        "format": "gguf",
        "family": models.architecture,
        "families": [models.architecture],
        "parameter_size": match file.size_label.as_str() {
            "" => human_number(file.parameters),
            label => label.to_string(),
        },
        "quantization_level": file.quantization,
    })
}

/// What the model can do, in Ollama's names: complete; call tools where its template
/// renders them; fill in the middle where its tokenizer has the tokens; think where its
/// template writes thoughts.
fn capabilities(models: &Models) -> Vec<&'static str> {
    let template = models.tokenizer.chat_template().unwrap_or_default();
    let can = [
        (true, "completion"),
        (template.contains("tools"), "tools"),
        (models.tokenizer.infill().is_some(), "insert"),
        (models.writes_thoughts, "thinking"),
    ];
    can.into_iter()
        .filter(|(on, _)| *on)
        .map(|(_, c)| c)
        .collect()
}

/// A count as Ollama writes parameter sizes: `1.5B`, `494.03M`, `135M`.
fn human_number(n: u64) -> String {
    let scaled = |unit: f64, suffix: &str, decimals: usize| {
        let x = n as f64 / unit;
        match x.fract() == 0.0 {
            true => format!("{x:.0}{suffix}"),
            false => format!("{x:.decimals$}{suffix}"),
        }
    };
    match n {
        1_000_000_000.. => scaled(1e9, "B", 1),
        1_000_000.. => scaled(1e6, "M", 2),
        1_000.. => format!("{:.0}K", n as f64 / 1e3),
        _ => n.to_string(),
    }
}

/// A refusal in Ollama's shape: the same status, `{"error": message}`.
fn refuse((status, body): Refusal) -> Response {
    json_response(status, &ollama_error(&body))
}

/// Ollama's error body of an OpenAI one.
fn ollama_error(body: &Value) -> Value {
    json!({"error": body["error"]["message"]})
}

#[cfg(test)]
mod tests;
