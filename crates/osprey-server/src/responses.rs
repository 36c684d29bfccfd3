//! OpenAI's Responses API (`POST /v1/responses`) on the same engine, for the clients and agents
//! that speak it (the `openai` SDKs' `client.responses`, coding agents). A conversation comes whole
//! in `input`, or continues a stored response's (`previous_response_id`: responses are kept in
//! memory unless `store: false`, a bounded number, see `ResponseStore`). A request is translated into the chat-completions request it
//! means (`instructions` and system/developer messages, user and assistant messages,
//! `function_call` and `function_call_output` items, `reasoning` items as the assistant turn's
//! reasoning; function tools and `tool_choice`; `text.format` as `response_format`;
//! `reasoning.effort: "none"` as thinking off) and checked by the same code; the reply's
//! reasoning, text and calls come back as `reasoning`, `message` and `function_call` output items,
//! streamed as the API's `response.*` events.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};

use crate::api::{joined_text, ApiError, ApiResult, Fields};
use crate::parse::{self, Delta};
use crate::worker::{Event, Usage};
use crate::{
    json_body, named_event_stream, now, prepare_chat_request, whole_reply, AppState,
    REASONING_EFFORTS,
};

const RESPONSE_FIELDS: &[&str] = &[
    "model",
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "max_output_tokens",
    "temperature",
    "top_p",
    "stream",
    "text",
    "reasoning",
    "store",
    "metadata",
    "user",
    "parallel_tool_calls",
    "truncation",
    "service_tier",
    "previous_response_id",
    "conversation",
    "background",
    // hints for OpenAI's own caching, storage and safety systems: nothing to do here
    "include",
    "prompt_cache_key",
    "prompt_cache_retention",
    "safety_identifier",
    "max_tool_calls",
    // extensions, as on chat completions
    "chat_template_kwargs",
    "thinking_token_budget",
];

fn bad(message: impl Into<String>, field: &str) -> ApiError {
    ApiError::bad_request(message, Some(field))
}

/// The text of a string or a list of text parts (`at` names it in errors).
fn content_text(v: &Value, at: &str) -> ApiResult<String> {
    joined_text(v, &["input_text", "output_text", "text"], at, "input")
}

/// The conversation so far (`history`: an earlier response's) with `input`'s items appended as
/// chat messages. Consecutive `function_call` items (and a `reasoning` item before them) join the
/// assistant turn they belong to.
fn chat_messages(f: &Fields, history: Vec<Value>) -> ApiResult<Vec<Value>> {
    let mut out = history;
    let items = match f.get("input") {
        Some(Value::String(s)) => vec![json!({"role": "user", "content": s})],
        Some(Value::Array(a)) if !a.is_empty() => a.clone(),
        _ => {
            return Err(bad(
                "'input' is required: a string or a non-empty list of items",
                "input",
            ))
        }
    };
    let mut reasoning: Option<String> = None;
    for (i, item) in items.iter().enumerate() {
        let at = format!("input[{i}]");
        let kind = item["type"]
            .as_str()
            .unwrap_or(if item.get("role").is_some() {
                "message"
            } else {
                ""
            });
        match kind {
            "message" => {
                let role = match item["role"].as_str() {
                    Some("developer" | "system") => "system",
                    Some(r @ ("user" | "assistant")) => r,
                    other => {
                        return Err(bad(
                            format!("{at}.role must be user, assistant, system or developer, got {other:?}"),
                            "input",
                        ))
                    }
                };
                let mut m = json!({"role": role, "content": content_text(&item["content"], &format!("{at}.content"))?});
                if role == "assistant" {
                    if let Some(r) = reasoning.take() {
                        m["reasoning_content"] = r.into();
                    }
                }
                out.push(m);
            }
            "reasoning" => {
                let parts = item["content"].as_array().or(item["summary"].as_array());
                let text: String = parts
                    .into_iter()
                    .flatten()
                    .filter_map(|p| p["text"].as_str())
                    .collect();
                reasoning = Some(text);
            }
            "function_call" => {
                let (Some(call_id), Some(name), Some(arguments)) = (
                    item["call_id"].as_str(),
                    item["name"].as_str(),
                    item["arguments"].as_str(),
                ) else {
                    return Err(bad(
                        format!("{at}: a function_call needs call_id, name and arguments (a JSON string)"),
                        "input",
                    ));
                };
                let call = json!({"id": call_id, "type": "function",
                                  "function": {"name": name, "arguments": arguments}});
                // joins the assistant turn just before it, or opens one
                let joins = out.last().is_some_and(|m| {
                    m["role"] == "assistant" && reasoning.is_none()
                });
                if joins {
                    if let Some(m) = out.last_mut() {
                        match m["tool_calls"].as_array_mut() {
                            Some(calls) => calls.push(call),
                            None => m["tool_calls"] = json!([call]),
                        }
                    }
                } else {
                    let mut m = json!({"role": "assistant", "content": "", "tool_calls": [call]});
                    if let Some(r) = reasoning.take() {
                        m["reasoning_content"] = r.into();
                    }
                    out.push(m);
                }
            }
            "function_call_output" => {
                let (Some(call_id), Some(output)) =
                    (item["call_id"].as_str(), item.get("output"))
                else {
                    return Err(bad(
                        format!("{at}: a function_call_output needs call_id and output"),
                        "input",
                    ));
                };
                let text = match output {
                    Value::String(s) => s.clone(),
                    other => content_text(other, &format!("{at}.output"))?,
                };
                out.push(json!({"role": "tool", "tool_call_id": call_id, "content": text}));
            }
            other => {
                return Err(bad(
                    format!("{at}: {other:?} items are not supported (message, reasoning, function_call and function_call_output are)"),
                    "input",
                ))
            }
        }
    }
    Ok(out)
}

/// Conversations of earlier responses, for `previous_response_id`: by response id, the chat
/// messages it ended with (its `instructions` left out: they do not carry over), least recently
/// stored dropped beyond `STORED_RESPONSES` or `STORED_BYTES` of JSON. Memory only: a restart
/// forgets them.
#[derive(Default)]
pub struct ResponseStore {
    order: VecDeque<(String, usize)>,
    conversations: HashMap<String, Vec<Value>>,
    bytes: usize,
}

const STORED_RESPONSES: usize = 1024;
const STORED_BYTES: usize = 256 << 20;

impl ResponseStore {
    fn get(&self, id: &str) -> Option<Vec<Value>> {
        self.conversations.get(id).cloned()
    }

    fn put(&mut self, id: String, conversation: Vec<Value>) {
        let size = serde_json::to_string(&conversation).map_or(0, |s| s.len());
        self.bytes += size;
        self.order.push_back((id.clone(), size));
        self.conversations.insert(id, conversation);
        while self.order.len() > STORED_RESPONSES || self.bytes > STORED_BYTES {
            let Some((old, size)) = self.order.pop_front() else {
                break;
            };
            self.bytes -= size;
            self.conversations.remove(&old);
        }
    }
}

/// The chat-completions request a Responses request means, and its conversation without
/// `instructions` (what a later `previous_response_id` continues). `history` looks up an earlier
/// response's conversation.
pub fn chat_request(
    body: &Value,
    history: impl Fn(&str) -> Option<Vec<Value>>,
) -> ApiResult<(Value, Vec<Value>)> {
    let f = Fields::parse(body)?;
    f.check_known(RESPONSE_FIELDS)?;
    let earlier = match f.get("previous_response_id") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(id)) => history(id).ok_or_else(|| {
            bad(
                format!("'previous_response_id' {id:?} not found: this server keeps the last {STORED_RESPONSES} responses stored with store: true, in memory"),
                "previous_response_id",
            )
        })?,
        Some(_) => {
            return Err(bad(
                "'previous_response_id' must be a string",
                "previous_response_id",
            ))
        }
    };
    if f.get("conversation").is_some_and(|v| !v.is_null()) {
        return Err(bad(
            "'conversation' is not supported: this server keeps no conversations; send the whole conversation in 'input'",
            "conversation",
        ));
    }
    if f.get("background") == Some(&Value::Bool(true)) {
        return Err(bad(
            "'background' responses are not supported: this server answers while the request waits",
            "background",
        ));
    }
    let conversation = chat_messages(&f, earlier)?;
    let mut messages = Vec::new();
    if let Some(i) = f.get("instructions").filter(|i| !i.is_null()) {
        let Some(text) = i.as_str() else {
            return Err(bad("'instructions' must be a string", "instructions"));
        };
        messages.push(json!({"role": "system", "content": text}));
    }
    messages.extend(conversation.iter().cloned());
    let mut out = Map::new();
    out.insert("messages".into(), Value::Array(messages));
    if let Some(v) = f.get("max_output_tokens").filter(|v| !v.is_null()) {
        if !v
            .as_u64()
            .is_some_and(|n| (1..=u32::MAX as u64).contains(&n))
        {
            return Err(bad(
                format!("'max_output_tokens' must be a positive integer, got {v}"),
                "max_output_tokens",
            ));
        }
    }
    for (from, to) in [
        ("model", "model"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("stream", "stream"),
        ("max_output_tokens", "max_tokens"),
    ] {
        if let Some(v) = f.get(from).filter(|v| !v.is_null()) {
            out.insert(to.into(), v.clone());
        }
    }
    for k in ["chat_template_kwargs", "thinking_token_budget"] {
        if let Some(v) = f.get(k) {
            out.insert(k.into(), v.clone());
        }
    }
    // true, the default, needs nothing; anything else is the chat request's to check
    if let Some(v) = f
        .get("parallel_tool_calls")
        .filter(|v| **v != Value::Bool(true))
    {
        out.insert("parallel_tool_calls".into(), v.clone());
    }
    // the chat request's reasoning_effort: "none" turns thinking off, the others change nothing
    if let Some(r) = f.get("reasoning").filter(|r| !r.is_null()) {
        match r.get("effort").filter(|e| !e.is_null()) {
            Some(Value::String(e)) if e == "none" => {
                out.insert("reasoning_effort".into(), e.as_str().into());
            }
            None => {}
            Some(Value::String(e)) if REASONING_EFFORTS.contains(&e.as_str()) => {}
            Some(other) => {
                return Err(bad(
                    format!(
                        "'reasoning.effort' {other}: one of {}",
                        REASONING_EFFORTS.join(", ")
                    ),
                    "reasoning",
                ))
            }
        }
    }
    if let Some(tools) = f.get("tools") {
        let Some(list) = tools.as_array() else {
            return Err(bad("'tools' must be a list", "tools"));
        };
        let mut chat_tools = Vec::new();
        for (i, t) in list.iter().enumerate() {
            if t["type"] != "function" || !t["name"].is_string() {
                return Err(bad(
                    format!("tools[{i}]: only function tools with a name are supported"),
                    "tools",
                ));
            }
            let mut function = json!({"name": t["name"], "parameters": t.get("parameters").cloned().unwrap_or(json!({"type": "object"}))});
            if let Some(d) = t.get("description").filter(|d| !d.is_null()) {
                function["description"] = d.clone();
            }
            chat_tools.push(json!({"type": "function", "function": function}));
        }
        out.insert("tools".into(), Value::Array(chat_tools));
    }
    if let Some(c) = f.get("tool_choice") {
        let choice = match c {
            Value::String(s) if ["auto", "none", "required"].contains(&s.as_str()) => c.clone(),
            Value::Object(o) if o.get("type") == Some(&json!("function")) => match o.get("name") {
                Some(name) if name.is_string() => {
                    json!({"type": "function", "function": {"name": name}})
                }
                _ => {
                    return Err(bad(
                        "'tool_choice' {\"type\": \"function\"} needs the function's \"name\"",
                        "tool_choice",
                    ))
                }
            },
            _ => {
                return Err(bad(
                    "'tool_choice' must be auto, none, required or {\"type\": \"function\", \"name\": ...}",
                    "tool_choice",
                ))
            }
        };
        out.insert("tool_choice".into(), choice);
    }
    if let Some(format) = f.get("text").and_then(|t| t.get("format")) {
        match format["type"].as_str() {
            Some("text") => {}
            Some("json_object") => {
                out.insert("response_format".into(), json!({"type": "json_object"}));
            }
            Some("json_schema") => {
                let mut schema = json!({"name": format["name"].as_str().unwrap_or("response"),
                                        "schema": format.get("schema").cloned().unwrap_or(Value::Null)});
                if let Some(s) = format.get("strict") {
                    schema["strict"] = s.clone();
                }
                out.insert(
                    "response_format".into(),
                    json!({"type": "json_schema", "json_schema": schema}),
                );
            }
            _ => {
                return Err(bad(
                    "'text.format.type' must be text, json_object or json_schema",
                    "text",
                ))
            }
        }
    }
    Ok((Value::Object(out), conversation))
}

fn usage_json(u: &Usage) -> Value {
    json!({"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens},
           "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
           "total_tokens": u.prompt_tokens + u.completion_tokens})
}

/// The fields every response object carries, with its status, output and usage.
struct Head {
    id: String,
    model: String,
    created_at: u64,
    request: Value,
}

impl Head {
    /// The response once the engine is done: incomplete when cut at max_output_tokens.
    fn finished(&self, finish_reason: &str, output: Vec<Value>, usage: &Usage) -> Value {
        let incomplete = finish_reason == "length";
        let status = if incomplete {
            "incomplete"
        } else {
            "completed"
        };
        self.response(status, output, usage_json(usage), incomplete)
    }

    fn response(&self, status: &str, output: Vec<Value>, usage: Value, incomplete: bool) -> Value {
        let r = &self.request;
        json!({"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
               "model": self.model, "output": output, "error": null,
               "incomplete_details": if incomplete { json!({"reason": "max_output_tokens"}) } else { Value::Null },
               "instructions": r.get("instructions").cloned().unwrap_or(Value::Null),
               "max_output_tokens": r.get("max_output_tokens").cloned().unwrap_or(Value::Null),
               "parallel_tool_calls": true,
               "previous_response_id": r.get("previous_response_id").cloned().unwrap_or(Value::Null),
               "temperature": r.get("temperature").cloned().unwrap_or(Value::Null),
               "top_p": r.get("top_p").cloned().unwrap_or(Value::Null),
               "tool_choice": r.get("tool_choice").cloned().unwrap_or(json!("auto")),
               "tools": r.get("tools").cloned().unwrap_or(json!([])),
               "text": r.get("text").cloned().unwrap_or(json!({"format": {"type": "text"}})),
               "metadata": r.get("metadata").cloned().unwrap_or(json!({})),
               "store": r.get("store") != Some(&Value::Bool(false)), "usage": usage})
    }
}

fn reasoning_item(id: &str, text: &str) -> Value {
    json!({"type": "reasoning", "id": id, "summary": [], "content": [{"type": "reasoning_text", "text": text}]})
}

fn message_item(id: &str, text: &str, status: &str) -> Value {
    json!({"type": "message", "id": id, "role": "assistant", "status": status,
           "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]})
}

fn call_item(id: &str, call: &parse::ToolCall, status: &str) -> Value {
    json!({"type": "function_call", "id": id, "call_id": call.id, "name": call.name,
           "arguments": call.arguments, "status": status})
}

/// A reply as the assistant chat message a later turn's template reads.
fn assistant_message(r: &parse::Reply) -> Value {
    let mut m = json!({"role": "assistant", "content": r.content});
    if !r.reasoning.is_empty() {
        m["reasoning_content"] = r.reasoning.clone().into();
    }
    if !r.calls.is_empty() {
        m["tool_calls"] = r.calls.iter().map(parse::ToolCall::chat_json).collect();
    }
    m
}

/// The output items of a whole reply.
fn output_items(r: &parse::Reply, id: &str) -> Vec<Value> {
    let mut items = Vec::new();
    if !r.reasoning.is_empty() {
        items.push(reasoning_item(
            &format!("rs_{id}_{}", items.len()),
            &r.reasoning,
        ));
    }
    if !r.content.is_empty() {
        items.push(message_item(
            &format!("msg_{id}_{}", items.len()),
            &r.content,
            "completed",
        ));
    }
    for c in &r.calls {
        items.push(call_item(
            &format!("fc_{id}_{}", items.len()),
            c,
            "completed",
        ));
    }
    items
}

/// The item being streamed: its kind, id and text so far.
/// The two kinds of text item a reply streams: its reasoning and its message.
#[derive(Clone, Copy, PartialEq)]
enum TextKind {
    Reasoning,
    Message,
}

impl TextKind {
    fn id_prefix(self) -> &'static str {
        match self {
            TextKind::Reasoning => "rs",
            TextKind::Message => "msg",
        }
    }

    /// The item's one content part holding `text`.
    fn part(self, text: &str) -> Value {
        match self {
            TextKind::Reasoning => json!({"type": "reasoning_text", "text": text}),
            TextKind::Message => {
                json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
            }
        }
    }

    fn in_progress_item(self, id: &str) -> Value {
        match self {
            TextKind::Reasoning => {
                json!({"type": "reasoning", "id": id, "summary": [], "content": []})
            }
            TextKind::Message => {
                json!({"type": "message", "id": id, "role": "assistant", "status": "in_progress", "content": []})
            }
        }
    }

    fn completed_item(self, id: &str, text: &str) -> Value {
        match self {
            TextKind::Reasoning => reasoning_item(id, text),
            TextKind::Message => message_item(id, text, "completed"),
        }
    }

    /// The `(delta, done)` event names; message text events also carry `logprobs`.
    fn events(self) -> (&'static str, &'static str) {
        match self {
            TextKind::Reasoning => (
                "response.reasoning_text.delta",
                "response.reasoning_text.done",
            ),
            TextKind::Message => ("response.output_text.delta", "response.output_text.done"),
        }
    }

    /// A text event's body: `field` ("delta" or "text") holding `text`.
    fn event_body(self, id: &str, n: usize, field: &str, text: &str) -> Value {
        let mut body = json!({"item_id": id, "output_index": n, "content_index": 0});
        body[field] = text.into();
        if self == TextKind::Message {
            body["logprobs"] = json!([]);
        }
        body
    }
}

enum Open {
    Text(TextKind, String, String),
    Call(usize, String, parse::ToolCall),
}

/// Turns the parser's deltas into `response.*` events, opening and closing output items as the
/// kind of text changes; keeps the finished items for the final response.
struct ItemStream {
    id: String,
    sequence: u64,
    open: Option<Open>,
    done: Vec<Value>,
}

impl ItemStream {
    fn event(&mut self, kind: &'static str, mut body: Value) -> (&'static str, Value) {
        body["type"] = kind.into();
        body["sequence_number"] = self.sequence.into();
        self.sequence += 1;
        (kind, body)
    }

    fn index(&self) -> usize {
        self.done.len()
    }

    fn close(&mut self, out: &mut Vec<(&'static str, Value)>) {
        let n = self.index();
        let item = match self.open.take() {
            None => return,
            Some(Open::Text(kind, id, text)) => {
                let e = self.event(kind.events().1, kind.event_body(&id, n, "text", &text));
                out.push(e);
                let e = self.event(
                    "response.content_part.done",
                    json!({"item_id": id, "output_index": n, "content_index": 0, "part": kind.part(&text)}),
                );
                out.push(e);
                kind.completed_item(&id, &text)
            }
            Some(Open::Call(_, id, call)) => {
                let e = self.event(
                    "response.function_call_arguments.done",
                    json!({"item_id": id, "output_index": n, "arguments": call.arguments}),
                );
                out.push(e);
                call_item(&id, &call, "completed")
            }
        };
        let e = self.event(
            "response.output_item.done",
            json!({"output_index": n, "item": item}),
        );
        out.push(e);
        self.done.push(item);
    }

    fn start(&mut self, open: Open, out: &mut Vec<(&'static str, Value)>) {
        self.close(out);
        let n = self.index();
        let (item, part) = match &open {
            Open::Text(kind, id, _) => {
                (kind.in_progress_item(id), Some((id.clone(), kind.part(""))))
            }
            Open::Call(_, id, call) => (call_item(id, call, "in_progress"), None),
        };
        let e = self.event(
            "response.output_item.added",
            json!({"output_index": n, "item": item}),
        );
        out.push(e);
        if let Some((id, part)) = part {
            let e = self.event(
                "response.content_part.added",
                json!({"item_id": id, "output_index": n, "content_index": 0, "part": part}),
            );
            out.push(e);
        }
        self.open = Some(open);
    }

    /// Text of `kind`: into the open item of that kind, or a new one.
    fn push_text(&mut self, kind: TextKind, s: &str, out: &mut Vec<(&'static str, Value)>) {
        if !matches!(&self.open, Some(Open::Text(k, ..)) if *k == kind) {
            let id = format!("{}_{}_{}", kind.id_prefix(), self.id, self.index());
            self.start(Open::Text(kind, id, String::new()), out);
        }
        let n = self.index();
        if let Some(Open::Text(_, id, text)) = self.open.as_mut() {
            text.push_str(s);
            let body = kind.event_body(id, n, "delta", s);
            let e = self.event(kind.events().0, body);
            out.push(e);
        }
    }

    fn push(&mut self, d: &Delta, out: &mut Vec<(&'static str, Value)>) {
        match d {
            Delta::Reasoning(s) if !s.is_empty() => self.push_text(TextKind::Reasoning, s, out),
            Delta::Content(s) if !s.is_empty() => self.push_text(TextKind::Message, s, out),
            Delta::CallStart { index, id, name } => {
                self.close(out);
                let call = parse::ToolCall {
                    id: id.clone(),
                    name: name.clone(),
                    arguments: String::new(),
                };
                let item_id = format!("fc_{}_{}", self.id, self.index());
                self.start(Open::Call(*index, item_id, call), out);
            }
            Delta::CallArguments { index, fragment } => {
                let n = self.index();
                if let Some(Open::Call(i, id, call)) = self.open.as_mut() {
                    if i == index {
                        call.arguments.push_str(fragment);
                        let id = id.clone();
                        let e = self.event(
                            "response.function_call_arguments.delta",
                            json!({"item_id": id, "output_index": n, "delta": fragment}),
                        );
                        out.push(e);
                    }
                }
            }
            _ => {}
        }
    }
}

/// `POST /v1/responses`
pub async fn responses(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let received = Instant::now();
    let request = match json_body(body) {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    let history = |id: &str| st.responses.lock().ok()?.get(id);
    let (chat, conversation) = match chat_request(&request, history) {
        Ok(c) => c,
        Err(e) => return e.into_response(),
    };
    let (job, mut rx, gen) = match prepare_chat_request(&st, &chat, received, "call_") {
        Ok(p) => p,
        Err(e) => return e.into_response(),
    };
    if let Err(e) = st.enqueue(job) {
        return e.into_response();
    }
    let head = Head {
        id: st.next_id("resp").replacen('-', "_", 1),
        model: st.cfg.model_name.clone(),
        created_at: now(),
        request,
    };
    // kept for a later previous_response_id unless the request says not to
    let keep = {
        let st = st.clone();
        let id = head.id.clone();
        let stored = head.request.get("store") != Some(&Value::Bool(false));
        move |reply: &parse::Reply| {
            if let (true, Ok(mut store)) = (stored, st.responses.lock()) {
                let mut c = conversation;
                c.push(assistant_message(reply));
                store.put(id, c);
            }
        }
    };
    if gen.stream {
        let mut deltas = Vec::new();
        let mut keep = Some(keep);
        let mut items = ItemStream {
            id: head.id.trim_start_matches("resp_").to_string(),
            sequence: 0,
            open: None,
            done: Vec::new(),
        };
        let created = head.response("in_progress", Vec::new(), Value::Null, false);
        let first = vec![
            items.event("response.created", json!({"response": created})),
            items.event("response.in_progress", json!({"response": created})),
        ];
        return named_event_stream(first, rx, move |ev, out| match ev {
            Event::Deltas { deltas: d, .. } => {
                d.iter().for_each(|d| items.push(d, out));
                deltas.extend(d);
                false
            }
            // (a chat request never asks for its prompt back)
            Event::Prompt { .. } => false,
            Event::Done {
                finish_reason,
                usage,
                ..
            } => {
                if let Some(keep) = keep.take() {
                    keep(&parse::collect(&deltas));
                }
                items.close(out);
                let done = std::mem::take(&mut items.done);
                let response = head.finished(finish_reason, done, &usage);
                // also when cut at max_output_tokens (status "incomplete"), as vLLM does: the
                // SDKs' stream helpers finish on response.completed only
                out.push(items.event("response.completed", json!({"response": response})));
                true
            }
            Event::Error { message, .. } => {
                out.push(items.event(
                    "error",
                    json!({"code": "server_error", "message": message, "param": null}),
                ));
                true
            }
        });
    }

    match whole_reply(&mut rx).await {
        Ok(w) => {
            let id = head.id.trim_start_matches("resp_").to_string();
            let reply = parse::collect(&w.deltas);
            let output = output_items(&reply, &id);
            keep(&reply);
            Json(head.finished(w.finish_reason, output, &w.usage)).into_response()
        }
        Err(e) => e.into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tool_conversation_becomes_chat_messages() {
        let body = json!({
            "model": "m", "instructions": "Be brief.", "max_output_tokens": 50, "stream": true,
            "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
            "tool_choice": {"type": "function", "name": "get_weather"},
            "reasoning": {"effort": "none"},
            "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}, "strict": true}},
            "input": [
                {"role": "developer", "content": "Use tools."},
                {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
                {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Ask the tool."}]},
                {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"},
                {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": "{\"city\": \"Lyon\"}"},
                {"type": "function_call_output", "call_id": "call_1", "output": "21C"},
                {"type": "function_call_output", "call_id": "call_2", "output": "19C"},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "21C and 19C."}]},
                {"role": "user", "content": "And tomorrow?"}
            ]
        });
        let chat = chat_request(&body, |_| None).unwrap().0;
        let call = |id: &str, city: &str| {
            json!({"id": id, "type": "function",
                   "function": {"name": "get_weather", "arguments": format!("{{\"city\": \"{city}\"}}")}})
        };
        assert_eq!(
            chat,
            json!({
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "system", "content": "Use tools."},
                    {"role": "user", "content": "Weather in Paris?"},
                    {"role": "assistant", "content": "", "reasoning_content": "Ask the tool.",
                     "tool_calls": [call("call_1", "Paris"), call("call_2", "Lyon")]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "21C"},
                    {"role": "tool", "tool_call_id": "call_2", "content": "19C"},
                    {"role": "assistant", "content": "21C and 19C."},
                    {"role": "user", "content": "And tomorrow?"}
                ],
                "model": "m", "max_tokens": 50, "stream": true,
                "reasoning_effort": "none",
                "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
                "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                "response_format": {"type": "json_schema",
                                    "json_schema": {"name": "w", "schema": {"type": "object"}, "strict": true}}
            })
        );
    }

    #[test]
    fn a_previous_response_continues_without_its_instructions() {
        let earlier = vec![
            json!({"role": "user", "content": "Hi"}),
            json!({"role": "assistant", "content": "Hello."}),
        ];
        let body = json!({"input": "And now?", "instructions": "Be brief.", "previous_response_id": "resp_1"});
        let (chat, conversation) =
            chat_request(&body, |id| (id == "resp_1").then(|| earlier.clone())).unwrap();
        let mut want = earlier.clone();
        want.push(json!({"role": "user", "content": "And now?"}));
        assert_eq!(conversation, want, "the instructions are not stored");
        assert_eq!(
            chat["messages"][0],
            json!({"role": "system", "content": "Be brief."})
        );
        assert_eq!(chat["messages"].as_array().unwrap()[1..], want[..]);
    }

    #[test]
    fn the_store_keeps_the_latest_responses() {
        let mut store = ResponseStore::default();
        for i in 0..STORED_RESPONSES + 2 {
            store.put(
                format!("resp_{i}"),
                vec![json!({"role": "user", "content": i})],
            );
        }
        assert!(store.get("resp_0").is_none() && store.get("resp_1").is_none());
        assert_eq!(store.get("resp_2").unwrap()[0]["content"], 2);
        assert_eq!(store.conversations.len(), STORED_RESPONSES);
    }

    #[test]
    fn openai_housekeeping_fields_change_nothing() {
        let plain = json!({"model": "m", "input": "hi"});
        let mut busy = plain.clone();
        for (k, v) in [
            ("store", json!(false)),
            ("include", json!(["reasoning.encrypted_content"])),
            ("prompt_cache_key", json!("k")),
            ("parallel_tool_calls", json!(true)),
            ("background", json!(false)),
            ("metadata", json!({"a": "b"})),
            ("reasoning", json!({"effort": "high", "summary": "auto"})),
        ] {
            busy[k] = v;
        }
        assert_eq!(
            chat_request(&busy, |_| None).unwrap(),
            chat_request(&plain, |_| None).unwrap()
        );
    }

    #[test]
    fn bad_requests_name_the_problem() {
        for (body, says) in [
            (json!({}), "'input' is required"),
            (json!({"input": []}), "'input' is required"),
            (
                json!({"input": "hi", "previous_response_id": "resp_1"}),
                "\"resp_1\" not found",
            ),
            (
                json!({"input": [{"type": "web_search_call"}]}),
                "\"web_search_call\" items",
            ),
            (
                json!({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}),
                "input_image parts",
            ),
            (
                json!({"input": [{"type": "function_call", "name": "f"}]}),
                "needs call_id",
            ),
            (
                json!({"input": "hi", "tools": [{"type": "web_search"}]}),
                "only function tools",
            ),
            (
                json!({"input": "hi", "tool_choice": "sometimes"}),
                "'tool_choice' must be",
            ),
            (
                json!({"input": "hi", "tool_choice": {"type": "function"}}),
                "needs the function's",
            ),
            (
                json!({"input": "hi", "max_output_tokens": -1}),
                "'max_output_tokens'",
            ),
            (
                json!({"input": "hi", "reasoning": {"effort": "max"}}),
                "'reasoning.effort'",
            ),
            (
                json!({"input": "hi", "text": {"format": {"type": "xml"}}}),
                "'text.format.type'",
            ),
            (
                json!({"input": "hi", "background": true}),
                "'background' responses",
            ),
            (
                json!({"input": "hi", "conversation": "conv_1"}),
                "keeps no conversations",
            ),
            (json!({"input": "hi", "prompt": {"id": "p"}}), "prompt"),
        ] {
            let e = chat_request(&body, |_| None).expect_err(&body.to_string());
            assert!(e.message.contains(says), "{body}: {}", e.message);
        }
    }
}
