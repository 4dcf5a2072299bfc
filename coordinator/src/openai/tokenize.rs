//! The target model's tokenizer over HTTP, in vLLM's shapes: `GET /tokenizer_info`,
//! `POST /tokenize` (a prompt, or chat messages rendered as a generation renders them) and
//! `POST /detokenize`. Clients that score prompts by token ids (lm-evaluation-harness's
//! "remote" tokenizer) use them instead of downloading the model's tokenizer. The tokenizer
//! works off the async threads, a call or so a core at once (`tokenized`), as a
//! generation's tokenizing does.

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
use serde_json::{Value, json};
use tonic::Status;

/// `/tokenize`'s body: text, or chat messages.
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
/// messages' text alone.
pub fn tokenize(
    coord: &Coordinator,
    models: &Models,
    req: TokenizeRequest,
) -> Result<Value, Refused> {
    let max = coord.config.limits.max_input_bytes;
    let tokens = match req {
        TokenizeRequest::Prompt {
            prompt,
            add_special_tokens,
        } => {
            if prompt.len() > max {
                return Err(format!("prompt: {} bytes; at most {max}", prompt.len()));
            }
            let ids = models.tokenizer.encode(&prompt, add_special_tokens);
            ids.map_err(|e| format!("prompt: {e}"))?
        }
        TokenizeRequest::Chat {
            messages,
            add_generation_prompt: true,
            tools,
            chat_template_kwargs,
        } => {
            let common = Common {
                tools,
                chat_template_kwargs,
                ..Common::default()
            };
            let chat = ChatRequest { messages, common }.to_request();
            prefilled(chat.map_err(|u| u.message)?, &coord.config, models)?
        }
        TokenizeRequest::Chat { tools: Some(_), .. }
        | TokenizeRequest::Chat {
            chat_template_kwargs: Some(_),
            ..
        } => {
            let why = "with add_generation_prompt only (as a generation renders them)";
            return Err(format!("tools, chat_template_kwargs: {why}"));
        }
        TokenizeRequest::Chat { messages, .. } => {
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
            ids.map_err(|e| format!("messages: {e}"))?
        }
    };
    Ok(json!({
        "count": tokens.len(),
        "max_model_len": models.context,
        "tokens": tokens,
        "token_strs": null,
    }))
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
    let text = models.tokenizer.decode(&req.tokens, false);
    Ok(json!({"prompt": text.map_err(|e| e.to_string())?}))
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
    let (models, req) = match served_with::<TokenizeRequest>(&app, &headers, body).await {
        Ok(both) => both,
        Err(refused) => return refuse(refused),
    };
    let coord = app.coord.clone();
    tokenizing(&app, move || tokenize(&coord, &models, req)).await
}

/// `POST /detokenize`.
pub(super) async fn post_detokenize(
    State(app): State<App>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let (models, req) = match served_with::<DetokenizeRequest>(&app, &headers, body).await {
        Ok(both) => both,
        Err(refused) => return refuse(refused),
    };
    tokenizing(&app, move || detokenize(&models, &req)).await
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
