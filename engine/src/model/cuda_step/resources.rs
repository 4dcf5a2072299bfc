//! What a step holds on the device: its kernels, its buffers and their addresses, and its
//! stream.

use super::{
    DRAFTED_MAX, KERNELS, MAX_ROWS, Q8_1_BYTES, Result, attn_shape, cu, load_module, row_blocks,
};
use crate::model::config::ModelConfig;
use crate::model::step_plan::{InputLayout, MAX_K_SPLITS};
use candle_core::cuda_backend::cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, result, sys,
};
use std::sync::Arc;

/// The step's kernels (`kernels.cu`), compiled and loaded once per step.
#[derive(Debug)]
pub(super) struct Kernels {
    pub(super) add_norm: CudaFunction,
    pub(super) silu_mul: CudaFunction,
    pub(super) rope_append: CudaFunction,
    pub(super) attend_parts: CudaFunction,
    pub(super) attend_parts_grouped: CudaFunction,
    pub(super) attend_combine: CudaFunction,
    pub(super) greedy: CudaFunction,
    pub(super) draw: CudaFunction,
    pub(super) propose: CudaFunction,
}

impl Kernels {
    pub(super) fn load(stream: &Arc<CudaStream>) -> Result<Self> {
        let module = load_module(stream, KERNELS, None, "step's kernels")?;
        let f = |name: &str| cu(module.load_function(name), name);
        Ok(Self {
            add_norm: f("duet_add_norm_q8")?,
            silu_mul: f("duet_silu_mul_q8")?,
            rope_append: f("duet_rope_append")?,
            attend_parts: f("duet_attend_parts")?,
            attend_parts_grouped: f("duet_attend_parts_grouped")?,
            attend_combine: f("duet_attend_combine_q8")?,
            greedy: f("duet_greedy")?,
            draw: f("duet_draw")?,
            propose: f("duet_propose")?,
        })
    }
}

/// The step's device buffers, each for [`MAX_ROWS`] rows.
#[derive(Debug)]
pub(super) struct Buffers {
    pub(super) inputs: CudaSlice<u8>,
    /// The residual stream `[rows, hidden]`.
    pub(super) x: CudaSlice<f32>,
    /// A normed row as the mat-vec kernels take it.
    pub(super) normed: CudaSlice<u8>,
    /// Each row's last normed hidden state, f32 (kept for callers that project it again).
    pub(super) hidden_out: CudaSlice<f32>,
    /// q, k and v as their launches write them (`step_plan::projection_launches`).
    pub(super) qkv: CudaSlice<f32>,
    pub(super) q_rotated: CudaSlice<f32>,
    /// Attention's parts over the keys (`duet_attend_parts`): `[rows, heads, parts,
    /// 2 + head_dim]`.
    pub(super) attn_parts: CudaSlice<f32>,
    pub(super) attn_q8: CudaSlice<u8>,
    pub(super) delta: CudaSlice<f32>,
    /// Gate and up as their launches write them.
    pub(super) gate_up: CudaSlice<f32>,
    pub(super) act_q8: CudaSlice<u8>,
    pub(super) logits: CudaSlice<f32>,
    /// Each logits row's greedy summary (index bits, maximum, sum), or the token drawn from
    /// it (`duet_draw`: token bits, probability, the excluded token's probability).
    pub(super) summaries: CudaSlice<f32>,
    /// The padding rows' cache: one position of keys and values per layer.
    pub(super) scratch_cache: CudaSlice<f32>,
    /// The parts of mat-vec rows split over blocks (`matvec::Partials`): up to
    /// `MAX_K_SPLITS` parts of `[rows, hidden]`.
    pub(super) partials: CudaSlice<f32>,
    /// For each row a draw is made from, a draft's distribution: the one the draft it
    /// corrects was drawn from, or the proposal a draft model's step draws from
    /// (`duet_propose`'s weights): up to `DRAFTED_MAX` ids, then as many f32s' bits.
    pub(super) drafted: CudaSlice<u32>,
}

impl Buffers {
    pub(super) fn new(
        stream: &Arc<CudaStream>,
        c: &ModelConfig,
        lm_rows: usize,
        inputs: usize,
    ) -> Result<Self> {
        let rows = MAX_ROWS;
        let (nq, nkv) = (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
        let f32s = |n: usize| cu(stream.alloc_zeros::<f32>(n), "allocating");
        let q8 = |k: usize| {
            cu(
                stream.alloc_zeros::<u8>(rows * row_blocks(k) * Q8_1_BYTES),
                "allocating",
            )
        };
        Ok(Self {
            inputs: cu(stream.alloc_zeros::<u8>(inputs), "allocating")?,
            x: f32s(rows * c.hidden)?,
            normed: q8(c.hidden)?,
            hidden_out: f32s(rows * c.hidden)?,
            qkv: f32s(rows * (nq + 2 * nkv))?,
            q_rotated: f32s(rows * nq)?,
            attn_parts: f32s(rows * c.n_heads * attn_shape().parts * (2 + c.head_dim))?,
            attn_q8: q8(nq)?,
            delta: f32s(rows * c.hidden)?,
            gate_up: f32s(rows * 2 * c.ffn_hidden)?,
            act_q8: q8(c.ffn_hidden)?,
            logits: f32s(rows * lm_rows)?,
            summaries: f32s(rows * 3)?,
            scratch_cache: f32s(c.n_layers * 2 * nkv)?,
            partials: f32s(partials_len(c))?,
            drafted: cu(
                stream.alloc_zeros::<u32>(rows * 2 * DRAFTED_MAX),
                "allocating",
            )?,
        })
    }
}

/// The f32 the `partials` buffer holds: `MAX_K_SPLITS` parts of `[MAX_ROWS, hidden]`.
pub(super) fn partials_len(c: &ModelConfig) -> usize {
    MAX_K_SPLITS * MAX_ROWS * c.hidden
}

/// The raw addresses one step's launches read and write.
#[derive(Debug, Clone, Copy)]
pub(super) struct Addrs {
    pub(super) tokens: u64,
    pub(super) positions: u64,
    pub(super) slots: u64,
    pub(super) prefixes: u64,
    pub(super) caches: u64,
    pub(super) paths: u64,
    pub(super) x: u64,
    pub(super) normed: u64,
    pub(super) hidden_out: u64,
    pub(super) qkv: u64,
    pub(super) q_rotated: u64,
    pub(super) attn_parts: u64,
    pub(super) attn_q8: u64,
    pub(super) delta: u64,
    pub(super) gate_up: u64,
    pub(super) act_q8: u64,
    pub(super) logits: u64,
    pub(super) summaries: u64,
    pub(super) scratch_cache: u64,
    pub(super) partials: u64,
    pub(super) drafted: u64,
}

impl Addrs {
    /// The addresses of `buffers`; the inputs' parts at their offsets in one buffer.
    pub(super) fn of(buffers: &Buffers, layout: &InputLayout, stream: &Arc<CudaStream>) -> Self {
        let ptr = |s: &CudaSlice<f32>| s.device_ptr(stream).0;
        let ptr8 = |s: &CudaSlice<u8>| s.device_ptr(stream).0;
        let inputs = ptr8(&buffers.inputs);
        Addrs {
            tokens: inputs + InputLayout::TOKENS as u64,
            positions: inputs + InputLayout::POSITIONS as u64,
            slots: inputs + InputLayout::SLOTS as u64,
            prefixes: inputs + InputLayout::PREFIXES as u64,
            caches: inputs + InputLayout::CACHES as u64,
            paths: inputs + layout.paths() as u64,
            x: ptr(&buffers.x),
            normed: ptr8(&buffers.normed),
            hidden_out: ptr(&buffers.hidden_out),
            qkv: ptr(&buffers.qkv),
            q_rotated: ptr(&buffers.q_rotated),
            attn_parts: ptr(&buffers.attn_parts),
            attn_q8: ptr8(&buffers.attn_q8),
            delta: ptr(&buffers.delta),
            gate_up: ptr(&buffers.gate_up),
            act_q8: ptr8(&buffers.act_q8),
            logits: ptr(&buffers.logits),
            summaries: ptr(&buffers.summaries),
            scratch_cache: ptr(&buffers.scratch_cache),
            partials: ptr(&buffers.partials),
            drafted: buffers.drafted.device_ptr(stream).0,
        }
    }
}

/// The step's stream, created and destroyed here rather than by cudarc (see the module
/// docs). It is the step's last field: the buffers before it free on it.
#[derive(Debug)]
pub(super) struct OwnedStream {
    pub(super) ctx: Arc<CudaContext>,
    pub(super) raw: sys::CUstream,
}

// SAFETY: a CUDA stream handle may be used from any thread; the step's lock serialises its
// uses, and the handle is destroyed once, on drop.
unsafe impl Send for OwnedStream {}

impl OwnedStream {
    pub(super) fn new(ctx: &Arc<CudaContext>) -> Result<(Self, Arc<CudaStream>)> {
        cu(ctx.bind_to_thread(), "binding the context")?;
        let raw = cu(
            result::stream::create(result::stream::StreamKind::NonBlocking),
            "creating a stream",
        )?;
        // SAFETY: `raw` is a stream of this context, alive until `OwnedStream` drops, after
        // everything that holds the wrapper (the step's other fields).
        let stream = unsafe { ctx.wrap_borrowed_stream(raw) };
        Ok((
            Self {
                ctx: ctx.clone(),
                raw,
            },
            stream,
        ))
    }
}

impl Drop for OwnedStream {
    fn drop(&mut self) {
        // SAFETY: the stream belongs to this live context; nothing uses it after this.
        unsafe {
            let _ = result::ctx::set_current(self.ctx.cu_ctx());
            let _ = result::stream::synchronize(self.raw);
            let _ = result::stream::destroy(self.raw);
        }
    }
}
