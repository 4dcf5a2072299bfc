//! Validation's second step, [`Checked::tokenize`]: the checked input tokenized (messages
//! through the chat template, a suffix in the model's fill-in-the-middle format with as many
//! of the repository's files as leave room), then the lengths, token ids and adapter checked
//! against the context and the served models.

use super::{Checked, Input, InvalidField, PROMPT_TAIL, ValidRequest, invalid};
use crate::reasoning::Thought;
use crate::tools::Tools;
use crate::workers::{AdapterNames, Models};
use duet_engine::EngineError;

impl Checked {
    /// Tokenizes the input (CPU work in proportion to its size: run it off the async
    /// threads) and checks the lengths against the context.
    pub fn tokenize(
        self,
        models: &Models,
        default_max_tokens: u32,
    ) -> Result<ValidRequest, InvalidField> {
        let (prompt, repository_files_left_out) = self.prompt(models, default_max_tokens)?;
        let thought = self.thought(models, &prompt);
        self.check_vocabulary(models.vocab)?;
        self.check_adapter(&models.adapters)?;
        let max_tokens = self.max_tokens(prompt.len(), models.context, default_max_tokens)?;
        // A middle ends where the model pads it or starts another file.
        let mut stop_token_ids = self.stop_token_ids;
        if let (Input::Infill { .. }, Some(infill)) = (&self.input, models.tokenizer.infill()) {
            stop_token_ids.extend(infill.ends());
        }
        let prediction = (models.tokenizer)
            .encode(&self.prediction, false)
            .map_err(|e| invalid("prediction", e.to_string()))?;
        let calls = models.call_format;
        let format = (self.format).or_else(|| self.tools.as_ref()?.format(calls));
        if let Some(format) = &format {
            format.check().map_err(|e| match e {
                EngineError::Grammar(why) => invalid("structured_output", why),
                other => invalid("structured_output", other.to_string()),
            })?;
        }
        if self.min_tokens > max_tokens {
            let why = format!("{} is more than max_tokens ({max_tokens})", self.min_tokens);
            return Err(invalid("min_tokens", why));
        }
        Ok(ValidRequest {
            prompt,
            max_tokens,
            sampling: self.sampling,
            stop: self.stop,
            method: self.method,
            k: self.k,
            choose_k: self.choose_k,
            logprobs: self.logprobs,
            penalties: self.penalties,
            prompt_logprobs: self.prompt_logprobs,
            logit_bias: self.logit_bias,
            ignore_eos: self.ignore_eos,
            stop_token_ids,
            include_stop_str_in_output: self.include_stop_str_in_output,
            skip_special_tokens: self.skip_special_tokens,
            cache_salt: self.cache_salt,
            min_tokens: self.min_tokens,
            prediction,
            format,
            finds_tool_calls: self.tools.as_ref().is_some_and(Tools::finds_calls),
            tool_names: self.tools.as_ref().map(Tools::names).unwrap_or_default(),
            parallel_tool_calls: self.tools.as_ref().is_none_or(Tools::parallel),
            thought,
            repository_files_left_out,
            min_line_indent: self.min_line_indent,
            max_predict: self.max_predict,
            priority: self.priority,
            adapter: self.adapter,
            request_id: None,
        })
    }

    /// The request's adapter is one the target loads.
    fn check_adapter(&self, adapters: &AdapterNames) -> Result<(), InvalidField> {
        match &self.adapter {
            Some(name) if !adapters.contains(name) => {
                Err(invalid("adapter", adapters.refusing(name)))
            }
            _ => Ok(()),
        }
    }

    /// The completion's most tokens after a prompt of `prompt` tokens in a `context`: the
    /// request's, or where unset the server's default, capped by the room left.
    fn max_tokens(
        &self,
        prompt: usize,
        context: usize,
        default: u32,
    ) -> Result<usize, InvalidField> {
        // One slot must stay free for the first completion token.
        if prompt >= context {
            return Err(invalid(
                "prompt",
                format!(
                    "{prompt} tokens; the context holds {context}, including at least one completion token"
                ),
            ));
        }
        let room = context - prompt;
        match self.max_tokens as usize {
            0 => Ok(room.min(self.asked_tokens(default))),
            n if n > room => Err(invalid(
                "max_tokens",
                format!(
                    "{n} does not fit: the prompt takes {prompt} of the context's {context} tokens, leaving {room}"
                ),
            )),
            n => Ok(n),
        }
    }

    /// The completion tokens the request asks for: its `max_tokens`, or where unset the
    /// server's `default`.
    fn asked_tokens(&self, default: u32) -> usize {
        match self.max_tokens {
            0 => default as usize,
            n => n as usize,
        }
    }

    /// The token ids the request names (biased, ending it) are in a vocabulary of `vocab`.
    fn check_vocabulary(&self, vocab: usize) -> Result<(), InvalidField> {
        let biased = self
            .logit_bias
            .entries()
            .iter()
            .map(|&(id, _)| ("logit_bias", id));
        let stops = self.stop_token_ids.iter().map(|&id| ("stop_token_ids", id));
        match biased.chain(stops).find(|&(_, id)| id as usize >= vocab) {
            Some((field, id)) => {
                let why = format!("token {id} is outside the target's vocabulary of {vocab}");
                Err(invalid(field, why))
            }
            None => Ok(()),
        }
    }

    /// Whether a chat's thought comes apart from its answer, and whether `prompt` opens it:
    /// a chat of a model whose template writes thoughts, where `separate_reasoning`.
    fn thought(&self, models: &Models, prompt: &[u32]) -> Option<bool> {
        let chat = matches!(self.input, Input::Messages(_));
        if !(self.separate_reasoning && models.writes_thoughts && chat) {
            return None;
        }
        let tok = &models.tokenizer;
        let tail = &prompt[prompt.len().saturating_sub(PROMPT_TAIL)..];
        Some(Thought::opened_by(
            &tok.decode(tail, false).unwrap_or_default(),
        ))
    }

    /// The prompt's ids: the text tokenized, the messages rendered and tokenized, or the ids
    /// given, each in the target's vocabulary; at least one. And of a repository's files,
    /// those left out for room (with `default_max_tokens`, the server's).
    fn prompt(
        &self,
        models: &Models,
        default_max_tokens: u32,
    ) -> Result<(Vec<u32>, usize), InvalidField> {
        let tok = &models.tokenizer;
        let mut left_out = 0;
        let prompt = match &self.input {
            Input::Prompt(text) => tok
                .encode(text, true)
                .map_err(|e| invalid("prompt", e.to_string()))?,
            Input::Infill {
                prefix,
                suffix,
                repository,
            } => {
                let repository = repository.as_ref();
                let infill =
                    self.infill(models, (prefix, suffix), repository, default_max_tokens)?;
                left_out = infill.files_left_out;
                infill.ids
            }
            Input::Messages(messages) => {
                let kwargs = self.template_kwargs.as_ref();
                let text = |k| serde_json::to_string(k).unwrap_or_default();
                if kwargs.is_some_and(|k| tok.holds_control_text(&text(k))) {
                    let why = "holds control-token text, which would read as the template's";
                    return Err(invalid("chat_template_kwargs", why));
                }
                let tools = self.tools.as_ref().map(Tools::for_template);
                let extras = duet_engine::ChatExtras {
                    tools: tools.as_deref().unwrap_or_default(),
                    kwargs,
                };
                tok.encode_chat_with(messages, extras, true)
                    .map_err(|e| invalid("messages", e.to_string()))?
            }
            Input::Tokens(ids) => {
                if let Some(id) = ids.iter().find(|&&id| id as usize >= models.vocab) {
                    let vocab = models.vocab;
                    let why = format!("{id} is outside the target's vocabulary of {vocab}");
                    return Err(invalid("prompt_token_ids", why));
                }
                ids.clone()
            }
        };
        match prompt.is_empty() {
            true => Err(invalid("prompt", "tokenizes to no tokens")),
            false => Ok((prompt, left_out)),
        }
    }

    /// A fill-in-the-middle prompt, its repository's first files left out where it would
    /// leave the context too little room for `max_tokens` (unset: `default_max_tokens`).
    fn infill(
        &self,
        models: &Models,
        (prefix, suffix): (&str, &str),
        repository: Option<&duet_engine::Repository>,
        default_max_tokens: u32,
    ) -> Result<duet_engine::InfillPrompt, InvalidField> {
        let tok = &models.tokenizer;
        let no_infill = || {
            invalid(
                "suffix",
                "the target model has no fill-in-the-middle tokens",
            )
        };
        let infill = tok.infill().ok_or_else(no_infill)?;
        if repository.is_some() && infill.repository_tokens().is_none() {
            let why = "the target model has no repository-level tokens";
            return Err(invalid("repository", why));
        }
        let reserve = self.asked_tokens(default_max_tokens).max(1);
        let room = models.context.saturating_sub(reserve);
        let prompt = tok.encode_infill(prefix, suffix, repository, room);
        prompt
            .map_err(|e| invalid("suffix", e.to_string()))?
            .ok_or_else(no_infill)
    }
}
