//! The mat-vec kernels (`matvec.cu`) on the CPU.

use super::super::launch::{Kernel, Launch};
use super::super::matvec::{self, Choice, Family, FewForm, MmaShape};
use super::super::{Q8_1_BYTES, row_blocks, source_for};
use super::{Script, build};
use crate::model::step_plan::{MAX_K_SPLITS, MAX_ROWS};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::path::Path;

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

const TYPES: [GgmlDType; 4] = [
    GgmlDType::Q8_0,
    GgmlDType::Q5_0,
    GgmlDType::Q4K,
    GgmlDType::Q6K,
];

/// Every kernel of the mat-vec's source with the tensor cores' shape `mma` and the few-row
/// form `few`.
pub(super) fn kernel_names(mma: MmaShape, few: FewForm) -> Vec<String> {
    let tiles = [1, 2, 4, 8].into_iter().filter(|&t| t <= mma.tiles);
    let few_tiles = [1, 2, 4, 8]
        .into_iter()
        .filter(|&t| t <= matvec::few_tile(few.rows));
    let kernels: Vec<_> = [(Family::Narrow, 0), (Family::Wide, 0)]
        .into_iter()
        .chain(tiles.map(|size| (Family::Mma, size)))
        .chain(few_tiles.map(|size| (Family::Few, size)))
        .collect();
    let names = TYPES.into_iter().flat_map(|dtype| {
        (kernels.iter()).map(move |&(family, size)| {
            Kernel::MatVec {
                dtype,
                family,
                size,
            }
            .name()
        })
    });
    names.chain([Kernel::MatVecCombine.name()]).collect()
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

/// The choices whose passes the test takes, each with the family it asks for: the tiled
/// kernels' two widths, the tensor cores', and the mma mode's pick (its few-row form up to
/// `few_rows` rows, else the tensor cores).
fn choices(rows: usize, (mma, few_rows): (MmaShape, usize)) -> [(Family, Choice); 4] {
    let choice = |mode, few_rows| Choice {
        mode,
        mma,
        few_rows,
    };
    [
        (Family::Narrow, choice("tiled1", 0)),
        (Family::Wide, choice("tiled4", 0)),
        (Family::Mma, choice("mma", 0)),
        (
            matvec::family_for(Some("mma"), few_rows, rows),
            choice("mma", few_rows),
        ),
    ]
}

/// Every family's passes of `weight` over `x` (40 rows), as `Tiled::launch` plans them
/// (or the few-row form's passes alone, and 40 rows of every family): each pass's outputs by
/// (family the plan took, rows).
fn passes(
    binary: &Path,
    dir: &Path,
    weight: &Weight,
    x: &[u8],
    form: &Form,
) -> Vec<((Family, usize), Vec<f32>)> {
    let mut script = Script::new(dir);
    let w = script.load("weight", &weight.bytes);
    let x = script.load("x", x);
    let (n, k) = (weight.n, weight.k);
    let floats = MAX_K_SPLITS * MAX_ROWS * n;
    let partials = Some((script.alloc("partials", floats * 4), floats));
    let mut planned = Vec::new();
    for rows in PASSES {
        let wanted = |c: &(Family, Choice)| form.every_family || c.0 == Family::Few || rows == 40;
        for (_, choice) in choices(rows, (form.mma, form.few.rows))
            .into_iter()
            .filter(wanted)
        {
            let name = format!("y{}", planned.len());
            let y = script.alloc(&name, rows * n * 4);
            let launches = choice.launches(
                weight.dtype,
                [w, x, y],
                (n, k),
                rows,
                row_blocks(k),
                partials,
            );
            let Launch::Ours {
                kernel: Kernel::MatVec { family, .. },
                ..
            } = launches[0]
            else {
                panic!("{launches:?}: not a mat-vec");
            };
            script.launches(&launches);
            script.save(&name);
            planned.push(((family, rows), name));
        }
    }
    script.run(binary);
    let read = |(key, y): ((Family, usize), String)| (key, script.floats(&y));
    planned.into_iter().map(read).collect()
}

/// The mat-vec kernels of each weight type the step takes, on the CPU: every pass's outputs
/// are candle's dot products within rounding, and the bits of a row do not depend on the
/// pass: one family's passes of 1 to 40 rows agree bit for bit, and the few-row form's agree
/// with the tensor cores' (which a process mixes by the rows of a pass), with the row's
/// units in one part, two, four and five (8,960 values: the 1.5B's down projection, its
/// 280 units not a multiple of the 16 warps), each few-row tile (1, 2, 4 and 8
/// rows, a unit's integers summed over 1, 2 and 4 lanes), a grid's last block short of
/// features (24 = 16 + 8), and the tensor cores' default blocks and two others (`8x16x2x4`,
/// the widest; `2x4x1`, 4 warps a part and rows whole).
#[test]
fn the_mat_vec_kernels_give_candles_sums_and_a_rows_bits_in_every_pass() {
    let shape = |tiles, warps, unroll, iterations| MmaShape {
        tiles,
        warps,
        unroll,
        iterations,
    };
    let default = matvec::mma_shape();
    let forms = [
        (default, 2, true),
        (default, 1, false),
        (default, 4, false),
        (shape(8, 16, 2, 4), 2, false),
        (shape(2, 4, 1, 0), 2, false),
    ];
    // Each form's build and runs on a thread of its own (a run is one thread).
    std::thread::scope(|scope| {
        for (mma, lanes, every_family) in forms {
            let few = FewForm {
                rows: matvec::MAX_FEW_ROWS,
                lanes,
            };
            scope.spawn(move || {
                mat_vec_passes_agree(&Form {
                    mma,
                    few,
                    every_family,
                })
            });
        }
    });
}

/// A source's shapes, and whether every family's passes run (the tiled kernels depend on
/// neither shape, so one form runs them; the others, the few-row form's passes and the
/// 40-row passes their bits are held to).
#[derive(Debug)]
struct Form {
    mma: MmaShape,
    few: FewForm,
    every_family: bool,
}

fn mat_vec_passes_agree(form: &Form) {
    let dir = tempfile::tempdir().unwrap();
    let source = source_for(matvec::SOURCE, form.mma, form.few);
    let binary = build("matvec", &source, &kernel_names(form.mma, form.few));
    let mut rng = ChaCha8Rng::seed_from_u64(36);
    let cases = [
        (GgmlDType::Q4K, 8192),
        (GgmlDType::Q6K, 8960),
        (GgmlDType::Q8_0, 512),
        (GgmlDType::Q5_0, 4096),
    ];
    for (dtype, k) in cases {
        let weight = Weight::random(&mut rng, dtype, (24, k));
        let (x, values) = q8_1_rows(&mut rng, 40, k);
        let outputs = passes(&binary, dir.path(), &weight, &x, form);
        let bits_of = |family: Family| &outputs.iter().find(|o| o.0 == (family, 40)).unwrap().1;
        let (tiled, mma) = (bits_of(Family::Narrow), bits_of(Family::Mma));
        for ((family, rows), y) in &outputs {
            let case = format!("{dtype:?} k {k}, {form:?}, {family:?}, {rows} rows");
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
