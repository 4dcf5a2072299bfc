//! duet's model runtime: GGUF Qwen2/Llama models on candle with per-session rollback KV
//! caches, logits for every new position, the GGUF tokenizer and chat template, logit
//! processing, penalties, log-probabilities, and the speculative verification math.

pub mod bias;
mod chat_template;
pub mod detokenize;
pub mod device;
pub mod error;
mod infill;
pub mod kv_cache;
pub mod logprobs;
pub mod model;
pub mod ngram;
pub mod penalties;
pub mod sampling;
mod scan;
pub mod speculate;
pub mod structured;
pub mod testing;
pub mod tokenizer;
pub mod verify;

pub use chat_template::{ChatExtras, TEMPLATE_VARIABLES};
pub use device::{device_kind, select_device};
pub use error::{EngineError, Result};
pub use infill::{Infill, Repository, RepositoryFile};
pub use kv_cache::{KvCache, PREFIX_BLOCK_TOKENS, adapter_salt, prefix_block_hashes};
pub use model::{
    Adapter, Architecture, AttentionKernel, CPU_KERNELS, ExtraLogits, FileFacts, GraphReport,
    Greedy, LoadOptions, Logits, LogitsFor, MatmulPath, Model, ModelConfig, RopeScaling,
    SequenceInput, adapter_names, cpu_kernels, describe_file, file_facts,
};
pub use tokenizer::{ChatMessage, InfillPrompt, Tokenizer, ToolCall};

/// Where `scripts/fetch-models` puts `file`: `$DUET_MODEL_DIR`, else
/// `$XDG_CACHE_HOME/duet/models`, else `~/.cache/duet/models` (the workers' default model
/// paths and the tests read it).
pub fn cached_model_path(file: &str) -> std::path::PathBuf {
    use std::path::PathBuf;
    let dir = std::env::var_os("DUET_MODEL_DIR")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("XDG_CACHE_HOME")
                .map(PathBuf::from)
                .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
                .map(|c| c.join("duet").join("models"))
        })
        .unwrap_or_default();
    dir.join(file)
}
