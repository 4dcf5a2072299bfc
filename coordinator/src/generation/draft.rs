//! The draft model's part in a request: its session (opened with the target's on separate
//! devices; on shared cores after the first token, for AUTO when the controller first wants
//! it, in the background), its Propose calls and what fits as their answer, drafting ahead
//! beside Verify (`speculation.overlap_drafting`), and its failures, which turn the request
//! target-only.

use super::{Abort, Drafted, Generation, Out, Tree, unless_cancelled};
use crate::controller::{Overlap, Plan};
use crate::method::Proposer;
use crate::request::ValidRequest;
use crate::workers::{
    CallError, Failure, Lease, Open, Party, Proposal, Propose, TargetChoice, Verified,
    WorkerTiming, Workers,
};
use duet_engine::sampling::Distribution;
use duet_engine::verify::verify_greedy;
use duet_proto::MAX_PROPOSE_APPEND;
use futures::FutureExt;
use std::future::Future;
use std::sync::Arc;
use tokio::task::JoinError;
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// Where a request stands with the draft model.
pub(super) enum DraftState<W: Workers> {
    /// Not used: not asked for, unavailable, or it failed.
    Unused,
    /// Usable, not opened yet: AUTO opens it when the controller first wants it, and
    /// DRAFT_MODEL on shared cores once the first token is out (`may_open_draft`).
    Closed,
    /// Being opened in the background.
    Opening(Opening<W>),
    /// Shared with a Propose call running beside a Verify.
    Open(Arc<W::Session>),
}

impl<W: Workers> DraftState<W> {
    pub(super) fn session(&self) -> Option<&Arc<W::Session>> {
        match self {
            Self::Open(s) => Some(s),
            _ => None,
        }
    }
}

/// A Propose call made while the target verifies a round's drafts: `k` tokens after them,
/// the first the draft's guess of the target's own token after the drafts.
pub(super) struct Ahead {
    pub(super) k: usize,
    /// `None`: dropped, once the Verify showed its drafts could not be used.
    pub(super) answer: Option<Result<Proposal, CallError>>,
}

/// A session being opened in the background. Dropped before the open is taken (the request
/// ended first), it aborts the open: its OpenSession call goes away, so the draft-worker
/// skips the rest of the prefill instead of spending its device on a session nobody will
/// use. A session the worker opened all the same is closed by the id the call named (the
/// gRPC client's `PendingOpen`), or as it drops if the open had finished.
pub(super) struct Opening<W: Workers>(tokio::task::JoinHandle<Opened<W>>);

impl<W: Workers> Drop for Opening<W> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

pub(super) type Opened<W> = Result<(<W as Workers>::Session, WorkerTiming), CallError>;

/// Opens `req`'s draft session with `prompt` (the request's, or the committed sequence) in a
/// task of its own.
pub(super) fn spawn_open_draft<W: Workers>(
    workers: Arc<W>,
    prompt: Vec<u32>,
    req: &ValidRequest,
    lease: Lease,
) -> Opening<W> {
    let capacity = req.prompt.len() + req.max_tokens;
    let (sampling, penalties, min_tokens) = (req.sampling, req.penalties, req.min_tokens);
    let (cache_salt, stop_token_ids) = (req.cache_salt, req.held_stop_tokens().to_vec());
    let (logit_bias, format) = (req.logit_bias.clone(), req.format.clone());
    let adapter = req.adapter.clone();
    // A draft that proposes by the completion so far counts it from where it starts; other
    // draft sessions prefill all they are given as a prompt (a takeover's completion would
    // be fed as calls feed it, which they do not need).
    let generated_after = match req.reads_completion() {
        true => req.prompt.len(),
        false => 0,
    };
    // In the request's trace: its OpenSession call is a child of the span opening it.
    let task = tokio::spawn(
        async move {
            let open = Open {
                generated_after,
                penalties,
                logit_bias: &logit_bias,
                min_tokens,
                format: format.as_ref(),
                cache_salt,
                stop_token_ids: &stop_token_ids,
                adapter: adapter.as_deref(),
                ..Open::plain(&prompt, capacity, &sampling, &lease)
            };
            workers.open_draft(open).await
        }
        .in_current_span(),
    );
    Opening(task)
}

/// The draft session did not open: trips the breaker unless the worker was only busy, and
/// says why for the usage.
pub(super) fn draft_open_failed<W: Workers>(workers: &W, e: &CallError) -> String {
    if e.trips_breaker() {
        workers.trip_draft(&e.to_string());
    }
    format!("the draft session did not open: {e}")
}

/// A draft answer fits a call for `k` tokens: exactly `k` tokens (1 to `k` where the call
/// let the draft stop early: `may_stop`) inside the vocabulary, for sampling sessions one q
/// per token that gives its token some mass (rejection sampling is exact only then), and,
/// where the call asked for up to `alternatives` a token, one list per token within that.
pub(super) fn check_proposal(
    p: Proposal,
    (k, may_stop): (usize, bool),
    alternatives: usize,
    vocab: usize,
    greedy: bool,
) -> Result<Proposal, CallError> {
    let malformed = |m: String| Err(CallError::new(Party::Draft, Failure::Malformed(m)));
    let n = p.tokens.len();
    let fits = match may_stop {
        true => (1..=k).contains(&n),
        false => n == k,
    };
    if !fits {
        return malformed(format!("{n} tokens, {k} were asked for"));
    }
    if let Some(t) = p.tokens.iter().find(|&&t| t as usize >= vocab) {
        return malformed(format!("token {t} is outside the vocabulary of {vocab}"));
    }
    let q_wanted = if greedy { 0 } else { n };
    if p.q.len() != q_wanted {
        return malformed(format!("{} distributions for {n} tokens", p.q.len()));
    }
    for (i, (q, &t)) in p.q.iter().zip(&p.tokens).enumerate() {
        if q.ids().last().is_some_and(|&id| id as usize >= vocab) || q.prob(t) <= 0.0 {
            return malformed(format!("q of draft token {i} does not fit its token {t}"));
        }
    }
    let lists = if alternatives > 0 { n } else { 0 };
    if p.alternatives.len() != lists {
        return malformed(format!(
            "{} alternatives for {n} tokens",
            p.alternatives.len()
        ));
    }
    for (i, (others, &t)) in p.alternatives.iter().zip(&p.tokens).enumerate() {
        let fit = others.len() <= alternatives
            && others.iter().all(|&o| (o as usize) < vocab)
            && alternatives_fit(others, t, p.q.get(i));
        if !fit {
            return malformed(format!("alternatives {others:?} of draft token {i} ({t})"));
        }
    }
    Ok(p)
}

/// A greedy draft's alternatives (no `q`) are other tokens than its own `token`, each once;
/// a sampling draft's are draws from the token's q (repeats allowed).
fn alternatives_fit(others: &[u32], token: u32, q: Option<&Distribution>) -> bool {
    match q {
        None => {
            let distinct = (1..others.len()).all(|j| !others[..j].contains(&others[j]));
            distinct && !others.contains(&token)
        }
        Some(q) => others.iter().all(|&o| q.prob(o) > 0.0),
    }
}

impl<W: Workers> Generation<W> {
    /// The draft session and the tokens it should draft while the target verifies `drafts`
    /// (none: no drafting ahead): the guess of the target's token after them, then the next
    /// round's K, if the completion has room for them.
    pub(super) fn ahead_k(
        &self,
        drafts: usize,
        remaining: usize,
    ) -> Option<(Arc<W::Session>, usize)> {
        let session = self.draft.session()?;
        if !self.ctx.speculation.overlap_drafting || drafts == 0 {
            return None;
        }
        // If this round commits all its drafts and the target's token, the next round may
        // draft this many: the request's K, or where the controller chooses K (AUTO, and a
        // named method without K) as many as this round, where it finds drafting ahead pays.
        let k = match &self.controller {
            None => self.req.k,
            Some(c) => match self.ctx.shared.costs(self.mode()) {
                Some(costs) if c.draft_ahead(&costs, drafts, self.overlap()) => drafts,
                _ => {
                    self.ctx.shared.ahead_declined();
                    return None;
                }
            },
        };
        let next = k.min(remaining.saturating_sub(drafts + 2));
        (next > 0).then(|| (session.clone(), next + 1))
    }

    /// A Propose call that goes on from this round's `drafts` as if all were accepted (the
    /// draft's cache holds all of them but the last), for `k` tokens. It owns what it needs,
    /// so it runs beside the round's Verify.
    pub(super) fn draft_ahead(
        &mut self,
        out: &Out,
        session: Arc<W::Session>,
        drafts: &[u32],
        k: usize,
    ) -> impl Future<Output = Result<Result<Proposal, CallError>, Abort>> + use<W> {
        self.stats.ahead_calls += 1;
        self.ctx.metrics.drafted_ahead.inc();
        let workers = self.ctx.workers.clone();
        let keep = self.seq.len() + drafts.len() - 1;
        let append = drafts[drafts.len() - 1..].to_vec();
        let out = out.clone();
        let span = tracing::info_span!("draft.ahead", duet.k = k as i64);
        async move {
            let call = Propose {
                keep,
                append: &append,
                k,
                stop_below: 0.0,
                alternatives: (0.0, 0),
            };
            unless_cancelled(&out, workers.propose(&session, call)).await
        }
        .instrument(span)
    }

    /// Whether and how this request's rounds draft ahead: greedy ones drop a call made
    /// ahead once the round rejects a draft, sampling ones wait for it (`verify_beside`).
    pub(super) fn overlap(&self) -> Overlap {
        match (
            self.ctx.speculation.overlap_drafting,
            self.req.sampling.is_greedy(),
        ) {
            (false, _) => Overlap::Off,
            (true, true) => Overlap::Dropped,
            (true, false) => Overlap::Waited,
        }
    }

    /// Verifies `drafts` while `ahead`, a Propose made ahead from them, runs. A greedy
    /// round that rejects one of its drafts cannot use what is drafted after them: the call
    /// made ahead is then dropped as soon as the target answers (the draft-worker stops it
    /// before its next pass), and the next round's Propose need not wait for the rest of
    /// it, which on separate devices, where a draft step may cost what a target pass does,
    /// would be most of a round. Sampling rounds wait for it whatever the verdict: when a
    /// call stops must not decide how many of its random draws the draft takes, or the same
    /// seed would not give the same text.
    pub(super) async fn verify_beside(
        &mut self,
        out: &Out,
        tree: &mut Tree,
        ahead: impl Future<Output = Result<Result<Proposal, CallError>, Abort>>,
    ) -> Result<(Verified, Option<Result<Proposal, CallError>>), Abort> {
        tokio::pin!(ahead);
        let mut answer = None;
        let verified = {
            let verify = self.verify(out, tree, None);
            tokio::pin!(verify);
            loop {
                // Verify first: its call goes out before the one made ahead, as a `join`'s.
                tokio::select! {
                    biased;
                    verified = &mut verify => break verified?,
                    a = &mut ahead, if answer.is_none() => answer = Some(a?),
                }
            }
        };
        // Only where this request drops such calls (`overlap`: greedy requests).
        // (The chain's drafts come first in a tree, and the answers after them.)
        let rejected = match (self.overlap(), &verified.choice) {
            (Overlap::Dropped, TargetChoice::Argmax(argmax)) => {
                let (chain, after) = (&tree.drafts[..tree.chain], &argmax[..tree.chain + 1]);
                verify_greedy(chain, after).is_ok_and(|v| v.accepted < chain.len())
            }
            _ => false,
        };
        let answer = match answer {
            Some(answer) => Some(answer),
            None if rejected => {
                self.ctx.metrics.drafted_ahead_dropped.inc();
                None
            }
            None => Some(ahead.await?),
        };
        Ok((verified, answer))
    }

    /// What the draft made ahead is worth after the round: the next round's drafts when the
    /// round committed all its drafts and then the token the draft guessed (`last`: the
    /// target's token after them, when all were accepted). A dropped call is worth nothing.
    pub(super) fn take_ahead(&mut self, ahead: Ahead, last: Option<u32>) {
        let greedy = self.req.sampling.is_greedy();
        let vocab = self.ctx.models.vocab;
        let Some(answer) = ahead.answer else {
            return;
        };
        match answer.and_then(|p| check_proposal(p, (ahead.k, false), 0, vocab, greedy)) {
            Ok(mut p) => {
                self.stats.add_timing(p.timing, Party::Draft);
                self.stats.timings.draft_ahead +=
                    (p.timing.forward + p.timing.queue).as_secs_f64() * 1e3;
                if last.is_some_and(|t| p.tokens.first() == Some(&t)) {
                    p.tokens.remove(0);
                    if !p.q.is_empty() {
                        p.q.remove(0);
                    }
                    self.ready = Some(p);
                }
            }
            Err(e) => self.draft_failed(e),
        }
    }

    /// Starts opening the draft session in the background, with the committed sequence as
    /// its prompt. Logs (debug) the draft costs the decision rested on.
    pub(super) fn open_draft_later(&mut self) {
        if let Some(costs) = self.ctx.shared.costs(self.mode()) {
            tracing::debug!(
                rows = self.seq.len() - 1,
                draft_ms_per_token = costs.draft_per_token,
                prefill_ms_per_row = costs.draft_prefill_per_row,
                "opening the draft session"
            );
        }
        self.synced.draft = self.seq.len() - 1;
        let (workers, prompt) = (self.ctx.workers.clone(), self.seq.clone());
        let lease = self.ctx.lease.clone();
        let opening = spawn_open_draft(workers, prompt, &self.req, lease);
        self.draft = DraftState::Opening(opening);
    }

    /// Takes the draft session once its background open has finished.
    pub(super) fn take_opened_draft(&mut self) {
        let DraftState::Opening(Opening(task)) = &mut self.draft else {
            return;
        };
        if !task.is_finished() {
            return;
        }
        let opened = task.now_or_never();
        self.draft = DraftState::Unused;
        if let Some(opened) = opened {
            self.opened_draft(opened);
        }
    }

    /// Waits for the draft session's background open to finish, and takes it. Usage counts
    /// the wait as prefill, not as time of the round it was waited in.
    pub(super) async fn wait_opened_draft(&mut self, out: &Out) -> Result<(), Abort> {
        let DraftState::Opening(mut opening) =
            std::mem::replace(&mut self.draft, DraftState::Unused)
        else {
            return Ok(());
        };
        let waited = tokio::time::Instant::now();
        let opened = unless_cancelled(out, &mut opening.0).await?;
        let ms = waited.elapsed().as_secs_f64() * 1e3;
        tracing::debug!(ms, "waited for the draft session");
        self.stats.timings.prefill += ms;
        self.stats.waited_in_round += ms;
        self.opened_draft(opened);
        Ok(())
    }

    pub(super) fn opened_draft(&mut self, opened: Result<Opened<W>, JoinError>) {
        match opened {
            Ok(Ok((session, timing))) => {
                let rows = self.synced.draft;
                tracing::debug!(
                    rows,
                    forward_ms = timing.forward.as_secs_f64() * 1e3,
                    "draft session open"
                );
                self.ctx.shared.observe_draft_prefill(rows, timing.forward);
                self.draft = DraftState::Open(Arc::new(session));
            }
            Ok(Err(e)) => {
                self.fallback = Some(draft_open_failed(self.ctx.workers.as_ref(), &e));
            }
            Err(e) => self.fallback = Some(format!("opening the draft session: {e}")),
        }
    }

    /// Whether the closed draft session may be opened now. On shared cores (no
    /// `concurrent_prefill`) its prefill runs alone, so not before the first token is out:
    /// the caller's time to first token stays target-only's (the prefill then delays the
    /// second token instead, and costs the same in all).
    pub(super) fn may_open_draft(&self) -> bool {
        matches!(self.draft, DraftState::Closed)
            && (self.ctx.speculation.concurrent_prefill || self.seq.len() > self.req.prompt.len())
    }

    /// Asks the draft model for the plan's tokens. A failure, or an answer that does not
    /// fit, ends its part in the request (`Ok(None)`) and, unless the worker was only busy,
    /// trips the breaker.
    pub(super) async fn propose(
        &mut self,
        out: &Out,
        plan: Plan,
    ) -> Result<Option<Drafted>, Abort> {
        let Some(session) = self.draft.session().cloned() else {
            return Ok(None);
        };
        if !self.catch_up_draft(out, &session).await? {
            return Ok(None);
        }
        let keep = self.synced.draft;
        let alternatives = self.alternatives(plan);
        let call = Propose {
            keep,
            append: &self.seq[keep..],
            k: plan.k,
            stop_below: plan.stop_below,
            alternatives,
        };
        let may_stop = plan.stop_below > 0.0;
        if may_stop {
            let round = tracing::Span::current();
            round.set_attribute("duet.stop_below", f64::from(plan.stop_below));
        }
        let called = tokio::time::Instant::now();
        let answer = unless_cancelled(out, self.ctx.workers.propose(&session, call)).await?;
        self.stats.calls_in_round[0] += called.elapsed().as_secs_f64() * 1e3;
        let (greedy, vocab) = (self.req.sampling.is_greedy(), self.ctx.models.vocab);
        let fits = |p| check_proposal(p, (plan.k, may_stop), alternatives.1, vocab, greedy);
        match answer.and_then(fits) {
            Ok(p) => {
                self.stats.add_timing(p.timing, Party::Draft);
                Ok(Some(Drafted {
                    proposer: Proposer::DraftModel,
                    proposal: p,
                }))
            }
            Err(e) => {
                self.draft_failed(e);
                Ok(None)
            }
        }
    }

    /// What the plan's round asks the draft model for beside its chain: alternatives above
    /// the configured threshold, or else the plan's (`Plan::alternatives_above`), where the
    /// target verifies trees (none where that threshold is 0).
    fn alternatives(&self, plan: Plan) -> (f32, usize) {
        let fixed = self.ctx.speculation.adaptive.tree_alternatives_above;
        let above = if fixed > 0.0 {
            fixed
        } else {
            plan.alternatives_above
        };
        // At 1 no alternative can qualify.
        match (self.tree_width(), above > 0.0 && above < 1.0) {
            (width, true) if width > 0 => (above, width),
            _ => (0.0, 0),
        }
    }

    /// Feeds the draft the committed tokens it lacks beyond [`MAX_PROPOSE_APPEND`] (rounds
    /// went without it), in one-token Proposes of that many each, so that no Propose is a
    /// long prefill inside a batched pass. `false`: the draft-worker failed (the request
    /// goes on without it).
    async fn catch_up_draft(&mut self, out: &Out, session: &W::Session) -> Result<bool, Abort> {
        while self.seq.len() - self.synced.draft > MAX_PROPOSE_APPEND {
            let keep = self.synced.draft;
            let call = Propose {
                keep,
                append: &self.seq[keep..keep + MAX_PROPOSE_APPEND],
                k: 1,
                stop_below: 0.0,
                alternatives: (0.0, 0),
            };
            match unless_cancelled(out, self.ctx.workers.propose(session, call)).await? {
                // One token drafted, none fed: the cache holds exactly what was appended.
                Ok(p) => {
                    self.stats.add_timing(p.timing, Party::Draft);
                    self.synced.draft = keep + MAX_PROPOSE_APPEND;
                }
                Err(e) => {
                    self.draft_failed(e);
                    return Ok(false);
                }
            }
        }
        Ok(true)
    }

    /// The draft-worker failed a call, or answered what does not fit: the request goes on
    /// without it, and unless the worker was only busy, its breaker trips.
    pub(super) fn draft_failed(&mut self, e: CallError) {
        if e.trips_breaker() {
            self.ctx.workers.trip_draft(&e.to_string());
        }
        tracing::warn!(error = %e, "draft-worker failed; continuing without it");
        self.draft = DraftState::Unused;
        self.ready = None;
        self.fallback = Some(e.to_string());
    }
}
