//! vLLM's tokenizer endpoints, so that a client can use the server's own tokenizer and chat
//! template instead of fetching them: `GET /tokenizer_info`, `POST /tokenize` (a prompt, or chat
//! messages through the template) and `POST /detokenize`. lm-evaluation-harness finds a server's
//! tokenizer this way.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use crate::api::{self, ApiError, ApiResult, Fields};
use crate::{json_body, render_chat, AppState, PromptEnding};

const TOKENIZE_FIELDS: &[&str] = &[
    "model",
    "prompt",
    "messages",
    "tools",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "return_token_strs",
];

/// `GET /tokenizer_info`: the special tokens, the chat template and the context length.
pub async fn tokenizer_info(State(st): State<Arc<AppState>>) -> Json<Value> {
    let special = &st.format.special;
    Json(json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": special.bos,
        "eos_token": special.eos,
        "pad_token": special.pad,
        "chat_template": st.format.template.source(),
        "model_max_length": st.cfg.max_context,
    }))
}

/// `POST /tokenize`: `prompt` (text) or `messages` (rendered as a chat request's are) to ids.
/// The tokenizer adds no special tokens of its own (this model has no BOS), so
/// `add_special_tokens` changes nothing.
pub async fn tokenize(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    answer(&st, body, TOKENIZE_FIELDS, |f| {
        f.bool("add_special_tokens")?;
        let tokens = match (f.get("prompt"), f.get("messages")) {
            (Some(Value::String(text)), None) => st
                .format
                .encode(text)
                .map_err(|e| ApiError::bad_request(format!("{e:#}"), Some("prompt")))?,
            (None, Some(_)) => {
                let tools = api::tools(f)?;
                render_chat(&st, f, api::messages(f)?, &tools, PromptEnding::parse(f)?)?.1
            }
            _ => {
                return Err(ApiError::bad_request(
                    "give either 'prompt' (a string) or 'messages'",
                    Some("prompt"),
                ))
            }
        };
        let token_strs = if f.bool("return_token_strs")? {
            tokens
                .iter()
                .map(|&id| Value::from(st.format.tokenizer.id_to_token(id)))
                .collect()
        } else {
            Value::Null
        };
        Ok(
            json!({"count": tokens.len(), "max_model_len": st.cfg.max_context,
                  "tokens": tokens, "token_strs": token_strs}),
        )
    })
}

/// `POST /detokenize`: `tokens` to text (special tokens kept, as the prompt holds them).
pub async fn detokenize(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    answer(&st, body, &["model", "tokens"], |f| {
        let bad = || {
            ApiError::bad_request(
                format!(
                    "'tokens' must be a list of token ids below {}",
                    st.vocab_size
                ),
                Some("tokens"),
            )
        };
        let ids = f
            .get("tokens")
            .and_then(Value::as_array)
            .and_then(|a| api::token_ids(a, st.vocab_size).ok())
            .ok_or_else(bad)?;
        let text = st
            .format
            .tokenizer
            .decode(&ids, false)
            .map_err(|e| ApiError::bad_request(format!("tokenizer: {e}"), Some("tokens")))?;
        Ok(json!({"prompt": text}))
    })
}

/// A JSON request with these `known` fields (and the served model, if it names one), answered
/// by `reply` or with the error it raises.
fn answer(
    st: &AppState,
    body: Result<Bytes, BytesRejection>,
    known: &[&str],
    reply: impl FnOnce(&Fields) -> ApiResult<Value>,
) -> Response {
    let answered = json_body(body).and_then(|body| {
        let f = Fields::parse(&body)?;
        f.check_known(known)?;
        st.check_model(&f)?;
        reply(&f)
    });
    match answered {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}
