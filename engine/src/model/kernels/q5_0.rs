//! Q5_0 weights: packing a block's 5-bit values into 5 lines and unpacking them to bytes
//! (512 or 256 bits at a time).
//!
//! A GGUF Q5_0 block holds 32 values as 4-bit low parts (two per byte: value j in the low
//! nibble of byte j, value j + 16 in its high nibble) and a 32-bit word of top bits, after its
//! f16 `d`: `w = d * (q5 - 16)`. Packed, 16 columns of a block take 4 lines of nibbles and one
//! line of top bits, 320 bytes (plus their `d`, kept by `super::q8_0`): GGUF's 16 x 22 bytes.
//! The kernels feed `q5` (unsigned, < 32: no vpmaddubsw saturation) to vpdpbusd or vpmaddubsw
//! and take the 16 back as `super::q8_0` says.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::q8_0::Line;

/// GGUF bytes of one block.
pub(super) const BLOCK_BYTES: usize = 22;
/// Packed lines of one block of 16 columns.
pub(super) const LINES: usize = 5;
/// `q5 - w / d`.
pub(super) const OFFSET: i32 = 16;

/// Packs one column's block (`src`: top-bit word and nibbles, without `d`) into lane `lane`
/// of the block's lines. Line g < 4 holds, at byte 4 lane + i, the low 4 bits of k = 4g + i in
/// its low nibble and of k = 16 + 4g + i in its high nibble; line 4 holds at byte 4 lane + i
/// the top bit of k = 4t + i in bit t, so vector t of the unpacked block reads bit t.
pub(super) fn pack(src: &[u8], lane: usize, dst: &mut [Line]) {
    let qh = u32::from_le_bytes([src[0], src[1], src[2], src[3]]);
    let nibbles = &src[4..20];
    let q5 = |j: usize| {
        let low = if j < 16 {
            nibbles[j] & 0xF
        } else {
            nibbles[j - 16] >> 4
        };
        low | (((qh >> j) & 1) as u8) << 4
    };
    for (g, line) in dst[..4].iter_mut().enumerate() {
        for i in 0..4 {
            line.0[4 * lane + i] = (q5(4 * g + i) & 0xF) | (q5(16 + 4 * g + i) & 0xF) << 4;
        }
    }
    for i in 0..4 {
        dst[4].0[4 * lane + i] = (0..8).map(|t| (q5(4 * t + i) >> 4) << t).sum();
    }
}

/// The 8 weight vectors of a block (vector t: k = 4t..4t+4 of each column), as `q5` bytes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
pub(super) fn unpack(block: &[Line]) -> [__m512i; 8] {
    let nibble = _mm512_set1_epi8(0x0F);
    let top = _mm512_set1_epi8(0x10);
    let h = super::load512(&block[4]);
    // Bit t of each byte moved to bit 4; 16-bit shifts by at most 4 keep every byte's bit 4
    // within that byte, and the other bits are masked off below.
    let tops = [
        _mm512_slli_epi16::<4>(h),
        _mm512_slli_epi16::<3>(h),
        _mm512_slli_epi16::<2>(h),
        _mm512_slli_epi16::<1>(h),
        h,
        _mm512_srli_epi16::<1>(h),
        _mm512_srli_epi16::<2>(h),
        _mm512_srli_epi16::<3>(h),
    ];
    let mut w = [_mm512_setzero_si512(); 8];
    for g in 0..4 {
        let v = super::load512(&block[g]);
        let low = _mm512_and_si512(v, nibble);
        let high = _mm512_and_si512(_mm512_srli_epi16::<4>(v), nibble);
        // a | (b & c): 0xF8 in vpternlog's truth table.
        w[g] = _mm512_ternarylogic_epi32::<0xF8>(low, tops[g], top);
        w[g + 4] = _mm512_ternarylogic_epi32::<0xF8>(high, tops[g + 4], top);
    }
    w
}

/// Half `h` (8 columns) of [`unpack`], on 256-bit vectors.
///
/// # Safety
/// AVX2 must be available.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn unpack_half(block: &[Line], h: usize) -> [__m256i; 8] {
    use super::avx2::load_half;
    // SAFETY: the caller guarantees AVX2; the loads are through references.
    unsafe {
        let nibble = _mm256_set1_epi8(0x0F);
        let top = _mm256_set1_epi8(0x10);
        let bits = load_half(&block[4], h);
        // Bit t of each byte moved to bit 4, as in `unpack`.
        let tops = [
            _mm256_slli_epi16::<4>(bits),
            _mm256_slli_epi16::<3>(bits),
            _mm256_slli_epi16::<2>(bits),
            _mm256_slli_epi16::<1>(bits),
            bits,
            _mm256_srli_epi16::<1>(bits),
            _mm256_srli_epi16::<2>(bits),
            _mm256_srli_epi16::<3>(bits),
        ];
        let mut w = [_mm256_setzero_si256(); 8];
        for g in 0..4 {
            let v = load_half(&block[g], h);
            let low = _mm256_and_si256(v, nibble);
            let high = _mm256_and_si256(_mm256_srli_epi16::<4>(v), nibble);
            w[g] = _mm256_or_si256(low, _mm256_and_si256(tops[g], top));
            w[g + 4] = _mm256_or_si256(high, _mm256_and_si256(tops[g + 4], top));
        }
        w
    }
}

/// `q5` of lane `lane` at `kk` (0..32) of a packed block, for tests.
#[cfg(test)]
pub(super) fn packed_q(block: &[Line], lane: usize, kk: usize) -> i32 {
    let (t, i) = (kk / 4, kk % 4);
    let byte = block[t % 4].0[4 * lane + i];
    let low = if t < 4 { byte & 0xF } else { byte >> 4 };
    let top = (block[4].0[4 * lane + i] >> t) & 1;
    i32::from(low | top << 4) - OFFSET
}
