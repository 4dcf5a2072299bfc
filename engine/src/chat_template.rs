//! Chat templates rendered as Hugging Face renders them: Jinja2 with its loop controls,
//! Python's string methods and JSON layout, and the helpers its templates call
//! (`raise_exception`, `strftime_now`), so a GGUF file's template gives the text its model
//! was trained on.

use crate::error::{EngineError, Result};
use crate::tokenizer::ChatMessage;
use serde::Serialize;

/// The variables every template is given (`render_chat_template`'s context); a request's
/// own (`ChatExtras::kwargs`) may not take these names.
pub const TEMPLATE_VARIABLES: [&str; 5] = [
    "messages",
    "tools",
    "add_generation_prompt",
    "bos_token",
    "eos_token",
];

/// What a chat's template renders besides its messages.
#[derive(Debug, Clone, Copy, Default)]
pub struct ChatExtras<'a> {
    /// The request's tools, in Hugging Face's shape (`{"type": "function", "function":
    /// {"name", "description", "parameters"}}`); a template that does not read `tools`
    /// leaves them out.
    pub tools: &'a [serde_json::Value],
    /// More variables for the template (vLLM's `chat_template_kwargs`: Qwen3's
    /// `enable_thinking`, say); the template's own ([`TEMPLATE_VARIABLES`]) win over them.
    pub kwargs: Option<&'a serde_json::Map<String, serde_json::Value>>,
}

pub(crate) struct TemplateContext<'a> {
    pub(crate) messages: &'a [ChatMessage],
    pub(crate) extras: ChatExtras<'a>,
    pub(crate) add_generation_prompt: bool,
    pub(crate) bos_token: &'a str,
    pub(crate) eos_token: &'a str,
}

pub(crate) fn render_chat_template(source: &str, ctx: &TemplateContext<'_>) -> Result<String> {
    let err = |e: minijinja::Error| EngineError::ChatTemplate(e.to_string());
    let mut env = minijinja::Environment::new();
    // Hugging Face renders templates with Jinja2's trim_blocks and lstrip_blocks, and with
    // Python string methods (`.strip()`, `.startswith()`) available.
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_filter("tojson", python_tojson);
    // Jinja2's `none is iterable` is false, where minijinja iterates none as empty:
    // templates guard `tools | length` with it.
    env.add_test("iterable", |value: &minijinja::Value| {
        use minijinja::value::ValueKind;
        let kind = value.kind();
        matches!(kind, ValueKind::String | ValueKind::Bytes | ValueKind::Seq)
            || matches!(kind, ValueKind::Map | ValueKind::Iterable)
    });
    env.add_function("strftime_now", |format: String| {
        strftime(&format, std::time::SystemTime::now())
    });
    env.add_function(
        "raise_exception",
        |msg: String| -> std::result::Result<String, minijinja::Error> {
            Err(minijinja::Error::new(
                minijinja::ErrorKind::InvalidOperation,
                msg,
            ))
        },
    );
    let source = without_generation_tags(source);
    env.add_template("chat", &source).map_err(err)?;
    let template = env.get_template("chat").map_err(err)?;
    template
        .render(minijinja::context! {
            messages => ctx.messages,
            tools => (!ctx.extras.tools.is_empty()).then_some(ctx.extras.tools),
            add_generation_prompt => ctx.add_generation_prompt,
            bos_token => ctx.bos_token,
            eos_token => ctx.eos_token,
            ..minijinja::Value::from_serialize(ctx.extras.kwargs)
        })
        .map_err(err)
}

/// `source` with Hugging Face's `{% generation %}` … `{% endgeneration %}` (which mark the
/// assistant's text for training masks, and render their body as it is) as an `if true`
/// block, keeping each tag's whitespace control.
fn without_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(at) = rest.find("{%") {
        out.push_str(&rest[..at]);
        let tag = &rest[at..];
        let Some(end) = tag.find("%}") else {
            break;
        };
        let inner = &tag[2..end];
        let (open, inner) = split_control(inner, true);
        let (inner, close) = split_control(inner, false);
        let body = match inner.trim() {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        match body {
            Some(body) => out.push_str(&format!("{{%{open} {body} {close}%}}")),
            None => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

/// A tag's inside split at its whitespace control (`-` or `+`) at the start or the end.
fn split_control(inner: &str, start: bool) -> (&str, &str) {
    let control = |c: char| c == '-' || c == '+';
    match start {
        true if inner.starts_with(control) => (&inner[..1], &inner[1..]),
        true => ("", inner),
        false if inner.ends_with(control) => (&inner[..inner.len() - 1], &inner[inner.len() - 1..]),
        false => (inner, ""),
    }
}

/// Python's `strftime` of `time` in UTC, for templates that write today's date
/// (`strftime_now("%d %b %Y")`): dates, weekdays and times of day; other directives stay
/// as they are.
fn strftime(format: &str, time: std::time::SystemTime) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    let seconds = time
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let days = (seconds / 86_400) as i64;
    let (year, month, day) = civil_date(days);
    // 1970-01-01 was a Thursday.
    let weekday = (days + 3).rem_euclid(7) as usize;
    let of_day = seconds % 86_400;
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let month_name = MONTHS[month as usize - 1];
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('e') => out.push_str(&format!("{day:2}")),
            Some('B') => out.push_str(month_name),
            Some('b') => out.push_str(&month_name[..3]),
            Some('A') => out.push_str(DAYS[weekday]),
            Some('a') => out.push_str(&DAYS[weekday][..3]),
            Some('H') => out.push_str(&format!("{:02}", of_day / 3600)),
            Some('M') => out.push_str(&format!("{:02}", of_day / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", of_day % 60)),
            Some('%') => out.push('%'),
            Some(other) => out.extend(['%', other]),
            None => out.push('%'),
        }
    }
    out
}

/// The proleptic Gregorian date (year, month 1-12, day 1-31) `days` after 1970-01-01.
fn civil_date(days: i64) -> (i64, u32, u32) {
    // Howard Hinnant's days_from_civil, inverted: eras of 400 years from 0000-03-01.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let day_of_era = z.rem_euclid(146_097);
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let mp = (5 * day_of_year + 2) / 153;
    let day = (day_of_year - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// Jinja's `tojson` as Hugging Face renders templates (Python's `json.dumps`): `", "` and
/// `": "` between items, keys in their order, text as it is (no HTML escapes), so tools
/// reach the model laid out as in its training. Control-token text cannot come through it:
/// `encode_chat_with` refuses tools and calls that hold any.
fn python_tojson(
    value: &minijinja::Value,
    indent: Option<minijinja::Value>,
) -> std::result::Result<minijinja::Value, minijinja::Error> {
    let mut out = Vec::new();
    let written = match indent.and_then(|i| usize::try_from(i).ok()) {
        Some(n) => {
            let indentation = " ".repeat(n);
            let pretty = serde_json::ser::PrettyFormatter::with_indent(indentation.as_bytes());
            value.serialize(&mut serde_json::Serializer::with_formatter(
                &mut out, pretty,
            ))
        }
        None => value.serialize(&mut serde_json::Serializer::with_formatter(
            &mut out, PythonJson,
        )),
    };
    written.map_err(|e| {
        minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, "tojson").with_source(e)
    })?;
    let text = String::from_utf8(out).unwrap_or_default();
    Ok(minijinja::Value::from_safe_string(text))
}

/// Python's default JSON layout: `", "` between items, `": "` after keys.
struct PythonJson;

impl serde_json::ser::Formatter for PythonJson {
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first { Ok(()) } else { w.write_all(b", ") }
    }

    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first { Ok(()) } else { w.write_all(b", ") }
    }

    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(b": ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(source: &str, messages: &[ChatMessage]) -> Result<String> {
        let ctx = TemplateContext {
            messages,
            extras: ChatExtras::default(),
            add_generation_prompt: true,
            bos_token: "",
            eos_token: "",
        };
        render_chat_template(source, &ctx)
    }

    /// What Hugging Face's Jinja has and minijinja needs told: loop controls, `none is
    /// iterable` false (the guard of `tools | length`), `{% generation %}` blocks, and
    /// `strftime_now`.
    #[test]
    fn templates_render_as_hugging_faces_jinja_renders_them() {
        let messages = [ChatMessage::new("user", "a"), ChatMessage::new("user", "b")];
        let loop_controls = "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}\
                             {{ m.content }}{% endfor %}";
        assert_eq!(render(loop_controls, &messages).unwrap(), "a");
        let guard = "{% if tools is iterable and tools | length > 0 %}tools{% else %}none\
                     {% endif %}{% if 'x' is iterable %}!{% endif %}";
        assert_eq!(render(guard, &messages).unwrap(), "none!");
        let generation = "{% for m in messages %}{%- generation -%} {{ m.content }} \
                          {%- endgeneration %}{% endfor %}";
        assert_eq!(render(generation, &messages).unwrap(), "ab");
        let today = render("{{ strftime_now('%Y-%m-%d') }}", &messages).unwrap();
        let now = strftime("%Y-%m-%d", std::time::SystemTime::now());
        assert_eq!(today, now);
    }

    #[test]
    fn dates_are_written_as_python_writes_them() {
        let at = |seconds: u64| std::time::UNIX_EPOCH + std::time::Duration::from_secs(seconds);
        let format = "%d %b %Y, %A %H:%M:%S %%";
        assert_eq!(strftime(format, at(0)), "01 Jan 1970, Thursday 00:00:00 %");
        // 2024-02-29 13:05:09 UTC, a leap day.
        assert_eq!(
            strftime(format, at(1_709_211_909)),
            "29 Feb 2024, Thursday 13:05:09 %"
        );
        assert_eq!(
            strftime("%e %B %y %a %q", at(1_764_028_800)),
            "25 November 25 Tue %q"
        );
    }

    #[test]
    fn renders_a_chatml_template() {
        let source = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | trim }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
        let messages = [ChatMessage::new("user", " hi ")];
        let ctx = TemplateContext {
            messages: &messages,
            extras: ChatExtras::default(),
            add_generation_prompt: true,
            bos_token: "",
            eos_token: "",
        };
        assert_eq!(
            render_chat_template(source, &ctx).unwrap(),
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        );
    }
}
