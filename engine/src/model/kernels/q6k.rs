//! Q6_K weights: the packed tile layout, packing from GGUF blocks, and the AVX-512 VNNI and
//! AVX2 kernels.
//!
//! A GGUF Q6_K block holds 256 values as 6-bit `q` (split into a 4-bit and a 2-bit part) with
//! 16 sub-blocks of 16 values, each with a signed 8-bit scale `sc`, and one f16 `d`:
//! `w = d * sc * (q - 32)`. A packed tile holds one such block for each of 16 columns in
//! 3328 bytes, plus the 16 `d` kept apart: 16 x 210 bytes, GGUF's size.
//! The dot product with a row quantized to `y = dy * qy` is
//! `dy * d * (Σ_s sc_s Σ q qy - 32 Σ_s sc_s Σ_s qy)`, whose inner sums are exact in i32.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::{Level, QK, RowBlock, TILE, amx, f16_bits};

/// GGUF bytes of one Q6_K block.
const BLOCK_BYTES: usize = 210;

/// A quarter of a tile (64 values of 16 columns), in the order the kernel reads it, so that the
/// hardware prefetcher sees one ascending stream.
#[derive(Debug, Clone)]
#[repr(C)]
struct Quarter {
    /// `[p(2)][c(16)][2]`: the scales of sub-blocks 2p and 2p+1 of the quarter, in pairs for
    /// vpdpwssd.
    sc: [[i8; 2 * TILE]; 2],
    /// `[v(8)]`, 4 bytes per column (column c at bytes 4c..4c+4): byte i holds the low 4 bits
    /// of the value at k = 4v + i in its low nibble and of k = 32 + 4v + i in its high nibble.
    ql: [[u8; 64]; 8],
    /// `[u(4)]`, 4 bytes per column: bits 2t..2t+2 of byte i hold the top 2 bits of the value
    /// at k = 16t + 4u + i, so sub-block t reads bit pair t of the 4 vectors.
    qh: [[u8; 64]; 4],
}

/// One 256-value block of 16 columns (their `d` are in [`Packed::d`], to keep tiles aligned).
#[derive(Debug, Clone)]
#[repr(C, align(64))]
struct Tile {
    quarters: [Quarter; 4],
}
const _: () = assert!(std::mem::size_of::<Tile>() + 2 * TILE == TILE * BLOCK_BYTES);

const ZERO: Tile = Tile {
    quarters: [const {
        Quarter {
            sc: [[0; 2 * TILE]; 2],
            ql: [[0; 64]; 8],
            qh: [[0; 64]; 4],
        }
    }; 4],
};

/// A Q6_K weight as `[n / 16][k / 256]` tiles (columns past `n` are zero).
#[derive(Debug)]
pub(super) struct Packed {
    kb: usize,
    tiles: Vec<Tile>,
    /// f16 bits of each tile's 16 `d`, indexed like `tiles`.
    d: Vec<[u16; TILE]>,
}

/// A GGUF Q6_K block decoded (but for `d`): 6-bit values (0..64) in k order, and scales.
struct Decoded {
    q: [u8; QK],
    sc: [i8; 16],
}

fn decode(block: &[u8]) -> Decoded {
    let (ql, qh) = (&block[..128], &block[128..192]);
    let mut out = Decoded {
        q: [0; QK],
        sc: [0; 16],
    };
    for (dst, &s) in out.sc.iter_mut().zip(&block[192..208]) {
        *dst = s as i8;
    }
    // Each half of 128 values: 64 bytes of low nibbles (values l and l+64 share byte l, values
    // l+32 and l+96 share byte l+32) and 32 bytes of 2-bit tops (four values per byte).
    for h in 0..2 {
        let (ql, qh, q) = (&ql[64 * h..], &qh[32 * h..], &mut out.q[128 * h..]);
        for l in 0..32 {
            q[l] = (ql[l] & 0xF) | ((qh[l] & 3) << 4);
            q[l + 32] = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4);
            q[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
            q[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
        }
    }
    out
}

impl Packed {
    pub(super) fn new(bytes: &[u8], n: usize, k: usize) -> Option<Self> {
        let kb = k / QK;
        if bytes.len() != n * kb * BLOCK_BYTES {
            return None;
        }
        let n_tiles = n.div_ceil(TILE) * kb;
        let mut tiles = vec![ZERO; n_tiles];
        super::chunks_parallel(&mut tiles, kb, |column_tile, dst| {
            for (lane, c) in (column_tile * TILE..n.min((column_tile + 1) * TILE)).enumerate() {
                let row = &bytes[c * kb * BLOCK_BYTES..(c + 1) * kb * BLOCK_BYTES];
                pack_column(row, lane, dst);
            }
        });
        let mut ds = vec![[0u16; TILE]; n_tiles];
        for (c, row) in bytes.chunks_exact(kb * BLOCK_BYTES).enumerate() {
            for (b, block) in row.chunks_exact(BLOCK_BYTES).enumerate() {
                ds[(c / TILE) * kb + b][c % TILE] = f16_bits(block, 208);
            }
        }
        Some(Self { kb, tiles, d: ds })
    }

    /// Accumulates column tile `tile` against `acc.len()` rows (`rows`: each row's `k / 256`
    /// blocks in turn) into `acc[r][c]`, which starts at zero.
    pub(super) fn dot_tile(
        &self,
        level: Level,
        tile: usize,
        rows: &[RowBlock],
        acc: &mut [[f32; TILE]],
    ) {
        let tiles = &self.tiles[tile * self.kb..][..self.kb];
        let d = &self.d[tile * self.kb..][..self.kb];
        assert_eq!(rows.len(), acc.len() * self.kb);
        #[cfg(target_arch = "x86_64")]
        // SAFETY: a `Packed` of `level` is only built where the CPU supports that level.
        unsafe {
            match level {
                Level::Avx512Vnni => {
                    super::with_rows!(acc.len(), kernel::<R>(tiles, d, rows, acc))
                }
                Level::AvxVnni => {
                    super::with_rows!(acc.len(), kernel_avxvnni::<R>(tiles, d, rows, acc))
                }
                Level::Avx2 => super::with_rows!(acc.len(), kernel_avx2::<R>(tiles, d, rows, acc)),
                Level::None => unreachable!("no kernels at level None"),
            }
        }
    }

    /// [`Packed::dot_tile`] at the AVX-512 level on AMX tiles, for `acc.len()` rows (`rows`:
    /// padded with zero rows to whole tiles), bitwise the same.
    pub(super) fn dot_tile_amx(
        &self,
        amx: &mut amx::Scratch,
        tile: usize,
        rows: &[RowBlock],
        acc: &mut [[f32; TILE]],
    ) {
        let tiles = &self.tiles[tile * self.kb..][..self.kb];
        let d = &self.d[tile * self.kb..][..self.kb];
        assert_eq!(rows.len(), acc.len().next_multiple_of(amx::ROWS) * self.kb);
        #[cfg(target_arch = "x86_64")]
        // SAFETY: a `Scratch` exists only where AMX is enabled, which takes the AVX-512 level.
        unsafe {
            kernel_amx(amx, tiles, d, rows, acc)
        }
    }
}

/// Packs one column's GGUF blocks (`row`) into lane `lane` of its column tile's `tiles`.
fn pack_column(row: &[u8], lane: usize, tiles: &mut [Tile]) {
    for (block, tile) in row.chunks_exact(BLOCK_BYTES).zip(tiles) {
        let src = decode(block);
        for (quarter, dst) in tile.quarters.iter_mut().enumerate() {
            let q = &src.q[64 * quarter..64 * quarter + 64];
            for v in 0..8 {
                for i in 0..4 {
                    let lo = q[4 * v + i] & 0xF;
                    let hi = q[32 + 4 * v + i] & 0xF;
                    dst.ql[v][4 * lane + i] = lo | (hi << 4);
                }
            }
            for u in 0..4 {
                for i in 0..4 {
                    let mut byte = 0;
                    for t in 0..4 {
                        byte |= (q[16 * t + 4 * u + i] >> 4) << (2 * t);
                    }
                    dst.qh[u][4 * lane + i] = byte;
                }
            }
            for p in 0..2 {
                let s = 4 * quarter + 2 * p;
                dst.sc[p][2 * lane] = src.sc[s];
                dst.sc[p][2 * lane + 1] = src.sc[s + 1];
            }
        }
    }
}

/// `R` rows against one column tile over all k. Every row has its own accumulators and sees
/// the same instructions in the same order for any `R`, which is what makes results
/// batch-invariant; `R` only decides how many rows share each unpacked weight vector.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
fn kernel<const R: usize>(
    tiles: &[Tile],
    ds: &[[u16; TILE]],
    rows: &[RowBlock],
    acc: &mut [[f32; TILE]],
) {
    let kb = tiles.len();
    let mut facc = [_mm512_setzero_ps(); R];
    for (b, (t, d)) in tiles.iter().zip(ds).enumerate() {
        // The d stream is 1/104 of the tile stream: one line every other tile.
        super::prefetch_ahead_scaled(d, std::mem::size_of::<Tile>() / (2 * TILE));
        let mut isum = [_mm512_setzero_si512(); R];
        for (quarter, q) in t.quarters.iter().enumerate() {
            super::prefetch_ahead(q, std::mem::size_of::<Quarter>());
            for p in 2 * quarter..2 * quarter + 2 {
                let (even, odd) = scales(q, p % 2);
                if p % 2 == 0 {
                    sub_block::<R, 0>(q, quarter, even, rows, b, &mut isum);
                    sub_block::<R, 1>(q, quarter, odd, rows, b, &mut isum);
                } else {
                    sub_block::<R, 2>(q, quarter, even, rows, b, &mut isum);
                    sub_block::<R, 3>(q, quarter, odd, rows, b, &mut isum);
                }
            }
        }
        let d = _mm512_cvtph_ps(super::load256(d));
        for r in 0..R {
            facc[r] = accumulate(d, &rows[r * kb + b], isum[r], facc[r]);
        }
    }
    for (acc, facc) in acc.iter_mut().zip(facc) {
        super::store_ps(acc, facc);
    }
}

/// Scales of sub-blocks `4 quarter + 2 half` and `4 quarter + 2 half + 1` of quarter `q`, as
/// i32 lanes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
fn scales(q: &Quarter, half: usize) -> (__m512i, __m512i) {
    let pair = _mm512_cvtepi8_epi16(super::load256(&q.sc[half]));
    let even = _mm512_srai_epi32::<16>(_mm512_slli_epi32::<16>(pair));
    (even, _mm512_srai_epi32::<16>(pair))
}

/// One row's float accumulators after a super-block: `facc + d dy isum`, in the one order
/// both the AVX-512 and the AMX path use.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
fn accumulate(d: __m512, y: &RowBlock, isum: __m512i, facc: __m512) -> __m512 {
    let dd = _mm512_mul_ps(d, _mm512_set1_ps(y.d));
    _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(isum), facc)
}

/// [`kernel`] on AMX tiles for `acc.len()` rows (`rows`: each row's blocks in turn, padded
/// with zero rows to whole 16-row tiles): the same integer sums (`Σ sc (q - 32) qy`, the
/// offset folded into the unpacked weights) and float steps, so bitwise the same rows.
/// `acc` starts at zero.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
fn kernel_amx(
    amx: &mut amx::Scratch,
    tiles: &[Tile],
    ds: &[[u16; TILE]],
    rows: &[RowBlock],
    acc: &mut [[f32; TILE]],
) {
    let kb = tiles.len();
    for (b, (t, d)) in tiles.iter().zip(ds).enumerate() {
        super::prefetch_ahead(t, std::mem::size_of::<Tile>());
        for (quarter, q) in t.quarters.iter().enumerate() {
            // Tile rows 4T..4T+4: sub-block 4 quarter + T (16 values).
            for t in 0..4 {
                let (even, odd) = scales(q, t / 2);
                let sc = amx::Scale::new(if t % 2 == 0 { even } else { odd }, 32);
                let w = match t {
                    0 => values::<0>(q),
                    1 => values::<1>(q),
                    2 => values::<2>(q),
                    _ => values::<3>(q),
                };
                for (u, w) in w.into_iter().enumerate() {
                    let (pe, po) = amx::scale(w, sc);
                    amx.weights.store(quarter, 4 * t + u, pe, po);
                }
            }
        }
        let d = _mm512_cvtph_ps(super::load256(d));
        amx.rows(rows, b, kb, acc.len(), |r, isum, y| {
            let facc = super::load_ps(&acc[r]);
            super::store_ps(&mut acc[r], accumulate(d, y, isum, facc));
        });
    }
}

/// Sub-block `4 * quarter + T` (16 values) of 16 columns, scaled by `sc`, into each row's
/// `isum`. Each row's dot product starts from the row's `-32 Σ qy` over the sub-block, so the
/// offset of 32 costs nothing: `sc Σ (q - 32) qy`, exact in i32 (|·| < 2^31 over a block).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[inline]
fn sub_block<const R: usize, const T: usize>(
    q: &Quarter,
    quarter: usize,
    sc: __m512i,
    rows: &[RowBlock],
    b: usize,
    isum: &mut [__m512i; R],
) {
    let kb = rows.len() / R;
    let w = values::<T>(q);
    let s = 4 * quarter + T;
    for (r, isum) in isum.iter_mut().enumerate() {
        let row = &rows[r * kb + b];
        let y = &row.qs[4 * s..4 * s + 4];
        let mut dot = _mm512_set1_epi32(row.bias16[s]);
        for u in 0..4 {
            dot = _mm512_dpbusd_epi32(dot, w[u], _mm512_set1_epi32(y[u]));
        }
        *isum = _mm512_add_epi32(*isum, _mm512_mullo_epi32(dot, sc));
    }
}

/// The 6-bit values of sub-block `4 quarter + T` of quarter `q`: 16 values of 16 columns in
/// 4 vectors (vector u: k = 16T + 4u + i at byte 4c + i).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
fn values<const T: usize>(q: &Quarter) -> [__m512i; 4] {
    let mut w = [_mm512_setzero_si512(); 4];
    for (u, w) in w.iter_mut().enumerate() {
        // Low 4 bits: a nibble of the ql vectors (T = 0, 1 low, T = 2, 3 high).
        let ql = super::load512(&q.ql[4 * (T % 2) + u]);
        let ql = if T < 2 {
            ql
        } else {
            _mm512_srli_epi16::<4>(ql)
        };
        // Top 2 bits: bit pair T of the qh vector, moved to bits 4-5.
        let qh = super::load512(&q.qh[u]);
        let qh = match T {
            0 => _mm512_slli_epi16::<4>(qh),
            1 => _mm512_slli_epi16::<2>(qh),
            2 => qh,
            _ => _mm512_srli_epi16::<2>(qh),
        };
        // (ql & 0x0F) | (qh & 0x30); 0xD8 is c ? b : a, bitwise.
        *w = _mm512_ternarylogic_epi32::<0xD8>(qh, ql, _mm512_set1_epi8(0x0F));
        *w = _mm512_and_si512(*w, _mm512_set1_epi8(0x3F));
    }
    w
}

/// [`kernel`] with AVX2 and AVX-VNNI.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
fn kernel_avxvnni<const R: usize>(
    tiles: &[Tile],
    ds: &[[u16; TILE]],
    rows: &[RowBlock],
    acc: &mut [[f32; TILE]],
) {
    // SAFETY: this function's features are the body's requirements.
    unsafe { kernel256::<R, true>(tiles, ds, rows, acc) }
}

/// [`kernel`] with AVX2 only.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
fn kernel_avx2<const R: usize>(
    tiles: &[Tile],
    ds: &[[u16; TILE]],
    rows: &[RowBlock],
    acc: &mut [[f32; TILE]],
) {
    // SAFETY: this function's features are the body's requirements.
    unsafe { kernel256::<R, false>(tiles, ds, rows, acc) }
}

/// [`kernel`] on 256-bit vectors: each tile as two halves of 8 columns, in turn. Values are 6
/// bits, so vpmaddubsw cannot saturate without VNNI.
///
/// # Safety
/// AVX2, FMA, F16C and, if `VNNI`, AVX-VNNI must be available.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn kernel256<const R: usize, const VNNI: bool>(
    tiles: &[Tile],
    ds: &[[u16; TILE]],
    rows: &[RowBlock],
    acc: &mut [[f32; TILE]],
) {
    use super::avx2::{dot_scaled, f16_half, load_half, pairs16, store_half};
    let kb = tiles.len();
    // SAFETY: the caller guarantees the features; every load is through a reference.
    unsafe {
        if R == 1 {
            return one_row256::<VNNI>(tiles, ds, rows, &mut acc[0]);
        }
        let mut facc = [[_mm256_setzero_ps(); 2]; R];
        for (b, (t, d)) in tiles.iter().zip(ds).enumerate() {
            super::prefetch_ahead_scaled(d, std::mem::size_of::<Tile>() / (2 * TILE));
            for h in 0..2 {
                let mut isum = [_mm256_setzero_si256(); R];
                let mut corr = [_mm256_setzero_si256(); R];
                for (quarter, q) in t.quarters.iter().enumerate() {
                    if h == 0 {
                        super::prefetch_ahead(q, std::mem::size_of::<Quarter>());
                    }
                    for p in 2 * quarter..2 * quarter + 2 {
                        // Scales of sub-blocks 2p, 2p+1 as i16 pairs per column, and as i32.
                        let sc = &q.sc[p % 2][16 * h..16 * h + 16];
                        let pair = _mm256_cvtepi8_epi16(_mm_loadu_si128(sc.as_ptr().cast()));
                        for (r, corr) in corr.iter_mut().enumerate() {
                            let sums = _mm256_set1_epi32(rows[r * kb + b].sums16[p]);
                            *corr = _mm256_add_epi32(*corr, _mm256_madd_epi16(pair, sums));
                        }
                        let even = _mm256_srai_epi32::<16>(_mm256_slli_epi32::<16>(pair));
                        let odd = _mm256_srai_epi32::<16>(pair);
                        for (tt, sc) in [(2 * (p % 2), even), (2 * (p % 2) + 1, odd)] {
                            let w: [__m256i; 4] = std::array::from_fn(|u| {
                                let ql = load_half(&q.ql[4 * (tt % 2) + u], h);
                                values256(ql, load_half(&q.qh[u], h), tt)
                            });
                            let s = 4 * quarter + tt;
                            // 6-bit values: 2 · 2 · 63 · 127 fits i16, 4 · 2 · 63 · 127 not.
                            let sc16 = pairs16(sc);
                            for (r, isum) in isum.iter_mut().enumerate() {
                                let y = &rows[r * kb + b].qs[4 * s..4 * s + 4];
                                let dot = dot_scaled::<VNNI, 2, 4>(&w, y, sc, sc16);
                                *isum = _mm256_add_epi32(*isum, dot);
                            }
                        }
                    }
                }
                let d = f16_half(d, h);
                for (r, facc) in facc.iter_mut().enumerate() {
                    let y = &rows[r * kb + b];
                    let total = _mm256_sub_epi32(isum[r], _mm256_slli_epi32::<5>(corr[r]));
                    let dd = _mm256_mul_ps(d, _mm256_set1_ps(y.d));
                    facc[h] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(total), facc[h]);
                }
            }
        }
        for (acc, facc) in acc.iter_mut().zip(facc) {
            store_half(acc, 0, facc[0]);
            store_half(acc, 1, facc[1]);
        }
    }
}

/// [`kernel256`] for one row, whose speed is memory's: one pass over each quarter, each
/// line's two halves at once, with no software prefetch (see `super::q4k::one_row256`).
/// Each sub-block's integer sum is [`kernel256`]'s (exact, in another order) and the float
/// steps are the same, so are the row's bits.
///
/// # Safety
/// AVX2, FMA, F16C and, if `VNNI`, AVX-VNNI must be available.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn one_row256<const VNNI: bool>(
    tiles: &[Tile],
    ds: &[[u16; TILE]],
    row: &[RowBlock],
    acc: &mut [f32; TILE],
) {
    use super::avx2::{f16_half, store_half};
    // SAFETY: the caller guarantees the features; every load is through a reference.
    unsafe {
        let mut facc = [_mm256_setzero_ps(); 2];
        for ((t, d), y) in tiles.iter().zip(ds).zip(row) {
            let mut isum = [_mm256_setzero_si256(); 2];
            let mut corr = [_mm256_setzero_si256(); 2];
            for (quarter, q) in t.quarters.iter().enumerate() {
                let sc = quarter_scales::<VNNI>(q, quarter, y, &mut corr);
                quarter_dots::<VNNI>(q, quarter, y, &sc, &mut isum);
            }
            for h in 0..2 {
                let total = _mm256_sub_epi32(isum[h], _mm256_slli_epi32::<5>(corr[h]));
                let dd = _mm256_mul_ps(f16_half(d, h), _mm256_set1_ps(y.d));
                facc[h] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(total), facc[h]);
            }
        }
        store_half(acc, 0, facc[0]);
        store_half(acc, 1, facc[1]);
    }
}

/// The scales of quarter `q`'s four sub-blocks for columns `8h..8h+8` (`[h][tt]`): as i32
/// lanes with VNNI, else as i16 pairs for vpmaddwd; adds the row's `Σ sc Σ qy` over them to
/// `corr` (the offset of 32, taken off at the end).
///
/// # Safety
/// AVX2 must be available.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn quarter_scales<const VNNI: bool>(
    q: &Quarter,
    quarter: usize,
    y: &RowBlock,
    corr: &mut [__m256i; 2],
) -> [[__m256i; 4]; 2] {
    // SAFETY: the caller guarantees AVX2; every load is through a reference.
    unsafe {
        let mut sc = [[_mm256_setzero_si256(); 4]; 2];
        for (h, sc) in sc.iter_mut().enumerate() {
            for p in 0..2 {
                let pair = &q.sc[p][16 * h..16 * h + 16];
                let pair = _mm256_cvtepi8_epi16(_mm_loadu_si128(pair.as_ptr().cast()));
                let sums = _mm256_set1_epi32(y.sums16[2 * quarter + p]);
                corr[h] = _mm256_add_epi32(corr[h], _mm256_madd_epi16(pair, sums));
                let even = _mm256_srai_epi32::<16>(_mm256_slli_epi32::<16>(pair));
                let odd = _mm256_srai_epi32::<16>(pair);
                [sc[2 * p], sc[2 * p + 1]] = if VNNI {
                    [even, odd]
                } else {
                    [even, odd].map(|sc| super::avx2::pairs16(sc))
                };
            }
        }
        sc
    }
}

/// Adds quarter `q`'s four sub-blocks' products with the row, scaled by `sc`, to `isum`,
/// each line's two halves at once: with VNNI in i32 over the whole sub-block, else in i16
/// pairs two vectors at a time (6-bit values: 2 · 2 · 63 · 127 fits i16, 4 · 2 · 63 · 127
/// not).
///
/// # Safety
/// AVX2 and, if `VNNI`, AVX-VNNI must be available.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn quarter_dots<const VNNI: bool>(
    q: &Quarter,
    quarter: usize,
    y: &RowBlock,
    sc: &[[__m256i; 4]; 2],
    isum: &mut [__m256i; 2],
) {
    use super::avx2::load_half;
    // SAFETY: the caller guarantees the features; every load is through a reference.
    unsafe {
        let mut dots = [[_mm256_setzero_si256(); 4]; 2];
        for u in 0..4 {
            let a: [__m256i; 4] =
                std::array::from_fn(|tt| _mm256_set1_epi32(y.qs[4 * (4 * quarter + tt) + u]));
            for (h, dots) in dots.iter_mut().enumerate() {
                let ql = [load_half(&q.ql[u], h), load_half(&q.ql[4 + u], h)];
                let qh = load_half(&q.qh[u], h);
                for tt in 0..4 {
                    let w = values256(ql[tt % 2], qh, tt);
                    dots[tt] = if VNNI {
                        _mm256_dpbusd_avx_epi32(dots[tt], w, a[tt])
                    } else {
                        _mm256_add_epi16(dots[tt], _mm256_maddubs_epi16(w, a[tt]))
                    };
                }
            }
            if !VNNI && u % 2 == 1 {
                for (h, dots) in dots.iter_mut().enumerate() {
                    for (dot, &sc) in dots.iter_mut().zip(&sc[h]) {
                        isum[h] = _mm256_add_epi32(isum[h], _mm256_madd_epi16(*dot, sc));
                        *dot = _mm256_setzero_si256();
                    }
                }
            }
        }
        if VNNI {
            for (h, dots) in dots.iter().enumerate() {
                for (&dot, &sc) in dots.iter().zip(&sc[h]) {
                    isum[h] = _mm256_add_epi32(isum[h], _mm256_mullo_epi32(dot, sc));
                }
            }
        }
    }
}

/// Sub-block `tt`'s 6-bit values (of the 4 in a quarter) for 8 columns, from its ql vector
/// (`ql[4 (tt % 2) + u]`) and the quarter's qh vector `u`: the low 4 bits are a nibble of `ql`
/// (low for tt 0, 1, high for 2, 3), the top 2 bit pair tt of `qh`, moved to bits 4-5.
///
/// # Safety
/// AVX2 must be available.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn values256(ql: __m256i, qh: __m256i, tt: usize) -> __m256i {
    // SAFETY: the caller guarantees AVX2.
    unsafe {
        let ql = if tt < 2 {
            ql
        } else {
            _mm256_srli_epi16::<4>(ql)
        };
        let qh = match tt {
            0 => _mm256_slli_epi16::<4>(qh),
            1 => _mm256_slli_epi16::<2>(qh),
            2 => qh,
            _ => _mm256_srli_epi16::<2>(qh),
        };
        _mm256_or_si256(
            _mm256_and_si256(ql, _mm256_set1_epi8(0x0F)),
            _mm256_and_si256(qh, _mm256_set1_epi8(0x30)),
        )
    }
}

/// The exact value of one packed weight, for tests.
#[cfg(test)]
pub(super) fn packed_value(p: &Packed, col: usize, k: usize) -> f32 {
    use half::f16;
    let at = (col / TILE) * p.kb + k / QK;
    let t = &p.tiles[at];
    let (lane, kk) = (col % TILE, k % QK);
    let (quarter, rest) = (kk / 64, kk % 64);
    let (v, upper, i) = ((rest % 32) / 4, rest / 32, rest % 4);
    let qt = &t.quarters[quarter];
    let byte = qt.ql[v][4 * lane + i];
    let lo = if upper == 0 { byte & 0xF } else { byte >> 4 };
    let (t4, u) = ((rest / 16), (rest % 16) / 4);
    let hi = (qt.qh[u][4 * lane + i] >> (2 * t4)) & 3;
    let q = i32::from(lo | (hi << 4)) - 32;
    let s = kk / 16;
    let sc = qt.sc[(s / 2) % 2][2 * lane + s % 2];
    f16::from_bits(p.d[at][lane]).to_f32() * f32::from(sc) * q as f32
}
