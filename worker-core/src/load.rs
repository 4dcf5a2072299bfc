//! Loading a worker's model: the weights, the tokenizer the coordinator will use, and the
//! description both sides check each other with.

use crate::WorkerConfig;
use duet_engine::{EngineError, LoadOptions, Model, Tokenizer};
use sha2::{Digest, Sha256};

/// What is known once the model has loaded.
#[derive(Debug)]
pub(crate) struct Loaded {
    pub model: Model,
    pub description: ModelDescription,
    /// Tokens one session may hold at most.
    pub context: usize,
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

pub(crate) fn load(config: &WorkerConfig) -> Result<Loaded, EngineError> {
    let device = duet_engine::select_device(&config.device)?;
    let model = Model::load(
        &config.model,
        &LoadOptions {
            device,
            shortlist: (config.vocab_shortlist > 0).then_some(config.vocab_shortlist),
            cuda_graphs: config.cuda_graphs,
            ..LoadOptions::default()
        },
    )?;
    let tokenizer = duet_engine::tokenizer::tokenizer_gguf(&config.model)?;
    // Fail at load, not at the first request, if the tokenizer cannot be built.
    let vocabulary = vocabulary_sha256(&Tokenizer::from_gguf_bytes(&tokenizer)?);
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
    };
    Ok(Loaded {
        model,
        description,
        context,
    })
}
