//! The CUDA backend behind the engine's `Backend` interface: `osprey generate`, `chat` and `serve`
//! run on it. The device holds one session's state at a time; a forward call for another session
//! (or after a snapshot was restored) rebuilds the device state by prefilling that session's
//! tokens (only the missing suffix when the device already holds a prefix of them). Several tokens
//! run through the batched prefill path, a single token through the captured decode step; logits
//! come back to the host for sampling.

use std::sync::Mutex;

use anyhow::{anyhow, bail, Result};
use osprey_engine::{Backend, LogitsFor, SessionState};
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
    /// of `prefill_chunk` tokens.
    pub fn new(
        weights: &ModelWeights,
        max_context: usize,
        valid_vocab: usize,
        prefill_chunk: usize,
    ) -> Result<Self> {
        if prefill_chunk == 0 {
            bail!("the prefill chunk must be at least 1 token");
        }
        let decoder = CudaDecoder::new(weights, max_context, valid_vocab)?;
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

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn device_name(&self) -> Option<String> {
        Some(self.device_name.clone())
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
        if !history.starts_with(&d.tokens) {
            d.decoder.reset()?;
            d.tokens.clear();
        }
        let held = d.tokens.len();
        let mut todo = history[held..].to_vec();
        todo.extend_from_slice(tokens);
        if want == LogitsFor::All {
            // scoring: every position's logits, token by token through the decode step (the
            // path generation uses), after the held prefix is brought up to date
            let missing = history[held..].to_vec();
            let ran = (|| -> Result<Vec<f32>> {
                if missing.len() > 1 {
                    d.decoder.prefill(held, &missing, self.prefill_chunk)?;
                } else if let [t] = missing[..] {
                    d.decoder.set_token(t)?;
                    d.decoder.step()?;
                }
                let mut all = Vec::with_capacity(tokens.len() * self.config.vocab_size);
                for &t in tokens {
                    d.decoder.set_token(t)?;
                    d.decoder.step()?;
                    all.extend(d.decoder.logits()?);
                }
                Ok(all)
            })();
            return match ran {
                Ok(all) => {
                    d.tokens.extend_from_slice(&todo);
                    state.position = d.tokens.len();
                    Ok(all)
                }
                Err(e) => {
                    d.tokens.clear();
                    Err(e)
                }
            };
        }
        let ran = match todo.len() {
            0 => Ok(()),
            1 => d.decoder.set_token(todo[0]).and_then(|_| d.decoder.step()),
            _ => d.decoder.prefill(held, &todo, self.prefill_chunk),
        };
        if let Err(e) = ran {
            // the device state is now unknown: the next call rebuilds it from scratch
            d.tokens.clear();
            return Err(e);
        }
        d.tokens.extend_from_slice(&todo);
        state.position = d.tokens.len();
        match want {
            LogitsFor::None => Ok(Vec::new()),
            _ => d.decoder.logits(),
        }
    }
}
