//! vLLM's request parameters that change an answer and that duet does not take: each is
//! refused (400 naming it) where a request sets it to anything but its default, rather than
//! left out of an answer that would look like one that honoured it. At their defaults they
//! pass, as clients written for vLLM send them so.

use serde::Deserialize;
use serde_json::{Value, json};

use super::wire::{Unsupported, unsupported};

/// The parameters as a request sends them (any JSON; `null` is unset).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Unhonoured {
    use_beam_search: Option<Value>,
    length_penalty: Option<Value>,
    allowed_token_ids: Option<Value>,
    bad_words: Option<Value>,
    truncate_prompt_tokens: Option<Value>,
    prompt_logprobs: Option<Value>,
    add_generation_prompt: Option<Value>,
    continue_final_message: Option<Value>,
    chat_template: Option<Value>,
    logits_processors: Option<Value>,
    return_tokens_as_token_ids: Option<Value>,
    structural_tag: Option<Value>,
    guided_whitespace_pattern: Option<Value>,
}

impl Unhonoured {
    /// The first parameter set away from its default, refused with what to do instead.
    pub fn refuse(&self) -> Result<(), Unsupported> {
        let not = "duet does not take it";
        let none = Value::Null;
        let checks: [(&'static str, &Option<Value>, Value, &str); 13] = [
            ("use_beam_search", &self.use_beam_search, json!(false), not),
            (
                "length_penalty",
                &self.length_penalty,
                json!(1.0),
                "beam search only",
            ),
            ("allowed_token_ids", &self.allowed_token_ids, json!([]), not),
            ("bad_words", &self.bad_words, json!([]), not),
            (
                "truncate_prompt_tokens",
                &self.truncate_prompt_tokens,
                none.clone(),
                not,
            ),
            (
                "prompt_logprobs",
                &self.prompt_logprobs,
                none.clone(),
                "ask a completion with echo and logprobs, or gRPC's prompt_logprobs",
            ),
            (
                "add_generation_prompt",
                &self.add_generation_prompt,
                json!(true),
                "a chat's prompt always ends with the assistant's turn opened",
            ),
            (
                "continue_final_message",
                &self.continue_final_message,
                json!(false),
                not,
            ),
            (
                "chat_template",
                &self.chat_template,
                none.clone(),
                "the target model's own template renders every chat",
            ),
            (
                "logits_processors",
                &self.logits_processors,
                none.clone(),
                not,
            ),
            (
                "return_tokens_as_token_ids",
                &self.return_tokens_as_token_ids,
                json!(false),
                not,
            ),
            ("structural_tag", &self.structural_tag, none.clone(), not),
            (
                "guided_whitespace_pattern",
                &self.guided_whitespace_pattern,
                none,
                "a schema's whitespace is llguidance's",
            ),
        ];
        match checks
            .into_iter()
            .find(|(_, v, default, _)| differs(v, default))
        {
            Some((param, _, _, why)) => Err(unsupported(param, why)),
            None => Ok(()),
        }
    }
}

/// Whether `value` is set to other than `default` (numbers compared as numbers: 1 is 1.0).
pub(super) fn differs(value: &Option<Value>, default: &Value) -> bool {
    match (value, default) {
        (None | Some(Value::Null), _) => false,
        (Some(Value::Number(a)), Value::Number(b)) => a.as_f64() != b.as_f64(),
        (Some(v), d) => v != d,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(body: Value) -> Option<Unsupported> {
        serde_json::from_value::<Unhonoured>(body)
            .unwrap()
            .refuse()
            .err()
    }

    /// At their defaults (or null) the parameters pass; set otherwise, each is refused by
    /// name.
    #[test]
    fn a_parameter_away_from_its_default_is_refused_by_name() {
        let defaults = json!({
            "use_beam_search": false, "length_penalty": 1,
            "allowed_token_ids": [], "bad_words": [], "truncate_prompt_tokens": null,
            "prompt_logprobs": null, "add_generation_prompt": true,
            "continue_final_message": false, "chat_template": null,
            "logits_processors": null, "return_tokens_as_token_ids": false,
            "structural_tag": null, "guided_whitespace_pattern": null,
        });
        assert_eq!(refused(defaults), None);
        assert_eq!(refused(json!({})), None);
        for (param, value) in [
            ("use_beam_search", json!(true)),
            ("length_penalty", json!(0.8)),
            ("allowed_token_ids", json!([1, 2])),
            ("bad_words", json!(["x"])),
            ("truncate_prompt_tokens", json!(100)),
            ("prompt_logprobs", json!(0)),
            ("add_generation_prompt", json!(false)),
            ("continue_final_message", json!(true)),
            ("chat_template", json!("{{ messages }}")),
            ("logits_processors", json!(["a.b"])),
            ("return_tokens_as_token_ids", json!(true)),
            ("structural_tag", json!("{}")),
            ("guided_whitespace_pattern", json!("[ ]?")),
        ] {
            let e = refused(json!({ param: value })).expect(param);
            assert_eq!(e.param, param);
        }
        let e = refused(json!({"add_generation_prompt": false})).unwrap();
        assert_eq!(
            e.message,
            "add_generation_prompt: a chat's prompt always ends with the assistant's turn opened"
        );
    }
}
