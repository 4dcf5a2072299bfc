//! What every request of a coordinator learns together: the proposers' typical acceptance
//! (each request's prior) and the costs (the target's pass time by rows, the draft model's
//! time per token and per prefilled token, drafting ahead's slowdown, the overhead of a
//! round, greedy and sampling apart), and the snapshot of them a round plans with
//! ([`Costs`]).

use super::estimate::{Acceptance, Mean, NGRAM_BUCKETS, Odds, Seen};
use super::pass::{PassTime, PassTimes};
use super::plan::COPIED_PRIOR;
use std::sync::Mutex;

/// What every request of a coordinator learns together: the proposers' typical acceptance
/// (each request's prior) and the costs.
#[derive(Debug, Default)]
pub struct Shared {
    state: Mutex<SharedState>,
}

#[derive(Debug, Default, Clone)]
pub(super) struct SharedState {
    pub(super) draft: Acceptance,
    pub(super) ngram: [Acceptance; NGRAM_BUCKETS],
    /// The target's passes by row count, and the pass time read off them as of the latest
    /// pass (not each time a request plans a round).
    pub(super) passes: PassTimes,
    pub(super) pass_time: Option<PassTime>,
    /// Draft-worker time per draft token (its share of batched passes).
    pub(super) draft_per_token: Mean,
    /// Draft-worker time per prompt token of a session's prefill.
    pub(super) draft_prefill_per_row: Mean,
    /// How much slower a target pass ran, relative to `pass_time`, beside a Propose made
    /// ahead; and that Propose's time per draft token.
    pub(super) ahead_slowdown: Mean,
    pub(super) draft_ahead_per_token: Mean,
    /// Coordinator and network time per round, with and without a draft-worker call, by
    /// [`Mode`].
    pub(super) overhead_draft: [Mean; 2],
    pub(super) overhead_plain: [Mean; 2],
    /// Over all rounds of all requests.
    pub(super) tokens_per_round: Mean,
    pub(super) draft_ms_per_round: Mean,
    /// Committed tokens that prompt lookup proposed (or would have), over committed tokens,
    /// of requests that look up, by their prompt's length (`copied_bucket`).
    pub(super) copied: [Mean; COPIED_BUCKETS],
}

/// Memory of the all-requests figures: about the last 50 observations.
pub(super) const SHARED_KEEP: f64 = 0.98;

/// A target-only round's overhead (ms) before any is measured.
const OVERHEAD_PLAIN_PRIOR: f64 = 0.5;

/// Greedy or sampling requests: their rounds' overheads are learnt apart. A sampling round
/// carries the draft's distributions (each without its tail), which the draft-worker
/// encodes, the coordinator decodes and passes on to the target-worker, which draws a
/// rejection's correction from them; more than a greedy round's overhead (docs/benchmarks.md,
/// "A draft's distribution without its tail").
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Mode {
    #[default]
    Greedy,
    Sampling,
}

impl Mode {
    pub fn of(greedy: bool) -> Self {
        match greedy {
            true => Mode::Greedy,
            false => Mode::Sampling,
        }
    }
}

/// What all requests learnt of the draft model fades this much with each round of any
/// request that did not use it (toward the optimistic prior): otherwise a draft model that
/// its first round or two made look poor would never be opened again, and so never measured
/// again, for the coordinator's whole life. A verdict from one round is retried within a
/// request or two; one from fifty (a draft model that really does not pay) after several.
pub(super) const DRAFT_UNUSED_KEEP: f64 = 0.995;

/// What the draft model costs (per draft token, per prefilled prompt token) fades ten times
/// slower: it is the hardware's and the load's, which do not change with the text, where
/// acceptance does. A cost that faded as fast as acceptance would be back at the guess after
/// a few requests that lookup serves, and the next requests would open the draft session on
/// that guess (docs/benchmarks.md, "Forgotten draft costs reopened draft sessions on code
/// edits"). A cost set by one slow call is still back near the guess within a few
/// thousand rounds.
pub(super) const DRAFT_COST_UNUSED_KEEP: f64 = 0.9995;

/// How much the guessed draft costs weigh: as a call of four tokens (per draft token) and
/// as one session's prefill (per prompt token).
pub(super) const DRAFT_COST_PRIOR_WEIGHT: f64 = 4.0;
pub(super) const DRAFT_PREFILL_PRIOR_WEIGHT: f64 = 1.0;

/// Prompt lengths the copied share is learnt apart for: under 64 tokens, under 128, ...,
/// under 1,024, and longer. How much of an answer repeats its prompt is known only once the
/// answer runs, and a draft session is worth opening early only where little will be
/// copied; what earlier requests of about the same prompt length copied tells a short chat
/// question (little) from an edit of the code it carries (most) before the answer starts.
pub(super) const COPIED_BUCKETS: usize = 6;

/// The copied share's bucket for a prompt of `tokens`.
pub(super) fn copied_bucket(tokens: usize) -> usize {
    let log2 = usize::BITS - (tokens >> 6).leading_zeros();
    (log2 as usize).min(COPIED_BUCKETS - 1)
}

/// Memory of the copied shares: about the last 200 rounds of requests in a bucket.
pub(super) const COPIED_KEEP: f64 = 0.995;

/// How much the guess of half weighs against what a bucket learnt: as 32 committed tokens.
pub(super) const COPIED_GUESS_WEIGHT: f64 = 32.0;

impl SharedState {
    /// A pass of `rows` rows in `ms` that `calls` requests report, each with its share.
    pub(super) fn observe_pass(&mut self, rows: usize, ms: f64, calls: usize) {
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
pub(super) const AHEAD_PRIOR_WEIGHT: f64 = 0.25;

/// Under the first observations. The draft model is assumed good (a draft model is paired
/// with its target because it predicts it well): requests then try it and its estimate
/// comes from measurement, where a modest guess on a CPU, on which drafting costs much,
/// would never be put to the test; a few bad rounds outweigh it. Prompt lookup's rises
/// with the match length (it is scored every round anyway); the cache of earlier requests'
/// starts as low as a short match.
pub(super) const DRAFT_PRIOR: Odds = Odds {
    first: 0.9,
    next: 0.9,
};
pub(super) const NGRAM_PRIOR: [Odds; NGRAM_BUCKETS] = [
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
    // The cache of earlier requests, a continuation seen once: what followed the same 8
    // tokens elsewhere, right for a repeated request, often wrong where requests share
    // only a template.
    Odds {
        first: 0.3,
        next: 0.6,
    },
    // The cache, a continuation several requests agreed on, as far as they agreed.
    Odds {
        first: 0.6,
        next: 0.8,
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
    /// Round wall time not spent in the workers (coordinator, network); `None` where the
    /// target's step began before the round (a Decode stream's).
    pub overhead_ms: Option<f64>,
    /// The request's: what the overhead is learnt for.
    pub mode: Mode,
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
    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, SharedState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The estimates now for a request of `mode`, or `None` before the first target pass
    /// was seen.
    pub fn costs(&self, mode: Mode) -> Option<Costs> {
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
            overhead_draft: s.overhead_draft[mode as usize].get().unwrap_or(1.0),
            overhead_plain: s.overhead_plain[mode as usize]
                .get()
                .unwrap_or(OVERHEAD_PLAIN_PRIOR),
            tokens_per_round: s.tokens_per_round.get().unwrap_or(1.0),
            draft_ms_per_round: s.draft_ms_per_round.get().unwrap_or(0.0),
            draft_tried: s.draft.first.trials > 0.0,
            draft_prior: s.draft.odds(DRAFT_PRIOR),
            ngram_prior: std::array::from_fn(|i| s.ngram[i].odds(NGRAM_PRIOR[i])),
        })
    }

    /// Whether `steps` target-only steps of a request of `mode` save, a round's overhead
    /// each, at least a one-row pass (what a stream leaves in flight when a proposal ends
    /// it); false before any pass is measured. A request asks it every target-only round:
    /// no snapshot of all the estimates ([`Shared::costs`]) for it.
    pub fn streaming_pays(&self, steps: usize, mode: Mode) -> bool {
        let s = self.lock();
        let Some(pass) = &s.pass_time else {
            return false;
        };
        let overhead = s.overhead_plain[mode as usize]
            .get()
            .unwrap_or(OVERHEAD_PLAIN_PRIOR);
        steps as f64 * overhead >= pass.ms(1.0)
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
        }
        if let Some(overhead) = r.overhead_ms {
            let overhead_of = match r.draft_tokens > 0 {
                true => &mut s.overhead_draft[r.mode as usize],
                false => &mut s.overhead_plain[r.mode as usize],
            };
            overhead_of.add(overhead.max(0.0), SHARED_KEEP);
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

    /// Learns from a round of a request with a prompt of `prompt` tokens that looks up: of
    /// its `committed` tokens, the first `copied` were prompt lookup's proposal.
    pub fn observe_copied(&self, prompt: usize, copied: usize, committed: usize) {
        let bucket = copied_bucket(prompt);
        self.lock().copied[bucket].add_total(copied as f64, committed as f64, COPIED_KEEP);
    }

    /// The share of its answer that a request with a prompt of `prompt` tokens is expected
    /// to copy before its own rounds tell: what requests of about that length copied, from
    /// a guess of half (`COPIED_PRIOR`).
    pub fn copied_prior(&self, prompt: usize) -> f64 {
        self.lock().copied[copied_bucket(prompt)].toward(COPIED_PRIOR, COPIED_GUESS_WEIGHT)
    }

    /// Learns how a proposer's drafts fared (the priors of later requests).
    pub fn observe_acceptance(&self, source: Source, proposed: usize, accepted: usize) {
        self.observe_seen(source, Seen::round(proposed, accepted));
    }

    /// Learns what a round showed of a proposer's drafts.
    pub fn observe_seen(&self, source: Source, seen: Seen) {
        let mut s = self.lock();
        let a = match source {
            Source::DraftModel => &mut s.draft,
            Source::Ngram(bucket) => &mut s.ngram[bucket],
        };
        a.observe_seen(seen, SHARED_KEEP);
    }
}

/// A proposer whose acceptance is tracked: the draft model, or prompt lookup by match length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    DraftModel,
    Ngram(usize),
}
