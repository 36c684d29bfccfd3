//! The CUDA backend behind the engine's `Backend` interface: `osprey generate`, `chat` and `serve`
//! run on it. The device holds one session's state at a time. A forward call whose tokens extend
//! what the device holds runs only the new ones; for another branch or conversation it restores
//! the longest session copy kept on the device (`keep_state`, see `snapshots`) that its tokens
//! extend, else rebuilds the state by prefilling from the first token. Several
//! tokens run through the batched prefill path, a single token through the captured decode step;
//! logits come back to the host for sampling.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::{anyhow, bail, Result};
use osprey_engine::sampler::PositionLogprobs;
use osprey_engine::{Backend, DeviceRun, KvCache, LogitsFor, OnToken, SessionState};
use osprey_model::config::ModelConfig;
use osprey_model::ModelWeights;

use crate::decoder::SessionCopy;
use crate::snapshots::{Start, StateBook};
use crate::CudaDecoder;

struct Device {
    decoder: CudaDecoder,
    /// What the device holds, what its K/V rows hold, and the state copies kept on it.
    book: StateBook<SessionCopy>,
    /// How many calls resumed from a kept copy (checks, logs).
    restored: Arc<AtomicUsize>,
    /// Tokens of callers' histories run again (`Backend::recomputed_tokens`).
    recomputed: usize,
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
    /// of `prefill_chunk` tokens; the attention layers keep K/V as `kv` says; copies of session
    /// states kept on the device (`keep_state`) take at most `copy_budget` bytes (allocated on
    /// use).
    pub fn new(
        weights: &ModelWeights,
        max_context: usize,
        valid_vocab: usize,
        prefill_chunk: usize,
        kv: KvCache,
        copy_budget: usize,
    ) -> Result<Self> {
        if prefill_chunk == 0 {
            bail!("the prefill chunk must be at least 1 token");
        }
        let decoder = CudaDecoder::new(weights, max_context, valid_vocab, kv)?;
        let mut memory = decoder.memory_report().to_vec();
        memory.push(("session copies, at most (allocated on use)", copy_budget));
        let book = StateBook::new(
            copy_budget,
            decoder.session_copy_bytes(),
            decoder.kv_row_bytes(),
        );
        Ok(CudaBackend {
            prefill_chunk,
            device_name: decoder.device_name(),
            memory,
            config: weights.config.clone(),
            device: Mutex::new(Device {
                decoder,
                book,
                restored: Arc::new(AtomicUsize::new(0)),
                recomputed: 0,
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

    /// Counts the calls that resumed from a kept state copy instead of what the device held or
    /// a rebuild (`osprey check` asserts it).
    pub fn restore_count(&self) -> Arc<AtomicUsize> {
        match self.device.lock() {
            Ok(d) => d.restored.clone(),
            Err(poisoned) => poisoned.into_inner().restored.clone(),
        }
    }

    /// The device, for one call. After a panic while it was in use (a defect; the server fails
    /// only that request and goes on) what it holds is unknown: the next call starts from an
    /// empty state instead of refusing every call after.
    fn device(&self) -> Result<std::sync::MutexGuard<'_, Device>> {
        Ok(self.device.lock().unwrap_or_else(|poisoned| {
            self.device.clear_poison();
            let mut d = poisoned.into_inner();
            d.book.lost();
            if let Err(e) = d.decoder.set_sampling(None) {
                tracing::warn!("after a failure, the GPU token choice could not be reset: {e:#}");
            }
            tracing::warn!("the CUDA backend failed in an earlier call: its state is rebuilt");
            d
        }))
    }
}

impl Device {
    /// Whether `tokens` after `history` fit the context allocated on the device.
    fn fits(&self, history: &[u32], tokens: &[u32]) -> Result<()> {
        let needed = history.len() + tokens.len();
        if needed > self.decoder.max_context {
            bail!("the context is full: {needed} tokens, {} allocated on the GPU (raise --max-context)", self.decoder.max_context);
        }
        Ok(())
    }

    /// A scored prefill: brings the held prefix up to date with `history`, then `run` prefills
    /// `tokens` from that position keeping what it needs of each position's logits; what the
    /// device holds is forgotten if the run fails midway.
    fn score<T>(
        &mut self,
        history: &[u32],
        tokens: &[u32],
        chunk: usize,
        run: impl FnOnce(&mut CudaDecoder, usize) -> Result<T>,
    ) -> Result<T> {
        self.catch_up(history, &[], 0, chunk)?;
        let from = self.book.held().len();
        match run(&mut self.decoder, from) {
            Ok(kept) => {
                self.book.ran(tokens);
                Ok(kept)
            }
            Err(e) => {
                self.book.lost();
                Err(e)
            }
        }
    }

    /// Brings the device state to `history` followed by `then`, leaving at least `min_run` of
    /// those tokens to run (1 when the last one's logits are wanted): continues what it holds,
    /// or restores a kept copy, or starts from an empty state; then runs the rest by prefill or
    /// one step.
    fn catch_up(
        &mut self,
        history: &[u32],
        then: &[u32],
        min_run: usize,
        chunk: usize,
    ) -> Result<()> {
        // a step (or decoding) right after exactly what the device holds, the common case on the
        // host path: no plan, and no copy of the history
        let ran = if then.len() <= min_run && self.book.continues(history) {
            self.run(history.len(), then, chunk)
        } else {
            self.reach(&[history, then].concat(), history.len(), min_run, chunk)
        };
        if ran.is_err() {
            // the device state is now unknown: the next call rebuilds it from scratch
            self.book.lost();
        }
        ran
    }

    /// `catch_up` for `target`, of which the first `history` tokens are the caller's history.
    fn reach(
        &mut self,
        target: &[u32],
        history: usize,
        min_run: usize,
        chunk: usize,
    ) -> Result<()> {
        let start = self.book.start(target, min_run);
        let restoring = match start {
            Start::Restore { id, .. } => Some(id),
            _ => None,
        };
        // rows other kept sessions still need, before this call writes over them; a copy whose
        // rows cannot be stashed (out of device memory) is dropped, the call goes on
        for st in self.book.before_writing(target, restoring) {
            let stashed = match self.book.saved_mut(st.id) {
                Some(copy) => self.decoder.stash_rows(copy, st.from, st.to),
                None => continue,
            };
            if let Err(e) = stashed {
                tracing::warn!("dropped a session copy whose K/V rows could not be kept: {e:#}");
                self.book.forget(st.id);
            }
        }
        let from = match start {
            Start::Held => self.book.held().len(),
            Start::Restore { id, len, rows_from } => {
                let saved = self
                    .book
                    .saved(id)
                    .ok_or_else(|| anyhow!("session copy {id} is not kept"))?;
                self.decoder.restore_session(saved, rows_from)?;
                self.book.holds(&target[..len]);
                self.restored.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(
                    "resumed from the session copy at {len} tokens ({} K/V rows copied back, {} tokens to run)",
                    len - rows_from,
                    target.len() - len
                );
                len
            }
            Start::Empty => {
                self.decoder.reset()?;
                self.book.holds(&[]);
                0
            }
        };
        self.recomputed += history.saturating_sub(from);
        self.run(from, &target[from..], chunk)
    }

    /// Runs `missing` after the `from` tokens the device holds: by prefill, or one step.
    fn run(&mut self, from: usize, missing: &[u32], chunk: usize) -> Result<()> {
        match missing.len() {
            0 => {}
            1 => {
                self.decoder.set_token(missing[0])?;
                self.decoder.step()?;
            }
            _ => self.decoder.prefill(from, missing, chunk)?,
        }
        self.book.ran(missing);
        Ok(())
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
        run: &DeviceRun,
        on_token: &mut OnToken,
    ) -> Result<Option<Vec<u32>>> {
        // the summaries read the step's logits after the sampler, which applies its penalties
        // to them in place: with penalties the host path gives the model's log-probabilities
        let penalised = run.sampler.params().penalises();
        if !CudaDecoder::can_sample(run.sampler.params()) || (run.logprobs.is_some() && penalised) {
            return Ok(None);
        }
        let first = run.first;
        let mut d = self.device()?;
        // each step runs one token: the steps that fit the allocated context
        d.fits(history, &[first])?;
        let max_steps = run.max_steps.min(d.decoder.max_context - history.len());
        d.catch_up(history, &[], 0, self.prefill_chunk)?;
        let mut chosen = Vec::new();
        let ran = d.decoder.set_sampling(Some(run.sampler)).and_then(|_| {
            d.decoder
                .run_steps(first, max_steps, run.logprobs, &mut |t, summary| {
                    chosen.push(t);
                    on_token(t, summary)
                })
        });
        let off = d.decoder.set_sampling(None);
        let steps = match ran.and_then(|n| off.map(|_| n)) {
            Ok(n) => n,
            Err(e) => {
                d.book.lost();
                return Err(e);
            }
        };
        let mut consumed = vec![first];
        consumed.extend_from_slice(&chosen[..steps.saturating_sub(1).min(chosen.len())]);
        d.book.ran(&consumed);
        state.position = d.book.held().len();
        Ok(Some(consumed))
    }

    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn recomputed_tokens(&self) -> usize {
        self.device().map_or(0, |d| d.recomputed)
    }

    fn keep_state(&self, tokens: &[u32]) -> Result<()> {
        let mut d = self.device()?;
        if d.book.held() != tokens || !d.book.wants_copy() {
            return Ok(());
        }
        let copy = d.decoder.save_session(tokens.len())?;
        d.book.keep(copy);
        Ok(())
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
        let mut d = self.device()?;
        d.fits(history, tokens)?;
        if want == LogitsFor::All {
            let chunk = self.prefill_chunk;
            let all = d.score(history, tokens, chunk, |dec, from| {
                dec.prefill_scored(from, tokens, chunk)
            })?;
            state.position = d.book.held().len();
            return Ok(all);
        }
        let min_run = usize::from(want != LogitsFor::None);
        d.catch_up(history, tokens, min_run, self.prefill_chunk)?;
        state.position = d.book.held().len();
        match want {
            LogitsFor::None => Ok(Vec::new()),
            _ => d.decoder.logits(),
        }
    }

    fn prefill_logprobs(
        &self,
        state: &mut SessionState,
        history: &[u32],
        tokens: &[u32],
        following: Option<u32>,
        valid: usize,
        top: usize,
    ) -> Result<(Vec<PositionLogprobs>, Option<Vec<f32>>)> {
        let mut d = self.device()?;
        d.fits(history, tokens)?;
        // the logits summarised on the device (`forward`'s scoring brings back ~1 MB a position)
        let chunk = self.prefill_chunk;
        let scored = d.score(history, tokens, chunk, |dec, from| {
            let summaries = dec.prefill_logprobs(from, tokens, chunk, following, valid, top)?;
            // the last position's logits only where generation may start from them
            let last = match following {
                None => Some(dec.logits()?),
                Some(_) => None,
            };
            Ok((summaries, last))
        })?;
        state.position = d.book.held().len();
        Ok(scored)
    }
}
