//! What a row's logits lose by the completion so far: OpenAI's presence and frequency
//! penalties (a token's logit is lowered by `presence` once it has appeared in the completion
//! so far, and by `frequency` for each time it has) and vLLM's `min_tokens` (no
//! end-of-sequence token while the completion is shorter), before greedy's argmax or
//! temperature, top-k and top-p. The target applies them row by row, a row's completion so
//! far being the committed tokens and the drafts before it, so each position's choice is the
//! one target-only decoding makes there, drafts or not.

use std::borrow::Cow;
use std::collections::HashMap;

/// The largest penalty either way (OpenAI's bound).
pub const MAX_PENALTY: f32 = 2.0;

#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Penalties {
    pub presence: f32,
    pub frequency: f32,
}

impl Penalties {
    /// Penalties that change nothing.
    pub fn is_none(&self) -> bool {
        self.presence == 0.0 && self.frequency == 0.0
    }

    /// The name and value of a penalty outside [-2, 2] (NaN included), if any.
    pub fn out_of_range(&self) -> Option<(&'static str, f32)> {
        let within = |v: f32| (-MAX_PENALTY..=MAX_PENALTY).contains(&v);
        [
            ("presence_penalty", self.presence),
            ("frequency_penalty", self.frequency),
        ]
        .into_iter()
        .find(|&(_, v)| !within(v))
    }

    /// `row` with the penalties of the token `counts` of the completion so far.
    pub fn apply<'a>(&self, row: &'a [f32], counts: &Counts) -> Cow<'a, [f32]> {
        if self.is_none() || counts.0.is_empty() {
            return Cow::Borrowed(row);
        }
        let mut row = row.to_vec();
        for (&token, &count) in &counts.0 {
            if let Some(logit) = row.get_mut(token as usize) {
                *logit -= self.presence + self.frequency * count as f32;
            }
        }
        Cow::Owned(row)
    }
}

/// How often each token appears in a completion so far.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Counts(HashMap<u32, u32>);

impl Counts {
    pub fn of(tokens: &[u32]) -> Self {
        let mut counts = Self::default();
        tokens.iter().for_each(|&t| counts.add(t));
        counts
    }

    pub fn add(&mut self, token: u32) {
        *self.0.entry(token).or_default() += 1;
    }
}

/// No end-of-sequence token (`eos`) where the completion so far is shorter than `until`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MinTokens {
    pub until: usize,
    pub eos: Vec<u32>,
}

impl MinTokens {
    /// Whether any row may lose anything.
    pub fn applies(&self) -> bool {
        self.until > 0 && !self.eos.is_empty()
    }

    /// `row`, after a completion of `so_far` tokens.
    pub fn apply<'a>(&self, row: Cow<'a, [f32]>, so_far: usize) -> Cow<'a, [f32]> {
        if so_far >= self.until || self.eos.is_empty() {
            return row;
        }
        let mut row = row.into_owned();
        for &id in &self.eos {
            if let Some(logit) = row.get_mut(id as usize) {
                *logit = f32::NEG_INFINITY;
            }
        }
        Cow::Owned(row)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_end_of_sequence_before_min_tokens() {
        let min = MinTokens {
            until: 2,
            eos: vec![1, 7],
        };
        let row = [0.5f32, 3.0, 1.0];
        let lost = min.apply(Cow::Borrowed(&row[..]), 1);
        assert_eq!(*lost, [0.5, f32::NEG_INFINITY, 1.0]);
        assert!(matches!(
            min.apply(Cow::Borrowed(&row[..]), 2),
            Cow::Borrowed(_)
        ));
        assert!(min.applies() && !MinTokens::default().applies());
    }

    #[test]
    fn each_seen_token_loses_presence_once_and_frequency_per_time() {
        let p = Penalties {
            presence: 0.5,
            frequency: 0.25,
        };
        let row = [1.0f32, 1.0, 1.0, 1.0];
        let mut counts = Counts::of(&[2, 0, 2]);
        assert_eq!(*p.apply(&row, &counts), [0.25, 1.0, 0.0, 1.0]);
        counts.add(9); // outside the row: nothing to lower
        assert_eq!(*p.apply(&row, &counts), [0.25, 1.0, 0.0, 1.0]);
        let none = Penalties::default();
        assert!(matches!(none.apply(&row, &counts), Cow::Borrowed(_)));
        assert!(matches!(
            p.apply(&row, &Counts::default()),
            Cow::Borrowed(_)
        ));
    }

    #[test]
    fn penalties_stay_within_two_either_way() {
        let p = |presence, frequency| Penalties {
            presence,
            frequency,
        };
        assert_eq!(p(2.0, -2.0).out_of_range(), None);
        assert_eq!(p(2.5, 0.0).out_of_range(), Some(("presence_penalty", 2.5)));
        let nan = p(0.0, f32::NAN).out_of_range().unwrap();
        assert_eq!(nan.0, "frequency_penalty");
    }
}
