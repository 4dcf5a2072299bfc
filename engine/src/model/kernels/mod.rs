//! Batch-invariant CPU matmul kernels for Q4_K, Q6_K, Q8_0 and Q5_0 weights times f32
//! activations.
//!
//! Why: greedy speculative decoding is exact only if the target computes a row of activations
//! bitwise the same whether it is alone (decode) or one of K+1 rows (verification). candle's
//! compact kernel has that property but costs m times the single-row time; its repacked kernel
//! amortizes the weights over rows but reads more bytes for one row and rounds differently.
//!
//! How: weights are repacked once at load into tiles of 16 output columns by one 256-value
//! super-block (or one 32-value block), with exactly GGUF's byte count (4.5 / 6.5 / 8.5 / 5.5
//! bits per weight), laid out so that one AVX-512 VNNI `vpdpbusd` multiplies 4 k-values of 16
//! columns by 4 broadcast activation bytes. A tile is unpacked into registers once and reused
//! for every row of a row tile; each row keeps its own accumulators and goes through the same
//! instruction sequence whatever the row tile size, so its result does not depend on the
//! batch. Activations are quantized per row to 8 bits with one scale per 256 values (like
//! candle's Q8_K), or per 32 values for the 32-value block formats Q8_0 and Q5_0 (`q8_0`),
//! which need `k` to be a multiple of 32 only.
//!
//! Levels ([`Level`]): the same tiles also serve CPUs without AVX-512 (AMD Zen 2/3, older or
//! client Intel), read as two 256-bit halves of 8 columns by AVX2 kernels (`avx2`), with
//! AVX-VNNI's 256-bit `vpdpbusd` where present and `vpmaddubsw` otherwise. A process runs one
//! level, the best its CPU has, or the one `DUET_CPU_KERNELS` (`avx512`, `avxvnni`, `avx2`,
//! `off`) names, read once at first use. Levels round differently from each other (integer
//! sums are exact at every level, but scales are applied in different orders); each is
//! batch-invariant on its own.
//!
//! AMX (`amx`): where the AVX-512 level runs on a CPU with Intel AMX (Xeons since Sapphire
//! Rapids), Q4_K and Q6_K products of [`amx::MIN_ROWS`] rows or more run on the tile unit,
//! bitwise the same as the AVX-512 kernels (`DUET_CPU_KERNELS=avx512` keeps it off; `amx`
//! asks for it, as the default does).
//!
//! Column tiles are spread over candle's barrier pool (the threads candle itself uses). Each
//! thread streams its tiles in address order and prefetches ahead of itself in software: with
//! one stream per core the hardware prefetcher alone falls short of candle's compact kernel
//! on weights that live in DRAM (the 190 MB lm_head), though it is faster in cache. The
//! 256-bit bodies for one row are the exception: they read each tile in one pass, which
//! spreads the misses evenly enough for the hardware prefetcher, and a software prefetch
//! only slows them (`q4k::one_row256`).

mod amx;
mod avx2;
mod q4k;
mod q5_0;
mod q6k;
mod q8_0;

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, OnceLock};

/// Values per GGUF k-quant super-block.
pub(crate) const QK: usize = 256;
/// Output columns per packed tile (one 512-bit vector of i32 / f32 lanes).
pub(crate) const TILE: usize = 16;
/// Most rows sharing one unpacked tile (bounded by the 32 vector registers).
const ROW_TILE: usize = 8;

/// Which implementation of the kernels this process runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Level {
    /// AVX-512 F/BW with VNNI: one 512-bit vector per tile row.
    Avx512Vnni,
    /// AVX2/FMA/F16C with AVX-VNNI (`vpdpbusd` on 256 bits), e.g. Alder Lake and later.
    AvxVnni,
    /// AVX2/FMA/F16C (x86-64-v3), e.g. AMD Zen 2/3: u8 x i8 products via vpmaddubsw.
    Avx2,
    /// No kernels: `Linear` uses candle's.
    None,
}

impl Level {
    /// Whether this CPU has the level's instructions.
    pub(crate) fn supported(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c");
            match self {
                Level::Avx512Vnni => {
                    is_x86_feature_detected!("avx512f")
                        && is_x86_feature_detected!("avx512bw")
                        && is_x86_feature_detected!("avx512vnni")
                }
                Level::AvxVnni => avx2 && is_x86_feature_detected!("avxvnni"),
                Level::Avx2 => avx2,
                Level::None => true,
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            self == Level::None
        }
    }
}

/// What `DUET_CPU_KERNELS` asks for, read once: a level, or `amx` (the AVX-512 level with
/// AMX tiles for products of several rows, where the CPU has them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Requested {
    Amx,
    Level(Level),
}

/// The names `DUET_CPU_KERNELS` and the workers' `cpu_kernels` take, best first (the
/// workers check their configuration against it).
pub const CPU_KERNELS: [&str; 5] = ["amx", "avx512", "avxvnni", "avx2", "off"];

/// What one of [`CPU_KERNELS`] asks for; `None` for any other name.
fn parse(name: &str) -> Option<Requested> {
    match name {
        "amx" => Some(Requested::Amx),
        "avx512" => Some(Requested::Level(Level::Avx512Vnni)),
        "avxvnni" => Some(Requested::Level(Level::AvxVnni)),
        "avx2" => Some(Requested::Level(Level::Avx2)),
        "off" => Some(Requested::Level(Level::None)),
        _ => None,
    }
}

fn requested() -> Option<Requested> {
    static REQUESTED: OnceLock<Option<Requested>> = OnceLock::new();
    *REQUESTED.get_or_init(|| parse(&std::env::var("DUET_CPU_KERNELS").ok()?))
}

/// The level this process runs, chosen once at first use: the best this CPU supports, or
/// the one `DUET_CPU_KERNELS` (`avx512`, `avxvnni`, `avx2` or `off`) names to test or compare
/// another. A requested level the CPU lacks falls back to the best supported one. Whether
/// the AVX-512 level also uses AMX tiles is [`amx::enabled`].
pub(crate) fn level() -> Level {
    static LEVEL: OnceLock<Level> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        let best = [Level::Avx512Vnni, Level::AvxVnni, Level::Avx2]
            .into_iter()
            .find(|l| l.supported())
            .unwrap_or(Level::None);
        match requested() {
            Some(Requested::Level(l)) if l.supported() => l,
            _ => best,
        }
    })
}

/// The CPU kernels this process runs, by its name in [`CPU_KERNELS`] (`off`: candle's).
pub fn cpu_kernels() -> &'static str {
    match level() {
        Level::Avx512Vnni if amx::enabled() => "amx",
        Level::Avx512Vnni => "avx512",
        Level::AvxVnni => "avxvnni",
        Level::Avx2 => "avx2",
        Level::None => "off",
    }
}

/// Whether this process runs the kernels (see [`level`]).
pub(crate) fn available() -> bool {
    level() != Level::None
}

/// Calls `$kernel::<R, ...>(args)` with the const `R` equal to `$rows` (1 to [`ROW_TILE`]).
macro_rules! with_rows {
    ($rows:expr, $kernel:ident::<R $(, $c:tt)*>($($arg:expr),* $(,)?)) => {
        match $rows {
            1 => $kernel::<1 $(, $c)*>($($arg),*),
            2 => $kernel::<2 $(, $c)*>($($arg),*),
            3 => $kernel::<3 $(, $c)*>($($arg),*),
            4 => $kernel::<4 $(, $c)*>($($arg),*),
            5 => $kernel::<5 $(, $c)*>($($arg),*),
            6 => $kernel::<6 $(, $c)*>($($arg),*),
            7 => $kernel::<7 $(, $c)*>($($arg),*),
            8 => $kernel::<8 $(, $c)*>($($arg),*),
            r => unreachable!("row tile of {r} rows"),
        }
    };
}
use with_rows;

/// The weight types the kernels handle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Quant {
    Q4K,
    Q6K,
    Q8_0,
    Q5_0,
}

/// A weight matrix `[n, k]` repacked for the kernels.
#[derive(Debug)]
pub(crate) struct Packed {
    level: Level,
    n: usize,
    k: usize,
    tiles: Tiles,
}

#[derive(Debug)]
enum Tiles {
    Q4K(q4k::Packed),
    Q6K(q6k::Packed),
    /// Q8_0 or Q5_0.
    Block32(q8_0::Packed),
}

/// One activation row's 256-value block quantized to 8 bits: `x ≈ d * qs`.
#[derive(Debug, Clone)]
#[repr(C, align(64))]
pub(crate) struct RowBlock {
    /// The 256 quantized values, 4 per i32 (little-endian), so one i32 broadcast feeds vpdpbusd.
    pub(crate) qs: [i32; QK / 4],
    /// Sums of `qs` over each 16 values, in i16 pairs (sums 2p, 2p+1 in the low, high half):
    /// Q6_K's offset of 32 in the 256-bit kernels.
    pub(crate) sums16: [i32; 8],
    /// Sums of `qs` over each 32 values, in i16 pairs.
    pub(crate) sums32: [i32; 4],
    /// `-32` times the sum of `qs` over each 16 values: Q6_K's offset of 32, which the
    /// AVX-512 kernel folds into each sub-block's dot product.
    pub(crate) bias16: [i32; 16],
    pub(crate) d: f32,
}

impl RowBlock {
    const ZERO: Self = Self {
        qs: [0; QK / 4],
        sums16: [0; 8],
        sums32: [0; 4],
        bias16: [0; 16],
        d: 0.0,
    };
}

impl Packed {
    /// Repacks GGUF blocks (`bytes`, row-major `[n][k / block]` blocks) of a `[n, k]` weight.
    /// `None` when the CPU lacks the instructions or the shape does not fit the kernels.
    pub(crate) fn new(quant: Quant, bytes: &[u8], n: usize, k: usize) -> Option<Self> {
        Self::at_level(level(), quant, bytes, n, k)
    }

    /// [`Packed::new`] for the kernels of `level` (the layout is the same for all levels).
    pub(crate) fn at_level(
        level: Level,
        quant: Quant,
        bytes: &[u8],
        n: usize,
        k: usize,
    ) -> Option<Self> {
        let block = match quant {
            Quant::Q4K | Quant::Q6K => QK,
            Quant::Q8_0 | Quant::Q5_0 => q8_0::QB,
        };
        if level == Level::None
            || !level.supported()
            || n == 0
            || k == 0
            || !k.is_multiple_of(block)
        {
            return None;
        }
        let tiles = match quant {
            Quant::Q4K => Tiles::Q4K(q4k::Packed::new(bytes, n, k)?),
            Quant::Q6K => Tiles::Q6K(q6k::Packed::new(bytes, n, k)?),
            Quant::Q8_0 => Tiles::Block32(q8_0::Packed::new(q8_0::Format::Q8_0, bytes, n, k)?),
            Quant::Q5_0 => Tiles::Block32(q8_0::Packed::new(q8_0::Format::Q5_0, bytes, n, k)?),
        };
        Some(Self { level, n, k, tiles })
    }

    /// `y = x W^T` for `x` of `m` rows of `k` values; returns `m` rows of `n` values.
    pub(crate) fn matmul(&self, x: &[f32], m: usize) -> Vec<f32> {
        self.matmul_on(x, m, self.on_tiles(m))
    }

    /// [`Packed::matmul`], on AMX tiles where `tiles` is set and the weight type has a tile
    /// path (Q4_K, Q6_K).
    fn matmul_on(&self, x: &[f32], m: usize, tiles: bool) -> Vec<f32> {
        assert!(
            !tiles || (self.level == Level::Avx512Vnni && amx::enabled()),
            "AMX tiles asked for where they are not enabled"
        );
        assert_eq!(
            x.len(),
            m * self.k,
            "activation shape does not match the weight"
        );
        // Blocks never straddle rows (k is a multiple of the block), so each row is quantized
        // on its own.
        let level = self.level;
        match &self.tiles {
            Tiles::Q4K(p) => {
                let rows: Vec<RowBlock> = x
                    .chunks_exact(QK)
                    .map(|x| quantize_block(x, level))
                    .collect();
                if tiles {
                    return self.run_amx(rows, m, |amx, tile, rows, acc| {
                        p.dot_tile_amx(amx, tile, rows, acc)
                    });
                }
                self.run(&rows, m, |tile, rows, acc| {
                    p.dot_tile(level, tile, rows, acc)
                })
            }
            Tiles::Q6K(p) => {
                let rows: Vec<RowBlock> = x
                    .chunks_exact(QK)
                    .map(|x| quantize_block(x, level))
                    .collect();
                if tiles {
                    return self.run_amx(rows, m, |amx, tile, rows, acc| {
                        p.dot_tile_amx(amx, tile, rows, acc)
                    });
                }
                self.run(&rows, m, |tile, rows, acc| {
                    p.dot_tile(level, tile, rows, acc)
                })
            }
            Tiles::Block32(p) => {
                let rows: Vec<_> = x
                    .chunks_exact(q8_0::QB)
                    .map(|x| q8_0::quantize(x, level))
                    .collect();
                self.run(&rows, m, |tile, rows, acc| {
                    p.dot_tile(level, tile, rows, acc)
                })
            }
        }
    }

    /// Whether a product of `m` rows runs on AMX tiles.
    fn on_tiles(&self, m: usize) -> bool {
        self.level == Level::Avx512Vnni && m >= amx::MIN_ROWS && amx::enabled()
    }

    /// [`Packed::run`] on AMX tiles: each worker configures its thread's tiles once, and
    /// `dot(tiles, column tile, all rows' blocks, accumulators)` takes every row at once,
    /// the blocks padded with zero rows to whole 16-row tiles.
    fn run_amx(
        &self,
        mut rows: Vec<RowBlock>,
        m: usize,
        dot: impl Fn(&mut amx::Scratch, usize, &[RowBlock], &mut [[f32; TILE]]) + Sync,
    ) -> Vec<f32> {
        let n = self.n;
        let kb = rows.len() / m;
        rows.resize(m.next_multiple_of(amx::ROWS) * kb, RowBlock::ZERO);
        let out: Vec<AtomicU32> = (0..m * n).map(|_| AtomicU32::new(0)).collect();
        candle_core::utils::barrier_pool().execute_chunked(n.div_ceil(TILE), |range| {
            let mut amx = amx::Scratch::new();
            let mut acc = vec![[0f32; TILE]; m];
            for tile in range {
                acc.fill([0.0; TILE]);
                dot(&mut amx, tile, &rows, &mut acc);
                store_rows(&out, n, tile, 0, &acc);
            }
        });
        collect(out)
    }

    /// Runs `dot(column tile, row tile's blocks, accumulators)` over all column tiles and row
    /// tiles of `m` rows of quantized blocks `rows`, and gathers the output.
    fn run<B: Sync>(
        &self,
        rows: &[B],
        m: usize,
        dot: impl Fn(usize, &[B], &mut [[f32; TILE]]) + Sync,
    ) -> Vec<f32> {
        let n = self.n;
        let kb = rows.len() / m;
        let out: Vec<AtomicU32> = (0..m * n).map(|_| AtomicU32::new(0)).collect();
        let n_tiles = n.div_ceil(TILE);
        candle_core::utils::barrier_pool().execute_chunked(n_tiles, |range| {
            for tile in range {
                let mut r0 = 0;
                while r0 < m {
                    let rt = ROW_TILE.min(m - r0);
                    let rows = &rows[r0 * kb..(r0 + rt) * kb];
                    let mut acc = [[0f32; TILE]; ROW_TILE];
                    dot(tile, rows, &mut acc[..rt]);
                    store_rows(&out, n, tile, r0, &acc[..rt]);
                    r0 += rt;
                }
            }
        });
        collect(out)
    }
}

/// Stores the accumulators `acc` of rows `r0..` and column tile `tile` into `out` (`[m][n]`).
/// Workers own disjoint columns of the output but interleave within each row, so they store
/// through relaxed atomics (plain moves on x86) rather than aliasing `&mut`.
fn store_rows(out: &[AtomicU32], n: usize, tile: usize, r0: usize, acc: &[[f32; TILE]]) {
    let cols = TILE.min(n - tile * TILE);
    for (r, acc) in acc.iter().enumerate() {
        let dst = &out[(r0 + r) * n + tile * TILE..][..cols];
        for (o, &v) in dst.iter().zip(acc) {
            o.store(v.to_bits(), Ordering::Relaxed);
        }
    }
}

fn collect(out: Vec<AtomicU32>) -> Vec<f32> {
    out.into_iter()
        .map(|v| f32::from_bits(v.into_inner()))
        .collect()
}

/// Quantizes 256 activations to 8 bits with one scale (round to nearest, ties to even). Rows
/// are quantized on their own, so a row's blocks never depend on the batch either. Below
/// AVX-512 the scalar version serves (the quantization is a small part of a matmul).
fn quantize_block(x: &[f32], level: Level) -> RowBlock {
    #[cfg(target_arch = "x86_64")]
    if level == Level::Avx512Vnni {
        // SAFETY: a `Packed` of this level exists only where the CPU has AVX-512F/BW.
        return unsafe { quantize_block_avx512(x) };
    }
    quantize_block_scalar(x)
}

/// How an activation block whose largest magnitude is `amax` gets quantized: `Ok(iscale)`
/// (values become `round(x * iscale)`, and the block's scale is `1 / iscale`), or `Err(d)`
/// when every value quantizes to zero: `d` is 0, or NaN when the block held a NaN or an
/// infinity (which must poison the result rather than vanish).
pub(crate) fn block_scale(amax: f32, nan: bool) -> Result<f32, f32> {
    if amax == 0.0 || !amax.is_finite() || nan {
        return Err(if amax == 0.0 && !nan { 0.0 } else { f32::NAN });
    }
    let iscale = 127.0 / amax;
    if !iscale.is_finite() {
        // Only subnormal values: they round to zero in any case.
        return Err(0.0);
    }
    Ok(iscale)
}

/// [`quantize_block`] with AVX-512, bitwise equal to the scalar version (tested).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
fn quantize_block_avx512(x: &[f32]) -> RowBlock {
    let x: &[f32; QK] = x.try_into().expect("a block of 256 values");
    let mut v = [_mm512_setzero_ps(); QK / TILE];
    let mut amax = _mm512_setzero_ps();
    let mut nan = 0u16;
    for (i, v) in v.iter_mut().enumerate() {
        let sixteen: &[f32; TILE] = x[TILE * i..TILE * (i + 1)].try_into().unwrap();
        // SAFETY: `sixteen` is 16 readable f32; the load is unaligned.
        *v = unsafe { _mm512_loadu_ps(sixteen.as_ptr()) };
        amax = _mm512_max_ps(amax, _mm512_abs_ps(*v));
        nan |= _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(*v, *v);
    }
    let amax = _mm512_reduce_max_ps(amax);
    let mut block = RowBlock::ZERO;
    let iscale = match block_scale(amax, nan != 0) {
        Ok(iscale) => iscale,
        Err(d) => {
            block.d = d;
            return block;
        }
    };
    block.d = 1.0 / iscale;
    let scale = _mm512_set1_ps(iscale);
    let mut sums = [0i32; QK / TILE];
    for (i, v) in v.iter().enumerate() {
        // Rounds to nearest even (the MXCSR default, which Rust never changes).
        let q = _mm512_cvtps_epi32(_mm512_mul_ps(*v, scale));
        let q = _mm512_max_epi32(
            _mm512_min_epi32(q, _mm512_set1_epi32(127)),
            _mm512_set1_epi32(-127),
        );
        sums[i] = _mm512_reduce_add_epi32(q);
        block.bias16[i] = -32 * sums[i];
        let dst: &mut [i32; 4] = (&mut block.qs[4 * i..4 * i + 4]).try_into().unwrap();
        // SAFETY: `dst` is 16 writable bytes; the store is unaligned.
        unsafe { _mm_storeu_si128(dst.as_mut_ptr().cast(), _mm512_cvtepi32_epi8(q)) };
    }
    let pair = |lo: i32, hi: i32| (lo & 0xFFFF) | (hi << 16);
    for p in 0..8 {
        block.sums16[p] = pair(sums[2 * p], sums[2 * p + 1]);
    }
    for p in 0..4 {
        let (a, b, c, d) = (
            sums[4 * p],
            sums[4 * p + 1],
            sums[4 * p + 2],
            sums[4 * p + 3],
        );
        block.sums32[p] = pair(a + b, c + d);
    }
    block
}

/// [`quantize_block`] in plain Rust: the reference for the AVX-512 version.
fn quantize_block_scalar(x: &[f32]) -> RowBlock {
    let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
    let nan = x.iter().any(|v| v.is_nan());
    let mut block = RowBlock::ZERO;
    let iscale = match block_scale(amax, nan) {
        Ok(iscale) => iscale,
        Err(d) => {
            block.d = d;
            return block;
        }
    };
    block.d = 1.0 / iscale;
    let mut q = [0i8; QK];
    for (q, &v) in q.iter_mut().zip(x) {
        // |v * iscale| <= 127 up to rounding, so the clamp only guards the last ulp.
        *q = (v * iscale).round_ties_even().clamp(-127.0, 127.0) as i8;
    }
    for (dst, four) in block.qs.iter_mut().zip(q.chunks_exact(4)) {
        *dst = i32::from_le_bytes([four[0] as u8, four[1] as u8, four[2] as u8, four[3] as u8]);
    }
    let sum = |s: &[i8]| s.iter().map(|&v| i32::from(v)).sum::<i32>();
    let pair = |lo: i32, hi: i32| (lo & 0xFFFF) | (hi << 16);
    for (bias, sixteen) in block.bias16.iter_mut().zip(q.chunks_exact(16)) {
        *bias = -32 * sum(sixteen);
    }
    for p in 0..8 {
        let lo = sum(&q[32 * p..32 * p + 16]);
        let hi = sum(&q[32 * p + 16..32 * p + 32]);
        block.sums16[p] = pair(lo, hi);
    }
    for p in 0..4 {
        let lo = sum(&q[64 * p..64 * p + 32]);
        let hi = sum(&q[64 * p + 32..64 * p + 64]);
        block.sums32[p] = pair(lo, hi);
    }
    block
}

/// Runs `work(i, chunk i)` over the `chunk`-long pieces of `data` (the last may be shorter)
/// on candle's barrier pool, the threads our kernels run on: a weight's tiles packed, a
/// LoRA delta's rows. Each piece sits behind its own (never contended) lock, which hands
/// its slice to whichever worker draws it.
pub(crate) fn chunks_parallel<T: Send>(
    data: &mut [T],
    chunk: usize,
    work: impl Fn(usize, &mut [T]) + Sync,
) {
    let slots: Vec<Mutex<&mut [T]>> = data.chunks_mut(chunk).map(Mutex::new).collect();
    candle_core::utils::barrier_pool().execute_chunked(slots.len(), |range| {
        for i in range {
            let mut dst = slots[i]
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            work(i, &mut dst);
        }
    });
}

/// Reads a little-endian f16 at `bytes[at..at + 2]` as raw bits.
fn f16_bits(bytes: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([bytes[at], bytes[at + 1]])
}

/// Loads the first 64 bytes of `v`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
fn load512<T>(v: &T) -> __m512i {
    assert!(std::mem::size_of::<T>() >= 64);
    // SAFETY: `v` is a reference to at least 64 readable bytes; the load is unaligned.
    unsafe { _mm512_loadu_si512(std::ptr::from_ref(v).cast()) }
}

/// Loads the first 32 bytes of `v`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
fn load256<T>(v: &T) -> __m256i {
    assert!(std::mem::size_of::<T>() >= 32);
    // SAFETY: `v` is a reference to at least 32 readable bytes; the load is unaligned.
    unsafe { _mm256_loadu_si256(std::ptr::from_ref(v).cast()) }
}

/// Loads the first 16 bytes of `v`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
fn load128<T>(v: &T) -> __m128i {
    assert!(std::mem::size_of::<T>() >= 16);
    // SAFETY: `v` is a reference to at least 16 readable bytes; the load is unaligned.
    unsafe { _mm_loadu_si128(std::ptr::from_ref(v).cast()) }
}

/// How far ahead of the tile being computed the weights are prefetched: with one stream per
/// core the hardware prefetcher alone leaves single-row products well short of DRAM bandwidth.
const PREFETCH_AHEAD: usize = 8192;

/// Prefetches the `bytes` bytes that start `PREFETCH_AHEAD` bytes after `v`. The addresses may
/// lie past the end of the weights: they are only prefetched, never dereferenced.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "sse")]
#[inline]
fn prefetch_ahead<T>(v: &T, bytes: usize) {
    let base = std::ptr::from_ref(v)
        .cast::<i8>()
        .wrapping_add(PREFETCH_AHEAD);
    for offset in (0..bytes).step_by(64) {
        // A prefetch is a hint that cannot fault, whatever the address (hence a safe intrinsic).
        _mm_prefetch::<_MM_HINT_T0>(base.wrapping_add(offset));
        _mm_prefetch::<_MM_HINT_T1>(base.wrapping_add(offset + 3 * PREFETCH_AHEAD));
    }
}

/// Prefetches the line `PREFETCH_AHEAD / ratio` bytes after `v`: for a stream read `ratio`
/// times slower than the main one, so both are fetched the same number of tiles ahead.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "sse")]
#[inline]
fn prefetch_ahead_scaled<T>(v: &T, ratio: usize) {
    let at = std::ptr::from_ref(v)
        .cast::<i8>()
        .wrapping_add(PREFETCH_AHEAD / ratio);
    _mm_prefetch::<_MM_HINT_T0>(at);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
fn load_ps(src: &[f32; TILE]) -> __m512 {
    // SAFETY: `src` is 16 readable f32; the load is unaligned.
    unsafe { _mm512_loadu_ps(src.as_ptr()) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
fn store_ps(dst: &mut [f32; TILE], v: __m512) {
    // SAFETY: `dst` is 16 writable f32; the store is unaligned.
    unsafe { _mm512_storeu_ps(dst.as_mut_ptr(), v) }
}

#[cfg(test)]
mod tests;
