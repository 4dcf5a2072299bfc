//! How tokens are proposed: a request's method, and a round's proposer. The wire's
//! `SpeculationMethod` converts to these at the edge (`request.rs`) and back in the usage
//! (`service.rs`); nothing else in the coordinator reads it.

use duet_proto::v1 as pb;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Who proposes a round's draft tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Proposer {
    DraftModel,
    Ngram,
    /// A target-only step.
    None,
}

/// How a request's tokens are proposed: by one proposer throughout, or by the one AUTO's
/// controller chooses round by round. In the configuration (`speculation.auto_method`)
/// the controller is spelled `adaptive`, a fixed proposer by its name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum Method {
    #[serde(rename = "adaptive")]
    Auto,
    #[serde(untagged)]
    Fixed(Proposer),
}

impl Proposer {
    /// As metrics, traces and the configuration spell it.
    pub fn name(self) -> &'static str {
        match self {
            Self::DraftModel => "draft_model",
            Self::Ngram => "ngram",
            Self::None => "none",
        }
    }
}

impl Default for Method {
    /// Target only: what a usage reports before a request is known.
    fn default() -> Self {
        Method::NONE
    }
}

impl Method {
    pub const NONE: Method = Method::Fixed(Proposer::None);
    pub const DRAFT_MODEL: Method = Method::Fixed(Proposer::DraftModel);
    pub const NGRAM: Method = Method::Fixed(Proposer::Ngram);

    /// As metrics and traces spell it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Fixed(p) => p.name(),
        }
    }

    /// The request's method for a wire value; AUTO is what `auto_method` configures.
    pub fn from_wire(value: i32, auto_method: Method) -> Option<Method> {
        Some(match pb::SpeculationMethod::try_from(value).ok()? {
            pb::SpeculationMethod::Auto => auto_method,
            pb::SpeculationMethod::DraftModel => Method::DRAFT_MODEL,
            pb::SpeculationMethod::Ngram => Method::NGRAM,
            pb::SpeculationMethod::None => Method::NONE,
        })
    }
}

impl From<Proposer> for pb::SpeculationMethod {
    fn from(p: Proposer) -> Self {
        match p {
            Proposer::DraftModel => Self::DraftModel,
            Proposer::Ngram => Self::Ngram,
            Proposer::None => Self::None,
        }
    }
}

impl From<Method> for pb::SpeculationMethod {
    fn from(m: Method) -> Self {
        match m {
            Method::Auto => Self::Auto,
            Method::Fixed(p) => p.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_match_the_wire_names() {
        for m in [
            Method::Auto,
            Method::DRAFT_MODEL,
            Method::NGRAM,
            Method::NONE,
        ] {
            let wire = pb::SpeculationMethod::from(m);
            assert_eq!(duet_proto::method_name(wire as i32), m.name());
            assert_eq!(Method::from_wire(wire as i32, Method::Auto), Some(m));
        }
        let auto = pb::SpeculationMethod::Auto as i32;
        assert_eq!(Method::from_wire(auto, Method::NGRAM), Some(Method::NGRAM));
        assert_eq!(Method::from_wire(7, Method::Auto), None);
    }

    #[test]
    fn the_configuration_spells_auto_adaptive() {
        let parse = |s: &str| serde_json::from_str::<Method>(&format!("\"{s}\""));
        assert_eq!(parse("adaptive").unwrap(), Method::Auto);
        assert_eq!(parse("draft_model").unwrap(), Method::DRAFT_MODEL);
        assert_eq!(parse("ngram").unwrap(), Method::NGRAM);
        assert_eq!(parse("none").unwrap(), Method::NONE);
        assert!(parse("auto").is_err());
        assert!(parse("fastest").is_err());
        assert_eq!(
            serde_json::to_string(&Method::Auto).unwrap(),
            "\"adaptive\""
        );
        assert_eq!(serde_json::to_string(&Method::NGRAM).unwrap(), "\"ngram\"");
    }
}
