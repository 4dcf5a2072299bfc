//! The target model's tokenizer over HTTP, in vLLM's shapes: `GET /tokenizer_info`,
//! `POST /tokenize` (a prompt, or chat messages rendered as a generation renders them) and
//! `POST /detokenize`; `/tokenize` also takes llama.cpp's body (`content`) and TGI's
//! (`inputs`) and answers each in its own shape, and llama.cpp's `POST /apply-template`
//! answers the prompt text a chat renders to. Clients that score prompts by token ids
//! (lm-evaluation-harness's "remote" tokenizer) use them instead of downloading the
//! model's tokenizer. The tokenizer works off the async threads, a call or so a core at
//! once (`tokenized`), as a generation's tokenizing does.

use super::wire::{ChatMessage, ChatRequest, Common, Tool};
use super::{App, Refusal, bad_request, error_body, json_response, refuse, served, served_with};
use crate::workers::Models;
use crate::{Coordinator, CoordinatorConfig, request};
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use duet_proto::v1 as pb;
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use tonic::Status;

/// `/tokenize`'s body: text, or chat messages; llama.cpp's text, or TGI's.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum TokenizeRequest {
    Prompt {
        prompt: String,
        /// The model's beginning-of-sequence token, where it asks for one.
        #[serde(default = "yes")]
        add_special_tokens: bool,
    },
    Chat {
        messages: Vec<ChatMessage>,
        /// The assistant turn's opening after the messages.
        #[serde(default = "yes")]
        add_generation_prompt: bool,
        /// As a chat completion's: the template renders them (with the opening only).
        tools: Option<Vec<Tool>>,
        chat_template_kwargs: Option<Value>,
    },
    /// llama.cpp's: the beginning-of-sequence token only with `add_special`; with
    /// `with_pieces`, each id with its text (its bytes where they are not UTF-8).
    Content {
        content: String,
        #[serde(default)]
        add_special: bool,
        #[serde(default)]
        with_pieces: bool,
    },
    /// TGI's: each token with the characters of `inputs` it completes.
    Inputs { inputs: String },
}

/// `/apply-template`'s body (llama.cpp's): a chat, as a chat completion sends it.
#[derive(Debug, Deserialize)]
pub struct TemplateRequest {
    messages: Vec<ChatMessage>,
    tools: Option<Vec<Tool>>,
    chat_template_kwargs: Option<Value>,
}

fn yes() -> bool {
    true
}

/// `/detokenize`'s body.
#[derive(Debug, Deserialize)]
pub struct DetokenizeRequest {
    pub tokens: Vec<u32>,
}

/// What a tokenizer call cannot do: the message of a 400.
pub type Refused = String;

/// The tokenizer's description: its special tokens' text, its chat template, the context.
pub fn info(models: &Models) -> Value {
    let tok = &models.tokenizer;
    let (eos, bos) = tok.special_texts();
    json!({
        "eos_token": eos,
        "bos_token": bos,
        "pad_token": null,
        "chat_template": tok.chat_template(),
        "model_max_length": models.context,
        "tokenizer_class": "gguf",
    })
}

/// The ids of `req`'s text, or of its messages as a generation of them prefills them (the
/// same checks, the same template, its tools); without the assistant turn's opening, the
/// messages' text alone. Each in the shape of the API whose body it is.
pub fn tokenize(
    coord: &Coordinator,
    models: &Models,
    req: TokenizeRequest,
) -> Result<Value, Refused> {
    let tokens = match req {
        TokenizeRequest::Prompt {
            prompt,
            add_special_tokens,
        } => text_ids(coord, models, ("prompt", &prompt), add_special_tokens)?,
        TokenizeRequest::Chat {
            messages,
            add_generation_prompt,
            tools,
            chat_template_kwargs,
        } => {
            let chat = TemplateRequest {
                messages,
                tools,
                chat_template_kwargs,
            };
            chat_ids(coord, models, chat, add_generation_prompt)?
        }
        TokenizeRequest::Content {
            content,
            add_special,
            with_pieces,
        } => {
            let ids = text_ids(coord, models, ("content", &content), add_special)?;
            return Ok(llama_tokens(models, &ids, with_pieces));
        }
        TokenizeRequest::Inputs { inputs } => {
            let ids = text_ids(coord, models, ("inputs", &inputs), false)?;
            return Ok(super::tgi::tokenized(models, &ids));
        }
    };
    Ok(json!({
        "count": tokens.len(),
        "max_model_len": models.context,
        "tokens": tokens,
        "token_strs": null,
    }))
}

/// The ids of `text` (the field `name`), within the input limit.
fn text_ids(
    coord: &Coordinator,
    models: &Models,
    (name, text): (&str, &str),
    add_special_tokens: bool,
) -> Result<Vec<u32>, Refused> {
    let max = coord.config.limits.max_input_bytes;
    if text.len() > max {
        return Err(format!("{name}: {} bytes; at most {max}", text.len()));
    }
    let ids = models.tokenizer.encode(text, add_special_tokens);
    ids.map_err(|e| format!("{name}: {e}"))
}

/// The ids of `chat`: as a generation of it prefills them with the assistant turn's
/// opening; without it, the messages' text alone (no tools, no template variables).
fn chat_ids(
    coord: &Coordinator,
    models: &Models,
    chat: TemplateRequest,
    add_generation_prompt: bool,
) -> Result<Vec<u32>, Refused> {
    let TemplateRequest {
        messages,
        tools,
        chat_template_kwargs,
    } = chat;
    if add_generation_prompt {
        let common = Common {
            tools,
            chat_template_kwargs,
            ..Common::default()
        };
        let chat = ChatRequest { messages, common }.to_request();
        return prefilled(chat.map_err(|u| u.message)?, &coord.config, models);
    }
    if tools.is_some() || chat_template_kwargs.is_some() {
        let why = "with add_generation_prompt only (as a generation renders them)";
        return Err(format!("tools, chat_template_kwargs: {why}"));
    }
    let messages = super::wire::messages(&messages).map_err(|u| u.message)?;
    // A generation's checks of the same messages (roles, count, size).
    let generation = pb::GenerateRequest {
        input: Some(pb::generate_request::Input::Messages(pb::Messages {
            messages: messages.clone(),
        })),
        ..Default::default()
    };
    request::check(generation, &coord.config).map_err(|e| e.to_string())?;
    let chat: Vec<_> = (messages.into_iter())
        .map(|m| duet_engine::ChatMessage::new(m.role, m.content))
        .collect();
    let ids = models.tokenizer.encode_chat(&chat, false);
    ids.map_err(|e| format!("messages: {e}"))
}

/// llama.cpp's answer: the ids, or with `with_pieces` each id with its text, or its bytes
/// where they are not UTF-8 (part of a character).
fn llama_tokens(models: &Models, ids: &[u32], with_pieces: bool) -> Value {
    if !with_pieces {
        return json!({"tokens": ids});
    }
    let piece = |&id: &u32| {
        let bytes = models.tokenizer.token_bytes(id).unwrap_or_default();
        match String::from_utf8(bytes) {
            Ok(text) => json!({"id": id, "piece": text}),
            Err(e) => json!({"id": id, "piece": e.into_bytes()}),
        }
    };
    json!({"tokens": ids.iter().map(piece).collect::<Vec<_>>()})
}

/// The prompt a generation of `request` prefills: the same checks, template and tools. Its
/// `adapter` (the `model` it named, as `openai::begin` reads it) changes no token of it.
pub fn prefilled(
    request: pb::GenerateRequest,
    config: &CoordinatorConfig,
    models: &Models,
) -> Result<Vec<u32>, Refused> {
    let request = pb::GenerateRequest {
        adapter: String::new(),
        ..request
    };
    let checked = request::check(request, config).map_err(|e| e.to_string())?;
    let valid = checked.tokenize(models, config.default_max_tokens);
    Ok(valid.map_err(|e| e.to_string())?.prompt)
}

/// The text of `req`'s ids (special tokens included), or which id is not in the vocabulary.
pub fn detokenize(models: &Models, req: &DetokenizeRequest) -> Result<Value, Refused> {
    let vocab = models.tokenizer.vocab_size();
    if let Some(id) = req.tokens.iter().find(|&&id| id as usize >= vocab) {
        return Err(format!("tokens: {id} is outside the vocabulary of {vocab}"));
    }
    let text = models
        .tokenizer
        .decode(&req.tokens, false)
        .map_err(|e| e.to_string())?;
    // vLLM's key, and llama.cpp's.
    Ok(json!({"prompt": text, "content": text}))
}

/// llama.cpp's `/apply-template`: the text of the prompt a generation of `chat` prefills
/// (the same checks, template and tools), special tokens written out.
pub fn apply_template(
    coord: &Coordinator,
    models: &Models,
    chat: TemplateRequest,
) -> Result<Value, Refused> {
    let ids = chat_ids(coord, models, chat, true)?;
    let text = models
        .tokenizer
        .decode(&ids, false)
        .map_err(|e| e.to_string())?;
    Ok(json!({"prompt": text}))
}

/// `GET /tokenizer_info`.
pub(super) async fn get_info(State(app): State<App>, headers: HeaderMap) -> Response {
    match served(&app, &headers).await {
        Ok(models) => json_response(StatusCode::OK, &info(&models)),
        Err(refused) => refuse(refused),
    }
}

/// `POST /tokenize`: off the async threads, as a generation's tokenizing is.
pub(super) async fn post_tokenize(
    State(app): State<App>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    tokenizer_call(app, headers, body, tokenize).await
}

/// `POST /detokenize`.
pub(super) async fn post_detokenize(
    State(app): State<App>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    tokenizer_call(app, headers, body, |_, models, req| {
        detokenize(models, &req)
    })
    .await
}

/// `POST /apply-template`, llama.cpp's.
pub(super) async fn post_apply_template(
    State(app): State<App>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    tokenizer_call(app, headers, body, apply_template).await
}

/// A tokenizer call whose body is a `T`: the caller's token, the served models and the
/// body checked as every call's are, then `work` on them off the async threads.
async fn tokenizer_call<T: DeserializeOwned + Send + 'static>(
    app: App,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
    work: fn(&Coordinator, &Models, T) -> Result<Value, Refused>,
) -> Response {
    let (models, req) = match served_with::<T>(&app, &headers, body).await {
        Ok(both) => both,
        Err(refused) => return refuse(refused),
    };
    let coord = app.coord.clone();
    tokenizing(&app, move || work(&coord, &models, req)).await
}

/// A tokenizer call's `work`, off the async threads in its turn (`App::tokenizing`): 200
/// with its answer, 400 naming what it refused, 500 where it panicked.
async fn tokenizing(
    app: &App,
    work: impl FnOnce() -> Result<Value, Refused> + Send + 'static,
) -> Response {
    match tokenized(app, work).await {
        Ok(body) => json_response(StatusCode::OK, &body),
        Err(refused) => refuse(refused),
    }
}

/// [`tokenizing`]'s answer or refusal, to be written in an API's shape.
pub(super) async fn tokenized(
    app: &App,
    work: impl FnOnce() -> Result<Value, Refused> + Send + 'static,
) -> Result<Value, Refusal> {
    // The semaphore is never closed.
    let Ok(_turn) = app.tokenizing.acquire().await else {
        return Err(error_body(&Status::internal("tokenizing stopped")));
    };
    match tokio::task::spawn_blocking(work).await.ok() {
        Some(Ok(body)) => Ok(body),
        Some(Err(message)) => Err(bad_request(&message, None)),
        None => Err(error_body(&Status::internal("tokenizing failed"))),
    }
}
