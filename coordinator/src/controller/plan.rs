//! One request's controller: the plan of each round (who proposes, K, where the draft model
//! stops early), chosen for the most committed tokens per unit of time of the whole batch.

use super::estimate::{Acceptance, KEEP, Mean, NGRAM_BUCKETS, Odds, Seen};
use super::shared::{Costs, Source};
use crate::method::Proposer;

/// What one round does.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Plan {
    pub proposer: Proposer,
    /// Draft tokens: exactly, or at most where the draft model may stop early.
    pub k: usize,
    /// The draft model stops drafting after the token that brings the product of its
    /// drafts' probabilities below this (0: exactly `k`; `ProposeRequest.stop_below`).
    pub stop_below: f32,
    /// Other candidates are verified beside the draft model's chain where their probability
    /// times its drafts' before them reaches this (0: a chain;
    /// `ProposeRequest.alternatives_above`).
    pub alternatives_above: f32,
}

impl Plan {
    pub const TARGET_ONLY: Plan = Plan::exactly(Proposer::None, 0);

    /// `k` tokens by `proposer`, none fewer.
    pub const fn exactly(proposer: Proposer, k: usize) -> Plan {
        Plan {
            proposer,
            k,
            stop_below: 0.0,
            alternatives_above: 0.0,
        }
    }
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
    /// Prompt lookup (or the cache of earlier requests) found a match: its bucket
    /// (`ngram_bucket`), and its K at most.
    pub ngram: Option<(usize, usize)>,
    /// Whether and how the draft model drafts ahead beside Verify (`overlap_drafting`).
    pub overlap: Overlap,
    /// The draft model may stop a round's drafting where its confidence runs low
    /// (`speculation.adaptive.stop_early`): `k` is then the most it drafts.
    pub stop_early: bool,
    /// The draft model's rounds may verify a tree: its chain and other candidates beside it
    /// (`speculation.adaptive.tree_alternatives`, on a target-worker that verifies trees).
    pub trees: bool,
    /// The request's target-only steps come from a Decode stream that runs now
    /// (`speculation.target_streams`): a target-only step costs no round overhead, and a
    /// round that drafts ends the stream, whose step in flight runs in a pass before the
    /// round's and gives nothing (the round verifies from the same position).
    pub streaming: bool,
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
pub(super) struct Ahead {
    /// The chance the next round finds its drafts ready.
    pub(super) hit: f64,
    /// The drafting that round then skips, ms.
    pub(super) saved: f64,
    /// What it adds to this round, ms.
    pub(super) extra: f64,
}

impl Ahead {
    pub(super) fn pays(&self) -> bool {
        self.hit * self.saved > self.extra
    }
}

/// One request's controller.
#[derive(Debug, Default)]
pub struct Controller {
    pub(super) draft: Acceptance,
    pub(super) ngram: [Acceptance; NGRAM_BUCKETS],
    /// The other sessions' calls and rows in the target passes this request ran in.
    pub(super) other_calls: Mean,
    pub(super) other_rows: Mean,
    /// Other generations running on this coordinator now (`observe_running`).
    pub(super) peers: usize,
    /// This request's committed tokens that prompt lookup proposed, or would have
    /// (`observe_copied`), over its committed tokens: about the last 12 rounds.
    pub(super) copied: Mean,
    /// The share of its text lookup is expected to copy before its rounds tell
    /// ([`Controller::expecting_copied`]; `None`: [`COPIED_PRIOR`]).
    pub(super) copied_prior: Option<f64>,
}

/// How much more tokens per unit of time the draft model must promise than the best plan
/// without it before a request in a batch opens its draft session.
pub(super) const OPEN_MARGIN: f64 = 1.15;

/// Memory of the batch around a request: about the last 5 passes.
pub(super) const BATCH_KEEP: f64 = 0.8;

/// Before a request has committed tokens, lookup is taken to copy what earlier requests
/// with prompts of about its length copied (`Shared::copied_prior`), or half of its text
/// before any did, a guess that weighs as this many tokens: a draft session is opened at
/// once only where it would pay even then, and otherwise once the first rounds show the
/// text is not copied.
pub(super) const COPIED_PRIOR: f64 = 0.5;
pub(super) const COPIED_PRIOR_WEIGHT: f64 = 4.0;
/// The most of the text still to come that lookup is taken to copy.
pub(super) const MAX_COPIED: f64 = 0.9;

impl Controller {
    /// A request's controller that takes lookup to copy `share` of its text before its
    /// rounds tell (`Shared::copied_prior`).
    pub fn expecting_copied(share: f64) -> Self {
        Self {
            copied_prior: Some(share),
            ..Self::default()
        }
    }

    /// The plan with the most committed tokens per unit of time; in a batch, among those
    /// that would beat a target-only step even at the acceptance this request is fairly
    /// sure of (`SURE_Z` standard deviations below its estimate). Where a drafted row costs
    /// about what it earns (a batch of streams on a CPU, where a row costs about what a
    /// decoded token does) a slightly high estimate makes speculation lose, and the winner
    /// among noisy estimates is the one most likely to be high: there only drafts the
    /// evidence vouches for are made. A request whose passes are its own is not gated: its
    /// rows cost little, and the draft model, whose time is what such a round risks, would
    /// otherwise be shut out of the requests it speeds up, by the spread the all-requests
    /// estimate carries before a request has rounds of its own, or by one unlucky round
    /// (docs/benchmarks.md, "AUTO alone plans on its estimates").
    pub fn plan(&self, costs: &Costs, options: &Options) -> Plan {
        let floor = self.value(costs, None, 0, options.overlap, options.streaming);
        let gate = self.in_a_batch().then_some(floor);
        let mut best = (floor, Plan::TARGET_ONLY);
        if let Some(x) = self.ngram_round(costs, options, gate)
            && x.0 > best.0
        {
            best = x;
        }
        if let Some(d) = options.draft {
            // Before its session is open the draft's acceptance for this request is only the
            // all-requests estimate, and opening is paid at once and for good: in a batch,
            // where a row costs about what it earns, the draft model must promise a clear
            // gain first (unless no request has measured it yet). Alone, its estimate
            // (prefill included, spread over the tokens lookup will not copy) is the bar.
            let margin = if d.opening && costs.draft_tried && self.in_a_batch() {
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
        // logging is on): its estimate, the share of the text lookup is expected to copy
        // (what an unopened draft session's prefill is spread against), what the gate, where
        // it applies, judges it at, and, where the request may draft ahead, what drafting
        // ahead beside a draft-model round of the chosen K (or 1) is worth and the measured
        // costs that went into it.
        tracing::debug!(
            plan = ?best.1,
            floor,
            copied_share = self.copied_share(),
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

    /// How many drafts a Decode stream's step verifies for a prompt-lookup match of bucket
    /// `b` (`DecodeRequest.lookup`): the K in `1..=max_k` with the most value where the
    /// drafts cost only their rows in the step's pass (no round, and the stream goes on),
    /// where that beats a plain streamed step; in a batch, only among the K that beat it at
    /// the odds this request is sure of, as `plan` gates its rounds. 0: none.
    pub fn stream_lookup_k(&self, costs: &Costs, b: usize, max_k: usize) -> usize {
        let acceptance = &self.ngram[b];
        let odds = acceptance.odds(costs.ngram_prior[b]);
        let sure = self
            .in_a_batch()
            .then(|| acceptance.sure_odds(costs.ngram_prior[b]));
        let streamed = |odds: Odds, k: usize| {
            let (tokens, ms) = self.pass_value(costs, odds.expected_tokens(k), k);
            tokens / ms
        };
        let floor = {
            let (tokens, ms) = self.pass_value(costs, 1.0, 0);
            tokens / ms
        };
        (1..=max_k)
            .filter(|&k| sure.is_none_or(|sure| streamed(sure, k) > floor))
            .map(|k| (streamed(odds, k), k))
            .fold((floor, 0), |best, x| if x.0 > best.0 { x } else { best })
            .1
    }

    /// Prompt lookup's best round where it has a match: its value and plan (with a
    /// `floor`, among the K that beat it at the odds this request is sure of).
    pub(super) fn ngram_round(
        &self,
        costs: &Costs,
        options: &Options,
        floor: Option<f64>,
    ) -> Option<(f64, Plan)> {
        let (b, max_k) = options.ngram?;
        let acceptance = &self.ngram[b];
        let odds = acceptance.odds(costs.ngram_prior[b]);
        let sure = floor.map(|floor| (acceptance.sure_odds(costs.ngram_prior[b]), floor));
        self.best_k(costs, options, (odds, Proposer::Ngram, 0.0), sure, max_k)
    }

    /// The draft model's best round: its value and plan (with a `floor`, as for
    /// [`Controller::ngram_round`]), which stops early where the draft runs unsure
    /// (`Options::stop_early`).
    pub(super) fn draft_round(
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
        if options.trees {
            plan.alternatives_above = self.alternatives_above(costs, value, plan.k);
        }
        Some((value, plan))
    }

    /// Where a round of `k` draft-model drafts, worth `value` tokens per millisecond, also
    /// verifies the draft's other likely tokens. An alternative adds a row to the pass and,
    /// where the chain's token before it is rejected for it, one committed token (the
    /// target's after it): about the probability the draft gives it times that of the
    /// drafts before it, the chance the round gets there. It pays where that beats what
    /// the row costs at the round's rate: `probability > value * row_ms`. Clamped to 1,
    /// where none is verified.
    pub(super) fn alternatives_above(&self, costs: &Costs, value: f64, k: usize) -> f32 {
        let rows = self.others().1 + (k + 1) as f64;
        (value * costs.pass.row_ms(rows)).clamp(0.0, 1.0) as f32
    }

    /// The K in `1..=max_k` (and the round's limit) with the most value for `proposer`;
    /// with `sure` odds and a floor, only among the K whose value at those odds beats it.
    pub(super) fn best_k(
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
                    let odds = Some((odds, who, catch_up));
                    self.value(costs, odds, k, options.overlap, options.streaming) > floor
                })
            })
            .map(|k| {
                let v = self.value(costs, Some(proposer), k, options.overlap, options.streaming);
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
    pub(super) fn stop_below(
        &self,
        costs: &Costs,
        odds: Odds,
        value: f64,
        k: usize,
        overlap: Overlap,
    ) -> f32 {
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
    /// drafting ahead adds to each round. Where the request's target-only steps are
    /// `streaming`, a target-only step has no round overhead, and a round with drafts first
    /// waits out the pass that runs the stream's step in flight: the batch's other tokens
    /// come in it, none of this request's.
    pub(super) fn value(
        &self,
        c: &Costs,
        proposer: Option<(Odds, Proposer, f64)>,
        k: usize,
        overlap: Overlap,
        streaming: bool,
    ) -> f64 {
        let (other_calls, other_rows) = self.others();
        let others = other_calls * c.tokens_per_round;
        let mine = proposer.map_or(1.0, |(odds, _, _)| odds.expected_tokens(k));
        let (mut tokens, mut ms) = self.pass_value(c, mine, k);
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
            None if streaming => 0.0,
            _ => c.overhead_plain,
        };
        if streaming && proposer.is_some() {
            tokens += others;
            ms += c.pass.ms(other_rows + 1.0) + other_calls * c.draft_ms_per_round;
        }
        tokens / ms
    }

    /// The whole batch's tokens and milliseconds in a target pass where this request's row
    /// and `k` drafts commit `mine` tokens and each other call its usual round's.
    fn pass_value(&self, c: &Costs, mine: f64, k: usize) -> (f64, f64) {
        let (other_calls, other_rows) = self.others();
        let tokens = other_calls * c.tokens_per_round + mine;
        let rows = other_rows + (k + 1) as f64;
        (tokens, c.pass.ms(rows) + other_calls * c.draft_ms_per_round)
    }

    /// Drafting ahead beside a round of `k` draft-model drafts with acceptance `odds`.
    pub(super) fn ahead(&self, c: &Costs, odds: Odds, k: usize, overlap: Overlap) -> Ahead {
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
        self.observe_seen(source, Seen::round(proposed, accepted));
    }

    /// What a round showed of this request's drafts by `source`.
    pub fn observe_seen(&mut self, source: Source, seen: Seen) {
        match source {
            Source::DraftModel => self.draft.observe_seen(seen, KEEP),
            Source::Ngram(b) => self.ngram[b].observe_seen(seen, KEEP),
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
    pub(super) fn copied_share(&self) -> f64 {
        self.copied
            .toward(
                self.copied_prior.unwrap_or(COPIED_PRIOR),
                COPIED_PRIOR_WEIGHT,
            )
            .clamp(0.0, MAX_COPIED)
    }

    /// `running` generations run on this coordinator now, this one included.
    pub fn observe_running(&mut self, running: usize) {
        self.peers = running.saturating_sub(1);
    }

    /// Whether this request shares its target passes: on average at least half a row of
    /// other sessions beside its own, or other generations running on this coordinator.
    pub(super) fn in_a_batch(&self) -> bool {
        self.others().1 >= 0.5
    }

    /// Other sessions' calls and rows per target pass: at least a row of each other
    /// generation running on this coordinator, whatever this request's passes showed so far
    /// (a stream's first rounds can run alone while the others still prefill, and a draft
    /// session opened then, judged alone, is paid for in the batch that follows).
    pub(super) fn others(&self) -> (f64, f64) {
        let peers = self.peers as f64;
        (
            self.other_calls.get().unwrap_or(0.0).max(peers),
            self.other_rows.get().unwrap_or(0.0).max(peers),
        )
    }
}
