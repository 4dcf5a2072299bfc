//! The transformer forward pass for speculation: N new tokens per sequence at any position,
//! logits for every new position, several sequences (sessions) in one pass.

mod attention;
pub mod config;
#[cfg(feature = "cuda")]
pub(crate) mod cuda;
#[cfg(feature = "cuda")]
mod cuda_step;
mod file;
mod greedy;
mod kernels;
mod linear;
mod lora;
mod rope;
mod shortlist;
mod step_plan;
pub(crate) mod weights;

pub use attention::AttentionKernel;
pub use config::{Architecture, ModelConfig, RopeScaling};
pub use file::{FileFacts, describe_file, file_facts};
pub use greedy::Greedy;
pub use kernels::{CPU_KERNELS, cpu_kernels};
pub use linear::MatmulPath;
pub use lora::{Adapter, name_list as adapter_names};
pub use shortlist::{ExtraLogits, MAX_EXTRA_IDS};
pub use step_plan::GraphReport;
pub use weights::LoadOptions;
pub(crate) use weights::read_content as read_gguf;

use crate::error::{EngineError, Result};
use crate::kv_cache::KvCache;
use crate::sampling::{Draw, Drawn, SamplingError};
use candle_core::{DType, Device, Tensor};
use lora::Module;
use std::path::Path;
use std::sync::Arc;
use weights::Weights;

/// A loaded model: immutable weights shared by every session. Cloning is cheap (`Arc`).
#[derive(Debug, Clone)]
pub struct Model {
    inner: Arc<Inner>,
    kernel: AttentionKernel,
    /// On CUDA, the invariant path takes the CUDA step (`cuda_step`) where the model can.
    cuda_step: bool,
}

#[derive(Debug)]
struct Inner {
    config: ModelConfig,
    weights: Weights,
    device: Device,
    /// On CUDA, the decode and verify step, built at the first pass on the invariant path
    /// (or why this model cannot take it).
    #[cfg(feature = "cuda")]
    step: std::sync::Mutex<Option<std::result::Result<cuda_step::CudaStep, String>>>,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    cuda_graphs: bool,
}

/// Which positions of a sequence need logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsFor {
    /// None: prefill whose last token is fed again later (saves the vocabulary projection).
    None,
    /// Only the last new token (plain decoding, prompt prefill).
    Last,
    /// Every new token.
    All,
    /// The last `n` new tokens (verification: the last appended token and the drafts).
    Tail(usize),
}

/// One sequence's share of a forward pass: its cache and the tokens to append to it.
#[derive(Debug)]
pub struct SequenceInput<'a> {
    pub cache: &'a mut KvCache,
    pub tokens: &'a [u32],
    pub logits: LogitsFor,
    /// With a shortlisted model: the session's extra ids, whose logits are added.
    pub extra: Option<&'a ExtraLogits>,
    /// Only each requested row's greedy choice is read ([`Logits::greedy`]). On CUDA the
    /// rows' logits then stay on the GPU, which gives the choice alone, and
    /// [`Logits::row`] has nothing to show.
    pub greedy: bool,
    /// With `greedy` false, one draw for each row of logits asked for (or none): the token
    /// drawn from each row is all that is read ([`Logits::drawn`]). On CUDA, with
    /// `DUET_CUDA_DRAW=1` (off until a GPU has run it), the GPU then draws them and the rows
    /// stay there; elsewhere the rows come back and the draws are made from them.
    pub draws: &'a [Draw],
    /// Empty: the tokens follow one another (a chain). Otherwise a tree of tokens, one
    /// entry per token: token `i > 0` follows token `parents[i] < i` (entry 0, which
    /// follows the cache, is 0). Each token then sits at the position after its parent's
    /// and attends to the cache and its own ancestors only, so its logits equal those of
    /// its path fed as a chain ([`Model::verifies_trees`]). The cache keeps every token's
    /// row in input order; [`KvCache::keep_path`] keeps one path of them afterwards.
    pub parents: &'a [u32],
}

impl<'a> SequenceInput<'a> {
    /// `tokens` appended to `cache` as a chain, with the `logits` asked for as whole rows
    /// (no extra ids, no draws).
    pub fn chain(cache: &'a mut KvCache, tokens: &'a [u32], logits: LogitsFor) -> Self {
        Self {
            cache,
            tokens,
            logits,
            extra: None,
            greedy: false,
            draws: &[],
            parents: &[],
        }
    }
}

/// Logits rows for one sequence, `rows × vocab`, row `i` for the i-th requested position;
/// or, for a greedy sequence on CUDA, each row's greedy choice alone.
#[derive(Debug, Clone, PartialEq)]
pub struct Logits {
    data: Vec<f32>,
    vocab: usize,
    /// The rows as summaries (where `data` is empty): see [`SequenceInput::greedy`].
    summaries: Vec<greedy::Summary>,
    /// Each row as the token drawn from it (where `data` is empty): see
    /// [`SequenceInput::draws`].
    drawn: Vec<Result<Drawn, SamplingError>>,
}

impl Logits {
    fn full(data: Vec<f32>, vocab: usize) -> Self {
        Self {
            data,
            vocab,
            summaries: Vec::new(),
            drawn: Vec::new(),
        }
    }

    pub fn rows(&self) -> usize {
        match (self.summaries.len(), self.drawn.len()) {
            (0, 0) => self.data.len().checked_div(self.vocab).unwrap_or(0),
            (0, n) | (n, _) => n,
        }
    }

    /// Row `i`'s logits. Panics for the rows of a greedy sequence on CUDA, which come as
    /// their greedy choice alone ([`Logits::greedy`]), and for a row the GPU drew from
    /// ([`Logits::drawn`]).
    pub fn row(&self, i: usize) -> &[f32] {
        assert!(
            self.summaries.is_empty(),
            "a greedy sequence's rows on CUDA have no logits: read Logits::greedy"
        );
        assert!(
            self.drawn.is_empty(),
            "a row drawn from on CUDA has no logits: read Logits::drawn"
        );
        &self.data[i * self.vocab..(i + 1) * self.vocab]
    }

    /// The token `draw` (row `i`'s of the sequence's [`SequenceInput::draws`]) takes from
    /// row `i`: the GPU's where it drew it, else drawn from the row here.
    pub fn drawn(&self, i: usize, draw: &Draw) -> Result<Drawn, SamplingError> {
        match self.drawn.get(i) {
            Some(drawn) => drawn.clone(),
            None => draw.of_row(self.row(i)),
        }
    }

    pub fn last(&self) -> Option<&[f32]> {
        self.rows().checked_sub(1).map(|i| self.row(i))
    }

    /// Every row's logits, copied. Panics where [`Logits::row`] does.
    pub fn to_rows(&self) -> Vec<Vec<f32>> {
        (0..self.rows()).map(|i| self.row(i).to_vec()).collect()
    }

    /// Row `i`'s greedy token and its probability (`sampling::argmax_probability`).
    pub fn greedy(&self, i: usize) -> Result<Greedy, SamplingError> {
        match self.summaries.get(i) {
            Some(summary) => summary.greedy(),
            None => Greedy::of_row(self.row(i)),
        }
    }

    /// Row `i`'s greedy token alone (`sampling::argmax`: from a whole row, no softmax).
    pub fn greedy_token(&self, i: usize) -> Result<u32, SamplingError> {
        match self.summaries.get(i) {
            Some(summary) => summary.greedy().map(|g| g.token),
            None => crate::sampling::argmax(self.row(i)),
        }
    }

    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// Whether the rows come as a few bytes a row to read, their greedy summaries (a greedy
    /// sequence on CUDA) or the token drawn from the row (a draw the GPU made), not whole
    /// rows of the vocabulary.
    pub fn summarized(&self) -> bool {
        !self.summaries.is_empty() || !self.drawn.is_empty()
    }
}

impl Model {
    /// Loads a GGUF file of a supported architecture.
    pub fn load(path: &Path, options: &LoadOptions) -> Result<Self> {
        let (content, mut file) = weights::read_content(path)?;
        let config = ModelConfig::from_gguf(&content)?;
        let weights = weights::load_weights(&content, &mut file, &config, options)?;
        Ok(Self {
            kernel: AttentionKernel::default_for(&options.device),
            cuda_step: std::env::var("DUET_CUDA_STEP").map_or(true, |v| v != "off"),
            inner: Arc::new(Inner {
                config,
                weights,
                device: options.device.clone(),
                #[cfg(feature = "cuda")]
                step: std::sync::Mutex::new(None),
                cuda_graphs: options.cuda_graphs,
            }),
        })
    }

    /// The same weights with another attention kernel (to compare kernels in tests).
    pub fn with_attention_kernel(&self, kernel: AttentionKernel) -> Result<Self> {
        if kernel == AttentionKernel::Host && !self.inner.device.is_cpu() {
            return Err(EngineError::Device(
                format!("{:?}", self.inner.device),
                "the host attention kernel needs CPU tensors".to_string(),
            ));
        }
        Ok(Self {
            inner: self.inner.clone(),
            kernel,
            cuda_step: self.cuda_step,
        })
    }

    /// The same weights with the CUDA step on or off: off, the invariant path runs on
    /// candle's ops (to compare the two in tests and benchmarks). On by default, unless
    /// `DUET_CUDA_STEP=off` was set at load. Nothing changes off CUDA.
    pub fn with_cuda_step(&self, on: bool) -> Self {
        Self {
            cuda_step: on,
            ..self.clone()
        }
    }

    pub fn config(&self) -> &ModelConfig {
        &self.inner.config
    }

    pub fn device(&self) -> &Device {
        &self.inner.device
    }

    /// Adds the ids of `tokens` (a session's prompt, or text it appends) that the model's
    /// shortlist lacks to the session's `extra` ids, up to [`MAX_EXTRA_IDS`]: a draft then
    /// also proposes the rare tokens its own text holds. Nothing without a shortlist.
    pub fn extend_shortlist(&self, extra: &mut ExtraLogits, tokens: &[u32]) -> Result<()> {
        match &self.inner.weights.shortlist {
            Some(shortlist) => shortlist.extend(extra, tokens),
            None => Ok(()),
        }
    }

    /// Whether a token's keys and values come out bitwise the same whatever pass computed
    /// them: a prompt's prefill in any chunks, or decode and verification beside any other
    /// rows. Only then may a session start from rows another session computed (the
    /// workers' prefix cache) and still hold exactly what it would have computed itself.
    /// True on the CPU where the host attention kernel runs and every layer's projections
    /// are row-invariant on both paths; false on a GPU, where prefill goes through candle's
    /// kernels, which it picks by row count.
    pub fn kv_rows_invariant(&self) -> bool {
        let layers_invariant = self.inner.weights.layers.iter().all(|l| {
            let linears = l.qkv.linears().chain(l.gate_up.linears());
            linears
                .chain([&l.o, &l.down])
                .all(|p| p.same_on_every_path())
        });
        self.inner.device.is_cpu() && self.kernel == AttentionKernel::Host && layers_invariant
    }

    /// A new, empty KV cache for one session, holding at most `capacity` tokens.
    pub fn new_cache(&self, capacity: usize) -> Result<KvCache> {
        self.new_adapted_cache(capacity, None)
    }

    /// Reads the LoRA adapter at `path` (PEFT's format) for this model, as `name`, its
    /// deltas on the model's device. On a GPU only where the model runs the CUDA step,
    /// which adds the deltas of its passes (candle's ops there keep no batch invariance
    /// for them), and up to the step's largest rank.
    pub fn load_adapter(&self, name: &str, path: &Path) -> Result<Arc<Adapter>> {
        let refused = |reason: String| EngineError::Adapter {
            path: path.to_path_buf(),
            reason,
        };
        if let Some(why) = self.adapters_refused() {
            return Err(refused(why));
        }
        let adapter = Adapter::load(name, path, &self.inner.config)?;
        #[cfg(feature = "cuda")]
        if !self.inner.device.is_cpu() && adapter.max_rank() > cuda_step::LORA_MAX_RANK {
            let (rank, max) = (adapter.max_rank(), cuda_step::LORA_MAX_RANK);
            return Err(refused(format!("rank {rank} is over the GPU's {max}")));
        }
        Ok(Arc::new(adapter.placed(&self.inner.device)?))
    }

    /// Why this model runs no LoRA adapter, if it does not: off the CPU, without the CUDA
    /// step.
    pub fn adapters_refused(&self) -> Option<String> {
        let device = &self.inner.device;
        if device.is_cpu() {
            return None;
        }
        #[cfg(feature = "cuda")]
        if device.is_cuda() {
            let (c, w) = (&self.inner.config, &self.inner.weights);
            let why = match cuda_step::unsupported(c, w) {
                None if self.cuda_step => return None,
                None => "the CUDA step is off".to_string(),
                Some(reason) => reason,
            };
            return Some(format!("adapters on a GPU run on the CUDA step ({why})"));
        }
        Some(format!(
            "adapters run on the CPU and CUDA (this model is on {device:?})"
        ))
    }

    /// [`Model::new_cache`] for a session of `adapter` (from [`Model::load_adapter`]): every
    /// pass over the cache adds the adapter's deltas to its rows.
    pub fn new_adapted_cache(
        &self,
        capacity: usize,
        adapter: Option<Arc<Adapter>>,
    ) -> Result<KvCache> {
        let c = &self.inner.config;
        if capacity > c.context_length {
            return Err(EngineError::CapacityTooLarge {
                requested: capacity,
                max: c.context_length,
            });
        }
        KvCache::new(
            c.n_layers,
            c.n_kv_heads,
            c.head_dim,
            capacity,
            &self.inner.device,
            adapter,
        )
    }

    /// Appends `tokens` to one sequence and returns the requested logits.
    pub fn forward(
        &self,
        cache: &mut KvCache,
        tokens: &[u32],
        logits: LogitsFor,
    ) -> Result<Logits> {
        self.forward_one(cache, tokens, logits, MatmulPath::Invariant)
    }

    /// Ingests a prompt on the throughput path (see [`MatmulPath`]): deterministic, and where
    /// our CPU kernels run (AVX-512 VNNI) bitwise equal to [`Model::forward`]; elsewhere
    /// candle's faster prefill kernels round differently from `forward`. Use it for every
    /// session's prompt and `forward` for everything after, and target-only and speculative
    /// runs see identical caches either way.
    pub fn prefill(
        &self,
        cache: &mut KvCache,
        tokens: &[u32],
        logits: LogitsFor,
    ) -> Result<Logits> {
        self.forward_one(cache, tokens, logits, MatmulPath::Throughput)
    }

    fn forward_one(
        &self,
        cache: &mut KvCache,
        tokens: &[u32],
        logits: LogitsFor,
        path: MatmulPath,
    ) -> Result<Logits> {
        let mut seqs = [SequenceInput::chain(cache, tokens, logits)];
        Ok(self.forward_batch_with(&mut seqs, path)?.remove(0))
    }

    /// [`Model::forward_batch_with`] on the batch-invariant path.
    pub fn forward_batch(&self, seqs: &mut [SequenceInput<'_>]) -> Result<Vec<Logits>> {
        self.forward_batch_with(seqs, MatmulPath::Invariant)
    }

    /// One forward pass over several sequences: their tokens share every matrix multiplication,
    /// while rotary positions and attention stay per sequence. Each cache grows by its
    /// sequence's token count; on error no cache changes.
    pub fn forward_batch_with(
        &self,
        seqs: &mut [SequenceInput<'_>],
        path: MatmulPath,
    ) -> Result<Vec<Logits>> {
        let c = &self.inner.config;
        for s in seqs.iter() {
            if s.tokens.is_empty() {
                return Err(EngineError::EmptyInput);
            }
            if !s.cache.matches(c.n_layers, c.n_kv_heads, c.head_dim) {
                return Err(EngineError::CacheMismatch);
            }
            s.cache.check_room(s.tokens.len())?;
            if s.cache
                .adapter()
                .is_some_and(|a| !a.runs_on(&self.inner.device))
            {
                let why = "a cache with a LoRA adapter loaded for another device";
                return Err(EngineError::Device(
                    format!("{:?}", self.inner.device),
                    why.into(),
                ));
            }
            if !s.parents.is_empty() && s.parents.len() != s.tokens.len() {
                let why = format!("{} parents for {} tokens", s.parents.len(), s.tokens.len());
                return Err(EngineError::BadTree(why));
            }
            // Off the CPU only the invariant path (the CUDA step) follows a tree's paths.
            let tree_ok = || {
                (path == MatmulPath::Invariant || self.inner.device.is_cpu())
                    && self.verifies_trees()
            };
            if !s.parents.is_empty() && !tree_ok() {
                let why = "this device verifies chains only (Model::verifies_trees)";
                return Err(EngineError::BadTree(why.into()));
            }
            if let Some(&token) = s.tokens.iter().find(|&&t| t as usize >= c.vocab) {
                return Err(EngineError::TokenOutOfRange {
                    token,
                    vocab: c.vocab,
                });
            }
        }
        #[cfg(feature = "cuda")]
        if path == MatmulPath::Invariant
            && let Some(out) = self.forward_cuda_step(seqs)?
        {
            return Ok(out);
        }
        self.forward_candle(seqs, path)
    }

    /// What the CUDA step did with graphs: `None` off CUDA, before the step's first pass,
    /// or where the model runs without the step.
    pub fn cuda_graphs(&self) -> Option<GraphReport> {
        #[cfg(feature = "cuda")]
        if let Some(Ok(step)) = &*self.inner.step.lock().unwrap_or_else(|e| e.into_inner()) {
            return Some(step.report());
        }
        None
    }

    /// The pass on the CUDA step (`cuda_step`), where the model is on a GPU and can take
    /// it; `None` elsewhere.
    #[cfg(feature = "cuda")]
    fn forward_cuda_step(&self, seqs: &mut [SequenceInput<'_>]) -> Result<Option<Vec<Logits>>> {
        let Device::Cuda(device) = &self.inner.device else {
            return Ok(None);
        };
        if !self.cuda_step {
            return Ok(None);
        }
        let (c, w) = (&self.inner.config, &self.inner.weights);
        let mut state = self.inner.step.lock().unwrap_or_else(|e| e.into_inner());
        if state.is_none() {
            *state = Some(match cuda_step::unsupported(c, w) {
                Some(reason) => Err(reason),
                None => Ok(cuda_step::CudaStep::new(
                    c,
                    w,
                    device,
                    self.inner.cuda_graphs,
                )?),
            });
        }
        let Some(Ok(step)) = state.as_mut() else {
            return Ok(None);
        };
        let inputs: Vec<_> = seqs
            .iter()
            .map(|s| cuda_step::StepSeq {
                cache: &*s.cache,
                tokens: s.tokens,
                parents: s.parents,
                logits: s.logits,
                hidden: w.shortlist.is_some() && s.extra.is_some(),
                greedy: s.greedy,
                // A shortlisted row is not the vocabulary's: its draws are made whole.
                draws: match w.shortlist {
                    None => s.draws,
                    Some(_) => &[],
                },
            })
            .collect();
        let results = step.forward(w, &self.inner.device, &inputs)?;
        drop(state);
        let out = seqs
            .iter()
            .zip(results)
            .map(|(s, result)| self.step_logits(s, result))
            .collect::<Result<Vec<_>>>()?;
        for s in seqs.iter_mut() {
            s.cache.commit(s.tokens);
        }
        Ok(Some(out))
    }

    /// A sequence's logits from what the step gave it: a shortlisted model's rows widened
    /// to the vocabulary (and its extra ids' logits added), or their greedy summaries
    /// mapped to token ids (and merged with the extra ids').
    #[cfg(feature = "cuda")]
    fn step_logits(&self, s: &SequenceInput<'_>, result: cuda_step::StepOut) -> Result<Logits> {
        let (c, w) = (&self.inner.config, &self.inner.weights);
        let rows = result.hidden.len() / c.hidden;
        let extra = match (s.extra, &w.shortlist, rows > 0) {
            (Some(extra), Some(_), true) => {
                let h = Tensor::from_vec(result.hidden, (rows, c.hidden), &self.inner.device)?;
                extra
                    .logits(&h, MatmulPath::Invariant)?
                    .map(|x| (extra.ids(), x))
            }
            _ => None,
        };
        if !result.drawn.is_empty() {
            return Ok(Logits {
                data: Vec::new(),
                vocab: c.vocab,
                summaries: Vec::new(),
                drawn: result.drawn,
            });
        }
        if !s.greedy {
            let data = match &w.shortlist {
                Some(shortlist) => {
                    let mut wide = shortlist.widen(&result.logits, c.vocab);
                    if let Some((ids, x)) = &extra {
                        shortlist::scatter(x, ids, &mut wide, c.vocab);
                    }
                    wide
                }
                None => result.logits,
            };
            return Ok(Logits::full(data, c.vocab));
        }
        let id = |i: usize| match &w.shortlist {
            Some(shortlist) => shortlist.ids[i],
            None => i as u32,
        };
        let mut summaries: Vec<greedy::Summary> = result
            .summaries
            .iter()
            .map(|&raw| greedy::Summary::from_kernel(raw, id))
            .collect();
        if let Some((ids, x)) = &extra {
            for (summary, row) in summaries.iter_mut().zip(x.chunks_exact(ids.len())) {
                *summary = summary.merge(greedy::Summary::of(row, |j| ids[j]));
            }
        }
        Ok(Logits {
            data: Vec::new(),
            vocab: c.vocab,
            summaries,
            drawn: Vec::new(),
        })
    }

    /// Whether a pass on the batch-invariant path may take a tree of tokens
    /// (`SequenceInput::parents`) with each token's logits equal to its path's as a chain.
    /// On the CPU both attention kernels follow a row's ancestors with a chain's arithmetic,
    /// and on a GPU the CUDA step's attention does (`step_plan::RowKeys`); candle's ops on a
    /// GPU, where the step is off or cannot take the model, verify chains only.
    pub fn verifies_trees(&self) -> bool {
        if self.inner.device.is_cpu() {
            return true;
        }
        #[cfg(feature = "cuda")]
        if self.inner.device.is_cuda() && self.cuda_step {
            return cuda_step::unsupported(&self.inner.config, &self.inner.weights).is_none();
        }
        false
    }

    /// Whether a pass makes the draws a sequence asks for ([`SequenceInput::draws`]) where
    /// its rows are, so that they need not come back: the CUDA step with `DUET_CUDA_DRAW=1`
    /// on a model of the whole vocabulary. Elsewhere the rows come back and the draws are
    /// made from them, so a caller whose rows serve it as well may skip taking them ahead.
    pub fn draws_where_rows_are(&self) -> bool {
        #[cfg(feature = "cuda")]
        if self.inner.device.is_cuda() && self.cuda_step && self.inner.weights.shortlist.is_none() {
            let (c, w) = (&self.inner.config, &self.inner.weights);
            return cuda_step::draws_wanted() && cuda_step::unsupported(c, w).is_none();
        }
        false
    }

    /// The pass on candle's ops (and on the CPU, our kernels).
    fn forward_candle(
        &self,
        seqs: &mut [SequenceInput<'_>],
        path: MatmulPath,
    ) -> Result<Vec<Logits>> {
        let c = &self.inner.config;
        let w = &self.inner.weights;
        let dev = &self.inner.device;
        let (ids, positions, spans) = batch_rows(seqs)?;
        let total = ids.len();
        let plan = attention::Plan::new(c, self.kernel, path, spans, dev)?;
        let spans = plan.spans();
        let adapted: Vec<_> = (seqs.iter().zip(spans))
            .filter_map(|(s, span)| Some((span.row, span.len, &**s.cache.adapter()?)))
            .collect();
        let ids = Tensor::from_vec(ids, total, dev)?;
        let positions = Tensor::from_vec(positions, total, dev)?;
        let half = c.head_dim / 2;
        let cos = w
            .cos
            .index_select(&positions, 0)?
            .reshape((total, 1, half))?;
        let sin = w
            .sin
            .index_select(&positions, 0)?
            .reshape((total, 1, half))?;
        let rope = |x: Tensor, heads: usize| -> Result<Tensor> {
            let x = x.reshape((total, heads, 1, c.head_dim))?;
            let x = match c.architecture.interleaved_rope() {
                false => candle_nn::rotary_emb::rope(&x, &cos, &sin)?,
                true => candle_nn::rotary_emb::rope_i(&x, &cos, &sin)?,
            };
            Ok(x.reshape((total, heads, c.head_dim))?)
        };
        let eps = c.rms_eps as f32;

        let mut x = w.embedding.embedding(&ids)?;
        for (index, layer) in w.layers.iter().enumerate() {
            let h = candle_nn::ops::rms_norm(&x, &layer.attn_norm, eps)?;
            let [q, k, v] = layer.qkv.forward(&h, path)?;
            let qkv = [(Module::Q, q), (Module::K, k), (Module::V, v)];
            let [q, k, v] = lora::with_deltas(&adapted, index, &h, qkv)?;
            let (q, k) = match &layer.head_norms {
                Some([q_norm, k_norm]) => {
                    let norm = |x: Tensor, heads, w| -> Result<Tensor> {
                        let x = x.reshape((total, heads, c.head_dim))?;
                        Ok(candle_nn::ops::rms_norm(&x, w, eps)?)
                    };
                    (norm(q, c.n_heads, q_norm)?, norm(k, c.n_kv_heads, k_norm)?)
                }
                None => (q, k),
            };
            let q = rope(q, c.n_heads)?;
            let k = rope(k, c.n_kv_heads)?;
            let v = v.reshape((total, c.n_kv_heads, c.head_dim))?;
            for (s, span) in seqs.iter().zip(spans) {
                s.cache.write(
                    index,
                    &k.narrow(0, span.row, span.len)?,
                    &v.narrow(0, span.row, span.len)?,
                )?;
            }
            let caches: Vec<_> = seqs.iter().map(|s| s.cache.layer(index)).collect();
            let attn = plan.attend(c, &q, &caches)?;
            let o = layer.o.forward(&attn, path)?;
            let [o] = lora::with_deltas(&adapted, index, &attn, [(Module::O, o)])?;
            x = (x + o)?;
            x = Self::mlp(layer, index, x, eps, &adapted, path)?;
        }

        let out = self.logits_candle(seqs, spans, &x, path)?;
        for s in seqs.iter_mut() {
            s.cache.commit(s.tokens);
        }
        Ok(out)
    }

    /// `x` through layer `index`'s feed-forward block (SwiGLU), the rows of `adapted`
    /// sequences with their adapters' deltas.
    fn mlp(
        layer: &weights::Layer,
        index: usize,
        x: Tensor,
        eps: f32,
        adapted: &lora::AdaptedRows<'_>,
        path: MatmulPath,
    ) -> Result<Tensor> {
        let h = candle_nn::ops::rms_norm(&x, &layer.ffn_norm, eps)?;
        let [gate, up] = layer.gate_up.forward(&h, path)?;
        let gate_up = [(Module::Gate, gate), (Module::Up, up)];
        let [gate, up] = lora::with_deltas(adapted, index, &h, gate_up)?;
        let act = (candle_nn::ops::silu(&gate)? * up)?;
        let down = layer.down.forward(&act, path)?;
        let [down] = lora::with_deltas(adapted, index, &act, [(Module::Down, down)])?;
        Ok((x + down)?)
    }

    /// The logits each sequence asked for, from the last layer's output `x`. Only those rows
    /// are projected: the vocabulary matmul is the largest one.
    fn logits_candle(
        &self,
        seqs: &[SequenceInput<'_>],
        spans: &[attention::Span],
        x: &Tensor,
        path: MatmulPath,
    ) -> Result<Vec<Logits>> {
        let c = &self.inner.config;
        let w = &self.inner.weights;
        let dev = &self.inner.device;
        let eps = c.rms_eps as f32;
        let mut rows = Vec::new();
        let mut counts = Vec::with_capacity(seqs.len());
        for (s, span) in seqs.iter().zip(spans) {
            let wanted = match s.logits {
                LogitsFor::None => 0..0,
                LogitsFor::Last => span.len - 1..span.len,
                LogitsFor::All => 0..span.len,
                LogitsFor::Tail(n) => span.len - n.min(span.len)..span.len,
            };
            counts.push(wanted.len());
            rows.extend(wanted.map(|i| (span.row + i) as u32));
        }
        let mut out = Vec::with_capacity(seqs.len());
        let mut data = if rows.is_empty() {
            Vec::new()
        } else {
            let n = rows.len();
            let rows = Tensor::from_vec(rows, n, dev)?;
            let h = x.index_select(&rows, 0)?;
            let h = candle_nn::ops::rms_norm(&h, &w.output_norm, eps)?;
            let data = w
                .lm_head
                .forward(&h, path)?
                .to_dtype(DType::F32)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            match &w.shortlist {
                Some(shortlist) => {
                    let mut wide = shortlist.widen(&data, c.vocab);
                    let mut row = 0;
                    for (s, &count) in seqs.iter().zip(&counts) {
                        if let Some(extra) = s.extra.filter(|_| count > 0) {
                            let out = &mut wide[row * c.vocab..(row + count) * c.vocab];
                            extra.project(&h.narrow(0, row, count)?, path, out, c.vocab)?;
                        }
                        row += count;
                    }
                    wide
                }
                None => data,
            }
        };
        for count in counts.iter().rev() {
            let tail = data.split_off(data.len() - count * c.vocab);
            out.push(Logits::full(tail, c.vocab));
        }
        out.reverse();
        Ok(out)
    }
}

/// A pass's rows, sequence after sequence: each row's token and position (a tree's token
/// one past its parent's), and each sequence's span of rows.
fn batch_rows(seqs: &[SequenceInput<'_>]) -> Result<(Vec<u32>, Vec<u32>, Vec<attention::Span>)> {
    let mut ids = Vec::new();
    let mut positions = Vec::new();
    let mut spans = Vec::with_capacity(seqs.len());
    for s in seqs {
        let start = s.cache.len();
        let paths = match s.parents {
            [] => None,
            parents => Some(attention::tree_paths(parents, start)?),
        };
        match &paths {
            Some(paths) => positions.extend(paths.iter().map(|p| (start + p.len() - 1) as u32)),
            None => positions.extend((start..start + s.tokens.len()).map(|p| p as u32)),
        }
        spans.push(attention::Span {
            row: ids.len(),
            len: s.tokens.len(),
            start,
            paths,
        });
        ids.extend_from_slice(s.tokens);
    }
    Ok((ids, positions, spans))
}
