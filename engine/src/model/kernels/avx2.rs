//! Building blocks of the AVX2 kernels, which read the same 16-column tiles as two 8-column
//! halves of 256 bits, with or without AVX-VNNI.
//!
//! Each format's AVX2 kernel is one `#[inline(always)]` body generic over `VNNI`, instantiated
//! by two thin entry points: one compiled with AVX2/FMA/F16C, one with AVX-VNNI added. The body
//! is inlined into each, so the intrinsics are inlined with the entry point's features (a body
//! with its own `#[target_feature]` could not take VNNI as a parameter).

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// `acc + Σ w·a` over each i32 lane's 4 byte pairs, with `w` unsigned and `a` signed bytes.
/// Without VNNI it goes through vpmaddubsw, whose i16 pair sums saturate: exact only when
/// `2 · max w · 127 <= 32767`, i.e. `w < 129`, which every caller guarantees (the Q8_0 kernel
/// makes its weights fit with the sign trick instead).
///
/// # Safety
/// AVX2 must be available and, if `VNNI`, AVX-VNNI too.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn dpbusd<const VNNI: bool>(acc: __m256i, w: __m256i, a: __m256i) -> __m256i {
    // SAFETY: the caller guarantees the features.
    unsafe {
        if VNNI {
            _mm256_dpbusd_avx_epi32(acc, w, a)
        } else {
            let pairs = _mm256_maddubs_epi16(w, a);
            _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))
        }
    }
}

/// `sc · Σ_g w[g]·a[g]` per i32 lane, with `w` unsigned and `a` signed bytes (4 per lane, as
/// for [`dpbusd`]), `sc32` the scale as i32 lanes and `sc16` the same as i16 pairs (`sc` in
/// both halves of each lane). Without VNNI the i16 pair sums of `GROUP` vectors are added
/// before widening, which is exact only when `GROUP · 2 · max w · 127 <= 32767`, and widened
/// with vpmaddwd by `sc16`, which saves the widening by ones and the vpmulld per vector.
///
/// # Safety
/// AVX2 must be available and, if `VNNI`, AVX-VNNI too.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn dot_scaled<const VNNI: bool, const GROUP: usize, const N: usize>(
    w: &[__m256i; N],
    a: &[i32],
    sc32: __m256i,
    sc16: __m256i,
) -> __m256i {
    // SAFETY: the caller guarantees the features.
    unsafe {
        if VNNI {
            // Two chains: one chain of N vpdpbusd (latency 5 each) stalls single-row products.
            let mut dot = [_mm256_setzero_si256(); 2];
            for (g, &w) in w.iter().enumerate() {
                dot[g % 2] = _mm256_dpbusd_avx_epi32(dot[g % 2], w, _mm256_set1_epi32(a[g]));
            }
            _mm256_mullo_epi32(_mm256_add_epi32(dot[0], dot[1]), sc32)
        } else {
            let mut total = _mm256_setzero_si256();
            for (group, w) in w.chunks_exact(GROUP).enumerate() {
                let a = &a[GROUP * group..];
                let mut pairs = _mm256_maddubs_epi16(w[0], _mm256_set1_epi32(a[0]));
                for g in 1..GROUP {
                    let more = _mm256_maddubs_epi16(w[g], _mm256_set1_epi32(a[g]));
                    pairs = _mm256_add_epi16(pairs, more);
                }
                total = _mm256_add_epi32(total, _mm256_madd_epi16(pairs, sc16));
            }
            total
        }
    }
}

/// `sc` (i32 lanes in i16 range) as i16 pairs, for [`dot_scaled`].
///
/// # Safety
/// AVX2 must be available.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn pairs16(sc: __m256i) -> __m256i {
    // SAFETY: the caller guarantees AVX2.
    unsafe {
        let low = _mm256_and_si256(sc, _mm256_set1_epi32(0xFFFF));
        _mm256_or_si256(low, _mm256_slli_epi32::<16>(sc))
    }
}

/// Loads the 32 bytes at byte `32 * h` of `v`: half `h` of a 64-byte vector of 16 columns.
///
/// # Safety
/// AVX must be available.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn load_half<T>(v: &T, h: usize) -> __m256i {
    assert!(std::mem::size_of::<T>() >= 32 * (h + 1));
    // SAFETY: the 32 bytes lie within `v` (asserted); the load is unaligned; the caller
    // guarantees AVX.
    unsafe { _mm256_loadu_si256(std::ptr::from_ref(v).cast::<u8>().add(32 * h).cast()) }
}

/// The 8 f16 at `v[8 h..8 h + 8]` as f32 lanes: half `h` of 16 columns' scales.
///
/// # Safety
/// AVX and F16C must be available.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn f16_half(v: &[u16; 16], h: usize) -> __m256 {
    let eight = &v[8 * h..8 * h + 8];
    // SAFETY: `eight` is 16 readable bytes; the load is unaligned; the caller guarantees F16C.
    unsafe { _mm256_cvtph_ps(_mm_loadu_si128(eight.as_ptr().cast())) }
}

/// Stores `v` to half `h` (8 columns) of a row of 16 outputs.
///
/// # Safety
/// AVX must be available.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn store_half(dst: &mut [f32; 16], h: usize, v: __m256) {
    let eight = &mut dst[8 * h..8 * h + 8];
    // SAFETY: `eight` is 8 writable f32; the store is unaligned; the caller guarantees AVX.
    unsafe { _mm256_storeu_ps(eight.as_mut_ptr(), v) }
}
