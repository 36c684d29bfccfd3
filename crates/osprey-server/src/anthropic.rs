//! The Anthropic Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) on the same
//! engine, for the clients and agents that speak it (the `anthropic` SDKs; coding agents pointed
//! at `ANTHROPIC_BASE_URL`). A request is translated into the chat-completions request it means
//! (system prompt; text, tool_use, tool_result and thinking blocks; tools and tool_choice;
//! thinking on or off) and checked by the same code; the reply's reasoning, text and tool calls
//! come back as `thinking`, `text` and `tool_use` blocks, streamed as Anthropic's events.
//! Errors use Anthropic's envelope, `{"type": "error", "error": {"type", "message"}}`.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};

use crate::api::{self, ApiError, ApiResult, Fields};
use crate::parse::{self, Delta};
use crate::worker::{Event, Usage};
use crate::{
    json_body, named_event_stream, prepare_chat_request, render_chat, whole_reply, AppState,
    PromptEnding,
};

/// Fields of a Messages request (count_tokens takes them too, less the generation ones).
const MESSAGE_FIELDS: &[&str] = &[
    "model",
    "messages",
    "max_tokens",
    "system",
    "stop_sequences",
    "stream",
    "temperature",
    "top_p",
    "top_k",
    "tools",
    "tool_choice",
    "thinking",
    "output_config",
    "output_format",
    "cache_control",
];

/// An error in Anthropic's envelope, its type from the HTTP status.
pub fn error(e: ApiError) -> Response {
    let kind = match e.status.as_u16() {
        400 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        _ => "api_error",
    };
    let body = json!({"type": "error", "error": {"type": kind, "message": e.message}});
    (e.status, Json(body)).into_response()
}

fn bad(message: impl Into<String>, field: &str) -> ApiError {
    ApiError::bad_request(message, Some(field))
}

/// The text of a string or of a list of text blocks (`what` names the field in errors).
fn text_of(v: &Value, what: &str) -> ApiResult<String> {
    let field = what.split(['[', '.']).next().unwrap_or(what);
    api::joined_text(v, &["text"], what, field)
}

/// The chat messages of a Messages request: the system prompt first, tool results as `tool`
/// messages (before the user's own text of that turn), assistant turns with their reasoning
/// and tool calls.
fn chat_messages(f: &Fields) -> ApiResult<Vec<Value>> {
    let mut out = Vec::new();
    if let Some(system) = f.get("system") {
        out.push(json!({"role": "system", "content": text_of(system, "system")?}));
    }
    let Some(list) = f.get("messages").and_then(Value::as_array) else {
        return Err(bad(
            "'messages' is required and must be a non-empty list",
            "messages",
        ));
    };
    for (i, m) in list.iter().enumerate() {
        let role = m.get("role").and_then(Value::as_str);
        let blocks = match m.get("content") {
            Some(Value::String(s)) => vec![json!({"type": "text", "text": s})],
            Some(Value::Array(a)) => a.clone(),
            _ => {
                return Err(bad(
                    format!("messages[{i}].content must be a string or a list of blocks"),
                    "messages",
                ))
            }
        };
        let unsupported = |j: usize, kind: Option<&str>| {
            bad(
                format!(
                    "messages[{i}].content[{j}]: {} blocks are not supported (text, tool_use, tool_result and thinking are)",
                    kind.map_or("untyped".to_string(), |k| format!("'{k}'"))
                ),
                "messages",
            )
        };
        match role {
            Some("user") => {
                let (mut text, mut results) = (String::new(), 0);
                for (j, b) in blocks.iter().enumerate() {
                    match b["type"].as_str() {
                        Some("text") => text.push_str(b["text"].as_str().ok_or_else(|| {
                            bad(
                                format!("messages[{i}].content[{j}].text must be a string"),
                                "messages",
                            )
                        })?),
                        Some("tool_result") => {
                            let id = b["tool_use_id"].as_str().ok_or_else(|| {
                                bad(
                                    format!("messages[{i}].content[{j}].tool_use_id is required"),
                                    "messages",
                                )
                            })?;
                            let what = format!("messages[{i}].content[{j}].content");
                            let content = match &b["content"] {
                                Value::Null => String::new(),
                                v => text_of(v, &what)?,
                            };
                            let content = if b["is_error"] == Value::Bool(true) {
                                format!("Error: {content}")
                            } else {
                                content
                            };
                            out.push(
                                json!({"role": "tool", "tool_call_id": id, "content": content}),
                            );
                            results += 1;
                        }
                        kind => return Err(unsupported(j, kind)),
                    }
                }
                if !text.is_empty() || results == 0 {
                    out.push(json!({"role": "user", "content": text}));
                }
            }
            Some("assistant") => {
                let (mut text, mut reasoning, mut calls) =
                    (String::new(), String::new(), Vec::new());
                for (j, b) in blocks.iter().enumerate() {
                    match b["type"].as_str() {
                        Some("text") => text.push_str(b["text"].as_str().unwrap_or_default()),
                        Some("thinking") => {
                            reasoning.push_str(b["thinking"].as_str().unwrap_or_default())
                        }
                        Some("redacted_thinking") => {}
                        Some("tool_use") => {
                            let (Some(id), Some(name)) = (b["id"].as_str(), b["name"].as_str())
                            else {
                                return Err(bad(
                                    format!("messages[{i}].content[{j}]: a tool_use block needs 'id' and 'name'"),
                                    "messages",
                                ));
                            };
                            let input = match &b["input"] {
                                Value::Null => json!({}),
                                v @ Value::Object(_) => v.clone(),
                                _ => {
                                    return Err(bad(
                                        format!(
                                            "messages[{i}].content[{j}].input must be an object"
                                        ),
                                        "messages",
                                    ))
                                }
                            };
                            calls.push(json!({"id": id, "type": "function", "function": {"name": name, "arguments": input}}));
                        }
                        kind => return Err(unsupported(j, kind)),
                    }
                }
                if i + 1 == list.len() && !calls.is_empty() {
                    return Err(bad(
                        "a final assistant message is a reply to continue, so it cannot end in tool_use blocks (send their tool_result in a user message)",
                        "messages",
                    ));
                }
                let mut msg = json!({"role": "assistant", "content": text});
                if !reasoning.is_empty() {
                    msg["reasoning_content"] = Value::String(reasoning);
                }
                if !calls.is_empty() {
                    msg["tool_calls"] = Value::Array(calls);
                }
                out.push(msg);
            }
            _ => {
                return Err(bad(
                    format!("messages[{i}].role must be \"user\" or \"assistant\""),
                    "messages",
                ))
            }
        }
    }
    Ok(out)
}

/// Client tools (`{name, description, input_schema}`) as chat-completions functions.
fn chat_tools(v: &Value) -> ApiResult<Value> {
    let Some(list) = v.as_array() else {
        return Err(bad("'tools' must be a list", "tools"));
    };
    let mut out = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        if let Some(kind) = t["type"].as_str().filter(|k| *k != "custom") {
            return Err(bad(
                format!("tools[{i}]: server tools ('{kind}') are not supported, only client tools"),
                "tools",
            ));
        }
        let Some(name) = t["name"].as_str().filter(|n| !n.is_empty()) else {
            return Err(bad(format!("tools[{i}].name is required"), "tools"));
        };
        let schema = match &t["input_schema"] {
            v @ Value::Object(_) => v.clone(),
            _ => {
                return Err(bad(
                    format!("tools[{i}].input_schema must be a JSON schema object"),
                    "tools",
                ))
            }
        };
        let mut function = json!({"name": name, "parameters": schema});
        if let Some(d) = t["description"].as_str() {
            function["description"] = Value::String(d.to_string());
        }
        out.push(json!({"type": "function", "function": function}));
    }
    Ok(Value::Array(out))
}

fn chat_tool_choice(v: &Value) -> ApiResult<Value> {
    match (v["type"].as_str(), v["name"].as_str()) {
        (Some("auto"), _) => Ok(json!("auto")),
        (Some("any"), _) => Ok(json!("required")),
        (Some("none"), _) => Ok(json!("none")),
        (Some("tool"), Some(name)) => Ok(json!({"type": "function", "function": {"name": name}})),
        _ => Err(bad(
            "'tool_choice' must be {\"type\": \"auto\"}, {\"type\": \"any\"}, {\"type\": \"none\"} or {\"type\": \"tool\", \"name\": ...}",
            "tool_choice",
        )),
    }
}

/// The chat-completions request a Messages request means (`count_only`: for count_tokens,
/// which needs no `max_tokens`).
pub fn chat_request(body: &Value, count_only: bool) -> ApiResult<Value> {
    let f = Fields::parse(body)?;
    f.check_known(MESSAGE_FIELDS)?;
    let mut out = Map::new();
    let messages = chat_messages(&f)?;
    // a final assistant message is the start of the reply (Anthropic's "prefill"): the model
    // continues it, and the response holds only what it adds
    if messages.last().is_some_and(|m| m["role"] == "assistant") {
        out.insert("continue_final_message".into(), Value::Bool(true));
    }
    out.insert("messages".into(), Value::Array(messages));
    if let Some(format) = structured_output(&f)? {
        out.insert("response_format".into(), format);
    }
    if let Some(m) = f.get("model") {
        out.insert("model".into(), m.clone());
    }
    match f.get("max_tokens") {
        Some(v) => {
            out.insert("max_tokens".into(), v.clone());
        }
        None if !count_only => return Err(bad("'max_tokens' is required", "max_tokens")),
        None => {}
    }
    if !count_only {
        for k in ["temperature", "top_p", "top_k", "stream"] {
            if let Some(v) = f.get(k) {
                out.insert(k.into(), v.clone());
            }
        }
        if let Some(v) = f.get("stop_sequences") {
            let ok = v
                .as_array()
                .is_some_and(|a| a.len() <= 16 && a.iter().all(Value::is_string));
            if !ok {
                return Err(bad(
                    "'stop_sequences' must be a list of at most 16 strings",
                    "stop_sequences",
                ));
            }
            out.insert("stop".into(), v.clone());
        }
    }
    if let Some(t) = f.get("tools") {
        out.insert("tools".into(), chat_tools(t)?);
    }
    if let Some(c) = f.get("tool_choice") {
        out.insert("tool_choice".into(), chat_tool_choice(c)?);
        match &c["disable_parallel_tool_use"] {
            Value::Null | Value::Bool(false) => {}
            Value::Bool(true) => {
                out.insert("parallel_tool_calls".into(), Value::Bool(false));
            }
            v => {
                return Err(bad(
                    format!(
                        "'tool_choice.disable_parallel_tool_use' must be true or false, got {v}"
                    ),
                    "tool_choice",
                ))
            }
        }
    }
    if let Some(t) = f.get("thinking") {
        let on = match t["type"].as_str() {
            Some("enabled" | "adaptive") => true,
            Some("disabled") => false,
            _ => {
                return Err(bad(
                    "'thinking' must be {\"type\": \"enabled\"} or {\"type\": \"disabled\"}",
                    "thinking",
                ))
            }
        };
        out.insert(
            "chat_template_kwargs".into(),
            json!({"enable_thinking": on}),
        );
        match &t["budget_tokens"] {
            Value::Null => {}
            Value::Number(n) if on && n.as_u64().is_some() => {
                out.insert("thinking_token_budget".into(), Value::Number(n.clone()));
            }
            v => {
                return Err(bad(
                    format!("'thinking.budget_tokens' must be a non-negative integer with thinking enabled, got {v}"),
                    "thinking",
                ))
            }
        }
    }
    Ok(Value::Object(out))
}

/// Anthropic's structured outputs as the chat request's `response_format`: `output_config.format`
/// (what the SDK's `messages.parse` sends) or the beta's `output_format`, both
/// `{"type": "json_schema", "schema": ...}`, held to the schema by the same grammar. The output
/// effort is accepted and changes nothing (the model has no graded effort). A top-level
/// `cache_control` needs nothing: every prompt's prefix is cached.
fn structured_output(f: &Fields) -> ApiResult<Option<Value>> {
    let mut format = f.get("output_format");
    if let Some(config) = f.get("output_config") {
        let Some(config) = config.as_object() else {
            return Err(bad("'output_config' must be an object", "output_config"));
        };
        for (k, v) in config {
            match (k.as_str(), v) {
                ("format", v) if !v.is_null() => format = format.or(Some(v)),
                ("format", _) => {}
                ("effort", Value::String(e))
                    if ["low", "medium", "high", "xhigh", "max"].contains(&e.as_str()) => {}
                ("effort", Value::Null) => {}
                _ => {
                    return Err(bad(
                        format!("'output_config.{k}': expected format (a json_schema) or effort (low, medium, high, xhigh, max), got {v}"),
                        "output_config",
                    ))
                }
            }
        }
    }
    let Some(format) = format else {
        return Ok(None);
    };
    match (format["type"].as_str(), format.get("schema")) {
        (Some("json_schema"), Some(schema)) if schema.is_object() => Ok(Some(json!({
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": schema, "strict": true}
        }))),
        _ => Err(bad(
            format!("the output format must be {{\"type\": \"json_schema\", \"schema\": {{...}}}}, got {format}"),
            "output_config",
        )),
    }
}

fn stop_reason(finish: &str, stop_sequence: Option<&str>) -> &'static str {
    match finish {
        "length" => "max_tokens",
        "tool_calls" => "tool_use",
        _ if stop_sequence.is_some() => "stop_sequence",
        _ => "end_turn",
    }
}

/// Anthropic counts prompt tokens read from the cache apart from the others.
fn usage_json(u: &Usage) -> Value {
    json!({"input_tokens": u.prompt_tokens - u.cached_tokens, "output_tokens": u.completion_tokens,
           "cache_read_input_tokens": u.cached_tokens, "cache_creation_input_tokens": 0})
}

/// The content blocks of a whole reply.
fn content_blocks(r: parse::Reply) -> Vec<Value> {
    let mut blocks = Vec::new();
    if !r.reasoning.is_empty() {
        blocks.push(json!({"type": "thinking", "thinking": r.reasoning, "signature": ""}));
    }
    if !r.content.is_empty() {
        blocks.push(json!({"type": "text", "text": r.content}));
    }
    for c in r.calls {
        let input: Value = serde_json::from_str(&c.arguments).unwrap_or_else(|_| json!({}));
        blocks.push(json!({"type": "tool_use", "id": c.id, "name": c.name, "input": input}));
    }
    blocks
}

/// The block being streamed.
#[derive(Clone, Copy, PartialEq)]
enum Open {
    Thinking,
    Text,
    Tool(usize),
}

/// Turns the parser's deltas into content-block events, opening and closing blocks as the kind
/// of text changes.
#[derive(Default)]
struct BlockStream {
    next: usize,
    open: Option<Open>,
}

impl BlockStream {
    fn close(&mut self, out: &mut Vec<(&'static str, Value)>) {
        if self.open.take().is_some() {
            out.push((
                "content_block_stop",
                json!({"type": "content_block_stop", "index": self.next}),
            ));
            self.next += 1;
        }
    }

    fn start(&mut self, kind: Open, block: Value, out: &mut Vec<(&'static str, Value)>) {
        self.close(out);
        self.open = Some(kind);
        out.push((
            "content_block_start",
            json!({"type": "content_block_start", "index": self.next, "content_block": block}),
        ));
    }

    fn delta(&self, delta: Value) -> (&'static str, Value) {
        (
            "content_block_delta",
            json!({"type": "content_block_delta", "index": self.next, "delta": delta}),
        )
    }

    fn push(&mut self, d: &Delta, out: &mut Vec<(&'static str, Value)>) {
        match d {
            Delta::Reasoning(s) if !s.is_empty() => {
                if self.open != Some(Open::Thinking) {
                    self.start(
                        Open::Thinking,
                        json!({"type": "thinking", "thinking": "", "signature": ""}),
                        out,
                    );
                }
                out.push(self.delta(json!({"type": "thinking_delta", "thinking": s})));
            }
            Delta::Content(s) if !s.is_empty() => {
                if self.open != Some(Open::Text) {
                    self.start(Open::Text, json!({"type": "text", "text": ""}), out);
                }
                out.push(self.delta(json!({"type": "text_delta", "text": s})));
            }
            Delta::CallStart { index, id, name } => self.start(
                Open::Tool(*index),
                json!({"type": "tool_use", "id": id, "name": name, "input": {}}),
                out,
            ),
            Delta::CallArguments { index, fragment } if self.open == Some(Open::Tool(*index)) => {
                out.push(self.delta(json!({"type": "input_json_delta", "partial_json": fragment})));
            }
            _ => {}
        }
    }
}

/// `POST /v1/messages`
pub async fn messages(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let received = Instant::now();
    let prepared = json_body(body)
        .and_then(|b| chat_request(&b, false))
        .and_then(|chat| prepare_chat_request(&st, &chat, received, "toolu_"));
    let (job, mut rx, gen) = match prepared {
        Ok(p) => p,
        Err(e) => return error(e),
    };
    let input_tokens = job.prompt.len();
    if let Err(e) = st.enqueue(job) {
        return error(e);
    }
    let id = st.next_id("msg").replacen('-', "_", 1);
    let model = st.cfg.model_name.clone();
    if gen.stream {
        let start = json!({"type": "message_start", "message": {"id": id, "type": "message", "role": "assistant",
            "model": model, "content": [], "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": input_tokens, "output_tokens": 0}}});
        let mut blocks = BlockStream::default();
        return named_event_stream(
            vec![("message_start", start)],
            rx,
            move |ev, out| match ev {
                Event::Deltas { deltas, .. } => {
                    deltas.iter().for_each(|d| blocks.push(d, out));
                    false
                }
                // (a chat request never asks for its prompt back)
                Event::Prompt { .. } => false,
                Event::Done {
                    finish_reason,
                    stop_sequence,
                    usage,
                } => {
                    blocks.close(out);
                    let reason = stop_reason(finish_reason, stop_sequence.as_deref());
                    out.push((
                    "message_delta",
                    json!({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": stop_sequence},
                           "usage": usage_json(&usage)}),
                ));
                    out.push(("message_stop", json!({"type": "message_stop"})));
                    true
                }
                Event::Error { message, .. } => {
                    out.push((
                    "error",
                    json!({"type": "error", "error": {"type": "api_error", "message": message}}),
                ));
                    true
                }
            },
        );
    }

    match whole_reply(&mut rx).await {
        Ok(w) => {
            let reason = stop_reason(w.finish_reason, w.stop_sequence.as_deref());
            Json(
                json!({"id": id, "type": "message", "role": "assistant", "model": model,
                        "content": content_blocks(parse::collect(&w.deltas)), "stop_reason": reason,
                        "stop_sequence": w.stop_sequence, "usage": usage_json(&w.usage)}),
            )
            .into_response()
        }
        Err(e) => error(e),
    }
}

/// `POST /v1/messages/count_tokens`: the prompt's length in tokens as this model reads it.
pub async fn count_tokens(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let counted = (|| -> ApiResult<usize> {
        let chat = chat_request(&json_body(body)?, true)?;
        let f = Fields::parse(&chat)?;
        st.check_model(&f)?;
        let tools = api::tools(&f)?;
        let ending = PromptEnding::parse(&f)?;
        let (_, prompt) = render_chat(&st, &f, api::messages(&f)?, &tools, ending)?;
        Ok(prompt.len())
    })();
    match counted {
        Ok(n) => Json(json!({"input_tokens": n})).into_response(),
        Err(e) => error(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tool_conversation_becomes_chat_messages() {
        let body = json!({
            "model": "m", "max_tokens": 50, "system": [{"type": "text", "text": "Be brief."}],
            "stop_sequences": ["END"], "thinking": {"type": "disabled"},
            "tools": [{"name": "get_weather", "description": "Weather", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "tool", "name": "get_weather"},
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "Use the tool.", "signature": "x"},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "21C"}]},
                    {"type": "text", "text": "And tomorrow?"}]}
            ]
        });
        let chat = chat_request(&body, false).unwrap();
        assert_eq!(
            chat,
            json!({
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Weather in Paris?"},
                    {"role": "assistant", "content": "", "reasoning_content": "Use the tool.",
                     "tool_calls": [{"id": "toolu_1", "type": "function",
                                     "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                    {"role": "tool", "tool_call_id": "toolu_1", "content": "21C"},
                    {"role": "user", "content": "And tomorrow?"}
                ],
                "model": "m", "max_tokens": 50, "stop": ["END"],
                "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"},
                           "description": "Weather"}}],
                "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                "chat_template_kwargs": {"enable_thinking": false}
            })
        );
    }

    #[test]
    fn structured_outputs_become_a_json_schema_response_format() {
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let expected = json!({"type": "json_schema",
                              "json_schema": {"name": "output", "schema": schema, "strict": true}});
        let user = json!([{"role": "user", "content": "x"}]);
        for body in [
            json!({"max_tokens": 5, "messages": user, "cache_control": {"type": "ephemeral"},
                   "output_config": {"format": {"type": "json_schema", "schema": schema}, "effort": "high"}}),
            json!({"max_tokens": 5, "messages": user,
                   "output_format": {"type": "json_schema", "schema": schema}}),
        ] {
            let chat = chat_request(&body, false).unwrap();
            assert_eq!(chat["response_format"], expected, "{body}");
        }
        let plain = json!({"max_tokens": 5, "messages": user, "output_config": {"effort": "low"}});
        assert_eq!(
            chat_request(&plain, false).unwrap().get("response_format"),
            None
        );
        for (bad, says) in [
            (json!({"output_config": {"effort": "extreme"}}), "effort"),
            (
                json!({"output_config": {"format": {"type": "json_object"}}}),
                "json_schema",
            ),
            (
                json!({"output_format": {"type": "json_schema"}}),
                "json_schema",
            ),
            (json!({"output_config": "json"}), "must be an object"),
        ] {
            let mut body = json!({"max_tokens": 5, "messages": user});
            for (k, v) in bad.as_object().unwrap() {
                body[k] = v.clone();
            }
            let e = chat_request(&body, false).unwrap_err();
            assert!(e.message.contains(says), "{body}: {}", e.message);
        }
    }

    #[test]
    fn a_final_assistant_message_is_continued() {
        let body = json!({"max_tokens": 5, "messages": [{"role": "user", "content": "x"},
                          {"role": "assistant", "content": [{"type": "text", "text": "{\"a\": "}]}]});
        let chat = chat_request(&body, false).unwrap();
        assert_eq!(chat["continue_final_message"], true);
        assert_eq!(chat["messages"][1]["content"], "{\"a\": ");
        let asked = json!({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}]});
        assert_eq!(
            chat_request(&asked, false)
                .unwrap()
                .get("continue_final_message"),
            None
        );
    }

    #[test]
    fn the_thinking_budget_is_enforced_as_thinking_token_budget() {
        let body = json!({"model": "m", "max_tokens": 4096, "messages": [{"role": "user", "content": "hi"}],
                          "thinking": {"type": "enabled", "budget_tokens": 2048}});
        let chat = chat_request(&body, false).unwrap();
        assert_eq!(chat["thinking_token_budget"], 2048);
        assert_eq!(chat["chat_template_kwargs"]["enable_thinking"], true);
        let off = json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
                         "thinking": {"type": "disabled", "budget_tokens": 10}});
        assert!(chat_request(&off, false).is_err());
    }

    #[test]
    fn bad_requests_name_the_problem() {
        let user = json!([{"role": "user", "content": "hi"}]);
        for (body, says) in [
            (json!({"messages": user}), "'max_tokens' is required"),
            (json!({"max_tokens": 5}), "'messages' is required"),
            (json!({"max_tokens": 5, "messages": user, "n": 2}), "'n'"),
            (
                json!({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}),
                "'image' blocks are not supported",
            ),
            (
                json!({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}),
                "must be \"user\" or \"assistant\"",
            ),
            (
                json!({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": [
                    {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]}),
                "cannot end in tool_use",
            ),
            (
                json!({"max_tokens": 5, "messages": user, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}),
                "server tools",
            ),
            (
                json!({"max_tokens": 5, "messages": user, "tool_choice": {"type": "tool"}}),
                "'tool_choice' must be",
            ),
            (
                json!({"max_tokens": 5, "messages": user, "thinking": {"type": "maybe"}}),
                "'thinking' must be",
            ),
            (
                json!({"max_tokens": 5, "messages": user, "stop_sequences": "END"}),
                "'stop_sequences'",
            ),
        ] {
            let err = chat_request(&body, false).unwrap_err();
            assert_eq!(err.status.as_u16(), 400);
            assert!(err.message.contains(says), "{body}: {}", err.message);
        }
        assert!(chat_request(&json!({"messages": user}), true).is_ok());
    }

    #[test]
    fn deltas_stream_as_content_blocks() {
        let mut s = BlockStream::default();
        let mut out = Vec::new();
        for d in [
            Delta::Reasoning("Hm".into()),
            Delta::Reasoning(".".into()),
            Delta::Content("Let me check.".into()),
            Delta::CallStart {
                index: 0,
                id: "toolu_a".into(),
                name: "f".into(),
            },
            Delta::CallArguments {
                index: 0,
                fragment: "{\"x\": ".into(),
            },
            Delta::CallArguments {
                index: 0,
                fragment: "1}".into(),
            },
        ] {
            s.push(&d, &mut out);
        }
        s.close(&mut out);
        let got: Vec<(String, Value, Value)> = out
            .into_iter()
            .map(|(n, v)| {
                (
                    n.to_string(),
                    v["index"].clone(),
                    v["delta"]["type"].clone(),
                )
            })
            .collect();
        let want = [
            ("content_block_start", 0, Value::Null),
            ("content_block_delta", 0, json!("thinking_delta")),
            ("content_block_delta", 0, json!("thinking_delta")),
            ("content_block_stop", 0, Value::Null),
            ("content_block_start", 1, Value::Null),
            ("content_block_delta", 1, json!("text_delta")),
            ("content_block_stop", 1, Value::Null),
            ("content_block_start", 2, Value::Null),
            ("content_block_delta", 2, json!("input_json_delta")),
            ("content_block_delta", 2, json!("input_json_delta")),
            ("content_block_stop", 2, Value::Null),
        ];
        let want: Vec<(String, Value, Value)> = want
            .into_iter()
            .map(|(n, i, d)| (n.to_string(), json!(i), d))
            .collect();
        assert_eq!(got, want);
    }

    #[test]
    fn finish_reasons_map_to_stop_reasons() {
        assert_eq!(stop_reason("stop", None), "end_turn");
        assert_eq!(stop_reason("stop", Some("END")), "stop_sequence");
        assert_eq!(stop_reason("length", None), "max_tokens");
        assert_eq!(stop_reason("tool_calls", None), "tool_use");
    }
}
