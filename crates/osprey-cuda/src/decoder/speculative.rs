//! Speculative decoding on the GPU (greedy): a verify step checks one drafted token a replay, so a
//! replay yields one token or two, as `osprey_engine::speculative` does on the CPU. The verify
//! step is a second captured graph: row 0 runs the step's input token at position p, row 1 the
//! draft at p + 1, each through the one-token kernels with its own scratch (`issue_rows`, kernel by kernel); then
//! speculative.cu `spec_accept` keeps the draft when row 0's choice equals it, writes the next
//! input, position and draft, and a record the host reads one replay late. The Gated DeltaNet
//! state needs no copy when a draft is rejected: row 0 writes the state after its token into a
//! second buffer per layer and row 1 reads it from there (gdn.cu GdnArgs role), so a rejection
//! only flips which buffer is current; conv state already alternates by position parity, and a
//! rejected position's K/V rows are written over by the next replay.
//!
//! The rows are the one-token step issued twice: a replay costs about two steps, so this form is
//! the scaffold the two-row kernels replace family by family (docs/cuda-decode-tried.md), not
//! yet a speed-up.

use anyhow::{bail, Result};
use cudarc::driver::{sys, CudaGraph, CudaSlice, PinnedHostSlice};

use super::{launch_cfg, ptr, CudaDecoder, GdnRole, LayerDev, Row, Scratch};
use crate::args::*;

/// Where the verify step's drafts come from.
pub enum Drafts<'a> {
    /// Prompt lookup over the context (`osprey_engine::speculative::NgramDrafter`'s rule, up to
    /// 3 tokens).
    Lookup,
    /// `tokens[i]` drafts position `from + i`, lookup elsewhere (checks; the best case).
    Known { from: usize, tokens: &'a [u32] },
}

/// What `run_speculative` ran.
#[derive(Debug)]
pub struct SpecRun {
    /// Verify steps replayed.
    pub replays: usize,
    /// Drafts kept (each gave a second token in its replay).
    pub accepted: usize,
    /// Every token chosen, in order: those handed over, and any the device chose after the
    /// caller stopped.
    pub chosen: Vec<u32>,
    /// The position after the run: the state holds the context and the chosen tokens before it.
    pub position: usize,
}

/// The verify step's buffers (allocated on first use).
pub(super) struct SpecDev {
    /// row 1's scratch
    s1: Scratch,
    /// the rows' lm_head token choices (gemv.cu TokenChoice, recording nothing else)
    choices: CudaSlice<TokenChoice>,
    chosen: CudaSlice<i32>,
    /// tokens by position
    context: CudaSlice<i32>,
    record: CudaSlice<i32>,
    cur: CudaSlice<i32>,
    answer: CudaSlice<i32>,
    span: CudaSlice<i32>,
    /// every GDN layer's second state buffer
    alt: Vec<CudaSlice<f32>>,
    graph: Option<CudaGraph>,
    record_host: [PinnedHostSlice<i32>; 2],
}

/// spec_accept's record: tokens this replay, c0, c1, the position after.
const RECORD: usize = 4;

impl CudaDecoder {
    fn alloc_spec(&self) -> Result<SpecDev> {
        let st = &self.stream;
        let chosen = st.alloc_zeros::<i32>(2)?;
        let choice = |row: u64| TokenChoice {
            n: self.valid_vocab as i32,
            sampling: ptr(&self.s.sample_params, st)
                + std::mem::offset_of!(SampleParams, active) as u64,
            token: ptr(&chosen, st) + 4 * row,
            record: 0,
            ..Default::default()
        };
        let choices = st.clone_htod(&[choice(0), choice(1)])?;
        let mut alt = Vec::new();
        for l in &self.layers {
            if let LayerDev::Gdn { state, .. } = &l.mixer {
                alt.push(st.alloc_zeros::<f32>(state.len())?);
            }
        }
        // SAFETY: page-locked host memory read only after the copy into it has completed
        let record_host = unsafe {
            [
                self.ctx.alloc_pinned_with_flags::<i32>(RECORD, 0)?,
                self.ctx.alloc_pinned_with_flags::<i32>(RECORD, 0)?,
            ]
        };
        Ok(SpecDev {
            s1: Scratch::new(st, &self.cfg, self.max_context)?,
            choices,
            chosen,
            context: st.alloc_zeros(self.max_context + 2)?,
            record: st.alloc_zeros(RECORD)?,
            cur: st.alloc_zeros(1)?,
            answer: st.alloc_zeros(self.max_context)?,
            span: st.alloc_zeros(2)?,
            alt,
            graph: None,
            record_host,
        })
    }

    fn launch_spec_accept(&self, spec: &SpecDev, accept: bool) -> Result<()> {
        let args = SpecArgs {
            chosen: self.p(&spec.chosen),
            token0: self.p(&self.s.token),
            token1: self.p(&spec.s1.token),
            pos0: self.p(&self.s.pos),
            pos1: self.p(&spec.s1.pos),
            cur: self.p(&spec.cur),
            context: self.p(&spec.context),
            record: self.p(&spec.record),
            answer: self.p(&spec.answer),
            span: self.p(&spec.span),
            accept: i32::from(accept),
            _pad: 0,
        };
        self.launch(&self.f.spec_accept, launch_cfg((1, 1), 1024), &args)
    }

    /// Captures the verify step: both rows, then spec_accept.
    fn capture_verify(&self, spec: &SpecDev) -> Result<CudaGraph> {
        let cur = self.p(&spec.cur);
        let choices = self.p(&spec.choices);
        let rows = [
            Row {
                s: &self.s,
                choice: choices,
                gdn: Some(GdnRole {
                    role: 1,
                    alt: &spec.alt,
                    cur,
                }),
                state_early: true,
            },
            Row {
                s: &spec.s1,
                choice: choices + std::mem::size_of::<TokenChoice>() as u64,
                gdn: Some(GdnRole {
                    role: 2,
                    alt: &spec.alt,
                    cur,
                }),
                state_early: false,
            },
        ];
        self.stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
        let issued = self
            .issue_rows(None, None, &rows, false)
            .and_then(|_| self.launch_spec_accept(spec, true));
        let graph = self.stream.end_capture(sys::CUgraphInstantiate_flags(0))?;
        issued?;
        graph.ok_or_else(|| anyhow::anyhow!("graph capture produced no graph"))
    }

    /// Greedy decoding with one drafted token verified a replay. `context`: the tokens so far,
    /// of which the device holds all but the last (its position is `context.len() - 1`), the
    /// last being the first replay's input. Each chosen token goes to `on_token`, one replay
    /// late, until it returns false or `max_tokens` were handed over. The state then holds the
    /// tokens before `SpecRun::position`.
    pub fn run_speculative(
        &mut self,
        context: &[u32],
        max_tokens: usize,
        drafts: Drafts,
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<SpecRun> {
        let Some(&first) = context.last() else {
            bail!("speculative decoding needs at least one token of context");
        };
        let p0 = context.len() - 1;
        if p0 + 2 >= self.max_context {
            bail!(
                "a verify step at position {p0} runs past the allocated context of {}",
                self.max_context
            );
        }
        if let Drafts::Known { tokens, .. } = drafts {
            if tokens.len() > self.max_context {
                bail!("at most {} known drafts fit", self.max_context);
            }
        }
        let mut spec = match self.spec.take() {
            Some(s) => s,
            None => self.alloc_spec()?,
        };
        let ran = self.run_verify_steps(&mut spec, context, first, max_tokens, drafts, on_token);
        self.spec = Some(spec);
        // settled even after a failed run, so the state is where the rest of the decoder keeps it
        let settled = self.settle_gdn_state();
        let ran = ran?;
        settled?;
        Ok(ran)
    }

    fn run_verify_steps(
        &mut self,
        spec: &mut SpecDev,
        context: &[u32],
        first: u32,
        max_tokens: usize,
        drafts: Drafts,
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<SpecRun> {
        let p0 = context.len() - 1;
        let mut run = SpecRun {
            replays: 0,
            accepted: 0,
            chosen: Vec::new(),
            position: p0,
        };
        if max_tokens == 0 {
            return Ok(run);
        }
        self.set_sampling(None)?;
        let st = self.stream.clone();
        let ids: Vec<i32> = context.iter().map(|&t| t as i32).collect();
        st.memcpy_htod(&ids, &mut spec.context.slice_mut(..ids.len()))?;
        let span = match drafts {
            Drafts::Lookup => [0, 0],
            Drafts::Known { from, tokens } => {
                let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
                st.memcpy_htod(&ids, &mut spec.answer.slice_mut(..ids.len()))?;
                [from as i32, tokens.len() as i32]
            }
        };
        st.memcpy_htod(&span, &mut spec.span)?;
        st.memcpy_htod(&[0i32], &mut spec.cur)?;
        st.memcpy_htod(&[p0 as i32 + 1], &mut spec.s1.pos)?;
        self.set_position(p0)?;
        self.set_token(first)?;
        // the first draft
        self.launch_spec_accept(spec, false)?;
        if spec.graph.is_none() {
            spec.graph = Some(self.capture_verify(spec)?);
        }
        let graph = spec.graph.as_ref().expect("captured above");
        // replay r starts at most at p0 + 2r and writes K/V one position further
        let max_replays = ((self.max_context - 2 - p0) / 2 + 1).min(max_tokens);
        let flags = Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING);
        let done = [self.ctx.new_event(flags)?, self.ctx.new_event(flags)?];
        let mut handed = 0;
        let mut stopped = false;
        let mut absorb = |rec: &[i32], run: &mut SpecRun| {
            let count = rec[0].clamp(1, 2) as usize;
            run.accepted += count - 1;
            run.position = rec[3] as usize;
            for &t in &rec[1..1 + count] {
                run.chosen.push(t as u32);
                if !stopped {
                    handed += 1;
                    stopped = !on_token(t as u32) || handed == max_tokens;
                }
            }
            stopped
        };
        for n in 0..max_replays {
            graph.launch()?;
            let slot = n % 2;
            st.memcpy_dtoh(&spec.record, &mut spec.record_host[slot])?;
            done[slot].record(&st)?;
            run.replays += 1;
            if n > 0 {
                done[1 - slot].synchronize()?;
                let rec = spec.record_host[1 - slot].as_slice()?.to_vec();
                if absorb(&rec, &mut run) {
                    break;
                }
            }
        }
        let last = (run.replays - 1) % 2;
        done[last].synchronize()?;
        let rec = spec.record_host[last].as_slice()?.to_vec();
        absorb(&rec, &mut run);
        Ok(run)
    }

    /// After verify steps: makes the layers' own GDN state buffers current again (copying the
    /// second buffers in where the last rejection left them current), so prefill, session
    /// copies and the one-token step find the state where they keep it.
    fn settle_gdn_state(&mut self) -> Result<()> {
        let Some(spec) = self.spec.as_ref() else {
            return Ok(());
        };
        let st = self.stream.clone();
        let cur = st.clone_dtoh(&spec.cur)?[0];
        if cur == 0 {
            return Ok(());
        }
        let mut spec = self.spec.take().expect("checked above");
        let mut alt = spec.alt.iter();
        let copied = self.layers.iter_mut().try_for_each(|l| {
            if let LayerDev::Gdn { state, .. } = &mut l.mixer {
                let src = alt.next().expect("one second buffer per GDN layer");
                st.memcpy_dtod(src, state)?;
            }
            anyhow::Ok(())
        });
        let reset = st.memcpy_htod(&[0i32], &mut spec.cur);
        self.spec = Some(spec);
        copied?;
        reset?;
        Ok(())
    }
}
