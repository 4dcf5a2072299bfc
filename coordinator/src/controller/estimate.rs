//! The estimators the controller learns with: acceptance as two forgetting Beta rates (the
//! first draft token, each next one given the one before) and forgetting means.

/// Hits over trials that forget: each observation first scales the old counts by `keep`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(super) struct Rate {
    pub(super) hits: f64,
    pub(super) trials: f64,
}

impl Rate {
    pub(super) fn add(&mut self, hits: f64, trials: f64, keep: f64) {
        self.hits = self.hits * keep + hits;
        self.trials = self.trials * keep + trials;
    }

    /// The posterior mean with `prior` counted as `weight` trials.
    pub(super) fn mean(&self, prior: f64, weight: f64) -> f64 {
        (self.hits + prior * weight) / (self.trials + weight)
    }

    /// [`Rate::mean`] less [`SURE_Z`] standard deviations of the posterior (a Beta of
    /// `trials + weight` observations), at least 0: what the evidence makes fairly sure.
    pub(super) fn lower(&self, prior: f64, weight: f64) -> f64 {
        let mean = self.mean(prior, weight);
        let n = self.trials + weight;
        (mean - SURE_Z * (mean * (1.0 - mean) / (n + 1.0)).sqrt()).max(0.0)
    }
}

/// Standard deviations below the estimated acceptance at which a round must still beat a
/// target-only step before it speculates ([`Controller::plan`]).
pub(super) const SURE_Z: f64 = 1.0;

/// How a proposer's drafts fare: the first token, and each next one given the one before.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Acceptance {
    pub(super) first: Rate,
    pub(super) next: Rate,
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
pub(super) const KEEP: f64 = 0.92;
/// How much the all-requests prior weighs against a request's own rounds, in rounds.
pub(super) const PRIOR_WEIGHT: f64 = 3.0;

/// What one round showed of a proposer's drafts: whether the first one was right (`None`:
/// not tested this round), and of the next ones tested, how many were right.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Seen {
    pub first: Option<bool>,
    pub next_right: usize,
    pub next_tested: usize,
}

impl Seen {
    /// `accepted` of `proposed` drafts (the leading ones) were accepted.
    pub fn round(proposed: usize, accepted: usize) -> Self {
        let accepted = accepted.min(proposed);
        Self {
            first: (proposed > 0).then_some(accepted > 0),
            next_right: accepted.saturating_sub(1),
            // Positions 2..=proposed were reached when the one before was accepted.
            next_tested: accepted.min(proposed.saturating_sub(1)),
        }
    }

    fn is_empty(&self) -> bool {
        self.first.is_none() && self.next_tested == 0
    }
}

impl Acceptance {
    /// `accepted` of `proposed` drafts (the leading ones) were accepted.
    pub fn observe(&mut self, proposed: usize, accepted: usize, keep: f64) {
        self.observe_seen(Seen::round(proposed, accepted), keep);
    }

    /// A round's worth of evidence: a round that tested a first draft makes both rates
    /// forget by `keep` once; one that tested only next drafts (a proposal still being
    /// scored across rounds, `generation/shadow.rs`), only the next rate.
    pub fn observe_seen(&mut self, seen: Seen, keep: f64) {
        if seen.is_empty() {
            return;
        }
        if let Some(right) = seen.first {
            self.first.add(f64::from(u8::from(right)), 1.0, keep);
        }
        self.next
            .add(seen.next_right as f64, seen.next_tested as f64, keep);
    }

    /// Old evidence weighs less, without a new observation.
    pub(super) fn fade(&mut self, keep: f64) {
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
    pub(super) fn sure_odds(&self, prior: Odds) -> Odds {
        Odds {
            first: self.first.lower(prior.first, PRIOR_WEIGHT),
            next: self.next.lower(prior.next, PRIOR_WEIGHT),
        }
    }
}

/// Prompt-lookup matches in the request's own text by length: 1-2, 3-5, 6 or more tokens.
/// Proposals from the cache of earlier requests (`proposals.rs`, `cache_votes`) are judged
/// apart, by how often their continuation was seen: once (a repeated request's text, or a
/// guess where requests share only a template), or more (what several requests agreed on).
pub fn ngram_bucket(matched: usize, cache_votes: Option<u32>) -> usize {
    match (cache_votes, matched) {
        (Some(0..=1), _) => CACHE_BUCKET,
        (Some(_), _) => CACHE_BUCKET + 1,
        (None, 0..=2) => 0,
        (None, 3..=5) => 1,
        (None, _) => 2,
    }
}

/// Which of the prompt-lookup estimates judges `lookup`.
pub fn lookup_bucket(lookup: &duet_engine::ngram::Lookup) -> usize {
    ngram_bucket(lookup.matched, lookup.cache_votes)
}

/// The first bucket of proposals from the cache of earlier requests.
pub const CACHE_BUCKET: usize = 3;
pub(super) const NGRAM_BUCKETS: usize = 5;

/// Exponentially weighted mean.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(super) struct Mean {
    pub(super) value: f64,
    pub(super) weight: f64,
}

impl Mean {
    pub(super) fn add(&mut self, x: f64, keep: f64) {
        self.add_total(x, 1.0, keep);
    }

    /// Adds `weight` observations that sum to `total` (a call's time over its tokens).
    pub(super) fn add_total(&mut self, total: f64, weight: f64, keep: f64) {
        self.value = self.value * keep + total;
        self.weight = self.weight * keep + weight;
    }

    pub(super) fn get(&self) -> Option<f64> {
        (self.weight > 1e-9).then(|| self.value / self.weight)
    }

    /// The mean with `prior` counted as `weight` observations: a single odd measurement
    /// (a slow first call) moves it only part of the way.
    pub(super) fn toward(&self, prior: f64, weight: f64) -> f64 {
        (self.value + prior * weight) / (self.weight + weight)
    }

    /// Old observations weigh less, without a new one.
    pub(super) fn fade(&mut self, keep: f64) {
        self.value *= keep;
        self.weight *= keep;
    }
}
