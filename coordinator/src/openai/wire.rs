//! OpenAI's request and response shapes, and their conversion to and from duet's own
//! `GenerateRequest` and stream. Validation stays where gRPC's is (`request.rs`): this only
//! moves fields, and refuses what duet does not do (`best_of`, `logit_bias`, tools, …).

use super::logprobs;
use super::unhonoured::Unhonoured;
use duet_proto::v1 as pb;
use pb::structured_output::Format;
use serde::Deserialize;
use serde_json::Value;
use std::collections::HashMap;

mod answer;

pub use answer::{Header, Kind, finish_reason, stop_reason, usage};

/// `stop` takes a string or a list of strings.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

impl OneOrMany {
    fn into_vec(self) -> Vec<String> {
        match self {
            Self::One(s) => vec![s],
            Self::Many(v) => v,
        }
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// The fields `/v1/completions` and `/v1/chat/completions` share; others are ignored, as
/// the OpenAI API's clients send many that a server may leave aside (`user`, …).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Common {
    /// A LoRA adapter's name selects it (as vLLM's `--lora-modules` names do); any other
    /// name is the target alone (a coordinator serves one model, whatever else it is
    /// called).
    pub model: Option<String>,
    pub max_tokens: Option<u32>,
    /// Chat's newer name for `max_tokens`.
    pub max_completion_tokens: Option<u32>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub seed: Option<u64>,
    pub stop: Option<OneOrMany>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub n: Option<u32>,
    pub best_of: Option<u32>,
    #[serde(default)]
    pub echo: bool,
    /// Chat: whether to answer each token's log-probability; completions: how many most
    /// likely tokens' to answer beside it (`logprobs::asked`).
    pub logprobs: Option<Value>,
    /// Chat: how many most likely tokens' log-probabilities beside each token's.
    pub top_logprobs: Option<u32>,
    /// vLLM's and duet's own: keep only the k most likely tokens (0: all).
    pub top_k: Option<u32>,
    /// vLLM's and llama.cpp's: keep only the tokens at least this share as likely as the
    /// most likely one.
    pub min_p: Option<f32>,
    /// vLLM's: a seen token's logit divided (positive) or multiplied (not) by this.
    pub repetition_penalty: Option<f32>,
    /// vLLM's: go on past end-of-sequence tokens; no end (nor stop string) before
    /// `min_tokens` tokens.
    #[serde(default)]
    pub ignore_eos: bool,
    pub min_tokens: Option<u32>,
    /// vLLM's: more tokens that end the completion.
    pub stop_token_ids: Option<Vec<u32>>,
    /// vLLM's: the text ends with the stop string that ended it.
    #[serde(default)]
    pub include_stop_str_in_output: bool,
    /// vLLM's: special (control) tokens add no text (unset: true).
    pub skip_special_tokens: Option<bool>,
    /// vLLM's: a cached prompt prefix only from requests of the same salt.
    pub cache_salt: Option<String>,
    /// vLLM's: false leaves a thought that comes apart out of the answer.
    pub include_reasoning: Option<bool>,
    /// vLLM's: the lower goes first in the wait queue.
    pub priority: Option<i32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    /// Token ids (as strings) to the bias added to their logits.
    pub logit_bias: Option<Value>,
    /// Predicted output: `{"type": "content", "content": text or text parts}`.
    pub prediction: Option<Value>,
    /// Structured output (`Common::structured_output`): OpenAI's `{"type": "text"}`,
    /// `{"type": "json_object"}` or `{"type": "json_schema", "json_schema": {"schema": …}}`,
    /// and vLLM's `guided_json` (a schema), `guided_regex` and `guided_choice` (strings).
    pub response_format: Option<Value>,
    pub guided_json: Option<Value>,
    pub guided_regex: Option<String>,
    pub guided_choice: Option<Value>,
    /// A grammar in llguidance's Lark dialect (vLLM's `guided_grammar` with its llguidance
    /// backend).
    pub guided_grammar: Option<String>,
    /// vLLM's newer form of the same: `{"json" | "regex" | "choice" | "grammar" |
    /// "json_object": …}`.
    pub structured_outputs: Option<serde_json::Map<String, Value>>,
    /// Chat: functions the model may call (`[{"type": "function", "function": {"name",
    /// "description", "parameters"}}]`) and how (`"auto"`, `"none"`, `"required"` or
    /// `{"type": "function", "function": {"name"}}`).
    pub tools: Option<Vec<Tool>>,
    pub tool_choice: Option<Value>,
    /// False: at most one call.
    pub parallel_tool_calls: Option<bool>,
    /// vLLM's: more variables for the chat template (`{"enable_thinking": false}`).
    pub chat_template_kwargs: Option<Value>,
    /// duet's own: `auto`, `draft_model`, `ngram` or `none`.
    pub speculation: Option<String>,
    /// duet's own: K (0: the server's choice).
    pub num_speculative_tokens: Option<u32>,
    /// vLLM's parameters duet refuses away from their defaults.
    #[serde(flatten)]
    pub unhonoured: Unhonoured,
}

/// `/v1/completions`' `prompt`: text or token ids, or a list of either (several prompts,
/// each with its own choices).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Prompts {
    Text(String),
    Tokens(Vec<u32>),
    Texts(Vec<String>),
    TokenLists(Vec<Vec<u32>>),
}

impl Prompts {
    fn inputs(&self) -> Vec<pb::generate_request::Input> {
        use pb::generate_request::Input;
        let tokens = |ids: &Vec<u32>| Input::PromptTokenIds(pb::TokenIds { ids: ids.clone() });
        match self {
            Self::Text(text) => vec![Input::Prompt(text.clone())],
            Self::Tokens(ids) => vec![tokens(ids)],
            Self::Texts(texts) => texts.iter().cloned().map(Input::Prompt).collect(),
            Self::TokenLists(lists) => lists.iter().map(tokens).collect(),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    pub prompt: Prompts,
    /// Fill in the middle: the completion goes between the prompt and this text.
    pub suffix: Option<String>,
    #[serde(flatten)]
    pub common: Common,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<ChatMessage>,
    #[serde(flatten)]
    pub common: Common,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    /// Null in an assistant message that only calls tools.
    #[serde(default)]
    pub content: Option<Content>,
    #[serde(default)]
    pub tool_calls: Vec<ToolCall>,
    /// A `tool` message: the call whose result it holds.
    #[serde(default)]
    pub tool_call_id: Option<String>,
}

impl ChatMessage {
    /// A message of `role` holding `text` alone.
    pub fn text(role: &str, text: &str) -> Self {
        Self {
            role: role.into(),
            content: Some(Content::Text(text.into())),
            tool_calls: Vec::new(),
            tool_call_id: None,
        }
    }
}

/// A tool as OpenAI's requests give it.
#[derive(Debug, Clone, Deserialize)]
pub struct Tool {
    #[serde(rename = "type")]
    pub kind: String,
    pub function: Function,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Function {
    pub name: String,
    #[serde(default)]
    pub description: String,
    #[serde(default)]
    pub parameters: Option<Value>,
}

/// A call in an assistant message: its arguments JSON text.
#[derive(Debug, Clone, Deserialize)]
pub struct ToolCall {
    #[serde(default)]
    pub id: String,
    pub function: CalledFunction,
}

#[derive(Debug, Clone, Deserialize)]
pub struct CalledFunction {
    pub name: String,
    #[serde(default)]
    pub arguments: String,
}

/// A message's content: a string, or a list of parts of which duet reads the text ones.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Debug, Clone, Deserialize)]
pub struct Part {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: String,
}

/// An upper bound on the JSON values in `body` without parsing it: every value after the
/// first in an array or object follows a comma, and every array or object opens a bracket.
pub fn json_values(body: &[u8]) -> usize {
    let (mut values, mut in_string, mut escaped) = (1, false, false);
    for &b in body {
        match (in_string, b) {
            (true, _) if escaped => escaped = false,
            (true, b'\\') => escaped = true,
            (true, b'"') => in_string = false,
            (true, _) => {}
            (false, b'"') => in_string = true,
            (false, b',' | b'[' | b'{') => values += 1,
            (false, _) => {}
        }
    }
    values
}

/// The most choices (`n`) one request may ask for: each is a generation of its own, with a
/// place of its own among `max_concurrent_requests`.
pub const MAX_CHOICES: u32 = 16;

/// The most generations (prompts times choices) one request may start, and at most as many
/// as the server runs at once (`max_concurrent_requests`): the answer reads none of them
/// until all have started, so one waiting for a place its own generations hold could wait
/// until they time out.
pub const MAX_GENERATIONS: usize = 64;

/// Why a request of `prompts` prompts and `n` choices each cannot run on a server that runs
/// `max_concurrent` generations at once, if it cannot.
pub fn too_many(prompts: usize, n: usize, max_concurrent: usize) -> Option<Unsupported> {
    let (generations, most) = (prompts * n, MAX_GENERATIONS.min(max_concurrent));
    let why = format!("{generations} generations (prompts times n); at most {most} at once");
    let param = if prompts > 1 { "prompt" } else { "n" };
    (generations > most).then(|| unsupported(param, &why))
}

/// A request duet cannot take, with the parameter it names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unsupported {
    pub param: &'static str,
    pub message: String,
}

/// A field sent as null reads as unset (its default), as Ollama's (Go) and TGI's clients
/// send them.
pub fn null_as_default<'de, D, T>(field: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Default + Deserialize<'de>,
{
    Option::<T>::deserialize(field).map(Option::unwrap_or_default)
}

pub fn unsupported(param: &'static str, message: &str) -> Unsupported {
    Unsupported {
        param,
        message: format!("{param}: {message}"),
    }
}

/// vLLM's formats: `json` (a schema, as JSON or as text), `regex`, `choice`, `grammar`
/// (llguidance's Lark dialect).
fn vllm_formats(
    json: Option<&Value>,
    regex: Option<&str>,
    choice: Option<Value>,
    grammar: Option<&str>,
) -> Result<[Option<Format>; 4], Unsupported> {
    let json = json.filter(|v| !v.is_null()).map(|schema| match schema {
        Value::String(schema) => Format::JsonSchema(schema.clone()),
        schema => Format::JsonSchema(schema.to_string()),
    });
    let choice = choice.map(choice_regex).transpose()?;
    let regex = regex.map(|r| Format::Regex(r.into()));
    let grammar = grammar.map(|g| Format::Lark(g.into()));
    Ok([json, regex, choice, grammar])
}

/// vLLM's `choice`: the completion is one of the strings, each matched literally.
fn choice_regex(choices: Value) -> Result<Format, Unsupported> {
    let refused = || unsupported("guided_choice", "a list of at least one string");
    let choices: Vec<String> = serde_json::from_value(choices).map_err(|_| refused())?;
    if choices.is_empty() {
        return Err(refused());
    }
    let escaped: Vec<String> = choices.iter().map(|c| regex_syntax::escape(c)).collect();
    Ok(Format::Regex(escaped.join("|")))
}

impl Common {
    /// duet's request for `input` to `kind`'s endpoint, with every field this carries.
    fn to_request(
        &self,
        kind: Kind,
        input: pb::generate_request::Input,
    ) -> Result<pb::GenerateRequest, Unsupported> {
        self.refuse_what_duet_cannot_honour()?;
        if self.echo && kind == Kind::Chat {
            return Err(unsupported("echo", "completions only"));
        }
        let (logprobs, top_logprobs) =
            logprobs::asked(kind, self.logprobs.as_ref(), self.top_logprobs)?;
        let speculation = match self.speculation.as_deref() {
            None => pb::SpeculationMethod::Auto,
            Some(name) => duet_proto::parse_method(name).ok_or_else(|| {
                unsupported(
                    "speculation",
                    &format!("unknown method {name:?} (auto, draft_model, ngram, none)"),
                )
            })?,
        };
        Ok(pb::GenerateRequest {
            input: Some(input),
            max_tokens: self.max_completion_tokens.or(self.max_tokens).unwrap_or(0),
            temperature: self.temperature.unwrap_or(0.0),
            top_k: self.top_k.unwrap_or(0),
            top_p: self.top_p,
            min_p: self.min_p.unwrap_or(0.0),
            seed: self.seed.unwrap_or(0),
            stop: self
                .stop
                .clone()
                .map(OneOrMany::into_vec)
                .unwrap_or_default(),
            speculation: speculation as i32,
            num_speculative_tokens: self.num_speculative_tokens.unwrap_or(0),
            logprobs,
            top_logprobs,
            presence_penalty: self.presence_penalty.unwrap_or(0.0),
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0),
            repetition_penalty: self.repetition_penalty.unwrap_or(1.0),
            // An echoed prompt's tokens come with figures as the completion's do.
            prompt_logprobs: (self.echo && logprobs).then_some(top_logprobs),
            logit_bias: self.logit_bias()?,
            ignore_eos: self.ignore_eos,
            stop_token_ids: self.stop_token_ids.clone().unwrap_or_default(),
            include_stop_str_in_output: self.include_stop_str_in_output,
            skip_special_tokens: self.skip_special_tokens,
            cache_salt: self.cache_salt.clone().unwrap_or_default(),
            priority: self.priority.unwrap_or(0),
            // A name for now: `openai::begin` keeps it only where it is an adapter's.
            adapter: self.model.clone().unwrap_or_default(),
            min_tokens: self.min_tokens.unwrap_or(0),
            prediction: self.prediction()?,
            structured_output: self.structured_output()?,
            tools: self.tools(kind)?,
            tool_choice: self.tool_choice()?,
            parallel_tool_calls: self.parallel_tool_calls,
            chat_template_kwargs: self.chat_template_kwargs()?,
            // A completion's, set by its caller.
            suffix: None,
            // llama.cpp's infill's (`/infill`).
            repository: None,
            min_line_indent: 0,
            max_predict_ms: 0,
        })
    }

    /// `chat_template_kwargs` as the JSON text duet's request carries (an object; chat
    /// only: a completion's prompt is not templated).
    fn chat_template_kwargs(&self) -> Result<String, Unsupported> {
        match &self.chat_template_kwargs {
            None | Some(Value::Null) => Ok(String::new()),
            Some(kwargs @ Value::Object(_)) => Ok(kwargs.to_string()),
            Some(_) => Err(unsupported("chat_template_kwargs", "must be a JSON object")),
        }
    }

    /// The request's tools as duet's (chat only; functions only).
    fn tools(&self, kind: Kind) -> Result<Vec<pb::Tool>, Unsupported> {
        let tools = self.tools.as_deref().unwrap_or_default();
        if !tools.is_empty() && kind == Kind::Completion {
            return Err(unsupported("tools", "chat completions only"));
        }
        let tool = |t: &Tool| match t.kind.as_str() {
            "function" => Ok(pb::Tool {
                name: t.function.name.clone(),
                description: t.function.description.clone(),
                parameters: (t.function.parameters.as_ref())
                    .filter(|p| !p.is_null())
                    .map_or_else(String::new, Value::to_string),
            }),
            _ => Err(unsupported("tools", "functions only")),
        };
        tools.iter().map(tool).collect()
    }

    /// `tool_choice` as duet's: `auto` (unset), `none`, `required`, or a function's name.
    fn tool_choice(&self) -> Result<String, Unsupported> {
        match self.tool_choice.as_ref() {
            None | Some(Value::Null) => Ok(String::new()),
            Some(Value::String(choice)) if ["auto", "none", "required"].contains(&&**choice) => {
                Ok(choice.clone())
            }
            Some(choice) => match choice["function"]["name"].as_str() {
                Some(name) if choice["type"] == "function" => Ok(name.to_string()),
                _ => {
                    let named = r#"{"type": "function", "function": {"name"}}"#;
                    Err(unsupported(
                        "tool_choice",
                        &format!("auto, none, required or {named}"),
                    ))
                }
            },
        }
    }

    /// The one structured output the request asks for, if any: `response_format`'s JSON
    /// object or schema, or vLLM's `guided_json`, `guided_regex`, `guided_choice` (the
    /// completion is one of the strings), `guided_grammar`, or `structured_outputs` holding
    /// one of these.
    fn structured_output(&self) -> Result<Option<pb::StructuredOutput>, Unsupported> {
        let guided = vllm_formats(
            self.guided_json.as_ref(),
            self.guided_regex.as_deref(),
            self.guided_choice.clone().filter(|c| !c.is_null()),
            self.guided_grammar.as_deref(),
        )?;
        let mut asked = [self.response_format()?]
            .into_iter()
            .chain(guided)
            .chain(self.structured_outputs()?)
            .flatten();
        let format = asked.next();
        if asked.next().is_some() {
            let why = "one structured output: response_format, a guided_* field or \
                       structured_outputs, with one format";
            return Err(unsupported("response_format", why));
        }
        Ok(format.map(|format| pb::StructuredOutput {
            format: Some(format),
        }))
    }

    /// OpenAI's `response_format`: text (no format), `json_object`, or `json_schema` with
    /// its `schema`.
    fn response_format(&self) -> Result<Option<Format>, Unsupported> {
        let Some(format) = self.response_format.as_ref().filter(|v| !v.is_null()) else {
            return Ok(None);
        };
        match format["type"].as_str() {
            Some("text") => Ok(None),
            Some("json_object") => Ok(Some(Format::JsonObject(true))),
            Some("json_schema") => match &format["json_schema"]["schema"] {
                schema @ (Value::Object(_) | Value::Bool(_)) => {
                    Ok(Some(Format::JsonSchema(schema.to_string())))
                }
                _ => {
                    let why = "json_schema.schema: a JSON Schema object";
                    Err(unsupported("response_format", why))
                }
            },
            _ => {
                let why = "type text, json_object or json_schema";
                Err(unsupported("response_format", why))
            }
        }
    }

    /// vLLM's `structured_outputs`: `json`, `regex`, `choice`, `grammar` or `json_object`;
    /// any other key set is refused (it would change the output).
    fn structured_outputs(&self) -> Result<[Option<Format>; 5], Unsupported> {
        let Some(outputs) = self.structured_outputs.as_ref() else {
            return Ok(Default::default());
        };
        let refused = |why: String| unsupported("structured_outputs", &why);
        let known = ["json", "regex", "choice", "grammar", "json_object"];
        let unknown = |(name, v): &(&String, &Value)| {
            !known.contains(&name.as_str()) && !matches!(v, Value::Null | Value::Bool(false))
        };
        if let Some((name, _)) = outputs.iter().find(unknown) {
            return Err(refused(format!(
                "{name} is not supported ({})",
                known.join(", ")
            )));
        }
        let field = |name: &str| outputs.get(name).filter(|v| !v.is_null());
        let text = |name: &str| match field(name) {
            Some(Value::String(s)) => Ok(Some(s.as_str())),
            None => Ok(None),
            Some(_) => Err(refused(format!("{name}: a string"))),
        };
        let [json, regex, choice, grammar] = vllm_formats(
            field("json"),
            text("regex")?,
            field("choice").cloned(),
            text("grammar")?,
        )?;
        let json_object =
            (field("json_object") == Some(&Value::Bool(true))).then_some(Format::JsonObject(true));
        Ok([json, regex, choice, grammar, json_object])
    }

    /// The predicted output's text: `content` as a string, or its text parts joined.
    fn prediction(&self) -> Result<String, Unsupported> {
        let Some(prediction) = self.prediction.as_ref().filter(|p| !p.is_null()) else {
            return Ok(String::new());
        };
        let refused = || unsupported("prediction", "{\"type\": \"content\", \"content\": text}");
        if prediction["type"] != "content" {
            return Err(refused());
        }
        let content = prediction["content"].clone();
        match serde_json::from_value::<Content>(content).map_err(|_| refused())? {
            Content::Text(text) => Ok(text),
            Content::Parts(parts) => text_of(&parts, "prediction"),
        }
    }

    /// `logit_bias` as duet's: each key a token id, each value a number (gRPC's checks
    /// bound them).
    fn logit_bias(&self) -> Result<HashMap<u32, f32>, Unsupported> {
        let bias = match &self.logit_bias {
            None | Some(Value::Null) => return Ok(HashMap::new()),
            Some(Value::Object(bias)) => bias,
            Some(_) => return Err(unsupported("logit_bias", "a map of token ids to numbers")),
        };
        let entry = |(id, bias): (&String, &Value)| Some((id.parse().ok()?, bias.as_f64()? as f32));
        let read = bias.iter().map(entry).collect::<Option<_>>();
        read.ok_or_else(|| unsupported("logit_bias", "a map of token ids to numbers"))
    }

    /// What duet cannot do is refused, naming the parameter, rather than left out of an
    /// answer the caller would take for one that did it: several choices ranked (`best_of`).
    fn refuse_what_duet_cannot_honour(&self) -> Result<(), Unsupported> {
        match () {
            _ if self.n.is_some_and(|n| !(1..=MAX_CHOICES).contains(&n)) => {
                Err(unsupported("n", &format!("1 to {MAX_CHOICES} choices")))
            }
            _ if self.best_of.is_some_and(|n| n != 1) => {
                Err(unsupported("best_of", "duet does not rank choices"))
            }
            _ => self.unhonoured.refuse(),
        }
    }

    pub fn include_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage)
    }
}

impl CompletionRequest {
    /// duet's request for each prompt, in order.
    pub fn to_requests(&self) -> Result<Vec<pb::GenerateRequest>, Unsupported> {
        if self.suffix.is_some() && self.common.echo {
            return Err(unsupported("suffix", "not with echo"));
        }
        let each = self.prompt.inputs().into_iter();
        let request = |input| {
            let req = self.common.to_request(Kind::Completion, input)?;
            let suffix = self.suffix.clone();
            Ok(pb::GenerateRequest { suffix, ..req })
        };
        each.map(request).collect()
    }
}

impl ChatRequest {
    pub fn to_request(&self) -> Result<pb::GenerateRequest, Unsupported> {
        let messages = messages(&self.messages)?;
        let input = pb::generate_request::Input::Messages(pb::Messages { messages });
        self.common.to_request(Kind::Chat, input)
    }
}

/// duet's messages of OpenAI's: the text of each, and its tool calls or the call it answers.
/// Content other than text (an image, audio, a file) is refused: the model reads text only,
/// and an answer that left it out would look like one that had read it.
pub fn messages(messages: &[ChatMessage]) -> Result<Vec<pb::ChatMessage>, Unsupported> {
    let call = |c: &ToolCall| pb::ToolCall {
        id: c.id.clone(),
        name: c.function.name.clone(),
        arguments: c.function.arguments.clone(),
    };
    let message = |m: &ChatMessage| {
        Ok(pb::ChatMessage {
            // OpenAI's `developer` role is its newer name for `system`.
            role: match m.role.as_str() {
                "developer" => "system".into(),
                role => role.into(),
            },
            content: match &m.content {
                None => String::new(),
                Some(Content::Text(t)) => t.clone(),
                Some(Content::Parts(parts)) => text_of(parts, "messages")?,
            },
            tool_calls: m.tool_calls.iter().map(call).collect(),
            tool_call_id: m.tool_call_id.clone().unwrap_or_default(),
        })
    };
    messages.iter().map(message).collect()
}

/// The text parts of `param`'s content list, joined; a part of another kind is refused.
fn text_of(parts: &[Part], param: &'static str) -> Result<String, Unsupported> {
    let text = |p: &Part| match p.kind.as_str() {
        "text" => Ok(p.text.clone()),
        kind => Err(unsupported(
            param,
            &format!("text content only, not a part of type {kind}"),
        )),
    };
    parts.iter().map(text).collect()
}

#[cfg(test)]
mod tests;
