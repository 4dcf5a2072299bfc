//! The decode and verify step on CUDA: the invariant path's forward pass as a fixed
//! sequence of launches over preallocated buffers, replayed from a CUDA graph.
//!
//! Through candle's ops a one-row forward of the 1.5B target is about 840 launches, each
//! with its own allocation, and the GPU idles between them: decode was bound by launches,
//! not by reading the weights. Here a step is about 13 launches a layer (fused norm and
//! quantization, candle's mat-vec kernels, our kernels for rotary + cache append, attention
//! and SiLU; `cuda_step.cu`), on buffers allocated once for [`MAX_ROWS`] rows. What changes
//! from step to step — tokens' positions and which cache each row writes — is read from
//! one device buffer written by one copy before the step, so the launches of a row
//! bucket never change: captured once into a CUDA graph, they replay with a single launch.
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
use super::config::{Architecture, ModelConfig};
use super::cuda::{MatVec, ROW_PADDING, mat_vec};
use super::linear::Linear;
use super::step_plan::{self, GraphReport, InputLayout, MATVEC_ROWS, MAX_ROWS, StepRow};
use super::weights::Weights;
use crate::error::Result;
use crate::kv_cache::KvCache;
use candle_core::cuda_backend::cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaGraph, CudaSlice, CudaStream, DevicePtr, DriverError,
    LaunchConfig, PushKernelArg, result, sys,
};
use candle_core::cuda_backend::cudarc::nvrtc;
use candle_core::{CudaDevice, Device, Storage, Tensor};
use std::ffi::c_void;
use std::sync::Arc;

const Q8_1_BYTES: usize = 36;
const NORM_THREADS: u32 = 256;
const ATTN_THREADS: u32 = 128;
const GREEDY_THREADS: u32 = 1024;
const KERNELS: &str = include_str!("cuda_step.cu");

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
        [
            (&l.q, true),
            (&l.k, true),
            (&l.v, true),
            (&l.o, false),
            (&l.gate, false),
            (&l.up, false),
            (&l.down, false),
        ]
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
    n: usize,
    k: usize,
}

impl MatVecWeight {
    fn new(linear: &Linear) -> Result<Self> {
        let weight = linear.quantized().ok_or_else(|| {
            candle_core::Error::Msg("cuda step: a weight off candle's kernels".into())
        })?;
        let (n, k) = weight.shape().dims2()?;
        let launch = mat_vec(weight.dtype()).ok_or_else(|| {
            candle_core::Error::Msg(format!("cuda step: no kernel for {:?}", weight.dtype()))
        })?;
        Ok(Self {
            ptr: weight.device_ptr()? as u64,
            launch,
            n,
            k,
        })
    }
}

/// Q8_1 blocks per row of `k` activations (candle pads rows to [`ROW_PADDING`] values).
fn row_blocks(k: usize) -> usize {
    k.div_ceil(ROW_PADDING) * ROW_PADDING / 32
}

/// A dense f32 tensor's device address.
fn dense_ptr(t: &Tensor, stream: &Arc<CudaStream>) -> Result<u64> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cuda(cuda) = &*storage else {
        return Err(candle_core::Error::Msg("cuda step: a tensor off the GPU".into()).into());
    };
    if !layout.is_contiguous() {
        return Err(candle_core::Error::Msg("cuda step: a strided tensor".into()).into());
    }
    let slice = cuda.as_cuda_slice::<f32>()?;
    let (ptr, _sync) = slice.device_ptr(stream);
    Ok(ptr + (layout.start_offset() * 4) as u64)
}

#[derive(Debug)]
struct LayerPtrs {
    attn_norm: u64,
    q: MatVecWeight,
    k: MatVecWeight,
    v: MatVecWeight,
    biases: [u64; 3],
    o: MatVecWeight,
    ffn_norm: u64,
    gate: MatVecWeight,
    up: MatVecWeight,
    down: MatVecWeight,
}

/// The step's kernels (`cuda_step.cu`), compiled and loaded once per step.
#[derive(Debug)]
struct Kernels {
    add_norm: CudaFunction,
    quantize: CudaFunction,
    silu_mul: CudaFunction,
    rope_append: CudaFunction,
    attend: CudaFunction,
    greedy: CudaFunction,
}

impl Kernels {
    fn load(stream: &Arc<CudaStream>) -> Result<Self> {
        let ptx = nvrtc::compile_ptx(KERNELS).map_err(|e| {
            candle_core::Error::Msg(format!("compiling the cuda step's kernels: {e}"))
        })?;
        let module = cu(stream.context().load_module(ptx), "loading kernels")?;
        let f = |name: &str| cu(module.load_function(name), name);
        Ok(Self {
            add_norm: f("duet_add_norm_q8")?,
            quantize: f("duet_quantize_q8")?,
            silu_mul: f("duet_silu_mul_q8")?,
            rope_append: f("duet_rope_append")?,
            attend: f("duet_attend")?,
            greedy: f("duet_greedy")?,
        })
    }
}

/// The step's device buffers, each for [`MAX_ROWS`] rows.
#[derive(Debug)]
struct Buffers {
    inputs: CudaSlice<u8>,
    /// The residual stream `[rows, hidden]`.
    x: CudaSlice<f32>,
    /// A normed row as the mat-vec kernels take it.
    normed: CudaSlice<u8>,
    /// Each row's last normed hidden state, f32 (kept for callers that project it again).
    hidden_out: CudaSlice<f32>,
    q: CudaSlice<f32>,
    k: CudaSlice<f32>,
    v: CudaSlice<f32>,
    q_rotated: CudaSlice<f32>,
    attn: CudaSlice<f32>,
    attn_q8: CudaSlice<u8>,
    delta: CudaSlice<f32>,
    gate: CudaSlice<f32>,
    up: CudaSlice<f32>,
    act_q8: CudaSlice<u8>,
    logits: CudaSlice<f32>,
    /// Each logits row's greedy summary: index bits, maximum, sum.
    summaries: CudaSlice<f32>,
    /// The padding rows' cache: one position of keys and values per layer.
    scratch_cache: CudaSlice<f32>,
}

impl Buffers {
    fn new(
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
            q: f32s(rows * nq)?,
            k: f32s(rows * nkv)?,
            v: f32s(rows * nkv)?,
            q_rotated: f32s(rows * nq)?,
            attn: f32s(rows * nq)?,
            attn_q8: q8(nq)?,
            delta: f32s(rows * c.hidden)?,
            gate: f32s(rows * c.ffn_hidden)?,
            up: f32s(rows * c.ffn_hidden)?,
            act_q8: q8(c.ffn_hidden)?,
            logits: f32s(rows * lm_rows)?,
            summaries: f32s(rows * 3)?,
            scratch_cache: f32s(c.n_layers * 2 * nkv)?,
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

/// The raw addresses one step's launches read and write.
#[derive(Debug, Clone, Copy)]
struct Addrs {
    tokens: u64,
    positions: u64,
    caches: u64,
    x: u64,
    normed: u64,
    hidden_out: u64,
    q: u64,
    k: u64,
    v: u64,
    q_rotated: u64,
    attn: u64,
    attn_q8: u64,
    delta: u64,
    gate: u64,
    up: u64,
    act_q8: u64,
    logits: u64,
    summaries: u64,
    scratch_cache: u64,
}

/// The step's stream, created and destroyed here rather than by cudarc (see the module
/// docs). It is the step's last field: the buffers before it free on it.
#[derive(Debug)]
struct OwnedStream {
    ctx: Arc<CudaContext>,
    raw: sys::CUstream,
}

// SAFETY: a CUDA stream handle may be used from any thread; the step's lock serialises its
// uses, and the handle is destroyed once, on drop.
unsafe impl Send for OwnedStream {}

impl OwnedStream {
    fn new(ctx: &Arc<CudaContext>) -> Result<(Self, Arc<CudaStream>)> {
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

/// The step for one model (see the module docs).
#[derive(Debug)]
pub(crate) struct CudaStep {
    stream: Arc<CudaStream>,
    candle_stream: Arc<CudaStream>,
    ready: CudaEvent,
    kernels: Kernels,
    /// Owns the device memory `addrs` points into.
    _buffers: Buffers,
    addrs: Addrs,
    layout: InputLayout,
    host_inputs: Vec<u8>,
    config: ModelConfig,
    layers: Vec<LayerPtrs>,
    output_norm: u64,
    lm_head: MatVecWeight,
    cos: u64,
    sin: u64,
    use_graphs: bool,
    /// One per bucket of [`step_plan::BUCKETS`], captured after the bucket's first eager run.
    graphs: Vec<Option<Graph>>,
    report: GraphReport,
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

/// One row of a pass: its sequence, token and position, whether it wants logits, and
/// whether its greedy summary stands for them.
#[derive(Debug, Clone, Copy)]
struct PassRow {
    seq: usize,
    token: u32,
    position: u32,
    wanted: bool,
    greedy: bool,
}

/// One sequence's share of a step's pass: the tokens to append to its cache, the rows
/// it wants logits for, whether it also wants those rows' last hidden states (a
/// shortlisted draft's extra ids are projected from them), and whether each row's greedy
/// summary is all it reads.
#[derive(Debug)]
pub(crate) struct StepSeq<'a> {
    pub(crate) cache: &'a KvCache,
    pub(crate) tokens: &'a [u32],
    pub(crate) logits: LogitsFor,
    pub(crate) hidden: bool,
    pub(crate) greedy: bool,
}

/// What a step's pass gives one sequence for the rows it wanted: `rows x lm_head rows`
/// logits, or for a greedy sequence each row's summary (`duet_greedy`: index bits,
/// maximum, sum); and, where asked, `rows x hidden` last hidden states.
#[derive(Debug, Default)]
pub(crate) struct StepOut {
    pub(crate) logits: Vec<f32>,
    pub(crate) summaries: Vec<[f32; 3]>,
    pub(crate) hidden: Vec<f32>,
}

/// The rows of a pass in batch order, with the logits each sequence asked for.
fn pass_rows(seqs: &[StepSeq<'_>]) -> Vec<PassRow> {
    let mut rows = Vec::new();
    for (seq, s) in seqs.iter().enumerate() {
        let (cache, tokens) = (s.cache, s.tokens);
        let n = tokens.len();
        let first_wanted = match s.logits {
            LogitsFor::None => n,
            LogitsFor::Last => n - 1,
            LogitsFor::All => 0,
            LogitsFor::Tail(k) => n - k.min(n),
        };
        for (i, &token) in tokens.iter().enumerate() {
            rows.push(PassRow {
                seq,
                token,
                position: (cache.len() + i) as u32,
                wanted: i >= first_wanted,
                greedy: s.greedy,
            });
        }
    }
    rows
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
        let lm_head = MatVecWeight::new(&w.lm_head)?;
        let layout = InputLayout { layers: c.n_layers };
        let buffers = Buffers::new(&stream, c, lm_head.n, layout.bytes())?;
        let ptr = |s: &CudaSlice<f32>| s.device_ptr(&stream).0;
        let ptr8 = |s: &CudaSlice<u8>| s.device_ptr(&stream).0;
        let inputs = ptr8(&buffers.inputs);
        let addrs = Addrs {
            tokens: inputs + InputLayout::TOKENS as u64,
            positions: inputs + InputLayout::POSITIONS as u64,
            caches: inputs + InputLayout::CACHES as u64,
            x: ptr(&buffers.x),
            normed: ptr8(&buffers.normed),
            hidden_out: ptr(&buffers.hidden_out),
            q: ptr(&buffers.q),
            k: ptr(&buffers.k),
            v: ptr(&buffers.v),
            q_rotated: ptr(&buffers.q_rotated),
            attn: ptr(&buffers.attn),
            attn_q8: ptr8(&buffers.attn_q8),
            delta: ptr(&buffers.delta),
            gate: ptr(&buffers.gate),
            up: ptr(&buffers.up),
            act_q8: ptr8(&buffers.act_q8),
            logits: ptr(&buffers.logits),
            summaries: ptr(&buffers.summaries),
            scratch_cache: ptr(&buffers.scratch_cache),
        };
        let bias = |l: &Linear| l.bias().map_or(Ok(0), |b| dense_ptr(b, &stream));
        let layers = w
            .layers
            .iter()
            .map(|l| {
                Ok(LayerPtrs {
                    attn_norm: dense_ptr(&l.attn_norm, &stream)?,
                    q: MatVecWeight::new(&l.q)?,
                    k: MatVecWeight::new(&l.k)?,
                    v: MatVecWeight::new(&l.v)?,
                    biases: [bias(&l.q)?, bias(&l.k)?, bias(&l.v)?],
                    o: MatVecWeight::new(&l.o)?,
                    ffn_norm: dense_ptr(&l.ffn_norm, &stream)?,
                    gate: MatVecWeight::new(&l.gate)?,
                    up: MatVecWeight::new(&l.up)?,
                    down: MatVecWeight::new(&l.down)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            kernels: Kernels::load(&stream)?,
            host_inputs: vec![0; layout.bytes()],
            output_norm: dense_ptr(&w.output_norm, &stream)?,
            cos: dense_ptr(&w.cos, &stream)?,
            sin: dense_ptr(&w.sin, &stream)?,
            graphs: (0..step_plan::BUCKETS.len()).map(|_| None).collect(),
            report: GraphReport::default(),
            config: c.clone(),
            stream,
            candle_stream,
            ready,
            _buffers: buffers,
            addrs,
            layout,
            layers,
            lm_head,
            use_graphs,
            _owned_stream: owned_stream,
        })
    }

    pub(crate) fn report(&self) -> &GraphReport {
        &self.report
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
        let caches = seqs
            .iter()
            .map(|s| self.cache_ptrs(s.cache))
            .collect::<Result<Vec<_>>>()?;
        let scratch = self.scratch_ptrs();
        let rows = pass_rows(seqs);
        let any_hidden = seqs.iter().any(|s| s.hidden);
        let mut out: Vec<StepOut> = seqs.iter().map(|_| StepOut::default()).collect();
        for range in step_plan::steps(rows.len()) {
            let chunk = &rows[range];
            let bucket = step_plan::bucket_for(chunk.len());
            let step_rows: Vec<StepRow<'_>> = chunk
                .iter()
                .map(|r| StepRow {
                    token: r.token,
                    position: r.position,
                    caches: &caches[r.seq],
                })
                .collect();
            let bytes = self
                .layout
                .fill(&mut self.host_inputs, &step_rows, bucket, &scratch);
            // Kept alive until the step's stream has read it (freed on candle's stream).
            let embedded = self.embed(w, device, chunk, bucket)?;
            // SAFETY: the inputs buffer holds `bytes`; the copy is staged from host memory
            // before the call returns, so the host buffer may be refilled afterwards.
            cu(
                unsafe {
                    result::memcpy_htod_async(
                        self.addrs.tokens,
                        &self.host_inputs[..bytes],
                        self.stream.cu_stream(),
                    )
                },
                "copying the step's inputs",
            )?;
            self.run_layers(bucket)?;
            let projected = self.project(chunk, any_hidden)?;
            drop(embedded);
            let (n, h) = (self.lm_head.n, self.config.hidden);
            let wanted = chunk.iter().enumerate().filter(|(_, r)| r.wanted);
            for (at, (i, row)) in wanted.enumerate() {
                let seq = &mut out[row.seq];
                match row.greedy {
                    true => seq.summaries.push(projected.summaries[at]),
                    false => seq
                        .logits
                        .extend_from_slice(&projected.logits[at * n..(at + 1) * n]),
                }
                if seqs[row.seq].hidden {
                    seq.hidden
                        .extend_from_slice(&projected.hidden[i * h..(i + 1) * h]);
                }
            }
        }
        Ok(out)
    }

    fn cache_ptrs(&self, cache: &KvCache) -> Result<Vec<[u64; 2]>> {
        (0..self.config.n_layers)
            .map(|layer| {
                let (k, v) = cache.layer(layer);
                Ok([dense_ptr(k, &self.stream)?, dense_ptr(v, &self.stream)?])
            })
            .collect()
    }

    fn scratch_ptrs(&self) -> Vec<[u64; 2]> {
        let row = (self.config.n_kv_heads * self.config.head_dim * 4) as u64;
        (0..self.config.n_layers as u64)
            .map(|l| {
                let at = self.addrs.scratch_cache + 2 * l * row;
                [at, at + row]
            })
            .collect()
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
        let src = dense_ptr(&embedded, &self.candle_stream)?;
        cu(self.ready.record(&self.candle_stream), "recording an event")?;
        cu(self.stream.wait(&self.ready), "waiting for candle's stream")?;
        let bytes = bucket * self.config.hidden * 4;
        // SAFETY: both buffers hold `bytes`: the lookup's rows, and `x`'s first rows.
        cu(
            unsafe { result::memcpy_dtod_async(self.addrs.x, src, bytes, self.stream.cu_stream()) },
            "copying the embeddings",
        )?;
        Ok(embedded)
    }

    /// The layers for `bucket` rows: the bucket's graph where one was captured, else the
    /// launches one by one, then a capture of them for the next step of this bucket.
    fn run_layers(&mut self, bucket: usize) -> Result<()> {
        let index = step_plan::BUCKETS
            .iter()
            .position(|&b| b == bucket)
            .unwrap_or_else(|| unreachable!("{bucket} is a bucket"));
        if let Some(graph) = &self.graphs[index] {
            return cu(graph.0.launch(), "launching the step's graph");
        }
        self.enqueue_layers(bucket)?;
        if self.use_graphs && self.report.failure.is_none() {
            match self.capture(bucket) {
                Ok(graph) => {
                    self.graphs[index] = Some(Graph(graph));
                    self.report.captured += 1;
                }
                Err(reason) => self.report.failure = Some(reason),
            }
        }
        Ok(())
    }

    /// Records the bucket's launches into a graph (they do not run now). The bucket ran
    /// eagerly just before, so every kernel it launches is loaded already.
    fn capture(&self, bucket: usize) -> std::result::Result<CudaGraph, String> {
        let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        self.stream
            .begin_capture(mode)
            .map_err(|e| format!("beginning a capture of {bucket} rows: {e}"))?;
        let launched = self.enqueue_layers(bucket);
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
    /// of the logits buffer; the greedy rows' summaries (`duet_greedy`) and, where a wanted
    /// row is not greedy, the logits copied to the host; and with `hidden`, every row's last
    /// hidden state.
    fn project(&self, chunk: &[PassRow], hidden: bool) -> Result<StepOut> {
        let wanted: Vec<bool> = chunk.iter().map(|r| r.wanted).collect();
        let blocks = row_blocks(self.lm_head.k);
        let mut at = 0;
        for (first, rows) in step_plan::logits_launches(&wanted) {
            let input = self.addrs.normed + (first * blocks * Q8_1_BYTES) as u64;
            let output = self.addrs.logits + (at * self.lm_head.n * 4) as u64;
            self.mat_vec(&self.lm_head, input, output, rows);
            at += rows;
        }
        let rows = chunk.iter().filter(|r| r.wanted);
        let (any_greedy, all_greedy) = (
            rows.clone().any(|r| r.greedy),
            rows.clone().all(|r| r.greedy),
        );
        if any_greedy {
            self.summarise(at)?;
        }
        let mut out = StepOut {
            logits: vec![0f32; if all_greedy { 0 } else { at * self.lm_head.n }],
            summaries: vec![[0f32; 3]; if any_greedy { at } else { 0 }],
            hidden: vec![
                0f32;
                if hidden {
                    chunk.len() * self.config.hidden
                } else {
                    0
                }
            ],
        };
        let stream = self.stream.cu_stream();
        // SAFETY (each copy): the device buffer holds at least as many f32 as the host one.
        if !out.logits.is_empty() {
            cu(
                unsafe { result::memcpy_dtoh_async(&mut out.logits, self.addrs.logits, stream) },
                "copying logits",
            )?;
        }
        if !out.summaries.is_empty() {
            let flat = out.summaries.as_flattened_mut();
            cu(
                unsafe { result::memcpy_dtoh_async(flat, self.addrs.summaries, stream) },
                "copying greedy choices",
            )?;
        }
        if !out.hidden.is_empty() {
            cu(
                unsafe {
                    result::memcpy_dtoh_async(&mut out.hidden, self.addrs.hidden_out, stream)
                },
                "copying hidden states",
            )?;
        }
        cu(self.stream.synchronize(), "running the step")?;
        Ok(out)
    }

    /// `duet_greedy` over the first `rows` rows of the logits buffer.
    fn summarise(&self, rows: usize) -> Result<()> {
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
}

/// The step's launches, in the order of one forward pass.
impl CudaStep {
    fn enqueue_layers(&self, bucket: usize) -> Result<()> {
        let a = self.addrs;
        let c = &self.config;
        let (nq, ffn) = (c.n_heads * c.head_dim, c.ffn_hidden);
        for (index, layer) in self.layers.iter().enumerate() {
            let residual = if index == 0 { 0 } else { a.delta };
            self.add_norm(bucket, residual, layer.attn_norm, 0)?;
            self.mat_vec(&layer.q, a.normed, a.q, bucket);
            self.mat_vec(&layer.k, a.normed, a.k, bucket);
            self.mat_vec(&layer.v, a.normed, a.v, bucket);
            self.rope_append(bucket, index, layer)?;
            self.attend(bucket, index)?;
            self.per_block(&self.kernels.quantize, bucket, [a.attn, 0, a.attn_q8], nq)?;
            self.mat_vec(&layer.o, a.attn_q8, a.delta, bucket);
            self.add_norm(bucket, a.delta, layer.ffn_norm, 0)?;
            self.mat_vec(&layer.gate, a.normed, a.gate, bucket);
            self.mat_vec(&layer.up, a.normed, a.up, bucket);
            self.per_block(
                &self.kernels.silu_mul,
                bucket,
                [a.gate, a.up, a.act_q8],
                ffn,
            )?;
            self.mat_vec(&layer.down, a.act_q8, a.delta, bucket);
        }
        self.add_norm(bucket, a.delta, self.output_norm, a.hidden_out)
    }

    /// `output = input W^T` for `rows` rows of Q8_1 input, at most [`MATVEC_ROWS`] a launch.
    fn mat_vec(&self, w: &MatVecWeight, input: u64, output: u64, rows: usize) {
        let blocks = row_blocks(w.k);
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

    /// A kernel with a warp per Q8_1 block of `n` values a row (quantize, SiLU):
    /// `[input, second input or 0, Q8_1 output]`.
    fn per_block(&self, f: &CudaFunction, rows: usize, bufs: [u64; 3], n: usize) -> Result<()> {
        let (n_i, blocks) = (n as i32, row_blocks(n) as i32);
        let mut launch = self.stream.launch_builder(f);
        launch.arg(&bufs[0]);
        if bufs[1] != 0 {
            launch.arg(&bufs[1]);
        }
        launch.arg(&bufs[2]).arg(&n_i).arg(&blocks);
        let config = LaunchConfig {
            grid_dim: ((n / 32).div_ceil(8) as u32, rows as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match `duet_quantize_q8` (one input) or `duet_silu_mul_q8`
        // (two); every buffer holds `rows` rows of `n` values or their Q8_1 blocks.
        cu(
            unsafe { launch.launch(config) }.map(drop),
            "a per-block kernel",
        )
    }

    fn rope_append(&self, rows: usize, layer: usize, ptrs: &LayerPtrs) -> Result<()> {
        let c = &self.config;
        let a = &self.addrs;
        let ints = [
            layer as i32,
            c.n_layers as i32,
            c.n_heads as i32,
            c.n_kv_heads as i32,
            c.head_dim as i32,
            (c.architecture == Architecture::Llama) as i32,
        ];
        let mut launch = self.stream.launch_builder(&self.kernels.rope_append);
        launch.arg(&a.q).arg(&a.k).arg(&a.v);
        launch
            .arg(&ptrs.biases[0])
            .arg(&ptrs.biases[1])
            .arg(&ptrs.biases[2]);
        launch
            .arg(&self.cos)
            .arg(&self.sin)
            .arg(&a.positions)
            .arg(&a.caches);
        launch.arg(&ints[0]).arg(&ints[1]).arg(&a.q_rotated);
        launch
            .arg(&ints[2])
            .arg(&ints[3])
            .arg(&ints[4])
            .arg(&ints[5]);
        let config = LaunchConfig {
            grid_dim: ((c.n_heads + c.n_kv_heads) as u32, rows as u32, 1),
            block_dim: ((c.head_dim / 2) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match `duet_rope_append`; the positions lie in each row's
        // cache (checked by the caller before the pass) or at 0 of the scratch cache.
        cu(unsafe { launch.launch(config) }.map(drop), "rope_append")
    }

    fn attend(&self, rows: usize, layer: usize) -> Result<()> {
        let c = &self.config;
        let a = &self.addrs;
        let ints = [
            layer as i32,
            c.n_layers as i32,
            c.n_heads as i32,
            c.n_kv_heads as i32,
            c.head_dim as i32,
        ];
        let scale = 1.0 / (c.head_dim as f32).sqrt();
        let mut launch = self.stream.launch_builder(&self.kernels.attend);
        launch.arg(&a.q_rotated).arg(&a.caches).arg(&a.positions);
        launch.arg(&ints[0]).arg(&ints[1]).arg(&a.attn);
        launch.arg(&ints[2]).arg(&ints[3]).arg(&ints[4]).arg(&scale);
        let config = LaunchConfig {
            grid_dim: (c.n_heads as u32, rows as u32, 1),
            block_dim: (ATTN_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match `duet_attend`; each row's cache holds its positions
        // up to its own, written by this step's `rope_append` or before.
        cu(unsafe { launch.launch(config) }.map(drop), "attend")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kernel source of ours compiles with NVRTC (no GPU needed) for Ampere and
    /// Hopper, and the toolkit's `ptxas` (on PATH under `scripts/cuda-env`) assembles the
    /// PTX for each: a kernel that does not build fails here, not at a worker's first pass.
    #[test]
    fn kernels_compile_with_nvrtc_and_assemble_with_ptxas() {
        let sources = [
            ("cuda_step", KERNELS),
            ("attention", super::super::cuda::ATTENTION),
        ];
        let ptxas = std::env::var_os("PATH").and_then(|paths| {
            std::env::split_paths(&paths)
                .map(|dir| dir.join("ptxas"))
                .find(|p| p.is_file())
        });
        let dir = tempfile::tempdir().unwrap();
        for (name, source) in sources {
            for arch in ["80", "90"] {
                let options = nvrtc::CompileOptions {
                    arch: Some(if arch == "80" {
                        "compute_80"
                    } else {
                        "compute_90"
                    }),
                    ..Default::default()
                };
                let ptx = nvrtc::compile_ptx_with_opts(source, options)
                    .unwrap_or_else(|e| panic!("{name} for compute_{arch}: {e}"));
                let Some(ptxas) = &ptxas else {
                    eprintln!("no ptxas on PATH: {name} compiled, not assembled");
                    continue;
                };
                let file = dir.path().join(format!("{name}-{arch}.ptx"));
                std::fs::write(&file, ptx.to_src()).unwrap();
                let status = std::process::Command::new(ptxas)
                    .args([&format!("-arch=sm_{arch}"), "-o"])
                    .arg(dir.path().join(format!("{name}-{arch}.cubin")))
                    .arg(&file)
                    .status()
                    .unwrap();
                assert!(status.success(), "ptxas refused {name} for sm_{arch}");
            }
        }
    }
}
