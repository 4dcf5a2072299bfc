//! The decode and verify step on CUDA: the invariant path's forward pass as a fixed
//! sequence of launches over preallocated buffers, replayed from a CUDA graph.
//!
//! Through candle's ops a one-row forward of the 1.5B target is about 840 launches, each
//! with its own allocation, and the GPU idles between them: decode is bound by launches,
//! not by reading the weights. Here a step is 10 or 11 launches a layer (fused norm and
//! quantization, candle's mat-vec kernels, our kernels for rotary + cache append, attention
//! ending in the output projection's quantized input, and SiLU; `kernels.cu`; q, k and v,
//! and gate and up, load as one weight each where their types agree and launch as one
//! mat-vec: `fuse_projections`, the default; 13 apart; 8 more where a pass has rows of
//! LoRA adapters), on buffers allocated once for [`MAX_ROWS`] rows. What changes from step
//! to step — tokens' positions, which cache each row writes, its adapter — is read from
//! one device buffer written by one copy before the step, so the launches of a row bucket
//! never change: captured once into a CUDA graph, they replay with a single launch.
//!
//! Each row's arithmetic does not depend on the rows beside it or on the bucket (mat-vec
//! launches of at most four rows, and per-row kernels), so decode, verification and every
//! bucket give a row bitwise the same logits, as the CPU kernels do. The embedding lookup
//! (candle's, before the step) and the vocabulary projection (after it, for the rows that
//! want logits only) run outside the graph.
//!
//! The step runs on a stream of its own: a capture there records only the step's launches,
//! never a buffer another thread frees on candle's stream meanwhile. It waits for candle's
//! stream (the prompt's prefill writes the caches) and ends with the logits copied to the
//! host. The stream is made outside cudarc's bookkeeping, which would otherwise switch the
//! whole context to tracking every buffer's uses with events (a cost on each of candle's
//! ops): the step orders its own work, and candle's ops stay as they were.

use super::LogitsFor;
use super::config::ModelConfig;
use super::cuda::{MatVec, ROW_PADDING, device_addr, mat_vec};
use super::linear::{Linear, Projections};
use super::step_plan::{
    self, ATTN_GROUP_MAX, AttnShape, GraphReport, InputLayout, MATVEC_ROWS, MAX_ROWS, RowKeys,
    StepRow, TREE_PATH,
};
use super::weights::{Layer, Weights};
use crate::error::Result;
use crate::kv_cache::KvCache;
use crate::sampling::{Distribution, Draw, Drawn, SamplingError};
use candle_core::cuda_backend::cudarc::driver::{
    CudaEvent, CudaGraph, CudaStream, DriverError, result, sys,
};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{CudaDevice, Device, Tensor};
use std::sync::Arc;

const Q8_1_BYTES: usize = 36;
const NORM_THREADS: u32 = 256;
const ATTN_THREADS: u32 = 128;
const GREEDY_THREADS: u32 = 1024;
const LORA_THREADS: u32 = 256;
/// The largest rank of an adapter's delta the step takes (vLLM's largest `max_lora_rank`):
/// its buffer of each row's `x A^T` holds this many values a projection.
pub(crate) const LORA_MAX_RANK: usize = 512;
/// Blocks a row and projection for a delta's ranks, each taking every this-many-th rank:
/// a rank a block up to rank 16 (vLLM's default `max_lora_rank`), a few in turn past it.
const LORA_RANK_BLOCKS: u32 = 16;
mod launch;
pub(crate) mod matvec;
#[cfg(test)]
mod on_cpu;
mod resources;
mod source;

use resources::{Addrs, Buffers, Kernels, OwnedStream};
use source::{attn_shape, load_module, shape_from_env};
#[cfg(test)]
use source::{source, source_for};

pub(crate) const COMMON: &str = include_str!("common.cuh");
const KERNELS: &str = include_str!("kernels.cu");

/// Why a model cannot take the step (it then runs the invariant path on candle's ops).
pub(crate) fn unsupported(c: &ModelConfig, w: &Weights) -> Option<String> {
    let dims = [("hidden", c.hidden), ("ffn_hidden", c.ffn_hidden)];
    if let Some((name, n)) = dims.iter().find(|(_, n)| n % 32 != 0) {
        return Some(format!("{name} {n} is not a multiple of 32"));
    }
    if !(c.n_heads * c.head_dim).is_multiple_of(32) || !c.head_dim.is_multiple_of(2) {
        return Some(format!("heads of {} dims", c.head_dim));
    }
    if c.head_dim > ATTN_THREADS as usize {
        return Some(format!("head_dim {} over {ATTN_THREADS}", c.head_dim));
    }
    let linears = w.layers.iter().flat_map(|l| {
        let qkv = l.qkv.linears().map(|linear| (linear, true));
        let rest = l.gate_up.linears().chain([&l.o, &l.down]);
        qkv.chain(rest.map(|linear| (linear, false)))
    });
    for (linear, bias_ok) in linears.chain([(&w.lm_head, false)]) {
        match linear.quantized() {
            Some(q) if mat_vec(q.dtype()).is_some() => {}
            Some(q) => return Some(format!("weights of type {:?}", q.dtype())),
            None => return Some("weights off candle's kernels".into()),
        }
        if linear.bias().is_some() && !bias_ok {
            return Some("a bias outside attention's q, k, v".into());
        }
    }
    None
}

fn cu<T>(r: std::result::Result<T, DriverError>, what: &str) -> Result<T> {
    r.map_err(|e| candle_core::Error::Msg(format!("cuda step, {what}: {e}")).into())
}

/// A quantized weight as candle's mat-vec kernel takes it.
#[derive(Debug, Clone, Copy)]
struct MatVecWeight {
    ptr: u64,
    launch: MatVec,
    dtype: GgmlDType,
    n: usize,
    k: usize,
}

impl MatVecWeight {
    fn new(linear: &Linear, place: &mut impl Place) -> Result<Self> {
        let (weight, ptr) = place.weight(linear)?;
        let (n, k) = weight.shape().dims2()?;
        let launch = mat_vec(weight.dtype()).ok_or_else(|| {
            candle_core::Error::Msg(format!("cuda step: no kernel for {:?}", weight.dtype()))
        })?;
        Ok(Self {
            ptr,
            launch,
            dtype: weight.dtype(),
            n,
            k,
        })
    }
}

/// Q8_1 blocks per row of `k` activations (candle pads rows to [`ROW_PADDING`] values).
fn row_blocks(k: usize) -> usize {
    k.div_ceil(ROW_PADDING) * ROW_PADDING / 32
}

/// Projections that share an input (a layer's q, k and v; its gate and up) as loaded
/// (`linear::Projections`): a mat-vec launch a weight, the address it writes, and where each
/// projection's outputs sit (address, row stride in f32) and its bias (0: none).
#[derive(Debug)]
struct ProjectionPtrs<const N: usize> {
    launches: Vec<(MatVecWeight, u64)>,
    outs: [(u64, i32); N],
    biases: [u64; N],
}

impl<const N: usize> ProjectionPtrs<N> {
    fn new(projections: &Projections<N>, buffer: u64, place: &mut impl Place) -> Result<Self> {
        let parts = projections.parts();
        // Each projection keyed by the weight that holds it: one launch a weight.
        let members = parts
            .iter()
            .enumerate()
            .flat_map(|(part, (_, widths))| widths.iter().map(move |&width| (part, width)));
        let members: Vec<(usize, usize)> = members.collect();
        let (launches, outs) = step_plan::projection_launches(&members, true);
        let addr = |f32s: usize| buffer + (f32s * std::mem::size_of::<f32>()) as u64;
        let mut biases = [0; N];
        for (launch, (linear, _)) in launches.iter().zip(parts) {
            let Some(bias) = linear.bias() else { continue };
            // A projection's bias sits at its column of the weight's.
            let base = place.tensor(bias)?;
            for member in launch.members.clone() {
                let column = outs[member].offset - launch.base;
                biases[member] = base + (column * std::mem::size_of::<f32>()) as u64;
            }
        }
        let weights = parts
            .iter()
            .map(|(linear, _)| MatVecWeight::new(linear, place));
        Ok(Self {
            launches: weights
                .collect::<Result<Vec<_>>>()?
                .into_iter()
                .zip(&launches)
                .map(|(w, l)| (w, addr(l.base)))
                .collect(),
            outs: std::array::from_fn(|i| (addr(outs[i].offset), outs[i].stride as i32)),
            biases,
        })
    }
}

#[derive(Debug)]
struct LayerPtrs {
    attn_norm: u64,
    qkv: ProjectionPtrs<3>,
    /// Qwen3's norms of each head's queries and keys; 0: none.
    head_norms: [u64; 2],
    o: MatVecWeight,
    ffn_norm: u64,
    gate_up: ProjectionPtrs<2>,
    down: MatVecWeight,
}

impl LayerPtrs {
    fn of(l: &Layer, a: &Addrs, place: &mut impl Place) -> Result<Self> {
        Ok(Self {
            attn_norm: place.tensor(&l.attn_norm)?,
            qkv: ProjectionPtrs::new(&l.qkv, a.qkv, place)?,
            head_norms: match &l.head_norms {
                Some([q, k]) => [place.tensor(q)?, place.tensor(k)?],
                None => [0, 0],
            },
            o: MatVecWeight::new(&l.o, place)?,
            ffn_norm: place.tensor(&l.ffn_norm)?,
            gate_up: ProjectionPtrs::new(&l.gate_up, a.gate_up, place)?,
            down: MatVecWeight::new(&l.down, place)?,
        })
    }

    /// Every weight the layer's launches read.
    fn weights(&self) -> impl Iterator<Item = &MatVecWeight> {
        let projections = self.qkv.launches.iter().chain(&self.gate_up.launches);
        projections.map(|(w, _)| w).chain([&self.o, &self.down])
    }
}

/// Where the step finds a model's tensors: on the GPU, where candle loaded them
/// ([`OnDevice`]); in the CPU's tests, where their script put them.
trait Place {
    fn tensor(&mut self, t: &Tensor) -> Result<u64>;
    /// A projection's weight as candle loaded it, and its address.
    fn weight<'l>(&mut self, linear: &'l Linear) -> Result<(&'l QTensor, u64)>;
}

/// The model's tensors where candle loaded them on the GPU.
struct OnDevice;

impl Place for OnDevice {
    fn tensor(&mut self, t: &Tensor) -> Result<u64> {
        Ok(device_addr(t)?)
    }

    fn weight<'l>(&mut self, linear: &'l Linear) -> Result<(&'l QTensor, u64)> {
        let weight = linear.quantized().ok_or_else(|| {
            candle_core::Error::Msg("cuda step: a weight off candle's kernels".into())
        })?;
        Ok((weight, weight.device_ptr()? as u64))
    }
}

/// What the step's launches read and write, and how they run its mat-vecs: everything
/// its launches are made from ([`launch`]) but the device itself.
#[derive(Debug)]
struct StepPtrs {
    config: ModelConfig,
    addrs: Addrs,
    layers: Vec<LayerPtrs>,
    output_norm: u64,
    lm_head: MatVecWeight,
    cos: u64,
    sin: u64,
    /// The tiled mat-vec kernels' choice, where it asks for them and every weight has one
    /// (`matvec`); else candle's, at most four rows a launch.
    matvec: Option<matvec::Choice>,
}

impl StepPtrs {
    fn new(
        c: &ModelConfig,
        w: &Weights,
        addrs: Addrs,
        matvec: Option<matvec::Choice>,
        place: &mut impl Place,
    ) -> Result<Self> {
        let layers = (w.layers.iter())
            .map(|l| LayerPtrs::of(l, &addrs, place))
            .collect::<Result<Vec<_>>>()?;
        let lm_head = MatVecWeight::new(&w.lm_head, place)?;
        let tiled = (layers.iter().flat_map(LayerPtrs::weights))
            .chain([&lm_head])
            .all(|w| matvec::supports(w.dtype));
        Ok(Self {
            config: c.clone(),
            addrs,
            output_norm: place.tensor(&w.output_norm)?,
            cos: place.tensor(&w.cos)?,
            sin: place.tensor(&w.sin)?,
            matvec: matvec.filter(|_| tiled),
            layers,
            lm_head,
        })
    }
}

/// A captured step. cudarc's graph holds raw handles; it is only touched under the
/// model's step lock, from one thread at a time.
struct Graph(CudaGraph);
// SAFETY: see above: the lock serialises every use, as CUDA requires of graph objects.
unsafe impl Send for Graph {}

impl std::fmt::Debug for Graph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Graph")
    }
}

/// The step for one model (see the module docs).
#[derive(Debug)]
pub(crate) struct CudaStep {
    stream: Arc<CudaStream>,
    candle_stream: Arc<CudaStream>,
    ready: CudaEvent,
    kernels: Kernels,
    /// Owns the device memory `ptrs.addrs` points into.
    _buffers: Buffers,
    ptrs: StepPtrs,
    layout: InputLayout,
    host_inputs: Vec<u8>,
    use_graphs: bool,
    /// The tiled mat-vec kernels, where `ptrs` takes them.
    tiled: Option<&'static matvec::Tiled>,
    /// The padding rows' cache addresses, `[keys, values]` a layer.
    scratch: Vec<[u64; 2]>,
    /// One per bucket of [`step_plan::BUCKETS`], captured after the bucket's first eager run;
    /// then as many for passes with LoRA adapters' rows.
    graphs: Vec<Option<Graph>>,
    /// Why a capture failed, once one has: the step then stays eager.
    capture_failure: Option<String>,
    /// Last: dropped after every field that frees on it.
    _owned_stream: OwnedStream,
}

impl Drop for CudaStep {
    /// The step's buffers, graphs and kernels are freed with the context current on this
    /// thread, whichever thread drops the model (see `cuda::make_current_before_free`).
    fn drop(&mut self) {
        // SAFETY: the context outlives the step (the stream wrapper holds it).
        let _ = unsafe { result::ctx::set_current(self.stream.context().cu_ctx()) };
    }
}

/// The scratch cache's per-layer `[keys, values]` addresses: one position of each at
/// `base`, layer after layer.
fn scratch_addrs(c: &ModelConfig, base: u64) -> Vec<[u64; 2]> {
    let row = (c.n_kv_heads * c.head_dim * std::mem::size_of::<f32>()) as u64;
    (0..c.n_layers as u64)
        .map(|layer| {
            let at = base + 2 * layer * row;
            [at, at + row]
        })
        .collect()
}

/// One row of a pass: its sequence, token and place in the sequence's cache, whether it
/// wants logits, and whether its greedy summary stands for them.
#[derive(Debug, Clone)]
struct PassRow {
    seq: usize,
    token: u32,
    keys: RowKeys,
    wanted: bool,
    greedy: bool,
    draw: Option<Draw>,
}

/// One sequence's share of a step's pass: the tokens to append to its cache (a chain, or a
/// tree by `parents`, as `SequenceInput` has them), the rows it wants logits for, whether
/// it also wants those rows' last hidden states (a shortlisted draft's extra ids are
/// projected from them), and whether each row's greedy summary, or a token drawn from it
/// (a draw a row asked for), is all it reads.
#[derive(Debug)]
pub(crate) struct StepSeq<'a> {
    pub(crate) cache: &'a KvCache,
    pub(crate) tokens: &'a [u32],
    pub(crate) parents: &'a [u32],
    pub(crate) logits: LogitsFor,
    pub(crate) hidden: bool,
    pub(crate) greedy: bool,
    pub(crate) draws: &'a [Draw],
}

/// What a step's pass gives one sequence for the rows it wanted: `rows x lm_head rows`
/// logits, or for a greedy sequence each row's summary (`duet_greedy`: index bits,
/// maximum, sum), or the token drawn from each row; and, where asked, `rows x hidden` last
/// hidden states.
#[derive(Debug, Default)]
pub(crate) struct StepOut {
    pub(crate) logits: Vec<f32>,
    pub(crate) summaries: Vec<[f32; 3]>,
    pub(crate) drawn: Vec<std::result::Result<Drawn, SamplingError>>,
    pub(crate) hidden: Vec<f32>,
}

/// Whether draws are made on the GPU (`DUET_CUDA_DRAW=1`, read once; off until a GPU has
/// run it): a drawn row then comes back as its token alone.
pub(crate) fn draws_wanted() -> bool {
    static WANTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *WANTED.get_or_init(|| std::env::var("DUET_CUDA_DRAW").is_ok_and(|v| v == "1"))
}

/// The most tokens of the distribution a rejected draft was drawn from that a draw on the
/// GPU takes (`resources::Addrs::drafted`); a sequence with a wider one reads its rows
/// whole. A draft model's proposals hold the few hundred tokens that matter
/// (`sampling::proposal_distribution`).
pub(crate) const DRAFTED_MAX: usize = 8192;

/// Whether `draw`'s excluded draft, if any, was drawn from at most [`DRAFTED_MAX`] tokens.
fn drafted_fits(draw: &Draw) -> bool {
    let from = draw.excluded().and_then(|x| x.from.as_ref());
    from.is_none_or(|q| q.ids().len() <= DRAFTED_MAX)
}

/// The rows of a pass in batch order, with the logits each sequence asked for; each wanted
/// row's draw (where `draws`, a sequence has one for each, and each draft they exclude
/// was drawn from at most [`DRAFTED_MAX`] tokens).
fn pass_rows(seqs: &[StepSeq<'_>], draws: bool) -> Result<Vec<PassRow>> {
    let mut rows = Vec::new();
    for (seq, s) in seqs.iter().enumerate() {
        let (start, tokens) = (s.cache.len(), s.tokens);
        let n = tokens.len();
        let first_wanted = match s.logits {
            LogitsFor::None => n,
            LogitsFor::Last => n - 1,
            LogitsFor::All => 0,
            LogitsFor::Tail(k) => n - k.min(n),
        };
        let drawn = draws
            && !s.greedy
            && s.draws.len() == n - first_wanted
            && s.draws
                .iter()
                .all(|d| !d.params.is_greedy() && drafted_fits(d));
        let draw =
            |i: usize| (drawn && i >= first_wanted).then(|| s.draws[i - first_wanted].clone());
        let paths = match s.parents {
            [] => None,
            parents => Some(super::attention::tree_paths(parents, start)?),
        };
        for (i, &token) in tokens.iter().enumerate() {
            let keys = match &paths {
                None => RowKeys::chain((start + i) as u32),
                Some(paths) => RowKeys::tree(&paths[i]).ok_or_else(|| {
                    let why = format!("a path leaves the chain for over {TREE_PATH} tokens");
                    crate::error::EngineError::BadTree(why)
                })?,
            };
            rows.push(PassRow {
                seq,
                token,
                keys,
                wanted: i >= first_wanted,
                greedy: s.greedy,
                draw: draw(i),
            });
        }
    }
    Ok(rows)
}

impl CudaStep {
    pub(crate) fn new(
        c: &ModelConfig,
        w: &Weights,
        device: &CudaDevice,
        use_graphs: bool,
    ) -> Result<Self> {
        let candle_stream = device.cuda_stream();
        let (owned_stream, stream) = OwnedStream::new(candle_stream.context())?;
        let no_timing = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING;
        let ready = cu(
            candle_stream.context().new_event(Some(no_timing)),
            "creating an event",
        )?;
        let lm_rows = w.lm_head.out_features();
        let layout = InputLayout { layers: c.n_layers };
        let (buffers, addrs) = Buffers::new(&stream, c, lm_rows, &layout)?;
        let ptrs = StepPtrs::new(c, w, addrs, matvec::Choice::from_env(), &mut OnDevice)?;
        let tiled = match ptrs.matvec {
            Some(_) => matvec::for_stream(&stream)?,
            None => None,
        };
        Ok(Self {
            tiled,
            kernels: Kernels::load(&stream)?,
            host_inputs: vec![0; layout.bytes()],
            graphs: (0..2 * step_plan::BUCKETS.len()).map(|_| None).collect(),
            scratch: scratch_addrs(c, addrs.scratch_cache),
            capture_failure: None,
            stream,
            candle_stream,
            ready,
            _buffers: buffers,
            ptrs,
            layout,
            use_graphs,
            _owned_stream: owned_stream,
        })
    }

    pub(crate) fn report(&self) -> GraphReport {
        GraphReport {
            captured: self.graphs.iter().flatten().count(),
            failure: self.capture_failure.clone(),
        }
    }

    /// Appends each sequence's tokens to its cache (keys and values written, length not yet
    /// committed) and returns what each sequence asked for.
    pub(crate) fn forward(
        &mut self,
        w: &Weights,
        device: &Device,
        seqs: &[StepSeq<'_>],
    ) -> Result<Vec<StepOut>> {
        cu(
            self.stream.context().bind_to_thread(),
            "binding the context",
        )?;
        let caches: Vec<&[[u64; 2]]> = seqs.iter().map(|s| s.cache.device_addrs()).collect();
        // A cache made on another device has no device addresses: an error, not the input
        // layout's panic.
        if caches.iter().any(|c| c.len() != self.ptrs.config.n_layers) {
            let msg = "cuda step: a KV cache that is not on this CUDA device".to_string();
            return Err(candle_core::Error::Msg(msg).into());
        }
        let rows = pass_rows(seqs, draws_wanted())?;
        let adapters: Vec<u64> = (seqs.iter())
            .map(|s| s.cache.adapter().map_or(Ok(0), |a| a.step_table_addr()))
            .collect::<Result<_>>()?;
        let any_hidden = seqs.iter().any(|s| s.hidden);
        let mut out: Vec<StepOut> = seqs.iter().map(|_| StepOut::default()).collect();
        for range in step_plan::steps(rows.len()) {
            let chunk = &rows[range];
            let bucket = step_plan::bucket_for(chunk.len());
            let step_rows: Vec<StepRow<'_>> = chunk
                .iter()
                .map(|r| StepRow {
                    token: r.token,
                    keys: &r.keys,
                    caches: caches[r.seq],
                    adapter: adapters[r.seq],
                })
                .collect();
            let lora = step_rows.iter().any(|r| r.adapter != 0);
            let bytes = self
                .layout
                .fill(&mut self.host_inputs, &step_rows, bucket, &self.scratch);
            // Kept alive until the step's stream has read it (freed on candle's stream).
            let embedded = self.embed(w, device, chunk, bucket)?;
            // SAFETY: the inputs buffer holds `bytes`; the copy is staged from host memory
            // before the call returns, so the host buffer may be refilled afterwards.
            cu(
                unsafe {
                    result::memcpy_htod_async(
                        self.ptrs.addrs.tokens,
                        &self.host_inputs[..bytes],
                        self.stream.cu_stream(),
                    )
                },
                "copying the step's inputs",
            )?;
            self.run_layers(bucket, lora)?;
            let projected = self.project(chunk, any_hidden)?;
            drop(embedded);
            self.hand_out(chunk, &projected, seqs, &mut out)?;
        }
        Ok(out)
    }

    /// Each wanted row of a chunk's projection to its sequence: its logits, its greedy
    /// summary, or the token drawn from it (where the GPU left the draw to the host, drawn
    /// here from the row); and its hidden state where the sequence asked for them.
    fn hand_out(
        &self,
        chunk: &[PassRow],
        projected: &StepOut,
        seqs: &[StepSeq<'_>],
        out: &mut [StepOut],
    ) -> Result<()> {
        let (n, h) = (self.ptrs.lm_head.n, self.ptrs.config.hidden);
        let wanted = chunk.iter().enumerate().filter(|(_, r)| r.wanted);
        for (at, (i, row)) in wanted.enumerate() {
            let seq = &mut out[row.seq];
            match (row.greedy, &row.draw) {
                (true, _) => seq.summaries.push(projected.summaries[at]),
                (false, Some(draw)) => seq.drawn.push(self.drawn(at, projected, draw)?),
                (false, None) => seq
                    .logits
                    .extend_from_slice(&projected.logits[at * n..(at + 1) * n]),
            }
            if seqs[row.seq].hidden {
                seq.hidden
                    .extend_from_slice(&projected.hidden[i * h..(i + 1) * h]);
            }
        }
        Ok(())
    }

    /// The token `duet_draw` drew from row `at` (its token's bits, probability and the
    /// excluded token's), or a proposal's draw from the tokens `duet_propose` kept (copied
    /// here); where either left it to the host (an infinite logit, none usable, a proposal
    /// past what the GPU keeps), the row copied here and drawn from.
    fn drawn(
        &self,
        at: usize,
        projected: &StepOut,
        draw: &Draw,
    ) -> Result<std::result::Result<Drawn, SamplingError>> {
        let [token, probability, excluded] = projected.summaries[at];
        Ok(match (token.to_bits() as i32, draw.is_proposal()) {
            (..0, _) => draw.of_row(&self.logits_row(at)?),
            (kept, true) => match self.proposal(at, kept as usize)? {
                Some(proposal) => Ok(draw.drawn_from(proposal, 0.0)),
                None => draw.of_row(&self.logits_row(at)?),
            },
            (_, false) => Ok(Drawn {
                token: token.to_bits(),
                probability,
                excluded,
                proposal: None,
            }),
        })
    }

    /// The proposal `duet_propose` made of row `at`: its `kept` tokens' ids and weights,
    /// copied to the host and normalized as the host normalizes its own (`None`: no mass,
    /// which weights above a positive floor always have).
    fn proposal(&self, at: usize, kept: usize) -> Result<Option<Distribution>> {
        let (mut ids, mut weights) = (vec![0u32; kept], vec![0f32; kept]);
        let [_, _, ids_at, weights_at] = self.ptrs.drawing_row(at);
        let stream = self.stream.cu_stream();
        // SAFETY (both copies): the row's place holds DRAFTED_MAX ids and as many weights,
        // of which `duet_propose` wrote `kept` (at most DRAFTED_MAX).
        cu(
            unsafe { result::memcpy_dtoh_async(&mut ids, ids_at, stream) },
            "copying a proposal",
        )?;
        cu(
            unsafe { result::memcpy_dtoh_async(&mut weights, weights_at, stream) },
            "copying a proposal",
        )?;
        cu(self.stream.synchronize(), "copying a proposal")?;
        let entries = ids.into_iter().zip(weights.into_iter().map(f64::from));
        Ok(Distribution::from_sorted_weights(entries.collect()))
    }

    /// Row `at` of the logits buffer, copied to the host after the step has run.
    fn logits_row(&self, at: usize) -> Result<Vec<f32>> {
        let n = self.ptrs.lm_head.n;
        let mut row = vec![0f32; n];
        let from = self.ptrs.addrs.logits + (at * n * 4) as u64;
        // SAFETY: the logits buffer holds at least `at + 1` rows of `n` f32.
        cu(
            unsafe { result::memcpy_dtoh_async(&mut row, from, self.stream.cu_stream()) },
            "copying a row of logits",
        )?;
        cu(self.stream.synchronize(), "copying a row of logits")?;
        Ok(row)
    }

    /// The rows' embeddings (candle's lookup, on candle's stream) copied into the residual
    /// stream, after everything candle's stream was asked to do before: the prefill that
    /// wrote the caches this step reads. Returns the lookup, which must live until the
    /// step's stream has copied it.
    fn embed(
        &self,
        w: &Weights,
        device: &Device,
        chunk: &[PassRow],
        bucket: usize,
    ) -> Result<Tensor> {
        // Padding rows start from token 0's embedding each step, as a real row would.
        let mut ids: Vec<u32> = chunk.iter().map(|r| r.token).collect();
        ids.resize(bucket, 0);
        let ids = Tensor::from_vec(ids, bucket, device)?;
        let embedded = w.embedding.embedding(&ids)?.contiguous()?;
        let src = device_addr(&embedded)?;
        cu(self.ready.record(&self.candle_stream), "recording an event")?;
        cu(self.stream.wait(&self.ready), "waiting for candle's stream")?;
        let (bytes, x) = (bucket * self.ptrs.config.hidden * 4, self.ptrs.addrs.x);
        // SAFETY: both buffers hold `bytes`: the lookup's rows, and `x`'s first rows.
        cu(
            unsafe { result::memcpy_dtod_async(x, src, bytes, self.stream.cu_stream()) },
            "copying the embeddings",
        )?;
        Ok(embedded)
    }

    /// The layers for `bucket` rows (with `lora`, adding adapters' deltas): the bucket's
    /// graph where one was captured, else the launches one by one, then a capture of them
    /// for the next step of this bucket.
    fn run_layers(&mut self, bucket: usize, lora: bool) -> Result<()> {
        let buckets = step_plan::BUCKETS;
        let index = (buckets.iter().position(|&b| b == bucket))
            .unwrap_or_else(|| unreachable!("{bucket} is a bucket"))
            + usize::from(lora) * buckets.len();
        if let Some(graph) = &self.graphs[index] {
            return cu(graph.0.launch(), "launching the step's graph");
        }
        self.run(&self.ptrs.layer_launches(bucket, lora))?;
        if self.use_graphs && self.capture_failure.is_none() {
            match self.capture(bucket, lora) {
                Ok(graph) => self.graphs[index] = Some(Graph(graph)),
                Err(reason) => self.capture_failure = Some(reason),
            }
        }
        Ok(())
    }

    /// Records the bucket's launches into a graph (they do not run now). The bucket ran
    /// eagerly just before, so every kernel it launches is loaded already.
    fn capture(&self, bucket: usize, lora: bool) -> std::result::Result<CudaGraph, String> {
        let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        self.stream
            .begin_capture(mode)
            .map_err(|e| format!("beginning a capture of {bucket} rows: {e}"))?;
        let launched = self.run(&self.ptrs.layer_launches(bucket, lora));
        let ended = self.stream.end_capture(sys::CUgraphInstantiate_flags(0));
        launched.map_err(|e| format!("capturing {bucket} rows: {e}"))?;
        let graph = ended
            .map_err(|e| format!("capturing {bucket} rows: {e}"))?
            .ok_or_else(|| format!("capturing {bucket} rows gave no graph"))?;
        graph
            .upload()
            .map_err(|e| format!("uploading the graph of {bucket} rows: {e}"))?;
        Ok(graph)
    }

    /// The vocabulary projection of the chunk's wanted rows only, into consecutive rows
    /// of the logits buffer; the greedy rows' summaries (`duet_greedy`), the drawn rows'
    /// tokens (`duet_draw`) and, where a wanted row is neither, the logits copied to the
    /// host; and with `hidden`, every row's last hidden state.
    fn project(&self, chunk: &[PassRow], hidden: bool) -> Result<StepOut> {
        let wanted: Vec<bool> = chunk.iter().map(|r| r.wanted).collect();
        let (launches, at) = self.ptrs.logits_launches(&wanted);
        self.run(&launches)?;
        let rows = chunk.iter().filter(|r| r.wanted);
        let (any_greedy, any_whole) = (
            rows.clone().any(|r| r.greedy),
            rows.clone().any(|r| !r.greedy && r.draw.is_none()),
        );
        if any_greedy {
            self.run(&[self.ptrs.greedy(at)])?;
        }
        // After the summaries: each draw writes its own row's place among them.
        let draws: Vec<(usize, &Draw)> = (rows.enumerate())
            .filter_map(|(i, r)| r.draw.as_ref().map(|d| (i, d)))
            .collect();
        for (i, draw) in &draws {
            match draw.is_proposal() {
                true => self.run(&[self.ptrs.propose(*i, draw)])?,
                false => self.draw(*i, draw)?,
            }
        }
        let summarised = any_greedy || !draws.is_empty();
        let mut out = StepOut {
            logits: vec![
                0f32;
                if any_whole {
                    at * self.ptrs.lm_head.n
                } else {
                    0
                }
            ],
            summaries: vec![[0f32; 3]; if summarised { at } else { 0 }],
            drawn: Vec::new(),
            hidden: vec![
                0f32;
                if hidden {
                    chunk.len() * self.ptrs.config.hidden
                } else {
                    0
                }
            ],
        };
        let (stream, a) = (self.stream.cu_stream(), &self.ptrs.addrs);
        // SAFETY (each copy): the device buffer holds at least as many f32 as the host one.
        if !out.logits.is_empty() {
            cu(
                unsafe { result::memcpy_dtoh_async(&mut out.logits, a.logits, stream) },
                "copying logits",
            )?;
        }
        if !out.summaries.is_empty() {
            let flat = out.summaries.as_flattened_mut();
            cu(
                unsafe { result::memcpy_dtoh_async(flat, a.summaries, stream) },
                "copying greedy choices",
            )?;
        }
        if !out.hidden.is_empty() {
            cu(
                unsafe { result::memcpy_dtoh_async(&mut out.hidden, a.hidden_out, stream) },
                "copying hidden states",
            )?;
        }
        cu(self.stream.synchronize(), "running the step")?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests;
