//! Speculative-decoding verification: decides how many draft tokens the target accepts and
//! which token it emits next, as pure functions over already-computed distributions.

use rand::Rng;
use std::borrow::Cow;
use thiserror::Error;

use crate::sampling::{Distribution, uniform01};

/// Inputs whose lengths do not fit together; the round cannot be verified.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum VerifyError {
    #[error("target_argmax has {actual} entries, expected draft length + 1 = {expected}")]
    TargetArgmaxLength { expected: usize, actual: usize },
    #[error("got {actual} draft distributions, expected one per draft token ({expected})")]
    DraftDistributionsLength { expected: usize, actual: usize },
    #[error("got {actual} target distributions, expected draft length + 1 = {expected}")]
    TargetDistributionsLength { expected: usize, actual: usize },
    #[error("got {actual} parents, expected one per draft token ({expected})")]
    ParentsLength { expected: usize, actual: usize },
}

/// Outcome of verifying one round of K draft tokens.
///
/// The tokens committed for the round are `draft[..accepted]` followed by `token`, so every
/// round commits between 1 and K + 1 tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verdict {
    /// Number of leading draft tokens accepted, in `0..=K`.
    pub accepted: usize,
    /// The target's own token after the accepted prefix: the correction at the first
    /// rejection, or the bonus token when all K draft tokens were accepted.
    pub token: u32,
}

impl Verdict {
    /// The tokens this round commits: `draft[..accepted]` then `token`.
    pub fn committed(&self, draft: &[u32]) -> Vec<u32> {
        let mut out: Vec<u32> = draft.iter().take(self.accepted).copied().collect();
        out.push(self.token);
        out
    }
}

/// Greedy verification: accept draft tokens while they equal the target's argmax.
///
/// `target_argmax[i]` is the target's argmax at draft position `i`, and
/// `target_argmax[K]` the one after the last draft token, so it must hold K + 1 entries.
pub fn verify_greedy(draft: &[u32], target_argmax: &[u32]) -> Result<Verdict, VerifyError> {
    let expected = draft.len() + 1;
    if target_argmax.len() != expected {
        return Err(VerifyError::TargetArgmaxLength {
            expected,
            actual: target_argmax.len(),
        });
    }
    let accepted = draft
        .iter()
        .zip(target_argmax)
        .take_while(|(d, t)| d == t)
        .count();
    Ok(Verdict {
        accepted,
        token: target_argmax[accepted],
    })
}

/// Greedy verification of a tree of drafts: from the last committed token, follow the
/// draft whose token is the target's argmax there (the first such, in draft order) while
/// there is one. `parents[j]` is draft `j`'s parent (0: the last committed token, `i`:
/// draft `i - 1`), `target_argmax[0]` the target's argmax after the last committed token
/// and `target_argmax[j + 1]` after draft `j` (its path). Returns the accepted drafts'
/// indices, in order, and the target's token after the last of them. For a chain
/// (`parents[j] = j`) this is [`verify_greedy`].
pub fn verify_greedy_tree(
    draft: &[u32],
    parents: &[u32],
    target_argmax: &[u32],
) -> Result<(Vec<usize>, u32), VerifyError> {
    check_parents(draft, parents)?;
    let expected = draft.len() + 1;
    if target_argmax.len() != expected {
        return Err(VerifyError::TargetArgmaxLength {
            expected,
            actual: target_argmax.len(),
        });
    }
    let mut path = Vec::new();
    let mut at = 0;
    loop {
        let token = target_argmax[at];
        let next = (0..draft.len()).find(|&j| parents[j] as usize == at && draft[j] == token);
        match next {
            Some(j) => {
                path.push(j);
                at = j + 1;
            }
            None => return Ok((path, token)),
        }
    }
}

/// Speculative sampling (Leviathan et al. 2023; Chen et al. 2023): the committed tokens are
/// distributed exactly as if sampled from the target one by one, provided each `draft[i]` was
/// drawn from `q[i]`.
///
/// `q[i]` is the draft's distribution at position `i` (K entries), `p[i]` the target's
/// (K + 1 entries, the last one for the bonus token). Draft token `x` at position `i` is
/// accepted with probability `min(1, p[i](x) / q[i](x))`, tested as `u * q(x) < p(x)` for
/// one uniform `u` in [0, 1) per examined position, which needs no division:
/// - `p(x) = 0` always rejects;
/// - `q(x) = 0 < p(x)` always accepts. The ratio is +inf; this only happens when the caller
///   proposed a token its own distribution excludes, and exactness then no longer holds.
///
/// At the first rejection the correction is drawn from the residual
/// `normalize(max(0, p[i] - q[i]))`, or from `p[i]` when rounding leaves no residual mass
/// (`p == q`). If all K are accepted the bonus is drawn from `p[K]`.
pub fn verify_sampling(
    draft: &[u32],
    q: &[Distribution],
    p: &[Distribution],
    rng: &mut impl Rng,
) -> Result<Verdict, VerifyError> {
    check_distributions(draft.len(), q.len(), p.len())?;
    let (tested, _) = test_sampled(draft, Drafted::Whole(q), rows(p), rng)?;
    let token = tested
        .token
        .expect("with every q whole, the test draws the token");
    Ok(Verdict {
        accepted: tested.accepted,
        token,
    })
}

/// What the side that tests a chain ([`test_sampled`]) holds of the draft's distributions.
#[derive(Debug, Clone, Copy)]
pub enum Drafted<'q> {
    /// Each draft's probability under its q (`q[i](draft[i])`): a rejection's correction
    /// is left to the caller, who holds the q's.
    Probabilities(&'q [f32]),
    /// Each draft's whole q (a lookup's: the point mass on its draft): the correction is
    /// drawn here too.
    Whole(&'q [Distribution]),
}

impl Drafted<'_> {
    fn len(&self) -> usize {
        match self {
            Self::Probabilities(q) => q.len(),
            Self::Whole(q) => q.len(),
        }
    }

    /// Draft `i`'s probability, `x` being the draft.
    fn prob(&self, i: usize, x: u32) -> f32 {
        match self {
            Self::Probabilities(q) => q[i],
            Self::Whole(q) => q[i].prob(x),
        }
    }
}

/// What [`test_sampled`] decided: the drafts accepted and, where it could draw it, the
/// token after them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tested {
    pub accepted: usize,
    /// `None`: draft `accepted` was rejected and the test held its q's probability only:
    /// the correction is the caller's ([`draw_correction`]).
    pub token: Option<u32>,
}

/// The acceptance tests of [`verify_sampling`] for the side that holds p (the target),
/// with what it holds of the q's (`drafted`): the tests, the bonus token where all K are
/// accepted, and a rejection's correction where each q is whole (a lookup's proposals are
/// point masses, whose residual is p without the draft). With probabilities alone, a
/// rejection leaves the correction to the caller, [`draw_correction`] with the random
/// stream where this left it: draw for draw the same as [`verify_sampling`].
///
/// `p(i)` gives the target's distribution at position `i` (0..=K), asked for only as far
/// as the tests go (a rejection ends them), so rows after it need never be computed; the
/// last one asked for, the rejected draft's or the bonus position's, comes back with the
/// verdict.
pub fn test_sampled<'p, E: From<VerifyError>>(
    draft: &[u32],
    drafted: Drafted<'_>,
    mut p: impl FnMut(usize) -> Result<Cow<'p, Distribution>, E>,
    rng: &mut impl Rng,
) -> Result<(Tested, Cow<'p, Distribution>), E> {
    let k = draft.len();
    if drafted.len() != k {
        let actual = drafted.len();
        return Err(VerifyError::DraftDistributionsLength {
            expected: k,
            actual,
        }
        .into());
    }
    for (i, &x) in draft.iter().enumerate() {
        let (p_i, q_x) = (p(i)?, drafted.prob(i, x));
        // Drawing even when acceptance is certain (p >= q) fixes RNG use at one uniform per
        // examined position, which keeps seeded replays easy to reason about.
        let u = uniform01(rng);
        if u * f64::from(q_x) < f64::from(p_i.prob(x)) {
            continue;
        }
        let token = match drafted {
            Drafted::Whole(q) => Some(draw_correction(&p_i, &q[i], rng)),
            Drafted::Probabilities(_) => None,
        };
        return Ok((Tested { accepted: i, token }, p_i));
    }
    let p_k = p(k)?;
    let token = Some(p_k.sample(rng));
    Ok((Tested { accepted: k, token }, p_k))
}

/// Distributions already at hand, for [`test_sampled`]: position `i` is `p[i]`, and one
/// past them is a length error.
pub fn rows<'p>(
    p: &'p [Distribution],
) -> impl FnMut(usize) -> Result<Cow<'p, Distribution>, VerifyError> {
    move |i| match p.get(i) {
        Some(p_i) => Ok(Cow::Borrowed(p_i)),
        None => Err(VerifyError::TargetDistributionsLength {
            expected: i + 1,
            actual: p.len(),
        }),
    }
}

/// The correction after a draft drawn from `q` was rejected where the target's
/// distribution is `p`: drawn from their residual, or from `p` where rounding leaves none.
pub fn draw_correction(p: &Distribution, q: &Distribution, rng: &mut impl Rng) -> u32 {
    match residual(p, q) {
        Some(r) => r.sample(rng),
        None => p.sample(rng),
    }
}

/// Multi-candidate speculative sampling over a tree of drafts (SpecInfer's recursive
/// rejection): from the last committed token, the children of the current node (drafts `j`
/// with `parents[j]` equal to it, in draft order) are tried in turn against the target's
/// distribution there, each accepted with probability `min(1, r(x) / q(x))`, where `r` starts
/// as the node's `p` and after each rejection becomes `normalize(max(0, r - q))`; an
/// accepted child becomes the current node; where none is accepted, the token is drawn
/// from `r`. The committed tokens are distributed exactly as the target's own, provided the
/// children of each node were drawn independently from one distribution, `q[j]` for each of
/// them (the draft's at that position). `p[0]` is the target's distribution after the last
/// committed token, `p[j + 1]` after draft `j`'s path. Returns the accepted drafts, in
/// order, and the token after them. One uniform is drawn per child tried: for a chain
/// (`parents[j] = j`) this is [`verify_sampling`], draw for draw.
pub fn verify_sampling_tree(
    draft: &[u32],
    parents: &[u32],
    q: &[&Distribution],
    p: &[Distribution],
    rng: &mut impl Rng,
) -> Result<(Vec<usize>, u32), VerifyError> {
    check_parents(draft, parents)?;
    let k = draft.len();
    check_distributions(k, q.len(), p.len())?;
    let mut path = Vec::new();
    let mut at = 0;
    'node: loop {
        let mut r = std::borrow::Cow::Borrowed(&p[at]);
        for j in (0..k).filter(|&j| parents[j] as usize == at) {
            let (x, q_j) = (draft[j], q[j]);
            let u = uniform01(rng);
            if u * f64::from(q_j.prob(x)) < f64::from(r.prob(x)) {
                path.push(j);
                at = j + 1;
                continue 'node;
            }
            // Equal distributions leave no residual: r is then q, and the next child is
            // accepted.
            if let Some(rest) = residual(&r, q_j) {
                r = std::borrow::Cow::Owned(rest);
            }
        }
        return Ok((path, r.sample(rng)));
    }
}

/// `k` drafts need `k` draft distributions and `k + 1` target ones.
fn check_distributions(k: usize, q: usize, p: usize) -> Result<(), VerifyError> {
    if q != k {
        return Err(VerifyError::DraftDistributionsLength {
            expected: k,
            actual: q,
        });
    }
    if p != k + 1 {
        return Err(VerifyError::TargetDistributionsLength {
            expected: k + 1,
            actual: p,
        });
    }
    Ok(())
}

fn check_parents(draft: &[u32], parents: &[u32]) -> Result<(), VerifyError> {
    match parents.len() == draft.len() {
        true => Ok(()),
        false => Err(VerifyError::ParentsLength {
            expected: draft.len(),
            actual: parents.len(),
        }),
    }
}

/// `normalize(max(0, p - q))`, the distribution of the correction token after a rejection.
///
/// Computed by one merge walk over the two sorted supports. Returns `None` when no token has
/// `p > q`, which for two normalized distributions means they are equal up to rounding.
pub fn residual(p: &Distribution, q: &Distribution) -> Option<Distribution> {
    let (p_ids, p_probs) = (p.ids(), p.probs());
    let (q_ids, q_probs) = (q.ids(), q.probs());
    let mut pairs = Vec::with_capacity(p_ids.len());
    let mut j = 0;
    for (&token, &p_x) in p_ids.iter().zip(p_probs) {
        while j < q_ids.len() && q_ids[j] < token {
            j += 1;
        }
        let q_x = if j < q_ids.len() && q_ids[j] == token {
            q_probs[j]
        } else {
            0.0
        };
        // In f64 no difference of two distinct f32 values underflows, so diff > 0 exactly
        // when p(x) > q(x).
        let diff = f64::from(p_x) - f64::from(q_x);
        if diff > 0.0 {
            pairs.push((token, diff));
        }
    }
    Distribution::from_sorted_weights(pairs)
}

#[cfg(test)]
mod tests;
