//! The draw kernels (`kernels.cu`'s `duet_draw`, `duet_propose`, `duet_greedy`) on the CPU.

use super::super::launch::{draw_args, propose_args};
use super::super::{DRAFTED_MAX, GREEDY_THREADS};
use super::{Script, grid, step_binary};
use crate::model::greedy::{Greedy, Summary};
use crate::sampling::{
    Distribution, Draw, DrawFrom, Drawn, Excluded, SamplingParams, argmax, proposal_distribution,
};
use crate::testing::{check_drawn, check_proposal, draw_settings, logit_row};
use std::fmt::Display;
use std::sync::Arc;

/// A draw or a proposal as the step launches it.
enum DrawLaunch {
    Draw(Draw),
    Propose(SamplingParams),
}

impl DrawLaunch {
    /// The launch on the logits at `row` (`n` of them), its results into `out{i}` (3 f32;
    /// a proposal's ids and weights into `ids{i}` and `weights{i}`, a draft's q from
    /// `q_ids{i}` and `q_probs{i}`), with the arguments `launch::draw` and `launch::propose`
    /// push (`draw_args`, `propose_args`).
    fn add_to(&self, script: &mut Script<'_>, i: usize, row: u64, n: usize) {
        let out = format!("out{i}");
        let (kernel, args) = match self {
            Self::Propose(params) => {
                let ids = script.alloc(&format!("ids{i}"), DRAFTED_MAX * 4);
                let weights = script.alloc(&format!("weights{i}"), DRAFTED_MAX * 4);
                let at = [row, script.alloc(&out, 12), ids, weights];
                ("duet_propose", propose_args(at, n, params).to_vec())
            }
            Self::Draw(draw) => {
                let q = draw.excluded().and_then(|x| x.from.as_deref());
                let ids: Vec<u8> = q.map_or(vec![], |q| {
                    q.ids().iter().flat_map(|id| id.to_le_bytes()).collect()
                });
                let ids = script.load(&format!("q_ids{i}"), &ids);
                let probs = script.load_f32(&format!("q_probs{i}"), q.map_or(&[], |q| q.probs()));
                let at = [row, script.alloc(&out, 12), ids, probs];
                ("duet_draw", draw_args(at, n, draw).to_vec())
            }
        };
        let args: Vec<&dyn Display> = args.iter().map(|a| a as &dyn Display).collect();
        script.launch(kernel, grid((1, 1, 1), GREEDY_THREADS), &args);
        script.save(&out);
        if let Self::Propose(_) = self {
            script.save(&format!("ids{i}"));
            script.save(&format!("weights{i}"));
        }
    }
}

/// The launches of the draw test for a row: each setting's proposal, and its draws at three
/// uniforms from the whole row, after the likeliest token (a lookup's draft) and after a
/// draft model's draft (drawn from `other`'s proposal).
fn draw_launches(x: &[f32], other: &[f32]) -> Vec<DrawLaunch> {
    let mut launches = Vec::new();
    for params in draw_settings() {
        launches.push(DrawLaunch::Propose(params));
        let q = proposal_distribution(other, &params).unwrap();
        let drafted = Excluded {
            token: q.iter().max_by(|a, b| a.1.total_cmp(&b.1)).unwrap().0,
            from: Some(Arc::new(q)),
        };
        let likeliest = Excluded::point(argmax(x).unwrap());
        let froms = [
            DrawFrom::Row,
            DrawFrom::After(likeliest),
            DrawFrom::After(drafted),
        ];
        for (k, from) in (0..3).flat_map(|k| froms.clone().map(|f| (k, f))) {
            let uniform = (k as f64 + 0.37) / 3.0;
            launches.push(DrawLaunch::Draw(Draw {
                params,
                uniform,
                from,
            }));
        }
    }
    launches
}

/// `duet_draw` and `duet_propose` on the CPU against the host's sampler: a draw's token is
/// `Draw::of_row`'s with its probabilities but within rounding of an edge, and a proposal
/// is `proposal_distribution`'s but where the tail's floor falls otherwise by rounding, for
/// every setting of `draw_settings`, rows of 3,000 and of the 1.5B's 151,936 logits (ties,
/// NaN, -inf), draws from whole rows and after a lookup's and a draft model's drafts.
#[test]
fn the_draw_kernels_draw_and_propose_as_the_sampler_but_at_an_edge() {
    let dir = tempfile::tempdir().unwrap();
    let binary = step_binary();
    let mut script = Script::new(dir.path());
    let (mut rows, mut launches) = (Vec::new(), Vec::new());
    for (seed, n) in [(1, 3000), (2, 151_936)] {
        let x = logit_row(n, seed);
        let row = script.load_f32(&format!("row{seed}"), &x);
        for launch in draw_launches(&x, &logit_row(n, seed + 10)) {
            launch.add_to(&mut script, launches.len(), row, n);
            launches.push((launch, rows.len()));
        }
        rows.push(x);
    }
    script.run(binary);
    let (mut checked, mut at_edges, mut left) = (0, 0, 0);
    for (i, (launch, row)) in launches.iter().enumerate() {
        let out = script.floats(&format!("out{i}"));
        let (x, n) = (&rows[*row], rows[*row].len());
        let kept = out[0].to_bits() as i32;
        match launch {
            DrawLaunch::Draw(draw) => {
                let at = format!("n {n}, {draw:?}");
                assert!(kept >= 0, "{at}: left to the host");
                let got = Drawn {
                    token: out[0].to_bits(),
                    probability: out[1],
                    excluded: out[2],
                    proposal: None,
                };
                checked += 1;
                at_edges += usize::from(check_drawn(x, draw, got, 1e-6, &at));
            }
            DrawLaunch::Propose(params) => {
                let at = format!("n {n}, {params:?}");
                let want = proposal_distribution(x, params).unwrap();
                if kept < 0 {
                    // Left to the host: every token kept, or more than the GPU keeps.
                    let whole = want.ids().len() == n || want.ids().len() > DRAFTED_MAX;
                    assert!(whole, "{at}: left to the host");
                    left += 1;
                    continue;
                }
                let kept = kept as usize;
                let ids = script.floats(&format!("ids{i}"));
                let weights = script.floats(&format!("weights{i}"));
                let entries = (ids[..kept].iter().map(|v| v.to_bits()))
                    .zip(weights[..kept].iter().map(|&w| f64::from(w)));
                let got = Distribution::from_sorted_weights(entries.collect()).unwrap();
                checked += 1;
                at_edges += usize::from(check_proposal(&got, &want, 1e-6, &at));
            }
        }
    }
    assert!(
        at_edges * 20 < checked && left * 4 < launches.len(),
        "{checked} checked, {at_edges} at edges, {left} left to the host"
    );
}

/// `duet_greedy` on the CPU: each row's summary gives `Greedy::of_row`'s token and its
/// probability, for rows with ties (across the block's threads too), NaN and -inf, two +inf
/// maxima (the lower id, at probability one half) and none usable.
#[test]
fn the_greedy_kernel_summarises_a_row_as_the_host_chooses_from_it() {
    let dir = tempfile::tempdir().unwrap();
    let binary = step_binary();
    let mut rows = vec![logit_row(3000, 4), logit_row(151_936, 5)];
    let mut tied = logit_row(5000, 6);
    // Ties within a warp (ids 1234 and 2248: threads 210 and 200) and across warps (4001).
    (tied[4001], tied[2248], tied[1234]) = (30.0, 30.0, 30.0);
    let mut infinite = logit_row(2048, 7);
    (infinite[2000], infinite[17]) = (f32::INFINITY, f32::INFINITY);
    rows.extend([tied, infinite, vec![f32::NAN, f32::NEG_INFINITY, f32::NAN]]);
    let mut script = Script::new(dir.path());
    for (i, row) in rows.iter().enumerate() {
        let (x, out) = (format!("x{i}"), format!("out{i}"));
        script.load_f32(&x, row);
        script.alloc(&out, 12);
        let args: [&dyn Display; 3] = [&x, &row.len(), &out];
        script.launch("duet_greedy", grid((1, 1, 1), GREEDY_THREADS), &args);
        script.save(&out);
    }
    script.run(binary);
    let mut got = Vec::new();
    for (i, row) in rows.iter().enumerate() {
        let out = script.floats(&format!("out{i}"));
        let summary = Summary::from_kernel([out[0], out[1], out[2]], |i| i as u32);
        match (summary.greedy(), Greedy::of_row(row)) {
            (Ok(g), Ok(want)) => {
                assert_eq!(g.token, want.token, "row {i}");
                let close = (g.probability - want.probability).abs() <= 1e-6;
                assert!(close, "row {i}: {g:?} against {want:?}");
                got.push(Some((g.token, g.probability)));
            }
            (Err(e), Err(want)) => {
                assert_eq!(e.to_string(), want.to_string(), "row {i}");
                got.push(None);
            }
            (g, want) => panic!("row {i}: {g:?} against {want:?}"),
        }
    }
    assert_eq!(got[2].unwrap().0, 1234);
    assert_eq!(got[3], Some((17, 0.5)));
    assert_eq!(got[4], None);
}
