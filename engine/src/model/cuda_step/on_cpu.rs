//! The step's kernels run on the CPU, where no GPU is: `on_cpu/cuda_on_cpu.h` stands in for
//! the CUDA device language (each thread a fiber, the blocks one after another, warp
//! shuffles and the int8 MMA by the PTX ISA's layouts), the host's C++ compiler builds a
//! kernel source as the step assembles it (`source_for`) with a driver behind it, and the
//! tests hold the kernels' results to candle's dequantized weights and to each other, bit
//! for bit where the step relies on it. What only a GPU can say (speed, the compiler's and
//! the hardware's own behaviour) stays with `scripts/gpu-check`.

use super::matvec::{self, Family, FewForm, Plan, Tiled};
use super::{DRAFTED_MAX, KERNELS, Q8_1_BYTES, row_blocks, source, source_for};
use crate::model::greedy::{Greedy, Summary};
use crate::model::step_plan::{MAX_K_SPLITS, MAX_ROWS};
use crate::sampling::{
    Distribution, Draw, DrawFrom, Drawn, Excluded, PROPOSAL_TAIL, SamplingParams, argmax,
    proposal_distribution,
};
use crate::testing::{check_drawn, check_proposal, draw_settings, logit_row};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

const SHIM: &str = include_str!("on_cpu/cuda_on_cpu.h");
const MATVEC_MAIN: &str = include_str!("on_cpu/matvec_main.cpp");
const DRAW_MAIN: &str = include_str!("on_cpu/draw_main.cpp");

/// Builds `source` (a kernel source as the step compiles it) after the shim and before
/// `main` into `dir/name` with the host's C++ compiler (`CXX`, else `c++`).
fn build(dir: &Path, name: &str, source: &str, main: &str) -> PathBuf {
    let file = dir.join(format!("{name}.cpp"));
    let text =
        format!("{SHIM}\n#line 1 \"{name}.cu\"\n{source}\n#line 1 \"{name}_main.cpp\"\n{main}");
    std::fs::write(&file, text).unwrap();
    let binary = dir.join(name);
    let compiler = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let output = Command::new(&compiler)
        .args(["-std=c++20", "-O1", "-ffp-contract=off", "-w", "-o"])
        .arg(&binary)
        .arg(&file)
        .output()
        .unwrap_or_else(|e| panic!("running the C++ compiler `{compiler}`: {e}"));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "building {name} on the CPU:\n{stderr}"
    );
    binary
}

/// Runs a driver on `dir`, which it reads its launches from and writes their outputs to.
fn run(binary: &Path, dir: &Path) {
    let output = Command::new(binary).arg(dir).output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    // A kernel reading or writing past a buffer's end stops at its guard page (SIGSEGV).
    let status = output.status;
    assert!(
        status.success(),
        "{} ({status}): {stderr}",
        binary.display()
    );
}

fn floats(path: &Path) -> Vec<f32> {
    let bytes = std::fs::read(path).unwrap();
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

/// `rows` rows of `k` activations as the step's norm kernels write them: Q8_1 blocks (f16
/// scale, f16 sum of the row's values, 32 int8), `row_blocks(k)` a row (the padding blocks
/// zero); with the values the blocks stand for.
fn q8_1_rows(rng: &mut ChaCha8Rng, rows: usize, k: usize) -> (Vec<u8>, Vec<f32>) {
    let stride = row_blocks(k);
    let mut bytes = vec![0u8; rows * stride * Q8_1_BYTES];
    let mut values = Vec::with_capacity(rows * k);
    for r in 0..rows {
        for b in 0..k / 32 {
            let d = half::f16::from_f32(rng.random_range(0.001..0.05));
            let mut q: Vec<i8> = (0..32).map(|_| rng.random_range(-127..=127)).collect();
            q[rng.random_range(0..32)] = 127;
            let sum: f32 = q.iter().map(|&v| d.to_f32() * v as f32).sum();
            let block = &mut bytes[(r * stride + b) * Q8_1_BYTES..][..Q8_1_BYTES];
            block[..2].copy_from_slice(&d.to_le_bytes());
            block[2..4].copy_from_slice(&half::f16::from_f32(sum).to_le_bytes());
            for (byte, v) in block[4..].iter_mut().zip(&q) {
                *byte = *v as u8;
            }
            values.extend(q.iter().map(|&v| d.to_f32() * v as f32));
        }
    }
    (bytes, values)
}

/// The kernel's name for a plan of `rows` rows of a weight of `dtype`.
fn kernel_name(dtype: GgmlDType, plan: &Plan, rows: usize) -> String {
    let ty = match dtype {
        GgmlDType::Q8_0 => "q8_0",
        GgmlDType::Q5_0 => "q5_0",
        GgmlDType::Q4K => "q4_k",
        GgmlDType::Q6K => "q6_k",
        other => panic!("no kernel for {other:?}"),
    };
    let suffix = match plan.family {
        Family::Narrow => String::new(),
        Family::Wide => "_x4".into(),
        Family::Mma => format!("_mma{}", matvec::mma_tiles(rows)),
        Family::Few => format!("_few{}", matvec::few_tile(rows)),
    };
    format!("duet_matvec_{ty}{suffix}")
}

/// A weight of `dtype` quantized by candle from random values, and its values as candle
/// dequantizes them.
struct Weight {
    dtype: GgmlDType,
    n: usize,
    k: usize,
    bytes: Vec<u8>,
    values: Vec<f32>,
}

impl Weight {
    fn random(rng: &mut ChaCha8Rng, dtype: GgmlDType, (n, k): (usize, usize)) -> Self {
        let data: Vec<f32> = (0..n * k).map(|_| rng.random_range(-1.0..1.0)).collect();
        let tensor = Tensor::from_vec(data, (n, k), &Device::Cpu).unwrap();
        let q = QTensor::quantize(&tensor, dtype).unwrap();
        let values = q.dequantize(&Device::Cpu).unwrap().flatten_all().unwrap();
        Self {
            dtype,
            n,
            k,
            bytes: q.data().unwrap().into_owned(),
            values: values.to_vec1().unwrap(),
        }
    }

    /// Row `r`'s output `f` as the kernels define it, in f64, and the sum of its terms'
    /// magnitudes (for the rounding it may carry): the dot product of the values, where
    /// Q5_0's `- 16` is taken off by the activations' stored sum (candle's kernel's way).
    fn expected(&self, x: (&[u8], &[f32]), r: usize, f: usize) -> (f64, f64) {
        let (k, stride) = (self.k, row_blocks(self.k));
        let w = &self.values[f * k..][..k];
        let xr = &x.1[r * k..][..k];
        let terms = w.iter().zip(xr).map(|(&a, &b)| a as f64 * b as f64);
        let (mut sum, magnitude) = terms.fold((0.0, 0.0), |(s, m), t| (s + t, m + t.abs()));
        if self.dtype == GgmlDType::Q5_0 {
            for u in 0..k / 32 {
                let at = (f * k / 32 + u) * 22;
                let d = half::f16::from_le_bytes([self.bytes[at], self.bytes[at + 1]]);
                let block = &x.0[(r * stride + u) * Q8_1_BYTES..];
                let stored = half::f16::from_le_bytes([block[2], block[3]]).to_f64();
                let values: f64 = xr[32 * u..][..32].iter().map(|&v| v as f64).sum();
                sum += 16.0 * d.to_f64() * (values - stored);
            }
        }
        (sum, magnitude)
    }
}

/// Passes of these many rows (a pass of `r` rows takes the first `r` of the case's).
const PASSES: [usize; 7] = [1, 2, 3, 5, 8, 13, 40];

/// The families a pass may take: the tiled kernels' two widths, the tensor cores', and
/// the mma mode's pick (its few-row form up to `few_rows`, else the tensor cores).
fn families(rows: usize, few_rows: usize) -> [Family; 4] {
    let mma_mode = matvec::family_for(Some("mma"), few_rows, rows);
    [Family::Narrow, Family::Wide, Family::Mma, mma_mode]
}

/// Every family's passes of `weight` over `x` (40 rows), as `Tiled::launch` plans them,
/// run by the driver (or the few-row form's passes alone, and 40 rows of every family):
/// each pass's outputs by (family the plan took, rows).
fn passes(
    binary: &Path,
    dir: &Path,
    weight: &Weight,
    x: &[u8],
    (few_rows, every_family): (usize, bool),
) -> Vec<((Family, usize), Vec<f32>)> {
    std::fs::write(dir.join("weight.bin"), &weight.bytes).unwrap();
    std::fs::write(dir.join("x.bin"), x).unwrap();
    let (n, k) = (weight.n, weight.k);
    let partials = Some((0, MAX_K_SPLITS * MAX_ROWS * n));
    let mut launches = String::new();
    let mut planned = Vec::new();
    for rows in PASSES {
        let wanted = |f: &Family| every_family || *f == Family::Few || rows == 40;
        for family in families(rows, few_rows).into_iter().filter(wanted) {
            let plan = Tiled::plan(family, (n, k), rows, partials);
            let c = plan.config;
            let out = format!("y{}", planned.len());
            launches += &format!(
                "{} {} {} {} {} {} {k} {n} {rows} {} {} {out}\n",
                kernel_name(weight.dtype, &plan, rows),
                c.grid_dim.0,
                c.grid_dim.1,
                c.grid_dim.2,
                c.block_dim.0,
                c.shared_mem_bytes,
                row_blocks(k),
                plan.split,
            );
            planned.push(((plan.family, rows), out));
        }
    }
    std::fs::write(dir.join("launches.txt"), launches).unwrap();
    run(binary, dir);
    let read = |(key, out): ((Family, usize), String)| (key, floats(&dir.join(out)));
    planned.into_iter().map(read).collect()
}

/// The mat-vec kernels of each weight type the step takes, on the CPU: every pass's outputs
/// are candle's dot products within rounding, and the bits of a row do not depend on the
/// pass: one family's passes of 1 to 40 rows agree bit for bit, and the few-row form's agree
/// with the tensor cores' (which a process mixes by the rows of a pass), with the row's
/// units in one part and in two (`step_plan::k_splits`), each few-row tile (1, 2, 4 and 8
/// rows, a unit's integers summed over 1, 2 and 4 lanes) and a grid's last block short of
/// features (24 = 16 + 8).
#[test]
fn the_mat_vec_kernels_give_candles_sums_and_a_rows_bits_in_every_pass() {
    for lanes in [1, 2, 4] {
        let few = FewForm {
            rows: matvec::MAX_FEW_ROWS,
            lanes,
        };
        // The other families do not depend on the lanes.
        mat_vec_passes_agree(few, lanes == 2);
    }
}

fn mat_vec_passes_agree(few: FewForm, every_family: bool) {
    let dir = tempfile::tempdir().unwrap();
    let source = source_for(matvec::SOURCE, matvec::mma_shape(), few);
    let binary = build(dir.path(), "matvec", &source, MATVEC_MAIN);
    let mut rng = ChaCha8Rng::seed_from_u64(36);
    let cases = [
        (GgmlDType::Q4K, 8192),
        (GgmlDType::Q6K, 512),
        (GgmlDType::Q8_0, 512),
        (GgmlDType::Q5_0, 4096),
    ];
    for (dtype, k) in cases {
        let weight = Weight::random(&mut rng, dtype, (24, k));
        let (x, values) = q8_1_rows(&mut rng, 40, k);
        let outputs = passes(&binary, dir.path(), &weight, &x, (few.rows, every_family));
        let bits_of = |family: Family| &outputs.iter().find(|o| o.0 == (family, 40)).unwrap().1;
        let (tiled, mma) = (bits_of(Family::Narrow), bits_of(Family::Mma));
        for ((family, rows), y) in &outputs {
            let case = format!("{dtype:?} k {k}, {few:?}, {family:?}, {rows} rows");
            for (i, &got) in y.iter().enumerate() {
                let (r, f) = (i / weight.n, i % weight.n);
                let (want, magnitude) = weight.expected((&x, &values), r, f);
                let error = (got as f64 - want).abs();
                assert!(
                    error <= 1e-5 * magnitude,
                    "{case}: row {r} feature {f}: {got}, candle's {want}"
                );
                let same = match family {
                    Family::Narrow | Family::Wide => tiled[i],
                    Family::Mma | Family::Few => mma[i],
                };
                assert_eq!(got.to_bits(), same.to_bits(), "{case}: row {r} feature {f}");
            }
        }
        let took_few = outputs.iter().any(|o| o.0.0 == Family::Few);
        assert!(took_few, "{dtype:?}: no pass took the few-row form");
    }
}

/// A draw or a proposal as the step launches it, on row `row` of the case's logits.
enum DrawLaunch {
    Draw(Draw),
    Propose(SamplingParams),
}

impl DrawLaunch {
    /// The launch on the `n` logits from the `at`-th as a line of the draw driver's
    /// `launches.txt` (a draft distribution's ids and probabilities into `dir/q{i}`), its
    /// output into `out{i}`.
    fn line(&self, dir: &Path, i: usize, at: usize, n: usize) -> String {
        let p = match self {
            Self::Draw(draw) => &draw.params,
            Self::Propose(params) => params,
        };
        let (t, min_p, top_k, top_p) = (p.temperature, p.min_p, p.top_k, p.top_p);
        let head = format!("{at} {n} {t:?} {min_p:?} {top_k} {top_p:?}");
        match self {
            Self::Propose(_) => format!("propose {head} {PROPOSAL_TAIL:?} {DRAFTED_MAX} out{i}"),
            Self::Draw(draw) => {
                let exclude = draw.excluded().map_or(-1, |x| i64::from(x.token));
                let q = match draw.excluded().and_then(|x| x.from.as_deref()) {
                    Some(q) => {
                        let ids = q.ids().iter().flat_map(|id| id.to_le_bytes());
                        let probs = q.probs().iter().flat_map(|p| p.to_le_bytes());
                        std::fs::write(
                            dir.join(format!("q{i}")),
                            ids.chain(probs).collect::<Vec<_>>(),
                        )
                        .unwrap();
                        format!("q{i}")
                    }
                    None => "-".into(),
                };
                format!("draw {head} {:?} {exclude} {q} out{i}", draw.uniform)
            }
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
    let binary = build(dir.path(), "draw", &source(KERNELS), DRAW_MAIN);
    let (mut logits, mut launches, mut lines) = (Vec::new(), Vec::new(), String::new());
    for (seed, n) in [(1, 3000), (2, 151_936)] {
        let x = logit_row(n, seed);
        for launch in draw_launches(&x, &logit_row(n, seed + 10)) {
            lines += &launch.line(dir.path(), launches.len(), logits.len(), n);
            lines.push('\n');
            launches.push((launch, logits.len(), n));
        }
        logits.extend(x);
    }
    let bytes: Vec<u8> = logits.iter().flat_map(|v| v.to_le_bytes()).collect();
    std::fs::write(dir.path().join("logits.bin"), bytes).unwrap();
    std::fs::write(dir.path().join("launches.txt"), lines).unwrap();
    run(&binary, dir.path());
    let (mut checked, mut at_edges, mut left) = (0, 0, 0);
    for (i, (launch, at, n)) in launches.iter().enumerate() {
        let out = floats(&dir.path().join(format!("out{i}")));
        let x = &logits[*at..at + n];
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
                    let whole = want.ids().len() == *n || want.ids().len() > DRAFTED_MAX;
                    assert!(whole, "{at}: left to the host");
                    left += 1;
                    continue;
                }
                let kept = kept as usize;
                let ids = out[3..3 + kept].iter().map(|v| v.to_bits());
                let weights = out[3 + DRAFTED_MAX..][..kept].iter().map(|&w| f64::from(w));
                let got = Distribution::from_sorted_weights(ids.zip(weights).collect()).unwrap();
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
    let binary = build(dir.path(), "greedy", &source(KERNELS), DRAW_MAIN);
    let mut rows = vec![logit_row(3000, 4), logit_row(151_936, 5)];
    let mut tied = logit_row(5000, 6);
    // Ties within a warp (ids 1234 and 2248: threads 210 and 200) and across warps (4001).
    (tied[4001], tied[2248], tied[1234]) = (30.0, 30.0, 30.0);
    let mut infinite = logit_row(2048, 7);
    (infinite[2000], infinite[17]) = (f32::INFINITY, f32::INFINITY);
    rows.extend([tied, infinite, vec![f32::NAN, f32::NEG_INFINITY, f32::NAN]]);
    let (mut logits, mut lines) = (Vec::new(), String::new());
    for (i, row) in rows.iter().enumerate() {
        lines += &format!("greedy {} {} out{i}\n", logits.len(), row.len());
        logits.extend_from_slice(row);
    }
    let bytes: Vec<u8> = logits.iter().flat_map(|v| v.to_le_bytes()).collect();
    std::fs::write(dir.path().join("logits.bin"), bytes).unwrap();
    std::fs::write(dir.path().join("launches.txt"), lines).unwrap();
    run(&binary, dir.path());
    let mut got = Vec::new();
    for (i, row) in rows.iter().enumerate() {
        let out = floats(&dir.path().join(format!("out{i}")));
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
