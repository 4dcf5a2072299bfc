//! Q8_0 and Q5_0 weights (32-value blocks): activation rows, the tile layout, and the
//! AVX-512 VNNI and AVX2 kernels.
//!
//! Both formats hold 32 values per block with one f16 scale `d`: `w = d * q`, with `q` a signed
//! byte (Q8_0) or `q5 - 16` for a 5-bit `q5` (Q5_0, see `super::q5_0`). vpdpbusd multiplies
//! unsigned by signed bytes, so weights are stored unsigned (`q + 128` for Q8_0, `q5` for
//! Q5_0) and the offset is taken back with the row's sum over the block:
//! `Σ q qy = Σ (q + off) qy - off Σ qy`, exact in i32. Without VNNI, vpmaddubsw would
//! saturate on `q + 128` (2 · 255 · 127 > 32767), so the AVX2 kernel flips Q8_0 weights back
//! to signed and multiplies `|q|` by `qy` with q's sign: `2 · 128 · 127` fits.
//!
//! Activations are quantized per 32 values (one f32 scale each, finer than candle's f16 Q8_0
//! scale), so any `k` that is a multiple of 32 works, e.g. 896 and 4864 of the 0.5B draft.
//! A column tile is one ascending stream of 64-byte lines: the 16 columns' `d` for all of its
//! blocks first (two blocks per line), then each block's weights (8 lines for Q8_0, 5 for
//! Q5_0), exactly GGUF's byte count but for half a line of padding when the block count is odd.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::{Level, TILE};

/// Values per block.
pub(crate) const QB: usize = 32;

/// One 64-byte line of a packed weight.
#[derive(Debug, Clone)]
#[repr(C, align(64))]
pub(super) struct Line(pub(super) [u8; 64]);

/// One activation row's 32-value block quantized to 8 bits: `x ≈ d * qs`.
#[derive(Debug, Clone)]
pub(crate) struct RowBlock32 {
    /// The 32 quantized values, 4 per i32 (little-endian), so one i32 broadcast feeds vpdpbusd.
    pub(crate) qs: [i32; QB / 4],
    /// Sum of the 32 quantized values.
    pub(crate) sum: i32,
    pub(crate) d: f32,
}

const EMPTY: RowBlock32 = RowBlock32 {
    qs: [0; QB / 4],
    sum: 0,
    d: 0.0,
};

/// Quantizes 32 activations to 8 bits with one scale (round to nearest, ties to even). Rows
/// are quantized on their own, so a row's blocks never depend on the batch either.
/// Below AVX-512 the scalar version serves (the quantization is a small part of a matmul).
pub(super) fn quantize(x: &[f32], level: Level) -> RowBlock32 {
    #[cfg(target_arch = "x86_64")]
    if level == Level::Avx512Vnni {
        // SAFETY: a `Packed` of this level exists only where the CPU has AVX-512F/BW.
        return unsafe { quantize_avx512(x) };
    }
    quantize_scalar(x)
}

/// [`quantize`] with AVX-512, bitwise equal to the scalar version (tested).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
fn quantize_avx512(x: &[f32]) -> RowBlock32 {
    let x: &[f32; QB] = x.try_into().expect("a block of 32 values");
    // SAFETY: `x` is 32 readable f32; the loads are unaligned.
    let v = unsafe {
        [
            _mm512_loadu_ps(x.as_ptr()),
            _mm512_loadu_ps(x[TILE..].as_ptr()),
        ]
    };
    let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
    let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v[0], v[0])
        | _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v[1], v[1]);
    let mut block = EMPTY;
    let iscale = match super::block_scale(amax, nan != 0) {
        Ok(iscale) => iscale,
        Err(d) => {
            block.d = d;
            return block;
        }
    };
    block.d = 1.0 / iscale;
    let scale = _mm512_set1_ps(iscale);
    let mut total = _mm512_setzero_si512();
    for (h, v) in v.iter().enumerate() {
        // Rounds to nearest even (the MXCSR default, which Rust never changes).
        let q = _mm512_cvtps_epi32(_mm512_mul_ps(*v, scale));
        let q = _mm512_max_epi32(
            _mm512_min_epi32(q, _mm512_set1_epi32(127)),
            _mm512_set1_epi32(-127),
        );
        total = _mm512_add_epi32(total, q);
        let dst: &mut [i32; 4] = (&mut block.qs[4 * h..4 * h + 4]).try_into().unwrap();
        // SAFETY: `dst` is 16 writable bytes; the store is unaligned.
        unsafe { _mm_storeu_si128(dst.as_mut_ptr().cast(), _mm512_cvtepi32_epi8(q)) };
    }
    block.sum = _mm512_reduce_add_epi32(total);
    block
}

/// [`quantize`] in plain Rust: the reference for the AVX-512 version.
pub(super) fn quantize_scalar(x: &[f32]) -> RowBlock32 {
    let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
    let nan = x.iter().any(|v| v.is_nan());
    let mut block = EMPTY;
    let iscale = match super::block_scale(amax, nan) {
        Ok(iscale) => iscale,
        Err(d) => {
            block.d = d;
            return block;
        }
    };
    block.d = 1.0 / iscale;
    // |v * iscale| <= 127 up to rounding, so the clamp only guards the last ulp.
    let q: Vec<i8> = x
        .iter()
        .map(|&v| (v * iscale).round_ties_even().clamp(-127.0, 127.0) as i8)
        .collect();
    for (dst, four) in block.qs.iter_mut().zip(q.chunks_exact(4)) {
        *dst = i32::from_le_bytes([four[0] as u8, four[1] as u8, four[2] as u8, four[3] as u8]);
    }
    block.sum = q.iter().map(|&v| i32::from(v)).sum();
    block
}

/// The two 32-value formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Format {
    Q8_0,
    Q5_0,
}

impl Format {
    /// GGUF bytes of one block.
    fn block_bytes(self) -> usize {
        match self {
            Format::Q8_0 => 34,
            Format::Q5_0 => super::q5_0::BLOCK_BYTES,
        }
    }

    /// Packed lines of one block of 16 columns (without their `d`).
    fn lines(self) -> usize {
        match self {
            Format::Q8_0 => 8,
            Format::Q5_0 => super::q5_0::LINES,
        }
    }
}

/// A Q8_0 or Q5_0 weight as `[n / 16]` column tiles of `stride` lines (columns past `n` are
/// zero): `kb.div_ceil(2)` lines of `d`, then `kb` blocks.
#[derive(Debug)]
pub(super) struct Packed {
    format: Format,
    kb: usize,
    stride: usize,
    lines: Vec<Line>,
}

impl Packed {
    pub(super) fn new(format: Format, bytes: &[u8], n: usize, k: usize) -> Option<Self> {
        let kb = k / QB;
        let block_bytes = format.block_bytes();
        if bytes.len() != n * kb * block_bytes {
            return None;
        }
        let stride = kb.div_ceil(2) + kb * format.lines();
        let mut lines = vec![Line([0; 64]); n.div_ceil(TILE) * stride];
        super::chunks_parallel(&mut lines, stride, |column_tile, dst| {
            let (head, blocks) = dst.split_at_mut(kb.div_ceil(2));
            for (lane, c) in (column_tile * TILE..n.min((column_tile + 1) * TILE)).enumerate() {
                let row = &bytes[c * kb * block_bytes..(c + 1) * kb * block_bytes];
                let blocks = blocks.chunks_exact_mut(format.lines());
                for (b, (block, dst)) in row.chunks_exact(block_bytes).zip(blocks).enumerate() {
                    let at = 32 * (b % 2) + 2 * lane;
                    head[b / 2].0[at..at + 2].copy_from_slice(&block[..2]);
                    match format {
                        Format::Q8_0 => pack_q8_0(&block[2..], lane, dst),
                        Format::Q5_0 => super::q5_0::pack(&block[2..], lane, dst),
                    }
                }
            }
        });
        Some(Self {
            format,
            kb,
            stride,
            lines,
        })
    }

    /// Accumulates column tile `tile` against `acc.len()` rows (`rows`: each row's `k / 32`
    /// blocks in turn) into `acc[r][c]`, which starts at zero.
    pub(super) fn dot_tile(
        &self,
        level: Level,
        tile: usize,
        rows: &[RowBlock32],
        acc: &mut [[f32; TILE]],
    ) {
        let lines = &self.lines[tile * self.stride..][..self.stride];
        assert_eq!(rows.len(), acc.len() * self.kb);
        #[cfg(target_arch = "x86_64")]
        // SAFETY: a `Packed` of `level` is only built where the CPU supports that level.
        unsafe {
            use super::with_rows;
            let n = acc.len();
            match (level, self.format == Format::Q5_0) {
                (Level::Avx512Vnni, false) => with_rows!(n, kernel::<R, false>(lines, rows, acc)),
                (Level::Avx512Vnni, true) => with_rows!(n, kernel::<R, true>(lines, rows, acc)),
                (Level::AvxVnni, false) => {
                    with_rows!(n, kernel_avxvnni::<R, false>(lines, rows, acc))
                }
                (Level::AvxVnni, true) => {
                    with_rows!(n, kernel_avxvnni::<R, true>(lines, rows, acc))
                }
                (Level::Avx2, false) => with_rows!(n, kernel_avx2::<R, false>(lines, rows, acc)),
                (Level::Avx2, true) => with_rows!(n, kernel_avx2::<R, true>(lines, rows, acc)),
                (Level::None, _) => unreachable!("no kernels at level None"),
            }
        }
    }
}

/// Packs one column's Q8_0 block values (`qs`, 32 signed bytes) into lane `lane` of its
/// block's 8 lines: line g holds k = 4g..4g+4 at bytes 4 lane..4 lane+4, plus 128 (unsigned).
fn pack_q8_0(qs: &[u8], lane: usize, dst: &mut [Line]) {
    for (g, line) in dst.iter_mut().enumerate() {
        for i in 0..4 {
            line.0[4 * lane + i] = qs[4 * g + i] ^ 0x80;
        }
    }
}

/// The 8 weight vectors of a Q8_0 block: already unsigned bytes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
fn unpack_q8_0(block: &[Line]) -> [__m512i; 8] {
    std::array::from_fn(|g| super::load512(&block[g]))
}

/// `R` rows against one column tile over all k. Every row has its own accumulators and sees
/// the same instructions in the same order for any `R`, which is what makes results
/// batch-invariant; `R` only decides how many rows share each unpacked weight vector.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
fn kernel<const R: usize, const Q5: bool>(
    lines: &[Line],
    rows: &[RowBlock32],
    acc: &mut [[f32; TILE]],
) {
    let kb = rows.len() / R;
    let (head, blocks) = lines.split_at(kb.div_ceil(2));
    let (per_block, offset) = if Q5 {
        (super::q5_0::LINES, super::q5_0::OFFSET)
    } else {
        (8, 128)
    };
    // The blocks' prefetches below skip the head's lines; fetch them here.
    super::prefetch_ahead(&head[0], 64 * head.len());
    let mut facc = [_mm512_setzero_ps(); R];
    for (b, block) in blocks.chunks_exact(per_block).enumerate() {
        super::prefetch_ahead(&block[0], 64 * per_block);
        let (lo, hi) = head[b / 2].0.split_at(32);
        let d: &[u8; 32] = if b % 2 == 0 { lo } else { hi }.try_into().unwrap();
        let dw = _mm512_cvtph_ps(super::load256(d));
        let w = if Q5 {
            super::q5_0::unpack(block)
        } else {
            unpack_q8_0(block)
        };
        for (r, facc) in facc.iter_mut().enumerate() {
            let y = &rows[r * kb + b];
            // Starting from -offset * Σ qy takes the weights' offset back (module docs).
            let mut dot = _mm512_set1_epi32(-offset * y.sum);
            for (g, &w) in w.iter().enumerate() {
                dot = _mm512_dpbusd_epi32(dot, w, _mm512_set1_epi32(y.qs[g]));
            }
            let dd = _mm512_mul_ps(dw, _mm512_set1_ps(y.d));
            *facc = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(dot), *facc);
        }
    }
    for (acc, facc) in acc.iter_mut().zip(facc) {
        super::store_ps(acc, facc);
    }
}

/// [`kernel`] with AVX2 and AVX-VNNI.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
fn kernel_avxvnni<const R: usize, const Q5: bool>(
    lines: &[Line],
    rows: &[RowBlock32],
    acc: &mut [[f32; TILE]],
) {
    // SAFETY: this function's features are the body's requirements.
    unsafe { kernel256::<R, Q5, true>(lines, rows, acc) }
}

/// [`kernel`] with AVX2 only.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
fn kernel_avx2<const R: usize, const Q5: bool>(
    lines: &[Line],
    rows: &[RowBlock32],
    acc: &mut [[f32; TILE]],
) {
    // SAFETY: this function's features are the body's requirements.
    unsafe { kernel256::<R, Q5, false>(lines, rows, acc) }
}

/// [`kernel`] on 256-bit vectors: each block as two halves of 8 columns, in turn.
///
/// # Safety
/// AVX2, FMA, F16C and, if `VNNI`, AVX-VNNI must be available.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn kernel256<const R: usize, const Q5: bool, const VNNI: bool>(
    lines: &[Line],
    rows: &[RowBlock32],
    acc: &mut [[f32; TILE]],
) {
    use super::avx2::{dot_scaled, dpbusd, load_half, store_half};
    let kb = rows.len() / R;
    let (head, blocks) = lines.split_at(kb.div_ceil(2));
    let per_block = if Q5 { super::q5_0::LINES } else { 8 };
    // SAFETY: the caller guarantees the features; every load is through a reference.
    unsafe {
        // The blocks' prefetches below skip the head's lines; fetch them here.
        super::prefetch_ahead(&head[0], 64 * head.len());
        let (ones, ones16) = (_mm256_set1_epi32(1), _mm256_set1_epi16(1));
        let mut facc = [[_mm256_setzero_ps(); 2]; R];
        for (b, block) in blocks.chunks_exact(per_block).enumerate() {
            super::prefetch_ahead(&block[0], 64 * per_block);
            for h in 0..2 {
                // Half h of the 16 columns' d: bytes 16h..16h+16 of the block's 32.
                let at = 32 * (b % 2) + 16 * h;
                let d = &head[b / 2].0[at..at + 16];
                let dw = _mm256_cvtph_ps(_mm_loadu_si128(d.as_ptr().cast()));
                let mut w: [__m256i; 8] = if Q5 {
                    super::q5_0::unpack_half(block, h)
                } else {
                    std::array::from_fn(|g| load_half(&block[g], h))
                };
                let offset = if Q5 {
                    super::q5_0::OFFSET
                } else if VNNI {
                    128
                } else {
                    // Signed weights: |q| for vpmaddubsw, q's sign moved onto qy per row.
                    let signed =
                        std::array::from_fn(|g| _mm256_xor_si256(w[g], _mm256_set1_epi8(-128)));
                    w = signed;
                    0
                };
                // Read by the signed Q8_0 path only; the other instances drop it when compiled.
                let abs: [__m256i; 8] = std::array::from_fn(|g| _mm256_abs_epi8(w[g]));
                for (r, facc) in facc.iter_mut().enumerate() {
                    let y = &rows[r * kb + b];
                    // Starting from -offset * Σ qy takes the weights' offset back.
                    let mut dot = _mm256_set1_epi32(-offset * y.sum);
                    if Q5 && !VNNI {
                        // 5-bit values: 4 · 2 · 31 · 127 fits i16.
                        let sums = dot_scaled::<false, 4, 8>(&w, &y.qs, ones, ones16);
                        dot = _mm256_add_epi32(dot, sums);
                    } else {
                        for g in 0..8 {
                            let a = _mm256_set1_epi32(y.qs[g]);
                            dot = if Q5 || VNNI {
                                dpbusd::<VNNI>(dot, w[g], a)
                            } else {
                                dpbusd::<false>(dot, abs[g], _mm256_sign_epi8(a, w[g]))
                            };
                        }
                    }
                    let dd = _mm256_mul_ps(dw, _mm256_set1_ps(y.d));
                    facc[h] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(dot), facc[h]);
                }
            }
        }
        for (acc, facc) in acc.iter_mut().zip(facc) {
            store_half(acc, 0, facc[0]);
            store_half(acc, 1, facc[1]);
        }
    }
}

/// The f16 bits of `d` of column `col`'s block holding `k`, for tests.
#[cfg(test)]
fn packed_d(p: &Packed, col: usize, k: usize) -> f32 {
    let b = k / QB;
    let line = &p.lines[(col / TILE) * p.stride + b / 2];
    half::f16::from_bits(super::f16_bits(&line.0, 32 * (b % 2) + 2 * (col % TILE))).to_f32()
}

/// The lines of column `col`'s block holding `k`, for tests.
#[cfg(test)]
fn packed_block(p: &Packed, col: usize, k: usize) -> &[Line] {
    let at = (col / TILE) * p.stride + p.kb.div_ceil(2) + (k / QB) * p.format.lines();
    &p.lines[at..at + p.format.lines()]
}

/// The exact value of one packed weight, for tests.
#[cfg(test)]
pub(super) fn packed_value(p: &Packed, col: usize, k: usize) -> f32 {
    let block = packed_block(p, col, k);
    let q = match p.format {
        Format::Q8_0 => {
            let kk = k % QB;
            i32::from((block[kk / 4].0[4 * (col % TILE) + kk % 4] ^ 0x80) as i8)
        }
        Format::Q5_0 => super::q5_0::packed_q(block, col % TILE, k % QB),
    };
    packed_d(p, col, k) * q as f32
}
