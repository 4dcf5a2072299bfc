use std::slice;

use super::*;
use crate::sampling::rng_for;

#[test]
fn a_tree_accepts_the_path_the_target_takes() {
    // Chain 10, 11, 12; 20 beside 11 (after 10); 30 beside 10 (after the root).
    let draft = [10, 11, 12, 20, 30];
    let parents = [0, 1, 2, 1, 0];
    // Argmax after: root, 10, 11, 12, 20, 30.
    let t = |a: [u32; 6]| verify_greedy_tree(&draft, &parents, &a).unwrap();
    assert_eq!(t([10, 11, 12, 99, 0, 0]), (vec![0, 1, 2], 99));
    assert_eq!(t([10, 20, 0, 0, 7, 0]), (vec![0, 3], 7));
    assert_eq!(t([30, 0, 0, 0, 0, 5]), (vec![4], 5));
    assert_eq!(t([40, 0, 0, 0, 0, 0]), (vec![], 40));
    // A chain is verify_greedy.
    let chain = [1, 2, 3];
    let argmax = [1, 2, 9, 4];
    let v = verify_greedy(&chain, &argmax).unwrap();
    let (path, token) = verify_greedy_tree(&chain, &[0, 1, 2], &argmax).unwrap();
    assert_eq!((path.len(), token), (v.accepted, v.token));
    assert!(verify_greedy_tree(&chain, &[0, 1], &argmax).is_err());
}
use crate::sampling::test_stats::assert_fits;
use rand::RngCore;

fn dist(weights: &[f32]) -> Distribution {
    Distribution::from_pairs((0u32..).zip(weights.iter().copied())).unwrap()
}

fn as_f64(d: &Distribution, vocab: usize) -> Vec<f64> {
    (0..vocab as u32).map(|t| f64::from(d.prob(t))).collect()
}

#[test]
fn verify_greedy_lengths_and_edges() {
    assert_eq!(
        verify_greedy(&[1, 2], &[1, 2]),
        Err(VerifyError::TargetArgmaxLength {
            expected: 3,
            actual: 2
        })
    );
    assert!(verify_greedy(&[], &[]).is_err());
    let v = verify_greedy(&[], &[9]).unwrap();
    assert_eq!(
        v,
        Verdict {
            accepted: 0,
            token: 9
        }
    );
    let v = verify_greedy(&[4, 5, 6], &[4, 5, 6, 7]).unwrap();
    assert_eq!(
        v,
        Verdict {
            accepted: 3,
            token: 7
        }
    );
    assert_eq!(v.committed(&[4, 5, 6]), vec![4, 5, 6, 7]);
}

#[test]
fn verify_greedy_mismatch_at_each_position() {
    let draft = [10, 11, 12, 13];
    for miss in 0..draft.len() {
        let mut target = vec![10, 11, 12, 13, 14];
        target[miss] = 99;
        // Positions after the mismatch must be ignored even if they would match.
        let v = verify_greedy(&draft, &target).unwrap();
        assert_eq!(
            v,
            Verdict {
                accepted: miss,
                token: 99
            },
            "miss at {miss}"
        );
        let mut expected = draft[..miss].to_vec();
        expected.push(99);
        assert_eq!(v.committed(&draft), expected);
    }
}

#[test]
fn verify_sampling_length_errors() {
    let d = dist(&[0.5, 0.5]);
    let mut rng = rng_for(0);
    assert_eq!(
        verify_sampling(&[0], &[], &[d.clone(), d.clone()], &mut rng),
        Err(VerifyError::DraftDistributionsLength {
            expected: 1,
            actual: 0
        })
    );
    assert_eq!(
        verify_sampling(&[0], slice::from_ref(&d), slice::from_ref(&d), &mut rng),
        Err(VerifyError::TargetDistributionsLength {
            expected: 2,
            actual: 1
        })
    );
    assert!(verify_sampling(&[], &[], &[], &mut rng).is_err());
}

#[test]
fn verify_sampling_k0_draws_bonus_from_p0() {
    let p = dist(&[0.2, 0.0, 0.5, 0.3]);
    let mut rng = rng_for(5);
    let mut counts = [0u64; 4];
    for _ in 0..100_000 {
        let v = verify_sampling(&[], &[], slice::from_ref(&p), &mut rng).unwrap();
        assert_eq!(v.accepted, 0);
        counts[v.token as usize] += 1;
    }
    assert_fits(&counts, &as_f64(&p, 4), 0.01, "k=0");
}

#[test]
fn verify_sampling_accepts_all_when_p_covers_q() {
    // p(x) >= q(x) for every drafted token: acceptance is certain; bonus comes from p[K].
    let q = Distribution::point(1);
    let p = dist(&[0.0, 1.0]);
    let bonus = Distribution::point(3);
    let mut rng = rng_for(9);
    let v = verify_sampling(&[1, 1], &[q.clone(), q], &[p.clone(), p, bonus], &mut rng).unwrap();
    assert_eq!(
        v,
        Verdict {
            accepted: 2,
            token: 3
        }
    );
}

#[test]
fn verify_sampling_first_rejected_uses_residual() {
    // p gives the drafted token 0 probability: always rejected at position 0, and the
    // correction comes from p minus q, which excludes token 0 entirely.
    let q = dist(&[0.5, 0.5, 0.0]);
    let p = dist(&[0.0, 0.25, 0.75]);
    let mut rng = rng_for(3);
    for _ in 0..1000 {
        let v = verify_sampling(
            &[0, 1],
            &[q.clone(), q.clone()],
            &[p.clone(), p.clone(), p.clone()],
            &mut rng,
        )
        .unwrap();
        assert_eq!(
            v,
            Verdict {
                accepted: 0,
                token: 2
            }
        );
    }
}

#[test]
fn verify_sampling_zero_q_accepts_when_p_positive() {
    let q = Distribution::point(0);
    let p = dist(&[0.5, 0.5]);
    let mut rng = rng_for(4);
    for _ in 0..1000 {
        let v =
            verify_sampling(&[1], slice::from_ref(&q), &[p.clone(), p.clone()], &mut rng).unwrap();
        assert_eq!(v.accepted, 1);
    }
}

#[test]
fn verify_residual_cases() {
    let p = dist(&[0.5, 0.3, 0.2, 0.0]);
    assert_eq!(residual(&p, &p), None);
    let q = dist(&[0.2, 0.3, 0.1, 0.4]);
    let r = residual(&p, &q).unwrap();
    // max(0, p - q) = [0.3, 0, 0.1, 0] -> [0.75, 0, 0.25, 0].
    assert_eq!(r.ids(), &[0, 2]);
    assert!((r.prob(0) - 0.75).abs() < 1e-6 && (r.prob(2) - 0.25).abs() < 1e-6);
    // Disjoint supports: the residual is p itself.
    let r = residual(&dist(&[0.0, 0.0, 0.6, 0.4]), &dist(&[0.7, 0.3])).unwrap();
    assert_eq!(r.ids(), &[2, 3]);
    assert!((r.prob(2) - 0.6).abs() < 1e-6);
}

#[test]
fn verify_point_masses_agree_with_greedy() {
    let mut rng = rng_for(77);
    let mut cases_rng = rng_for(78);
    for _ in 0..2000 {
        let k = (cases_rng.next_u32() % 5) as usize;
        // A 3-token vocabulary makes matches and mismatches both common.
        let draft: Vec<u32> = (0..k).map(|_| cases_rng.next_u32() % 3).collect();
        let argmax: Vec<u32> = (0..=k).map(|_| cases_rng.next_u32() % 3).collect();
        let q: Vec<_> = draft.iter().map(|&t| Distribution::point(t)).collect();
        let p: Vec<_> = argmax.iter().map(|&t| Distribution::point(t)).collect();
        let greedy = verify_greedy(&draft, &argmax).unwrap();
        let sampled = verify_sampling(&draft, &q, &p, &mut rng).unwrap();
        assert_eq!(greedy, sampled, "draft {draft:?} argmax {argmax:?}");
    }
}

const TRIALS: usize = 200_000;

/// First committed token of K = 1 rounds with the draft token drawn from `q`.
fn first_token_counts(q: &Distribution, p: &Distribution, vocab: usize, seed: u64) -> Vec<u64> {
    let mut rng = rng_for(seed);
    let qs = slice::from_ref(q);
    // The bonus distribution is deliberately unrelated: it must not leak into token one.
    let ps = [p.clone(), Distribution::point(vocab as u32 - 1)];
    let mut counts = vec![0u64; vocab];
    for _ in 0..TRIALS {
        let x = q.sample(&mut rng);
        let v = verify_sampling(&[x], qs, &ps, &mut rng).unwrap();
        counts[v.committed(&[x])[0] as usize] += 1;
    }
    counts
}

const P6: [f32; 6] = [0.1, 0.35, 0.05, 0.2, 0.3, 0.0];

/// `(label, q, p)`: draft and target distributions over small vocabularies.
const STATISTICAL_CASES: [(&str, &[f32], &[f32]); 8] = [
    ("q = p", &P6, &P6),
    ("q disjoint from p", &[0.0, 0.0, 0.0, 0.0, 0.0, 1.0], &P6),
    (
        "q zero where p positive",
        &[0.5, 0.0, 0.0, 0.0, 0.5, 0.0],
        &P6,
    ),
    (
        "q nonzero where p zero",
        &[0.3, 0.1, 0.1, 0.1, 0.1, 0.3],
        &P6,
    ),
    (
        "q peaked, p flat",
        &[0.01, 0.01, 0.9, 0.03, 0.03, 0.02],
        &[1.0; 6],
    ),
    (
        "q flat, p peaked",
        &[1.0; 8],
        &[0.02, 0.02, 0.8, 0.04, 0.04, 0.04, 0.02, 0.02],
    ),
    // p/q = 0.011 at token 0: the acceptance test must resolve small ratios.
    ("p tiny where q large", &[0.9, 0.1, 0.0], &[0.01, 0.9, 0.09]),
    (
        "p point mass",
        &[0.25, 0.25, 0.25, 0.25],
        &[0.0, 0.0, 1.0, 0.0],
    ),
];

#[test]
fn verify_sampling_first_token_follows_p() {
    for (seed, (label, q, p)) in (100u64..).zip(STATISTICAL_CASES) {
        let vocab = q.len().max(p.len());
        let (q, p) = (dist(q), dist(p));
        let counts = first_token_counts(&q, &p, vocab, seed);
        assert_fits(&counts, &as_f64(&p, vocab), 0.01, label);
    }
}

/// A draft drawn from a proposal without its tail (tokens the target may well want,
/// at q = 0 now) still commits the target's distribution: accepted with `min(p, q)`,
/// corrected from the residual with the rest, exactly, and so drawn.
#[test]
fn a_proposal_without_its_tail_commits_p() {
    use crate::sampling::{SamplingParams, process_logits, proposal_distribution};
    let params = SamplingParams {
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        seed: 0,
    };
    let vocab = 12;
    let draft: Vec<f32> = (0..vocab)
        .map(|i| if i < 3 { 0.0 } else { -15.0 })
        .collect();
    let target: Vec<f32> = (0..vocab).map(|i| (i % 7) as f32 * 0.3).collect();
    let q = proposal_distribution(&draft, &params).unwrap();
    assert_eq!(q.ids(), &[0, 1, 2]);
    let p = process_logits(&target, &params).unwrap();
    let both = |t: u32| f64::from(p.prob(t).min(q.prob(t)));
    let overlap: f64 = (0..vocab as u32).map(both).sum();
    let r = residual(&p, &q).unwrap();
    for t in 0..vocab as u32 {
        let committed = both(t) + (1.0 - overlap) * f64::from(r.prob(t));
        assert!((committed - f64::from(p.prob(t))).abs() < 1e-6, "token {t}");
    }
    let counts = first_token_counts(&q, &p, vocab, 300);
    assert_fits(&counts, &as_f64(&p, vocab), 0.01, "without the tail");
}

/// Prompt lookup drafts a fixed token: q is a point mass on it, whatever p gives it.
/// The committed token must still follow p, for every drafted token in turn.
#[test]
fn verify_sampling_a_fixed_draft_token_still_gives_p() {
    let p = dist(&P6);
    for (seed, token) in (200u64..).zip(0..P6.len() as u32) {
        let q = Distribution::point(token);
        let counts = first_token_counts(&q, &p, P6.len(), seed);
        assert_fits(
            &counts,
            &as_f64(&p, P6.len()),
            0.01,
            &format!("draft {token}"),
        );
    }
}

/// A chain given as a tree is verified as a chain, draw for draw: the same seed gives
/// the same verdict (the coordinator verifies chains this way).
#[test]
fn a_chain_as_a_tree_samples_what_verify_sampling_does() {
    let (q, p) = (dist(&[0.4, 0.1, 0.0, 0.5]), dist(&[0.1, 0.4, 0.2, 0.3]));
    let mut draws = rng_for(9);
    for seed in 0..500u64 {
        let k = 1 + (seed % 4) as usize;
        let draft: Vec<u32> = (0..k).map(|_| q.sample(&mut draws)).collect();
        let (qs, ps) = (vec![q.clone(); k], vec![p.clone(); k + 1]);
        let chain = verify_sampling(&draft, &qs, &ps, &mut rng_for(seed)).unwrap();
        let parents: Vec<u32> = (0..k as u32).collect();
        let refs: Vec<&Distribution> = qs.iter().collect();
        let tree = verify_sampling_tree(&draft, &parents, &refs, &ps, &mut rng_for(seed));
        let (path, token) = tree.unwrap();
        assert_eq!(
            (path.len(), token),
            (chain.accepted, chain.token),
            "seed {seed}"
        );
    }
}

/// The target's half with each draft's q(x) alone, then the caller's correction drawn
/// where the target's draws stopped (in another process: the stream's position passed
/// between them), give verify_sampling's verdict, draw for draw; with the q's whole
/// (a lookup's point masses among them) the target draws the correction itself, asking
/// for no p past the rejected draft.
#[test]
fn the_targets_half_then_the_callers_is_verify_sampling() {
    use crate::sampling::{rng_at, rng_position};
    let (q, p) = (dist(&[0.4, 0.1, 0.0, 0.5]), dist(&[0.1, 0.4, 0.2, 0.3]));
    let mut draws = rng_for(9);
    let mut left_to_the_caller = 0;
    for seed in 0..500u64 {
        let k = 1 + (seed % 4) as usize;
        let draft: Vec<u32> = (0..k).map(|_| q.sample(&mut draws)).collect();
        let (qs, ps) = (vec![q.clone(); k], vec![p.clone(); k + 1]);
        let points: Vec<Distribution> = draft.iter().map(|&x| Distribution::point(x)).collect();
        // The bound below counts the q's rejections only (point masses reject more).
        for (whole, counted) in [(&qs, true), (&points, false)] {
            let expected = verify_sampling(&draft, whole, &ps, &mut rng_for(seed)).unwrap();
            // The target's half with each q(x) alone, then the caller's correction.
            let drafted: Vec<f32> = draft.iter().zip(whole).map(|(&x, q)| q.prob(x)).collect();
            let mut target = rng_at(seed, 0);
            let drafted = Drafted::Probabilities(&drafted);
            let (tested, _) = test_sampled(&draft, drafted, rows(&ps), &mut target).unwrap();
            let mut caller = rng_at(seed, rng_position(&target));
            let at = tested.accepted;
            left_to_the_caller += usize::from(tested.token.is_none() && counted);
            let token =
                (tested.token).unwrap_or_else(|| draw_correction(&ps[at], &whole[at], &mut caller));
            assert_eq!(
                Verdict {
                    accepted: at,
                    token
                },
                expected,
                "seed {seed}"
            );

            // The q's whole: the target draws the correction too.
            let mut asked = 0;
            let lazily = |i: usize| {
                asked = i + 1;
                rows(&ps)(i)
            };
            let mut rng = rng_for(seed);
            let tested = test_sampled(&draft, Drafted::Whole(whole), lazily, &mut rng);
            let (tested, _) = tested.unwrap();
            // Positions after a rejection are never asked for.
            assert_eq!(asked, tested.accepted + 1);
            let token = tested
                .token
                .expect("with the q's whole, the correction is drawn");
            assert_eq!(
                Verdict {
                    accepted: tested.accepted,
                    token
                },
                expected
            );
        }
    }
    assert!(
        (100..500).contains(&left_to_the_caller),
        "{left_to_the_caller}"
    );
    let ps = [p.clone(), p.clone(), p];
    let short = test_sampled(
        &[1, 2],
        Drafted::Probabilities(&[0.5]),
        rows(&ps),
        &mut draws,
    );
    assert_eq!(
        short.map(|(tested, _)| tested),
        Err(VerifyError::DraftDistributionsLength {
            expected: 2,
            actual: 1
        })
    );
}

/// Three candidates for the first token, drawn independently from q (a chain token and
/// two alternatives beside it), tried in turn: the committed first token follows p in
/// every case, the bonus distributions after them notwithstanding.
#[test]
fn a_tree_of_independent_candidates_gives_the_first_token_p() {
    for (seed, (label, q, p)) in (300u64..).zip(STATISTICAL_CASES) {
        let vocab = q.len().max(p.len());
        let (q, p) = (dist(q), dist(p));
        let mut rng = rng_for(seed);
        let qs = [&q, &q, &q];
        let bonus = Distribution::point(vocab as u32 - 1);
        let ps = [p.clone(), bonus.clone(), bonus.clone(), bonus];
        let mut counts = vec![0u64; vocab];
        for _ in 0..TRIALS {
            let draft: Vec<u32> = (0..3).map(|_| q.sample(&mut rng)).collect();
            let (path, token) =
                verify_sampling_tree(&draft, &[0, 0, 0], &qs, &ps, &mut rng).unwrap();
            let first = path.first().map_or(token, |&j| draft[j]);
            counts[first as usize] += 1;
        }
        assert_fits(&counts, &as_f64(&p, vocab), 0.01, label);
    }
}

/// A chain of two with an alternative beside its first token, against a context-free
/// target: the first two committed tokens are independent draws from p.
#[test]
fn a_tree_round_commits_an_iid_p_stream() {
    let vocab = 4;
    let p = dist(&[0.1, 0.4, 0.2, 0.3]);
    let q = dist(&[0.4, 0.1, 0.0, 0.5]);
    let qs = [&q, &q, &q];
    let ps = [p.clone(), p.clone(), p.clone(), p.clone()];
    let mut rng = rng_for(5);
    let mut counts = vec![0u64; vocab * vocab];
    for _ in 0..TRIALS {
        // Chain x, y (y after x); z beside x.
        let draft: Vec<u32> = (0..3).map(|_| q.sample(&mut rng)).collect();
        let (path, token) = verify_sampling_tree(&draft, &[0, 1, 0], &qs, &ps, &mut rng).unwrap();
        let mut committed: Vec<u32> = path.iter().map(|&j| draft[j]).collect();
        committed.push(token);
        if committed.len() < 2 {
            // One token this round: the next is a fresh draw from p.
            committed.push(p.sample(&mut rng));
        }
        counts[(committed[0] * vocab as u32 + committed[1]) as usize] += 1;
    }
    let pf = as_f64(&p, vocab);
    let joint: Vec<f64> = (0..vocab * vocab)
        .map(|i| pf[i / vocab] * pf[i % vocab])
        .collect();
    assert_fits(&counts, &joint, 0.01, "first two tokens of a tree round");
}

#[test]
fn verify_sampling_k2_stream_is_iid_p() {
    // With a context-free target p and draft q, the committed stream must be i.i.d. p.
    // Rounds continue until two tokens are committed; the joint of the first two tokens
    // is compared with p x p, which checks the second token's marginal and independence.
    let vocab = 4;
    let p = dist(&[0.1, 0.4, 0.2, 0.3]);
    let q = dist(&[0.4, 0.1, 0.0, 0.5]);
    let qs = [q.clone(), q.clone()];
    let ps = [p.clone(), p.clone(), p.clone()];
    let mut rng = rng_for(2);
    let mut counts = vec![0u64; vocab * vocab];
    let mut second = vec![0u64; vocab];
    for _ in 0..TRIALS {
        let mut stream = Vec::with_capacity(4);
        while stream.len() < 2 {
            let draft = [q.sample(&mut rng), q.sample(&mut rng)];
            let v = verify_sampling(&draft, &qs, &ps, &mut rng).unwrap();
            stream.extend(v.committed(&draft));
        }
        counts[stream[0] as usize * vocab + stream[1] as usize] += 1;
        second[stream[1] as usize] += 1;
    }
    let marginal = as_f64(&p, vocab);
    assert_fits(&second, &marginal, 0.01, "second token");
    let joint: Vec<f64> = marginal
        .iter()
        .flat_map(|&a| marginal.iter().map(move |&b| a * b))
        .collect();
    assert_fits(&counts, &joint, 0.015, "joint of first two");
}
