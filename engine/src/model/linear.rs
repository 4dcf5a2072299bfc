//! Quantized projections, and the kernel choice that keeps greedy speculation exact.
//!
//! Greedy speculation is exact only if the target computes a row of activations bitwise the
//! same whether it is alone (decode) or one of K+1 rows (verification). candle picks its CPU
//! matmul kernel by shape: Q4_K and Q6_K weights go through a repacked AVX-512 VNNI kernel
//! (Q6_K only for more than one row) or a compact per-row kernel, and the two round
//! differently (~1e-6). Activations are re-quantized at every layer, so such a difference flips
//! roundings and grows into different logits. Hence:
//!
//! - Q4_K/Q6_K on CPUs with AVX2/FMA (x86-64-v3; AVX-512 VNNI or AVX-VNNI when present) use
//!   our own kernels (`super::kernels`) for every forward pass: each row gets the same
//!   instructions whatever the batch, they read GGUF's byte count for one row (what decode is
//!   bound by) and reuse each unpacked weight block for up to 8 rows (verifying K+1 rows costs
//!   far less than K+1 decodes), and on AVX-512 they match candle's repacked kernel on long
//!   prompts. candle's copy of the weight is then dropped.
//! - Elsewhere the kernel depends on the [`MatmulPath`]: `Invariant` (decode and verification)
//!   sends Q4_K/Q6_K through candle's compact per-row kernel (batch-invariant, m times the cost
//!   of one row); `Throughput` (prompt prefill) lets candle choose. Every session ingests its
//!   prompt the same way, so target-only and speculative runs still see the same cache.
//! - Q8_0 and Q5_0 (the 0.5B draft) use our kernels too wherever they run, for any `k` that is
//!   a multiple of 32 (candle's repacked kernels need multiples of 256, which the draft's
//!   k = 896 is not): Q5_0 stays at 5.5 bits per weight, and K+1 rows cost far less than K+1
//!   decodes, where candle's Q8_0 kernel costs m times one row.
//! - Other types (Q4_0, ..., and Q8_0 without our kernels) use candle, whose choice for them
//!   does not depend on the row count on the CPU.
//! - On a GPU, candle's choice depends on the row count for every type, so the `Invariant`
//!   path runs each row as decode does: on CUDA through candle's mat-vec kernel in launches of
//!   at most four rows (`super::cuda`), elsewhere (and for types that kernel lacks) one row
//!   per call.
//!
//! The kernel level (AVX-512 VNNI, AVX-VNNI, AVX2 or none) is the best the CPU has, detected
//! once; `DUET_CPU_KERNELS=avx512|avxvnni|avx2|off`, read once at first use, forces another
//! (for tests and comparisons; `off` is candle's kernels, `avx512` also keeps AMX tiles off).
//! Levels round differently from each other, so greedy texts may differ between them, but
//! each is batch-invariant on its own; AMX tiles, where the AVX-512 level uses them, give
//! that level's bits.

use super::kernels::{self, Packed, Quant};
use crate::error::Result;
use candle_core::quantized::k_quants::{self, BlockQ4K, BlockQ6K, GgmlType};
use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{D, DType, Device, Module, Tensor};
use std::sync::Arc;

/// Which matmul kernels a forward pass may use (see the module docs).
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
    kernel: Kernel,
    bias: Option<Tensor>,
    /// `(n, k)`: output and input features.
    shape: (usize, usize),
    /// The weight as loaded, whichever kernel serves it: the tests that run the CUDA
    /// step's launches on the CPU read its bytes (`cuda_step::on_cpu`).
    #[cfg(all(test, feature = "cuda"))]
    loaded: Arc<QTensor>,
}

#[derive(Debug)]
enum Kernel {
    /// Our batch-invariant kernel, for every path.
    Packed(Packed),
    /// candle's; `compact` is set for Q4_K/Q6_K on CPU, whose invariant path must bypass
    /// candle's shape-dependent choice.
    Candle {
        weight: Arc<QTensor>,
        matmul: QMatMul,
        compact: Option<GgmlDType>,
    },
}

impl Linear {
    pub(crate) fn new(weight: Arc<QTensor>, bias: Option<Tensor>) -> Result<Self> {
        let shape = weight.shape().dims2()?;
        let on_cpu = weight.device().is_cpu();
        let quant = match weight.dtype() {
            GgmlDType::Q4K => Some(Quant::Q4K),
            GgmlDType::Q6K => Some(Quant::Q6K),
            GgmlDType::Q8_0 => Some(Quant::Q8_0),
            GgmlDType::Q5_0 => Some(Quant::Q5_0),
            _ => None,
        };
        let packed = match quant {
            Some(quant) if on_cpu && kernels::available() => {
                Packed::new(quant, &weight.data()?, shape.0, shape.1)
            }
            _ => None,
        };
        #[cfg(all(test, feature = "cuda"))]
        let loaded = weight.clone();
        let kernel = match packed {
            Some(packed) => Kernel::Packed(packed),
            None => Kernel::Candle {
                matmul: QMatMul::from_arc(weight.clone())?,
                compact: matches!(quant, Some(Quant::Q4K | Quant::Q6K))
                    .then_some(weight.dtype())
                    .filter(|_| on_cpu),
                weight,
            },
        };
        Ok(Self {
            #[cfg(all(test, feature = "cuda"))]
            loaded,
            kernel,
            bias,
            shape,
        })
    }

    pub(crate) fn forward(&self, x: &Tensor, path: MatmulPath) -> Result<Tensor> {
        let y = match &self.kernel {
            Kernel::Packed(packed) => {
                let (m, lhs) = self.lhs_rows(x)?;
                Tensor::from_vec(packed.matmul(&lhs, m), (m, self.shape.0), &Device::Cpu)?
            }
            Kernel::Candle {
                weight,
                matmul,
                compact,
            } => match (compact, path) {
                (Some(GgmlDType::Q4K), MatmulPath::Invariant) => {
                    self.compact_matmul::<BlockQ4K>(weight, x)?
                }
                (Some(GgmlDType::Q6K), MatmulPath::Invariant) => {
                    self.compact_matmul::<BlockQ6K>(weight, x)?
                }
                (_, MatmulPath::Invariant) if !x.device().is_cpu() => {
                    row_invariant(weight, matmul, x)?
                }
                _ => matmul.forward(x)?,
            },
        };
        self.add_bias(y)
    }

    /// Whether a row's output is the same on both paths and beside any other rows: our
    /// kernel, or candle's on the CPU for types whose kernel does not depend on the rows
    /// (not Q4_K/Q6_K, whose throughput path candle repacks).
    pub(crate) fn same_on_every_path(&self) -> bool {
        match &self.kernel {
            Kernel::Packed(_) => true,
            Kernel::Candle {
                weight, compact, ..
            } => weight.device().is_cpu() && compact.is_none(),
        }
    }

    /// Output features: the weight's rows.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn out_features(&self) -> usize {
        self.shape.0
    }

    /// The weight as loaded, on the CPU too (see `loaded`).
    #[cfg(all(test, feature = "cuda"))]
    pub(crate) fn loaded(&self) -> &QTensor {
        &self.loaded
    }

    /// candle's quantized weight, where candle's kernels serve this projection (always off
    /// the CPU).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn quantized(&self) -> Option<&QTensor> {
        match &self.kernel {
            Kernel::Candle { weight, .. } => Some(weight),
            Kernel::Packed(_) => None,
        }
    }

    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    fn add_bias(&self, y: Tensor) -> Result<Tensor> {
        Ok(match &self.bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        })
    }

    /// candle's weight when its kernel may serve `path` and fuse with others of its type.
    fn fusable_weight(&self, path: MatmulPath) -> Option<&QTensor> {
        match &self.kernel {
            Kernel::Candle {
                weight, compact, ..
            } if compact.is_none() || path == MatmulPath::Throughput => Some(weight),
            _ => None,
        }
    }

    /// The activation rows as f32, checked against the weight's shape: `(m, rows)`.
    fn lhs_rows(&self, x: &Tensor) -> Result<(usize, Vec<f32>)> {
        let (m, xk) = x.dims2()?;
        if xk != self.shape.1 {
            return Err(candle_core::Error::ShapeMismatchBinaryOp {
                lhs: x.shape().clone(),
                rhs: self.shape.into(),
                op: "quantized matmul",
            }
            .into());
        }
        let lhs = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        Ok((m, lhs))
    }

    fn compact_matmul<T: GgmlType>(&self, weight: &QTensor, x: &Tensor) -> Result<Tensor> {
        let (m, lhs) = self.lhs_rows(x)?;
        let (n, k) = self.shape;
        let data = weight.data()?;
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

/// `x W^T` off the CPU with each row's result independent of the batch (see the module docs).
#[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
fn row_invariant(weight: &QTensor, matmul: &QMatMul, x: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() && super::cuda::supports(weight.dtype()) {
        return Ok(super::cuda::matmul(weight, x)?);
    }
    let m = x.dim(0)?;
    if m == 1 {
        return Ok(matmul.forward(x)?);
    }
    let rows = (0..m)
        .map(|i| matmul.forward(&x.narrow(0, i, 1)?))
        .collect::<candle_core::Result<Vec<_>>>()?;
    Ok(Tensor::cat(&rows, 0)?)
}

/// Several projections of the same input. Where candle's kernel serves them all and they
/// share a type, they are fused into one pass over the quantized input (one quantization,
/// one parallel region).
fn project<const N: usize>(
    x: &Tensor,
    linears: [&Linear; N],
    path: MatmulPath,
) -> Result<[Tensor; N]> {
    let weights: Option<Vec<&QTensor>> = linears.iter().map(|l| l.fusable_weight(path)).collect();
    let fused = match weights {
        Some(ws) if x.device().is_cpu() && ws.iter().all(|w| w.dtype() == ws[0].dtype()) => {
            QTensor::gemv_fused_shared_lhs(&ws, x)?
        }
        _ => None,
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

/// Projections of one input (a layer's q, k and v; its gate and up) as loaded: a weight
/// each, or consecutive ones of a type concatenated into one weight, their rows one after
/// another (`LoadOptions::fuse_projections`), which one matmul reads and each projection's
/// columns come out of. Every kernel computes an output feature from its own weight row
/// alone, so a projection's outputs are the same either way.
#[derive(Debug)]
pub(crate) struct Projections<const N: usize> {
    /// Each weight, with the output widths of the projections it holds, in order.
    parts: Vec<(Linear, Vec<usize>)>,
}

impl<const N: usize> Projections<N> {
    pub(crate) fn new(parts: Vec<(Linear, Vec<usize>)>) -> Self {
        debug_assert_eq!(parts.iter().map(|p| p.1.len()).sum::<usize>(), N);
        Self { parts }
    }

    /// Each weight with the output widths of the projections it holds.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn parts(&self) -> &[(Linear, Vec<usize>)] {
        &self.parts
    }

    pub(crate) fn linears(&self) -> impl Iterator<Item = &Linear> {
        self.parts.iter().map(|(linear, _)| linear)
    }

    /// Each projection of `x`, in order.
    pub(crate) fn forward(&self, x: &Tensor, path: MatmulPath) -> Result<[Tensor; N]> {
        if self.parts.len() == N {
            return project(x, std::array::from_fn(|i| &self.parts[i].0), path);
        }
        let mut outputs = Vec::with_capacity(N);
        for (linear, widths) in &self.parts {
            let y = linear.forward(x, path)?;
            if let [_] = widths[..] {
                outputs.push(y);
                continue;
            }
            let mut at = 0;
            for &width in widths {
                outputs.push(y.narrow(D::Minus1, at, width)?.contiguous()?);
                at += width;
            }
        }
        Ok(outputs
            .try_into()
            .unwrap_or_else(|_| unreachable!("one output per projection")))
    }
}
