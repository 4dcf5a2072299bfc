//! What a step holds on the device: its kernels, its buffers and their addresses, and its
//! stream.

use super::launch::Kernel;
use super::{
    DRAFTED_MAX, KERNELS, LORA_MAX_RANK, MAX_ROWS, Q8_1_BYTES, Result, attn_shape, cu, load_module,
    row_blocks,
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
    add_norm: CudaFunction,
    silu_mul: CudaFunction,
    rope_append: CudaFunction,
    attend_parts: CudaFunction,
    attend_parts_grouped: CudaFunction,
    attend_combine: CudaFunction,
    greedy: CudaFunction,
    draw: CudaFunction,
    propose: CudaFunction,
    lora_shrink: CudaFunction,
    lora_expand: CudaFunction,
}

impl Kernels {
    pub(super) fn load(stream: &Arc<CudaStream>) -> Result<Self> {
        let module = load_module(stream, KERNELS, None, "step's kernels")?;
        let f = |kernel: Kernel| cu(module.load_function(&kernel.name()), &kernel.name());
        Ok(Self {
            add_norm: f(Kernel::AddNorm)?,
            silu_mul: f(Kernel::SiluMul)?,
            rope_append: f(Kernel::RopeAppend)?,
            attend_parts: f(Kernel::AttendParts)?,
            attend_parts_grouped: f(Kernel::AttendPartsGrouped)?,
            attend_combine: f(Kernel::AttendCombine)?,
            greedy: f(Kernel::Greedy)?,
            draw: f(Kernel::Draw)?,
            propose: f(Kernel::Propose)?,
            lora_shrink: f(Kernel::LoraShrink)?,
            lora_expand: f(Kernel::LoraExpand)?,
        })
    }

    /// A kernel's function (`None`: a mat-vec kernel, `matvec::Tiled`'s).
    pub(super) fn function(&self, kernel: Kernel) -> Option<&CudaFunction> {
        Some(match kernel {
            Kernel::AddNorm => &self.add_norm,
            Kernel::SiluMul => &self.silu_mul,
            Kernel::RopeAppend => &self.rope_append,
            Kernel::AttendParts => &self.attend_parts,
            Kernel::AttendPartsGrouped => &self.attend_parts_grouped,
            Kernel::AttendCombine => &self.attend_combine,
            Kernel::Greedy => &self.greedy,
            Kernel::Draw => &self.draw,
            Kernel::Propose => &self.propose,
            Kernel::LoraShrink => &self.lora_shrink,
            Kernel::LoraExpand => &self.lora_expand,
            Kernel::MatVec { .. } | Kernel::MatVecCombine => return None,
        })
    }
}

/// The step's device buffers (see [`Addrs`]), zeroed at first.
#[derive(Debug)]
pub(super) struct Buffers {
    _owned: Vec<CudaSlice<u8>>,
}

impl Buffers {
    /// The buffers of a step of `c` with `lm_rows` vocabulary rows, and their addresses.
    pub(super) fn new(
        stream: &Arc<CudaStream>,
        c: &ModelConfig,
        lm_rows: usize,
        layout: &InputLayout,
    ) -> Result<(Self, Addrs)> {
        let mut slices = Vec::new();
        let addrs = Addrs::new(c, lm_rows, layout, &mut |_, bytes| {
            let slice = cu(stream.alloc_zeros::<u8>(bytes), "allocating")?;
            let at = slice.device_ptr(stream).0;
            slices.push(slice);
            Ok(at)
        })?;
        Ok((Self { _owned: slices }, addrs))
    }
}

/// The f32 the `partials` buffer holds: `MAX_K_SPLITS` parts of `[MAX_ROWS, hidden]`.
pub(super) fn partials_len(c: &ModelConfig) -> usize {
    MAX_K_SPLITS * MAX_ROWS * c.hidden
}

/// The raw addresses one step's launches read and write, each buffer for [`MAX_ROWS`]
/// rows.
#[derive(Debug, Clone, Copy)]
pub(super) struct Addrs {
    /// The step's inputs ([`InputLayout`]), one buffer: its tokens, positions, cache slots,
    /// key prefixes, cache pointers and key tails.
    pub(super) tokens: u64,
    pub(super) positions: u64,
    pub(super) slots: u64,
    pub(super) prefixes: u64,
    /// Each row's adapter's table (`lora::Adapter::step_table`; 0: none).
    pub(super) adapters: u64,
    pub(super) caches: u64,
    pub(super) paths: u64,
    /// The residual stream `[rows, hidden]`.
    pub(super) x: u64,
    /// A normed row as the mat-vec kernels take it.
    pub(super) normed: u64,
    /// Each row's last normed hidden state, f32 (kept for callers that project it again).
    pub(super) hidden_out: u64,
    /// q, k and v as their launches write them (`step_plan::projection_launches`).
    pub(super) qkv: u64,
    pub(super) q_rotated: u64,
    /// Attention's parts over the keys (`duet_attend_parts`): `[rows, heads, parts,
    /// 2 + head_dim]`.
    pub(super) attn_parts: u64,
    pub(super) attn_q8: u64,
    pub(super) delta: u64,
    /// Gate and up as their launches write them.
    pub(super) gate_up: u64,
    pub(super) act_q8: u64,
    pub(super) logits: u64,
    /// Each logits row's greedy summary (index bits, maximum, sum), or the token drawn from
    /// it (`duet_draw`: token bits, probability, the excluded token's probability).
    pub(super) summaries: u64,
    /// The padding rows' cache: one position of keys and values per layer.
    pub(super) scratch_cache: u64,
    /// The parts of mat-vec rows split over blocks (`matvec::Partials`): up to
    /// `MAX_K_SPLITS` parts of `[rows, hidden]`.
    pub(super) partials: u64,
    /// For each row a draw is made from, a draft's distribution: the one the draft it
    /// corrects was drawn from, or the proposal a draft model's step draws from
    /// (`duet_propose`'s weights): up to `DRAFTED_MAX` ids, then as many f32s' bits.
    pub(super) drafted: u64,
    /// Each row's `scale · x A^T` for up to 3 projections of an input (`duet_lora_shrink`):
    /// `[rows, 3, LORA_MAX_RANK]`.
    pub(super) lora_t: u64,
}

impl Addrs {
    /// The step's buffers for `c` with `lm_rows` vocabulary rows, each from `alloc`
    /// (its name and bytes; its address); the inputs' parts at their offsets in one.
    pub(super) fn new(
        c: &ModelConfig,
        lm_rows: usize,
        layout: &InputLayout,
        alloc: &mut impl FnMut(&str, usize) -> Result<u64>,
    ) -> Result<Self> {
        let rows = MAX_ROWS;
        let (nq, nkv) = (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
        let inputs = alloc("inputs", layout.bytes())?;
        // Buffers of f32 (and `drafted`'s u32).
        let mut f32s = |name: &str, n: usize| alloc(name, n * 4);
        let parts = rows * c.n_heads * attn_shape().parts * (2 + c.head_dim);
        let mut addrs = Addrs {
            tokens: inputs + InputLayout::TOKENS as u64,
            positions: inputs + InputLayout::POSITIONS as u64,
            slots: inputs + InputLayout::SLOTS as u64,
            prefixes: inputs + InputLayout::PREFIXES as u64,
            adapters: inputs + InputLayout::ADAPTERS as u64,
            caches: inputs + InputLayout::CACHES as u64,
            paths: inputs + layout.paths() as u64,
            x: f32s("x", rows * c.hidden)?,
            normed: 0,
            hidden_out: f32s("hidden_out", rows * c.hidden)?,
            qkv: f32s("qkv", rows * (nq + 2 * nkv))?,
            q_rotated: f32s("q_rotated", rows * nq)?,
            attn_parts: f32s("attn_parts", parts)?,
            attn_q8: 0,
            delta: f32s("delta", rows * c.hidden)?,
            gate_up: f32s("gate_up", rows * 2 * c.ffn_hidden)?,
            act_q8: 0,
            logits: f32s("logits", rows * lm_rows)?,
            summaries: f32s("summaries", rows * 3)?,
            scratch_cache: f32s("scratch_cache", c.n_layers * 2 * nkv)?,
            partials: f32s("partials", partials_len(c))?,
            drafted: f32s("drafted", rows * 2 * DRAFTED_MAX)?,
            lora_t: f32s("lora_t", rows * 3 * LORA_MAX_RANK)?,
        };
        let mut q8 = |name: &str, k: usize| alloc(name, rows * row_blocks(k) * Q8_1_BYTES);
        addrs.normed = q8("normed", c.hidden)?;
        addrs.attn_q8 = q8("attn_q8", nq)?;
        addrs.act_q8 = q8("act_q8", c.ffn_hidden)?;
        Ok(addrs)
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
