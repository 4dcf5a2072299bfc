//! Causal grouped-query attention over a session's KV cache.
//!
//! Two kernels compute the same thing. `Host` (CPU) works on the raw cache rows: each query
//! row attends to exactly the keys at positions `0..=pos`, so a row's result does not depend on
//! how many tokens were fed with it. That batch invariance is what makes greedy speculation
//! exact: verifying K drafted tokens in one pass sees what K single-token steps would see.
//! `Tensor` uses candle ops (matmul + mask + softmax) and runs on any device; on the invariant
//! path it takes one query row at a time, so that a row meets the same GPU kernels as in a
//! decode step.

use super::config::ModelConfig;
use super::linear::MatmulPath;
use crate::error::Result;
use candle_core::{DType, Device, Storage, Tensor};
use std::cell::RefCell;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionKernel {
    /// Batch-invariant CPU kernel on raw cache rows.
    Host,
    /// candle tensor ops; runs on every device.
    Tensor,
}

impl AttentionKernel {
    pub(crate) fn default_for(device: &Device) -> Self {
        if device.is_cpu() {
            Self::Host
        } else {
            Self::Tensor
        }
    }
}

/// Where one sequence's rows sit in the batch and where its new tokens start in its cache.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Span {
    pub(crate) row: usize,
    pub(crate) len: usize,
    pub(crate) start: usize,
}

/// Attention for one forward pass: the sequences' spans and, for the tensor kernel on the
/// throughput path, their causal masks, built once per pass rather than once per layer.
#[derive(Debug)]
pub(crate) struct Plan {
    kernel: AttentionKernel,
    /// The tensor kernel one query row at a time (the invariant path): a row then goes
    /// through the same tensor shapes, and so the same GPU kernels, as when it is decoded
    /// alone, whatever the rows beside it.
    per_row: bool,
    spans: Vec<Span>,
    masks: Vec<Tensor>,
}

impl Plan {
    pub(crate) fn new(
        kernel: AttentionKernel,
        path: MatmulPath,
        spans: Vec<Span>,
        device: &Device,
    ) -> Result<Self> {
        let per_row = kernel == AttentionKernel::Tensor && path == MatmulPath::Invariant;
        let masks = match kernel {
            AttentionKernel::Tensor if !per_row => spans
                .iter()
                .map(|span| causal_mask(span, device))
                .collect::<Result<_>>()?,
            _ => Vec::new(),
        };
        Ok(Self {
            kernel,
            per_row,
            spans,
            masks,
        })
    }

    pub(crate) fn spans(&self) -> &[Span] {
        &self.spans
    }

    /// `q`: `[total, n_heads, head_dim]` (rotary applied); `caches[i]`: keys and values of
    /// sequence `i` for this layer, already holding its new rows. Returns
    /// `[total, n_heads * head_dim]`.
    pub(crate) fn attend(
        &self,
        c: &ModelConfig,
        q: &Tensor,
        caches: &[(&Tensor, &Tensor)],
    ) -> Result<Tensor> {
        match self.kernel {
            AttentionKernel::Host => attend_host(c, q, caches, &self.spans),
            AttentionKernel::Tensor if self.per_row => attend_rows(c, q, caches, &self.spans),
            AttentionKernel::Tensor => attend_tensor(c, q, caches, &self.spans, &self.masks),
        }
    }
}

/// `[n, start + n]`: 0 where query row i (position start + i) may look, -inf after it.
fn causal_mask(span: &Span, device: &Device) -> Result<Tensor> {
    let (n, len) = (span.len, span.start + span.len);
    let mask: Vec<f32> = (0..n)
        .flat_map(|i| {
            (0..len).map(move |j| {
                if j <= span.start + i {
                    0.0
                } else {
                    f32::NEG_INFINITY
                }
            })
        })
        .collect();
    Ok(Tensor::from_vec(mask, (n, len), device)?)
}

/// softmax(q K^T / sqrt(d) + mask) V for `n` query rows against the first `len` cached
/// keys and values: `q` `[n, n_heads, head_dim]` in, `[n, n_heads * head_dim]` out.
fn attend_block(
    c: &ModelConfig,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    len: usize,
    mask: Option<&Tensor>,
) -> Result<Tensor> {
    let (g, kvh, hd) = (c.group_size(), c.n_kv_heads, c.head_dim);
    let n = q.dim(0)?;
    let scale = 1.0 / (hd as f64).sqrt();
    // Query head h uses key/value head h / g: lay the g heads of a group out as rows.
    let q = q
        .reshape((n, kvh, g, hd))?
        .permute((1, 2, 0, 3))?
        .contiguous()?
        .reshape((kvh, g * n, hd))?;
    let k = k.narrow(0, 0, len)?.transpose(0, 1)?.contiguous()?;
    let v = v.narrow(0, 0, len)?.transpose(0, 1)?.contiguous()?;
    let scores = (q.matmul(&k.t()?)? * scale)?.reshape((kvh, g, n, len))?;
    let scores = match mask {
        Some(mask) => scores.broadcast_add(&mask.to_dtype(scores.dtype())?)?,
        None => scores,
    };
    let probs = candle_nn::ops::softmax_last_dim(&scores)?;
    let out = probs.reshape((kvh, g * n, len))?.matmul(&v)?;
    Ok(out
        .reshape((kvh, g, n, hd))?
        .permute((2, 0, 1, 3))?
        .reshape((n, kvh * g * hd))?)
}

/// Each query row on its own, over the keys up to its position: on CUDA our kernel (one
/// launch per sequence), elsewhere candle's ops with no mask and the shapes of a decode step
/// at that position.
fn attend_rows(
    c: &ModelConfig,
    q: &Tensor,
    caches: &[(&Tensor, &Tensor)],
    spans: &[Span],
) -> Result<Tensor> {
    let mut outs = Vec::with_capacity(q.dim(0)?);
    for (span, (k, v)) in spans.iter().zip(caches) {
        #[cfg(feature = "cuda")]
        if q.device().is_cuda() && super::cuda::attention_fits(span.start + span.len) {
            let rows = q.narrow(0, span.row, span.len)?;
            outs.push(super::cuda::attend(&rows, k, v, span.start, c.n_kv_heads)?);
            continue;
        }
        for i in 0..span.len {
            let row = q.narrow(0, span.row + i, 1)?;
            outs.push(attend_block(c, &row, k, v, span.start + i + 1, None)?);
        }
    }
    Ok(Tensor::cat(&outs, 0)?)
}

fn attend_tensor(
    c: &ModelConfig,
    q: &Tensor,
    caches: &[(&Tensor, &Tensor)],
    spans: &[Span],
    masks: &[Tensor],
) -> Result<Tensor> {
    let mut outs = Vec::with_capacity(spans.len());
    for ((span, (k, v)), mask) in spans.iter().zip(caches).zip(masks) {
        let rows = q.narrow(0, span.row, span.len)?;
        outs.push(attend_block(
            c,
            &rows,
            k,
            v,
            span.start + span.len,
            Some(mask),
        )?);
    }
    Ok(Tensor::cat(&outs, 0)?)
}

/// A pointer to the output buffer that worker threads write disjoint rows of.
#[derive(Clone, Copy)]
struct OutRows(*mut f32);
// SAFETY: every (row, head) item writes only its own `head_dim` slice of the buffer, and the
// buffer outlives the parallel region.
unsafe impl Send for OutRows {}
unsafe impl Sync for OutRows {}

impl OutRows {
    /// # Safety
    /// `start..start + len` must lie in the buffer and be written by no other thread.
    #[allow(clippy::mut_from_ref)]
    unsafe fn slice(&self, start: usize, len: usize) -> &mut [f32] {
        // SAFETY: upheld by the caller.
        unsafe { std::slice::from_raw_parts_mut(self.0.add(start), len) }
    }
}

fn attend_host(
    c: &ModelConfig,
    q: &Tensor,
    caches: &[(&Tensor, &Tensor)],
    spans: &[Span],
) -> Result<Tensor> {
    let (g, kvh, hd, nh) = (c.group_size(), c.n_kv_heads, c.head_dim, c.n_heads);
    let scale = 1.0 / (hd as f32).sqrt();
    let q = q.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let total: usize = spans.iter().map(|s| s.len).sum();
    let mut out = vec![0f32; total * nh * hd];
    let out_ptr = OutRows(out.as_mut_ptr());
    for (span, (k, v)) in spans.iter().zip(caches) {
        let (k_guard, k_layout) = k.storage_and_layout();
        let (v_guard, v_layout) = v.storage_and_layout();
        let (Storage::Cpu(k_store), Storage::Cpu(v_store)) = (&*k_guard, &*v_guard) else {
            return Err(
                candle_core::Error::Msg("host attention needs a CPU KV cache".into()).into(),
            );
        };
        let keys = &k_store.as_slice::<f32>()?[k_layout.start_offset()..];
        let values = &v_store.as_slice::<f32>()?[v_layout.start_offset()..];
        let items = span.len * nh;
        candle_core::utils::barrier_pool().execute_chunked(items, |range| {
            SCORES.with(|scores| {
                let mut scores = scores.borrow_mut();
                for item in range {
                    let (i, h) = (item / nh, item % nh);
                    let row = span.row + i;
                    let pos = span.start + i;
                    let query = &q[(row * nh + h) * hd..(row * nh + h + 1) * hd];
                    let kv_head = h / g;
                    // SAFETY: (row, h) is unique to this work item.
                    let dst = unsafe { out_ptr.slice((row * nh + h) * hd, hd) };
                    let rows = KvRows {
                        keys,
                        values,
                        stride: kvh * hd,
                        offset: kv_head * hd,
                        head_dim: hd,
                    };
                    attend_row(query, &rows, pos + 1, scale, &mut scores, dst);
                }
            })
        });
    }
    Ok(Tensor::from_vec(out, (total, nh * hd), &Device::Cpu)?)
}

thread_local! {
    static SCORES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// One key/value head's rows in a token-major cache.
struct KvRows<'a> {
    keys: &'a [f32],
    values: &'a [f32],
    stride: usize,
    offset: usize,
    head_dim: usize,
}

impl KvRows<'_> {
    fn key(&self, t: usize) -> &[f32] {
        let at = t * self.stride + self.offset;
        &self.keys[at..at + self.head_dim]
    }

    fn value(&self, t: usize) -> &[f32] {
        let at = t * self.stride + self.offset;
        &self.values[at..at + self.head_dim]
    }
}

/// softmax(q·K[0..n] * scale) · V[0..n] for one query row, into `dst`.
fn attend_row(
    query: &[f32],
    rows: &KvRows<'_>,
    n: usize,
    scale: f32,
    scores: &mut Vec<f32>,
    dst: &mut [f32],
) {
    scores.clear();
    let mut max = f32::NEG_INFINITY;
    for t in 0..n {
        let s = dot(query, rows.key(t)) * scale;
        max = max.max(s);
        scores.push(s);
    }
    let mut sum = 0f32;
    for s in scores.iter_mut() {
        *s = (*s - max).exp();
        sum += *s;
    }
    dst.fill(0.0);
    for (t, &w) in scores.iter().enumerate() {
        axpy(w, rows.value(t), dst);
    }
    let inv = 1.0 / sum;
    for d in dst.iter_mut() {
        *d *= inv;
    }
}

/// Dot product with eight independent accumulators so the compiler can keep them in one
/// SIMD register (float addition is not reassociated otherwise).
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (a8, a_rest) = a.split_at(a.len() / 8 * 8);
    let (b8, b_rest) = b.split_at(a8.len());
    for (x, y) in a8.chunks_exact(8).zip(b8.chunks_exact(8)) {
        for i in 0..8 {
            acc[i] = x[i].mul_add(y[i], acc[i]);
        }
    }
    let mut s = acc.iter().sum::<f32>();
    for (x, y) in a_rest.iter().zip(b_rest) {
        s = x.mul_add(*y, s);
    }
    s
}

#[inline]
fn axpy(w: f32, x: &[f32], y: &mut [f32]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi = xi.mul_add(w, *yi);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_matches_naive() {
        let a: Vec<f32> = (0..37).map(|i| i as f32 * 0.5 - 3.0).collect();
        let b: Vec<f32> = (0..37).map(|i| (i as f32).sin()).collect();
        let naive: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
        assert!((dot(&a, &b) - naive).abs() < 1e-4);
    }

    #[test]
    fn equal_scores_average_the_values() {
        // Two keys with equal scores: the output is the mean of their values.
        let keys = [1.0f32, 0.0, 1.0, 0.0];
        let values = [2.0f32, 4.0, 6.0, 8.0];
        let rows = KvRows {
            keys: &keys,
            values: &values,
            stride: 2,
            offset: 0,
            head_dim: 2,
        };
        let mut dst = [0f32; 2];
        attend_row(&[1.0, 0.0], &rows, 2, 1.0, &mut Vec::new(), &mut dst);
        assert_eq!(dst, [4.0, 6.0]);
    }
}
