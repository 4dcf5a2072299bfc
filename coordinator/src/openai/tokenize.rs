//! The target model's tokenizer over HTTP, in vLLM's shapes: `GET /tokenizer_info`,
//! `POST /tokenize` (a prompt, or chat messages rendered as a generation renders them) and
//! `POST /detokenize`. Clients that score prompts by token ids (lm-evaluation-harness's
//! "remote" tokenizer) use them instead of downloading the model's tokenizer.

use super::wire::{ChatMessage, ChatRequest, Common, Tool};
use crate::workers::Models;
use crate::{Coordinator, CoordinatorConfig, request};
use duet_proto::v1 as pb;
use serde::Deserialize;
use serde_json::{Value, json};

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
