//! The step's launches as data, in the order of one forward pass ([`StepPtrs`]' builders),
//! and their running on a stream. The CPU's tests (`on_cpu`) run the same lists on the
//! kernels' sources built for the CPU, with their buffers at the addresses the lists name,
//! so what they hold to the host's arithmetic is what the GPU is given: each kernel, grid,
//! argument and address.

use super::matvec::Family;
use super::resources::partials_len;
use super::{
    ATTN_THREADS, CudaStep, DRAFTED_MAX, GREEDY_THREADS, LORA_RANK_BLOCKS, LORA_THREADS, LayerPtrs,
    MATVEC_ROWS, MatVecWeight, NORM_THREADS, Q8_1_BYTES, Result, StepPtrs, cu, row_blocks,
};
use crate::model::cuda::{MatVec, type_name};
use crate::model::lora::Module;
use crate::model::step_plan::{self, ATTN_GROUP_MAX};
use crate::sampling::SamplingParams;
use crate::sampling::{Draw, PROPOSAL_TAIL};
use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaStream, LaunchArgs, LaunchConfig, PushKernelArg, result,
};
use candle_core::quantized::GgmlDType;
use std::ffi::c_void;
use std::sync::Arc;

/// One of our kernels (`kernels.cu`'s, `matvec.cu`'s).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Kernel {
    AddNorm,
    SiluMul,
    RopeAppend,
    AttendParts,
    AttendPartsGrouped,
    AttendCombine,
    Greedy,
    Draw,
    Propose,
    LoraShrink,
    LoraExpand,
    /// The mat-vec of a weight type and family; `size`: the tensor cores' tiles a block,
    /// the few-row form's rows a tile (else 0).
    MatVec {
        dtype: GgmlDType,
        family: Family,
        size: usize,
    },
    /// The adding of a split row's parts.
    MatVecCombine,
}

impl Kernel {
    /// The kernel's name in its source.
    pub(super) fn name(self) -> String {
        let name = match self {
            Self::AddNorm => "duet_add_norm_q8",
            Self::SiluMul => "duet_silu_mul_q8",
            Self::RopeAppend => "duet_rope_append",
            Self::AttendParts => "duet_attend_parts",
            Self::AttendPartsGrouped => "duet_attend_parts_grouped",
            Self::AttendCombine => "duet_attend_combine_q8",
            Self::Greedy => "duet_greedy",
            Self::Draw => "duet_draw",
            Self::Propose => "duet_propose",
            Self::LoraShrink => "duet_lora_shrink",
            Self::LoraExpand => "duet_lora_expand",
            Self::MatVecCombine => "duet_matvec_combine",
            Self::MatVec {
                dtype,
                family,
                size,
            } => {
                let Some(dtype) = type_name(dtype) else {
                    return format!("duet_matvec_{dtype:?}");
                };
                let family = match family {
                    Family::Narrow => String::new(),
                    Family::Wide => "_x4".into(),
                    Family::Mma => format!("_mma{size}"),
                    Family::Few => format!("_few{size}"),
                };
                return format!("duet_matvec_{dtype}{family}");
            }
        };
        name.into()
    }
}

/// A launch of the step.
#[derive(Debug, Clone)]
pub(super) enum Launch {
    /// One of our kernels over `config`'s grid with `args`, in its parameters' order.
    Ours {
        kernel: Kernel,
        config: LaunchConfig,
        args: Vec<Arg>,
    },
    /// candle's mat-vec kernel for `weight` over `rows` rows (at most [`MATVEC_ROWS`]) of
    /// Q8_1 input at `input`, into `output`.
    Candle {
        weight: MatVecWeight,
        input: u64,
        output: u64,
        rows: usize,
    },
}

impl Launch {
    /// One of our kernels' launches: the kernel, its grid and its arguments (`None`:
    /// candle's mat-vec).
    pub(super) fn ours(&self) -> Option<(Kernel, LaunchConfig, &[Arg])> {
        match self {
            Self::Ours {
                kernel,
                config,
                args,
            } => Some((*kernel, *config, args)),
            Self::Candle { .. } => None,
        }
    }

    /// candle's mat-vec launch as its launcher takes it (`cuda::MatVec`, the stream
    /// after): the weight, input and output addresses, then `k`, `n`, the input's row
    /// stride in Q8_1 blocks, the output's in f32, the rows (`None`: one of ours).
    pub(super) fn candle(&self) -> Option<(MatVec, [u64; 3], [i32; 5])> {
        let Self::Candle {
            weight: w,
            input,
            output,
            rows,
        } = self
        else {
            return None;
        };
        let ints = [w.k, w.n, row_blocks(w.k), w.n, *rows].map(|x| x as i32);
        Some((w.launch, [w.ptr, *input, *output], ints))
    }
}

/// A kernel argument as a launch pushes it: a device address or a number.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Arg {
    Ptr(u64),
    I32(i32),
    F32(f32),
    F64(f64),
}

/// `n` as a kernel's `int` argument.
fn int(n: usize) -> Arg {
    Arg::I32(n as i32)
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

/// Launches `f` (`kernel`'s function) on `stream` over `config`'s grid with `args`.
pub(super) fn launch_kernel(
    stream: &Arc<CudaStream>,
    f: &CudaFunction,
    kernel: Kernel,
    config: LaunchConfig,
    args: &[Arg],
) -> Result<()> {
    let mut launch = stream.launch_builder(f);
    push(&mut launch, args);
    // SAFETY: `args` are what `kernel`'s parameters take, in order, as [`StepPtrs`]' and
    // `matvec::Choice`'s builders make them (the CPU's tests launch the same lists on the
    // kernels' sources: `on_cpu`); each address is of a device buffer that holds what the
    // kernel reads and writes over `config`'s grid and outlives the launch (or the graph it
    // is captured into).
    let launched = unsafe { launch.launch(config) };
    // The kernel's name only where the launch failed: a name is a string built a launch.
    launched.map(drop).map_err(|e| {
        let what = format!("cuda step, {}: {e}", kernel.name());
        candle_core::Error::Msg(what).into()
    })
}

/// A grid of `blocks` blocks of `threads` threads without dynamic shared memory.
pub(super) fn grid(blocks: (u32, u32, u32), threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: blocks,
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// `kernel` over `config` with `args`.
fn launch_of(kernel: Kernel, config: LaunchConfig, args: Vec<Arg>) -> Launch {
    Launch::Ours {
        kernel,
        config,
        args,
    }
}

/// A grid of a warp per Q8_1 block of `n` values a row, eight warps a block.
fn per_block(rows: usize, n: usize) -> LaunchConfig {
    grid(((n / 32).div_ceil(8) as u32, rows as u32, 1), 256)
}

/// The step's launches, in the order of one forward pass.
impl StepPtrs {
    /// The layers' launches for `bucket` rows, ending with the output norm; with `lora`,
    /// each projection's output gets the deltas of its rows' adapters added
    /// ([`StepPtrs::lora`]).
    pub(super) fn layer_launches(&self, bucket: usize, lora: bool) -> Vec<Launch> {
        let (a, c) = (&self.addrs, &self.config);
        let (nq, nkv) = (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
        let mut out = Vec::new();
        for (index, layer) in self.layers.iter().enumerate() {
            let deltas = |first: Module, input, k, outs: &[_], out: &mut Vec<Launch>| {
                if lora {
                    out.extend(self.lora(bucket, [index, first as usize], input, k, outs));
                }
            };
            let residual = if index == 0 { 0 } else { a.delta };
            out.push(self.add_norm(bucket, residual, layer.attn_norm, 0));
            for (weight, output) in &layer.qkv.launches {
                self.mat_vec(weight, [a.normed, *output], bucket, &mut out);
            }
            let [q, k, v] = layer.qkv.outs;
            let qkv = [(q.0, q.1, nq), (k.0, k.1, nkv), (v.0, v.1, nkv)];
            deltas(Module::Q, a.normed, c.hidden, &qkv, &mut out);
            out.push(self.rope_append(bucket, index, layer));
            out.extend(self.attend(bucket, index));
            self.mat_vec(&layer.o, [a.attn_q8, a.delta], bucket, &mut out);
            let into_delta = [(a.delta, c.hidden as i32, c.hidden)];
            deltas(Module::O, a.attn_q8, nq, &into_delta, &mut out);
            out.push(self.add_norm(bucket, a.delta, layer.ffn_norm, 0));
            for (weight, output) in &layer.gate_up.launches {
                self.mat_vec(weight, [a.normed, *output], bucket, &mut out);
            }
            let [gate, up] = layer.gate_up.outs;
            let gate_up = [(gate.0, gate.1, c.ffn_hidden), (up.0, up.1, c.ffn_hidden)];
            deltas(Module::Gate, a.normed, c.hidden, &gate_up, &mut out);
            out.push(self.silu_mul(bucket, &layer.gate_up.outs));
            self.mat_vec(&layer.down, [a.act_q8, a.delta], bucket, &mut out);
            deltas(Module::Down, a.act_q8, c.ffn_hidden, &into_delta, &mut out);
        }
        out.push(self.add_norm(bucket, a.delta, self.output_norm, a.hidden_out));
        out
    }

    /// The LoRA deltas of the projections from `first` of `layer` (`[layer, first]`, in
    /// `lora::Module`'s order), which share a Q8_1 input of `k` values at `input`: each
    /// adapted row's `scale · x A^T` (`duet_lora_shrink`), then its `t B^T` added to each
    /// projection's outputs (`outs`: address, row stride, width; `duet_lora_expand`).
    fn lora(
        &self,
        rows: usize,
        [layer, first]: [usize; 2],
        input: u64,
        k: usize,
        outs: &[(u64, i32, usize)],
    ) -> [Launch; 2] {
        let a = &self.addrs;
        let shrink = vec![
            Arg::Ptr(input),
            int(k),
            int(row_blocks(k)),
            Arg::Ptr(a.adapters),
            int(layer),
            int(first),
            Arg::Ptr(a.lora_t),
        ];
        let mut expand = vec![
            Arg::Ptr(a.lora_t),
            Arg::Ptr(a.adapters),
            int(layer),
            int(first),
            int(outs.len()),
        ];
        for i in 0..3 {
            let (at, stride, n) = outs.get(i).copied().unwrap_or((0, 0, 0));
            expand.extend([Arg::Ptr(at), int(n), Arg::I32(stride)]);
        }
        let width: usize = outs.iter().map(|o| o.2).sum();
        let blocks = (rows as u32, outs.len() as u32, LORA_RANK_BLOCKS);
        let columns = width.div_ceil(LORA_THREADS as usize) as u32;
        [
            launch_of(Kernel::LoraShrink, grid(blocks, LORA_THREADS), shrink),
            launch_of(
                Kernel::LoraExpand,
                grid((columns, rows as u32, 1), LORA_THREADS),
                expand,
            ),
        ]
    }

    /// The vocabulary projection of the rows `wanted` marks, into consecutive rows of the
    /// logits buffer; and how many rows it wrote.
    pub(super) fn logits_launches(&self, wanted: &[bool]) -> (Vec<Launch>, usize) {
        let blocks = row_blocks(self.lm_head.k);
        let per_launch = match self.matvec {
            Some(_) => step_plan::MAX_ROWS,
            None => MATVEC_ROWS,
        };
        let (mut out, mut at) = (Vec::new(), 0);
        for (first, rows) in step_plan::logits_launches(wanted, per_launch) {
            let input = self.addrs.normed + (first * blocks * Q8_1_BYTES) as u64;
            let output = self.addrs.logits + (at * self.lm_head.n * 4) as u64;
            self.mat_vec(&self.lm_head, [input, output], rows, &mut out);
            at += rows;
        }
        (out, at)
    }

    /// `output = input W^T` for `rows` rows of Q8_1 input: the tiled kernels in one launch
    /// (two where a row splits into parts) where the step has them, else candle's at most
    /// [`MATVEC_ROWS`] rows a launch.
    fn mat_vec(
        &self,
        w: &MatVecWeight,
        [input, output]: [u64; 2],
        rows: usize,
        out: &mut Vec<Launch>,
    ) {
        let blocks = row_blocks(w.k);
        if let Some(choice) = &self.matvec {
            let partials = (self.addrs.partials, partials_len(&self.config));
            let ptrs = [w.ptr, input, output];
            out.extend(choice.launches(w.dtype, ptrs, (w.n, w.k), rows, blocks, Some(partials)));
            return;
        }
        for first in (0..rows).step_by(MATVEC_ROWS) {
            out.push(Launch::Candle {
                weight: *w,
                input: input + (first * blocks * Q8_1_BYTES) as u64,
                output: output + (first * w.n * 4) as u64,
                rows: MATVEC_ROWS.min(rows - first),
            });
        }
    }

    /// `x += residual` (when not 0), then the norm of `x` by `weight` into the normed
    /// buffer (and as f32 into `f32_out` when not 0).
    fn add_norm(&self, rows: usize, residual: u64, weight: u64, f32_out: u64) -> Launch {
        let (a, n) = (&self.addrs, self.config.hidden);
        let eps = Arg::F32(self.config.rms_eps as f32);
        let args = vec![
            Arg::Ptr(a.x),
            Arg::Ptr(residual),
            Arg::Ptr(weight),
            Arg::Ptr(a.normed),
            Arg::Ptr(f32_out),
            int(n),
            int(row_blocks(n)),
            eps,
        ];
        launch_of(
            Kernel::AddNorm,
            grid((rows as u32, 1, 1), NORM_THREADS),
            args,
        )
    }

    /// SiLU(gate) * up into the down projection's Q8_1 input; `[gate, up]`: where each
    /// sits (address, row stride).
    fn silu_mul(&self, rows: usize, [gate, up]: &[(u64, i32); 2]) -> Launch {
        let n = self.config.ffn_hidden;
        let args = vec![
            Arg::Ptr(gate.0),
            Arg::Ptr(up.0),
            Arg::Ptr(self.addrs.act_q8),
            int(n),
            int(row_blocks(n)),
            Arg::I32(gate.1),
            Arg::I32(up.1),
        ];
        launch_of(Kernel::SiluMul, per_block(rows, n), args)
    }

    /// The layer and the attention shape as the rotary and attention kernels take them:
    /// `[layer, layers, heads, kv_heads, head_dim]`.
    fn head_args(&self, layer: usize) -> [Arg; 5] {
        let c = &self.config;
        [layer, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim].map(int)
    }

    /// The rotary embedding of q and k (after their biases, or their heads' norms), q
    /// into the rotated buffer, k and v appended to each row's cache at its slot.
    fn rope_append(&self, rows: usize, layer: usize, ptrs: &LayerPtrs) -> Launch {
        let (c, a) = (&self.config, &self.addrs);
        let [layer, layers, heads, kv_heads, hd] = self.head_args(layer);
        let [q, k, v] = ptrs.qkv.outs;
        let [q_bias, k_bias, v_bias] = ptrs.qkv.biases;
        let [q_norm, k_norm] = ptrs.head_norms;
        let interleaved = c.architecture.interleaved_rope() as usize;
        let args = vec![
            Arg::Ptr(q.0),
            Arg::Ptr(k.0),
            Arg::Ptr(v.0),
            Arg::Ptr(q_bias),
            Arg::Ptr(k_bias),
            Arg::Ptr(v_bias),
            Arg::Ptr(self.cos),
            Arg::Ptr(self.sin),
            Arg::Ptr(a.positions),
            Arg::Ptr(a.slots),
            Arg::Ptr(a.caches),
            layer,
            layers,
            Arg::Ptr(a.q_rotated),
            heads,
            kv_heads,
            hd,
            int(interleaved),
            Arg::I32(q.1),
            Arg::I32(k.1),
            Arg::I32(v.1),
            Arg::Ptr(q_norm),
            Arg::Ptr(k_norm),
            Arg::F32(c.rms_eps as f32),
        ];
        let blocks = ((c.n_heads + c.n_kv_heads) as u32, rows as u32, 1);
        launch_of(
            Kernel::RopeAppend,
            grid(blocks, (c.head_dim / 2) as u32),
            args,
        )
    }

    /// Attention, split over the keys (`duet_attend_parts`, or by groups of query heads
    /// `duet_attend_parts_grouped`), then `duet_attend_combine_q8`, which writes the output
    /// projection's Q8_1 input.
    fn attend(&self, rows: usize, layer: usize) -> [Launch; 2] {
        let (c, a) = (&self.config, &self.addrs);
        let [layer, layers, heads, kv_heads, hd] = self.head_args(layer);
        let shape = super::attn_shape();
        let grouped = shape.grouped && c.n_heads / c.n_kv_heads <= ATTN_GROUP_MAX;
        let (kernel, blocks) = match grouped {
            true => (Kernel::AttendPartsGrouped, c.n_kv_heads),
            false => (Kernel::AttendParts, c.n_heads),
        };
        let scale = 1.0 / (c.head_dim as f32).sqrt();
        let parts = vec![
            Arg::Ptr(a.q_rotated),
            Arg::Ptr(a.caches),
            Arg::Ptr(a.positions),
            Arg::Ptr(a.prefixes),
            Arg::Ptr(a.paths),
            layer,
            layers,
            Arg::Ptr(a.attn_parts),
            heads,
            kv_heads,
            hd,
            Arg::F32(scale),
        ];
        let parts_grid = (blocks as u32, rows as u32, shape.parts as u32);
        let nq = c.n_heads * c.head_dim;
        let combine = vec![
            Arg::Ptr(a.attn_parts),
            Arg::Ptr(a.positions),
            Arg::Ptr(a.attn_q8),
            int(nq),
            int(row_blocks(nq)),
            heads,
            hd,
        ];
        [
            launch_of(kernel, grid(parts_grid, ATTN_THREADS), parts),
            launch_of(Kernel::AttendCombine, per_block(rows, nq), combine),
        ]
    }

    /// `duet_greedy` over the first `rows` rows of the logits buffer.
    pub(super) fn greedy(&self, rows: usize) -> Launch {
        let a = &self.addrs;
        let args = vec![
            Arg::Ptr(a.logits),
            int(self.lm_head.n),
            Arg::Ptr(a.summaries),
        ];
        launch_of(
            Kernel::Greedy,
            grid((rows as u32, 1, 1), GREEDY_THREADS),
            args,
        )
    }

    /// `duet_propose` from logits row `row`: how many tokens its proposal keeps into the
    /// row's place in the summaries buffer, their ids and weights into its place in the
    /// `drafted` buffer.
    pub(super) fn propose(&self, row: usize, draw: &Draw) -> Launch {
        let args = propose_args(self.drawing_row(row), self.lm_head.n, &draw.params);
        launch_of(
            Kernel::Propose,
            grid((1, 1, 1), GREEDY_THREADS),
            args.to_vec(),
        )
    }

    /// `duet_draw` from logits row `row` into that row's place in the summaries buffer
    /// (token bits, probability, the excluded token's probability); a draft model's draft
    /// it corrects with the distribution that draft was drawn from, which the row's place
    /// in the `drafted` buffer holds by then.
    pub(super) fn draw(&self, row: usize, draw: &Draw) -> Launch {
        let args = draw_args(self.drawing_row(row), self.lm_head.n, draw);
        launch_of(Kernel::Draw, grid((1, 1, 1), GREEDY_THREADS), args.to_vec())
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
}

/// Running the step's launches on its stream.
impl CudaStep {
    pub(super) fn run(&self, launches: &[Launch]) -> Result<()> {
        for launch in launches {
            match launch {
                Launch::Ours {
                    kernel,
                    config,
                    args,
                } => {
                    let f = match kernel {
                        Kernel::MatVec { .. } | Kernel::MatVecCombine => {
                            self.tiled.and_then(|t| t.function(*kernel))
                        }
                        _ => self.kernels.function(*kernel),
                    };
                    let f = f.ok_or_else(|| {
                        let what = format!("cuda step: no kernel {}", kernel.name());
                        candle_core::Error::Msg(what)
                    })?;
                    launch_kernel(&self.stream, f, *kernel, *config, args)?;
                }
                Launch::Candle { .. } => {
                    let Some((launch, [w, x, y], [k, n, x_stride, y_stride, rows])) =
                        launch.candle()
                    else {
                        unreachable!("candle's")
                    };
                    // SAFETY: the weight is `n x k` as loaded by candle; the input holds
                    // `rows` rows of `x_stride` Q8_1 blocks and the output `rows` rows of
                    // `n` f32, device buffers that outlive the launch (or the graph it is
                    // captured into).
                    unsafe {
                        launch(
                            w as *const c_void,
                            x as *const c_void,
                            y as *mut c_void,
                            k,
                            n,
                            x_stride,
                            y_stride,
                            rows,
                            self.stream.cu_stream() as *mut c_void,
                        );
                    }
                }
            }
        }
        Ok(())
    }

    /// `duet_draw` from logits row `row` ([`StepPtrs::draw`]), after copying the
    /// distribution the draft it corrects was drawn from, if any, into the row's place in
    /// the `drafted` buffer.
    pub(super) fn draw(&self, row: usize, draw: &Draw) -> Result<()> {
        let [_, _, ids, probs] = self.ptrs.drawing_row(row);
        if let Some(q) = draw.excluded().and_then(|x| x.from.as_deref()) {
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
        self.run(&[self.ptrs.draw(row, draw)])
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
/// where the row's launch reads and writes, [`StepPtrs::drawing_row`]'s): the row, the
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
