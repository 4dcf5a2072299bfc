//! Validation at the edge: a `GenerateRequest` off the wire becomes a [`ValidRequest`] (the
//! only form of a request the speculative loop sees) or an error that names the offending
//! field.

use crate::config::CoordinatorConfig;
use crate::workers::Models;
use duet_engine::ChatMessage;
use duet_engine::sampling::SamplingParams;
use duet_proto::v1 as pb;

/// Stop strings per request at most.
pub const MAX_STOP_STRINGS: usize = 16;

/// How a request's tokens are proposed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Method {
    /// The controller chooses round by round.
    Auto,
    DraftModel,
    Ngram,
    /// Target only.
    #[default]
    None,
}

impl Method {
    /// As configuration and traces spell it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::DraftModel => "draft_model",
            Self::Ngram => "ngram",
            Self::None => "none",
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct ValidRequest {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub method: Method,
    /// Draft tokens per round: exactly (DRAFT_MODEL, NGRAM), at most (AUTO).
    pub k: usize,
}

/// A field that is not acceptable, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct InvalidField {
    pub field: &'static str,
    pub message: String,
}

fn invalid(field: &'static str, message: impl Into<String>) -> InvalidField {
    InvalidField {
        field,
        message: message.into(),
    }
}

/// Checks every field that needs no tokenizer (cheap, and possible before the models are
/// known), then tokenizes and checks lengths against the context.
pub fn validate(
    req: &pb::GenerateRequest,
    config: &CoordinatorConfig,
    models: &Models,
) -> Result<ValidRequest, InvalidField> {
    let sampling = sampling(req)?;
    let method = match pb::SpeculationMethod::try_from(req.speculation) {
        Ok(pb::SpeculationMethod::Auto) => match config.speculation.auto_method.as_str() {
            "draft_model" => Method::DraftModel,
            "ngram" => Method::Ngram,
            "none" => Method::None,
            _ => Method::Auto,
        },
        Ok(pb::SpeculationMethod::DraftModel) => Method::DraftModel,
        Ok(pb::SpeculationMethod::Ngram) => Method::Ngram,
        Ok(pb::SpeculationMethod::None) => Method::None,
        Err(_) => {
            return Err(invalid(
                "speculation",
                format!("unknown value {}", req.speculation),
            ));
        }
    };
    let max_k = config.speculation.max_speculative_tokens;
    let k = match req.num_speculative_tokens {
        0 if method == Method::Auto => max_k,
        0 => config.speculation.num_speculative_tokens,
        k if k > max_k => {
            return Err(invalid(
                "num_speculative_tokens",
                format!("{k} exceeds this server's maximum of {max_k}"),
            ));
        }
        k => k,
    } as usize;
    if req.stop.len() > MAX_STOP_STRINGS {
        return Err(invalid(
            "stop",
            format!("{} strings; at most {MAX_STOP_STRINGS}", req.stop.len()),
        ));
    }
    if req.stop.iter().any(String::is_empty) {
        return Err(invalid("stop", "stop strings must not be empty"));
    }

    let prompt = tokenize(req, models)?;
    let context = models.context;
    // One slot must stay free for the first completion token.
    if prompt.len() >= context {
        return Err(invalid(
            "prompt",
            format!(
                "{} tokens; the context holds {context}, including at least one completion token",
                prompt.len()
            ),
        ));
    }
    let room = context - prompt.len();
    let max_tokens = match req.max_tokens as usize {
        0 => room.min(config.default_max_tokens as usize),
        n if n > room => {
            return Err(invalid(
                "max_tokens",
                format!(
                    "{n} does not fit: the prompt takes {} of the context's {context} tokens, leaving {room}",
                    prompt.len()
                ),
            ));
        }
        n => n,
    };
    Ok(ValidRequest {
        prompt,
        max_tokens,
        sampling,
        stop: req.stop.clone(),
        method,
        k,
    })
}

fn sampling(req: &pb::GenerateRequest) -> Result<SamplingParams, InvalidField> {
    if !(req.temperature.is_finite() && req.temperature >= 0.0) {
        return Err(invalid(
            "temperature",
            format!("{} must be a number >= 0", req.temperature),
        ));
    }
    let top_p = req.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(invalid("top_p", format!("{top_p} is outside (0, 1]")));
    }
    Ok(SamplingParams {
        temperature: req.temperature,
        top_k: req.top_k as usize,
        top_p,
        seed: req.seed,
    })
}

fn tokenize(req: &pb::GenerateRequest, models: &Models) -> Result<Vec<u32>, InvalidField> {
    let tok = &models.tokenizer;
    let ids = match &req.input {
        None => return Err(invalid("input", "set either prompt or messages")),
        Some(pb::generate_request::Input::Prompt(text)) => {
            if text.is_empty() {
                return Err(invalid("prompt", "must not be empty"));
            }
            tok.encode(text, true)
                .map_err(|e| invalid("prompt", e.to_string()))?
        }
        Some(pb::generate_request::Input::Messages(m)) => {
            if m.messages.is_empty() {
                return Err(invalid("messages", "must hold at least one message"));
            }
            if let Some(bad) = m.messages.iter().find(|m| m.role.is_empty()) {
                return Err(invalid(
                    "messages",
                    format!("a message has no role (content {:?})", bad.content),
                ));
            }
            let messages: Vec<ChatMessage> = m
                .messages
                .iter()
                .map(|m| ChatMessage::new(&m.role, &m.content))
                .collect();
            let text = tok
                .apply_chat_template(&messages, true)
                .map_err(|e| invalid("messages", e.to_string()))?;
            tok.encode(&text, false)
                .map_err(|e| invalid("messages", e.to_string()))?
        }
    };
    if ids.is_empty() {
        return Err(invalid("prompt", "tokenizes to no tokens"));
    }
    Ok(ids)
}
