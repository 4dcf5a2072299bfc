//! The step's NVRTC sources as they are compiled: the launch shapes the host sizes grids and
//! buffers by (attention's from `DUET_CUDA_ATTN`, the tensor-core mat-vec's), `common.cuh`
//! and a kernel file, compiled for the GPU and loaded.

use super::{
    ATTN_GROUP_MAX, ATTN_THREADS, AttnShape, COMMON, GREEDY_THREADS, LORA_MAX_RANK, LORA_THREADS,
    NORM_THREADS, Result, TREE_PATH, cu, matvec,
};
use candle_core::cuda_backend::cudarc::driver::{CudaModule, CudaStream};
use candle_core::cuda_backend::cudarc::nvrtc;
use std::sync::Arc;

/// How attention splits a row's keys, read once: `DUET_CUDA_ATTN=PARTSxCHUNK[g]`
/// (experimental, `AttnShape::parse`), else [`AttnShape::DEFAULT`].
pub(super) fn attn_shape() -> AttnShape {
    static SHAPE: std::sync::OnceLock<AttnShape> = std::sync::OnceLock::new();
    *SHAPE.get_or_init(|| {
        let expected = "PARTSxCHUNK[g] with 1-64 parts and chunks of 16, 32 or 64 keys";
        shape_from_env("DUET_CUDA_ATTN", AttnShape::parse, expected).unwrap_or(AttnShape::DEFAULT)
    })
}

/// A launch shape the variable `name` sets (to compare shapes on a GPU): `parse`'s reading
/// of it; `None` where it is unset or empty, or where `parse` refuses it, which a warning
/// then says (`expected`: what it should be), since a comparison of shapes must not measure
/// the default under another name.
pub(super) fn shape_from_env<T>(
    name: &str,
    parse: impl Fn(&str) -> Option<T>,
    expected: &str,
) -> Option<T> {
    let v = std::env::var(name).ok().filter(|v| !v.is_empty())?;
    let shape = parse(&v);
    if shape.is_none() {
        tracing::warn!(value = %v, "{name} is not {expected}; the default runs");
    }
    shape
}

/// An NVRTC source of the step as it is compiled: the launch shapes the host sizes grids
/// and buffers by (written once, here), `common.cuh`, then `body`.
pub(super) fn source(body: &str) -> String {
    source_for(body, matvec::mma_shape(), matvec::few_form())
}

/// [`source`] for the tensor-core kernels' shape `mma` and their few-row form `few`.
pub(super) fn source_for(body: &str, mma: matvec::MmaShape, few: matvec::FewForm) -> String {
    let (tile, warps) = (matvec::TILE, matvec::WARPS);
    let (mma_tiles, mma_warps, mma_unroll) = (mma.tiles, mma.warps, mma.unroll);
    let AttnShape { parts, chunk, .. } = attn_shape();
    format!(
        "#define NORM_THREADS {NORM_THREADS}\n#define ATTN_THREADS {ATTN_THREADS}\n\
         #define ATTN_PARTS {parts}\n#define ATTN_CHUNK {chunk}\n\
         #define ATTN_GROUP_MAX {ATTN_GROUP_MAX}\n\
         #define GREEDY_THREADS {GREEDY_THREADS}\n\
         #define LORA_THREADS {LORA_THREADS}\n#define LORA_MAX_RANK {LORA_MAX_RANK}\n\
         #define TREE_PATH {TREE_PATH}\n\
         #define MATVEC_TILE {tile}\n#define MATVEC_WARPS {warps}\n\
         #define MMA_TILES {mma_tiles}\n#define MMA_WARPS {mma_warps}\n\
         #define MMA_UNROLL {mma_unroll}\n#define FEW_ROWS {}\n#define FEW_LANES {}\n\
         {COMMON}\n{body}",
        few.rows, few.lanes
    )
}

/// Compiles one of the step's sources with NVRTC (for the PTX the driver assembles for
/// this GPU; `arch`: the virtual architecture, NVRTC's default where `None`) and loads it
/// into the stream's context.
pub(super) fn load_module(
    stream: &Arc<CudaStream>,
    body: &str,
    arch: Option<&'static str>,
    what: &str,
) -> Result<Arc<CudaModule>> {
    let options = nvrtc::CompileOptions {
        arch,
        ..Default::default()
    };
    let ptx = nvrtc::compile_ptx_with_opts(source(body), options)
        .map_err(|e| candle_core::Error::Msg(format!("compiling the {what}: {e}")))?;
    cu(stream.context().load_module(ptx), what)
}
