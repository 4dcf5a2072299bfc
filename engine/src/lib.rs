//! duet's model runtime: GGUF Qwen2/Llama models on candle with per-session rollback KV
//! caches, logits for every new position, the GGUF tokenizer and chat template, logit
//! processing, and the speculative verification math.

pub mod detokenize;
pub mod device;
pub mod error;
pub mod kv_cache;
pub mod model;
pub mod sampling;
pub mod speculate;
pub mod testing;
pub mod tokenizer;
pub mod verify;

pub use device::select_device;
pub use error::{EngineError, Result};
pub use kv_cache::KvCache;
pub use model::{
    Architecture, AttentionKernel, ExtraLogits, GraphReport, Greedy, LoadOptions, Logits,
    LogitsFor, MatmulPath, Model, ModelConfig, SequenceInput,
};
pub use tokenizer::{ChatMessage, Tokenizer};
