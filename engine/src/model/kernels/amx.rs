//! Intel AMX tiles for the AVX-512 level's products of many rows (Xeons since Sapphire
//! Rapids).
//!
//! Why: a core's tile unit multiplies int8 matrices many times faster than its `vpdpbusd`, so
//! a verification or prefill pass that is bound by multiply-adds on the AVX-512 kernels is
//! bound by reading the weights here.
//!
//! How it stays exact: the AVX-512 kernels sum each row's products in i32 exactly and then
//! apply the same float steps per super-block; `tdpbsud`/`tdpbssd` also sum exactly in i32, so a
//! path that forms the same integers and applies the same float steps gives every row bitwise
//! the same result, and the level stays batch-invariant whichever path a row count takes. A
//! tile multiplies whole chunks of 64 values while k-quants scale each 16- or 32-value
//! sub-block per column, so each super-block's weights are unpacked already scaled: the
//! 16-bit product `sc * q` (or `sc * (q - 32)`) is split into a low byte (unsigned) and a high
//! byte (signed), and `Σ y lo + 256 Σ y hi = Σ y sc q`. The unpacking is paid once per
//! column tile and super-block and shared by every 16-row tile of the pass, which is why the
//! path starts at [`MIN_ROWS`].
//!
//! Tile registers, each 16 rows of 64 bytes: 0 and 1 sum one row tile's products with the
//! weights' low and high bytes, 2 and 3 a second row tile's; 4 and 5 hold 64 values of the
//! two row tiles, 6 and 7 the weights' low and high bytes for those 64 values (16 rows of 4
//! values by 16 columns).

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;
use std::sync::OnceLock;

use super::{Level, QK, RowBlock, TILE};

/// Rows per tile (the most a tile register holds).
pub(super) const ROWS: usize = 16;
/// Values per tile row: one 64-byte row of activations, 16 rows of 4 per weight column.
const CHUNK: usize = 64;
/// Fewest rows a product takes the tiles for: below it the unpacking costs more than the
/// AVX-512 kernels' multiply-adds (measured with `kernel_speed`).
pub(super) const MIN_ROWS: usize = 12;

/// Whether products of at least [`MIN_ROWS`] rows run on AMX tiles: the AVX-512 level runs,
/// the CPU has AMX-INT8, the kernel lets this process use the tile data, and
/// `DUET_CPU_KERNELS` does not name a level (`avx512` keeps the tiles off). Decided once.
pub(super) fn enabled() -> bool {
    static ENABLED: OnceLock<bool> = OnceLock::new();
    *ENABLED.get_or_init(|| {
        super::level() == Level::Avx512Vnni
            && super::requested().is_none_or(|l| l == super::Requested::Amx)
            && usable()
    })
}

/// Whether this CPU has AMX-TILE and AMX-INT8 and Linux grants this process the tile state
/// (which it does only on request, since the state makes every context switch save 8 KiB).
fn usable() -> bool {
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    {
        // CPUID leaf 7: EDX bit 24 is AMX-TILE, bit 25 AMX-INT8.
        let edx = __cpuid_count(7, 0).edx;
        if edx & (3 << 24) != 3 << 24 {
            return false;
        }
        const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
        const XFEATURE_XTILEDATA: libc::c_long = 18;
        // SAFETY: arch_prctl with this request only reads its integer arguments.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_arch_prctl,
                ARCH_REQ_XCOMP_PERM,
                XFEATURE_XTILEDATA,
            )
        };
        rc == 0
    }
    #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
    {
        false
    }
}

/// One super-block of one column tile as the tiles read it: for each chunk of 64 values, 16
/// rows of 4 values by 16 columns (column c at bytes 4c..4c+4), low and high bytes apart.
#[repr(C, align(64))]
pub(super) struct Weights {
    lo: [[[u8; CHUNK]; ROWS]; QK / CHUNK],
    hi: [[[u8; CHUNK]; ROWS]; QK / CHUNK],
}

impl Weights {
    fn new() -> Box<Self> {
        Box::new(Self {
            lo: [[[0; CHUNK]; ROWS]; QK / CHUNK],
            hi: [[[0; CHUNK]; ROWS]; QK / CHUNK],
        })
    }

    /// Stores tile row `row` of chunk `chunk`: the 16-bit products `pe` (of each 32-bit
    /// lane's bytes 0 and 2) and `po` (bytes 1 and 3), split into their low and high bytes.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    pub(super) fn store(&mut self, chunk: usize, row: usize, pe: __m512i, po: __m512i) {
        // 0xEA is (a & b) | c, bitwise.
        let lo = _mm512_ternarylogic_epi32::<0xEA>(
            _mm512_set1_epi16(0x00FF),
            pe,
            _mm512_slli_epi16::<8>(po),
        );
        let hi = _mm512_ternarylogic_epi32::<0xEA>(
            _mm512_set1_epi16(0xFF00u16 as i16),
            po,
            _mm512_srli_epi16::<8>(pe),
        );
        // SAFETY: each destination is 64 writable bytes; the stores are unaligned.
        unsafe {
            _mm512_storeu_si512(self.lo[chunk][row].as_mut_ptr().cast(), lo);
            _mm512_storeu_si512(self.hi[chunk][row].as_mut_ptr().cast(), hi);
        }
    }
}

/// The 16-bit products of a tile row's bytes `q` (unsigned) with per-column scales `sc` (i32
/// lanes, each within i8), less `offset * sc`: `(pe, po)` for [`Weights::store`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
pub(super) fn scale(q: __m512i, sc: Scale) -> (__m512i, __m512i) {
    (
        _mm512_sub_epi16(_mm512_maddubs_epi16(q, sc.even), sc.offset),
        _mm512_sub_epi16(_mm512_maddubs_epi16(q, sc.odd), sc.offset),
    )
}

/// A column scale laid out for [`scale`].
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
pub(super) struct Scale {
    /// The scale in bytes 0 and 2 of each column's lane, zero in bytes 1 and 3.
    even: __m512i,
    /// The scale in bytes 1 and 3.
    odd: __m512i,
    /// `offset * sc` in both 16-bit halves of each lane.
    offset: __m512i,
}

#[cfg(target_arch = "x86_64")]
impl Scale {
    /// `sc`: one i32 lane per column, each value within i8; `offset`: subtracted from `q`.
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    pub(super) fn new(sc: __m512i, offset: i32) -> Self {
        let byte = _mm512_and_si512(sc, _mm512_set1_epi32(0xFF));
        let even = _mm512_or_si512(byte, _mm512_slli_epi32::<16>(byte));
        let off = _mm512_and_si512(
            _mm512_mullo_epi32(sc, _mm512_set1_epi32(offset)),
            _mm512_set1_epi32(0xFFFF),
        );
        Self {
            even,
            odd: _mm512_slli_epi32::<8>(even),
            offset: _mm512_or_si512(off, _mm512_slli_epi32::<16>(off)),
        }
    }
}

/// The exact integer sums of 16 rows against one super-block of 16 columns, `[row][column]`.
#[repr(C, align(64))]
pub(super) struct Sums {
    lo: [[i32; TILE]; ROWS],
    hi: [[i32; TILE]; ROWS],
}

impl Sums {
    fn new() -> Self {
        Self {
            lo: [[0; TILE]; ROWS],
            hi: [[0; TILE]; ROWS],
        }
    }

    /// Row `r`'s 16 sums: `lo + 256 hi`.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    #[inline]
    pub(super) fn row(&self, r: usize) -> __m512i {
        let lo = super::load512(&self.lo[r]);
        let hi = super::load512(&self.hi[r]);
        _mm512_add_epi32(lo, _mm512_slli_epi32::<8>(hi))
    }
}

/// What a thread needs to run products on tiles: the tiles configured, and room for one
/// super-block's weights and sums.
pub(super) struct Scratch {
    tiles: Tiles,
    pub(super) weights: Box<Weights>,
    sums: Box<[Sums; 2]>,
}

impl Scratch {
    /// Configures this thread's tiles (put back as they were when the scratch is dropped).
    pub(super) fn new() -> Self {
        Self {
            tiles: Tiles::configure(),
            weights: Weights::new(),
            sums: Box::new([Sums::new(), Sums::new()]),
        }
    }

    /// Sums the first `m` rows of `rows` (each row's `kb` blocks in turn, padded with zero
    /// rows to whole 16-row tiles) at block `b` against [`Scratch::weights`] and calls
    /// `f(row, its 16 sums, its block)` for each.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    #[inline]
    pub(super) fn rows(
        &mut self,
        rows: &[RowBlock],
        b: usize,
        kb: usize,
        m: usize,
        mut f: impl FnMut(usize, __m512i, &RowBlock),
    ) {
        // Two row tiles at a time share each load of the weights' tiles.
        for r0 in (0..m).step_by(2 * ROWS) {
            let pair = r0 + ROWS < m;
            let a = &rows[r0 * kb + b..];
            if pair {
                self.tiles.dot2(a, kb, &self.weights, &mut self.sums);
            } else {
                self.tiles.dot(a, kb, &self.weights, &mut self.sums[0]);
            }
            for r in r0..m.min(r0 + 2 * ROWS) {
                let sums = &self.sums[(r - r0) / ROWS];
                f(r, sums.row((r - r0) % ROWS), &rows[r * kb + b]);
            }
        }
    }
}

/// The tile layout, as `ldtilecfg` reads it and `sttilecfg` writes it.
#[repr(C, align(64))]
struct Config {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    bytes_per_row: [u16; 16],
    rows: [u8; 16],
}
const _: () = assert!(std::mem::size_of::<Config>() == 64);

impl Config {
    /// No tiles (palette 0).
    const UNSET: Self = Self {
        palette: 0,
        start_row: 0,
        reserved: [0; 14],
        bytes_per_row: [0; 16],
        rows: [0; 16],
    };
}

/// Tiles configured on the current thread. Dropping them puts back the configuration they
/// replaced, or releases the tiles where there was none (so that the thread's context
/// switches stop saving the tile state): candle's own AMX kernels configure a thread's
/// tiles once and rely on that configuration staying.
struct Tiles {
    replaced: Config,
}

impl Tiles {
    /// Configures the 8 tile registers as 16 rows of 64 bytes.
    fn configure() -> Self {
        assert!(enabled(), "AMX tiles used where they are not enabled");
        let mut config = Config::UNSET;
        config.palette = 1;
        for t in 0..8 {
            config.bytes_per_row[t] = CHUNK as u16;
            config.rows[t] = ROWS as u8;
        }
        let mut replaced = Config::UNSET;
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `enabled()` holds (the CPU has AMX and the process may use the tile state);
        // `sttilecfg` writes 64 bytes (zeros where no tiles are configured) into `replaced`,
        // and `config` is a valid palette 1 configuration.
        unsafe {
            std::arch::asm!(
                "sttilecfg [{old}]",
                "ldtilecfg [{new}]",
                old = in(reg) &raw mut replaced,
                new = in(reg) &raw const config,
                options(nostack),
            );
        }
        Self { replaced }
    }

    /// Sums 16 rows of activations (`rows[r * stride]`: row r's block, as the AVX-512
    /// kernels read it) against `w` into `sums`.
    fn dot(&mut self, rows: &[RowBlock], stride: usize, w: &Weights, sums: &mut Sums) {
        assert!(rows.len() > (ROWS - 1) * stride, "16 rows of blocks");
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the tiles are configured (`self`); each load reads 16 rows of 64 bytes at
        // `stride` blocks apart inside `rows` (asserted above; the values are a block's first
        // 256 bytes) or inside `w`, and each store writes 16 rows of 64 bytes inside `sums`.
        unsafe {
            std::arch::asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "tileloadd tmm4, [{a} + {s}*1]",
                "tileloadd tmm6, [{lo} + {b}*1]",
                "tileloadd tmm7, [{hi} + {b}*1]",
                "tdpbsud tmm0, tmm4, tmm6",
                "tdpbssd tmm1, tmm4, tmm7",
                "tileloadd tmm4, [{a} + {s}*1 + 64]",
                "tileloadd tmm6, [{lo} + {b}*1 + 1024]",
                "tileloadd tmm7, [{hi} + {b}*1 + 1024]",
                "tdpbsud tmm0, tmm4, tmm6",
                "tdpbssd tmm1, tmm4, tmm7",
                "tileloadd tmm4, [{a} + {s}*1 + 128]",
                "tileloadd tmm6, [{lo} + {b}*1 + 2048]",
                "tileloadd tmm7, [{hi} + {b}*1 + 2048]",
                "tdpbsud tmm0, tmm4, tmm6",
                "tdpbssd tmm1, tmm4, tmm7",
                "tileloadd tmm4, [{a} + {s}*1 + 192]",
                "tileloadd tmm6, [{lo} + {b}*1 + 3072]",
                "tileloadd tmm7, [{hi} + {b}*1 + 3072]",
                "tdpbsud tmm0, tmm4, tmm6",
                "tdpbssd tmm1, tmm4, tmm7",
                "tilestored [{slo} + {b}*1], tmm0",
                "tilestored [{shi} + {b}*1], tmm1",
                a = in(reg) rows.as_ptr(),
                s = in(reg) stride * std::mem::size_of::<RowBlock>(),
                lo = in(reg) w.lo.as_ptr(),
                hi = in(reg) w.hi.as_ptr(),
                b = in(reg) CHUNK,
                slo = in(reg) sums.lo.as_mut_ptr(),
                shi = in(reg) sums.hi.as_mut_ptr(),
                options(nostack),
            );
        }
    }

    /// [`Tiles::dot`] for 32 rows (the second 16 from `rows[16 * stride]` on) into `sums[0]`
    /// and `sums[1]`: each load of the weights serves both row tiles.
    fn dot2(&mut self, rows: &[RowBlock], stride: usize, w: &Weights, sums: &mut [Sums; 2]) {
        assert!(rows.len() > (2 * ROWS - 1) * stride, "32 rows of blocks");
        let [s0, s1] = sums;
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in `dot`, for 32 rows (asserted above) and two `Sums`.
        unsafe {
            std::arch::asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                "tileloadd tmm4, [{a} + {s}*1]",
                "tileloadd tmm5, [{a2} + {s}*1]",
                "tileloadd tmm6, [{lo} + {b}*1]",
                "tileloadd tmm7, [{hi} + {b}*1]",
                "tdpbsud tmm0, tmm4, tmm6",
                "tdpbssd tmm1, tmm4, tmm7",
                "tdpbsud tmm2, tmm5, tmm6",
                "tdpbssd tmm3, tmm5, tmm7",
                "tileloadd tmm4, [{a} + {s}*1 + 64]",
                "tileloadd tmm5, [{a2} + {s}*1 + 64]",
                "tileloadd tmm6, [{lo} + {b}*1 + 1024]",
                "tileloadd tmm7, [{hi} + {b}*1 + 1024]",
                "tdpbsud tmm0, tmm4, tmm6",
                "tdpbssd tmm1, tmm4, tmm7",
                "tdpbsud tmm2, tmm5, tmm6",
                "tdpbssd tmm3, tmm5, tmm7",
                "tileloadd tmm4, [{a} + {s}*1 + 128]",
                "tileloadd tmm5, [{a2} + {s}*1 + 128]",
                "tileloadd tmm6, [{lo} + {b}*1 + 2048]",
                "tileloadd tmm7, [{hi} + {b}*1 + 2048]",
                "tdpbsud tmm0, tmm4, tmm6",
                "tdpbssd tmm1, tmm4, tmm7",
                "tdpbsud tmm2, tmm5, tmm6",
                "tdpbssd tmm3, tmm5, tmm7",
                "tileloadd tmm4, [{a} + {s}*1 + 192]",
                "tileloadd tmm5, [{a2} + {s}*1 + 192]",
                "tileloadd tmm6, [{lo} + {b}*1 + 3072]",
                "tileloadd tmm7, [{hi} + {b}*1 + 3072]",
                "tdpbsud tmm0, tmm4, tmm6",
                "tdpbssd tmm1, tmm4, tmm7",
                "tdpbsud tmm2, tmm5, tmm6",
                "tdpbssd tmm3, tmm5, tmm7",
                "tilestored [{s0lo} + {b}*1], tmm0",
                "tilestored [{s0hi} + {b}*1], tmm1",
                "tilestored [{s1lo} + {b}*1], tmm2",
                "tilestored [{s1hi} + {b}*1], tmm3",
                a = in(reg) rows.as_ptr(),
                a2 = in(reg) rows[ROWS * stride..].as_ptr(),
                s = in(reg) stride * std::mem::size_of::<RowBlock>(),
                lo = in(reg) w.lo.as_ptr(),
                hi = in(reg) w.hi.as_ptr(),
                b = in(reg) CHUNK,
                s0lo = in(reg) s0.lo.as_mut_ptr(),
                s0hi = in(reg) s0.hi.as_mut_ptr(),
                s1lo = in(reg) s1.lo.as_mut_ptr(),
                s1hi = in(reg) s1.hi.as_mut_ptr(),
                options(nostack),
            );
        }
    }
}

impl Drop for Tiles {
    fn drop(&mut self) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `replaced` is what `sttilecfg` stored: a valid configuration, or zeros
        // (palette 0), in which case the tiles are released instead.
        unsafe {
            if self.replaced.palette == 0 {
                std::arch::asm!("tilerelease", options(nostack, nomem));
            } else {
                std::arch::asm!(
                    "ldtilecfg [{}]",
                    in(reg) &raw const self.replaced,
                    options(nostack),
                );
            }
        }
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::{Config, Scratch, enabled};

    fn stored() -> Config {
        let mut config = Config::UNSET;
        // SAFETY: `sttilecfg` writes 64 bytes into `config`.
        unsafe { std::arch::asm!("sttilecfg [{}]", in(reg) &raw mut config, options(nostack)) };
        config
    }

    /// A thread's tiles come back as they were: released where none were configured, and
    /// configured as before where another user (candle's kernels) had configured them.
    #[test]
    fn a_scratch_gives_the_tiles_back_as_it_found_them() {
        if !enabled() {
            eprintln!("skipped: this CPU (or DUET_CPU_KERNELS) runs no AMX tiles");
            return;
        }
        std::thread::spawn(|| {
            assert_eq!(stored().palette, 0);
            drop(Scratch::new());
            assert_eq!(stored().palette, 0, "released");
            let mut theirs = Config::UNSET;
            theirs.palette = 1;
            theirs.bytes_per_row[0] = 32;
            theirs.rows[0] = 8;
            // SAFETY: a valid palette 1 configuration of one 8 x 32-byte tile.
            unsafe {
                std::arch::asm!("ldtilecfg [{}]", in(reg) &raw const theirs, options(nostack));
            }
            let scratch = Scratch::new();
            assert_eq!(stored().bytes_per_row[0], 64);
            drop(scratch);
            let back = stored();
            assert_eq!(
                (back.palette, back.bytes_per_row, back.rows),
                (1, theirs.bytes_per_row, theirs.rows)
            );
            // SAFETY: releasing configured tiles has no other effect.
            unsafe { std::arch::asm!("tilerelease", options(nostack, nomem)) };
        })
        .join()
        .unwrap();
    }
}
