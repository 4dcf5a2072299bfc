//! Tests of the kernels against candle's dequantization: packing, accuracy, batch invariance,
//! at every kernel level this CPU supports.

use super::{
    CPU_KERNELS, Level, Packed, QK, Quant, Requested, amx, cpu_kernels, parse, q4k, q6k, q8_0,
    quantize_block, quantize_block_scalar,
};
use candle_core::quantized::k_quants::{self, BlockQ4K, BlockQ5_0, BlockQ6K, BlockQ8_0, GgmlType};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};

/// Deterministic pseudo-random values in [-1, 1) (a 64-bit LCG), with a few larger outliers
/// like real activations have.
fn values(len: usize, seed: u64) -> Vec<f32> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..len)
        .map(|i| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let v = ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0;
            if i % 97 == 0 { v * 8.0 } else { v }
        })
        .collect()
}

/// Shapes with odd `n` and the models' k (1536 and 8960 for the 1.5B target).
const SHAPES: [(usize, usize); 7] = [
    (1, 256),
    (17, 512),
    (37, 768),
    (100, 1024),
    (48, 256),
    (23, 1536),
    (9, 8960),
];
/// Shapes for the 32-value block formats: the draft's k (896, 4864) and odd block counts.
const SHAPES_32: [(usize, usize); 7] = [
    (1, 32),
    (17, 96),
    (37, 896),
    (21, 4864),
    (48, 224),
    (23, 1536),
    (9, 8960),
];

/// The kernel levels this CPU runs; every test covers each.
fn levels() -> Vec<Level> {
    [Level::Avx512Vnni, Level::AvxVnni, Level::Avx2]
        .into_iter()
        .filter(|l| l.supported())
        .collect()
}

struct Case {
    level: Level,
    packed: Packed,
    /// candle's dequantization of the weight, `[n][k]`.
    dequant: Vec<f32>,
    n: usize,
    k: usize,
    quant: Quant,
    seed: u64,
}

fn case(level: Level, quant: Quant, n: usize, k: usize, seed: u64) -> Case {
    let dtype = match quant {
        Quant::Q4K => GgmlDType::Q4K,
        Quant::Q6K => GgmlDType::Q6K,
        Quant::Q8_0 => GgmlDType::Q8_0,
        Quant::Q5_0 => GgmlDType::Q5_0,
    };
    let w = Tensor::from_vec(values(n * k, seed), (n, k), &Device::Cpu).unwrap();
    let q = QTensor::quantize(&w, dtype).unwrap();
    let dequant = q
        .dequantize(&Device::Cpu)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    let packed = Packed::at_level(level, quant, &q.data().unwrap(), n, k).unwrap();
    Case {
        level,
        packed,
        dequant,
        n,
        k,
        quant,
        seed,
    }
}

fn cases() -> Vec<Case> {
    let mut out = Vec::new();
    for level in levels() {
        for (i, &(n, k)) in SHAPES.iter().enumerate() {
            out.push(case(level, Quant::Q4K, n, k, i as u64));
            out.push(case(level, Quant::Q6K, n, k, 100 + i as u64));
        }
        for (i, &(n, k)) in SHAPES_32.iter().enumerate() {
            out.push(case(level, Quant::Q8_0, n, k, 200 + i as u64));
            out.push(case(level, Quant::Q5_0, n, k, 300 + i as u64));
        }
    }
    out
}

#[test]
fn packing_keeps_every_weight() {
    for c in cases() {
        for col in 0..c.n {
            for k in 0..c.k {
                let got = match &c.packed.tiles {
                    super::Tiles::Q4K(p) => q4k::packed_value(p, col, k),
                    super::Tiles::Q6K(p) => q6k::packed_value(p, col, k),
                    super::Tiles::Block32(p) => q8_0::packed_value(p, col, k),
                };
                assert_eq!(
                    got.to_bits(),
                    c.dequant[col * c.k + k].to_bits(),
                    "{col},{k}"
                );
            }
        }
    }
}

/// `max_r |y_r - ref_r| / |ref_r|` over rows, with `ref` computed in f64.
fn rel_error(c: &Case, x: &[f32], y: &[f32]) -> f64 {
    let m = x.len() / c.k;
    let mut worst = 0f64;
    for r in 0..m {
        let xr = &x[r * c.k..(r + 1) * c.k];
        let (mut err, mut norm) = (0f64, 0f64);
        for col in 0..c.n {
            let w = &c.dequant[col * c.k..(col + 1) * c.k];
            let reference: f64 = xr.iter().zip(w).map(|(&a, &b)| a as f64 * b as f64).sum();
            err += (y[r * c.n + col] as f64 - reference).powi(2);
            norm += reference.powi(2);
        }
        worst = worst.max((err / norm).sqrt());
    }
    worst
}

/// candle's compact kernel on the same weights (re-quantized the same deterministic way);
/// `None` where it does not run: its Q5_0 kernel needs an even number of blocks.
fn candle_compact(c: &Case, x: &[f32]) -> Option<Vec<f32>> {
    if c.quant == Quant::Q5_0 && (c.k / q8_0::QB) % 2 == 1 {
        return None;
    }
    fn run<T: GgmlType>(c: &Case, x: &[f32], seed: u64) -> Vec<f32> {
        let w = values(c.n * c.k, seed);
        let mut blocks = vec![T::zeros(); c.n * c.k / T::BLCK_SIZE];
        T::from_float(&w, &mut blocks);
        let m = x.len() / c.k;
        let mut y = vec![0f32; m * c.n];
        k_quants::matmul((m, c.k, c.n), x, &blocks, &mut y).unwrap();
        y
    }
    Some(match c.quant {
        Quant::Q4K => run::<BlockQ4K>(c, x, c.seed),
        Quant::Q6K => run::<BlockQ6K>(c, x, c.seed),
        Quant::Q8_0 => run::<BlockQ8_0>(c, x, c.seed),
        Quant::Q5_0 => run::<BlockQ5_0>(c, x, c.seed),
    })
}

#[test]
fn matches_the_dequantized_reference() {
    for c in cases() {
        let m = 5;
        let x = values(m * c.k, 7);
        let y = c.packed.matmul(&x, m);
        // Against the activations as the kernel quantized them, only f32 rounding is left.
        let dequant = |qs: &[i32], d: f32| -> Vec<f32> {
            qs.iter()
                .flat_map(|v| v.to_le_bytes().map(|b| b as i8 as f32 * d))
                .collect()
        };
        let xq: Vec<f32> = match c.quant {
            Quant::Q4K | Quant::Q6K => x
                .chunks_exact(QK)
                .flat_map(|block| {
                    let q = quantize_block(block, c.level);
                    dequant(&q.qs, q.d)
                })
                .collect(),
            Quant::Q8_0 | Quant::Q5_0 => x
                .chunks_exact(q8_0::QB)
                .flat_map(|block| {
                    let q = q8_0::quantize(block, c.level);
                    dequant(&q.qs, q.d)
                })
                .collect(),
        };
        let exact = rel_error(&c, &xq, &y);
        assert!(exact < 1e-5, "{:?} {}x{}: {exact}", c.level, c.n, c.k);
        // Against f32 activations the 8-bit activation quantization dominates (0.5-3% here,
        // with the outliers); candle's compact kernel quantizes the same way.
        let full = rel_error(&c, &x, &y);
        let Some(candle) = candle_compact(&c, &x) else {
            continue;
        };
        let candle = rel_error(&c, &x, &candle);
        assert!(
            full < 1.2 * candle + 1e-4,
            "{:?} {}x{}: {full} vs {candle}",
            c.level,
            c.n,
            c.k
        );
    }
}

#[test]
fn rows_do_not_depend_on_the_batch() {
    for c in cases() {
        let m = 17;
        let x = values(m * c.k, 11);
        let all = c.packed.matmul(&x, m);
        // Each row alone.
        for r in 0..m {
            let one = c.packed.matmul(&x[r * c.k..(r + 1) * c.k], 1);
            let same = one
                .iter()
                .zip(&all[r * c.n..(r + 1) * c.n])
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{:?} {}x{} row {r}", c.level, c.n, c.k);
        }
        // Rows permuted, and sub-batches of several sizes (different row tilings).
        for (len, stride) in [(17, 5), (9, 7), (3, 4), (8, 3), (12, 13)] {
            let order: Vec<usize> = (0..len).map(|i| (i * stride + 3) % m).collect();
            let xp: Vec<f32> = order
                .iter()
                .flat_map(|&r| x[r * c.k..(r + 1) * c.k].iter().copied())
                .collect();
            let yp = c.packed.matmul(&xp, len);
            for (i, &r) in order.iter().enumerate() {
                let same = yp[i * c.n..(i + 1) * c.n]
                    .iter()
                    .zip(&all[r * c.n..(r + 1) * c.n])
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(
                    same,
                    "{:?} {}x{} row {r} at {i} of {len}",
                    c.level, c.n, c.k
                );
            }
        }
    }
}

#[test]
fn simd_quantization_matches_the_scalar_reference() {
    let mut x = values(64 * QK, 5);
    // Exact ties, zeros, tiny and huge values, and blocks that are all zero or hold a NaN.
    x[3] = 0.5 * 8.0 / 127.0;
    x[QK..2 * QK].fill(0.0);
    x[2 * QK + 7] = 1e-30;
    x[3 * QK + 9] = 3e30;
    x[4 * QK + 1] = f32::NAN;
    x[5 * QK + 2] = f32::INFINITY;
    x[6 * QK..7 * QK].fill(1e-39);
    // Every level quantizes like the scalar reference (below AVX-512 it is the reference).
    for level in levels() {
        for block in x.chunks_exact(QK) {
            let (a, b) = (quantize_block(block, level), quantize_block_scalar(block));
            assert_eq!(a.qs, b.qs);
            assert_eq!(a.sums16, b.sums16);
            assert_eq!(a.sums32, b.sums32);
            assert_eq!(a.bias16, b.bias16);
            assert_eq!(a.d.to_bits(), b.d.to_bits());
        }
        for block in x.chunks_exact(q8_0::QB) {
            let (a, b) = (q8_0::quantize(block, level), q8_0::quantize_scalar(block));
            assert_eq!(a.qs, b.qs);
            assert_eq!(a.sum, b.sum);
            assert_eq!(a.d.to_bits(), b.d.to_bits());
        }
    }
}

/// Q8_0 weights at the ends of their range (-128, 127) times activations at ±127: the products
/// that would saturate vpmaddubsw's i16 sums with unsigned `q + 128` weights.
#[test]
fn extreme_q8_0_weights_are_exact() {
    let (n, k) = (16, 64);
    let mut bytes = Vec::new();
    for col in 0..n {
        for b in 0..k / q8_0::QB {
            bytes.extend_from_slice(&half::f16::from_f32(1.0).to_bits().to_le_bytes());
            bytes.extend((0..q8_0::QB).map(|i| match (col + b + i) % 3 {
                0 => 0x80, // -128
                1 => 0x7F, // 127
                _ => 0x81, // -127
            }));
        }
    }
    // Activations that quantize to exactly ±127, in patterns with and against the weights'.
    let x: Vec<f32> = (0..2 * k)
        .map(|i| if (i / 3 + i / k) % 2 == 0 { 1.0 } else { -1.0 })
        .collect();
    for level in levels() {
        let packed = Packed::at_level(level, Quant::Q8_0, &bytes, n, k).unwrap();
        let y = packed.matmul(&x, 2);
        for r in 0..2 {
            for col in 0..n {
                let reference: f64 = (0..k)
                    .map(|kk| {
                        let q = bytes[col * (k / q8_0::QB) * 34 + (kk / 32) * 34 + 2 + kk % 32];
                        f64::from(q as i8) * f64::from(x[r * k + kk])
                    })
                    .sum();
                let got = f64::from(y[r * n + col]);
                assert!(
                    (got - reference).abs() < 1e-4,
                    "{level:?} {r},{col}: {got} vs {reference}"
                );
            }
        }
    }
}

/// Every name the workers' configuration accepts is one the engine reads, each for its own
/// kernels, and the name the process reports is one of them.
#[test]
fn the_kernels_names_are_the_ones_the_engine_reads() {
    let read: Vec<_> = CPU_KERNELS.iter().map(|name| parse(name)).collect();
    assert_eq!(
        read,
        [
            Some(Requested::Amx),
            Some(Requested::Level(Level::Avx512Vnni)),
            Some(Requested::Level(Level::AvxVnni)),
            Some(Requested::Level(Level::Avx2)),
            Some(Requested::Level(Level::None)),
        ]
    );
    assert_eq!(parse("sse2"), None);
    assert!(CPU_KERNELS.contains(&cpu_kernels()), "{}", cpu_kernels());
}

/// GGUF bytes of `[n, k]` Q4_K and Q6_K weights at the formats' extremes: every scale and
/// min at its largest magnitude (Q6_K's scales -128 and 127), values all 0 or all at their
/// top (15, 63) by column and block, so the unpacked products reach their bounds.
fn extreme_k_quants(n: usize, k: usize) -> [(Quant, Vec<u8>); 2] {
    let one = half::f16::from_f32(1.0).to_bits().to_le_bytes();
    let (mut q4, mut q6) = (Vec::new(), Vec::new());
    for col in 0..n {
        for b in 0..k / QK {
            let top = (col + b) % 2 == 0;
            let v = if top { 0xFF } else { 0x00 };
            q4.extend_from_slice(&one);
            q4.extend_from_slice(&one);
            q4.extend([0xFF; 12]);
            q4.extend([v; 128]);
            q6.extend([v; 128 + 64]);
            q6.extend((0..16).map(|s| if (s + col) % 2 == 0 { 0x80 } else { 0x7F }));
            q6.extend_from_slice(&one);
        }
    }
    [(Quant::Q4K, q4), (Quant::Q6K, q6)]
}

/// AMX tiles and the AVX-512 kernels give bitwise the same rows, for row counts that fill
/// tiles, leave a partial tile, and pair tiles; on random weights and at the formats'
/// extremes with activations that quantize to ±127.
#[test]
fn amx_tiles_give_the_avx512_kernels_bits() {
    if !amx::enabled() {
        eprintln!("skipped: this CPU (or DUET_CPU_KERNELS) runs no AMX tiles");
        return;
    }
    let mut weights: Vec<(Quant, Packed, usize, usize)> = Vec::new();
    for (i, &(n, k)) in SHAPES.iter().enumerate() {
        for quant in [Quant::Q4K, Quant::Q6K] {
            let c = case(Level::Avx512Vnni, quant, n, k, 400 + i as u64);
            weights.push((quant, c.packed, n, k));
        }
    }
    for (quant, bytes) in extreme_k_quants(33, 512) {
        let packed = Packed::at_level(Level::Avx512Vnni, quant, &bytes, 33, 512).unwrap();
        weights.push((quant, packed, 33, 512));
    }
    for (quant, packed, n, k) in &weights {
        for m in [amx::MIN_ROWS, 16, 17, 32, 33, 40] {
            let mut x = values(m * k, 13);
            // Rows of ±1: every activation quantizes to ±127.
            for (i, v) in x[..k * 2].iter_mut().enumerate() {
                *v = if (i / 5) % 2 == 0 { 1.0 } else { -1.0 };
            }
            let tiles = packed.matmul_on(&x, m, true);
            let kernels = packed.matmul_on(&x, m, false);
            assert_eq!(tiles.len(), m * n);
            for (i, (a, b)) in tiles.iter().zip(&kernels).enumerate() {
                assert_eq!(
                    a.to_bits(),
                    b.to_bits(),
                    "{quant:?} {n}x{k} m={m} row {} col {}: {a} vs {b}",
                    i / n,
                    i % n
                );
            }
        }
    }
}

/// Timing of the kernels alone on the models' shapes (the 1.5B target's FFN and attention
/// projections, the 0.5B draft's FFN and a slice of its lm_head), a measurement rather than a
/// test: `cargo test --release -p duet-engine --lib kernel_speed -- --ignored --nocapture`.
#[test]
#[ignore]
fn kernel_speed() {
    let level = levels()[0];
    for (quant, n, k) in [
        (Quant::Q4K, 8960, 1536),
        (Quant::Q6K, 1536, 8960),
        (Quant::Q4K, 1536, 1536),
        (Quant::Q5_0, 4864, 896),
        (Quant::Q8_0, 8192, 896),
    ] {
        let c = case(level, quant, n, k, 1);
        for m in [1, 4, 8, 9, 12, 16, 32, 64] {
            let x = values(m * k, 3);
            let _ = c.packed.matmul(&x, m);
            let per = per_call(3000 / m, |_| {
                std::hint::black_box(c.packed.matmul(&x, m));
            });
            let gmacs = (m * n * k) as f64 / per / 1e9;
            println!(
                "{quant:?} {n}x{k} m={m:2}: {:7.3} ms, {:6.3} ms/row, {gmacs:6.1} GMAC/s",
                per * 1e3,
                per * 1e3 / m as f64
            );
        }
    }
}

/// One-row products from memory, as decode runs them: eight copies of each weight (past the
/// caches) taken in turn, ours against candle's compact kernel, in GB/s of weights read; a
/// measurement rather than a test: `cargo test --release -p duet-engine --lib
/// one_row_from_memory -- --ignored --nocapture`.
#[test]
#[ignore]
fn one_row_from_memory() {
    const COPIES: usize = 8;
    fn blocks<T: GgmlType>(n: usize, k: usize, seed: u64) -> Vec<T> {
        let mut blocks = vec![T::zeros(); n * k / T::BLCK_SIZE];
        T::from_float(&values(n * k, seed), &mut blocks);
        blocks
    }
    fn candle<T: GgmlType>(n: usize, k: usize, x: &[f32]) -> impl FnMut(usize) {
        let weights: Vec<Vec<T>> = (0..COPIES).map(|s| blocks(n, k, s as u64)).collect();
        let x = x.to_vec();
        move |i| {
            let mut y = vec![0f32; n];
            k_quants::matmul((1, k, n), &x, &weights[i % COPIES], &mut y).unwrap();
            std::hint::black_box(y);
        }
    }
    let level = levels()[0];
    for (quant, n, k) in [
        (Quant::Q4K, 8960, 1536),
        (Quant::Q6K, 1536, 8960),
        (Quant::Q4K, 1536, 1536),
        (Quant::Q4K, 17920, 1536),
    ] {
        let ours: Vec<Packed> = (0..COPIES)
            .map(|s| case(level, quant, n, k, s as u64).packed)
            .collect();
        let x = values(k, 7);
        let mut theirs: Box<dyn FnMut(usize)> = match quant {
            Quant::Q4K => Box::new(candle::<BlockQ4K>(n, k, &x)),
            _ => Box::new(candle::<BlockQ6K>(n, k, &x)),
        };
        let bytes = (n * k / QK) as f64 * if quant == Quant::Q4K { 144.0 } else { 210.0 };
        for _ in 0..3 {
            let a = per_call(200, |i| {
                std::hint::black_box(ours[i % COPIES].matmul(&x, 1));
            });
            let b = per_call(200, &mut theirs);
            println!(
                "{quant:?} {n}x{k} one row: ours {:.3} ms ({:.1} GB/s), candle {:.3} ms ({:.1} GB/s), {:.2}x",
                a * 1e3,
                bytes / a / 1e9,
                b * 1e3,
                bytes / b / 1e9,
                b / a
            );
        }
    }
}

/// Seconds per call of `f(i)` over `reps` calls (`i` counting them), for the timings above.
fn per_call(reps: usize, mut f: impl FnMut(usize)) -> f64 {
    let start = std::time::Instant::now();
    for i in 0..reps {
        f(i);
    }
    start.elapsed().as_secs_f64() / reps as f64
}

/// What this machine allows the kernels: the rate at which two threads (the kernels' pool on
/// two cores) stream a 1 GiB buffer from memory, the ceiling of one-row products; and where
/// the CPU has AVX-512 VNNI, the rate of independent 512-bit `vpdpbusd` on one core, the
/// ceiling of batched ones (64 multiply-adds each). A measurement rather than a test:
/// `cargo test --release -p duet-engine --lib machine_ceilings -- --ignored --nocapture`.
#[test]
#[ignore]
fn machine_ceilings() {
    let buffer = vec![1u64; 1 << 27];
    for _ in 0..3 {
        let start = std::time::Instant::now();
        let sum: u64 = std::thread::scope(|s| {
            let halves = buffer.chunks(buffer.len() / 2);
            let sums: Vec<_> = halves
                .map(|half| s.spawn(move || half.iter().fold(0u64, |a, &x| a.wrapping_add(x))))
                .collect();
            sums.into_iter().map(|h| h.join().unwrap()).sum()
        });
        let gb_s = (buffer.len() * 8) as f64 / start.elapsed().as_secs_f64() / 1e9;
        assert_eq!(sum, buffer.len() as u64);
        println!("two threads stream memory at {gb_s:.1} GB/s");
    }
    #[cfg(target_arch = "x86_64")]
    if Level::Avx512Vnni.supported() {
        for _ in 0..3 {
            // SAFETY: the CPU has the level's features (checked above).
            let rate = unsafe { dpbusd_per_second() };
            println!(
                "one core runs {:.2}G vpdpbusd/s ({:.0} GMAC/s)",
                rate / 1e9,
                rate * 64.0 / 1e9
            );
        }
    }
}

/// Independent 512-bit `vpdpbusd` a second on this thread: twelve accumulators, so that
/// the instruction's latency never waits.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
fn dpbusd_per_second() -> f64 {
    use std::arch::x86_64::*;
    const ROUNDS: usize = 50_000_000;
    let mut acc = [_mm512_setzero_si512(); 12];
    let mut w = _mm512_set1_epi8(3);
    let x = _mm512_set1_epi8(5);
    let start = std::time::Instant::now();
    for _ in 0..ROUNDS {
        for a in acc.iter_mut() {
            *a = _mm512_dpbusd_epi32(*a, w, x);
        }
        // Opaque to the compiler, so that the loop is not folded away.
        w = std::hint::black_box(w);
    }
    std::hint::black_box(acc);
    (ROUNDS * acc.len()) as f64 / start.elapsed().as_secs_f64()
}
