//! Rotary tables: the cosine and sine of every position's angle at every frequency, as
//! llama.cpp computes them (`ggml`'s `rope_yarn`), so that a model's positions mean what its
//! GGUF file says: a plain base, a linear or YaRN scaling, and per-frequency factors.

use super::config::{ModelConfig, RopeScaling};
use crate::error::Result;
use candle_core::{Device, Tensor};

/// YaRN's bounds, in turns over the original context: frequencies turning more often than
/// `BETA_FAST` times are kept, fewer than `BETA_SLOW` times interpolated (llama.cpp's
/// defaults, which its loader does not read from the file).
const BETA_FAST: f64 = 32.0;
const BETA_SLOW: f64 = 1.0;

/// The angle of each frequency at one position, and the factor on its cosine and sine.
struct Angles {
    /// Per frequency (a pair of a head's dimensions): the angle per position before scaling.
    base: Vec<f64>,
    /// Per frequency: how much of the angle is extrapolated (the position as it is) rather
    /// than interpolated (the position over the factor).
    extrapolated: Vec<f64>,
    factor: f64,
    magnitude: f64,
}

impl Angles {
    /// The angles of `c`, each frequency divided by its entry of `freq_factors` where the
    /// model has them (`rope_freqs.weight`: Llama 3.1's long-context factors).
    fn new(c: &ModelConfig, freq_factors: Option<&[f32]>) -> Self {
        let (dims, half) = (c.head_dim as f64, c.head_dim / 2);
        let base = (0..half).map(|i| {
            let own = freq_factors.map_or(1.0, |f| f64::from(f[i]));
            c.rope_theta.powf(-2.0 * i as f64 / dims) / own
        });
        let (factor, extrapolated, magnitude) = match c.rope_scaling {
            RopeScaling::None => (1.0, vec![0.0; half], 1.0),
            RopeScaling::Linear { factor } => (factor, vec![0.0; half], 1.0),
            RopeScaling::Yarn {
                factor,
                original_context,
            } => {
                let turns = |beta: f64| {
                    dims * (original_context as f64 / (beta * 2.0 * std::f64::consts::PI)).ln()
                        / (2.0 * c.rope_theta.ln())
                };
                let low = turns(BETA_FAST).floor().max(0.0);
                let high = turns(BETA_SLOW).ceil().min(dims - 1.0);
                let ramp = |i: usize| {
                    let y = (i as f64 - low) / (high - low).max(0.001);
                    1.0 - y.clamp(0.0, 1.0)
                };
                let magnitude = 1.0 + 0.1 * factor.ln();
                (factor, (0..half).map(ramp).collect(), magnitude)
            }
        };
        Self {
            base: base.collect(),
            extrapolated,
            factor,
            magnitude: magnitude * c.rope_attn_factor,
        }
    }

    /// Frequency `i`'s angle at `position`.
    fn at(&self, position: usize, i: usize) -> f64 {
        let extrapolated = position as f64 * self.base[i];
        let interpolated = extrapolated / self.factor;
        let mix = self.extrapolated[i];
        interpolated * (1.0 - mix) + extrapolated * mix
    }
}

/// The tables `[context_length, head_dim / 2]` of cosines and sines that the forward pass
/// (candle's `rope` on the CPU, the CUDA step's own kernel) reads by position.
pub(crate) fn tables(
    c: &ModelConfig,
    freq_factors: Option<&[f32]>,
    device: &Device,
) -> Result<(Tensor, Tensor)> {
    let angles = Angles::new(c, freq_factors);
    let half = c.head_dim / 2;
    let mut cos = Vec::with_capacity(c.context_length * half);
    let mut sin = Vec::with_capacity(c.context_length * half);
    for position in 0..c.context_length {
        for i in 0..half {
            let angle = angles.at(position, i);
            cos.push((angle.cos() * angles.magnitude) as f32);
            sin.push((angle.sin() * angles.magnitude) as f32);
        }
    }
    let shape = (c.context_length, half);
    Ok((
        Tensor::from_vec(cos, shape, device)?,
        Tensor::from_vec(sin, shape, device)?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::config::Architecture;

    /// Qwen2.5's shape and base, with `scaling`.
    fn config(scaling: RopeScaling) -> ModelConfig {
        ModelConfig {
            architecture: Architecture::Qwen2,
            n_layers: 1,
            hidden: 1024,
            ffn_hidden: 1024,
            n_heads: 8,
            n_kv_heads: 8,
            head_dim: 128,
            vocab: 32,
            context_length: 64,
            rms_eps: 1e-6,
            rope_theta: 1_000_000.0,
            rope_scaling: scaling,
            rope_attn_factor: 1.0,
        }
    }

    fn plain(position: usize, i: usize) -> f64 {
        position as f64 * 1_000_000f64.powf(-2.0 * i as f64 / 128.0)
    }

    #[test]
    fn plain_angles_are_the_position_times_the_frequency() {
        let angles = Angles::new(&config(RopeScaling::None), None);
        for (position, i) in [(0, 0), (1, 0), (17, 5), (63, 63)] {
            assert_eq!(angles.at(position, i), plain(position, i));
        }
        let (cos, sin) = tables(&config(RopeScaling::None), None, &Device::Cpu).unwrap();
        let (cos, sin) = (cos.to_vec2::<f32>().unwrap(), sin.to_vec2::<f32>().unwrap());
        assert_eq!(cos[17][5], plain(17, 5).cos() as f32);
        assert_eq!(sin[17][5], plain(17, 5).sin() as f32);
    }

    #[test]
    fn linear_scaling_divides_the_position() {
        let angles = Angles::new(&config(RopeScaling::Linear { factor: 4.0 }), None);
        for i in [0, 10, 63] {
            assert_eq!(angles.at(40, i), plain(10, i));
        }
    }

    #[test]
    fn frequency_factors_divide_their_own_frequency() {
        let factors: Vec<f32> = (0..64).map(|i| 1.0 + i as f32 / 8.0).collect();
        let angles = Angles::new(&config(RopeScaling::None), Some(&factors));
        for i in [0, 31, 63] {
            let expected = plain(9, i) / f64::from(factors[i]);
            assert!((angles.at(9, i) - expected).abs() < 1e-12 * expected.max(1.0));
        }
    }

    /// Qwen2.5's long-context setting (YaRN, factor 4 over 32,768 positions): llama.cpp's
    /// bounds are frequencies 23 and 40 of 64 (`ggml_rope_yarn_corr_dims`), the faster ones
    /// kept, the slower ones interpolated, a linear blend between; every cosine and sine
    /// grows by 1 + 0.1 ln 4.
    #[test]
    fn yarn_keeps_fast_frequencies_and_interpolates_slow_ones() {
        let yarn = RopeScaling::Yarn {
            factor: 4.0,
            original_context: 32_768,
        };
        let angles = Angles::new(&config(yarn), None);
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-12 * b.abs().max(1.0);
        for i in [0, 10, 23] {
            assert!(close(angles.at(50, i), plain(50, i)), "frequency {i}");
        }
        for i in [40, 50, 63] {
            assert!(close(angles.at(50, i), plain(50, i) / 4.0), "frequency {i}");
        }
        let mix = 1.0 - (30.0 - 23.0) / 17.0;
        let blended = plain(50, 30) * mix + plain(50, 30) / 4.0 * (1.0 - mix);
        assert!(close(angles.at(50, 30), blended));
        assert_eq!(angles.magnitude, 1.0 + 0.1 * 4f64.ln());
        let (cos, _) = tables(&config(yarn), None, &Device::Cpu).unwrap();
        assert_eq!(cos.to_vec2::<f32>().unwrap()[0][0], angles.magnitude as f32);
    }
}
