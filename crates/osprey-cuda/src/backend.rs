//! The CUDA backend behind the engine's `Backend` interface: `osprey generate`, `chat` and `serve`
//! run on it. The device holds one session's state at a time; a forward call for another session
//! (or after a snapshot was restored) rebuilds the device state by replaying that session's tokens.
//! Each token runs the captured decode step; logits come back to the host for sampling.

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

pub struct CudaBackend {
    device: Mutex<Device>,
    config: ModelConfig,
    device_name: String,
    memory: Vec<(&'static str, usize)>,
}

// SAFETY: the decoder's CUDA handles are only used while the mutex is held, and every cudarc
// call binds the context to the calling thread first.
unsafe impl Send for Device {}

impl CudaBackend {
    /// Uploads the weights and allocates state for `max_context` positions.
    pub fn new(weights: &ModelWeights, max_context: usize, valid_vocab: usize) -> Result<Self> {
        let decoder = CudaDecoder::new(weights, max_context, valid_vocab)?;
        Ok(CudaBackend {
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
        if want == LogitsFor::All {
            bail!("the CUDA backend returns the last position's logits only (use --backend cpu for scoring)");
        }
        let mut d = self
            .device
            .lock()
            .map_err(|_| anyhow!("the CUDA device state is poisoned by an earlier failure"))?;
        let needed = history.len() + tokens.len();
        if needed > d.decoder.max_context {
            bail!("the context is full: {needed} tokens, {} allocated on the GPU (raise --max-context)", d.decoder.max_context);
        }
        if d.tokens != history {
            d.decoder.reset()?;
            d.tokens.clear();
            for &t in history {
                d.decoder.set_token(t)?;
                d.decoder.step()?;
                d.tokens.push(t);
            }
        }
        for &t in tokens {
            d.decoder.set_token(t)?;
            d.decoder.step()?;
            d.tokens.push(t);
        }
        state.position = d.tokens.len();
        match want {
            LogitsFor::None => Ok(Vec::new()),
            _ => d.decoder.logits(),
        }
    }
}
