//! Tool calling: the request's tools checked and shaped for the chat template, what
//! `tool_choice` makes of them (a structured output where a call is required), and the calls
//! a completion's text holds, in the format the model's template teaches it
//! ([`CallFormat`]): Qwen's and Hermes's `<tool_call>\n{"name": …, "arguments": {…}}\n
//! </tool_call>` blocks (or an answer that is the same JSON untagged, bare or fenced), or
//! Llama 3's answer that is `{"name": …, "parameters": {…}}`.

use crate::request::InvalidField;
use duet_engine::ToolCall;
use duet_engine::structured::Format;
use duet_proto::v1 as pb;
use serde_json::{Value, json};

/// At most this many tools a request.
pub const MAX_TOOLS: usize = 128;

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";
/// What Llama 3.1's models may write before a call.
const PYTHON_TAG: &str = "<|python_tag|>";
/// The fences a model may put an untagged call in, the bare one last.
const FENCES: [&str; 3] = ["```json", "```xml", "```"];

/// How a model writes its calls, as its chat template teaches it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CallFormat {
    /// Qwen2.5's, Qwen3's and Hermes's: `<tool_call>` blocks of JSON (`name`, `arguments`)
    /// after any text.
    #[default]
    Blocks,
    /// Llama 3.x's: the whole answer is a call's JSON (`name`, `parameters`), after
    /// `<|python_tag|>` where the model writes one; several separated by `;`.
    Json,
}

impl CallFormat {
    /// The format `template` teaches: blocks where it writes `<tool_call>`, Llama 3's JSON
    /// where it writes Llama 3's turn headers and a call's `"parameters"`; else blocks.
    pub fn of_template(template: Option<&str>) -> Self {
        match template {
            Some(t) if t.contains(OPEN) => Self::Blocks,
            Some(t) if t.contains("<|start_header_id|>") && t.contains("\"parameters\"") => {
                Self::Json
            }
            _ => Self::Blocks,
        }
    }
}

/// What the model may call, and how it must.
#[derive(Debug, Clone, PartialEq)]
pub struct Tools {
    tools: Vec<Tool>,
    choice: Choice,
    /// More than one call (OpenAI's `parallel_tool_calls`).
    parallel: bool,
}

#[derive(Debug, Clone, PartialEq)]
struct Tool {
    name: String,
    description: String,
    parameters: Value,
}

/// `tool_choice`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Choice {
    /// The model chooses whether to call.
    Auto,
    /// No tools: none rendered, no calls looked for.
    None,
    /// One or more calls, the text nothing else.
    Required,
    /// One call of this tool.
    Named(String),
}

fn invalid(message: impl Into<String>) -> InvalidField {
    InvalidField {
        field: "tools",
        message: message.into(),
    }
}

impl Tools {
    /// The request's tools, checked: names of 1-64 letters, digits, `_` and `-`, each once;
    /// parameters a JSON Schema object (empty: no arguments); a choice that names a tool
    /// names one of them. `parallel`: more than one call. `None` where the request has none.
    pub fn check(
        tools: &[pb::Tool],
        choice: &str,
        parallel: bool,
    ) -> Result<Option<Self>, InvalidField> {
        if tools.is_empty() {
            return match choice {
                "" | "auto" | "none" => Ok(None),
                _ => Err(invalid(format!("tool_choice {choice:?} without tools"))),
            };
        }
        if tools.len() > MAX_TOOLS {
            return Err(invalid(format!("{}; at most {MAX_TOOLS}", tools.len())));
        }
        let mut checked: Vec<Tool> = Vec::with_capacity(tools.len());
        for tool in tools {
            let name = &tool.name;
            if !is_name(name) {
                let why = "a name of 1-64 letters, digits, _ and -";
                return Err(invalid(format!("tool {name:?}: {why}")));
            }
            if checked.iter().any(|t| &t.name == name) {
                return Err(invalid(format!("tool {name:?} is given twice")));
            }
            let mut parameters = match tool.parameters.as_str() {
                "" => json!({"type": "object", "properties": {}}),
                text => match serde_json::from_str(text) {
                    Ok(schema @ Value::Object(_)) => schema,
                    _ => return Err(invalid(format!("tool {name:?}: parameters: a JSON object"))),
                },
            };
            // Arguments are an object (OpenAI's functions'), also where the schema omits it.
            if parameters.get("type").is_none() {
                parameters["type"] = json!("object");
            }
            checked.push(Tool {
                name: name.clone(),
                description: tool.description.clone(),
                parameters,
            });
        }
        let choice = match choice {
            "" | "auto" => Choice::Auto,
            "none" => Choice::None,
            "required" => Choice::Required,
            name if checked.iter().any(|t| t.name == name) => Choice::Named(name.into()),
            other => return Err(invalid(format!("tool_choice {other:?} names no tool"))),
        };
        Ok(Some(Self {
            tools: checked,
            choice,
            parallel,
        }))
    }

    /// Calls are looked for in the completion: any choice but `none`.
    pub fn finds_calls(&self) -> bool {
        self.choice != Choice::None
    }

    /// The tools' names.
    pub fn names(&self) -> Vec<String> {
        self.tools.iter().map(|t| t.name.clone()).collect()
    }

    /// More than one call is answered (`parallel_tool_calls`).
    pub fn parallel(&self) -> bool {
        self.parallel
    }

    /// The tools as the chat template reads them (Hugging Face's shape); none for `none`.
    pub fn for_template(&self) -> Vec<Value> {
        if self.choice == Choice::None {
            return Vec::new();
        }
        // A tool given without a description has none in the template either.
        let shape = |t: &Tool| {
            let mut function = json!({"name": t.name});
            if !t.description.is_empty() {
                function["description"] = json!(t.description);
            }
            function["parameters"] = t.parameters.clone();
            json!({"type": "function", "function": function})
        };
        self.tools.iter().map(shape).collect()
    }

    /// Where a call is required, the structured output that makes the completion one or
    /// more calls in `calls`' format (one where not `parallel`, or where the format is
    /// Llama's, whose templates take one; one of the named tool): each a `<tool_call>` block,
    /// or the JSON alone, naming a tool and holding arguments its parameters accept.
    pub fn format(&self, calls: CallFormat) -> Option<Format> {
        let (named, blocks) = match &self.choice {
            Choice::Auto | Choice::None => return None,
            Choice::Required if self.parallel && calls == CallFormat::Blocks => {
                (None, "call (\"\\n\" call)*")
            }
            Choice::Required => (None, "call"),
            Choice::Named(name) => (Some(name), "call"),
        };
        let arguments = match calls {
            CallFormat::Blocks => "arguments",
            CallFormat::Json => "parameters",
        };
        let objects: Vec<Value> = (self.tools.iter())
            .filter(|t| named.is_none_or(|name| &t.name == name))
            .map(|t| {
                json!({"type": "object", "properties": {
                    "name": {"const": t.name}, arguments: t.parameters},
                    "required": ["name", arguments], "additionalProperties": false})
            })
            .collect();
        // The layout the templates show their models (Python's `json.dumps`), and no room
        // for whitespace a model could loop in.
        let layout = json!({"whitespace_flexible": false, "item_separator": ", ",
                            "key_separator": ": "});
        let schema = json!({"x-guidance": layout, "anyOf": objects});
        let (open, close) = match calls {
            CallFormat::Blocks => (format!("{OPEN}\n"), format!("\n{CLOSE}")),
            CallFormat::Json => (String::new(), String::new()),
        };
        let quoted = |text: &str| match text {
            "" => String::new(),
            text => serde_json::to_string(text).unwrap_or_default(),
        };
        let (open, close) = (quoted(&open), quoted(&close));
        Some(Format::Lark(format!(
            "start: {blocks}\ncall: {open} body {close}\nbody: %json {schema}\n"
        )))
    }
}

/// Whether a request with `tools` and `tool_choice` has its completion's calls looked for:
/// it has tools, and does not choose `none`.
pub fn finds_calls(tools: &[pb::Tool], choice: &str) -> bool {
    !tools.is_empty() && choice != "none"
}

/// A tool's name or a call's id: 1-64 letters, digits, `_` and `-` (templates write names
/// as they are, so nothing else may reach them).
pub fn is_name(name: &str) -> bool {
    let allowed = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '-';
    (1..=64).contains(&name.len()) && name.chars().all(allowed)
}

/// The calls in `text` of a request with tools `names`, written in `format` (the first
/// alone where not `parallel`), numbered `call_<request>_<i>`: each `<tool_call>` block
/// whose JSON has a `name` and (an object of) `arguments` (a block that does not parse is
/// not a call), else the whole text as [`untagged`] calls; or, in Llama's format, the whole
/// text as calls, or none.
pub fn parse(
    text: &str,
    request: &str,
    (parallel, names): (bool, &[String]),
    format: CallFormat,
) -> Vec<ToolCall> {
    let mut calls = match format {
        CallFormat::Blocks => match blocks(text, parallel) {
            none if none.is_empty() => untagged(text, names),
            calls => calls,
        },
        CallFormat::Json => json_calls(text),
    };
    if !parallel {
        calls.truncate(1);
    }
    (calls.into_iter().enumerate())
        .map(|(i, (name, arguments))| ToolCall {
            id: format!("call_{request}_{i}"),
            name,
            arguments,
        })
        .collect()
}

/// The name and arguments (JSON text; `{}` where there are none) of a call's JSON, whose
/// arguments are `arguments` or, as Llama's, `parameters`.
fn call_of(call: &Value) -> Option<(String, String)> {
    let name = call["name"].as_str()?;
    let given = match &call["arguments"] {
        Value::Null => &call["parameters"],
        arguments => arguments,
    };
    let arguments = match given {
        Value::Null => "{}".to_string(),
        Value::String(text) => text.clone(),
        arguments => arguments.to_string(),
    };
    Some((name.to_string(), arguments))
}

fn blocks(text: &str, parallel: bool) -> Vec<(String, String)> {
    let mut calls = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find(OPEN)
        && (parallel || calls.is_empty())
    {
        let after = &rest[start + OPEN.len()..];
        let Some(end) = after.find(CLOSE) else {
            break;
        };
        let call = serde_json::from_str::<Value>(after[..end].trim());
        calls.extend(call.ok().as_ref().and_then(call_of));
        rest = &after[end + CLOSE.len()..];
    }
    calls
}

/// Calls written without their `<tool_call>` tags, as small models often write them when
/// left to choose (Qwen2.5-Coder 1.5B does; llama.cpp's Hermes parser reads them too): the
/// whole text JSON objects, or lists of them, each calling one of the request's tools
/// (`names`) with its `arguments`, bare or in a fenced block (```` ```json ````). Any other
/// text, or a name that is not a tool's, is no call: a JSON answer stays an answer.
fn untagged(text: &str, names: &[String]) -> Vec<(String, String)> {
    let text = text.trim();
    let inner = match FENCES.iter().find_map(|f| text.strip_prefix(f)) {
        Some(fenced) => match fenced.strip_suffix("```") {
            Some(inner) => inner,
            None => return Vec::new(),
        },
        None => text,
    };
    let mut calls = Vec::new();
    for value in serde_json::Deserializer::from_str(inner).into_iter::<Value>() {
        let objects = match value {
            Ok(Value::Array(objects)) => objects,
            Ok(object) => vec![object],
            Err(_) => return Vec::new(),
        };
        for object in &objects {
            let tool = object["name"]
                .as_str()
                .is_some_and(|n| names.iter().any(|t| t == n));
            let given = object.get("arguments").or(object.get("parameters"));
            match call_of(object) {
                Some(call) if tool && given.is_some() => calls.push(call),
                _ => return Vec::new(),
            }
        }
    }
    calls
}

/// Whether `text`, the start of a completion, may still grow into [`untagged`] calls: blank,
/// JSON's opening, or a fence (or the start of one) before it.
fn may_be_untagged(text: &str) -> bool {
    let opens_json = |t: &str| t.is_empty() || t.starts_with('{') || t.starts_with('[');
    let start = text.trim_start();
    opens_json(start)
        || FENCES.iter().any(|f| {
            f.starts_with(start)
                || start
                    .strip_prefix(f)
                    .is_some_and(|r| opens_json(r.trim_start()))
        })
}

/// Llama's calls: the text (after `<|python_tag|>`) is JSON objects that each name a tool,
/// `;` between them; any other text is no call.
fn json_calls(text: &str) -> Vec<(String, String)> {
    let text = text.trim_start();
    let mut rest = text.strip_prefix(PYTHON_TAG).unwrap_or(text).trim_start();
    let mut calls = Vec::new();
    while !rest.is_empty() {
        if !rest.starts_with('{') {
            return Vec::new();
        }
        let mut values = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
        let Some((name, arguments)) = values
            .next()
            .and_then(Result::ok)
            .as_ref()
            .and_then(call_of)
        else {
            return Vec::new();
        };
        calls.push((name, arguments));
        rest = rest[values.byte_offset()..].trim_start();
        match rest.strip_prefix(';') {
            Some(next) => rest = next.trim_start(),
            None if rest.is_empty() => {}
            None => return Vec::new(),
        }
    }
    calls
}

/// Where in `text` a call written in `format` may start: at its first `<tool_call>`, or at
/// a suffix that may grow into one, or, while the text is the completion's `start` and may
/// still be [`untagged`] calls, at its start; in Llama's format, at the start, while the
/// text may still be a call's JSON; else its length.
pub fn may_start_call(text: &str, format: CallFormat, start: bool) -> usize {
    if format == CallFormat::Blocks && start && may_be_untagged(text) {
        return 0;
    }
    if format == CallFormat::Json {
        let start = text.trim_start();
        let may = start.starts_with('{')
            || start.starts_with(PYTHON_TAG)
            || PYTHON_TAG.starts_with(start);
        return if may { 0 } else { text.len() };
    }
    if let Some(at) = text.find(OPEN) {
        return at;
    }
    let partial = (1..OPEN.len()).rev().find(|&n| text.ends_with(&OPEN[..n]));
    partial.map_or(text.len(), |n| text.len() - n)
}

/// The text of a completion that made calls before its first call (what an OpenAI answer's
/// `content` holds beside the calls), trimmed: none where the calls are the whole text, as
/// Llama's are.
pub fn content_before_calls(text: &str) -> &str {
    text.find(OPEN).map_or("", |at| &text[..at]).trim()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tool(name: &str, parameters: &str) -> pb::Tool {
        pb::Tool {
            name: name.into(),
            description: format!("{name} it"),
            parameters: parameters.into(),
        }
    }

    #[test]
    fn tools_are_checked_and_name_the_problem() {
        let weather = tool("get_weather", r#"{"type": "object"}"#);
        let refused = |tools: &[pb::Tool], choice: &str| {
            Tools::check(tools, choice, true).unwrap_err().to_string()
        };
        assert_eq!(Tools::check(&[], "", true), Ok(None));
        assert_eq!(
            refused(&[], "required"),
            "tools: tool_choice \"required\" without tools"
        );
        let bad_name = refused(&[tool("a b", "")], "");
        assert_eq!(
            bad_name,
            "tools: tool \"a b\": a name of 1-64 letters, digits, _ and -"
        );
        let twice = refused(&[weather.clone(), weather.clone()], "");
        assert_eq!(twice, "tools: tool \"get_weather\" is given twice");
        let not_object = refused(&[tool("f", "[1]")], "");
        assert_eq!(not_object, "tools: tool \"f\": parameters: a JSON object");
        let unknown = refused(std::slice::from_ref(&weather), "get_time");
        assert_eq!(unknown, "tools: tool_choice \"get_time\" names no tool");
        let many = vec![weather.clone(); MAX_TOOLS + 1];
        assert_eq!(refused(&many, ""), "tools: 129; at most 128");
        let named = Tools::check(&[weather, tool("f", "")], "f", true)
            .unwrap()
            .unwrap();
        assert_eq!(named.choice, Choice::Named("f".into()));
        let rendered = named.for_template();
        assert_eq!(rendered[1]["function"]["parameters"]["type"], "object");
        assert_eq!(rendered[0]["function"]["description"], "get_weather it");
    }

    /// A required call's format compiles and is a Lark grammar over the tools' schemas;
    /// `auto` and `none` leave the text free.
    #[test]
    fn a_required_call_is_a_structured_output() {
        let tools = [tool(
            "get_weather",
            r#"{"type": "object", "properties":
            {"city": {"type": "string"}}, "required": ["city"]}"#,
        )];
        for (choice, parallel, blocks) in [
            ("required", true, "start: call (\"\\n\" call)*"),
            ("required", false, "start: call\n"),
            ("get_weather", true, "start: call\n"),
        ] {
            let format = Tools::check(&tools, choice, parallel)
                .unwrap()
                .unwrap()
                .format(CallFormat::Blocks)
                .unwrap();
            let Format::Lark(grammar) = &format else {
                panic!("{format:?}");
            };
            assert!(grammar.starts_with(blocks), "{grammar}");
            assert!(grammar.contains(r#"{"const":"get_weather"}"#), "{grammar}");
            format.check().unwrap();
        }
        for choice in ["auto", "none"] {
            assert_eq!(
                Tools::check(&tools, choice, true)
                    .unwrap()
                    .unwrap()
                    .format(CallFormat::Blocks),
                None
            );
        }
        let none = Tools::check(&tools, "none", true).unwrap().unwrap();
        assert!(none.for_template().is_empty() && !finds_calls(&tools, "none"));
        assert!(finds_calls(&tools, "auto") && !finds_calls(&[], "auto"));
    }

    #[test]
    fn calls_are_read_from_their_blocks() {
        let text = "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": \
                    {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\nnot json\n</tool_call>\
                    <tool_call>{\"name\": \"now\"}</tool_call><tool_call>{\"name\": \"cut";
        let calls = parse(text, "r1", (true, &[]), CallFormat::Blocks);
        let want = [
            ToolCall {
                id: "call_r1_0".into(),
                name: "get_weather".into(),
                arguments: r#"{"city":"Paris"}"#.into(),
            },
            ToolCall {
                id: "call_r1_1".into(),
                name: "now".into(),
                arguments: "{}".into(),
            },
        ];
        assert_eq!(calls, want);
        assert_eq!(
            parse(text, "r1", (false, &[]), CallFormat::Blocks),
            want[..1]
        );
        assert_eq!(content_before_calls(text), "Let me look.");
        assert_eq!(parse("no calls", "r1", (true, &[]), CallFormat::Blocks), []);
        assert_eq!(may_start_call("a <tool", CallFormat::Blocks, false), 2);
        assert_eq!(may_start_call("a <b", CallFormat::Blocks, false), 4);
    }

    /// A call written without its tags, as the whole text (bare or fenced, one or several
    /// objects, or a list), is a call of the request's tools; prose around it, a name that
    /// is no tool's, a call without arguments, an unclosed fence are answers. Streamed, the
    /// text's start is held while it may still be such a call.
    #[test]
    fn untagged_calls_are_the_whole_text() {
        let names = ["get_weather".to_string(), "now".to_string()];
        let blocks = CallFormat::Blocks;
        let parsed = |text: &str| parse(text, "r1", (true, &names), blocks);
        let paris = ToolCall {
            id: "call_r1_0".into(),
            name: "get_weather".into(),
            arguments: r#"{"city":"Paris"}"#.into(),
        };
        let call = r#"{"name": "get_weather", "arguments": {"city": "Paris"}}"#;
        for text in [
            format!("```json\n{call}\n```"),
            format!("\n```\n{call}\n```\n"),
            format!(" {call} "),
            format!("```xml\n[{call}]\n```"),
        ] {
            assert_eq!(parsed(&text), std::slice::from_ref(&paris), "{text}");
            assert_eq!(content_before_calls(&text), "");
        }
        let two = format!("{call}\n{{\"name\": \"now\", \"arguments\": {{}}}}");
        assert_eq!(parsed(&two).len(), 2);
        assert_eq!(parse(&two, "r1", (false, &names), blocks), [paris]);
        for answer in [
            format!("Here it is: ```json\n{call}\n```"),
            format!("```json\n{call}\n``` and more"),
            format!("```json\n{call}"),
            r#"{"name": "Alice", "arguments": {}}"#.to_string(),
            r#"{"name": "now"}"#.to_string(),
            "```python\nprint(1)\n```".to_string(),
        ] {
            assert_eq!(parsed(&answer), [], "{answer}");
        }
        assert_eq!(parse(call, "r1", (true, &[]), blocks), []);
        // Streamed: the start held while it may be an untagged call, released once not.
        for (text, from) in [
            ("", 0),
            (" ", 0),
            ("``", 0),
            ("```js", 0),
            ("```json\n{\"na", 0),
            ("```\n[", 0),
            ("{", 0),
            ("```py", 5),
            ("Sure", 4),
            ("Sure <tool", 5),
        ] {
            assert_eq!(may_start_call(text, blocks, true), from, "{text:?}");
        }
        assert_eq!(may_start_call("{", blocks, false), 1);
    }

    /// Llama 3's calls: the answer is the calls' JSON (after `<|python_tag|>` where the
    /// model writes one), `parameters` its arguments; text before, after or between that
    /// is not JSON makes it an answer, not calls. A required call is that JSON alone.
    #[test]
    fn llamas_calls_are_the_whole_answer() {
        let json = CallFormat::Json;
        let call = |i: usize, name: &str, arguments: &str| ToolCall {
            id: format!("call_r1_{i}"),
            name: name.into(),
            arguments: arguments.into(),
        };
        let one = r#" {"name": "get_weather", "parameters": {"city": "Paris"}}"#;
        let paris = call(0, "get_weather", r#"{"city":"Paris"}"#);
        assert_eq!(
            parse(one, "r1", (true, &[]), json),
            std::slice::from_ref(&paris)
        );
        let tagged = format!("<|python_tag|>{one}; {{\"name\": \"now\"}}");
        assert_eq!(
            parse(&tagged, "r1", (true, &[]), json),
            [paris.clone(), call(1, "now", "{}")]
        );
        assert_eq!(parse(&tagged, "r1", (false, &[]), json), [paris]);
        for answer in [
            "It is sunny.",
            &format!("Sure: {one}"),
            &format!("{one} and more"),
            "{\"x\": 1}",
        ] {
            assert_eq!(parse(answer, "r1", (true, &[]), json), [], "{answer}");
        }
        assert_eq!(content_before_calls(one), "");
        // Streamed: held from the start while it may be a call.
        for (text, from) in [(" {\"na", 0), ("<|pyth", 0), ("", 0), (" It", 3), ("<b", 2)] {
            assert_eq!(may_start_call(text, json, true), from, "{text:?}");
        }
        let tools = [tool("get_weather", r#"{"type": "object"}"#)];
        let required = Tools::check(&tools, "required", true).unwrap().unwrap();
        let format = required.format(json).unwrap();
        let Format::Lark(grammar) = &format else {
            panic!("{format:?}");
        };
        assert!(
            grammar.starts_with("start: call\ncall:  body \n"),
            "{grammar}"
        );
        assert!(
            grammar.contains(r#""required":["name","parameters"]"#),
            "{grammar}"
        );
        format.check().unwrap();
        let llama = "<|start_header_id|>assistant<|end_header_id|>{{ '\"parameters\": ' }}";
        assert_eq!(CallFormat::of_template(Some(llama)), json);
        let qwen = "{{ '<tool_call>\\n' }}<|start_header_id|>\"parameters\"";
        assert_eq!(CallFormat::of_template(Some(qwen)), CallFormat::Blocks);
        assert_eq!(CallFormat::of_template(None), CallFormat::Blocks);
    }
}
