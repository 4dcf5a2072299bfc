//! Hyperparameters of a decoder-only transformer, read from GGUF metadata.

use crate::error::{EngineError, Result};
use candle_core::quantized::gguf_file::{Content, Value};

/// The architectures the engine can run. They differ in attention biases, norms of each
/// head's queries and keys, and rotary layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    /// Qwen2/Qwen2.5: q/k/v biases, rotary embedding on split halves ("neox" layout).
    Qwen2,
    /// Qwen3 (dense): no biases, each head's queries and keys RMS-normed (with weights of
    /// their own, shared by the heads) before the rotary embedding, on split halves.
    Qwen3,
    /// Llama family (SmolLM2, Llama 2/3): no biases, rotary embedding on interleaved pairs,
    /// which is how llama.cpp's converter permutes the q/k weights in GGUF.
    Llama,
}

impl Architecture {
    pub fn from_name(name: &str) -> Result<Self> {
        match name {
            "qwen2" => Ok(Self::Qwen2),
            "qwen3" => Ok(Self::Qwen3),
            "llama" => Ok(Self::Llama),
            other => Err(EngineError::UnsupportedArchitecture(other.to_string())),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Qwen2 => "qwen2",
            Self::Qwen3 => "qwen3",
            Self::Llama => "llama",
        }
    }

    /// Whether the rotary embedding turns interleaved pairs of a head's dimensions (Llama,
    /// as llama.cpp's converter permutes its q/k weights) rather than its two halves.
    pub fn interleaved_rope(self) -> bool {
        self == Self::Llama
    }

    /// Whether each head's queries and keys are RMS-normed before the rotary embedding.
    pub fn norms_heads(self) -> bool {
        self == Self::Qwen3
    }
}

/// How a position becomes a rotary angle beyond `rope_theta`: GGUF's `rope.scaling.*`, read as
/// llama.cpp reads them, so a model runs with the positions its converter wrote. (A
/// `rope_freqs.weight` tensor, Llama 3.1's per-frequency factors, is a weight: see
/// `weights::load_weights`.)
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeScaling {
    /// Positions as they are.
    None,
    /// Positions divided by `factor` (llama.cpp's default type where a factor is given).
    Linear { factor: f64 },
    /// YaRN: frequencies that turn more than about once in `original_context` positions
    /// are divided by `factor`, faster ones kept, the ones between blended; cosines and
    /// sines grow by `1 + 0.1 ln(factor)`.
    Yarn {
        factor: f64,
        original_context: usize,
    },
}

/// Shape of the network, everything the forward pass needs to know besides the weights.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub n_layers: usize,
    pub hidden: usize,
    pub ffn_hidden: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    pub context_length: usize,
    pub rms_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    /// Multiplies the rotary cosines and sines (`rope.scaling.attn_factor`, 1 by default).
    pub rope_attn_factor: f64,
}

impl ModelConfig {
    /// Reads the hyperparameters from GGUF metadata; a missing or mistyped key is an error
    /// naming the key.
    pub fn from_gguf(content: &Content) -> Result<Self> {
        let arch_name = string(content, "general.architecture")?;
        let architecture = Architecture::from_name(&arch_name)?;
        let key = |suffix: &str| format!("{arch_name}.{suffix}");
        let hidden = uint(content, &key("embedding_length"))?;
        let n_heads = uint(content, &key("attention.head_count"))?;
        // Absent head_count_kv means plain multi-head attention.
        let n_kv_heads = match content.metadata.get(&key("attention.head_count_kv")) {
            Some(_) => uint(content, &key("attention.head_count_kv"))?,
            None => n_heads,
        };
        let head_dim = match content.metadata.get(&key("attention.key_length")) {
            Some(_) => uint(content, &key("attention.key_length"))?,
            None => hidden / n_heads.max(1),
        };
        let vocab = match content.metadata.get("tokenizer.ggml.tokens") {
            Some(Value::Array(tokens)) => tokens.len(),
            _ => content
                .tensor_infos
                .get("token_embd.weight")
                .map(|t| t.shape.dims()[0])
                .ok_or_else(|| missing("tokenizer.ggml.tokens"))?,
        };
        let rope_theta = float(content, &key("rope.freq_base"))?.unwrap_or(10_000.0);
        let eps_key = key("attention.layer_norm_rms_epsilon");
        let rms_eps = float(content, &eps_key)?.ok_or_else(|| missing(&eps_key))?;
        let context_length = uint(content, &key("context_length"))?;
        let config = Self {
            architecture,
            n_layers: uint(content, &key("block_count"))?,
            hidden,
            ffn_hidden: uint(content, &key("feed_forward_length"))?,
            n_heads,
            n_kv_heads,
            head_dim,
            vocab,
            context_length,
            rms_eps,
            rope_theta,
            rope_scaling: rope_scaling(content, &key, context_length)?,
            rope_attn_factor: float(content, &key("rope.scaling.attn_factor"))?.unwrap_or(1.0),
        };
        rotates_whole_heads(content, &key, head_dim)?;
        config.validate(&arch_name)?;
        Ok(config)
    }

    fn validate(&self, arch: &str) -> Result<()> {
        let fail = |suffix: &str, reason: String| {
            Err(EngineError::Metadata {
                key: format!("{arch}.{suffix}"),
                reason,
            })
        };
        if self.n_heads == 0
            || self.n_kv_heads == 0
            || !self.n_heads.is_multiple_of(self.n_kv_heads)
        {
            return fail(
                "attention.head_count_kv",
                format!(
                    "{} query heads cannot be grouped over {} key/value heads",
                    self.n_heads, self.n_kv_heads
                ),
            );
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            return fail(
                "attention.key_length",
                format!("head dimension {} must be even and non-zero", self.head_dim),
            );
        }
        if self.n_layers == 0 || self.hidden == 0 || self.vocab == 0 || self.context_length == 0 {
            return fail(
                "block_count",
                "the model has an empty dimension".to_string(),
            );
        }
        Ok(())
    }

    /// Query heads per key/value head (grouped-query attention).
    pub fn group_size(&self) -> usize {
        self.n_heads / self.n_kv_heads
    }
}

/// The model's rotary scaling. llama.cpp takes a missing type for `linear` and a missing or
/// zero factor for 1; `longrope` (Phi-3's factor tables) and YaRN with DeepSeek's log
/// multiplier are refused, naming the key, rather than run with other positions than the
/// model was trained on.
fn rope_scaling(
    content: &Content,
    key: &dyn Fn(&str) -> String,
    context_length: usize,
) -> Result<RopeScaling> {
    let type_key = key("rope.scaling.type");
    let kind = match content.metadata.get(&type_key) {
        Some(_) => string(content, &type_key)?,
        None => "linear".to_string(),
    };
    let factor = match float(content, &key("rope.scaling.factor"))? {
        Some(factor) => Some(factor),
        None => float(content, &key("rope.scale_linear"))?,
    };
    let factor = factor.filter(|&f| f != 0.0).unwrap_or(1.0);
    if !(factor.is_finite() && factor > 0.0) {
        let reason = format!("{factor} is not a positive scaling factor");
        return Err(metadata(&key("rope.scaling.factor"), reason));
    }
    let log_multiplier = key("rope.scaling.yarn_log_multiplier");
    match kind.as_str() {
        "none" => Ok(RopeScaling::None),
        "linear" if factor == 1.0 => Ok(RopeScaling::None),
        "linear" => Ok(RopeScaling::Linear { factor }),
        "yarn" if float(content, &log_multiplier)?.is_some_and(|m| m != 0.0) => Err(metadata(
            &log_multiplier,
            "YaRN with a log multiplier (DeepSeek's) is not supported".to_string(),
        )),
        "yarn" => {
            let original = key("rope.scaling.original_context_length");
            let original_context = match content.metadata.get(&original) {
                Some(_) => uint(content, &original)?,
                None => context_length,
            };
            Ok(RopeScaling::Yarn {
                factor,
                original_context,
            })
        }
        other => Err(metadata(
            &type_key,
            format!("rotary scaling `{other}` is not supported (none, linear and yarn are)"),
        )),
    }
}

/// Refuses a model that rotates only part of each head (`rope.dimension_count` below the
/// head's size): the forward pass rotates whole heads.
fn rotates_whole_heads(
    content: &Content,
    key: &dyn Fn(&str) -> String,
    head_dim: usize,
) -> Result<()> {
    let dims_key = key("rope.dimension_count");
    if content.metadata.contains_key(&dims_key) && uint(content, &dims_key)? != head_dim {
        let reason = format!("rotating part of a {head_dim}-wide head is not supported");
        return Err(metadata(&dims_key, reason));
    }
    Ok(())
}

fn metadata(key: &str, reason: String) -> EngineError {
    EngineError::Metadata {
        key: key.to_string(),
        reason,
    }
}

/// The number under `key`, where the file has one.
fn float(content: &Content, key: &str) -> Result<Option<f64>> {
    let Some(value) = content.metadata.get(key) else {
        return Ok(None);
    };
    let number = value.to_f32().map(f64::from).or_else(|_| value.to_f64());
    number.map(Some).map_err(|e| bad(key, e))
}

fn missing(key: &str) -> EngineError {
    EngineError::Metadata {
        key: key.to_string(),
        reason: "missing".to_string(),
    }
}

fn bad(key: &str, e: candle_core::Error) -> EngineError {
    EngineError::Metadata {
        key: key.to_string(),
        reason: e.to_string(),
    }
}

pub(crate) fn string(content: &Content, key: &str) -> Result<String> {
    let v = content.metadata.get(key).ok_or_else(|| missing(key))?;
    v.to_string().cloned().map_err(|e| bad(key, e))
}

pub(crate) fn uint(content: &Content, key: &str) -> Result<usize> {
    let v = content.metadata.get(key).ok_or_else(|| missing(key))?;
    let n = match v {
        Value::U8(x) => *x as u64,
        Value::U16(x) => *x as u64,
        Value::U32(x) => *x as u64,
        Value::U64(x) => *x,
        Value::I8(x) if *x >= 0 => *x as u64,
        Value::I16(x) if *x >= 0 => *x as u64,
        Value::I32(x) if *x >= 0 => *x as u64,
        Value::I64(x) if *x >= 0 => *x as u64,
        other => {
            return Err(EngineError::Metadata {
                key: key.to_string(),
                reason: format!("expected a non-negative integer, found {other:?}"),
            });
        }
    };
    Ok(n as usize)
}
