//! duet's gRPC API: the public `Generation` service and the internal worker protocol
//! (`proto/duet/v1/*.proto`, whose comments are the reference).

/// Package `duet.v1`.
pub mod v1 {
    #![allow(missing_debug_implementations, clippy::large_enum_variant)]
    tonic::include_proto!("duet.v1");
}

pub mod bounded;
mod completion;

pub use bounded::{MAX_CHAT_MESSAGES, MAX_STOP_STRINGS};
pub use completion::{Completion, overhead_ms_per_round};

/// Draft tokens one Propose or Verify may carry: the protocol's limit, which the workers
/// enforce and the coordinator's configuration is checked against.
pub const MAX_DRAFT_TOKENS: usize = 64;

/// Tokens one Verify may append before its drafts. The coordinator appends only the tokens
/// committed since the last Verify (the correction or bonus token: one); a long append would
/// be a prefill inside a batched verification pass, stalling every session batched with it.
pub const MAX_VERIFY_APPEND: usize = 64;

/// Stop tokens one Decode may name (`DecodeRequest.stop_tokens`).
pub const MAX_STOP_TOKENS: usize = 64;

/// Other likely tokens one draft position may carry (`ProposeRequest.max_alternatives`).
pub const MAX_ALTERNATIVES: usize = 7;

/// Tokens one Propose may append before drafting. A draft that fell behind (rounds without
/// it) catches up in pieces of at most this many, for the same reason as Verify's limit.
pub const MAX_PROPOSE_APPEND: usize = 64;

/// Encoded `FileDescriptorSet` of `duet.v1`, for gRPC server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("duet_descriptor");

/// `SPECULATION_METHOD_DRAFT_MODEL` → `draft_model`: the short name CLIs and JSON show.
pub fn method_name(value: i32) -> String {
    v1::SpeculationMethod::try_from(value).map_or_else(
        |_| format!("unknown({value})"),
        |m| short(m.as_str_name(), "SPECULATION_METHOD_"),
    )
}

/// `draft_model` (or `draft`) → `SPECULATION_METHOD_DRAFT_MODEL`: the short names CLIs take.
pub fn parse_method(name: &str) -> Option<v1::SpeculationMethod> {
    let name = match name.trim() {
        "draft" => "draft_model",
        other => other,
    };
    v1::SpeculationMethod::from_str_name(&format!("SPECULATION_METHOD_{}", name.to_uppercase()))
}

/// `FINISH_REASON_EOS` → `eos`.
pub fn finish_reason_name(value: i32) -> String {
    v1::FinishReason::try_from(value).map_or_else(
        |_| format!("unknown({value})"),
        |r| short(r.as_str_name(), "FINISH_REASON_"),
    )
}

fn short(name: &str, prefix: &str) -> String {
    name.trim_start_matches(prefix).to_lowercase()
}

#[cfg(test)]
mod tests {
    use super::*;
    use v1::SpeculationMethod as M;

    #[test]
    fn method_names_parse_back() {
        for m in [M::Auto, M::DraftModel, M::None, M::Ngram] {
            assert_eq!(parse_method(&method_name(m as i32)), Some(m));
        }
        assert_eq!(method_name(M::DraftModel as i32), "draft_model");
        assert_eq!(parse_method("draft"), Some(M::DraftModel));
        assert_eq!(parse_method(" ngram "), Some(M::Ngram));
        assert_eq!(parse_method("fastest"), None);
        assert_eq!(method_name(9), "unknown(9)");
    }
}
