//! Structured output: which tokens keep a completion within a JSON schema, a regular
//! expression or a Lark grammar, position by position. llguidance computes each position's
//! token mask from the bytes of the vocabulary's tokens; a position's logits outside it
//! become -inf, so the target's choice (greedy or sampled) is the constrained model's.

use crate::{EngineError, Result, Tokenizer};
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use std::borrow::Cow;
use std::sync::{Arc, OnceLock};

/// The tokens one position allows (a bit per token id).
pub type Mask = llguidance::toktrie::SimpleVob;

/// What a completion must match (`StructuredOutput` on the wire).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Format {
    /// A JSON Schema, as JSON text: the completion is one JSON value the schema accepts.
    JsonSchema(String),
    /// Any JSON object (OpenAI's `json_object`).
    JsonObject,
    /// A regular expression the whole completion matches.
    Regex(String),
    /// A grammar in llguidance's Lark dialect (its `start` rule).
    Lark(String),
}

impl Format {
    /// As traces and the API name the kind of format.
    pub fn name(&self) -> &'static str {
        match self {
            Format::JsonSchema(_) => "json_schema",
            Format::JsonObject => "json_object",
            Format::Regex(_) => "regex",
            Format::Lark(_) => "lark",
        }
    }

    fn grammar(&self) -> Result<TopLevelGrammar> {
        Ok(match self {
            Format::JsonSchema(text) => {
                let schema = serde_json::from_str(text)
                    .map_err(|e| invalid(format!("the JSON schema is not JSON: {e}")))?;
                TopLevelGrammar::from_json_schema(schema)
            }
            Format::JsonObject => {
                TopLevelGrammar::from_json_schema(serde_json::json!({"type": "object"}))
            }
            Format::Regex(regex) => TopLevelGrammar::from_regex(regex),
            Format::Lark(grammar) => TopLevelGrammar::from_lark(grammar.clone()),
        })
    }

    /// Checks that the format compiles, without a model's vocabulary (a vocabulary of the
    /// 256 bytes): what a server checks at its edge before any worker opens a session.
    pub fn check(&self) -> Result<()> {
        static BYTES: OnceLock<ParserFactory> = OnceLock::new();
        let factory = BYTES.get_or_init(|| {
            let mut factory = ParserFactory::new_simple(&ApproximateTokEnv::single_byte_env())
                .expect("a parser factory over the 256 bytes");
            factory.quiet();
            factory
        });
        factory.create_parser(self.grammar()?).map_err(invalid)?;
        Ok(())
    }
}

fn invalid(why: impl std::fmt::Display) -> EngineError {
    EngineError::Grammar(why.to_string())
}

/// A model's vocabulary as llguidance reads it: every token's bytes in a trie (special
/// tokens marked, so no grammar writes them as text), and the tokenizer for the literal
/// strings grammars hold.
struct Vocabulary {
    trie: TokTrie,
    tokenizer: Tokenizer,
}

impl TokenizerEnv for Vocabulary {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, bytes: &[u8]) -> Vec<u32> {
        self.trie.tokenize_with_greedy_fallback(bytes, |text| {
            self.tokenizer.encode_literal(text).unwrap_or_default()
        })
    }
}

/// What constrains a model's completions: the vocabulary and llguidance's parser factory,
/// built once per model (a pass over the vocabulary) and shared by its sessions.
pub struct Grammars {
    factory: ParserFactory,
    eos: Arc<[u32]>,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammars").finish_non_exhaustive()
    }
}

impl Grammars {
    /// `rows` is the width of the model's logits, which may exceed the tokenizer's
    /// vocabulary (padding ids no grammar allows).
    pub fn new(tokenizer: &Tokenizer, rows: usize) -> Result<Self> {
        let vocab = tokenizer.vocab_size();
        let width = rows.max(vocab);
        let mut words = Vec::with_capacity(width);
        for id in 0..width as u32 {
            let mut bytes = match id as usize >= vocab {
                true => format!("<[{id}]>").into_bytes(),
                false => tokenizer.token_bytes(id)?,
            };
            if id as usize >= vocab || tokenizer.is_special(id) {
                bytes.insert(0, TokTrie::SPECIAL_TOKEN_MARKER);
            }
            words.push(bytes);
        }
        let eos: Vec<u32> = tokenizer.eos_tokens().iter().copied().collect();
        let first = *eos
            .first()
            .ok_or_else(|| invalid("the model has no end token"))?;
        let trie = TokTrie::from(&TokRxInfo::new(width as u32, first), &words);
        let vocabulary = Vocabulary {
            trie: trie.with_eos_tokens(&eos),
            tokenizer: tokenizer.clone(),
        };
        let mut factory = ParserFactory::new_simple(&(Arc::new(vocabulary) as _))
            .map_err(|e| invalid(format!("building the vocabulary's parser: {e}")))?;
        factory.quiet();
        Ok(Self {
            factory,
            eos: eos.into(),
        })
    }

    /// One completion's constraint, at its start. A format llguidance cannot compile (a
    /// malformed schema, regular expression or grammar) is [`EngineError::Grammar`].
    pub fn constrain(&self, format: &Format) -> Result<Constraint> {
        let parser = self
            .factory
            .create_parser(format.grammar()?)
            .map_err(invalid)?;
        Ok(Constraint {
            matcher: Matcher::new(Ok(parser)),
            read: Vec::new(),
            eos: self.eos.clone(),
        })
    }
}

/// One completion's constraint: llguidance's matcher and the completion tokens it has read.
pub struct Constraint {
    matcher: Matcher,
    read: Vec<u32>,
    eos: Arc<[u32]>,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("read", &self.read.len())
            .finish_non_exhaustive()
    }
}

impl Constraint {
    /// The mask of each verified position: the first after `so_far` (the completion up to
    /// the last committed token), then one after each of a chain's `drafts`, up to and
    /// including the position of the first draft the constraint does not allow or that
    /// ends the completion (an end token); past it no row counts (the draft there is never
    /// accepted, or ends the text), so there is no mask. A token of `so_far` the constraint
    /// does not allow is [`EngineError::Grammar`].
    pub fn masks(&mut self, so_far: &[u32], drafts: &[u32]) -> Result<Vec<Mask>> {
        self.follow(so_far)?;
        let mut masks = Vec::with_capacity(drafts.len() + 1);
        let mut fed = 0;
        loop {
            let mask = self.matcher.compute_mask_or_eos().map_err(invalid)?;
            let next = drafts.get(masks.len()).copied();
            masks.push(mask);
            match next {
                Some(d) if masks[masks.len() - 1].is_allowed(d) && !self.eos.contains(&d) => {
                    self.matcher.consume_token(d).map_err(invalid)?;
                    fed += 1;
                }
                _ => break,
            }
        }
        self.matcher.rollback(fed).map_err(invalid)?;
        Ok(masks)
    }

    /// Brings the matcher to the completion `so_far`: back to what it shares with the
    /// tokens read before (a rejected draft's position), then on with the rest.
    fn follow(&mut self, so_far: &[u32]) -> Result<()> {
        let common = self
            .read
            .iter()
            .zip(so_far)
            .take_while(|(a, b)| a == b)
            .count();
        if common < self.read.len() {
            self.matcher
                .rollback(self.read.len() - common)
                .map_err(invalid)?;
            self.read.truncate(common);
        }
        for &token in &so_far[common..] {
            let taken = self.matcher.try_consume_tokens(&[token]).map_err(invalid)?;
            if taken == 0 {
                return Err(invalid(format!(
                    "token {token} at completion position {} is outside the format",
                    self.read.len()
                )));
            }
            self.read.push(token);
        }
        Ok(())
    }
}

/// `row` with every token `mask` leaves out at -inf.
pub fn masked<'a>(mask: &Mask, row: Cow<'a, [f32]>) -> Cow<'a, [f32]> {
    let mut row = row.into_owned();
    let words = mask.as_slice();
    for (i, chunk) in row.chunks_mut(32).enumerate() {
        match words.get(i).copied().unwrap_or(0) {
            u32::MAX => {}
            0 => chunk.fill(f32::NEG_INFINITY),
            word => {
                for (bit, logit) in chunk.iter_mut().enumerate() {
                    if word & (1 << bit) == 0 {
                        *logit = f32::NEG_INFINITY;
                    }
                }
            }
        }
    }
    Cow::Owned(row)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> (Tokenizer, Grammars) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tiny.gguf");
        crate::testing::TinyModel::default().write(&path).unwrap();
        let tokenizer = Tokenizer::load(&path).unwrap();
        // Wider logits than the vocabulary, as Qwen's are.
        let grammars = Grammars::new(&tokenizer, tokenizer.vocab_size() + 5).unwrap();
        (tokenizer, grammars)
    }

    fn id(tokenizer: &Tokenizer, text: &str) -> u32 {
        let ids = tokenizer.encode_literal(text).unwrap();
        assert_eq!(ids.len(), 1, "{text:?} is one token");
        ids[0]
    }

    fn allowed(mask: &Mask, tokenizer: &Tokenizer, texts: &[&str]) -> Vec<bool> {
        texts
            .iter()
            .map(|t| mask.is_allowed(id(tokenizer, t)))
            .collect()
    }

    /// Each position allows what can continue the format, an end token only where the
    /// completion is whole, and no control token or padding id as text.
    #[test]
    fn a_regex_allows_what_continues_it_and_ends_only_when_whole() {
        let (tok, grammars) = tiny();
        let eos = *tok.eos_tokens().first().unwrap();
        let mut c = grammars.constrain(&Format::Regex("ab+c".into())).unwrap();
        let [a, b, c_] = ["a", "b", "c"].map(|t| id(&tok, t));
        let masks = c.masks(&[], &[a, b, b, c_]).unwrap();
        assert_eq!(masks.len(), 5);
        assert_eq!(
            allowed(&masks[0], &tok, &["a", "b", "c"]),
            [true, false, false]
        );
        assert_eq!(
            allowed(&masks[1], &tok, &["a", "b", "c"]),
            [false, true, false]
        );
        assert_eq!(
            allowed(&masks[2], &tok, &["a", "b", "c"]),
            [false, true, true]
        );
        assert!(!masks[2].is_allowed(eos));
        assert_eq!(
            masks[4].iter().collect::<Vec<_>>(),
            tok.eos_tokens().iter().copied().collect::<Vec<_>>()
        );
        let im_start = tok.encode("<|im_start|>", false).unwrap()[0];
        let anything = grammars
            .constrain(&Format::Regex("(.|\\n)*".into()))
            .unwrap()
            .masks(&[], &[])
            .unwrap();
        assert!(anything[0].is_allowed(id(&tok, "<")));
        assert!(!anything[0].is_allowed(im_start));
        assert!(!anything[0].is_allowed(tok.vocab_size() as u32 + 1));
    }

    /// The masks stop at the first draft the format does not allow or that ends the text,
    /// and leave the matcher where the committed completion stands: the next call's masks
    /// after a shorter or other completion are those of a fresh constraint.
    #[test]
    fn drafts_are_read_up_to_the_first_outside_and_given_back() {
        let (tok, grammars) = tiny();
        let format = Format::Regex("ab+c|ad".into());
        let [a, b, c, d, x] = ["a", "b", "c", "d", "x"].map(|t| id(&tok, t));
        let eos = *tok.eos_tokens().first().unwrap();
        let mut constraint = grammars.constrain(&format).unwrap();
        assert_eq!(constraint.masks(&[a], &[b, x, b]).unwrap().len(), 2);
        assert_eq!(constraint.masks(&[a], &[d, eos, a]).unwrap().len(), 2);
        let later = constraint.masks(&[a, d], &[]).unwrap();
        let fresh = grammars
            .constrain(&format)
            .unwrap()
            .masks(&[a, d], &[])
            .unwrap();
        assert_eq!(later, fresh);
        let back = constraint.masks(&[a, b], &[c]).unwrap();
        let fresh = grammars
            .constrain(&format)
            .unwrap()
            .masks(&[a, b], &[c])
            .unwrap();
        assert_eq!(back, fresh);
        let outside = constraint.masks(&[a, c], &[]).unwrap_err().to_string();
        assert_eq!(
            outside,
            format!("structured output: token {c} at completion position 1 is outside the format")
        );
    }

    #[test]
    fn a_json_schema_starts_its_value_and_malformed_formats_are_refused() {
        let (tok, grammars) = tiny();
        let schema =
            r#"{"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}"#;
        for format in [Format::JsonSchema(schema.into()), Format::JsonObject] {
            let masks = grammars
                .constrain(&format)
                .unwrap()
                .masks(&[], &[])
                .unwrap();
            assert_eq!(
                allowed(&masks[0], &tok, &["{", "a", "["]),
                [true, false, false]
            );
        }
        let malformed = [
            Format::JsonSchema("{".into()),
            Format::JsonSchema(r#"{"type": "no such type"}"#.into()),
            Format::Regex("a(".into()),
            Format::Lark("start: undefined_rule".into()),
        ];
        for format in malformed {
            let refused = grammars.constrain(&format).unwrap_err().to_string();
            assert!(refused.starts_with("structured output: "), "{refused}");
            // The edge's check, without the vocabulary, refuses it the same way.
            assert_eq!(format.check().unwrap_err().to_string(), refused);
        }
        assert!(Format::JsonSchema(schema.into()).check().is_ok());
        let not_json = Format::JsonSchema("{".into())
            .check()
            .unwrap_err()
            .to_string();
        assert!(not_json.starts_with("structured output: the JSON schema is not JSON"));
    }

    #[test]
    fn a_masked_row_keeps_only_the_allowed_logits() {
        let mut mask = Mask::alloc(70);
        for allowed in [0, 33, 69] {
            mask.allow_token(allowed);
        }
        let row: Vec<f32> = (0..70).map(|i| i as f32).collect();
        let masked = masked(&mask, Cow::Borrowed(&row));
        let kept: Vec<(usize, f32)> = masked
            .iter()
            .copied()
            .enumerate()
            .filter(|(_, l)| l.is_finite())
            .collect();
        assert_eq!(kept, [(0, 0.0), (33, 33.0), (69, 69.0)]);
    }
}
