//! A configuration described from its own struct: every key with its default and the doc
//! comment of its field (read through the struct's JSON schema). `--print-config` prints it
//! as commented TOML; docs/configuration.md holds it as tables, and a test fails when the
//! two drift apart.

use schemars::JsonSchema;
use serde::Serialize;
use serde_json::{Map, Value};

/// One key of a configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Key {
    /// Dotted path, such as `draft.timeout_ms`.
    pub path: String,
    /// The value in the described configuration; `Null` where an optional key is unset.
    pub value: Value,
    /// The field's doc comment, one paragraph.
    pub doc: String,
}

/// A table of keys (the top level, or a section such as `draft.tls`), with its own doc.
#[derive(Debug, Clone, PartialEq)]
pub struct Section {
    pub path: String,
    pub doc: String,
    pub keys: Vec<Key>,
}

/// The sections of `config`, the top level first, each key with its value and doc comment.
pub fn describe<T: JsonSchema + Serialize>(config: &T) -> Vec<Section> {
    let schema = schemars::schema_for!(T);
    let root = schema.as_value();
    let defs = root.get("$defs").cloned().unwrap_or_default();
    let value = serde_json::to_value(config).unwrap_or_default();
    let mut sections = Vec::new();
    walk(root, &defs, &value, "", "", &mut sections);
    sections
}

fn walk(
    schema: &Value,
    defs: &Value,
    value: &Value,
    path: &str,
    doc: &str,
    out: &mut Vec<Section>,
) {
    let at = out.len();
    out.push(Section {
        path: path.to_string(),
        doc: doc.to_string(),
        keys: Vec::new(),
    });
    let Some(properties) = resolve(schema, defs)
        .get("properties")
        .and_then(Value::as_object)
    else {
        return;
    };
    for (name, property) in properties {
        let full = match path {
            "" => name.clone(),
            _ => format!("{path}.{name}"),
        };
        let doc = description(property, defs);
        let field = value.get(name).cloned().unwrap_or(Value::Null);
        match resolve(property, defs).get("properties") {
            Some(_) => walk(property, defs, &field, &full, &doc, out),
            None => out[at].keys.push(Key {
                path: full,
                value: field,
                doc,
            }),
        }
    }
}

/// The schema a `$ref` points at (`#/$defs/Name`), or `schema` itself.
fn resolve<'a>(schema: &'a Value, defs: &'a Value) -> &'a Value {
    match schema.get("$ref").and_then(Value::as_str) {
        Some(r) => r
            .strip_prefix("#/$defs/")
            .and_then(|name| defs.get(name))
            .unwrap_or(schema),
        None => schema,
    }
}

/// A property's doc comment (the field's, else its type's) as one paragraph, with rustdoc's
/// link brackets dropped.
fn description(property: &Value, defs: &Value) -> String {
    let text = property
        .get("description")
        .or_else(|| resolve(property, defs).get("description"))
        .and_then(Value::as_str)
        .unwrap_or("");
    let joined = text.split_whitespace().collect::<Vec<_>>().join(" ");
    joined.replace("[`", "`").replace("`]", "`")
}

/// The sections as commented TOML that loads back as the same configuration: each key's
/// doc comment above it; an unset optional key commented out.
pub fn commented_toml(sections: &[Section]) -> String {
    let mut out = String::new();
    for s in sections.iter().filter(|s| !s.keys.is_empty()) {
        if !s.path.is_empty() {
            out.push('\n');
            comment(&mut out, &s.doc);
            out.push_str(&format!("[{}]\n", s.path));
        }
        for key in &s.keys {
            comment(&mut out, &key.doc);
            let name = key.path.rsplit('.').next().unwrap_or(&key.path);
            match toml_value(&key.value) {
                Some(v) => out.push_str(&format!("{name} = {v}\n")),
                None => out.push_str(&format!("# {name} = (unset)\n")),
            }
        }
    }
    out
}

/// `text` as `#` lines of at most 96 characters.
fn comment(out: &mut String, text: &str) {
    let mut line = String::from("#");
    for word in text.split_whitespace() {
        if line.len() + 1 + word.len() > 96 && line.len() > 1 {
            out.push_str(&line);
            out.push('\n');
            line = String::from("#");
        }
        line.push(' ');
        line.push_str(word);
    }
    if line.len() > 1 {
        out.push_str(&line);
        out.push('\n');
    }
}

fn toml_value(value: &Value) -> Option<String> {
    let v: toml::Value = match value {
        Value::Null => return None,
        Value::Bool(b) => toml::Value::Boolean(*b),
        Value::Number(n) => match n.as_i64() {
            Some(i) => toml::Value::Integer(i),
            None => toml::Value::Float(n.as_f64()?),
        },
        Value::String(s) => toml::Value::String(s.clone()),
        Value::Array(items) => toml::Value::Array(
            items
                .iter()
                .map(|i| toml_value(i).and_then(|t| t.parse::<toml::Value>().ok()))
                .collect::<Option<_>>()?,
        ),
        Value::Object(_) => return None,
    };
    Some(v.to_string())
}

/// A Markdown table of the keys of one or more configurations of the same shape, such as
/// the draft-worker's and the target-worker's: one row a key, its defaults named by label
/// where they differ (`draft 65536, target 0`).
pub fn markdown_table(configs: &[(&str, Vec<Section>)]) -> String {
    let mut out = String::from("| key | default | meaning |\n|---|---|---|\n");
    let Some((_, first)) = configs.first() else {
        return out;
    };
    for key in first.iter().flat_map(|s| &s.keys) {
        let values: Vec<(&str, &Value)> = configs
            .iter()
            .map(|(label, sections)| (*label, find(sections, &key.path).unwrap_or(&Value::Null)))
            .collect();
        let default = match values.iter().all(|(_, v)| *v == values[0].1) {
            true => shown(values[0].1),
            false => values
                .iter()
                .map(|(label, v)| format!("{label} {}", shown(v)))
                .collect::<Vec<_>>()
                .join(", "),
        };
        let doc = key.doc.replace('|', "\\|");
        out.push_str(&format!("| `{}` | {default} | {doc} |\n", key.path));
    }
    out
}

fn find<'a>(sections: &'a [Section], path: &str) -> Option<&'a Value> {
    sections
        .iter()
        .flat_map(|s| &s.keys)
        .find(|k| k.path == path)
        .map(|k| &k.value)
}

/// A default as the tables show it.
fn shown(value: &Value) -> String {
    match value {
        Value::Null => "unset".into(),
        Value::String(s) if s.is_empty() => "empty".into(),
        Value::Array(a) if a.is_empty() => "empty".into(),
        Value::Object(m) if m == &Map::new() => "empty".into(),
        other => format!(
            "`{}`",
            toml_value(other).unwrap_or_default().trim_matches('"')
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    /// Outer doc.
    #[derive(Debug, Serialize, Deserialize, JsonSchema, PartialEq)]
    #[serde(deny_unknown_fields)]
    struct Outer {
        /// Where it listens;
        /// an address.
        listen: String,
        /// Cores, `[0]` for one.
        cores: Vec<usize>,
        /// Unset: by device ([`Outer`]).
        chunk: Option<usize>,
        /// The inner table.
        inner: Inner,
    }

    /// Inner's own doc.
    #[derive(Debug, Serialize, Deserialize, JsonSchema, PartialEq)]
    #[serde(deny_unknown_fields)]
    struct Inner {
        /// A | ratio.
        ratio: f64,
        on: bool,
    }

    fn example(listen: &str, ratio: f64) -> Outer {
        Outer {
            listen: listen.into(),
            cores: vec![],
            chunk: None,
            inner: Inner { ratio, on: true },
        }
    }

    #[test]
    fn keys_carry_their_doc_comments_and_values() {
        let sections = describe(&example("a:1", 0.5));
        let paths: Vec<_> = sections.iter().map(|s| s.path.as_str()).collect();
        assert_eq!(paths, ["", "inner"]);
        assert_eq!(sections[1].doc, "The inner table.");
        let keys = &sections[0].keys;
        assert_eq!(keys[0].path, "listen");
        assert_eq!(keys[0].doc, "Where it listens; an address.");
        assert_eq!(keys[0].value, Value::String("a:1".into()));
        assert_eq!(keys[2].doc, "Unset: by device (`Outer`).");
        assert_eq!(keys[2].value, Value::Null);
        assert_eq!(sections[1].keys[0].path, "inner.ratio");
        assert_eq!(sections[1].keys[1].doc, "");
    }

    #[test]
    fn the_commented_toml_loads_back_as_the_same_configuration() {
        let config = Outer {
            cores: vec![0, 1],
            chunk: Some(64),
            ..example("a:1", 0.5)
        };
        let text = commented_toml(&describe(&config));
        assert!(text.starts_with("# Where it listens; an address.\nlisten = \"a:1\"\n"));
        assert!(text.contains("\n# The inner table.\n[inner]\n# A | ratio.\nratio = 0.5\n"));
        assert_eq!(toml::from_str::<Outer>(&text).unwrap(), config);
        let unset = commented_toml(&describe(&example("a:1", 0.5)));
        assert!(unset.contains("# chunk = (unset)\n"), "{unset}");
    }

    #[test]
    fn a_table_names_the_defaults_that_differ() {
        let table = markdown_table(&[
            ("draft", describe(&example("a:1", 0.5))),
            ("target", describe(&example("a:2", 0.5))),
        ]);
        let rows: Vec<_> = table.lines().collect();
        assert_eq!(
            rows[2],
            "| `listen` | draft `a:1`, target `a:2` | Where it listens; an address. |"
        );
        assert_eq!(rows[3], "| `cores` | empty | Cores, `[0]` for one. |");
        assert_eq!(rows[4], "| `chunk` | unset | Unset: by device (`Outer`). |");
        assert_eq!(rows[5], "| `inner.ratio` | `0.5` | A \\| ratio. |");
        assert_eq!(rows[6], "| `inner.on` | `true` |  |");
    }
}
