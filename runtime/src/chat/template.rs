//! Chat formatting from the model's own files: the Jinja `chat_template` of tokenizer_config.json
//! (or chat_template.jinja) rendered with minijinja the way transformers renders it
//! (`PreTrainedTokenizerBase.apply_chat_template`, transformers/utils/chat_template_utils.py:
//! `trim_blocks`, `lstrip_blocks`, loop controls, `raise_exception`, a `tojson` that is Python's
//! `json.dumps(ensure_ascii=False)`, the tokenizer config's special tokens as variables), with
//! minijinja-contrib's Python string methods (`startswith`, `split`, `strip(chars)`...) that real
//! templates call; or, for GPT-OSS, whose tokenizer ships no template, the harmony format
//! ([`super::harmony`]).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// One chat message, as the OpenAI API and transformers' templates take it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Message {
    /// `system`, `developer`, `user`, `assistant` or `tool` (see [`ROLES`]).
    pub role: String,
    /// The text (`null` reads as empty, as an assistant message that only calls tools has it).
    #[serde(default, deserialize_with = "null_as_empty")]
    pub content: String,
    /// The assistant's reasoning kept apart from `content` (Qwen3's `<think>` text, GPT-OSS's
    /// analysis channel), when known. Absent (undefined to the template) when `None`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// The assistant's tool calls (OpenAI's `tool_calls`). Absent when `None`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCall>>,
    /// A `tool` message: the id of the call it answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// A `tool` message: the function's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl Message {
    /// A message of `role` with `content` and nothing else.
    pub fn new(role: &str, content: &str) -> Message {
        Message {
            role: role.into(),
            content: content.into(),
            reasoning_content: None,
            tool_calls: None,
            tool_call_id: None,
            name: None,
        }
    }
}

/// One tool call of an assistant message, in OpenAI's shape:
/// `{"id": ..., "type": "function", "function": {"name": ..., "arguments": ...}}`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    /// The call's id, which the `tool` message answering it names.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// `function`.
    #[serde(rename = "type", default = "function_kind")]
    pub kind: String,
    /// The function and its arguments.
    pub function: FunctionCall,
}

/// The function a [`ToolCall`] calls.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FunctionCall {
    /// The function's name.
    pub name: String,
    /// The arguments: a JSON string (OpenAI's shape) or a JSON value, kept with its key order (a
    /// template writes a mapping with `tojson`).
    pub arguments: minijinja::Value,
}

fn function_kind() -> String {
    "function".into()
}

fn null_as_empty<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<String, D::Error> {
    Ok(Option::<String>::deserialize(d)?.unwrap_or_default())
}

/// The roles a message may have.
pub const ROLES: &[&str] = &["system", "developer", "user", "assistant", "tool"];

/// Rendering settings.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RenderOptions<'a> {
    /// Append the header of the assistant's next turn (transformers' `add_generation_prompt`).
    pub add_generation_prompt: bool,
    /// Qwen3's `enable_thinking` switch (passed to the template when `Some`; `Some(false)` makes it
    /// append an empty think block). Harmony ignores it.
    pub enable_thinking: Option<bool>,
    /// Function tools in OpenAI's shape (`{"type": "function", "function": {"name", "description",
    /// "parameters"}}`), given to a template as `tools` (transformers' `apply_chat_template(tools=)`)
    /// when not empty, and rendered into harmony's developer message. Values keep their key order.
    pub tools: &'a [minijinja::Value],
}

/// A Jinja chat template, compiled.
pub struct JinjaTemplate {
    env: minijinja::Environment<'static>,
    path: PathBuf,
    /// Special tokens of the tokenizer config given to the template (`bos_token`, `eos_token`, ...).
    specials: Vec<(String, String)>,
}

/// The name the template is compiled under.
const NAME: &str = "chat_template";

/// The most instructions one rendering may run (minijinja's fuel): a template comes from a model
/// directory, and one that loops without end (`range` nested in `range`) must stop with an error
/// naming it, not hang a chat turn or a server request. The Qwen3 template on a 2,000-message
/// conversation with tools uses well under a tenth of it (test `fuel_bounds_a_runaway_template`).
pub const TEMPLATE_FUEL: u64 = 50_000_000;

/// The largest `indent` the `tojson` filter and the `indent` width the `indent` filter take (Python
/// takes any; a number in the template must not size an allocation).
const MAX_TOJSON_INDENT: usize = 64;

impl JinjaTemplate {
    /// Compiles `source` (read from `path`, named in errors), with the special tokens of
    /// `tokenizer_config` (its `bos_token`, `eos_token`, `pad_token`, `unk_token`, each a string or an
    /// `{"content": ...}` object) as template variables.
    ///
    /// # Errors
    /// [`Error::Template`] naming the line of a syntax error.
    pub fn new(source: &str, path: &Path, tokenizer_config: Option<&serde_json::Value>) -> Result<JinjaTemplate> {
        Self::with_fuel(source, path, tokenizer_config, TEMPLATE_FUEL)
    }

    /// [`JinjaTemplate::new`] with `fuel` instructions per rendering instead of [`TEMPLATE_FUEL`].
    fn with_fuel(
        source: &str,
        path: &Path,
        tokenizer_config: Option<&serde_json::Value>,
        fuel: u64,
    ) -> Result<JinjaTemplate> {
        let mut env = minijinja::Environment::new();
        // transformers: ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
        // extensions=[AssertExtension, jinja2.ext.loopcontrols]).
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        env.set_fuel(Some(fuel));
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_filter("tojson", tojson);
        env.add_filter("indent", indent);
        env.add_template_owned(NAME, source.to_owned()).map_err(|e| template_error(path, &e))?;
        let mut specials = Vec::new();
        if let Some(cfg) = tokenizer_config {
            for key in ["bos_token", "eos_token", "pad_token", "unk_token"] {
                if let Some(t) = special_token(cfg, key) {
                    specials.push((key.to_string(), t));
                }
            }
        }
        Ok(JinjaTemplate { env, path: path.to_path_buf(), specials })
    }

    /// Renders `messages` (checked by [`check_messages`]).
    ///
    /// # Errors
    /// [`Error::NoMessages`] or [`Error::UnknownRole`] for a bad message list; [`Error::Template`] naming the template line where
    /// rendering failed (including the template's own `raise_exception`).
    /// A `developer` message is given to the template as `system`: OpenAI's developer role is the
    /// system role of models before it, and transformers' templates (Qwen3's) know only `system`
    /// (they would drop it). Harmony ([`crate::chat::harmony`]) keeps the role as its own.
    pub fn render(&self, messages: &[Message], opts: RenderOptions<'_>) -> Result<String> {
        check_messages(messages)?;
        let renamed: Vec<Message>;
        let messages = if messages.iter().any(|m| m.role == "developer") {
            renamed = messages
                .iter()
                .map(|m| match m.role.as_str() {
                    "developer" => Message { role: "system".into(), ..m.clone() },
                    _ => m.clone(),
                })
                .collect();
            &renamed[..]
        } else {
            messages
        };
        let tmpl = self.env.get_template(NAME).map_err(|e| template_error(&self.path, &e))?;
        // minijinja values, not serde_json's (whose maps sort their keys): fields keep their order.
        let mut ctx = std::collections::BTreeMap::new();
        ctx.insert("messages".to_string(), minijinja::Value::from_serialize(messages));
        ctx.insert("add_generation_prompt".into(), opts.add_generation_prompt.into());
        if let Some(t) = opts.enable_thinking {
            ctx.insert("enable_thinking".into(), t.into());
        }
        if !opts.tools.is_empty() {
            ctx.insert("tools".into(), minijinja::Value::from(opts.tools.to_vec()));
        }
        for (k, v) in &self.specials {
            ctx.insert(k.clone(), v.as_str().into());
        }
        tmpl.render(ctx).map_err(|e| template_error(&self.path, &e))
    }

    /// The file the template came from.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// A token string of the tokenizer config: `cfg[key]` as a string or `{"content": ...}`.
pub fn special_token(cfg: &serde_json::Value, key: &str) -> Option<String> {
    match cfg.get(key)? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content")?.as_str().map(str::to_owned),
        _ => None,
    }
}

/// Refuses an empty message list and a role outside [`ROLES`].
///
/// # Errors
/// [`Error::NoMessages`]; [`Error::UnknownRole`] naming the message.
pub fn check_messages(messages: &[Message]) -> Result<()> {
    if messages.is_empty() {
        return Err(Error::NoMessages);
    }
    for (i, m) in messages.iter().enumerate() {
        if !ROLES.contains(&m.role.as_str()) {
            return Err(Error::UnknownRole { index: i, role: m.role.clone() });
        }
    }
    Ok(())
}

fn template_error(path: &Path, e: &minijinja::Error) -> Error {
    let mut message = e.kind().to_string();
    if let Some(d) = e.detail() {
        message = format!("{message}: {d}");
    }
    Error::Template { path: path.to_path_buf(), line: e.line(), message }
}

/// transformers' `raise_exception(message)`: the template refuses its input.
fn raise_exception(message: String) -> std::result::Result<minijinja::Value, minijinja::Error> {
    Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, message))
}

/// Jinja2's `indent(width=4, first=False, blank=False)` filter, with `width` (a count of spaces or
/// the indentation string) at most [`MAX_TOJSON_INDENT`] characters: minijinja's own takes any
/// width, so a number in a template would size every line's allocation.
fn indent(
    value: String,
    width: Option<minijinja::Value>,
    first: Option<bool>,
    blank: Option<bool>,
    kwargs: minijinja::value::Kwargs,
) -> std::result::Result<String, minijinja::Error> {
    let width = match width {
        Some(w) => Some(w),
        None => kwargs.get::<Option<minijinja::Value>>("width")?,
    };
    let first = match first {
        Some(f) => f,
        None => kwargs.get::<Option<bool>>("first")?.unwrap_or(false),
    };
    let blank = match blank {
        Some(b) => b,
        None => kwargs.get::<Option<bool>>("blank")?.unwrap_or(false),
    };
    kwargs.assert_all_used()?;
    let too_wide = |n: usize| {
        minijinja::Error::new(
            minijinja::ErrorKind::InvalidOperation,
            format!("indent width {n} is above the largest taken, {MAX_TOJSON_INDENT}"),
        )
    };
    let pad = match width {
        None => "    ".to_string(),
        Some(w) => match w.as_str() {
            Some(s) if s.chars().count() > MAX_TOJSON_INDENT => return Err(too_wide(s.chars().count())),
            Some(s) => s.to_string(),
            None => {
                let n = usize::try_from(w.clone()).map_err(|_| {
                    minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, format!("indent width {w}"))
                })?;
                if n > MAX_TOJSON_INDENT {
                    return Err(too_wide(n));
                }
                " ".repeat(n)
            }
        },
    };
    // Jinja2: the lines after the first get the indentation (blank ones only with `blank`), the
    // first with `first`; a trailing newline is dropped.
    let mut out = String::with_capacity(value.len());
    for (i, line) in value.lines().enumerate() {
        if i > 0 {
            out.push('\n');
        }
        if (i > 0 || first) && (blank || !line.trim().is_empty()) {
            out.push_str(&pad);
        }
        out.push_str(line);
    }
    Ok(out)
}

/// transformers' `tojson` filter: `json.dumps(x, ensure_ascii=False, indent=indent,
/// separators=separators, sort_keys=sort_keys)` — Python's separators `", "` and `": "` and the
/// mapping's own key order (minijinja's own filter writes compact, HTML-escaped JSON). Supports
/// `indent` (an integer) and `sort_keys`.
fn tojson(
    value: minijinja::Value,
    kwargs: minijinja::value::Kwargs,
) -> std::result::Result<minijinja::Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    if let Some(n) = indent.filter(|&n| n > MAX_TOJSON_INDENT) {
        return Err(minijinja::Error::new(
            minijinja::ErrorKind::InvalidOperation,
            format!("tojson indent {n} is above the largest taken, {MAX_TOJSON_INDENT}"),
        ));
    }
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let mut out = String::new();
    py_json(&value, indent, sort_keys.unwrap_or(false), 0, &mut out)?;
    Ok(minijinja::Value::from_safe_string(out))
}

/// Writes `v` as Python's `json.dumps(v, ensure_ascii=False)` does (with `indent` when given),
/// maps in their own key order unless `sort_keys`.
///
/// # Errors
/// A value JSON cannot hold (an undefined attribute of a map is written `null`, as Python's
/// `None`).
pub fn py_json(
    v: &minijinja::Value,
    indent: Option<usize>,
    sort_keys: bool,
    depth: usize,
    out: &mut String,
) -> std::result::Result<(), minijinja::Error> {
    use minijinja::value::ValueKind;
    let bad = |e: serde_json::Error| minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, e.to_string());
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
    };
    let item_sep = if indent.is_some() { "," } else { ", " };
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<_> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, x) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                py_json(x, indent, sort_keys, depth + 1, out)?;
            }
            newline(out, depth);
            out.push(']');
        }
        ValueKind::Map => {
            let mut keys: Vec<_> = v.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if sort_keys {
                keys.sort();
            }
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                let key = k.as_str().map_or_else(|| k.to_string(), str::to_owned);
                out.push_str(&serde_json::to_string(&key).map_err(bad)?);
                out.push_str(": ");
                py_json(&v.get_item(k)?, indent, sort_keys, depth + 1, out)?;
            }
            newline(out, depth);
            out.push('}');
        }
        _ => out.push_str(&serde_json::to_string(v).map_err(bad)?),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tojson_matches_python_json_dumps() {
        let render = |src: &str| {
            let t = JinjaTemplate::new(src, Path::new("/t"), None).unwrap();
            t.render(&[Message::new("user", "x")], RenderOptions::default()).unwrap()
        };
        // Python: json.dumps({"name": "f", "a": [1, 2.5, True, None, 'é\n"<>'], "o": {}, "e": []},
        // ensure_ascii=False): insertion order, ", " and ": ", nothing HTML-escaped.
        let src = r#"{{ {"name": "f", "a": [1, 2.5, true, none, "é\n\"<>"], "o": {}, "e": []} | tojson }}"#;
        assert_eq!(render(src), r#"{"name": "f", "a": [1, 2.5, true, null, "é\n\"<>"], "o": {}, "e": []}"#);
        let src = r#"{{ {"b": [1], "a": 2} | tojson(indent=2, sort_keys=true) }}"#;
        assert_eq!(render(src), "{\n  \"a\": 2,\n  \"b\": [\n    1\n  ]\n}");
        // A message's fields in their declared order.
        assert_eq!(render("{{ messages[0] | tojson }}"), r#"{"role": "user", "content": "x"}"#);
    }

    #[test]
    fn a_developer_message_reaches_the_template_as_system() {
        let src = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}";
        let t = JinjaTemplate::new(src, Path::new("/t"), None).unwrap();
        let r =
            |role| t.render(&[Message::new(role, "be brief"), Message::new("user", "hi")], RenderOptions::default());
        assert_eq!(r("developer").unwrap(), r("system").unwrap());
        assert_eq!(r("system").unwrap(), "[system] be brief\n[user] hi\n");
    }

    #[test]
    fn a_failing_template_names_its_line() {
        let src = "{% for m in messages %}\n{{ m.content }}\n{% if m.role == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}\n{% endfor %}";
        let t = JinjaTemplate::new(src, Path::new("/m/chat_template.jinja"), None).unwrap();
        assert_eq!(t.render(&[Message::new("user", "hi")], RenderOptions::default()).unwrap(), "hi\n");
        let e = t.render(&[Message::new("tool", "x")], RenderOptions::default()).unwrap_err();
        assert!(matches!(e, Error::Template { line: Some(3), .. }), "{e:?}");
        assert!(e.to_string().contains("/m/chat_template.jinja: chat template line 3"), "{e}");
        assert!(e.to_string().contains("no tools here"), "{e}");
        let e = JinjaTemplate::new("{% for m in messages %}\n{{ m.content }\n", Path::new("/t"), None).err().unwrap();
        assert!(matches!(e, Error::Template { line: Some(2), .. }), "{e:?}");
    }

    #[test]
    fn unknown_roles_and_empty_lists_are_refused() {
        let e = check_messages(&[]).unwrap_err();
        assert!(e.to_string().contains("empty"), "{e}");
        let e = check_messages(&[Message::new("user", "a"), Message::new("wizard", "b")]).unwrap_err();
        assert!(e.to_string().contains("message 1 has role `wizard`"), "{e}");
    }

    #[test]
    fn fuel_bounds_a_runaway_template() {
        let src = "{% for m in messages %}{{ m.content }}{% endfor %}\n{% for i in range(10000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}";
        let t = JinjaTemplate::new(src, Path::new("/m/chat_template.jinja"), None).unwrap();
        let e = t.render(&[Message::new("user", "hi")], RenderOptions::default()).unwrap_err();
        assert!(matches!(e, Error::Template { line: Some(2), .. }), "{e:?}");
        assert!(e.to_string().contains("/m/chat_template.jinja"), "{e}");
        // The Qwen3 template on a 2,001-message conversation with tools, with a tenth of the fuel.
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/qwen3_moe_text");
        let tc: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("tokenizer_config.json")).unwrap()).unwrap();
        let qwen = tc["chat_template"].as_str().unwrap();
        let t = JinjaTemplate::with_fuel(qwen, &dir, Some(&tc), TEMPLATE_FUEL / 10).unwrap();
        let messages: Vec<Message> = (0..2001)
            .map(|i| {
                Message::new(if i % 2 == 0 { "user" } else { "assistant" }, &format!("turn {i} <think>x</think> y"))
            })
            .collect();
        let tools = [minijinja::Value::from_serialize(serde_json::json!({
            "type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}
        }))];
        let opts = RenderOptions { add_generation_prompt: true, enable_thinking: None, tools: &tools };
        let text = t.render(&messages, opts).unwrap();
        assert!(text.contains("turn 2000"), "{}", &text[text.len().saturating_sub(200)..]);
    }

    #[test]
    fn tojson_indent_is_bounded() {
        let t = JinjaTemplate::new("{{ messages | tojson(indent=1000000000) }}", Path::new("/t"), None).unwrap();
        let e = t.render(&[Message::new("user", "x")], RenderOptions::default()).unwrap_err();
        assert!(e.to_string().contains("indent 1000000000"), "{e}");
    }

    #[test]
    fn indent_filter_follows_jinja2_and_is_bounded() {
        let render = |src: &str| {
            let t = JinjaTemplate::new(src, Path::new("/t"), None).unwrap();
            t.render(&[Message::new("user", "a\n\nb\n")], RenderOptions::default())
        };
        // Jinja2: indent("a\n\nb\n") == "a\n\n    b"; first=True indents "a"; blank=True the blank line.
        assert_eq!(render("{{ messages[0].content | indent }}").unwrap(), "a\n\n    b");
        assert_eq!(render("{{ messages[0].content | indent(2, true) }}").unwrap(), "  a\n\n  b");
        assert_eq!(render("{{ messages[0].content | indent(width='> ', blank=true) }}").unwrap(), "a\n> \n> b");
        let e = render("{{ messages[0].content | indent(1000000000) }}").unwrap_err();
        assert!(e.to_string().contains("indent width 1000000000"), "{e}");
    }
}
