//! Quantized projections, and the kernel choice that keeps greedy speculation exact.
//!
//! candle picks its CPU matmul kernel by shape: Q4_K and Q6_K weights go through a repacked
//! AVX-512 VNNI kernel (Q6_K only for more than one row) and otherwise through a compact
//! per-row kernel. The two round differently (~1e-6), and since activations are re-quantized
//! at every layer such a difference flips roundings and grows into different logits. A target
//! that verified K drafted tokens with another kernel than it decodes one token with would not
//! be exact, so forward passes come in two kinds:
//!
//! - [`MatmulPath::Invariant`] (decode and verification): Q4_K/Q6_K go through candle's compact
//!   kernel, which computes each row on its own, so a row's result is bitwise the same whether
//!   it is multiplied alone or with K others. It also reads the fewest weight bytes, which is
//!   what single-token decode is bound by.
//! - [`MatmulPath::Throughput`] (prompt prefill): candle's own choice, the repacked kernel,
//!   2.5x faster for long prompts. Deterministic, but not bitwise equal to the invariant path;
//!   every session ingests its prompt this way, so target-only and speculative runs still see
//!   the same cache.

use crate::error::Result;
use candle_core::quantized::k_quants::{self, BlockQ4K, BlockQ6K, GgmlType};
use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Device, Module, Tensor};
use std::sync::Arc;

/// Which matmul kernels a forward pass uses (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MatmulPath {
    /// Row results independent of the batch: decode and verification.
    #[default]
    Invariant,
    /// Fastest for many rows: prompt prefill.
    Throughput,
}

/// A quantized projection `y = x W^T (+ b)`.
#[derive(Debug)]
pub(crate) struct Linear {
    weight: Arc<QTensor>,
    matmul: QMatMul,
    bias: Option<Tensor>,
    /// The weight's dtype when the invariant path must bypass candle's kernel choice.
    compact: Option<GgmlDType>,
}

impl Linear {
    pub(crate) fn new(weight: Arc<QTensor>, bias: Option<Tensor>) -> Result<Self> {
        let compact = match weight.dtype() {
            d @ (GgmlDType::Q4K | GgmlDType::Q6K) if weight.device().is_cpu() => Some(d),
            _ => None,
        };
        Ok(Self {
            matmul: QMatMul::from_arc(weight.clone())?,
            weight,
            bias,
            compact,
        })
    }

    pub(crate) fn forward(&self, x: &Tensor, path: MatmulPath) -> Result<Tensor> {
        let y = match (self.compact, path) {
            (Some(GgmlDType::Q4K), MatmulPath::Invariant) => self.compact_matmul::<BlockQ4K>(x)?,
            (Some(GgmlDType::Q6K), MatmulPath::Invariant) => self.compact_matmul::<BlockQ6K>(x)?,
            _ => self.matmul.forward(x)?,
        };
        self.add_bias(y)
    }

    fn add_bias(&self, y: Tensor) -> Result<Tensor> {
        Ok(match &self.bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        })
    }

    fn compact_matmul<T: GgmlType>(&self, x: &Tensor) -> Result<Tensor> {
        let (n, k) = self.weight.shape().dims2()?;
        let (m, xk) = x.dims2()?;
        if xk != k {
            return Err(candle_core::Error::ShapeMismatchBinaryOp {
                lhs: x.shape().clone(),
                rhs: self.weight.shape().clone(),
                op: "quantized matmul",
            }
            .into());
        }
        let lhs = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let data = self.weight.data()?;
        assert_eq!(
            data.as_ptr().align_offset(std::mem::align_of::<T>()),
            0,
            "candle stores CPU quantized tensors as a Vec of blocks"
        );
        // SAFETY: `compact` is set only for CPU tensors of T's dtype, which candle stores as a
        // Vec<T>; `data()` borrows those bytes (aligned, as asserted) and T is plain old data.
        let blocks: &[T] = unsafe {
            std::slice::from_raw_parts(
                data.as_ptr().cast::<T>(),
                data.len() / std::mem::size_of::<T>(),
            )
        };
        let mut dst = vec![0f32; m * n];
        k_quants::matmul((m, k, n), &lhs, blocks, &mut dst)?;
        Ok(Tensor::from_vec(dst, (m, n), &Device::Cpu)?)
    }
}

/// Several projections of the same input. Where candle's kernel is used anyway, same-type
/// projections are fused into one pass over the quantized input (one quantization, one
/// parallel region).
pub(crate) fn project<const N: usize>(
    x: &Tensor,
    linears: [&Linear; N],
    path: MatmulPath,
) -> Result<[Tensor; N]> {
    let weights: Vec<&QTensor> = linears.iter().map(|l| l.weight.as_ref()).collect();
    let fusable = x.device().is_cpu()
        && linears.iter().all(|l| {
            (l.compact.is_none() || path == MatmulPath::Throughput)
                && l.weight.dtype() == weights[0].dtype()
        });
    let fused = if fusable {
        QTensor::gemv_fused_shared_lhs(&weights, x)?
    } else {
        None
    };
    let outputs: Vec<Tensor> = match fused {
        Some(ys) => ys
            .into_iter()
            .zip(linears)
            .map(|(y, l)| l.add_bias(y))
            .collect::<Result<_>>()?,
        None => linears
            .iter()
            .map(|l| l.forward(x, path))
            .collect::<Result<_>>()?,
    };
    Ok(outputs
        .try_into()
        .unwrap_or_else(|_| unreachable!("one output per projection")))
}
