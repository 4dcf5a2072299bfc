//! The speculative loop of one request: each round, choose who proposes (the draft model,
//! prompt lookup, or nobody: AUTO asks the controller, the other methods are fixed) and K
//! (the controller's, unless the request set it), draft K tokens, verify them in one target
//! pass, reconcile with the engine's verification functions, commit, stream the text, and
//! learn from it. Both caches roll back through the
//! next round's `keep`/`append` (see `proto/duet/v1/worker.proto`). The draft-worker failing
//! at any point, or answering something that does not fit, ends its part in the request;
//! the target-worker failing ends the request.
//!
//! Target-only steps may come from one Decode stream instead of a Verify call each
//! (`speculation.target_streams`: NONE always, AUTO after a long run of them): the target
//! runs each step as soon as the one before answers, and a round that drafts ends it. A
//! sampling request's stream draws each token on the target where this loop would draw it
//! (its random stream's position travels with the call and comes back with each token), so
//! a seed gives the same text with streams on or off. AUTO's streams look up drafts in the
//! request's text themselves (`speculation.stream_lookup`), as many as the controller finds
//! pay for each match length: a step that verified some comes back as a lookup round, its
//! accepted drafts and the target's token after them.
//!
//! With `speculation.overlap_drafting` (workers on separate devices), the draft model does
//! not wait while the target verifies: it drafts on from the round's drafts, first its guess
//! of the token the target adds after them, then the next round's drafts. When the round
//! commits all its drafts and the target's token is the guess, the next round finds its
//! drafts ready and goes straight to Verify; otherwise they are dropped (the next Propose's
//! `keep` rolls the draft cache back).

use crate::config::SpeculationConfig;
use crate::controller::{Controller, Plan, Shared};
use crate::method::{Method, Proposer};
use crate::metrics::CoordinatorMetrics;
use crate::output::{Chunk, Event, FinishReason, Finished, Output, PromptFigures};
use crate::proposals::{ProposalCache, Tenant};
use crate::request::ValidRequest;
use crate::room::Holding;
use crate::tools;
use crate::workers::{
    CallError, Decoded, Lease, Models, Open, Proposal, StreamLookup, Verified, Workers,
};
use duet_engine::logprobs::TokenLogprobs;
use duet_engine::ngram::{Lookup, NgramIndex, Prediction};
use duet_engine::sampling::rng_for;
use duet_serving::shutdown::Shutdown;
use rand_chacha::ChaCha8Rng;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tracing::Instrument;

mod draft;
#[cfg(test)]
pub(crate) mod fakes;
mod plan;
mod report;
mod shadow;
mod target;
#[cfg(test)]
pub(crate) mod tests;
mod tree;

use draft::{Ahead, DraftState, draft_open_failed, spawn_open_draft};
use report::{Stats, trace_usage};
use shadow::Shadow;
use tree::{Drawn, Tree};

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
    /// The request ran past `limits.request_timeout_ms` (this many ms) from its arrival.
    #[error("the request ran past limits.request_timeout_ms ({0} ms); generation stopped")]
    TimedOut(u64),
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
    /// The request's place, held by its sessions until the workers have closed them.
    pub lease: Lease,
    /// Where the request waits while no target replica has room for its session.
    pub room: Arc<crate::room::RoomQueue>,
    /// The proposal cache and the part of it this request reads and feeds (its tenant's);
    /// `None`: off for this request.
    pub proposals: Option<(Arc<ProposalCache>, Tenant)>,
}

/// When a request arrived, and how long it then waited for a place (admission).
#[derive(Debug, Clone, Copy)]
pub struct Arrival {
    pub at: Instant,
    pub queued: Duration,
}

#[cfg(test)]
impl Arrival {
    /// A request that arrives now and waits for nothing.
    pub fn now() -> Self {
        Self {
            at: Instant::now(),
            queued: Duration::ZERO,
        }
    }
}

/// Runs one request to its end, sending chunks and the final message to `out`.
pub async fn generate<W: Workers>(
    ctx: Context<W>,
    req: ValidRequest,
    arrival: Arrival,
    out: &Out,
) -> Result<(), Abort> {
    // Both sessions close when `g` (which owns them) goes, whatever the outcome.
    let prefill = tracing::info_span!("prefill");
    let mut g = Generation::start(ctx, req, arrival, out)
        .instrument(prefill)
        .await?;
    g.run(out).await
}

/// Tokens on each side: how much of the committed sequence each worker's cache holds.
#[derive(Debug, Default)]
struct Synced {
    target: usize,
    draft: usize,
    /// Of the committed tokens past `target`, those whose rows the target-worker still
    /// holds from a tree (an accepted alternative's): the next Verify appends them but the
    /// worker keeps their rows (`Session::reuse_tree`), so its pass does not compute them.
    target_held: usize,
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
    /// The prompt followed by the request's predicted output: lookups find the
    /// completion's own course there (its start where the prompt ends).
    predicted: Option<Prediction>,
    /// AUTO's choices.
    controller: Option<Controller>,
    /// Drafts the draft model made while the target verified the round before, which that
    /// round's outcome made the right ones: this round's proposal, with no Propose call.
    ready: Option<Proposal>,
    /// The target-only tokens of a Decode call still coming (`speculation.target_streams`).
    decoding: Option<Decoded>,
    /// Rounds in a row that were target-only steps.
    target_only_streak: usize,
    /// The proposal cache's proposal of a round that did not use it, still being scored
    /// against the committed text (`shadow.rs`).
    shadow: Option<Shadow>,
    /// The target refused a Decode call (a target-worker from before it): steps are Verify
    /// calls from then on.
    streams_refused: bool,
    /// How the Decode stream that runs looks up drafts itself (`speculation.stream_lookup`),
    /// and the committed tokens when that was last weighed.
    stream_lookup: Option<StreamLookup>,
    stream_lookup_at: usize,
    /// The prompt's figures (`prompt_logprobs`), until the first chunk carries them.
    prompt_figures: Option<PromptFigures>,
    /// Its entry among the requests holding target sessions, which a request of a lower
    /// priority waiting for room may ask to give way (`room.rs`).
    holding: Holding,
    /// The `preempted` span of a request that gave its room up, until it goes on.
    preempted: Option<tracing::Span>,
}

/// A round's committed tokens, and their figures where the request asks for them.
type Committed = (Vec<u32>, Vec<TokenLogprobs>);

/// What a round drafted, and how.
struct Drafted {
    proposer: Proposer,
    proposal: Proposal,
}

/// A round's plan, and when the round's own time starts again after a wait for the draft
/// session's prefill.
struct Choice {
    plan: Plan,
    waited: Option<tokio::time::Instant>,
}

/// One reconciled round: what `commit` records and learns from.
struct Round<'a> {
    started: tokio::time::Instant,
    lookup: Option<Lookup>,
    drafted: Option<Drafted>,
    /// Its drafts were made ahead, during the round before.
    drafted_ahead: bool,
    /// Rows of the target pass that were this request's: tokens appended and drafts.
    own_rows: usize,
    /// Its target step came from a Decode stream: it began before the round, so the
    /// round's time says nothing of a round's overhead.
    streamed: bool,
    verified: Verified,
    /// The draft model's call made ahead beside the Verify.
    ahead: Option<Ahead>,
    /// The drafts' chain accepted, from the first.
    accepted: usize,
    /// Alternatives verified beside the chain, and whether the target chose one.
    alternatives: usize,
    took_alternative: bool,
    committed: &'a [u32],
}

impl Round<'_> {
    fn drafts(&self) -> &[u32] {
        self.drafted.as_ref().map_or(&[], |d| &d.proposal.tokens)
    }

    fn proposer(&self) -> Proposer {
        self.drafted.as_ref().map_or(Proposer::None, |d| d.proposer)
    }
}

/// The target session of `req`: its prompt, with all it asks of the target.
fn target_open<'a, W: Workers>(req: &'a ValidRequest, ctx: &'a Context<W>) -> Open<'a> {
    Open {
        priority: ctx.room.preempts().then_some(req.priority),
        logprobs: req.logprobs,
        penalties: req.penalties,
        prompt_logprobs: req.prompt_logprobs,
        logit_bias: &req.logit_bias,
        min_tokens: req.min_tokens,
        format: req.format.as_ref(),
        cache_salt: req.cache_salt,
        stop_token_ids: req.held_stop_tokens(),
        adapter: req.adapter.as_deref(),
        ..Open::plain(
            &req.prompt,
            req.prompt.len() + req.max_tokens,
            &req.sampling,
            &ctx.lease,
        )
    }
}

/// Awaits `call` unless the caller goes away first.
async fn unless_cancelled<T>(out: &Out, call: impl Future<Output = T>) -> Result<T, Abort> {
    tokio::select! {
        r = call => Ok(r),
        _ = out.closed() => Err(Abort::CallerGone),
    }
}

/// How long a send waits for a caller that stopped reading (`Context::stall_timeout`), the
/// drain deadline, and the counter of streams ended for it.
struct Stall {
    timeout: Duration,
    stopping: Shutdown,
    metrics: Arc<CoordinatorMetrics>,
}

/// Offers one stream message: a stream with room (every round of a caller that reads)
/// takes it at once (`None`); a full one gives it back.
fn offer(out: &Out, event: Event) -> Result<Option<Event>, Abort> {
    match out.try_send(event) {
        Ok(()) => Ok(None),
        Err(mpsc::error::TrySendError::Closed(_)) => Err(Abort::CallerGone),
        Err(mpsc::error::TrySendError::Full(event)) => Ok(Some(event)),
    }
}

/// Sends a message a full stream gave back (`offer`). A caller that stops reading would
/// hold its sessions and its permit for ever: the send waits at most `stall.timeout`, and
/// not past the drain deadline.
async fn wait_to_send(ctx: &Stall, out: &Out, event: Event) -> Result<(), Abort> {
    let waiting = tokio::time::Instant::now();
    tokio::select! {
        sent = out.send(event) => return sent.map_err(|_| Abort::CallerGone),
        _ = tokio::time::sleep(ctx.timeout) => {}
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
        arrival: Arrival,
        out: &Out,
    ) -> Result<Self, Abort> {
        let open = target_open(&req, &ctx);
        let (speculate, mut fallback) = match req.method {
            Method::NONE | Method::NGRAM => (false, None),
            Method::DRAFT_MODEL | Method::Auto => match ctx.workers.draft_available() {
                Ok(()) => (true, None),
                Err(why) => (false, Some(why)),
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
        let opening = (later && concurrent).then(|| {
            let lease = ctx.lease.clone();
            spawn_open_draft(w.clone(), req.prompt.clone(), &req, lease)
        });
        let arrived = tokio::time::Instant::from_std(arrival.at);
        let open_target = (ctx.room).open((req.priority, arrived), |ask_for_room| {
            w.open_target(Open {
                ask_for_room,
                ..open
            })
        });
        let (target, draft) = if !speculate || later {
            (unless_cancelled(out, open_target).await?, None)
        } else {
            let both = async { tokio::join!(open_target, w.open_draft(open)) };
            let (t, d) = unless_cancelled(out, both).await?;
            (t, Some(d))
        };
        // On any early return the sessions already opened close as they drop.
        let ((target, opened, prompt_logprobs), waited_for_room) = target?;
        let draft = match draft {
            Some(Ok((session, _))) => DraftState::Open(Arc::new(session)),
            Some(Err(e)) => {
                fallback = Some(draft_open_failed(w.as_ref(), &e));
                DraftState::Unused
            }
            None => match opening {
                Some(opening) => DraftState::Opening(opening),
                None if later => DraftState::Closed,
                None => DraftState::Unused,
            },
        };
        let mut stats = Stats {
            prompt_cached: opened.cached,
            ..Stats::default()
        };
        let prefill = started.elapsed().saturating_sub(waited_for_room);
        stats.timings.prefill = prefill.as_secs_f64() * 1e3;
        stats.timings.admission_wait = (arrival.queued + waited_for_room).as_secs_f64() * 1e3;
        let prompt_figures = req.prompt_logprobs.map(|_| PromptFigures {
            tokens: req.prompt.clone(),
            logprobs: prompt_logprobs,
        });
        let mut generation = Self::new(ctx, req, arrival.at, (target, draft), fallback, stats);
        generation.prompt_figures = prompt_figures;
        Ok(generation)
    }

    /// A generation whose sessions are open (the draft's, or where it stands), before its
    /// first round.
    fn new(
        ctx: Context<W>,
        req: ValidRequest,
        arrived: Instant,
        (target, draft): (W::Session, DraftState<W>),
        fallback: Option<String>,
        stats: Stats,
    ) -> Self {
        let prompt_len = req.prompt.len();
        let looks_up = matches!(req.method, Method::NGRAM | Method::Auto);
        let n = &ctx.speculation.ngram;
        let ngram = looks_up.then(|| {
            let mut index = NgramIndex::new(n.min_match, n.max_match);
            index.extend(&req.prompt);
            index
        });
        let predicted = (looks_up && !req.prediction.is_empty())
            .then(|| Prediction::new(&req.prompt, &req.prediction, n.min_match, n.max_match));
        let copied_prior = ctx.shared.copied_prior(prompt_len);
        let rank = (req.priority, tokio::time::Instant::from_std(arrived));
        Self {
            holding: ctx.room.hold(rank),
            preempted: None,
            ngram,
            predicted,
            controller: req
                .choose_k
                .then(|| Controller::expecting_copied(copied_prior)),
            ready: None,
            decoding: None,
            target_only_streak: 0,
            shadow: None,
            streams_refused: false,
            stream_lookup: None,
            stream_lookup_at: 0,
            prompt_figures: None,
            rng: rng_for(req.sampling.seed),
            seq: req.prompt.clone(),
            synced: Synced {
                target: prompt_len - 1,
                draft: prompt_len - 1,
                target_held: 0,
            },
            ctx,
            req,
            arrived,
            target,
            draft,
            fallback,
            stats,
        }
    }

    /// Rounds until a finish condition, then the final message.
    async fn run(&mut self, out: &Out) -> Result<(), Abort> {
        let mut output = Output::new(&self.req);
        let deadline = (self.req.max_predict).map(|limit| tokio::time::Instant::now() + limit);
        let finish = loop {
            if self.ctx.stopping.is_triggered() {
                break FinishReason::Cancelled;
            }
            let preempted = self.holding.asked() || self.holding.waits_for_room();
            if preempted && !self.give_way(out).await? {
                break FinishReason::Cancelled;
            }
            let round_start = tokio::time::Instant::now();
            let span =
                tracing::info_span!("speculate.round", duet.round = self.stats.totals().0 as i64);
            let (committed, mut logprobs) =
                self.round(out, output.remaining()).instrument(span).await?;
            let waited = std::mem::take(&mut self.stats.waited_in_round);
            self.stats.timings.rounds += round_start.elapsed().as_secs_f64() * 1e3 - waited;
            let taken = output
                .take(&self.ctx.models.tokenizer, &committed)
                .map_err(Abort::Internal)?;
            self.seq.extend_from_slice(&taken.tokens);
            if let Some(index) = &mut self.ngram {
                index.extend(&self.seq);
            }
            self.observe_latencies(round_start, taken.tokens.len());
            logprobs.truncate(taken.tokens.len());
            let chunk = Chunk {
                text: taken.text,
                reasoning: taken.reasoning,
                tokens: taken.tokens,
                logprobs,
                prompt: self.prompt_figures.take(),
            };
            self.send(out, Event::Chunk(chunk)).await?;
            if let Some(reason) = taken.finish {
                break reason;
            }
            // An editor's completion comes in time, with at least a line.
            if deadline.is_some_and(|d| tokio::time::Instant::now() >= d) && output.holds_newline()
            {
                break FinishReason::Length;
            }
        };
        self.hold_prefix();
        // Its text (the target's own) teaches the proposal cache for later requests.
        if let Some((cache, tenant)) = &self.ctx.proposals {
            let entries = cache.learn(*tenant, &self.seq);
            self.ctx.metrics.proposal_cache_entries.set(entries as i64);
        }
        let last = output.flush(finish);
        let usage = self.usage((output.generated(), output.reasoning_tokens()));
        self.observe_finish(finish, &usage);
        trace_usage(&usage, finish);
        // Each call's id: random for the request, numbered within it.
        let request = format!("{:016x}", rand::random::<u64>());
        let asked = (self.req.parallel_tool_calls, &*self.req.tool_names);
        let format = self.ctx.models.call_format;
        let tool_calls = output
            .kept()
            .map(|text| tools::parse(text, &request, asked, format));
        let finished = Finished {
            reason: finish,
            text: last.content,
            reasoning: last.reasoning,
            usage,
            tool_calls: tool_calls.unwrap_or_default(),
            stop_string: output.stop_string().map(String::from),
            stop_token_id: output.stop_token(),
        };
        self.send(out, Event::Finished(Box::new(finished))).await
    }

    /// Sends one stream message (`offer`, then where the stream is full `wait_to_send`). A
    /// request asked to give its room up while the send waits for a caller that stopped
    /// reading gives it up then, not once the caller reads again: it could not use the room
    /// meanwhile, and nobody else is asked while it is.
    async fn send(&mut self, out: &Out, event: Event) -> Result<(), Abort> {
        let Some(event) = offer(out, event)? else {
            return Ok(());
        };
        let stall = Stall {
            timeout: self.ctx.stall_timeout,
            stopping: self.ctx.stopping.clone(),
            metrics: self.ctx.metrics.clone(),
        };
        let sending = wait_to_send(&stall, out, event);
        tokio::pin!(sending);
        loop {
            tokio::select! {
                biased;
                sent = &mut sending => return sent,
                () = self.holding.wait_until_asked() => self.give_room_up().await,
            }
        }
    }

    /// Both workers' caches keep the committed sequence once the sessions close: routing
    /// sends later prompts sharing it there.
    fn hold_prefix(&self) {
        let draft = self.draft.session().map(|d| &**d);
        let sessions: Vec<_> = std::iter::once(&self.target).chain(draft).collect();
        (self.ctx.workers).hold_prefix(&sessions, &self.seq, self.req.cache_salt);
    }

    /// One round: choose the proposer and K, draft, verify (failing over a lost target
    /// replica), reconcile and commit. Returns the committed tokens (1 to K + 1) and, where
    /// the request asks for them, their figures.
    async fn round(&mut self, out: &Out, remaining: usize) -> Result<Committed, Abort> {
        let mut started = tokio::time::Instant::now();
        self.take_opened_draft();
        if let Some(c) = &mut self.controller {
            c.observe_running(usize::try_from(self.ctx.metrics.running.get()).unwrap_or(0));
        }
        let limit = self.req.k.min(remaining.saturating_sub(1));
        let lookup = self.lookup(limit);
        let ready = self.ready.take().filter(|_| limit > 0);
        let plan = match &ready {
            // Drafted while the last round was verified: they cost nothing more now.
            Some(r) => Plan::exactly(Proposer::DraftModel, r.tokens.len().min(limit)),
            None => {
                let choice = self.choose(out, limit, remaining, lookup.as_ref()).await?;
                // A wait for the draft's prefill is learnt apart, per prompt token, not as
                // this round's overhead: counted here, it would make every draft-model
                // round look a prefill dearer.
                started = choice.waited.unwrap_or(started);
                choice.plan
            }
        };
        let drafted_ahead = ready.is_some();
        self.end_stream_if_drafting(&plan);
        let drafted = self.make_drafts(out, plan, ready, lookup.as_ref()).await?;
        let appended = self.seq.len() - self.synced.target - self.synced.target_held;
        let mut tree = self.tree(drafted.as_ref(), remaining);
        let (mut verified, ahead) = self
            .verify_round(out, &drafted, &mut tree, remaining)
            .await?;
        if verified.give_way {
            // Another coordinator's request waits for the room: given up next round.
            self.holding.ask();
        }
        if let Some(pass) = verified.pass.take() {
            return Ok(self.commit_pass(started, appended, pass, verified));
        }
        let outcome = self.reconcile(drafted.as_ref().map(|d| &d.proposal), &tree, &verified)?;
        let (committed, own_rows) = (outcome.committed(&tree), appended + tree.drafts.len());
        let logprobs = match self.req.logprobs {
            // The answer was checked to carry a row's figures for each committed token.
            Some(_) => outcome
                .rows()
                .map(|r| verified.logprobs[r].clone())
                .collect(),
            None => Vec::new(),
        };
        self.commit(Round {
            started,
            lookup,
            drafted,
            drafted_ahead,
            own_rows,
            streamed: self.decoding.is_some(),
            verified,
            ahead,
            accepted: outcome.accepted,
            alternatives: tree.alternatives(),
            took_alternative: outcome.alternative.is_some(),
            committed: &committed,
        });
        Ok((committed, logprobs))
    }

    /// What the target verifies of a round's drafts: the chain and the alternatives beside
    /// it (as many as the session has room for after the committed tokens), and for a
    /// sampling request what it tests the chain with. A sampling request that asks for
    /// log-probabilities sends its chain alone and each q whole: the target then draws every
    /// token it commits, and answers each one's figures. A request with penalties,
    /// `min_tokens` or a structured output sends chains alone too (a position's counts and
    /// constraint read the drafts before it, in order).
    fn tree(&self, drafted: Option<&Drafted>, remaining: usize) -> Tree {
        let sampling = !self.req.sampling.is_greedy();
        let all_drawn_there = sampling && self.req.logprobs.is_some();
        let chain_only = all_drawn_there || self.req.reads_completion();
        let mut tree = match drafted {
            Some(d) if chain_only => Tree::chain(&d.proposal.tokens),
            Some(d) => Tree::of(&d.proposal.tokens, &d.proposal.alternatives, remaining),
            None => Tree::default(),
        };
        if sampling {
            let (tokens, q) =
                drafted.map_or((&[][..], &[][..]), |d| (&d.proposal.tokens, &d.proposal.q));
            let point_masses = drafted.is_some_and(|d| d.proposer == Proposer::Ngram);
            tree.drawn = Some(match all_drawn_there {
                true => Drawn::all_on_the_target(tokens, q, point_masses),
                false => Drawn::of(tokens, q, point_masses, self.ctx.models.vocab),
            });
        }
        tree
    }

    /// The round's plan. A draft model that is worth its prefill but has no session yet
    /// opens one for the rounds to come. On shared cores (no `concurrent_prefill`) its
    /// prefill would slow the target's steps meanwhile as much as running it alone: the
    /// request waits for it, unless other generations run and `take_turns` keeps the
    /// passes apart; then its target-only steps join the target's turns between the
    /// draft's, instead of every stream waiting for its draft session.
    async fn choose(
        &mut self,
        out: &Out,
        limit: usize,
        remaining: usize,
        lookup: Option<&Lookup>,
    ) -> Result<Choice, Abort> {
        let plan = self.plan(limit, remaining, lookup);
        if plan.proposer != Proposer::DraftModel || self.draft.session().is_some() {
            return Ok(Choice { plan, waited: None });
        }
        // Before any wait for the draft: its prefill waits for the target's turn, which a
        // stream holds on a shared device.
        self.end_stream_if_drafting(&plan);
        self.open_draft_later();
        let others = self.ctx.metrics.running.get() > 1;
        let apart = self.ctx.speculation.take_turns && others;
        let mut waited = None;
        if !self.ctx.speculation.concurrent_prefill && !apart {
            self.wait_opened_draft(out).await?;
            waited = Some(tokio::time::Instant::now());
        }
        let plan = self.plan(limit, remaining, lookup);
        Ok(Choice { plan, waited })
    }

    /// The round's drafts by the plan's proposer: those drafted ahead during the last
    /// round, a Propose call, prompt lookup's match, or none (a target-only step).
    async fn make_drafts(
        &mut self,
        out: &Out,
        plan: Plan,
        ready: Option<Proposal>,
        lookup: Option<&Lookup>,
    ) -> Result<Option<Drafted>, Abort> {
        Ok(match (ready, plan.proposer) {
            (Some(mut r), _) => {
                self.stats.ahead_used += 1;
                r.tokens.truncate(plan.k);
                r.q.truncate(plan.k);
                Some(Drafted {
                    proposer: Proposer::DraftModel,
                    proposal: r,
                })
            }
            (None, Proposer::DraftModel) => self.propose(out, plan).await?,
            (None, Proposer::Ngram) => lookup.map(|l| self.lookup_proposal(l, plan.k)),
            (None, Proposer::None) => None,
        })
    }

    /// The target's verdict on the drafts; beside it, where it pays, the draft model
    /// drafts on from them (the next round's drafts, made ahead).
    async fn verify_round(
        &mut self,
        out: &Out,
        drafted: &Option<Drafted>,
        tree: &mut Tree,
        remaining: usize,
    ) -> Result<(Verified, Option<Ahead>), Abort> {
        let drafts = drafted.as_ref().map_or(&[][..], |d| &d.proposal.tokens);
        let ahead = match drafted.as_ref().map(|d| d.proposer) {
            Some(Proposer::DraftModel) => self.ahead_k(drafts.len(), remaining),
            _ => None,
        };
        let Some((session, k)) = ahead else {
            let stream = (drafted.is_none() && self.streams()).then_some(remaining);
            return Ok((self.verify(out, tree, stream).await?, None));
        };
        let call = self.draft_ahead(out, session, drafts, k);
        let (verified, answer) = self.verify_beside(out, tree, call).await?;
        Ok((verified, Some(Ahead { k, answer })))
    }

    /// Commits a reconciled round: how far each cache now holds the sequence, what the
    /// round teaches (metrics, trace, the controller), and the drafts made ahead kept for
    /// the next round where the target's token was the guess they started from.
    fn commit(&mut self, r: Round<'_>) {
        let k = r.drafts().len();
        // The draft fed its tokens but the last one; all of them if it drafted ahead (a call
        // made ahead that was dropped may not have fed the last one yet).
        let draft_fed = match &r.ahead {
            Some(Ahead {
                answer: Some(Ok(_)),
                ..
            }) => k,
            _ => k.saturating_sub(1),
        };
        let used = r.proposer();
        self.target_only_streak = match used {
            Proposer::None => self.target_only_streak + 1,
            _ => 0,
        };
        self.report_round(&r, draft_fed);
        let before = self.seq.len();
        self.synced.target = before + r.accepted;
        self.synced.target_held = usize::from(r.took_alternative);
        // Drafts verified and accepted, alternatives included.
        let took = usize::from(r.took_alternative);
        let (verified, accepted) = (k + r.alternatives, r.accepted + took);
        self.ctx.metrics.round(used.name(), verified, accepted);
        self.stats.count(used, verified, accepted);
        if r.alternatives > 0 {
            let m = &self.ctx.metrics;
            m.tree_alternatives.inc_by(r.alternatives as u64);
            m.tree_alternatives_accepted.inc_by(took as u64);
        }
        if used == Proposer::DraftModel {
            self.synced.draft = before + r.accepted.min(draft_fed);
        }
        if r.drafted_ahead {
            self.ctx.metrics.drafted_ahead_used.inc();
        }
        if r.streamed && used == Proposer::None {
            self.ctx.metrics.target_streamed_tokens.inc();
        }
        if let Some(ahead) = r.ahead {
            let all_accepted = r.accepted == k;
            let last = r.committed[r.committed.len() - 1];
            self.take_ahead(ahead, all_accepted.then_some(last));
        }
    }
}
