//! Reading a Generate stream: the one way the unary `Complete`, `duet-client`, `duet-bench`
//! and the tests fold the streamed messages into a whole completion.

use crate::v1::{
    CompleteResponse, GenerateResponse, PromptLogprobs, Timings, TokenLogprobs, ToolCall, Usage,
    generate_response::Event,
};
use tokio_stream::{Stream, StreamExt};
use tonic::Status;

/// A Generate stream folded so far.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Completion {
    pub text: String,
    /// A thinking model's thought, where it comes apart from the text.
    pub reasoning: String,
    pub token_ids: Vec<u32>,
    /// One per token id where the request asked for log-probabilities, else empty.
    pub logprobs: Vec<TokenLogprobs>,
    /// Where the request asked for them (`prompt_logprobs`), the prompt and its figures.
    pub prompt: Option<PromptLogprobs>,
    /// `chunk` messages read.
    pub chunks: usize,
    /// Set by the final message.
    pub finish_reason: Option<i32>,
    /// The final message's usage (default until then).
    pub usage: Usage,
    /// The final message's tool calls (a request with tools).
    pub tool_calls: Vec<ToolCall>,
    /// The stop string that ended it (empty where none did).
    pub stop_string: String,
    /// The request's stop token that ended it.
    pub stop_token_id: Option<u32>,
}

impl Completion {
    /// Takes one message into the completion; returns the text it adds.
    pub fn add(&mut self, message: GenerateResponse) -> String {
        match message.event {
            Some(Event::Chunk(chunk)) => {
                self.chunks += 1;
                self.text.push_str(&chunk.text);
                self.reasoning.push_str(&chunk.reasoning);
                self.token_ids.extend(chunk.token_ids);
                self.logprobs.extend(chunk.logprobs);
                self.prompt = self.prompt.take().or(chunk.prompt);
                chunk.text
            }
            Some(Event::Finished(finished)) => {
                self.text.push_str(&finished.text);
                self.reasoning.push_str(&finished.reasoning);
                self.finish_reason = Some(finished.finish_reason);
                self.usage = finished.usage.unwrap_or_default();
                self.tool_calls = finished.tool_calls;
                self.stop_string = finished.stop_string;
                self.stop_token_id = finished.stop_token_id;
                finished.text
            }
            None => String::new(),
        }
    }

    pub fn is_finished(&self) -> bool {
        self.finish_reason.is_some()
    }

    /// Reads the rest of `stream`, calling `on_text` with each piece of new text. A stream that
    /// ends without its final message is an error (UNKNOWN), as is any status it carries.
    pub async fn read_rest<S>(
        &mut self,
        stream: &mut S,
        mut on_text: impl FnMut(&str),
    ) -> Result<(), Status>
    where
        S: Stream<Item = Result<GenerateResponse, Status>> + Unpin,
    {
        while let Some(message) = stream.next().await {
            let text = self.add(message?);
            if !text.is_empty() {
                on_text(&text);
            }
        }
        self.ended()
    }

    /// The stream has ended: an error (UNKNOWN) unless its final message came.
    pub fn ended(&self) -> Result<(), Status> {
        if self.is_finished() {
            Ok(())
        } else {
            Err(Status::unknown(
                "the stream ended without a finished message",
            ))
        }
    }

    /// Reads a whole stream.
    pub async fn read<S>(mut stream: S, on_text: impl FnMut(&str)) -> Result<Self, Status>
    where
        S: Stream<Item = Result<GenerateResponse, Status>> + Unpin,
    {
        let mut completion = Self::default();
        completion.read_rest(&mut stream, on_text).await?;
        Ok(completion)
    }

    /// The unary `Complete` answer for this completion.
    pub fn into_response(self) -> CompleteResponse {
        CompleteResponse {
            text: self.text,
            token_ids: self.token_ids,
            finish_reason: self.finish_reason.unwrap_or_default(),
            usage: Some(self.usage),
            logprobs: self.logprobs,
            prompt: self.prompt,
            tool_calls: self.tool_calls,
            reasoning: self.reasoning,
            stop_string: self.stop_string,
            stop_token_id: self.stop_token_id,
        }
    }
}

/// Coordinator and network time per round: round wall time not spent in the workers'
/// forward passes or queues. `timings` may be one request's or a sum over several, with
/// `rounds` the matching count.
pub fn overhead_ms_per_round(timings: &Timings, rounds: u64) -> Option<f64> {
    // Propose calls made ahead ran beside a Verify: not on the rounds' path.
    let overhead = timings.rounds_ms + timings.draft_ahead_ms
        - timings.draft_forward_ms
        - timings.target_forward_ms
        - timings.queue_ms;
    (rounds > 0).then(|| overhead / rounds as f64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::v1::{Chunk, FinishReason, Finished};

    fn chunk(text: &str, ids: &[u32]) -> Result<GenerateResponse, Status> {
        Ok(GenerateResponse {
            event: Some(Event::Chunk(Chunk {
                text: text.into(),
                token_ids: ids.to_vec(),
                logprobs: ids
                    .iter()
                    .map(|&id| TokenLogprobs {
                        logprob: -(id as f32),
                        ..TokenLogprobs::default()
                    })
                    .collect(),
                prompt: None,
                reasoning: String::new(),
            })),
        })
    }

    fn finished(text: &str) -> Result<GenerateResponse, Status> {
        Ok(GenerateResponse {
            event: Some(Event::Finished(Finished {
                finish_reason: FinishReason::Stop as i32,
                text: text.into(),
                usage: Some(Usage {
                    completion_tokens: 3,
                    ..Usage::default()
                }),
                tool_calls: Vec::new(),
                reasoning: String::new(),
                stop_string: "END".into(),
                stop_token_id: None,
            })),
        })
    }

    #[tokio::test]
    async fn a_stream_folds_into_one_completion() {
        let stream = tokio_stream::iter([chunk("ab", &[1, 2]), chunk("", &[3]), finished("c")]);
        let mut seen = Vec::new();
        let c = Completion::read(stream, |t| seen.push(t.to_string()))
            .await
            .unwrap();
        assert_eq!(seen, ["ab", "c"]);
        assert_eq!(c.chunks, 2);
        let r = c.into_response();
        assert_eq!(r.text, "abc");
        assert_eq!(r.token_ids, [1, 2, 3]);
        let logprobs: Vec<f32> = r.logprobs.iter().map(|l| l.logprob).collect();
        assert_eq!(logprobs, [-1.0, -2.0, -3.0]);
        assert_eq!(r.finish_reason, FinishReason::Stop as i32);
        assert_eq!(r.stop_string, "END");
        assert_eq!(r.usage.unwrap().completion_tokens, 3);
    }

    #[tokio::test]
    async fn a_stream_without_its_final_message_is_an_error() {
        let stream = tokio_stream::iter([chunk("ab", &[1, 2])]);
        let err = Completion::read(stream, |_| {}).await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::Unknown);
        let failed = tokio_stream::iter([chunk("ab", &[1]), Err(Status::unavailable("gone"))]);
        let err = Completion::read(failed, |_| {}).await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::Unavailable);
    }

    #[test]
    fn overhead_is_round_time_outside_the_workers() {
        let t = Timings {
            rounds_ms: 100.0,
            draft_forward_ms: 30.0,
            target_forward_ms: 50.0,
            queue_ms: 10.0,
            ..Timings::default()
        };
        assert_eq!(overhead_ms_per_round(&t, 5), Some(2.0));
        assert_eq!(overhead_ms_per_round(&t, 0), None);
        // 20 ms of the draft's time were calls made ahead, beside a Verify.
        let ahead = Timings {
            rounds_ms: 80.0,
            draft_ahead_ms: 20.0,
            ..t
        };
        assert_eq!(overhead_ms_per_round(&ahead, 5), Some(2.0));
    }
}
