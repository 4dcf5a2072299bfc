//! Passes over a row of logits eight lanes at a time (the `wide` crate's `f32x8`: AVX on
//! the x86-64-v3 target the workspace builds for). A vocabulary row is 152k entries, read
//! for every token a worker answers; one entry at a time its softmax costs a few percent
//! of a pass on a CPU (docs/benchmarks.md, "A row of logits read eight lanes at a time").
//! Results do not depend on the lanes: the max of a row is the same whichever order it is
//! taken in, each weight is computed on its own, and sums run in eight fixed lane
//! accumulators, so a row gives the same bits every call, alone or beside others.

use wide::{CmpGe, CmpGt, CmpLt, f32x8};

const LANES: usize = 8;

/// The row in chunks of eight, the last one padded with NaN (which every pass here treats
/// as an entry that does not count).
fn chunks(row: &[f32]) -> impl Iterator<Item = f32x8> + '_ {
    let exact = row.chunks_exact(LANES);
    let tail = exact.remainder();
    let full = exact.map(|c| f32x8::new(c.try_into().expect("eight lanes")));
    let padded = (!tail.is_empty()).then(|| {
        let mut lanes = [f32::NAN; LANES];
        lanes[..tail.len()].copy_from_slice(tail);
        f32x8::new(lanes)
    });
    full.chain(padded)
}

/// The largest entry that is not NaN (infinities count); -inf for a row of NaN alone.
pub(crate) fn max(row: &[f32]) -> f32 {
    let low = f32x8::splat(f32::NEG_INFINITY);
    let lanes = chunks(row).fold(low, |m, x| m.max(x.is_nan().blend(low, x)));
    lanes
        .to_array()
        .into_iter()
        .fold(f32::NEG_INFINITY, f32::max)
}

/// `exp((x - max) / temperature)` for each entry `x` of a row whose finite entries are at
/// most `max`: the softmax's weights before normalizing. Non-finite entries weigh 0, and
/// so do entries whose weight is below f32's normal range (under 1.2e-38 of the max's).
/// Subtracting before dividing keeps every argument at or below 0, so no temperature
/// overflows it to NaN.
pub(crate) fn exp_weights(row: &[f32], max: f32, temperature: f32) -> Vec<f32> {
    let (max, temperature) = (f32x8::splat(max), f32x8::splat(temperature));
    let mut weights = Vec::with_capacity(row.len().next_multiple_of(LANES));
    for x in chunks(row) {
        // `exp` is 0 for non-finite arguments: a NaN, and -inf's x - max, weigh nothing.
        weights.extend_from_slice(&((x - max) / temperature).exp().to_array());
    }
    weights.truncate(row.len());
    weights
}

/// The sum of `exp(x - max)` over the entries `x` above `max - below` (temperature 1): a
/// softmax's denominator without the entries too small to move it.
pub(crate) fn exp_sum_above(row: &[f32], max: f32, below: f32) -> f32 {
    let (max, floor) = (f32x8::splat(max), f32x8::splat(max - below));
    let zero = f32x8::splat(0.0);
    let lanes = chunks(row).fold(zero, |sum, x| {
        // NaN fails the comparison, so it adds nothing.
        sum + x.cmp_gt(floor).blend((x - max).exp(), zero)
    });
    lanes.to_array().into_iter().sum()
}

/// Whether every entry is finite and >= 0.
pub(crate) fn all_probabilities(row: &[f32]) -> bool {
    let (zero, infinity) = (f32x8::splat(0.0), f32x8::splat(f32::INFINITY));
    let exact = row.chunks_exact(LANES);
    let tail = exact.remainder();
    // NaN fails both comparisons.
    let good = |x: f32x8| x.cmp_ge(zero) & x.cmp_lt(infinity);
    let lanes = exact.fold(good(zero), |all, c| {
        all & good(f32x8::new(c.try_into().expect("eight lanes")))
    });
    lanes.move_mask() == 0xFF && tail.iter().all(|p| p.is_finite() && *p >= 0.0)
}

/// The sum of non-negative weights, in f64, in eight fixed lane accumulators.
pub(crate) fn sum(weights: &[f32]) -> f64 {
    sum_above(weights, -1.0)
}

/// The sum of the weights above `least`, as [`sum`] adds them.
pub(crate) fn sum_above(weights: &[f32], least: f32) -> f64 {
    let mut lanes = [0.0f64; LANES];
    let mut exact = weights.chunks_exact(LANES);
    for chunk in exact.by_ref() {
        for (lane, &w) in lanes.iter_mut().zip(chunk) {
            *lane += if w > least { f64::from(w) } else { 0.0 };
        }
    }
    let tail = exact.remainder().iter().filter(|&&w| w > least);
    lanes.iter().sum::<f64>() + tail.map(|&w| f64::from(w)).sum::<f64>()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_max_skips_nan_and_counts_infinities() {
        assert_eq!(max(&[]), f32::NEG_INFINITY);
        assert_eq!(max(&[f32::NAN; 11]), f32::NEG_INFINITY);
        let mut row: Vec<f32> = (0..37).map(|i| (i as f32 * 0.37).sin()).collect();
        let want = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        assert_eq!(max(&row), want);
        row[36] = 5.0; // in the padded tail
        assert_eq!(max(&row), 5.0);
        row[3] = f32::NAN;
        row[9] = f32::INFINITY;
        assert_eq!(max(&row), f32::INFINITY);
    }

    #[test]
    fn weights_are_the_softmax_numerators_and_non_finite_entries_weigh_nothing() {
        let row = [
            1.0f32,
            -2.0,
            f32::NAN,
            f32::NEG_INFINITY,
            0.5,
            -300.0,
            1.0,
            0.0,
            -1.0,
            2.0,
        ];
        let weights = exp_weights(&row, 2.0, 0.7);
        assert_eq!(weights.len(), row.len());
        for (&x, &w) in row.iter().zip(&weights) {
            let want = match x.is_finite() {
                true => ((f64::from(x) - 2.0) / 0.7).exp(),
                false => 0.0,
            };
            // Below f32's normal range (-300's e^-431) a weight is 0.
            assert!(
                (f64::from(w) - want).abs() <= 1e-6 * want + 1e-38,
                "{x}: {w} vs {want}"
            );
        }
        assert_eq!(weights[9], 1.0);
        assert_eq!(weights[5], 0.0);
        // A tiny temperature leaves the max alone at 1 (no 0 / 0).
        assert_eq!(exp_weights(&[1.0, 2.0], 2.0, 1e-30), vec![0.0, 1.0]);
        let total = sum(&weights);
        let want: f64 = weights.iter().map(|&w| f64::from(w)).sum();
        assert!((total - want).abs() < 1e-12);
    }

    #[test]
    fn probabilities_are_finite_and_not_negative() {
        let mut row = vec![0.25f32; 19];
        assert!(all_probabilities(&row) && all_probabilities(&[]));
        for (at, bad) in [(3, -0.0001), (17, f32::NAN), (18, f32::INFINITY), (0, -0.0)] {
            let was = std::mem::replace(&mut row[at], bad);
            // -0.0 compares equal to 0.
            assert_eq!(all_probabilities(&row), bad == 0.0, "{bad} at {at}");
            row[at] = was;
        }
    }

    #[test]
    fn the_sum_above_a_floor_leaves_out_what_is_below_it() {
        let row = [0.0f32, -1.0, -30.0, f32::NAN, -2.0, 0.0, -23.0, -25.0, 0.0];
        let want: f32 = [0.0f32, -1.0, -2.0, 0.0, -23.0, 0.0]
            .iter()
            .map(|x| x.exp())
            .sum();
        let got = exp_sum_above(&row, 0.0, 24.0);
        assert!((got - want).abs() < 1e-6, "{got} vs {want}");
    }
}
