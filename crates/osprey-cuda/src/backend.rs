//! The CUDA backend behind the engine's `Backend` interface: `osprey generate`, `chat` and `serve`
//! run on it. The device holds one session's state at a time; a forward call for another session
//! (or after a snapshot was restored) rebuilds the device state by prefilling that session's
//! tokens (only the missing suffix when the device already holds a prefix of them). Several tokens
//! run through the batched prefill path, a single token through the captured decode step; logits
//! come back to the host for sampling.

use std::sync::Mutex;

use anyhow::{anyhow, bail, Result};
use osprey_engine::sampler::Sampler;
use osprey_engine::{Backend, KvCache, LogitsFor, SessionState};
use osprey_model::config::ModelConfig;
use osprey_model::ModelWeights;

use crate::CudaDecoder;

struct Device {
    decoder: CudaDecoder,
    /// Tokens whose state the device holds.
    tokens: Vec<u32>,
}

/// Tokens per prefill chunk unless the caller asks otherwise: long enough to keep the tensor
/// cores busy, small enough that the chunk's activations stay near 1 GB.
pub const DEFAULT_CUDA_PREFILL_CHUNK: usize = 4096;

pub struct CudaBackend {
    device: Mutex<Device>,
    config: ModelConfig,
    device_name: String,
    memory: Vec<(&'static str, usize)>,
    prefill_chunk: usize,
}

// SAFETY: the decoder's CUDA handles are only used while the mutex is held, and every cudarc
// call binds the context to the calling thread first.
unsafe impl Send for Device {}

impl CudaBackend {
    /// Uploads the weights and allocates state for `max_context` positions; prompts run in chunks
    /// of `prefill_chunk` tokens; the attention layers keep K/V as `kv` says.
    pub fn new(
        weights: &ModelWeights,
        max_context: usize,
        valid_vocab: usize,
        prefill_chunk: usize,
        kv: KvCache,
    ) -> Result<Self> {
        if prefill_chunk == 0 {
            bail!("the prefill chunk must be at least 1 token");
        }
        let decoder = CudaDecoder::new(weights, max_context, valid_vocab, kv)?;
        Ok(CudaBackend {
            prefill_chunk,
            device_name: decoder.device_name(),
            memory: decoder.memory_report().to_vec(),
            config: weights.config.clone(),
            device: Mutex::new(Device {
                decoder,
                tokens: Vec::new(),
            }),
        })
    }

    pub fn device_name(&self) -> &str {
        &self.device_name
    }

    /// GPU memory taken at load, by part.
    pub fn memory_report(&self) -> &[(&'static str, usize)] {
        &self.memory
    }
}

impl Device {
    /// Brings the device state to `history` followed by `then` (reusing a held prefix), by
    /// prefill or one step, without copying the history (a decode step passes the whole session).
    fn catch_up(&mut self, history: &[u32], then: &[u32], chunk: usize) -> Result<()> {
        let held = self.tokens.len();
        let (in_history, in_then) = self.tokens.split_at(held.min(history.len()));
        if !(history.starts_with(in_history) && then.starts_with(in_then)) {
            self.decoder.reset()?;
            self.tokens.clear();
        }
        let held = self.tokens.len();
        let missing: Vec<u32> = history.iter().chain(then).skip(held).copied().collect();
        let ran = match missing.len() {
            0 => Ok(()),
            1 => self
                .decoder
                .set_token(missing[0])
                .and_then(|_| self.decoder.step()),
            _ => self.decoder.prefill(held, &missing, chunk),
        };
        match ran {
            Ok(()) => {
                self.tokens.extend_from_slice(&missing);
                Ok(())
            }
            Err(e) => {
                // the device state is now unknown: the next call rebuilds it from scratch
                self.tokens.clear();
                Err(e)
            }
        }
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn device_name(&self) -> Option<String> {
        Some(self.device_name.clone())
    }

    fn decode_on_device(
        &self,
        state: &mut SessionState,
        history: &[u32],
        first: u32,
        sampler: &Sampler,
        max_steps: usize,
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<Option<Vec<u32>>> {
        if !CudaDecoder::can_sample(sampler.params()) {
            return Ok(None);
        }
        let mut d = self
            .device
            .lock()
            .map_err(|_| anyhow!("the CUDA device state is poisoned by an earlier failure"))?;
        // each step runs one token: the steps that fit the allocated context
        let room = d.decoder.max_context.saturating_sub(history.len());
        if room == 0 {
            bail!(
                "the context is full: {} tokens, {} allocated on the GPU (raise --max-context)",
                history.len() + 1,
                d.decoder.max_context
            );
        }
        let max_steps = max_steps.min(room);
        d.catch_up(history, &[], self.prefill_chunk)?;
        let mut chosen = Vec::new();
        let ran = d.decoder.set_sampling(Some(sampler)).and_then(|_| {
            d.decoder.run_steps(first, max_steps, &mut |t| {
                chosen.push(t);
                on_token(t)
            })
        });
        let off = d.decoder.set_sampling(None);
        let steps = match ran.and_then(|n| off.map(|_| n)) {
            Ok(n) => n,
            Err(e) => {
                d.tokens.clear();
                return Err(e);
            }
        };
        let mut consumed = vec![first];
        consumed.extend_from_slice(&chosen[..steps.saturating_sub(1).min(chosen.len())]);
        d.tokens.extend_from_slice(&consumed);
        state.position = d.tokens.len();
        Ok(Some(consumed))
    }

    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn new_state(&self) -> SessionState {
        // the state lives on the device; the host side only tracks the position
        SessionState {
            layers: Vec::new(),
            position: 0,
        }
    }

    fn forward(
        &self,
        state: &mut SessionState,
        history: &[u32],
        tokens: &[u32],
        want: LogitsFor,
    ) -> Result<Vec<f32>> {
        let mut d = self
            .device
            .lock()
            .map_err(|_| anyhow!("the CUDA device state is poisoned by an earlier failure"))?;
        let needed = history.len() + tokens.len();
        if needed > d.decoder.max_context {
            bail!("the context is full: {needed} tokens, {} allocated on the GPU (raise --max-context)", d.decoder.max_context);
        }
        if want == LogitsFor::All {
            // scoring: every position's logits, token by token through the decode step (the
            // path generation uses), after the held prefix is brought up to date
            d.catch_up(history, &[], self.prefill_chunk)?;
            let mut all = Vec::with_capacity(tokens.len() * self.config.vocab_size);
            for &t in tokens {
                let logits = d
                    .decoder
                    .set_token(t)
                    .and_then(|_| d.decoder.step())
                    .and_then(|_| d.decoder.logits());
                match logits {
                    Ok(l) => {
                        all.extend(l);
                        d.tokens.push(t);
                    }
                    Err(e) => {
                        d.tokens.clear();
                        return Err(e);
                    }
                }
            }
            state.position = d.tokens.len();
            return Ok(all);
        }
        d.catch_up(history, tokens, self.prefill_chunk)?;
        state.position = d.tokens.len();
        match want {
            LogitsFor::None => Ok(Vec::new()),
            _ => d.decoder.logits(),
        }
    }
}
