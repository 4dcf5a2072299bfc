//! Test support: writes tiny random-weight GGUF models (a real file with real metadata and a
//! byte-level BPE tokenizer) so fast tests exercise the same loading and forward code as the
//! real models. Also used by the services' tests.

use crate::error::{EngineError, Result};
use crate::model::{Architecture, LoadOptions, LogitsFor, Model};
use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use rand::{Rng, SeedableRng};
use std::path::{Path, PathBuf};

/// Q5_0 tensor data as Q8_0 data with the same scales and values (the transcode the CPU
/// path's loading does), for tests that load a model some other way.
pub fn q5_0_to_q8_0(data: &[u8]) -> Vec<u8> {
    crate::model::weights::q5_0_blocks_to_q8_0(data)
}

/// `file` in the model cache `scripts/fetch-models` fills (`crate::cached_model_path`); it
/// must be there.
pub fn cached_model(file: &str) -> PathBuf {
    let path = crate::cached_model_path(file);
    assert!(
        path.exists(),
        "{} is missing: run scripts/fetch-models (or scripts/test, which does)",
        path.display()
    );
    path
}

/// The device tests run their models on: `DUET_TEST_DEVICE` (`cpu` when unset; `cuda` needs
/// a build with `--features duet-engine/cuda`), so the same tests check a GPU.
pub fn test_device() -> String {
    std::env::var("DUET_TEST_DEVICE").unwrap_or_else(|_| "cpu".into())
}

/// The logits of every token of `tokens` after the first `prefix`: the prefix in one pass
/// (no logits; none when `prefix` is 0), the rest fed `chunk` tokens a pass. Comparing chunk
/// sizes checks that a row's logits do not depend on the rows fed with it.
pub fn logits_after_prefix(
    model: &Model,
    tokens: &[u32],
    prefix: usize,
    chunk: usize,
) -> Vec<Vec<f32>> {
    let mut cache = model
        .new_cache(tokens.len())
        .expect("a cache for the tokens");
    if prefix > 0 {
        model
            .forward(&mut cache, &tokens[..prefix], LogitsFor::None)
            .expect("the prefix");
    }
    let rows = chunked_logits(model, &mut cache, &tokens[prefix..], chunk);
    assert_eq!(cache.len(), tokens.len(), "the cache holds every token");
    rows
}

/// The logits of every token of `tokens` appended to `cache` (an adapted one, say),
/// `chunk` tokens a pass.
pub fn chunked_logits(
    model: &Model,
    cache: &mut crate::KvCache,
    tokens: &[u32],
    chunk: usize,
) -> Vec<Vec<f32>> {
    let mut rows = Vec::new();
    for part in tokens.chunks(chunk) {
        let logits = model.forward(cache, part, LogitsFor::All).expect("a chunk");
        assert_eq!(logits.rows(), part.len(), "a row of logits per token");
        rows.extend(logits.to_rows());
    }
    rows
}

/// The sampling settings draws made another way are checked at (`check_drawn`): a plain
/// temperature, min-p, top-k from one token to more than the vocabulary, top-p down to
/// 0.01, and top-k and top-p together.
pub fn draw_settings() -> Vec<crate::sampling::SamplingParams> {
    let settings = [
        // temperature, min_p, top_k, top_p
        (0.7, 0.0, 0, 1.0),
        (1.7, 0.0, 0, 1.0),
        (1.0, 0.05, 0, 1.0),
        (0.8, 0.0, 40, 1.0),
        (1.0, 0.0, 1, 1.0),
        (0.8, 0.0, 0, 0.9),
        (0.9, 0.0, 0, 0.01),
        (1.2, 0.02, 20, 0.8),
        (0.6, 0.0, 5, 0.5),
        (1.5, 0.0, 1_000_000, 0.99),
    ];
    (settings.into_iter())
        .map(
            |(temperature, min_p, top_k, top_p)| crate::sampling::SamplingParams {
                temperature,
                min_p,
                top_k,
                top_p,
                seed: 0,
            },
        )
        .collect()
}

/// A row of `n` logits from a seeded generator, for the draw kernels' tests: spread like a
/// model's, a third of them on a coarse grid (ties), a few NaN and -inf.
pub fn logit_row(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = crate::sampling::rng_for(seed);
    (0..n)
        .map(|i| {
            let v: f64 = rng.random_range(-6.0..6.0) + if i % 97 == 5 { 9.0 } else { 0.0 };
            match i % 211 {
                7 => f32::NAN,
                11 => f32::NEG_INFINITY,
                j if j % 3 == 0 => ((v * 4.0).round() / 4.0) as f32,
                _ => v as f32,
            }
        })
        .collect()
}

/// Checks `got`, `draw` made from `row` another way (a GPU's, the kernel's algorithm on the
/// host), against the host sampler's draw from `row`: the same token with its probability
/// and the left-out token's within `tolerance`, or another token only by rounding (the
/// sampler's running sum up to the later of the two within 1e-6 of where the uniform
/// points). Panics, saying `at`, otherwise; returns whether the tokens part at an edge.
pub fn check_drawn(
    row: &[f32],
    draw: &crate::sampling::Draw,
    got: crate::sampling::Drawn,
    tolerance: f32,
    at: &str,
) -> bool {
    let want = draw.of_row(row).expect("a usable row");
    if let Some(edge) = proposals_differ(&got, &want, tolerance, at) {
        return edge;
    }
    if got.token == want.token {
        let close = |a: f32, b: f32| (a - b).abs() <= tolerance;
        let probabilities =
            close(got.probability, want.probability) && close(got.excluded, want.excluded);
        assert!(probabilities, "{at}: {got:?} against {want:?}");
        return false;
    }
    let (p, _) = draw.distribution(row).expect("a usable row");
    let total: f64 = p.probs().iter().map(|&x| f64::from(x)).sum();
    let edge: f64 = (p.iter())
        .filter(|&(id, _)| id < got.token.max(want.token))
        .map(|(_, x)| f64::from(x))
        .sum();
    assert!(
        (edge - draw.uniform * total).abs() < 1e-6,
        "{at}: {got:?} against {want:?}"
    );
    true
}

/// For a proposal's draws: `None` where `got`'s proposal is `want`'s (as
/// [`check_proposal`] holds them), the tokens then to compare; `Some(true)` where the two
/// kept other tokens. Panics, saying `at`, otherwise.
fn proposals_differ(
    got: &crate::sampling::Drawn,
    want: &crate::sampling::Drawn,
    tolerance: f32,
    at: &str,
) -> Option<bool> {
    match (&got.proposal, &want.proposal) {
        (None, None) => None,
        (Some(g), Some(w)) => check_proposal(g, w, tolerance, at).then_some(true),
        _ => panic!("{at}: {got:?} against {want:?}"),
    }
}

/// Checks `got`, a proposal made another way (a GPU's, the kernel's algorithm on the host),
/// against the host's `want` (`proposal_distribution`): the same tokens, each probability
/// within `tolerance`, or other tokens only where the tail's floor fell otherwise by
/// rounding: what either keeps alone is then within the tail's share of its mass. Panics,
/// saying `at`, otherwise; returns whether they kept other tokens.
pub fn check_proposal(
    got: &crate::sampling::Distribution,
    want: &crate::sampling::Distribution,
    tolerance: f32,
    at: &str,
) -> bool {
    if got.ids() == want.ids() {
        let mut probs = got.probs().iter().zip(want.probs());
        let close = probs.all(|(a, b)| (a - b).abs() <= tolerance);
        assert!(close, "{at}: {got:?} against {want:?}");
        return false;
    }
    let alone = |a: &crate::sampling::Distribution, b: &crate::sampling::Distribution| {
        let only = a.iter().filter(|&(id, _)| b.prob(id) == 0.0);
        only.map(|(_, p)| f64::from(p)).sum::<f64>()
    };
    let tail = 2.0 * crate::sampling::PROPOSAL_TAIL;
    let edge = alone(got, want) <= tail && alone(want, got) <= tail;
    assert!(edge, "{at}: {got:?} against {want:?}");
    true
}

/// Load options for tests: the models on [`test_device`], with CUDA graphs (as workers run
/// them) unless `DUET_TEST_CUDA_GRAPHS=off`.
pub fn test_load_options() -> LoadOptions {
    let name = test_device();
    LoadOptions {
        device: crate::select_device(&name)
            .unwrap_or_else(|e| panic!("DUET_TEST_DEVICE={name}: {e}")),
        cuda_graphs: std::env::var("DUET_TEST_CUDA_GRAPHS").map_or(true, |v| v != "off"),
        ..LoadOptions::default()
    }
}

/// Shape of a tiny model. Dimensions must be multiples of 32 (the Q8_0/Q5_0 block size).
#[derive(Debug, Clone)]
pub struct TinyModel {
    pub architecture: Architecture,
    pub layers: usize,
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    /// A head's width where it is not `hidden / heads` (as in Qwen3-0.6B: 16 heads of 128 in
    /// 1,024).
    pub head_dim: Option<usize>,
    pub ffn_hidden: usize,
    pub context_length: usize,
    /// Seed of the random weights: two models with different seeds disagree, as a draft and
    /// its target do.
    pub seed: u64,
    /// The chat template where not [`CHATML_TEMPLATE`].
    pub chat_template: Option<String>,
    /// More metadata after the shape's and the tokenizer's (a rotary scaling, say).
    pub metadata: Vec<(String, Value)>,
    /// A `rope_freqs.weight` tensor (one divisor a frequency, `head_dim / 2` of them).
    pub rope_freqs: Option<Vec<f32>>,
    /// Control tokens after the vocabulary's three (fill-in-the-middle's, say); the
    /// vocabulary grows by them.
    pub more_specials: Vec<String>,
    /// Every projection in F32 (a reference may then add a delta to a weight exactly).
    pub float_weights: bool,
}

impl Default for TinyModel {
    fn default() -> Self {
        Self {
            architecture: Architecture::Qwen2,
            layers: 2,
            hidden: 64,
            heads: 4,
            kv_heads: 2,
            head_dim: None,
            ffn_hidden: 128,
            context_length: 256,
            seed: 7,
            chat_template: None,
            metadata: Vec::new(),
            rope_freqs: None,
            more_specials: Vec::new(),
            float_weights: false,
        }
    }
}

/// ChatML, as the Qwen2.5 models' template renders it, tools in their format (without
/// Qwen's default system prompt): the tools as JSON lines in a system turn, a call as
/// `<tool_call>` JSON, a tool's result as a user turn's `<tool_response>`; and, as Qwen3's,
/// an empty thought opening the answer where the request sets `enable_thinking` false.
pub const CHATML_TEMPLATE: &str = concat!(
    "{% if tools %}{{ '<|im_start|>system\\n<tools>' }}{% for tool in tools %}",
    "{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n</tools><|im_end|>\\n' }}{% endif %}",
    "{% for message in messages %}{% if message.role == 'tool' %}",
    "{{ '<|im_start|>user\\n<tool_response>\\n' + message['content'] }}",
    "{{ '\\n</tool_response><|im_end|>\\n' }}{% else %}",
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] }}",
    "{% for call in message.tool_calls %}{{ '<tool_call>\\n{\"name\": \"' }}",
    "{{ call.function.name }}{{ '\", \"arguments\": ' }}{{ call.function.arguments | tojson }}",
    "{{ '}\\n</tool_call>' }}{% endfor %}{{ '<|im_end|>' + '\\n' }}{% endif %}{% endfor %}",
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}",
    "{% if enable_thinking is defined and enable_thinking is false %}",
    "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}{% endif %}"
);

/// Merged tokens of the tiny vocabulary (after the 256 byte tokens).
const MERGES: &[(&str, &str)] = &[
    ("Ġ", "t"),
    ("h", "e"),
    ("Ġt", "he"),
    ("i", "n"),
    ("Ġ", "a"),
    ("e", "r"),
    ("o", "n"),
    ("Ġ", "="),
    ("d", "e"),
    ("Ġ", "f"),
];
const SPECIALS: &[&str] = &["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

/// Qwen2.5-Coder's fill-in-the-middle control tokens (for [`TinyModel::more_specials`]).
pub fn infill_specials() -> Vec<String> {
    let fim = ["prefix", "middle", "suffix", "pad"].map(|t| format!("<|fim_{t}|>"));
    let more = ["<|repo_name|>", "<|file_sep|>"].map(String::from);
    fim.into_iter().chain(more).collect()
}

/// The tiny vocabulary: 256 byte tokens, the merges, then the special tokens.
pub fn tiny_vocab_size() -> usize {
    256 + MERGES.len() + SPECIALS.len()
}

fn byte_tokens() -> Vec<String> {
    crate::tokenizer::byte_level_chars()
        .iter()
        .map(|c| c.to_string())
        .collect()
}

/// A tensor of a tiny model: its name, shape, type, and the bound of its random values.
type Spec = (String, Vec<usize>, GgmlDType, f32);

fn spec(name: &str, dims: &[usize], dtype: GgmlDType, scale: f32) -> Spec {
    (name.to_string(), dims.to_vec(), dtype, scale)
}

impl TinyModel {
    /// A code model: with Qwen2.5-Coder's fill-in-the-middle tokens, the repository-level
    /// ones included.
    pub fn coder() -> Self {
        Self {
            more_specials: infill_specials(),
            ..Default::default()
        }
    }

    /// A code model without the repository-level tokens.
    pub fn coder_without_repository() -> Self {
        Self {
            more_specials: infill_specials()[..4].to_vec(),
            ..Default::default()
        }
    }

    /// Writes the model to `path` as GGUF.
    pub fn write(&self, path: &Path) -> Result<()> {
        let mut file = std::fs::File::create(path).map_err(|source| EngineError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        self.write_to(&mut file)
    }

    fn write_to(&self, out: &mut (impl std::io::Write + std::io::Seek)) -> Result<()> {
        let metadata = self.metadata();
        let tensors = self.tensors()?;
        let metadata: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let tensors: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
        gguf_file::write(out, &metadata, &tensors)?;
        Ok(())
    }

    /// The model's tokenizer, read from its GGUF written in memory.
    pub fn tokenizer(&self) -> Result<crate::Tokenizer> {
        let mut gguf = std::io::Cursor::new(Vec::new());
        self.write_to(&mut gguf)?;
        crate::Tokenizer::from_gguf_bytes(gguf.get_ref())
    }

    /// The vocabulary's size: [`tiny_vocab_size`] and the more control tokens.
    pub fn vocab_size(&self) -> usize {
        tiny_vocab_size() + self.more_specials.len()
    }

    /// The GGUF metadata: the shapes, and a byte-level BPE tokenizer with ChatML.
    fn metadata(&self) -> Vec<(String, Value)> {
        let arch = self.architecture.name();
        let mut tokens = byte_tokens();
        tokens.extend(MERGES.iter().map(|(a, b)| format!("{a}{b}")));
        tokens.extend(SPECIALS.iter().map(|s| s.to_string()));
        tokens.extend(self.more_specials.iter().cloned());
        let vocab = tokens.len();
        let token_types: Vec<Value> = (0..vocab)
            .map(|i| Value::I32(if i >= 256 + MERGES.len() { 3 } else { 1 }))
            .collect();
        let special = |name: &str| {
            Value::U32(
                (256 + MERGES.len() + SPECIALS.iter().position(|s| *s == name).unwrap_or(0)) as u32,
            )
        };
        let strings = |v: Vec<String>| Value::Array(v.into_iter().map(Value::String).collect());
        let key = |k: &str| format!("{arch}.{k}");
        let metadata: Vec<(String, Value)> = vec![
            ("general.architecture".into(), Value::String(arch.into())),
            (key("block_count"), Value::U32(self.layers as u32)),
            (
                key("context_length"),
                Value::U32(self.context_length as u32),
            ),
            (key("embedding_length"), Value::U32(self.hidden as u32)),
            (
                key("feed_forward_length"),
                Value::U32(self.ffn_hidden as u32),
            ),
            (key("attention.head_count"), Value::U32(self.heads as u32)),
            (
                key("attention.head_count_kv"),
                Value::U32(self.kv_heads as u32),
            ),
            (
                key("attention.key_length"),
                Value::U32(self.head_dim() as u32),
            ),
            (
                key("attention.value_length"),
                Value::U32(self.head_dim() as u32),
            ),
            (key("attention.layer_norm_rms_epsilon"), Value::F32(1e-6)),
            (key("rope.freq_base"), Value::F32(10_000.0)),
            ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
            ("tokenizer.ggml.pre".into(), Value::String("qwen2".into())),
            ("tokenizer.ggml.tokens".into(), strings(tokens)),
            (
                "tokenizer.ggml.token_type".into(),
                Value::Array(token_types),
            ),
            (
                "tokenizer.ggml.merges".into(),
                strings(MERGES.iter().map(|(a, b)| format!("{a} {b}")).collect()),
            ),
            ("tokenizer.ggml.eos_token_id".into(), special("<|im_end|>")),
            (
                "tokenizer.ggml.bos_token_id".into(),
                special("<|endoftext|>"),
            ),
            (
                "tokenizer.chat_template".into(),
                Value::String(
                    self.chat_template
                        .as_deref()
                        .unwrap_or(CHATML_TEMPLATE)
                        .into(),
                ),
            ),
        ];
        [metadata, self.metadata.clone()].concat()
    }

    /// Seeded random weights, quantized as the real models are.
    fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.hidden / self.heads)
    }

    fn tensors(&self) -> Result<Vec<(String, QTensor)>> {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(self.seed);
        let h = self.hidden;
        let mut specs = vec![spec(
            "token_embd.weight",
            &[self.vocab_size(), h],
            GgmlDType::Q8_0,
            1.0,
        )];
        specs.extend((0..self.layers).flat_map(|i| self.layer_tensors(i)));
        specs.push(spec("output_norm.weight", &[h], GgmlDType::F32, 0.2));
        let mut tensors: Vec<(String, QTensor)> = Vec::new();
        for (name, dims, mut dtype, scale) in specs {
            if self.float_weights && name.starts_with("blk.") {
                dtype = GgmlDType::F32;
            }
            let n: usize = dims.iter().product();
            let data: Vec<f32> = (0..n).map(|_| rng.random_range(-scale..scale)).collect();
            let t = Tensor::from_vec(data, dims, &Device::Cpu)?;
            tensors.push((name, QTensor::quantize(&t, dtype)?));
        }
        if let Some(factors) = &self.rope_freqs {
            let t = Tensor::from_vec(factors.clone(), factors.len(), &Device::Cpu)?;
            let t = QTensor::quantize(&t, GgmlDType::F32)?;
            tensors.push(("rope_freqs.weight".into(), t));
        }
        // Norm weights: shift the random values to around 1.
        for (name, t) in tensors.iter_mut() {
            if name.ends_with("norm.weight") {
                let w = (t.dequantize(&Device::Cpu)? + 1.0)?;
                *t = QTensor::quantize(&w, GgmlDType::F32)?;
            }
        }
        Ok(tensors)
    }

    /// Layer `i`'s tensors in the order their random values are drawn.
    fn layer_tensors(&self, i: usize) -> Vec<Spec> {
        let head_dim = self.head_dim();
        let (h, ffn) = (self.hidden, self.ffn_hidden);
        let (q, kv) = (self.heads * head_dim, self.kv_heads * head_dim);
        let p = format!("blk.{i}");
        let t = |name: &str, dims: &[usize], dtype, scale| {
            spec(&format!("{p}.{name}"), dims, dtype, scale)
        };
        use GgmlDType::{F32, Q5_0, Q8_0};
        // Norm weights near 1 keep activations in a sane range through the layers.
        let mut specs = vec![
            t("attn_norm.weight", &[h], F32, 0.2),
            t("attn_q.weight", &[q, h], Q8_0, 0.3),
            t("attn_k.weight", &[kv, h], Q8_0, 0.3),
            t("attn_v.weight", &[kv, h], Q8_0, 0.3),
        ];
        if self.architecture == Architecture::Qwen2 {
            specs.push(t("attn_q.bias", &[q], F32, 0.1));
            specs.push(t("attn_k.bias", &[kv], F32, 0.1));
            specs.push(t("attn_v.bias", &[kv], F32, 0.1));
        }
        if self.architecture.norms_heads() {
            specs.push(t("attn_q_norm.weight", &[head_dim], F32, 0.2));
            specs.push(t("attn_k_norm.weight", &[head_dim], F32, 0.2));
        }
        specs.extend([
            t("attn_output.weight", &[h, q], Q8_0, 0.3),
            t("ffn_norm.weight", &[h], F32, 0.2),
            t("ffn_gate.weight", &[ffn, h], Q8_0, 0.3),
            t("ffn_up.weight", &[ffn, h], Q8_0, 0.3),
            // Q5_0, as in the real draft model, so the transcode path is exercised.
            t("ffn_down.weight", &[h, ffn], Q5_0, 0.3),
        ]);
        specs
    }
}

/// A LoRA adapter of random deltas in PEFT's format, for tests.
#[derive(Debug, Clone)]
pub struct TinyAdapter {
    pub rank: usize,
    pub alpha: f64,
    /// The projections it changes, by PEFT's names (`q_proj`, ..., `down_proj`).
    pub modules: Vec<&'static str>,
    pub seed: u64,
    /// The bound of `lora_B`'s random values (0: a delta of zero, as PEFT initializes it).
    pub b_scale: f32,
}

impl Default for TinyAdapter {
    fn default() -> Self {
        Self {
            rank: 4,
            alpha: 8.0,
            modules: vec![
                "q_proj",
                "k_proj",
                "v_proj",
                "o_proj",
                "gate_proj",
                "up_proj",
                "down_proj",
            ],
            seed: 11,
            b_scale: 0.3,
        }
    }
}

impl TinyAdapter {
    /// Its tensors for a model of `c`, by PEFT's names: `lora_A` (`rank x inputs`) and
    /// `lora_B` (`outputs x rank`) of each module in each layer, in f32 holding bf16 values
    /// (its file's, as a bf16 trainer writes them).
    pub fn tensors(
        &self,
        c: &crate::ModelConfig,
    ) -> Result<std::collections::HashMap<String, Tensor>> {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(self.seed);
        let (q, kv) = (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
        let mut tensors = std::collections::HashMap::new();
        for layer in 0..c.n_layers {
            for &module in &self.modules {
                let (part, inputs, outputs) = match module {
                    "q_proj" => ("self_attn", c.hidden, q),
                    "k_proj" | "v_proj" => ("self_attn", c.hidden, kv),
                    "o_proj" => ("self_attn", q, c.hidden),
                    "gate_proj" | "up_proj" => ("mlp", c.hidden, c.ffn_hidden),
                    "down_proj" => ("mlp", c.ffn_hidden, c.hidden),
                    other => panic!("no projection {other}"),
                };
                let name = format!("base_model.model.model.layers.{layer}.{part}.{module}");
                let mut random = |n: usize, bound: f32| -> Vec<f32> {
                    (0..n)
                        .map(|_| rng.random_range(-1.0..1.0) * bound)
                        .collect()
                };
                let a = random(self.rank * inputs, 0.3);
                let b = random(outputs * self.rank, self.b_scale);
                let bf16 = |t: Tensor| t.to_dtype(DType::BF16)?.to_dtype(DType::F32);
                let a = bf16(Tensor::from_vec(a, (self.rank, inputs), &Device::Cpu)?)?;
                let b = bf16(Tensor::from_vec(b, (outputs, self.rank), &Device::Cpu)?)?;
                tensors.insert(format!("{name}.lora_A.weight"), a);
                tensors.insert(format!("{name}.lora_B.weight"), b);
            }
        }
        Ok(tensors)
    }

    /// Writes it into `dir` as PEFT does: `adapter_config.json` and
    /// `adapter_model.safetensors`.
    pub fn write(&self, dir: &Path, c: &crate::ModelConfig) -> Result<()> {
        let config = serde_json::json!({
            "peft_type": "LORA",
            "r": self.rank,
            "lora_alpha": self.alpha,
            "target_modules": self.modules,
            "bias": "none",
        });
        let io = |source| EngineError::Io {
            path: dir.to_path_buf(),
            source,
        };
        std::fs::create_dir_all(dir).map_err(io)?;
        std::fs::write(dir.join("adapter_config.json"), config.to_string()).map_err(io)?;
        let tensors = (self.tensors(c)?.into_iter())
            .map(|(name, t)| Ok((name, t.to_dtype(DType::BF16)?)))
            .collect::<Result<std::collections::HashMap<_, _>>>()?;
        candle_core::safetensors::save(&tensors, dir.join("adapter_model.safetensors"))?;
        Ok(())
    }
}
