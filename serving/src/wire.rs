//! Conversions between engine values and their protobuf form, shared by both ends of a call.

use duet_engine::sampling::{Distribution, SamplingError, SamplingParams};
use duet_proto::v1 as pb;

/// Encodes sparsely when at most a quarter of the vocabulary has mass (top-k/top-p cuts),
/// densely otherwise: 4 bytes per token instead of 8.
pub fn encode_distribution(d: &Distribution, vocab: usize) -> pb::Distribution {
    if d.len() * 4 <= vocab {
        return pb::Distribution {
            ids: d.ids().to_vec(),
            probs: d.probs().to_vec(),
        };
    }
    let mut probs = vec![0.0f32; vocab];
    for (id, p) in d.iter() {
        if let Some(slot) = probs.get_mut(id as usize) {
            *slot = p;
        }
    }
    pb::Distribution {
        ids: Vec::new(),
        probs,
    }
}

/// Why a distribution off the wire was refused.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("{ids} ids but {probs} probabilities")]
    LengthMismatch { ids: usize, probs: usize },
    #[error(transparent)]
    Invalid(#[from] SamplingError),
}

/// The distribution a peer sent; malformed input (lengths differ, negative or NaN mass, no
/// mass) is an error.
pub fn decode_distribution(d: &pb::Distribution) -> Result<Distribution, WireError> {
    if d.ids.is_empty() {
        let dense = d.probs.iter().enumerate().map(|(i, &p)| (i as u32, p));
        return Ok(Distribution::from_pairs(dense)?);
    }
    if d.ids.len() != d.probs.len() {
        return Err(WireError::LengthMismatch {
            ids: d.ids.len(),
            probs: d.probs.len(),
        });
    }
    Ok(Distribution::from_pairs(
        d.ids.iter().copied().zip(d.probs.iter().copied()),
    )?)
}

pub fn sampling_to_wire(s: &SamplingParams) -> pb::SamplingParams {
    pb::SamplingParams {
        temperature: s.temperature,
        top_k: s.top_k as u32,
        top_p: s.top_p,
        seed: s.seed,
    }
}

pub fn sampling_from_wire(s: &pb::SamplingParams) -> SamplingParams {
    SamplingParams {
        temperature: s.temperature,
        top_k: s.top_k as usize,
        top_p: s.top_p,
        seed: s.seed,
    }
}

/// Bytes off the wire (a session id) as lowercase hex, for spans, logs and errors.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn distributions_round_trip_sparse_and_dense() {
        let sparse = Distribution::from_pairs([(3, 0.25), (9, 0.75)]).unwrap();
        let wire = encode_distribution(&sparse, 100);
        assert_eq!(wire.ids, vec![3, 9]);
        assert_eq!(decode_distribution(&wire).unwrap(), sparse);

        let dense = Distribution::from_pairs((0..8).map(|i| (i, 1.0 + i as f32))).unwrap();
        let wire = encode_distribution(&dense, 10);
        assert!(wire.ids.is_empty());
        assert_eq!(wire.probs.len(), 10);
        let back = decode_distribution(&wire).unwrap();
        for (a, b) in back.iter().zip(dense.iter()) {
            assert_eq!(a.0, b.0);
            assert!((a.1 - b.1).abs() < 1e-6);
        }
    }

    #[test]
    fn malformed_distributions_are_errors() {
        let bad = pb::Distribution {
            ids: vec![1, 2],
            probs: vec![1.0],
        };
        assert!(matches!(
            decode_distribution(&bad),
            Err(WireError::LengthMismatch { ids: 2, probs: 1 })
        ));
        let negative = pb::Distribution {
            ids: vec![],
            probs: vec![0.5, -0.5, 1.0],
        };
        assert!(decode_distribution(&negative).is_err());
        let empty = pb::Distribution::default();
        assert!(decode_distribution(&empty).is_err());
    }
}
