//! Request parsing and validation for the OpenAI endpoints, and the OpenAI error envelope.
//! Every field is read by hand so that a bad one is named in a 400, never a 500.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use osprey_engine::sampler::SamplingParams;
use osprey_prompt::GenerationDefaults;
use serde_json::{json, Map, Value};

/// `{"error": {"message", "type", "param", "code"}}` with an HTTP status.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    pub fn bad_request(message: impl Into<String>, param: Option<&str>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.map(String::from),
            code: None,
        }
    }
    pub fn new(
        status: StatusCode,
        kind: &'static str,
        code: &'static str,
        message: impl Into<String>,
    ) -> Self {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code: Some(code),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}});
        (self.status, Json(body)).into_response()
    }
}

pub type ApiResult<T> = Result<T, ApiError>;

/// Fields a client may send that change nothing here.
const IGNORED: &[&str] = &[
    "user",
    "metadata",
    "store",
    "service_tier",
    "stream_options",
    "prompt_cache_key",
    "safety_identifier",
];
/// Fields of the OpenAI API this server does not implement: a clear 400 rather than silence.
const UNSUPPORTED: &[&str] = &[
    "functions",
    "function_call",
    "audio",
    "modalities",
    "prediction",
    "web_search_options",
    "best_of",
    "suffix",
];

pub struct Fields<'a> {
    obj: &'a Map<String, Value>,
}

impl<'a> Fields<'a> {
    pub fn parse(body: &'a Value) -> ApiResult<Self> {
        match body.as_object() {
            Some(obj) => Ok(Fields { obj }),
            None => Err(ApiError::bad_request(
                "the request body must be a JSON object",
                None,
            )),
        }
    }
    pub fn check_known(&self, known: &[&str]) -> ApiResult<()> {
        for k in self.obj.keys() {
            if UNSUPPORTED.contains(&k.as_str()) {
                return Err(ApiError::bad_request(
                    format!("'{k}' is not supported by this server"),
                    Some(k),
                ));
            }
            if !known.contains(&k.as_str()) && !IGNORED.contains(&k.as_str()) {
                return Err(ApiError::bad_request(
                    format!("unrecognized request field '{k}'"),
                    Some(k),
                ));
            }
        }
        Ok(())
    }
    pub fn get(&self, k: &str) -> Option<&'a Value> {
        self.obj.get(k).filter(|v| !v.is_null())
    }
    pub fn f32_in(&self, k: &str, lo: f32, hi: f32) -> ApiResult<Option<f32>> {
        match self.get(k) {
            None => Ok(None),
            Some(v) => match v.as_f64() {
                Some(x) if (lo as f64..=hi as f64).contains(&x) => Ok(Some(x as f32)),
                _ => Err(ApiError::bad_request(
                    format!("'{k}' must be a number between {lo} and {hi}, got {v}"),
                    Some(k),
                )),
            },
        }
    }
    pub fn int_in(&self, k: &str, lo: i64, hi: i64) -> ApiResult<Option<i64>> {
        match self.get(k) {
            None => Ok(None),
            Some(v) => match v.as_i64() {
                Some(x) if (lo..=hi).contains(&x) => Ok(Some(x)),
                _ => Err(ApiError::bad_request(
                    format!("'{k}' must be an integer between {lo} and {hi}, got {v}"),
                    Some(k),
                )),
            },
        }
    }
    pub fn bool(&self, k: &str) -> ApiResult<bool> {
        match self.get(k) {
            None => Ok(false),
            Some(Value::Bool(b)) => Ok(*b),
            Some(v) => Err(ApiError::bad_request(
                format!("'{k}' must be true or false, got {v}"),
                Some(k),
            )),
        }
    }
}

/// Generation settings shared by both endpoints.
#[derive(Clone, Debug)]
pub struct GenerationRequest {
    pub sampling: SamplingParams,
    pub max_tokens: Option<usize>,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    /// `Some(n)`: return log-probabilities with the top `n` alternatives.
    pub logprobs: Option<usize>,
    /// Added to these tokens' logits before each token is chosen (OpenAI's `logit_bias`).
    pub logit_bias: Vec<(u32, f32)>,
    /// How many replies to the one prompt (`n`); the engine generates them one after another.
    pub choices: usize,
    /// Generate past end-of-turn tokens until `max_tokens` or a stop string (vLLM's
    /// `ignore_eos`, which serving benchmarks send to fix every reply's length).
    pub ignore_eos: bool,
    /// More token ids that end the reply (vLLM's `stop_token_ids`; not ignored by `ignore_eos`).
    pub stop_token_ids: Vec<u32>,
    /// Tokens the reply runs before it may end (vLLM's `min_tokens`): until then the tokens that
    /// would end it are not chosen and stop strings are not looked for.
    pub min_tokens: usize,
}

/// Most choices (`n`) one request may ask for: each is a whole generation on a batch-1 engine.
pub const MAX_CHOICES: usize = 16;

/// JSON values as token ids below `vocab`; the first value that is not one is the error.
pub fn token_ids(values: &[Value], vocab: usize) -> Result<Vec<u32>, &Value> {
    values
        .iter()
        .map(|x| {
            x.as_u64()
                .filter(|&i| (i as usize) < vocab)
                .map(|i| i as u32)
                .ok_or(x)
        })
        .collect()
}

/// `stop_token_ids`: a list of at most 64 ids below `vocab`.
fn stop_token_ids(f: &Fields, vocab: usize) -> ApiResult<Vec<u32>> {
    let Some(v) = f.get("stop_token_ids") else {
        return Ok(Vec::new());
    };
    let ids = v
        .as_array()
        .filter(|a| a.len() <= 64)
        .and_then(|a| token_ids(a, vocab).ok());
    ids.ok_or_else(|| {
        ApiError::bad_request(
            format!(
                "'stop_token_ids' must be a list of at most 64 token ids below {vocab}, got {v}"
            ),
            Some("stop_token_ids"),
        )
    })
}

/// Most entries `logit_bias` may hold (OpenAI documents no limit; this bounds a request's work).
const MAX_LOGIT_BIAS: usize = 1024;

/// `logit_bias`: token ids (as strings, JSON object keys) below `vocab`, each to a bias in
/// [-100, 100].
fn logit_bias(f: &Fields, vocab: usize) -> ApiResult<Vec<(u32, f32)>> {
    let bad = |msg: String| ApiError::bad_request(msg, Some("logit_bias"));
    let map = match f.get("logit_bias") {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Object(m)) => m,
        Some(v) => {
            return Err(bad(format!(
                "'logit_bias' must be an object of token id -> bias, got {v}"
            )))
        }
    };
    if map.len() > MAX_LOGIT_BIAS {
        return Err(bad(format!(
            "'logit_bias' has {} entries; at most {MAX_LOGIT_BIAS}",
            map.len()
        )));
    }
    map.iter()
        .map(|(k, v)| {
            let id = k
                .parse::<u32>()
                .ok()
                .filter(|&id| (id as usize) < vocab)
                .ok_or_else(|| {
                    bad(format!(
                        "'logit_bias' key {k:?} is not a token id (0 to {})",
                        vocab - 1
                    ))
                })?;
            let bias = v
                .as_f64()
                .filter(|b| (-100.0..=100.0).contains(b))
                .ok_or_else(|| {
                    bad(format!(
                        "'logit_bias' value for token {id} must be a number from -100 to 100, got {v}"
                    ))
                })?;
            Ok((id, bias as f32))
        })
        .collect()
}

pub const GENERATION_FIELDS: &[&str] = &[
    "model",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "max_tokens",
    "max_completion_tokens",
    "stop",
    "stream",
    "stream_options",
    "logprobs",
    "top_logprobs",
    "logit_bias",
    "n",
    "ignore_eos",
    "stop_token_ids",
    "min_tokens",
];

pub fn generation_request(
    f: &Fields,
    defaults: &GenerationDefaults,
    chat: bool,
    vocab: usize,
) -> ApiResult<GenerationRequest> {
    let choices = f.int_in("n", 1, MAX_CHOICES as i64)?.unwrap_or(1) as usize;
    let top_k = match f.get("top_k") {
        None => defaults.top_k.unwrap_or(0),
        Some(v) => match v.as_i64() {
            Some(-1) | Some(0) => 0,
            Some(k) if k > 0 => k as usize,
            _ => {
                return Err(ApiError::bad_request(
                    format!("'top_k' must be a positive integer, or -1/0 for no limit, got {v}"),
                    Some("top_k"),
                ))
            }
        },
    };
    let sampling = SamplingParams {
        temperature: f
            .f32_in("temperature", 0.0, 2.0)?
            .or(defaults.temperature)
            .unwrap_or(1.0),
        top_k,
        top_p: match f.f32_in("top_p", 0.0, 1.0)? {
            Some(p) if p <= 0.0 => {
                return Err(ApiError::bad_request(
                    "'top_p' must be greater than 0",
                    Some("top_p"),
                ))
            }
            Some(p) => p,
            None => defaults.top_p.unwrap_or(1.0),
        },
        min_p: f
            .f32_in("min_p", 0.0, 1.0)?
            .or(defaults.min_p)
            .unwrap_or(0.0),
        presence_penalty: f.f32_in("presence_penalty", -2.0, 2.0)?.unwrap_or(0.0),
        frequency_penalty: f.f32_in("frequency_penalty", -2.0, 2.0)?.unwrap_or(0.0),
        repetition_penalty: match f.f32_in("repetition_penalty", 0.0, 10.0)? {
            Some(r) if r <= 0.0 => {
                return Err(ApiError::bad_request(
                    "'repetition_penalty' must be greater than 0",
                    Some("repetition_penalty"),
                ))
            }
            Some(r) => r,
            None => defaults.repetition_penalty.unwrap_or(1.0),
        },
        // without a seed every request samples differently (a retried question gets a new
        // answer), as OpenAI's API does; with one, the same request gives the same reply
        seed: match f.int_in("seed", i64::MIN, i64::MAX)? {
            Some(s) => s as u64,
            None => rand::random(),
        },
    };
    // a completion may ask for none (its echoed prompt's log-probabilities are the answer)
    let fewest = i64::from(chat);
    let max_tokens = match f.int_in("max_completion_tokens", fewest, u32::MAX as i64)? {
        Some(n) => Some(n as usize),
        None => f
            .int_in("max_tokens", fewest, u32::MAX as i64)?
            .map(|n| n as usize),
    };
    let stop = match f.get("stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => {
            let v: Option<Vec<String>> = a.iter().map(|x| x.as_str().map(String::from)).collect();
            match v {
                Some(v) if v.len() <= 16 => v,
                _ => {
                    return Err(ApiError::bad_request(
                        "'stop' must be a string or a list of at most 16 strings",
                        Some("stop"),
                    ))
                }
            }
        }
        Some(_) => {
            return Err(ApiError::bad_request(
                "'stop' must be a string or a list of strings",
                Some("stop"),
            ))
        }
    };
    let stream = f.bool("stream")?;
    let include_usage = match f.get("stream_options") {
        None => false,
        Some(Value::Object(o)) => match o.get("include_usage") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(v) => {
                return Err(ApiError::bad_request(
                    format!("'stream_options.include_usage' must be a boolean, got {v}"),
                    Some("stream_options"),
                ))
            }
        },
        Some(_) => {
            return Err(ApiError::bad_request(
                "'stream_options' must be an object",
                Some("stream_options"),
            ))
        }
    };
    let logprobs = if chat {
        let top = f.int_in("top_logprobs", 0, 20)?;
        match (f.bool("logprobs")?, top) {
            (true, t) => Some(t.unwrap_or(0) as usize),
            (false, Some(_)) => {
                return Err(ApiError::bad_request(
                    "'top_logprobs' requires 'logprobs': true",
                    Some("top_logprobs"),
                ))
            }
            (false, None) => None,
        }
    } else {
        f.int_in("logprobs", 0, 20)?.map(|n| n as usize)
    };
    let min_tokens = f.int_in("min_tokens", 0, u32::MAX as i64)?.unwrap_or(0) as usize;
    if let Some(max) = max_tokens.filter(|&max| min_tokens > max) {
        return Err(ApiError::bad_request(
            format!(
                "'min_tokens' ({min_tokens}) must not exceed the most tokens asked for ({max})"
            ),
            Some("min_tokens"),
        ));
    }
    Ok(GenerationRequest {
        sampling,
        max_tokens,
        stop,
        stream,
        include_usage,
        logprobs,
        logit_bias: logit_bias(f, vocab)?,
        choices,
        ignore_eos: f.bool("ignore_eos")?,
        stop_token_ids: stop_token_ids(f, vocab)?,
        min_tokens,
    })
}

/// The text of a string, or of a list of parts whose `type` is one of `kinds` (each with a
/// `text`), joined; `at` names the value in errors, `field` the request field.
pub fn joined_text(v: &Value, kinds: &[&str], at: &str, field: &str) -> ApiResult<String> {
    let bad = |m: String| ApiError::bad_request(m, Some(field));
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut text = String::new();
            for (j, p) in parts.iter().enumerate() {
                match (p["type"].as_str(), p["text"].as_str()) {
                    (Some(k), Some(t)) if kinds.contains(&k) => text.push_str(t),
                    (kind, _) => {
                        return Err(bad(format!(
                            "{at}[{j}]: {} parts are not supported here (only {})",
                            kind.unwrap_or("untyped"),
                            kinds.join(", ")
                        )))
                    }
                }
            }
            Ok(text)
        }
        _ => Err(bad(format!(
            "{at} must be a string or a list of {} parts",
            kinds.join(", ")
        ))),
    }
}

/// How tools may be used.
#[derive(Clone, Debug, PartialEq)]
pub enum ToolChoice {
    None,
    Auto,
    Required,
    Function(String),
}

pub fn tool_choice(f: &Fields, tools: Option<&Value>) -> ApiResult<ToolChoice> {
    let choice = match f.get("tool_choice") {
        None => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            _ => return Err(ApiError::bad_request(format!("'tool_choice' must be none, auto, required or a function, got \"{s}\""), Some("tool_choice"))),
        },
        Some(Value::Object(o)) => match o.get("function").and_then(|f| f.get("name")).and_then(Value::as_str) {
            Some(name) => ToolChoice::Function(name.to_string()),
            None => return Err(ApiError::bad_request("'tool_choice' object must be {\"type\": \"function\", \"function\": {\"name\": ...}}", Some("tool_choice"))),
        },
        Some(v) => return Err(ApiError::bad_request(format!("'tool_choice' has an invalid value {v}"), Some("tool_choice"))),
    };
    let names: Vec<&str> = tools
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|t| t["function"]["name"].as_str())
        .collect();
    match &choice {
        ToolChoice::Required if names.is_empty() => Err(ApiError::bad_request(
            "'tool_choice' is required but no 'tools' were given",
            Some("tool_choice"),
        )),
        ToolChoice::Function(n) if !names.contains(&n.as_str()) => Err(ApiError::bad_request(
            format!("'tool_choice' names function '{n}', which is not in 'tools'"),
            Some("tool_choice"),
        )),
        _ => Ok(choice),
    }
}

/// Checks `tools` is a list of `{"type": "function", "function": {"name": ..., ...}}`.
pub fn tools(f: &Fields) -> ApiResult<Option<Value>> {
    let Some(t) = f.get("tools") else {
        return Ok(None);
    };
    let Some(list) = t.as_array() else {
        return Err(ApiError::bad_request(
            "'tools' must be a list",
            Some("tools"),
        ));
    };
    for (i, tool) in list.iter().enumerate() {
        let ok = tool.get("type").and_then(Value::as_str) == Some("function")
            && tool["function"]["name"]
                .as_str()
                .is_some_and(|n| !n.is_empty());
        if !ok {
            return Err(ApiError::bad_request(format!("tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}"), Some("tools")));
        }
    }
    Ok((!list.is_empty()).then(|| t.clone()))
}

/// Normalises OpenAI messages for the chat template: content parts joined, `developer` as
/// `system`, tool-call arguments parsed from JSON strings into objects.
pub fn messages(f: &Fields) -> ApiResult<Value> {
    let Some(list) = f.get("messages").and_then(Value::as_array) else {
        return Err(ApiError::bad_request(
            "'messages' is required and must be a non-empty list",
            Some("messages"),
        ));
    };
    if list.is_empty() {
        return Err(ApiError::bad_request(
            "'messages' must not be empty",
            Some("messages"),
        ));
    }
    let mut out = Vec::with_capacity(list.len());
    for (i, m) in list.iter().enumerate() {
        let Some(obj) = m.as_object() else {
            return Err(ApiError::bad_request(
                format!("messages[{i}] must be an object"),
                Some("messages"),
            ));
        };
        let role = match obj.get("role").and_then(Value::as_str) {
            Some("developer") => "system",
            Some(r @ ("system" | "user" | "assistant" | "tool")) => r,
            Some(r) => return Err(ApiError::bad_request(format!("messages[{i}].role '{r}' is not one of system, developer, user, assistant, tool"), Some("messages"))),
            None => return Err(ApiError::bad_request(format!("messages[{i}].role is required"), Some("messages"))),
        };
        let content = match obj.get("content") {
            None | Some(Value::Null) if role == "assistant" => Value::String(String::new()),
            Some(Value::String(s)) => Value::String(s.clone()),
            Some(Value::Array(parts)) => {
                let mut text = String::new();
                for p in parts {
                    match (
                        p.get("type").and_then(Value::as_str),
                        p.get("text").and_then(Value::as_str),
                    ) {
                        (Some("text"), Some(t)) => text.push_str(t),
                        _ => {
                            return Err(ApiError::bad_request(
                                format!("messages[{i}].content: only text parts are supported"),
                                Some("messages"),
                            ))
                        }
                    }
                }
                Value::String(text)
            }
            _ => {
                return Err(ApiError::bad_request(
                    format!("messages[{i}].content must be a string or a list of text parts"),
                    Some("messages"),
                ))
            }
        };
        let mut msg = Map::new();
        msg.insert("role".into(), role.into());
        msg.insert("content".into(), content);
        if let Some(r) = obj
            .get("reasoning_content")
            .or(obj.get("reasoning"))
            .filter(|v| !v.is_null())
        {
            match r {
                Value::String(_) => {
                    msg.insert("reasoning_content".into(), r.clone());
                }
                _ => {
                    return Err(ApiError::bad_request(
                        format!("messages[{i}].reasoning_content must be a string"),
                        Some("messages"),
                    ))
                }
            }
        }
        if let Some(calls) = obj.get("tool_calls").filter(|v| !v.is_null()) {
            let Some(calls) = calls.as_array() else {
                return Err(ApiError::bad_request(
                    format!("messages[{i}].tool_calls must be a list"),
                    Some("messages"),
                ));
            };
            let mut norm = Vec::new();
            for (j, c) in calls.iter().enumerate() {
                let name = c["function"]["name"].as_str();
                let args = match &c["function"]["arguments"] {
                    Value::String(s) if s.trim().is_empty() => Value::Object(Map::new()),
                    Value::String(s) => match serde_json::from_str::<Value>(s) {
                        Ok(v @ Value::Object(_)) => v,
                        _ => return Err(ApiError::bad_request(format!("messages[{i}].tool_calls[{j}].function.arguments must be a JSON object string"), Some("messages"))),
                    },
                    v @ Value::Object(_) => v.clone(),
                    Value::Null => Value::Object(Map::new()),
                    _ => return Err(ApiError::bad_request(format!("messages[{i}].tool_calls[{j}].function.arguments must be a JSON object string"), Some("messages"))),
                };
                let Some(name) = name else {
                    return Err(ApiError::bad_request(
                        format!("messages[{i}].tool_calls[{j}].function.name is required"),
                        Some("messages"),
                    ));
                };
                norm.push(json!({"id": c.get("id").cloned().unwrap_or(Value::Null), "type": "function", "function": {"name": name, "arguments": args}}));
            }
            msg.insert("tool_calls".into(), Value::Array(norm));
        }
        if let Some(id) = obj.get("tool_call_id") {
            msg.insert("tool_call_id".into(), id.clone());
        }
        out.push(Value::Object(msg));
    }
    Ok(Value::Array(out))
}
