//! OpenAI's `logit_bias`: a fixed amount added to chosen tokens' logits at every position,
//! before greedy's argmax or temperature, top-k and top-p (-100 in effect bans a token, 100
//! all but forces it). A bias does not depend on the position, so the target applies it to
//! any row alike, a tree's included, and a draft that applies it too proposes what the
//! target will choose.

use std::borrow::Cow;

/// The largest bias either way (OpenAI's bound).
pub const MAX_BIAS: f32 = 100.0;

/// The most tokens one request may bias.
pub const MAX_BIASED_TOKENS: usize = 1024;

/// Each biased token's id and bias, by id.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LogitBias(Vec<(u32, f32)>);

impl LogitBias {
    /// No bias (a `static`'s value).
    pub const fn none() -> Self {
        Self(Vec::new())
    }

    pub fn new(entries: impl IntoIterator<Item = (u32, f32)>) -> Self {
        let mut entries: Vec<_> = entries.into_iter().collect();
        entries.sort_by_key(|&(id, _)| id);
        Self(entries)
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn entries(&self) -> &[(u32, f32)] {
        &self.0
    }

    /// What is wrong with it, if anything: more than [`MAX_BIASED_TOKENS`] tokens, or a
    /// bias outside [-100, 100] (NaN included).
    pub fn check(&self) -> Result<(), String> {
        if self.0.len() > MAX_BIASED_TOKENS {
            let n = self.0.len();
            return Err(format!("{n} tokens; at most {MAX_BIASED_TOKENS}"));
        }
        let within = |b: f32| (-MAX_BIAS..=MAX_BIAS).contains(&b);
        match self.0.iter().find(|&&(_, b)| !within(b)) {
            Some((id, b)) => Err(format!("token {id}: {b} is outside [-100, 100]")),
            None => Ok(()),
        }
    }

    /// `row` with the bias added (ids past its end change nothing).
    pub fn apply<'a>(&self, row: Cow<'a, [f32]>) -> Cow<'a, [f32]> {
        if self.0.is_empty() {
            return row;
        }
        let mut row = row.into_owned();
        for &(id, bias) in &self.0 {
            if let Some(logit) = row.get_mut(id as usize) {
                *logit += bias;
            }
        }
        Cow::Owned(row)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bias_adds_to_its_tokens_logits_and_stays_within_a_hundred() {
        let bias = LogitBias::new([(3, -100.0), (0, 2.5), (9, 1.0)]);
        assert_eq!(bias.entries(), [(0, 2.5), (3, -100.0), (9, 1.0)]);
        let row = [1.0, 2.0, 3.0, 4.0];
        assert_eq!(
            &bias.apply(Cow::Borrowed(&row[..]))[..],
            [3.5, 2.0, 3.0, -96.0]
        );
        let none = LogitBias::default();
        assert!(matches!(
            none.apply(Cow::Borrowed(&row[..])),
            Cow::Borrowed(_)
        ));
        assert_eq!(bias.check(), Ok(()));
        let e = LogitBias::new([(7, 100.5)]).check().unwrap_err();
        assert_eq!(e, "token 7: 100.5 is outside [-100, 100]");
        assert!(LogitBias::new([(7, f32::NAN)]).check().is_err());
        let many = LogitBias::new((0..1025).map(|id| (id, 1.0)));
        assert_eq!(many.check().unwrap_err(), "1025 tokens; at most 1024");
    }
}
