//! A row's greedy choice without the row: its argmax and that token's probability, from a
//! summary of the row (the argmax, the maximum and the softmax's denominator). On CUDA the
//! GPU summarises each row, so a greedy pass copies 12 bytes a row to the host instead of
//! the vocabulary's logits (600 KB a row for a 152k vocabulary); a shortlisted draft's
//! extra ids, projected apart, merge in as a second summary.

// Without the `cuda` feature only `Greedy` and the tests use this.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

use crate::sampling::{SamplingError, argmax_probability};

/// A row's greedy token and its probability under the row's softmax (temperature 1).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Greedy {
    pub token: u32,
    pub probability: f32,
}

impl Greedy {
    /// From a whole row of logits (`sampling::argmax_probability`).
    pub fn of_row(row: &[f32]) -> Result<Self, SamplingError> {
        let (token, probability) = argmax_probability(row)?;
        Ok(Self { token, probability })
    }
}

/// Logits this far below the largest are left out of the denominator, as
/// `sampling::argmax_probability` leaves them out (each adds under e^-24).
pub(crate) const NEGLIGIBLE_LOGIT: f32 = 24.0;

/// Part of a row, summarised: the token of its largest logit (on a tie the lowest id; NaN
/// never wins, -inf is never chosen; `None` when no logit is usable), that logit, and the
/// sum of exp(x - max) over its logits within [`NEGLIGIBLE_LOGIT`] of it (where the maximum
/// is +inf: how many logits are +inf).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Summary {
    pub(crate) token: Option<u32>,
    pub(crate) max: f32,
    pub(crate) sum: f32,
}

impl Summary {
    /// What `cuda_step/kernels.cu`'s `duet_greedy` writes for a row: the index's bits (-1: none),
    /// the maximum and the sum; the index maps to a token id through `id`.
    pub(crate) fn from_kernel([index, max, sum]: [f32; 3], id: impl Fn(usize) -> u32) -> Self {
        let index = index.to_bits() as i32;
        Self {
            token: usize::try_from(index).ok().map(id),
            max,
            sum,
        }
    }

    /// The summary of `logits`, whose i-th entry is token `id(i)`'s.
    pub(crate) fn of(logits: &[f32], id: impl Fn(usize) -> u32) -> Self {
        let mut best: Option<(u32, f32)> = None;
        for (i, &x) in logits.iter().enumerate() {
            let better = match best {
                None => x > f32::NEG_INFINITY,
                Some((token, max)) => x > max || (x == max && id(i) < token),
            };
            if better {
                best = Some((id(i), x));
            }
        }
        let Some((token, max)) = best else {
            return Self {
                token: None,
                max: f32::NEG_INFINITY,
                sum: 0.0,
            };
        };
        let sum = if max == f32::INFINITY {
            logits.iter().filter(|&&x| x == f32::INFINITY).count() as f32
        } else {
            let floor = max - NEGLIGIBLE_LOGIT;
            logits
                .iter()
                .filter(|&&x| x > floor)
                .map(|&x| (x - max).exp())
                .sum()
        };
        Self {
            token: Some(token),
            max,
            sum,
        }
    }

    /// The summary of a row made of two disjoint parts: the larger maximum (on a tie the
    /// lower token id), the other part's sum rescaled to it.
    pub(crate) fn merge(self, other: Self) -> Self {
        let (Some(a), Some(b)) = (self.token, other.token) else {
            return if self.token.is_some() { self } else { other };
        };
        let (high, low) = match other.max > self.max || (other.max == self.max && b < a) {
            true => (other, self),
            false => (self, other),
        };
        let sum = match (high.max == f32::INFINITY, low.max == f32::INFINITY) {
            (true, true) => high.sum + low.sum,
            (true, false) => high.sum,
            _ if low.max < high.max - NEGLIGIBLE_LOGIT => high.sum,
            _ => high.sum + low.sum * (low.max - high.max).exp(),
        };
        Self { sum, ..high }
    }

    pub(crate) fn greedy(self) -> Result<Greedy, SamplingError> {
        let token = self.token.ok_or(SamplingError::NoUsableLogits)?;
        Ok(Greedy {
            token,
            probability: 1.0 / self.sum,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f32, b: f32) -> bool {
        (a - b).abs() <= 1e-6 * b.abs().max(1.0)
    }

    #[test]
    fn a_summary_gives_what_the_whole_row_gives() {
        let rows: [&[f32]; 5] = [
            &[0.5, 2.0, -1.0, 2.0, f32::NAN],
            &[f32::NEG_INFINITY, -3.0, -40.0, -3.5],
            &[1.0, f32::INFINITY, 0.0, f32::INFINITY],
            &[7.0],
            &[-1.0, 30.0, 29.0, 0.0, 5.0],
        ];
        for row in rows {
            let want = Greedy::of_row(row).unwrap();
            let got = Summary::of(row, |i| i as u32).greedy().unwrap();
            assert_eq!(got.token, want.token, "{row:?}");
            assert!(close(got.probability, want.probability), "{row:?}");
        }
        let none = Summary::of(&[f32::NAN, f32::NEG_INFINITY], |i| i as u32);
        assert_eq!(none.token, None);
        assert_eq!(none.greedy(), Err(SamplingError::NoUsableLogits));
    }

    /// A shortlisted row (some ids) and its extra ids (others), merged, choose the token
    /// and probability of the whole row, ties going to the lower id as `argmax` does.
    #[test]
    fn merged_parts_give_what_the_whole_row_gives() {
        let row = [1.0f32, 4.0, -2.0, 4.0, 3.5, f32::NAN, 0.25, -30.0];
        let splits: [&[usize]; 4] = [&[0, 1, 2], &[3, 4, 6], &[5, 7], &[0, 2, 4, 5, 6, 7]];
        let want = Greedy::of_row(&row).unwrap();
        for ids in splits {
            let rest: Vec<usize> = (0..row.len()).filter(|i| !ids.contains(i)).collect();
            let part = |ids: &[usize]| {
                let values: Vec<f32> = ids.iter().map(|&i| row[i]).collect();
                Summary::of(&values, |j| ids[j] as u32)
            };
            for merged in [part(ids).merge(part(&rest)), part(&rest).merge(part(ids))] {
                let got = merged.greedy().unwrap();
                assert_eq!(got.token, want.token, "{ids:?}");
                assert!(close(got.probability, want.probability), "{ids:?}");
            }
        }
        // Infinite maxima count, finite parts drop out.
        let inf = Summary::of(&[f32::INFINITY, 1.0], |i| 10 + i as u32);
        let also = Summary::of(&[f32::INFINITY], |_| 3);
        let merged = inf.merge(also);
        assert_eq!((merged.token, merged.sum), (Some(3), 2.0));
        let kernel = Summary::from_kernel([f32::from_bits(2), 1.5, 3.0], |i| [7, 8, 9][i]);
        assert_eq!(kernel.token, Some(9));
        let empty = Summary::from_kernel([f32::from_bits(u32::MAX), f32::NEG_INFINITY, 0.0], |i| {
            i as u32
        });
        assert_eq!(empty.token, None);
    }
}
