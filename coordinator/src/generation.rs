//! The speculative loop of one request: each round, choose who proposes (the draft model,
//! prompt lookup, or nobody: AUTO asks the controller, the other methods are fixed), draft K
//! tokens, verify them in one target pass, reconcile with the engine's verification
//! functions, commit, stream the text, and learn from it. Both caches roll back through the
//! next round's `keep`/`append` (see `proto/duet/v1/worker.proto`). The draft-worker failing
//! at any point, or answering something that does not fit, ends its part in the request;
//! the target-worker failing ends the request.
//!
//! With `speculation.overlap_drafting` (workers on separate devices), the draft model does
//! not wait while the target verifies: it drafts on from the round's drafts, first its guess
//! of the token the target adds after them, then the next round's drafts. When the round
//! commits all its drafts and the target's token is the guess, the next round finds its
//! drafts ready and goes straight to Verify; otherwise they are dropped (the next Propose's
//! `keep` rolls the draft cache back).

use crate::config::SpeculationConfig;
use crate::controller::{self, Controller, Plan, Proposer, RoundCosts, Shared, Source};
use crate::metrics::CoordinatorMetrics;
use crate::ngram::{Lookup, NgramIndex};
use crate::output::{Chunk, Event, FinishReason, Finished, Output, ProposerUsage, Timings, Usage};
use crate::request::{Method, ValidRequest};
use crate::workers::{
    CallError, Failure, Models, Open, Party, Proposal, Propose, TargetChoice, Verified, Verify,
    WorkerTiming, Workers,
};
use duet_engine::sampling::{Distribution, SamplingParams, rng_for};
use duet_engine::verify::{Verdict, verify_greedy, verify_sampling};
use duet_serving::shutdown::Shutdown;
use futures::FutureExt;
use rand_chacha::ChaCha8Rng;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio::task::JoinError;
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;

#[cfg(test)]
mod fakes;
#[cfg(test)]
mod tests;

/// Where a generation sends its stream; the task running it reports the error, if any.
pub type Out = mpsc::Sender<Event>;

/// Why a generation ended without its final message.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Abort {
    #[error("the caller went away")]
    CallerGone,
    /// The caller stopped reading: its stream stayed full this long (or until the drain
    /// deadline).
    #[error("the caller took no stream message for {0} ms; generation stopped")]
    Stalled(u64),
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
    pub speculation: Arc<SpeculationConfig>,
    /// What all requests learn together (AUTO's priors and costs).
    pub shared: Arc<Shared>,
    pub metrics: Arc<CoordinatorMetrics>,
    /// Fires when the drain deadline passes: running generations end as `cancelled`.
    pub stopping: Shutdown,
    /// How long a send may wait for the caller to take a message.
    pub stall_timeout: Duration,
    /// Target sessions a request may rebuild after losing its replica.
    pub max_failovers: u32,
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
    /// All but the time to first token and the total, which are set when known.
    timings: Timings,
    first_token_ms: Option<f64>,
    proposers: Vec<ProposerUsage>,
    /// Completion tokens committed at each target failover, and why it happened.
    failovers: Vec<(usize, String)>,
    /// Propose calls made while the target verified, and the rounds that used their drafts.
    ahead_calls: usize,
    ahead_used: usize,
}

impl Stats {
    fn count(&mut self, proposer: Proposer, proposed: usize, accepted: usize) {
        let at = match self.proposers.iter().position(|p| p.proposer == proposer) {
            Some(at) => at,
            None => {
                self.proposers.push(ProposerUsage {
                    proposer,
                    rounds: 0,
                    proposed: 0,
                    accepted: 0,
                });
                self.proposers.len() - 1
            }
        };
        let p = &mut self.proposers[at];
        p.rounds += 1;
        p.proposed += proposed;
        p.accepted += accepted;
    }

    /// Rounds, draft tokens proposed and accepted, over all proposers.
    fn totals(&self) -> (usize, usize, usize) {
        self.proposers.iter().fold((0, 0, 0), |(r, p, a), x| {
            (r + x.rounds, p + x.proposed, a + x.accepted)
        })
    }

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
    /// The draft model's session.
    draft: DraftState<W>,
    fallback: Option<String>,
    /// The committed sequence: prompt and completion.
    seq: Vec<u32>,
    synced: Synced,
    stats: Stats,
    rng: ChaCha8Rng,
    /// Prompt lookup's index of `seq` (NGRAM and AUTO).
    ngram: Option<NgramIndex>,
    /// AUTO's choices.
    controller: Option<Controller>,
    /// Drafts the draft model made while the target verified the round before, which that
    /// round's outcome made the right ones: this round's proposal, with no Propose call.
    ready: Option<Proposal>,
}

/// Where a request stands with the draft model.
enum DraftState<W: Workers> {
    /// Not used: not asked for, unavailable, or it failed.
    Unused,
    /// Usable, not opened yet: AUTO opens it when the controller first wants it, and
    /// DRAFT_MODEL on shared cores once the first token is out (`may_open_draft`).
    Closed,
    /// Being opened in the background (a dropped handle lets the open finish; the session
    /// then closes as it drops).
    Opening(Opening<W>),
    /// Shared with a Propose call running beside a Verify.
    Open(Arc<W::Session>),
}

impl<W: Workers> DraftState<W> {
    fn session(&self) -> Option<&Arc<W::Session>> {
        match self {
            Self::Open(s) => Some(s),
            _ => None,
        }
    }
}

/// A Propose call made while the target verifies a round's drafts: `k` tokens after them,
/// the first the draft's guess of the target's own token after the drafts.
struct Ahead {
    k: usize,
    answer: Result<Proposal, CallError>,
}

/// What a round drafted, and how.
struct Drafted {
    proposer: Proposer,
    proposal: Proposal,
}

/// Awaits `call` unless the caller goes away first.
async fn unless_cancelled<T>(out: &Out, call: impl Future<Output = T>) -> Result<T, Abort> {
    tokio::select! {
        r = call => Ok(r),
        _ = out.closed() => Err(Abort::CallerGone),
    }
}

/// Sends one stream message. A caller that stops reading would hold its sessions and its
/// permit for ever: when the stream is full, the send waits at most `ctx.stall_timeout`,
/// and not past the drain deadline. A stream with room (every round of a caller that
/// reads) takes the message at once, with no timer armed.
async fn send<W: Workers>(ctx: &Context<W>, out: &Out, event: Event) -> Result<(), Abort> {
    let event = match out.try_send(event) {
        Ok(()) => return Ok(()),
        Err(mpsc::error::TrySendError::Closed(_)) => return Err(Abort::CallerGone),
        Err(mpsc::error::TrySendError::Full(event)) => event,
    };
    let waiting = tokio::time::Instant::now();
    tokio::select! {
        sent = out.send(event) => return sent.map_err(|_| Abort::CallerGone),
        _ = tokio::time::sleep(ctx.stall_timeout) => {}
        _ = ctx.stopping.wait() => {}
    }
    ctx.metrics.stalled_streams.inc();
    Err(Abort::Stalled(waiting.elapsed().as_millis() as u64))
}

impl<W: Workers> Generation<W> {
    /// Opens the target session and, when the request speculates and the draft-worker is
    /// usable, the draft session with it on separate devices (`concurrent_prefill`); on
    /// shared cores the draft session opens after the first token (`may_open_draft`).
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
            Method::None | Method::Ngram => false,
            Method::DraftModel | Method::Auto => match ctx.workers.draft_available() {
                Ok(()) => true,
                Err(why) => {
                    fallback = Some(why);
                    false
                }
            },
        };
        let started = Instant::now();
        let w = &ctx.workers;
        // On separate devices (`concurrent_prefill`) the draft session opens beside the
        // target's prefill: DRAFT_MODEL waits for both, AUTO lets it open in the background
        // so that it is ready when the controller first wants the draft model. On shared
        // cores, where the two prefills would slow each other, it opens later, after the
        // first token (`may_open_draft`).
        let concurrent = ctx.speculation.concurrent_prefill;
        let later = speculate && (req.method == Method::Auto || !concurrent);
        let opening = (later && concurrent)
            .then(|| spawn_open_draft(w.clone(), req.prompt.clone(), req.sampling, open.capacity));
        let (target, draft) = if !speculate || later {
            (unless_cancelled(out, w.open_target(open)).await?, None)
        } else {
            let both = async { tokio::join!(w.open_target(open), w.open_draft(open)) };
            let (t, d) = unless_cancelled(out, both).await?;
            (t, Some(d))
        };
        // On any early return the sessions already opened close as they drop.
        let (target, _) = target?;
        let draft = match draft {
            Some(Ok((session, _))) => Some(session),
            Some(Err(e)) => {
                fallback = Some(draft_open_failed(w.as_ref(), &e));
                None
            }
            None => None,
        };
        let mut stats = Stats::default();
        stats.timings.prefill = started.elapsed().as_secs_f64() * 1e3;
        let prompt_len = req.prompt.len();
        let ngram = matches!(req.method, Method::Ngram | Method::Auto).then(|| {
            let n = &ctx.speculation.ngram;
            let mut index = NgramIndex::new(n.min_match, n.max_match);
            index.extend(&req.prompt);
            index
        });
        Ok(Self {
            ngram,
            controller: (req.method == Method::Auto).then(Controller::default),
            ready: None,
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
            draft: match (draft, opening) {
                (Some(session), _) => DraftState::Open(Arc::new(session)),
                (None, Some(opening)) => DraftState::Opening(opening),
                (None, None) if later => DraftState::Closed,
                (None, None) => DraftState::Unused,
            },
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
                tracing::info_span!("speculate.round", duet.round = self.stats.totals().0 as i64);
            let committed = self.round(out, output.remaining()).instrument(span).await?;
            self.stats.timings.rounds += round_start.elapsed().as_secs_f64() * 1e3;
            let taken = output
                .take(&self.ctx.models.tokenizer, &committed)
                .map_err(Abort::Internal)?;
            self.seq.extend_from_slice(&taken.tokens);
            if let Some(index) = &mut self.ngram {
                index.extend(&self.seq);
            }
            self.observe_latencies(round_start, taken.tokens.len());
            let chunk = Chunk {
                text: taken.text,
                tokens: taken.tokens,
            };
            send(&self.ctx, out, Event::Chunk(chunk)).await?;
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
        send(&self.ctx, out, Event::Finished(finished)).await
    }

    /// One round: draft tokens by the plan's proposer (none: a target-only step), verify
    /// them, commit. Returns the committed tokens (1 to K + 1).
    async fn round(&mut self, out: &Out, remaining: usize) -> Result<Vec<u32>, Abort> {
        let mut started = tokio::time::Instant::now();
        self.take_opened_draft();
        if let Some(c) = &mut self.controller {
            c.observe_running(usize::try_from(self.ctx.metrics.running.get()).unwrap_or(0));
        }
        let limit = self.req.k.min(remaining.saturating_sub(1));
        let lookup = self.lookup(limit);
        let ready = self.ready.take().filter(|_| limit > 0);
        let mut plan = match &ready {
            // Drafted while the last round was verified: they cost nothing more now.
            Some(r) => Plan {
                proposer: Proposer::DraftModel,
                k: r.tokens.len().min(limit),
            },
            None => self.plan(limit, remaining, lookup.as_ref()),
        };
        if plan.proposer == Proposer::DraftModel && self.draft.session().is_none() {
            // Worth the draft model's prefill (`plan` asks for it only when it may open):
            // open its session for the rounds to come. On shared cores (no
            // `concurrent_prefill`) the draft's prefill would slow the target's steps
            // meanwhile as much as running it alone: the request waits for it.
            self.open_draft_later();
            if !self.ctx.speculation.concurrent_prefill {
                self.wait_opened_draft(out).await?;
                // That wait was the draft's prefill (learnt apart, per prompt token), not
                // this round's overhead: counted as overhead, one such round made every
                // draft-model round look a prefill dearer to requests that never open the
                // draft session again to measure it.
                started = tokio::time::Instant::now();
            }
            plan = self.plan(limit, remaining, lookup.as_ref());
        }
        let was_ready = ready.is_some();
        let drafted = match (ready, plan.proposer) {
            (Some(mut r), _) => {
                self.stats.ahead_used += 1;
                r.tokens.truncate(plan.k);
                r.q.truncate(plan.k);
                Some(Drafted {
                    proposer: Proposer::DraftModel,
                    proposal: r,
                })
            }
            (None, Proposer::DraftModel) => self.propose(out, plan.k).await?,
            (None, Proposer::Ngram) => lookup.as_ref().map(|l| self.lookup_proposal(l, plan.k)),
            (None, Proposer::None) => None,
        };
        let proposal = drafted.as_ref().map(|d| &d.proposal);
        let drafts: &[u32] = proposal.map_or(&[], |p| &p.tokens);
        let used = drafted.as_ref().map_or(Proposer::None, |d| d.proposer);
        let appended = self.seq.len() - self.synced.target;
        let ahead = match used {
            Proposer::DraftModel => self.ahead_k(drafts.len(), remaining),
            _ => None,
        };
        let (verified, ahead) = match ahead {
            None => (self.verify(out, drafts).await?, None),
            Some((session, k)) => {
                let ahead = self.draft_ahead(out, session, drafts, k);
                let (verified, answer) = tokio::join!(self.verify(out, drafts), ahead);
                (verified?, Some(Ahead { k, answer: answer? }))
            }
        };
        let verdict = self.reconcile(proposal, &verified)?;
        let committed = verdict.committed(drafts);
        // The draft fed its tokens but the last one; all of them if it drafted ahead.
        let draft_fed = match &ahead {
            Some(Ahead { answer: Ok(_), .. }) => drafts.len(),
            _ => drafts.len().saturating_sub(1),
        };
        self.trace_round(
            used,
            drafts.len(),
            verdict.accepted,
            committed.len(),
            draft_fed,
        );
        if self.ctx.speculation.overlap_drafting {
            tracing::Span::current().set_attribute("duet.drafts_made_ahead", was_ready);
        }
        self.learn(Learned {
            used,
            lookup: lookup.as_ref(),
            proposal,
            drafted_ahead: was_ready,
            beside: ahead.as_ref(),
            verified: &verified,
            accepted: verdict.accepted,
            committed: &committed,
            own_rows: appended + drafts.len(),
            started,
        });

        let before = self.seq.len();
        self.synced.target = before + verdict.accepted;
        self.ctx
            .metrics
            .round(used.name(), drafts.len(), verdict.accepted);
        self.stats.count(used, drafts.len(), verdict.accepted);
        if used == Proposer::DraftModel {
            self.synced.draft = before + verdict.accepted.min(draft_fed);
        }
        if was_ready {
            self.ctx.metrics.drafted_ahead_used.inc();
        }
        if let Some(ahead) = ahead {
            let all_accepted = verdict.accepted == drafts.len();
            self.take_ahead(ahead, all_accepted.then(|| committed[committed.len() - 1]));
        }
        Ok(committed)
    }

    /// The draft session and the tokens it should draft while the target verifies `drafts`
    /// (none: no drafting ahead): the guess of the target's token after them, then the next
    /// round's K, if the completion has room for them.
    fn ahead_k(&self, drafts: usize, remaining: usize) -> Option<(Arc<W::Session>, usize)> {
        let session = self.draft.session()?;
        if !self.ctx.speculation.overlap_drafting || drafts == 0 {
            return None;
        }
        // If this round commits all its drafts and the target's token, the next round may
        // draft this many: the request's K, or under AUTO as many as this round, where its
        // controller finds drafting ahead pays (only AUTO reads the shared costs).
        let k = match &self.controller {
            None => self.req.k,
            Some(c) => match self.ctx.shared.costs() {
                Some(costs) if c.draft_ahead(&costs, drafts) => drafts,
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
    fn draft_ahead(
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
            };
            unless_cancelled(&out, workers.propose(&session, call)).await
        }
        .instrument(span)
    }

    /// What the draft made ahead is worth after the round: the next round's drafts when the
    /// round committed all its drafts and then the token the draft guessed (`last`: the
    /// target's token after them, when all were accepted).
    fn take_ahead(&mut self, ahead: Ahead, last: Option<u32>) {
        let greedy = self.req.sampling.is_greedy();
        let vocab = self.ctx.models.vocab;
        match ahead
            .answer
            .and_then(|p| check_proposal(p, ahead.k, vocab, greedy))
        {
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
    /// its prompt.
    fn open_draft_later(&mut self) {
        let capacity = self.req.prompt.len() + self.req.max_tokens;
        self.synced.draft = self.seq.len() - 1;
        let (workers, prompt) = (self.ctx.workers.clone(), self.seq.clone());
        let opening = spawn_open_draft(workers, prompt, self.req.sampling, capacity);
        self.draft = DraftState::Opening(opening);
    }

    /// Takes the draft session once its background open has finished.
    fn take_opened_draft(&mut self) {
        let DraftState::Opening(handle) = &mut self.draft else {
            return;
        };
        if !handle.is_finished() {
            return;
        }
        let opened = handle.now_or_never();
        self.draft = DraftState::Unused;
        if let Some(opened) = opened {
            self.opened_draft(opened);
        }
    }

    /// Waits for the draft session's background open to finish, and takes it.
    async fn wait_opened_draft(&mut self, out: &Out) -> Result<(), Abort> {
        let DraftState::Opening(handle) = std::mem::replace(&mut self.draft, DraftState::Unused)
        else {
            return Ok(());
        };
        let opened = unless_cancelled(out, handle).await?;
        self.opened_draft(opened);
        Ok(())
    }

    fn opened_draft(&mut self, opened: Result<Opened<W>, JoinError>) {
        match opened {
            Ok(Ok((session, timing))) => {
                let rows = self.synced.draft;
                self.ctx.shared.observe_draft_prefill(rows, timing.forward);
                self.draft = DraftState::Open(Arc::new(session));
            }
            Ok(Err(e)) => {
                self.fallback = Some(draft_open_failed(self.ctx.workers.as_ref(), &e));
            }
            Err(e) => self.fallback = Some(format!("opening the draft session: {e}")),
        }
    }

    /// Prompt lookup's proposal for this round (NGRAM and AUTO), at most `limit` tokens
    /// (AUTO: also at most its configured share).
    fn lookup(&self, limit: usize) -> Option<Lookup> {
        let index = self.ngram.as_ref()?;
        let cap = match self.req.method {
            Method::Auto => limit.min(self.ctx.speculation.adaptive.max_ngram_tokens as usize),
            _ => limit,
        };
        index.lookup(&self.seq, cap)
    }

    /// Who drafts this round, and how many tokens, with `remaining` completion tokens to go.
    fn plan(&self, limit: usize, remaining: usize, lookup: Option<&Lookup>) -> Plan {
        let draft_open = self.draft.session().is_some() && limit > 0;
        match self.req.method {
            Method::None => Plan::TARGET_ONLY,
            Method::DraftModel if draft_open || (self.may_open_draft() && limit > 0) => Plan {
                proposer: Proposer::DraftModel,
                k: limit,
            },
            Method::DraftModel => Plan::TARGET_ONLY,
            Method::Ngram => lookup.map_or(Plan::TARGET_ONLY, |l| Plan {
                proposer: Proposer::Ngram,
                k: l.tokens.len(),
            }),
            Method::Auto => {
                let (Some(controller), Some(costs)) = (&self.controller, self.ctx.shared.costs())
                else {
                    // Nothing is known of the costs yet: one plain step measures them.
                    return Plan::TARGET_ONLY;
                };
                let max_k = self.ctx.speculation.adaptive.max_draft_model_tokens as usize;
                // Committed tokens the draft model's cache would first have to take in: the
                // ones it lacks, or, before its session is open, all of them.
                let catch_up = match &self.draft {
                    DraftState::Open(_) => Some(self.seq.len() - self.synced.draft - 1),
                    DraftState::Closed if self.may_open_draft() => Some(self.seq.len() - 1),
                    DraftState::Closed | DraftState::Opening(_) | DraftState::Unused => None,
                };
                let options = controller::Options {
                    limit,
                    remaining,
                    draft: catch_up
                        .filter(|_| limit > 0)
                        .map(|catch_up| controller::DraftOption { max_k, catch_up }),
                    ngram: lookup.map(|l| (l.matched, l.tokens.len())),
                    overlap: self.ctx.speculation.overlap_drafting,
                };
                controller.plan(&costs, &options)
            }
        }
    }

    /// Whether the closed draft session may be opened now. On shared cores (no
    /// `concurrent_prefill`) its prefill runs alone, so not before the first token is out:
    /// the caller's time to first token stays target-only's (the prefill then delays the
    /// second token instead, and costs the same in all).
    fn may_open_draft(&self) -> bool {
        matches!(self.draft, DraftState::Closed)
            && (self.ctx.speculation.concurrent_prefill || self.seq.len() > self.req.prompt.len())
    }

    /// The first `k` tokens of a lookup as a proposal: point masses for rejection sampling
    /// (a token is then accepted with the target's own probability of it).
    fn lookup_proposal(&self, lookup: &Lookup, k: usize) -> Drafted {
        let tokens = lookup.tokens[..k.min(lookup.tokens.len())].to_vec();
        let q = match self.req.sampling.is_greedy() {
            true => Vec::new(),
            false => tokens.iter().map(|&t| Distribution::point(t)).collect(),
        };
        Drafted {
            proposer: Proposer::Ngram,
            proposal: Proposal {
                tokens,
                q,
                timing: WorkerTiming::default(),
            },
        }
    }

    /// What a finished round teaches: the costs and acceptance all requests share, and this
    /// request's controller. Prompt lookup is scored on every round, used or not, against
    /// the committed tokens (for sampling, a token equal to the committed one is exactly as
    /// likely as its acceptance would have been).
    fn learn(&mut self, r: Learned<'_>) {
        let shared = &self.ctx.shared;
        let target = r.verified.timing;
        // Drafts made ahead took their time in the round before, beside its Verify.
        let draft = r
            .proposal
            .filter(|_| r.used == Proposer::DraftModel && !r.drafted_ahead)
            .map(|p| (p.timing, p.tokens.len()));
        let (draft_timing, draft_tokens) = draft.unwrap_or_default();
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        let workers = target.forward + target.queue + draft_timing.forward + draft_timing.queue;
        shared.observe_round(&RoundCosts {
            pass_calls: target.batch_calls,
            pass_rows: target.batch_rows.max(r.own_rows),
            pass_ms: ms(target.forward),
            draft_ms: ms(draft_timing.share),
            draft_tokens,
            overhead_ms: ms(r.started.elapsed().saturating_sub(workers)),
            committed: r.committed.len(),
            beside_ahead: r.beside.map(|a| match &a.answer {
                Ok(p) => (ms(p.timing.share), p.tokens.len()),
                Err(_) => (0.0, 0),
            }),
        });
        let proposed = r.proposal.map_or(0, |p| p.tokens.len());
        let source = match r.used {
            Proposer::DraftModel => Some(Source::DraftModel),
            Proposer::Ngram => r
                .lookup
                .map(|l| Source::Ngram(controller::ngram_bucket(l.matched))),
            Proposer::None => None,
        };
        let mut seen = Vec::new();
        if let Some(source) = source {
            seen.push((source, proposed, r.accepted));
        }
        if let (Some(l), false) = (r.lookup, r.used == Proposer::Ngram) {
            let n = l.tokens.len().min(r.committed.len());
            let hits = l
                .tokens
                .iter()
                .zip(r.committed)
                .take_while(|(a, b)| a == b)
                .count();
            seen.push((
                Source::Ngram(controller::ngram_bucket(l.matched)),
                n,
                hits.min(n),
            ));
        }
        for &(source, proposed, accepted) in &seen {
            shared.observe_acceptance(source, proposed, accepted);
        }
        if r.used != Proposer::DraftModel {
            shared.round_without_draft();
        }
        if let Some(c) = &mut self.controller {
            for (source, proposed, accepted) in seen {
                c.observe(source, proposed, accepted);
            }
            c.observe_batch(target.batch_calls, target.batch_rows, r.own_rows);
            if r.used != Proposer::DraftModel {
                c.round_without_draft();
            }
        }
    }

    /// Asks the draft model for `k` tokens. A failure, or an answer that does not fit, ends
    /// its part in the request (`Ok(None)`) and, unless the worker was only busy, trips the
    /// breaker.
    async fn propose(&mut self, out: &Out, k: usize) -> Result<Option<Drafted>, Abort> {
        let Some(session) = self.draft.session() else {
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

    /// The draft-worker failed a call, or answered what does not fit: the request goes on
    /// without it, and unless the worker was only busy, its breaker trips.
    fn draft_failed(&mut self, e: CallError) {
        if e.trips_breaker() {
            self.ctx.workers.trip_draft(&e.to_string());
        }
        tracing::warn!(error = %e, "draft-worker failed; continuing without it");
        self.draft = DraftState::Unused;
        self.ready = None;
        self.fallback = Some(e.to_string());
    }

    /// The target's verdict on `drafts` (none: one plain decoding step). A lost replica
    /// costs a failover, not the request.
    async fn verify(&mut self, out: &Out, drafts: &[u32]) -> Result<Verified, Abort> {
        let verified = loop {
            let keep = self.synced.target;
            let call = Verify {
                keep,
                append: &self.seq[keep..],
                drafts,
            };
            match unless_cancelled(out, self.ctx.workers.verify(&self.target, call)).await? {
                Ok(verified) => break verified,
                Err(e)
                    if e.lost_replica()
                        && self.stats.failovers.len() < self.ctx.max_failovers as usize =>
                {
                    self.fail_over(out, e).await?;
                }
                Err(e) => return Err(e.into()),
            }
        };
        let greedy = self.req.sampling.is_greedy();
        check_verified(&verified, drafts.len(), self.ctx.models.vocab, greedy)?;
        self.stats.add_timing(verified.timing, Party::Target);
        Ok(verified)
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
        let open = Open {
            prompt: &self.seq,
            capacity: self.req.prompt.len() + self.req.max_tokens,
            sampling: &self.req.sampling,
        };
        let reopen = self.ctx.workers.reopen_target(open, &self.target);
        let (session, timing) = unless_cancelled(out, reopen.instrument(span)).await??;
        // The lost session closes as it drops (best effort: its replica may be gone).
        self.target = session;
        self.synced.target = self.seq.len() - 1;
        self.stats.timings.prefill += timing.forward.as_secs_f64() * 1e3;
        Ok(())
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
    fn trace_round(
        &self,
        proposer: Proposer,
        k: usize,
        accepted: usize,
        committed: usize,
        draft_fed: usize,
    ) {
        let round = tracing::Span::current();
        round.set_attribute("duet.method", proposer.name());
        round.set_attribute("duet.k", k as i64);
        round.set_attribute("duet.accepted", accepted as i64);
        round.set_attribute("duet.committed", committed as i64);
        round.set_attribute("duet.fallback", self.fallback.is_some());
        if accepted < k {
            // The target fed all K drafts; the draft `draft_fed` of them.
            let target = k - accepted;
            let draft = draft_fed - accepted.min(draft_fed);
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
        let (rounds, proposed, accepted) = s.totals();
        let speculative = self.req.method != Method::None;
        Usage {
            prompt_tokens: self.req.prompt.len(),
            completion_tokens: completion,
            draft_tokens_proposed: proposed,
            draft_tokens_accepted: accepted,
            rounds,
            method: self.req.method,
            num_speculative_tokens: if speculative { self.req.k } else { 0 },
            fallback: self.fallback.clone(),
            timings: Timings {
                time_to_first_token: s.first_token_ms.unwrap_or_default(),
                total: self.arrived.elapsed().as_secs_f64() * 1e3,
                ..s.timings
            },
            proposers: s.proposers.clone(),
            target_failovers: s.failovers.clone(),
            drafted_ahead: s.ahead_calls,
            drafted_ahead_used: s.ahead_used,
        }
    }
}

/// A session being opened in the background.
type Opening<W> = tokio::task::JoinHandle<Opened<W>>;
type Opened<W> = Result<(<W as Workers>::Session, WorkerTiming), CallError>;

/// A finished round, for [`Generation::learn`].
struct Learned<'a> {
    used: Proposer,
    /// Prompt lookup's proposal at the round's start, used or not.
    lookup: Option<&'a Lookup>,
    proposal: Option<&'a Proposal>,
    /// The round's drafts were made ahead, in the round before.
    drafted_ahead: bool,
    /// A Propose made ahead ran beside this round's Verify.
    beside: Option<&'a Ahead>,
    verified: &'a Verified,
    accepted: usize,
    committed: &'a [u32],
    /// Rows this round fed the target: the appended tokens and the drafts.
    own_rows: usize,
    /// When the round began (tokio's clock, which tests pause).
    started: tokio::time::Instant,
}

/// Opens a draft session with `prompt` in a task of its own. Should the request end first,
/// the session closes as the task's result drops.
fn spawn_open_draft<W: Workers>(
    workers: Arc<W>,
    prompt: Vec<u32>,
    sampling: SamplingParams,
    capacity: usize,
) -> Opening<W> {
    // In the request's trace: its OpenSession call is a child of the span opening it.
    tokio::spawn(
        async move {
            let open = Open {
                prompt: &prompt,
                capacity,
                sampling: &sampling,
            };
            workers.open_draft(open).await
        }
        .in_current_span(),
    )
}

/// The draft session did not open: trips the breaker unless the worker was only busy, and
/// says why for the usage.
fn draft_open_failed<W: Workers>(workers: &W, e: &CallError) -> String {
    if e.trips_breaker() {
        workers.trip_draft(&e.to_string());
    }
    format!("the draft session did not open: {e}")
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
