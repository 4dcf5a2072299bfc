//! The adaptive controller behind AUTO: before each round it picks who proposes (the draft
//! model, prompt lookup, or nobody) and how many tokens (K, 0 included), to get the most
//! committed tokens per unit of time (for a request that named its proposer but no K, only
//! that proposer's K, at least 1: [`Controller::plan_for`]), from
//! - how well each proposer has done for this request: the chance its first draft token is
//!   accepted, and the chance each next one is given the one before was (two Beta
//!   estimates that forget old rounds, started from what the proposer does for all
//!   requests); prompt lookup is judged separately by how long its match is, and is
//!   scored on every round, used or not, by comparing its proposal with what was committed;
//! - what a round costs: the target's pass time as a function of its token rows (measured
//!   at each row count of the Verify passes: [`PassTime`]), the draft-worker's time per
//!   draft token, and the coordinator's and network's time per round;
//! - with drafting ahead on (`overlap_drafting`), how much a target pass slows while the
//!   draft drafts beside it: nothing on separate devices, much on shared cores. Drafting
//!   ahead is chosen only where the draft time it saves beats that, and the draft model's
//!   drafting is then counted only on the rounds whose drafts were not made ahead;
//! - what the other sessions in the target's passes do: their rows, their committed tokens
//!   and their draft work. A round's value is the tokens all of them commit over the time
//!   the pass and the drafting take, so a row is worth verifying only when the chance it
//!   commits a token beats what that row's time would earn the whole batch. Alone on the
//!   target, that is the request's own tokens per second; in a batch of eight on a CPU,
//!   where a verified row costs about as much as a decoded one, only near-certain drafts
//!   pay.

use std::sync::Mutex;

mod pass;
pub use pass::PassTime;
use pass::PassTimes;

/// Who proposes a round's draft tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Proposer {
    DraftModel,
    Ngram,
    /// A target-only step.
    None,
}

impl Proposer {
    pub fn name(self) -> &'static str {
        match self {
            Self::DraftModel => "draft_model",
            Self::Ngram => "ngram",
            Self::None => "none",
        }
    }
}

/// What one round does.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Plan {
    pub proposer: Proposer,
    /// Draft tokens: exactly, or at most where the draft model may stop early.
    pub k: usize,
    /// The draft model stops drafting after the token that brings the product of its
    /// drafts' probabilities below this (0: exactly `k`; `ProposeRequest.stop_below`).
    pub stop_below: f32,
}

impl Plan {
    pub const TARGET_ONLY: Plan = Plan::exactly(Proposer::None, 0);

    /// `k` tokens by `proposer`, none fewer.
    pub const fn exactly(proposer: Proposer, k: usize) -> Plan {
        Plan {
            proposer,
            k,
            stop_below: 0.0,
        }
    }
}

/// Hits over trials that forget: each observation first scales the old counts by `keep`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Rate {
    hits: f64,
    trials: f64,
}

impl Rate {
    fn add(&mut self, hits: f64, trials: f64, keep: f64) {
        self.hits = self.hits * keep + hits;
        self.trials = self.trials * keep + trials;
    }

    /// The posterior mean with `prior` counted as `weight` trials.
    fn mean(&self, prior: f64, weight: f64) -> f64 {
        (self.hits + prior * weight) / (self.trials + weight)
    }

    /// [`Rate::mean`] less [`SURE_Z`] standard deviations of the posterior (a Beta of
    /// `trials + weight` observations), at least 0: what the evidence makes fairly sure.
    fn lower(&self, prior: f64, weight: f64) -> f64 {
        let mean = self.mean(prior, weight);
        let n = self.trials + weight;
        (mean - SURE_Z * (mean * (1.0 - mean) / (n + 1.0)).sqrt()).max(0.0)
    }
}

/// Standard deviations below the estimated acceptance at which a round must still beat a
/// target-only step before it speculates ([`Controller::plan`]).
const SURE_Z: f64 = 1.0;

/// How a proposer's drafts fare: the first token, and each next one given the one before.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Acceptance {
    first: Rate,
    next: Rate,
}

/// Acceptance as two probabilities.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Odds {
    pub first: f64,
    pub next: f64,
}

impl Odds {
    /// Expected tokens a round commits with `k` drafts: the target's own token plus each
    /// draft token's chance of being reached and accepted.
    pub fn expected_tokens(&self, k: usize) -> f64 {
        let mut total = 1.0;
        let mut reach = self.first;
        for _ in 0..k {
            total += reach;
            reach *= self.next;
        }
        total
    }
}

/// Per-request memory: about the last 12 rounds' worth.
const KEEP: f64 = 0.92;
/// How much the all-requests prior weighs against a request's own rounds, in rounds.
const PRIOR_WEIGHT: f64 = 3.0;

impl Acceptance {
    /// `accepted` of `proposed` drafts (the leading ones) were accepted.
    pub fn observe(&mut self, proposed: usize, accepted: usize, keep: f64) {
        if proposed == 0 {
            return;
        }
        let accepted = accepted.min(proposed);
        self.first.add((accepted > 0) as u8 as f64, 1.0, keep);
        // Positions 2..=proposed were reached when the one before was accepted.
        let reached = accepted.min(proposed - 1);
        self.next
            .add(accepted.saturating_sub(1) as f64, reached as f64, keep);
    }

    /// Old evidence weighs less, without a new observation.
    fn fade(&mut self, keep: f64) {
        for rate in [&mut self.first, &mut self.next] {
            rate.hits *= keep;
            rate.trials *= keep;
        }
    }

    /// This request's estimate, starting from `prior`.
    pub fn odds(&self, prior: Odds) -> Odds {
        Odds {
            first: self.first.mean(prior.first, PRIOR_WEIGHT),
            next: self.next.mean(prior.next, PRIOR_WEIGHT),
        }
    }

    /// This request's odds that it is fairly sure of: [`Acceptance::odds`] less
    /// [`SURE_Z`] standard deviations, wide while the request has few rounds of its own.
    fn sure_odds(&self, prior: Odds) -> Odds {
        Odds {
            first: self.first.lower(prior.first, PRIOR_WEIGHT),
            next: self.next.lower(prior.next, PRIOR_WEIGHT),
        }
    }
}

/// Prompt-lookup matches by length: 1-2, 3-5, 6 or more tokens.
pub fn ngram_bucket(matched: usize) -> usize {
    match matched {
        0..=2 => 0,
        3..=5 => 1,
        _ => 2,
    }
}

const NGRAM_BUCKETS: usize = 3;

/// Exponentially weighted mean.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Mean {
    value: f64,
    weight: f64,
}

impl Mean {
    fn add(&mut self, x: f64, keep: f64) {
        self.add_total(x, 1.0, keep);
    }

    /// Adds `weight` observations that sum to `total` (a call's time over its tokens).
    fn add_total(&mut self, total: f64, weight: f64, keep: f64) {
        self.value = self.value * keep + total;
        self.weight = self.weight * keep + weight;
    }

    fn get(&self) -> Option<f64> {
        (self.weight > 1e-9).then(|| self.value / self.weight)
    }

    /// The mean with `prior` counted as `weight` observations: a single odd measurement
    /// (a slow first call) moves it only part of the way.
    fn toward(&self, prior: f64, weight: f64) -> f64 {
        (self.value + prior * weight) / (self.weight + weight)
    }

    /// Old observations weigh less, without a new one.
    fn fade(&mut self, keep: f64) {
        self.value *= keep;
        self.weight *= keep;
    }
}

/// What every request of a coordinator learns together: the proposers' typical acceptance
/// (each request's prior) and the costs.
#[derive(Debug, Default)]
pub struct Shared {
    state: Mutex<SharedState>,
}

#[derive(Debug, Default, Clone)]
struct SharedState {
    draft: Acceptance,
    ngram: [Acceptance; NGRAM_BUCKETS],
    /// The target's passes by row count, and the pass time read off them as of the latest
    /// pass (not each time a request plans a round).
    passes: PassTimes,
    pass_time: Option<PassTime>,
    /// Draft-worker time per draft token (its share of batched passes).
    draft_per_token: Mean,
    /// Draft-worker time per prompt token of a session's prefill.
    draft_prefill_per_row: Mean,
    /// How much slower a target pass ran, relative to `pass_time`, beside a Propose made
    /// ahead; and that Propose's time per draft token.
    ahead_slowdown: Mean,
    draft_ahead_per_token: Mean,
    /// Coordinator and network time per round, with and without a draft-worker call.
    overhead_draft: Mean,
    overhead_plain: Mean,
    /// Over all rounds of all requests.
    tokens_per_round: Mean,
    draft_ms_per_round: Mean,
}

/// Memory of the all-requests figures: about the last 50 observations.
const SHARED_KEEP: f64 = 0.98;

/// What all requests learnt of the draft model fades this much with each round of any
/// request that did not use it (toward the optimistic prior): otherwise a draft model that
/// its first round or two made look poor would never be opened again, and so never measured
/// again, for the coordinator's whole life. A verdict from one round is retried within a
/// request or two; one from fifty (a draft model that really does not pay) after several.
const DRAFT_UNUSED_KEEP: f64 = 0.995;

/// What the draft model costs (per draft token, per prefilled prompt token) fades ten times
/// slower: it is the hardware's and the load's, which do not change with the text, where
/// acceptance does. Faded as fast as acceptance, the cost of a draft model left unused
/// through a few requests that copy their prompts (code edits, where lookup serves) was back
/// at the guess, about two thirds of the measured cost on the reference machine, and the next
/// requests opened the draft session on that belief and paid its prefill for little. A cost
/// set by one slow call (it weighs as little as the guess) is still back near the guess
/// within a few thousand rounds.
const DRAFT_COST_UNUSED_KEEP: f64 = 0.9995;

/// How much the guessed draft costs weigh: as a call of four tokens (per draft token) and
/// as one session's prefill (per prompt token).
const DRAFT_COST_PRIOR_WEIGHT: f64 = 4.0;
const DRAFT_PREFILL_PRIOR_WEIGHT: f64 = 1.0;

impl SharedState {
    /// A pass of `rows` rows in `ms` that `calls` requests report, each with its share.
    fn observe_pass(&mut self, rows: usize, ms: f64, calls: usize) {
        let weight = 1.0 / calls.max(1) as f64;
        self.passes.observe(rows, ms, SHARED_KEEP, weight);
        self.pass_time = self.passes.time();
    }
}

/// The slowdown beside a Propose made ahead starts at none (separate devices), counted as
/// a quarter of a pass: the first pass measured outweighs it (on shared cores a round
/// drafted ahead can take several times as long). Declined chances to draft ahead fade what
/// was measured back toward it, so a slowdown that made drafting ahead not pay is measured
/// again some rounds later (the load on the workers changes) instead of never.
const AHEAD_PRIOR_WEIGHT: f64 = 0.25;

/// Under the first observations. The draft model is assumed good (a draft model is paired
/// with its target because it predicts it well): requests then try it and its estimate
/// comes from measurement, where a modest guess on a CPU, on which drafting costs much,
/// would never be put to the test; a few bad rounds outweigh it. Prompt lookup's rises
/// with the match length (it is scored every round anyway).
const DRAFT_PRIOR: Odds = Odds {
    first: 0.9,
    next: 0.9,
};
const NGRAM_PRIOR: [Odds; NGRAM_BUCKETS] = [
    Odds {
        first: 0.3,
        next: 0.5,
    },
    Odds {
        first: 0.5,
        next: 0.7,
    },
    Odds {
        first: 0.7,
        next: 0.85,
    },
];

/// What one finished round tells the shared estimates.
#[derive(Debug, Clone, Copy, Default)]
pub struct RoundCosts {
    /// The target pass: its calls (this request's included), total rows and time.
    pub pass_calls: usize,
    pub pass_rows: usize,
    pub pass_ms: f64,
    /// This round's draft-worker share (0 without a draft-worker call), and its K.
    pub draft_ms: f64,
    pub draft_tokens: usize,
    /// Round wall time not spent in the workers (coordinator, network).
    pub overhead_ms: f64,
    pub committed: usize,
    /// A Propose made ahead ran beside the pass: its draft-worker time and tokens (0 and 0
    /// when it failed). Such a pass measures the slowdown, not the pass time.
    pub beside_ahead: Option<(f64, usize)>,
}

/// A snapshot of the shared estimates for one decision.
#[derive(Debug, Clone)]
pub struct Costs {
    /// The target's pass time by its rows.
    pub pass: PassTime,
    pub draft_per_token: f64,
    pub draft_prefill_per_row: f64,
    /// A target pass beside a Propose made ahead takes `1 + ahead_slowdown` times as long.
    pub ahead_slowdown: f64,
    pub draft_ahead_per_token: f64,
    pub overhead_draft: f64,
    pub overhead_plain: f64,
    pub tokens_per_round: f64,
    pub draft_ms_per_round: f64,
    /// Some request has measured the draft model.
    pub draft_tried: bool,
    pub draft_prior: Odds,
    pub ngram_prior: [Odds; NGRAM_BUCKETS],
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, SharedState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The estimates now, or `None` before the first target pass was seen.
    pub fn costs(&self) -> Option<Costs> {
        let s = self.lock();
        let pass = s.pass_time.clone()?;
        // The draft's costs start from a guess (a third of a one-row target pass per token;
        // a prompt token an eighth of that) that weighs as a call or a prefill, so one slow
        // call does not set them alone, and drift back to it, slowly, while no round uses
        // the draft model (`round_without_draft`).
        let draft_per_token = s
            .draft_per_token
            .toward(pass.ms(1.0) / 3.0, DRAFT_COST_PRIOR_WEIGHT);
        Some(Costs {
            pass,
            draft_per_token,
            draft_prefill_per_row: s
                .draft_prefill_per_row
                .toward(draft_per_token / 8.0, DRAFT_PREFILL_PRIOR_WEIGHT),
            ahead_slowdown: (s.ahead_slowdown.value
                / (s.ahead_slowdown.weight + AHEAD_PRIOR_WEIGHT))
                .max(0.0),
            draft_ahead_per_token: s.draft_ahead_per_token.get().unwrap_or(draft_per_token),
            overhead_draft: s.overhead_draft.get().unwrap_or(1.0),
            overhead_plain: s.overhead_plain.get().unwrap_or(0.5),
            tokens_per_round: s.tokens_per_round.get().unwrap_or(1.0),
            draft_ms_per_round: s.draft_ms_per_round.get().unwrap_or(0.0),
            draft_tried: s.draft.first.trials > 0.0,
            draft_prior: s.draft.odds(DRAFT_PRIOR),
            ngram_prior: std::array::from_fn(|i| s.ngram[i].odds(NGRAM_PRIOR[i])),
        })
    }

    /// Learns from a finished round of any request.
    pub fn observe_round(&self, r: &RoundCosts) {
        let mut s = self.lock();
        match r.beside_ahead {
            _ if r.pass_rows == 0 => {}
            None => s.observe_pass(r.pass_rows, r.pass_ms, r.pass_calls),
            Some((ahead_ms, ahead_tokens)) => {
                let alone = s.pass_time.as_ref().map(|p| p.ms(r.pass_rows as f64));
                if let Some(alone) = alone
                    && alone > 0.0
                {
                    let slowdown = r.pass_ms / alone - 1.0;
                    s.ahead_slowdown.add(slowdown, SHARED_KEEP);
                }
                if ahead_tokens > 0 {
                    s.draft_ahead_per_token
                        .add(ahead_ms / ahead_tokens as f64, SHARED_KEEP);
                }
            }
        }
        if r.draft_tokens > 0 {
            // Weighed by tokens: calls that stopped early after a token or two weigh less.
            s.draft_per_token
                .add_total(r.draft_ms, r.draft_tokens as f64, SHARED_KEEP);
            s.overhead_draft.add(r.overhead_ms.max(0.0), SHARED_KEEP);
        } else {
            s.overhead_plain.add(r.overhead_ms.max(0.0), SHARED_KEEP);
        }
        s.tokens_per_round.add(r.committed as f64, SHARED_KEEP);
        s.draft_ms_per_round.add(r.draft_ms, SHARED_KEEP);
    }

    /// A round of some request went by without the draft model: what all requests learnt
    /// of it fades toward the prior, its acceptance (`DRAFT_UNUSED_KEEP`) faster than its
    /// costs (`DRAFT_COST_UNUSED_KEEP`).
    pub fn round_without_draft(&self) {
        let mut s = self.lock();
        s.draft.fade(DRAFT_UNUSED_KEEP);
        s.draft_per_token.fade(DRAFT_COST_UNUSED_KEEP);
        s.draft_prefill_per_row.fade(DRAFT_COST_UNUSED_KEEP);
    }

    /// A request could have drafted ahead and did not: the slowdown measured fades toward
    /// none.
    pub fn ahead_declined(&self) {
        let mut s = self.lock();
        s.ahead_slowdown.value *= SHARED_KEEP;
        s.ahead_slowdown.weight *= SHARED_KEEP;
    }

    /// Learns from a draft session's prefill of `rows` prompt tokens.
    pub fn observe_draft_prefill(&self, rows: usize, took: std::time::Duration) {
        if rows > 0 {
            let ms = took.as_secs_f64() * 1e3 / rows as f64;
            self.lock().draft_prefill_per_row.add(ms, SHARED_KEEP);
        }
    }

    /// Learns how a proposer's drafts fared (the priors of later requests).
    pub fn observe_acceptance(&self, source: Source, proposed: usize, accepted: usize) {
        let mut s = self.lock();
        let a = match source {
            Source::DraftModel => &mut s.draft,
            Source::Ngram(bucket) => &mut s.ngram[bucket],
        };
        a.observe(proposed, accepted, SHARED_KEEP);
    }
}

/// A proposer whose acceptance is tracked: the draft model, or prompt lookup by match length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    DraftModel,
    Ngram(usize),
}

/// What this round could do.
#[derive(Debug, Clone, Copy, Default)]
pub struct Options {
    /// Draft tokens at most this round (the completion's room, the request's K).
    pub limit: usize,
    /// Completion tokens still to come.
    pub remaining: usize,
    /// The draft model is usable.
    pub draft: Option<DraftOption>,
    /// Prompt lookup found a match of this many tokens: its length, and its K at most.
    pub ngram: Option<(usize, usize)>,
    /// Whether and how the draft model drafts ahead beside Verify (`overlap_drafting`).
    pub overlap: Overlap,
    /// The draft model may stop a round's drafting where its confidence runs low
    /// (`speculation.adaptive.stop_early`): `k` is then the most it drafts.
    pub stop_early: bool,
}

/// Drafting ahead beside Verify (`speculation.overlap_drafting`), as a request's rounds do it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Overlap {
    /// No drafting ahead.
    #[default]
    Off,
    /// A round waits for the call made ahead whatever its verdict (sampling requests).
    Waited,
    /// A round that rejects a draft drops the call made ahead (greedy requests).
    Dropped,
}

/// The draft model, as this round could use it.
#[derive(Debug, Clone, Copy, Default)]
pub struct DraftOption {
    /// Its K at most.
    pub max_k: usize,
    /// Committed tokens its cache would first take in (the prompt, before its session is
    /// open): a prefill whose cost is spread over the tokens still to come that the draft
    /// model would serve.
    pub catch_up: usize,
    /// Its session is not open yet: choosing it opens the session (and pays `catch_up` as
    /// a prefill at once).
    pub opening: bool,
}

/// What drafting ahead beside a round is worth.
#[derive(Debug, Clone, Copy)]
struct Ahead {
    /// The chance the next round finds its drafts ready.
    hit: f64,
    /// The drafting that round then skips, ms.
    saved: f64,
    /// What it adds to this round, ms.
    extra: f64,
}

impl Ahead {
    fn pays(&self) -> bool {
        self.hit * self.saved > self.extra
    }
}

/// One request's controller.
#[derive(Debug, Default)]
pub struct Controller {
    draft: Acceptance,
    ngram: [Acceptance; NGRAM_BUCKETS],
    /// The other sessions' calls and rows in the target passes this request ran in.
    other_calls: Mean,
    other_rows: Mean,
    /// Other generations running on this coordinator now (`observe_running`).
    peers: usize,
    /// This request's committed tokens that prompt lookup proposed, or would have
    /// (`observe_copied`), over its committed tokens: about the last 12 rounds.
    copied: Mean,
}

/// How much more tokens per unit of time the draft model must promise than the best plan
/// without it before a request opens its draft session.
const OPEN_MARGIN: f64 = 1.15;

/// Memory of the batch around a request: about the last 5 passes.
const BATCH_KEEP: f64 = 0.8;

/// Before a request has committed tokens, lookup is taken to copy half of its text (whether
/// an answer copies its prompt is not known before it starts), a guess that weighs as this
/// many tokens: a draft session is opened at once only where it would pay even then, and
/// otherwise once the first rounds show the text is not copied.
const COPIED_PRIOR: f64 = 0.5;
const COPIED_PRIOR_WEIGHT: f64 = 4.0;
/// The most of the text still to come that lookup is taken to copy.
const MAX_COPIED: f64 = 0.9;

impl Controller {
    /// The plan with the most committed tokens per unit of time; in a batch, among those
    /// that would beat a target-only step even at the acceptance this request is fairly
    /// sure of ([`SURE_Z`] standard deviations below its estimate). Where a drafted row costs
    /// about what it earns (a batch of streams on a CPU, where a row costs about what a
    /// decoded token does) a slightly high estimate makes speculation lose, and the winner
    /// among noisy estimates is the one most likely to be high: there only drafts the
    /// evidence vouches for are made. A request whose passes are its own is not gated: its
    /// rows cost little, and the draft model, whose time is what such a round risks, would
    /// otherwise be shut out of the requests it speeds up, by the spread the all-requests
    /// estimate carries before a request has rounds of its own, or by one unlucky round
    /// (docs/benchmarks.md, "AUTO alone plans on its estimates").
    pub fn plan(&self, costs: &Costs, options: &Options) -> Plan {
        let floor = self.value(costs, None, 0, options.overlap);
        let gate = self.in_a_batch().then_some(floor);
        let mut best = (floor, Plan::TARGET_ONLY);
        if let Some(x) = self.ngram_round(costs, options, gate)
            && x.0 > best.0
        {
            best = x;
        }
        if let Some(d) = options.draft {
            // Before its session is open the draft's acceptance for this request is only the
            // all-requests estimate, and opening is paid at once and for good: the draft
            // model must promise a clear gain first (unless no request has measured it yet).
            let margin = if d.opening && costs.draft_tried {
                OPEN_MARGIN
            } else {
                1.0
            };
            if let Some(x) = self.draft_round(costs, options, d, gate)
                && x.0 > best.0 * margin
            {
                best = x;
            }
        }
        // The inputs behind the draft model's part in the choice (built only when debug
        // logging is on): its estimate, what the gate, where it applies, judges it at, and,
        // where the request may draft ahead, what drafting ahead beside a draft-model round
        // of the chosen K (or 1) is worth and the measured costs that went into it.
        tracing::debug!(
            plan = ?best.1,
            floor,
            gated = gate.is_some(),
            draft_odds = ?options.draft.map(|_| self.draft.odds(costs.draft_prior)),
            draft_sure_odds = ?options.draft.map(|_| self.draft.sure_odds(costs.draft_prior)),
            ahead = ?(options.draft.is_some() && options.overlap != Overlap::Off).then(|| {
                let odds = self.draft.odds(costs.draft_prior);
                self.ahead(costs, odds, best.1.k.max(1), options.overlap)
            }),
            ahead_slowdown = costs.ahead_slowdown,
            draft_ahead_ms_per_token = costs.draft_ahead_per_token,
            "auto plan"
        );
        best.1
    }

    /// The best round by `proposer` alone, for a request that named its method and left K
    /// to the server: as many draft tokens as pay best, and at least one, even where a
    /// target-only step would pay more (the request asked for that proposer). A target-only
    /// step only where the proposer has nothing to offer (no match, no draft session).
    pub fn plan_for(&self, proposer: Proposer, costs: &Costs, options: &Options) -> Plan {
        let round = match proposer {
            Proposer::DraftModel => options
                .draft
                .and_then(|d| self.draft_round(costs, options, d, None)),
            Proposer::Ngram => self.ngram_round(costs, options, None),
            Proposer::None => None,
        };
        round.map_or(Plan::TARGET_ONLY, |(_, plan)| plan)
    }

    /// Prompt lookup's best round where it has a match: its value and plan (with a
    /// `floor`, among the K that beat it at the odds this request is sure of).
    fn ngram_round(
        &self,
        costs: &Costs,
        options: &Options,
        floor: Option<f64>,
    ) -> Option<(f64, Plan)> {
        let (matched, max_k) = options.ngram?;
        let b = ngram_bucket(matched);
        let acceptance = &self.ngram[b];
        let odds = acceptance.odds(costs.ngram_prior[b]);
        let sure = floor.map(|floor| (acceptance.sure_odds(costs.ngram_prior[b]), floor));
        self.best_k(costs, options, (odds, Proposer::Ngram, 0.0), sure, max_k)
    }

    /// The draft model's best round: its value and plan (with a `floor`, as for
    /// [`Controller::ngram_round`]), which stops early where the draft runs unsure
    /// (`Options::stop_early`).
    fn draft_round(
        &self,
        costs: &Costs,
        options: &Options,
        d: DraftOption,
        floor: Option<f64>,
    ) -> Option<(f64, Plan)> {
        let odds = self.draft.odds(costs.draft_prior);
        let sure = floor.map(|floor| (self.draft.sure_odds(costs.draft_prior), floor));
        // The catch-up prefill, shared by the tokens left that the draft model would
        // commit: ms per token. Where lookup copies the text (edits of a given code), the
        // draft model earns only the rest, so its prefill weighs the more on each token.
        let serves = options.remaining as f64 * (1.0 - self.copied_share());
        let catch_up = d.catch_up as f64 * costs.draft_prefill_per_row / serves.max(1.0);
        let (value, mut plan) = self.best_k(
            costs,
            options,
            (odds, Proposer::DraftModel, catch_up),
            sure,
            d.max_k,
        )?;
        if options.stop_early {
            plan.stop_below = self.stop_below(costs, odds, value, plan.k, options.overlap);
        }
        Some((value, plan))
    }

    /// The K in `1..=max_k` (and the round's limit) with the most value for `proposer`;
    /// with `sure` odds and a floor, only among the K whose value at those odds beats it.
    fn best_k(
        &self,
        costs: &Costs,
        options: &Options,
        proposer: (Odds, Proposer, f64),
        sure: Option<(Odds, f64)>,
        max_k: usize,
    ) -> Option<(f64, Plan)> {
        let (_, who, catch_up) = proposer;
        (1..=max_k.min(options.limit))
            .filter(|&k| {
                sure.is_none_or(|(odds, floor)| {
                    self.value(costs, Some((odds, who, catch_up)), k, options.overlap) > floor
                })
            })
            .map(|k| {
                let v = self.value(costs, Some(proposer), k, options.overlap);
                (v, Plan::exactly(proposer.1, k))
            })
            .fold(None, |best: Option<(f64, Plan)>, x| match best {
                Some(b) if b.0 >= x.0 => Some(b),
                _ => Some(x),
            })
    }

    /// Where a draft-model round of `k` tokens, worth `value` tokens per millisecond, stops
    /// drafting. After a draft token whose drafts so far the draft model believes all right
    /// with probability `sure`, one more token adds at most `sure` committed tokens and costs
    /// a draft step (what of it drafting ahead does not hide) and a verified row; it pays
    /// while that beats the round's own rate: `sure > value * ms`. The draft's probability
    /// stands in for acceptance: the model is paired with its target because it predicts it,
    /// and its sure tokens are accepted about as often as it says, its unsure ones much less
    /// (docs/benchmarks.md, "AUTO's draft-model rounds stop where the draft is unsure").
    /// Clamped to 1, where a round stops after its first token.
    fn stop_below(&self, costs: &Costs, odds: Odds, value: f64, k: usize, overlap: Overlap) -> f32 {
        let ahead = self.ahead(costs, odds, k, overlap);
        let drafting = match overlap != Overlap::Off && ahead.pays() {
            true => (1.0 - ahead.hit) * costs.draft_per_token,
            false => costs.draft_per_token,
        };
        let rows = self.others().1 + (k + 1) as f64;
        (value * (drafting + costs.pass.row_ms(rows))).clamp(0.0, 1.0) as f32
    }

    /// Tokens per millisecond of the whole batch for a round with `k` drafts by `proposer`;
    /// for the draft model, `catch_up` ms per token it is expected to commit come on top.
    /// Where the draft model would draft ahead, its drafting counts only on the rounds whose
    /// drafts were not made ahead (the rounds to come look like this one), plus what
    /// drafting ahead adds to each round.
    fn value(
        &self,
        c: &Costs,
        proposer: Option<(Odds, Proposer, f64)>,
        k: usize,
        overlap: Overlap,
    ) -> f64 {
        let (other_calls, other_rows) = self.others();
        let mine = proposer.map_or(1.0, |(odds, _, _)| odds.expected_tokens(k));
        let tokens = other_calls * c.tokens_per_round + mine;
        let rows = other_rows + (k + 1) as f64;
        let mut ms = c.pass.ms(rows) + other_calls * c.draft_ms_per_round;
        ms += match proposer {
            Some((odds, Proposer::DraftModel, catch_up)) => {
                let drafting = c.draft_per_token * k as f64 + c.overhead_draft;
                let ahead = self.ahead(c, odds, k, overlap);
                let drafting = match overlap != Overlap::Off && ahead.pays() {
                    true => (1.0 - ahead.hit) * drafting + ahead.extra,
                    false => drafting,
                };
                drafting + catch_up * mine
            }
            _ => c.overhead_plain,
        };
        tokens / ms
    }

    /// Drafting ahead beside a round of `k` draft-model drafts with acceptance `odds`.
    fn ahead(&self, c: &Costs, odds: Odds, k: usize, overlap: Overlap) -> Ahead {
        let (_, other_rows) = self.others();
        // The next round's drafts are ready when this round commits all `k` (`all`) and the
        // draft guessed the target's token after them: k + 1 positions in a row.
        let all = match k {
            0 => 0.0,
            _ => odds.first * odds.next.powi(k as i32 - 1),
        };
        let hit = all * odds.next;
        let pass = c.pass.ms(other_rows + (k + 1) as f64);
        let slowed = pass * (1.0 + c.ahead_slowdown);
        // The round ends when both the pass, slowed by the draft beside it, and the k + 1
        // tokens drafted ahead are done; where a rejection drops the call made ahead, only
        // the rounds that accept all k drafts wait for it, the others at most for the draft
        // step under way.
        let wait = (c.draft_ahead_per_token * (k + 1) as f64 - slowed).max(0.0);
        let wait = match overlap {
            Overlap::Dropped if k > 0 => {
                all * wait + (1.0 - all) * wait.min(c.draft_ahead_per_token)
            }
            _ => wait,
        };
        Ahead {
            hit,
            saved: c.draft_per_token * k as f64 + c.overhead_draft,
            extra: slowed - pass + wait,
        }
    }

    /// Whether the draft model should draft ahead beside a round of `k` draft-model drafts:
    /// the next round's `k` drafts are then ready when this round commits all `k` and the
    /// draft guessed the target's token after them, which saves that round's drafting. Every
    /// round pays what it adds, used or not: the pass slowed by the draft beside it (on
    /// shared cores; `Costs::ahead_slowdown`), or the wait for the `k + 1` tokens drafted
    /// ahead where the draft is slower than the pass (where a rejection drops the call,
    /// `Overlap::Dropped`, only on the rounds that accept all their drafts).
    pub fn draft_ahead(&self, costs: &Costs, k: usize, overlap: Overlap) -> bool {
        k > 0
            && self
                .ahead(costs, self.draft.odds(costs.draft_prior), k, overlap)
                .pays()
    }

    /// This request's drafts by `source`: `accepted` of `proposed`.
    pub fn observe(&mut self, source: Source, proposed: usize, accepted: usize) {
        match source {
            Source::DraftModel => self.draft.observe(proposed, accepted, KEEP),
            Source::Ngram(b) => self.ngram[b].observe(proposed, accepted, KEEP),
        }
    }

    /// A round went by without the draft model: what this request's drafts showed fades
    /// toward what all requests see, so a draft model that did badly for a stretch of text
    /// is tried again some rounds later instead of never.
    pub fn round_without_draft(&mut self) {
        self.draft.fade(KEEP);
    }

    /// The target pass this request's Verify ran in: `calls` calls and `rows` rows in all,
    /// of which `own_rows` its own.
    pub fn observe_batch(&mut self, calls: usize, rows: usize, own_rows: usize) {
        self.other_calls
            .add(calls.saturating_sub(1) as f64, BATCH_KEEP);
        self.other_rows
            .add(rows.saturating_sub(own_rows) as f64, BATCH_KEEP);
    }

    /// A round committed `committed` tokens, of which the first `copied` were prompt
    /// lookup's proposal at the round's start, used or not.
    pub fn observe_copied(&mut self, copied: usize, committed: usize) {
        self.copied.add_total(copied as f64, committed as f64, KEEP);
    }

    /// The share of the text to come that prompt lookup is expected to copy.
    fn copied_share(&self) -> f64 {
        self.copied
            .toward(COPIED_PRIOR, COPIED_PRIOR_WEIGHT)
            .clamp(0.0, MAX_COPIED)
    }

    /// `running` generations run on this coordinator now, this one included.
    pub fn observe_running(&mut self, running: usize) {
        self.peers = running.saturating_sub(1);
    }

    /// Whether this request shares its target passes: on average at least half a row of
    /// other sessions beside its own, or other generations running on this coordinator.
    fn in_a_batch(&self) -> bool {
        self.others().1 >= 0.5
    }

    /// Other sessions' calls and rows per target pass: at least a row of each other
    /// generation running on this coordinator, whatever this request's passes showed so far
    /// (a stream's first rounds can run alone while the others still prefill, and a draft
    /// session opened then, judged alone, is paid for in the batch that follows).
    fn others(&self) -> (f64, f64) {
        let peers = self.peers as f64;
        (
            self.other_calls.get().unwrap_or(0.0).max(peers),
            self.other_rows.get().unwrap_or(0.0).max(peers),
        )
    }
}

#[cfg(test)]
mod tests;
