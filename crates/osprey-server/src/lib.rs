//! `osprey serve`: the OpenAI chat-completions API over the engine. HTTP runs on tokio; the
//! model runs on one engine thread fed by a bounded FIFO (batch 1). See README for the endpoints.

mod anthropic;
pub mod api;
pub mod metrics;
pub mod parse;
mod responses;
pub mod structured;
mod tokenize;
pub mod worker;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use osprey_engine::Engine;
use osprey_prompt::{ChatOptions, PromptFormat};
use serde_json::{json, Map, Value};
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;

use api::{ApiError, ApiResult, Fields, GenerationRequest, ToolChoice};
use metrics::Metrics;
use parse::{Delta, ToolSchemas};
use structured::{Constraint, ForcedCall, Grammars, ResponseFormat};
use worker::{ChatParsing, Event, Job, PrefixCache, TokenLogprob, Usage, Worker};

#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// The model's id: reported in replies, listed first by /v1/models.
    pub model_name: String,
    /// Other ids requests may ask for, each served by this model (an agent that asks for its
    /// own model names, as Claude Code asks for a large and a small model).
    pub model_aliases: Vec<String>,
    pub api_key: Option<String>,
    /// Longest prompt + reply, in tokens.
    pub max_context: usize,
    /// Requests waiting for the engine before new ones get 429.
    pub max_queue: usize,
    pub request_timeout: Duration,
    pub cache_entries: usize,
    pub cache_bytes: usize,
    pub max_body_bytes: usize,
    /// Default `max_tokens` when a request gives none.
    pub default_max_tokens: usize,
}

struct AppState {
    cfg: ServerConfig,
    format: Arc<PromptFormat>,
    jobs: Mutex<std::sync::mpsc::Sender<Job>>,
    queued: Arc<AtomicUsize>,
    metrics: Arc<Metrics>,
    vocab_size: usize,
    ids: AtomicU64,
    /// The vocabulary indexed for grammars (response_format, forced tool calls), built by the
    /// first request that needs one (~1 s and ~200 MB, blocking that request: a server that is
    /// never asked for one never pays).
    grammars: OnceLock<Result<Grammars, String>>,
    /// Earlier responses' conversations, for the Responses API's `previous_response_id`.
    responses: Mutex<responses::ResponseStore>,
}

/// The HTTP application; spawns the engine thread.
pub fn app(engine: Engine, format: PromptFormat, cfg: ServerConfig) -> anyhow::Result<Router> {
    let format = Arc::new(format);
    let metrics = Arc::new(Metrics::default());
    let queued = Arc::new(AtomicUsize::new(0));
    let (tx, rx) = std::sync::mpsc::channel();
    let vocab_size = engine.config().vocab_size;
    let worker = Worker {
        engine,
        format: format.clone(),
        cache: PrefixCache::new(cfg.cache_entries, cfg.cache_bytes),
        metrics: metrics.clone(),
        queued: queued.clone(),
    };
    std::thread::Builder::new()
        .name("osprey-engine".into())
        .spawn(move || worker.run(rx))?;
    let max_body = cfg.max_body_bytes;
    let state = Arc::new(AppState {
        cfg,
        format,
        jobs: Mutex::new(tx),
        queued,
        metrics,
        vocab_size,
        ids: AtomicU64::new(0),
        grammars: OnceLock::new(),
        responses: Mutex::default(),
    });
    let v1 = Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .route("/v1/responses", post(responses::responses))
        .route("/tokenize", post(tokenize::tokenize))
        .route("/detokenize", post(tokenize::detokenize))
        .route("/tokenizer_info", get(tokenize::tokenizer_info))
        .route_layer(middleware::from_fn_with_state(state.clone(), require_key));
    Ok(Router::new()
        .merge(v1)
        .route("/health", get(|| async { Json(json!({"status": "ok"})) }))
        .route("/metrics", get(metrics_text))
        .fallback(|| async {
            ApiError::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                "not_found",
                "unknown route",
            )
        })
        .method_not_allowed_fallback(|| async {
            ApiError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "invalid_request_error",
                "method_not_allowed",
                "method not allowed on this route",
            )
        })
        .layer(DefaultBodyLimit::max(max_body))
        .layer(middleware::from_fn_with_state(state.clone(), count_status))
        .with_state(state))
}

/// Serves until SIGINT/SIGTERM; in-flight requests finish first.
pub async fn serve(router: Router, addr: SocketAddr) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on {addr}: {e}"))?;
    tracing::info!("listening on http://{}", listener.local_addr()?);
    axum::serve(listener, router)
        .with_graceful_shutdown(shutdown_signal())
        .await?;
    tracing::info!("shut down");
    Ok(())
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! { _ = ctrl_c => {}, _ = term => {} }
    tracing::info!("shutting down: finishing in-flight requests");
}

async fn count_status(
    State(st): State<Arc<AppState>>,
    req: axum::extract::Request,
    next: Next,
) -> Response {
    let r = next.run(req).await;
    st.metrics.record_status(r.status().as_u16());
    r
}

async fn require_key(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    req: axum::extract::Request,
    next: Next,
) -> Response {
    if let Some(key) = &st.cfg.api_key {
        // OpenAI clients send `Authorization: Bearer KEY`, Anthropic ones `x-api-key: KEY`
        let bearer = headers
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        let x_api_key = headers.get("x-api-key").and_then(|v| v.to_str().ok());
        if bearer != Some(key.as_str()) && x_api_key != Some(key.as_str()) {
            let e = ApiError::new(
                StatusCode::UNAUTHORIZED,
                "invalid_request_error",
                "invalid_api_key",
                "invalid or missing API key",
            );
            return if req.uri().path().starts_with("/v1/messages") {
                anthropic::error(e)
            } else {
                e.into_response()
            };
        }
    }
    next.run(req).await
}

async fn metrics_text(State(st): State<Arc<AppState>>) -> impl IntoResponse {
    (
        [("content-type", "text/plain; version=0.0.4")],
        st.metrics.render(),
    )
}

/// The served model under each of its ids, in a list both the OpenAI and the Anthropic SDKs
/// read (each ignores the other's fields).
async fn models(State(st): State<Arc<AppState>>) -> Json<Value> {
    let created = now();
    let data: Vec<Value> = st
        .model_ids()
        .map(|id| {
            json!({"id": id, "object": "model", "created": created, "owned_by": "osprey",
                   "type": "model", "display_name": id, "created_at": rfc3339(created)})
        })
        .collect();
    let (first, last) = (&data[0]["id"], &data[data.len() - 1]["id"]);
    Json(
        json!({"object": "list", "has_more": false, "first_id": first, "last_id": last,
                "data": data}),
    )
}

/// Seconds since the Unix epoch as an RFC 3339 UTC time (days to a civil date by Howard
/// Hinnant's algorithm).
pub fn rfc3339(secs: u64) -> String {
    let (days, rest) = ((secs / 86_400) as i64, secs % 86_400);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rest / 3600,
        rest % 3600 / 60,
        rest % 60
    )
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn json_body(body: Result<Bytes, BytesRejection>) -> ApiResult<Value> {
    let bytes = body.map_err(|e| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "invalid_request_error",
                "request_too_large",
                "request body is too large",
            )
        } else {
            ApiError::bad_request(format!("cannot read the request body: {e}"), None)
        }
    })?;
    serde_json::from_slice(&bytes).map_err(|e| {
        ApiError::bad_request(format!("the request body is not valid JSON: {e}"), None)
    })
}

impl AppState {
    /// The grammar a reply must follow, or None for free text; a schema that cannot be
    /// compiled is a 400 naming the problem.
    fn constraint(&self, rf: &ResponseFormat) -> ApiResult<Option<Constraint>> {
        if *rf == ResponseFormat::Text {
            return Ok(None);
        }
        let grammars = self.grammars().map_err(|e| {
            ApiError::bad_request(
                format!("structured outputs are not available with this tokenizer: {e}"),
                Some("response_format"),
            )
        })?;
        grammars.constraint(rf).map_err(|e| {
            ApiError::bad_request(
                format!("the response_format schema cannot be enforced: {e:#}"),
                Some("response_format"),
            )
        })
    }

    /// The vocabulary indexed for grammars (built on first use).
    fn grammars(&self) -> Result<&Grammars, &String> {
        self.grammars
            .get_or_init(|| Grammars::new(&self.format).map_err(|e| format!("{e:#}")))
            .as_ref()
    }

    /// A forced tool call held to the tools' schemas; None (the call left free, as the model
    /// writes it) where the grammar cannot be built.
    fn tool_call_constraint(&self, forced: ForcedCall) -> Option<Constraint> {
        match self.grammars() {
            Ok(g) => g.tool_call(forced),
            Err(e) => {
                tracing::warn!("forced tool calls stay unconstrained: {e}");
                None
            }
        }
    }

    /// Every id the model answers to, its own first.
    fn model_ids(&self) -> impl Iterator<Item = &str> {
        std::iter::once(&self.cfg.model_name)
            .chain(&self.cfg.model_aliases)
            .map(String::as_str)
    }

    fn check_model(&self, f: &Fields) -> ApiResult<()> {
        match f.get("model") {
            None => Ok(()),
            Some(Value::String(m)) if self.model_ids().any(|id| id == m) => Ok(()),
            Some(Value::String(m)) => Err(ApiError {
                status: StatusCode::NOT_FOUND,
                message: format!(
                    "the model '{m}' does not exist (this server serves '{}'; --served-model-name adds other names)",
                    self.model_ids().collect::<Vec<_>>().join("', '")
                ),
                kind: "invalid_request_error",
                param: Some("model".into()),
                code: Some("model_not_found"),
            }),
            Some(v) => Err(ApiError::bad_request(
                format!("'model' must be a string, got {v}"),
                Some("model"),
            )),
        }
    }

    /// Token budget for the reply; the prompt must leave room for at least one token.
    fn max_tokens(&self, prompt: usize, gen: &GenerationRequest) -> ApiResult<usize> {
        let ctx = self.cfg.max_context;
        if prompt >= ctx {
            return Err(ApiError {
                status: StatusCode::BAD_REQUEST,
                message: format!(
                    "the prompt is {prompt} tokens, {} more than this server's context of {ctx} tokens allows (it must leave room for at least one generated token)",
                    prompt + 1 - ctx
                ),
                kind: "invalid_request_error",
                param: Some("messages".into()),
                code: Some("context_length_exceeded"),
            });
        }
        Ok(gen
            .max_tokens
            .unwrap_or(self.cfg.default_max_tokens)
            .min(ctx - prompt))
    }

    fn enqueue(&self, job: Job) -> ApiResult<()> {
        if self.queued.load(Ordering::SeqCst) >= self.cfg.max_queue {
            return Err(ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                "queue_full",
                "the request queue is full; retry later",
            ));
        }
        self.queued.fetch_add(1, Ordering::SeqCst);
        self.metrics
            .queue_depth
            .store(self.queued.load(Ordering::SeqCst), Ordering::Relaxed);
        let sent = self
            .jobs
            .lock()
            .map_err(|_| internal("engine queue poisoned"))?
            .send(job);
        sent.map_err(|_| {
            self.queued.fetch_sub(1, Ordering::SeqCst);
            ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "engine_stopped",
                "the engine is not running",
            )
        })
    }

    fn next_id(&self, prefix: &str) -> String {
        format!(
            "{prefix}-{:x}{:06x}",
            now(),
            self.ids.fetch_add(1, Ordering::Relaxed)
        )
    }
}

/// A whole reply, gathered from the engine's events.
struct WholeReply {
    /// The echoed prompt: its text, its first token's, and the rest's log-probabilities.
    prompt: Option<(String, String, Option<Vec<TokenLogprob>>)>,
    deltas: Vec<Delta>,
    logprobs: Vec<TokenLogprob>,
    finish_reason: &'static str,
    stop_sequence: Option<String>,
    usage: Usage,
}

/// Waits for the engine to finish a request and gathers its reply; its failure is the error to
/// answer with.
async fn whole_reply(rx: &mut mpsc::UnboundedReceiver<Event>) -> ApiResult<WholeReply> {
    let (mut deltas, mut logprobs, mut prompt) = (Vec::new(), Vec::new(), None);
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Prompt {
                text,
                first_token,
                logprobs,
            } => prompt = Some((text, first_token, logprobs)),
            Event::Deltas {
                deltas: d,
                logprobs: l,
            } => {
                deltas.extend(d);
                logprobs.extend(l);
            }
            Event::Done {
                finish_reason,
                stop_sequence,
                usage,
            } => {
                return Ok(WholeReply {
                    prompt,
                    deltas,
                    logprobs,
                    finish_reason,
                    stop_sequence,
                    usage,
                })
            }
            Event::Error { message, timeout } => return Err(engine_error(message, timeout)),
        }
    }
    Err(internal("the engine ended the request without a result"))
}

/// Named server-sent events (`event: NAME`, `data: JSON`), the form of Anthropic's and the
/// Responses API's streams: `first`, then what `on_event` makes of each engine event (true after
/// the last one). A client that goes away drops `rx`, which tells the engine to stop.
fn named_event_stream(
    first: Vec<(&'static str, Value)>,
    mut rx: mpsc::UnboundedReceiver<Event>,
    mut on_event: impl FnMut(Event, &mut Vec<(&'static str, Value)>) -> bool + Send + 'static,
) -> Response {
    let (out_tx, out_rx) = mpsc::unbounded_channel::<Result<SseEvent, Infallible>>();
    tokio::spawn(async move {
        let send = |(name, v): (&'static str, Value)| {
            out_tx
                .send(Ok(SseEvent::default().event(name).data(v.to_string())))
                .is_ok()
        };
        if !first.into_iter().all(send) {
            return;
        }
        while let Some(ev) = rx.recv().await {
            let mut out = Vec::new();
            let last = on_event(ev, &mut out);
            if !out.into_iter().all(send) || last {
                return;
            }
        }
    });
    Sse::new(UnboundedReceiverStream::new(out_rx))
        .keep_alive(KeepAlive::default())
        .into_response()
}

/// The engine's failure of a request (a 504 when it ran past its deadline).
fn engine_error(message: String, timeout: bool) -> ApiError {
    let status = if timeout {
        StatusCode::GATEWAY_TIMEOUT
    } else {
        StatusCode::INTERNAL_SERVER_ERROR
    };
    let code = if timeout { "timeout" } else { "engine_error" };
    ApiError::new(status, "server_error", code, message)
}

fn internal(msg: &str) -> ApiError {
    ApiError::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "server_error",
        "internal_error",
        msg,
    )
}

/// A system part (system prompt and tool definitions) at least this long gets its own prefix
/// snapshot, which later conversations starting with it resume from: an agent's sub-tasks each
/// open a conversation with the same long instructions. Shorter ones are cheaper to prefill again
/// than to keep.
const MIN_SHARED_PREFIX: usize = 256;

const CHAT_FIELDS: &[&str] = &[
    "messages",
    "tools",
    "tool_choice",
    "chat_template_kwargs",
    "response_format",
    "thinking_token_budget",
    "continue_final_message",
    "add_generation_prompt",
    "reasoning_effort",
    "parallel_tool_calls",
];

/// OpenAI's `reasoning_effort` values: "none" turns the model's thinking off, the others leave
/// it on (the model has no graded effort).
pub(crate) const REASONING_EFFORTS: &[&str] =
    &["none", "minimal", "low", "medium", "high", "xhigh"];

async fn chat_completions(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let received = Instant::now();
    let prepared = json_body(body)
        .and_then(|body| choices(&body, |b| prepare_chat_request(&st, b, received, "call_")));
    match prepared {
        Ok((choices, gen)) => respond(st, choices, gen, true).await,
        Err(e) => e.into_response(),
    }
}

type Prepared = (Job, mpsc::UnboundedReceiver<Event>, GenerationRequest);

/// One reply of a request: its job, the receiver of its events, and whether it is the first
/// reply to its prompt (a request's usage counts each prompt once).
type Choice = (Job, mpsc::UnboundedReceiver<Event>, bool);

/// The request's `n` choices: one job prepared (its prompt rendered and encoded once), then a
/// copy of it for each other choice; with a `seed`, choice i samples with seed + i, so they
/// differ and repeat alike.
fn choices(
    body: &Value,
    prepare: impl Fn(&Value) -> ApiResult<Prepared>,
) -> ApiResult<(Vec<Choice>, GenerationRequest)> {
    let (job, rx, gen) = prepare(body)?;
    let seeded = body.get("seed").is_some_and(|s| !s.is_null());
    let others: Vec<Choice> = (1..gen.choices)
        .map(|i| {
            let (mut other, rx) = job.another_choice();
            if seeded {
                other.gen.sampling.seed = gen.sampling.seed.wrapping_add(i as u64);
            }
            (other, rx, false)
        })
        .collect();
    let mut out = vec![(job, rx, true)];
    out.extend(others);
    Ok((out, gen))
}

/// A chat-completions request (as JSON) made into a job; `call_id_prefix` begins its tool-call ids.
fn prepare_chat_request(
    st: &AppState,
    body: &Value,
    received: Instant,
    call_id_prefix: &'static str,
) -> ApiResult<Prepared> {
    let f = Fields::parse(body)?;
    f.check_known(&[api::GENERATION_FIELDS, CHAT_FIELDS].concat())?;
    st.check_model(&f)?;
    let response_format = match f.get("response_format") {
        None | Some(Value::Null) => ResponseFormat::Text,
        Some(rf) => ResponseFormat::parse(rf)
            .map_err(|e| ApiError::bad_request(e, Some("response_format")))?,
    };
    let gen = api::generation_request(&f, &st.format.defaults, true, st.format.vocab_size)?;
    let messages = api::messages(&f)?;
    let tools = api::tools(&f)?;
    let choice = api::tool_choice(&f, tools.as_ref())?;
    if response_format != ResponseFormat::Text && tools.is_some() && choice != ToolChoice::None {
        return Err(ApiError::bad_request(
            "response_format json_object or json_schema cannot be combined with tools (unless tool_choice is \"none\")",
            Some("response_format"),
        ));
    }
    let constraint = match (st.constraint(&response_format)?, &choice, &tools) {
        (Some(c), ..) => Some(c),
        (None, ToolChoice::Required, Some(t)) => st.tool_call_constraint(ForcedCall::AnyOf(t)),
        (None, ToolChoice::Function(name), Some(t)) => {
            st.tool_call_constraint(ForcedCall::Named(t, name))
        }
        _ => None,
    };
    let force = match &choice {
        ToolChoice::Required => Some("<tool_call>\n<function=".to_string()),
        ToolChoice::Function(name) => Some(format!("<tool_call>\n<function={name}>\n")),
        _ => None,
    };
    let ending = PromptEnding::parse(&f)?;
    let last = messages.as_array().and_then(|m| m.last());
    if ending.continue_final_message
        && !last.is_some_and(|m| {
            let calls = m.get("tool_calls").and_then(Value::as_array);
            m["role"] == "assistant" && calls.is_none_or(|c| c.is_empty())
        })
    {
        return Err(ApiError::bad_request(
            "continue_final_message continues an assistant reply: the final message must be the assistant's, without tool calls",
            Some("continue_final_message"),
        ));
    }
    if ending.continue_final_message && (constraint.is_some() || force.is_some()) {
        return Err(ApiError::bad_request(
            "continue_final_message (a reply begun by the caller) cannot be combined with response_format or a forced tool call, which shape the reply from its start",
            Some("continue_final_message"),
        ));
    }
    let (text, prompt) = render_chat(st, &f, messages, &tools, ending)?;
    let max_tokens = st.max_tokens(prompt.len(), &gen)?;
    let branches = st.format.branch_points(&prompt, MIN_SHARED_PREFIX);
    let schemas = tools.as_ref().map(ToolSchemas::from_tools);
    let thinking_budget = f
        .int_in("thinking_token_budget", 0, u32::MAX as i64)?
        .map(|n| n as usize);
    let one_call = match f.get("parallel_tool_calls") {
        None | Some(Value::Bool(true)) => false,
        Some(Value::Bool(false)) => true,
        Some(v) => {
            return Err(ApiError::bad_request(
                format!("'parallel_tool_calls' must be true or false, got {v}"),
                Some("parallel_tool_calls"),
            ))
        }
    };
    let chat = ChatParsing {
        thinking_budget,
        one_call,
        in_reasoning: text.ends_with("<think>\n"),
        tools: if choice == ToolChoice::None {
            None
        } else {
            schemas
        },
        force,
        constraint,
        call_id_prefix,
    };
    let (tx, rx) = mpsc::unbounded_channel();
    let job = Job {
        prompt,
        echo: None,
        prompt_logprobs: None,
        branches,
        gen: gen.clone(),
        max_tokens,
        chat: Some(chat),
        events: tx,
        received,
        deadline: received + st.cfg.request_timeout,
    };
    Ok((job, rx, gen))
}

/// How a chat prompt ends: with the opening of the assistant's turn (the default), or inside the
/// final message, which the model then continues (vLLM's `continue_final_message`: a reply
/// begun by the caller).
#[derive(Clone, Copy)]
pub(crate) struct PromptEnding {
    add_generation_prompt: bool,
    continue_final_message: bool,
}

impl PromptEnding {
    pub(crate) fn parse(f: &Fields) -> ApiResult<Self> {
        let continue_final_message = f.bool("continue_final_message")?;
        let add_generation_prompt = match f.get("add_generation_prompt") {
            None => !continue_final_message,
            Some(_) => f.bool("add_generation_prompt")?,
        };
        if continue_final_message && add_generation_prompt {
            return Err(ApiError::bad_request(
                "continue_final_message and add_generation_prompt cannot both be true: the prompt ends either inside the final message or after it",
                Some("add_generation_prompt"),
            ));
        }
        Ok(PromptEnding {
            add_generation_prompt,
            continue_final_message,
        })
    }
}

/// The prompt of a chat request: its messages (checked by `api::messages`) and tools through
/// the chat template (`chat_template_kwargs` reach it), as text and tokens.
fn render_chat(
    st: &AppState,
    f: &Fields,
    messages: Value,
    tools: &Option<Value>,
    ending: PromptEnding,
) -> ApiResult<(String, Vec<u32>)> {
    let mut kwargs: Map<String, Value> = match f.get("chat_template_kwargs") {
        None => Map::new(),
        Some(Value::Object(o)) => o.clone(),
        Some(_) => {
            return Err(ApiError::bad_request(
                "'chat_template_kwargs' must be an object",
                Some("chat_template_kwargs"),
            ))
        }
    };
    match f.get("reasoning_effort") {
        Some(Value::String(e)) if e == "none" => {
            // an explicit chat_template_kwargs.enable_thinking wins
            kwargs
                .entry("enable_thinking")
                .or_insert(Value::Bool(false));
        }
        None => {}
        Some(Value::String(e)) if REASONING_EFFORTS.contains(&e.as_str()) => {}
        Some(v) => {
            return Err(ApiError::bad_request(
                format!(
                    "'reasoning_effort' must be one of {}, got {v}",
                    REASONING_EFFORTS.join(", ")
                ),
                Some("reasoning_effort"),
            ))
        }
    }
    let text = st
        .format
        .render(
            &messages,
            &ChatOptions {
                add_generation_prompt: ending.add_generation_prompt,
                tools: tools.clone(),
                kwargs,
                continue_final_message: ending.continue_final_message,
            },
        )
        .map_err(|e| ApiError::bad_request(format!("{e:#}"), Some("messages")))?;
    let prompt = st
        .format
        .encode(&text)
        .map_err(|e| ApiError::bad_request(format!("{e:#}"), Some("messages")))?;
    Ok((text, prompt))
}

const COMPLETION_FIELDS: &[&str] = &["prompt", "echo"];

/// Most prompts one completions request may hold (a batch, as evaluation harnesses send).
const MAX_PROMPTS: usize = 64;

async fn completions(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let received = Instant::now();
    let prepared = json_body(body).and_then(|body| {
        let mut all = Vec::new();
        let mut gen = None;
        for prompt in completion_prompts(&st, &body)? {
            let (some, g) = choices(&body, |b| prepare_completion(&st, b, &prompt, received))?;
            all.extend(some);
            gen.get_or_insert(g);
        }
        Ok((
            all,
            gen.ok_or_else(|| internal("a request without prompts"))?,
        ))
    });
    match prepared {
        Ok((choices, gen)) => respond(st, choices, gen, false).await,
        Err(e) => e.into_response(),
    }
}

/// One prompt of a completions request: its tokens, and its text (what `echo` gives back).
struct CompletionPrompt {
    ids: Vec<u32>,
    text: String,
}

/// A completions request's prompts: a string, token ids, or a list of either (a batch, each
/// prompt's choices after the one before's).
fn completion_prompts(st: &AppState, body: &Value) -> ApiResult<Vec<CompletionPrompt>> {
    let bad = |msg: String| ApiError::bad_request(msg, Some("prompt"));
    let from_text = |s: &str| -> ApiResult<CompletionPrompt> {
        let ids = st.format.encode(s).map_err(|e| bad(format!("{e:#}")))?;
        Ok(CompletionPrompt {
            ids,
            text: s.to_string(),
        })
    };
    let from_ids = |a: &[Value]| -> ApiResult<CompletionPrompt> {
        let ids = api::token_ids(a, st.vocab_size).map_err(|x| {
            bad(format!(
                "token id {x} is not one of the vocabulary's ({} ids)",
                st.vocab_size
            ))
        })?;
        let text = st.format.decode(&ids).map_err(|e| bad(format!("{e:#}")))?;
        Ok(CompletionPrompt { ids, text })
    };
    let prompts = match body.get("prompt") {
        Some(Value::String(s)) => vec![from_text(s)?],
        Some(Value::Array(a)) if !a.is_empty() && a.iter().all(Value::is_number) => {
            vec![from_ids(a)?]
        }
        Some(Value::Array(a)) if !a.is_empty() && a.iter().all(Value::is_string) => a
            .iter()
            .map(|s| from_text(s.as_str().unwrap_or_default()))
            .collect::<ApiResult<_>>()?,
        Some(Value::Array(a)) if !a.is_empty() && a.iter().all(Value::is_array) => a
            .iter()
            .map(|ids| from_ids(ids.as_array().map_or(&[], Vec::as_slice)))
            .collect::<ApiResult<_>>()?,
        _ => {
            return Err(bad(
                "'prompt' must be a string, token ids, or a non-empty list of strings or of token-id lists".into(),
            ))
        }
    };
    if prompts.len() > MAX_PROMPTS {
        return Err(bad(format!(
            "'prompt' holds {} prompts; at most {MAX_PROMPTS}",
            prompts.len()
        )));
    }
    if let Some(i) = prompts.iter().position(|p| p.ids.is_empty()) {
        return Err(bad(format!("prompt {i} encodes to no tokens")));
    }
    Ok(prompts)
}

/// One prompt of a completions request made into a job.
fn prepare_completion(
    st: &AppState,
    body: &Value,
    prompt: &CompletionPrompt,
    received: Instant,
) -> ApiResult<Prepared> {
    let f = Fields::parse(body)?;
    f.check_known(&[api::GENERATION_FIELDS, COMPLETION_FIELDS].concat())?;
    st.check_model(&f)?;
    let gen = api::generation_request(&f, &st.format.defaults, false, st.format.vocab_size)?;
    let echo = f.bool("echo")?;
    if gen.max_tokens == Some(0) && !echo {
        return Err(ApiError::bad_request(
            "'max_tokens' may be 0 only with 'echo': true (the prompt's log-probabilities are then the answer)",
            Some("max_tokens"),
        ));
    }
    let max_tokens = st.max_tokens(prompt.ids.len(), &gen)?;
    let (tx, rx) = mpsc::unbounded_channel();
    let job = Job {
        prompt: prompt.ids.clone(),
        echo: echo.then(|| prompt.text.clone()),
        prompt_logprobs: gen.logprobs.filter(|_| echo),
        branches: Vec::new(),
        gen: gen.clone(),
        max_tokens,
        chat: None,
        events: tx,
        received,
        deadline: received + st.cfg.request_timeout,
    };
    Ok((job, rx, gen))
}

/// The completions API's log-probabilities of some tokens (text, log-probability and
/// alternatives with the token itself among them, as vLLM gives; none for a prompt's first
/// token): the lists it gives per choice, each token's place in the choice's text counted on
/// from `offset` by the lengths of the tokens' texts.
fn completion_logprobs<'a>(
    entries: impl Iterator<Item = (&'a str, Option<&'a TokenLogprob>)>,
    offset: &mut usize,
) -> Value {
    let (mut tokens, mut logprobs, mut tops, mut offsets) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for (token, entry) in entries {
        tokens.push(json!(token));
        offsets.push(json!(*offset));
        *offset += token.chars().count();
        match entry {
            None => {
                logprobs.push(Value::Null);
                tops.push(Value::Null);
            }
            Some(e) => {
                logprobs.push(json!(e.logprob));
                let mut top: Map<String, Value> = e
                    .top_logprobs
                    .iter()
                    .map(|t| (t.token.clone(), json!(t.logprob)))
                    .collect();
                top.entry(e.token.clone()).or_insert(json!(e.logprob));
                tops.push(Value::Object(top));
            }
        }
    }
    json!({"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops,
           "text_offset": offsets})
}

/// The completions entries of tokens chosen by the model.
fn chosen(entries: &[TokenLogprob]) -> impl Iterator<Item = (&str, Option<&TokenLogprob>)> {
    entries.iter().map(|e| (e.token.as_str(), Some(e)))
}

/// The completions entries of an echoed prompt: its first token (no log-probability), then the
/// rest.
fn prompt_entries<'a>(
    first_token: &'a str,
    rest: &'a [TokenLogprob],
) -> impl Iterator<Item = (&'a str, Option<&'a TokenLogprob>)> {
    std::iter::once((first_token, None)).chain(chosen(rest))
}

fn logprobs_json(entries: &[TokenLogprob]) -> Value {
    json!({"content": entries})
}

fn usage_json(u: &Usage) -> Value {
    json!({"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
           "total_tokens": u.prompt_tokens + u.completion_tokens,
           "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
           "completion_tokens_details": {"reasoning_tokens": u.reasoning_tokens}})
}

/// Chat-completion `delta` objects for some parser deltas.
fn chat_deltas(deltas: &[Delta]) -> Vec<Value> {
    deltas
        .iter()
        .map(|d| match d {
            Delta::Reasoning(s) => json!({"reasoning_content": s}),
            Delta::Content(s) => json!({"content": s}),
            Delta::CallStart { index, id, name } => {
                json!({"tool_calls": [{"index": index, "id": id, "type": "function", "function": {"name": name, "arguments": ""}}]})
            }
            Delta::CallArguments { index, fragment } => json!({"tool_calls": [{"index": index, "function": {"arguments": fragment}}]}),
        })
        .collect()
}

/// Answers a chat or completions request: its first choice is queued now (a full queue is a
/// 429), each later one when the one before it has finished, so other requests keep their turn.
async fn respond(
    st: Arc<AppState>,
    choices: Vec<Choice>,
    gen: GenerationRequest,
    chat: bool,
) -> Response {
    // each choice: its job until queued, its events, and whether its prompt is the one before's
    let mut queue: Vec<(Option<Job>, mpsc::UnboundedReceiver<Event>, bool)> = Vec::new();
    for (i, (job, rx, first_of_prompt)) in choices.into_iter().enumerate() {
        let same_prompt = !first_of_prompt;
        if i == 0 {
            if let Err(e) = st.enqueue(job) {
                return e.into_response();
            }
            queue.push((None, rx, same_prompt));
        } else {
            queue.push((Some(job), rx, same_prompt));
        }
    }
    let id = st.next_id(if chat { "chatcmpl" } else { "cmpl" });
    let created = now();
    let model = st.cfg.model_name.clone();
    if gen.stream {
        let (out_tx, out_rx) = mpsc::unbounded_channel::<Result<SseEvent, Infallible>>();
        tokio::spawn(async move {
            let object = if chat {
                "chat.completion.chunk"
            } else {
                "text_completion"
            };
            let chunk = |choice: Value| json!({"id": id, "object": object, "created": created, "model": model, "choices": [choice]});
            let send = |v: Value| {
                out_tx
                    .send(Ok(SseEvent::default().data(v.to_string())))
                    .is_ok()
            };
            let error_chunk = |message: &str| json!({"error": {"message": message, "type": "server_error", "param": null, "code": null}});
            // the usage so far; None once a choice has failed
            let mut total = Some(Usage::default());
            'choices: for (index, (job, mut rx, same_prompt)) in queue.into_iter().enumerate() {
                // where the next token's text starts in the choice's (an echoed prompt's first)
                let mut offset = 0;
                if let Some(job) = job {
                    if let Err(e) = st.enqueue(job) {
                        send(error_chunk(&e.message));
                        total = None;
                        break;
                    }
                }
                if chat
                    && !send(chunk(
                        json!({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}),
                    ))
                {
                    return;
                }
                while let Some(ev) = rx.recv().await {
                    let alive = match ev {
                        Event::Prompt {
                            text,
                            first_token,
                            logprobs,
                        } => {
                            let lp = match &logprobs {
                                Some(rest) => completion_logprobs(
                                    prompt_entries(&first_token, rest),
                                    &mut offset,
                                ),
                                None => Value::Null,
                            };
                            send(chunk(
                                json!({"index": index, "text": text, "logprobs": lp, "finish_reason": null}),
                            ))
                        }
                        Event::Deltas { deltas, logprobs } => {
                            if chat {
                                let lp = if logprobs.is_empty() {
                                    Value::Null
                                } else {
                                    logprobs_json(&logprobs)
                                };
                                let mut ds = chat_deltas(&deltas);
                                if ds.is_empty() && !logprobs.is_empty() {
                                    ds.push(json!({"content": ""}));
                                }
                                let n = ds.len();
                                ds.into_iter().enumerate().all(|(i, d)| {
                                    let lp = if i + 1 == n { lp.clone() } else { Value::Null };
                                    send(chunk(json!({"index": index, "delta": d, "logprobs": lp, "finish_reason": null})))
                                })
                            } else {
                                let text: String = deltas
                                    .iter()
                                    .filter_map(|d| {
                                        if let Delta::Content(s) = d {
                                            Some(s.as_str())
                                        } else {
                                            None
                                        }
                                    })
                                    .collect();
                                let lp = if gen.logprobs.is_some() {
                                    completion_logprobs(chosen(&logprobs), &mut offset)
                                } else {
                                    Value::Null
                                };
                                send(chunk(
                                    json!({"index": index, "text": text, "logprobs": lp, "finish_reason": null}),
                                ))
                            }
                        }
                        Event::Done {
                            finish_reason,
                            usage,
                            ..
                        } => {
                            let last = if chat {
                                json!({"index": index, "delta": {}, "logprobs": null, "finish_reason": finish_reason})
                            } else {
                                json!({"index": index, "text": "", "logprobs": null, "finish_reason": finish_reason})
                            };
                            send(chunk(last));
                            total = total.map(|t| t.with_choice(&usage, same_prompt));
                            continue 'choices;
                        }
                        Event::Error { message, .. } => {
                            send(error_chunk(&message));
                            total = None;
                            break 'choices;
                        }
                    };
                    if !alive {
                        return; // client gone: dropping rx tells the engine to stop
                    }
                }
                total = None; // the engine ended the reply without a result
                break;
            }
            if let (true, Some(usage)) = (gen.include_usage, total) {
                send(
                    json!({"id": id, "object": object, "created": created, "model": model, "choices": [], "usage": usage_json(&usage)}),
                );
            }
            let _ = out_tx.send(Ok(SseEvent::default().data("[DONE]")));
        });
        return Sse::new(UnboundedReceiverStream::new(out_rx))
            .keep_alive(KeepAlive::default())
            .into_response();
    }

    let mut replies = Vec::new();
    let mut total = Usage::default();
    for (index, (job, mut rx, same_prompt)) in queue.into_iter().enumerate() {
        if let Some(job) = job {
            if let Err(e) = st.enqueue(job) {
                return e.into_response();
            }
        }
        let whole = match whole_reply(&mut rx).await {
            Ok(w) => w,
            Err(e) => return e.into_response(),
        };
        total = total.with_choice(&whole.usage, same_prompt);
        let parse::Reply {
            reasoning,
            content,
            calls,
        } = parse::collect(&whole.deltas);
        let finish_reason = whole.finish_reason;
        let lp = match (&gen.logprobs, chat, &whole.prompt) {
            (None, ..) => Value::Null,
            (Some(_), true, _) => logprobs_json(&whole.logprobs),
            (Some(_), false, Some((_, first, Some(rest)))) => completion_logprobs(
                prompt_entries(first, rest).chain(chosen(&whole.logprobs)),
                &mut 0,
            ),
            (Some(_), false, _) => completion_logprobs(chosen(&whole.logprobs), &mut 0),
        };
        let echo = whole.prompt.map(|(text, ..)| text).unwrap_or_default();
        replies.push(if chat {
            let mut message = json!({"role": "assistant", "content": if content.is_empty() && !calls.is_empty() { Value::Null } else { Value::String(content) }});
            if !reasoning.is_empty() {
                message["reasoning_content"] = Value::String(reasoning);
            }
            if !calls.is_empty() {
                message["tool_calls"] = calls.iter().map(parse::ToolCall::chat_json).collect();
            }
            json!({"index": index, "message": message, "logprobs": lp, "finish_reason": finish_reason})
        } else {
            json!({"index": index, "text": echo + &content, "logprobs": lp, "finish_reason": finish_reason})
        });
    }
    let usage = usage_json(&total);
    let object = if chat {
        "chat.completion"
    } else {
        "text_completion"
    };
    Json(
        json!({"id": id, "object": object, "created": created, "model": model,
                "choices": replies, "usage": usage}),
    )
    .into_response()
}

#[cfg(test)]
mod tests {
    use super::rfc3339;

    #[test]
    fn epoch_seconds_as_rfc3339() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_796_428_799), "2026-12-04T23:59:59Z");
        assert_eq!(rfc3339(4_107_542_400), "2100-03-01T00:00:00Z");
    }
}
