//! The algorithm of the CUDA step's `duet_draw` (`cuda_step/kernels.cu`), step for step on
//! the host: a block's threads each take a run of ids, top-k's and top-p's boundaries are
//! found bit by bit with counters (counts, or weights in fixed point), ties are ranked by
//! the runs before them, and the draw runs its sums run by run, from the residual after a
//! rejected draft where it has one (a lookup's point mass, or a draft model's q). Its token
//! is the host sampler's (`Draw::of_row`) but within rounding of an edge, for rows with
//! ties, NaN and -inf, every cut, uniforms across [0, 1) and a draft left out or none. And
//! `duet_propose`'s proposal is `proposal_distribution`'s but where the tail's floor falls
//! otherwise by rounding. On a GPU, forward.rs's
//! `drawn_rows_give_the_tokens_their_whole_rows_give` holds the kernels themselves to the
//! sampler.

use duet_engine::sampling::{
    Distribution, Draw, DrawFrom, Drawn, Excluded, PROPOSAL_TAIL, SamplingParams,
    proposal_distribution,
};
use duet_engine::testing::{check_drawn, check_proposal, draw_settings, logit_row as row};
use std::sync::Arc;

/// `DRAFTED_MAX`: the most tokens a proposal made on the GPU keeps.
const DRAFTED_MAX: usize = 8192;
/// `GREEDY_THREADS`: the kernel's block.
const THREADS: usize = 1024;
/// Top-p's weights are counted in units of 2^-40.
const FIXED: f64 = (1u64 << 40) as f64;

struct Row<'a> {
    x: &'a [f32],
    top: f32,
    params: SamplingParams,
    run: usize,
}

/// Of the weights at a cut's boundary, the first `ties` stay; `least` 0 keeps all.
#[derive(Clone, Copy)]
struct Cut {
    least: f32,
    ties: u64,
}

const ALL: Cut = Cut {
    least: 0.0,
    ties: 0,
};

impl Row<'_> {
    fn ids(&self, t: usize) -> std::ops::Range<usize> {
        let n = self.x.len();
        (t * self.run).min(n)..(t * self.run + self.run).min(n)
    }

    fn base_weight(&self, i: usize) -> f32 {
        let w = ((self.x[i] - self.top) / self.params.temperature).exp();
        if w >= f32::MIN_POSITIVE && w >= self.params.min_p {
            w
        } else {
            0.0
        }
    }

    /// Thread `t`'s weights after both cuts, from the ranks its run starts with.
    fn weights(&self, t: usize, cuts: &[Cut; 2], starts: [u64; 2]) -> Vec<f32> {
        let mut ranks = starts;
        let after = |w: f32, cut: Cut, rank: &mut u64| {
            if w > cut.least {
                return w;
            }
            if w > 0.0 && w == cut.least {
                *rank += 1;
                return if *rank <= cut.ties { w } else { 0.0 };
            }
            0.0
        };
        (self.ids(t))
            .map(|i| {
                let w = after(self.base_weight(i), cuts[0], &mut ranks[0]);
                after(w, cuts[1], &mut ranks[1])
            })
            .collect()
    }

    /// `least_reaching` of the kernel: 11, 10 and 10 bits at a time, from the top bucket.
    fn least_reaching(&self, cuts: &[Cut; 2], starts: &[[u64; 2]], mass: bool, need: u64) -> f32 {
        let (mut prefix, mut need) = (0u32, need);
        for (pass, (shift, width)) in [(20u32, 11u32), (10, 10), (0, 10)].into_iter().enumerate() {
            let mut hist = vec![0u64; 1 << width];
            for (t, &start) in starts.iter().enumerate() {
                for w in self.weights(t, cuts, start) {
                    let bits = w.to_bits();
                    if w > 0.0 && bits >> (shift + width) == prefix {
                        let count = if mass {
                            (f64::from(w) * FIXED) as u64
                        } else {
                            1
                        };
                        hist[((bits >> shift) & ((1 << width) - 1)) as usize] += count;
                    }
                }
            }
            let mut above = 0u64;
            let mut digit = None;
            for b in (0..hist.len()).rev() {
                if hist[b] > 0 && above + hist[b] >= need {
                    digit = Some(b);
                    need -= above;
                    break;
                }
                above += hist[b];
            }
            let digit = match (digit, hist.iter().position(|&h| h > 0)) {
                (Some(d), _) => d,
                (None, Some(lowest)) if pass > 0 => {
                    need = need.saturating_sub(above);
                    lowest
                }
                _ => return 0.0,
            };
            prefix = (prefix << width) | digit as u32;
        }
        f32::from_bits(prefix)
    }

    /// Each run's count of weights equal to `least` as the count of the runs before it.
    fn ties_before(&self, cuts: &[Cut; 2], starts: &[[u64; 2]], least: f32) -> Vec<u64> {
        let mut before = 0;
        (0..THREADS)
            .map(|t| {
                let at = before;
                before += (self.weights(t, cuts, starts[t]).iter())
                    .filter(|&&w| w == least)
                    .count() as u64;
                at
            })
            .collect()
    }
}

/// Every run's weights after `cuts`.
fn all(r: &Row<'_>, cuts: &[Cut; 2], starts: &[[u64; 2]]) -> Vec<f32> {
    (0..THREADS)
        .flat_map(|t| r.weights(t, cuts, starts[t]))
        .collect()
}

/// The kernel's `find_cuts`: the top-k cut, then the top-p cut, and each cut's ties before
/// each run.
fn find_cuts(r: &Row<'_>) -> ([Cut; 2], Vec<[u64; 2]>) {
    let (mut cuts, mut starts) = ([ALL; 2], vec![[0u64; 2]; THREADS]);
    let top_k = r.params.top_k;
    if top_k > 0 {
        let least = r.least_reaching(&cuts, &starts, false, top_k as u64);
        if least > 0.0 {
            let above = all(r, &cuts, &starts)
                .iter()
                .filter(|&&w| w > least)
                .count();
            let before = r.ties_before(&cuts, &starts, least);
            let ties = (top_k - above) as u64;
            cuts[0] = Cut { least, ties };
            starts.iter_mut().zip(before).for_each(|(s, b)| s[0] = b);
        }
    }
    if r.params.top_p < 1.0 {
        let sum: f64 = all(r, &cuts, &starts).iter().map(|&w| f64::from(w)).sum();
        let target = f64::from(r.params.top_p) * sum;
        let need = ((target * FIXED).ceil() as u64).max(1);
        let least = r.least_reaching(&cuts, &starts, true, need);
        if least > 0.0 {
            let above: f64 = (all(r, &cuts, &starts).iter())
                .filter(|&&w| w > least)
                .map(|&w| f64::from(w))
                .sum();
            let before = r.ties_before(&cuts, &starts, least);
            let ties = ((target - above) / f64::from(least)).ceil().max(1.0) as u64;
            cuts[1] = Cut { least, ties };
            starts.iter_mut().zip(before).for_each(|(s, b)| s[1] = b);
        }
    }
    (cuts, starts)
}

/// The kernels' `weigh`: every run's weights after both cuts, in id order; `None` where the
/// host must take the row.
fn weigh(x: &[f32], params: SamplingParams) -> Option<(Row<'_>, Vec<f32>)> {
    let usable = x.iter().copied().filter(|v| !v.is_nan());
    let top = usable.fold(f32::NEG_INFINITY, f32::max);
    if top.is_infinite() {
        return None;
    }
    let run = x.len().div_ceil(THREADS);
    let r = Row {
        x,
        top,
        params,
        run,
    };
    let (cuts, starts) = find_cuts(&r);
    let weights = all(&r, &cuts, &starts);
    Some((r, weights))
}

/// The sum of `weights` as the kernels add it: each run's, then the runs'.
fn runs_sum(r: &Row<'_>, weights: &[f32], keep: impl Fn(f32) -> bool) -> f64 {
    let kept = |run: &[f32]| -> f64 {
        run.iter()
            .filter(|&&w| keep(w))
            .map(|&w| f64::from(w))
            .sum()
    };
    weights.chunks(r.run.max(1)).map(kept).sum()
}

/// `duet_propose`: the weights above the highest of the tail's floors that leaves out at
/// most the tail's share, normalized; `None` where it leaves the proposal to the host.
fn kernel_proposal(x: &[f32], params: SamplingParams) -> Option<Distribution> {
    let (r, weights) = weigh(x, params)?;
    let total = runs_sum(&r, &weights, |_| true);
    let least = [1e-4, 1e-6, 1e-8].into_iter().find_map(|share| {
        let least = (share * total) as f32;
        let kept = runs_sum(&r, &weights, |w| w > least);
        (total - kept <= PROPOSAL_TAIL * total).then_some(least)
    })?;
    let kept = weights.iter().filter(|&&w| w > least).count();
    if kept == x.len() || kept > DRAFTED_MAX {
        return None;
    }
    let entries = (0u32..).zip(weights).filter(|&(_, w)| w > least);
    Some(Distribution::from_pairs(entries).unwrap())
}

/// The kernel's token, its probability and the excluded token's; `None` where it leaves the
/// draw to the host.
fn kernel_draw(x: &[f32], draw: &Draw) -> Option<Drawn> {
    let uniform = draw.uniform;
    let (r, weights) = weigh(x, draw.params)?;
    let scale = 1.0 / weights.iter().map(|&w| f64::from(w)).sum::<f64>();
    let p = |w: f32| (f64::from(w) * scale) as f32;
    // The residual after the excluded draft, max(0, p - q) over its total, q a point mass
    // on it or the distribution it was drawn from.
    let q = |i: usize| match draw.excluded() {
        Some(Excluded { from: Some(q), .. }) => f64::from(q.prob(i as u32)),
        Some(Excluded { token, .. }) if *token as usize == i => 1.0,
        _ => 0.0,
    };
    let residual = |i: usize, w: f32| (f64::from(p(w)) - q(i)).max(0.0);
    let excluded = (draw.excluded()).map_or(0.0, |x| p(weights[x.token as usize]));
    let rest: f64 = match draw.excluded() {
        Some(_) => (weights.iter().enumerate())
            .map(|(i, &w)| residual(i, w))
            .sum(),
        None => 0.0,
    };
    let probability = |i: usize, w: f32| match rest {
        ..=0.0 => p(w),
        _ => (residual(i, w) / rest) as f32,
    };
    let probs: Vec<Vec<f32>> = (0..THREADS)
        .map(|t| r.ids(t).map(|i| probability(i, weights[i])).collect())
        .collect();
    let sums: Vec<f64> = (probs.iter())
        .map(|run| run.iter().map(|&p| f64::from(p)).sum())
        .collect();
    let target = uniform * sums.iter().sum::<f64>();
    // The last run with mass that starts at or below the target.
    let (mut before, mut chosen) = (0.0, None);
    for (t, &s) in sums.iter().enumerate() {
        if s > 0.0 && before <= target {
            chosen = Some((t, before));
        }
        before += s;
    }
    let (t, mut running) = chosen?;
    let mut token = None;
    for (i, &p) in r.ids(t).zip(&probs[t]).filter(|&(_, &p)| p > 0.0) {
        token = Some(Drawn {
            token: i as u32,
            probability: p,
            excluded,
            proposal: None,
        });
        running += f64::from(p);
        if target < running {
            break;
        }
    }
    token
}

#[test]
fn the_kernels_draw_is_the_samplers_but_at_an_edge() {
    let (mut drawn, mut at_edges) = (0, 0);
    for (n, seed) in [(3000, 1), (5000, 2), (151_936, 3)] {
        let x = row(n, seed);
        // A draft model's q: another row's distribution without its tail, and its likeliest
        // token the draft.
        let other = row(n, seed + 10);
        for params in draw_settings() {
            let q = proposal_distribution(&other, &params).unwrap();
            let drafted = Excluded {
                token: q.iter().max_by(|a, b| a.1.total_cmp(&b.1)).unwrap().0,
                from: Some(Arc::new(q)),
            };
            // Each uniform plain, after the likeliest token as a lookup's draft, and after a
            // draft model's.
            let likeliest = Excluded::point(duet_engine::sampling::argmax(&x).unwrap());
            let froms = [
                DrawFrom::Row,
                DrawFrom::After(likeliest),
                DrawFrom::After(drafted),
            ];
            for (k, from) in (0..16).flat_map(|k| froms.clone().map(|f| (k, f))) {
                let draw = Draw {
                    params,
                    uniform: (k as f64 + 0.37) / 16.0,
                    from,
                };
                let got = kernel_draw(&x, &draw).unwrap();
                let at = format!("n {n}, {draw:?}");
                drawn += 1;
                at_edges += usize::from(check_drawn(&x, &draw, got, 1e-6, &at));
            }
        }
    }
    assert!(at_edges * 100 < drawn, "{at_edges} of {drawn} at edges");
}

#[test]
fn the_kernels_proposal_is_the_samplers_but_at_an_edge() {
    let (mut made, mut at_edges, mut left) = (0, 0, 0);
    for (n, seed) in [(3000, 1), (5000, 2), (151_936, 3)] {
        let x = row(n, seed);
        for params in draw_settings() {
            let want = proposal_distribution(&x, &params).unwrap();
            let at = format!("n {n}, {params:?}");
            match kernel_proposal(&x, params) {
                Some(got) => {
                    made += 1;
                    at_edges += usize::from(check_proposal(&got, &want, 1e-6, &at));
                }
                // Left to the host: every token kept, or more than the GPU keeps.
                None => {
                    assert!(
                        want.ids().len() == n || want.ids().len() > DRAFTED_MAX,
                        "{at}"
                    );
                    left += 1;
                }
            }
        }
    }
    assert!(
        made > 2 * left && at_edges * 10 < made,
        "{made} made, {left} left, {at_edges}"
    );
}
