//! The chat template through minijinja, made to render exactly as transformers'
//! `apply_chat_template` does: Python string methods (pycompat), `raise_exception`, and a `tojson`
//! that prints like Python's `json.dumps(x, ensure_ascii=False)` (", " and ": " separators, keys
//! in insertion order, no HTML escaping) instead of minijinja's compact, key-sorted one.

use std::path::Path;

use anyhow::{bail, Context, Result};
use minijinja::{Environment, Error, ErrorKind, Value as JValue};
use serde_json::Value;

use crate::ChatOptions;

pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
}

impl ChatTemplate {
    /// The template of a model directory: chat_template.jinja, else the `chat_template` string
    /// of its tokenizer_config.json (`tokenizer_config`, parsed; Null when there is none).
    pub fn from_dir(dir: &Path, tokenizer_config: &Value) -> Result<Self> {
        let jinja = dir.join("chat_template.jinja");
        let source = if jinja.exists() {
            std::fs::read_to_string(&jinja)
                .with_context(|| format!("cannot read {}", jinja.display()))?
        } else {
            match tokenizer_config.get("chat_template") {
                Some(Value::String(s)) => s.clone(),
                _ => bail!(
                    "{} has no chat template (no chat_template.jinja, no \"chat_template\" string in tokenizer_config.json)",
                    dir.display()
                ),
            }
        };
        Self::from_source(source)
    }

    pub fn from_source(source: String) -> Result<Self> {
        let mut env = Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_auto_escape_callback(|_| minijinja::AutoEscape::None);
        env.add_function("raise_exception", |msg: String| -> Result<JValue, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_filter("tojson", python_tojson);
        env.add_template_owned("chat", source.clone())
            .context("the chat template does not parse")?;
        Ok(ChatTemplate { env, source })
    }

    /// The template's Jinja text.
    pub fn source(&self) -> &str {
        &self.source
    }

    pub fn render(&self, messages: &Value, opts: &ChatOptions) -> Result<String> {
        if !opts.continue_final_message {
            return self.render_plain(messages, opts);
        }
        let mut messages = messages.clone();
        let final_text = mark_final_message(&mut messages)?;
        let rendered = self.render_plain(&messages, opts)?;
        cut_at_continue_tag(rendered, &final_text)
    }

    fn render_plain(&self, messages: &Value, opts: &ChatOptions) -> Result<String> {
        let mut ctx = opts.kwargs.clone();
        ctx.insert("messages".into(), messages.clone());
        ctx.insert(
            "add_generation_prompt".into(),
            Value::Bool(opts.add_generation_prompt),
        );
        if let Some(tools) = &opts.tools {
            ctx.insert("tools".into(), tools.clone());
        }
        let tmpl = self.env.get_template("chat")?;
        tmpl.render(JValue::from_serialize(&ctx)).map_err(|e| {
            let detail = if e.kind() == ErrorKind::InvalidOperation {
                e.detail().unwrap_or("").to_string()
            } else {
                format!("{e:#}")
            };
            anyhow::anyhow!("chat template: {detail}")
        })
    }
}

/// Appended to the text of the message to continue, and the rendering cut where it lands: what
/// transformers' `apply_chat_template(continue_final_message=True)` does, so the prompt ends
/// inside that message (the template's end-of-turn and anything after it gone).
const CONTINUE_TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG ";

/// Tags the final message's `content` (a string, or the last text part of a list) and returns the
/// text it had.
fn mark_final_message(messages: &mut Value) -> Result<String> {
    let Some(last) = messages.as_array_mut().and_then(|m| m.last_mut()) else {
        bail!("continue_final_message is set but the conversation is empty");
    };
    let text = match last.get_mut("content") {
        Some(Value::String(s)) => Some(s),
        Some(Value::Array(parts)) => parts
            .iter_mut()
            .rev()
            .find_map(|p| match p.get_mut("text") {
                Some(Value::String(s)) => Some(s),
                _ => None,
            }),
        _ => None,
    };
    let Some(text) = text else {
        bail!(
            "continue_final_message is set but the final message has no text content to continue"
        );
    };
    let original = text.clone();
    text.push_str(CONTINUE_TAG);
    Ok(original)
}

fn cut_at_continue_tag(rendered: String, final_text: &str) -> Result<String> {
    let tag = CONTINUE_TAG.trim();
    let (Some(at), true) = (rendered.rfind(tag), rendered.contains(final_text.trim())) else {
        bail!("continue_final_message is set but the chat template drops part of the final message, so it cannot be continued");
    };
    if rendered[at..].starts_with(CONTINUE_TAG) {
        Ok(rendered[..at].to_string())
    } else {
        // the template trimmed the message, and with it the tag's space: trim what precedes too
        Ok(rendered[..at].trim_end().to_string())
    }
}

fn python_tojson(v: JValue) -> Result<JValue, Error> {
    let json: Value = serde_json::to_value(&v)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let mut out = String::new();
    write_python_json(&json, &mut out);
    Ok(JValue::from_safe_string(out))
}

/// `json.dumps(v, ensure_ascii=False)`.
pub fn write_python_json(v: &Value, out: &mut String) {
    match v {
        Value::Array(a) => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_python_json(x, out);
            }
            out.push(']');
        }
        Value::Object(m) => {
            out.push('{');
            for (i, (k, x)) in m.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                out.push_str(&Value::String(k.clone()).to_string());
                out.push_str(": ");
                write_python_json(x, out);
            }
            out.push('}');
        }
        Value::Number(n) if n.is_f64() => {
            let f = n.as_f64().unwrap_or(0.0);
            if f.fract() == 0.0 && f.abs() < 1e16 {
                out.push_str(&format!("{f:.1}"));
            } else {
                out.push_str(&n.to_string());
            }
        }
        other => out.push_str(&other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_json_spacing_order_and_unicode() {
        let v: Value =
            serde_json::from_str(r#"{"b": 1, "a": [true, null, 2.0, "é\n\"x\""], "c": {}}"#)
                .unwrap();
        let mut s = String::new();
        write_python_json(&v, &mut s);
        assert_eq!(
            s,
            r#"{"b": 1, "a": [true, null, 2.0, "é\n\"x\""], "c": {}}"#
        );
    }

    fn continuing(source: &str, messages: Value) -> Result<String> {
        let opts = ChatOptions {
            continue_final_message: true,
            ..Default::default()
        };
        ChatTemplate::from_source(source.into())?.render(&messages, &opts)
    }

    #[test]
    fn a_continued_message_keeps_its_spacing_unless_the_template_trims_it() {
        let plain = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</end>{% endfor %}";
        let msgs = serde_json::json!([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b, "}]);
        assert_eq!(
            continuing(plain, msgs.clone()).unwrap(),
            "<user>a</end><assistant>b, "
        );
        let trims = "{% for m in messages %}<{{ m.role }}>{{ m.content|trim }}</end>{% endfor %}";
        assert_eq!(
            continuing(trims, msgs).unwrap(),
            "<user>a</end><assistant>b,"
        );
    }

    #[test]
    fn what_cannot_be_continued_is_an_error() {
        let plain = "{% for m in messages %}{{ m.content }}{% endfor %}";
        let e = continuing(plain, serde_json::json!([])).unwrap_err();
        assert!(e.to_string().contains("conversation is empty"), "{e}");
        let e = continuing(plain, serde_json::json!([{"role": "assistant"}])).unwrap_err();
        assert!(e.to_string().contains("no text content"), "{e}");
        let parts = serde_json::json!([{"role": "assistant", "content": [{"type": "image"}]}]);
        let e = continuing(plain, parts).unwrap_err();
        assert!(e.to_string().contains("no text content"), "{e}");
        let drops = "{% for m in messages %}{{ m.content[:3] }}{% endfor %}";
        let msgs = serde_json::json!([{"role": "assistant", "content": "hello"}]);
        let e = continuing(drops, msgs).unwrap_err();
        assert!(e.to_string().contains("drops part"), "{e}");
    }

    #[test]
    fn raise_exception_becomes_an_error() {
        let t = ChatTemplate::from_source("{{ raise_exception('No messages provided.') }}".into())
            .unwrap();
        let e = t
            .render(&Value::Array(vec![]), &ChatOptions::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("No messages provided."), "{e}");
    }
}
