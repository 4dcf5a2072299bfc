//! The proposal cache's proposal in rounds that do not use it, scored as a round using it
//! would have fared: its first token against the next committed token, then each next one
//! against what the rounds after commit, until one differs or all are checked. Target-only
//! steps commit one token each, so scored round by round they would only ever teach how
//! often its first token is right, never its next ones, and count every token of a long
//! right proposal (a repeat's cached answer that the gate declines) as a new first one. One
//! proposal at a time, as rounds using it would see them, they teach both rates as they go
//! (for sampling too: a committed token equal to a point-mass draft is exactly as likely as
//! that draft's acceptance). Lookup in the request's own text is still scored round by
//! round (`report.rs`): scored this way it made AUTO slower on code edits
//! (docs/benchmarks.md, "Lookup scored across the rounds that skip it").

use crate::controller::Seen;

/// A proposal being scored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Shadow {
    /// Its estimate (`Lookup::bucket`).
    pub(super) bucket: usize,
    tokens: Vec<u32>,
    /// Its leading tokens that the committed text took so far.
    hits: usize,
}

impl Shadow {
    pub(super) fn new(bucket: usize, tokens: Vec<u32>) -> Option<Self> {
        (!tokens.is_empty()).then_some(Self {
            bucket,
            tokens,
            hits: 0,
        })
    }

    /// Scores a round's committed tokens: what they showed of the proposal, and whether it
    /// is decided (a token differed, or all are checked). Over all its rounds it shows what
    /// one round verifying it would have (`Seen::round`).
    pub(super) fn score(&mut self, committed: &[u32]) -> (Seen, bool) {
        let mut seen = Seen::default();
        for &token in committed {
            let right = self.tokens[self.hits] == token;
            match self.hits {
                0 => seen.first = Some(right),
                _ => {
                    seen.next_tested += 1;
                    seen.next_right += usize::from(right);
                }
            }
            if !right {
                return (seen, true);
            }
            self.hits += 1;
            if self.hits == self.tokens.len() {
                return (seen, true);
            }
        }
        (seen, false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::controller::Acceptance;

    fn seen(first: Option<bool>, next_right: usize, next_tested: usize) -> Seen {
        Seen {
            first,
            next_right,
            next_tested,
        }
    }

    #[test]
    fn a_proposal_is_scored_across_rounds_until_a_token_differs() {
        let mut s = Shadow::new(2, vec![7, 8, 9, 10]).unwrap();
        assert_eq!(s.score(&[7]), (seen(Some(true), 0, 0), false));
        assert_eq!(s.score(&[8]), (seen(None, 1, 1), false));
        assert_eq!(s.score(&[5, 6]), (seen(None, 0, 1), true));
        let mut s = Shadow::new(2, vec![7, 8]).unwrap();
        assert_eq!(s.score(&[4, 7]), (seen(Some(false), 0, 0), true));
        let mut s = Shadow::new(2, vec![7, 8]).unwrap();
        assert_eq!(s.score(&[7, 8, 9]), (seen(Some(true), 1, 1), true));
        assert_eq!(Shadow::new(2, Vec::new()), None);
    }

    /// Three target-only steps taking a proposal's first two tokens and not its third
    /// teach what one round verifying it would: the first right, one next right, one next
    /// wrong.
    #[test]
    fn steps_teach_what_a_round_using_the_proposal_would_have() {
        let mut s = Shadow::new(0, vec![7, 8, 9, 10]).unwrap();
        let mut stepped = Acceptance::default();
        for token in [7, 8, 1] {
            stepped.observe_seen(s.score(&[token]).0, 1.0);
        }
        let mut round = Acceptance::default();
        round.observe(4, 2, 1.0);
        assert_eq!(stepped, round);
    }
}
