//! The answers' shapes: OpenAI's choices, chunks and usage of one request, and the finish
//! and stop reasons vLLM answers beside them.

use duet_proto::v1 as pb;
use serde_json::{Value, json};

/// Calls in OpenAI's shape.
fn tool_calls(calls: &[pb::ToolCall]) -> Vec<Value> {
    let call = |c: &pb::ToolCall| {
        json!({"id": c.id, "type": "function",
               "function": {"name": c.name, "arguments": c.arguments}})
    };
    calls.iter().map(call).collect()
}

/// OpenAI's finish reasons: an end-of-sequence token or a stop string is `stop`; a
/// generation the server stopped while draining is `abort`, as vLLM calls it.
pub fn finish_reason(value: Option<i32>) -> Option<&'static str> {
    match pb::FinishReason::try_from(value?).ok()? {
        pb::FinishReason::Length => Some("length"),
        pb::FinishReason::Stop | pb::FinishReason::Eos => Some("stop"),
        pb::FinishReason::Cancelled => Some("abort"),
        pb::FinishReason::Unspecified => None,
    }
}

/// vLLM's `stop_reason` of a choice: the stop string or the stop token id that ended it,
/// else null (an end-of-sequence token, `max_tokens`).
pub fn stop_reason(stop_string: &str, stop_token_id: Option<u32>) -> Value {
    match (stop_string, stop_token_id) {
        ("", Some(id)) => json!(id),
        ("", None) => Value::Null,
        (stop, _) => json!(stop),
    }
}

/// OpenAI's usage of a request's choices, `n` to a prompt (each prompt counted once, as its
/// first choice's generation took it), with duet's own figures beside it under `duet`: the
/// choices' rounds and draft tokens together, the first token of any, the last to end.
pub fn usage(choices: &[pb::Usage], n: usize) -> Value {
    let first = choices.first().cloned().unwrap_or_default();
    let prompts = choices.iter().step_by(n.max(1));
    let (prompt, cached) = prompts.fold((0, 0), |(p, c), u| {
        (p + u.prompt_tokens, c + u.prompt_tokens_cached)
    });
    let timings: Vec<pb::Timings> = choices
        .iter()
        .map(|u| u.timings.unwrap_or_default())
        .collect();
    let sum = |f: fn(&pb::Usage) -> u32| choices.iter().map(f).sum::<u32>();
    let most = |f: fn(&pb::Timings) -> f64| timings.iter().map(f).fold(0.0, f64::max);
    let ttft = timings
        .iter()
        .map(|t| t.time_to_first_token_ms)
        .fold(f64::INFINITY, f64::min);
    let completion = sum(|u| u.completion_tokens);
    let mut usage = json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": { "cached_tokens": cached },
        "duet": {
            "method": duet_proto::method_name(first.method),
            "rounds": sum(|u| u.rounds),
            "draft_tokens_proposed": sum(|u| u.draft_tokens_proposed),
            "draft_tokens_accepted": sum(|u| u.draft_tokens_accepted),
            "time_to_first_token_ms": if ttft.is_finite() { ttft } else { 0.0 },
            "admission_wait_ms": most(|t| t.admission_wait_ms),
            "total_ms": most(|t| t.total_ms),
        },
    });
    // A thinking model's thought, as OpenAI counts its reasoning models'.
    let reasoning = sum(|u| u.reasoning_tokens);
    if reasoning > 0 {
        usage["completion_tokens_details"] = json!({"reasoning_tokens": reasoning});
    }
    usage
}

/// Which endpoint, for the shapes of its answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Completion,
    Chat,
}

impl Kind {
    pub fn route(self) -> &'static str {
        match self {
            Self::Completion => "/v1/completions",
            Self::Chat => "/v1/chat/completions",
        }
    }
}

/// What every answer of one request carries.
#[derive(Debug, Clone)]
pub struct Header {
    pub kind: Kind,
    pub id: String,
    pub created: u64,
    pub model: String,
    /// A thought that comes apart is answered (`reasoning_content`); vLLM's
    /// `include_reasoning` false leaves it out.
    pub include_reasoning: bool,
}

impl Header {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.kind, chunk) {
            (Kind::Completion, _) => "text_completion",
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
        }
    }

    /// `reasoning` as the answer carries it: none where the request left it out.
    pub fn thought<'a>(&self, reasoning: &'a str) -> &'a str {
        match self.include_reasoning {
            true => reasoning,
            false => "",
        }
    }

    /// Choice `index` of a request that did not stream (`logprobs`: its tokens', or null).
    /// A chat choice that called tools answers them, with the text before them (or null)
    /// as its content, and finishes with `tool_calls`; a thinking model's thought is its
    /// message's `reasoning_content`.
    pub fn choice(
        &self,
        index: usize,
        (text, reasoning): (&str, &str),
        (finish, calls): (Option<&str>, &[pb::ToolCall]),
        logprobs: Value,
    ) -> Value {
        let mut choice = self.choice_of(index, text, (finish, calls), logprobs);
        if !self.thought(reasoning).is_empty() {
            choice["message"]["reasoning_content"] = json!(reasoning);
        }
        choice
    }

    fn choice_of(
        &self,
        index: usize,
        text: &str,
        (finish, calls): (Option<&str>, &[pb::ToolCall]),
        logprobs: Value,
    ) -> Value {
        match self.kind {
            Kind::Completion => json!({
                "index": index, "text": text, "logprobs": logprobs, "finish_reason": finish,
            }),
            Kind::Chat if calls.is_empty() => json!({
                "index": index,
                "message": {"role": "assistant", "content": text},
                "logprobs": logprobs,
                "finish_reason": finish,
            }),
            Kind::Chat => {
                let content =
                    Some(crate::tools::content_before_calls(text)).filter(|c| !c.is_empty());
                json!({
                    "index": index,
                    "message": {"role": "assistant", "content": content,
                                "tool_calls": tool_calls(calls)},
                    "logprobs": logprobs,
                    "finish_reason": "tool_calls",
                })
            }
        }
    }

    /// A streamed chat choice's calls: one chunk with them all, finishing with `tool_calls`.
    pub fn calls_chunk(&self, index: usize, calls: &[pb::ToolCall]) -> Value {
        let calls: Vec<Value> = (tool_calls(calls).into_iter().enumerate())
            .map(|(i, mut call)| {
                call["index"] = json!(i);
                call
            })
            .collect();
        let choice = json!({"index": index, "delta": {"tool_calls": calls}, "logprobs": null,
                            "finish_reason": "tool_calls"});
        self.with_choices(true, vec![choice], None)
    }

    /// The whole answer of a request that did not stream.
    pub fn response(&self, choices: Vec<Value>, usage: Value) -> Value {
        self.with_choices(false, choices, Some(usage))
    }

    /// One streamed chunk of choice `index`: `text`, its tokens' `logprobs` (or null) and, on
    /// the choice's last one, the finish reason. A chat choice's first chunk names the role.
    pub fn chunk(
        &self,
        index: usize,
        text: &str,
        first: bool,
        finish: Option<&str>,
        logprobs: Value,
    ) -> Value {
        let choice = match self.kind {
            Kind::Completion => json!({
                "index": index, "text": text, "logprobs": logprobs, "finish_reason": finish,
            }),
            Kind::Chat => {
                let delta = match (first, finish) {
                    (true, _) => json!({"role": "assistant", "content": text}),
                    (false, Some(_)) if text.is_empty() => json!({}),
                    (false, _) => json!({"content": text}),
                };
                json!({
                    "index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish,
                })
            }
        };
        self.with_choices(true, vec![choice], None)
    }

    /// A streamed chat choice's piece of its thought (`reasoning_content`, as vLLM's and
    /// llama.cpp's servers stream it), with its tokens' `logprobs` (or null).
    pub fn reasoning_chunk(
        &self,
        index: usize,
        reasoning: &str,
        first: bool,
        logprobs: Value,
    ) -> Value {
        let mut delta = json!({"reasoning_content": reasoning});
        if first {
            delta["role"] = json!("assistant");
        }
        let choice = json!({"index": index, "delta": delta, "logprobs": logprobs,
                            "finish_reason": null});
        self.with_choices(true, vec![choice], None)
    }

    /// The chunk after the last one with `stream_options.include_usage`: no choices.
    pub fn usage_chunk(&self, usage: Value) -> Value {
        self.with_choices(true, Vec::new(), Some(usage))
    }

    fn with_choices(&self, chunk: bool, choices: Vec<Value>, usage: Option<Value>) -> Value {
        let mut v = json!({
            "id": self.id,
            "object": self.object(chunk),
            "created": self.created,
            "model": self.model,
            "choices": choices,
        });
        if let Some(usage) = usage {
            v["usage"] = usage;
        }
        v
    }
}
