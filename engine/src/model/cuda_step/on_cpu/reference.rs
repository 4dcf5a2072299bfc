//! A model's forward pass in f64, with the step's quantization of each matmul's input (Q8_1
//! blocks of 32 values: a scale of the block's largest magnitude over 127 kept as f16,
//! the values rounded to it, and for Q5_0 weights the block's stored sum), written from
//! the model's definition apart from both the step and the host's engine: what the step's
//! launches should give, up to the rounding of f32 against f64.

use crate::model::Model;
use crate::model::config::ModelConfig;
use crate::model::linear::{Linear, Projections};
use crate::model::lora::{Adapter, Module};
use crate::model::weights::Layer;
use candle_core::quantized::GgmlDType;
use candle_core::{Device, Tensor};
use half::f16;

/// A projection's weight as the kernels read it: its values and, for Q5_0, each unit's
/// scale (the products' stored-sum term).
struct Weight {
    n: usize,
    k: usize,
    values: Vec<f64>,
    q5_0_scales: Option<Vec<f64>>,
    bias: Option<Vec<f64>>,
}

impl Weight {
    fn of(linear: &Linear) -> Self {
        let q = linear.loaded();
        let (n, k) = q.shape().dims2().unwrap();
        let values = q.dequantize(&Device::Cpu).unwrap().flatten_all().unwrap();
        let q5_0_scales = (q.dtype() == GgmlDType::Q5_0).then(|| {
            let bytes = q.data().unwrap();
            (bytes.chunks_exact(22))
                .map(|block| f16::from_le_bytes([block[0], block[1]]).to_f64())
                .collect()
        });
        Self {
            n,
            k,
            values: floats(&values.to_vec1::<f32>().unwrap()),
            q5_0_scales,
            bias: linear.bias().map(|b| floats(&b.to_vec1::<f32>().unwrap())),
        }
    }

    /// `W x` for `x` as the step quantizes it.
    fn apply(&self, x: &Quantized) -> Vec<f64> {
        (0..self.n)
            .map(|f| {
                let row = &self.values[f * self.k..][..self.k];
                let mut y: f64 = row.iter().zip(&x.values).map(|(w, x)| w * x).sum();
                if let Some(scales) = &self.q5_0_scales {
                    // The kernels take Q5_0's offset of 16 off with the input's stored sums.
                    for (u, (sum, stored)) in x.sums.iter().enumerate() {
                        y += 16.0 * scales[f * self.k / 32 + u] * (sum - stored);
                    }
                }
                y + self.bias.as_ref().map_or(0.0, |b| b[f])
            })
            .collect()
    }
}

/// The weights of projections of one input (fused or not), in order.
fn weights_of<const N: usize>(p: &Projections<N>) -> Vec<Weight> {
    p.parts()
        .iter()
        .map(|(linear, _)| Weight::of(linear))
        .collect()
}

/// Their outputs one after another.
fn apply_all(weights: &[Weight], x: &Quantized) -> Vec<f64> {
    weights.iter().flat_map(|w| w.apply(x)).collect()
}

/// A layer's weights as the kernels read them, read once.
struct LayerWeights {
    attn_norm: Vec<f64>,
    qkv: Vec<Weight>,
    /// Qwen3's norms of each head's queries and keys.
    head_norms: Option<[Vec<f64>; 2]>,
    o: Weight,
    ffn_norm: Vec<f64>,
    gate_up: Vec<Weight>,
    down: Weight,
}

impl LayerWeights {
    fn of(layer: &Layer) -> Self {
        Self {
            attn_norm: tensor(&layer.attn_norm),
            qkv: weights_of(&layer.qkv),
            head_norms: layer
                .head_norms
                .as_ref()
                .map(|[q, k]| [tensor(q), tensor(k)]),
            o: Weight::of(&layer.o),
            ffn_norm: tensor(&layer.ffn_norm),
            gate_up: weights_of(&layer.gate_up),
            down: Weight::of(&layer.down),
        }
    }
}

fn tensor(t: &Tensor) -> Vec<f64> {
    floats(&t.flatten_all().unwrap().to_vec1().unwrap())
}

fn floats(values: &[f32]) -> Vec<f64> {
    values.iter().map(|&v| f64::from(v)).collect()
}

/// A row quantized as `store_q8_1` stores it: the values each block's scale times its
/// rounded integers, and each block's (sum of those, stored sum of the row's values).
struct Quantized {
    values: Vec<f64>,
    sums: Vec<(f64, f64)>,
}

fn quantize(x: &[f64]) -> Quantized {
    let (mut values, mut sums) = (Vec::new(), Vec::new());
    for block in x.chunks(32) {
        let amax = block.iter().fold(0f64, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let scale = f16::from_f64(d).to_f64();
        let q = block
            .iter()
            .map(|v| if amax == 0.0 { 0.0 } else { (v / d).round() });
        let block_values: Vec<f64> = q.map(|q| scale * q).collect();
        let stored = f16::from_f64(block.iter().sum()).to_f64();
        sums.push((block_values.iter().sum(), stored));
        values.extend(block_values);
    }
    Quantized { values, sums }
}

pub(super) fn rms_norm(x: &[f64], w: &[f64], eps: f64) -> Vec<f64> {
    let scale = 1.0 / (x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64 + eps).sqrt();
    x.iter().zip(w).map(|(v, w)| v * scale * w).collect()
}

/// Each of `tokens`' last hidden state (the output norm's, before the vocabulary
/// projection) and logits, fed from position 0.
pub(super) struct Forward {
    pub(super) hidden: Vec<Vec<f64>>,
    pub(super) logits: Vec<Vec<f64>>,
}

pub(super) fn forward(model: &Model, tokens: &[u32]) -> Forward {
    forward_adapted(model, tokens, None)
}

/// [`forward`] with `adapter`'s deltas added to each projection it changes: `scale · B A x`
/// for `x` as the step quantizes the projection's input.
pub(super) fn forward_adapted(model: &Model, tokens: &[u32], adapter: Option<&Adapter>) -> Forward {
    let (c, w) = (&model.inner.config, &model.inner.weights);
    let embedding = tensor(&w.embedding.dequantize(&Device::Cpu).unwrap());
    let mut x: Vec<Vec<f64>> = (tokens.iter())
        .map(|&t| embedding[t as usize * c.hidden..][..c.hidden].to_vec())
        .collect();
    let tables = (tensor(&w.cos), tensor(&w.sin));
    for (index, layer) in w.layers.iter().enumerate() {
        let deltas = Deltas {
            adapter,
            layer: index,
        };
        let weights = LayerWeights::of(layer);
        layer_forward(c, &weights, &deltas, (&tables.0, &tables.1), &mut x);
    }
    let norm = tensor(&w.output_norm);
    let hidden: Vec<Vec<f64>> = x
        .iter()
        .map(|row| rms_norm(row, &norm, c.rms_eps))
        .collect();
    let lm_head = Weight::of(&w.lm_head);
    Forward {
        logits: hidden.iter().map(|h| lm_head.apply(&quantize(h))).collect(),
        hidden,
    }
}

/// A layer's LoRA deltas, where the pass has an adapter.
struct Deltas<'a> {
    adapter: Option<&'a Adapter>,
    layer: usize,
}

impl Deltas<'_> {
    /// `y` (the outputs of `modules`, one after another: each a projection and its width)
    /// with their deltas for the input `x` added.
    fn add(&self, modules: &[(Module, usize)], x: &Quantized, mut y: Vec<f64>) -> Vec<f64> {
        let mut at = 0;
        for &(module, n) in modules {
            at += n;
            let values = self
                .adapter
                .and_then(|a| a.delta_values(self.layer, module));
            let Some((a, b_t, rank, scale)) = values else {
                continue;
            };
            let (k, from) = (a.len() / rank, at - n);
            let widen = |bits: u16| f64::from(half::bf16::from_bits(bits).to_f32());
            for r in 0..rank {
                let dot: f64 = (a[r * k..][..k].iter().zip(&x.values))
                    .map(|(&a, x)| widen(a) * x)
                    .sum();
                let t = f64::from(scale) * dot;
                for (y, &b) in y[from..at].iter_mut().zip(&b_t[r * n..][..n]) {
                    *y += t * widen(b);
                }
            }
        }
        y
    }
}

/// One layer over the residual stream `x` (a row a position from 0), with its LoRA deltas
/// and the rotary tables `(cos, sin)`.
fn layer_forward(
    c: &ModelConfig,
    l: &LayerWeights,
    deltas: &Deltas<'_>,
    tables: (&[f64], &[f64]),
    x: &mut [Vec<f64>],
) {
    let (hd, eps) = (c.head_dim, c.rms_eps);
    let (nq, nkv) = (c.n_heads * hd, c.n_kv_heads * hd);
    let (mut qs, mut keys, mut values) = (Vec::new(), Vec::new(), Vec::new());
    for (pos, row) in x.iter().enumerate() {
        let input = quantize(&rms_norm(row, &l.attn_norm, eps));
        let qkv = deltas.add(
            &[(Module::Q, nq), (Module::K, nkv), (Module::V, nkv)],
            &input,
            apply_all(&l.qkv, &input),
        );
        let (q, kv) = qkv.split_at(nq);
        let (k, v) = kv.split_at(c.n_kv_heads * hd);
        let rotate = |heads: &[f64], norm: Option<&Vec<f64>>| {
            (heads.chunks(hd))
                .flat_map(|head| {
                    let head = norm.map_or_else(|| head.to_vec(), |w| rms_norm(head, w, eps));
                    rotated(&head, pos, tables, c.architecture.interleaved_rope())
                })
                .collect::<Vec<f64>>()
        };
        let norms = l.head_norms.as_ref();
        qs.push(rotate(q, norms.map(|[q, _]| q)));
        keys.push(rotate(k, norms.map(|[_, k]| k)));
        values.push(v.to_vec());
    }
    let (group, scale) = (c.n_heads / c.n_kv_heads, 1.0 / (hd as f64).sqrt());
    for (pos, row) in x.iter_mut().enumerate() {
        let heads: Vec<f64> = (qs[pos].chunks(hd).enumerate())
            .flat_map(|(h, q)| {
                let at = (h / group) * hd;
                let key = |j: usize| &keys[j][at..at + hd];
                let value = |j: usize| &values[j][at..at + hd];
                attend_head(q, pos + 1, key, value, scale)
            })
            .collect();
        let input = quantize(&heads);
        let o = deltas.add(&[(Module::O, c.hidden)], &input, l.o.apply(&input));
        row.iter_mut().zip(&o).for_each(|(x, o)| *x += o);
        let normed = rms_norm(row, &l.ffn_norm, eps);
        let input = quantize(&normed);
        let gate_up = deltas.add(
            &[(Module::Gate, c.ffn_hidden), (Module::Up, c.ffn_hidden)],
            &input,
            apply_all(&l.gate_up, &input),
        );
        let (gate, up) = gate_up.split_at(c.ffn_hidden);
        let act: Vec<f64> = (gate.iter().zip(up))
            .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
            .collect();
        let input = quantize(&act);
        let down = deltas.add(&[(Module::Down, c.hidden)], &input, l.down.apply(&input));
        row.iter_mut().zip(&down).for_each(|(x, d)| *x += d);
    }
}

/// A head's values rotated for position `pos` by the model's tables: pairs (i, i + hd / 2),
/// or (2i, 2i + 1) where `interleaved`, each by its frequency's angle.
pub(super) fn rotated(
    head: &[f64],
    pos: usize,
    (cos, sin): (&[f64], &[f64]),
    interleaved: bool,
) -> Vec<f64> {
    let half = head.len() / 2;
    let mut out = head.to_vec();
    for i in 0..half {
        let (a, b) = if interleaved {
            (2 * i, 2 * i + 1)
        } else {
            (i, i + half)
        };
        let (c, s) = (cos[pos * half + i], sin[pos * half + i]);
        out[a] = head[a] * c - head[b] * s;
        out[b] = head[a] * s + head[b] * c;
    }
    out
}

/// One query head's attention over `n` keys (`key(j)`, `value(j)`: the `j`th key's and
/// value's values), its scores scaled by `scale`.
pub(super) fn attend_head<'a>(
    q: &[f64],
    n: usize,
    key: impl Fn(usize) -> &'a [f64],
    value: impl Fn(usize) -> &'a [f64],
    scale: f64,
) -> Vec<f64> {
    let dot = |k: &[f64]| q.iter().zip(k).map(|(a, b)| a * b).sum::<f64>();
    let scores: Vec<f64> = (0..n).map(|j| dot(key(j)) * scale).collect();
    let top = scores.iter().fold(f64::NEG_INFINITY, |m, &s| m.max(s));
    let weights: Vec<f64> = scores.iter().map(|s| (s - top).exp()).collect();
    let total: f64 = weights.iter().sum();
    (0..q.len())
        .map(|d| (0..n).map(|j| weights[j] * value(j)[d]).sum::<f64>() / total)
        .collect()
}
