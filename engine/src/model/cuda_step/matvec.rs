//! The step's own quantized mat-vec (`matvec.cu`): every activation row of a pass in one
//! launch a matmul, a tile of rows sharing each weight load, each row's sums in a fixed
//! order. candle's mat-vec kernel keeps a row's order only up to four rows a launch and
//! re-reads the weights for every four rows.
//!
//! Experimental, off unless `DUET_CUDA_MATVEC=tiled`: where it stands against candle's
//! kernel (faster from a few rows on, slower for one; its agreement with candle's ops on
//! Q5_0 not yet checked on a GPU) is in docs/benchmarks.md, "A mat-vec kernel that scales
//! with rows". A shortlisted draft's extra ids still go through candle's kernel, so their
//! logits round differently from the same ids' in a whole model.

use super::{Result, cu, load_module};
use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaStream, LaunchConfig, PushKernelArg,
};
use candle_core::quantized::GgmlDType;
use std::sync::Arc;

pub(super) const SOURCE: &str = include_str!("matvec.cu");
/// Activation rows a warp takes at once (`TILE` in `matvec.cu`).
const TILE: usize = 8;
/// Warps a block, one output feature each (`WARPS` in `matvec.cu`).
const WARPS: usize = 4;

/// Whether the tiled kernels are asked for: `DUET_CUDA_MATVEC=tiled`, read once.
pub(super) fn wanted() -> bool {
    static TILED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *TILED.get_or_init(|| std::env::var("DUET_CUDA_MATVEC").is_ok_and(|v| v == "tiled"))
}

/// Whether a weight type has a tiled kernel.
pub(super) fn supports(dtype: GgmlDType) -> bool {
    matches!(
        dtype,
        GgmlDType::Q8_0 | GgmlDType::Q5_0 | GgmlDType::Q4K | GgmlDType::Q6K
    )
}

/// The tiled kernels, one per weight type.
#[derive(Debug)]
pub(super) struct Tiled {
    q8_0: CudaFunction,
    q5_0: CudaFunction,
    q4_k: CudaFunction,
    q6_k: CudaFunction,
}

impl Tiled {
    pub(super) fn load(stream: &Arc<CudaStream>) -> Result<Self> {
        let module = load_module(stream, SOURCE, "tiled mat-vec kernels")?;
        let f = |name: &str| cu(module.load_function(name), name);
        Ok(Self {
            q8_0: f("duet_matvec_q8_0")?,
            q5_0: f("duet_matvec_q5_0")?,
            q4_k: f("duet_matvec_q4_k")?,
            q6_k: f("duet_matvec_q6_k")?,
        })
    }

    /// `output = input W^T` for `rows` rows of Q8_1 input of `x_blocks` blocks each, one
    /// launch. `weight`: `n x k` of `dtype`, as candle loaded it.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn launch(
        &self,
        stream: &Arc<CudaStream>,
        dtype: GgmlDType,
        [weight, input, output]: [u64; 3],
        (n, k): (usize, usize),
        rows: usize,
        x_blocks: usize,
    ) -> Result<()> {
        let f = match dtype {
            GgmlDType::Q8_0 => &self.q8_0,
            GgmlDType::Q5_0 => &self.q5_0,
            GgmlDType::Q4K => &self.q4_k,
            GgmlDType::Q6K => &self.q6_k,
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
            grid_dim: (n.div_ceil(WARPS) as u32, rows.div_ceil(TILE) as u32, 1),
            block_dim: ((32 * WARPS) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match the kernel's signature; the weight holds `n` rows of
        // `k` values of its type, the input `rows` rows of `x_blocks` Q8_1 blocks (at
        // least k / 32), the output `rows` rows of `n` f32.
        cu(unsafe { launch.launch(config) }.map(drop), "tiled mat-vec")
    }
}
