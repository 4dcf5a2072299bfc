//! What a row's logits lose by the text so far: vLLM's (and Hugging Face's) repetition
//! penalty (the logit of a token seen in the prompt or the completion so far is divided by
//! it where positive, multiplied where not), OpenAI's presence and frequency penalties (a
//! token's logit is lowered by `presence` once it has appeared in the completion so far, and
//! by `frequency` for each time it has) and vLLM's `min_tokens` (no end-of-sequence token
//! while the completion is shorter), after the logit bias and before greedy's argmax or
//! temperature, min-p, top-k and top-p, in vLLM's order. The target applies them row by row,
//! a row's completion so far being the committed tokens and the drafts before it, so each
//! position's choice is the one target-only decoding makes there, drafts or not.

use std::borrow::Cow;
use std::collections::HashMap;

/// The largest presence or frequency penalty either way (OpenAI's bound).
pub const MAX_PENALTY: f32 = 2.0;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Penalties {
    pub presence: f32,
    pub frequency: f32,
    /// 1: none; above 1 a seen token is less likely, below 1 more.
    pub repetition: f32,
}

impl Default for Penalties {
    fn default() -> Self {
        Self {
            presence: 0.0,
            frequency: 0.0,
            repetition: 1.0,
        }
    }
}

impl Penalties {
    /// Penalties that change nothing.
    pub fn is_none(&self) -> bool {
        self.presence == 0.0 && self.frequency == 0.0 && !self.repeats()
    }

    /// Whether the repetition penalty changes anything (the prompt's tokens count).
    pub fn repeats(&self) -> bool {
        self.repetition != 1.0
    }

    /// The name of a penalty out of its range and why, if any: presence and frequency
    /// outside [-2, 2], repetition not a positive number (NaN fails each).
    pub fn check(&self) -> Result<(), (&'static str, String)> {
        let within = |v: f32| (-MAX_PENALTY..=MAX_PENALTY).contains(&v);
        let outside = [
            ("presence_penalty", self.presence),
            ("frequency_penalty", self.frequency),
        ]
        .into_iter()
        .find(|&(_, v)| !within(v));
        if let Some((name, v)) = outside {
            return Err((name, format!("{v} is outside [-2, 2]")));
        }
        match self.repetition.is_finite() && self.repetition > 0.0 {
            true => Ok(()),
            false => Err((
                "repetition_penalty",
                format!("{} must be a number > 0", self.repetition),
            )),
        }
    }

    /// `row` with the penalties of the token `counts` of the completion so far and, for
    /// the repetition penalty, the `prompt`'s tokens.
    pub fn apply<'a>(
        &self,
        row: Cow<'a, [f32]>,
        counts: &Counts,
        prompt: &PromptTokens,
    ) -> Cow<'a, [f32]> {
        let repeats = self.repeats() && !(counts.0.is_empty() && prompt.0.is_empty());
        if self.is_none() || (counts.0.is_empty() && !repeats) {
            return row;
        }
        let mut row = row.into_owned();
        if repeats {
            // Each token seen once: the prompt's, then the completion's not in the prompt.
            let completion = counts.0.keys().filter(|&&t| !prompt.contains(t));
            for &token in prompt.0.iter().chain(completion) {
                if let Some(logit) = row.get_mut(token as usize) {
                    *logit = match *logit > 0.0 {
                        true => *logit / self.repetition,
                        false => *logit * self.repetition,
                    };
                }
            }
        }
        if self.presence != 0.0 || self.frequency != 0.0 {
            for (&token, &count) in &counts.0 {
                if let Some(logit) = row.get_mut(token as usize) {
                    *logit -= self.presence + self.frequency * count as f32;
                }
            }
        }
        Cow::Owned(row)
    }
}

/// The distinct tokens of a prompt, which the repetition penalty counts as seen.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PromptTokens(Vec<u32>);

impl PromptTokens {
    /// `prompt`'s tokens where `penalties` count them (a repetition penalty), else none.
    pub fn of(prompt: &[u32], penalties: &Penalties) -> Self {
        if !penalties.repeats() {
            return Self::default();
        }
        let mut tokens = prompt.to_vec();
        tokens.sort_unstable();
        tokens.dedup();
        Self(tokens)
    }

    fn contains(&self, token: u32) -> bool {
        self.0.binary_search(&token).is_ok()
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

    /// `row` penalized by `p` for `counts` and `prompt`, as a vector.
    fn penalized(p: &Penalties, row: &[f32], counts: &Counts, prompt: &[u32]) -> Vec<f32> {
        let prompt = PromptTokens::of(prompt, p);
        p.apply(Cow::Borrowed(row), counts, &prompt).into_owned()
    }

    #[test]
    fn each_seen_token_loses_presence_once_and_frequency_per_time() {
        let p = Penalties {
            presence: 0.5,
            frequency: 0.25,
            ..Penalties::default()
        };
        let row = [1.0f32, 1.0, 1.0, 1.0];
        let mut counts = Counts::of(&[2, 0, 2]);
        assert_eq!(penalized(&p, &row, &counts, &[1]), [0.25, 1.0, 0.0, 1.0]);
        counts.add(9); // outside the row: nothing to lower
        assert_eq!(penalized(&p, &row, &counts, &[]), [0.25, 1.0, 0.0, 1.0]);
        let unchanged = |p: &Penalties, counts: &Counts, prompt: &[u32]| {
            let prompt = PromptTokens::of(prompt, p);
            matches!(
                p.apply(Cow::Borrowed(&row[..]), counts, &prompt),
                Cow::Borrowed(_)
            )
        };
        assert!(unchanged(&Penalties::default(), &counts, &[1]));
        assert!(unchanged(&p, &Counts::default(), &[1]));
    }

    /// The repetition penalty divides a seen token's positive logit and multiplies its
    /// negative one, once whether the token was seen in the prompt, the completion or both,
    /// and before the presence and frequency penalties.
    #[test]
    fn a_repeated_token_is_scaled_once_by_the_repetition_penalty() {
        let p = Penalties {
            repetition: 2.0,
            ..Penalties::default()
        };
        let row = [4.0f32, -4.0, 4.0, -4.0, 4.0];
        let counts = Counts::of(&[2, 2, 3]);
        assert_eq!(
            penalized(&p, &row, &counts, &[0, 1, 2, 1]),
            [2.0, -8.0, 2.0, -8.0, 4.0]
        );
        assert_eq!(
            penalized(&p, &row, &Counts::default(), &[4]),
            [4.0, -4.0, 4.0, -4.0, 2.0]
        );
        let below_one = Penalties {
            repetition: 0.5,
            ..p
        };
        assert_eq!(
            penalized(&below_one, &row, &counts, &[]),
            [4.0, -4.0, 8.0, -2.0, 4.0]
        );
        let all = Penalties {
            presence: 1.0,
            frequency: 0.5,
            ..p
        };
        // Token 2: 4 / 2 - 1 - 2 * 0.5; token 3: -4 * 2 - 1 - 0.5.
        assert_eq!(
            penalized(&all, &row, &counts, &[0]),
            [2.0, -4.0, 0.0, -9.5, 4.0]
        );
        // Without a repetition penalty the prompt is not kept at all.
        assert_eq!(
            PromptTokens::of(&[3, 1, 3], &Penalties::default()),
            PromptTokens::default()
        );
        assert_eq!(PromptTokens::of(&[3, 1, 3], &p), PromptTokens(vec![1, 3]));
    }

    #[test]
    fn penalties_stay_within_their_ranges() {
        let p = |presence, frequency, repetition| Penalties {
            presence,
            frequency,
            repetition,
        };
        assert_eq!(p(2.0, -2.0, 0.01).check(), Ok(()));
        let why = |p: Penalties| p.check().unwrap_err();
        assert_eq!(
            why(p(2.5, 0.0, 1.0)),
            ("presence_penalty", "2.5 is outside [-2, 2]".into())
        );
        assert_eq!(why(p(0.0, f32::NAN, 1.0)).0, "frequency_penalty");
        for bad in [0.0, -1.0, f32::NAN, f32::INFINITY] {
            assert_eq!(why(p(0.0, 0.0, bad)).0, "repetition_penalty", "{bad}");
        }
        assert_eq!(why(p(0.0, 0.0, 0.0)).1, "0 must be a number > 0");
    }
}
