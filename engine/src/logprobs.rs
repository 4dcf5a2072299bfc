//! What a caller asking for log-probabilities gets for each committed token: the token's
//! log-probability under the model's own distribution at that position (the softmax of the
//! row's logits at temperature 1, before any temperature, top-k or top-p), and the most
//! likely tokens' there. A row's logits do not depend on the rows beside it, so a token's
//! figures are the same whichever way speculation reached it.

use crate::sampling::SamplingError;
use crate::scan;

/// The most alternatives a token may carry (OpenAI's `top_logprobs` bound).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// One committed token's log-probability and the `top` most likely tokens' at its position
/// (most likely first, the lower id on a tie).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TokenLogprobs {
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// `token`'s log-probability in `row` and the `top` (at most [`MAX_TOP_LOGPROBS`]) most
/// likely tokens' (ids whose logit is NaN or -inf have none and are never among them).
pub fn token_logprobs(row: &[f32], token: u32, top: usize) -> Result<TokenLogprobs, SamplingError> {
    let max = scan::max(row);
    if !max.is_finite() {
        // -inf: nothing usable; +inf: a softmax without a meaning.
        return Err(SamplingError::NoUsableLogits);
    }
    // Every entry above -inf counts: the exact denominator, not the greedy path's
    // shortcut over the entries near the largest.
    let log_denominator = max + scan::exp_sum_above(row, max, f32::INFINITY).ln();
    let of = |logit: f32| match logit > f32::NEG_INFINITY {
        true => logit - log_denominator,
        false => f32::NEG_INFINITY,
    };
    let logit = *row
        .get(token as usize)
        .ok_or(SamplingError::TokenOutsideRow {
            token,
            vocab: row.len(),
        })?;
    Ok(TokenLogprobs {
        logprob: of(logit),
        top: most_likely(row, top.min(MAX_TOP_LOGPROBS))
            .into_iter()
            .map(|(id, logit)| (id, of(logit)))
            .collect(),
    })
}

/// The `n` largest usable logits with their ids, largest first, the lower id on a tie:
/// one pass over the row, keeping the best `n` in order.
fn most_likely(row: &[f32], n: usize) -> Vec<(u32, f32)> {
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(n + 1);
    if n == 0 {
        return best;
    }
    for (id, &logit) in (0u32..).zip(row) {
        // NaN fails both comparisons; a later id never displaces an equal logit.
        let beats_last = best.len() < n || best.last().is_some_and(|&(_, l)| logit > l);
        if logit > f32::NEG_INFINITY && beats_last {
            let at = best.partition_point(|&(_, l)| l >= logit);
            best.insert(at, (id, logit));
            best.truncate(n);
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tokens_logprob_is_its_log_softmax_and_the_top_come_most_likely_first() {
        let row = [1.0f32, 3.0, f32::NAN, 3.0, f32::NEG_INFINITY, 2.0];
        let lse = (1f64.exp() + 2.0 * 3f64.exp() + 2f64.exp()).ln();
        let got = token_logprobs(&row, 5, 3).unwrap();
        assert!((f64::from(got.logprob) - (2.0 - lse)).abs() < 1e-6);
        let ids: Vec<u32> = got.top.iter().map(|&(id, _)| id).collect();
        // The tie between ids 1 and 3 goes to the lower id; NaN and -inf never count.
        assert_eq!(ids, [1, 3, 5]);
        assert_eq!(got.top[2].1, got.logprob);
        assert!((f64::from(got.top[0].1) - (3.0 - lse)).abs() < 1e-6);
        let minus_inf = token_logprobs(&row, 4, 0).unwrap();
        assert_eq!(
            minus_inf,
            TokenLogprobs {
                logprob: f32::NEG_INFINITY,
                top: vec![]
            }
        );
    }

    #[test]
    fn the_top_stops_at_the_usable_logits_and_at_the_bound() {
        let row: Vec<f32> = (0..40).map(|i| i as f32 / 10.0).collect();
        let got = token_logprobs(&row, 0, 100).unwrap();
        let ids: Vec<u32> = got.top.iter().map(|&(id, _)| id).collect();
        assert_eq!(ids, (20..40).rev().collect::<Vec<u32>>());
        let few = token_logprobs(&[0.0, f32::NEG_INFINITY, 1.0], 2, 5).unwrap();
        assert_eq!(
            few.top.iter().map(|&(id, _)| id).collect::<Vec<_>>(),
            [2, 0]
        );
    }

    #[test]
    fn rows_without_a_usable_maximum_are_refused() {
        let none = [f32::NAN, f32::NEG_INFINITY];
        assert_eq!(
            token_logprobs(&none, 0, 1),
            Err(SamplingError::NoUsableLogits)
        );
        let inf = [0.0, f32::INFINITY];
        assert_eq!(
            token_logprobs(&inf, 0, 1),
            Err(SamplingError::NoUsableLogits)
        );
        let outside = SamplingError::TokenOutsideRow { token: 3, vocab: 1 };
        assert_eq!(token_logprobs(&[0.0], 3, 0), Err(outside));
    }
}
