//! A Decode call: target-only steps of one greedy session, each queued as a Verify without
//! drafts (so it joins the other sessions' calls in their batched passes), the next one
//! queued as soon as a step answers, before its token goes out. The caller saves a call and
//! an answer's handling per token: on a GPU, where a one-row pass takes about as long as a
//! round trip through the coordinator, that is most of the time between tokens.

use crate::worker::{Choice, Kind, Verification, VerifyJob};
use duet_proto::v1 as pb;
use duet_worker_core::{CallTrace, Session, SessionKey, WorkerCore, WorkerError, timing_to_wire};
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
    /// Queues the step that cuts the session to `keep` and feeds `append` (`first`: the
    /// call's first step, whose rollback the call's span records).
    pub fn queue(&self, keep: usize, append: Vec<u32>, first: bool) -> Result<Answer, WorkerError> {
        let (reply, answer) = oneshot::channel();
        let job = VerifyJob {
            session: self.session.clone(),
            call: self.call,
            kind: match first {
                true => Kind::DecodeFirst,
                false => Kind::DecodeLater,
            },
            keep,
            append,
            draft: Vec::new(),
            parents: Vec::new(),
            reply,
            enqueued: Instant::now(),
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
            let (token, timing) = match step.and_then(the_token) {
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
                false => Some(self.next_step(cached, token)),
            };
            let response = pb::DecodeResponse {
                token,
                timing: Some(timing_to_wire(timing)),
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
    fn next_step(&self, cached: usize, token: u32) -> Result<Answer, WorkerError> {
        self.core.session(&self.id, self.instance)?;
        self.queue(cached, vec![token], false)
    }
}

/// A step's token: its one argmax.
fn the_token(step: Verification) -> Result<(u32, duet_worker_core::Timing), WorkerError> {
    match step.choice {
        Choice::Argmax(argmax) => Ok((argmax[0], step.timing)),
        // A Decode's steps fail on a sampling session before they run (`rewind`).
        Choice::P(_) => Err(WorkerError::Dropped),
    }
}
