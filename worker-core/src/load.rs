//! Loading a worker's model: the weights, the tokenizer the coordinator will use, the
//! description both sides check each other with, and the passes run before serving.

use crate::WorkerConfig;
use crate::adapters::Adapters;
use duet_engine::structured::Grammars;
use duet_engine::{EngineError, LoadOptions, LogitsFor, Model, SequenceInput, Tokenizer};
use sha2::{Digest, Sha256};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The passes a worker's start runs (`warm_up`): rows, and whether the pass reads only the
/// greedy choices the device makes (else the whole logits, as sampling and a draft's
/// alternatives do). One stream's decode and verify passes (a draft step, K + 1 rows) and
/// the row buckets up to 8.
const WARM_UP_ROWS: [(usize, bool); 6] = [
    (1, true),
    (2, true),
    (4, true),
    (8, true),
    (1, false),
    (5, false),
];

/// What is known once the model has loaded.
#[derive(Debug)]
pub(crate) struct Loaded {
    pub model: Model,
    pub description: ModelDescription,
    /// Tokens one session may hold at most.
    pub context: usize,
    /// The tokenizer's end-of-sequence tokens (what `min_tokens` holds back).
    pub eos: Vec<u32>,
    /// What constrains a structured output's completions; `None` where llguidance cannot
    /// read the vocabulary (the worker then takes no structured output).
    pub grammars: Option<Arc<Grammars>>,
    /// The LoRA adapters sessions may ask for.
    pub adapters: Adapters,
}

/// The model facts a worker's Describe answers with.
#[derive(Debug, Clone)]
pub struct ModelDescription {
    /// File name of the model.
    pub model: String,
    pub architecture: String,
    pub vocab_size: usize,
    /// The model's context capped by the worker's `max_context`.
    pub context_length: usize,
    pub vocabulary_sha256: String,
    /// A GGUF file holding only the tokenizer metadata.
    pub tokenizer: Vec<u8>,
    /// Verify takes trees of drafts (`Model::verifies_trees`).
    pub verifies_trees: bool,
    /// The worker takes structured outputs (`Loaded::grammars`).
    pub applies_structured_output: bool,
    /// The file's weights, their storage and its size.
    pub file: duet_engine::FileFacts,
    /// The kind of device holding the model: `cpu` or `cuda`.
    pub device: &'static str,
}

/// Where `scripts/fetch-models` puts `file` (`duet_engine::cached_model_path`).
pub fn default_model_path(file: &str) -> String {
    duet_engine::cached_model_path(file)
        .to_string_lossy()
        .into_owned()
}

/// Hash of every token's bytes in id order, each prefixed by its length.
fn vocabulary_sha256(tokenizer: &Tokenizer) -> String {
    let mut h = Sha256::new();
    for id in 0..tokenizer.vocab_size() as u32 {
        let bytes = tokenizer.token_bytes(id).unwrap_or_default();
        h.update((bytes.len() as u32).to_le_bytes());
        h.update(&bytes);
    }
    format!("{:x}", h.finalize())
}

/// Loads `config`'s model and the vocabulary as structured outputs read it (a pass over
/// every token's bytes, paid at start rather than by a first request): the target keeps its
/// choices within a request's format, the draft its proposals.
pub(crate) fn load(config: &WorkerConfig) -> Result<Loaded, EngineError> {
    let device = duet_engine::select_device(&config.device)?;
    let kind = duet_engine::device_kind(&device);
    let model = Model::load(
        &config.model,
        &LoadOptions {
            device,
            shortlist: (config.vocab_shortlist > 0).then_some(config.vocab_shortlist),
            cuda_graphs: config.cuda_graphs,
            ..LoadOptions::default()
        },
    )?;
    let (file, tokenizer) = duet_engine::describe_file(&config.model)?;
    // Fail at load, not at the first request, if the tokenizer cannot be built.
    let read = Tokenizer::from_gguf_bytes(&tokenizer)?;
    let vocabulary = vocabulary_sha256(&read);
    let eos = read.eos_tokens().iter().copied().collect();
    let grammars = match Grammars::new(&read, model.config().vocab) {
        Ok(grammars) => Some(Arc::new(grammars)),
        Err(e) => {
            tracing::warn!(error = %e, "structured output is off: the vocabulary's bytes");
            None
        }
    };
    let adapters = Adapters::load(config, &model)?;
    let model_context = model.config().context_length;
    let context = match config.max_context {
        0 => model_context,
        n => n.min(model_context),
    };
    let description = ModelDescription {
        model: config
            .model
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        architecture: format!("{:?}", model.config().architecture).to_lowercase(),
        vocab_size: model.config().vocab,
        context_length: context,
        vocabulary_sha256: vocabulary,
        tokenizer,
        verifies_trees: model.verifies_trees(),
        applies_structured_output: grammars.is_some(),
        file,
        device: kind,
    };
    Ok(Loaded {
        model,
        description,
        context,
        eos,
        grammars,
        adapters,
    })
}

/// Runs, on a scratch cache, a prompt's prefill and then the passes of [`WARM_UP_ROWS`]:
/// what a worker's first calls would otherwise pay once. On a GPU the first passes build the
/// CUDA step (NVRTC compiles its kernels) and capture each row bucket's CUDA graph; paid by
/// the first requests, that took their time and, measured as what a pass costs, made the
/// coordinator's first cost estimates wrong by as much. On a CPU it is a few passes at
/// start. Returns how long it took.
pub(crate) fn warm_up(model: &Model) -> Result<Duration, EngineError> {
    let start = Instant::now();
    let vocab = model.config().vocab as u32;
    let tokens: Vec<u32> = (1..=16).map(|t| t % vocab).collect();
    let rows: usize = WARM_UP_ROWS.iter().map(|(n, _)| n).sum();
    let capacity = (tokens.len() + rows).min(model.config().context_length);
    let mut cache = model.new_cache(capacity)?;
    model.prefill(&mut cache, &tokens, LogitsFor::None)?;
    for (n, greedy) in WARM_UP_ROWS {
        if cache.len() + n > capacity {
            break;
        }
        model.forward_batch(&mut [SequenceInput {
            cache: &mut cache,
            tokens: &tokens[..n],
            logits: LogitsFor::All,
            extra: None,
            greedy,
            draws: &[],
            parents: &[],
        }])?;
    }
    Ok(start.elapsed())
}
