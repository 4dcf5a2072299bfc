//! The batch-invariant quantized matmul on CUDA (see `linear`'s module docs for why).
//!
//! candle's CUDA matmul for GGUF weights picks its kernel by row count: a mat-vec kernel with
//! four warps per output row for 1 to 4 rows, the same kernel with two warps for 5 to 8, and a
//! tiled stream-k kernel above 8. Each sums a row's products in its own order, so a row's
//! result depends on how many rows share the call, and greedy speculation would drift from
//! the target alone. Here every row goes through candle's mat-vec kernel in launches of at
//! most four rows: within one to four rows that kernel gives each row the same lanes, the same
//! loop over the weight's blocks and the same reduction, so a row's result is the same whether
//! it is decoded alone or verified among others. Activations are quantized to Q8_1 row by row
//! (each row's blocks on their own), as candle does for decode. Where `DUET_CUDA_MATVEC`
//! asks for the step's tiled kernel, these matmuls take it too (`cuda_step::matvec`).
//!
//! Attention gets the same treatment: one kernel of ours (compiled by NVRTC at first use)
//! computes each query row from its query and the cache alone.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DevicePtr, LaunchConfig, PushKernelArg};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{CpuStorage, CudaStorage, CustomOp1, CustomOp3, DType, Layout, Shape, Tensor};
use std::ffi::c_void;
use std::sync::OnceLock;

/// Rows per mat-vec launch: the most for which the kernel keeps four warps per output row.
const ROWS_PER_LAUNCH: usize = 4;
/// Q8_1: 32 values per block, stored as two halves (scale, sum) and 32 int8.
const Q8_1_BLOCK: usize = 32;
const Q8_1_BYTES: usize = 36;
/// candle pads each quantized row of activations to a multiple of this many values.
pub(crate) const ROW_PADDING: usize = 512;

pub(crate) type MatVec = unsafe extern "C" fn(
    *const c_void,
    *const c_void,
    *mut c_void,
    i32,
    i32,
    i32,
    i32,
    i32,
    *mut c_void,
);

/// The weight types candle's mat-vec kernels take, each with its name in the kernels'
/// names (candle's `launch_mmvq_gguf_{name}_f32_plain`, the step's `duet_matvec_{name}`)
/// and candle's launcher (f32 output).
pub(crate) const MAT_VEC_TYPES: [(GgmlDType, &str, MatVec); 10] = {
    use GgmlDType::{Q2K, Q3K, Q4_0, Q4_1, Q4K, Q5_0, Q5_1, Q5K, Q6K, Q8_0};
    use candle_kernels::ffi;
    [
        (Q4_0, "q4_0", ffi::launch_mmvq_gguf_q4_0_f32_plain),
        (Q4_1, "q4_1", ffi::launch_mmvq_gguf_q4_1_f32_plain),
        (Q5_0, "q5_0", ffi::launch_mmvq_gguf_q5_0_f32_plain),
        (Q5_1, "q5_1", ffi::launch_mmvq_gguf_q5_1_f32_plain),
        (Q8_0, "q8_0", ffi::launch_mmvq_gguf_q8_0_f32_plain),
        (Q2K, "q2_k", ffi::launch_mmvq_gguf_q2_k_f32_plain),
        (Q3K, "q3_k", ffi::launch_mmvq_gguf_q3_k_f32_plain),
        (Q4K, "q4_k", ffi::launch_mmvq_gguf_q4_k_f32_plain),
        (Q5K, "q5_k", ffi::launch_mmvq_gguf_q5_k_f32_plain),
        (Q6K, "q6_k", ffi::launch_mmvq_gguf_q6_k_f32_plain),
    ]
};

fn mat_vec_type(dtype: GgmlDType) -> Option<&'static (GgmlDType, &'static str, MatVec)> {
    MAT_VEC_TYPES.iter().find(|(t, ..)| *t == dtype)
}

/// A weight type's name in the mat-vec kernels' names ([`MAT_VEC_TYPES`]).
pub(crate) fn type_name(dtype: GgmlDType) -> Option<&'static str> {
    mat_vec_type(dtype).map(|(_, name, _)| *name)
}

/// candle's mat-vec launcher (f32 output) for a weight type, where it has one.
pub(crate) fn mat_vec(dtype: GgmlDType) -> Option<MatVec> {
    mat_vec_type(dtype).map(|(.., launch)| *launch)
}

/// Whether [`matmul`] serves weights of this type.
pub(crate) fn supports(dtype: GgmlDType) -> bool {
    mat_vec(dtype).is_some()
}

/// `x W^T` for `x: (m, k)` on the GPU, each row's result independent of `m`.
pub(crate) fn matmul(weight: &QTensor, x: &Tensor) -> candle_core::Result<Tensor> {
    x.to_dtype(DType::F32)?
        .contiguous()?
        .apply_op1_no_bwd(&RowInvariant(weight))
}

struct RowInvariant<'a>(&'a QTensor);

impl CustomOp1 for RowInvariant<'_> {
    fn name(&self) -> &'static str {
        "duet-row-invariant-mat-vec"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        candle_core::bail!("{} runs on CUDA tensors only", self.name())
    }

    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let weight = self.0;
        let (n, k) = weight.shape().dims2()?;
        let (m, xk) = layout.shape().dims2()?;
        if xk != k {
            candle_core::bail!(
                "{}: input {:?}, weight {n}x{k}",
                self.name(),
                layout.shape()
            );
        }
        let Some((start, end)) = layout.contiguous_offsets() else {
            candle_core::bail!("{}: the input must be contiguous", self.name());
        };
        let Some(launch) = mat_vec(weight.dtype()) else {
            candle_core::bail!("{}: no kernel for {:?}", self.name(), weight.dtype());
        };
        let dev = x.device().clone();
        let stream = dev.cuda_stream();
        // Where the step takes the tiled kernels, so do the matmuls outside it.
        let tiled = match super::cuda_step::matvec::supports(weight.dtype()) {
            true => super::cuda_step::matvec::for_stream(&stream)
                .map_err(|e| candle_core::Error::Msg(e.to_string()))?,
            false => None,
        };
        let input = x.as_cuda_slice::<f32>()?.slice(start..end);
        let k_padded = k.div_ceil(ROW_PADDING) * ROW_PADDING;
        let row_bytes = k_padded / Q8_1_BLOCK * Q8_1_BYTES;
        // SAFETY: both buffers are written in full below before anything reads them: the
        // quantizer writes every padded block of every row, the mat-vec every output.
        let quantized = unsafe { dev.alloc::<u8>(m * row_bytes)? };
        let out = unsafe { dev.alloc::<f32>(m * n)? };
        {
            let (x_ptr, _x_guard) = input.device_ptr(&stream);
            let (q_ptr, _q_guard) = quantized.device_ptr(&stream);
            let (out_ptr, _out_guard) = out.device_ptr(&stream);
            let w_ptr = weight.device_ptr()?;
            let raw_stream = stream.cu_stream() as *mut c_void;
            // SAFETY: the pointers are live device buffers of the sizes the kernels read and
            // write (the weight padded by candle at load, the activations `m x k` f32, the
            // quantized rows `m x row_bytes`, the output `m x n` f32), all on this stream.
            unsafe {
                candle_kernels::ffi::launch_mmvq_gguf_quantize_q8_1_f32(
                    x_ptr as *const c_void,
                    q_ptr as *mut c_void,
                    k as i32,
                    k_padded as i32,
                    m as i32,
                    raw_stream,
                );
            }
            if let Some(tiled) = tiled {
                tiled
                    .launch(
                        &stream,
                        weight.dtype(),
                        [w_ptr as u64, q_ptr, out_ptr],
                        (n, k),
                        m,
                        k_padded / Q8_1_BLOCK,
                        None,
                    )
                    .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
            } else {
                // SAFETY: as above.
                let pointers = [w_ptr as u64, q_ptr, out_ptr];
                unsafe { launch_by_fours(launch, pointers, (n, k), m, raw_stream) };
            }
        }
        Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from((m, n))))
    }
}

/// candle's mat-vec kernel over `m` rows, at most [`ROWS_PER_LAUNCH`] rows a launch.
///
/// # Safety
/// The pointers are live device buffers on `raw_stream`: the weight `n x k` as candle loaded
/// it, the quantized input `m` rows of `k` padded to [`ROW_PADDING`], the output `m x n` f32.
unsafe fn launch_by_fours(
    launch: MatVec,
    [w_ptr, q_ptr, out_ptr]: [u64; 3],
    (n, k): (usize, usize),
    m: usize,
    raw_stream: *mut c_void,
) {
    let blocks = k.div_ceil(ROW_PADDING) * ROW_PADDING / Q8_1_BLOCK;
    for first in (0..m).step_by(ROWS_PER_LAUNCH) {
        let rows = ROWS_PER_LAUNCH.min(m - first);
        // SAFETY: the caller's buffers, rows `first..first + rows` of each.
        unsafe {
            launch(
                w_ptr as *const c_void,
                (q_ptr as usize + first * blocks * Q8_1_BYTES) as *const c_void,
                (out_ptr as usize + first * n * std::mem::size_of::<f32>()) as *mut c_void,
                k as i32,
                n as i32,
                blocks as i32,
                n as i32,
                rows as i32,
                raw_stream,
            );
        }
    }
}

/// Causal attention for one sequence's new rows, one thread block per (row, query head): the
/// block scores the row's query against the cached keys `0..=position`, takes the softmax
/// (maximum and sum by a fixed reduction tree) and sums the values in position order. A row's
/// result depends on its query and the cache alone, not on the rows launched with it, and the
/// whole layer's attention is one launch instead of candle's dozen per row.
const ATTENTION: &str = r#"
// q: [rows, heads, hd]; k, v: [capacity, kv_heads, hd]; out: [rows, heads * hd].
extern "C" __global__ void duet_attend_rows(const float* q, const float* k, const float* v,
                                            float* out, int start, int heads, int kv_heads,
                                            int hd, float scale) {
    DYNAMIC_SHARED(float, shared);
    float* scratch = shared;              // THREADS / 32 floats
    float* scores = shared + THREADS / 32; // start + row + 1 floats
    const int head = blockIdx.x, row = blockIdx.y;
    const int kv_head = head / (heads / kv_heads);
    const int n = start + row + 1;
    const float* query = q + ((u64)row * heads + head) * hd;
    const u64 stride = (u64)kv_heads * hd;
    const float* keys = k + (u64)kv_head * hd;
    const float* values = v + (u64)kv_head * hd;

    float local_max = __int_as_float(0xff800000); // -inf
    for (int t = threadIdx.x; t < n; t += THREADS) {
        const float* key = keys + t * stride;
        float dot = 0.0f;
        for (int d = 0; d < hd; ++d) dot = fmaf(query[d], key[d], dot);
        scores[t] = dot * scale;
        local_max = fmaxf(local_max, scores[t]);
    }
    const float max = block_reduce<THREADS>(local_max, scratch, true);
    float local_sum = 0.0f;
    for (int t = threadIdx.x; t < n; t += THREADS) {
        const float e = expf(scores[t] - max);
        scores[t] = e;
        local_sum += e;
    }
    const float sum = block_reduce<THREADS>(local_sum, scratch, false);
    __syncthreads();
    for (int d = threadIdx.x; d < hd; d += THREADS) {
        float acc = 0.0f;
        for (int t = 0; t < n; ++t) acc = fmaf(scores[t], values[t * stride + d], acc);
        out[((u64)row * heads + head) * hd + d] = acc / sum;
    }
}
"#;
pub(crate) const ATTENTION_THREADS: u32 = 128;

/// The attention kernel's NVRTC source: its block size, the header our kernels share
/// (`cuda_step/common.cuh`: its reductions), then the kernel.
pub(crate) fn attention_source() -> String {
    format!(
        "#define THREADS {ATTENTION_THREADS}\n{}\n{ATTENTION}",
        super::cuda_step::COMMON
    )
}

/// Shared memory a block may take without opting in: it holds one score per cached position.
const SHARED_BYTES: usize = 48 * 1024;

/// Whether [`attend`] serves a sequence whose cache will hold `len` positions.
pub(crate) fn attention_fits(len: usize) -> bool {
    static OFF: OnceLock<bool> = OnceLock::new();
    let off =
        *OFF.get_or_init(|| std::env::var("DUET_CUDA_ATTENTION").is_ok_and(|v| v == "tensor"));
    !off && (len + ATTENTION_THREADS as usize / 32) * std::mem::size_of::<f32>() <= SHARED_BYTES
}

/// The attention kernel's PTX, compiled by NVRTC once per process.
fn attention_ptx() -> candle_core::Result<&'static str> {
    static PTX: OnceLock<Result<String, String>> = OnceLock::new();
    PTX.get_or_init(|| {
        candle_core::cuda_backend::cudarc::nvrtc::compile_ptx(attention_source())
            .map(|ptx| ptx.to_src())
            .map_err(|e| e.to_string())
    })
    .as_deref()
    .map_err(|e| candle_core::Error::Msg(format!("compiling the attention kernel: {e}")))
}

/// Attention of `q: [rows, heads, hd]` (positions `start..start + rows`) over one sequence's
/// cached keys and values `[capacity, kv_heads, hd]`, which already hold the new rows.
/// Returns `[rows, heads * hd]`.
pub(crate) fn attend(
    q: &Tensor,
    keys: &Tensor,
    values: &Tensor,
    start: usize,
    kv_heads: usize,
) -> candle_core::Result<Tensor> {
    let (rows, heads, hd) = q.dims3()?;
    let q = q.to_dtype(DType::F32)?.contiguous()?;
    let out = q.apply_op3_no_bwd(
        keys,
        values,
        &RowAttention {
            start,
            kv_heads,
            scale: 1.0 / (hd as f32).sqrt(),
        },
    )?;
    out.reshape((rows, heads * hd))
}

struct RowAttention {
    start: usize,
    kv_heads: usize,
    scale: f32,
}

impl CustomOp3 for RowAttention {
    fn name(&self) -> &'static str {
        "duet-row-attention"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        candle_core::bail!("{} runs on CUDA tensors only", self.name())
    }

    fn cuda_fwd(
        &self,
        q: &CudaStorage,
        q_layout: &Layout,
        k: &CudaStorage,
        k_layout: &Layout,
        v: &CudaStorage,
        v_layout: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let (rows, heads, hd) = q_layout.shape().dims3()?;
        let (capacity, kv_heads, khd) = k_layout.shape().dims3()?;
        if khd != hd || kv_heads != self.kv_heads || heads % kv_heads != 0 {
            candle_core::bail!(
                "{}: q {:?}, cache {:?}",
                self.name(),
                q_layout.shape(),
                k_layout.shape()
            );
        }
        if v_layout.shape() != k_layout.shape() || self.start + rows > capacity {
            candle_core::bail!(
                "{}: {} rows at {} in a cache of {capacity}",
                self.name(),
                rows,
                self.start
            );
        }
        let contiguous = |layout: &Layout| {
            layout.contiguous_offsets().ok_or_else(|| {
                candle_core::Error::Msg(format!("{}: inputs must be contiguous", self.name()))
            })
        };
        let (q_from, q_to) = contiguous(q_layout)?;
        let (k_from, k_to) = contiguous(k_layout)?;
        let (v_from, v_to) = contiguous(v_layout)?;
        let dev = q.device().clone();
        let func =
            dev.get_or_load_custom_func("duet_attend_rows", "duet_attention", attention_ptx()?)?;
        let q = q.as_cuda_slice::<f32>()?.slice(q_from..q_to);
        let k = k.as_cuda_slice::<f32>()?.slice(k_from..k_to);
        let v = v.as_cuda_slice::<f32>()?.slice(v_from..v_to);
        // SAFETY: the kernel writes every element: each block one (row, head) slice of hd.
        let out = unsafe { dev.alloc::<f32>(rows * heads * hd)? };
        let len = self.start + rows;
        let config = LaunchConfig {
            grid_dim: (heads as u32, rows as u32, 1),
            block_dim: (ATTENTION_THREADS, 1, 1),
            shared_mem_bytes: ((len + ATTENTION_THREADS as usize / 32) * std::mem::size_of::<f32>())
                as u32,
        };
        let (start, heads_i, kv_i, hd_i) =
            (self.start as i32, heads as i32, kv_heads as i32, hd as i32);
        let mut launch = func.builder();
        launch.arg(&q);
        launch.arg(&k);
        launch.arg(&v);
        launch.arg(&out);
        launch.arg(&start);
        launch.arg(&heads_i);
        launch.arg(&kv_i);
        launch.arg(&hd_i);
        launch.arg(&self.scale);
        // SAFETY: the arguments match the kernel's signature, and the buffers hold what it
        // reads (the cache's first `len` positions, checked above) and writes.
        unsafe { launch.launch(config) }
            .map_err(|e| candle_core::Error::Msg(format!("{}: {e}", self.name())))?;
        Ok((
            CudaStorage::wrap_cuda_slice(out, dev),
            Shape::from((rows, heads, hd)),
        ))
    }
}

/// The device address of a contiguous tensor on CUDA (its first element), of f32, bf16 or
/// u8.
pub(crate) fn device_addr(t: &Tensor) -> candle_core::Result<u64> {
    let (storage, layout) = t.storage_and_layout();
    let candle_core::Storage::Cuda(cuda) = &*storage else {
        candle_core::bail!("a tensor off the GPU");
    };
    if !layout.is_contiguous() {
        candle_core::bail!("a strided tensor");
    }
    let base = match t.dtype() {
        DType::F32 => slice_addr(cuda.as_cuda_slice::<f32>()?),
        DType::BF16 => slice_addr(cuda.as_cuda_slice::<half::bf16>()?),
        DType::U8 => slice_addr(cuda.as_cuda_slice::<u8>()?),
        other => candle_core::bail!("the address of a {other:?} tensor"),
    };
    Ok(base + (layout.start_offset() * t.dtype().size_in_bytes()) as u64)
}

fn slice_addr<T>(slice: &candle_core::cuda_backend::cudarc::driver::CudaSlice<T>) -> u64 {
    slice.device_ptr(slice.stream()).0
}

/// Makes the device's context current on this thread before CUDA buffers are freed here.
/// cudarc binds the context for its allocations, copies and launches, but frees a buffer
/// without binding it: a session's cache dropped on a thread that never ran CUDA work (a
/// worker's gRPC threads close and expire sessions) would fail the free with
/// CUDA_ERROR_INVALID_CONTEXT, and cudarc would report that error at the next call on any
/// thread. This skips cudarc's `bind_to_thread`, which first returns an error an earlier
/// call recorded: a drop has no caller to hand it to.
pub(crate) fn make_current_before_free(device: &candle_core::CudaDevice) {
    let ctx = device.cuda_stream().context().cu_ctx();
    // SAFETY: the context is alive (the device holds it), and making it current changes
    // nothing else on this thread. Should it fail, the frees that follow record the error.
    let _ = unsafe { candle_core::cuda_backend::cudarc::driver::result::ctx::set_current(ctx) };
}
