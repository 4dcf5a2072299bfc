//! OpenAI's Responses API (`POST /v1/responses`), what newer clients and agent frameworks
//! send. duet keeps no responses: each request carries its whole conversation in `input`
//! (a `previous_response_id` is refused), and becomes a chat request (`ChatRequest`), so it
//! is checked, templated and generated as a chat completion is. The answer is a `response`
//! object, or with `stream: true` its events (`response.created` … `response.completed`).

use super::wire::{
    CalledFunction, ChatMessage, ChatRequest, Common, Function, Tool, ToolCall, Unsupported,
    unsupported,
};
use super::{App, Choice, Gone, authorized, bad_request, error_body, grpc_error, json_response};
use super::{begin_chat, in_server_span, read, refuse, unix_now};
use crate::service::GenerateStream;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use duet_proto::v1 as pb;
use futures::StreamExt;
use pb::generate_response::Event as Generated;
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

pub const ROUTE: &str = "/v1/responses";

/// `POST /v1/responses`, in the request's server span (from its `traceparent`).
pub async fn handle(
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
    let tenant = match authorized(&app, &headers) {
        Ok(tenant) => tenant,
        Err(refused) => return refuse(refused),
    };
    let request = match read::<ResponsesRequest>(&app, body) {
        Ok(request) => request,
        Err(refused) => return refuse(refused),
    };
    let one = match request.to_request() {
        Ok(one) => one,
        Err(u) => return refuse(bad_request(&u.message, Some(u.param))),
    };
    let (model, choice, stream) = match begin_chat(&app, one, tenant, &span).await {
        Ok((model, choice, started)) => (model, choice, started.stream),
        Err(status) => return grpc_error(&status),
    };
    let reply = Reply::new(&request, unix_now(), model);
    match request.stream {
        true => streamed(stream, reply, choice),
        false => whole(stream, reply).await,
    }
}

/// The response object once the generation has ended.
async fn whole(stream: GenerateStream, reply: Reply) -> Response {
    let done = match duet_proto::Completion::read(stream, |_| {}).await {
        Ok(done) => done,
        Err(status) => return grpc_error(&status),
    };
    let output = reply.output(&done.text, &done.reasoning, &done.tool_calls);
    let object = reply.object(done.finish_reason, output, Some(&done.usage));
    json_response(StatusCode::OK, &object)
}

/// The response's events: `response.created` and `response.in_progress`, a thinking
/// model's reasoning item with each piece of its thought (done when the answer starts), the
/// message item opened at its first text and each piece of text as it comes (with tools,
/// none from where a call may start), then the message's and the calls' items done, and
/// `response.completed` (`response.incomplete` where `max_output_tokens` cut it). A failure
/// is an `error` event, and ends the stream; a caller that goes away ends the generation.
fn streamed(mut stream: GenerateStream, reply: Reply, mut choice: Choice) -> Response {
    let (tx, rx) = mpsc::channel(8);
    tokio::spawn(async move {
        let mut events = Events {
            tx,
            sequence: 0,
            thought: None,
        };
        let mut sent = String::new();
        let started = json!({"response": reply.object(None, Vec::new(), None)});
        events.send("response.created", started.clone()).await?;
        events.send("response.in_progress", started).await?;
        while let Some(message) = stream.next().await {
            match message.map(|m| m.event) {
                Ok(Some(Generated::Chunk(c))) => {
                    events.reasoning(&reply, &c.reasoning).await?;
                    let piece = choice.release(c.text);
                    events.text(&reply, &mut sent, &piece).await?;
                }
                Ok(Some(Generated::Finished(mut f))) => {
                    events.reasoning(&reply, &f.reasoning).await?;
                    let piece = choice.last(std::mem::take(&mut f.text), &f.tool_calls);
                    events.text(&reply, &mut sent, &piece).await?;
                    return events.finish(&reply, &sent, &f).await;
                }
                Ok(None) => {}
                Err(status) => {
                    let (_, mut body) = error_body(&status);
                    return events.send("error", body["error"].take()).await;
                }
            }
        }
        Ok::<(), Gone>(())
    });
    Sse::new(ReceiverStream::new(rx))
        .keep_alive(KeepAlive::default())
        .into_response()
}

/// A response's event stream, numbering its events.
struct Events {
    tx: mpsc::Sender<Result<Event, std::convert::Infallible>>,
    sequence: u64,
    /// The reasoning item's text so far, once it is open (the first output item), and
    /// whether it is done.
    thought: Option<(String, bool)>,
}

impl Events {
    async fn send(&mut self, kind: &str, mut body: Value) -> Result<(), Gone> {
        body["type"] = json!(kind);
        body["sequence_number"] = json!(self.sequence);
        self.sequence += 1;
        let event = Event::default().event(kind).data(body.to_string());
        self.tx.send(Ok(event)).await.map_err(|_| Gone)
    }

    /// A piece of the thought, after the reasoning item where it is the first.
    async fn reasoning(&mut self, reply: &Reply, piece: &str) -> Result<(), Gone> {
        if piece.is_empty() {
            return Ok(());
        }
        if self.thought.is_none() {
            let item = json!({"output_index": 0, "item": reply.reasoning("", "in_progress")});
            self.send("response.output_item.added", item).await?;
        }
        let (thought, _) = self.thought.get_or_insert_default();
        thought.push_str(piece);
        let delta = json!({"item_id": reply.reasoning_id(), "output_index": 0,
                           "content_index": 0, "delta": piece});
        self.send("response.reasoning_text.delta", delta).await
    }

    /// The reasoning item done, where it is open: its text, then the item.
    async fn close_thought(&mut self, reply: &Reply) -> Result<(), Gone> {
        let Some((thought, done @ false)) = &mut self.thought else {
            return Ok(());
        };
        *done = true;
        let (text, item) = (json!(thought), reply.reasoning(thought, "completed"));
        let done = json!({"item_id": reply.reasoning_id(), "output_index": 0,
                          "content_index": 0, "text": text});
        self.send("response.reasoning_text.done", done).await?;
        let done = json!({"output_index": 0, "item": item});
        self.send("response.output_item.done", done).await
    }

    /// The message's place among the output items: after the reasoning item, if any.
    fn message_index(&self) -> usize {
        usize::from(self.thought.is_some())
    }

    /// A piece of the message's text (`sent`: the text before it), after the message item
    /// and its text part where it is the first.
    async fn text(&mut self, reply: &Reply, sent: &mut String, piece: &str) -> Result<(), Gone> {
        if piece.is_empty() {
            return Ok(());
        }
        if sent.is_empty() {
            self.open_message(reply).await?;
        }
        sent.push_str(piece);
        let delta = json!({"item_id": reply.message_id(), "output_index": self.message_index(),
                           "content_index": 0, "delta": piece, "logprobs": []});
        self.send("response.output_text.delta", delta).await
    }

    /// The message item and its text part opened, the thought before it done.
    async fn open_message(&mut self, reply: &Reply) -> Result<(), Gone> {
        self.close_thought(reply).await?;
        let index = self.message_index();
        let item = json!({"output_index": index, "item": reply.message("", "in_progress")});
        self.send("response.output_item.added", item).await?;
        let part = json!({"item_id": reply.message_id(), "output_index": index,
                          "content_index": 0, "part": output_text("")});
        self.send("response.content_part.added", part).await
    }

    /// The end: the thought done, the message's text (`sent`) done, each call's item with
    /// its arguments, and the whole response.
    async fn finish(&mut self, reply: &Reply, sent: &str, f: &pb::Finished) -> Result<(), Gone> {
        let mut output = Vec::new();
        self.close_thought(reply).await?;
        if let Some((thought, _)) = &self.thought {
            output.push(reply.reasoning(thought, "completed"));
        }
        if !sent.is_empty() || f.tool_calls.is_empty() {
            if sent.is_empty() {
                self.open_message(reply).await?;
            }
            let at = json!({"item_id": reply.message_id(), "output_index": output.len(),
                            "content_index": 0});
            let with = |key: &str, value: Value| {
                let mut body = at.clone();
                body[key] = value;
                body
            };
            self.send("response.output_text.done", with("text", json!(sent)))
                .await?;
            let part = with("part", output_text(sent));
            self.send("response.content_part.done", part).await?;
            let item = reply.message(sent, "completed");
            let done = json!({"output_index": output.len(), "item": item});
            self.send("response.output_item.done", done).await?;
            output.push(item);
        }
        for call in &f.tool_calls {
            output.push(self.call(reply, call, output.len()).await?);
        }
        let object = reply.object(Some(f.finish_reason), output, f.usage.as_ref());
        let kind = match object["status"].as_str() {
            Some("incomplete") => "response.incomplete",
            _ => "response.completed",
        };
        self.send(kind, json!({"response": object})).await
    }

    /// A call's item, added, its arguments in one piece, done; returns the item.
    async fn call(
        &mut self,
        reply: &Reply,
        call: &pb::ToolCall,
        index: usize,
    ) -> Result<Value, Gone> {
        let opened = pb::ToolCall {
            arguments: String::new(),
            ..call.clone()
        };
        let added = json!({"output_index": index, "item": reply.call(&opened, "in_progress")});
        self.send("response.output_item.added", added).await?;
        let at = json!({"item_id": format!("fc_{}", call.id), "output_index": index});
        let mut delta = at.clone();
        delta["delta"] = json!(call.arguments);
        self.send("response.function_call_arguments.delta", delta)
            .await?;
        let mut done = at;
        done["arguments"] = json!(call.arguments);
        self.send("response.function_call_arguments.done", done)
            .await?;
        let item = reply.call(call, "completed");
        let done = json!({"output_index": index, "item": item});
        self.send("response.output_item.done", done).await?;
        Ok(item)
    }
}

/// A Responses request. Fields clients send that change nothing here (`store`, `user`,
/// `truncation`, `reasoning` for a model without reasoning) are ignored, as
/// `/v1/chat/completions` ignores its own.
#[derive(Debug, Clone, Deserialize)]
pub struct ResponsesRequest {
    /// A user message's text, or a list of items: messages (`role`, `content`), the
    /// model's `function_call`s and their `function_call_output`s.
    pub input: Input,
    /// A system message before the input.
    pub instructions: Option<String>,
    pub max_output_tokens: Option<u32>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    #[serde(default)]
    pub stream: bool,
    /// Function tools, flattened: `{"type": "function", "name", "description",
    /// "parameters"}`.
    pub tools: Option<Vec<Value>>,
    /// `auto`, `none`, `required` or `{"type": "function", "name"}`.
    pub tool_choice: Option<Value>,
    /// False: at most one call.
    pub parallel_tool_calls: Option<bool>,
    /// `{"format": {"type": "text" | "json_object" | "json_schema", "schema"}}`.
    pub text: Option<Value>,
    pub previous_response_id: Option<String>,
    pub include: Option<Vec<String>>,
    /// Handed back in the response as it came.
    pub metadata: Option<Value>,
    /// duet's and vLLM's own, as in chat completions.
    pub seed: Option<u64>,
    pub top_k: Option<u32>,
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
#[serde(untagged)]
pub enum Input {
    Text(String),
    Items(Vec<Value>),
}

impl ResponsesRequest {
    /// duet's request: the chat completion request this one is.
    pub fn to_request(&self) -> Result<pb::GenerateRequest, Unsupported> {
        self.to_chat()?.to_request()
    }

    fn to_chat(&self) -> Result<ChatRequest, Unsupported> {
        if self.previous_response_id.is_some() {
            let why = "this server keeps no responses: send the conversation in input";
            return Err(unsupported("previous_response_id", why));
        }
        // Reasoning summaries a model without reasoning never writes.
        let known = |i: &&String| i.as_str() != "reasoning.encrypted_content";
        if let Some(what) = self.include.iter().flatten().find(known) {
            return Err(unsupported("include", &format!("{what} is not supported")));
        }
        let system = self
            .instructions
            .iter()
            .map(|text| ChatMessage::text("system", text));
        let messages = system.chain(items(&self.input)?).collect();
        let common = Common {
            max_completion_tokens: self.max_output_tokens,
            temperature: self.temperature,
            top_p: self.top_p,
            seed: self.seed,
            top_k: self.top_k,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            cache_salt: self.cache_salt.clone(),
            model: self.model.clone(),
            priority: self.priority,
            tools: self.tools.as_deref().map(tools).transpose()?,
            tool_choice: self.tool_choice.as_ref().map(tool_choice).transpose()?,
            parallel_tool_calls: self.parallel_tool_calls,
            response_format: self.response_format()?,
            speculation: self.speculation.clone(),
            num_speculative_tokens: self.num_speculative_tokens,
            ..Common::default()
        };
        Ok(ChatRequest { messages, common })
    }

    /// `text.format` as chat's `response_format`.
    fn response_format(&self) -> Result<Option<Value>, Unsupported> {
        let format = match self.text.as_ref().map(|t| &t["format"]) {
            None | Some(Value::Null) => return Ok(None),
            Some(format) => format,
        };
        match format["type"].as_str() {
            Some("text") => Ok(None),
            Some("json_object") => Ok(Some(json!({"type": "json_object"}))),
            Some("json_schema") => Ok(Some(json!({"type": "json_schema", "json_schema": {
                "name": format["name"], "schema": format["schema"],
            }}))),
            _ => Err(unsupported(
                "text",
                "format of type text, json_object or json_schema",
            )),
        }
    }
}

/// The chat messages of `input`: a text is one user message; items map one to one, but a
/// function call joins the assistant message before it (one turn with its text and calls).
fn items(input: &Input) -> Result<Vec<ChatMessage>, Unsupported> {
    let items = match input {
        Input::Text(text) => return Ok(vec![ChatMessage::text("user", text)]),
        Input::Items(items) => items,
    };
    let mut messages: Vec<ChatMessage> = Vec::new();
    for item in items {
        let text = |field: &str| item[field].as_str().unwrap_or_default().to_string();
        match item["type"].as_str() {
            None | Some("message") => {
                let role = item["role"].as_str().ok_or_else(|| {
                    unsupported("input", "a message has a role (user, assistant, system)")
                })?;
                messages.push(ChatMessage::text(role, &content_text(&item["content"])?));
            }
            Some("function_call") => {
                let call = ToolCall {
                    id: text("call_id"),
                    function: CalledFunction {
                        name: text("name"),
                        arguments: text("arguments"),
                    },
                };
                match messages.last_mut() {
                    Some(m) if m.role == "assistant" => m.tool_calls.push(call),
                    _ => messages.push(ChatMessage {
                        content: None,
                        tool_calls: vec![call],
                        ..ChatMessage::text("assistant", "")
                    }),
                }
            }
            Some("function_call_output") => messages.push(ChatMessage {
                tool_call_id: Some(text("call_id")),
                ..ChatMessage::text("tool", &content_text(&item["output"])?)
            }),
            // An earlier answer's thought, handed back: its turn is rendered without it, as
            // thinking models' templates render past turns.
            Some("reasoning") => {}
            Some(other) => {
                let why = format!(
                    "items of type {other}: messages, function_call, function_call_output and \
                     reasoning only"
                );
                return Err(unsupported("input", &why));
            }
        }
    }
    Ok(messages)
}

/// A content's text: a string, or text parts (`input_text`, `output_text`) joined.
fn content_text(content: &Value) -> Result<String, Unsupported> {
    let refused = || unsupported("input", "text content only (input_text, output_text)");
    match content {
        Value::String(text) => Ok(text.clone()),
        Value::Array(parts) => parts
            .iter()
            .map(
                |part| match (part["type"].as_str(), part["text"].as_str()) {
                    (Some("input_text" | "output_text" | "text"), Some(text)) => Ok(text),
                    _ => Err(refused()),
                },
            )
            .collect(),
        _ => Err(refused()),
    }
}

/// The flattened function tools as chat's.
fn tools(tools: &[Value]) -> Result<Vec<Tool>, Unsupported> {
    let tool = |t: &Value| match (t["type"].as_str(), t["name"].as_str()) {
        (Some("function"), Some(name)) => Ok(Tool {
            kind: "function".into(),
            function: Function {
                name: name.into(),
                description: t["description"].as_str().unwrap_or_default().into(),
                parameters: Some(t["parameters"].clone()).filter(|p| !p.is_null()),
            },
        }),
        _ => Err(unsupported(
            "tools",
            "function tools only, each with a name",
        )),
    };
    tools.iter().map(tool).collect()
}

/// `tool_choice` as chat's.
fn tool_choice(choice: &Value) -> Result<Value, Unsupported> {
    match (choice, choice["type"].as_str(), choice["name"].as_str()) {
        (Value::String(_) | Value::Null, ..) => Ok(choice.clone()),
        (_, Some("function"), Some(name)) => {
            Ok(json!({"type": "function", "function": {"name": name}}))
        }
        _ => Err(unsupported(
            "tool_choice",
            r#"auto, none, required or {"type": "function", "name"}"#,
        )),
    }
}

/// What a response object says besides its output: its id, time, model, and the request's
/// settings as OpenAI's objects hand them back.
#[derive(Debug, Clone)]
pub struct Reply {
    pub id: String,
    pub created: u64,
    pub model: String,
    settings: Value,
}

impl Reply {
    pub fn new(request: &ResponsesRequest, created: u64, model: String) -> Self {
        let id: u128 = rand::random();
        let format = match &request.text {
            Some(text) if !text["format"].is_null() => text["format"].clone(),
            _ => json!({"type": "text"}),
        };
        Self {
            id: format!("resp_{id:032x}"),
            created,
            model,
            settings: json!({
                "instructions": request.instructions,
                "max_output_tokens": request.max_output_tokens,
                "temperature": request.temperature.unwrap_or(0.0),
                "top_p": request.top_p.unwrap_or(1.0),
                "tools": request.tools.clone().unwrap_or_default(),
                "tool_choice": request.tool_choice.clone().unwrap_or(json!("auto")),
                "parallel_tool_calls": request.parallel_tool_calls.unwrap_or(true),
                "text": {"format": format},
                "metadata": request.metadata.clone().unwrap_or(json!({})),
                "previous_response_id": null,
                "store": false,
                "truncation": "disabled",
                "reasoning": null,
            }),
        }
    }

    /// The response object: `status` (`in_progress`, `completed`, or `incomplete` where
    /// `max_output_tokens` cut it), its output items and usage.
    pub fn object(
        &self,
        finish: Option<i32>,
        output: Vec<Value>,
        usage: Option<&pb::Usage>,
    ) -> Value {
        let cut = finish == Some(pb::FinishReason::Length as i32);
        let status = match finish {
            None => "in_progress",
            Some(_) if cut => "incomplete",
            Some(_) => "completed",
        };
        let mut object = json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": null,
            "incomplete_details": cut.then(|| json!({"reason": "max_output_tokens"})),
            "model": self.model,
            "output": output,
            "usage": usage.map(self::usage),
        });
        for (key, value) in self.settings.as_object().into_iter().flatten() {
            object[key] = value.clone();
        }
        object
    }

    /// The output items of a finished text with its thought and `calls`: the reasoning item
    /// (where there is a thought), an assistant message with the text (before the calls;
    /// none where that is empty), then one item a call.
    pub fn output(&self, text: &str, thought: &str, calls: &[pb::ToolCall]) -> Vec<Value> {
        let text = match calls.is_empty() {
            true => text,
            false => crate::tools::content_before_calls(text),
        };
        let reasoning = (!thought.is_empty()).then(|| self.reasoning(thought, "completed"));
        let message =
            (!text.is_empty() || calls.is_empty()).then(|| self.message(text, "completed"));
        (reasoning.into_iter().chain(message))
            .chain(calls.iter().map(|c| self.call(c, "completed")))
            .collect()
    }

    /// The reasoning item holding a thinking model's `thought`.
    pub fn reasoning(&self, thought: &str, status: &str) -> Value {
        let content = match status {
            "in_progress" => json!([]),
            _ => json!([{"type": "reasoning_text", "text": thought}]),
        };
        json!({"type": "reasoning", "id": self.reasoning_id(), "status": status, "summary": [],
               "content": content})
    }

    fn reasoning_id(&self) -> String {
        format!("rs_{}", &self.id["resp_".len()..])
    }

    /// The assistant message item holding `text`.
    pub fn message(&self, text: &str, status: &str) -> Value {
        let content = match status {
            "in_progress" => json!([]),
            _ => json!([output_text(text)]),
        };
        json!({"type": "message", "id": self.message_id(), "status": status,
               "role": "assistant", "content": content})
    }

    fn message_id(&self) -> String {
        format!("msg_{}", &self.id["resp_".len()..])
    }

    /// The item of a function call.
    pub fn call(&self, call: &pb::ToolCall, status: &str) -> Value {
        json!({"type": "function_call", "id": format!("fc_{}", call.id), "call_id": call.id,
               "name": call.name, "arguments": call.arguments, "status": status})
    }
}

/// A message's text part.
pub fn output_text(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
}

/// The Responses API's usage, with duet's own figures under `duet` as chat's has them.
fn usage(u: &pb::Usage) -> Value {
    let duet = super::wire::usage(std::slice::from_ref(u), 1)["duet"].take();
    json!({
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.prompt_tokens_cached},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "duet": duet,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(body: Value) -> Result<pb::GenerateRequest, Unsupported> {
        serde_json::from_value::<ResponsesRequest>(body)
            .unwrap()
            .to_request()
    }

    fn chat(body: Value) -> pb::GenerateRequest {
        serde_json::from_value::<ChatRequest>(body)
            .unwrap()
            .to_request()
            .unwrap()
    }

    /// A Responses request is the chat request of the same conversation: instructions a
    /// system message, input items messages (a call joining the assistant's text, its
    /// output a tool message), tools flattened, `text.format` as `response_format`, `model`
    /// as chat's (an adapter's name where it is one).
    #[test]
    fn a_responses_request_is_the_chat_request_of_its_conversation() {
        let schema = json!({"type": "object"});
        let parameters = json!({"type": "object", "properties": {"city": {"type": "string"}}});
        let responses = request(json!({
            "model": "x", "instructions": "Be brief.", "max_output_tokens": 20,
            "temperature": 0.5, "top_p": 0.9, "seed": 3, "store": true, "user": "u",
            "cache_salt": "s", "priority": 3,
            "input": [
                {"role": "user", "content": "Weather?"},
                {"type": "message", "role": "assistant",
                 "content": [{"type": "output_text", "text": "Looking."}]},
                {"type": "function_call", "call_id": "c1", "name": "w",
                 "arguments": "{\"city\": \"Paris\"}"},
                {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
                {"role": "user", "content": [{"type": "input_text", "text": "And "},
                                             {"type": "input_text", "text": "tomorrow?"}]},
            ],
            "tools": [{"type": "function", "name": "w", "description": "weather",
                       "parameters": parameters}],
            "tool_choice": {"type": "function", "name": "w"},
            "parallel_tool_calls": false,
            "text": {"format": {"type": "json_schema", "name": "s", "schema": schema}},
        }));
        let as_chat = chat(json!({
            "model": "x", "max_completion_tokens": 20, "temperature": 0.5, "top_p": 0.9, "seed": 3,
            "cache_salt": "s", "priority": 3,
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "Looking.", "tool_calls": [{"id": "c1",
                 "type": "function",
                 "function": {"name": "w", "arguments": "{\"city\": \"Paris\"}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
                {"role": "user", "content": "And tomorrow?"},
            ],
            "tools": [{"type": "function", "function": {"name": "w", "description": "weather",
                       "parameters": parameters}}],
            "tool_choice": {"type": "function", "function": {"name": "w"}},
            "parallel_tool_calls": false,
            "response_format": {"type": "json_schema", "json_schema": {"schema": schema}},
        }));
        assert_eq!(responses, Ok(as_chat));
        let plain = request(json!({"input": "Hi", "text": {"format": {"type": "text"}}}));
        let user = json!({"messages": [{"role": "user", "content": "Hi"}]});
        assert_eq!(plain, Ok(chat(user)));
    }

    #[test]
    fn what_a_stateless_text_server_cannot_do_is_refused_naming_it() {
        let refused = |body: Value| request(body).unwrap_err().message;
        assert_eq!(
            refused(json!({"input": "Hi", "previous_response_id": "resp_1"})),
            "previous_response_id: this server keeps no responses: send the conversation in input"
        );
        assert_eq!(
            refused(json!({"input": [{"role": "user",
                "content": [{"type": "input_image", "image_url": "x"}]}]})),
            "input: text content only (input_text, output_text)"
        );
        assert_eq!(
            refused(json!({"input": [{"type": "web_search_call", "id": "ws_1"}]})),
            "input: items of type web_search_call: messages, function_call, \
             function_call_output and reasoning only"
        );
        assert_eq!(
            refused(json!({"input": "Hi", "tools": [{"type": "web_search"}]})),
            "tools: function tools only, each with a name"
        );
        assert_eq!(
            refused(json!({"input": "Hi", "include": ["message.output_text.logprobs"]})),
            "include: message.output_text.logprobs is not supported"
        );
        assert_eq!(
            refused(json!({"input": "Hi", "text": {"format": {"type": "grammar"}}})),
            "text: format of type text, json_object or json_schema"
        );
        let ok = json!({"input": "Hi", "include": ["reasoning.encrypted_content"]});
        assert!(request(ok).is_ok());
    }

    /// A finished response's output: a thinking model's reasoning item, the message (its
    /// text before any calls), then the calls; `incomplete` where `max_output_tokens` cut
    /// it; OpenAI's usage names.
    #[test]
    fn a_response_object_has_openais_shape() {
        let req: ResponsesRequest =
            serde_json::from_value(json!({"input": "Hi", "metadata": {"k": "v"}})).unwrap();
        let reply = Reply::new(&req, 7, "m.gguf".into());
        let call = pb::ToolCall {
            id: "call_1".into(),
            name: "w".into(),
            arguments: "{}".into(),
        };
        let output = reply.output(
            "Sure. <tool_call>{...}</tool_call>",
            "",
            std::slice::from_ref(&call),
        );
        assert_eq!(output.len(), 2);
        assert_eq!(output[0]["content"][0]["text"], "Sure.");
        assert_eq!(
            (&output[1]["type"], &output[1]["call_id"]),
            (&json!("function_call"), &json!("call_1"))
        );
        assert_eq!(
            reply.output("", "", &[]).len(),
            1,
            "an empty answer is an empty message"
        );
        let thought = reply.output("<tool_call>{...}</tool_call>", "Use w.", &[call]);
        let types: Vec<&Value> = thought.iter().map(|item| &item["type"]).collect();
        assert_eq!(types, [&json!("reasoning"), &json!("function_call")]);
        let reasoning_text = json!([{"type": "reasoning_text", "text": "Use w."}]);
        assert_eq!(thought[0]["content"], reasoning_text);
        assert!(thought[0]["id"].as_str().unwrap().starts_with("rs_"));
        let usage = pb::Usage {
            prompt_tokens: 5,
            completion_tokens: 3,
            prompt_tokens_cached: 2,
            ..Default::default()
        };
        let cut = Some(pb::FinishReason::Length as i32);
        let object = reply.object(cut, reply.output("abc", "", &[]), Some(&usage));
        assert_eq!(object["status"], "incomplete");
        assert_eq!(object["incomplete_details"]["reason"], "max_output_tokens");
        assert_eq!(object["metadata"], json!({"k": "v"}));
        let figures = (
            &object["usage"]["input_tokens"],
            &object["usage"]["total_tokens"],
        );
        assert_eq!(figures, (&json!(5), &json!(8)));
        assert_eq!(object["usage"]["input_tokens_details"]["cached_tokens"], 2);
        let done = reply.object(Some(pb::FinishReason::Eos as i32), Vec::new(), None);
        assert_eq!(
            (&done["status"], &done["usage"]),
            (&json!("completed"), &Value::Null)
        );
    }
}
