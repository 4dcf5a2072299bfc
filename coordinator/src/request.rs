//! Validation at the edge: a `GenerateRequest` off the wire becomes a [`ValidRequest`] (the
//! only form of a request the speculative loop sees) or an error that names the offending
//! field. Two steps: [`check`] bounds every field without tokenizing (before the request
//! takes a permit), [`Checked::tokenize`] does the expensive part (after it, off the async
//! threads). Errors never echo more than a few characters of the caller's text.

use crate::config::{CoordinatorConfig, LimitsConfig, SchedulingPolicy};
use crate::method::Method;
use crate::tools::Tools;
use duet_engine::bias::LogitBias;
use duet_engine::logprobs::MAX_TOP_LOGPROBS;
use duet_engine::penalties::Penalties;
use duet_engine::sampling::SamplingParams;
use duet_engine::structured::Format;
use duet_engine::{ChatMessage, ToolCall};
use duet_proto::MAX_STOP_STRINGS;
use duet_proto::v1 as pb;
use duet_serving::wire::format_from_wire;

mod tokenize;

#[derive(Debug, Clone, PartialEq)]
pub struct ValidRequest {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub method: Method,
    /// Draft tokens per round: exactly (DRAFT_MODEL, NGRAM), or at most (`choose_k`).
    pub k: usize,
    /// The controller chooses each round's K, up to `k`: always for AUTO (which also
    /// chooses the proposer), for DRAFT_MODEL and NGRAM where the request set no K and
    /// `speculation.adaptive.choose_k` is on.
    pub choose_k: bool,
    /// Each committed token's log-probability, with this many most likely tokens' at its
    /// position (`GenerateRequest.logprobs`, `top_logprobs`); `None`: none.
    pub logprobs: Option<usize>,
    /// The request's presence, frequency and repetition penalties (the target applies them,
    /// and the draft proposes with them).
    pub penalties: Penalties,
    /// Each prompt token's figures after the first, with this many most likely tokens' at
    /// its position (`GenerateRequest.prompt_logprobs`); `None`: none.
    pub prompt_logprobs: Option<usize>,
    /// The request's logit bias (the target applies it, and the draft proposes with it).
    pub logit_bias: LogitBias,
    /// Generation goes on past end-of-sequence tokens (`GenerateRequest.ignore_eos`).
    pub ignore_eos: bool,
    /// More tokens that end the completion as an end-of-sequence token does, also where
    /// `ignore_eos` (`GenerateRequest.stop_token_ids`).
    pub stop_token_ids: Vec<u32>,
    /// The text ends with the stop string that ended it
    /// (`GenerateRequest.include_stop_str_in_output`).
    pub include_stop_str_in_output: bool,
    /// Special (control) tokens add no text (`GenerateRequest.skip_special_tokens`, unset:
    /// true), unless tool calls are looked for.
    pub skip_special_tokens: bool,
    /// The prefix cache's salt (`OpenSessionRequest.cache_salt`): the request's own
    /// (`GenerateRequest.cache_salt`) and, where tenants are kept apart, its tenant's
    /// (`Coordinator::prefix_salt`); 0: none.
    pub cache_salt: u64,
    /// No end-of-sequence token, and no stop string, before this many completion tokens.
    pub min_tokens: usize,
    /// The predicted output's tokens (`GenerateRequest.prediction`): prompt lookup proposes
    /// from them too. Empty: none.
    pub prediction: Vec<u32>,
    /// What the completion must match (`GenerateRequest.structured_output`; the target
    /// applies it, and the draft proposes within it; a required tool call is one); `None`:
    /// free text.
    pub format: Option<Format>,
    /// The completion's tool calls are looked for (a request with tools, not `none`).
    pub finds_tool_calls: bool,
    /// The request's tools' names (a call written without its tags names one of them).
    pub tool_names: Vec<String>,
    /// More than one call is answered (`GenerateRequest.parallel_tool_calls`, unset: true).
    pub parallel_tool_calls: bool,
    /// The completion's thought comes apart from its answer (a chat of a thinking model,
    /// `separate_reasoning`): `Some(open)`, `open` where the prompt leaves a thought open.
    pub thought: Option<bool>,
    /// Of the request's repository files, those its prompt left out for room.
    pub repository_files_left_out: usize,
    /// The target's LoRA adapter (`GenerateRequest.adapter`), one the target replicas load;
    /// `None`: the target alone.
    pub adapter: Option<String>,
    /// The completion ends before a line indented by fewer than this many spaces or tabs
    /// (`GenerateRequest.min_line_indent`); 0: none.
    pub min_line_indent: usize,
    /// The completion ends at the first round this long after the first started, once its
    /// text holds a newline (`GenerateRequest.max_predict_ms`).
    pub max_predict: Option<std::time::Duration>,
    /// Its place in the lines it waits in, for a place and for KV room (0 under `fcfs`).
    pub priority: i32,
    /// The caller's id of the request (`x-request-id`), for its log line; `None`: none.
    pub request_id: Option<String>,
}

impl ValidRequest {
    /// The request's own end tokens the workers hold back until `min_tokens` (none without
    /// it: the coordinator ends the completion at them).
    pub fn held_stop_tokens(&self) -> &[u32] {
        match self.min_tokens {
            0 => &[],
            _ => &self.stop_token_ids,
        }
    }

    /// Whether a position's choice reads the completion before it: penalties count its
    /// tokens, `min_tokens` its length, a structured output its text. The target then
    /// verifies chains alone (a position reads the drafts before it, in order), and the
    /// draft session learns where the completion starts.
    pub fn reads_completion(&self) -> bool {
        !self.penalties.is_none() || self.min_tokens > 0 || self.format.is_some()
    }
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

/// Chat roles a message may have.
pub const ROLES: [&str; 4] = ["system", "user", "assistant", "tool"];

/// At most this much of a caller's text is echoed in an error.
const ECHO_CHARS: usize = 32;

/// `text`, cut to a few characters for an error message.
pub(crate) fn echo(text: &str) -> String {
    match text.char_indices().nth(ECHO_CHARS) {
        Some((at, _)) => format!("{:?}...", &text[..at]),
        None => format!("{text:?}"),
    }
}

/// A request whose every field is checked but whose input is not tokenized yet: what is
/// cheap to know before a request takes its place among the running ones.
#[derive(Debug, Clone, PartialEq)]
pub struct Checked {
    input: Input,
    max_tokens: u32,
    sampling: SamplingParams,
    stop: Vec<String>,
    method: Method,
    k: usize,
    choose_k: bool,
    logprobs: Option<usize>,
    penalties: Penalties,
    prompt_logprobs: Option<usize>,
    logit_bias: LogitBias,
    ignore_eos: bool,
    stop_token_ids: Vec<u32>,
    include_stop_str_in_output: bool,
    skip_special_tokens: bool,
    cache_salt: u64,
    min_tokens: usize,
    prediction: String,
    format: Option<Format>,
    tools: Option<Tools>,
    /// More variables for the chat template.
    template_kwargs: Option<serde_json::Map<String, serde_json::Value>>,
    /// A thinking model's thought comes apart from the answer (`separate_reasoning`).
    separate_reasoning: bool,
    min_line_indent: usize,
    max_predict: Option<std::time::Duration>,
    priority: i32,
    adapter: Option<String>,
}

#[derive(Debug, Clone, PartialEq)]
enum Input {
    Prompt(String),
    /// The text between a prompt and its suffix (`GenerateRequest.suffix`).
    Infill {
        prefix: String,
        suffix: String,
        repository: Option<duet_engine::Repository>,
    },
    Messages(Vec<ChatMessage>),
    Tokens(Vec<u32>),
}

/// Checks every field and size that needs no tokenizer. Nothing here costs more than a
/// pass over the request's bytes.
pub fn check(
    req: pb::GenerateRequest,
    config: &CoordinatorConfig,
) -> Result<Checked, InvalidField> {
    let sampling = sampling(&req)?;
    let (method, k, choose_k) = speculation(&req, config)?;
    if req.priority != 0 && config.scheduling_policy == SchedulingPolicy::Fcfs {
        let why = "this server admits first come, first served (scheduling_policy = \"fcfs\")";
        return Err(invalid("priority", why));
    }
    let limits = &config.limits;
    check_stop(&req.stop, limits)?;
    check_stop_tokens(&req)?;
    let logprobs = logprobs(&req)?;
    let prompt_logprobs = match req.prompt_logprobs {
        Some(top) if top as usize > MAX_TOP_LOGPROBS => {
            let most = MAX_TOP_LOGPROBS;
            return Err(invalid("prompt_logprobs", format!("{top}; at most {most}")));
        }
        asked => asked.map(|top| top as usize),
    };
    let penalties = penalties(&req)?;
    let max = limits.max_input_bytes;
    if req.prediction.len() > max {
        let why = format!("{} bytes; at most {max}", req.prediction.len());
        return Err(invalid("prediction", why));
    }
    let format = structured_output(&req, max)?;
    let tools = tools(&req, max)?;
    let template_kwargs = template_kwargs(&req, max)?;
    let logit_bias = LogitBias::new(req.logit_bias);
    logit_bias
        .check()
        .map_err(|why| invalid("logit_bias", why))?;
    let input = match (req.suffix, req.repository) {
        (None, Some(_)) => return Err(invalid("repository", "with a suffix only")),
        (None, None) => input(req.input, limits)?,
        (Some(suffix), repository) => infill(req.input, suffix, repository, limits)?,
    };
    Ok(Checked {
        input,
        max_tokens: req.max_tokens,
        sampling,
        stop: req.stop,
        method,
        k,
        choose_k,
        logprobs,
        penalties,
        prompt_logprobs,
        logit_bias,
        ignore_eos: req.ignore_eos,
        stop_token_ids: req.stop_token_ids,
        include_stop_str_in_output: req.include_stop_str_in_output,
        skip_special_tokens: req.skip_special_tokens.unwrap_or(true),
        cache_salt: cache_salt(&req.cache_salt)?,
        min_tokens: req.min_tokens as usize,
        prediction: req.prediction,
        format,
        tools,
        template_kwargs,
        separate_reasoning: config.separate_reasoning,
        min_line_indent: req.min_line_indent as usize,
        max_predict: (req.max_predict_ms > 0)
            .then(|| std::time::Duration::from_millis(req.max_predict_ms.into())),
        priority: req.priority,
        adapter: adapter(req.adapter)?,
    })
}

/// Bytes of an adapter's name at most.
const MAX_ADAPTER_BYTES: usize = 256;

/// A request's adapter name: none where empty; a name longer than any loaded one may be
/// is refused before it is compared with them.
fn adapter(name: String) -> Result<Option<String>, InvalidField> {
    if name.len() > MAX_ADAPTER_BYTES {
        let why = format!("{} bytes; at most {MAX_ADAPTER_BYTES}", name.len());
        return Err(invalid("adapter", why));
    }
    Ok(Some(name).filter(|name| !name.is_empty()))
}

/// The request's method, its K, and whether the controller chooses K (up to it).
fn speculation(
    req: &pb::GenerateRequest,
    config: &CoordinatorConfig,
) -> Result<(Method, usize, bool), InvalidField> {
    let Some(method) = Method::from_wire(req.speculation, config.speculation.auto_method) else {
        return Err(invalid(
            "speculation",
            format!("unknown value {}", req.speculation),
        ));
    };
    let s = &config.speculation;
    let max_k = s.max_speculative_tokens;
    let (k, choose_k) = match (req.num_speculative_tokens, method) {
        (0, Method::Auto) => (max_k, true),
        (0, Method::DRAFT_MODEL) if s.adaptive.choose_k => {
            (s.adaptive.max_draft_model_tokens, true)
        }
        (0, Method::NGRAM) if s.adaptive.choose_k => (s.adaptive.max_ngram_tokens, true),
        (0, _) => (s.num_speculative_tokens, false),
        (k, _) if k > max_k => {
            return Err(invalid(
                "num_speculative_tokens",
                format!("{k} exceeds this server's maximum of {max_k}"),
            ));
        }
        (k, method) => (k, method == Method::Auto),
    };
    Ok((method, k as usize, choose_k))
}

/// The prompt's last tokens, where a chat template opens a thought (`<think>` and blank
/// lines are a few tokens in any vocabulary).
const PROMPT_TAIL: usize = 8;

/// The request's variables for the chat template: a JSON object of at most `max` bytes, for
/// chat messages only, none of the template's own names.
fn template_kwargs(
    req: &pb::GenerateRequest,
    max: usize,
) -> Result<Option<serde_json::Map<String, serde_json::Value>>, InvalidField> {
    const FIELD: &str = "chat_template_kwargs";
    let text = req.chat_template_kwargs.trim();
    if text.is_empty() {
        return Ok(None);
    }
    if text.len() > max {
        return Err(invalid(
            FIELD,
            format!("{} bytes; at most {max}", text.len()),
        ));
    }
    if !matches!(req.input, Some(pb::generate_request::Input::Messages(_))) {
        return Err(invalid(FIELD, "chat messages only"));
    }
    let Ok(serde_json::Value::Object(kwargs)) = serde_json::from_str(text) else {
        return Err(invalid(FIELD, "not a JSON object"));
    };
    if let Some(own) = duet_engine::TEMPLATE_VARIABLES
        .iter()
        .find(|&&k| kwargs.contains_key(k))
    {
        return Err(invalid(
            FIELD,
            format!("`{own}` is the template's own variable"),
        ));
    }
    Ok(Some(kwargs))
}

/// The request's structured output: at most `max` bytes of schema or grammar, and not with
/// what would hold back the end it finishes with (`ignore_eos`, `min_tokens`). Whether it
/// compiles costs more than a pass over its bytes: `Checked::tokenize` checks that.
fn structured_output(
    req: &pb::GenerateRequest,
    max: usize,
) -> Result<Option<Format>, InvalidField> {
    let Some(format) = req.structured_output.as_ref().and_then(format_from_wire) else {
        return Ok(None);
    };
    let text = match &format {
        Format::JsonSchema(text) | Format::Regex(text) | Format::Lark(text) => text.as_str(),
        Format::JsonObject => "",
    };
    let field = "structured_output";
    if text.len() > max {
        return Err(invalid(
            field,
            format!("{} bytes; at most {max}", text.len()),
        ));
    }
    if req.ignore_eos || req.min_tokens > 0 {
        let why = "not with ignore_eos or min_tokens: a structured output ends when whole";
        return Err(invalid(field, why));
    }
    Ok(Some(format))
}

/// At most [`MAX_STOP_STRINGS`] stop strings, none empty, none over `max_stop_bytes`.
fn check_stop(stop: &[String], limits: &LimitsConfig) -> Result<(), InvalidField> {
    if stop.len() > MAX_STOP_STRINGS {
        return Err(invalid(
            "stop",
            format!("{} strings; at most {MAX_STOP_STRINGS}", stop.len()),
        ));
    }
    if stop.iter().any(String::is_empty) {
        return Err(invalid("stop", "stop strings must not be empty"));
    }
    if let Some(long) = stop.iter().find(|s| s.len() > limits.max_stop_bytes) {
        return Err(invalid(
            "stop",
            format!(
                "a stop string of {} bytes; at most {}",
                long.len(),
                limits.max_stop_bytes
            ),
        ));
    }
    Ok(())
}

/// The request's penalties, each within its range.
fn penalties(req: &pb::GenerateRequest) -> Result<Penalties, InvalidField> {
    let penalties = duet_serving::wire::penalties_from_wire(
        req.presence_penalty,
        req.frequency_penalty,
        req.repetition_penalty,
    );
    penalties
        .check()
        .map_err(|(name, why)| invalid(name, why))?;
    Ok(penalties)
}

/// The most tokens a request may end at besides the end-of-sequence token.
const MAX_STOP_TOKEN_IDS: usize = 64;

/// At most [`MAX_STOP_TOKEN_IDS`] stop tokens (with `min_tokens` the workers hold them back
/// until then, as vLLM does).
fn check_stop_tokens(req: &pb::GenerateRequest) -> Result<(), InvalidField> {
    let n = req.stop_token_ids.len();
    if n > MAX_STOP_TOKEN_IDS {
        let why = format!("{n} tokens; at most {MAX_STOP_TOKEN_IDS}");
        return Err(invalid("stop_token_ids", why));
    }
    Ok(())
}

/// How many most likely tokens' figures each committed token carries, where the request
/// asks for its figures at all.
fn logprobs(req: &pb::GenerateRequest) -> Result<Option<usize>, InvalidField> {
    let (top, most) = (req.top_logprobs as usize, MAX_TOP_LOGPROBS);
    match req.logprobs {
        false if top > 0 => Err(invalid("top_logprobs", "set logprobs to ask for them")),
        true if top > most => Err(invalid("top_logprobs", format!("{top}; at most {most}"))),
        true => Ok(Some(top)),
        false => Ok(None),
    }
}

fn input(
    input: Option<pb::generate_request::Input>,
    limits: &LimitsConfig,
) -> Result<Input, InvalidField> {
    let max = limits.max_input_bytes;
    match input {
        None => Err(invalid(
            "input",
            "set one of prompt, messages and prompt_token_ids",
        )),
        Some(pb::generate_request::Input::Prompt(text)) => {
            if text.is_empty() {
                return Err(invalid("prompt", "must not be empty"));
            }
            if text.len() > max {
                return Err(invalid(
                    "prompt",
                    format!("{} bytes; at most {max}", text.len()),
                ));
            }
            Ok(Input::Prompt(text))
        }
        Some(pb::generate_request::Input::PromptTokenIds(t)) => {
            if t.ids.is_empty() {
                return Err(invalid("prompt_token_ids", "must not be empty"));
            }
            // A token id is never less than a byte of text.
            if t.ids.len() > max {
                return Err(invalid(
                    "prompt_token_ids",
                    format!("{} tokens; at most {max}", t.ids.len()),
                ));
            }
            Ok(Input::Tokens(t.ids))
        }
        Some(pb::generate_request::Input::Messages(m)) => messages(m.messages, limits),
    }
}

/// Bytes of a request's `cache_salt` at most.
const MAX_CACHE_SALT_BYTES: usize = 1024;

/// A request's `cache_salt` as the workers' salt: a hash of it (never 0, which is none), or
/// 0 where it is empty.
fn cache_salt(salt: &str) -> Result<u64, InvalidField> {
    if salt.len() > MAX_CACHE_SALT_BYTES {
        let why = format!("{} bytes; at most {MAX_CACHE_SALT_BYTES}", salt.len());
        return Err(invalid("cache_salt", why));
    }
    Ok(match salt {
        "" => 0,
        salt => stable_hash(salt).max(1),
    })
}

/// One salt of two (a tenant's and a request's), 0 standing for none: either alone, or a
/// hash of both (never 0).
pub(crate) fn mix_salts(a: u64, b: u64) -> u64 {
    match (a, b) {
        (a, 0) => a,
        (0, b) => b,
        (a, b) => stable_hash((a, b)).max(1),
    }
}

/// A hash that every coordinator computes alike (SipHash with fixed keys): salts must agree
/// across the coordinators that open sessions on the same workers.
pub(crate) fn stable_hash(value: impl std::hash::Hash) -> u64 {
    use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};
    BuildHasherDefault::<DefaultHasher>::default().hash_one(value)
}

/// A text prompt (empty or not) and its `suffix`, for the text between them, and the
/// repository around them: within `max_input_bytes` together.
fn infill(
    input: Option<pb::generate_request::Input>,
    suffix: String,
    repository: Option<pb::Repository>,
    limits: &LimitsConfig,
) -> Result<Input, InvalidField> {
    let Some(pb::generate_request::Input::Prompt(prefix)) = input else {
        let why = "with a text prompt only (not messages or prompt_token_ids)";
        return Err(invalid("suffix", why));
    };
    let repository = repository.map(|r| duet_engine::Repository {
        name: r.name,
        path: r.path,
        files: (r.files.into_iter())
            .map(|f| duet_engine::RepositoryFile {
                path: f.path,
                text: f.text,
            })
            .collect(),
    });
    let around = repository
        .as_ref()
        .map_or(0, duet_engine::Repository::bytes);
    let (bytes, max) = (prefix.len() + suffix.len(), limits.max_input_bytes);
    if bytes > max {
        let why = format!("{bytes} bytes with the prompt; at most {max}");
        return Err(invalid("suffix", why));
    }
    if bytes + around > max {
        let why = format!("{around} bytes, {bytes} more with the prompt and suffix; at most {max}");
        return Err(invalid("repository", why));
    }
    Ok(Input::Infill {
        prefix,
        suffix,
        repository,
    })
}

/// Chat messages: at least one, at most `max_messages`, their contents within
/// `max_input_bytes` together, each of a known role.
fn messages(messages: Vec<pb::ChatMessage>, limits: &LimitsConfig) -> Result<Input, InvalidField> {
    let max = limits.max_input_bytes;
    if messages.is_empty() {
        return Err(invalid("messages", "must hold at least one message"));
    }
    if messages.len() > limits.max_messages {
        return Err(invalid(
            "messages",
            format!(
                "{} messages; at most {}",
                messages.len(),
                limits.max_messages
            ),
        ));
    }
    let call_bytes = |m: &pb::ChatMessage| -> usize {
        let calls = m.tool_calls.iter();
        calls
            .map(|c| c.id.len() + c.name.len() + c.arguments.len())
            .sum()
    };
    let bytes: usize = messages
        .iter()
        .map(|m| m.content.len() + call_bytes(m))
        .sum();
    if bytes > max {
        return Err(invalid(
            "messages",
            format!("{bytes} bytes of content; at most {max}"),
        ));
    }
    if let Some((i, m)) = messages
        .iter()
        .enumerate()
        .find(|(_, m)| !ROLES.contains(&m.role.as_str()))
    {
        let role = if m.role.is_empty() {
            "no role".to_string()
        } else {
            format!("role {}", echo(&m.role))
        };
        return Err(invalid(
            "messages",
            format!(
                "message {i} has {role}; expected one of {}",
                ROLES.join(", ")
            ),
        ));
    }
    let ids = |m: &pb::ChatMessage| {
        let calls = m.tool_calls.iter().flat_map(|c| [&c.name, &c.id]);
        let answered = Some(&m.tool_call_id).filter(|id| !id.is_empty());
        calls
            .chain(answered)
            .all(|name| crate::tools::is_name(name))
    };
    if let Some(i) = messages.iter().position(|m| !ids(m)) {
        let why = format!("message {i}: tool call names and ids are 1-64 letters, digits, _ and -");
        return Err(invalid("messages", why));
    }
    Ok(Input::Messages(
        messages.into_iter().map(chat_message).collect(),
    ))
}

fn chat_message(m: pb::ChatMessage) -> ChatMessage {
    let call = |c: pb::ToolCall| ToolCall {
        id: c.id,
        name: c.name,
        arguments: c.arguments,
    };
    ChatMessage {
        tool_calls: m.tool_calls.into_iter().map(call).collect(),
        tool_call_id: (!m.tool_call_id.is_empty()).then_some(m.tool_call_id),
        ..ChatMessage::new(m.role, m.content)
    }
}

/// The request's tools: chat messages only, their text within `max` bytes, and not beside a
/// structured output of the request's own (the calls are one).
fn tools(req: &pb::GenerateRequest, max: usize) -> Result<Option<Tools>, InvalidField> {
    let parallel = req.parallel_tool_calls.unwrap_or(true);
    let Some(tools) = Tools::check(&req.tools, &req.tool_choice, parallel)? else {
        return Ok(None);
    };
    let chat = matches!(req.input, Some(pb::generate_request::Input::Messages(_)));
    if !chat {
        return Err(invalid("tools", "chat messages only"));
    }
    let bytes: usize = (req.tools.iter())
        .map(|t| t.name.len() + t.description.len() + t.parameters.len())
        .sum();
    if bytes > max {
        return Err(invalid("tools", format!("{bytes} bytes; at most {max}")));
    }
    if tools.finds_calls() && req.structured_output.is_some() {
        return Err(invalid("tools", "not with structured_output"));
    }
    Ok(Some(tools))
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
    if !(0.0..=1.0).contains(&req.min_p) {
        return Err(invalid("min_p", format!("{} is outside [0, 1]", req.min_p)));
    }
    Ok(SamplingParams {
        temperature: req.temperature,
        top_k: req.top_k as usize,
        top_p,
        min_p: req.min_p,
        seed: req.seed,
    })
}

#[cfg(test)]
mod tests;
