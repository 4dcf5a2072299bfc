//! Hugging Face TGI's own API (text-generation-inference), which its clients speak
//! (`huggingface_hub`'s `InferenceClient.text_generation`, the `text-generation` package,
//! LangChain's `HuggingFaceEndpoint`): `POST /generate` (the answer in one object), `POST
//! /generate_stream` (server-sent events, one a token), `POST /` (either, by `stream`; the
//! whole answer as a one-element list, the prompt before the text unless
//! `return_full_text` is false, as TGI answers for a text-generation model) and `GET
//! /info`. Each becomes a completion of the prompt (`CompletionRequest`), checked and
//! generated as that is; TGI's parameters that duet does not take are refused where set.
//! `/tokenize` answers TGI's body in TGI's shape here too (`tokenized`).

use super::wire::{
    Common, CompletionRequest, OneOrMany, Prompts, Unsupported, null_as_default, unsupported,
};
use super::{App, Gone, Refusal, bad_request, begin, error_body, in_server_span};
use super::{json_response, logprobs, served};
use crate::service::GenerateStream;
use crate::workers::Models;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use duet_engine::detokenize::Utf8Stream;
use duet_proto::v1 as pb;
use futures::StreamExt;
use pb::generate_response::Event as Generated;
use serde::Deserialize;
use serde_json::{Value, json};
use std::sync::Arc;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

pub const GENERATE: &str = "/generate";
pub const GENERATE_STREAM: &str = "/generate_stream";
pub const INFO: &str = "/info";
/// TGI's first route, which its clients call: `POST /`.
pub const COMPAT: &str = "/";

/// Which of the generating routes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    Generate,
    Stream,
    Compat,
}

/// A request to any of them, as TGI reads it: fields sent as null read as unset (the
/// `text-generation` package sends every field).
#[derive(Debug, Deserialize)]
struct Request {
    inputs: String,
    /// Absent: TGI's defaults, sampling (`do_sample`) on.
    parameters: Option<Parameters>,
    /// `POST /` only: stream the answer.
    #[serde(default, deserialize_with = "null_as_default")]
    stream: bool,
}

#[derive(Debug, Default, Deserialize)]
struct Parameters {
    best_of: Option<u32>,
    temperature: Option<f32>,
    repetition_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    top_k: Option<i64>,
    top_p: Option<f32>,
    typical_p: Option<f32>,
    #[serde(default, deserialize_with = "null_as_default")]
    do_sample: bool,
    max_new_tokens: Option<u32>,
    return_full_text: Option<bool>,
    #[serde(default, deserialize_with = "null_as_default")]
    stop: Vec<String>,
    truncate: Option<u32>,
    #[serde(default, deserialize_with = "null_as_default")]
    watermark: bool,
    /// The answer's `details`: why it ended, the seed, each token with its figures.
    #[serde(default, deserialize_with = "null_as_default")]
    details: bool,
    /// `details` and the prompt's tokens with their figures (`prefill`).
    #[serde(default, deserialize_with = "null_as_default")]
    decoder_input_details: bool,
    seed: Option<u64>,
    /// The most likely tokens at each place, with theirs (`top_tokens`).
    top_n_tokens: Option<u32>,
    /// `{"type": "json" | "json_schema" | "regex", "value": …}`.
    grammar: Option<Value>,
    /// A LoRA adapter's name.
    adapter_id: Option<String>,
    /// duet's own, as in chat completions.
    speculation: Option<String>,
    num_speculative_tokens: Option<u32>,
}

/// What the answer needs beside the generation.
#[derive(Debug, Clone)]
struct Answer {
    route: Route,
    /// The text before the generated one: the prompt where the full text is asked for.
    before: String,
    details: bool,
    /// The seed drawn from; none where greedy.
    seed: Option<u64>,
    top_n: u32,
    models: Arc<Models>,
    /// The prompt's length in characters (`x-compute-characters`).
    characters: usize,
}

impl Parameters {
    /// Whether TGI samples: asked to, or any of its samplers set away from off.
    fn samples(&self) -> bool {
        self.do_sample
            || self.temperature.is_some_and(|t| t != 1.0)
            || self.top_k.is_some_and(|k| k != 0)
            || self.top_p.is_some_and(|p| p < 1.0)
            || self.typical_p.is_some_and(|p| p < 1.0)
    }

    /// What duet cannot do is refused, naming the field, rather than left out of an
    /// answer that would look like one that did it.
    fn refuse_what_duet_cannot_honour(&self, streamed: bool) -> Result<(), Unsupported> {
        if self.best_of.is_some_and(|n| n > 1) {
            return Err(unsupported("best_of", "1 at most: one sequence a request"));
        }
        if self.typical_p.is_some_and(|p| p < 1.0) {
            return Err(unsupported("typical_p", "duet does not take it"));
        }
        if self.watermark {
            return Err(unsupported("watermark", "duet does not take it"));
        }
        if self.truncate.is_some() {
            let why = "a prompt the context cannot hold is refused, not cut";
            return Err(unsupported("truncate", why));
        }
        if streamed && self.decoder_input_details {
            return Err(unsupported("decoder_input_details", "not when streaming"));
        }
        if self.max_new_tokens == Some(0) {
            return Err(unsupported("max_new_tokens", "must be strictly positive"));
        }
        Ok(())
    }

    /// The completion's fields: greedy unless TGI samples, a stop string kept in the text
    /// (as TGI keeps it), each token's figures where the answer shows them.
    fn common(&self, sampling: bool) -> Result<Common, Unsupported> {
        let top_k = match self.top_k {
            None => None,
            Some(k) => Some(u32::try_from(k).map_err(|_| unsupported("top_k", "0 or more"))?),
        };
        let temperature = match sampling {
            true => self.temperature.unwrap_or(1.0),
            false => 0.0,
        };
        let seed = (temperature > 0.0).then(|| self.seed.unwrap_or_else(rand::random));
        let top_n = self.top_n_tokens.unwrap_or(0);
        let figures = self.details || self.decoder_input_details || top_n > 0;
        let (response_format, guided_regex) = self.grammar()?;
        Ok(Common {
            max_tokens: self.max_new_tokens,
            temperature: Some(temperature),
            top_k: top_k.filter(|_| sampling),
            top_p: self.top_p.filter(|_| sampling),
            seed,
            stop: (!self.stop.is_empty()).then(|| OneOrMany::Many(self.stop.clone())),
            include_stop_str_in_output: true,
            repetition_penalty: self.repetition_penalty,
            frequency_penalty: self.frequency_penalty,
            logprobs: figures.then(|| json!(top_n)),
            response_format,
            guided_regex,
            speculation: self.speculation.clone(),
            num_speculative_tokens: self.num_speculative_tokens,
            ..Common::default()
        })
    }

    /// `grammar` as chat's `response_format` (a JSON schema, or its text) or vLLM's
    /// `guided_regex`.
    fn grammar(&self) -> Result<(Option<Value>, Option<String>), Unsupported> {
        let Some(grammar) = self.grammar.as_ref().filter(|g| !g.is_null()) else {
            return Ok((None, None));
        };
        let schema = |value: &Value| match value {
            Value::Object(_) => Ok(value.clone()),
            Value::String(text) => serde_json::from_str::<Value>(text)
                .ok()
                .filter(Value::is_object)
                .ok_or_else(|| unsupported("grammar", "its value is not a JSON schema")),
            _ => Err(unsupported("grammar", "its value is not a JSON schema")),
        };
        let format = |schema| json!({"type": "json_schema", "json_schema": {"schema": schema}});
        let value = &grammar["value"];
        match grammar["type"].as_str() {
            Some("json" | "json_object") => Ok((Some(format(schema(value)?)), None)),
            Some("json_schema") => Ok((Some(format(schema(&value["schema"])?)), None)),
            Some("regex") => match value.as_str() {
                Some(regex) => Ok((None, Some(regex.to_string()))),
                None => Err(unsupported("grammar", "a regex is a string")),
            },
            _ => Err(unsupported("grammar", "of type json, json_schema or regex")),
        }
    }
}

impl Request {
    /// duet's request for `route`, and what its answer needs beside the generation.
    fn to_request(
        &self,
        route: Route,
        models: &Arc<Models>,
    ) -> Result<(pb::GenerateRequest, Answer), Unsupported> {
        let sampling = self.parameters.as_ref().is_none_or(Parameters::samples);
        let unset = Parameters::default();
        let p = self.parameters.as_ref().unwrap_or(&unset);
        p.refuse_what_duet_cannot_honour(self.streams(route))?;
        if self.inputs.is_empty() {
            return Err(unsupported("inputs", "cannot be empty"));
        }
        let common = p.common(sampling)?;
        let seed = common.seed;
        let completion = CompletionRequest {
            prompt: Prompts::Text(self.inputs.clone()),
            suffix: None,
            common,
        };
        let mut request = (completion.to_requests()?.pop()).expect("one prompt, one request");
        let top_n = p.top_n_tokens.unwrap_or(0);
        if p.decoder_input_details {
            request.prompt_logprobs = Some(top_n);
        }
        request.adapter = p.adapter_id.clone().unwrap_or_default();
        // TGI's `POST /` gives a text-generation model's full text unless told otherwise.
        let before = match p.return_full_text.unwrap_or(route == Route::Compat) {
            true => self.inputs.clone(),
            false => String::new(),
        };
        let answer = Answer {
            route,
            characters: self.inputs.chars().count(),
            before,
            details: p.details || p.decoder_input_details,
            seed,
            top_n,
            models: models.clone(),
        };
        Ok((request, answer))
    }

    fn streams(&self, route: Route) -> bool {
        route == Route::Stream || (route == Route::Compat && self.stream)
    }
}

/// `POST /generate`, in the request's server span.
pub async fn generate(
    State(app): State<App>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let answer = |headers, span| respond(app, headers, body, Route::Generate, span);
    in_server_span(headers, GENERATE, answer).await
}

/// `POST /generate_stream`, in the request's server span.
pub async fn generate_stream(
    State(app): State<App>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let answer = |headers, span| respond(app, headers, body, Route::Stream, span);
    in_server_span(headers, GENERATE_STREAM, answer).await
}

/// `POST /`, in the request's server span.
pub async fn compat(
    State(app): State<App>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let answer = |headers, span| respond(app, headers, body, Route::Compat, span);
    in_server_span(headers, COMPAT, answer).await
}

/// Checked as a completion is, answered whole or as a token's events.
async fn respond(
    app: App,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
    route: Route,
    span: tracing::Span,
) -> Response {
    let (tenant, models, request) = match super::accepted::<Request>(&app, &headers, body).await {
        Ok(all) => all,
        Err(refused) => return refuse(refused),
    };
    let (one, answer) = match request.to_request(route, &models) {
        Ok(both) => both,
        Err(u) => return refuse(bad_request(&u.message, Some(u.param))),
    };
    // An adapter is asked for by name: one no target replica loads is refused, not
    // answered by the target alone.
    let adapter = one.adapter.as_str();
    if !adapter.is_empty() && !app.coord.serves(&models, adapter).await {
        let why = format!("adapter_id: {}", models.adapters.refusing(adapter));
        return refuse(bad_request(&why, Some("adapter_id")));
    }
    let stream = match begin(&app, one, tenant, &span).await {
        Ok(started) => started.stream,
        Err(status) => return refuse(error_body(&status)),
    };
    match request.streams(route) {
        true => streamed(stream, answer),
        false => whole(stream, answer).await,
    }
}

/// The answer in one object once the generation has ended (`POST /`: in a list).
async fn whole(stream: GenerateStream, answer: Answer) -> Response {
    let done = match duet_proto::Completion::read(stream, |_| {}).await {
        Ok(done) => done,
        Err(status) => return refuse(error_body(&status)),
    };
    let finish = match finish_reason(done.finish_reason) {
        Ok(finish) => finish,
        Err(refused) => return refuse(refused),
    };
    let mut body = json!({"generated_text": answer.before.clone() + &done.text});
    if answer.details {
        body["details"] = answer.details(&done, finish);
    }
    let mut response = match answer.route {
        Route::Compat => json_response(StatusCode::OK, &json!([body])),
        Route::Generate | Route::Stream => json_response(StatusCode::OK, &body),
    };
    let figures = answer.compute().into_iter().chain(timings(&done.usage));
    response.headers_mut().extend(figures);
    response
}

/// TGI's figures of a whole answer, as its headers carry them: the times in whole
/// milliseconds (`x-compute-time` in seconds), from arrival to the end, before the
/// generation (checks, tokenizing, routing), waiting for a place, and generating (prefill
/// and rounds), that over the tokens generated; and the tokens of the prompt and of the
/// answer.
fn timings(usage: &pb::Usage) -> Vec<(HeaderName, HeaderValue)> {
    let t = usage.timings.unwrap_or_default();
    let inference = t.prefill_ms + t.rounds_ms;
    let validation = (t.total_ms - t.admission_wait_ms - inference).max(0.0);
    let per_token = match usage.completion_tokens {
        0 => 0.0,
        n => inference / f64::from(n),
    };
    let ms = |ms: f64| HeaderValue::from(ms as u64);
    // A float's text (digits, a point, a sign) is a valid header value.
    let seconds = (t.total_ms / 1e3).to_string().parse().expect("a number");
    let figures = [
        ("x-compute-time", seconds),
        ("x-total-time", ms(t.total_ms)),
        ("x-validation-time", ms(validation)),
        ("x-queue-time", ms(t.admission_wait_ms)),
        ("x-inference-time", ms(inference)),
        ("x-time-per-token", ms(per_token)),
        ("x-prompt-tokens", usage.prompt_tokens.into()),
        ("x-generated-tokens", usage.completion_tokens.into()),
    ];
    headers(figures)
}

/// `(name, value)` pairs as headers.
fn headers(
    pairs: impl IntoIterator<Item = (&'static str, HeaderValue)>,
) -> Vec<(HeaderName, HeaderValue)> {
    let named = |(name, value)| (HeaderName::from_static(name), value);
    pairs.into_iter().map(named).collect()
}

/// The answer as server-sent events, one a token (a round's tokens come together), each
/// with its text and figures; the last also with the whole text and, where asked for,
/// why it ended. No `[DONE]` follows, as TGI sends none here. A failure is an `{"error",
/// "error_type"}` event, and ends the stream; a caller that goes away ends the generation.
fn streamed(mut stream: GenerateStream, answer: Answer) -> Response {
    let compute = answer.compute();
    let (tx, rx) = mpsc::channel::<Result<Event, std::convert::Infallible>>(8);
    tokio::spawn(async move {
        let send = |body: Value| {
            let tx = tx.clone();
            async move {
                let event = Event::default().data(body.to_string());
                tx.send(Ok(event)).await.map_err(|_| Gone)
            }
        };
        let mut pieces = Utf8Stream::new();
        let (mut text, mut sent) = (answer.before.clone(), 0);
        // Each token's event waits for the next token: the last one carries the end.
        let mut held: Option<Value> = None;
        while let Some(message) = stream.next().await {
            match message.map(|m| m.event) {
                Ok(Some(Generated::Chunk(c))) => {
                    text.push_str(&c.text);
                    for (i, &id) in c.token_ids.iter().enumerate() {
                        if let Some(event) = held.take() {
                            send(event).await?;
                        }
                        sent += 1;
                        let (token, top) = answer.token(&mut pieces, id, c.logprobs.get(i));
                        held = Some(answer.event(sent, token, top));
                    }
                }
                Ok(Some(Generated::Finished(f))) => {
                    text.push_str(&f.text);
                    for event in answer.ending(held, &f, &text, sent, &mut pieces) {
                        send(event).await?;
                    }
                    return Ok(());
                }
                Ok(None) => {}
                Err(status) => {
                    if let Some(event) = held.take() {
                        send(event).await?;
                    }
                    return send(tgi_error(error_body(&status)).1).await;
                }
            }
        }
        Ok::<(), Gone>(())
    });
    let mut response = Sse::new(ReceiverStream::new(rx))
        .keep_alive(KeepAlive::default())
        .into_response();
    response.headers_mut().extend(compute);
    response
}

impl Answer {
    /// What TGI's answers carry before any figure, streamed or whole: the kind of device
    /// that generates (`gpu` or `cpu`, as TGI's `x-compute-type` begins; none where the
    /// target's worker does not say) and the prompt's characters.
    fn compute(&self) -> Vec<(HeaderName, HeaderValue)> {
        let kind = (self.models.on_gpu()).map(|gpu| if gpu { "gpu" } else { "cpu" });
        let kind = kind.map(|k| ("x-compute-type", HeaderValue::from_static(k)));
        let characters = ("x-compute-characters", HeaderValue::from(self.characters));
        headers(kind.into_iter().chain([characters]))
    }

    /// A token's event, not the last.
    fn event(&self, index: usize, token: Value, top: Vec<Value>) -> Value {
        let mut event = json!({"index": index, "token": token, "generated_text": null,
                               "details": null});
        if self.top_n > 0 {
            event["top_tokens"] = Value::Array(top);
        }
        event
    }

    /// The stream's last events once it has `finished`: the held token's, with the rest
    /// of its text, the whole `text` and, where asked for, why it ended after `sent`
    /// tokens; or where it ended without a token or early, an error after it.
    fn ending(
        &self,
        held: Option<Value>,
        finished: &pb::Finished,
        text: &str,
        sent: usize,
        pieces: &mut Utf8Stream,
    ) -> Vec<Value> {
        match (held, finish_reason(Some(finished.finish_reason))) {
            (Some(mut last), Ok(finish)) => {
                with_rest(&mut last["token"], pieces);
                last["generated_text"] = json!(text);
                if self.details {
                    let input = finished.usage.as_ref().map_or(0, |u| u.prompt_tokens);
                    last["details"] = json!({"finish_reason": finish, "generated_tokens": sent,
                                             "seed": self.seed, "input_length": input});
                }
                vec![last]
            }
            (held, end) => {
                let early = end.err();
                let why = early.unwrap_or_else(|| incomplete("it ended without a token"));
                held.into_iter().chain([tgi_error(why).1]).collect()
            }
        }
    }

    /// TGI's `Token` of `id` (its text the characters its bytes complete after the
    /// tokens' before it in `pieces`, so that the tokens' texts add up to the sequence's;
    /// its log-probability where asked for), and those of its most likely tokens (each
    /// text on its own).
    fn token(
        &self,
        pieces: &mut Utf8Stream,
        id: u32,
        figures: Option<&pb::TokenLogprobs>,
    ) -> (Value, Vec<Value>) {
        let tokenizer = &self.models.tokenizer;
        let entry = |id: u32, text: String, logprob: Option<f32>| {
            json!({"id": id, "text": text, "logprob": logprob,
                   "special": tokenizer.is_special(id)})
        };
        let chosen = entry(id, piece(pieces, tokenizer, id), figures.map(|f| f.logprob));
        let top = figures.map(|f| f.top_token_ids.iter().zip(&f.top_logprobs));
        let top = (top.into_iter().flatten()).map(|(&other, &logprob)| {
            entry(other, logprobs::token(tokenizer, other).1, Some(logprob))
        });
        (chosen, top.collect())
    }

    /// `details` of a whole answer: why it ended, its tokens, the seed, and the prompt's
    /// tokens with their figures (`prefill`, where asked for; the first has none).
    fn details(&self, done: &duet_proto::Completion, finish: &str) -> Value {
        let mut pieces = Utf8Stream::new();
        let each = done.token_ids.iter().enumerate();
        let (mut tokens, top): (Vec<Value>, Vec<Vec<Value>>) = each
            .map(|(i, &id)| self.token(&mut pieces, id, done.logprobs.get(i)))
            .unzip();
        if let Some(last) = tokens.last_mut() {
            with_rest(last, &mut pieces);
        }
        let mut prompt = Utf8Stream::new();
        let tokenizer = &self.models.tokenizer;
        let prefill = done.prompt.iter().flat_map(|p| {
            let figures = std::iter::once(None).chain(p.logprobs.iter().map(Some));
            p.token_ids.iter().zip(figures)
        });
        let prefill: Vec<Value> = prefill
            .map(|(&id, f)| {
                let text = piece(&mut prompt, tokenizer, id);
                json!({"id": id, "text": text, "logprob": f.map(|f| f.logprob)})
            })
            .collect();
        let mut details = json!({
            "finish_reason": finish,
            "generated_tokens": done.token_ids.len(),
            "seed": self.seed,
            "prefill": prefill,
            "tokens": tokens,
        });
        if self.top_n > 0 {
            details["top_tokens"] = json!(top);
        }
        details
    }
}

/// TGI's answer to `/tokenize`: each token of the input's `ids` with the characters it completes (`text`)
/// and where they lie in the input (`start`, `stop`, in characters), after the
/// beginning-of-sequence token the model adds (if any), which spans none.
pub(super) fn tokenized(models: &Models, ids: &[u32]) -> Value {
    let tokenizer = &models.tokenizer;
    let added = tokenizer.encode("", true).unwrap_or_default();
    let added = added
        .iter()
        .map(|id| json!({"id": id, "text": "", "start": 0, "stop": 0}));
    let mut pieces = Utf8Stream::new();
    let mut at = 0;
    let token = |&id: &u32| {
        let text = piece(&mut pieces, tokenizer, id);
        let start = at;
        at += text.chars().count();
        json!({"id": id, "text": text, "start": start, "stop": at})
    };
    Value::Array(added.chain(ids.iter().map(token)).collect())
}

/// The characters token `id`'s bytes complete after those before it in `pieces`.
fn piece(pieces: &mut Utf8Stream, tokenizer: &duet_engine::Tokenizer, id: u32) -> String {
    // The target answered the id, so its vocabulary holds it.
    pieces.push(&tokenizer.token_bytes(id).unwrap_or_default())
}

/// `token`'s text with what is left of a character it opened, at the sequence's end (as
/// U+FFFD, as in the sequence's text).
fn with_rest(token: &mut Value, pieces: &mut Utf8Stream) {
    let text = token["text"].as_str().unwrap_or_default().to_string();
    token["text"] = json!(text + &pieces.finish());
}

/// TGI's finish reason of duet's; a generation the server stopped early (draining) did not
/// end, which TGI's reasons cannot say: an `incomplete_generation` error.
fn finish_reason(reason: Option<i32>) -> Result<&'static str, Refusal> {
    match reason.map(pb::FinishReason::try_from) {
        Some(Ok(pb::FinishReason::Length)) => Ok("length"),
        Some(Ok(pb::FinishReason::Stop)) => Ok("stop_sequence"),
        Some(Ok(pb::FinishReason::Eos)) => Ok("eos_token"),
        _ => Err(incomplete("the server stopped the generation early")),
    }
}

fn incomplete(why: &str) -> Refusal {
    let body = super::error_json("incomplete_generation", why, None);
    (StatusCode::INTERNAL_SERVER_ERROR, body)
}

/// A refusal in TGI's shape: `{"error", "error_type"}`, a request duet cannot take 422
/// (`validation`, as TGI's), too many at once 429 (`overloaded`), others their status.
fn refuse(refused: Refusal) -> Response {
    let (status, body) = tgi_error(refused);
    json_response(status, &body)
}

fn tgi_error((status, body): Refusal) -> Refusal {
    let (status, kind) = match (status.as_u16(), body["error"]["type"].as_str()) {
        (_, Some("incomplete_generation")) => (status, "incomplete_generation"),
        (400 | 422, _) => (StatusCode::UNPROCESSABLE_ENTITY, "validation"),
        (413, _) => (status, "validation"),
        (429, _) => (status, "overloaded"),
        (401 | 403, _) => (status, "authentication"),
        _ => (status, "generation"),
    };
    let error = json!({"error": body["error"]["message"], "error_type": kind});
    (status, error)
}

/// `GET /info`: the served model and the limits a client sizes its requests by, in TGI's
/// shape (`max_total_tokens` the target's context; one sequence a request).
pub async fn info(State(app): State<App>, headers: HeaderMap) -> Response {
    let m = match served(&app, &headers).await {
        Ok(m) => m,
        Err(refused) => return refuse(refused),
    };
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let info = json!({
        "model_id": m.target_model,
        "model_sha": null,
        "model_pipeline_tag": "text-generation",
        "max_concurrent_requests": app.coord.config.max_concurrent_requests,
        "max_best_of": 1,
        "max_stop_sequences": duet_proto::MAX_STOP_STRINGS,
        "max_input_tokens": m.context.saturating_sub(1),
        "max_total_tokens": m.context,
        "validation_workers": cores,
        "max_client_batch_size": 1,
        "router": "duet",
        "version": env!("CARGO_PKG_VERSION"),
        "sha": null,
        "docker_label": null,
    });
    json_response(StatusCode::OK, &info)
}

#[cfg(test)]
mod tests;
