//! Quantized projections, with one rule on CPU: a row's result must not depend on how many
//! rows are multiplied with it (see the batch-invariance note in `attention.rs`).
//!
//! candle picks its matmul kernel by shape. For Q4_K and Q8_0 the choice does not depend on the
//! row count, but Q6_K uses a compact kernel for one row and a repacked one for more, and the
//! two round differently (~1e-6). Activations are re-quantized at every layer, so such a
//! difference flips roundings and grows to visible logit changes; a target that verified K
//! drafted tokens with a different kernel than it decodes one token with would break greedy
//! exactness. Q6_K therefore always goes through candle's compact kernel, which walks rows
//! independently and reads each weight row once per 16 activation rows.

use crate::error::Result;
use candle_core::quantized::k_quants::{self, BlockQ6K};
use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Device, Module, Tensor};
use std::sync::Arc;

/// A quantized projection `y = x W^T (+ b)`.
#[derive(Debug)]
pub(crate) struct Linear {
    weight: Arc<QTensor>,
    matmul: QMatMul,
    bias: Option<Tensor>,
    compact_q6k: bool,
}

impl Linear {
    pub(crate) fn new(weight: Arc<QTensor>, bias: Option<Tensor>) -> Result<Self> {
        let compact_q6k = weight.dtype() == GgmlDType::Q6K && weight.device().is_cpu();
        Ok(Self {
            matmul: QMatMul::from_arc(weight.clone())?,
            weight,
            bias,
            compact_q6k,
        })
    }

    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = if self.compact_q6k {
            self.forward_q6k(x)?
        } else {
            self.matmul.forward(x)?
        };
        self.add_bias(y)
    }

    fn add_bias(&self, y: Tensor) -> Result<Tensor> {
        Ok(match &self.bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        })
    }

    fn forward_q6k(&self, x: &Tensor) -> Result<Tensor> {
        let (n, k) = self.weight.shape().dims2()?;
        let (m, xk) = x.dims2()?;
        if xk != k {
            return Err(candle_core::Error::ShapeMismatchBinaryOp {
                lhs: x.shape().clone(),
                rhs: self.weight.shape().clone(),
                op: "q6k matmul",
            }
            .into());
        }
        let lhs = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let data = self.weight.data()?;
        let block = std::mem::size_of::<BlockQ6K>();
        assert_eq!(
            data.as_ptr().align_offset(std::mem::align_of::<BlockQ6K>()),
            0,
            "Q6_K storage is a Vec<BlockQ6K>"
        );
        // SAFETY: candle stores a CPU Q6_K tensor as a Vec<BlockQ6K>; `data()` borrows those
        // bytes (aligned, as asserted), and BlockQ6K is plain old data.
        let blocks: &[BlockQ6K] = unsafe {
            std::slice::from_raw_parts(data.as_ptr().cast::<BlockQ6K>(), data.len() / block)
        };
        let mut dst = vec![0f32; m * n];
        k_quants::matmul((m, k, n), &lhs, blocks, &mut dst)?;
        Ok(Tensor::from_vec(dst, (m, n), &Device::Cpu)?)
    }
}

/// Several projections of the same input. candle fuses same-type projections into one pass
/// over the quantized input (one quantization, one parallel region) where it can.
pub(crate) fn project<const N: usize>(x: &Tensor, linears: [&Linear; N]) -> Result<[Tensor; N]> {
    let weights: Vec<&QTensor> = linears.iter().map(|l| l.weight.as_ref()).collect();
    let fusable = x.device().is_cpu()
        && linears
            .iter()
            .all(|l| !l.compact_q6k && l.weight.dtype() == weights[0].dtype());
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
            .map(|l| l.forward(x))
            .collect::<Result<_>>()?,
    };
    Ok(outputs
        .try_into()
        .unwrap_or_else(|_| unreachable!("one output per projection")))
}
