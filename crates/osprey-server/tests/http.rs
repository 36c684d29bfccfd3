//! The server over real HTTP on 127.0.0.1: a tiny synthetic model for real generation, and a
//! scripted backend (fixed replies through the real tokenizer) for exact streaming and parsing.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use futures_util::StreamExt;
use osprey_engine::{Backend, CpuBackend, Engine, LogitsFor, SessionState};
use osprey_model::config::ModelConfig;
use osprey_model::synth::{write_checkpoint, Preset, SynthOptions};
use osprey_model::ModelWeights;
use osprey_prompt::PromptFormat;
use osprey_server::{app, ServerConfig};
use serde_json::{json, Value};

/// The tiny synthetic model, made once per build directory and reused by later runs (the seed
/// fixes its bytes): written beside its final name and renamed into place, so an interrupted or
/// concurrent run never leaves a half-written model there.
fn tiny_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("osprey-http-tiny-seed1");
        if !dir.join("config.json").exists() {
            let part = dir.with_extension(format!("part-{}", std::process::id()));
            write_checkpoint(
                &part,
                &SynthOptions {
                    preset: Preset::Tiny,
                    layers: None,
                    seed: 1,
                    show_progress: false,
                    mtp: false,
                },
            )
            .unwrap();
            // another run may have put its copy there first: then that one serves
            if let Err(e) = std::fs::rename(&part, &dir) {
                std::fs::remove_dir_all(&part).unwrap();
                assert!(
                    dir.join("config.json").exists(),
                    "placing {}: {e}",
                    dir.display()
                );
            }
        }
        dir
    })
}

fn config() -> ServerConfig {
    ServerConfig {
        model_name: "tiny".into(),
        model_aliases: Vec::new(),
        api_key: None,
        max_context: 4096,
        max_queue: 8,
        request_timeout: Duration::from_secs(60),
        cache_entries: 8,
        cache_bytes: 1 << 30,
        max_body_bytes: 1 << 20,
        default_max_tokens: 16,
    }
}

/// Replies with a fixed token script after any prompt.
struct Scripted {
    config: ModelConfig,
    script: Vec<u32>,
    delay: Duration,
    /// Chooses tokens itself like the GPU backend (one step ahead of what it hands over).
    device: bool,
    /// What the server asked of it: the states it was told to keep, the histories it ran after.
    calls: Arc<Mutex<Calls>>,
}

#[derive(Default)]
struct Calls {
    kept: Vec<Vec<u32>>,
    ran_after: Vec<Vec<u32>>,
    /// Acts as a device backend that lost every state: each call's history is run again.
    forgets: bool,
    /// The next forward call panics (a defect in the engine).
    panic_once: bool,
    recomputed: usize,
    /// Tokens handed over by `decode_on_device`, and how many came with log-probabilities.
    device_tokens: usize,
    device_summaries: usize,
}

impl Scripted {
    /// A pure function of the sequence: continue the script from however much of it the
    /// sequence already ends with (so cached and replayed states behave like a real model).
    fn next_after(&self, seq: &[u32]) -> u32 {
        let done = (0..=self.script.len())
            .rev()
            .find(|&k| seq.ends_with(&self.script[..k]))
            .unwrap_or(0);
        self.script[done.min(self.script.len() - 1)]
    }

    /// Its logits after `seq`: the scripted next token far ahead of the rest.
    fn logits_after(&self, seq: &[u32]) -> Vec<f32> {
        let mut logits = vec![0.0; self.config.vocab_size];
        logits[self.next_after(seq) as usize] = 100.0;
        logits
    }
}

impl Backend for Scripted {
    fn name(&self) -> &'static str {
        "scripted"
    }
    fn config(&self) -> &ModelConfig {
        &self.config
    }
    fn new_state(&self) -> SessionState {
        SessionState::new(&self.config)
    }
    fn forward(
        &self,
        state: &mut SessionState,
        history: &[u32],
        tokens: &[u32],
        want: LogitsFor,
    ) -> anyhow::Result<Vec<f32>> {
        std::thread::sleep(self.delay);
        let panics = self
            .calls
            .lock()
            .map(|mut c| std::mem::take(&mut c.panic_once))
            .unwrap_or(false);
        assert!(!panics, "scripted defect");
        state.position += tokens.len();
        if let Ok(mut c) = self.calls.lock() {
            c.ran_after.push(history.to_vec());
            if c.forgets {
                c.recomputed += history.len();
            }
        }
        let seq: Vec<u32> = history.iter().chain(tokens).copied().collect();
        Ok(if want == LogitsFor::None {
            Vec::new()
        } else {
            self.logits_after(&seq)
        })
    }

    /// The CUDA backend's contract (`osprey_engine::decode_by_steps`), log-probabilities too.
    fn decode_on_device(
        &self,
        state: &mut SessionState,
        history: &[u32],
        run: &osprey_engine::DeviceRun,
        on_token: &mut osprey_engine::OnToken,
    ) -> anyhow::Result<Option<Vec<u32>>> {
        if !self.device {
            return Ok(None);
        }
        if let Ok(mut c) = self.calls.lock() {
            if c.forgets {
                c.recomputed += history.len();
            }
        }
        let choose = |seq: &[u32]| {
            std::thread::sleep(self.delay);
            self.next_after(seq)
        };
        let ran = osprey_engine::decode_by_steps(
            history,
            run,
            &choose,
            &|seq| self.logits_after(seq),
            &mut |t, summary| {
                if let Ok(mut c) = self.calls.lock() {
                    c.device_tokens += 1;
                    c.device_summaries += usize::from(summary.is_some());
                }
                on_token(t, summary)
            },
        );
        state.position += ran.len();
        Ok(Some(ran))
    }

    fn recomputed_tokens(&self) -> usize {
        self.calls.lock().map_or(0, |c| c.recomputed)
    }

    fn keep_state(&self, tokens: &[u32]) -> anyhow::Result<()> {
        if let Ok(mut c) = self.calls.lock() {
            c.kept.push(tokens.to_vec());
        }
        Ok(())
    }
}

struct Server {
    base: String,
    client: reqwest::Client,
}

impl Server {
    async fn start(engine: Engine, cfg: ServerConfig) -> Server {
        let format = PromptFormat::from_dir(tiny_dir()).unwrap();
        let router = app(engine, format, cfg).unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
        Server {
            base: format!("http://{addr}"),
            client: reqwest::Client::new(),
        }
    }

    async fn tiny(cfg: ServerConfig) -> Server {
        Server::start(
            Engine::new(Box::new(CpuBackend::new(
                ModelWeights::load(tiny_dir()).unwrap(),
            ))),
            cfg,
        )
        .await
    }

    async fn scripted(reply: &str, delay: Duration, cfg: ServerConfig) -> Server {
        Server::scripted_on(reply, delay, cfg, false).await
    }

    /// `device`: the backend chooses tokens itself, as the GPU does.
    async fn scripted_on(reply: &str, delay: Duration, cfg: ServerConfig, device: bool) -> Server {
        Server::scripted_calls(reply, delay, cfg, device).await.0
    }

    /// A scripted server and the record of what it asked of its backend.
    async fn scripted_calls(
        reply: &str,
        delay: Duration,
        cfg: ServerConfig,
        device: bool,
    ) -> (Server, Arc<Mutex<Calls>>) {
        let format = PromptFormat::from_dir(tiny_dir()).unwrap();
        let mut script = format.encode(reply).unwrap();
        script.push(248046); // <|im_end|>
        let calls = Arc::new(Mutex::new(Calls::default()));
        let backend = Scripted {
            config: ModelConfig::from_dir(tiny_dir()).unwrap(),
            script,
            delay,
            device,
            calls: calls.clone(),
        };
        (
            Server::start(Engine::new(Box::new(backend)), cfg).await,
            calls,
        )
    }

    async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        let r = self
            .client
            .post(format!("{}{path}", self.base))
            .json(&body)
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or(Value::Null))
    }

    /// Posts a request the server must refuse with a 400 naming `param`.
    async fn refuses(&self, path: &str, body: Value, param: &str) {
        let (st, r) = self.post(path, body).await;
        assert_eq!((st, &r["error"]["param"]), (400, &json!(param)), "{r}");
    }

    async fn post_raw(&self, path: &str, body: Vec<u8>, key: Option<&str>) -> (u16, Value) {
        let mut req = self
            .client
            .post(format!("{}{path}", self.base))
            .header("content-type", "application/json")
            .body(body);
        if let Some(k) = key {
            req = req.bearer_auth(k);
        }
        let r = req.send().await.unwrap();
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or(Value::Null))
    }

    /// The server-sent events of a streaming request, as text.
    async fn sse_text(&self, path: &str, body: Value) -> String {
        let r = self
            .client
            .post(format!("{}{path}", self.base))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 200);
        assert!(r.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream"));
        r.text().await.unwrap()
    }

    /// SSE `data:` payloads of a streaming request.
    async fn stream(&self, body: Value) -> Vec<String> {
        let text = self.sse_text("/v1/chat/completions", body).await;
        text.lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .map(String::from)
            .collect()
    }

    async fn metric(&self, name: &str) -> f64 {
        let text = self
            .client
            .get(format!("{}/metrics", self.base))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        text.lines()
            .find_map(|l| {
                l.strip_prefix(&format!("{name} "))
                    .and_then(|v| v.parse().ok())
            })
            .unwrap_or(0.0)
    }
}

const WEATHER: &str = r#"[{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]"#;

const CALL_REPLY: &str = "Need weather.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>";

fn user(text: &str) -> Value {
    json!([{"role": "user", "content": text}])
}

/// `body` with the fields of `extra` set on it.
fn with(mut body: Value, extra: Value) -> Value {
    for (key, v) in extra.as_object().unwrap() {
        body[key] = v.clone();
    }
    body
}

#[tokio::test]
async fn health_models_and_metrics() {
    let s = Server::tiny(config()).await;
    let h: Value = s
        .client
        .get(format!("{}/health", s.base))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(h["status"], "ok");
    let m: Value = s
        .client
        .get(format!("{}/v1/models", s.base))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(m["data"][0]["id"], "tiny");
    let (st, _) = s
        .post(
            "/v1/chat/completions",
            json!({"messages": user("hi"), "max_tokens": 3}),
        )
        .await;
    assert_eq!(st, 200);
    assert_eq!(s.metric("osprey_generated_tokens_total").await, 3.0);
    assert!(s.metric("osprey_requests_total{status=\"200\"}").await >= 1.0);
}

#[tokio::test]
async fn reasoning_and_tool_call_non_streaming() {
    let s = Server::scripted(CALL_REPLY, Duration::ZERO, config()).await;
    let tools: Value = serde_json::from_str(WEATHER).unwrap();
    let (st, r) = s
        .post(
            "/v1/chat/completions",
            json!({"messages": user("weather?"), "tools": tools, "max_tokens": 100}),
        )
        .await;
    assert_eq!(st, 200, "{r}");
    let c = &r["choices"][0];
    assert_eq!(c["finish_reason"], "tool_calls");
    assert_eq!(c["message"]["reasoning_content"], "Need weather.");
    assert!(c["message"]["content"].is_null());
    let call = &c["message"]["tool_calls"][0];
    assert_eq!(call["type"], "function");
    assert_eq!(call["function"]["name"], "get_weather");
    let args: Value =
        serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, json!({"city": "Paris", "days": 3}));
    assert!(r["usage"]["completion_tokens"].as_u64().unwrap() > 10);
}

#[tokio::test]
async fn streaming_framing_with_tool_call_fragments() {
    let s = Server::scripted(CALL_REPLY, Duration::ZERO, config()).await;
    let tools: Value = serde_json::from_str(WEATHER).unwrap();
    let events = s.stream(json!({"messages": user("weather?"), "tools": tools, "max_tokens": 100, "stream": true, "stream_options": {"include_usage": true}})).await;
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(chunks
        .iter()
        .all(|c| c["object"] == "chat.completion.chunk"));
    let deltas: Vec<&Value> = chunks
        .iter()
        .filter_map(|c| c["choices"].get(0))
        .map(|c| &c["delta"])
        .collect();
    let reasoning: String = deltas
        .iter()
        .filter_map(|d| d["reasoning_content"].as_str())
        .collect();
    assert_eq!(reasoning, "Need weather.");
    let calls: Vec<&Value> = deltas
        .iter()
        .filter_map(|d| d["tool_calls"].get(0))
        .collect();
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    assert!(calls[0]["id"].as_str().unwrap().starts_with("call_"));
    assert!(calls.iter().all(|c| c["index"] == 0));
    assert!(calls.len() >= 3, "arguments arrive in fragments: {calls:?}");
    let args: String = calls
        .iter()
        .filter_map(|c| c["function"]["arguments"].as_str())
        .collect();
    assert_eq!(
        serde_json::from_str::<Value>(&args).unwrap(),
        json!({"city": "Paris", "days": 3})
    );
    let finish: Vec<&Value> = chunks
        .iter()
        .filter_map(|c| c["choices"].get(0))
        .map(|c| &c["finish_reason"])
        .filter(|f| !f.is_null())
        .collect();
    assert_eq!(finish, vec!["tool_calls"]);
    let usage = &chunks.last().unwrap()["usage"];
    assert!(chunks.last().unwrap()["choices"]
        .as_array()
        .unwrap()
        .is_empty());
    assert_eq!(
        usage["total_tokens"],
        usage["prompt_tokens"].as_u64().unwrap() + usage["completion_tokens"].as_u64().unwrap()
    );
}

#[tokio::test]
async fn stop_strings_end_the_reply_and_never_leak() {
    let s = Server::scripted("Hello STOP world, more text", Duration::ZERO, config()).await;
    let body = json!({"messages": user("x"), "stop": ["STOP"], "chat_template_kwargs": {"enable_thinking": false}});
    let (st, r) = s.post("/v1/chat/completions", body.clone()).await;
    assert_eq!(st, 200, "{r}");
    assert_eq!(r["choices"][0]["message"]["content"], "Hello ");
    assert_eq!(r["choices"][0]["finish_reason"], "stop");
    let mut streamed = body;
    streamed["stream"] = json!(true);
    let events = s.stream(streamed).await;
    let text: String = events
        .iter()
        .filter(|e| *e != "[DONE]")
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .filter_map(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .map(String::from)
        })
        .collect();
    assert_eq!(text, "Hello ");
}

#[tokio::test]
async fn client_disconnect_cancels_generation() {
    let s = Server::scripted(
        "a b c d e f g h i j k l m n o p",
        Duration::from_millis(20),
        config(),
    )
    .await;
    let body = json!({"messages": user("x"), "max_tokens": 1000, "stream": true});
    let r = s
        .client
        .post(format!("{}/v1/chat/completions", s.base))
        .json(&body)
        .send()
        .await
        .unwrap();
    let mut stream = r.bytes_stream();
    stream.next().await.unwrap().unwrap();
    drop(stream);
    for _ in 0..100 {
        if s.metric("osprey_cancelled_total").await >= 1.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(s.metric("osprey_cancelled_total").await, 1.0);
    // the engine is free again
    let (st, _) = s
        .post(
            "/v1/chat/completions",
            json!({"messages": user("y"), "max_tokens": 2}),
        )
        .await;
    assert_eq!(st, 200);
}

#[tokio::test]
async fn full_queue_answers_429() {
    let cfg = ServerConfig {
        max_queue: 1,
        ..config()
    };
    let s = Arc::new(
        Server::scripted(
            "one two three four five six",
            Duration::from_millis(30),
            cfg,
        )
        .await,
    );
    let mut handles = Vec::new();
    for _ in 0..4 {
        let s = s.clone();
        handles.push(tokio::spawn(async move {
            s.post(
                "/v1/chat/completions",
                json!({"messages": user("x"), "max_tokens": 6}),
            )
            .await
        }));
    }
    let mut codes = Vec::new();
    for h in handles {
        let (st, body) = h.await.unwrap();
        if st == 429 {
            assert_eq!(body["error"]["code"], "queue_full");
        }
        codes.push(st);
    }
    assert!(codes.contains(&200) && codes.contains(&429), "{codes:?}");
}

#[tokio::test]
async fn errors_use_the_openai_envelope() {
    let cfg = ServerConfig {
        api_key: Some("sekret".into()),
        max_context: 64,
        max_body_bytes: 4096,
        ..config()
    };
    let s = Server::tiny(cfg).await;
    let k = Some("sekret");
    let ok_body = |extra: Value| {
        serde_json::to_vec(&with(
            json!({"messages": user("hi"), "max_tokens": 2}),
            extra,
        ))
        .unwrap()
    };
    let cases: Vec<(Vec<u8>, Option<&str>, u16, &str)> = vec![
        (ok_body(json!({})), None, 401, "invalid_api_key"),
        (ok_body(json!({})), Some("wrong"), 401, "invalid_api_key"),
        (b"{not json".to_vec(), k, 400, "not valid JSON"),
        (b"[1, 2]".to_vec(), k, 400, "JSON object"),
        (br#"{"max_tokens": 2}"#.to_vec(), k, 400, "'messages'"),
        (
            ok_body(json!({"temperature": "hot"})),
            k,
            400,
            "'temperature'",
        ),
        (ok_body(json!({"top_p": 2})), k, 400, "'top_p'"),
        (ok_body(json!({"max_tokens": 0})), k, 400, "'max_tokens'"),
        (ok_body(json!({"n": 17})), k, 400, "'n'"),
        (ok_body(json!({"prediction": {}})), k, 400, "not supported"),
        (
            ok_body(json!({"frobnicate": 1})),
            k,
            400,
            "unrecognized request field 'frobnicate'",
        ),
        (
            ok_body(json!({"messages": [{"role": "wizard", "content": "x"}]})),
            k,
            400,
            "'wizard'",
        ),
        (
            ok_body(json!({"messages": [{"role": "user", "content": 5}]})),
            k,
            400,
            "content",
        ),
        (
            ok_body(json!({"tool_choice": "required"})),
            k,
            400,
            "no 'tools'",
        ),
        (ok_body(json!({"stop": 7})), k, 400, "'stop'"),
        (
            ok_body(json!({"response_format": {"type": "yaml"}})),
            k,
            400,
            "is not supported (expected text, json_object or json_schema)",
        ),
        (
            ok_body(
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}),
            ),
            k,
            400,
            "cannot be enforced",
        ),
        (
            ok_body(
                json!({"response_format": {"type": "json_object"}, "tools": serde_json::from_str::<Value>(WEATHER).unwrap()}),
            ),
            k,
            400,
            "cannot be combined with tools",
        ),
        (
            ok_body(json!({"messages": [{"role": "assistant", "content": "only"}]})),
            k,
            400,
            "No user query",
        ),
        (
            ok_body(json!({"messages": user(&"word ".repeat(200))})),
            k,
            400,
            "more than this server's context",
        ),
        (
            ok_body(json!({"model": "gpt-5"})),
            k,
            404,
            "model_not_found",
        ),
        (
            ok_body(json!({"messages": user(&"x".repeat(8000))})),
            k,
            413,
            "request_too_large",
        ),
    ];
    for (body, key, want, needle) in cases {
        let (st, r) = s.post_raw("/v1/chat/completions", body.clone(), key).await;
        assert_eq!(
            st,
            want,
            "{}: {r}",
            String::from_utf8_lossy(&body[..body.len().min(80)])
        );
        let err = &r["error"];
        assert!(
            err["message"].is_string()
                && err.get("type").is_some()
                && err.get("param").is_some()
                && err.get("code").is_some(),
            "{r}"
        );
        assert!(r.to_string().contains(needle), "want {needle:?} in {r}");
    }
    let r = s
        .client
        .get(format!("{}/v2/nothing", s.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 404);
    let r: Value = r.json().await.unwrap();
    assert_eq!(r["error"]["code"], "not_found");
    let (st, _) = s
        .post_raw("/v1/chat/completions", ok_body(json!({})), k)
        .await;
    assert_eq!(
        st, 200,
        "a valid request still works after all the bad ones"
    );
}

#[tokio::test]
async fn second_turn_prefills_only_new_tokens_and_matches_a_cold_run() {
    let warm = Server::tiny(config()).await;
    let cold = Server::tiny(ServerConfig {
        cache_entries: 0,
        ..config()
    })
    .await;
    let greedy = |messages: Value| json!({"messages": messages, "max_tokens": 8, "temperature": 0, "chat_template_kwargs": {"enable_thinking": false}});
    let (_, r1) = warm
        .post("/v1/chat/completions", greedy(user("What is an osprey?")))
        .await;
    let reply = r1["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    let turn2 = json!([{"role": "user", "content": "What is an osprey?"}, {"role": "assistant", "content": reply}, {"role": "user", "content": "Where do they live?"}]);
    let (_, w) = warm
        .post("/v1/chat/completions", greedy(turn2.clone()))
        .await;
    let (_, c) = cold.post("/v1/chat/completions", greedy(turn2)).await;
    let cached = w["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    let prompt = w["usage"]["prompt_tokens"].as_u64().unwrap();
    let turn1_prompt = r1["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(
        cached >= turn1_prompt - 5,
        "turn 2 reused {cached} of {prompt} tokens (turn 1 prompt was {turn1_prompt})"
    );
    assert!(cached < prompt);
    assert_eq!(c["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(
        w["choices"][0]["message"], c["choices"][0]["message"],
        "cached and cold runs must agree"
    );
}

#[tokio::test]
async fn named_tool_choice_forces_a_call() {
    let s = Server::tiny(config()).await;
    let tools: Value = serde_json::from_str(WEATHER).unwrap();
    let body = json!({"messages": user("hi"), "tools": tools, "max_tokens": 4,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "chat_template_kwargs": {"enable_thinking": false}});
    let (st, r) = s.post("/v1/chat/completions", body).await;
    assert_eq!(st, 200, "{r}");
    let call = &r["choices"][0]["message"]["tool_calls"][0];
    assert_eq!(call["function"]["name"], "get_weather");
    assert!(
        serde_json::from_str::<Value>(call["function"]["arguments"].as_str().unwrap())
            .unwrap()
            .is_object()
    );
}

#[tokio::test]
async fn logprobs_and_completions_endpoint() {
    let s = Server::tiny(config()).await;
    let (st, r) = s.post("/v1/chat/completions", json!({"messages": user("hi"), "max_tokens": 3, "logprobs": true, "top_logprobs": 2, "temperature": 0})).await;
    assert_eq!(st, 200, "{r}");
    let content = r["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 3);
    for e in content {
        let top = e["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 2);
        assert!(e["logprob"].as_f64().unwrap() <= 0.0);
        // greedy: the chosen token is the most likely one
        assert!(
            (top[0]["logprob"].as_f64().unwrap() - e["logprob"].as_f64().unwrap()).abs() < 1e-5
        );
    }
    let (st, r) = s
        .post(
            "/v1/completions",
            json!({"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}),
        )
        .await;
    assert_eq!(st, 200, "{r}");
    assert_eq!(r["object"], "text_completion");
    assert!(r["choices"][0]["text"].is_string());
    assert_eq!(r["usage"]["completion_tokens"], 4);
    let (st, _) = s
        .post("/v1/completions", json!({"prompt": [1, 2, 999999]}))
        .await;
    assert_eq!(st, 400);
}

#[tokio::test]
async fn slow_request_times_out_with_504() {
    let cfg = ServerConfig {
        request_timeout: Duration::from_millis(300),
        ..config()
    };
    let s = Server::scripted(
        "a b c d e f g h i j k l m n o p q r s t",
        Duration::from_millis(50),
        cfg,
    )
    .await;
    let (st, r) = s
        .post(
            "/v1/chat/completions",
            json!({"messages": user("x"), "max_tokens": 1000}),
        )
        .await;
    assert_eq!(st, 504, "{r}");
    assert_eq!(r["error"]["code"], "timeout");
    // the engine moves on
    let (st, _) = s
        .post(
            "/v1/chat/completions",
            json!({"messages": user("y"), "max_tokens": 1}),
        )
        .await;
    assert_eq!(st, 200);
}

#[tokio::test]
async fn repeated_prompt_is_served_without_prefill() {
    let s = Server::tiny(config()).await;
    let body = json!({"messages": user("Same question again"), "max_tokens": 6, "temperature": 0});
    let (_, first) = s.post("/v1/chat/completions", body.clone()).await;
    let (_, second) = s.post("/v1/chat/completions", body).await;
    let prompt = second["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(
        second["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap(),
        prompt
    );
    assert_eq!(
        first["choices"][0]["message"],
        second["choices"][0]["message"]
    );
}

/// What a reply says, without its random ids and timestamps.
fn reply_content(r: &Value) -> Value {
    let c = &r["choices"][0];
    let calls: Vec<Value> = c["message"]["tool_calls"]
        .as_array()
        .map(|a| a.iter().map(|t| t["function"].clone()).collect())
        .unwrap_or_default();
    json!({"content": c["message"]["content"], "reasoning": c["message"]["reasoning_content"],
           "finish": c["finish_reason"], "calls": calls, "usage": r["usage"], "logprobs": c["logprobs"]})
}

#[tokio::test]
async fn device_decoding_gives_the_host_path_replies() {
    let host = Server::scripted_on(CALL_REPLY, Duration::ZERO, config(), false).await;
    let (device, calls) = Server::scripted_calls(CALL_REPLY, Duration::ZERO, config(), true).await;
    let tools: Value = serde_json::from_str(WEATHER).unwrap();
    let bodies = [
        // a tool call, ended by the end-of-turn id
        json!({"messages": user("weather?"), "tools": tools, "max_tokens": 100}),
        // the token limit
        json!({"messages": user("weather?"), "max_tokens": 5}),
        // a stop string
        json!({"messages": user("weather?"), "stop": ["Paris"], "max_tokens": 100}),
        // forced text injected when the reasoning ends (tool_choice)
        json!({"messages": user("weather?"), "tools": tools, "tool_choice": "required", "max_tokens": 60}),
        // log-probabilities: made with each token on the device (the backend's summaries)
        json!({"messages": user("weather?"), "max_tokens": 8, "logprobs": true, "top_logprobs": 2}),
    ];
    for body in bodies {
        // (one seed for both: a request without one samples differently each time)
        let body = with(body, json!({"seed": 1}));
        let (st_h, r_h) = host.post("/v1/chat/completions", body.clone()).await;
        let (st_d, r_d) = device.post("/v1/chat/completions", body.clone()).await;
        assert_eq!((st_h, st_d), (200, 200), "{r_h} {r_d}");
        assert_eq!(reply_content(&r_h), reply_content(&r_d), "request {body}");
    }
    // the log-probabilities request's tokens after its first came from the device, each with
    // its summary (the first is chosen on the host from the prompt's logits)
    let (tokens, summaries) = calls
        .lock()
        .map(|c| (c.device_tokens, c.device_summaries))
        .unwrap();
    assert_eq!(summaries, 7, "device tokens {tokens}");
    // a second turn after a device-run reply reuses its cached state and still agrees
    let first = json!({"messages": user("weather?"), "max_tokens": 100, "chat_template_kwargs": {"enable_thinking": false}});
    let (_, r) = device.post("/v1/chat/completions", first.clone()).await;
    let (_, r_host) = host.post("/v1/chat/completions", first).await;
    let answer = r["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or("")
        .to_string();
    let second = json!({"messages": [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": answer},
        {"role": "user", "content": "and tomorrow?"}], "max_tokens": 100, "chat_template_kwargs": {"enable_thinking": false}});
    let (_, r2_d) = device.post("/v1/chat/completions", second.clone()).await;
    let (_, r2_h) = host.post("/v1/chat/completions", second).await;
    assert_eq!(reply_content(&r_host), reply_content(&r));
    assert_eq!(reply_content(&r2_h), reply_content(&r2_d));
    assert!(
        r2_d["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0)
            > 0
    );
}

#[tokio::test]
async fn the_backend_keeps_the_state_the_next_turn_resumes_from() {
    // the template drops an earlier reply's reasoning, so turn 2 does not extend what the device
    // ran in turn 1: a backend holding state on a device (the GPU) must have been told to keep the
    // state turn 2 resumes from, or it prefills the whole conversation again
    let (s, calls) = Server::scripted_calls(CALL_REPLY, Duration::ZERO, config(), true).await;
    let tools: Value = serde_json::from_str(WEATHER).unwrap();
    let (_, r1) = s
        .post(
            "/v1/chat/completions",
            json!({"messages": user("weather?"), "tools": tools, "max_tokens": 100}),
        )
        .await;
    let message = &r1["choices"][0]["message"];
    assert!(
        message["reasoning_content"]
            .as_str()
            .is_some_and(|r| !r.is_empty()),
        "{r1}"
    );
    let call = &message["tool_calls"][0];
    let kept = calls.lock().unwrap().kept.clone();
    let ran_before = calls.lock().unwrap().ran_after.len();
    let turn2 = json!([{"role": "user", "content": "weather?"}, message,
        {"role": "tool", "tool_call_id": call["id"], "content": "sunny"},
        {"role": "user", "content": "and tomorrow?"}]);
    let (st, r2) = s
        .post(
            "/v1/chat/completions",
            json!({"messages": turn2, "tools": tools, "max_tokens": 100}),
        )
        .await;
    assert_eq!(st, 200, "{r2}");
    let cached = r2["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap() as usize;
    let resumed = calls.lock().unwrap().ran_after[ran_before].clone();
    assert!(cached > 0);
    assert_eq!(resumed.len(), cached, "turn 2 ran after the cached prefix");
    assert!(
        kept.contains(&resumed),
        "turn 2 resumed from a state the backend was not told to keep ({} tokens; kept: {:?})",
        resumed.len(),
        kept.iter().map(Vec::len).collect::<Vec<_>>()
    );
    // a backend that had to run the cached prefix again (it lost the state): nothing was cached,
    // and /metrics counts both requests as misses
    calls.lock().unwrap().forgets = true;
    let (hits, misses) = (
        s.metric("osprey_prefix_cache_hits_total").await,
        s.metric("osprey_prefix_cache_misses_total").await,
    );
    assert_eq!(hits, 1.0, "turn 2 resumed");
    let retry = json!({"messages": user("weather, again?"), "max_tokens": 4});
    let (_, first) = s.post("/v1/chat/completions", retry.clone()).await;
    let (_, again) = s.post("/v1/chat/completions", retry).await;
    let cached = |r: &Value| r["usage"]["prompt_tokens_details"]["cached_tokens"].clone();
    assert_eq!(
        (cached(&first), cached(&again)),
        (json!(0), json!(0)),
        "{again}"
    );
    assert_eq!(s.metric("osprey_prefix_cache_hits_total").await, hits);
    assert_eq!(
        s.metric("osprey_prefix_cache_misses_total").await,
        misses + 2.0
    );
}

#[tokio::test]
async fn conversations_with_one_long_system_prompt_share_its_state() {
    let (s, calls) = Server::scripted_calls(CALL_REPLY, Duration::ZERO, config(), true).await;
    let system = "You are an agent with many rules. ".repeat(60);
    let ask = |question: &str| {
        json!({"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
               "max_tokens": 8})
    };
    let (_, first) = s.post("/v1/chat/completions", ask("first task")).await;
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let ran_before = calls.lock().unwrap().ran_after.len();
    let (_, second) = s.post("/v1/chat/completions", ask("another task")).await;
    let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap() as usize;
    // the system part (~400 tokens), up to the first user header
    assert!(cached >= 256, "{second}");
    {
        let c = calls.lock().unwrap();
        let resumed = &c.ran_after[ran_before];
        assert_eq!(resumed.len(), cached);
        assert!(c.kept.contains(resumed), "the system part's state was kept");
    }
    // a short system prompt gets no snapshot of its own
    let short = |question: &str| {
        json!({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": question}],
               "max_tokens": 8})
    };
    s.post("/v1/chat/completions", short("one")).await;
    let (_, again) = s.post("/v1/chat/completions", short("two")).await;
    assert_eq!(again["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
}

/// The answer's JSON and finish reason of a chat reply.
fn json_answer(r: &Value) -> (Value, String) {
    let c = &r["choices"][0];
    let text = c["message"]["content"].as_str().unwrap_or("");
    let v = serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {r}"));
    (v, c["finish_reason"].as_str().unwrap_or("").to_string())
}

const FORECAST: &str = r#"{"type": "json_schema", "json_schema": {"name": "forecast", "strict": true, "schema": {
    "type": "object", "additionalProperties": false, "required": ["rain", "days", "sky"],
    "properties": {"rain": {"type": "boolean"}, "days": {"type": "integer", "minimum": 1, "maximum": 7},
                   "sky": {"enum": ["clear", "cloudy"]}}}}}"#;

#[tokio::test]
async fn response_format_holds_a_random_model_to_the_schema() {
    // the tiny model's weights are random: left alone it writes gibberish; held by the grammar
    // every reply is the schema's JSON, greedy or sampled, streamed or not
    let s = Server::tiny(config()).await;
    let rf: Value = serde_json::from_str(FORECAST).unwrap();
    let check = |v: &Value| {
        assert!(v["rain"].is_boolean(), "{v}");
        assert!((1..=7).contains(&v["days"].as_i64().unwrap()), "{v}");
        assert!(
            ["clear", "cloudy"].contains(&v["sky"].as_str().unwrap()),
            "{v}"
        );
        assert_eq!(v.as_object().unwrap().len(), 3, "{v}");
    };
    for sampling in [
        json!({"temperature": 0}),
        json!({"temperature": 1.0, "seed": 3}),
    ] {
        let mut body = json!({"messages": user("Weather for the week?"), "max_tokens": 64,
            "response_format": rf, "chat_template_kwargs": {"enable_thinking": false}});
        for (k, v) in sampling.as_object().unwrap() {
            body[k] = v.clone();
        }
        let (st, r) = s.post("/v1/chat/completions", body.clone()).await;
        assert_eq!(st, 200, "{r}");
        let (v, finish) = json_answer(&r);
        check(&v);
        assert_eq!(
            finish, "stop",
            "the end of turn comes with the closing brace: {r}"
        );
        // n choices: each reply held by a grammar state of its own, from the schema's start
        let mut two = body.clone();
        two["n"] = json!(2);
        let (st, r) = s.post("/v1/chat/completions", two).await;
        assert_eq!(st, 200, "{r}");
        for c in r["choices"].as_array().unwrap() {
            let content = c["message"]["content"].as_str().unwrap();
            check(&serde_json::from_str(content).unwrap_or_else(|e| panic!("{e}: {r}")));
        }

        body["stream"] = json!(true);
        let mut content = String::new();
        for data in s.stream(body).await {
            if let Ok(chunk) = serde_json::from_str::<Value>(&data) {
                if let Some(piece) = chunk["choices"][0]["delta"]["content"].as_str() {
                    content.push_str(piece);
                }
            }
        }
        check(&serde_json::from_str(&content).unwrap_or_else(|e| panic!("{e}: {content:?}")));
    }
    // json_object: any object
    let body = json!({"messages": user("Anything"), "max_tokens": 48, "temperature": 0,
        "response_format": {"type": "json_object"}, "chat_template_kwargs": {"enable_thinking": false}});
    let (st, r) = s.post("/v1/chat/completions", body).await;
    assert_eq!(st, 200, "{r}");
    if r["choices"][0]["finish_reason"] == "stop" {
        assert!(json_answer(&r).0.is_object(), "{r}");
    } else {
        let text = r["choices"][0]["message"]["content"].as_str().unwrap();
        assert!(text.starts_with('{'), "{r}");
    }
}

#[tokio::test]
async fn response_format_leaves_the_reasoning_free() {
    // a model that reasons in prose and then answers in the schema's JSON is not disturbed
    let s = Server::scripted(
        "Rain is likely.\n</think>{\"rain\": true, \"days\": 3, \"sky\": \"cloudy\"}",
        Duration::ZERO,
        config(),
    )
    .await;
    let rf: Value = serde_json::from_str(FORECAST).unwrap();
    let body = json!({"messages": user("Weather?"), "max_tokens": 64, "response_format": rf});
    let (st, r) = s.post("/v1/chat/completions", body).await;
    assert_eq!(st, 200, "{r}");
    let msg = &r["choices"][0]["message"];
    assert_eq!(msg["reasoning_content"], "Rain is likely.", "{r}");
    let (v, finish) = json_answer(&r);
    assert_eq!(v, json!({"rain": true, "days": 3, "sky": "cloudy"}));
    assert_eq!(finish, "stop");
}

const WEATHER_ANTHROPIC: &str = r#"[{"name": "get_weather", "description": "Weather for a city", "input_schema": {"type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}]"#;

/// Anthropic SSE: (event name, data) pairs.
async fn anthropic_stream(s: &Server, body: Value) -> Vec<(String, Value)> {
    let text = s.sse_text("/v1/messages", body).await;
    let mut events = Vec::new();
    let mut name = String::new();
    for line in text.lines() {
        if let Some(n) = line.strip_prefix("event: ") {
            name = n.to_string();
        } else if let Some(d) = line.strip_prefix("data: ") {
            events.push((name.clone(), serde_json::from_str(d).unwrap()));
        }
    }
    events
}

#[tokio::test]
async fn anthropic_messages_tool_use_whole_and_streamed() {
    let s = Server::scripted(CALL_REPLY, Duration::ZERO, config()).await;
    let tools: Value = serde_json::from_str(WEATHER_ANTHROPIC).unwrap();
    let body = json!({"model": "tiny", "max_tokens": 100, "tools": tools,
        "messages": [{"role": "user", "content": "weather in Paris?"}]});
    let (st, r) = s.post("/v1/messages", body.clone()).await;
    assert_eq!(st, 200, "{r}");
    assert_eq!(r["type"], "message");
    assert_eq!(r["role"], "assistant");
    assert!(r["id"].as_str().unwrap().starts_with("msg_"), "{r}");
    assert_eq!(r["stop_reason"], "tool_use");
    let content = r["content"].as_array().unwrap();
    assert_eq!(content[0]["type"], "thinking");
    assert_eq!(content[0]["thinking"], "Need weather.");
    let call = content.last().unwrap();
    assert_eq!(call["type"], "tool_use");
    assert_eq!(call["name"], "get_weather");
    assert_eq!(call["input"], json!({"city": "Paris", "days": 3}));
    assert!(call["id"].as_str().unwrap().starts_with("toolu_"), "{call}");
    let usage = &r["usage"];
    assert!(
        usage["input_tokens"].as_u64().unwrap() > 0 && usage["output_tokens"].as_u64().unwrap() > 0
    );

    // count_tokens reads the prompt as the request did
    let (st, n) = s.post("/v1/messages/count_tokens", body.clone()).await;
    assert_eq!(st, 200, "{n}");
    let cached = usage["cache_read_input_tokens"].as_u64().unwrap();
    assert_eq!(
        n["input_tokens"].as_u64().unwrap(),
        usage["input_tokens"].as_u64().unwrap() + cached
    );

    // streamed: the event sequence Anthropic sends, and the same blocks once put together
    let mut body = body;
    body["stream"] = json!(true);
    let events = anthropic_stream(&s, body).await;
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names.first(), Some(&"message_start"));
    assert_eq!(&names[names.len() - 2..], ["message_delta", "message_stop"]);
    for (n, d) in &events {
        assert_eq!(d["type"], n.as_str(), "each event's data names its event");
    }
    let mut thinking = String::new();
    let mut input_json = String::new();
    let mut kinds = Vec::new();
    for (_, d) in &events {
        match d["type"].as_str().unwrap() {
            "content_block_start" => {
                kinds.push(d["content_block"]["type"].as_str().unwrap().to_string())
            }
            "content_block_delta" => match d["delta"]["type"].as_str().unwrap() {
                "thinking_delta" => thinking.push_str(d["delta"]["thinking"].as_str().unwrap()),
                "input_json_delta" => {
                    input_json.push_str(d["delta"]["partial_json"].as_str().unwrap())
                }
                _ => {}
            },
            _ => {}
        }
    }
    assert_eq!(kinds.first().map(String::as_str), Some("thinking"));
    assert_eq!(kinds.last().map(String::as_str), Some("tool_use"));
    assert_eq!(thinking, "Need weather.");
    assert_eq!(
        serde_json::from_str::<Value>(&input_json).unwrap(),
        json!({"city": "Paris", "days": 3})
    );
    let end = &events[events.len() - 2].1;
    assert_eq!(end["delta"]["stop_reason"], "tool_use");
}

#[tokio::test]
async fn anthropic_messages_stop_sequences_thinking_off_and_errors() {
    let cfg = ServerConfig {
        api_key: Some("sekret".into()),
        ..config()
    };
    let s = Server::scripted("The answer is 42. END more text", Duration::ZERO, cfg).await;
    let post = |body: Value, key: Option<&'static str>| {
        let req = s.client.post(format!("{}/v1/messages", s.base)).json(&body);
        let req = match key {
            Some(k) => req.header("x-api-key", k),
            None => req,
        };
        async move {
            let r = req.send().await.unwrap();
            (r.status().as_u16(), r.json::<Value>().await.unwrap())
        }
    };
    let body = json!({"max_tokens": 50, "stop_sequences": ["END"], "thinking": {"type": "disabled"},
        "messages": [{"role": "user", "content": "?"}]});
    let (st, r) = post(body.clone(), Some("sekret")).await;
    assert_eq!(st, 200, "{r}");
    assert_eq!(
        r["content"],
        json!([{"type": "text", "text": "The answer is 42. "}])
    );
    assert_eq!(r["stop_reason"], "stop_sequence");
    assert_eq!(r["stop_sequence"], "END");

    // errors in Anthropic's envelope, typed by status
    let (st, r) = post(body.clone(), Some("wrong")).await;
    assert_eq!(st, 401);
    assert_eq!(r["type"], "error");
    assert_eq!(r["error"]["type"], "authentication_error");
    let (st, r) = post(
        json!({"messages": [{"role": "user", "content": "?"}]}),
        Some("sekret"),
    )
    .await;
    assert_eq!(
        (st, r["error"]["type"].as_str()),
        (400, Some("invalid_request_error")),
        "{r}"
    );
    assert!(r["error"]["message"]
        .as_str()
        .unwrap()
        .contains("'max_tokens' is required"));
    let mut other = body;
    other["model"] = json!("claude-opus");
    let (st, r) = post(other, Some("sekret")).await;
    assert_eq!(
        (st, r["error"]["type"].as_str()),
        (404, Some("not_found_error")),
        "{r}"
    );
}

#[tokio::test]
async fn forced_tool_calls_are_held_to_the_schema() {
    // random weights write no call of their own; forced (tool_choice "required", or Anthropic's
    // "any"), every call is complete and typed by its schema
    let s = Server::tiny(config()).await;
    let alarm = json!({"name": "set_alarm", "parameters": {"type": "object", "required": ["hour", "loud"],
        "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}, "loud": {"type": "boolean"},
                       "tone": {"enum": ["beep", "chime"]}}}});
    let check = |args: &Value| {
        assert!((0..=23).contains(&args["hour"].as_i64().unwrap()), "{args}");
        assert!(args["loud"].is_boolean(), "{args}");
        let keys: Vec<&String> = args.as_object().unwrap().keys().collect();
        assert!(
            keys.iter()
                .all(|k| ["hour", "loud", "tone"].contains(&k.as_str())),
            "{args}"
        );
        if let Some(t) = args.get("tone") {
            assert!(t == "beep" || t == "chime", "{args}");
        }
    };
    for seed in 0..3 {
        // (random weights spell the grammar's tags a few letters a token, hence the room)
        let body = json!({"messages": user("Wake me up"), "max_tokens": 160, "seed": seed, "tool_choice": "required",
            "tools": [{"type": "function", "function": alarm}], "chat_template_kwargs": {"enable_thinking": false}});
        let (st, r) = s.post("/v1/chat/completions", body).await;
        assert_eq!(st, 200, "{r}");
        let c = &r["choices"][0];
        assert_eq!(c["finish_reason"], "tool_calls", "{r}");
        let call = &c["message"]["tool_calls"][0]["function"];
        assert_eq!(call["name"], "set_alarm");
        check(&serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap());

        let body = json!({"max_tokens": 160, "thinking": {"type": "disabled"}, "tool_choice": {"type": "any"},
            "tools": [{"name": "set_alarm", "input_schema": alarm["parameters"]}],
            "messages": [{"role": "user", "content": "Wake me up"}], "temperature": 1.0, "top_k": 50});
        let (st, r) = s.post("/v1/messages", body).await;
        assert_eq!(st, 200, "{r}");
        assert_eq!(r["stop_reason"], "tool_use", "{r}");
        let call = r["content"].as_array().unwrap().last().unwrap().clone();
        assert_eq!(call["name"], "set_alarm");
        check(&call["input"]);
    }
}

#[tokio::test]
async fn logit_bias_forces_and_bans_tokens() {
    let s = Server::tiny(config()).await;
    let format = PromptFormat::from_dir(tiny_dir()).unwrap();
    let ask = |bias: Value| {
        json!({"messages": user("hi"), "max_tokens": 4, "temperature": 0, "logprobs": true,
               "chat_template_kwargs": {"enable_thinking": false}, "logit_bias": bias})
    };
    let first_token = |r: &Value| r["choices"][0]["logprobs"]["content"][0]["token"].clone();
    // +100 makes a token every choice
    let the = format.encode(" the").unwrap();
    assert_eq!(the.len(), 1);
    let (st, r) = s
        .post(
            "/v1/chat/completions",
            ask(json!({the[0].to_string(): 100})),
        )
        .await;
    assert_eq!(st, 200, "{r}");
    assert_eq!(r["choices"][0]["message"]["content"], " the the the the");
    // -100 keeps the greedy choice from being chosen; log-probabilities stay the model's
    let (_, plain) = s.post("/v1/chat/completions", ask(json!({}))).await;
    let greedy = first_token(&plain);
    let id = format.encode(greedy.as_str().unwrap()).unwrap();
    assert_eq!(id.len(), 1, "{greedy}");
    let (st, banned) = s
        .post(
            "/v1/chat/completions",
            ask(json!({id[0].to_string(): -100})),
        )
        .await;
    assert_eq!(st, 200, "{banned}");
    assert_ne!(first_token(&banned), greedy, "{banned}");
    let top = &banned["choices"][0]["logprobs"]["content"][0]["top_logprobs"];
    assert_eq!(
        top[0],
        plain["choices"][0]["logprobs"]["content"][0]["top_logprobs"][0]
    );
    // bad maps are a 400 naming the field
    for bad in [
        json!({"x": 1}),
        json!({"999999999": 1}),
        json!({"5": 101}),
        json!([1]),
    ] {
        let (st, r) = s.post("/v1/chat/completions", ask(bad.clone())).await;
        assert_eq!(st, 400, "{bad}: {r}");
        assert_eq!(r["error"]["param"], "logit_bias", "{r}");
    }
}

#[tokio::test]
async fn thinking_token_budget_closes_the_reasoning_for_the_model() {
    let s = Server::tiny(config()).await;
    let ask = |budget: Option<u64>| {
        let mut b = json!({"messages": user("hi"), "max_tokens": 16, "temperature": 0});
        if let Some(n) = budget {
            b["thinking_token_budget"] = n.into();
        }
        b
    };
    let reasoning = |r: &Value| {
        r["choices"][0]["message"]["reasoning_content"]
            .as_str()
            .unwrap_or("")
            .to_string()
    };
    let (st, plain) = s.post("/v1/chat/completions", ask(None)).await;
    assert_eq!(st, 200, "{plain}");
    // the tiny model's random weights never close their reasoning in 16 tokens
    assert_eq!(plain["choices"][0]["message"]["content"], "", "{plain}");
    for budget in [0, 3] {
        let (st, r) = s.post("/v1/chat/completions", ask(Some(budget))).await;
        assert_eq!(st, 200, "{r}");
        let (thought, full) = (reasoning(&r), reasoning(&plain));
        assert!(
            full.starts_with(thought.trim_end()) && thought.len() < full.len(),
            "budget {budget}: {thought:?} is not the start of {full:?}"
        );
        // the answer follows in the same reply, and the closing tag is nobody's text
        let content = r["choices"][0]["message"]["content"].as_str().unwrap();
        assert!(!content.is_empty() && !content.contains("</think>"), "{r}");
        assert_eq!(r["usage"]["completion_tokens"], 16, "{r}");
        assert_eq!(
            r["usage"]["completion_tokens_details"]["reasoning_tokens"], budget,
            "{r}"
        );
    }
    assert_eq!(
        plain["usage"]["completion_tokens_details"]["reasoning_tokens"],
        16
    );
    s.refuses(
        "/v1/chat/completions",
        json!({"messages": user("hi"), "thinking_token_budget": -1}),
        "thinking_token_budget",
    )
    .await;
}

#[tokio::test]
async fn the_thinking_budget_holds_on_a_backend_that_chooses_tokens_itself() {
    // the GPU runs a reply on its own until the host needs to put text in: the budget stops it
    const THOUGHT: &str = "First this, then that, then something else again and again";
    let s = Server::scripted_on(THOUGHT, Duration::ZERO, config(), true).await;
    let format = PromptFormat::from_dir(tiny_dir()).unwrap();
    let ids = format.encode(THOUGHT).unwrap();
    let (st, r) = s
        .post(
            "/v1/chat/completions",
            json!({"messages": user("hi"), "max_tokens": 8, "thinking_token_budget": 3}),
        )
        .await;
    assert_eq!(st, 200, "{r}");
    let m = &r["choices"][0]["message"];
    assert_eq!(
        m["reasoning_content"].as_str().unwrap().trim_end(),
        format.decode(&ids[..3]).unwrap().trim_end(),
        "{r}"
    );
    // (the script starts over after the tag it does not know)
    assert!(m["content"].as_str().unwrap().starts_with("First"), "{r}");
}

#[tokio::test]
async fn a_reply_begun_by_the_caller_is_continued() {
    // the scripted model continues its script from however much of it the prompt ends with
    let (s, calls) =
        Server::scripted_calls("The answer is 42.", Duration::ZERO, config(), false).await;
    let begun =
        json!([{"role": "user", "content": "?"}, {"role": "assistant", "content": "The answer"}]);
    let (st, r) = s
        .post(
            "/v1/chat/completions",
            json!({"messages": begun, "continue_final_message": true, "add_generation_prompt": false}),
        )
        .await;
    assert_eq!(st, 200, "{r}");
    assert_eq!(r["choices"][0]["message"]["content"], " is 42.", "{r}");
    assert_eq!(r["choices"][0]["message"]["reasoning_content"], Value::Null);
    let format = PromptFormat::from_dir(tiny_dir()).unwrap();
    let prompt = format
        .encode("<|im_start|>user\n?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nThe answer")
        .unwrap();
    // the reply's steps ran after exactly these tokens
    let ran_after = calls.lock().unwrap().ran_after.clone();
    let last = ran_after.last().unwrap();
    assert!(
        last.len() > prompt.len() && last.starts_with(&prompt),
        "{ran_after:?}"
    );

    // Anthropic's prefill is the same request
    let (st, r) = s
        .post("/v1/messages", json!({"max_tokens": 16, "messages": begun}))
        .await;
    assert_eq!(st, 200, "{r}");
    assert_eq!(
        r["content"],
        json!([{"type": "text", "text": " is 42."}]),
        "{r}"
    );
    let (st, r) = s
        .post("/v1/messages/count_tokens", json!({"messages": begun}))
        .await;
    assert_eq!((st, &r["input_tokens"]), (200, &json!(prompt.len())), "{r}");

    for (body, param) in [
        (
            json!({"messages": begun, "continue_final_message": true, "add_generation_prompt": true}),
            "add_generation_prompt",
        ),
        (
            json!({"messages": begun, "continue_final_message": true, "response_format": {"type": "json_object"}}),
            "continue_final_message",
        ),
        (
            json!({"messages": begun, "continue_final_message": true, "tools": serde_json::from_str::<Value>(WEATHER).unwrap(), "tool_choice": "required"}),
            "continue_final_message",
        ),
        (
            json!({"messages": begun, "continue_final_message": "yes"}),
            "continue_final_message",
        ),
        (
            json!({"messages": user("?"), "continue_final_message": true}),
            "continue_final_message",
        ),
        (
            json!({"messages": [{"role": "user", "content": "?"}, {"role": "assistant", "content": "",
                "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}],
                "continue_final_message": true}),
            "continue_final_message",
        ),
    ] {
        s.refuses("/v1/chat/completions", body, param).await;
    }
}

#[tokio::test]
async fn sampling_without_a_seed_differs_between_requests() {
    let s = Server::tiny(config()).await;
    let reply = |seed: Option<u64>| {
        let mut b = json!({"messages": user("Tell me something"), "max_tokens": 12, "temperature": 1.0,
                           "top_k": 0, "top_p": 1.0});
        if let Some(n) = seed {
            b["seed"] = n.into();
        }
        let s = &s;
        async move {
            let (st, r) = s.post("/v1/chat/completions", b).await;
            assert_eq!(st, 200, "{r}");
            r["choices"][0]["message"]["reasoning_content"].clone()
        }
    };
    assert_eq!(reply(Some(7)).await, reply(Some(7)).await);
    // twelve tokens drawn from the tiny model's whole vocabulary: equal only if seeded alike
    assert_ne!(reply(None).await, reply(None).await);
}

#[tokio::test]
async fn n_choices_are_generated_one_after_another() {
    let s = Server::tiny(config()).await;
    let ask = |extra: Value| {
        let b = json!({"messages": user("Tell me something"), "max_tokens": 6, "temperature": 1.0,
                       "top_k": 0, "top_p": 1.0});
        with(b, extra)
    };
    let (st, three) = s
        .post("/v1/chat/completions", ask(json!({"n": 3, "seed": 5})))
        .await;
    assert_eq!(st, 200, "{three}");
    let choices = three["choices"].as_array().unwrap();
    let text = |c: &Value| c["message"]["reasoning_content"].clone();
    assert_eq!(
        choices
            .iter()
            .map(|c| c["index"].clone())
            .collect::<Vec<_>>(),
        [0, 1, 2]
    );
    assert_ne!(text(&choices[0]), text(&choices[1]));
    // choice i samples with seed + i
    for (i, seed) in [(0, 5), (2, 7)] {
        let (_, one) = s
            .post("/v1/chat/completions", ask(json!({"seed": seed})))
            .await;
        assert_eq!(text(&one["choices"][0]), text(&choices[i]), "{one}");
        assert_eq!(
            three["usage"]["prompt_tokens"],
            one["usage"]["prompt_tokens"]
        );
    }
    assert_eq!(three["usage"]["completion_tokens"], 18, "{three}");

    // streamed: each choice in turn under its index, one usage chunk for all of them
    let mut body = ask(json!({"n": 2, "seed": 5, "stream": true,
                              "stream_options": {"include_usage": true}}));
    body["logprobs"] = json!(true);
    let events = s.stream(body).await;
    let chunks: Vec<Value> = events
        .iter()
        .filter(|e| *e != "[DONE]")
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let order: Vec<u64> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["index"].as_u64())
        .collect();
    let switch = order.iter().position(|&i| i == 1).unwrap();
    assert!(
        switch > 0
            && order[..switch].iter().all(|&i| i == 0)
            && order[switch..].iter().all(|&i| i == 1)
    );
    let streamed: String = chunks
        .iter()
        .filter(|c| c["choices"][0]["index"] == 1)
        .filter_map(|c| c["choices"][0]["delta"]["reasoning_content"].as_str())
        .collect();
    assert_eq!(Value::String(streamed), text(&choices[1]));
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(usage["completion_tokens"], 12, "{usage}");
    assert_eq!(events.last().unwrap(), "[DONE]");

    // the completions endpoint too
    let (st, r) = s
        .post(
            "/v1/completions",
            json!({"prompt": "Once upon a time", "max_tokens": 3, "n": 2, "temperature": 0}),
        )
        .await;
    assert_eq!(st, 200, "{r}");
    assert_eq!(r["choices"][0]["text"], r["choices"][1]["text"], "{r}");
    assert_eq!(r["choices"][1]["index"], 1);
    assert_eq!(r["usage"]["completion_tokens"], 6);
}

#[tokio::test]
async fn reasoning_effort_none_turns_thinking_off() {
    let s = Server::tiny(config()).await;
    let ask = |extra: Value| {
        with(
            json!({"messages": user("hi"), "max_tokens": 4, "temperature": 0}),
            extra,
        )
    };
    let thought = |r: &Value| r["choices"][0]["message"]["reasoning_content"].is_string();
    let (st, r) = s
        .post(
            "/v1/chat/completions",
            ask(json!({"reasoning_effort": "none"})),
        )
        .await;
    assert_eq!(st, 200, "{r}");
    assert!(!thought(&r), "{r}");
    // the same prompt as thinking turned off in the template
    let (_, off) = s
        .post(
            "/v1/chat/completions",
            ask(json!({"chat_template_kwargs": {"enable_thinking": false}})),
        )
        .await;
    assert_eq!(r["usage"]["prompt_tokens"], off["usage"]["prompt_tokens"]);
    assert_eq!(r["choices"][0]["message"], off["choices"][0]["message"]);
    for extra in [
        // (OpenAI's cache key and safety identifier change nothing here)
        json!({"reasoning_effort": "high", "prompt_cache_key": "k", "safety_identifier": "u"}),
        json!({"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": true}}),
    ] {
        let (st, r) = s.post("/v1/chat/completions", ask(extra)).await;
        assert_eq!(st, 200, "{r}");
        assert!(thought(&r), "{r}");
    }
    s.refuses(
        "/v1/chat/completions",
        ask(json!({"reasoning_effort": "max"})),
        "reasoning_effort",
    )
    .await;
}

#[tokio::test]
async fn ignore_eos_runs_to_the_token_limit() {
    // the script ends in <|im_end|>, then starts again
    for device in [false, true] {
        let s = Server::scripted_on("Hi.", Duration::ZERO, config(), device).await;
        let ask = |ignore: bool| {
            json!({"messages": user("?"), "max_tokens": 6, "ignore_eos": ignore,
                   "chat_template_kwargs": {"enable_thinking": false}})
        };
        let (st, r) = s.post("/v1/chat/completions", ask(false)).await;
        assert_eq!(st, 200, "{r}");
        assert_eq!(r["choices"][0]["finish_reason"], "stop", "{r}");
        assert!(r["usage"]["completion_tokens"].as_u64().unwrap() < 6, "{r}");
        let (st, r) = s.post("/v1/chat/completions", ask(true)).await;
        assert_eq!(st, 200, "{r}");
        assert_eq!(r["choices"][0]["finish_reason"], "length", "{r}");
        assert_eq!(r["usage"]["completion_tokens"], 6, "{r}");
        // "Hi" "." <|im_end|>, twice: past the end of turn, which adds no text
        assert_eq!(r["choices"][0]["message"]["content"], "Hi.Hi.", "{r}");
        // stop_token_ids end it still, and so does any other id given
        let format = PromptFormat::from_dir(tiny_dir()).unwrap();
        let dot = format.encode(".").unwrap()[0];
        for (ids, content) in [(json!([248046]), "Hi."), (json!([dot]), "Hi")] {
            let (st, r) = s
                .post(
                    "/v1/chat/completions",
                    with(ask(true), json!({"stop_token_ids": ids})),
                )
                .await;
            assert_eq!(st, 200, "{r}");
            assert_eq!(r["choices"][0]["message"]["content"], content, "{r}");
            assert_eq!(r["choices"][0]["finish_reason"], "stop", "{r}");
        }
        s.refuses(
            "/v1/chat/completions",
            with(ask(true), json!({"stop_token_ids": [-1]})),
            "stop_token_ids",
        )
        .await;
    }
}

#[tokio::test]
async fn min_tokens_holds_off_the_end_of_the_reply() {
    // the script: "Hi" "." <|im_end|>, then again; an end held off leaves every other logit 0,
    // so greedy takes id 0 ("!") and the script starts over
    for device in [false, true] {
        let s = Server::scripted_on("Hi.", Duration::ZERO, config(), device).await;
        let ask = |extra: Value| {
            with(
                json!({"messages": user("?"), "max_tokens": 10, "temperature": 0,
                       "chat_template_kwargs": {"enable_thinking": false}}),
                extra,
            )
        };
        let (st, r) = s
            .post("/v1/chat/completions", ask(json!({"min_tokens": 4})))
            .await;
        assert_eq!(st, 200, "{r}");
        assert_eq!(r["choices"][0]["message"]["content"], "Hi.!Hi.", "{r}");
        assert_eq!(r["choices"][0]["finish_reason"], "stop", "{r}");
        assert_eq!(r["usage"]["completion_tokens"], 6, "{r}");
        // stop strings are looked for only in what comes after the first min_tokens
        let (st, r) = s
            .post(
                "/v1/chat/completions",
                ask(json!({"min_tokens": 4, "stop": "."})),
            )
            .await;
        assert_eq!(st, 200, "{r}");
        assert_eq!(r["choices"][0]["message"]["content"], "Hi.!Hi", "{r}");
        assert_eq!(r["choices"][0]["finish_reason"], "stop", "{r}");
        // so are stop_token_ids
        let format = PromptFormat::from_dir(tiny_dir()).unwrap();
        let dot = format.encode(".").unwrap()[0];
        let (st, r) = s
            .post(
                "/v1/chat/completions",
                ask(json!({"min_tokens": 3, "stop_token_ids": [dot]})),
            )
            .await;
        assert_eq!(st, 200, "{r}");
        assert_eq!(r["choices"][0]["message"]["content"], "Hi!Hi", "{r}");
        // a min_tokens within what was asked for
        let (st, r) = s
            .post("/v1/chat/completions", ask(json!({"min_tokens": 10})))
            .await;
        assert_eq!(st, 200, "{r}");
        assert_eq!(r["choices"][0]["finish_reason"], "length", "{r}");
        for bad in [json!(11), json!(-1), json!("4")] {
            s.refuses(
                "/v1/chat/completions",
                ask(json!({"min_tokens": bad})),
                "min_tokens",
            )
            .await;
        }
    }
}

#[tokio::test]
async fn the_model_answers_to_its_aliases() {
    // an agent asking for its own models (Claude Code: a large and a small one)
    let cfg = ServerConfig {
        model_aliases: vec!["claude-sonnet-4-5".into(), "claude-haiku-4-5".into()],
        ..config()
    };
    let s = Server::scripted("Hi.", Duration::ZERO, cfg).await;
    let m: Value = s
        .client
        .get(format!("{}/v1/models", s.base))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let ids: Vec<&str> = m["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|d| d["id"].as_str())
        .collect();
    assert_eq!(ids, ["tiny", "claude-sonnet-4-5", "claude-haiku-4-5"]);
    assert_eq!(
        (&m["first_id"], &m["last_id"]),
        (&json!("tiny"), &json!("claude-haiku-4-5"))
    );
    for model in ["claude-haiku-4-5", "tiny"] {
        let (st, r) = s
            .post(
                "/v1/messages",
                json!({"model": model, "max_tokens": 8, "messages": user("?")}),
            )
            .await;
        assert_eq!(st, 200, "{r}");
        assert_eq!(r["model"], "tiny");
    }
    let (st, r) = s
        .post(
            "/v1/chat/completions",
            json!({"model": "claude-opus-4-1", "messages": user("?")}),
        )
        .await;
    assert_eq!(st, 404, "{r}");
    let message = r["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("'tiny', 'claude-sonnet-4-5', 'claude-haiku-4-5'"),
        "{message}"
    );
}

#[tokio::test]
async fn parallel_tool_calls_false_ends_the_reply_after_one_call() {
    const TWO_CALLS: &str = "Both.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nA\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nB\n</parameter>\n</function>\n</tool_call>";
    let tools: Value = serde_json::from_str(WEATHER).unwrap();
    for device in [false, true] {
        let s = Server::scripted_on(TWO_CALLS, Duration::ZERO, config(), device).await;
        let ask = |extra: Value| {
            with(
                json!({"messages": user("weather?"), "tools": tools, "max_tokens": 100}),
                extra,
            )
        };
        let cities = |r: &Value| -> Vec<String> {
            r["choices"][0]["message"]["tool_calls"]
                .as_array()
                .unwrap()
                .iter()
                .map(|c| c["function"]["arguments"].as_str().unwrap().to_string())
                .collect()
        };
        let (st, both) = s.post("/v1/chat/completions", ask(json!({}))).await;
        assert_eq!(st, 200, "{both}");
        assert_eq!(cities(&both), [r#"{"city": "A"}"#, r#"{"city": "B"}"#]);
        let (st, one) = s
            .post(
                "/v1/chat/completions",
                ask(json!({"parallel_tool_calls": false})),
            )
            .await;
        assert_eq!(st, 200, "{one}");
        assert_eq!(cities(&one), [r#"{"city": "A"}"#], "{one}");
        assert_eq!(one["choices"][0]["finish_reason"], "tool_calls");
        assert!(
            one["usage"]["completion_tokens"].as_u64()
                < both["usage"]["completion_tokens"].as_u64()
        );
        // Anthropic's form
        let (st, r) = s
            .post(
                "/v1/messages",
                json!({"max_tokens": 100, "messages": user("weather?"),
                       "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
                       "tool_choice": {"type": "auto", "disable_parallel_tool_use": true}}),
            )
            .await;
        assert_eq!(st, 200, "{r}");
        let uses = r["content"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|b| b["type"] == "tool_use")
            .count();
        assert_eq!((uses, &r["stop_reason"]), (1, &json!("tool_use")), "{r}");
        s.refuses(
            "/v1/chat/completions",
            ask(json!({"parallel_tool_calls": "no"})),
            "parallel_tool_calls",
        )
        .await;
    }
}

#[tokio::test]
async fn completions_echo_the_prompt_with_its_log_probabilities() {
    let s = Server::tiny(config()).await;
    let format = PromptFormat::from_dir(tiny_dir()).unwrap();
    let prompt = format.encode("Once upon a time there").unwrap();
    // the greedy next token and its log-probability, from a plain completion
    let (st, r) = s
        .post(
            "/v1/completions",
            json!({"prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 2}),
        )
        .await;
    assert_eq!(st, 200, "{r}");
    let lp = &r["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), 1, "{r}");
    let next_lp = lp["token_logprobs"][0].as_f64().unwrap();
    let next = format.encode(lp["tokens"][0].as_str().unwrap()).unwrap();
    assert_eq!(lp["top_logprobs"][0].as_object().unwrap().len(), 2, "{r}");

    // lm-evaluation-harness's loglikelihood request: a batch of token lists, echo, one token
    let extended: Vec<u32> = prompt.iter().chain(&next).copied().collect();
    let (st, r) = s
        .post(
            "/v1/completions",
            json!({"prompt": [prompt, extended], "max_tokens": 1, "temperature": 0,
                   "logprobs": 1, "echo": true, "seed": 1234}),
        )
        .await;
    assert_eq!(st, 200, "{r}");
    let choices = r["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2);
    for (c, ids) in choices.iter().zip([&prompt, &extended]) {
        let lp = &c["logprobs"];
        let logprobs = lp["token_logprobs"].as_array().unwrap();
        // every prompt token and the one generated
        assert_eq!(logprobs.len(), ids.len() + 1, "{c}");
        assert!(logprobs[0].is_null() && lp["top_logprobs"][0].is_null());
        assert!(logprobs[1..].iter().all(|x| x.as_f64().unwrap() <= 0.0));
        assert!(c["text"]
            .as_str()
            .unwrap()
            .starts_with("Once upon a time there"));
        let offsets = lp["text_offset"].as_array().unwrap();
        assert!(offsets.windows(2).all(|w| w[0].as_u64() <= w[1].as_u64()));
    }
    // the token the model chose after the prompt, scored as part of the next prompt: the same
    // log-probability (the prompt scored position by position on the CPU path; 1e-3 for the
    // different chunking of the same arithmetic)
    let scored = choices[1]["logprobs"]["token_logprobs"][prompt.len()]
        .as_f64()
        .unwrap();
    assert!((scored - next_lp).abs() < 1e-3, "{scored} vs {next_lp}");
    // and what follows the first prompt, generated greedily, is that token (its logits from
    // the scoring's rows, where the plain completion's come from the last position alone: the
    // same products summed apart, ~1e-6 apart, which the normaliser's f64 sum keeps)
    let generated = choices[0]["logprobs"]["token_logprobs"][prompt.len()]
        .as_f64()
        .unwrap();
    assert!(
        (generated - next_lp).abs() < 1e-4,
        "{generated} vs {next_lp}"
    );
    assert_eq!(
        r["usage"]["prompt_tokens"],
        prompt.len() + extended.len(),
        "{r}"
    );

    // no generation at all: the prompt's log-probabilities are the answer
    let (st, r) = s
        .post(
            "/v1/completions",
            json!({"prompt": "Once upon a time there", "max_tokens": 0, "echo": true, "logprobs": 0}),
        )
        .await;
    assert_eq!(st, 200, "{r}");
    assert_eq!(r["choices"][0]["text"], "Once upon a time there");
    assert_eq!(r["usage"]["completion_tokens"], 0);
    assert_eq!(
        r["choices"][0]["logprobs"]["tokens"]
            .as_array()
            .unwrap()
            .len(),
        prompt.len()
    );
    s.refuses(
        "/v1/completions",
        json!({"prompt": "Once", "max_tokens": 0}),
        "max_tokens",
    )
    .await;

    // streamed: the prompt comes first
    let text = s
        .sse_text(
            "/v1/completions",
            json!({"prompt": "Once upon", "max_tokens": 2, "echo": true, "stream": true, "temperature": 0}),
        )
        .await;
    let first: Value =
        serde_json::from_str(text.lines().find_map(|l| l.strip_prefix("data: ")).unwrap()).unwrap();
    assert_eq!(first["choices"][0]["text"], "Once upon", "{text}");
}

#[tokio::test]
async fn the_tokenizer_endpoints_speak_vllms_form() {
    let s = Server::tiny(config()).await;
    let format = PromptFormat::from_dir(tiny_dir()).unwrap();
    let info: Value = s
        .client
        .get(format!("{}/tokenizer_info", s.base))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(info["eos_token"], "<|im_end|>", "{info}");
    assert_eq!(info["model_max_length"], 4096);
    assert_eq!(info["chat_template"], format.template.source());

    let (st, r) = s
        .post(
            "/tokenize",
            json!({"prompt": "Hello world", "add_special_tokens": false}),
        )
        .await;
    assert_eq!(st, 200, "{r}");
    let ids = format.encode("Hello world").unwrap();
    assert_eq!(r["tokens"], json!(ids));
    assert_eq!(r["count"], ids.len());
    // a chat request's prompt, as the chat endpoint reads it
    let (_, chat) = s
        .post(
            "/v1/chat/completions",
            json!({"messages": user("Hi"), "max_tokens": 1}),
        )
        .await;
    let (st, r) = s
        .post(
            "/tokenize",
            json!({"messages": user("Hi"), "return_token_strs": true}),
        )
        .await;
    assert_eq!(st, 200, "{r}");
    assert_eq!(r["count"], chat["usage"]["prompt_tokens"], "{r}");
    assert_eq!(r["token_strs"][0], "<|im_start|>");

    let text = "<|im_start|>user\nHi there<|im_end|>";
    let (st, r) = s
        .post(
            "/detokenize",
            json!({"tokens": format.encode(text).unwrap()}),
        )
        .await;
    assert_eq!((st, &r["prompt"]), (200, &json!(text)), "{r}");

    s.refuses(
        "/tokenize",
        json!({"prompt": "x", "messages": user("y")}),
        "prompt",
    )
    .await;
    s.refuses("/detokenize", json!({"tokens": [1, -1]}), "tokens")
        .await;
}

#[tokio::test]
async fn a_panic_fails_its_request_and_the_server_goes_on() {
    let (s, calls) = Server::scripted_calls("Hi.", Duration::ZERO, config(), false).await;
    calls.lock().unwrap().panic_once = true;
    let body = json!({"messages": user("?"), "max_tokens": 4});
    let (st, r) = s.post("/v1/chat/completions", body.clone()).await;
    assert_eq!(st, 500, "{r}");
    assert!(r["error"]["message"]
        .as_str()
        .unwrap()
        .contains("scripted defect"));
    let (st, r) = s.post("/v1/chat/completions", body).await;
    assert_eq!(st, 200, "{r}");
    assert_eq!(r["choices"][0]["message"]["reasoning_content"], "Hi.");
}
