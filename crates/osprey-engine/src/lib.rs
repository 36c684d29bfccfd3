//! The engine: a backend that runs the model, per-conversation sessions, chunked prefill,
//! sampling and the generation loop. The engine asks a backend to "run these tokens into this
//! session"; the CPU backend here is the exact reference, GPU backends specialise the whole step.

pub mod cpu;
pub mod fidelity;
pub mod generate;
pub mod kv_cache;
pub mod sampler;
pub mod session;
pub mod speculative;

use std::time::Instant;

use anyhow::Result;
use osprey_model::config::ModelConfig;
use osprey_model::ModelWeights;
use rayon::prelude::*;

use cpu::forward::CpuModel;
pub use cpu::forward::{GdnForm, LogitsFor};
pub use kv_cache::KvCache;
pub use session::{Session, SessionState};

/// Runs the model over tokens, extending a session's state.
pub trait Backend: Send + Sync {
    fn name(&self) -> &'static str;
    /// The accelerator it runs on, when it is not the host CPU.
    fn device_name(&self) -> Option<String> {
        None
    }
    fn config(&self) -> &ModelConfig;
    /// An empty per-session state in this backend's shape.
    fn new_state(&self) -> SessionState;
    /// Processes `tokens` after the `history` that produced `state`; logits `[positions, vocab]`
    /// for `want`. (A backend that keeps session state on a device uses `history` to tell whether
    /// the device holds this session's state, and rebuilds it when not.)
    fn forward(
        &self,
        state: &mut SessionState,
        history: &[u32],
        tokens: &[u32],
        want: LogitsFor,
    ) -> Result<Vec<f32>>;
    /// Decodes with the tokens chosen on the device, as `run` asks, starting by running
    /// `run.first` after `history`; each chosen token goes to `on_token` (with its position's
    /// log-probabilities when `run.logprobs` asks for them) until it returns false or
    /// `run.max_steps` tokens were chosen. Returns the tokens the state now holds beyond
    /// `history` (`first`, then the chosen tokens that were run), or None when this backend
    /// does not choose tokens itself, or not with what `run` asks (the caller samples from
    /// logits).
    fn decode_on_device(
        &self,
        _state: &mut SessionState,
        _history: &[u32],
        _run: &DeviceRun,
        _on_token: &mut OnToken,
    ) -> Result<Option<Vec<u32>>> {
        Ok(None)
    }
    /// Called where a session may later branch off (a chat reply's start and end): keeps what
    /// the backend needs to resume from the state after `tokens` once other tokens have run. A
    /// backend whose state lives in `SessionState` needs nothing (a session's snapshot is a
    /// copy); one that holds it on a device copies it there, when the device holds exactly
    /// `tokens`.
    fn keep_state(&self, _tokens: &[u32]) -> Result<()> {
        Ok(())
    }
    /// Prefills `tokens` after `history` and summarises each position's logits over the ids
    /// below `valid` for prompt log-probabilities (`following`: the token after the last
    /// position, when known; `top` alternatives); returns the summaries and, when no token
    /// follows (the prompt's end, where generation starts), the last position's logits. This
    /// default takes every position's logits from `forward` and summarises them on the host,
    /// side by side; a backend whose logits live on a device summarises them there, so that
    /// ~1 MB a position does not cross to the host.
    fn prefill_logprobs(
        &self,
        state: &mut SessionState,
        history: &[u32],
        tokens: &[u32],
        following: Option<u32>,
        valid: usize,
        top: usize,
    ) -> Result<(Vec<sampler::PositionLogprobs>, Option<Vec<f32>>)> {
        let rows = self.forward(state, history, tokens, LogitsFor::All)?;
        let vocab = self.config().vocab_size;
        let summaries = rows
            .par_chunks_exact(vocab)
            .enumerate()
            .map(|(i, row)| {
                let next = tokens.get(i + 1).copied().or(following);
                sampler::PositionLogprobs::of(&row[..valid.min(vocab)], next, top)
            })
            .collect();
        let last = following
            .is_none()
            .then(|| rows[rows.len().saturating_sub(vocab)..].to_vec());
        Ok((summaries, last))
    }
    /// Tokens of calls' `history` that the backend ran again so far, because it no longer held
    /// their state (a device backend after another branch ran and no kept copy served). Lets a
    /// server report as cached only the prompt tokens that were not computed.
    fn recomputed_tokens(&self) -> usize {
        0
    }
}

/// What `Backend::decode_on_device` is asked to run.
pub struct DeviceRun<'a> {
    /// The token the first step runs (the caller chose it).
    pub first: u32,
    /// The choice's settings and the counts its penalties read.
    pub sampler: &'a sampler::Sampler,
    /// At most this many tokens are chosen.
    pub max_steps: usize,
    /// With each chosen token, its position's log-probabilities (the model's, before the
    /// sampler's adjustments) with this many alternatives.
    pub logprobs: Option<usize>,
}

/// Takes each token a device-side decode chose, with its position's log-probabilities when they
/// were asked for; false stops the decode.
pub type OnToken<'a> = dyn FnMut(u32, Option<sampler::PositionLogprobs>) -> bool + 'a;

/// The contract of `Backend::decode_on_device` for a backend whose next token is a function of
/// the sequence so far (`choose`, with the logits it chose from: `logits`), as the test doubles
/// of the engine and server implement it (the CUDA backend keeps it with steps on the device):
/// step n runs its input (`run.first`, then each chosen token) and chooses the next, which is
/// handed to `on_token` once step n + 1 has started, so a token the caller stops at has already
/// run unless it was the last of `run.max_steps`. Returns the tokens that ran.
pub fn decode_by_steps(
    history: &[u32],
    run: &DeviceRun,
    choose: &dyn Fn(&[u32]) -> u32,
    logits: &dyn Fn(&[u32]) -> Vec<f32>,
    on_token: &mut OnToken,
) -> Vec<u32> {
    let mut seq = history.to_vec();
    let mut ran = Vec::new();
    let (mut input, mut pending) = (run.first, None);
    for _ in 0..run.max_steps {
        seq.push(input);
        ran.push(input);
        let chosen = choose(&seq);
        let summary = run
            .logprobs
            .map(|top| sampler::PositionLogprobs::of(&logits(&seq), Some(chosen), top));
        if let Some((prev, prev_summary)) = pending.take() {
            if !on_token(prev, prev_summary) {
                return ran;
            }
        }
        pending = Some((chosen, summary));
        input = chosen;
    }
    if let Some((prev, prev_summary)) = pending {
        on_token(prev, prev_summary);
    }
    ran
}

pub struct CpuBackend {
    model: CpuModel,
    gdn_form: GdnForm,
}

impl CpuBackend {
    pub fn new(weights: ModelWeights) -> Self {
        CpuBackend {
            model: CpuModel::new(weights),
            gdn_form: GdnForm::Auto,
        }
    }
    /// Forces one form of the gated delta rule (tests compare the two).
    pub fn with_gdn_form(mut self, form: GdnForm) -> Self {
        self.gdn_form = form;
        self
    }
    /// Keeps the attention layers' K/V as `kv` would (int8: each row rounded as the GPU's int8
    /// cache stores it; the CPU still holds f32).
    pub fn with_kv_cache(mut self, kv: KvCache) -> Self {
        self.model.kv_cache = kv;
        self
    }
    pub fn weights(&self) -> &ModelWeights {
        &self.model.weights
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }
    fn config(&self) -> &ModelConfig {
        self.model.config()
    }
    fn new_state(&self) -> SessionState {
        SessionState::new(self.model.config())
    }
    fn forward(
        &self,
        state: &mut SessionState,
        _history: &[u32],
        tokens: &[u32],
        want: LogitsFor,
    ) -> Result<Vec<f32>> {
        self.model.forward(state, tokens, self.gdn_form, want)
    }
}

/// Default prefill chunk: bounds scratch memory for long prompts.
pub const DEFAULT_PREFILL_CHUNK: usize = 512;

/// Positions a scored prefill runs at once: their logits are held together (~64 MB at the real
/// vocabulary).
pub const SCORED_CHUNK: usize = 64;

pub struct Engine {
    pub backend: Box<dyn Backend>,
    pub prefill_chunk: usize,
}

/// Throughput of one call.
#[derive(Clone, Copy, Debug, Default)]
pub struct Timing {
    pub tokens: usize,
    pub seconds: f64,
}

impl Timing {
    pub fn tokens_per_s(&self) -> f64 {
        if self.seconds > 0.0 {
            self.tokens as f64 / self.seconds
        } else {
            0.0
        }
    }
}

impl Engine {
    pub fn new(backend: Box<dyn Backend>) -> Self {
        Engine {
            backend,
            prefill_chunk: DEFAULT_PREFILL_CHUNK,
        }
    }

    pub fn config(&self) -> &ModelConfig {
        self.backend.config()
    }

    pub fn new_session(&self) -> Session {
        Session {
            state: self.backend.new_state(),
            tokens: Vec::new(),
        }
    }

    /// Prefills `tokens` into the session in chunks of `prefill_chunk`; returns the last
    /// position's logits.
    pub fn prefill(&self, s: &mut Session, tokens: &[u32]) -> Result<(Vec<f32>, Timing)> {
        let start = Instant::now();
        let mut logits = Vec::new();
        let chunks: Vec<&[u32]> = tokens.chunks(self.prefill_chunk.max(1)).collect();
        for (i, chunk) in chunks.iter().enumerate() {
            let want = if i + 1 == chunks.len() {
                LogitsFor::Last
            } else {
                LogitsFor::None
            };
            logits = self.backend.forward(&mut s.state, &s.tokens, chunk, want)?;
            s.tokens.extend_from_slice(chunk);
        }
        Ok((
            logits,
            Timing {
                tokens: tokens.len(),
                seconds: start.elapsed().as_secs_f64(),
            },
        ))
    }

    /// Marks the session's present state as one to resume from later (see
    /// `Backend::keep_state`).
    pub fn keep_state(&self, s: &Session) -> Result<()> {
        self.backend.keep_state(&s.tokens)
    }

    /// See `Backend::recomputed_tokens`.
    pub fn recomputed_tokens(&self) -> usize {
        self.backend.recomputed_tokens()
    }

    /// Runs one token; returns its logits.
    pub fn decode(&self, s: &mut Session, token: u32) -> Result<Vec<f32>> {
        let logits = self
            .backend
            .forward(&mut s.state, &s.tokens, &[token], LogitsFor::Last)?;
        s.tokens.push(token);
        Ok(logits)
    }

    /// Decodes on the device when the backend chooses tokens itself (see
    /// `Backend::decode_on_device`), appending what it ran to the session, and returns how many
    /// tokens that was (`first` and the chosen tokens that ran); None when the backend does not.
    pub fn decode_on_device(
        &self,
        s: &mut Session,
        run: &DeviceRun,
        on_token: &mut OnToken,
    ) -> Result<Option<usize>> {
        let ran = self
            .backend
            .decode_on_device(&mut s.state, &s.tokens, run, on_token)?;
        Ok(ran.map(|tokens| {
            s.tokens.extend_from_slice(&tokens);
            tokens.len()
        }))
    }

    /// Logits of every position of `tokens` from a fresh session, `[T, vocab]`.
    pub fn score(&self, tokens: &[u32]) -> Result<Vec<f32>> {
        let mut s = self.new_session();
        let mut out = Vec::with_capacity(tokens.len() * self.config().vocab_size);
        self.prefill_scored(&mut s, tokens, &mut |row| out.extend_from_slice(row))?;
        Ok(out)
    }

    /// Prefills `tokens` into the session summarising every position's logits for prompt
    /// log-probabilities (`PositionLogprobs` over the ids below `valid`, with `top`
    /// alternatives; position i's `next` is token i + 1's logit), a chunk at a time; returns
    /// the summaries and the last position's logits.
    pub fn prefill_logprobs(
        &self,
        s: &mut Session,
        tokens: &[u32],
        valid: usize,
        top: usize,
    ) -> Result<(Vec<sampler::PositionLogprobs>, Vec<f32>)> {
        let size = self.prefill_chunk.clamp(1, SCORED_CHUNK);
        let (mut all, mut last) = (Vec::with_capacity(tokens.len()), Vec::new());
        for (c, chunk) in tokens.chunks(size).enumerate() {
            let following = tokens.get((c + 1) * size).copied();
            let (summaries, logits) = self.backend.prefill_logprobs(
                &mut s.state,
                &s.tokens,
                chunk,
                following,
                valid,
                top,
            )?;
            all.extend(summaries);
            if let Some(logits) = logits {
                last = logits;
            }
            s.tokens.extend_from_slice(chunk);
        }
        Ok((all, last))
    }

    /// Prefills `tokens` into the session handing every position's logits to `rows`, in order,
    /// a few positions at a time (`[n, vocab]`: a position's logits are ~1 MB at the real
    /// vocabulary).
    pub fn prefill_scored(
        &self,
        s: &mut Session,
        tokens: &[u32],
        rows: &mut dyn FnMut(&[f32]),
    ) -> Result<()> {
        for chunk in tokens.chunks(self.prefill_chunk.clamp(1, SCORED_CHUNK)) {
            let logits = self
                .backend
                .forward(&mut s.state, &s.tokens, chunk, LogitsFor::All)?;
            rows(&logits);
            s.tokens.extend_from_slice(chunk);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sampler::{PositionLogprobs, Sampler, SamplingParams};

    fn next_after(seq: &[u32]) -> u32 {
        (seq.iter().sum::<u32>() * 3 + 1) % 16
    }

    fn logits_after(seq: &[u32]) -> Vec<f32> {
        (0..16u32)
            .map(|i| {
                if i == next_after(seq) {
                    5.0
                } else {
                    i as f32 * 0.1
                }
            })
            .collect()
    }

    /// Each token comes one step late with the summary of the logits it was chosen from, and a
    /// stop leaves the tokens that ran: `first` and every chosen token but the last handed over.
    #[test]
    fn decode_by_steps_hands_each_token_with_its_summary() {
        let sampler = Sampler::new(SamplingParams::default(), 16, &[]);
        let history = [3, 1];
        let run = DeviceRun {
            first: 7,
            sampler: &sampler,
            max_steps: 5,
            logprobs: Some(2),
        };
        let mut got = Vec::new();
        let ran = decode_by_steps(&history, &run, &next_after, &logits_after, &mut |t, s| {
            got.push((t, s));
            got.len() < 3
        });
        let mut seq = history.to_vec();
        seq.push(7);
        for (t, s) in &got {
            assert_eq!(*t, next_after(&seq));
            let expected = PositionLogprobs::of(&logits_after(&seq), Some(*t), 2);
            assert_eq!(s.as_ref(), Some(&expected));
            seq.push(*t);
        }
        assert_eq!(got.len(), 3);
        // stopped at the third token, which step 4 had already run
        assert_eq!(ran, seq[history.len()..].to_vec());

        let plain = DeviceRun {
            logprobs: None,
            ..run
        };
        let mut summaries = 0;
        decode_by_steps(&history, &plain, &next_after, &logits_after, &mut |_, s| {
            summaries += usize::from(s.is_some());
            true
        });
        assert_eq!(summaries, 0);
    }
}
