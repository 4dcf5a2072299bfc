//! The model's tokenizer and chat template, built from GGUF metadata alone (no tokenizer.json).

use crate::chat_template::{ChatExtras, TemplateContext, render_chat_template};
use crate::error::{EngineError, Result};
use crate::infill::{Infill, Repository};
use candle_core::quantized::gguf_file::{Content, Value};
use serde::Serialize;
use std::collections::{BTreeSet, HashSet};
use std::path::Path;
use std::sync::OnceLock;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::unicode::NFC;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior};

/// One chat message for the model's chat template.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// An assistant message's calls of the request's tools, which the template renders in
    /// the model's own format.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// A `tool` message: the id of the call whose result it holds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            tool_calls: Vec::new(),
            tool_call_id: None,
        }
    }
}

/// A call of one of the request's tools.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    /// The arguments, as JSON text.
    pub arguments: String,
}

/// As Hugging Face's chat templates read a call: `{"id", "type": "function", "function":
/// {"name", "arguments"}}`, the arguments a JSON value (text that is not JSON stays text).
impl Serialize for ToolCall {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        let arguments = serde_json::from_str(&self.arguments)
            .unwrap_or_else(|_| serde_json::Value::String(self.arguments.clone()));
        serde_json::json!({
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": arguments},
        })
        .serialize(s)
    }
}

/// Text ↔ token ids for one model, plus its end-of-generation tokens and chat template.
#[derive(Debug, Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// The same tokenizer with special-token matching off: `<|im_start|>` in text stays text.
    literal: tokenizers::Tokenizer,
    /// Text of every special (control) token.
    specials: Vec<String>,
    /// Their ids: whether a token is one is asked for every generated token.
    special_ids: HashSet<u32>,
    eos: BTreeSet<u32>,
    bos: Option<u32>,
    add_bos: bool,
    chat_template: Option<String>,
    bos_text: String,
    eos_text: String,
    infill: Option<Infill>,
}

/// A fill-in-the-middle prompt, and how many of its repository's files it left out for room.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InfillPrompt {
    pub ids: Vec<u32>,
    pub files_left_out: usize,
}

/// Control tokens that end a turn in the chat formats of the supported model families
/// (llama.cpp marks end-of-generation tokens the same way).
const END_OF_TURN: &[&str] = &[
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|end_of_text|>",
    "<|eom_id|>",
    "</s>",
];

impl Tokenizer {
    /// Reads only the GGUF header of `path` (no weights).
    pub fn load(path: &Path) -> Result<Self> {
        let (content, _) = crate::model::read_gguf(path)?;
        Self::from_gguf(&content)
    }

    /// Reads a GGUF file held in memory, such as one made by [`tokenizer_gguf`].
    pub fn from_gguf_bytes(bytes: &[u8]) -> Result<Self> {
        let content = Content::read(&mut std::io::Cursor::new(bytes))
            .map_err(|e| EngineError::Tokenizer(format!("reading tokenizer GGUF: {e}")))?;
        Self::from_gguf(&content)
    }

    pub fn from_gguf(content: &Content) -> Result<Self> {
        let kind = meta_str(content, "tokenizer.ggml.model").unwrap_or_default();
        if kind != "gpt2" {
            return Err(EngineError::Tokenizer(format!(
                "unsupported tokenizer model `{kind}` (tokenizer.ggml.model; supported: gpt2 byte-level BPE)"
            )));
        }
        let tokens = string_array(content, "tokenizer.ggml.tokens")?;
        let merges = string_array(content, "tokenizer.ggml.merges")?
            .into_iter()
            .map(|m| {
                m.split_once(' ')
                    .map(|(a, b)| (a.to_string(), b.to_string()))
                    .ok_or_else(|| EngineError::Tokenizer(format!("malformed merge `{m}`")))
            })
            .collect::<Result<Vec<_>>>()?;
        let token_types: Vec<i64> = match content.metadata.get("tokenizer.ggml.token_type") {
            Some(Value::Array(v)) => v.iter().map(|t| int_value(t).unwrap_or(1)).collect(),
            _ => Vec::new(),
        };
        let pre = meta_str(content, "tokenizer.ggml.pre").unwrap_or_default();
        let inner = build_bpe(&tokens, merges, &token_types, &pre, content)?;

        let id_of = |key: &str| content.metadata.get(key).and_then(|v| v.to_u32().ok());
        let text_of = |id: u32| tokens.get(id as usize).cloned().unwrap_or_default();
        let mut eos: BTreeSet<u32> = ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"]
            .iter()
            .filter_map(|k| id_of(k))
            .collect();
        for (id, token) in tokens.iter().enumerate() {
            if token_types.get(id) == Some(&CONTROL) && END_OF_TURN.contains(&token.as_str()) {
                eos.insert(id as u32);
            }
        }
        let bos = id_of("tokenizer.ggml.bos_token_id");
        let add_bos = content
            .metadata
            .get("tokenizer.ggml.add_bos_token")
            .and_then(|v| v.to_bool().ok())
            .unwrap_or(false);
        let first_eos = id_of("tokenizer.ggml.eos_token_id");
        let mut literal = inner.clone();
        literal.set_encode_special_tokens(true);
        let (special_ids, specials) = inner
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| t.special)
            .map(|(id, t)| (id, t.content))
            .unzip();
        Ok(Self {
            inner,
            literal,
            specials,
            special_ids,
            eos,
            bos,
            add_bos,
            chat_template: meta_str(content, "tokenizer.chat_template"),
            bos_text: bos.map(text_of).unwrap_or_default(),
            eos_text: first_eos.map(text_of).unwrap_or_default(),
            infill: Infill::find(content, &tokens),
        })
    }

    /// Token ids of `text`. Special tokens written in the text (`<|im_start|>`) become their
    /// ids. `add_bos` prepends the beginning-of-sequence token when the model asks for one.
    pub fn encode(&self, text: &str, add_bos: bool) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .encode_fast(text, false)
            .map_err(|e| EngineError::Tokenizer(e.to_string()))?;
        let mut ids = Vec::with_capacity(encoding.len() + 1);
        if add_bos
            && self.add_bos
            && let Some(bos) = self.bos
        {
            ids.push(bos);
        }
        ids.extend_from_slice(encoding.get_ids());
        Ok(ids)
    }

    /// Token ids of a chat: the messages rendered with the chat template (ending with the
    /// assistant turn's opening when `add_generation_prompt`). The template's own control
    /// tokens become their ids; control-token text inside a message's content stays text,
    /// so a message cannot forge a turn. Messages without such text tokenize exactly as
    /// their rendering does.
    pub fn encode_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>> {
        self.encode_chat_with(messages, ChatExtras::default(), add_generation_prompt)
    }

    /// Whether `text` holds a control token's text (`<|im_start|>`...): text that, rendered by
    /// the chat template outside a message, would read as the template's own.
    pub fn holds_control_text(&self, text: &str) -> bool {
        self.specials.iter().any(|s| text.contains(s.as_str()))
    }

    /// [`Self::encode_chat`] with what else the request gives the template
    /// ([`ChatExtras`]): tools and calls (rendered as JSON text) or variables that hold
    /// control-token text are refused, so they cannot forge a turn.
    pub fn encode_chat_with(
        &self,
        messages: &[ChatMessage],
        extras: ChatExtras<'_>,
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>> {
        let forges = |text: &str| self.holds_control_text(text);
        let calls = messages.iter().flat_map(|m| &m.tool_calls);
        let answered = messages.iter().filter_map(|m| m.tool_call_id.as_ref());
        let mut texts = calls
            .flat_map(|c| [&c.id, &c.name, &c.arguments])
            .chain(answered);
        if extras.tools.iter().any(|t| forges(&t.to_string())) || texts.any(|t| forges(t)) {
            return Err(EngineError::ChatTemplate(
                "tools and tool calls must not hold control-token text".into(),
            ));
        }
        if extras
            .kwargs
            .is_some_and(|k| forges(&serde_json::to_string(k).unwrap_or_default()))
        {
            return Err(EngineError::ChatTemplate(
                "the template's variables must not hold control-token text".into(),
            ));
        }
        // Messages that carry control-token text render as sentinels (text no message and
        // no template holds), so that the template's own text can never be taken for a
        // message's: each sentinel marks exactly where its message goes, as literal text.
        let marked: Vec<usize> = (0..messages.len())
            .filter(|&i| {
                self.specials
                    .iter()
                    .any(|s| messages[i].content.contains(s.as_str()))
            })
            .collect();
        if marked.is_empty() {
            let text = self.render_chat(messages, extras, add_generation_prompt)?;
            return self.encode_with(&self.inner, &text);
        }
        let sentinel = self.sentinel(messages);
        let mut rendered = messages.to_vec();
        for &i in &marked {
            rendered[i].content = format!("{sentinel}{i}{sentinel}");
        }
        let text = self.render_chat(&rendered, extras, add_generation_prompt)?;
        let mut ids = Vec::new();
        let mut at = 0;
        for &i in &marked {
            let mark = format!("{sentinel}{i}{sentinel}");
            let start = match text.matches(&mark).count() {
                1 => text.find(&mark).unwrap_or_default(),
                _ => {
                    return Err(EngineError::ChatTemplate(format!(
                        "message {i} holds control-token text that the chat template does not \
                         render verbatim, once"
                    )));
                }
            };
            ids.extend(self.encode_with(&self.inner, &text[at..start])?);
            ids.extend(self.encode_with(&self.literal, &messages[i].content)?);
            at = start + mark.len();
        }
        ids.extend(self.encode_with(&self.inner, &text[at..])?);
        Ok(ids)
    }

    fn encode_with(&self, tokenizer: &tokenizers::Tokenizer, text: &str) -> Result<Vec<u32>> {
        let encoding = tokenizer
            .encode_fast(text, false)
            .map_err(|e| EngineError::Tokenizer(e.to_string()))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// A marker no message holds and the chat template does not write: private-use
    /// characters around a random number, drawn again in the unlikely case it is found.
    fn sentinel(&self, messages: &[ChatMessage]) -> String {
        let template = self.chat_template.as_deref().unwrap_or_default();
        loop {
            let mark = format!("\u{F8FF}{:016x}\u{F8FF}", rand::random::<u64>());
            let taken =
                template.contains(&mark) || messages.iter().any(|m| m.content.contains(&mark));
            if !taken {
                return mark;
            }
        }
    }

    /// Text of `ids`; special tokens are kept as text unless `skip_special`.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special)
            .map_err(|e| EngineError::Tokenizer(e.to_string()))
    }

    /// Raw bytes of one token (byte-level BPE tokens are not always whole UTF-8 characters).
    pub fn token_bytes(&self, id: u32) -> Result<Vec<u8>> {
        // Decoding a lone token of a byte-level vocabulary replaces partial characters with
        // U+FFFD, so map the token's symbols back to bytes instead.
        let token = self
            .inner
            .id_to_token(id)
            .ok_or(EngineError::TokenOutOfRange {
                token: id,
                vocab: self.vocab_size(),
            })?;
        if self.is_special(id) {
            return Ok(token.into_bytes());
        }
        Ok(byte_level_to_bytes(&token))
    }

    /// Whether `id` is a special (control) token: `<|im_end|>` is one token, never text.
    pub fn is_special(&self, id: u32) -> bool {
        self.special_ids.contains(&id)
    }

    /// Token ids of `text` with every character as text: control-token text stays text.
    pub fn encode_literal(&self, text: &str) -> Result<Vec<u32>> {
        self.encode_with(&self.literal, text)
    }

    /// The model's fill-in-the-middle tokens, where it has them (a code model's).
    pub fn infill(&self) -> Option<&Infill> {
        self.infill.as_ref()
    }

    /// The prompt that asks the model for the text between `prefix` and `suffix` (its
    /// fill-in-the-middle tokens around them, in llama.cpp's order: prefix, suffix, middle),
    /// control-token text staying text; `None` where the model has no such tokens. With a
    /// `repository`, its name and files come first in the model's repository-level format
    /// (each file after the separator, its path on the first line, then the path of the
    /// file being completed), and the first files are left out while the prompt would hold
    /// more than `room` tokens.
    pub fn encode_infill(
        &self,
        prefix: &str,
        suffix: &str,
        repository: Option<&Repository>,
        room: usize,
    ) -> Result<Option<InfillPrompt>> {
        let Some(infill) = &self.infill else {
            return Ok(None);
        };
        let mut head: Vec<u32> = self.bos.filter(|_| self.add_bos).into_iter().collect();
        let (mut files, mut file) = (Vec::new(), Vec::new());
        if let Some(repository) = repository {
            let Some((name, separator)) = infill.repository_tokens() else {
                let why = "the model has no repository-level tokens";
                return Err(EngineError::Tokenizer(why.into()));
            };
            head.push(name);
            head.extend(self.encode_literal(&format!("{}\n", repository.name))?);
            for f in &repository.files {
                let newline = if f.text.ends_with('\n') { "" } else { "\n" };
                let text = format!("{}\n{}{newline}", f.path, f.text);
                files.push([vec![separator], self.encode_literal(&text)?].concat());
            }
            file.push(separator);
            file.extend(self.encode_literal(&format!("{}\n", repository.path))?);
        }
        file.push(infill.prefix);
        file.extend(self.encode_literal(prefix)?);
        file.push(infill.suffix);
        file.extend(self.encode_literal(suffix)?);
        file.push(infill.middle);
        let mut length = head.len() + file.len() + files.iter().map(Vec::len).sum::<usize>();
        let mut left_out = 0;
        while length > room && left_out < files.len() {
            length -= files[left_out].len();
            left_out += 1;
        }
        let ids = [head, files[left_out..].concat(), file].concat();
        Ok(Some(InfillPrompt {
            ids,
            files_left_out: left_out,
        }))
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Tokens that end generation (end of text, end of turn).
    pub fn eos_tokens(&self) -> &BTreeSet<u32> {
        &self.eos
    }

    pub fn is_eos(&self, id: u32) -> bool {
        self.eos.contains(&id)
    }

    /// The text of the model's end-of-sequence token (`tokenizer.ggml.eos_token_id`), and of
    /// its beginning-of-sequence token where it has one.
    pub fn special_texts(&self) -> (&str, Option<&str>) {
        let bos = self.bos.map(|_| self.bos_text.as_str());
        (&self.eos_text, bos)
    }

    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// Renders `messages` with the model's chat template (`tokenizer.chat_template`), ending
    /// with the assistant turn's opening when `add_generation_prompt`.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String> {
        self.render_chat(messages, ChatExtras::default(), add_generation_prompt)
    }

    fn render_chat(
        &self,
        messages: &[ChatMessage],
        extras: ChatExtras<'_>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        let source = self.chat_template.as_deref().ok_or_else(|| {
            EngineError::ChatTemplate("the model has no tokenizer.chat_template".into())
        })?;
        render_chat_template(
            source,
            &TemplateContext {
                messages,
                extras,
                add_generation_prompt,
                bos_token: &self.bos_text,
                eos_token: &self.eos_text,
            },
        )
    }
}

/// GGUF token types (llama.cpp's `llama_token_type`).
const CONTROL: i64 = 3;
const USER_DEFINED: i64 = 4;

/// Pre-tokenizer split patterns, as in the models' tokenizer.json files. Qwen2 splits digits
/// one by one; Llama 3 groups up to three.
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// A byte-level BPE tokenizer configured as the model family's tokenizer.json would be.
/// Control tokens (type 3) and user-defined tokens (type 4) are matched whole in text; unused
/// slots (type 5, Qwen's `[PAD…]`) stay ordinary text, as in the reference tokenizers.
fn build_bpe(
    tokens: &[String],
    merges: Vec<(String, String)>,
    token_types: &[i64],
    pre: &str,
    content: &Content,
) -> Result<tokenizers::Tokenizer> {
    let err = |e: tokenizers::Error| EngineError::Tokenizer(e.to_string());
    let vocab: tokenizers::models::bpe::Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    let flag = |key: &str| {
        content
            .metadata
            .get(key)
            .and_then(|v| v.to_bool().ok())
            .unwrap_or(false)
    };
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(flag("tokenizer.ggml.ignore_merges"))
        .build()
        .map_err(err)?;
    let mut tokenizer = tokenizers::Tokenizer::new(bpe);
    let split = |pattern: &str| -> Result<PreTokenizerWrapper> {
        Ok(Split::new(
            SplitPattern::Regex(pattern.to_string()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(err)?
        .into())
    };
    let pre_tokenizer: PreTokenizerWrapper = match pre {
        "qwen2" => {
            tokenizer.with_normalizer(Some(NFC)).map_err(err)?;
            Sequence::new(vec![
                split(QWEN2_SPLIT)?,
                ByteLevel::new(false, false, false).into(),
            ])
            .into()
        }
        "llama3" | "llama-bpe" | "smaug-bpe" => Sequence::new(vec![
            split(LLAMA3_SPLIT)?,
            ByteLevel::new(false, true, false).into(),
        ])
        .into(),
        "smollm" => Sequence::new(vec![
            Digits::new(true).into(),
            ByteLevel::new(false, true, true).into(),
        ])
        .into(),
        "gpt2" | "" => ByteLevel::new(false, true, true).into(),
        other => {
            return Err(EngineError::Tokenizer(format!(
                "unsupported pre-tokenizer `{other}` (tokenizer.ggml.pre)"
            )));
        }
    };
    tokenizer.with_pre_tokenizer(Some(pre_tokenizer));
    tokenizer.with_decoder(Some(ByteLevelDecoder::default()));
    let added = |kind: i64, special: bool| -> Vec<AddedToken> {
        tokens
            .iter()
            .zip(token_types)
            .filter(|(_, t)| **t == kind)
            .map(|(text, _)| AddedToken::from(text.clone(), special).normalized(false))
            .collect()
    };
    tokenizer
        .add_special_tokens(added(CONTROL, true))
        .map_err(err)?;
    tokenizer
        .add_tokens(added(USER_DEFINED, false))
        .map_err(err)?;
    Ok(tokenizer)
}

fn int_value(v: &Value) -> Option<i64> {
    match v {
        Value::I32(x) => Some(*x as i64),
        Value::U32(x) => Some(*x as i64),
        Value::I64(x) => Some(*x),
        Value::U64(x) => Some(*x as i64),
        Value::I8(x) => Some(*x as i64),
        Value::U8(x) => Some(*x as i64),
        Value::I16(x) => Some(*x as i64),
        Value::U16(x) => Some(*x as i64),
        _ => None,
    }
}

fn string_array(content: &Content, key: &str) -> Result<Vec<String>> {
    match content.metadata.get(key) {
        Some(Value::Array(values)) => values
            .iter()
            .map(|v| {
                v.to_string()
                    .cloned()
                    .map_err(|_| EngineError::Tokenizer(format!("{key} holds a non-string")))
            })
            .collect(),
        _ => Err(EngineError::Tokenizer(format!("missing {key}"))),
    }
}

fn meta_str(content: &Content, key: &str) -> Option<String> {
    content
        .metadata
        .get(key)
        .and_then(|v| v.to_string().ok())
        .cloned()
}

/// GPT-2's byte-to-unicode table, which byte-level BPE vocabularies are written in: printable
/// bytes stand for themselves, the others take code points 256 and up in byte order.
pub(crate) fn byte_level_chars() -> &'static [char; 256] {
    static TABLE: OnceLock<[char; 256]> = OnceLock::new();
    TABLE.get_or_init(|| {
        let printable = |b: u32| {
            (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b)
        };
        let mut table = ['\0'; 256];
        let mut next = 256u32;
        for (b, ch) in (0u32..).zip(table.iter_mut()) {
            let cp = if printable(b) {
                b
            } else {
                next += 1;
                next - 1
            };
            *ch = char::from_u32(cp).unwrap_or(char::REPLACEMENT_CHARACTER);
        }
        table
    })
}

/// The bytes a byte-level token stands for (the inverse of [`byte_level_chars`]); characters
/// outside the table are kept as their UTF-8.
fn byte_level_to_bytes(token: &str) -> Vec<u8> {
    static INVERSE: OnceLock<[Option<u8>; 512]> = OnceLock::new();
    let inverse = INVERSE.get_or_init(|| {
        let mut inverse = [None; 512];
        for (b, &ch) in (0u8..=255).zip(byte_level_chars()) {
            inverse[ch as usize] = Some(b);
        }
        inverse
    });
    let mut out = Vec::with_capacity(token.len());
    for ch in token.chars() {
        match inverse.get(ch as usize).copied().flatten() {
            Some(b) => out.push(b),
            None => {
                let mut buf = [0u8; 4];
                out.extend_from_slice(ch.encode_utf8(&mut buf).as_bytes());
            }
        }
    }
    out
}

/// The tokenizer of the GGUF model at `path` as a small GGUF file of its own: every
/// `tokenizer.*` metadata key and the architecture, no tensors. [`Tokenizer::from_gguf_bytes`]
/// reads it back, so a process that only tokenizes (the coordinator) needs no model file.
pub fn tokenizer_gguf(path: &Path) -> Result<Vec<u8>> {
    let (content, _) = crate::model::read_gguf(path)?;
    tokenizer_gguf_of(&content)
}

/// [`tokenizer_gguf`] of a header already read.
pub(crate) fn tokenizer_gguf_of(content: &Content) -> Result<Vec<u8>> {
    let mut keys: Vec<(&str, &Value)> = content
        .metadata
        .iter()
        .filter(|(k, _)| k.starts_with("tokenizer.") || k.as_str() == "general.architecture")
        .map(|(k, v)| (k.as_str(), v))
        .collect();
    // HashMap order varies between runs; sorting makes the bytes (and their hash) stable.
    keys.sort_by(|a, b| a.0.cmp(b.0));
    let mut out = std::io::Cursor::new(Vec::new());
    candle_core::quantized::gguf_file::write(&mut out, &keys, &[])
        .map_err(|e| EngineError::Tokenizer(format!("writing tokenizer GGUF: {e}")))?;
    Ok(out.into_inner())
}

#[cfg(test)]
mod tests;
