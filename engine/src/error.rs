//! The engine's error type: one enum, each variant naming what went wrong and with which value.

use std::path::PathBuf;

/// Everything that can go wrong while loading or running a model.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("cannot read model file {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not a readable GGUF file: {reason}")]
    Gguf { path: PathBuf, reason: String },
    #[error("unsupported model architecture `{0}` (supported: qwen2, llama)")]
    UnsupportedArchitecture(String),
    #[error("GGUF metadata `{key}`: {reason}")]
    Metadata { key: String, reason: String },
    #[error("GGUF tensor `{name}`: {reason}")]
    Tensor { name: String, reason: String },
    #[error("LoRA adapter {path}: {reason}")]
    Adapter { path: PathBuf, reason: String },
    #[error("KV cache is full: {needed} tokens needed, capacity is {capacity}")]
    CacheFull { needed: usize, capacity: usize },
    #[error("KV cache capacity {requested} exceeds the model's context length {max}")]
    CapacityTooLarge { requested: usize, max: usize },
    #[error("cannot truncate the KV cache to {requested} tokens: it holds only {len}")]
    TruncateBeyondEnd { requested: usize, len: usize },
    #[error("the KV cache was made for a different model")]
    CacheMismatch,
    #[error("token id {token} is out of range for a vocabulary of {vocab}")]
    TokenOutOfRange { token: u32, vocab: usize },
    #[error("a forward pass needs at least one token")]
    EmptyInput,
    /// A sequence's `parents` do not describe a tree of its tokens (see `SequenceInput`).
    #[error("token tree: {0}")]
    BadTree(String),
    #[error("device `{0}` is not available: {1}")]
    Device(String, String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// A structured output's format that does not compile, or a completion outside it.
    #[error("structured output: {0}")]
    Grammar(String),
    #[error("chat template: {0}")]
    ChatTemplate(String),
    #[error(transparent)]
    Sampling(#[from] crate::sampling::SamplingError),
    #[error(transparent)]
    Verify(#[from] crate::verify::VerifyError),
    #[error("tensor operation failed: {0}")]
    Candle(#[from] candle_core::Error),
}

pub type Result<T, E = EngineError> = std::result::Result<T, E>;
