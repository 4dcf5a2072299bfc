//! The step's own quantized mat-vec (`matvec.cu`): every activation row of a pass in one
//! launch a matmul, a tile of rows sharing each weight load, each row's sums in a fixed
//! order. candle's mat-vec kernel keeps a row's order only up to four rows a launch and
//! re-reads the weights for every four rows.
//!
//! Experimental, off unless `DUET_CUDA_MATVEC=tiled`: where it stands against candle's
//! kernel (faster from a few rows on, slower for one) is in docs/benchmarks.md, "A mat-vec
//! kernel that scales with rows" and the entry after it.
//!
//! Each kernel comes in two widths, one output feature a warp and four (the activations
//! read once for four features); both add every sum in the same order, so a pass picks the
//! width by its row count without changing a bit. `tiled1` and `tiled4` pin the width, to
//! compare them. The matmuls outside the step (a shortlisted draft's extra ids) take the
//! same kernels ([`for_stream`], loaded once for both), so an id's logit is the same in a
//! shortlisted model as in the whole one.

use super::{Result, cu, load_module};
use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaStream, LaunchConfig, PushKernelArg,
};
use candle_core::quantized::GgmlDType;
use std::sync::Arc;

pub(super) const SOURCE: &str = include_str!("matvec.cu");
/// Activation rows a warp takes at once (`TILE` in `matvec.cu`).
pub(super) const TILE: usize = 8;
/// Warps a block (`WARPS` in `matvec.cu`).
pub(super) const WARPS: usize = 4;
/// Output features a warp of the wide kernels (their `_x4` names).
const WIDE: usize = 4;
/// From this many rows a pass uses the wide kernels: the activation reads they save grow
/// with the rows, the parallelism they give up matters most at few rows.
const WIDE_FROM_ROWS: usize = 16;

/// The tiled kernels, for the step and the matmuls outside it: loaded on first use where
/// they are asked for (`None` where not). A process drives one GPU, so they are loaded once.
pub(crate) fn for_stream(stream: &Arc<CudaStream>) -> Result<Option<&'static Tiled>> {
    static TILED: std::sync::OnceLock<std::result::Result<Tiled, String>> =
        std::sync::OnceLock::new();
    if !wanted() {
        return Ok(None);
    }
    match TILED.get_or_init(|| Tiled::load(stream).map_err(|e| e.to_string())) {
        Ok(tiled) => Ok(Some(tiled)),
        Err(e) => Err(candle_core::Error::Msg(e.clone()).into()),
    }
}

/// Which kernels `DUET_CUDA_MATVEC` asks for, read once: `None` for candle's.
fn mode() -> Option<&'static str> {
    static MODE: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    MODE.get_or_init(|| {
        std::env::var("DUET_CUDA_MATVEC")
            .ok()
            .filter(|v| matches!(v.as_str(), "tiled" | "tiled1" | "tiled4"))
    })
    .as_deref()
}

/// Whether the tiled kernels are asked for: `DUET_CUDA_MATVEC=tiled` (or `tiled1`,
/// `tiled4`).
fn wanted() -> bool {
    mode().is_some()
}

/// Output features a warp for a pass of `rows` rows.
fn width(rows: usize) -> usize {
    match mode() {
        Some("tiled1") => 1,
        Some("tiled4") => WIDE,
        _ if rows >= WIDE_FROM_ROWS => WIDE,
        _ => 1,
    }
}

/// Whether a weight type has a tiled kernel.
pub(crate) fn supports(dtype: GgmlDType) -> bool {
    matches!(
        dtype,
        GgmlDType::Q8_0 | GgmlDType::Q5_0 | GgmlDType::Q4K | GgmlDType::Q6K
    )
}

/// One width of the tiled kernels, one per weight type.
#[derive(Debug)]
struct Kernels {
    q8_0: CudaFunction,
    q5_0: CudaFunction,
    q4_k: CudaFunction,
    q6_k: CudaFunction,
}

/// The tiled kernels: one output feature a warp, and `WIDE`.
#[derive(Debug)]
pub(crate) struct Tiled {
    narrow: Kernels,
    wide: Kernels,
}

impl Tiled {
    fn load(stream: &Arc<CudaStream>) -> Result<Self> {
        let module = load_module(stream, SOURCE, "tiled mat-vec kernels")?;
        let kernels = |suffix: &str| -> Result<Kernels> {
            let f = |name: &str| {
                let name = format!("duet_matvec_{name}{suffix}");
                cu(module.load_function(&name), &name)
            };
            Ok(Kernels {
                q8_0: f("q8_0")?,
                q5_0: f("q5_0")?,
                q4_k: f("q4_k")?,
                q6_k: f("q6_k")?,
            })
        };
        Ok(Self {
            narrow: kernels("")?,
            wide: kernels("_x4")?,
        })
    }

    /// `output = input W^T` for `rows` rows of Q8_1 input of `x_blocks` blocks each, one
    /// launch. `weight`: `n x k` of `dtype`, as candle loaded it.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn launch(
        &self,
        stream: &Arc<CudaStream>,
        dtype: GgmlDType,
        [weight, input, output]: [u64; 3],
        (n, k): (usize, usize),
        rows: usize,
        x_blocks: usize,
    ) -> Result<()> {
        let width = width(rows);
        let kernels = if width == WIDE {
            &self.wide
        } else {
            &self.narrow
        };
        let f = match dtype {
            GgmlDType::Q8_0 => &kernels.q8_0,
            GgmlDType::Q5_0 => &kernels.q5_0,
            GgmlDType::Q4K => &kernels.q4_k,
            GgmlDType::Q6K => &kernels.q6_k,
            other => {
                return Err(candle_core::Error::Msg(format!(
                    "no tiled mat-vec kernel for {other:?}"
                ))
                .into());
            }
        };
        let ints = [k as i32, n as i32, rows as i32, x_blocks as i32];
        let mut launch = stream.launch_builder(f);
        launch.arg(&weight).arg(&input).arg(&output);
        launch
            .arg(&ints[0])
            .arg(&ints[1])
            .arg(&ints[2])
            .arg(&ints[3]);
        let config = LaunchConfig {
            grid_dim: (
                n.div_ceil(WARPS * width) as u32,
                rows.div_ceil(TILE) as u32,
                1,
            ),
            block_dim: ((32 * WARPS) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match the kernel's signature; the weight holds `n` rows of
        // `k` values of its type, the input `rows` rows of `x_blocks` Q8_1 blocks (at
        // least k / 32), the output `rows` rows of `n` f32.
        cu(unsafe { launch.launch(config) }.map(drop), "tiled mat-vec")
    }
}
