//! Logit processing and seeded sampling, shared by the draft and the target model so that
//! speculative verification compares q(x) and p(x) built by exactly the same rules.

use std::borrow::Cow;
use std::sync::Arc;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use thiserror::Error;

use crate::scan;
use crate::verify::residual;

/// Why sampling parameters, logits or probabilities were refused.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum SamplingError {
    #[error("temperature must be finite and >= 0, got {0}")]
    InvalidTemperature(f32),
    #[error("top_p must be in (0, 1], got {0}")]
    InvalidTopP(f32),
    #[error("min_p must be in [0, 1], got {0}")]
    InvalidMinP(f32),
    #[error("logits are empty")]
    EmptyLogits,
    #[error("no usable logit: every logit is NaN or -inf")]
    NoUsableLogits,
    #[error("vocabulary of {0} entries does not fit u32 token ids")]
    VocabTooLarge(usize),
    #[error("probability of token {token} must be finite and >= 0, got {prob}")]
    InvalidProbability { token: u32, prob: f32 },
    #[error("token {0} appears more than once")]
    DuplicateToken(u32),
    #[error("distribution has no positive mass")]
    ZeroMass,
    #[error("token {token} is outside a row of {vocab} logits")]
    TokenOutsideRow { token: u32, vocab: usize },
}

/// How logits become a distribution. The same value must be used for the draft and the
/// target of one request, otherwise the acceptance ratio p/q compares unlike things.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// 0 selects greedy decoding (point mass at the argmax).
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; 0 disables the cut.
    pub top_k: usize,
    /// Nucleus mass to keep; 1.0 disables the cut.
    pub top_p: f32,
    /// Keep only the tokens at least this share as likely as the most likely one (vLLM's
    /// and llama.cpp's `min_p`); 0 disables the cut.
    pub min_p: f32,
    /// Seed for [`rng_for`]; unused when greedy.
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self::greedy()
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 0,
        }
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    pub fn validate(&self) -> Result<(), SamplingError> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(SamplingError::InvalidTemperature(self.temperature));
        }
        // Written so that NaN fails too.
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(SamplingError::InvalidTopP(self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(SamplingError::InvalidMinP(self.min_p));
        }
        Ok(())
    }
}

/// A normalized distribution over token ids, stored sparsely.
///
/// Invariants (enforced by every constructor): at least one entry, ids strictly ascending,
/// every probability finite and > 0, and the probabilities sum to 1 up to f32 rounding.
/// Absent ids have probability 0, so a sampler can never pick them.
#[derive(Debug, Clone, PartialEq)]
pub struct Distribution {
    ids: Vec<u32>,
    probs: Vec<f32>,
}

impl Distribution {
    /// All mass on one token.
    pub fn point(token: u32) -> Self {
        Self {
            ids: vec![token],
            probs: vec![1.0],
        }
    }

    /// Builds a distribution from `(token, weight)` pairs in any order, normalizing the
    /// weights. Zero weights are dropped; negative or non-finite weights, duplicate ids and
    /// an all-zero input are errors, because silently fixing them would hide a bug upstream.
    pub fn from_pairs(pairs: impl IntoIterator<Item = (u32, f32)>) -> Result<Self, SamplingError> {
        let mut entries = Vec::new();
        for (token, prob) in pairs {
            if !(prob.is_finite() && prob >= 0.0) {
                return Err(SamplingError::InvalidProbability { token, prob });
            }
            if prob > 0.0 {
                entries.push((token, f64::from(prob)));
            }
        }
        entries.sort_unstable_by_key(|&(token, _)| token);
        if let Some(pair) = entries.windows(2).find(|w| w[0].0 == w[1].0) {
            return Err(SamplingError::DuplicateToken(pair[0].0));
        }
        Self::from_sorted_weights(entries).ok_or(SamplingError::ZeroMass)
    }

    /// A distribution as its sender computed it: probabilities in ascending id order that
    /// sum to 1 up to rounding (within 1e-3) are kept bit for bit, so that both sides of a
    /// call test and draw with the same numbers (normalizing them again would move most of
    /// them by a few ulps). Anything else (weights, or ids out of order) is built as
    /// [`Distribution::from_pairs`] builds it, with the same errors.
    pub fn from_probabilities(
        pairs: impl IntoIterator<Item = (u32, f32)>,
    ) -> Result<Self, SamplingError> {
        let (mut ids, mut probs) = (Vec::new(), Vec::new());
        let (mut ascending, mut total) = (true, 0.0f64);
        for (token, prob) in pairs {
            if !(prob.is_finite() && prob >= 0.0) {
                return Err(SamplingError::InvalidProbability { token, prob });
            }
            if prob > 0.0 {
                ascending &= ids.last().is_none_or(|&last| last < token);
                ids.push(token);
                probs.push(prob);
                total += f64::from(prob);
            }
        }
        match ascending && (total - 1.0).abs() <= 1e-3 {
            true => Ok(Self { ids, probs }),
            false => Self::from_pairs(ids.into_iter().zip(probs)),
        }
    }

    /// `entries` must be sorted by id with unique ids and finite weights >= 0. Normalizes in
    /// f64 and drops entries that underflow to 0 in f32, so the stored invariant holds.
    /// Returns `None` when there is no positive mass.
    pub(crate) fn from_sorted_weights(entries: Vec<(u32, f64)>) -> Option<Self> {
        debug_assert!(entries.windows(2).all(|w| w[0].0 < w[1].0));
        let total: f64 = entries.iter().map(|&(_, w)| w).sum();
        if !(total > 0.0 && total.is_finite()) {
            return None;
        }
        let mut ids = Vec::with_capacity(entries.len());
        let mut probs = Vec::with_capacity(entries.len());
        for (token, weight) in entries {
            let prob = (weight / total) as f32;
            if prob > 0.0 {
                ids.push(token);
                probs.push(prob);
            }
        }
        // The largest weight is >= total / n, so at least one entry survives; checked anyway
        // to keep the non-empty invariant independent of that argument.
        if ids.is_empty() {
            return None;
        }
        Some(Self { ids, probs })
    }

    /// A dense row of probabilities (indexed by token id) as
    /// [`Distribution::from_probabilities`] takes it, checked and summed eight lanes at a
    /// time (a whole vocabulary off the wire, for every sampled draft token).
    pub fn from_dense_probabilities(probs: &[f32]) -> Result<Self, SamplingError> {
        match scan::all_probabilities(probs) && (scan::sum(probs) - 1.0).abs() <= 1e-3 {
            true => Self::positive(probs.to_vec()).ok_or(SamplingError::ZeroMass),
            false => Self::from_probabilities((0u32..).zip(probs.iter().copied())),
        }
    }

    /// Normalizes a row's weights (finite, >= 0, indexed by token id) in f64, in place,
    /// leaving out tokens of weight 0 and those whose probability underflows in f32. `None`
    /// when no weight is positive.
    pub(crate) fn from_weights(mut probs: Vec<f32>) -> Option<Self> {
        let total = scan::sum(&probs);
        if !(total > 0.0 && total.is_finite()) {
            return None;
        }
        let scale = 1.0 / total;
        for p in &mut probs {
            *p = (f64::from(*p) * scale) as f32;
        }
        // The largest weight is >= total / n, so at least one entry survives.
        Self::positive(probs)
    }

    /// The positive entries of a row of probabilities (indexed by token id), in place;
    /// `None` when there are none.
    fn positive(mut probs: Vec<f32>) -> Option<Self> {
        let kept = probs.iter().filter(|&&p| p > 0.0).count();
        let mut ids = Vec::with_capacity(kept);
        if kept == probs.len() {
            // At temperatures near 1 every token keeps some mass.
            ids.extend(0..kept as u32);
        } else {
            for (id, i) in (0u32..).zip(0..probs.len()) {
                if probs[i] > 0.0 {
                    probs[ids.len()] = probs[i];
                    ids.push(id);
                }
            }
            probs.truncate(kept);
        }
        (kept > 0).then_some(Self { ids, probs })
    }

    /// Probability of `token`; 0 when it is outside the support.
    pub fn prob(&self, token: u32) -> f32 {
        match self.ids.binary_search(&token) {
            Ok(i) => self.probs[i],
            Err(_) => 0.0,
        }
    }

    /// Number of tokens with positive probability.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// Always false: a distribution has at least one token. Present for API symmetry.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// Support ids, ascending.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// Probabilities, parallel to [`Self::ids`].
    pub fn probs(&self) -> &[f32] {
        &self.probs
    }

    /// `(token, probability)` pairs in ascending token order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = (u32, f32)> + '_ {
        self.ids.iter().copied().zip(self.probs.iter().copied())
    }

    /// Most likely token; ties go to the lowest id so that greedy decoding is reproducible.
    pub fn argmax(&self) -> u32 {
        let mut best = 0;
        for (i, &prob) in self.probs.iter().enumerate() {
            if prob > self.probs[best] {
                best = i;
            }
        }
        self.ids[best]
    }

    /// Draws one token by inverting the CDF at a single uniform draw.
    ///
    /// The uniform is scaled by the actual f32 sum rather than assumed to be 1, and if
    /// rounding still leaves it past the last cumulative value the last support token is
    /// returned; every stored token has positive probability, so a zero-probability token
    /// can never come out.
    pub fn sample(&self, rng: &mut impl Rng) -> u32 {
        self.sample_at(uniform01(rng))
    }

    /// The token [`Distribution::sample`] draws where its uniform draw is `uniform`.
    pub fn sample_at(&self, uniform: f64) -> u32 {
        let total: f64 = self.probs.iter().map(|&p| f64::from(p)).sum();
        let target = uniform * total;
        let mut cumulative = 0.0;
        for (&token, &prob) in self.ids.iter().zip(&self.probs) {
            cumulative += f64::from(prob);
            if target < cumulative {
                return token;
            }
        }
        self.ids[self.ids.len() - 1]
    }
}

/// One token drawn from a row under `params` at a uniform draw taken beforehand, so that the
/// draw can be made where the row is (`SequenceInput::draws`: on a GPU, a few bytes come
/// back instead of the vocabulary's logits): the token `process_logits(row, params)?
/// .sample(rng)` gives, with the same use of `rng`, or from another distribution of the
/// row (`from`).
#[derive(Debug, Clone, PartialEq)]
pub struct Draw {
    pub params: SamplingParams,
    pub uniform: f64,
    pub from: DrawFrom,
}

/// The distribution of a row a [`Draw`] is made from.
#[derive(Debug, Clone, PartialEq)]
pub enum DrawFrom {
    /// The row's (`process_logits`).
    Row,
    /// The residual after a rejected draft (`verify::draw_correction` against the
    /// distribution it was drawn from).
    After(Excluded),
    /// The row's proposal distribution (`proposal_distribution`), which comes back with the
    /// token: a draft model's step.
    Proposal,
}

/// A rejected draft a draw corrects: its token, and the distribution it was drawn from
/// (`None`: a point mass on it, a lookup's; a draft model's q otherwise).
#[derive(Debug, Clone, PartialEq)]
pub struct Excluded {
    pub token: u32,
    pub from: Option<Arc<Distribution>>,
}

impl Excluded {
    /// A lookup's draft of `token`.
    pub fn point(token: u32) -> Self {
        Self { token, from: None }
    }
}

/// A drawn token, its probability under the distribution it was drawn from, the excluded
/// token's probability before it was excluded (0 where none was), and for a proposal's draw
/// the distribution it was drawn from.
#[derive(Debug, Clone, PartialEq)]
pub struct Drawn {
    pub token: u32,
    pub probability: f32,
    pub excluded: f32,
    pub proposal: Option<Distribution>,
}

impl Draw {
    /// The draw at `rng`'s place in its stream (one uniform taken, as `sample` takes it).
    pub fn new(params: SamplingParams, rng: &mut impl Rng) -> Self {
        Self {
            params,
            uniform: uniform01(rng),
            from: DrawFrom::Row,
        }
    }

    /// A draft model's step at `rng`'s place in its stream: the token drawn from the row's
    /// proposal distribution, which comes back with it.
    pub fn proposal(params: SamplingParams, rng: &mut impl Rng) -> Self {
        Self {
            from: DrawFrom::Proposal,
            ..Self::new(params, rng)
        }
    }

    /// The rejected draft the draw corrects, if it does.
    pub fn excluded(&self) -> Option<&Excluded> {
        match &self.from {
            DrawFrom::After(x) => Some(x),
            DrawFrom::Row | DrawFrom::Proposal => None,
        }
    }

    /// Whether the draw is a draft model's step, made from the row's proposal.
    pub fn is_proposal(&self) -> bool {
        self.from == DrawFrom::Proposal
    }

    /// The draw from a whole row of logits.
    pub fn of_row(&self, row: &[f32]) -> Result<Drawn, SamplingError> {
        let (from, excluded) = self.distribution(row)?;
        Ok(self.drawn_from(from, excluded))
    }

    /// The draw from `from`, the distribution `distribution` gives (`excluded`: the
    /// excluded token's probability).
    pub fn drawn_from(&self, from: Distribution, excluded: f32) -> Drawn {
        let token = from.sample_at(self.uniform);
        Drawn {
            token,
            probability: from.prob(token),
            excluded,
            proposal: self.is_proposal().then_some(from),
        }
    }

    /// The distribution the draw is made from: a row's, its residual after the excluded
    /// draft (the row's where none is left), or its proposal distribution; and the excluded
    /// token's probability (0: none).
    pub fn distribution(&self, row: &[f32]) -> Result<(Distribution, f32), SamplingError> {
        Ok(match &self.from {
            DrawFrom::Row => (process_logits(row, &self.params)?, 0.0),
            DrawFrom::After(x) => {
                let p = process_logits(row, &self.params)?;
                let excluded = p.prob(x.token);
                let q = match &x.from {
                    Some(q) => Cow::Borrowed(&**q),
                    None => Cow::Owned(Distribution::point(x.token)),
                };
                (residual(&p, &q).unwrap_or(p), excluded)
            }
            DrawFrom::Proposal => (proposal_distribution(row, &self.params)?, 0.0),
        })
    }
}

/// A uniform draw in [0, 1) with 53 random bits, built from `next_u64` directly so the
/// value depends only on the RNG's raw output, not on how a `rand` release maps bits to
/// floats.
pub(crate) fn uniform01(rng: &mut impl Rng) -> f64 {
    const SCALE: f64 = 1.0 / (1u64 << 53) as f64;
    (rng.next_u64() >> 11) as f64 * SCALE
}

/// A reproducible RNG for one request.
///
/// ChaCha8 is a fully specified algorithm, so the same seed yields the same stream on every
/// platform and every `rand` release; `StdRng` makes no such promise (its algorithm may
/// change between `rand` versions). The seed is placed into the key bytes ourselves rather
/// than through `seed_from_u64`, whose expansion is a `rand_core` implementation detail.
pub fn rng_for(seed: u64) -> ChaCha8Rng {
    let mut key = [0u8; 32];
    key[..8].copy_from_slice(&seed.to_le_bytes());
    ChaCha8Rng::from_seed(key)
}

/// The random stream of `seed` at `position` (in 32-bit words): where a sampling session's
/// draws go on when another process made the ones before (a Decode stream's steps on the
/// target-worker, the coordinator's rounds around them).
pub fn rng_at(seed: u64, position: u64) -> ChaCha8Rng {
    let mut rng = rng_for(seed);
    rng.set_word_pos(u128::from(position));
    rng
}

/// Where `rng` stands, in 32-bit words (as [`rng_at`] takes it).
pub fn rng_position(rng: &ChaCha8Rng) -> u64 {
    u64::try_from(rng.get_word_pos()).unwrap_or(u64::MAX)
}

/// Turns one position's logits into the distribution to sample from.
///
/// Greedy parameters give a point mass at the argmax (ties to the lowest id). Otherwise:
/// temperature scaling, min-p, top-k, softmax, top-p nucleus, renormalization (vLLM's
/// order). NaN logits are treated as impossible tokens; `+inf` logits, if any, share all
/// the mass equally (the limit of softmax). Errors on invalid parameters and on logits with
/// no usable entry.
pub fn process_logits(
    logits: &[f32],
    params: &SamplingParams,
) -> Result<Distribution, SamplingError> {
    distribution(logits, params, Distribution::from_weights)
}

/// The share of a draft's distribution that [`proposal_distribution`] may leave out.
pub const PROPOSAL_TAIL: f64 = 1e-3;

/// The distribution a draft token is drawn from: [`process_logits`]'s, without its long
/// tail of unlikely tokens where those hold at most [`PROPOSAL_TAIL`] of its mass.
///
/// Speculative sampling is exact for any proposal distribution, as long as the acceptance
/// test and the correction's residual use the one the draft was drawn from: leaving the
/// tail out costs no exactness, and at most the tail's mass in acceptance (a draft is
/// accepted with probability `sum(min(p, q))`, and renormalizing raises every kept `q`).
/// At a plain temperature every token keeps some mass, so a draft's whole distribution is
/// the vocabulary (600 KB a token on the wire); without the tail it is the few hundred
/// tokens that matter.
pub fn proposal_distribution(
    logits: &[f32],
    params: &SamplingParams,
) -> Result<Distribution, SamplingError> {
    let finish = |weights: Vec<f32>| {
        without_tail(&weights, PROPOSAL_TAIL).or_else(|| Distribution::from_weights(weights))
    };
    distribution(logits, params, finish)
}

/// The distribution of `logits` under `params`, its sampling weights (temperature, min-p,
/// top-k, top-p applied) made into one by `finish`.
fn distribution(
    logits: &[f32],
    params: &SamplingParams,
    finish: impl FnOnce(Vec<f32>) -> Option<Distribution>,
) -> Result<Distribution, SamplingError> {
    params.validate()?;
    if logits.is_empty() {
        return Err(SamplingError::EmptyLogits);
    }
    if logits.len() - 1 > u32::MAX as usize {
        return Err(SamplingError::VocabTooLarge(logits.len()));
    }
    if params.is_greedy() {
        return argmax(logits).map(Distribution::point);
    }
    let mut weights = match scan::max(logits) {
        f32::NEG_INFINITY => return Err(SamplingError::NoUsableLogits),
        f32::INFINITY => logits
            .iter()
            .map(|&l| if l == f32::INFINITY { 1.0 } else { 0.0 })
            .collect(),
        max => scan::exp_weights(logits, max, params.temperature),
    };
    if params.min_p > 0.0 {
        keep_likely(&mut weights, params.min_p);
    }
    if params.top_k > 0 {
        keep_top_k(&mut weights, params.top_k);
    }
    if params.top_p < 1.0 {
        keep_nucleus(&mut weights, f64::from(params.top_p));
    }
    finish(weights).ok_or(SamplingError::NoUsableLogits)
}

/// The distribution of the weights above the highest of a few floors (a share of the
/// row's mass each) under which they add up to at most `tail` of it; `None` where even the
/// lowest floor leaves out more. A floor found this way costs a pass over the row or two,
/// where the smallest set of tokens holding `1 - tail` (a nucleus) costs a selection, and
/// only the tokens kept are normalized.
fn without_tail(weights: &[f32], tail: f64) -> Option<Distribution> {
    let total = scan::sum(weights);
    for share in [1e-4, 1e-6, 1e-8] {
        let floor = (share * total) as f32;
        let kept: Vec<(u32, f64)> = (0u32..)
            .zip(weights)
            .filter(|&(_, &w)| w > floor)
            .map(|(token, &w)| (token, f64::from(w)))
            .collect();
        if total - kept.iter().map(|&(_, w)| w).sum::<f64>() <= tail * total {
            // Every token kept (a flat row): the request's distribution as it is.
            return (kept.len() < weights.len())
                .then(|| Distribution::from_sorted_weights(kept))
                .flatten();
        }
    }
    None
}

/// Keeps the tokens of weight at least `min_p` times the largest (a share of its
/// probability: the weights are probabilities times one factor) and zeroes the rest.
fn keep_likely(weights: &mut [f32], min_p: f32) {
    let least = min_p * scan::max(weights);
    for w in weights.iter_mut().filter(|w| **w < least) {
        *w = 0.0;
    }
}

/// Keeps the `top_k` tokens of most weight (on a tie the lower ids) and zeroes the rest.
fn keep_top_k(weights: &mut [f32], top_k: usize) {
    // Each token counts 1: the boundary is the k-th weight from the top.
    let Some(least) = least_reaching(weights, top_k as f64, |_| 1.0) else {
        // Fewer than k tokens have weight: all of them stay.
        return;
    };
    let above = weights.iter().filter(|&&w| w > least).count();
    keep_down_to(weights, least, top_k - above);
}

/// Keeps the nucleus of mass `top_p`: the fewest tokens of most weight (on a tie the lower
/// ids) whose weights reach `top_p` of the row's, and zeroes the rest.
fn keep_nucleus(weights: &mut [f32], top_p: f64) {
    let target = top_p * scan::sum(weights);
    let Some(least) = least_reaching(weights, target, f64::from) else {
        // Rounding left the whole row just short of the target: all of it is the nucleus.
        return;
    };
    let above = scan::sum_above(weights, least);
    // Of the tokens that weigh `least`, as many (lowest ids first) as reach the target.
    let ties = ((target - above) / f64::from(least)).ceil().max(1.0) as usize;
    keep_down_to(weights, least, ties);
}

/// The boundary of the top of a row: the largest weight `w` for which the tokens of weight
/// at least `w` reach `target`, each counting `count(its weight)` (1 for top-k, its weight
/// for top-p); `None` when even the whole row falls short.
///
/// Positive f32s order as their bits do, so the boundary's bits are found from the top,
/// ten or eleven at a time: each pass sums the counts of the weights that share the bits
/// found so far by their next bits, and descends into the bucket where the sum running
/// down from the largest weights reaches the target. One pass over the row and two over
/// the weights in one bucket, where a sort would cost O(V log V) on every token.
fn least_reaching(weights: &[f32], target: f64, count: impl Fn(f32) -> f64) -> Option<f32> {
    let (mut prefix, mut need) = (0u32, target);
    // The weights that share the bits found so far, in id order (so each pass sums them
    // in the same order).
    let mut sharing = Cow::Borrowed(weights);
    for (shift, width) in [(20u32, 11u32), (10, 10), (0, 10)] {
        let mut sums = vec![0.0f64; 1 << width];
        for &w in sharing.iter().filter(|&&w| w > 0.0) {
            sums[((w.to_bits() >> shift) & ((1 << width) - 1)) as usize] += count(w);
        }
        let lowest = sums.iter().position(|&m| m > 0.0)?;
        let reached = (lowest..sums.len()).rev().find(|&d| {
            let reached = sums[d] >= need;
            need -= if reached { 0.0 } else { sums[d] };
            reached
        });
        // Below the first pass the buckets split one bucket that reached the target, and
        // may fall just short of it, summed apart: the boundary is then its least weight.
        let digit = match (reached, shift) {
            (Some(d), _) => d,
            (None, 20) => return None,
            (None, _) => lowest,
        };
        prefix = (prefix << width) | digit as u32;
        if shift > 0 {
            let shared = sharing.iter().filter(|w| w.to_bits() >> shift == prefix);
            sharing = Cow::Owned(shared.copied().collect());
        }
    }
    Some(f32::from_bits(prefix))
}

/// Keeps the weights above `least` and the first `ties` (lowest ids) equal to it; zeroes
/// the rest.
fn keep_down_to(weights: &mut [f32], least: f32, mut ties: usize) {
    for w in weights {
        if *w == least && ties > 0 {
            ties -= 1;
        } else if *w <= least {
            *w = 0.0;
        }
    }
}

/// The greedy token: the largest logit, lowest id on ties; NaN never wins.
pub fn argmax(logits: &[f32]) -> Result<u32, SamplingError> {
    match scan::max(logits) {
        f32::NEG_INFINITY => Err(SamplingError::NoUsableLogits),
        max => Ok(logits
            .iter()
            .position(|&l| l == max)
            .expect("the max is an entry") as u32),
    }
}

/// Logits this far below the largest add under e^-24 (4e-11) each to the softmax's
/// denominator: over a 152k vocabulary under 1e-5 in all, so they are left out.
const NEGLIGIBLE_LOGIT: f32 = 24.0;

/// The greedy token and its probability under the softmax of `logits` (temperature 1): how
/// sure a greedy model is of its own choice. A draft-worker stops drafting when this runs
/// low. Only logits within [`NEGLIGIBLE_LOGIT`] of the largest are exponentiated (a few
/// dozen of a vocabulary's, where a full softmax would cost a tenth of a draft step).
pub fn argmax_probability(logits: &[f32]) -> Result<(u32, f32), SamplingError> {
    let token = argmax(logits)?;
    let max = logits[token as usize];
    if max == f32::INFINITY {
        let tied = logits.iter().filter(|&&l| l == f32::INFINITY).count();
        return Ok((token, 1.0 / tied as f32));
    }
    // The argmax itself adds exp(0) = 1.
    Ok((
        token,
        1.0 / scan::exp_sum_above(logits, max, NEGLIGIBLE_LOGIT),
    ))
}

/// Up to `max` tokens other than `chosen`, most probable first (the lower id on a tie),
/// whose softmax probability (temperature 1) is at least `min_prob`: the other candidates
/// a greedy draft rates likely at a position. As in [`argmax_probability`], only logits
/// within [`NEGLIGIBLE_LOGIT`] of the largest count.
pub fn likely_others(logits: &[f32], chosen: u32, min_prob: f32, max: usize) -> Vec<u32> {
    let top = logits
        .iter()
        .copied()
        .filter(|l| l.is_finite())
        .fold(f32::NEG_INFINITY, f32::max);
    if max == 0 || top == f32::NEG_INFINITY {
        return Vec::new();
    }
    let floor = top - NEGLIGIBLE_LOGIT;
    let near: Vec<(u32, f32)> = (0u32..)
        .zip(logits)
        .filter(|&(_, &l)| l.is_finite() && l > floor)
        .map(|(i, &l)| (i, (l - top).exp()))
        .collect();
    let total: f32 = near.iter().map(|&(_, w)| w).sum();
    let mut others: Vec<(u32, f32)> = near
        .into_iter()
        .filter(|&(i, w)| i != chosen && w / total >= min_prob)
        .collect();
    others.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    others.into_iter().take(max).map(|(i, _)| i).collect()
}

#[cfg(test)]
pub(crate) mod test_stats {
    //! Goodness-of-fit helpers shared by the sampling and verification tests.

    /// Chi-square critical values at p = 1e-6 for 1..=15 degrees of freedom; with fixed
    /// seeds a test either always passes or always fails, and this level makes a false
    /// failure astronomically unlikely when a seed is changed.
    const CRITICAL_1E6: [f64; 15] = [
        23.928, 27.631, 30.665, 33.377, 35.888, 38.258, 40.522, 42.701, 44.811, 46.863, 48.866,
        50.825, 52.747, 54.635, 56.493,
    ];

    /// Asserts that `counts` (indexed by outcome) were drawn from `expected` (same indexing):
    /// outcomes with expected probability 0 must never occur, the chi-square statistic must
    /// stay under the 1e-6 critical value, and the total-variation distance under `max_tv`.
    pub(crate) fn assert_fits(counts: &[u64], expected: &[f64], max_tv: f64, label: &str) {
        assert_eq!(counts.len(), expected.len(), "{label}");
        let n: u64 = counts.iter().sum();
        let n_f = n as f64;
        let mut chi2 = 0.0;
        let mut tv = 0.0;
        let mut cells = 0;
        for (&count, &p) in counts.iter().zip(expected) {
            if p == 0.0 {
                assert_eq!(count, 0, "{label}: impossible outcome observed");
                continue;
            }
            cells += 1;
            let e = p * n_f;
            chi2 += (count as f64 - e).powi(2) / e;
            tv += (count as f64 / n_f - p).abs() / 2.0;
        }
        if cells > 1 {
            let critical = CRITICAL_1E6[cells - 2];
            assert!(
                chi2 < critical,
                "{label}: chi2 {chi2:.2} >= {critical} (df {})",
                cells - 1
            );
        }
        assert!(tv < max_tv, "{label}: total variation {tv:.5} >= {max_tv}");
    }
}

#[cfg(test)]
mod tests;
