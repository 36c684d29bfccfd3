//! Splits the model's streamed text into what an OpenAI client expects: `reasoning_content` (the
//! text inside `<think>…</think>`), `content`, and `tool_calls` parsed from the qwen3_coder XML
//! format (model-spec §6.5):
//!
//! ```text
//! <tool_call>
//! <function=get_weather>
//! <parameter=city>
//! Paris
//! </parameter>
//! </function>
//! </tool_call>
//! ```
//!
//! Calls are emitted incrementally (the name once `<function=…>` is complete, argument fragments
//! as each parameter closes), with values typed by each parameter's JSON schema. A call inside the
//! reasoning block is still a call; a block that is not a valid call stays as text.

use std::collections::HashMap;

use serde_json::{json, Value};

pub const THINK_OPEN: &str = "<think>";
pub const THINK_CLOSE: &str = "</think>";
/// What ends a reasoning block put in for the model (a thinking budget spent; the model then
/// writes the blank line before its answer, as after its own `</think>`).
pub const CLOSE_REASONING: &str = "\n</think>";
const CALL_OPEN: &str = "<tool_call>";
const CALL_CLOSE: &str = "</tool_call>";

#[derive(Clone, Debug, PartialEq)]
pub enum Delta {
    Reasoning(String),
    Content(String),
    /// A new call: its index among this reply's calls, id and function name.
    CallStart {
        index: usize,
        id: String,
        name: String,
    },
    /// A fragment of the call's `arguments` JSON string.
    CallArguments {
        index: usize,
        fragment: String,
    },
}

/// JSON-schema types of each parameter, per function name.
#[derive(Clone, Debug, Default)]
pub struct ToolSchemas {
    functions: HashMap<String, HashMap<String, Vec<String>>>,
}

impl ToolSchemas {
    /// From an OpenAI `tools` list.
    pub fn from_tools(tools: &Value) -> Self {
        let mut functions = HashMap::new();
        for t in tools.as_array().into_iter().flatten() {
            let f = &t["function"];
            let Some(name) = f["name"].as_str() else {
                continue;
            };
            let mut params = HashMap::new();
            if let Some(props) = f["parameters"]["properties"].as_object() {
                for (p, schema) in props {
                    let types = match &schema["type"] {
                        Value::String(s) => vec![s.clone()],
                        Value::Array(a) => a
                            .iter()
                            .filter_map(|x| x.as_str().map(String::from))
                            .collect(),
                        _ => Vec::new(),
                    };
                    params.insert(p.clone(), types);
                }
            }
            functions.insert(name.to_string(), params);
        }
        ToolSchemas { functions }
    }

    pub fn has(&self, name: &str) -> bool {
        self.functions.contains_key(name)
    }

    /// Converts a raw parameter value by its schema type (strings stay raw text).
    pub fn typed_value(&self, function: &str, param: &str, raw: &str) -> Value {
        let types = self
            .functions
            .get(function)
            .and_then(|p| p.get(param))
            .cloned()
            .unwrap_or_default();
        for ty in &types {
            let v = match ty.as_str() {
                "string" => return Value::String(raw.to_string()),
                "integer" => raw.trim().parse::<i64>().ok().map(Value::from).or_else(|| {
                    raw.trim()
                        .parse::<f64>()
                        .ok()
                        .filter(|f| f.fract() == 0.0)
                        .map(|f| Value::from(f as i64))
                }),
                "number" => raw.trim().parse::<i64>().ok().map(Value::from).or_else(|| {
                    raw.trim()
                        .parse::<f64>()
                        .ok()
                        .and_then(|f| serde_json::Number::from_f64(f).map(Value::Number))
                }),
                "boolean" => match raw.trim().to_ascii_lowercase().as_str() {
                    "true" => Some(Value::Bool(true)),
                    "false" => Some(Value::Bool(false)),
                    _ => None,
                },
                "null" => (raw.trim() == "null" || raw.trim().is_empty()).then_some(Value::Null),
                "object" | "array" => serde_json::from_str::<Value>(raw.trim()).ok().filter(|v| {
                    if ty == "object" {
                        v.is_object()
                    } else {
                        v.is_array()
                    }
                }),
                _ => None,
            };
            if let Some(v) = v {
                return v;
            }
        }
        Value::String(raw.to_string())
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    Reasoning,
    Content,
}

/// A tool-call block being received.
struct OpenCall {
    /// Text of the block after `<tool_call>`.
    text: String,
    /// Mode to return to after the block.
    resume: Mode,
    /// Set once the function header was emitted.
    started: Option<(usize, String)>,
    /// Bytes of `text` already turned into argument fragments.
    consumed: usize,
    params: usize,
}

pub struct OutputParser {
    mode: Mode,
    pending: String,
    /// Tool calls are parsed only when tools were offered and tool_choice is not "none".
    tools: Option<ToolSchemas>,
    call: Option<OpenCall>,
    calls: usize,
    /// Calls whose `</tool_call>` has been read.
    closed_calls: usize,
    /// Strip newlines right after `</think>`.
    after_think: bool,
    id_prefix: String,
}

impl OutputParser {
    /// `in_reasoning`: the prompt ended inside an open `<think>` block.
    pub fn new(in_reasoning: bool, tools: Option<ToolSchemas>, id_prefix: &str) -> Self {
        OutputParser {
            mode: if in_reasoning {
                Mode::Reasoning
            } else {
                Mode::Content
            },
            pending: String::new(),
            tools,
            call: None,
            calls: 0,
            closed_calls: 0,
            after_think: false,
            id_prefix: id_prefix.to_string(),
        }
    }

    pub fn tool_calls(&self) -> usize {
        self.calls
    }

    /// Tool calls read to their end.
    pub fn closed_tool_calls(&self) -> usize {
        self.closed_calls
    }

    /// Still inside the reasoning block (and not inside a call).
    pub fn in_reasoning(&self) -> bool {
        self.mode == Mode::Reasoning && self.call.is_none()
    }

    fn markers(&self) -> Vec<&'static str> {
        let mut m = vec![match self.mode {
            Mode::Reasoning => THINK_CLOSE,
            Mode::Content => THINK_OPEN,
        }];
        if self.tools.is_some() {
            m.push(CALL_OPEN);
        }
        m
    }

    fn emit_text(&mut self, text: &str, out: &mut Vec<Delta>) {
        let mut text = text;
        if self.after_think && self.mode == Mode::Content {
            let trimmed = text.trim_start_matches('\n');
            if trimmed.is_empty() {
                return;
            }
            self.after_think = false;
            text = trimmed;
        }
        if text.is_empty() {
            return;
        }
        match (self.mode, out.last_mut()) {
            (Mode::Reasoning, Some(Delta::Reasoning(s)))
            | (Mode::Content, Some(Delta::Content(s))) => s.push_str(text),
            (Mode::Reasoning, _) => out.push(Delta::Reasoning(text.to_string())),
            (Mode::Content, _) => out.push(Delta::Content(text.to_string())),
        }
    }

    pub fn push(&mut self, text: &str) -> Vec<Delta> {
        let mut out = Vec::new();
        self.pending.push_str(text);
        self.drain(&mut out, false);
        out
    }

    /// Ends the stream: releases held text and closes an unfinished call.
    pub fn finish(&mut self) -> Vec<Delta> {
        let mut out = Vec::new();
        self.drain(&mut out, true);
        if let Some(call) = self.call.take() {
            match call.started {
                Some((index, _)) => {
                    let frag = if call.params == 0 { "{}" } else { "}" };
                    out.push(Delta::CallArguments {
                        index,
                        fragment: frag.to_string(),
                    });
                }
                None => {
                    self.mode = call.resume;
                    let raw = format!("{CALL_OPEN}{}", call.text);
                    self.emit_text(&raw, &mut out);
                }
            }
        }
        out
    }

    fn drain(&mut self, out: &mut Vec<Delta>, at_end: bool) {
        loop {
            if self.call.is_some() {
                if !self.advance_call(out) {
                    return;
                }
                continue;
            }
            let markers = self.markers();
            let hit = markers
                .iter()
                .filter_map(|m| self.pending.find(m).map(|i| (i, *m)))
                .min();
            match hit {
                Some((i, marker)) => {
                    let before = self.pending[..i].to_string();
                    let before = if marker == THINK_CLOSE {
                        before.trim_end_matches('\n').to_string()
                    } else {
                        before
                    };
                    self.emit_text(&before, out);
                    self.pending.drain(..i + marker.len());
                    match marker {
                        THINK_CLOSE => {
                            self.mode = Mode::Content;
                            self.after_think = true;
                        }
                        THINK_OPEN => self.mode = Mode::Reasoning,
                        _ => {
                            self.call = Some(OpenCall {
                                text: String::new(),
                                resume: self.mode,
                                started: None,
                                consumed: 0,
                                params: 0,
                            });
                        }
                    }
                }
                None => {
                    // hold back a suffix that may start a marker (and, in reasoning, trailing
                    // newlines that may precede </think>)
                    let mut hold = if at_end {
                        0
                    } else {
                        held_suffix(&self.pending, &markers)
                    };
                    if !at_end && self.mode == Mode::Reasoning {
                        let body = &self.pending[..self.pending.len() - hold];
                        hold += body.len() - body.trim_end_matches('\n').len();
                    }
                    let upto = self.pending.len() - hold;
                    let text: String = self.pending.drain(..upto).collect();
                    self.emit_text(&text, out);
                    return;
                }
            }
        }
    }

    /// Moves pending text into the open call and emits what became complete. Returns true when
    /// the call closed (parsing continues after it).
    fn advance_call(&mut self, out: &mut Vec<Delta>) -> bool {
        let Some(call) = self.call.as_mut() else {
            return false;
        };
        call.text.push_str(&self.pending);
        self.pending.clear();
        let closed_at = call.text.find(CALL_CLOSE);
        let body_end = closed_at.unwrap_or(call.text.len());
        let schemas = self.tools.clone().unwrap_or_default();

        if call.started.is_none() {
            let body = &call.text[..body_end];
            let trimmed = body.trim_start();
            if let Some(rest) = trimmed.strip_prefix("<function=") {
                if let Some(end) = rest.find('>') {
                    let name = rest[..end].trim().to_string();
                    if schemas.has(&name) {
                        let index = self.calls;
                        self.calls += 1;
                        out.push(Delta::CallStart {
                            index,
                            id: format!("{}{index}", self.id_prefix),
                            name: name.clone(),
                        });
                        call.consumed = body.len() - trimmed.len() + "<function=".len() + end + 1;
                        call.started = Some((index, name));
                    }
                }
            }
        }
        if let Some((index, name)) = call.started.clone() {
            // complete parameters: <parameter=NAME>\nVALUE\n</parameter>
            loop {
                let rest = &call.text[call.consumed..body_end];
                let Some(open) = rest.find("<parameter=") else {
                    break;
                };
                let Some(close) = rest[open..].find("</parameter>") else {
                    break;
                };
                let inner = &rest[open + "<parameter=".len()..open + close];
                let Some(gt) = inner.find('>') else { break };
                let pname = inner[..gt].trim().to_string();
                let raw = inner[gt + 1..]
                    .strip_prefix('\n')
                    .unwrap_or(&inner[gt + 1..]);
                let raw = raw.strip_suffix('\n').unwrap_or(raw);
                let value = schemas.typed_value(&name, &pname, raw);
                let sep = if call.params == 0 { "{" } else { ", " };
                let fragment = format!("{sep}{}: {}", Value::String(pname), value);
                out.push(Delta::CallArguments { index, fragment });
                call.params += 1;
                call.consumed += open + close + "</parameter>".len();
            }
        }
        let Some(at) = closed_at else { return false };
        let call = self.call.take().expect("open call");
        self.pending = call.text[at + CALL_CLOSE.len()..].to_string();
        self.mode = call.resume;
        match call.started {
            Some((index, _)) => {
                let frag = if call.params == 0 { "{}" } else { "}" };
                out.push(Delta::CallArguments {
                    index,
                    fragment: frag.to_string(),
                });
                self.closed_calls += 1;
                // the template separates consecutive calls with "\n"
                self.after_think = self.mode == Mode::Content;
            }
            None => {
                let raw = format!("{CALL_OPEN}{}{CALL_CLOSE}", &call.text[..at]);
                self.emit_text(&raw, out);
            }
        }
        true
    }
}

/// Length of the longest suffix of `text` that is a proper prefix of one of `markers`.
fn held_suffix(text: &str, markers: &[&str]) -> usize {
    let mut hold = 0;
    for m in markers {
        for k in (1..m.len()).rev() {
            if k <= text.len() && text.is_char_boundary(text.len() - k) && text.ends_with(&m[..k]) {
                hold = hold.max(k);
                break;
            }
        }
    }
    hold
}

/// One parsed tool call of a whole reply.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    /// JSON object text.
    pub arguments: String,
}

impl ToolCall {
    /// The call as a chat-completions `tool_calls` entry.
    pub fn chat_json(&self) -> Value {
        json!({"id": self.id, "type": "function",
               "function": {"name": self.name, "arguments": self.arguments}})
    }
}

/// A whole reply: the deltas folded together.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Reply {
    pub reasoning: String,
    pub content: String,
    pub calls: Vec<ToolCall>,
}

pub fn collect(deltas: &[Delta]) -> Reply {
    let mut r = Reply::default();
    for d in deltas {
        match d {
            Delta::Reasoning(s) => r.reasoning.push_str(s),
            Delta::Content(s) => r.content.push_str(s),
            Delta::CallStart { id, name, .. } => r.calls.push(ToolCall {
                id: id.clone(),
                name: name.clone(),
                arguments: String::new(),
            }),
            Delta::CallArguments { index, fragment } => {
                if let Some(c) = r.calls.get_mut(*index) {
                    c.arguments.push_str(fragment);
                }
            }
        }
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools() -> ToolSchemas {
        ToolSchemas::from_tools(
            &serde_json::json!([{"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {
                "city": {"type": "string"}, "days": {"type": "integer"}, "hot": {"type": "boolean"},
                "ratio": {"type": "number"}, "opts": {"type": "object"}, "tags": {"type": "array"},
                "none": {"type": "null"}, "maybe": {"type": ["integer", "string"]}}}}}]),
        )
    }

    /// Feeds `text` in pieces of `step` bytes (on char boundaries) and collects the result.
    fn run(
        text: &str,
        step: usize,
        in_reasoning: bool,
        tools: Option<ToolSchemas>,
    ) -> (Vec<Delta>, Reply) {
        let mut p = OutputParser::new(in_reasoning, tools, "call_");
        let mut deltas = Vec::new();
        let chars: Vec<char> = text.chars().collect();
        for piece in chars.chunks(step) {
            deltas.extend(p.push(&piece.iter().collect::<String>()));
        }
        deltas.extend(p.finish());
        let c = collect(&deltas);
        (deltas, c)
    }

    #[test]
    fn reasoning_then_content_at_any_split() {
        for step in [1, 2, 3, 7, 100] {
            let (
                _,
                Reply {
                    reasoning: r,
                    content: c,
                    calls,
                },
            ) = run(
                "Let me think.\nOK.\n</think>\n\nThe answer is 4.",
                step,
                true,
                None,
            );
            assert_eq!(r, "Let me think.\nOK.", "step {step}");
            assert_eq!(c, "The answer is 4.", "step {step}");
            assert!(calls.is_empty());
        }
    }

    #[test]
    fn thinking_off_is_all_content_and_explicit_think_opens_reasoning() {
        let (
            _,
            Reply {
                reasoning: r,
                content: c,
                ..
            },
        ) = run("plain answer", 3, false, None);
        assert_eq!((r.as_str(), c.as_str()), ("", "plain answer"));
        let (
            _,
            Reply {
                reasoning: r,
                content: c,
                ..
            },
        ) = run("<think>\nhmm\n</think>\n\nyes", 2, false, None);
        assert_eq!((r.as_str(), c.as_str()), ("\nhmm", "yes"));
    }

    #[test]
    fn tool_call_is_parsed_and_typed_at_any_split() {
        let text = "I'll check.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=hot>\ntrue\n</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n<parameter=opts>\n{\"unit\": \"C\"}\n</parameter>\n<parameter=tags>\n[1, 2]\n</parameter>\n<parameter=none>\nnull\n</parameter>\n<parameter=maybe>\nabc\n</parameter>\n</function>\n</tool_call>";
        for step in [1, 4, 9, 1000] {
            let (
                deltas,
                Reply {
                    reasoning: r,
                    content: c,
                    calls,
                },
            ) = run(text, step, true, Some(tools()));
            assert_eq!(r, "I'll check.");
            assert_eq!(c, "", "step {step}");
            assert_eq!(calls.len(), 1);
            assert_eq!(calls[0].name, "get_weather");
            let args: Value = serde_json::from_str(&calls[0].arguments).unwrap();
            assert_eq!(
                args,
                serde_json::json!({"city": "Paris", "days": 3, "hot": true, "ratio": 0.5,
                    "opts": {"unit": "C"}, "tags": [1, 2], "none": null, "maybe": "abc"})
            );
            // streamed: the name comes before the arguments, in several fragments
            let frags = deltas
                .iter()
                .filter(|d| matches!(d, Delta::CallArguments { .. }))
                .count();
            assert!(frags >= 2, "step {step}: {frags}");
            assert!(matches!(
                deltas.iter().find(|d| !matches!(d, Delta::Reasoning(_))),
                Some(Delta::CallStart { .. })
            ));
        }
    }

    #[test]
    fn several_calls_and_a_call_inside_reasoning() {
        let text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nA\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nB\n</parameter>\n</function>\n</tool_call>";
        let (
            _,
            Reply {
                content: c, calls, ..
            },
        ) = run(text, 5, false, Some(tools()));
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[1].arguments, r#"{"city": "B"}"#);
        assert_eq!(calls[0].id, "call_0");
        assert_eq!(c, "");
        let inside = "thinking <tool_call>\n<function=get_weather>\n</function>\n</tool_call> more";
        let (
            _,
            Reply {
                reasoning: r,
                calls,
                ..
            },
        ) = run(inside, 3, true, Some(tools()));
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0].arguments, "{}");
        assert_eq!(r, "thinking  more");
    }

    #[test]
    fn invalid_calls_stay_text() {
        let (
            _,
            Reply {
                content: c, calls, ..
            },
        ) = run(
            "x <tool_call>\n<function=unknown_fn>\n</function>\n</tool_call> y",
            3,
            false,
            Some(tools()),
        );
        assert!(calls.is_empty());
        assert_eq!(
            c,
            "x <tool_call>\n<function=unknown_fn>\n</function>\n</tool_call> y"
        );
        let (
            _,
            Reply {
                content: c, calls, ..
            },
        ) = run("a <tool_call> not xml at all", 2, false, Some(tools()));
        assert!(calls.is_empty());
        assert_eq!(c, "a <tool_call> not xml at all");
        // tools not offered: the markup is plain text
        let (
            _,
            Reply {
                content: c, calls, ..
            },
        ) = run(
            "<tool_call>\n<function=get_weather>\n</function>\n</tool_call>",
            4,
            false,
            None,
        );
        assert!(calls.is_empty());
        assert!(c.starts_with("<tool_call>"));
    }

    #[test]
    fn unfinished_call_is_closed_at_the_end() {
        let (_, Reply { calls, .. }) = run(
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n",
            3,
            false,
            Some(tools()),
        );
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0].arguments, r#"{"city": "Rome"}"#);
    }

    #[test]
    fn partial_marker_text_is_released_when_it_is_not_a_marker() {
        let (
            _,
            Reply {
                reasoning: _,
                content: c,
                calls: _,
            },
        ) = run("a <thin b < c", 1, false, Some(tools()));
        assert_eq!(c, "a <thin b < c");
    }
}
