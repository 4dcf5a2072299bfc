//! The target model's part in a request: its Verify calls (asked again while the target is
//! busy, a lost replica failed over to another), its Decode streams for target-only steps,
//! what fits as their answers, and the reconciliation of the drafts with its choice.

use super::draft::DraftState;
use super::tree::{self, Outcome, Tree};
use super::{Abort, Committed, Drafted, Generation, Out, Round, unless_cancelled};
use crate::controller::{CACHE_BUCKET, Plan, ngram_bucket};
use crate::method::{Method, Proposer};
use crate::request::ValidRequest;
use crate::workers::{
    CallError, Decode, Failure, LookupPass, Next, Open, Party, Proposal, SamplingTest,
    StreamLookup, TargetChoice, TargetOpened, Verified, Verify, WorkerTiming, Workers,
};
use duet_engine::ngram::Lookup;
use duet_engine::sampling::{Distribution, rng_position};
use futures::StreamExt;
use std::slice;
use std::time::Duration;
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;

impl<W: Workers> Generation<W> {
    /// The target's verdict on the drafts of `tree` (none: one plain decoding step, from a
    /// Decode stream of up to `stream` tokens where that is `Some`). A lost replica costs a
    /// failover, not the request (on a replica that verifies chains only, the round's tree
    /// is cut to its chain); a busy one (its queue full: the call was refused before it
    /// touched the session) is asked again after a pause.
    pub(super) async fn verify(
        &mut self,
        out: &Out,
        tree: &mut Tree,
        mut stream: Option<usize>,
    ) -> Result<Verified, Abort> {
        let mut busy = 0;
        let verified = loop {
            let answer = match stream {
                Some(max_tokens) => self.decoded(out, max_tokens).await?,
                None => {
                    // A round with drafts ends the stream: its call comes after the steps
                    // already queued, and `keep` drops what they fed.
                    self.decoding = None;
                    let keep = self.synced.target;
                    // A tree's sampling stays here (the target tests chains only).
                    let test = tree.drawn.as_ref().filter(|_| tree.parents.is_empty());
                    let call = Verify {
                        keep,
                        append: &self.seq[keep..],
                        drafts: &tree.drafts,
                        parents: &tree.parents,
                        test: test.map(|d| SamplingTest {
                            q: &d.q,
                            point_masses: d.point_masses,
                            whole: &d.whole,
                            rng_position: rng_position(&self.rng),
                        }),
                    };
                    let verify = self.ctx.workers.verify(&self.target, call);
                    let called = tokio::time::Instant::now();
                    let answer = unless_cancelled(out, verify).await?;
                    self.stats.calls_in_round[1] += called.elapsed().as_secs_f64() * 1e3;
                    answer
                }
            };
            match answer {
                Ok(verified) => break verified,
                Err(e) if matches!(e.failure, Failure::Refused(_)) && stream.is_some() => {
                    // A target-worker without Decode (older than this coordinator, in a
                    // rolling upgrade): the request goes on a Verify a step.
                    tracing::debug!(error = %e, "target refused Decode; a Verify a step");
                    self.streams_refused = true;
                    stream = None;
                }
                Err(e) if matches!(e.failure, Failure::Busy(_)) && busy < BUSY_RETRIES => {
                    // 5, 10, 20, ... ms, at most 160: about 2 s in all.
                    let pause = Duration::from_millis(5 << busy.min(5));
                    busy += 1;
                    tracing::debug!(error = %e, ?pause, "target busy; asking again");
                    tokio::time::sleep(pause).await;
                }
                Err(e)
                    if e.lost_replica()
                        && self.stats.failovers.len() < self.ctx.max_failovers as usize =>
                {
                    self.fail_over(out, e).await?;
                    if !self.ctx.workers.verifies_trees(&self.target) {
                        tree.keep_chain();
                    }
                }
                Err(e) => return Err(e.into()),
            }
        };
        let greedy = self.req.sampling.is_greedy();
        check_verified(&verified, tree, self.ctx.models.vocab, greedy)?;
        match &verified.pass {
            Some(pass) => check_pass(pass, &verified, self.ctx.models.vocab, &self.req)?,
            None => check_logprobs(&verified, self.req.logprobs.is_some())?,
        }
        self.stats.add_timing(verified.timing, Party::Target);
        Ok(verified)
    }

    /// Whether target-only steps come from Decode streams (`speculation.target_streams`):
    /// NONE's always. AUTO's in a batch (other requests running), where the step a stream
    /// leaves in flight when a proposal ends it is a row of a pass the batch runs anyway
    /// and a stream also saves the batch's gathering of calls; alone, once its target-only
    /// steps have run long enough that what a stream saves a step (the round's overhead)
    /// over as many steps again would pay for that step (a one-row pass): a few steps on a
    /// GPU, where the two are alike, tens on a CPU. NGRAM's where its stream can look up
    /// drafts itself: then the stream makes its lookup rounds.
    pub(super) fn streams(&self) -> bool {
        if !self.ctx.speculation.target_streams || self.streams_refused {
            return false;
        }
        match self.req.method {
            Method::NONE => true,
            Method::Auto if self.decoding.is_some() => true,
            Method::Auto if self.ctx.metrics.running.get() > 1 => true,
            Method::Auto => self
                .ctx
                .shared
                .streaming_pays(self.target_only_streak, self.mode()),
            Method::NGRAM => self.looks_up_in_streams(),
            Method::DRAFT_MODEL => false,
        }
    }

    /// Whether this request's Decode streams may look up drafts themselves
    /// (`speculation.stream_lookup`): AUTO's and NGRAM's, on a replica that can, without a
    /// predicted output (whose lookups the rounds make).
    fn looks_up_in_streams(&self) -> bool {
        self.ctx.speculation.stream_lookup
            && matches!(self.req.method, Method::Auto | Method::NGRAM)
            && self.ngram.is_some()
            && self.predicted.is_none()
            && self.ctx.workers.decodes_with_lookup(&self.target)
    }

    /// Whether a round's `lookup` is one apart from the stream's: the proposal cache's
    /// (which a stream cannot see), or one in the request's own text where no stream looks
    /// it up. AUTO's running stream looks up where it started doing so; NGRAM's where
    /// streams may, so that its first round starts the stream.
    pub(super) fn beside_stream_lookup(&self, lookup: &Lookup) -> bool {
        let in_stream = match self.req.method {
            Method::NGRAM => self.streams(),
            _ => self.decoding.is_some() && self.stream_lookup.is_some(),
        };
        lookup.cache_votes.is_some() || !in_stream
    }

    /// A round that drafts ends the request's stream before its calls: they come after
    /// the stream's steps, and on a shared device the draft's wait for the target's turn,
    /// which the stream holds.
    pub(super) fn end_stream_if_drafting(&mut self, plan: &Plan) {
        if plan.proposer != Proposer::None {
            self.decoding = None;
        }
    }

    /// The next token of the request's Decode stream, which starts (asking for `max_tokens`)
    /// where none runs. A stream that failed, or ended before the request did (the target's
    /// turn passed), is gone: the next call starts another from the committed tokens.
    async fn decoded(
        &mut self,
        out: &Out,
        max_tokens: usize,
    ) -> Result<Result<Verified, CallError>, Abort> {
        loop {
            if self.decoding.is_some() && self.stream_lookup_changed() {
                self.decoding = None;
            }
            let (mut stream, started) = match self.decoding.take() {
                Some(stream) => (stream, false),
                None => {
                    let keep = self.synced.target;
                    let stop: Vec<u32> = self
                        .ctx
                        .models
                        .tokenizer
                        .eos_tokens()
                        .iter()
                        .copied()
                        .collect();
                    let lookup = self.weigh_stream_lookup();
                    let call = Decode {
                        keep,
                        append: &self.seq[keep..],
                        max_tokens,
                        stop: &stop,
                        rng_position: rng_position(&self.rng),
                        lookup: lookup.as_ref(),
                    };
                    let decode = self.ctx.workers.decode(&self.target, call);
                    let started = unless_cancelled(out, decode).await?;
                    self.stream_lookup = lookup;
                    match started {
                        Ok(stream) => (stream, true),
                        Err(e) => return Ok(Err(e)),
                    }
                }
            };
            match unless_cancelled(out, stream.next()).await? {
                Some(Ok(verified)) => {
                    self.decoding = Some(stream);
                    return Ok(Ok(verified));
                }
                Some(Err(e)) => return Ok(Err(e)),
                // Every stream answers at least one token.
                None if started => {
                    let why = "a Decode stream ended without a token".to_string();
                    return Ok(Err(CallError::new(Party::Target, Failure::Malformed(why))));
                }
                None => {}
            }
        }
    }

    /// Whether a running stream that looks up nothing (one started before the costs were
    /// known, or while no K paid) now would, weighed again every `RELOOK` committed
    /// tokens: the stream then ends, and the next starts with the lookup. A stream that
    /// looks up keeps its K: ending it costs the step in flight, and in a batch of streams
    /// on a CPU restarts as the estimates drift cost more than the K they would fix
    /// (docs/benchmarks.md, "Prompt lookup inside the target's streams").
    fn stream_lookup_changed(&mut self) -> bool {
        if self.stream_lookup.is_some() || self.seq.len() < self.stream_lookup_at + RELOOK {
            return false;
        }
        self.weigh_stream_lookup().is_some()
    }

    /// [`Generation::stream_lookup`], noting when it was weighed.
    fn weigh_stream_lookup(&mut self) -> Option<StreamLookup> {
        self.stream_lookup_at = self.seq.len();
        self.stream_lookup()
    }

    /// How the request's next Decode stream looks up drafts itself
    /// ([`Generation::looks_up_in_streams`]): for each match length, AUTO's as many drafts
    /// as the controller finds pay as rows of a streamed step (none before the costs are
    /// known, or where no length pays); NGRAM's as many as its rounds would offer.
    fn stream_lookup(&self) -> Option<StreamLookup> {
        if !self.looks_up_in_streams() {
            return None;
        }
        let s = &self.ctx.speculation;
        let cap = match self.req.method {
            Method::Auto => self.req.k.min(s.adaptive.max_ngram_tokens as usize),
            _ => self.req.k,
        };
        let cap = cap.min(duet_proto::MAX_DRAFT_TOKENS);
        let (min_match, max_match) = (s.ngram.min_match, s.ngram.max_match);
        let ngram = self.req.method == Method::NGRAM;
        let mut drafts: Vec<usize> = match (&self.controller, self.ctx.shared.costs(self.mode())) {
            (Some(controller), Some(costs)) => {
                // NGRAM's rounds draft at least one token where they find a match.
                let least = usize::from(ngram);
                // Match lengths share the request's-own-text buckets: each weighed once.
                let by_bucket: Vec<usize> = (0..CACHE_BUCKET)
                    .map(|b| controller.stream_lookup_k(&costs, b, cap).max(least))
                    .collect();
                (min_match..=max_match)
                    .map(|n| by_bucket[ngram_bucket(n, None)])
                    .collect()
            }
            // Before the costs, NGRAM's rounds offer the configured K; AUTO weighs none.
            (Some(_), None) if ngram => vec![cap.min(s.num_speculative_tokens as usize)],
            (Some(_), None) => return None,
            (None, _) => vec![cap],
        };
        // The last entry serves the longer matches too.
        while drafts.len() > 1 && drafts[drafts.len() - 1] == drafts[drafts.len() - 2] {
            drafts.pop();
        }
        drafts.iter().any(|&k| k > 0).then_some(StreamLookup {
            min_match,
            max_match,
            drafts,
        })
    }

    /// Commits a Decode stream's step that verified lookup drafts (`pass`, taken from its
    /// answer `verified`) as the lookup round it was: its tokens, the target's figures of
    /// each, the random stream after its draws, and what it teaches of lookup (its match's
    /// bucket, the drafts accepted).
    pub(super) fn commit_pass(
        &mut self,
        started: tokio::time::Instant,
        appended: usize,
        pass: LookupPass,
        verified: Verified,
    ) -> Committed {
        if let TargetChoice::Tested { rng_position, .. } = &verified.choice {
            self.rng.set_word_pos(u128::from(*rng_position));
        }
        let logprobs = match self.req.logprobs {
            Some(_) => verified.logprobs.clone(),
            None => Vec::new(),
        };
        let lookup = Lookup {
            matched: pass.matched,
            tokens: pass.drafts.clone(),
            cache_votes: None,
        };
        let drafted = Drafted {
            proposer: Proposer::Ngram,
            proposal: Proposal {
                tokens: pass.drafts,
                q: Vec::new(),
                alternatives: Vec::new(),
                timing: WorkerTiming::default(),
            },
        };
        let own_rows = appended + lookup.tokens.len();
        self.ctx.metrics.stream_lookup_passes.inc();
        self.commit(Round {
            started,
            lookup: Some(lookup),
            drafted: Some(drafted),
            drafted_ahead: false,
            own_rows,
            streamed: true,
            verified,
            ahead: None,
            accepted: pass.accepted,
            alternatives: 0,
            took_alternative: false,
            committed: &pass.tokens,
        });
        (pass.tokens, logprobs)
    }

    /// The target replica serving this request is gone or stuck: the coordinator holds the
    /// committed sequence, so a new session prefilled with it goes on exactly where the lost
    /// one was (the same greedy text; sampling draws from the same distributions).
    async fn fail_over(&mut self, out: &Out, lost: CallError) -> Result<(), Abort> {
        tracing::warn!(error = %lost, "target replica lost mid-stream; reopening the session");
        let at = self.seq.len() - self.req.prompt.len();
        let span = tracing::info_span!("failover", duet.at_completion_tokens = at as i64);
        span.set_attribute("duet.reason", lost.to_string());
        self.stats.failovers.push((at, lost.to_string()));
        self.ctx.metrics.target_failovers.inc();
        let open = self.committed_open();
        // With every other replica full, the request waits for room as a new one would.
        let (workers, lost_session) = (&self.ctx.workers, &self.target);
        let waiting = (self.req.priority, tokio::time::Instant::now());
        let reopen = (self.ctx.room).open(waiting, |ask_for_room| {
            let open = Open {
                ask_for_room,
                ..open
            };
            workers.reopen_target(open, lost_session)
        });
        let reopened = unless_cancelled(out, reopen.instrument(span)).await??;
        // The lost session closes as it drops (best effort: its replica may be gone).
        self.took_over(reopened);
        Ok(())
    }

    /// A request of a lower priority number waits for the KV room this one holds (preemption,
    /// `room.rs`): both sessions close (`give_room_up`, unless they did while a send
    /// waited); the request waits for room in its own place in line; then a new target
    /// session prefilled with the committed tokens goes on where the closed one was (the
    /// draft's opens again when a round wants it). `Ok(false)`: the drain deadline passed
    /// while it waited.
    pub(super) async fn give_way(&mut self, out: &Out) -> Result<bool, Abort> {
        if !self.holding.waits_for_room() {
            self.give_room_up().await;
        }
        let span = self.preempted.take().unwrap_or_else(tracing::Span::none);
        let open = self.committed_open();
        let workers = &self.ctx.workers;
        let resume = (self.ctx.room).resume(self.holding.rank(), |ask_for_room| {
            workers.open_target(Open {
                ask_for_room,
                ..open
            })
        });
        let opened = tokio::select! {
            opened = unless_cancelled(out, resume.instrument(span)) => opened??,
            _ = self.ctx.stopping.wait() => return Ok(false),
        };
        self.took_over(opened);
        self.holding.resumed();
        Ok(true)
    }

    /// Closes both sessions for a request of a lower priority number waiting for the room
    /// (`give_way`), the workers' prefix caches keeping their rows where they have room.
    pub(super) async fn give_room_up(&mut self) {
        let at = self.seq.len() - self.req.prompt.len();
        let priority = self.req.priority;
        tracing::info!(
            at,
            priority,
            "giving KV room up to a request of a lower priority number"
        );
        let span = tracing::info_span!("preempted", duet.at_completion_tokens = at as i64);
        self.stats.preempted.push(at);
        self.ctx.metrics.preemptions.inc();
        (self.decoding, self.ready) = (None, None);
        self.hold_prefix();
        if matches!(self.draft, DraftState::Open(_) | DraftState::Opening(_)) {
            self.draft = DraftState::Closed;
        }
        let close = self.ctx.workers.close_target(&self.target);
        close.instrument(span.clone()).await;
        self.holding.gave_way();
        self.preempted = Some(span);
    }

    /// A target session's open of the committed sequence, taking over from a session of
    /// this request's that is gone.
    fn committed_open(&self) -> Open<'_> {
        Open {
            prompt: &self.seq,
            // The new session holds the old one's rows bit for bit (a GPU's prefill
            // computes a row otherwise than the calls that appended it).
            generated_after: self.req.prompt.len(),
            // The first open answered them.
            prompt_logprobs: None,
            ..super::target_open(&self.req, &self.ctx)
        }
    }

    /// Takes a session `committed_open` opened (and how long it waited for room) as the
    /// request's target session.
    fn took_over(&mut self, opened: (TargetOpened<W::Session>, Duration)) {
        let ((session, timing, _), waited) = opened;
        self.target = session;
        self.synced.target = self.seq.len() - 1;
        self.synced.target_held = 0;
        self.stats.timings.prefill += timing.forward.as_secs_f64() * 1e3;
        self.stats.timings.admission_wait += waited.as_secs_f64() * 1e3;
    }

    /// Greedy match (of a chain or a tree), or rejection sampling, of the drafts against
    /// the target's choice.
    pub(super) fn reconcile(
        &mut self,
        proposal: Option<&Proposal>,
        tree: &Tree,
        v: &Verified,
    ) -> Result<Outcome, Abort> {
        let verdict = match &v.choice {
            TargetChoice::Argmax(argmax) => tree::verify(tree, argmax),
            TargetChoice::P(p) => {
                let q = proposal.map_or(&[][..], |p| &p.q);
                tree::verify_sampled(tree, q, p, &mut self.rng)
            }
            // The target drew where this request's random stream stood: the stream goes on
            // after its draws.
            TargetChoice::Tested {
                accepted,
                next,
                rng_position,
            } => {
                self.rng.set_word_pos(u128::from(*rng_position));
                let q = proposal.map_or(&[][..], |p| &p.q);
                tree::tested(tree, q, (*accepted, next), &mut self.rng)
            }
        };
        // The answers were checked to fit: a mismatch here is the coordinator's own bug.
        verdict.map_err(|e| Abort::Internal(format!("verifying a round: {e}")))
    }
}

/// Committed tokens between two weighings of a running stream's lookup.
const RELOOK: usize = 16;

/// Times a round's Verify is asked again while the target answers that it is busy.
const BUSY_RETRIES: u32 = 16;

/// A target answer fits a call with the K drafts of `tree`: K + 1 argmaxes inside the
/// vocabulary for greedy sessions, K + 1 distributions over it for sampling sessions, or,
/// for a chain, their test's verdict (a Decode stream's step: none accepted, the token
/// drawn).
pub(super) fn check_verified(
    v: &Verified,
    tree: &Tree,
    vocab: usize,
    greedy: bool,
) -> Result<(), CallError> {
    let malformed = |m: String| Err(CallError::new(Party::Target, Failure::Malformed(m)));
    let k = tree.drafts.len();
    let (positions, tokens, p) = match (&v.choice, greedy) {
        (TargetChoice::Argmax(argmax), true) => (argmax.len(), &argmax[..], &[][..]),
        (TargetChoice::P(p), false) => (p.len(), &[][..], &p[..]),
        (TargetChoice::Tested { accepted, next, .. }, false) => match next {
            // A tree's sampling runs here: its Verify carries no test.
            _ if !tree.parents.is_empty() => {
                return malformed("a sampling verdict for a tree of drafts".into());
            }
            _ if *accepted > k => return malformed(format!("{accepted} of {k} accepted")),
            Next::Drawn(token) => (k + 1, slice::from_ref(token), &[][..]),
            Next::Rejected(_) if *accepted == k => {
                return malformed(format!("all {k} accepted and no token"));
            }
            Next::Rejected(p) => (k + 1, &[][..], slice::from_ref(p)),
        },
        (_, true) => return malformed("a sampling answer for a greedy session".into()),
        (TargetChoice::Argmax(_), false) => {
            return malformed("argmaxes for a sampling session".into());
        }
    };
    if positions != k + 1 {
        return malformed(format!("{positions} positions for {k} drafts"));
    }
    let beyond = |d: &Distribution| d.ids().last().is_some_and(|&id| id as usize >= vocab);
    match p.iter().any(beyond) {
        true => malformed(format!("a distribution beyond the vocabulary of {vocab}")),
        false => in_vocabulary(tokens, vocab),
    }
}

/// For a request that asks for log-probabilities, an answer carries the figures of every
/// token the round may commit: one per position for argmaxes; a tested chain's accepted
/// drafts' and its drawn token's. Such a request never leaves a token for the coordinator
/// to draw (a rejection's correction, or distributions alone): it would have none.
pub(super) fn check_logprobs(v: &Verified, wanted: bool) -> Result<(), CallError> {
    let malformed = |m: String| Err(CallError::new(Party::Target, Failure::Malformed(m)));
    let chosen = match &v.choice {
        _ if !wanted => return Ok(()),
        TargetChoice::Argmax(argmax) => argmax.len(),
        TargetChoice::Tested {
            accepted,
            next: Next::Drawn(_),
            ..
        } => accepted + 1,
        TargetChoice::Tested { .. } | TargetChoice::P(_) => {
            return malformed("no token drawn for a request with logprobs".into());
        }
    };
    match v.logprobs.len() {
        n if n == chosen => Ok(()),
        // A target-worker from before log-probabilities (a rolling upgrade) answers none.
        0 => malformed("no logprobs: the target-worker may predate them".into()),
        n => malformed(format!("logprobs for {n} tokens; {chosen} chosen")),
    }
}

/// A Decode stream's lookup pass fits: drafts (at most `MAX_DRAFT_TOKENS`) inside the
/// vocabulary, of which the accepted ones begin its tokens, followed by at most the
/// target's own, the last one the pass's choice; one figure a token where the request asks
/// for them.
pub(super) fn check_pass(
    pass: &LookupPass,
    v: &Verified,
    vocab: usize,
    req: &ValidRequest,
) -> Result<(), CallError> {
    let malformed = |m: String| Err(CallError::new(Party::Target, Failure::Malformed(m)));
    let (k, accepted, n) = (pass.drafts.len(), pass.accepted, pass.tokens.len());
    in_vocabulary(&pass.drafts, vocab)?;
    in_vocabulary(&pass.tokens, vocab)?;
    let last = match &v.choice {
        TargetChoice::Argmax(argmax) => argmax.first(),
        TargetChoice::Tested {
            next: Next::Drawn(token),
            ..
        } => Some(token),
        _ => None,
    };
    if k > duet_proto::MAX_DRAFT_TOKENS || accepted > k || n < accepted.max(1) || n > accepted + 1 {
        return malformed(format!(
            "a lookup pass of {n} tokens, {accepted} of {k} drafts"
        ));
    }
    if pass.tokens[..accepted] != pass.drafts[..accepted] || last != pass.tokens.last() {
        return malformed("a lookup pass's tokens are not its accepted drafts".into());
    }
    match v.logprobs.len() {
        _ if req.logprobs.is_none() => Ok(()),
        m if m == n => Ok(()),
        m => malformed(format!("logprobs for {m} tokens; {n} in a lookup pass")),
    }
}

/// Target tokens inside the vocabulary.
fn in_vocabulary(tokens: &[u32], vocab: usize) -> Result<(), CallError> {
    match tokens.iter().find(|&&t| t as usize >= vocab) {
        Some(t) => {
            let why = format!("token {t} is outside the vocabulary of {vocab}");
            Err(CallError::new(Party::Target, Failure::Malformed(why)))
        }
        None => Ok(()),
    }
}
