//! The step's launches, in the order of one forward pass, and each kernel's launcher.

use super::resources::partials_len;
use super::{
    ATTN_THREADS, CudaStep, DRAFTED_MAX, GREEDY_THREADS, LayerPtrs, MATVEC_ROWS, MatVecWeight,
    NORM_THREADS, Q8_1_BYTES, Result, cu, row_blocks,
};
use crate::model::step_plan::ATTN_GROUP_MAX;
use crate::sampling::SamplingParams;
use crate::sampling::{Draw, PROPOSAL_TAIL};
use candle_core::cuda_backend::cudarc::driver::{LaunchArgs, LaunchConfig, PushKernelArg, result};
use std::ffi::c_void;

/// One block of `GREEDY_THREADS`: a drawn row's launch.
const ONE_BLOCK: LaunchConfig = LaunchConfig {
    grid_dim: (1, 1, 1),
    block_dim: (GREEDY_THREADS, 1, 1),
    shared_mem_bytes: 0,
};

/// The step's launches, in the order of one forward pass.
impl CudaStep {
    pub(super) fn enqueue_layers(&self, bucket: usize) -> Result<()> {
        let a = self.addrs;
        for (index, layer) in self.layers.iter().enumerate() {
            let residual = if index == 0 { 0 } else { a.delta };
            self.add_norm(bucket, residual, layer.attn_norm, 0)?;
            for (weight, output) in &layer.qkv.launches {
                self.mat_vec(weight, a.normed, *output, bucket)?;
            }
            self.rope_append(bucket, index, layer)?;
            self.attend(bucket, index)?;
            self.mat_vec(&layer.o, a.attn_q8, a.delta, bucket)?;
            self.add_norm(bucket, a.delta, layer.ffn_norm, 0)?;
            for (weight, output) in &layer.gate_up.launches {
                self.mat_vec(weight, a.normed, *output, bucket)?;
            }
            self.silu_mul(bucket, &layer.gate_up.outs)?;
            self.mat_vec(&layer.down, a.act_q8, a.delta, bucket)?;
        }
        self.add_norm(bucket, a.delta, self.output_norm, a.hidden_out)
    }

    /// `output = input W^T` for `rows` rows of Q8_1 input: the tiled kernel in one launch
    /// where the step has it, else candle's at most [`MATVEC_ROWS`] rows a launch.
    pub(super) fn mat_vec(
        &self,
        w: &MatVecWeight,
        input: u64,
        output: u64,
        rows: usize,
    ) -> Result<()> {
        let blocks = row_blocks(w.k);
        if let Some(tiled) = &self.tiled {
            let partials = (self.addrs.partials, partials_len(&self.config));
            return tiled.launch(
                &self.stream,
                w.dtype,
                [w.ptr, input, output],
                (w.n, w.k),
                rows,
                blocks,
                Some(partials),
            );
        }
        for first in (0..rows).step_by(MATVEC_ROWS) {
            let count = MATVEC_ROWS.min(rows - first);
            // SAFETY: the weight is `n x k` as loaded by candle; the input holds `rows` rows
            // of `blocks` Q8_1 blocks and the output `rows` rows of `n` f32, all device
            // buffers that outlive the launch (or the graph it is captured into).
            unsafe {
                (w.launch)(
                    w.ptr as *const c_void,
                    (input + (first * blocks * Q8_1_BYTES) as u64) as *const c_void,
                    (output + (first * w.n * 4) as u64) as *mut c_void,
                    w.k as i32,
                    w.n as i32,
                    blocks as i32,
                    w.n as i32,
                    count as i32,
                    self.stream.cu_stream() as *mut c_void,
                );
            }
        }
        Ok(())
    }

    /// `x += residual` (when not 0), then the norm of `x` by `weight` into the normed
    /// buffer (and as f32 into `f32_out` when not 0).
    fn add_norm(&self, rows: usize, residual: u64, weight: u64, f32_out: u64) -> Result<()> {
        let n = self.config.hidden as i32;
        let blocks = row_blocks(self.config.hidden) as i32;
        let eps = self.config.rms_eps as f32;
        let mut launch = self.stream.launch_builder(&self.kernels.add_norm);
        launch
            .arg(&self.addrs.x)
            .arg(&residual)
            .arg(&weight)
            .arg(&self.addrs.normed)
            .arg(&f32_out)
            .arg(&n)
            .arg(&blocks)
            .arg(&eps);
        let config = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (NORM_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match `duet_add_norm_q8`; every buffer holds `rows` rows.
        cu(unsafe { launch.launch(config) }.map(drop), "add_norm")
    }

    /// A grid of a warp per Q8_1 block of `n` values a row, eight warps a block.
    fn per_block(rows: usize, n: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: ((n / 32).div_ceil(8) as u32, rows as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// SiLU(gate) * up into the down projection's Q8_1 input; `[gate, up]`: where each
    /// sits (address, row stride).
    fn silu_mul(&self, rows: usize, [gate, up]: &[(u64, i32); 2]) -> Result<()> {
        let n = self.config.ffn_hidden;
        let (n_i, blocks) = (n as i32, row_blocks(n) as i32);
        let mut launch = self.stream.launch_builder(&self.kernels.silu_mul);
        launch.arg(&gate.0).arg(&up.0).arg(&self.addrs.act_q8);
        launch.arg(&n_i).arg(&blocks).arg(&gate.1).arg(&up.1);
        // SAFETY: the arguments match `duet_silu_mul_q8`; gate and up hold `rows` rows of
        // `n` values at their strides, the output as many rows of Q8_1 blocks.
        let launched = unsafe { launch.launch(Self::per_block(rows, n)) };
        cu(launched.map(drop), "silu_mul")
    }

    /// The layer and the attention shape as the rotary and attention kernels take them:
    /// `[layer, layers, heads, kv_heads, head_dim]`.
    fn head_args(&self, layer: usize) -> [i32; 5] {
        let c = &self.config;
        [layer, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim].map(|x| x as i32)
    }

    fn rope_append(&self, rows: usize, layer: usize, ptrs: &LayerPtrs) -> Result<()> {
        let c = &self.config;
        let a = &self.addrs;
        let [layer, layers, heads, kv_heads, hd] = self.head_args(layer);
        let interleaved = c.architecture.interleaved_rope() as i32;
        let mut launch = self.stream.launch_builder(&self.kernels.rope_append);
        let [q, k, v] = &ptrs.qkv.outs;
        launch.arg(&q.0).arg(&k.0).arg(&v.0);
        launch
            .arg(&ptrs.qkv.biases[0])
            .arg(&ptrs.qkv.biases[1])
            .arg(&ptrs.qkv.biases[2]);
        launch
            .arg(&self.cos)
            .arg(&self.sin)
            .arg(&a.positions)
            .arg(&a.slots)
            .arg(&a.caches);
        launch.arg(&layer).arg(&layers).arg(&a.q_rotated);
        launch.arg(&heads).arg(&kv_heads).arg(&hd).arg(&interleaved);
        launch.arg(&q.1).arg(&k.1).arg(&v.1);
        let eps = c.rms_eps as f32;
        let [q_norm, k_norm] = &ptrs.head_norms;
        launch.arg(q_norm).arg(k_norm).arg(&eps);
        let config = LaunchConfig {
            grid_dim: ((c.n_heads + c.n_kv_heads) as u32, rows as u32, 1),
            block_dim: ((c.head_dim / 2) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match `duet_rope_append`; the slots lie in each row's cache
        // (checked by the caller before the pass) or at 0 of the scratch cache.
        cu(unsafe { launch.launch(config) }.map(drop), "rope_append")
    }

    /// Attention, split over the keys (`duet_attend_parts`, or by groups of query heads
    /// `duet_attend_parts_grouped`, then `duet_attend_combine_q8`, which writes the output
    /// projection's Q8_1 input).
    fn attend(&self, rows: usize, layer: usize) -> Result<()> {
        let c = &self.config;
        let a = &self.addrs;
        let [layer, layers, heads, kv_heads, hd] = self.head_args(layer);
        let scale = 1.0 / (c.head_dim as f32).sqrt();
        let shape = super::attn_shape();
        let grouped = shape.grouped && c.n_heads / c.n_kv_heads <= ATTN_GROUP_MAX;
        let (kernel, blocks) = match grouped {
            true => (&self.kernels.attend_parts_grouped, c.n_kv_heads),
            false => (&self.kernels.attend_parts, c.n_heads),
        };
        let config = LaunchConfig {
            grid_dim: (blocks as u32, rows as u32, shape.parts as u32),
            block_dim: (ATTN_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = self.stream.launch_builder(kernel);
        launch.arg(&a.q_rotated).arg(&a.caches).arg(&a.positions);
        launch.arg(&a.prefixes).arg(&a.paths);
        launch.arg(&layer).arg(&layers).arg(&a.attn_parts);
        launch.arg(&heads).arg(&kv_heads).arg(&hd).arg(&scale);
        // SAFETY: the arguments match `duet_attend_parts` and `duet_attend_parts_grouped`
        // (the same); each row's cache holds the rows its prefix and key tail name (slots
        // written by this pass or before it), and the parts buffer holds MAX_ROWS rows'
        // parts; a group holds at most ATTN_GROUP_MAX heads.
        cu(unsafe { launch.launch(config) }.map(drop), "attend parts")?;
        let nq = c.n_heads * c.head_dim;
        let (nq_i, blocks) = (nq as i32, row_blocks(nq) as i32);
        let mut launch = self.stream.launch_builder(&self.kernels.attend_combine);
        launch.arg(&a.attn_parts).arg(&a.positions).arg(&a.attn_q8);
        launch.arg(&nq_i).arg(&blocks).arg(&heads).arg(&hd);
        // SAFETY: the arguments match `duet_attend_combine_q8`; it reads the parts the
        // launch before wrote for the same rows and writes their Q8_1 blocks.
        let launched = unsafe { launch.launch(Self::per_block(rows, nq)) };
        cu(launched.map(drop), "attend combine")
    }

    /// `duet_greedy` over the first `rows` rows of the logits buffer.
    pub(super) fn summarise(&self, rows: usize) -> Result<()> {
        let n = self.lm_head.n as i32;
        let mut launch = self.stream.launch_builder(&self.kernels.greedy);
        launch
            .arg(&self.addrs.logits)
            .arg(&n)
            .arg(&self.addrs.summaries);
        let config = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (GREEDY_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match `duet_greedy`; the logits buffer holds `rows` rows of
        // `n`, the summaries buffer 3 f32 a row for up to MAX_ROWS rows.
        cu(unsafe { launch.launch(config) }.map(drop), "greedy")
    }

    /// `duet_propose` from logits row `row`: how many tokens its proposal keeps into the
    /// row's place in the summaries buffer, their ids and weights into its place in the
    /// `drafted` buffer.
    pub(super) fn propose(&self, row: usize, draw: &Draw) -> Result<()> {
        let args = propose_args(self.drawing_row(row), self.lm_head.n, &draw.params);
        let mut launch = self.stream.launch_builder(&self.kernels.propose);
        push(&mut launch, &args);
        // SAFETY: the arguments match `duet_propose`; the logits buffer holds row `row` of
        // `n`, the summaries buffer 3 f32 a row and the drafted buffer DRAFTED_MAX ids and
        // as many f32 a row, for up to MAX_ROWS rows.
        cu(unsafe { launch.launch(ONE_BLOCK) }.map(drop), "proposal")
    }

    /// Where a drawn row's launches read and write: its logits, its place in the summaries
    /// buffer, and its places for a draft distribution's ids and values in the `drafted`
    /// buffer.
    pub(super) fn drawing_row(&self, row: usize) -> [u64; 4] {
        let slot = self.addrs.drafted + (row * 2 * DRAFTED_MAX * 4) as u64;
        [
            self.addrs.logits + (row * self.lm_head.n * 4) as u64,
            self.addrs.summaries + (row * 3 * 4) as u64,
            slot,
            slot + (DRAFTED_MAX * 4) as u64,
        ]
    }

    /// `duet_draw` from logits row `row` into that row's place in the summaries buffer
    /// (token bits, probability, the excluded token's probability); a draft model's draft
    /// it corrects with the distribution that draft was drawn from, copied first into the
    /// row's place in the `drafted` buffer.
    pub(super) fn draw(&self, row: usize, draw: &Draw) -> Result<()> {
        let [logits, out, ids, probs] = self.drawing_row(row);
        let drafted = draw.excluded().and_then(|x| x.from.as_deref());
        if let Some(q) = drafted {
            let stream = self.stream.cu_stream();
            // SAFETY (both copies): a row's place holds DRAFTED_MAX ids and as many
            // probabilities, `pass_rows` gives the GPU draws of drafts from at most as many
            // tokens, and `q` outlives the copies (the pass waits for its stream).
            cu(
                unsafe { result::memcpy_htod_async(ids, q.ids(), stream) },
                "copying a draft's distribution",
            )?;
            cu(
                unsafe { result::memcpy_htod_async(probs, q.probs(), stream) },
                "copying a draft's distribution",
            )?;
        }
        let args = draw_args([logits, out, ids, probs], self.lm_head.n, draw);
        let mut launch = self.stream.launch_builder(&self.kernels.draw);
        push(&mut launch, &args);
        // SAFETY: the arguments match `duet_draw`; the logits buffer holds row `row` of `n`,
        // the summaries buffer 3 f32 a row for up to MAX_ROWS rows, the drafted buffer the
        // row's `drafted_len` ids and probabilities.
        cu(unsafe { launch.launch(ONE_BLOCK) }.map(drop), "draw")
    }
}

/// A kernel argument as a launch pushes it: a device address or a number. The draw
/// launches build theirs as a list ([`draw_args`], [`propose_args`]) that the CPU's tests
/// launch too (`on_cpu::draws`), so the order they test is the order the GPU gets.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Arg {
    Ptr(u64),
    I32(i32),
    F32(f32),
    F64(f64),
}

/// Pushes `args` onto a launch, in order.
fn push<'a>(launch: &mut LaunchArgs<'a>, args: &'a [Arg]) {
    for arg in args {
        match arg {
            Arg::Ptr(v) => launch.arg(v),
            Arg::I32(v) => launch.arg(v),
            Arg::F32(v) => launch.arg(v),
            Arg::F64(v) => launch.arg(v),
        };
    }
}

/// A sampling setting's arguments, as the draw kernels take them after the row and its
/// length: temperature, `min_p`, `top_k` (at most `i32::MAX`), `top_p`.
fn settings(p: &SamplingParams) -> [Arg; 4] {
    let top_k = p.top_k.min(i32::MAX as usize) as i32;
    [
        Arg::F32(p.temperature),
        Arg::F32(p.min_p),
        Arg::I32(top_k),
        Arg::F32(p.top_p),
    ]
}

/// `duet_draw`'s arguments for a row of `n` logits (`[logits, out, q_ids, q_probs]`:
/// where the row's launch reads and writes, [`CudaStep::drawing_row`]'s): the row, the
/// settings, the uniform, the draft left out (-1: none) and the distribution it was drawn
/// from (none: a point mass), the output.
pub(super) fn draw_args([logits, out, ids, probs]: [u64; 4], n: usize, draw: &Draw) -> [Arg; 12] {
    let [t, min_p, top_k, top_p] = settings(&draw.params);
    let exclude = draw.excluded().map_or(-1, |x| x.token as i32);
    let drafted = draw.excluded().and_then(|x| x.from.as_deref());
    let drafted_len = drafted.map_or(0, |q| q.ids().len() as i32);
    [
        Arg::Ptr(logits),
        Arg::I32(n as i32),
        t,
        min_p,
        top_k,
        top_p,
        Arg::F64(draw.uniform),
        Arg::I32(exclude),
        Arg::Ptr(ids),
        Arg::Ptr(probs),
        Arg::I32(drafted_len),
        Arg::Ptr(out),
    ]
}

/// `duet_propose`'s arguments for a row of `n` logits (`[logits, out, ids, weights]`, as
/// [`draw_args`]'s): the row, the settings, the tail's share, where the kept tokens go and
/// how many fit ([`DRAFTED_MAX`]), the output.
pub(super) fn propose_args(
    [logits, out, ids, weights]: [u64; 4],
    n: usize,
    p: &SamplingParams,
) -> [Arg; 11] {
    let [t, min_p, top_k, top_p] = settings(p);
    [
        Arg::Ptr(logits),
        Arg::I32(n as i32),
        t,
        min_p,
        top_k,
        top_p,
        Arg::F64(PROPOSAL_TAIL),
        Arg::Ptr(ids),
        Arg::Ptr(weights),
        Arg::I32(DRAFTED_MAX as i32),
        Arg::Ptr(out),
    ]
}
