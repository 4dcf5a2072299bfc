//! Conversions between engine values and their protobuf form, shared by both ends of a call.

use duet_engine::logprobs::TokenLogprobs;
use duet_engine::penalties::Penalties;
use duet_engine::sampling::{Distribution, SamplingError, SamplingParams};
use duet_engine::structured::Format;
use duet_proto::v1 as pb;

/// Encodes sparsely when at most a quarter of the vocabulary has mass (top-k/top-p cuts),
/// densely otherwise: 4 bytes per token instead of 8.
pub fn encode_distribution(d: &Distribution, vocab: usize) -> pb::Distribution {
    if d.len() * 4 <= vocab {
        return encode_sparse(d);
    }
    if d.len() == vocab && d.ids().last() == Some(&(vocab as u32 - 1)) {
        // Sorted distinct ids: they are 0..vocab, in order.
        return pb::Distribution {
            ids: Vec::new(),
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

/// Encodes as (id, probability) pairs, for a distribution known to be small.
pub fn encode_sparse(d: &Distribution) -> pb::Distribution {
    pb::Distribution {
        ids: d.ids().to_vec(),
        probs: d.probs().to_vec(),
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

/// The distribution a peer sent, its probabilities as the peer computed them
/// (`Distribution::from_probabilities`); malformed input (lengths differ, negative or NaN
/// mass, no mass) is an error.
pub fn decode_distribution(d: &pb::Distribution) -> Result<Distribution, WireError> {
    if d.ids.is_empty() {
        return Ok(Distribution::from_dense_probabilities(&d.probs)?);
    }
    if d.ids.len() != d.probs.len() {
        return Err(WireError::LengthMismatch {
            ids: d.ids.len(),
            probs: d.probs.len(),
        });
    }
    Ok(Distribution::from_probabilities(
        d.ids.iter().copied().zip(d.probs.iter().copied()),
    )?)
}

pub fn sampling_to_wire(s: &SamplingParams) -> pb::SamplingParams {
    pb::SamplingParams {
        temperature: s.temperature,
        top_k: s.top_k as u32,
        top_p: s.top_p,
        min_p: s.min_p,
        seed: s.seed,
    }
}

pub fn sampling_from_wire(s: &pb::SamplingParams) -> SamplingParams {
    SamplingParams {
        temperature: s.temperature,
        top_k: s.top_k as usize,
        top_p: s.top_p,
        min_p: s.min_p,
        seed: s.seed,
    }
}

/// The penalties of a request's wire fields (`GenerateRequest`'s and
/// `OpenSessionRequest`'s): an unset repetition penalty (0) is none (1).
pub fn penalties_from_wire(presence: f32, frequency: f32, repetition: f32) -> Penalties {
    Penalties {
        presence,
        frequency,
        repetition: if repetition == 0.0 { 1.0 } else { repetition },
    }
}

/// A request's structured output (`StructuredOutput`); `None` where no format is set (or
/// `json_object` is false).
pub fn format_from_wire(s: &pb::StructuredOutput) -> Option<Format> {
    use pb::structured_output::Format as Wire;
    Some(match s.format.as_ref()? {
        Wire::JsonSchema(schema) => Format::JsonSchema(schema.clone()),
        Wire::JsonObject(true) => Format::JsonObject,
        Wire::JsonObject(false) => return None,
        Wire::Regex(regex) => Format::Regex(regex.clone()),
        Wire::Lark(grammar) => Format::Lark(grammar.clone()),
    })
}

pub fn format_to_wire(f: &Format) -> pb::StructuredOutput {
    use pb::structured_output::Format as Wire;
    let format = match f {
        Format::JsonSchema(schema) => Wire::JsonSchema(schema.clone()),
        Format::JsonObject => Wire::JsonObject(true),
        Format::Regex(regex) => Wire::Regex(regex.clone()),
        Format::Lark(grammar) => Wire::Lark(grammar.clone()),
    };
    pb::StructuredOutput {
        format: Some(format),
    }
}

pub fn logprobs_to_wire(l: &TokenLogprobs) -> pb::TokenLogprobs {
    pb::TokenLogprobs {
        logprob: l.logprob,
        top_token_ids: l.top.iter().map(|&(id, _)| id).collect(),
        top_logprobs: l.top.iter().map(|&(_, logprob)| logprob).collect(),
    }
}

/// A token's figures off the wire; `None` where the alternatives' ids and figures differ
/// in number.
pub fn logprobs_from_wire(l: &pb::TokenLogprobs) -> Option<TokenLogprobs> {
    let ids = &l.top_token_ids;
    (ids.len() == l.top_logprobs.len()).then(|| TokenLogprobs {
        logprob: l.logprob,
        top: ids
            .iter()
            .copied()
            .zip(l.top_logprobs.iter().copied())
            .collect(),
    })
}

/// Bytes off the wire (a session id) as lowercase hex, for spans, logs and errors.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logprobs_round_trip_and_mismatched_alternatives_are_refused() {
        let l = TokenLogprobs {
            logprob: -0.5,
            top: vec![(7, -0.25), (3, -0.5)],
        };
        let wire = logprobs_to_wire(&l);
        assert_eq!(
            (wire.top_token_ids.clone(), wire.logprob),
            (vec![7, 3], -0.5)
        );
        assert_eq!(logprobs_from_wire(&wire), Some(l));
        let uneven = pb::TokenLogprobs {
            top_logprobs: vec![-1.0],
            ..wire
        };
        assert_eq!(logprobs_from_wire(&uneven), None);
    }

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
        assert_eq!(decode_distribution(&wire).unwrap(), dense);
    }

    /// A softmax over a whole vocabulary comes back bit for bit (its probabilities sum to 1
    /// only up to rounding); weights, and ids out of order, are normalized and sorted.
    #[test]
    fn a_peers_probabilities_come_back_as_it_computed_them() {
        let logits: Vec<f32> = (0..151_936)
            .map(|i| ((i * 7_919) % 1_000) as f32 / 97.0)
            .collect();
        let params = duet_engine::sampling::SamplingParams {
            temperature: 0.7,
            ..duet_engine::sampling::SamplingParams::greedy()
        };
        let p = duet_engine::sampling::process_logits(&logits, &params).unwrap();
        let sum: f64 = p.probs().iter().map(|&x| f64::from(x)).sum();
        assert_ne!(sum, 1.0, "a sum off by rounding is the case this is about");
        assert_eq!(
            decode_distribution(&encode_distribution(&p, 151_936)).unwrap(),
            p
        );
        let weights = pb::Distribution {
            ids: vec![9, 3],
            probs: vec![3.0, 1.0],
        };
        let normalized = Distribution::from_pairs([(3, 0.25), (9, 0.75)]).unwrap();
        assert_eq!(decode_distribution(&weights).unwrap(), normalized);
        let dense_weights = pb::Distribution {
            ids: vec![],
            probs: vec![1.0, 0.0, 3.0],
        };
        let normalized = Distribution::from_pairs([(0, 0.25), (2, 0.75)]).unwrap();
        assert_eq!(decode_distribution(&dense_weights).unwrap(), normalized);
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
