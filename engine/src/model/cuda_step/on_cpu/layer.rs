//! The layer's kernels (`kernels.cu`: the norm, SiLU, rotary embedding with the cache
//! append, attention in parts and their combine) on the CPU, against the same arithmetic
//! in f64 on the host.

use super::super::{ATTN_THREADS, NORM_THREADS, row_blocks};
use super::{Script, build, global_kernels, grid, reference, step_binary};
use crate::model::step_plan::TREE_PATH;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::fmt::Display;

fn random(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-1.0..1.0)).collect()
}

fn u32_bytes(values: &[u32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Holds row `r` of Q8_1 blocks (`row_blocks(n)` a row, as the next mat-vec reads them) to
/// the `n` values `want`: each within half a step of its block's scale (with the scale's
/// own f16 rounding), and each block's stored sum (which Q5_0 weights' products take) the
/// sum of its values within the sum's f16 rounding.
fn assert_q8_1(q8: &[f32], r: usize, want: &[f64], at: &str) {
    let bytes: Vec<u8> = q8.iter().flat_map(|v| v.to_le_bytes()).collect();
    let row = &bytes[r * row_blocks(want.len()) * 36..];
    for (b, values) in want.chunks(32).enumerate() {
        let block = &row[b * 36..][..36];
        let f16 = |at: usize| half::f16::from_le_bytes([block[at], block[at + 1]]).to_f64();
        let (d, stored) = (f16(0), f16(2));
        for (j, &w) in values.iter().enumerate() {
            let v = d * f64::from(block[4 + j] as i8);
            let bound = d / 2.0 * 1.01 + 1e-3 * w.abs() + 1e-6;
            assert!(
                (v - w).abs() <= bound,
                "{at}: value {}: {v}, expected {w}",
                32 * b + j
            );
        }
        let sum: f64 = values.iter().sum();
        let magnitude: f64 = values.iter().map(|w| w.abs()).sum();
        let bound = 1e-3 * sum.abs() + 1e-5 * magnitude + 1e-6;
        assert!(
            (stored - sum).abs() <= bound,
            "{at}: block {b}'s sum {stored}, expected {sum}"
        );
    }
}

/// `duet_add_norm_q8` and `duet_silu_mul_q8` on the CPU: the residual added in place, the
/// norm's f32 output and both kernels' Q8_1 blocks against the host's arithmetic, the
/// padding blocks past a row's values left as they were.
#[test]
fn the_norm_and_silu_kernels_write_the_host_values_as_q8_1() {
    let dir = tempfile::tempdir().unwrap();
    let binary = step_binary();
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let (rows, n, eps) = (3, 1600, 1e-6f32);
    let blocks = row_blocks(n);
    let (x, delta, w) = (
        random(&mut rng, rows * n),
        random(&mut rng, rows * n),
        random(&mut rng, n),
    );
    let (gate, up) = (random(&mut rng, rows * 2 * n), random(&mut rng, rows * n));
    let mut script = Script::new(dir.path());
    script.load_f32("x", &x);
    script.load_f32("delta", &delta);
    script.load_f32("w", &w);
    script.load_f32("gate", &gate);
    script.load_f32("up", &up);
    script.load("q", &vec![0u8; rows * blocks * 36]);
    script.load("act", &vec![0u8; rows * blocks * 36]);
    script.alloc("y", rows * n * 4);
    let norm: [&dyn Display; 8] = [&"x", &"delta", &"w", &"q", &"y", &n, &blocks, &eps];
    script.launch(
        "duet_add_norm_q8",
        grid((rows as u32, 1, 1), NORM_THREADS),
        &norm,
    );
    // The gate's rows twice as wide as the values (a launch that computed gate and up
    // side by side), the up's rows as wide.
    let silu: [&dyn Display; 7] = [&"gate", &"up", &"act", &n, &blocks, &(2 * n), &n];
    let per_block = ((n / 32).div_ceil(8) as u32, rows as u32, 1);
    script.launch("duet_silu_mul_q8", grid(per_block, 256), &silu);
    for name in ["x", "q", "y", "act"] {
        script.save(name);
    }
    script.run(binary);
    let (x_out, y_out) = (script.floats("x"), script.floats("y"));
    let (q, act) = (script.floats("q"), script.floats("act"));
    for r in 0..rows {
        let residual: Vec<f32> = (0..n).map(|i| x[r * n + i] + delta[r * n + i]).collect();
        assert_eq!(&x_out[r * n..][..n], &residual[..], "row {r}: the residual");
        let mean = residual
            .iter()
            .map(|&v| f64::from(v) * f64::from(v))
            .sum::<f64>()
            / n as f64;
        let scale = 1.0 / (mean + f64::from(eps)).sqrt();
        let want: Vec<f64> = (0..n)
            .map(|i| f64::from(residual[i]) * scale * f64::from(w[i]))
            .collect();
        for (i, (&got, &want)) in y_out[r * n..][..n].iter().zip(&want).enumerate() {
            assert!(
                (f64::from(got) - want).abs() <= 1e-5 * (1.0 + want.abs()),
                "row {r}: y {i}"
            );
        }
        assert_q8_1(&q, r, &want, &format!("norm row {r}"));
        let silu: Vec<f64> = (0..n)
            .map(|i| {
                let g = f64::from(gate[r * 2 * n + i]);
                g / (1.0 + (-g).exp()) * f64::from(up[r * n + i])
            })
            .collect();
        assert_q8_1(&act, r, &silu, &format!("silu row {r}"));
    }
    // 1,600 values are 50 blocks of a row's 64 (padded to 2,048): the rest stay zero.
    let padding = |q8: &[f32]| {
        let bytes: Vec<u8> = q8.iter().flat_map(|v| v.to_le_bytes()).collect();
        (0..rows).all(|r| {
            bytes[(r * blocks + n / 32) * 36..(r + 1) * blocks * 36]
                .iter()
                .all(|&b| b == 0)
        })
    };
    assert!(padding(&q) && padding(&act));
}

/// The attention test's shape: query heads, kv heads, a head's dimensions; keys already in
/// each cache before the pass (more than the parts' first round of chunks, so some parts
/// walk two chunks), and the caches' rows.
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const HD: usize = 64;
const CACHED: usize = 1100;
const CAPACITY: usize = 1200;
const EPS: f32 = 1e-6;

/// A pass's row: which of the inputs' q, k and v rows it takes, its position, the cache
/// (0 or 1) and slot its key goes to, and the keys it reads (`RowKeys`).
#[derive(Clone)]
struct RowSpec {
    input: usize,
    position: usize,
    cache: usize,
    slot: usize,
    prefix: usize,
    tail: Vec<usize>,
}

impl RowSpec {
    fn chain(input: usize) -> Self {
        let position = CACHED + input;
        Self {
            input,
            position,
            cache: 0,
            slot: position,
            prefix: position + 1,
            tail: vec![],
        }
    }

    /// Row `input` of a tree in cache 1 whose rows sit at slots past the cache: its keys
    /// the cache's, then its path's (the rows of inputs 0..=input).
    fn tree(input: usize) -> Self {
        let slot = |i: usize| CACHED + 5 + 2 * i;
        Self {
            input,
            position: CACHED + input,
            cache: 1,
            slot: slot(input),
            prefix: CACHED,
            tail: (0..=input).map(slot).collect(),
        }
    }

    /// Cache row of the row's `j`th key.
    fn key_row(&self, j: usize) -> usize {
        if j < self.prefix {
            j
        } else {
            self.tail[j - self.prefix]
        }
    }
}

/// What every pass shares: the inputs' q, k and v rows, the biases, the head norms, the
/// rotary tables and the caches' keys and values before the pass.
struct Inputs {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    biases: [Vec<f32>; 3],
    norms: [Vec<f32>; 2],
    cos: Vec<f32>,
    sin: Vec<f32>,
    caches: [Vec<f32>; 2],
}

impl Inputs {
    fn new(rng: &mut ChaCha8Rng) -> Self {
        let (qn, kn) = (HEADS * HD, KV_HEADS * HD);
        let half = HD / 2;
        let angle = |p: usize, i: usize| p as f64 * 10_000f64.powf(-2.0 * i as f64 / HD as f64);
        let table = |f: fn(f64) -> f64| -> Vec<f32> {
            (0..CAPACITY * half)
                .map(|j| f(angle(j / half, j % half)) as f32)
                .collect()
        };
        // Rows past the cached ones are NaN: a key read from a row no pass wrote shows.
        let cache = |rng: &mut ChaCha8Rng| {
            let mut c = random(rng, CACHED * kn);
            c.resize(CAPACITY * kn, f32::NAN);
            c
        };
        let keys = cache(rng);
        let values = cache(rng);
        Self {
            q: random(rng, 3 * qn),
            k: random(rng, 3 * kn),
            v: random(rng, 3 * kn),
            biases: [random(rng, qn), random(rng, kn), random(rng, kn)],
            norms: [random(rng, HD), random(rng, HD)],
            cos: table(f64::cos),
            sin: table(f64::sin),
            // Both caches hold the same keys and values before the pass: a chain's keys
            // in cache 0, a tree's in cache 1.
            caches: [keys.clone(), values.clone()],
        }
    }
}

/// Two caches' keys and values (each `CAPACITY` rows of `KV_HEADS * HD`).
type Caches<T> = [[Vec<T>; 2]; 2];

/// A pass's options: rotary pairs (2i, 2i + 1) rather than (i, i + HD / 2), the heads' RMS
/// norms (Qwen3's `q_norm` and `k_norm`) applied.
#[derive(Clone, Copy, Debug)]
struct Variant {
    interleaved: bool,
    norms: bool,
}

/// What a pass wrote: the rotated queries, each cache's keys and values after it, the
/// attention's parts (a block a head, and a block a group of heads) and its Q8_1 output.
struct Outputs {
    q_rot: Vec<f32>,
    caches: Caches<f32>,
    parts: Vec<f32>,
    grouped: Vec<f32>,
    q8: Vec<f32>,
}

/// The pass's inputs: the rows' q, k and v, the biases and norms, the rotary tables, each
/// row's position, slot and keys (`step_plan::InputLayout`'s), the caches and each row's
/// cache pointers (`kv`).
fn load_pass(s: &mut Script<'_>, inputs: &Inputs, caches: &Caches<f32>, rows: &[RowSpec]) {
    let (qn, kn, n) = (HEADS * HD, KV_HEADS * HD, rows.len());
    let pick = |x: &[f32], width: usize| -> Vec<f32> {
        rows.iter()
            .flat_map(|r| x[r.input * width..][..width].to_vec())
            .collect()
    };
    s.load_f32("q_in", &pick(&inputs.q, qn));
    s.load_f32("k_in", &pick(&inputs.k, kn));
    s.load_f32("v_in", &pick(&inputs.v, kn));
    for (name, values) in ["q_bias", "k_bias", "v_bias"].iter().zip(&inputs.biases) {
        s.load_f32(name, values);
    }
    s.load_f32("q_norm", &inputs.norms[0]);
    s.load_f32("k_norm", &inputs.norms[1]);
    s.load_f32("cos", &inputs.cos);
    s.load_f32("sin", &inputs.sin);
    let u32s = |f: &dyn Fn(&RowSpec) -> usize| -> Vec<u8> {
        u32_bytes(&rows.iter().map(|r| f(r) as u32).collect::<Vec<_>>())
    };
    s.load("positions", &u32s(&|r| r.position));
    s.load("slots", &u32s(&|r| r.slot));
    s.load("prefixes", &u32s(&|r| r.prefix));
    let mut paths = vec![0u32; n * TREE_PATH];
    for (i, r) in rows.iter().enumerate() {
        for (j, &slot) in r.tail.iter().enumerate() {
            paths[i * TREE_PATH + j] = slot as u32;
        }
    }
    s.load("paths", &u32_bytes(&paths));
    for (c, cache) in caches.iter().enumerate() {
        s.load_f32(&format!("cache{c}k"), &cache[0]);
        s.load_f32(&format!("cache{c}v"), &cache[1]);
    }
    let kv: Vec<String> = (rows.iter())
        .flat_map(|r| ["k", "v"].map(|w| format!("cache{}{w}", r.cache)))
        .collect();
    s.table("kv", &kv);
}

/// The pass's launches over its `n` rows, into `q_rot`, the caches, `parts` (a block a
/// head), `grouped` (a block a group of heads) and `q8`.
fn launch_pass(s: &mut Script<'_>, n: usize, variant: Variant) {
    let (qn, kn) = (HEADS * HD, KV_HEADS * HD);
    let parts = super::super::attn_shape().parts;
    let parts_bytes = n * HEADS * parts * (2 + HD) * 4;
    s.alloc("q_rot", n * qn * 4);
    s.alloc("parts", parts_bytes);
    s.alloc("grouped", parts_bytes);
    s.alloc("q8", n * row_blocks(qn) * 36);
    let (norm_q, norm_k) = match variant.norms {
        true => ("q_norm", "k_norm"),
        false => ("null", "null"),
    };
    let (heads, kv_heads, hd) = (HEADS as i32, KV_HEADS as i32, HD as i32);
    let interleaved = i32::from(variant.interleaved);
    let (qs, ks) = (qn as i32, kn as i32);
    let rope: [&dyn Display; 24] = [
        &"q_in",
        &"k_in",
        &"v_in",
        &"q_bias",
        &"k_bias",
        &"v_bias",
        &"cos",
        &"sin",
        &"positions",
        &"slots",
        &"kv",
        &0,
        &1,
        &"q_rot",
        &heads,
        &kv_heads,
        &hd,
        &interleaved,
        &qs,
        &ks,
        &ks,
        &norm_q,
        &norm_k,
        &EPS,
    ];
    let rope_grid = grid(((HEADS + KV_HEADS) as u32, n as u32, 1), (HD / 2) as u32);
    s.launch("duet_rope_append", rope_grid, &rope);
    let scale = 1.0 / (HD as f32).sqrt();
    for (kernel, out, blocks) in [
        ("duet_attend_parts", "parts", HEADS),
        ("duet_attend_parts_grouped", "grouped", KV_HEADS),
    ] {
        let args: [&dyn Display; 12] = [
            &"q_rot",
            &"kv",
            &"positions",
            &"prefixes",
            &"paths",
            &0,
            &1,
            &out,
            &heads,
            &kv_heads,
            &hd,
            &scale,
        ];
        let shape = grid((blocks as u32, n as u32, parts as u32), ATTN_THREADS);
        s.launch(kernel, shape, &args);
    }
    let blocks = row_blocks(qn);
    let combine: [&dyn Display; 7] = [&"parts", &"positions", &"q8", &qn, &blocks, &heads, &hd];
    let per_block = ((qn / 32).div_ceil(8) as u32, n as u32, 1);
    s.launch("duet_attend_combine_q8", grid(per_block, 256), &combine);
}

/// The rows' rotary-and-append, attention (both kernels) and combine, launched as
/// `launch::rope_append` and `launch::attend` launch them.
fn attention_pass(
    binary: &std::path::Path,
    dir: &std::path::Path,
    inputs: &Inputs,
    caches: &Caches<f32>,
    rows: &[RowSpec],
    variant: Variant,
) -> Outputs {
    let mut s = Script::new(dir);
    load_pass(&mut s, inputs, caches, rows);
    launch_pass(&mut s, rows.len(), variant);
    let saved = [
        "q_rot", "cache0k", "cache0v", "cache1k", "cache1v", "parts", "grouped", "q8",
    ];
    for name in saved {
        s.save(name);
    }
    s.run(binary);
    Outputs {
        q_rot: s.floats("q_rot"),
        caches: [0, 1].map(|c| ["k", "v"].map(|w| s.floats(&format!("cache{c}{w}")))),
        parts: s.floats("parts"),
        grouped: s.floats("grouped"),
        q8: s.floats("q8"),
    }
}

/// A head's `HD` values of `x` plus `bias`, RMS-normed by `norm` where given, rotated to
/// `position` by `tables`: the rotary kernel's arithmetic in f64 (`reference`'s).
fn rotated(
    x: &[f32],
    bias: &[f32],
    norm: Option<&[f32]>,
    position: usize,
    v: Variant,
    tables: (&[f64], &[f64]),
) -> Vec<f64> {
    let h: Vec<f64> = (x.iter().zip(bias))
        .map(|(&a, &b)| f64::from(a) + f64::from(b))
        .collect();
    let h = match norm {
        Some(norm) => reference::rms_norm(&h, &wide(norm), f64::from(EPS)),
        None => h,
    };
    reference::rotated(&h, position, tables, v.interleaved)
}

fn wide(values: &[f32]) -> Vec<f64> {
    values.iter().map(|&x| f64::from(x)).collect()
}

/// The pass's expected results in f64: each row's rotated queries, each cache's keys and
/// values after the rows' appends, and each row's attention output.
fn expected(
    inputs: &Inputs,
    rows: &[RowSpec],
    v: Variant,
) -> (Vec<Vec<f64>>, Caches<f64>, Vec<Vec<f64>>) {
    let (qn, kn) = (HEADS * HD, KV_HEADS * HD);
    let norm = |i: usize| v.norms.then_some(&inputs.norms[i][..]);
    let (cos, sin) = (wide(&inputs.cos), wide(&inputs.sin));
    let tables = (&cos[..], &sin[..]);
    let mut caches = [0, 1].map(|_| [wide(&inputs.caches[0]), wide(&inputs.caches[1])]);
    let mut queries = Vec::new();
    for r in rows {
        let q: Vec<f64> = (0..HEADS)
            .flat_map(|h| {
                let x = &inputs.q[r.input * qn + h * HD..][..HD];
                rotated(
                    x,
                    &inputs.biases[0][h * HD..][..HD],
                    norm(0),
                    r.position,
                    v,
                    tables,
                )
            })
            .collect();
        queries.push(q);
        for h in 0..KV_HEADS {
            let at = r.input * kn + h * HD;
            let k = rotated(
                &inputs.k[at..][..HD],
                &inputs.biases[1][h * HD..][..HD],
                norm(1),
                r.position,
                v,
                tables,
            );
            let row = (r.slot * KV_HEADS + h) * HD;
            caches[r.cache][0][row..][..HD].copy_from_slice(&k);
            for d in 0..HD {
                caches[r.cache][1][row + d] =
                    f64::from(inputs.v[at + d]) + f64::from(inputs.biases[2][h * HD + d]);
            }
        }
    }
    let scale = f64::from(1.0 / (HD as f32).sqrt());
    let outputs = rows
        .iter()
        .zip(&queries)
        .map(|(r, q)| {
            let [keys, values] = &caches[r.cache];
            (0..HEADS)
                .flat_map(|h| {
                    let kv = h / (HEADS / KV_HEADS);
                    let at = |j: usize| (r.key_row(j) * KV_HEADS + kv) * HD;
                    let key = |j: usize| &keys[at(j)..][..HD];
                    let value = |j: usize| &values[at(j)..][..HD];
                    let q = &q[h * HD..][..HD];
                    reference::attend_head(q, r.position + 1, key, value, scale)
                })
                .collect()
        })
        .collect();
    (queries, caches, outputs)
}

/// `duet_rope_append`, `duet_attend_parts`, `duet_attend_parts_grouped` and
/// `duet_attend_combine_q8` on the CPU, for a pass of three chain rows and the same three
/// tokens as a tree's rows (their keys at slots past the cache, read through their paths)
/// after 1,100 cached keys, with rotary pairs split and interleaved, with and without the
/// heads' norms: the rotated queries, the appended keys and values and the attention's
/// output are the host's arithmetic; the two attention kernels' parts agree bit for bit; a
/// tree's row gives its chain row's bits, and so does the last chain row in a pass of its
/// own.
#[test]
fn the_attention_kernels_give_the_host_attention_and_a_rows_bits_in_every_pass() {
    let dir = tempfile::tempdir().unwrap();
    let binary = step_binary();
    let inputs = Inputs::new(&mut ChaCha8Rng::seed_from_u64(11));
    let before = [0, 1].map(|_| inputs.caches.clone());
    let rows: Vec<RowSpec> = (0..3)
        .map(RowSpec::chain)
        .chain((0..3).map(RowSpec::tree))
        .collect();
    let qn = HEADS * HD;
    for variant in [
        Variant {
            interleaved: false,
            norms: false,
        },
        Variant {
            interleaved: true,
            norms: true,
        },
    ] {
        let at = format!("{variant:?}");
        let got = attention_pass(binary, dir.path(), &inputs, &before, &rows, variant);
        let (queries, caches, outputs) = expected(&inputs, &rows, variant);
        let close = |a: f32, b: f64| (f64::from(a) - b).abs() <= 1e-5 * (1.0 + b.abs());
        for (i, q) in queries.iter().enumerate() {
            let ok = got.q_rot[i * qn..][..qn]
                .iter()
                .zip(q)
                .all(|(&a, &b)| close(a, b));
            assert!(ok, "{at}: row {i}'s rotated queries");
        }
        for (c, w) in [(0, 0), (0, 1), (1, 0), (1, 1)] {
            let (g, e) = (&got.caches[c][w], &caches[c][w]);
            let ok = g
                .iter()
                .zip(e)
                .all(|(&a, &b)| (a.is_nan() && b.is_nan()) || close(a, b));
            assert!(ok, "{at}: cache {c}'s {}", ["keys", "values"][w]);
        }
        for (i, want) in outputs.iter().enumerate() {
            assert_q8_1(&got.q8, i, want, &format!("{at}: row {i}"));
        }
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&got.parts),
            bits(&got.grouped),
            "{at}: parts by head and by group"
        );
        let row_q8 = row_blocks(qn) * 9;
        let (chain, tree) = got.q8.split_at(3 * row_q8);
        assert_eq!(
            bits(chain),
            bits(tree),
            "{at}: the tree's rows against the chain's"
        );
        // The last chain row alone, after the pass: its keys and the rows before are in the
        // cache.
        let alone = attention_pass(
            binary,
            dir.path(),
            &inputs,
            &got.caches,
            &rows[2..3],
            variant,
        );
        assert_eq!(
            bits(&alone.q8),
            bits(&chain[2 * row_q8..]),
            "{at}: a row alone"
        );
    }
}

/// candle's path's attention kernel (`cuda.rs`'s `duet_attend_rows`, a block a row and
/// head over one sequence's cache) on the CPU: three rows after 700 cached keys against
/// attention in f64, and the last row in a launch of its own bit for bit as in the three.
#[test]
fn the_row_attention_kernel_gives_the_host_attention_and_a_rows_bits_alone() {
    use crate::model::cuda::{ATTENTION_THREADS, attention_source};
    let dir = tempfile::tempdir().unwrap();
    let source = attention_source();
    let binary = build("rows", &source, &global_kernels(&source));
    let mut rng = ChaCha8Rng::seed_from_u64(13);
    let (start, rows, capacity) = (700, 3, 720);
    let (qn, kn) = (HEADS * HD, KV_HEADS * HD);
    let q = random(&mut rng, rows * qn);
    let (keys, values) = (
        random(&mut rng, capacity * kn),
        random(&mut rng, capacity * kn),
    );
    let launch = |s: &mut Script<'_>, out: &str, first: usize, count: usize| {
        let (q_in, at) = (format!("{out}_q"), first + start);
        s.load_f32(&q_in, &q[first * qn..][..count * qn]);
        s.alloc(out, count * qn * 4);
        let shared = (at + count + ATTENTION_THREADS as usize / 32) * 4;
        let mut config = grid((HEADS as u32, count as u32, 1), ATTENTION_THREADS);
        config.shared_mem_bytes = shared as u32;
        let (heads, kv_heads, hd) = (HEADS as i32, KV_HEADS as i32, HD as i32);
        let scale = 1.0 / (HD as f32).sqrt();
        let args: [&dyn Display; 9] =
            [&q_in, &"k", &"v", &out, &at, &heads, &kv_heads, &hd, &scale];
        s.launch("duet_attend_rows", config, &args);
        s.save(out);
    };
    let mut s = Script::new(dir.path());
    s.load_f32("k", &keys);
    s.load_f32("v", &values);
    launch(&mut s, "three", 0, rows);
    launch(&mut s, "alone", rows - 1, 1);
    s.run(&binary);
    let (three, alone) = (s.floats("three"), s.floats("alone"));
    let scale = f64::from(1.0 / (HD as f32).sqrt());
    let (keys, values) = (wide(&keys), wide(&values));
    for r in 0..rows {
        for h in 0..HEADS {
            let at = |j: usize| (j * KV_HEADS + h / (HEADS / KV_HEADS)) * HD;
            let query = wide(&q[(r * HEADS + h) * HD..][..HD]);
            let key = |j: usize| &keys[at(j)..][..HD];
            let value = |j: usize| &values[at(j)..][..HD];
            let want = reference::attend_head(&query, start + r + 1, key, value, scale);
            for (d, want) in want.into_iter().enumerate() {
                let got = f64::from(three[(r * HEADS + h) * HD + d]);
                assert!(
                    (got - want).abs() <= 1e-5,
                    "row {r} head {h} value {d}: {got}, {want}"
                );
            }
        }
    }
    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    assert_eq!(
        bits(&alone),
        bits(&three[(rows - 1) * qn..]),
        "the last row alone"
    );
}
