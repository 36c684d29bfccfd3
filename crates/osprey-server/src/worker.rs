//! The engine thread: one model executing batch 1, fed by a FIFO of jobs. It owns the prefix
//! cache of session snapshots, runs prefill and the generation loop, and streams events back to
//! the HTTP side, stopping within one token when the client goes away.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use osprey_engine::generate::{ReasoningCountdown, StopScanner};
use osprey_engine::sampler::{PositionLogprobs, Sampler};
use osprey_engine::{DeviceRun, Engine, Session};
use osprey_prompt::PromptFormat;
use rayon::prelude::*;
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender};

use crate::api::GenerationRequest;
use crate::metrics::Metrics;
use crate::parse::{Delta, OutputParser, ToolSchemas, CLOSE_REASONING};
use crate::structured::Constraint;

/// How a chat reply's text is split into reasoning, content and tool calls.
#[derive(Clone)]
pub struct ChatParsing {
    /// The prompt ends inside `<think>`.
    pub in_reasoning: bool,
    /// Parse tool calls against these schemas (None: tool_choice "none" or no tools).
    pub tools: Option<ToolSchemas>,
    /// Text forced at the start of the answer (tool_choice "required" or a named function).
    pub force: Option<String>,
    /// The answer's grammar (`response_format`, or a forced tool call's), applied once the
    /// reasoning is over and any forced text is in.
    pub constraint: Option<Constraint>,
    /// How tool-call ids begin (`call_` for OpenAI clients, `toolu_` for Anthropic ones).
    pub call_id_prefix: &'static str,
    /// Most tokens the reasoning may take before `</think>` is put in for the model
    /// (`thinking_token_budget`, Anthropic's `thinking.budget_tokens`).
    pub thinking_budget: Option<usize>,
    /// End the reply once its first tool call is complete (`parallel_tool_calls: false`,
    /// Anthropic's `disable_parallel_tool_use`).
    pub one_call: bool,
}

pub struct Job {
    pub prompt: Vec<u32>,
    /// The prompt's text, reported back (`Event::Prompt`) before the reply: a completion's
    /// `echo`.
    pub echo: Option<String>,
    /// With `echo`: each prompt token's log-probability and this many alternatives (the
    /// prompt then runs from scratch, every position's logits kept).
    pub prompt_logprobs: Option<usize>,
    /// Snapshot the state at these positions, ascending (a shared system part's end, the start
    /// of the assistant turn: where other conversations and the next turn branch).
    pub branches: Vec<usize>,
    pub gen: GenerationRequest,
    pub max_tokens: usize,
    pub chat: Option<ChatParsing>,
    pub events: UnboundedSender<Event>,
    pub received: Instant,
    pub deadline: Instant,
}

impl Job {
    /// The same job for another of a request's `n` choices, with a channel of its own (its
    /// grammar state copied before any token), so the prompt is rendered and encoded once.
    pub fn another_choice(&self) -> (Job, UnboundedReceiver<Event>) {
        let (events, rx) = tokio::sync::mpsc::unbounded_channel();
        let job = Job {
            prompt: self.prompt.clone(),
            echo: self.echo.clone(),
            prompt_logprobs: self.prompt_logprobs,
            branches: self.branches.clone(),
            gen: self.gen.clone(),
            max_tokens: self.max_tokens,
            chat: self.chat.clone(),
            events,
            received: self.received,
            deadline: self.deadline,
        };
        (job, rx)
    }
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct TopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct TokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<TopLogprob>,
}

#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub cached_tokens: usize,
    /// Of the completion tokens, those generated inside the reasoning block.
    pub reasoning_tokens: usize,
}

impl Usage {
    /// A request's usage with one more choice added (starting from the default): the generated
    /// tokens of every choice, each prompt once (a choice of the same prompt as the one before
    /// adds none of its tokens).
    pub fn with_choice(self, other: &Usage, same_prompt: bool) -> Usage {
        let (prompt, cached) = if same_prompt {
            (0, 0)
        } else {
            (other.prompt_tokens, other.cached_tokens)
        };
        Usage {
            prompt_tokens: self.prompt_tokens + prompt,
            cached_tokens: self.cached_tokens + cached,
            completion_tokens: self.completion_tokens + other.completion_tokens,
            reasoning_tokens: self.reasoning_tokens + other.reasoning_tokens,
        }
    }
}

pub enum Event {
    /// The prompt, for `echo`: its text, its first token's text, and the log-probabilities of
    /// the rest when they were asked for.
    Prompt {
        text: String,
        first_token: String,
        logprobs: Option<Vec<TokenLogprob>>,
    },
    Deltas {
        deltas: Vec<Delta>,
        logprobs: Vec<TokenLogprob>,
    },
    Done {
        finish_reason: &'static str,
        /// The stop string that ended the reply, if one did.
        stop_sequence: Option<String>,
        usage: Usage,
    },
    Error {
        message: String,
        timeout: bool,
    },
}

/// A cached session state; `logits` are those of its last token when they were kept (a prompt
/// equal to `session.tokens` then needs no prefill at all).
struct Entry {
    session: Session,
    logits: Option<Vec<f32>>,
    bytes: usize,
    used: u64,
}

/// Session snapshots keyed by the tokens that produced them, bounded by count and bytes (LRU).
pub struct PrefixCache {
    entries: Vec<Entry>,
    max_entries: usize,
    max_bytes: usize,
    clock: u64,
}

impl PrefixCache {
    pub fn new(max_entries: usize, max_bytes: usize) -> Self {
        PrefixCache {
            entries: Vec::new(),
            max_entries,
            max_bytes,
            clock: 0,
        }
    }

    /// The longest cached state usable for `prompt`: a proper prefix of it, or the whole prompt
    /// when that entry kept its last logits (returned with it).
    pub fn lookup(&mut self, prompt: &[u32]) -> Option<(Session, Option<Vec<f32>>)> {
        self.clock += 1;
        let clock = self.clock;
        let best = self
            .entries
            .iter_mut()
            .filter(|e| {
                let n = e.session.tokens.len();
                prompt.starts_with(&e.session.tokens)
                    && (n < prompt.len() || (n == prompt.len() && e.logits.is_some()))
            })
            .max_by_key(|e| e.session.tokens.len())?;
        best.used = clock;
        let logits = if best.session.tokens.len() == prompt.len() {
            best.logits.clone()
        } else {
            None
        };
        Some((best.session.clone(), logits))
    }

    /// A session for `prompt`: the longest cached prefix, prefilled on to each of `branches`
    /// past it (ascending: where other conversations or the next turn fork) and snapshotted
    /// there. Returns the session, how many tokens came from the cache, and the logits of the
    /// whole prompt when the cache held exactly it (then nothing is left to run).
    pub fn resume(
        &mut self,
        engine: &Engine,
        prompt: &[u32],
        branches: &[usize],
    ) -> anyhow::Result<(Session, usize, Option<Vec<f32>>)> {
        let (mut session, logits) = self
            .lookup(prompt)
            .unwrap_or_else(|| (engine.new_session(), None));
        let cached = session.tokens.len();
        if logits.is_none() {
            for &b in branches {
                let from = session.tokens.len();
                if b > from && b < prompt.len() {
                    engine.prefill(&mut session, &prompt[from..b])?;
                    self.insert(engine, &session, None);
                }
            }
        }
        Ok((session, cached, logits))
    }

    /// Keeps a copy of `session` (and, if given, the logits of its last token); a backend that
    /// holds the state on a device keeps its own copy there (`Engine::keep_state`).
    pub fn insert(&mut self, engine: &Engine, session: &Session, logits: Option<&[f32]>) {
        if self.max_entries == 0 || session.tokens.is_empty() {
            return;
        }
        if let Err(e) = engine.keep_state(session) {
            tracing::warn!("the backend could not keep a copy of the session state: {e:#}");
        }
        if let Some(e) = self
            .entries
            .iter_mut()
            .find(|e| e.session.tokens == session.tokens)
        {
            if e.logits.is_none() {
                if let Some(l) = logits {
                    e.logits = Some(l.to_vec());
                    e.bytes += 4 * l.len();
                }
            }
            return;
        }
        let bytes =
            session.state.bytes() + 4 * session.tokens.len() + 4 * logits.map_or(0, |l| l.len());
        if bytes > self.max_bytes {
            return;
        }
        self.clock += 1;
        self.entries.push(Entry {
            session: session.clone(),
            logits: logits.map(|l| l.to_vec()),
            bytes,
            used: self.clock,
        });
        while self.entries.len() > self.max_entries
            || self.entries.iter().map(|e| e.bytes).sum::<usize>() > self.max_bytes
        {
            let oldest = self
                .entries
                .iter()
                .enumerate()
                .min_by_key(|(_, e)| e.used)
                .map(|(i, _)| i)
                .unwrap_or(0);
            self.entries.remove(oldest);
        }
    }
}

pub struct Worker {
    pub engine: Engine,
    pub format: Arc<PromptFormat>,
    pub cache: PrefixCache,
    pub metrics: Arc<Metrics>,
    pub queued: Arc<AtomicUsize>,
}

/// A token's log-probability and its position's top alternatives, as the API reports them.
fn token_logprob(p: &PositionLogprobs, chosen: u32, format: &PromptFormat) -> TokenLogprob {
    let text = |id: u32| format.decode(&[id]).unwrap_or_default();
    let top_logprobs = p
        .top
        .iter()
        .map(|&(id, logit)| {
            let t = text(id);
            TopLogprob {
                bytes: t.as_bytes().to_vec(),
                token: t,
                logprob: logit - p.log_normaliser,
            }
        })
        .collect();
    let t = text(chosen);
    TokenLogprob {
        bytes: t.as_bytes().to_vec(),
        token: t,
        logprob: p.next.unwrap_or(f32::NEG_INFINITY) - p.log_normaliser,
        top_logprobs,
    }
}

/// Runs `prompt` in a fresh session, each position's logits summarised where they are (on a
/// device backend, the GPU) into the next token's log-probability with `top` alternatives;
/// returns the session, those log-probabilities (for tokens 1.., the first has no context) and
/// the last position's logits.
fn score_prompt(
    engine: &Engine,
    format: &PromptFormat,
    prompt: &[u32],
    top: usize,
) -> anyhow::Result<(Session, Vec<TokenLogprob>, Vec<f32>)> {
    let valid_vocab = format.vocab_size.min(engine.config().vocab_size);
    let mut session = engine.new_session();
    let (summaries, last) = engine.prefill_logprobs(&mut session, prompt, valid_vocab, top)?;
    let logprobs = summaries
        .par_iter()
        .zip(prompt.get(1..).unwrap_or_default())
        .map(|(p, &next)| token_logprob(p, next, format))
        .collect();
    Ok((session, logprobs, last))
}

/// What a chosen token means for the reply.
enum Next {
    Continue,
    /// An end-of-turn id: the reply is over and its state is worth caching once the id has run.
    EndOfTurn,
    /// A stop string or the token limit.
    Finished,
    /// The client went away or the deadline passed (already reported).
    Aborted,
    /// Forced text (tool_choice) to run before the next token.
    Inject(Vec<u32>),
}

/// The reply being generated: detokenisation, stop strings, output parsing, streaming.
struct Reply<'a> {
    job: &'a Job,
    format: &'a PromptFormat,
    metrics: &'a Metrics,
    detok: osprey_prompt::IncrementalDecoder<'a>,
    stops: StopScanner,
    parser: Option<OutputParser>,
    force: Option<String>,
    /// The reasoning budget as it is spent (`thinking_token_budget`).
    thinking: ReasoningCountdown,
    generated: usize,
    /// Of `generated`, the tokens chosen inside the reasoning block.
    reasoning: usize,
    finish: &'static str,
}

impl Reply<'_> {
    /// Whether the next token may end the reply: the first `min_tokens` are chosen.
    fn may_end(&self) -> bool {
        self.generated >= self.job.gen.min_tokens
    }

    /// Whether choosing `token` ends the reply: an end-of-turn token (unless `ignore_eos`) or
    /// one of the request's `stop_token_ids`.
    fn ends_reply(&self, token: u32) -> bool {
        self.ending_tokens().any(|t| t == token)
    }

    fn ending_tokens(&self) -> impl Iterator<Item = u32> + '_ {
        let end_of_turn: &[u32] = if self.job.gen.ignore_eos {
            &[]
        } else {
            &self.format.stop_ids
        };
        end_of_turn
            .iter()
            .chain(&self.job.gen.stop_token_ids)
            .copied()
    }

    /// Whether the reply is inside its reasoning block.
    fn in_reasoning(&self) -> bool {
        self.parser.as_ref().is_some_and(OutputParser::in_reasoning)
    }

    /// Takes one chosen token (with its position's log-probabilities when they are wanted) and
    /// streams what it adds.
    fn accept(&mut self, token: u32, summary: Option<PositionLogprobs>) -> anyhow::Result<Next> {
        let job = self.job;
        if job.events.is_closed() {
            self.metrics.cancelled.fetch_add(1, Ordering::Relaxed);
            return Ok(Next::Aborted);
        }
        if Instant::now() > job.deadline {
            let _ = job.events.send(Event::Error {
                message: "request timed out".into(),
                timeout: true,
            });
            return Ok(Next::Aborted);
        }
        let may_end = self.may_end();
        self.generated += 1;
        if self.in_reasoning() {
            self.reasoning += 1;
        }
        if self.generated == 1 {
            self.metrics
                .record_ttft(job.received.elapsed().as_secs_f64());
        }
        let logprobs: Vec<TokenLogprob> = summary
            .map(|p| token_logprob(&p, token, self.format))
            .into_iter()
            .collect();
        if self.ends_reply(token) {
            self.finish = "stop";
            if !logprobs.is_empty() {
                let _ = job.events.send(Event::Deltas {
                    deltas: Vec::new(),
                    logprobs,
                });
            }
            return Ok(Next::EndOfTurn);
        }
        let text = self.detok.push(token);
        let (piece, hit) = if may_end {
            self.stops.push(&text)
        } else {
            (self.stops.pass(&text), false)
        };
        let mut deltas = match self.parser.as_mut() {
            Some(p) => p.push(&piece),
            None if piece.is_empty() => Vec::new(),
            None => vec![Delta::Content(piece)],
        };
        let mut inject = Vec::new();
        if self.thinking.spend(self.in_reasoning()) {
            inject = self.format.encode(CLOSE_REASONING)?;
            if let Some(p) = self.parser.as_mut() {
                deltas.extend(p.push(CLOSE_REASONING));
            }
        }
        if let (Some(p), Some(text)) = (self.parser.as_mut(), self.force.as_ref()) {
            if !p.in_reasoning() {
                let forced = format!("\n\n{text}");
                inject.extend(self.format.encode(&forced)?);
                deltas.extend(p.push(&forced));
                self.force = None;
            }
        }
        if !deltas.is_empty() || !logprobs.is_empty() {
            let _ = job.events.send(Event::Deltas { deltas, logprobs });
        }
        let one_call_done = job.chat.as_ref().is_some_and(|c| c.one_call)
            && self
                .parser
                .as_ref()
                .is_some_and(|p| p.closed_tool_calls() > 0);
        if hit || one_call_done {
            self.finish = "stop";
            return Ok(Next::Finished);
        }
        if self.generated == job.max_tokens {
            return Ok(Next::Finished);
        }
        Ok(if inject.is_empty() {
            Next::Continue
        } else {
            Next::Inject(inject)
        })
    }
}

impl Worker {
    /// Serves jobs until the sending side closes.
    pub fn run(mut self, jobs: std::sync::mpsc::Receiver<Job>) {
        while let Ok(job) = jobs.recv() {
            self.queued.fetch_sub(1, Ordering::SeqCst);
            self.metrics
                .queue_depth
                .store(self.queued.load(Ordering::SeqCst), Ordering::Relaxed);
            let events = job.events.clone();
            if events.is_closed() {
                continue;
            }
            // a defect that panics fails its own request, not the server: the engine thread
            // goes on to the next (a backend that held a lock then reports it poisoned)
            let served = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.serve(job)));
            let failed = match served {
                Ok(Ok(())) => None,
                Ok(Err(e)) => Some(format!("{e:#}")),
                Err(panic) => {
                    let what = panic
                        .downcast_ref::<String>()
                        .map(String::as_str)
                        .or_else(|| panic.downcast_ref::<&str>().copied())
                        .unwrap_or("a panic");
                    tracing::error!("the engine failed a request: {what}");
                    Some(format!("internal error: {what}"))
                }
            };
            if let Some(message) = failed {
                let _ = events.send(Event::Error {
                    message,
                    timeout: false,
                });
            }
        }
    }

    fn serve(&mut self, mut job: Job) -> anyhow::Result<()> {
        let engine = &self.engine;
        let format = self.format.clone();
        let valid_vocab = format.vocab_size.min(engine.config().vocab_size);
        let prompt = &job.prompt;

        // longest cached prefix, then prefill up to the branch point (snapshot) and the rest; a
        // cached copy of the whole prompt with its logits needs no prefill
        let started = Instant::now();
        let recomputed_before = engine.recomputed_tokens();
        // an echoed prompt with its log-probabilities runs from scratch, every position scored
        let (scored, prompt_logprobs) = match job.prompt_logprobs {
            Some(top) => {
                let (session, logprobs, last) = score_prompt(engine, &format, prompt, top)?;
                (Some((session, last)), Some(logprobs))
            }
            None => (None, None),
        };
        if let Some(text) = &job.echo {
            let _ = job.events.send(Event::Prompt {
                text: text.clone(),
                first_token: format.decode(&prompt[..1])?,
                logprobs: prompt_logprobs,
            });
        }
        let (mut session, cached, ready) = match scored {
            Some((session, last)) => (session, 0, Some(last)),
            None => self.cache.resume(engine, prompt, &job.branches)?,
        };
        let mut logits = match ready {
            Some(l) => l,
            None => {
                let from = session.tokens.len();
                let (l, _) = engine.prefill(&mut session, &prompt[from..])?;
                self.cache.insert(engine, &session, Some(&l));
                l
            }
        };
        let recomputed = engine
            .recomputed_tokens()
            .saturating_sub(recomputed_before)
            .min(cached);
        self.metrics.record_prefill(
            prompt.len() - cached + recomputed,
            cached - recomputed,
            started.elapsed().as_secs_f64(),
        );

        let mut constraint = job.chat.as_mut().and_then(|c| c.constraint.take());
        let mut sampler = Sampler::new(job.gen.sampling.clone(), valid_vocab, prompt);
        let mut reply = Reply {
            job: &job,
            format: &format,
            metrics: &self.metrics,
            detok: format.incremental(),
            stops: StopScanner::new(&job.gen.stop),
            parser: job
                .chat
                .as_ref()
                .map(|c| OutputParser::new(c.in_reasoning, c.tools.clone(), c.call_id_prefix)),
            force: job.chat.as_ref().and_then(|c| c.force.clone()),
            thinking: ReasoningCountdown::new(job.chat.as_ref().and_then(|c| c.thinking_budget)),
            generated: 0,
            reasoning: 0,
            finish: "length",
        };
        let decode_start = Instant::now();

        // text put in before the model writes anything: run, parsed and streamed as its own
        let mut put_in = |p: &mut OutputParser, text: &str| -> anyhow::Result<Vec<f32>> {
            let (l, _) = engine.prefill(&mut session, &format.encode(text)?)?;
            let _ = job.events.send(Event::Deltas {
                deltas: p.push(text),
                logprobs: Vec::new(),
            });
            Ok(l)
        };
        // a zero reasoning budget: the block closed before the model writes in it
        if let Some(p) = reply.parser.as_mut() {
            if reply.thinking.close_at_start(p.in_reasoning()) {
                logits = put_in(p, CLOSE_REASONING)?;
            }
        }
        // forced start of the answer when the prompt is already past the reasoning block
        if let (Some(p), Some(text)) = (reply.parser.as_mut(), reply.force.as_ref()) {
            if !p.in_reasoning() {
                logits = put_in(p, text)?;
                reply.force = None;
            }
        }

        // Each turn of this loop samples one token on the host from `logits`; then a backend
        // that chooses tokens itself (the GPU) runs on until the reply ends or needs the host
        // (forced text to inject), else the host decodes token by token. Log-probabilities come
        // with the device's tokens when the backend makes them there (the GPU summarises each
        // step's logits; it declines with penalties, which change its logits in place, and the
        // host path takes the reply). A grammar (response_format, a forced tool call) masks the
        // logits: it keeps the whole reply on the host path, as does a logit_bias (added to the
        // logits the host samples from; log-probabilities stay the model's). So do the first
        // `min_tokens`, whose choices leave out the tokens that would end the reply.
        let device_ok = constraint.is_none() && job.gen.logit_bias.is_empty();
        let mut biased = Vec::new();
        while reply.generated < job.max_tokens {
            let logits_now = &logits[..valid_vocab];
            // (a forced tool call's grammar starts after its injected opening)
            let mut held = constraint
                .as_mut()
                .filter(|_| !reply.in_reasoning() && reply.force.is_none());
            // a grammar decides itself where the reply ends (a finished JSON value may allow
            // only the end of the turn)
            let may_end = reply.may_end() || held.is_some();
            let choose_from = if job.gen.logit_bias.is_empty() && may_end {
                logits_now
            } else {
                biased.clear();
                biased.extend_from_slice(logits_now);
                for &(id, bias) in &job.gen.logit_bias {
                    if let Some(l) = biased.get_mut(id as usize) {
                        *l += bias;
                    }
                }
                if !may_end {
                    for id in reply.ending_tokens() {
                        if let Some(l) = biased.get_mut(id as usize) {
                            *l = f32::NEG_INFINITY;
                        }
                    }
                }
                &biased
            };
            let token = match held.as_mut() {
                Some(c) => sampler.sample(&c.mask(choose_from)?),
                None => sampler.sample(choose_from),
            };
            sampler.observe(token);
            let summary = job
                .gen
                .logprobs
                .map(|top| PositionLogprobs::of(logits_now, Some(token), top));
            let mut next = reply.accept(token, summary)?;
            if let (Some(c), Next::Continue) = (held, &next) {
                c.advance(token)?;
            }
            // the last chosen token, and whether the model has run it (the device runs each
            // token as it hands over the next, so all but possibly its last have run)
            let (mut last, mut last_ran, mut on_device) = (token, false, false);
            if matches!(next, Next::Continue) && device_ok && reply.may_end() {
                let remaining = job.max_tokens - reply.generated;
                let mut chosen = Vec::new();
                let mut failed = None;
                let run = DeviceRun {
                    first: token,
                    sampler: &sampler,
                    max_steps: remaining,
                    logprobs: job.gen.logprobs,
                };
                let ran = engine.decode_on_device(&mut session, &run, &mut |t, summary| {
                    chosen.push(t);
                    match reply.accept(t, summary) {
                        Ok(Next::Continue) => true,
                        Ok(other) => {
                            next = other;
                            false
                        }
                        Err(e) => {
                            failed = Some(e);
                            false
                        }
                    }
                })?;
                if let Some(e) = failed {
                    return Err(e);
                }
                chosen.iter().for_each(|&t| sampler.observe(t));
                if let Some(ran) = ran {
                    on_device = true;
                    last = *chosen.last().unwrap_or(&token);
                    last_ran = ran == 1 + chosen.len();
                }
            }
            match next {
                // the device stopped at the token limit
                Next::Continue if on_device => break,
                Next::Continue => logits = engine.decode(&mut session, token)?,
                Next::EndOfTurn => {
                    // run the end-of-turn token so the cached state ends where the next turn resumes
                    if !last_ran {
                        engine.decode(&mut session, last)?;
                    }
                    self.cache.insert(&self.engine, &session, None);
                    break;
                }
                Next::Finished => break,
                Next::Aborted => return Ok(()),
                Next::Inject(ids) => {
                    let mut feed = if last_ran { Vec::new() } else { vec![last] };
                    feed.extend(ids);
                    logits = engine.prefill(&mut session, &feed)?.0;
                }
            }
        }
        let Reply {
            mut detok,
            mut stops,
            mut parser,
            generated,
            reasoning,
            mut finish,
            ..
        } = reply;
        let decode_s = decode_start.elapsed().as_secs_f64();
        self.metrics.record_decode(generated, decode_s);

        let mut tail = Vec::new();
        let (piece, _) = stops.push(&detok.flush());
        let rest = piece + &stops.finish();
        match parser.as_mut() {
            Some(p) => {
                tail.extend(p.push(&rest));
                tail.extend(p.finish());
            }
            None if !rest.is_empty() => tail.push(Delta::Content(rest)),
            None => {}
        }
        if !tail.is_empty() {
            let _ = job.events.send(Event::Deltas {
                deltas: tail,
                logprobs: Vec::new(),
            });
        }
        if parser.as_ref().is_some_and(|p| p.tool_calls() > 0) && finish == "stop" {
            finish = "tool_calls";
        }
        // a backend that holds the state on a device may have run cached tokens again (also
        // when decoding starts: a whole-prompt hit skips the prefill)
        let recomputed = self
            .engine
            .recomputed_tokens()
            .saturating_sub(recomputed_before);
        let usage = Usage {
            prompt_tokens: prompt.len(),
            completion_tokens: generated,
            cached_tokens: cached.saturating_sub(recomputed),
            reasoning_tokens: reasoning,
        };
        // a hit is a prefix the backend did not run again, as in the usage
        let counter = if usage.cached_tokens > 0 {
            &self.metrics.cache_hits
        } else {
            &self.metrics.cache_misses
        };
        counter.fetch_add(1, Ordering::Relaxed);
        let stop_sequence = stops
            .matched()
            .filter(|_| finish == "stop")
            .map(String::from);
        let _ = job.events.send(Event::Done {
            finish_reason: finish,
            stop_sequence,
            usage,
        });
        Ok(())
    }
}
