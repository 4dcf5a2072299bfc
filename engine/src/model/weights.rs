//! Loading a GGUF file into shared, read-only weights (one copy per process, `Arc`-shared by
//! every session), including the Q5_0 → Q8_0 transcode that gives Q5_0 models a SIMD kernel
//! on CPUs that lack our own (AVX-512 VNNI).

use super::config::{Architecture, ModelConfig};
use super::linear::{Linear, Projections};
use super::shortlist::Shortlist;
use super::step_plan;
use crate::error::{EngineError, Result};
use candle_core::quantized::ggml_file::qtensor_from_ggml;
use candle_core::quantized::gguf_file::Content;
use candle_core::quantized::{GgmlDType, QStorage, QTensor};
use candle_core::{Device, Tensor};
use std::borrow::Cow;
use std::fs::File;
use std::io::{Read, Seek};
use std::path::Path;
use std::sync::Arc;

#[derive(Debug)]
pub(crate) struct Layer {
    pub(crate) attn_norm: Tensor,
    /// q, k and v.
    pub(crate) qkv: Projections<3>,
    /// Qwen3's norms of each head's queries and keys (`head_dim` weights each).
    pub(crate) head_norms: Option<[Tensor; 2]>,
    pub(crate) o: Linear,
    pub(crate) ffn_norm: Tensor,
    /// gate and up.
    pub(crate) gate_up: Projections<2>,
    pub(crate) down: Linear,
}

#[derive(Debug)]
pub(crate) struct Weights {
    pub(crate) embedding: Arc<QTensor>,
    pub(crate) layers: Vec<Layer>,
    pub(crate) output_norm: Tensor,
    pub(crate) lm_head: Linear,
    /// With `LoadOptions::shortlist`: the ids `lm_head`'s rows stand for.
    pub(crate) shortlist: Option<Shortlist>,
    /// Rotary tables `[context_length, head_dim / 2]`.
    pub(crate) cos: Tensor,
    pub(crate) sin: Tensor,
}

/// How weights are loaded.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    pub device: Device,
    /// Rewrite Q5_0 tensors as Q8_0 on CPU. Every Q5_0 value fits an i8 and keeps its block
    /// scale, so the transcode is exact, and candle has SIMD kernels for Q8_0 but only scalar
    /// code for Q5_0. Skipped where our kernels run: they read Q5_0 as it is, 5.5 bits a
    /// value against Q8_0's 8.5.
    pub transcode_q5_0: bool,
    /// Compute logits only for the first `n` token ids and for the special tokens (control
    /// and user-defined: end of turn, tool calls...); every other id gets `-inf`, so it is
    /// never drafted. For a draft model only: the vocabulary projection is the largest
    /// matmul of a small model (37% of the 0.5B draft's bytes read per token), and tokenizers
    /// number their BPE tokens by merge order, so the first ids are the common ones. The
    /// target verifies every draft, so output stays exact; a draft restricted this way only
    /// proposes less well where the text needs a rarer token. `None`, or `n` at least the
    /// vocabulary: all of it.
    pub shortlist: Option<usize>,
    /// On CUDA, replay each row bucket's decode and verify step from a CUDA graph captured
    /// at its first use, instead of launching its kernels one by one (`cuda_step`). Capture
    /// failing leaves the step eager, with the reason in [`super::Model::cuda_graphs`]. On
    /// by default.
    pub cuda_graphs: bool,
    /// Load the projections of one input (a layer's q, k and v; its gate and up) whose
    /// weights share a type as one weight, their rows one after another: one matmul (one
    /// launch of the CUDA step) instead of one each, with the same outputs. `None`: on, but
    /// on a GPU off with `DUET_CUDA_FUSE=0` (for comparisons).
    pub fuse_projections: Option<bool>,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            device: Device::Cpu,
            transcode_q5_0: true,
            shortlist: None,
            cuda_graphs: true,
            fuse_projections: None,
        }
    }
}

/// `members` (weights of one type and input width, with a bias each or none) as one
/// projection: their weights' rows one after another, and their biases likewise.
fn concatenated(members: Vec<(Arc<QTensor>, Option<Tensor>)>, device: &Device) -> Result<Linear> {
    if let [(weight, bias)] = &members[..] {
        return Linear::new(weight.clone(), bias.clone());
    }
    let (dtype, k) = (members[0].0.dtype(), members[0].0.shape().dims2()?.1);
    let (mut bytes, mut n) = (Vec::new(), 0);
    for (weight, _) in &members {
        bytes.extend_from_slice(&weight.data()?);
        n += weight.shape().dims2()?.0;
    }
    let weight = qtensor_from_ggml(dtype, &bytes, vec![n, k], device)?;
    let biases: Option<Vec<Tensor>> = members.iter().map(|(_, b)| b.clone()).collect();
    let bias = biases.map(|b| Tensor::cat(&b, 0)).transpose()?;
    Linear::new(Arc::new(weight), bias)
}

pub(crate) fn read_content(path: &Path) -> Result<(Content, File)> {
    let mut file = File::open(path).map_err(|source| EngineError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let content = Content::read(&mut file).map_err(|e| EngineError::Gguf {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    Ok((content, file))
}

/// Per-frequency divisors of the rotary angles (Llama 3.1's long-context factors), one for
/// every pair of a head's dimensions; llama.cpp reads them for any architecture.
const ROPE_FREQS: &str = "rope_freqs.weight";

struct Loader<'a, R> {
    content: &'a Content,
    reader: &'a mut R,
    options: &'a LoadOptions,
}

impl<R: Read + Seek> Loader<'_, R> {
    fn has(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    fn qtensor(&mut self, name: &str) -> Result<Arc<QTensor>> {
        let on_cpu = self.options.device.is_cpu();
        let info = self
            .content
            .tensor_infos
            .get(name)
            .ok_or_else(|| tensor_error(name, "missing"))?;
        let transcode = on_cpu
            && self.options.transcode_q5_0
            && info.ggml_dtype == GgmlDType::Q5_0
            && !super::kernels::available();
        let t = self
            .content
            .tensor(self.reader, name, &self.options.device)
            .map_err(|e| tensor_error(name, &e.to_string()))?;
        let t = if transcode { q5_0_to_q8_0(&t)? } else { t };
        Ok(Arc::new(t))
    }

    /// `name`'s values on the host, whatever the device.
    fn host_values(&mut self, name: &str) -> Result<Vec<f32>> {
        let t = self
            .content
            .tensor(self.reader, name, &Device::Cpu)
            .map_err(|e| tensor_error(name, &e.to_string()))?;
        Ok(t.dequantize(&Device::Cpu)?.flatten_all()?.to_vec1()?)
    }

    fn dense(&mut self, name: &str) -> Result<Tensor> {
        let t = self.qtensor(name)?;
        Ok(t.dequantize(&self.options.device)?)
    }

    fn linear(&mut self, name: &str, with_bias: bool) -> Result<Linear> {
        let (weight, bias) = self.weight_and_bias(name, with_bias)?;
        Linear::new(weight, bias)
    }

    /// `name`'s weight, and its bias where `with_bias` or the file has one.
    fn weight_and_bias(
        &mut self,
        name: &str,
        with_bias: bool,
    ) -> Result<(Arc<QTensor>, Option<Tensor>)> {
        let weight = self.qtensor(&format!("{name}.weight"))?;
        let bias_name = format!("{name}.bias");
        let bias = if with_bias || self.has(&bias_name) {
            Some(self.dense(&bias_name)?)
        } else {
            None
        };
        Ok((weight, bias))
    }

    /// The projections `names` of one input; where `fuse`, consecutive ones alike in weight
    /// type, input width and having a bias or not as one weight (as the CUDA step launches
    /// them: `step_plan::projection_launches`).
    fn projections<const N: usize>(
        &mut self,
        names: [String; N],
        with_bias: bool,
        fuse: bool,
    ) -> Result<Projections<N>> {
        let mut loaded = Vec::with_capacity(N);
        let mut shapes = Vec::with_capacity(N);
        for name in &names {
            let (weight, bias) = self.weight_and_bias(name, with_bias)?;
            let (n, k) = weight.shape().dims2()?;
            shapes.push(((weight.dtype(), k, bias.is_some()), n));
            loaded.push((weight, bias));
        }
        let (launches, _) = step_plan::projection_launches(&shapes, fuse);
        let mut loaded = loaded.into_iter();
        let parts = launches
            .iter()
            .map(|launch| {
                let members: Vec<_> = loaded.by_ref().take(launch.members.len()).collect();
                let widths = shapes[launch.members.clone()].iter().map(|s| s.1);
                Ok((
                    concatenated(members, &self.options.device)?,
                    widths.collect(),
                ))
            })
            .collect::<Result<_>>()?;
        Ok(Projections::new(parts))
    }

    /// Layer `i`, its projections of one input fused where `fuse`.
    fn layer(&mut self, c: &ModelConfig, i: usize, fuse: bool) -> Result<Layer> {
        let p = format!("blk.{i}");
        let (q, kv) = (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
        self.expect_shape(&format!("{p}.attn_q.weight"), &[q, c.hidden])?;
        self.expect_shape(&format!("{p}.attn_k.weight"), &[kv, c.hidden])?;
        self.expect_shape(&format!("{p}.ffn_up.weight"), &[c.ffn_hidden, c.hidden])?;
        let qkv_bias = c.architecture == Architecture::Qwen2;
        Ok(Layer {
            attn_norm: self.dense(&format!("{p}.attn_norm.weight"))?,
            qkv: self.projections(
                ["attn_q", "attn_k", "attn_v"].map(|n| format!("{p}.{n}")),
                qkv_bias,
                fuse,
            )?,
            head_norms: match c.architecture.norms_heads() {
                true => Some(self.head_norms(&p, c.head_dim)?),
                false => None,
            },
            o: self.linear(&format!("{p}.attn_output"), false)?,
            ffn_norm: self.dense(&format!("{p}.ffn_norm.weight"))?,
            gate_up: self.projections(
                ["ffn_gate", "ffn_up"].map(|n| format!("{p}.{n}")),
                false,
                fuse,
            )?,
            down: self.linear(&format!("{p}.ffn_down"), false)?,
        })
    }

    /// The rotary tables, with the file's per-frequency factors where it has them.
    fn rope_tables(&mut self, c: &ModelConfig) -> Result<(Tensor, Tensor)> {
        let freq_factors = match self.has(ROPE_FREQS) {
            true => {
                self.expect_shape(ROPE_FREQS, &[c.head_dim / 2])?;
                Some(self.host_values(ROPE_FREQS)?)
            }
            false => None,
        };
        super::rope::tables(c, freq_factors.as_deref(), &self.options.device)
    }

    /// Layer `p`'s norms of each head's queries and keys.
    fn head_norms(&mut self, p: &str, head_dim: usize) -> Result<[Tensor; 2]> {
        let [q, k] = ["attn_q_norm", "attn_k_norm"].map(|n| format!("{p}.{n}.weight"));
        self.expect_shape(&q, &[head_dim])?;
        self.expect_shape(&k, &[head_dim])?;
        Ok([self.dense(&q)?, self.dense(&k)?])
    }

    fn expect_shape(&self, name: &str, dims: &[usize]) -> Result<()> {
        let info = self
            .content
            .tensor_infos
            .get(name)
            .ok_or_else(|| tensor_error(name, "missing"))?;
        if info.shape.dims() != dims {
            return Err(tensor_error(
                name,
                &format!("shape {:?}, expected {dims:?}", info.shape.dims()),
            ));
        }
        Ok(())
    }
}

pub(crate) fn load_weights<R: Read + Seek>(
    content: &Content,
    reader: &mut R,
    config: &ModelConfig,
    options: &LoadOptions,
) -> Result<Weights> {
    let mut l = Loader {
        content,
        reader,
        options,
    };
    let c = config;
    let fuse = options.fuse_projections.unwrap_or_else(|| {
        options.device.is_cpu() || !std::env::var("DUET_CUDA_FUSE").is_ok_and(|v| v == "0")
    });
    l.expect_shape("token_embd.weight", &[c.vocab, c.hidden])?;
    let embedding = l.qtensor("token_embd.weight")?;
    let layers = (0..c.n_layers)
        .map(|i| l.layer(c, i, fuse))
        .collect::<Result<Vec<_>>>()?;
    let output_norm = l.dense("output_norm.weight")?;
    // Models with tied embeddings (Qwen2.5 0.5B/1.5B, SmolLM2) have no output.weight.
    let untied = l.has("output.weight");
    let (lm_head, shortlist) = match options.shortlist {
        Some(_) if l.has("output.bias") => {
            return Err(tensor_error(
                "output.bias",
                "a vocabulary shortlist needs an output projection without bias",
            ));
        }
        Some(_) => {
            let full = match untied {
                true => l.qtensor("output.weight")?,
                false => embedding.clone(),
            };
            match Shortlist::new(content, options.shortlist, full.clone())? {
                Some((shortlist, rows)) => (rows, Some(shortlist)),
                None => (Linear::new(full, None)?, None),
            }
        }
        None if untied => (l.linear("output", false)?, None),
        None => (Linear::new(embedding.clone(), None)?, None),
    };
    let (cos, sin) = l.rope_tables(c)?;
    Ok(Weights {
        embedding,
        layers,
        output_norm,
        lm_head,
        shortlist,
        cos,
        sin,
    })
}

fn tensor_error(name: &str, reason: &str) -> EngineError {
    EngineError::Tensor {
        name: name.to_string(),
        reason: reason.to_string(),
    }
}

const Q5_0_BLOCK_BYTES: usize = 22; // f16 scale, 32 high bits, 16 bytes of low nibbles
const Q8_0_BLOCK_BYTES: usize = 34; // f16 scale, 32 signed bytes

/// Rewrites a Q5_0 tensor as Q8_0 with the same scales and integer values (exact).
fn q5_0_to_q8_0(t: &QTensor) -> Result<QTensor> {
    let data = t.data()?;
    if data.len() % Q5_0_BLOCK_BYTES != 0 {
        return Err(tensor_error("q5_0", "data is not a whole number of blocks"));
    }
    let out = q5_0_blocks_to_q8_0(&data);
    let storage = QStorage::from_data(Cow::Owned(out), &Device::Cpu, GgmlDType::Q8_0)?;
    Ok(QTensor::new(storage, t.shape().clone())?)
}

/// Q5_0 blocks (f16 scale, 32 fifth bits, 16 bytes of low nibbles) as Q8_0 blocks (the same
/// scale, 32 signed bytes): `q - 16` of each value. A partial block at the end is dropped.
pub(crate) fn q5_0_blocks_to_q8_0(data: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(data.len() / Q5_0_BLOCK_BYTES * Q8_0_BLOCK_BYTES);
    for block in data.chunks_exact(Q5_0_BLOCK_BYTES) {
        let qh = u32::from_le_bytes([block[2], block[3], block[4], block[5]]);
        let qs = &block[6..];
        out.extend_from_slice(&block[..2]);
        let value = |low: u8, bit: usize| ((low | (((qh >> bit) & 1) as u8) << 4) as i8) - 16;
        for (j, &q) in qs.iter().enumerate() {
            out.push(value(q & 0x0F, j) as u8);
        }
        for (j, &q) in qs.iter().enumerate() {
            out.push(value(q >> 4, j + 16) as u8);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q5_0_transcode_is_exact() {
        let values: Vec<f32> = (0..256)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        let src = Tensor::from_vec(values, (2, 128), &Device::Cpu).unwrap();
        let q5 = QTensor::quantize(&src, GgmlDType::Q5_0).unwrap();
        let q8 = q5_0_to_q8_0(&q5).unwrap();
        assert_eq!(q8.dtype(), GgmlDType::Q8_0);
        let a = q5.dequantize(&Device::Cpu).unwrap().flatten_all().unwrap();
        let b = q8.dequantize(&Device::Cpu).unwrap().flatten_all().unwrap();
        assert_eq!(a.to_vec1::<f32>().unwrap(), b.to_vec1::<f32>().unwrap());
    }
}
