//! What a generation sends its caller, as domain values (`service.rs` puts them on the wire):
//! chunks of committed tokens with their text, then the final message with the finish reason
//! and the usage. [`Output`] turns committed tokens into text deltas (whole characters, a
//! possible stop string held back) and finds where the generation ends.

use crate::method::Method;
use crate::method::Proposer;
use crate::reasoning::{Split, Thought};
use crate::request::ValidRequest;
use duet_engine::detokenize::{Released, StopStrings, Utf8Stream};
use duet_engine::logprobs::TokenLogprobs;
use duet_engine::{Tokenizer, ToolCall};

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
    /// New text: whole characters, text that may start a stop string held back (the
    /// answer's, where the thought comes apart).
    pub text: String,
    /// New text of the thought, where it comes apart (`ValidRequest::thought`).
    pub reasoning: String,
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
    /// Held-back text of the thought released at the end.
    pub reasoning: String,
    pub usage: Usage,
    /// The tool calls the completion's text holds (a request with tools).
    pub tool_calls: Vec<ToolCall>,
    /// The stop string that ended it, if one did.
    pub stop_string: Option<String>,
    /// The request's stop token that ended it, if one did.
    pub stop_token_id: Option<u32>,
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
    /// Of those, a thinking model's thought's, where it comes apart (`Output`).
    pub reasoning_tokens: usize,
    /// Of the request's repository files, those left out for room.
    pub repository_files_left_out: usize,
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
    /// Completion tokens committed each time the request gave its target session up for
    /// a request of a lower priority number (`priority_preemption`).
    pub preempted_at: Vec<usize>,
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
    /// The thought's text, where it comes apart.
    pub reasoning: String,
    pub finish: Option<FinishReason>,
}

/// Turns committed tokens into text deltas and finish conditions.
#[derive(Debug)]
pub struct Output {
    utf8: Utf8Stream,
    stops: StopStrings,
    generated: usize,
    max_tokens: usize,
    /// Stop strings are looked for in the text after this many tokens.
    min_tokens: usize,
    /// End-of-sequence tokens end nothing (and add no text).
    ignore_eos: bool,
    /// The request's own end tokens (`stop_token_ids`), which end it even so.
    stop_tokens: Vec<u32>,
    /// The one of them that ended it, once one has.
    stopped_by: Option<u32>,
    /// Special (control) tokens add no text (`skip_special_tokens`), where no tool calls
    /// are looked for: a call may begin with one (Llama 3's `<|python_tag|>`).
    skip_special: bool,
    /// The whole text so far (the answer's), where the request's tool calls are looked
    /// for in it.
    kept: Option<String>,
    /// Splits the thought from the answer, where it comes apart.
    thought: Option<Thought>,
    /// Ends the text before a line indented too little (`min_line_indent`).
    indent: Option<Indent>,
    /// Whether the text so far holds a newline, looked for only where a time limit waits
    /// for one (`max_predict`).
    newline: Option<bool>,
}

/// Where a line indented by fewer than `min` spaces or tabs starts its text.
#[derive(Debug)]
struct Indent {
    min: usize,
    /// The current line's indentation while its leading blanks are read (after a newline:
    /// the first line is not looked at).
    leading: Option<usize>,
}

impl Indent {
    /// The offset in `text` of the first non-blank character of a line indented too little.
    fn cut(&mut self, text: &str) -> Option<usize> {
        for (at, c) in text.char_indices() {
            match (c, &mut self.leading) {
                // A blank line ends nothing.
                ('\n', leading) => *leading = Some(0),
                (' ' | '\t', Some(n)) => *n += 1,
                ('\r', Some(_)) => {}
                (_, Some(n)) if *n < self.min => return Some(at),
                (_, leading) => *leading = None,
            }
        }
        None
    }
}

impl Output {
    pub fn new(req: &ValidRequest) -> Self {
        Self {
            utf8: Utf8Stream::new(),
            stops: StopStrings::new(req.stop.clone()).keeping_stop(req.include_stop_str_in_output),
            generated: 0,
            max_tokens: req.max_tokens,
            min_tokens: req.min_tokens,
            ignore_eos: req.ignore_eos,
            stop_tokens: req.stop_token_ids.clone(),
            stopped_by: None,
            skip_special: req.skip_special_tokens && !req.finds_tool_calls,
            kept: req.finds_tool_calls.then(String::new),
            thought: req.thought.map(Thought::new),
            indent: (req.min_line_indent > 0).then_some(Indent {
                min: req.min_line_indent,
                leading: None,
            }),
            newline: req.max_predict.map(|_| false),
        }
    }

    /// The stop string that ended the text, once one has.
    pub fn stop_string(&self) -> Option<&str> {
        self.stops.matched()
    }

    /// The request's stop token that ended it, once one has.
    pub fn stop_token(&self) -> Option<u32> {
        self.stopped_by
    }

    /// Whether the text so far holds a newline.
    pub fn holds_newline(&self) -> bool {
        self.newline == Some(true)
    }

    /// `text` released by the stop strings (of one token where `token`) added to `out`, the
    /// thought's part apart where it comes apart; the answer's part kept for tool calls.
    fn release(&mut self, text: &str, token: bool, out: &mut Split) {
        let split;
        let (content, reasoning) = match &mut self.thought {
            Some(thought) => {
                split = match token {
                    true => thought.push_token(text),
                    false => thought.push(text),
                };
                (split.content.as_str(), split.reasoning.as_str())
            }
            None => (text, ""),
        };
        out.content.push_str(content);
        out.reasoning.push_str(reasoning);
        if let Some(kept) = &mut self.kept {
            kept.push_str(content);
        }
    }

    /// The whole text, where the request's tool calls are looked for.
    pub fn kept(&self) -> Option<&str> {
        self.kept.as_deref()
    }

    /// Completion tokens taken so far.
    pub fn generated(&self) -> usize {
        self.generated
    }

    /// Of those, the thought's, where it comes apart.
    pub fn reasoning_tokens(&self) -> usize {
        self.thought.as_ref().map_or(0, Thought::tokens)
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
            reasoning: String::new(),
            finish: None,
        };
        let mut out = Split::default();
        for &t in tokens {
            taken.tokens.push(t);
            self.generated += 1;
            match tokenizer.is_eos(t) {
                _ if self.stop_tokens.contains(&t) => {
                    self.stopped_by = Some(t);
                    taken.finish = Some(FinishReason::Eos);
                    break;
                }
                true if !self.ignore_eos => {
                    taken.finish = Some(FinishReason::Eos);
                    break;
                }
                true => {}
                false => {
                    let piece = self.piece(tokenizer, t)?;
                    // The first min_tokens tokens' text is not looked at for stop strings.
                    let mut released = match self.generated <= self.min_tokens {
                        true => Released {
                            text: piece,
                            stopped: false,
                        },
                        false => self.stops.push(&piece),
                    };
                    let looked_at = self.generated > self.min_tokens;
                    let indent = self.indent.as_mut().filter(|_| looked_at);
                    if let Some(at) = indent.and_then(|i| i.cut(&released.text)) {
                        released.text.truncate(at);
                        released.stopped = true;
                    }
                    if let Some(newline) = &mut self.newline {
                        *newline |= released.text.contains('\n');
                    }
                    self.release(&released.text, true, &mut out);
                    if released.stopped {
                        taken.finish = Some(FinishReason::Stop);
                        break;
                    }
                }
            }
            if self.generated >= self.max_tokens {
                taken.finish = Some(FinishReason::Length);
                break;
            }
        }
        (taken.text, taken.reasoning) = (out.content, out.reasoning);
        Ok(taken)
    }

    /// The text `token` completes: none for a skipped special token (a thought's tags are
    /// kept where the thought comes apart, as its splitter reads them).
    fn piece(&mut self, tokenizer: &Tokenizer, token: u32) -> Result<String, String> {
        let mut bytes = tokenizer
            .token_bytes(token)
            .map_err(|e| format!("detokenizing {token}: {e}"))?;
        let skipped = self.skip_special && tokenizer.is_special(token);
        if skipped && !(self.thought.is_some() && Thought::is_tag(&bytes)) {
            bytes.clear();
        }
        Ok(self.utf8.push(&bytes))
    }

    /// Text held back at the end (an incomplete character, a stop-string prefix, what may
    /// start a thought's tag).
    pub fn flush(&mut self, reason: FinishReason) -> Split {
        let mut split = Split::default();
        if reason != FinishReason::Stop {
            let tail = self.utf8.finish();
            let mut text = self.stops.push(&tail).text;
            text.push_str(&self.stops.finish());
            self.release(&text, false, &mut split);
        }
        if let Some(thought) = &mut self.thought {
            let last = thought.finish();
            if let Some(kept) = &mut self.kept {
                kept.push_str(&last.content);
            }
            split.reasoning.push_str(&last.reasoning);
            split.content.push_str(&last.content);
        }
        split
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Takes `rounds` in turn from an output for `req`: each round's taken tokens, text and
    /// finish.
    fn take(req: &ValidRequest, rounds: &[&[u32]]) -> Vec<(usize, String, Option<FinishReason>)> {
        let models = crate::generation::fakes::models();
        let mut output = Output::new(req);
        let each = rounds
            .iter()
            .map(|round| output.take(&models.tokenizer, round).unwrap());
        each.map(|t| (t.tokens.len(), t.text, t.finish)).collect()
    }

    fn request(stop: &str, max_tokens: usize) -> ValidRequest {
        let mut req = crate::generation::tests::request(crate::method::Method::NONE, 4, max_tokens);
        req.stop = vec![stop.into()];
        req
    }

    /// An end-of-sequence token ends the output, unless the request ignores it: then it adds
    /// no text and the output goes on to max_tokens.
    #[test]
    fn an_ignored_end_of_sequence_adds_nothing_and_ends_nothing() {
        let tok = &crate::generation::fakes::models().tokenizer;
        let eos = *tok.eos_tokens().first().unwrap();
        let cat = tok.encode(" cat", false).unwrap();
        let round = [cat[0], eos, cat[0]];
        let text = tok.decode(&cat[..1], false).unwrap();
        let ended = take(&request("zz", 8), &[&round]);
        assert_eq!(ended, [(2, text.clone(), Some(FinishReason::Eos))]);
        let ignoring = ValidRequest {
            ignore_eos: true,
            ..request("zz", 4)
        };
        let went_on = take(&ignoring, &[&round, &[eos, eos]]);
        let twice = format!("{text}{text}");
        assert_eq!(
            went_on,
            [
                (3, twice, None),
                (1, String::new(), Some(FinishReason::Length))
            ]
        );
    }

    /// A request's stop token ends the output as the end-of-sequence token does, its text
    /// left out and the text held back for a stop string released, also where the request
    /// ignores the end-of-sequence token.
    #[test]
    fn a_stop_token_ends_as_the_end_of_sequence_does() {
        let tok = &crate::generation::fakes::models().tokenizer;
        let cat = tok.encode(" cat", false).unwrap();
        let stop = tok.encode("z", false).unwrap()[0];
        assert!(!cat.contains(&stop));
        let req = ValidRequest {
            stop_token_ids: vec![stop],
            ignore_eos: true,
            ..request(" cat and", 16)
        };
        let mut output = Output::new(&req);
        let round: Vec<u32> = cat.iter().chain([&stop]).chain(&cat).copied().collect();
        let taken = output.take(tok, &round).unwrap();
        let ended = (taken.tokens.len(), taken.finish);
        assert_eq!(ended, (cat.len() + 1, Some(FinishReason::Eos)));
        // " cat" may begin the stop string: held back until the end releases it.
        assert_eq!(taken.text, "");
        let held = output.flush(FinishReason::Eos);
        assert_eq!(held.content, " cat");
    }

    /// A special (control) token the model writes adds no text but counts as a completion
    /// token, unless the request keeps them (`skip_special_tokens` false) or looks for tool
    /// calls (a call may begin with one).
    #[test]
    fn special_tokens_add_no_text_unless_kept() {
        let tok = &crate::generation::fakes::models().tokenizer;
        let cat = tok.encode(" cat", false).unwrap()[0];
        let start = tok.encode("<|im_start|>", false).unwrap();
        assert!(start.len() == 1 && tok.is_special(start[0]));
        let round = [cat, start[0], cat];
        let text = tok.decode(&[cat], false).unwrap();
        let skipped = take(&request("zz", 8), &[&round]);
        assert_eq!(skipped, [(3, format!("{text}{text}"), None)]);
        let kept = format!("{text}<|im_start|>{text}");
        let keeping = ValidRequest {
            skip_special_tokens: false,
            ..request("zz", 8)
        };
        assert_eq!(take(&keeping, &[&round]), [(3, kept.clone(), None)]);
        let calls = ValidRequest {
            finds_tool_calls: true,
            ..request("zz", 8)
        };
        assert_eq!(take(&calls, &[&round]), [(3, kept, None)]);
    }

    /// Where a vocabulary's `<think>` is a control token, it still opens the thought where
    /// the thought comes apart: the splitter reads it.
    #[test]
    fn a_special_thought_tag_is_kept_for_the_splitter() {
        let model = duet_engine::testing::TinyModel {
            more_specials: vec!["<think>".into()],
            ..Default::default()
        };
        let tok = model.tokenizer().unwrap();
        let think = tok.encode("<think>", false).unwrap();
        assert!(think.len() == 1 && tok.is_special(think[0]));
        let rest = tok.encode("x</think> cat", false).unwrap();
        let req = ValidRequest {
            thought: Some(false),
            ..request("zz", 32)
        };
        let mut output = Output::new(&req);
        let round: Vec<u32> = think.iter().chain(&rest).copied().collect();
        let taken = output.take(&tok, &round).unwrap();
        assert_eq!(
            (taken.reasoning.as_str(), taken.text.as_str()),
            ("x", "cat")
        );
    }

    /// A stop string is looked for only in the text after the first min_tokens tokens:
    /// within them it is text; after them it ends the output as ever. min_tokens equal to
    /// max_tokens ends at max_tokens.
    #[test]
    fn stop_strings_wait_for_min_tokens() {
        let tok = &crate::generation::fakes::models().tokenizer;
        let ids = tok.encode("a cat. a cat.", false).unwrap();
        let text = tok.decode(&ids, false).unwrap();
        let first = text.find("cat").unwrap();
        let plain = take(&request("cat", 32), &[&ids]);
        assert_eq!(plain[0].1, text[..first]);
        assert_eq!(plain[0].2, Some(FinishReason::Stop));
        // The first "cat" inside the first min_tokens tokens, the second after them.
        let upto = (1..=ids.len())
            .find(|&n| tok.decode(&ids[..n], false).unwrap().len() >= first + 3)
            .unwrap();
        let waiting = ValidRequest {
            min_tokens: upto,
            ..request("cat", 32)
        };
        let second = text[first + 3..].find("cat").unwrap() + first + 3;
        let taken = take(&waiting, &[&ids]);
        assert_eq!(
            (taken[0].1.as_str(), taken[0].2),
            (&text[..second], Some(FinishReason::Stop))
        );
        let all = ValidRequest {
            min_tokens: 3,
            ..request("cat", 3)
        };
        assert_eq!(take(&all, &[&ids])[0].0, 3);
        assert_eq!(take(&all, &[&ids])[0].2, Some(FinishReason::Length));
    }

    /// A thinking model's thought comes apart from its answer token by token, a stop
    /// string still ends the text (the thought's included), and tool calls are looked for
    /// in the answer alone.
    #[test]
    fn the_thought_comes_apart_from_the_answer() {
        let tok = &crate::generation::fakes::models().tokenizer;
        let text = "<think>\nthe cat</think>\n\n<tool_call>the a</tool_call> end";
        let ids = tok.encode(text, false).unwrap();
        let thinking = ValidRequest {
            thought: Some(false),
            finds_tool_calls: true,
            ..request("zz", 64)
        };
        let mut output = Output::new(&thinking);
        let (mut reasoning, mut content) = (String::new(), String::new());
        for id in &ids {
            let taken = output.take(tok, &[*id]).unwrap();
            reasoning.push_str(&taken.reasoning);
            content.push_str(&taken.text);
        }
        let last = output.flush(FinishReason::Length);
        reasoning.push_str(&last.reasoning);
        content.push_str(&last.content);
        assert_eq!(reasoning, "\nthe cat");
        assert_eq!(content, "<tool_call>the a</tool_call> end");
        assert_eq!(output.kept(), Some(content.as_str()));
        // Stopped inside the thought: the thought up to the stop string.
        let stopped = ValidRequest {
            thought: Some(false),
            ..request("cat", 64)
        };
        let mut output = Output::new(&stopped);
        let taken = output.take(tok, &ids).unwrap();
        assert_eq!(taken.finish, Some(FinishReason::Stop));
        assert_eq!(taken.reasoning, "\nthe ");
        assert_eq!(
            (taken.text.as_str(), output.flush(FinishReason::Stop)),
            ("", Split::default())
        );
    }

    /// With min_line_indent, the text ends right before the first non-blank character of
    /// a line indented less (finish STOP, the token that brought it the last one taken);
    /// the first line and blank lines end nothing. The text's first newline is seen (where
    /// a time limit waits for one).
    #[test]
    fn a_line_indented_too_little_ends_the_text() {
        let tok = &crate::generation::fakes::models().tokenizer;
        let req = ValidRequest {
            min_line_indent: 2,
            max_predict: Some(std::time::Duration::from_secs(1)),
            ..request("zz", 64)
        };
        let text = "a\n  b\n\n\t c\n d\n  e";
        let ids = tok.encode(text, false).unwrap();
        let mut output = Output::new(&req);
        assert!(!output.holds_newline());
        let taken = output.take(tok, &ids).unwrap();
        assert_eq!(taken.finish, Some(FinishReason::Stop));
        assert_eq!(taken.text, "a\n  b\n\n\t c\n ");
        let through_d = tok.encode("a\n  b\n\n\t c\n d", false).unwrap();
        assert_eq!(taken.tokens, through_d[..taken.tokens.len()]);
        assert!(tok.decode(&taken.tokens, false).unwrap().ends_with('d'));
        assert!(output.holds_newline());
        // Without it, or with the line indented enough, nothing ends.
        let each = |min| {
            let req = ValidRequest {
                min_line_indent: min,
                ..request("zz", 64)
            };
            take(&req, &[&ids])[0].2
        };
        assert_eq!((each(0), each(1)), (None, None));
    }
}
