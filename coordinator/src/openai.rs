//! The OpenAI-compatible HTTP API on the coordinator (`http_listen`): `POST /v1/completions`,
//! `POST /v1/chat/completions`, `POST /v1/responses` (each streamed as server-sent events
//! with `stream: true`), `GET /v1/models` and `GET /v1/models/{id}` (`models`), vLLM's
//! tokenizer endpoints (`tokenize`), `/health`, `/version` and `/metrics` (`server`),
//! beside the peers' own APIs: llama.cpp's `/infill`, `/completion` and `/props` (`llama`),
//! Anthropic's `/v1/messages` (`anthropic`), Ollama's `/api/...` (`ollama`), TGI's
//! `/generate`, `/generate_stream` and `POST /` (`tgi`), and SageMaker's `/ping` and
//! `/invocations` (`sagemaker`). Each request becomes duet's own `GenerateRequest` and runs
//! through the same path as a gRPC call (validation, limits, admission, the loop), so they
//! answer alike: the same greedy text, the same refusals, each gRPC code as its HTTP
//! status. Every answer carries the request's `x-request-id` (`request_id::layer`).

mod anthropic;
mod llama;
mod logprobs;
mod models;
mod ollama;
mod responses;
mod sagemaker;
mod server;
mod tgi;
mod tokenize;
mod unhonoured;
mod wire;

use crate::Coordinator;
use crate::auth::Auth;
use crate::metrics::{CoordinatorMetrics, HttpLabels};
use crate::proposals::Tenant;
use crate::service::{Caller, GenerateStream, GenerationService, Started};
use crate::tools::CallFormat;
use crate::workers::Models;
use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, MatchedPath, State};
use axum::http::header::{AUTHORIZATION, CONTENT_TYPE};
use axum::http::{HeaderMap, StatusCode};
use axum::middleware;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use duet_proto::v1 as pb;
use duet_serving::metrics::Render;
use duet_serving::request_id;
use duet_serving::telemetry::{http_server_span, set_error};
use futures::StreamExt;
use logprobs::Figures;
use serde_json::{Value, json};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Code, Status};
use tracing::Instrument;
use wire::{ChatRequest, Common, CompletionRequest, Header, Kind};

/// What the handlers share.
#[derive(Clone)]
struct App {
    service: GenerationService,
    coord: Arc<Coordinator>,
    auth: Auth,
    /// Tokenizer calls working at once: as many as the cores, the rest wait (a generation's
    /// tokenizing waits for its place among the running requests instead).
    tokenizing: Arc<tokio::sync::Semaphore>,
    /// Whether the coordinator serves (its readiness), for `GET /health`.
    ready: Arc<AtomicBool>,
    /// When the API started: Ollama's model lists date the served model by it.
    started: std::time::SystemTime,
}

/// The API's routes over `coord`, each call checked by `auth` first (but `GET /health`,
/// `GET /` and `GET /metrics`); `ready` is the coordinator's readiness, `render` its
/// metrics.
pub fn router(
    coord: Arc<Coordinator>,
    auth: Auth,
    ready: Arc<AtomicBool>,
    render: Render,
) -> Router {
    // JSON escapes and field names make a body larger than the same request in protobuf.
    let limit = 2 * coord.config.limits.max_request_bytes();
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let metrics = coord.metrics.clone();
    let app = App {
        service: GenerationService::new(coord.clone()),
        coord,
        auth,
        tokenizing: Arc::new(tokio::sync::Semaphore::new(cores)),
        ready,
        started: std::time::SystemTime::now(),
    };
    let routes = Router::new()
        .route(Kind::Completion.route(), post(completions))
        .route(Kind::Chat.route(), post(chat_completions))
        .route(responses::ROUTE, post(responses::handle))
        .route(llama::INFILL, post(llama::infill))
        .route(llama::COMPLETION, post(llama::completion))
        .route(llama::PROPS, get(llama::props))
        .route("/apply-template", post(tokenize::post_apply_template))
        .route(anthropic::ROUTE, post(anthropic::messages))
        .route(anthropic::COUNT_TOKENS, post(anthropic::count_tokens))
        .route(ollama::CHAT, post(ollama::chat))
        .route(ollama::GENERATE, post(ollama::generate))
        .route(ollama::SHOW, post(ollama::show))
        .route(ollama::TAGS, get(ollama::tags))
        .route(ollama::PS, get(ollama::ps))
        .route(ollama::VERSION, get(ollama::version))
        .route(ollama::ROOT, get(ollama::root).post(tgi::compat))
        .route(tgi::GENERATE, post(tgi::generate))
        .route(tgi::GENERATE_STREAM, post(tgi::generate_stream))
        .route(tgi::INFO, get(tgi::info))
        .route("/v1/models", get(models::list))
        .route("/v1/models/{*id}", get(models::retrieve))
        .route("/tokenizer_info", get(tokenize::get_info))
        .route("/tokenize", post(tokenize::post_tokenize))
        .route("/detokenize", post(tokenize::post_detokenize))
        .route("/health", get(server::health))
        .route(
            "/metrics",
            get(move || server::metrics_text(render.clone())),
        )
        .route("/version", get(server::version))
        .route(sagemaker::PING, get(server::health).post(server::health))
        .route(sagemaker::INVOCATIONS, post(sagemaker::invocations))
        .fallback(server::not_found)
        .layer(DefaultBodyLimit::max(limit))
        .layer(middleware::map_response(unbuffered))
        .layer(middleware::from_fn_with_state(metrics, counted));
    request_id::layer(routes).with_state(app)
}

/// A streamed answer (server-sent events, Ollama's JSON lines) says `x-accel-buffering:
/// no`, as TGI's streams do: NGINX (ingress-nginx, by default) then passes each
/// token on as it comes rather than holding the stream back in its buffers.
async fn unbuffered(mut response: Response) -> Response {
    let streamed = response.headers().get(CONTENT_TYPE).is_some_and(|kind| {
        let kind = kind.as_bytes();
        kind.starts_with(b"text/event-stream") || kind.starts_with(b"application/x-ndjson")
    });
    if streamed {
        let no = axum::http::HeaderValue::from_static("no");
        response.headers_mut().insert("x-accel-buffering", no);
    }
    response
}

/// Counts each call by its route and the status it was answered with.
async fn counted(
    State(metrics): State<Arc<CoordinatorMetrics>>,
    request: axum::extract::Request,
    next: middleware::Next,
) -> Response {
    let matched = request.extensions().get::<MatchedPath>();
    let route = matched.map_or("unmatched", MatchedPath::as_str).to_string();
    let response = next.run(request).await;
    let status = response.status().as_u16().to_string();
    let labels = HttpLabels { route, status };
    metrics.http_requests.get_or_create(&labels).inc();
    response
}

async fn completions(
    State(app): State<App>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    handle(app, headers, body, Kind::Completion).await
}

async fn chat_completions(
    State(app): State<App>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    handle(app, headers, body, Kind::Chat).await
}

/// One generation, in the request's server span.
async fn handle(
    app: App,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
    kind: Kind,
) -> Response {
    let answer = |headers, span| generation(app, headers, body, kind, span);
    in_server_span(headers, kind.route(), answer).await
}

/// What `respond` answers a `POST` to `route`, run in the request's server span (a child
/// of its `traceparent`), which it is handed to record a failure in.
async fn in_server_span<F: std::future::Future<Output = Response>>(
    headers: HeaderMap,
    route: &'static str,
    respond: impl FnOnce(HeaderMap, tracing::Span) -> F,
) -> Response {
    let span = http_server_span(&headers, "POST", route);
    // The request's id (`request_id::layer` made one where it came without) goes with the
    // generations the handler starts (`begin`).
    let id = headers
        .get(request_id::HEADER)
        .and_then(|id| id.to_str().ok());
    let id = id.map(str::to_string);
    let answer = respond(headers, span.clone()).instrument(span);
    REQUEST_ID.scope(id, answer).await
}

tokio::task_local! {
    /// The id of the HTTP request whose handler runs (`in_server_span`).
    static REQUEST_ID: Option<String>;
}

/// `request`'s generation, started in the request's `span`; else why it failed to start,
/// recorded on the span. The request's `adapter` holds the `model` it named: kept where an
/// adapter has that name, else cleared (the target alone).
async fn begin(
    app: &App,
    mut request: pb::GenerateRequest,
    tenant: Option<Tenant>,
    span: &tracing::Span,
) -> Result<Started, Status> {
    if !request.adapter.is_empty() {
        let models = app.coord.models().await;
        if !models.is_ok_and(|m| m.adapters.contains(&request.adapter)) {
            request.adapter.clear();
        }
    }
    let request_id = REQUEST_ID.try_with(Clone::clone).ok().flatten();
    let caller = Caller { tenant, request_id };
    let started = app.service.start(request, caller, span.clone()).await;
    started.inspect_err(|status| set_error(span, status))
}

/// The served models, knowing of the adapter `name` names where it is one added since the
/// adapters were last listed (`Coordinator::learn_adapter`).
async fn models_naming(app: &App, name: Option<&str>) -> Result<Arc<Models>, String> {
    let models = app.coord.models().await?;
    if let Some(name) = name.filter(|n| !n.is_empty()) {
        app.coord.learn_adapter(&models, name).await;
    }
    Ok(models)
}

/// A chat request's generation started as [`begin`] starts it, with the served model's
/// name and the writer of its one choice.
async fn begin_chat(
    app: &App,
    request: pb::GenerateRequest,
    tenant: Option<Tenant>,
    span: &tracing::Span,
) -> Result<(String, Choice, Started), Status> {
    let models = models_naming(app, Some(&request.adapter)).await.ok();
    let model = (models.as_ref()).map(|m| m.answering(Some(&request.adapter)).to_string());
    let choice = Choice::new(Kind::Chat, &request, false, models.as_ref());
    let stream = begin(app, request, tenant, span).await?;
    Ok((model.unwrap_or_default(), choice, stream))
}

/// [`begin`], or the answer to the generation's failing to start.
async fn start(
    app: &App,
    request: pb::GenerateRequest,
    tenant: Option<Tenant>,
    span: &tracing::Span,
) -> Result<GenerateStream, Response> {
    let started = begin(app, request, tenant, span).await;
    started
        .map(|s| s.stream)
        .map_err(|status| grpc_error(&status))
}

/// Each generation read to its end; else the answer to the first that failed.
async fn read_all(streams: Vec<GenerateStream>) -> Result<Vec<duet_proto::Completion>, Response> {
    let reads = (streams.into_iter()).map(|s| duet_proto::Completion::read(s, |_| {}));
    let done = futures::future::try_join_all(reads).await;
    done.map_err(|status| grpc_error(&status))
}

/// `n` generations of `request`, each drawn from a seed of its own (the request's plus its
/// index); else the answer to the first that failed to start (those started before it end
/// as their streams drop).
async fn start_seeded(
    app: &App,
    request: &pb::GenerateRequest,
    n: usize,
    tenant: Option<Tenant>,
    span: &tracing::Span,
) -> Result<Vec<GenerateStream>, Response> {
    let mut started = Vec::with_capacity(n);
    for i in 0..n {
        let seed = request.seed.wrapping_add(i as u64);
        let one = pb::GenerateRequest {
            seed,
            ..request.clone()
        };
        started.push(start(app, one, tenant, span).await?);
    }
    Ok(started)
}

/// Checked as gRPC's, answered whole or streamed.
async fn generation(
    app: App,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
    kind: Kind,
    span: tracing::Span,
) -> Response {
    let tenant = match authorized(&app, &headers) {
        Ok(tenant) => tenant,
        Err(refused) => return refuse(refused),
    };
    let parsed = match kind {
        Kind::Completion => {
            read::<CompletionRequest>(&app, body).map(|r| (r.to_requests(), r.common))
        }
        Kind::Chat => {
            read::<ChatRequest>(&app, body).map(|r| (r.to_request().map(|one| vec![one]), r.common))
        }
    };
    let (requests, common) = match parsed {
        Ok((Ok(requests), common)) => (requests, common),
        Ok((Err(u), _)) => return refuse(bad_request(&u.message, Some(u.param))),
        Err(refused) => return refuse(refused),
    };
    let n = common.n.unwrap_or(1) as usize;
    let places = app.coord.config.max_concurrent_requests;
    if let Some(u) = wire::too_many(requests.len(), n, places) {
        return refuse(bad_request(&u.message, Some(u.param)));
    }
    let include_reasoning = common.include_reasoning.unwrap_or(true);
    let (header, models) = header(&app, kind, &common, include_reasoning).await;
    let (mut streams, mut choices) = (Vec::new(), Vec::new());
    for request in &requests {
        // Each choice is a generation of its own; a sampling one draws from seed + i.
        match start_seeded(&app, request, n, tenant, &span).await {
            Ok(started) => streams.extend(started),
            Err(answer) => return answer,
        }
        let choice = Choice::new(kind, request, common.echo, models.as_ref());
        choices.extend(std::iter::repeat_n(choice, n));
    }
    let answer = Answer { header, choices, n };
    match common.stream {
        true => streamed(streams, answer, &common),
        false => whole(streams, answer).await,
    }
}

/// What the answer adds to its generations' streams: the common part, each choice's own,
/// and the choices of each prompt (`n`).
struct Answer {
    header: Header,
    choices: Vec<Choice>,
    n: usize,
}

/// What a choice's answer adds to its generation's: the prompt's text before its first
/// text where the request echoes it, and the writer of its `logprobs`.
#[derive(Debug, Clone)]
struct Choice {
    echo: Option<String>,
    figures: Option<Figures>,
    /// Streamed with tools: the text from where a call may start, held back until the
    /// end shows whether it was one.
    held: Option<String>,
    /// How the model writes calls.
    calls: CallFormat,
    /// Some of the text has gone out (so it is no call written untagged, which is the
    /// whole text).
    answered: bool,
}

impl Choice {
    /// The choice of `request` (`echo`: it echoes its prompt), with `models` where known
    /// (without them the request fails before its first token).
    fn new(
        kind: Kind,
        request: &pb::GenerateRequest,
        echo: bool,
        models: Option<&Arc<Models>>,
    ) -> Self {
        use pb::generate_request::Input;
        let prompt = |models: &Arc<Models>| match &request.input {
            Some(Input::Prompt(text)) => text.clone(),
            Some(Input::PromptTokenIds(t)) => {
                (models.tokenizer.decode(&t.ids, false)).unwrap_or_default()
            }
            Some(Input::Messages(_)) | None => String::new(),
        };
        let finds_calls = crate::tools::finds_calls(&request.tools, &request.tool_choice);
        Self {
            echo: models.filter(|_| echo).map(prompt),
            figures: (models.filter(|_| request.logprobs)).map(|m| Figures::new(kind, m.clone())),
            held: finds_calls.then(String::new),
            calls: models.map_or_else(CallFormat::default, |m| m.call_format),
            answered: false,
        }
    }

    /// Of a streamed piece of text, what can go out now: with tools, nothing from the
    /// first text that may start a call (`<tool_call>`, or the text's start while it may be
    /// a call's JSON) on.
    fn release(&mut self, text: String) -> String {
        let Some(held) = &mut self.held else {
            return text;
        };
        held.push_str(&text);
        let from = crate::tools::may_start_call(held, self.calls, !self.answered);
        let released = held[..from].to_string();
        held.drain(..from);
        self.answered |= !released.is_empty();
        // Llama's calls are the whole text: once some of it is an answer, none is a call.
        if self.calls == CallFormat::Json && self.answered {
            self.held = None;
        }
        released
    }

    /// The last piece of a streamed choice that ended with `calls`: what [`Self::release`]
    /// lets out of `text`, then the text held back where it held no call.
    fn last(&mut self, text: String, calls: &[pb::ToolCall]) -> String {
        let released = self.release(text);
        match (self.held.take(), calls.is_empty()) {
            (Some(held), true) => released + &held,
            _ => released,
        }
    }

    /// The text and `logprobs` of a piece of the choice: `text` of tokens `ids` with their
    /// `figures`, after the prompt (with its figures, `prompt`) while that is still to echo.
    fn piece(
        &mut self,
        text: &str,
        ids: &[u32],
        figures: &[pb::TokenLogprobs],
        prompt: Option<&pb::PromptLogprobs>,
    ) -> (String, Value) {
        let echo = self.echo.take();
        let logprobs = match (&mut self.figures, prompt) {
            (None, _) => Value::Null,
            (Some(f), Some(prompt)) if echo.is_some() => f.echoed(prompt, ids, figures),
            (Some(f), _) => f.of(ids, figures),
        };
        (echo.unwrap_or_default() + text, logprobs)
    }
}

/// A streamed answer's caller went away: nothing more to send.
struct Gone;

/// An answer refusing a call: its status and OpenAI's error body.
type Refusal = (StatusCode, Value);

fn refuse((status, body): Refusal) -> Response {
    json_response(status, &body)
}

/// The caller's tenant, where `auth` lets the call in; else why not.
fn authorized(app: &App, headers: &HeaderMap) -> Result<Option<Tenant>, Refusal> {
    let token = headers.get(AUTHORIZATION).map(|v| v.as_bytes());
    app.auth.check(token).map_err(|status| error_body(&status))
}

/// The request in `body` as `T`, or what is wrong with it.
fn read<T: serde::de::DeserializeOwned>(
    app: &App,
    body: Result<Bytes, BytesRejection>,
) -> Result<T, Refusal> {
    let body = body.map_err(|rejection| {
        let (status, message) = (rejection.status(), rejection.body_text());
        (status, error_json("invalid_request_error", &message, None))
    })?;
    let values = app.coord.config.limits.max_json_values();
    parse(&body, values).map_err(|message| bad_request(&message, None))
}

fn bad_request(message: &str, param: Option<&str>) -> Refusal {
    let body = error_json("invalid_request_error", message, param);
    (StatusCode::BAD_REQUEST, body)
}

/// The JSON body as `T`, or what is wrong with it.
/// The request in `body`, refused unparsed when it holds more than `max_values` JSON values:
/// a value of two bytes (`0,`) decodes to a 32-byte one, so a body within the byte limit
/// could still take tens of megabytes to parse.
fn parse<T: serde::de::DeserializeOwned>(body: &[u8], max_values: usize) -> Result<T, String> {
    if wire::json_values(body) > max_values {
        return Err(format!("the body holds more than {max_values} JSON values"));
    }
    serde_json::from_slice(body).map_err(|e| format!("the body is not a valid request: {e}"))
}

/// The answers' common part: a fresh id, the time, the served model, whether a thought is
/// answered; and the models, whose tokenizer gives a token's text.
async fn header(
    app: &App,
    kind: Kind,
    common: &Common,
    include_reasoning: bool,
) -> (Header, Option<Arc<Models>>) {
    let prefix = match kind {
        Kind::Completion => "cmpl",
        Kind::Chat => "chatcmpl",
    };
    let id: u128 = rand::random();
    let models = models_naming(app, common.model.as_deref()).await.ok();
    let header = Header {
        kind,
        id: format!("{prefix}-{id:032x}"),
        created: unix_now(),
        model: (models.as_ref())
            .map(|m| m.answering(common.model.as_deref()).to_string())
            .unwrap_or_default(),
        include_reasoning,
    };
    (header, models)
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// `time` as RFC 3339 (Ollama's and Anthropic's timestamps).
fn rfc3339(time: std::time::SystemTime) -> String {
    humantime::format_rfc3339_nanos(time).to_string()
}

/// A request that did not ask to stream: its whole answer in one JSON body, once every
/// choice has ended (the first to fail fails the request).
async fn whole(streams: Vec<GenerateStream>, answer: Answer) -> Response {
    let done = match read_all(streams).await {
        Ok(done) => done,
        Err(answer) => return answer,
    };
    let Answer { header, choices, n } = answer;
    let choices = done
        .iter()
        .zip(choices)
        .enumerate()
        .map(|(i, (c, mut choice))| {
            let (text, logprobs) =
                choice.piece(&c.text, &c.token_ids, &c.logprobs, c.prompt.as_ref());
            let finish = wire::finish_reason(c.finish_reason);
            let texts = (text.as_str(), c.reasoning.as_str());
            let mut choice = header.choice(i, texts, (finish, &c.tool_calls), logprobs);
            choice["stop_reason"] = wire::stop_reason(&c.stop_string, c.stop_token_id);
            choice
        });
    let usages: Vec<pb::Usage> = done.iter().map(|c| c.usage.clone()).collect();
    let body = header.response(choices.collect(), wire::usage(&usages, n));
    json_response(StatusCode::OK, &body)
}

/// A streamed request: one event per round's text of each choice as it comes, each choice's
/// last with its finish reason, the usage after them all where asked for, then `[DONE]`. A
/// failure mid-stream is an event with OpenAI's error body (the status line was sent with
/// the first byte), and ends the answer. A caller that goes away drops the receiver, which
/// ends the task and so the generations.
fn streamed(streams: Vec<GenerateStream>, answer: Answer, common: &Common) -> Response {
    let include_usage = common.include_usage();
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Event, std::convert::Infallible>>(8);
    let Answer {
        header,
        mut choices,
        n,
    } = answer;
    tokio::spawn(async move {
        let count = streams.len();
        let tagged = streams.into_iter().enumerate();
        let mut merged = futures::stream::select_all(tagged.map(|(i, s)| s.map(move |m| (i, m))));
        let (mut first, mut usages) = (vec![true; count], vec![None; count]);
        while let Some((i, message)) = merged.next().await {
            let (events, failed) = match message.map(|m| m.event) {
                Ok(Some(pb::generate_response::Event::Chunk(c))) => (
                    chunk_events(&header, &mut choices[i], (i, first[i]), &c),
                    false,
                ),
                Ok(Some(pb::generate_response::Event::Finished(f))) => {
                    let choice = &mut choices[i];
                    let mut events = finished_events(&header, choice, (i, first[i]), &f);
                    usages[i] = Some(f.usage.unwrap_or_default());
                    if include_usage && usages.iter().all(Option::is_some) {
                        let all: Vec<pb::Usage> = usages.iter().flatten().cloned().collect();
                        events.push(header.usage_chunk(wire::usage(&all, n)));
                    }
                    (events, false)
                }
                Ok(None) => (Vec::new(), false),
                Err(status) => (vec![error_body(&status).1], true),
            };
            first[i] &= events.is_empty();
            for event in events {
                let sent = tx.send(Ok(Event::default().data(event.to_string()))).await;
                if sent.is_err() {
                    return;
                }
            }
            if failed {
                break;
            }
        }
        let _ = tx.send(Ok(Event::default().data("[DONE]"))).await;
    });
    Sse::new(ReceiverStream::new(rx))
        .keep_alive(KeepAlive::default())
        .into_response()
}

/// The events of a round's text of choice `i` (`first`: nothing of it sent yet): its
/// piece of thought alone is one chunk (with its tokens' figures), beside its text.
fn chunk_events(
    header: &Header,
    choice: &mut Choice,
    (i, first): (usize, bool),
    c: &pb::Chunk,
) -> Vec<Value> {
    let prompt = c.prompt.as_ref();
    let (text, logprobs) = choice.piece(&c.text, &c.token_ids, &c.logprobs, prompt);
    let text = choice.release(text);
    let thought = header.thought(&c.reasoning);
    match (thought.is_empty(), text.is_empty()) {
        (true, _) => vec![header.chunk(i, &text, first, None, logprobs)],
        (false, true) => vec![header.reasoning_chunk(i, thought, first, logprobs)],
        (false, false) => vec![
            header.reasoning_chunk(i, thought, first, Value::Null),
            header.chunk(i, &text, false, None, logprobs),
        ],
    }
}

/// The events of choice `i`'s end (`first`: nothing of it sent yet): the rest of its thought
/// and text, its calls, the last chunk with its finish reason and what stopped it.
fn finished_events(
    header: &Header,
    choice: &mut Choice,
    (i, first): (usize, bool),
    f: &pb::Finished,
) -> Vec<Value> {
    let finish = wire::finish_reason(Some(f.finish_reason));
    // A choice stopped before its first token still echoes its prompt.
    let text = choice.echo.take().unwrap_or_default() + &f.text;
    let text = choice.last(text, &f.tool_calls);
    let mut events = Vec::new();
    let thought = header.thought(&f.reasoning);
    if !thought.is_empty() {
        events.push(header.reasoning_chunk(i, thought, first, Value::Null));
    }
    let first = first && events.is_empty();
    events.extend(match f.tool_calls.is_empty() {
        true => vec![header.chunk(i, &text, first, finish, Value::Null)],
        false => vec![
            header.chunk(i, &text, first, None, Value::Null),
            header.calls_chunk(i, &f.tool_calls),
        ],
    });
    if let Some(last) = events.last_mut() {
        let stop = wire::stop_reason(&f.stop_string, f.stop_token_id);
        last["choices"][0]["stop_reason"] = stop;
    }
    events
}

/// The served models, for a caller `auth` lets in; else why not.
async fn served(app: &App, headers: &HeaderMap) -> Result<Arc<Models>, Refusal> {
    authorized(app, headers)?;
    served_models(app).await
}

/// The served models; else why not (503).
async fn served_models(app: &App) -> Result<Arc<Models>, Refusal> {
    let models = app.coord.models().await;
    models.map_err(|why| error_body(&Status::unavailable(format!("not ready: {why}"))))
}

/// The caller's tenant (where its token lets it in), the served models and the request in
/// `body`; else why not.
async fn accepted<T: serde::de::DeserializeOwned>(
    app: &App,
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<(Option<Tenant>, Arc<Models>, T), Refusal> {
    let tenant = authorized(app, headers)?;
    let request = read(app, body)?;
    Ok((tenant, served_models(app).await?, request))
}

/// The served models and the request in `body`, or why not.
async fn served_with<T: serde::de::DeserializeOwned>(
    app: &App,
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<(Arc<Models>, T), Refusal> {
    let models = served(app, headers).await?;
    Ok((models, read(app, body)?))
}

fn json_response(status: StatusCode, body: &Value) -> Response {
    (
        status,
        [(CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

/// OpenAI's error body.
fn error_json(kind: &str, message: &str, param: Option<&str>) -> Value {
    json!({"error": {"message": message, "type": kind, "param": param, "code": null}})
}

/// The HTTP status and OpenAI error body of a gRPC status: the one table from gRPC codes
/// to HTTP ones.
fn error_body(status: &Status) -> (StatusCode, Value) {
    let (http, kind) = match status.code() {
        Code::InvalidArgument => (StatusCode::BAD_REQUEST, "invalid_request_error"),
        Code::OutOfRange => (StatusCode::PAYLOAD_TOO_LARGE, "invalid_request_error"),
        Code::Unauthenticated => (StatusCode::UNAUTHORIZED, "authentication_error"),
        Code::PermissionDenied => (StatusCode::FORBIDDEN, "permission_error"),
        Code::ResourceExhausted => (StatusCode::TOO_MANY_REQUESTS, "rate_limit_error"),
        Code::Unavailable => (StatusCode::SERVICE_UNAVAILABLE, "service_unavailable_error"),
        Code::DeadlineExceeded => (StatusCode::GATEWAY_TIMEOUT, "timeout_error"),
        Code::Cancelled => (
            StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST),
            "cancelled",
        ),
        _ => (StatusCode::INTERNAL_SERVER_ERROR, "server_error"),
    };
    (http, error_json(kind, status.message(), None))
}

fn grpc_error(status: &Status) -> Response {
    refuse(error_body(status))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_grpc_code_has_its_http_status() {
        for (code, http, kind) in [
            (Code::InvalidArgument, 400, "invalid_request_error"),
            (Code::OutOfRange, 413, "invalid_request_error"),
            (Code::Unauthenticated, 401, "authentication_error"),
            (Code::ResourceExhausted, 429, "rate_limit_error"),
            (Code::Unavailable, 503, "service_unavailable_error"),
            (Code::DeadlineExceeded, 504, "timeout_error"),
            (Code::Cancelled, 499, "cancelled"),
            (Code::Internal, 500, "server_error"),
        ] {
            let (status, body) = error_body(&Status::new(code, "why"));
            assert_eq!(status.as_u16(), http, "{code:?}");
            assert_eq!(
                body,
                json!({"error": {"message": "why", "type": kind, "param": null, "code": null}})
            );
        }
    }

    /// A streamed choice with tools holds back what may be a call: from a `<tool_call>` on,
    /// or, in Llama's format and for a call written untagged, from the start until the text
    /// is plainly an answer, after which nothing more is held there.
    #[test]
    fn streamed_text_is_held_where_a_call_may_start() {
        let choice = |calls| Choice {
            echo: None,
            figures: None,
            held: Some(String::new()),
            calls,
            answered: false,
        };
        let release = |choice: &mut Choice, pieces: &[&str]| -> Vec<String> {
            pieces
                .iter()
                .map(|p| choice.release(p.to_string()))
                .collect()
        };
        let mut blocks = choice(CallFormat::Blocks);
        let out = release(&mut blocks, &["Let me <tool", "_call>{", "}</tool_call>"]);
        assert_eq!(out, ["Let me ", "", ""]);
        assert_eq!(blocks.last(String::new(), &[]), "<tool_call>{}</tool_call>");
        let mut json = choice(CallFormat::Json);
        let out = release(&mut json, &[" ", "{\"name\"", ": \"w\"}"]);
        assert_eq!(out, ["", "", ""]);
        let mut answer = choice(CallFormat::Json);
        let out = release(&mut answer, &[" It", " is {x}", " done"]);
        assert_eq!(out, [" It", " is {x}", " done"]);
        assert_eq!(answer.last(" !".into(), &[]), " !");
        // A call written untagged is the whole text: held from the start while it may be
        // one; a fenced answer of another kind goes out once the fence shows it.
        let mut fenced = choice(CallFormat::Blocks);
        let out = release(&mut fenced, &["``", "`json\n{", "\"name\": \"w\"}\n```"]);
        assert_eq!(out, ["", "", ""]);
        let call = pb::ToolCall::default();
        assert_eq!(fenced.last(String::new(), std::slice::from_ref(&call)), "");
        let mut code = choice(CallFormat::Blocks);
        let out = release(&mut code, &["``", "`python\n", "{x}"]);
        assert_eq!(out, ["", "```python\n", "{x}"]);
    }
}
