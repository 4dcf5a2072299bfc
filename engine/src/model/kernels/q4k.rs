//! Q4_K weights: the packed tile layout, packing from GGUF blocks, and the AVX-512 VNNI and
//! AVX2 kernels.
//!
//! A GGUF Q4_K block holds 256 values as 4-bit `q` with 8 sub-blocks of 32 values, each with a
//! 6-bit scale `sc` and min `m`, and two f16 factors: `w = d * sc * q - dmin * m`. A packed tile
//! holds one such block for each of 16 columns, in 2304 bytes = 16 x 144 (GGUF's size).
//! The dot product with a row quantized to `y = dy * qy` is
//! `dy * (d * Σ_s sc_s Σ q qy - dmin * Σ_s m_s Σ_s qy)`, whose inner sums are exact in i32.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::{Level, QK, RowBlock, TILE, amx, f16_bits};

/// GGUF bytes of one Q4_K block.
const BLOCK_BYTES: usize = 144;

/// One 256-value block of 16 columns, scales first: the order the kernel reads it in, so that
/// the hardware prefetcher sees one ascending stream.
#[derive(Debug, Clone)]
#[repr(C, align(64))]
struct Tile {
    /// Per column: top 2 bits of scale s at bits 2s, top 2 bits of min s at bits 16 + 2s.
    hi: [u32; TILE],
    /// `[s(8)][c(16)]`: low 4 bits of scale s in bits 0-3, low 4 bits of min s in bits 4-7.
    lo: [[u8; TILE]; 8],
    /// Per column f16 bits of `d` and `dmin`.
    d: [u16; TILE],
    dmin: [u16; TILE],
    /// `[j(4)][g(8)]`, 4 bytes per column (column c at bytes 4c..4c+4): byte i holds in its low
    /// nibble the value at k = 64j + 4g + i (sub-block 2j) and in its high nibble the value at
    /// k = 64j + 32 + 4g + i (sub-block 2j+1), so one load feeds two vpdpbusd after masking.
    qs: [[u8; 64]; 32],
}
const _: () = assert!(std::mem::size_of::<Tile>() == TILE * BLOCK_BYTES);

const ZERO: Tile = Tile {
    hi: [0; TILE],
    lo: [[0; TILE]; 8],
    d: [0; TILE],
    dmin: [0; TILE],
    qs: [[0; 64]; 32],
};

/// A Q4_K weight as `[n / 16][k / 256]` tiles (columns past `n` are zero).
#[derive(Debug)]
pub(super) struct Packed {
    kb: usize,
    tiles: Vec<Tile>,
}

/// A GGUF Q4_K block decoded: 4-bit values in k order, 6-bit scales and mins, f16 bits.
struct Decoded {
    q: [u8; QK],
    sc: [u8; 8],
    m: [u8; 8],
    d: u16,
    dmin: u16,
}

fn decode(block: &[u8]) -> Decoded {
    let scales = &block[4..16];
    let qs = &block[16..BLOCK_BYTES];
    let mut out = Decoded {
        q: [0; QK],
        sc: [0; 8],
        m: [0; 8],
        d: f16_bits(block, 0),
        dmin: f16_bits(block, 2),
    };
    // The 12 scale bytes: sub-blocks 0-3 keep scale and min in the low 6 bits of bytes 0-3 and
    // 4-7; sub-blocks 4-7 keep their low 4 bits as nibbles of bytes 8-11 and their top 2 bits in
    // the spare top bits of bytes 0-7.
    for s in 0..8 {
        (out.sc[s], out.m[s]) = if s < 4 {
            (scales[s] & 63, scales[s + 4] & 63)
        } else {
            (
                (scales[s + 4] & 0xF) | ((scales[s - 4] >> 6) << 4),
                (scales[s + 4] >> 4) | ((scales[s] >> 6) << 4),
            )
        };
    }
    // Each 32 bytes hold 64 values: the low nibbles first, then the high nibbles.
    for j in 0..4 {
        for l in 0..32 {
            out.q[64 * j + l] = qs[32 * j + l] & 0xF;
            out.q[64 * j + 32 + l] = qs[32 * j + l] >> 4;
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
        let mut tiles = vec![ZERO; n.div_ceil(TILE) * kb];
        super::chunks_parallel(&mut tiles, kb, |column_tile, dst| {
            for (lane, c) in (column_tile * TILE..n.min((column_tile + 1) * TILE)).enumerate() {
                let row = &bytes[c * kb * BLOCK_BYTES..(c + 1) * kb * BLOCK_BYTES];
                pack_column(row, lane, dst);
            }
        });
        Some(Self { kb, tiles })
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
        assert_eq!(rows.len(), acc.len() * self.kb);
        #[cfg(target_arch = "x86_64")]
        // SAFETY: a `Packed` of `level` is only built where the CPU supports that level.
        unsafe {
            match level {
                Level::Avx512Vnni => super::with_rows!(acc.len(), kernel::<R>(tiles, rows, acc)),
                Level::AvxVnni => {
                    super::with_rows!(acc.len(), kernel_avxvnni::<R>(tiles, rows, acc))
                }
                Level::Avx2 => super::with_rows!(acc.len(), kernel_avx2::<R>(tiles, rows, acc)),
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
        assert_eq!(rows.len(), acc.len().next_multiple_of(amx::ROWS) * self.kb);
        #[cfg(target_arch = "x86_64")]
        // SAFETY: a `Scratch` exists only where AMX is enabled, which takes the AVX-512 level.
        unsafe {
            kernel_amx(amx, tiles, rows, acc)
        }
    }
}

/// Packs one column's GGUF blocks (`row`) into lane `lane` of its column tile's `tiles`.
fn pack_column(row: &[u8], lane: usize, tiles: &mut [Tile]) {
    for (block, tile) in row.chunks_exact(BLOCK_BYTES).zip(tiles) {
        let src = decode(block);
        for j in 0..4 {
            for g in 0..8 {
                for i in 0..4 {
                    let at = 64 * j + 4 * g + i;
                    tile.qs[8 * j + g][4 * lane + i] = src.q[at] | (src.q[at + 32] << 4);
                }
            }
        }
        for s in 0..8 {
            tile.lo[s][lane] = (src.sc[s] & 0xF) | ((src.m[s] & 0xF) << 4);
            tile.hi[lane] |=
                u32::from(src.sc[s] >> 4) << (2 * s) | u32::from(src.m[s] >> 4) << (16 + 2 * s);
        }
        tile.d[lane] = src.d;
        tile.dmin[lane] = src.dmin;
    }
}

/// `R` rows against one column tile over all k. Every row has its own accumulators and sees
/// the same instructions in the same order for any `R`, which is what makes results
/// batch-invariant; `R` only decides how many rows share each unpacked weight vector.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
fn kernel<const R: usize>(tiles: &[Tile], rows: &[RowBlock], acc: &mut [[f32; TILE]]) {
    let kb = tiles.len();
    let mut facc = [_mm512_setzero_ps(); R];
    for (b, t) in tiles.iter().enumerate() {
        // The scales' 4 lines here, the values' 32 lines a quarter at a time below.
        super::prefetch_ahead(t, 256);
        let hi = super::load512(&t.hi);
        let mut isum = [_mm512_setzero_si512(); R];
        let mut mins = [_mm512_setzero_si512(); 4];
        for (j, mins) in mins.iter_mut().enumerate() {
            super::prefetch_ahead(&t.qs[8 * j], 512);
            let sc;
            (sc, *mins) = scales(t, hi, j);
            sub_block::<R, 0>(t, j, sc[0], rows, b, &mut isum);
            sub_block::<R, 1>(t, j, sc[1], rows, b, &mut isum);
        }
        for r in 0..R {
            facc[r] = accumulate(t, &mins, &rows[r * kb + b], isum[r], facc[r]);
        }
    }
    for (acc, facc) in acc.iter_mut().zip(facc) {
        super::store_ps(acc, facc);
    }
}

/// Scales and mins of sub-blocks `2j`, `2j+1` for the 16 columns of `t` (`hi`: `t.hi`
/// loaded): the scales as i32 lanes, the mins in i16 pairs for one vpdpwssd with the row's
/// pair of 32-value sums.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
fn scales(t: &Tile, hi: __m512i, j: usize) -> ([__m512i; 2], __m512i) {
    let low4 = _mm512_set1_epi32(0x0F);
    let low2 = _mm512_set1_epi32(0x03);
    let mut sc = [_mm512_setzero_si512(); 2];
    let mut m = [_mm512_setzero_si512(); 2];
    for half in 0..2 {
        let s = 2 * j + half;
        let lo = _mm512_cvtepu8_epi32(super::load128(&t.lo[s]));
        let hs = _mm512_srl_epi32(hi, _mm_cvtsi32_si128(2 * s as i32));
        sc[half] = _mm512_or_si512(
            _mm512_and_si512(lo, low4),
            _mm512_slli_epi32::<4>(_mm512_and_si512(hs, low2)),
        );
        m[half] = _mm512_or_si512(
            _mm512_srli_epi32::<4>(lo),
            _mm512_slli_epi32::<4>(_mm512_and_si512(_mm512_srli_epi32::<16>(hs), low2)),
        );
    }
    (sc, _mm512_or_si512(m[0], _mm512_slli_epi32::<16>(m[1])))
}

/// One row's float accumulators after super-block `t`: `facc + dy (d isum - dmin Σ m sums)`,
/// in the one order both the AVX-512 and the AMX path use.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[inline]
fn accumulate(t: &Tile, mins: &[__m512i; 4], y: &RowBlock, isum: __m512i, facc: __m512) -> __m512 {
    let d = _mm512_cvtph_ps(super::load256(&t.d));
    let dmin = _mm512_cvtph_ps(super::load256(&t.dmin));
    let mut imin = _mm512_setzero_si512();
    for (p, &mins) in mins.iter().enumerate() {
        imin = _mm512_dpwssd_epi32(imin, mins, _mm512_set1_epi32(y.sums32[p]));
    }
    let dy = _mm512_set1_ps(y.d);
    let f = _mm512_fmadd_ps(_mm512_mul_ps(d, dy), _mm512_cvtepi32_ps(isum), facc);
    _mm512_fnmadd_ps(_mm512_mul_ps(dmin, dy), _mm512_cvtepi32_ps(imin), f)
}

/// [`kernel`] on AMX tiles for `acc.len()` rows (`rows`: each row's blocks in turn, padded
/// with zero rows to whole 16-row tiles): the same integer sums and float steps, so bitwise
/// the same rows. `acc` starts at zero.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
fn kernel_amx(amx: &mut amx::Scratch, tiles: &[Tile], rows: &[RowBlock], acc: &mut [[f32; TILE]]) {
    let kb = tiles.len();
    let low4 = _mm512_set1_epi8(0x0F);
    for (b, t) in tiles.iter().enumerate() {
        super::prefetch_ahead(t, std::mem::size_of::<Tile>());
        let hi = super::load512(&t.hi);
        let mut mins = [_mm512_setzero_si512(); 4];
        for (j, mins) in mins.iter_mut().enumerate() {
            let sc;
            (sc, *mins) = scales(t, hi, j);
            let (low, high) = (amx::Scale::new(sc[0], 0), amx::Scale::new(sc[1], 0));
            for g in 0..8 {
                // Tile rows 0-7: sub-block 2j (low nibbles); rows 8-15: 2j+1 (high nibbles).
                let v = super::load512(&t.qs[8 * j + g]);
                let (pe, po) = amx::scale(_mm512_and_si512(v, low4), low);
                amx.weights.store(j, g, pe, po);
                let v = _mm512_and_si512(_mm512_srli_epi16::<4>(v), low4);
                let (pe, po) = amx::scale(v, high);
                amx.weights.store(j, 8 + g, pe, po);
            }
        }
        amx.rows(rows, b, kb, acc.len(), |r, isum, y| {
            let facc = super::load_ps(&acc[r]);
            super::store_ps(&mut acc[r], accumulate(t, &mins, y, isum, facc));
        });
    }
}

/// Sub-block `2 * j + HALF` (32 values) of 16 columns, scaled by `sc`, into each row's `isum`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[inline]
fn sub_block<const R: usize, const HALF: usize>(
    t: &Tile,
    j: usize,
    sc: __m512i,
    rows: &[RowBlock],
    b: usize,
    isum: &mut [__m512i; R],
) {
    let kb = rows.len() / R;
    let mut w = [_mm512_setzero_si512(); 8];
    for (g, w) in w.iter_mut().enumerate() {
        let v = super::load512(&t.qs[8 * j + g]);
        let v = if HALF == 0 {
            v
        } else {
            _mm512_srli_epi16::<4>(v)
        };
        *w = _mm512_and_si512(v, _mm512_set1_epi8(0x0F));
    }
    let s = 2 * j + HALF;
    for (r, isum) in isum.iter_mut().enumerate() {
        let y = &rows[r * kb + b].qs[8 * s..8 * s + 8];
        let mut dot = _mm512_setzero_si512();
        for g in 0..8 {
            dot = _mm512_dpbusd_epi32(dot, w[g], _mm512_set1_epi32(y[g]));
        }
        *isum = _mm512_add_epi32(*isum, _mm512_mullo_epi32(dot, sc));
    }
}

/// [`kernel`] with AVX2 and AVX-VNNI.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
fn kernel_avxvnni<const R: usize>(tiles: &[Tile], rows: &[RowBlock], acc: &mut [[f32; TILE]]) {
    // SAFETY: this function's features are the body's requirements.
    unsafe { kernel256::<R, true>(tiles, rows, acc) }
}

/// [`kernel`] with AVX2 only.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
fn kernel_avx2<const R: usize>(tiles: &[Tile], rows: &[RowBlock], acc: &mut [[f32; TILE]]) {
    // SAFETY: this function's features are the body's requirements.
    unsafe { kernel256::<R, false>(tiles, rows, acc) }
}

/// [`kernel`] on 256-bit vectors: each tile as two halves of 8 columns, in turn. Values are 4
/// bits, so vpmaddubsw cannot saturate without VNNI, even summed over a sub-block. One row
/// takes [`one_row256`], which computes the same sums in another order.
///
/// # Safety
/// AVX2, FMA, F16C and, if `VNNI`, AVX-VNNI must be available.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn kernel256<const R: usize, const VNNI: bool>(
    tiles: &[Tile],
    rows: &[RowBlock],
    acc: &mut [[f32; TILE]],
) {
    use super::avx2::{dot_scaled, load_half, pairs16, store_half};
    let kb = tiles.len();
    // SAFETY: the caller guarantees the features; every load is through a reference.
    unsafe {
        if R == 1 {
            return one_row256::<VNNI>(tiles, rows, &mut acc[0]);
        }
        let nibble = _mm256_set1_epi8(0x0F);
        let mut facc = [[_mm256_setzero_ps(); 2]; R];
        for (b, t) in tiles.iter().enumerate() {
            super::prefetch_ahead(t, std::mem::size_of::<Tile>());
            for h in 0..2 {
                let hi = load_half(&t.hi, h);
                let mut isum = [_mm256_setzero_si256(); R];
                let mut mins = [_mm256_setzero_si256(); 4];
                for (j, mins) in mins.iter_mut().enumerate() {
                    let (sc, m) = scales256(t, hi, h, j);
                    for (half, sc) in sc.into_iter().enumerate() {
                        let s = 2 * j + half;
                        let w: [__m256i; 8] = std::array::from_fn(|g| {
                            let v = load_half(&t.qs[8 * j + g], h);
                            let v = if half == 0 {
                                v
                            } else {
                                _mm256_srli_epi16::<4>(v)
                            };
                            _mm256_and_si256(v, nibble)
                        });
                        // 4-bit values: 8 · 2 · 15 · 127 fits i16, so all 8 vectors sum there.
                        let sc16 = pairs16(sc);
                        for (r, isum) in isum.iter_mut().enumerate() {
                            let y = &rows[r * kb + b].qs[8 * s..8 * s + 8];
                            let dot = dot_scaled::<VNNI, 8, 8>(&w, y, sc, sc16);
                            *isum = _mm256_add_epi32(*isum, dot);
                        }
                    }
                    *mins = m;
                }
                for (r, facc) in facc.iter_mut().enumerate() {
                    facc[h] = accumulate256(t, h, &mins, &rows[r * kb + b], isum[r], facc[h]);
                }
            }
        }
        for (acc, facc) in acc.iter_mut().zip(facc) {
            store_half(acc, 0, facc[0]);
            store_half(acc, 1, facc[1]);
        }
    }
}

/// [`kernel256`] for one row, whose speed is memory's: one pass over each tile, each line's
/// two halves and both nibbles at once, so that the loads are spread evenly over the work
/// (two passes of half a tile each leave the second without a miss in flight), and no
/// software prefetch: with the loads spread, the hardware prefetcher keeps up on its own,
/// and the prefetches cost 20-40% (measured on AMD Zen 2). Each sub-block's integer sum is
/// [`kernel256`]'s (exact, in another order) and the float steps are the same, so are the
/// row's bits.
///
/// # Safety
/// AVX2, FMA, F16C and, if `VNNI`, AVX-VNNI must be available.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn one_row256<const VNNI: bool>(tiles: &[Tile], row: &[RowBlock], acc: &mut [f32; TILE]) {
    use super::avx2::{load_half, pairs16, store_half};
    // SAFETY: the caller guarantees the features; every load is through a reference.
    unsafe {
        let nibble = _mm256_set1_epi8(0x0F);
        let mut facc = [_mm256_setzero_ps(); 2];
        for (t, y) in tiles.iter().zip(row) {
            let hi = [0, 1].map(|h| load_half(&t.hi, h));
            let mut isum = [_mm256_setzero_si256(); 2];
            // `mins[j][h]`: sub-blocks 2j, 2j+1's mins for columns 8h..8h+8.
            let mut mins = [[_mm256_setzero_si256(); 2]; 4];
            for (j, mins) in mins.iter_mut().enumerate() {
                // `dots[h][half]`: columns 8h..8h+8 of sub-block 2j + half; i32 lanes with
                // VNNI, else i16 pairs (8 · 2 · 15 · 127 fits i16, as in `kernel256`).
                let mut dots = [[_mm256_setzero_si256(); 2]; 2];
                for g in 0..8 {
                    let a = [0, 1].map(|half| _mm256_set1_epi32(y.qs[8 * (2 * j + half) + g]));
                    for (h, dots) in dots.iter_mut().enumerate() {
                        let v = load_half(&t.qs[8 * j + g], h);
                        let w = [v, _mm256_srli_epi16::<4>(v)].map(|v| _mm256_and_si256(v, nibble));
                        for half in 0..2 {
                            dots[half] = if VNNI {
                                _mm256_dpbusd_avx_epi32(dots[half], w[half], a[half])
                            } else {
                                let pairs = _mm256_maddubs_epi16(w[half], a[half]);
                                _mm256_add_epi16(dots[half], pairs)
                            };
                        }
                    }
                }
                for (h, dots) in dots.into_iter().enumerate() {
                    let (sc, m) = scales256(t, hi[h], h, j);
                    for (dot, sc) in dots.into_iter().zip(sc) {
                        let scaled = if VNNI {
                            _mm256_mullo_epi32(dot, sc)
                        } else {
                            _mm256_madd_epi16(dot, pairs16(sc))
                        };
                        isum[h] = _mm256_add_epi32(isum[h], scaled);
                    }
                    mins[h] = m;
                }
            }
            for h in 0..2 {
                facc[h] = accumulate256(t, h, &mins.map(|m| m[h]), y, isum[h], facc[h]);
            }
        }
        store_half(acc, 0, facc[0]);
        store_half(acc, 1, facc[1]);
    }
}

/// Scales and mins of sub-blocks `2j`, `2j+1` for columns `8h..8h+8` of `t` (`hi`: that half
/// of `t.hi` loaded): the scales as i32 lanes, the mins in i16 pairs for one vpmaddwd with the
/// row's pair of 32-value sums.
///
/// # Safety
/// AVX2 must be available.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn scales256(t: &Tile, hi: __m256i, h: usize, j: usize) -> ([__m256i; 2], __m256i) {
    // SAFETY: the caller guarantees AVX2; every load is through a reference.
    unsafe {
        let low4 = _mm256_set1_epi32(0x0F);
        let low2 = _mm256_set1_epi32(0x03);
        let mut sc = [_mm256_setzero_si256(); 2];
        let mut m = [_mm256_setzero_si256(); 2];
        for half in 0..2 {
            let s = 2 * j + half;
            let lo = &t.lo[s][8 * h..8 * h + 8];
            let lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64(lo.as_ptr().cast()));
            let hs = _mm256_srl_epi32(hi, _mm_cvtsi32_si128(2 * s as i32));
            sc[half] = _mm256_or_si256(
                _mm256_and_si256(lo, low4),
                _mm256_slli_epi32::<4>(_mm256_and_si256(hs, low2)),
            );
            m[half] = _mm256_or_si256(
                _mm256_srli_epi32::<4>(lo),
                _mm256_slli_epi32::<4>(_mm256_and_si256(_mm256_srli_epi32::<16>(hs), low2)),
            );
        }
        (sc, _mm256_or_si256(m[0], _mm256_slli_epi32::<16>(m[1])))
    }
}

/// One row's float accumulators for columns `8h..8h+8` after super-block `t`:
/// `facc + dy (d isum - dmin Σ m sums)`, in the one order both 256-bit bodies use.
///
/// # Safety
/// AVX2, FMA and F16C must be available.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn accumulate256(
    t: &Tile,
    h: usize,
    mins: &[__m256i; 4],
    y: &RowBlock,
    isum: __m256i,
    facc: __m256,
) -> __m256 {
    use super::avx2::f16_half;
    // SAFETY: the caller guarantees the features; every load is through a reference.
    unsafe {
        let mut imin = _mm256_setzero_si256();
        for (p, &mins) in mins.iter().enumerate() {
            let prod = _mm256_madd_epi16(mins, _mm256_set1_epi32(y.sums32[p]));
            imin = _mm256_add_epi32(imin, prod);
        }
        let dy = _mm256_set1_ps(y.d);
        let f = _mm256_fmadd_ps(
            _mm256_mul_ps(f16_half(&t.d, h), dy),
            _mm256_cvtepi32_ps(isum),
            facc,
        );
        let dmin = _mm256_mul_ps(f16_half(&t.dmin, h), dy);
        _mm256_fnmadd_ps(dmin, _mm256_cvtepi32_ps(imin), f)
    }
}

/// The exact value of one packed weight, for tests.
#[cfg(test)]
pub(super) fn packed_value(p: &Packed, col: usize, k: usize) -> f32 {
    use half::f16;
    let t = &p.tiles[(col / TILE) * p.kb + k / QK];
    let (lane, kk) = (col % TILE, k % QK);
    let (j, rest) = (kk / 64, kk % 64);
    let (half, g, i) = (rest / 32, (rest % 32) / 4, rest % 4);
    let byte = t.qs[8 * j + g][4 * lane + i];
    let q = if half == 0 { byte & 0xF } else { byte >> 4 };
    let s = 2 * j + half;
    let sc = (t.lo[s][lane] & 0xF) as u32 | ((t.hi[lane] >> (2 * s)) & 3) << 4;
    let m = (t.lo[s][lane] >> 4) as u32 | ((t.hi[lane] >> (16 + 2 * s)) & 3) << 4;
    let d = f16::from_bits(t.d[lane]).to_f32();
    let dmin = f16::from_bits(t.dmin[lane]).to_f32();
    d * sc as f32 * q as f32 - dmin * m as f32
}
