//! A Decode call: target-only steps of one session, each queued as a Verify without drafts
//! (so it joins the other sessions' calls in their batched passes), the next one queued as
//! soon as a step answers, before its tokens go out. A sampling session's steps draw their
//! tokens on the model thread, each where the step before left the seed's random stream.
//! The caller saves a call and an answer's handling per token: on a GPU, where a one-row
//! pass takes about as long as a round trip through the coordinator, that is most of the
//! time between tokens.
//!
//! With `DecodeRequest.lookup`, a step verifies what prompt lookup finds after the session's
//! tokens as a chain of drafts, as a Verify with them would, and answers the drafts the target
//! accepts before its own token: prompt lookup without a round trip per round.

use crate::worker::{Choice, Kind, Test, Verification, VerifyJob};
use duet_engine::logprobs::TokenLogprobs;
use duet_engine::ngram::NgramIndex;
use duet_engine::sampling::Distribution;
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
    /// Prompt lookup between the steps (`DecodeRequest.lookup`).
    pub lookup: Option<StreamLookup>,
    /// The call's server span: each step's pass is traced under it.
    pub span: tracing::Span,
}

/// A step queued: its answer to come, and the lookup's drafts it verifies.
pub(crate) struct InFlight {
    answer: Answer,
    drafts: Vec<u32>,
    matched: usize,
}

impl Decoding {
    /// Queues the step (`kind`: the call's first, whose rollback the call's span records, or
    /// a later one) that cuts the session to `keep` and feeds `append`, with the lookup's
    /// drafts after it where it finds some for a stream that still has `room` tokens to
    /// answer.
    pub fn queue(
        &mut self,
        keep: usize,
        append: Vec<u32>,
        kind: Kind,
        room: usize,
    ) -> Result<InFlight, WorkerError> {
        let (reply, answer) = oneshot::channel();
        let first = matches!(kind, Kind::DecodeFirst { .. });
        let (drafts, matched) = match &mut self.lookup {
            // The step answers its own token after the drafts: room for one less.
            Some(lookup) => lookup.drafts(room.saturating_sub(1)),
            None => (Vec::new(), 0),
        };
        // A sampling session's drafts are tested as a lookup's are: each q the point mass on
        // its draft (a greedy session's test is never read).
        let test = (!drafts.is_empty()).then(|| Test {
            q: vec![1.0; drafts.len()],
            whole: Some(drafts.iter().map(|&x| Distribution::point(x)).collect()),
            rng_position: kind.rng_position(),
        });
        let job = VerifyJob {
            session: self.session.clone(),
            call: self.call,
            kind,
            keep,
            append,
            draft: drafts.clone(),
            parents: Vec::new(),
            test,
            reply,
            enqueued: Instant::now(),
            masks: Vec::new(),
            trace: match first {
                true => CallTrace::queued(self.span.clone()),
                false => CallTrace::next_step(self.span.clone()),
            },
        };
        self.core.submit(SessionKey::of(&self.session), job)?;
        Ok(InFlight {
            answer,
            drafts,
            matched,
        })
    }

    /// Sends each step's tokens to `out`, `cached` being the session's tokens once the step
    /// `queued` is waiting for has fed its appended tokens. Ends after `max_tokens` tokens,
    /// after a stop token, on an error (sent as the stream's last item), or when the caller
    /// goes away (a step still queued then gets no pass: its answer is dropped).
    pub async fn run(
        mut self,
        mut cached: usize,
        mut queued: InFlight,
        out: mpsc::Sender<Result<pb::DecodeResponse, WorkerError>>,
    ) {
        let mut sent = 0;
        loop {
            let step = tokio::select! {
                step = &mut queued.answer => step.map_err(|_| WorkerError::Dropped).and_then(|s| s),
                () = out.closed() => return,
            };
            let mut step = match step.and_then(|s| Step::of(s, &queued.drafts)) {
                Ok(step) => step,
                Err(e) => {
                    let _ = out.send(Err(e)).await;
                    return;
                }
            };
            let room = self.max_tokens - sent;
            let ended = step.cut(room, &self.stop);
            let answered = step.tokens.len();
            // Queued before the tokens go out: the caller's next call on the session, made
            // once it has read them, then always comes after this step. The accepted drafts'
            // rows stay; the step's own token is fed next.
            let next = match ended {
                true => None,
                false => Some(self.next_step(cached + answered - 1, &step, room - answered)),
            };
            let responses = step.responses(&queued, self.core.gives_way(&self.id));
            for response in responses {
                if out.send(Ok(response)).await.is_err() {
                    return;
                }
            }
            match next {
                None => return,
                Some(Ok(next)) => queued = next,
                Some(Err(e)) => {
                    let _ = out.send(Err(e)).await;
                    return;
                }
            }
            cached += answered;
            sent += answered;
        }
    }

    /// The step that feeds `step`'s last token after the `cached` tokens, while the session
    /// is open, for a stream with `room` tokens still to answer.
    fn next_step(
        &mut self,
        cached: usize,
        step: &Step,
        room: usize,
    ) -> Result<InFlight, WorkerError> {
        self.core.session(&self.id, self.instance)?;
        if let Some(lookup) = &mut self.lookup {
            lookup.seq.extend(&step.tokens);
        }
        let token = step.tokens[step.tokens.len() - 1];
        let kind = Kind::DecodeLater {
            rng_position: step.rng_position.unwrap_or(0),
        };
        self.queue(cached, vec![token], kind, room)
    }
}

/// Prompt lookup between a stream's steps (`DecodeRequest.lookup`), checked.
pub(crate) struct StreamLookup {
    index: NgramIndex,
    /// Drafts by the matched suffix's length from `min_match` (`StreamLookup.drafts`).
    drafts: Vec<usize>,
    /// The session's tokens: those the call kept and appended, then each one answered.
    seq: Vec<u32>,
}

impl StreamLookup {
    /// The call's lookup, where it asks for one: `min_match..=max_match` tokens in
    /// `1..=32`, at most 32 entries of at most `MAX_DRAFT_TOKENS`. `seq` is the session's
    /// tokens once the first step has fed its appended ones.
    pub fn of(wire: Option<pb::StreamLookup>, seq: Vec<u32>) -> Result<Option<Self>, WorkerError> {
        let Some(l) = wire.filter(|l| !l.drafts.is_empty()) else {
            return Ok(None);
        };
        let bad = |why: String| Err(WorkerError::invalid("lookup", why));
        let (min, max) = (l.min_match as usize, l.max_match as usize);
        if !(1 <= min && min <= max && max <= MAX_MATCH) {
            return bad(format!(
                "suffixes of {min}..={max} tokens; 1 <= min_match <= max_match <= {MAX_MATCH}"
            ));
        }
        if l.drafts.len() > MAX_MATCH {
            return bad(format!("{} entries; at most {MAX_MATCH}", l.drafts.len()));
        }
        let most = duet_proto::MAX_DRAFT_TOKENS;
        if let Some(k) = l.drafts.iter().find(|&&k| k as usize > most) {
            return bad(format!("{k} drafts; at most {most}"));
        }
        Ok(Some(Self {
            index: NgramIndex::new(min, max),
            drafts: l.drafts.iter().map(|&k| k as usize).collect(),
            seq,
        }))
    }

    /// At most `room` drafts after the session's tokens, as many as the policy gives for
    /// the longest suffix that occurred before, and that suffix's length; none without one.
    fn drafts(&mut self, room: usize) -> (Vec<u32>, usize) {
        self.index.extend(&self.seq);
        match self.index.lookup_by_match(&self.seq, &self.drafts, room) {
            Some(found) => (found.tokens, found.matched),
            None => (Vec::new(), 0),
        }
    }
}

/// The longest suffix a stream's lookup matches (`StreamLookup.max_match`).
pub(crate) const MAX_MATCH: usize = 32;

/// What one step answers: the drafts the target accepted and its own token after them,
/// their figures where the session asks for them, the pass's timing and, for a sampling
/// session, where the random stream then stands.
struct Step {
    tokens: Vec<u32>,
    accepted: usize,
    logprobs: Vec<TokenLogprobs>,
    timing: Timing,
    rng_position: Option<u64>,
}

impl Step {
    /// The step's tokens from its choice over `drafts`: the drafts equal to the argmax
    /// before the first that is not, then the argmax there; or a sampling session's drafts
    /// its test accepted and the token it drew after them.
    fn of(step: Verification, drafts: &[u32]) -> Result<Step, WorkerError> {
        let (tokens, accepted, rng_position) = match step.choice {
            Choice::Argmax(argmax) => {
                let accepted = drafts
                    .iter()
                    .zip(&argmax)
                    .take_while(|(d, t)| d == t)
                    .count();
                (argmax[..=accepted].to_vec(), accepted, None)
            }
            Choice::Tested {
                accepted,
                token: Some(token),
                rng_position,
                ..
            } => {
                let tokens = drafts[..accepted].iter().copied().chain([token]);
                (tokens.collect(), accepted, Some(rng_position))
            }
            // A Decode's steps on a sampling session draw their tokens (`worker::choice`),
            // the point masses' corrections included.
            Choice::P(_) | Choice::Tested { token: None, .. } => {
                return Err(WorkerError::Dropped);
            }
        };
        let mut logprobs = step.logprobs;
        logprobs.truncate(tokens.len());
        Ok(Step {
            tokens,
            accepted,
            logprobs,
            timing: step.timing,
            rng_position,
        })
    }

    /// Keeps the tokens a stream with `room` still to answer sends, up to the first stop
    /// token; whether the stream ends with them.
    fn cut(&mut self, room: usize, stop: &[u32]) -> bool {
        let stopped = self.tokens.iter().position(|t| stop.contains(t));
        let keep = stopped.map_or(self.tokens.len(), |i| i + 1).min(room);
        self.tokens.truncate(keep);
        self.logprobs.truncate(keep);
        self.accepted = self.accepted.min(keep);
        stopped.is_some_and(|i| i < keep) || keep == room
    }

    /// One answer a token, the first with the pass's timing and what it verified of the
    /// lookup's drafts, the others with a zero timing (each pass counts once). A sampling
    /// session's answers all carry the place in the random stream after the whole pass's
    /// draws: a caller that stops reading within them draws on from there.
    fn responses(self, queued: &InFlight, give_way: bool) -> Vec<pb::DecodeResponse> {
        let mut logprobs = self.logprobs.into_iter();
        let response = |token| pb::DecodeResponse {
            token,
            timing: Some(timing_to_wire(Timing::default())),
            rng_position: self.rng_position,
            logprobs: logprobs.next().as_ref().map(logprobs_to_wire),
            give_way,
            ..pb::DecodeResponse::default()
        };
        let mut all: Vec<_> = self.tokens.into_iter().map(response).collect();
        all[0].timing = Some(timing_to_wire(self.timing));
        if !queued.drafts.is_empty() {
            all[0].drafts = queued.drafts.clone();
            all[0].accepted = self.accepted as u32;
            all[0].matched = queued.matched as u32;
        }
        all
    }
}
