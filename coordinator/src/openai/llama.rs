//! llama.cpp's server's own endpoints, which editor plugins call for code completion:
//! `POST /infill` (llama.vim and llama.vscode: fill in the middle, with other files of the
//! repository as `input_extra`) and `POST /completion`, and `GET /props`, its description
//! of the server (its tokenizer endpoints' bodies are `tokenize.rs`'s). Each of the two
//! becomes duet's request (`GenerateRequest`: the repository, `n_indent` as
//! `min_line_indent`, `t_max_predict_ms` as `max_predict_ms`), so it is checked and
//! generated as a gRPC call is; the answer has llama.cpp's shape (`content`, `stop_type`,
//! `timings`, ...), whole or as server-sent events. llama.cpp's sampling defaults hold
//! (`DEFAULTS`: temperature 0.8, top_k 40, top_p 0.95, min_p 0.05), each applied where
//! `samplers` lists it, in duet's order; its parameters duet does not take are refused
//! where set away from their defaults.

use super::unhonoured::differs;
use super::wire::{Unsupported, unsupported};
use super::{App, authorized, bad_request, error_body, json_response, read, refuse, served};
use super::{in_server_span, read_all, start_seeded};
use crate::CoordinatorConfig;
use crate::service::GenerateStream;
use crate::workers::Models;
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
use serde_json::{Map, Value, json};
use tokio_stream::wrappers::ReceiverStream;

pub const INFILL: &str = "/infill";
pub const COMPLETION: &str = "/completion";
pub const PROPS: &str = "/props";

/// llama.cpp's sampling defaults: temperature, top_k, top_p, min_p.
pub const DEFAULTS: (f32, u32, f32, f32) = (0.8, 40, 0.95, 0.05);

/// Which of the two endpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Endpoint {
    Infill,
    Completion,
}

/// A request to either endpoint, as llama.cpp reads it (fields it does not know are left
/// in `rest`, and pass unless they are llama.cpp's and change the answer).
#[derive(Debug, Deserialize)]
struct Request {
    /// `/infill`: the code before the cursor, after it, and other files.
    #[serde(default)]
    input_prefix: String,
    #[serde(default)]
    input_suffix: String,
    #[serde(default)]
    input_extra: Vec<ExtraFile>,
    /// `/completion`'s prompt (text or token ids); `/infill`'s text typed after the prefix.
    #[serde(default)]
    prompt: Prompt,
    /// Completion tokens: -1 as many as the context holds (the server's default), 0 the
    /// prompt alone (an editor warming the cache).
    #[serde(default = "as_many_as_fit")]
    n_predict: i64,
    temperature: Option<f32>,
    top_k: Option<i64>,
    top_p: Option<f32>,
    min_p: Option<f32>,
    /// -1 (the default): a fresh seed.
    seed: Option<i64>,
    #[serde(default)]
    stop: Vec<String>,
    #[serde(default)]
    stream: bool,
    #[serde(default)]
    n_indent: u32,
    #[serde(default)]
    t_max_predict_ms: u32,
    /// Names, or llama.cpp's letters for them (`"kpt"`).
    samplers: Option<SamplerList>,
    response_fields: Option<Vec<String>>,
    #[serde(default)]
    ignore_eos: bool,
    #[serde(default)]
    return_tokens: bool,
    /// Completions of the same input, each drawn from a seed of its own (the seed plus its
    /// index): an answer of more than one is a list.
    n_cmpl: Option<u32>,
    /// duet's own: the speculation method (`auto`, `draft_model`, `ngram`, `none`).
    speculation: Option<String>,
    #[serde(flatten)]
    rest: Map<String, Value>,
}

fn as_many_as_fit() -> i64 {
    -1
}

#[derive(Debug, Deserialize)]
struct ExtraFile {
    #[serde(default)]
    filename: String,
    #[serde(default)]
    text: String,
}

#[derive(Debug, Default, Deserialize)]
#[serde(untagged)]
enum Prompt {
    #[default]
    None,
    Text(String),
    Tokens(Vec<u32>),
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum SamplerList {
    Names(Vec<String>),
    Letters(String),
}

impl SamplerList {
    /// The samplers' names (a letter llama.cpp does not know stays itself, and is refused).
    fn names(&self) -> Vec<String> {
        let name = |c| match c {
            'e' => "penalties",
            'd' => "dry",
            's' => "top_n_sigma",
            'k' => "top_k",
            'y' => "typ_p",
            'p' => "top_p",
            'm' => "min_p",
            'x' => "xtc",
            't' => "temperature",
            'i' => "infill",
            _ => "",
        };
        match self {
            Self::Names(names) => names.clone(),
            Self::Letters(letters) => (letters.chars())
                .map(|c| match name(c) {
                    "" => c.to_string(),
                    known => known.to_string(),
                })
                .collect(),
        }
    }
}

/// The samplers a request's `samplers` turns on (llama.cpp's names); all without it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Samplers {
    temperature: bool,
    top_k: bool,
    top_p: bool,
    min_p: bool,
}

impl Samplers {
    fn read(names: Option<&[String]>) -> Result<Self, Unsupported> {
        let Some(names) = names else {
            return Ok(Self {
                temperature: true,
                top_k: true,
                top_p: true,
                min_p: true,
            });
        };
        let on = |wanted: &[&str]| names.iter().any(|n| wanted.contains(&n.as_str()));
        // Those whose parameters are refused away from their defaults, and llama.cpp's
        // infill heuristic (merging tokens with a common prefix), which duet does not
        // apply: the middle is drawn from the target's distribution as listed.
        let inert = [
            "penalties",
            "dry",
            "top_n_sigma",
            "typ_p",
            "typical_p",
            "typical",
            "xtc",
            "infill",
        ];
        let known = ["temperature", "temp", "top_k", "top_p", "nucleus", "min_p"];
        if let Some(name) =
            (names.iter()).find(|n| !known.contains(&n.as_str()) && !inert.contains(&n.as_str()))
        {
            return Err(unsupported(
                "samplers",
                &format!("unknown sampler {name:?}"),
            ));
        }
        Ok(Self {
            temperature: on(&["temperature", "temp"]),
            top_k: on(&["top_k"]),
            top_p: on(&["top_p", "nucleus"]),
            min_p: on(&["min_p"]),
        })
    }
}

/// llama.cpp's parameters that change an answer and that duet does not take, with their
/// defaults: refused where set otherwise.
fn unhonoured() -> [(&'static str, Value); 14] {
    [
        ("repeat_penalty", json!(1.0)),
        ("presence_penalty", json!(0.0)),
        ("frequency_penalty", json!(0.0)),
        ("dry_multiplier", json!(0.0)),
        ("xtc_probability", json!(0.0)),
        ("typical_p", json!(1.0)),
        ("mirostat", json!(0)),
        ("dynatemp_range", json!(0.0)),
        ("top_n_sigma", json!(-1.0)),
        ("n_probs", json!(0)),
        ("grammar", json!("")),
        ("json_schema", json!({})),
        ("logit_bias", json!([])),
        ("lora", json!([])),
    ]
}

impl Request {
    /// duet's request for `endpoint`, and whether it is a warm-up (`n_predict` 0: the
    /// prompt alone, generated one token long and answered without it).
    fn into_request(self, endpoint: Endpoint) -> Result<(pb::GenerateRequest, bool), Unsupported> {
        self.refuse_what_duet_cannot_honour()?;
        let max_tokens = match self.n_predict {
            -1 => 0,
            0 => 1,
            n => u32::try_from(n).map_err(|_| unsupported("n_predict", "-1, 0 or a count"))?,
        };
        let seed = match self.seed {
            None | Some(-1) | Some(0xFFFF_FFFF) => rand::random(),
            Some(seed) => u64::try_from(seed).map_err(|_| unsupported("seed", "-1 or more"))?,
        };
        let speculation = match self.speculation.as_deref() {
            None => pb::SpeculationMethod::Auto,
            Some(name) => duet_proto::parse_method(name).ok_or_else(|| {
                let why = format!("unknown method {name:?} (auto, draft_model, ngram, none)");
                unsupported("speculation", &why)
            })?,
        };
        let mut request = pb::GenerateRequest {
            max_tokens,
            seed,
            speculation: speculation as i32,
            ignore_eos: self.ignore_eos,
            min_line_indent: self.n_indent,
            max_predict_ms: self.t_max_predict_ms,
            ..self.sampling()?
        };
        let warm_up = self.n_predict == 0;
        self.input(endpoint, &mut request)?;
        Ok((request, warm_up))
    }

    /// llama.cpp's sampling parameters (its defaults where unset), each where `samplers`
    /// lists it; a temperature of 0 or less is greedy, as in llama.cpp.
    fn sampling(&self) -> Result<pb::GenerateRequest, Unsupported> {
        let names = self.samplers.as_ref().map(SamplerList::names);
        let on = Samplers::read(names.as_deref())?;
        let pick = |on: bool, value: Option<f32>, default: f32, off: f32| match on {
            true => value.unwrap_or(default),
            false => off,
        };
        let (temperature, top_k, top_p, min_p) = DEFAULTS;
        let top_k = match on.top_k {
            true => (self.top_k.unwrap_or(top_k.into())).clamp(0, i64::from(u32::MAX)) as u32,
            false => 0,
        };
        Ok(pb::GenerateRequest {
            temperature: pick(on.temperature, self.temperature, temperature, 1.0).max(0.0),
            top_k,
            top_p: Some(pick(on.top_p, self.top_p, top_p, 1.0)).filter(|&p| p < 1.0),
            min_p: pick(on.min_p, self.min_p, min_p, 0.0),
            stop: self.stop.clone(),
            ..Default::default()
        })
    }

    /// Sets the input of `request`: `/completion`'s prompt; `/infill`'s prefix (and the
    /// text typed after it), suffix, and other files as the repository.
    fn input(
        self,
        endpoint: Endpoint,
        request: &mut pb::GenerateRequest,
    ) -> Result<(), Unsupported> {
        use pb::generate_request::Input;
        match (endpoint, self.prompt) {
            (Endpoint::Completion, Prompt::None) => {
                return Err(unsupported("prompt", "is required"));
            }
            (Endpoint::Completion, Prompt::Text(text)) => request.input = Some(Input::Prompt(text)),
            (Endpoint::Completion, Prompt::Tokens(ids)) => {
                request.input = Some(Input::PromptTokenIds(pb::TokenIds { ids }));
            }
            (Endpoint::Infill, Prompt::Tokens(_)) => {
                return Err(unsupported("prompt", "text only here"));
            }
            (Endpoint::Infill, typed) => {
                let typed = match typed {
                    Prompt::Text(text) => text,
                    _ => String::new(),
                };
                let files = self.input_extra.into_iter().map(|f| pb::RepositoryFile {
                    path: f.filename,
                    text: f.text,
                });
                let files: Vec<_> = files.collect();
                request.input = Some(Input::Prompt(self.input_prefix + &typed));
                request.suffix = Some(self.input_suffix);
                request.repository = (!files.is_empty()).then(|| pb::Repository {
                    files,
                    ..Default::default()
                });
            }
        }
        Ok(())
    }

    /// The first of llama.cpp's parameters duet does not take set away from its default.
    fn refuse_what_duet_cannot_honour(&self) -> Result<(), Unsupported> {
        let not = "duet does not take it";
        for (param, default) in unhonoured() {
            let value = self.rest.get(param).cloned();
            let empty_map = param == "logit_bias" && value == Some(json!({}));
            if differs(&value, &default) && !empty_map {
                return Err(unsupported(param, not));
            }
        }
        Ok(())
    }
}

/// `GET /props`, llama.cpp's description of its server, which its web UI and tools read:
/// the context (`default_generation_settings.n_ctx`), the sampling defaults `/completion`
/// applies, the requests that run at once (`total_slots`: `max_concurrent_requests`), the
/// model, its chat template and its special tokens.
pub async fn props(State(app): State<App>, headers: HeaderMap) -> Response {
    match served(&app, &headers).await {
        Ok(models) => json_response(StatusCode::OK, &props_of(&app.coord.config, &models)),
        Err(refused) => refuse(refused),
    }
}

fn props_of(config: &CoordinatorConfig, models: &Models) -> Value {
    let (temperature, top_k, top_p, min_p) = DEFAULTS;
    let (eos, bos) = models.tokenizer.special_texts();
    let params = json!({"n_predict": config.default_max_tokens, "temperature": temperature,
                        "top_k": top_k, "top_p": top_p, "min_p": min_p});
    json!({
        "default_generation_settings": {"n_ctx": models.context, "params": params},
        "total_slots": config.max_concurrent_requests,
        "model_alias": models.target_model,
        "model_path": models.target_model,
        "chat_template": models.tokenizer.chat_template().unwrap_or_default(),
        "bos_token": bos,
        "eos_token": eos,
        "modalities": {"vision": false, "audio": false},
        "build_info": format!("duet {}", env!("CARGO_PKG_VERSION")),
    })
}

/// `POST /infill`, in the request's server span.
pub async fn infill(
    State(app): State<App>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let answer = |headers, span| respond(app, headers, body, Endpoint::Infill, span);
    in_server_span(headers, INFILL, answer).await
}

/// `POST /completion`, in the request's server span.
pub async fn completion(
    State(app): State<App>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let answer = |headers, span| respond(app, headers, body, Endpoint::Completion, span);
    in_server_span(headers, COMPLETION, answer).await
}

async fn respond(
    app: App,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
    endpoint: Endpoint,
    span: tracing::Span,
) -> Response {
    let tenant = match authorized(&app, &headers) {
        Ok(tenant) => tenant,
        Err(refused) => return refuse(refused),
    };
    let request = match read::<Request>(&app, body) {
        Ok(request) => request,
        Err(refused) => return refuse(refused),
    };
    let (stream, n) = (request.stream, request.n_cmpl.unwrap_or(1) as usize);
    let (fields, return_tokens) = (request.response_fields.clone(), request.return_tokens);
    let places = app.coord.config.max_concurrent_requests;
    let checked = match super::wire::too_many(1, n, places) {
        _ if n == 0 => Err(unsupported("n_cmpl", "at least 1")),
        Some(u) => Err(Unsupported {
            param: "n_cmpl",
            ..u
        }),
        None => request.into_request(endpoint),
    };
    let (one, warm_up) = match checked {
        Ok(one) => one,
        Err(u) => return refuse(bad_request(&u.message, Some(u.param))),
    };
    let generations = match start_seeded(&app, &one, n, tenant, &span).await {
        Ok(generations) => generations,
        Err(answer) => return answer,
    };
    let model = app.coord.models().await.ok();
    let answer = Answer {
        model: model.map(|m| m.target_model.clone()).unwrap_or_default(),
        warm_up,
        return_tokens,
        fields,
    };
    match stream {
        true => streamed(generations, answer),
        false => whole(generations, answer).await,
    }
}

/// What the answer needs beside the generations.
struct Answer {
    model: String,
    warm_up: bool,
    return_tokens: bool,
    /// `response_fields`: only these (a nested one by its path, `timings/prompt_n`).
    fields: Option<Vec<String>>,
}

impl Answer {
    /// Completion `index`'s final object: the text (none for a warm-up), why it stopped
    /// (`f`: the finish reason, the stop string), the counts and timings.
    fn last(
        &self,
        index: usize,
        content: &str,
        ids: &[u32],
        f: (Option<i32>, &str, &pb::Usage),
    ) -> Value {
        let (finish, stopping_word, usage) = f;
        let (content, predicted) = match self.warm_up {
            true => ("", 0),
            false => (content, usage.completion_tokens),
        };
        let stop_type = match finish.and_then(|f| pb::FinishReason::try_from(f).ok()) {
            Some(pb::FinishReason::Eos) if !self.warm_up => "eos",
            Some(pb::FinishReason::Stop) => "word",
            _ => "limit",
        };
        let body = json!({
            "index": index,
            "content": content,
            "tokens": self.tokens(ids),
            "stop": true,
            "model": self.model,
            "tokens_predicted": predicted,
            "tokens_evaluated": usage.prompt_tokens,
            "has_new_line": content.contains('\n'),
            "truncated": usage.repository_files_left_out > 0,
            "stop_type": stop_type,
            "stopping_word": stopping_word,
            "tokens_cached": usage.prompt_tokens_cached,
            "timings": timings(usage, predicted),
        });
        match &self.fields {
            Some(fields) => pick(&body, fields),
            None => body,
        }
    }

    /// A piece of completion `index`'s text as it comes, with its count so far.
    fn piece(&self, index: usize, content: &str, ids: &[u32], predicted: usize) -> Value {
        json!({
            "index": index,
            "content": content,
            "tokens": self.tokens(ids),
            "stop": false,
            "tokens_predicted": predicted,
        })
    }

    fn tokens<'a>(&self, ids: &'a [u32]) -> &'a [u32] {
        match self.return_tokens && !self.warm_up {
            true => ids,
            false => &[],
        }
    }
}

/// llama.cpp's timings: the prompt's tokens not taken from the cache and their prefill,
/// the completion's tokens and their rounds.
fn timings(usage: &pb::Usage, predicted: u32) -> Value {
    let t = usage.timings.unwrap_or_default();
    let prompt_n = usage.prompt_tokens - usage.prompt_tokens_cached;
    let per = |ms: f64, n: u32| match n {
        0 => (0.0, 0.0),
        n => (
            ms / f64::from(n),
            if ms > 0.0 {
                1e3 * f64::from(n) / ms
            } else {
                0.0
            },
        ),
    };
    let (prompt_per_token, prompt_per_second) = per(t.prefill_ms, prompt_n);
    let (predicted_per_token, predicted_per_second) = per(t.rounds_ms, predicted);
    json!({
        "prompt_n": prompt_n,
        "prompt_ms": t.prefill_ms,
        "prompt_per_token_ms": prompt_per_token,
        "prompt_per_second": prompt_per_second,
        "predicted_n": predicted,
        "predicted_ms": t.rounds_ms,
        "predicted_per_token_ms": predicted_per_token,
        "predicted_per_second": predicted_per_second,
    })
}

/// Of `body`, the `fields` it has, each under its path (`timings/prompt_n` stays that key),
/// as llama.cpp's `response_fields` picks them.
fn pick(body: &Value, fields: &[String]) -> Value {
    let found = fields.iter().filter_map(|path| {
        let value = path.split('/').try_fold(body, |v, key| v.get(key))?;
        Some((path.clone(), value.clone()))
    });
    Value::Object(found.collect())
}

/// The final object, or with `n_cmpl` above 1 a list of them (the first to fail fails the
/// request).
async fn whole(generations: Vec<GenerateStream>, answer: Answer) -> Response {
    let n = generations.len();
    let done = match read_all(generations).await {
        Ok(done) => done,
        Err(answer) => return answer,
    };
    let mut bodies = done.iter().enumerate().map(|(i, c)| {
        let f = (c.finish_reason, c.stop_string.as_str(), &c.usage);
        answer.last(i, &c.text, &c.token_ids, f)
    });
    let body = match n {
        1 => bodies.next().unwrap_or_default(),
        _ => Value::Array(bodies.collect()),
    };
    json_response(StatusCode::OK, &body)
}

/// One event per round's text of each completion (`stop` false), then each one's final
/// object (`stop` true, its `content` empty), as llama.cpp streams; a warm-up sends the
/// final objects alone. A failure mid-stream is an event with the error body, and ends the
/// stream; a caller that goes away ends the generations.
fn streamed(generations: Vec<GenerateStream>, answer: Answer) -> Response {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Event, std::convert::Infallible>>(8);
    tokio::spawn(async move {
        let mut predicted = vec![0; generations.len()];
        let tagged = generations.into_iter().enumerate();
        let mut merged = futures::stream::select_all(tagged.map(|(i, g)| g.map(move |m| (i, m))));
        while let Some((i, message)) = merged.next().await {
            let mut events = Vec::new();
            let mut failed = false;
            match message.map(|m| m.event) {
                Ok(Some(Generated::Chunk(c))) if !answer.warm_up => {
                    predicted[i] += c.token_ids.len();
                    events.push(answer.piece(i, &c.text, &c.token_ids, predicted[i]));
                }
                Ok(Some(Generated::Finished(f))) => {
                    if !f.text.is_empty() && !answer.warm_up {
                        events.push(answer.piece(i, &f.text, &[], predicted[i]));
                    }
                    let usage = f.usage.unwrap_or_default();
                    let last = (Some(f.finish_reason), f.stop_string.as_str(), &usage);
                    events.push(answer.last(i, "", &[], last));
                }
                Ok(_) => {}
                Err(status) => (events, failed) = (vec![error_body(&status).1], true),
            }
            for event in events {
                let event = Event::default().data(event.to_string());
                if tx.send(Ok(event)).await.is_err() {
                    return;
                }
            }
            if failed {
                return;
            }
        }
    });
    Sse::new(ReceiverStream::new(rx))
        .keep_alive(KeepAlive::default())
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn into_request(
        endpoint: Endpoint,
        body: Value,
    ) -> Result<(pb::GenerateRequest, bool), String> {
        let request: Request = serde_json::from_value(body).unwrap();
        request.into_request(endpoint).map_err(|u| u.message)
    }

    /// llama.cpp's sampling defaults, each where `samplers` lists it (llama.vim's list
    /// leaves temperature and min_p out: 1 and none); a temperature of 0 or less is greedy;
    /// `n_predict` -1 is the server's default and 0 a warm-up of one token.
    #[test]
    fn llama_cpps_defaults_and_samplers_hold() {
        let (all, warm_up) = into_request(Endpoint::Completion, json!({"prompt": "x"})).unwrap();
        let sampling = (
            all.temperature,
            all.top_k,
            all.top_p,
            all.min_p,
            all.max_tokens,
        );
        assert_eq!((sampling, warm_up), ((0.8, 40, Some(0.95), 0.05, 0), false));
        let listed = json!({"prompt": "x", "samplers": ["top_k", "top_p", "infill"],
                            "top_p": 0.9, "n_predict": 0});
        let (some, warm_up) = into_request(Endpoint::Completion, listed).unwrap();
        let sampling = (
            some.temperature,
            some.top_k,
            some.top_p,
            some.min_p,
            some.max_tokens,
        );
        assert_eq!((sampling, warm_up), ((1.0, 40, Some(0.9), 0.0, 1), true));
        let letters = json!({"prompt": "x", "samplers": "kt", "temperature": 0.5});
        let (letters, _) = into_request(Endpoint::Completion, letters).unwrap();
        let sampling = (
            letters.temperature,
            letters.top_k,
            letters.top_p,
            letters.min_p,
        );
        assert_eq!(sampling, (0.5, 40, None, 0.0));
        let greedy = json!({"prompt": "x", "temperature": -1, "top_p": 1, "top_k": 0,
                            "n_predict": 7, "seed": 3});
        let (greedy, _) = into_request(Endpoint::Completion, greedy).unwrap();
        let sampling = (
            greedy.temperature,
            greedy.top_k,
            greedy.top_p,
            greedy.max_tokens,
        );
        assert_eq!((sampling, greedy.seed), ((0.0, 0, None, 7), 3));
    }

    /// `/infill`: the prefix and the text typed after it, the suffix, the other files as the
    /// repository (unnamed; a file without text is empty), the line and time limits;
    /// `/completion`: the prompt as text or ids.
    #[test]
    fn an_infill_is_a_middle_with_its_repository() {
        let body = json!({"input_prefix": "def f(", "input_suffix": "):\n", "prompt": "a",
                          "input_extra": [{"filename": "a.py", "text": "x = 1\n", "time": 3},
                                          {"filename": "empty.py"}],
                          "n_indent": 4, "t_max_predict_ms": 250, "cache_prompt": true});
        let (r, _) = into_request(Endpoint::Infill, body).unwrap();
        use pb::generate_request::Input;
        assert_eq!(r.input, Some(Input::Prompt("def f(a".into())));
        assert_eq!(r.suffix.as_deref(), Some("):\n"));
        let file = |path: &str, text: &str| pb::RepositoryFile {
            path: path.into(),
            text: text.into(),
        };
        let repository = pb::Repository {
            files: vec![file("a.py", "x = 1\n"), file("empty.py", "")],
            ..Default::default()
        };
        assert_eq!(r.repository, Some(repository));
        assert_eq!((r.min_line_indent, r.max_predict_ms), (4, 250));
        let (r, _) = into_request(Endpoint::Infill, json!({})).unwrap();
        assert_eq!(
            (r.input, r.suffix, r.repository),
            (
                Some(Input::Prompt(String::new())),
                Some(String::new()),
                None
            )
        );
        let (r, _) = into_request(Endpoint::Completion, json!({"prompt": [1, 2]})).unwrap();
        let ids = Input::PromptTokenIds(pb::TokenIds { ids: vec![1, 2] });
        assert_eq!((r.input, r.suffix), (Some(ids), None));
    }

    /// Parameters duet does not take are refused by name away from their defaults, as are
    /// an unknown sampler, a missing prompt and out-of-range counts.
    #[test]
    fn what_duet_cannot_honour_is_refused_by_name() {
        let passing = json!({"prompt": "x", "repeat_penalty": 1, "logit_bias": {},
                             "n_probs": 0, "grammar": "", "mirostat": 0});
        assert!(into_request(Endpoint::Completion, passing).is_ok());
        for (body, why) in [
            (
                json!({"repeat_penalty": 1.1}),
                "repeat_penalty: duet does not take it",
            ),
            (
                json!({"logit_bias": [[1, 2.0]]}),
                "logit_bias: duet does not take it",
            ),
            (
                json!({"grammar": "root ::= x"}),
                "grammar: duet does not take it",
            ),
            (
                json!({"samplers": ["top_k", "fancy"]}),
                "samplers: unknown sampler \"fancy\"",
            ),
            (json!({"samplers": "kq"}), "samplers: unknown sampler \"q\""),
            (
                json!({"lora": [{"id": 0, "scale": 0.5}]}),
                "lora: duet does not take it",
            ),
            (json!({"n_predict": -2}), "n_predict: -1, 0 or a count"),
            (json!({"seed": -5}), "seed: -1 or more"),
        ] {
            let mut body = body;
            body["prompt"] = json!("x");
            assert_eq!(into_request(Endpoint::Completion, body).unwrap_err(), why);
        }
        let none = into_request(Endpoint::Completion, json!({})).unwrap_err();
        assert_eq!(none, "prompt: is required");
        let ids = into_request(Endpoint::Infill, json!({"prompt": [1]})).unwrap_err();
        assert_eq!(ids, "prompt: text only here");
    }

    /// `response_fields` keeps the fields named, a nested one under its path.
    #[test]
    fn response_fields_pick_by_path() {
        let body = json!({"content": "x", "timings": {"prompt_n": 3, "prompt_ms": 1.5}});
        let fields = ["content", "timings/prompt_n", "missing", ""].map(String::from);
        assert_eq!(
            pick(&body, &fields),
            json!({"content": "x", "timings/prompt_n": 3})
        );
    }
}
