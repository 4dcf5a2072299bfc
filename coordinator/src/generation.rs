//! The speculative loop of one request: draft K tokens, verify them in one target pass,
//! reconcile with the engine's verification functions, commit, stream the text. Both caches
//! roll back through the next round's `keep`/`append` (see `proto/duet/v1/worker.proto`).
//! The draft-worker failing at any point, or answering something that does not fit, turns
//! the rest of the request target-only; the target-worker failing ends it.

use crate::metrics::CoordinatorMetrics;
use crate::output::{Chunk, Event, FinishReason, Finished, Output, Timings, Usage};
use crate::request::{Method, ValidRequest};
use crate::workers::{
    CallError, Failure, Models, Open, Party, Proposal, Propose, TargetChoice, Verified, Verify,
    WorkerTiming, Workers,
};
use duet_engine::sampling::rng_for;
use duet_engine::verify::{Verdict, verify_greedy, verify_sampling};
use duet_serving::shutdown::Shutdown;
use rand_chacha::ChaCha8Rng;
use std::future::Future;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc;
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;

#[cfg(test)]
mod fakes;
#[cfg(test)]
mod tests;

/// Where a generation sends its stream; the task running it adds the error, if any.
pub type Out = mpsc::Sender<Result<Event, Abort>>;

/// Why a generation ended without its final message.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Abort {
    #[error("the caller went away")]
    CallerGone,
    /// The target-worker failed (draft-worker failures turn the request target-only).
    #[error(transparent)]
    Worker(#[from] CallError),
    /// The coordinator itself could not go on.
    #[error("coordinator: {0}")]
    Internal(String),
}

/// What every generation of a coordinator runs with.
#[derive(Debug)]
pub struct Context<W> {
    pub workers: Arc<W>,
    pub models: Arc<Models>,
    /// Open the draft session at the same time as the target's (see the configuration).
    pub concurrent_prefill: bool,
    pub metrics: Arc<CoordinatorMetrics>,
    /// Fires when the drain deadline passes: running generations end as `cancelled`.
    pub stopping: Shutdown,
}

/// Runs one request to its end, sending chunks and the final message to `out`.
pub async fn generate<W: Workers>(
    ctx: Context<W>,
    req: ValidRequest,
    arrived: Instant,
    out: &Out,
) -> Result<(), Abort> {
    // Both sessions close when `g` (which owns them) goes, whatever the outcome.
    let prefill = tracing::info_span!("prefill");
    let mut g = Generation::start(ctx, req, arrived, out)
        .instrument(prefill)
        .await?;
    g.run(out).await
}

/// Tokens on each side: how much of the committed sequence each worker's cache holds.
#[derive(Debug, Default)]
struct Synced {
    target: usize,
    draft: usize,
}

#[derive(Debug, Default)]
struct Stats {
    proposed: usize,
    accepted: usize,
    rounds: usize,
    /// All but the time to first token and the total, which are set when known.
    timings: Timings,
    first_token_ms: Option<f64>,
}

impl Stats {
    fn add_timing(&mut self, t: WorkerTiming, party: Party) {
        let forward = t.forward.as_secs_f64() * 1e3;
        match party {
            Party::Draft => self.timings.draft_forward += forward,
            Party::Target => self.timings.target_forward += forward,
        }
        self.timings.queue += t.queue.as_secs_f64() * 1e3;
    }
}

struct Generation<W: Workers> {
    ctx: Context<W>,
    req: ValidRequest,
    arrived: Instant,
    target: W::Session,
    /// The draft session while speculation is on.
    draft: Option<W::Session>,
    fallback: Option<String>,
    /// The committed sequence: prompt and completion.
    seq: Vec<u32>,
    synced: Synced,
    stats: Stats,
    rng: ChaCha8Rng,
}

/// Awaits `call` unless the caller goes away first.
async fn unless_cancelled<T>(out: &Out, call: impl Future<Output = T>) -> Result<T, Abort> {
    tokio::select! {
        r = call => Ok(r),
        _ = out.closed() => Err(Abort::CallerGone),
    }
}

async fn send(out: &Out, event: Event) -> Result<(), Abort> {
    out.send(Ok(event)).await.map_err(|_| Abort::CallerGone)
}

impl<W: Workers> Generation<W> {
    /// Opens the target session and, when the request speculates and the draft-worker is
    /// usable, the draft session (after the target's, or with it when `concurrent_prefill`).
    async fn start(
        ctx: Context<W>,
        req: ValidRequest,
        arrived: Instant,
        out: &Out,
    ) -> Result<Self, Abort> {
        let open = Open {
            prompt: &req.prompt,
            capacity: req.prompt.len() + req.max_tokens,
            sampling: &req.sampling,
        };
        let mut fallback = None;
        let speculate = match req.method {
            Method::None => false,
            Method::DraftModel => match ctx.workers.draft_available() {
                Ok(()) => true,
                Err(why) => {
                    fallback = Some(why);
                    false
                }
            },
        };
        let started = Instant::now();
        let w = &ctx.workers;
        let (target, draft) = if !speculate {
            (unless_cancelled(out, w.open_target(open)).await?, None)
        } else if ctx.concurrent_prefill {
            let both = async { tokio::join!(w.open_target(open), w.open_draft(open)) };
            let (t, d) = unless_cancelled(out, both).await?;
            (t, Some(d))
        } else {
            let t = unless_cancelled(out, w.open_target(open)).await?;
            let d = match &t {
                Ok(_) => Some(unless_cancelled(out, w.open_draft(open)).await?),
                Err(_) => None,
            };
            (t, d)
        };
        // On any early return the sessions already opened close as they drop.
        let (target, target_timing) = target?;
        let draft = match draft {
            Some(Ok((session, _))) => Some(session),
            Some(Err(e)) => {
                if e.trips_breaker() {
                    w.trip_draft(&e.to_string());
                }
                fallback = Some(format!("the draft session did not open: {e}"));
                None
            }
            None => None,
        };
        let mut stats = Stats::default();
        stats.timings.prefill = started.elapsed().as_secs_f64() * 1e3;
        stats.timings.queue += target_timing.queue.as_secs_f64() * 1e3;
        let prompt_len = req.prompt.len();
        Ok(Self {
            rng: rng_for(req.sampling.seed),
            seq: req.prompt.clone(),
            synced: Synced {
                target: prompt_len - 1,
                draft: prompt_len - 1,
            },
            ctx,
            req,
            arrived,
            target,
            draft,
            fallback,
            stats,
        })
    }

    /// Rounds until a finish condition, then the final message.
    async fn run(&mut self, out: &Out) -> Result<(), Abort> {
        let mut output = Output::new(self.req.stop.clone(), self.req.max_tokens);
        let finish = loop {
            if self.ctx.stopping.is_triggered() {
                break FinishReason::Cancelled;
            }
            let round_start = Instant::now();
            let span =
                tracing::info_span!("speculate.round", duet.round = self.stats.rounds as i64);
            let committed = self.round(out, output.remaining()).instrument(span).await?;
            self.stats.rounds += 1;
            self.stats.timings.rounds += round_start.elapsed().as_secs_f64() * 1e3;
            let taken = output
                .take(&self.ctx.models.tokenizer, &committed)
                .map_err(Abort::Internal)?;
            self.seq.extend_from_slice(&taken.tokens);
            self.observe_latencies(round_start, taken.tokens.len());
            let chunk = Chunk {
                text: taken.text,
                tokens: taken.tokens,
            };
            send(out, Event::Chunk(chunk)).await?;
            if let Some(reason) = taken.finish {
                break reason;
            }
        };
        let text = output.flush(finish);
        let usage = self.usage(output.generated());
        self.observe_finish(finish, &usage);
        trace_usage(&usage, finish);
        let finished = Finished {
            reason: finish,
            text,
            usage,
        };
        send(out, Event::Finished(finished)).await
    }

    /// One round: a speculation round when a draft session is open and more than one token
    /// remains, else a target-only step. Returns the committed tokens (1 to K + 1).
    async fn round(&mut self, out: &Out, remaining: usize) -> Result<Vec<u32>, Abort> {
        let k = self.req.k.min(remaining.saturating_sub(1));
        let proposal = match k {
            0 => None,
            k => self.propose(out, k).await?,
        };
        let drafts: &[u32] = proposal.as_ref().map_or(&[], |p| &p.tokens);
        let verified = self.verify(out, drafts).await?;
        let verdict = self.reconcile(proposal.as_ref(), &verified)?;
        let committed = verdict.committed(drafts);
        self.trace_round(drafts.len(), verdict.accepted, committed.len());

        let before = self.seq.len();
        self.synced.target = before + verdict.accepted;
        self.ctx.metrics.round(drafts.len(), verdict.accepted);
        if !drafts.is_empty() {
            // The draft fed its tokens but the last one.
            self.synced.draft = before + verdict.accepted.min(drafts.len() - 1);
            self.stats.proposed += drafts.len();
            self.stats.accepted += verdict.accepted;
        }
        Ok(committed)
    }

    /// Asks the draft for `k` tokens. A failure, or an answer that does not fit, ends
    /// speculation for the request (`Ok(None)`) and, unless the worker was only busy,
    /// trips the breaker.
    async fn propose(&mut self, out: &Out, k: usize) -> Result<Option<Proposal>, Abort> {
        let Some(session) = &self.draft else {
            return Ok(None);
        };
        let keep = self.synced.draft;
        let call = Propose {
            keep,
            append: &self.seq[keep..],
            k,
        };
        let answer = unless_cancelled(out, self.ctx.workers.propose(session, call)).await?;
        let greedy = self.req.sampling.is_greedy();
        match answer.and_then(|p| check_proposal(p, k, self.ctx.models.vocab, greedy)) {
            Ok(p) => {
                self.stats.add_timing(p.timing, Party::Draft);
                Ok(Some(p))
            }
            Err(e) => {
                if e.trips_breaker() {
                    self.ctx.workers.trip_draft(&e.to_string());
                }
                tracing::warn!(error = %e, "draft-worker failed; continuing target-only");
                self.draft = None;
                self.fallback = Some(e.to_string());
                Ok(None)
            }
        }
    }

    /// The target's verdict on `drafts` (none: one plain decoding step).
    async fn verify(&mut self, out: &Out, drafts: &[u32]) -> Result<Verified, Abort> {
        let keep = self.synced.target;
        let call = Verify {
            keep,
            append: &self.seq[keep..],
            drafts,
        };
        let verified = unless_cancelled(out, self.ctx.workers.verify(&self.target, call)).await??;
        let greedy = self.req.sampling.is_greedy();
        check_verified(&verified, drafts.len(), self.ctx.models.vocab, greedy)?;
        self.stats.add_timing(verified.timing, Party::Target);
        Ok(verified)
    }

    /// Greedy match, or rejection sampling, of the drafts against the target's choice.
    fn reconcile(&mut self, proposal: Option<&Proposal>, v: &Verified) -> Result<Verdict, Abort> {
        let drafts = proposal.map_or(&[][..], |p| &p.tokens);
        let verdict = match &v.choice {
            TargetChoice::Argmax(argmax) => verify_greedy(drafts, argmax),
            TargetChoice::P(p) => {
                let q = proposal.map_or(&[][..], |p| &p.q);
                verify_sampling(drafts, q, p, &mut self.rng)
            }
        };
        // The answers were checked to fit: a mismatch here is the coordinator's own bug.
        verdict.map_err(|e| Abort::Internal(format!("verifying a round: {e}")))
    }

    /// The round's attributes on its span, and a `rollback` span when a draft token was
    /// rejected: what each worker drops at the start of its next call (`keep`).
    fn trace_round(&self, k: usize, accepted: usize, committed: usize) {
        let round = tracing::Span::current();
        round.set_attribute("duet.k", k as i64);
        round.set_attribute("duet.accepted", accepted as i64);
        round.set_attribute("duet.committed", committed as i64);
        round.set_attribute("duet.fallback", self.fallback.is_some());
        if accepted < k {
            // The target fed all K drafts; the draft fed all but the last.
            let target = k - accepted;
            let draft = (k - 1) - accepted.min(k - 1);
            round.set_attribute("duet.first_rejected_position", accepted as i64);
            round.set_attribute("duet.target.rollback_tokens", target as i64);
            round.set_attribute("duet.draft.rollback_tokens", draft as i64);
            let rollback = tracing::info_span!("rollback");
            rollback.set_attribute("duet.target.rollback_tokens", target as i64);
            rollback.set_attribute("duet.draft.rollback_tokens", draft as i64);
        }
    }

    /// Time to first token, then per-token latency: the round's time shared by its tokens.
    fn observe_latencies(&mut self, round_start: Instant, tokens: usize) {
        let m = &self.ctx.metrics;
        let mut per_token = tokens;
        if self.stats.first_token_ms.is_none() {
            let ttft = self.arrived.elapsed().as_secs_f64();
            self.stats.first_token_ms = Some(ttft * 1e3);
            m.time_to_first_token.observe(ttft);
            per_token = tokens.saturating_sub(1);
        }
        if per_token > 0 {
            let each = round_start.elapsed().as_secs_f64() / tokens as f64;
            for _ in 0..per_token {
                m.inter_token_latency.observe(each);
            }
        }
    }

    /// Counts a finished generation.
    fn observe_finish(&self, finish: FinishReason, usage: &Usage) {
        let m = &self.ctx.metrics;
        m.request_ended(finish.name(), tonic::Code::Ok);
        m.e2e_latency.observe(self.arrived.elapsed().as_secs_f64());
        m.prompt_tokens.inc_by(usage.prompt_tokens as u64);
        m.generation_tokens.inc_by(usage.completion_tokens as u64);
        if usage.fallback.is_some() {
            m.fallbacks.inc();
        }
    }

    fn usage(&self, completion: usize) -> Usage {
        let s = &self.stats;
        let speculative = self.req.method == Method::DraftModel;
        Usage {
            prompt_tokens: self.req.prompt.len(),
            completion_tokens: completion,
            draft_tokens_proposed: s.proposed,
            draft_tokens_accepted: s.accepted,
            rounds: s.rounds,
            method: self.req.method,
            num_speculative_tokens: if speculative { self.req.k } else { 0 },
            fallback: self.fallback.clone(),
            timings: Timings {
                time_to_first_token: s.first_token_ms.unwrap_or_default(),
                total: self.arrived.elapsed().as_secs_f64() * 1e3,
                ..s.timings
            },
        }
    }
}

/// A draft answer fits a call for `k` tokens: exactly `k` tokens inside the vocabulary, and
/// for sampling sessions one q per token that gives its token some mass (rejection sampling
/// is exact only then).
fn check_proposal(
    p: Proposal,
    k: usize,
    vocab: usize,
    greedy: bool,
) -> Result<Proposal, CallError> {
    let malformed = |m: String| Err(CallError::new(Party::Draft, Failure::Malformed(m)));
    if p.tokens.len() != k {
        return malformed(format!("{} tokens, {k} were asked for", p.tokens.len()));
    }
    if let Some(t) = p.tokens.iter().find(|&&t| t as usize >= vocab) {
        return malformed(format!("token {t} is outside the vocabulary of {vocab}"));
    }
    let q_wanted = if greedy { 0 } else { k };
    if p.q.len() != q_wanted {
        return malformed(format!("{} distributions for {k} tokens", p.q.len()));
    }
    for (i, (q, &t)) in p.q.iter().zip(&p.tokens).enumerate() {
        if q.ids().last().is_some_and(|&id| id as usize >= vocab) || q.prob(t) <= 0.0 {
            return malformed(format!("q of draft token {i} does not fit its token {t}"));
        }
    }
    Ok(p)
}

/// A target answer fits a call with `k` drafts: K + 1 argmaxes inside the vocabulary for
/// greedy sessions, K + 1 distributions over it for sampling sessions.
fn check_verified(v: &Verified, k: usize, vocab: usize, greedy: bool) -> Result<(), CallError> {
    let malformed = |m: String| Err(CallError::new(Party::Target, Failure::Malformed(m)));
    if v.choice.len() != k + 1 {
        return malformed(format!("{} positions for {k} drafts", v.choice.len()));
    }
    match (&v.choice, greedy) {
        (TargetChoice::Argmax(argmax), true) => match argmax.iter().find(|&&t| t as usize >= vocab)
        {
            Some(t) => malformed(format!("token {t} is outside the vocabulary of {vocab}")),
            None => Ok(()),
        },
        (TargetChoice::P(p), false) => {
            match p
                .iter()
                .any(|d| d.ids().last().is_some_and(|&id| id as usize >= vocab))
            {
                true => malformed(format!("a distribution beyond the vocabulary of {vocab}")),
                false => Ok(()),
            }
        }
        (TargetChoice::Argmax(_), false) => malformed("argmaxes for a sampling session".into()),
        (TargetChoice::P(_), true) => malformed("distributions for a greedy session".into()),
    }
}

/// The request's outcome on its span (the `Generate` span, current here).
fn trace_usage(usage: &Usage, finish: FinishReason) {
    let span = tracing::Span::current();
    span.set_attribute("duet.completion_tokens", usage.completion_tokens as i64);
    span.set_attribute("duet.rounds", usage.rounds as i64);
    span.set_attribute("duet.draft_tokens", usage.draft_tokens_proposed as i64);
    span.set_attribute("duet.accepted_tokens", usage.draft_tokens_accepted as i64);
    if usage.draft_tokens_proposed > 0 {
        let rate = usage.draft_tokens_accepted as f64 / usage.draft_tokens_proposed as f64;
        span.set_attribute("duet.acceptance_rate", rate);
    }
    span.set_attribute("duet.fallback", usage.fallback.is_some());
    if let Some(reason) = &usage.fallback {
        span.set_attribute("duet.fallback_reason", reason.clone());
    }
    span.set_attribute("duet.finish_reason", finish.name());
}
