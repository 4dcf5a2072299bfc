//! What a generation sends its caller, as domain values (`service.rs` puts them on the wire):
//! chunks of committed tokens with their text, then the final message with the finish reason
//! and the usage. [`Output`] turns committed tokens into text deltas (whole characters, a
//! possible stop string held back) and finds where the generation ends.

use crate::method::Method;
use crate::method::Proposer;
use duet_engine::Tokenizer;
use duet_engine::detokenize::{StopStrings, Utf8Stream};
use duet_engine::logprobs::TokenLogprobs;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// `max_tokens` reached.
    Length,
    /// A stop string was produced.
    Stop,
    /// The model produced an end-of-sequence token.
    Eos,
    /// The server is shutting down and stopped the generation early.
    Cancelled,
}

impl FinishReason {
    /// As metrics and traces spell it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Length => "length",
            Self::Stop => "stop",
            Self::Eos => "eos",
            Self::Cancelled => "cancelled",
        }
    }
}

/// What one round committed.
#[derive(Debug, Clone, PartialEq)]
pub struct Chunk {
    /// New text: whole characters, text that may start a stop string held back.
    pub text: String,
    pub tokens: Vec<u32>,
    /// One per token where the request asks for log-probabilities, else empty.
    pub logprobs: Vec<TokenLogprobs>,
    /// On the first chunk of a request that asks for them (`prompt_logprobs`).
    pub prompt: Option<PromptFigures>,
}

/// A prompt as the target read it, and the figures of each of its tokens after the first.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptFigures {
    pub tokens: Vec<u32>,
    pub logprobs: Vec<TokenLogprobs>,
}

/// The end of a generation.
#[derive(Debug, Clone, PartialEq)]
pub struct Finished {
    pub reason: FinishReason,
    /// Held-back text released at the end.
    pub text: String,
    pub usage: Usage,
}

/// One message of a Generate stream.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    Chunk(Chunk),
    Finished(Box<Finished>),
}

/// What a generation used.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Usage {
    pub prompt_tokens: usize,
    /// Of those, the tokens the target took from its prefix cache.
    pub prompt_tokens_cached: usize,
    pub completion_tokens: usize,
    pub draft_tokens_proposed: usize,
    pub draft_tokens_accepted: usize,
    /// Target forward passes: speculation rounds plus target-only steps.
    pub rounds: usize,
    /// The method that ran (AUTO resolved).
    pub method: Method,
    /// K, when the method drafts: the most a round could use where the controller chose
    /// each round's (`k_chosen_per_round`).
    pub num_speculative_tokens: usize,
    pub k_chosen_per_round: bool,
    /// Why (part of) the request ran target-only although speculation was asked for.
    pub fallback: Option<String>,
    pub timings: Timings,
    /// The rounds by proposer (those that ran at least one).
    pub proposers: Vec<ProposerUsage>,
    /// Each time the request moved to another target session: completion tokens committed
    /// then, and why.
    pub target_failovers: Vec<(usize, String)>,
    /// Propose calls made while the target verified, and rounds that used their drafts
    /// (`speculation.overlap_drafting`).
    pub drafted_ahead: usize,
    pub drafted_ahead_used: usize,
}

/// One proposer's rounds in a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProposerUsage {
    pub proposer: Proposer,
    pub rounds: usize,
    pub proposed: usize,
    pub accepted: usize,
}

/// Wall-clock figures in milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Timings {
    pub time_to_first_token: f64,
    pub total: f64,
    pub prefill: f64,
    pub rounds: f64,
    /// Reported by the workers.
    pub draft_forward: f64,
    pub target_forward: f64,
    pub queue: f64,
    /// Of `draft_forward` and `queue`: Propose calls made beside a Verify.
    pub draft_ahead: f64,
    /// Of `time_to_first_token` and `total`: waiting for a place (`max_queued`).
    pub admission_wait: f64,
}

/// The tokens of one round that the generation keeps, their text, and whether it ended.
#[derive(Debug, PartialEq, Eq)]
pub struct Taken {
    /// The round's tokens up to and including the one that ended the generation.
    pub tokens: Vec<u32>,
    pub text: String,
    pub finish: Option<FinishReason>,
}

/// Turns committed tokens into text deltas and finish conditions.
#[derive(Debug)]
pub struct Output {
    utf8: Utf8Stream,
    stops: StopStrings,
    generated: usize,
    max_tokens: usize,
}

impl Output {
    pub fn new(stop: Vec<String>, max_tokens: usize) -> Self {
        Self {
            utf8: Utf8Stream::new(),
            stops: StopStrings::new(stop),
            generated: 0,
            max_tokens,
        }
    }

    /// Completion tokens taken so far.
    pub fn generated(&self) -> usize {
        self.generated
    }

    /// Completion tokens still allowed.
    pub fn remaining(&self) -> usize {
        self.max_tokens - self.generated
    }

    /// Takes a round's tokens in order, up to the first that ends the generation (the rest
    /// are dropped). `Err` names a token the tokenizer does not know.
    pub fn take(&mut self, tokenizer: &Tokenizer, tokens: &[u32]) -> Result<Taken, String> {
        let mut taken = Taken {
            tokens: Vec::new(),
            text: String::new(),
            finish: None,
        };
        for &t in tokens {
            taken.tokens.push(t);
            self.generated += 1;
            if tokenizer.is_eos(t) {
                taken.finish = Some(FinishReason::Eos);
                break;
            }
            let bytes = tokenizer
                .token_bytes(t)
                .map_err(|e| format!("detokenizing {t}: {e}"))?;
            let piece = self.utf8.push(&bytes);
            let released = self.stops.push(&piece);
            taken.text.push_str(&released.text);
            if released.stopped {
                taken.finish = Some(FinishReason::Stop);
                break;
            }
            if self.generated >= self.max_tokens {
                taken.finish = Some(FinishReason::Length);
                break;
            }
        }
        Ok(taken)
    }

    /// Text held back at the end (an incomplete character, a stop-string prefix).
    pub fn flush(&mut self, reason: FinishReason) -> String {
        if reason == FinishReason::Stop {
            return String::new();
        }
        let tail = self.utf8.finish();
        let mut text = self.stops.push(&tail).text;
        text.push_str(&self.stops.finish());
        text
    }
}
