//! OpenAI's shapes of a choice's log-probabilities: chat's `logprobs.content` (each token's
//! text, bytes and log-probability, with the most likely tokens' in `top_logprobs`), and the
//! legacy completions' (`tokens`, `token_logprobs`, `top_logprobs` as maps of text to
//! log-probability that hold the chosen token too, and each token's `text_offset`).

use super::wire::{Kind, Unsupported, unsupported};
use crate::workers::Models;
use duet_proto::v1 as pb;
use serde_json::{Map, Value, json};
use std::sync::Arc;

/// What a request's `logprobs` (and chat's `top_logprobs`) ask of duet: whether to send
/// each token's figures, and how many most likely tokens' beside them. Chat's `logprobs`
/// is a boolean; the legacy completions' the number of most likely tokens.
pub fn asked(
    kind: Kind,
    logprobs: Option<&Value>,
    top_logprobs: Option<u32>,
) -> Result<(bool, u32), Unsupported> {
    let logprobs = logprobs.filter(|v| !v.is_null());
    match (kind, logprobs) {
        (Kind::Chat, None) => Ok((false, top_logprobs.unwrap_or(0))),
        (Kind::Chat, Some(Value::Bool(b))) => Ok((*b, top_logprobs.unwrap_or(0))),
        (Kind::Chat, Some(_)) => Err(unsupported("logprobs", "a boolean for chat")),
        (Kind::Completion, None | Some(Value::Bool(false))) => Ok((false, 0)),
        (Kind::Completion, Some(v)) => match v.as_u64().and_then(|n| u32::try_from(n).ok()) {
            Some(n) => Ok((true, n)),
            None => Err(unsupported(
                "logprobs",
                "the number of most likely tokens, 0-20",
            )),
        },
    }
}

/// A token's bytes (a token of a byte-level vocabulary may hold part of a character) and
/// its text on its own (such a part as U+FFFD).
pub fn token(tokenizer: &duet_engine::Tokenizer, id: u32) -> (Vec<u8>, String) {
    // The target answered the id, so its vocabulary holds it.
    let bytes = tokenizer.token_bytes(id).unwrap_or_default();
    let text = String::from_utf8_lossy(&bytes).into_owned();
    (bytes, text)
}

/// Writes a choice's `logprobs` for the tokens of each answer or streamed chunk in turn.
#[derive(Debug, Clone)]
pub struct Figures {
    kind: Kind,
    /// The served models: the target's tokenizer gives each token's text.
    models: Arc<Models>,
    /// Characters of the completion's tokens so far (the next token's `text_offset`).
    offset: usize,
}

impl Figures {
    pub fn new(kind: Kind, models: Arc<Models>) -> Self {
        Self {
            kind,
            models,
            offset: 0,
        }
    }

    /// The `logprobs` of a choice whose tokens are `ids`, with their figures.
    pub fn of(&mut self, ids: &[u32], figures: &[pb::TokenLogprobs]) -> Value {
        let tokens = ids.iter().zip(figures);
        match self.kind {
            Kind::Chat => {
                let content: Vec<Value> = tokens.map(|(&id, f)| self.chat_entry(id, f)).collect();
                json!({"content": content, "refusal": null})
            }
            Kind::Completion => self.legacy(tokens.map(|(&id, f)| (id, Some(f)))),
        }
    }

    /// The legacy `logprobs` of a choice that echoes its prompt: the prompt's tokens first
    /// (the first with null figures: nothing precedes it), then `ids` with their `figures`.
    pub fn echoed(
        &mut self,
        prompt: &pb::PromptLogprobs,
        ids: &[u32],
        figures: &[pb::TokenLogprobs],
    ) -> Value {
        let first = prompt.token_ids.first().map(|&id| (id, None));
        let rest = prompt.token_ids.iter().skip(1).zip(&prompt.logprobs);
        let completion = ids.iter().zip(figures);
        let tokens = rest.chain(completion).map(|(&id, f)| (id, Some(f)));
        self.legacy(first.into_iter().chain(tokens))
    }

    fn token(&self, id: u32) -> (Vec<u8>, String) {
        token(&self.models.tokenizer, id)
    }

    fn chat_entry(&self, id: u32, f: &pb::TokenLogprobs) -> Value {
        let entry = |id: u32, logprob: f32| {
            let (bytes, token) = self.token(id);
            json!({"token": token, "logprob": logprob, "bytes": bytes})
        };
        let top = f.top_token_ids.iter().zip(&f.top_logprobs);
        let mut chosen = entry(id, f.logprob);
        chosen["top_logprobs"] = top.map(|(&id, &l)| entry(id, l)).collect();
        chosen
    }

    /// The legacy shape of `tokens`: each id with its figures, or none (null).
    fn legacy<'a>(
        &mut self,
        tokens: impl Iterator<Item = (u32, Option<&'a pb::TokenLogprobs>)>,
    ) -> Value {
        let (mut texts, mut logprobs, mut tops, mut offsets) = (vec![], vec![], vec![], vec![]);
        for (id, f) in tokens {
            let (_, text) = self.token(id);
            let top = f.map(|f| {
                let mut top = Map::new();
                for (&other, &logprob) in f.top_token_ids.iter().zip(&f.top_logprobs) {
                    top.insert(self.token(other).1, json!(logprob));
                }
                top.insert(text.clone(), json!(f.logprob));
                top
            });
            offsets.push(self.offset);
            self.offset += text.chars().count();
            texts.push(text);
            logprobs.push(f.map(|f| f.logprob));
            tops.push(top);
        }
        json!({
            "tokens": texts,
            "token_logprobs": logprobs,
            "top_logprobs": tops,
            "text_offset": offsets,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn figures(logprob: f32, top: &[(u32, f32)]) -> pb::TokenLogprobs {
        pb::TokenLogprobs {
            logprob,
            top_token_ids: top.iter().map(|&(id, _)| id).collect(),
            top_logprobs: top.iter().map(|&(_, l)| l).collect(),
        }
    }

    /// The tiny test model's, and the ids of two of its tokens.
    fn models() -> (Arc<Models>, [u32; 2]) {
        let models = crate::generation::fakes::models();
        let ids = models.tokenizer.encode("the cat", false).unwrap();
        (models, [ids[0], ids[1]])
    }

    #[test]
    fn what_each_endpoint_asks_for() {
        use Kind::{Chat, Completion};
        assert_eq!(asked(Chat, None, None), Ok((false, 0)));
        assert_eq!(asked(Chat, Some(&json!(true)), Some(3)), Ok((true, 3)));
        // Without logprobs, gRPC's check refuses top_logprobs (naming it).
        assert_eq!(asked(Chat, Some(&Value::Null), Some(3)), Ok((false, 3)));
        assert_eq!(
            asked(Chat, Some(&json!(2)), None).unwrap_err().param,
            "logprobs"
        );
        assert_eq!(asked(Completion, Some(&json!(5)), None), Ok((true, 5)));
        assert_eq!(asked(Completion, Some(&json!(0)), Some(9)), Ok((true, 0)));
        assert_eq!(asked(Completion, Some(&json!(false)), None), Ok((false, 0)));
        assert_eq!(
            asked(Completion, Some(&json!(-1)), None).unwrap_err().param,
            "logprobs"
        );
    }

    #[test]
    fn chat_and_legacy_completions_have_openais_shapes() {
        let (models, [a, b]) = models();
        let text = |id| String::from_utf8(models.tokenizer.token_bytes(id).unwrap()).unwrap();
        let (ta, tb) = (text(a), text(b));
        let ids = [a, b];
        let f = [
            figures(-0.5, &[(a, -0.5), (b, -1.5)]),
            figures(-2.0, &[(a, -0.25)]),
        ];
        let chat = Figures::new(Kind::Chat, models.clone()).of(&ids, &f);
        let first = &chat["content"][0];
        assert_eq!(first["token"], ta);
        assert_eq!(first["bytes"], json!(ta.as_bytes()));
        assert_eq!(first["logprob"], -0.5);
        assert_eq!(
            first["top_logprobs"][1],
            json!({"token": tb, "logprob": -1.5, "bytes": tb.as_bytes()})
        );
        assert_eq!(
            chat["content"][1]["top_logprobs"].as_array().unwrap().len(),
            1
        );
        let mut legacy = Figures::new(Kind::Completion, models);
        let first = legacy.of(&ids[..1], &f[..1]);
        let second = legacy.of(&ids[1..], &f[1..]);
        assert_eq!(first["tokens"], json!([ta]));
        assert_eq!(second["token_logprobs"], json!([-2.0]));
        // The chosen token is among its position's most likely, as OpenAI's legacy API has it.
        assert_eq!(
            second["top_logprobs"][0],
            json!({ta.clone(): -0.25, tb: -2.0})
        );
        assert_eq!(second["text_offset"], json!([ta.chars().count()]));
    }

    /// An echoed prompt's tokens come first in a legacy choice's figures, the first with
    /// nulls (nothing precedes it), and the completion's offsets go on after the prompt's.
    #[test]
    fn an_echoed_prompt_leads_a_legacy_choices_figures() {
        let (models, [a, b]) = models();
        let text = |id| String::from_utf8(models.tokenizer.token_bytes(id).unwrap()).unwrap();
        let prompt = pb::PromptLogprobs {
            token_ids: vec![a, b],
            logprobs: vec![figures(-1.0, &[(a, -0.5)])],
        };
        let mut legacy = Figures::new(Kind::Completion, models.clone());
        let echoed = legacy.echoed(&prompt, &[a], &[figures(-0.75, &[])]);
        assert_eq!(echoed["tokens"], json!([text(a), text(b), text(a)]));
        assert_eq!(echoed["token_logprobs"], json!([null, -1.0, -0.75]));
        let tops = json!([null, {text(a): -0.5, text(b): -1.0}, {text(a): -0.75}]);
        assert_eq!(echoed["top_logprobs"], tops);
        let (la, lb) = (text(a).chars().count(), text(b).chars().count());
        assert_eq!(echoed["text_offset"], json!([0, la, la + lb]));
        let next = legacy.of(&[b], &[figures(-3.0, &[])]);
        assert_eq!(next["text_offset"], json!([2 * la + lb]));
    }
}
