//! A Decode call: target-only steps of one session, each queued as a Verify without drafts
//! (so it joins the other sessions' calls in their batched passes), the next one queued as
//! soon as a step answers, before its token goes out. A sampling session's steps draw their
//! tokens on the model thread, each where the step before left the seed's random stream.
//! The caller saves a call and an answer's handling per token: on a GPU, where a one-row
//! pass takes about as long as a round trip through the coordinator, that is most of the
//! time between tokens.

use crate::worker::{Choice, Kind, Verification, VerifyJob};
use duet_engine::logprobs::TokenLogprobs;
use duet_proto::v1 as pb;
use duet_serving::wire::logprobs_to_wire;
use duet_worker_core::{
    CallTrace, Session, SessionKey, Timing, WorkerCore, WorkerError, timing_to_wire,
};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tokio::sync::{mpsc, oneshot};

type Answer = oneshot::Receiver<Result<Verification, WorkerError>>;

/// One Decode call, checked.
pub(crate) struct Decoding {
    pub core: Arc<WorkerCore<VerifyJob>>,
    pub session: Arc<Mutex<Session>>,
    /// The call's number (`VerifyJob::call`).
    pub call: u64,
    /// The session's wire id and instance: each step looks it up again, which keeps it from
    /// expiring and ends the stream once it is closed.
    pub id: Vec<u8>,
    pub instance: u64,
    pub max_tokens: usize,
    pub stop: Vec<u32>,
    /// The call's server span: each step's pass is traced under it.
    pub span: tracing::Span,
}

impl Decoding {
    /// Queues the step (`kind`: the call's first, whose rollback the call's span records, or
    /// a later one) that cuts the session to `keep` and feeds `append`.
    pub fn queue(&self, keep: usize, append: Vec<u32>, kind: Kind) -> Result<Answer, WorkerError> {
        let (reply, answer) = oneshot::channel();
        let first = matches!(kind, Kind::DecodeFirst { .. });
        let job = VerifyJob {
            session: self.session.clone(),
            call: self.call,
            kind,
            keep,
            append,
            draft: Vec::new(),
            parents: Vec::new(),
            test: None,
            reply,
            enqueued: Instant::now(),
            masks: Vec::new(),
            trace: match first {
                true => CallTrace::queued(self.span.clone()),
                false => CallTrace::next_step(self.span.clone()),
            },
        };
        self.core.submit(SessionKey::of(&self.session), job)?;
        Ok(answer)
    }

    /// Sends each step's token to `out`, `cached` being the session's tokens once the step
    /// `answer` is waiting for has fed its tokens. Ends after `max_tokens` tokens, after a
    /// stop token, on an error (sent as the stream's last item), or when the caller goes
    /// away (a step still queued then gets no pass: its answer is dropped).
    pub async fn run(
        self,
        mut cached: usize,
        mut answer: Answer,
        out: mpsc::Sender<Result<pb::DecodeResponse, WorkerError>>,
    ) {
        for sent in 1..=self.max_tokens {
            let step = tokio::select! {
                step = answer => step.map_err(|_| WorkerError::Dropped).and_then(|s| s),
                () = out.closed() => return,
            };
            let (token, logprobs, timing, rng_position) = match step.and_then(the_token) {
                Ok(t) => t,
                Err(e) => {
                    let _ = out.send(Err(e)).await;
                    return;
                }
            };
            let last = sent == self.max_tokens || self.stop.contains(&token);
            // Queued before the token goes out: the caller's next call on the session, made
            // once it has read the token, then always comes after this step.
            let next = match last {
                true => None,
                false => Some(self.next_step(cached, token, rng_position.unwrap_or(0))),
            };
            let response = pb::DecodeResponse {
                token,
                timing: Some(timing_to_wire(timing)),
                rng_position,
                logprobs: logprobs.as_ref().map(logprobs_to_wire),
                give_way: self.core.gives_way(&self.id),
            };
            if out.send(Ok(response)).await.is_err() {
                return;
            }
            match next {
                None => return,
                Some(Ok(queued)) => answer = queued,
                Some(Err(e)) => {
                    let _ = out.send(Err(e)).await;
                    return;
                }
            }
            cached += 1;
        }
    }

    /// The step that feeds `token` after the `cached` tokens, while the session is open.
    fn next_step(
        &self,
        cached: usize,
        token: u32,
        rng_position: u64,
    ) -> Result<Answer, WorkerError> {
        self.core.session(&self.id, self.instance)?;
        self.queue(cached, vec![token], Kind::DecodeLater { rng_position })
    }
}

/// What a step answers for its token (its one argmax, or the token it drew).
type Step = (u32, Option<TokenLogprobs>, Timing, Option<u64>);

/// A step's token, its figures where the session asks for them and, for a sampling
/// session, where the random stream then stands.
fn the_token(step: Verification) -> Result<Step, WorkerError> {
    let logprobs = step.logprobs.into_iter().next();
    match step.choice {
        Choice::Argmax(argmax) => Ok((argmax[0], logprobs, step.timing, None)),
        Choice::Tested {
            token: Some(token),
            rng_position,
            ..
        } => Ok((token, logprobs, step.timing, Some(rng_position))),
        // A Decode's steps on a sampling session draw their tokens (`worker::choice`).
        Choice::P(_) | Choice::Tested { token: None, .. } => Err(WorkerError::Dropped),
    }
}
