//! CUDA paths of the CLI: `osprey check --backend cuda` (GPU logits against the CPU reference,
//! step by step) and the GPU side of `osprey bench decode`.

use std::path::Path;
use std::sync::atomic::Ordering;

use anyhow::{bail, Context, Result};
use osprey_cuda::{CudaBackend, CudaDecoder, GdnPrefill};
use osprey_engine::sampler::{argmax, PositionLogprobs, Sampler, SamplingParams};
use osprey_engine::{CpuBackend, Engine, SCORED_CHUNK};
use osprey_model::ModelWeights;
use serde_json::json;
use tracing::{info, warn};

use crate::bench::{cpu_name, git_commit, utc_now};
use crate::commands::GpuModel;

/// Ids the real tokenizer can produce; the embedding's tail rows are padding.
pub(crate) const TOKENIZER_VOCAB: usize = 248_077;

/// `n` token ids spread over the first `valid` ids by a multiplicative hash of the position: the
/// synthetic prompts and contexts of the GPU checks and benchmarks.
pub(crate) fn spread_tokens(n: usize, valid: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| i.wrapping_mul(2_654_435_761) % valid as u32)
        .collect()
}

/// Gap between the two largest values (how close the top choice is to a tie).
fn top2_gap(v: &[f32]) -> f32 {
    let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    for &x in v {
        if x > a {
            b = a;
            a = x;
        } else if x > b {
            b = x;
        }
    }
    a - b
}

/// Relative RMS difference allowed between GPU decode and CPU logits. The decode step keeps the
/// KV cache in bf16 (a 2^-9 relative rounding of every K and V), carries the input of every
/// 4-bit tensor-core product as two signed bytes per 64-element group (at most 2^-16 of the
/// group's largest element off) and sums in other orders; everything else is f32 as on the CPU.
/// Measured differences (~1.4e-4) are far below this; a wrong kernel gives O(1).
const MAX_RELATIVE_RMS: f32 = 1e-2;

/// Relative RMS difference allowed between GPU prefill and CPU logits. The prefill GEMMs take
/// bf16 inputs on the tensor cores: activations rounded to bf16 (2^-9 relative) and weights
/// dequantised to bf16 (one rounding of q·s + b), with f32 accumulation, plus bf16 attention
/// probabilities. `osprey numerics` measures what bf16 activations do to this model family
/// (percent-level after 40 layers); for the 4-layer check models the expected difference is a few
/// 1e-3. A wrong kernel (a misplaced tile, a wrong row) gives O(1).
const MAX_PREFILL_RELATIVE_RMS: f32 = 3e-2;

/// The other branch the resume check runs past the kept copy: prompt tokens, then decode steps.
const RESUME_BRANCH: usize = 37;
const RESUME_STEPS: usize = 5;

/// One comparison of a GPU logits row with the CPU reference.
struct Compared {
    rel: f32,
    max_abs: f32,
    cpu_choice: usize,
    gap: f32,
}

impl Compared {
    fn new(cpu: &[f32], gpu: &[f32]) -> Self {
        let diff2: f64 = cpu
            .iter()
            .zip(gpu)
            .map(|(a, b)| ((a - b) as f64).powi(2))
            .sum();
        let norm2: f64 = cpu.iter().map(|a| (*a as f64).powi(2)).sum();
        let max_abs = cpu
            .iter()
            .zip(gpu)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        Compared {
            rel: (diff2 / norm2.max(1e-30)).sqrt() as f32,
            max_abs,
            cpu_choice: argmax(cpu),
            gap: top2_gap(cpu),
        }
    }

    /// A different greedy choice is only acceptable at a near-tie that the measured error can flip.
    fn disagrees(&self, gpu_choice: usize) -> bool {
        gpu_choice != self.cpu_choice && self.gap > 2.0 * self.max_abs
    }
}

pub fn check(
    m: &GpuModel,
    prompt_len: usize,
    steps: usize,
    prefill_len: usize,
    chunk: usize,
    long_context: usize,
    out: Option<&Path>,
) -> Result<()> {
    let weights = ModelWeights::load(m.dir)?;
    let vocab = weights.config.vocab_size;
    let valid = vocab.min(TOKENIZER_VOCAB);
    // the context also holds the device's record of the sampler check's draws
    let context = (prompt_len.max(prefill_len) + steps + 8)
        .max(SAMPLE_DRAWS)
        .max(prompt_len + 64);
    let mut gpu = CudaDecoder::new(&weights, context, valid, m.kv)?;
    info!("loaded on {}: {}", gpu.device_name(), memory_line(&gpu));
    let cpu = Engine::new(Box::new(CpuBackend::new(weights).with_kv_cache(m.kv)));
    let make_prompt = |n: usize| spread_tokens(n, valid);

    // 1. decode: the prompt token by token through the captured step, then teacher-forced steps
    let prompt = make_prompt(prompt_len);
    gpu.reset()?;
    for &t in &prompt {
        gpu.set_token(t)?;
        gpu.step()?;
    }
    let mut session = cpu.new_session();
    let (cpu_logits, _) = cpu.prefill(&mut session, &prompt)?;
    let decode = teacher_forced(&mut gpu, &cpu, &mut session, cpu_logits, steps, valid)?;
    // the device also records every step's choice (what an asynchronous reader consumes)
    let recorded = gpu.history(prompt_len + steps)?;
    let record_ok = recorded[prompt_len - 1..prompt_len - 1 + steps] == decode.gpu_choices[..];

    // 2. prefill: chunked and whole, against the CPU; then decode continues from the prefill
    let long = make_prompt(prefill_len);
    gpu.reset()?;
    gpu.prefill(0, &long, chunk)?;
    let chunked = gpu.logits()?;
    let chunked_choice = argmax(&chunked[..valid]);
    gpu.reset()?;
    gpu.prefill(0, &long, prefill_len)?;
    let whole = gpu.logits()?;
    let whole_choice = argmax(&whole[..valid]);
    let mut session = cpu.new_session();
    let (cpu_logits, _) = cpu.prefill(&mut session, &long)?;
    let c_chunked = Compared::new(&cpu_logits[..valid], &chunked[..valid]);
    let c_whole = Compared::new(&cpu_logits[..valid], &whole[..valid]);
    let c_between = Compared::new(&whole[..valid], &chunked[..valid]);
    let after = teacher_forced(
        &mut gpu,
        &cpu,
        &mut session,
        cpu_logits.clone(),
        steps,
        valid,
    )?;
    // the register-scan GDN form (the default runs this prompt in the chunked form)
    gpu.set_gdn_prefill(GdnPrefill::Recurrent);
    gpu.reset()?;
    gpu.prefill(0, &long, prefill_len)?;
    let recurrent_gdn = gpu.logits()?;
    gpu.set_gdn_prefill(GdnPrefill::Auto);
    let c_recurrent_gdn = Compared::new(&cpu_logits[..valid], &recurrent_gdn[..valid]);
    let recurrent_gdn_choice = argmax(&recurrent_gdn[..valid]);
    let prefill_disagree = usize::from(c_chunked.disagrees(chunked_choice))
        + usize::from(c_whole.disagrees(whole_choice))
        + usize::from(c_recurrent_gdn.disagrees(recurrent_gdn_choice));
    let prefill_rel = c_chunked.rel.max(c_whole.rel).max(c_recurrent_gdn.rel);

    let sampling = check_sampling(&mut gpu, &long, valid, prefill_len)?;
    // speculative decoding's verify step against plain steps; near-ties: what the decode phase
    // measured the GPU's logits to differ from the CPU's by, on each side
    let speculative =
        crate::gpu_speculative::check(&mut gpu, &cpu, &prompt, valid, 2.0 * decode.worst_abs)?;
    let (kv_name, device) = (gpu.kv_cache().to_string(), gpu.device_name());
    drop(gpu);
    let resumed = check_resume(m, context, chunk, &long, &cpu_logits, &make_prompt)?;
    let scored = check_scoring(m, context, chunk, &long, &cpu)?;
    let beyond = (long_context > 0)
        .then(|| check_long_context(m, long_context, steps, &make_prompt))
        .transpose()?;

    let pass = sampling.pass
        && speculative.pass
        && decode.worst_rel <= MAX_RELATIVE_RMS
        && decode.disagree == 0
        && record_ok
        && prefill_rel <= MAX_PREFILL_RELATIVE_RMS
        && prefill_disagree == 0
        && after.worst_rel <= MAX_PREFILL_RELATIVE_RMS
        && after.disagree == 0
        && resumed.pass
        && scored.pass
        && beyond.as_ref().is_none_or(|b| b.pass);
    println!(
        "decode: cuda vs cpu over {steps} steps after a {prompt_len}-token prompt: worst relative RMS {:.2e} (limit {MAX_RELATIVE_RMS:.0e}), worst max |Δ| {:.3e}, greedy disagreements {}, device token record {}",
        decode.worst_rel, decode.worst_abs, decode.disagree,
        if record_ok { "consistent" } else { "INCONSISTENT" },
    );
    println!(
        "prefill: {prefill_len} tokens, last-position logits: chunks of {chunk} {:.2e}, whole {:.2e}, whole with the register-scan GDN form {:.2e} relative RMS vs cpu (limit {MAX_PREFILL_RELATIVE_RMS:.0e}), chunked vs whole {:.2e}; greedy disagreements {prefill_disagree}",
        c_chunked.rel, c_whole.rel, c_recurrent_gdn.rel, c_between.rel
    );
    println!("{}", sampling.summary);
    println!("{}", speculative.line);
    println!("{}", resumed.summary);
    println!("{}", scored.summary);
    if let Some(b) = &beyond {
        println!("{}", b.summary);
    }
    println!(
        "prefill then decode: {steps} teacher-forced steps: worst relative RMS {:.2e}, greedy disagreements {} -> {}",
        after.worst_rel,
        after.disagree,
        if pass { "PASS" } else { "FAIL" }
    );
    if let Some(path) = out {
        let report = json!({
            "kind": "check", "backend": "cuda", "kv_cache": kv_name, "device": device, "commit": git_commit(), "date": utc_now(),
            "command": std::env::args().collect::<Vec<_>>().join(" "), "model": m.dir.display().to_string(),
            "prompt_tokens": prompt_len, "steps": steps, "worst_relative_rms": decode.worst_rel, "worst_max_abs": decode.worst_abs,
            "limit_relative_rms": MAX_RELATIVE_RMS, "greedy_disagreements": decode.disagree, "device_token_record_consistent": record_ok,
            "prefill": {
                "tokens": prefill_len, "chunk": chunk, "limit_relative_rms": MAX_PREFILL_RELATIVE_RMS,
                "chunked_relative_rms": c_chunked.rel, "chunked_max_abs": c_chunked.max_abs,
                "whole_relative_rms": c_whole.rel, "whole_max_abs": c_whole.max_abs,
                "whole_recurrent_gdn_relative_rms": c_recurrent_gdn.rel, "whole_recurrent_gdn_max_abs": c_recurrent_gdn.max_abs,
                "chunked_vs_whole_relative_rms": c_between.rel, "greedy_disagreements": prefill_disagree,
                "decode_after_prefill": {"steps": steps, "worst_relative_rms": after.worst_rel, "worst_max_abs": after.worst_abs, "greedy_disagreements": after.disagree, "per_step": after.rows},
            },
            "resume_from_state_copy": resumed.report,
            "scored_prefill": scored.report,
            "long_context": beyond.as_ref().map(|b| &b.report),
            "gpu_sampling": sampling.report,
            "speculative": speculative.json,
            "pass": pass, "per_step": decode.rows,
        });
        std::fs::write(path, serde_json::to_string_pretty(&report)? + "\n")?;
    }
    if !pass {
        bail!("CUDA logits differ from the CPU reference beyond tolerance");
    }
    Ok(())
}

/// A session resumed from a copy the backend kept on the device, through `CudaBackend` as the
/// server runs it: the prompt's first part (an odd length, so the conv buffers' parity differs
/// from the later runs') is kept; another branch runs on from it by prefill and decode steps;
/// then the rest of the prompt after the kept part, by prefill, and again with its first tokens
/// by steps (a chat's next turn: the copy's K/V rows are still in the cache); then another
/// conversation from its first token (which writes over those rows, so the backend stashes them
/// in the copy first) and the rest of the prompt again (the rows copied back). Each must give the
/// whole prompt's CPU logits, and the backend must have restored its copy each time instead of
/// rebuilding.
fn check_resume(
    m: &GpuModel,
    context: usize,
    chunk: usize,
    long: &[u32],
    cpu_logits: &[f32],
    make_prompt: &dyn Fn(usize) -> Vec<u32>,
) -> Result<PartCheck> {
    let weights = ModelWeights::load(m.dir)?;
    let valid = weights.config.vocab_size.min(TOKENIZER_VOCAB);
    let backend = CudaBackend::new(&weights, context, valid, chunk, m.kv, 1 << 30)?;
    let restored = backend.restore_count();
    let engine = Engine::new(Box::new(backend));
    let split = (long.len() / 2) | 1;
    let shifted = |n: usize| -> Vec<u32> {
        make_prompt(n)
            .iter()
            .map(|t| (t + 7) % valid as u32)
            .collect()
    };
    let other = shifted(RESUME_BRANCH);
    let mut kept = engine.new_session();
    engine.prefill(&mut kept, &long[..split])?;
    engine.keep_state(&kept)?;
    let mut branch = kept.clone();
    engine.prefill(&mut branch, &other)?;
    for &t in &other[..RESUME_STEPS] {
        engine.decode(&mut branch, t)?;
    }
    let mut by_prefill = kept.clone();
    let (rest_by_prefill, _) = engine.prefill(&mut by_prefill, &long[split..])?;
    let mut by_steps = kept.clone();
    for &t in &long[split..split + RESUME_STEPS] {
        engine.decode(&mut by_steps, t)?;
    }
    let (first_by_steps, _) = engine.prefill(&mut by_steps, &long[split + RESUME_STEPS..])?;
    let mut stranger = engine.new_session();
    engine.prefill(&mut stranger, &shifted(split + RESUME_BRANCH))?;
    let mut back = kept.clone();
    let (rows_copied_back, _) = engine.prefill(&mut back, &long[split..])?;
    let restores = restored.load(Ordering::Relaxed);
    let runs = [&rest_by_prefill, &first_by_steps, &rows_copied_back];
    let compared: Vec<Compared> = runs
        .iter()
        .map(|l| Compared::new(&cpu_logits[..valid], &l[..valid]))
        .collect();
    let disagree = compared
        .iter()
        .zip(runs)
        .filter(|(c, l)| c.disagrees(argmax(&l[..valid])))
        .count();
    let worst = compared.iter().map(|c| c.rel).fold(0.0, f32::max);
    let pass = worst <= MAX_PREFILL_RELATIVE_RMS && disagree == 0 && restores == 3;
    Ok(PartCheck {
        pass,
        summary: format!(
            "resumed from a session copy at {split} of {} tokens, restored {restores} of 3 times: after another branch ({RESUME_BRANCH} tokens + {RESUME_STEPS} steps) the rest by prefill {:.2e}, its first {RESUME_STEPS} by steps {:.2e}; after another conversation, with the stashed K/V rows copied back, {:.2e} relative RMS vs cpu (limit {MAX_PREFILL_RELATIVE_RMS:.0e}); greedy disagreements {disagree}",
            long.len(), compared[0].rel, compared[1].rel, compared[2].rel
        ),
        report: json!({
            "copy_at": split, "prompt_tokens": long.len(), "other_branch_tokens": RESUME_BRANCH, "other_branch_steps": RESUME_STEPS,
            "copies_restored": restores, "copies_expected": 3,
            "rest_by_prefill_relative_rms": compared[0].rel, "rest_by_prefill_max_abs": compared[0].max_abs,
            "first_steps_then_prefill_relative_rms": compared[1].rel, "first_steps_then_prefill_max_abs": compared[1].max_abs,
            "after_another_conversation_relative_rms": compared[2].rel, "after_another_conversation_max_abs": compared[2].max_abs,
            "limit_relative_rms": MAX_PREFILL_RELATIVE_RMS, "greedy_disagreements": disagree, "pass": pass,
        }),
    })
}

/// Positions the scoring check scores: past one scored chunk of the engine, so that the last
/// chunk is a single token.
const SCORED_POSITIONS: usize = SCORED_CHUNK + 1;

/// Alternatives a position's summary holds in the check: the API's most (`top_logprobs` 20).
const SUMMARY_TOP: usize = 20;

/// How far the device's summaries of a position's logits (sample.cu's) may be from the
/// host's summaries of the same logits: the device sums the 248K exponentials in f32 by a tree
/// with a fast exp, the host in f64 (~1e-6 of the normaliser apart); a wrong row, offset or
/// token is off by whole units.
const MAX_SUMMARY_DIFFERENCE: f32 = 1e-4;

/// The device's summaries of each position's logits (`Engine::prefill_logprobs` on the GPU)
/// against the host's summaries of the same logits, rows as `Engine::score` returns them:
/// the largest difference of the log normaliser, the next token's logit and the top logits rank
/// by rank, and the positions whose top ids differ other than at a near-tie.
fn compare_summaries(
    device: &[PositionLogprobs],
    rows: &[f32],
    tokens: &[u32],
    valid: usize,
) -> (f32, usize) {
    if device.len() != tokens.len() {
        return (f32::INFINITY, 0);
    }
    let vocab = rows.len() / tokens.len().max(1);
    let host: Vec<PositionLogprobs> = rows
        .chunks_exact(vocab)
        .enumerate()
        .map(|(i, row)| {
            PositionLogprobs::of(&row[..valid], tokens.get(i + 1).copied(), SUMMARY_TOP)
        })
        .collect();
    summary_gaps(host.iter().zip(device), MAX_SUMMARY_DIFFERENCE)
}

/// Over pairs of one position's summaries made two ways: the largest difference
/// (`PositionLogprobs::difference`, `tie` for near-ties) and how many pairs' top ids differ
/// other than at a near-tie.
fn summary_gaps<'a>(
    pairs: impl IntoIterator<Item = (&'a PositionLogprobs, &'a PositionLogprobs)>,
    tie: f32,
) -> (f32, usize) {
    pairs
        .into_iter()
        .fold((0f32, 0usize), |(worst, differ), (a, b)| {
            let (gap, ids_differ) = a.difference(b, tie);
            (worst.max(gap), differ + usize::from(ids_differ))
        })
}

/// The long-context check's prefill chunk: the GPU backend's default (what `serve` runs).
const LONG_CONTEXT_CHUNK: usize = 4096;

/// The long-context check's limit on its worst step. Most steps differ by ~3e-3 (the prefill's
/// bf16 activations); a few reach 1-3e-2 where a router near-tie goes to another expert under
/// the prefill's rounding than under the decode's (the same steps, to three digits, with the
/// bf16 and the int8 cache: not the attention). Measured worst: 3.2e-2 at one of 64 steps after
/// 140K tiny-model tokens, 1.8e-2 at full width after 262K. A wrong split or merge moves every
/// step (the median's limit) by O(1).
const LONG_CONTEXT_WORST_RELATIVE_RMS: f32 = 1e-1;

/// Decode past the lengths the CPU reference can check in minutes (its attention is quadratic in
/// the prompt: by its growth from 8K to 16K, ~13 minutes for 140K tokens of the tiny model on 16
/// cores): `n` prompt tokens prefilled on the GPU, then `steps` teacher-forced decode steps,
/// each step's logits against
/// the GPU prefill's logits of the same position (the scored prefill of those tokens after the
/// same `n`). The two share the weights and the KV cache's contents but not their attention: the
/// prefill's is tiled over the whole context on the tensor cores, the decode's split-KV with its
/// blocks merging the splits (whose count grows past 128K), so a split or merge that goes wrong
/// at long context shows as O(1) at every step. Tolerance: the median step within the prefill's
/// against the CPU (MAX_PREFILL_RELATIVE_RMS; the decode side is the CPU's to 1e-4), and every
/// step within LONG_CONTEXT_WORST_RELATIVE_RMS.
fn check_long_context(
    m: &GpuModel,
    n: usize,
    steps: usize,
    make_prompt: &dyn Fn(usize) -> Vec<u32>,
) -> Result<PartCheck> {
    let weights = ModelWeights::load(m.dir)?;
    let vocab = weights.config.vocab_size;
    let valid = vocab.min(TOKENIZER_VOCAB);
    let mut gpu = CudaDecoder::new(&weights, n + steps + 8, valid, m.kv)?;
    drop(weights);
    let tokens = make_prompt(n + steps);
    let (prompt, forced) = tokens.split_at(n);
    gpu.reset()?;
    gpu.prefill(0, prompt, LONG_CONTEXT_CHUNK)?;
    let started = std::time::Instant::now();
    let by_prefill = gpu.prefill_scored(n, forced, LONG_CONTEXT_CHUNK)?;
    let prefill_s = started.elapsed().as_secs_f64();
    gpu.reset()?;
    gpu.prefill(0, prompt, LONG_CONTEXT_CHUNK)?;
    let (mut worst_rel, mut worst_abs, mut disagree) = (0f32, 0f32, 0usize);
    let (mut rows, mut by_size) = (Vec::with_capacity(steps), Vec::with_capacity(steps));
    for (i, (&t, reference)) in forced
        .iter()
        .zip(by_prefill.chunks_exact(vocab))
        .enumerate()
    {
        gpu.set_token(t)?;
        gpu.step()?;
        let logits = gpu.logits()?;
        let choice = argmax(&logits[..valid]);
        let c = Compared::new(&reference[..valid], &logits[..valid]);
        disagree += usize::from(c.disagrees(choice));
        worst_rel = worst_rel.max(c.rel);
        worst_abs = worst_abs.max(c.max_abs);
        by_size.push(c.rel);
        rows.push(
            json!({"step": i, "position": n + i, "relative_rms": c.rel, "max_abs": c.max_abs,
                         "prefill_token": c.cpu_choice, "decode_token": choice, "top2_gap": c.gap}),
        );
    }
    by_size.sort_by(f32::total_cmp);
    let median_rel = by_size.get(by_size.len() / 2).copied().unwrap_or(0.0);
    let pass = median_rel <= MAX_PREFILL_RELATIVE_RMS
        && worst_rel <= LONG_CONTEXT_WORST_RELATIVE_RMS
        && disagree == 0;
    Ok(PartCheck {
        pass,
        summary: format!(
            "long context: {steps} decode steps after a {n}-token prompt against the GPU prefill's logits of the same positions: relative RMS median {median_rel:.2e} (limit {MAX_PREFILL_RELATIVE_RMS:.0e}), worst {worst_rel:.2e} (limit {LONG_CONTEXT_WORST_RELATIVE_RMS:.0e}), worst max |Δ| {worst_abs:.3e}, greedy disagreements {disagree} ({} the GPU prefill's scored rows took {prefill_s:.2} s)",
            if pass { "pass;" } else { "FAIL;" }
        ),
        report: json!({"prompt_tokens": n, "chunk": LONG_CONTEXT_CHUNK, "steps": steps, "reference": "the GPU's scored prefill of the same tokens",
                       "limit_median_relative_rms": MAX_PREFILL_RELATIVE_RMS, "limit_worst_relative_rms": LONG_CONTEXT_WORST_RELATIVE_RMS,
                       "median_relative_rms": median_rel, "worst_relative_rms": worst_rel, "worst_max_abs": worst_abs,
                       "greedy_disagreements": disagree, "pass": pass, "per_step": rows}),
    })
}

/// Every position's logits (`Engine::score`, what prompt log-probabilities are computed from)
/// through `CudaBackend`, which runs them by prefill, against the CPU's, row by row; and the
/// summaries the server takes (`Engine::prefill_logprobs`, made on the device) against the
/// host's summaries of the same logits.
fn check_scoring(
    m: &GpuModel,
    context: usize,
    chunk: usize,
    long: &[u32],
    cpu: &Engine,
) -> Result<PartCheck> {
    let weights = ModelWeights::load(m.dir)?;
    let vocab = weights.config.vocab_size;
    let valid = vocab.min(TOKENIZER_VOCAB);
    let engine = Engine::new(Box::new(CudaBackend::new(
        &weights, context, valid, chunk, m.kv, 0,
    )?));
    let tokens = &long[..SCORED_POSITIONS.min(long.len())];
    let gpu_rows = engine.score(tokens)?;
    // what scoring costs beside the prefill it rides on (the whole prompt, not timed as a
    // benchmark: one run each, after the compared one)
    let started = std::time::Instant::now();
    let all = engine.score(long)?.len() / vocab;
    let scored_s = started.elapsed().as_secs_f64();
    let mut plain = engine.new_session();
    let started = std::time::Instant::now();
    for part in long.chunks(SCORED_CHUNK) {
        engine.prefill(&mut plain, part)?;
    }
    let prefill_s = started.elapsed().as_secs_f64();
    let (summaries, last) =
        engine.prefill_logprobs(&mut engine.new_session(), tokens, valid, SUMMARY_TOP)?;
    let (summary_worst, summary_ids_differ) =
        compare_summaries(&summaries, &gpu_rows, tokens, valid);
    let started = std::time::Instant::now();
    engine.prefill_logprobs(&mut engine.new_session(), long, valid, 5)?;
    let summarised_s = started.elapsed().as_secs_f64();
    let cpu_rows = cpu.score(tokens)?;
    // the last position's logits, which the first generated token is chosen from (the prefill's
    // own lm_head GEMV on f32 input, where the scored rows take a GEMM on bf16), against the CPU's
    if last.len() != vocab || cpu_rows.len() < vocab {
        bail!(
            "scored prefill handed {} logits for the last position, not {vocab}",
            last.len()
        );
    }
    let last_compared = Compared::new(&cpu_rows[cpu_rows.len() - vocab..][..valid], &last[..valid]);
    if gpu_rows.len() != cpu_rows.len() {
        bail!(
            "scored prefill returned {} logits for {} positions of {vocab}",
            gpu_rows.len(),
            tokens.len()
        );
    }
    let compared: Vec<Compared> = cpu_rows
        .chunks_exact(vocab)
        .zip(gpu_rows.chunks_exact(vocab))
        .map(|(c, g)| Compared::new(&c[..valid], &g[..valid]))
        .collect();
    let disagree = compared
        .iter()
        .zip(gpu_rows.chunks_exact(vocab))
        .filter(|(c, g)| c.disagrees(argmax(&g[..valid])))
        .count();
    let worst = compared.iter().map(|c| c.rel).fold(0.0, f32::max);
    let worst_abs = compared.iter().map(|c| c.max_abs).fold(0.0, f32::max);
    let summaries_pass = summary_worst <= MAX_SUMMARY_DIFFERENCE
        && summary_ids_differ == 0
        && last_compared.rel <= MAX_PREFILL_RELATIVE_RMS
        && !last_compared.disagrees(argmax(&last[..valid]));
    let pass = worst <= MAX_PREFILL_RELATIVE_RMS && disagree == 0 && summaries_pass;
    Ok(PartCheck {
        pass,
        summary: format!(
            "scored prefill: the logits of all {} positions (as prompt log-probabilities take them): worst relative RMS {worst:.2e} (limit {MAX_PREFILL_RELATIVE_RMS:.0e}), worst max |Δ| {worst_abs:.3e}, greedy disagreements {disagree}; summarised on the GPU (top {SUMMARY_TOP}) against the host's summaries of the same logits: worst |Δ| {summary_worst:.2e} (limit {MAX_SUMMARY_DIFFERENCE:.0e}), top ids differing {summary_ids_differ}; the last position's logits against the CPU's: relative RMS {:.2e}; {all} positions: logits scored in {:.0} ms, summarised (top 5) in {:.0} ms, prefilled alone in chunks of {SCORED_CHUNK} in {:.0} ms",
            tokens.len(), last_compared.rel, scored_s * 1e3, summarised_s * 1e3, prefill_s * 1e3
        ),
        report: json!({
            "positions": tokens.len(), "worst_relative_rms": worst, "worst_max_abs": worst_abs,
            "limit_relative_rms": MAX_PREFILL_RELATIVE_RMS, "greedy_disagreements": disagree, "pass": pass,
            "per_position_relative_rms": compared.iter().map(|c| c.rel).collect::<Vec<_>>(),
            "device_summaries": {"top": SUMMARY_TOP, "worst_difference": summary_worst, "top_ids_differing": summary_ids_differ,
                "limit": MAX_SUMMARY_DIFFERENCE, "last_logits_relative_rms_vs_cpu": last_compared.rel, "pass": summaries_pass},
            "whole_prompt": {"positions": all, "scored_seconds": scored_s, "summarised_top5_seconds": summarised_s,
                "prefilled_alone_seconds": prefill_s, "chunk": SCORED_CHUNK},
        }),
    })
}

/// Total variation distance allowed between the GPU sampler's empirical distribution over
/// `SAMPLE_DRAWS` draws and the host sampler's exact one: for k categories the expected distance
/// is below ½·sqrt(2k/(π·draws)), 0.028 for the 40 candidates here; a wrong cut or ordering
/// moves whole candidates' mass (≥ 0.1 here).
const MAX_SAMPLE_TV: f64 = 0.06;
/// Streamed decode steps' summaries against the same steps run again one a call: two runs of
/// the step, whose logits differ by the MoE's float atomics in arrival order (~5e-4 measured
/// between such summaries); a summary of the wrong step or slot differs by units.
const STREAMED_SUMMARY_DIFFERENCE: f32 = 1e-2;
const SAMPLE_DRAWS: usize = 8192;

/// One part of `osprey check` (the GPU sampler, the resume from a session copy): whether it
/// passed, its summary line and its JSON.
struct PartCheck {
    pass: bool,
    summary: String,
    report: serde_json::Value,
}

/// The GPU sampler against the host sampler's semantics on the GPU's own logits of the last
/// prefill position: the distribution of top-k/top-p/min-p sampling, the greedy choice under
/// penalties, and the asynchronous one-step-late token stream.
fn check_sampling(
    gpu: &mut CudaDecoder,
    prompt: &[u32],
    valid: usize,
    prefill_len: usize,
) -> Result<PartCheck> {
    use osprey_engine::sampler::{Sampler, SamplingParams};
    let reprefill = |gpu: &mut CudaDecoder| -> Result<()> {
        gpu.reset()?;
        gpu.prefill(0, prompt, prefill_len)
    };
    // 1. distribution: the exact host distribution vs GPU draws on the same logits
    let params = SamplingParams {
        temperature: 0.8,
        top_k: 40,
        top_p: 0.9,
        min_p: 0.02,
        seed: 7,
        ..Default::default()
    };
    let sampler = Sampler::new(params, valid, prompt);
    reprefill(gpu)?;
    let logits = gpu.logits()?;
    let exact = sampler.distribution(&logits);
    gpu.set_sampling(Some(&sampler))?;
    let draws = gpu.choose_repeatedly(SAMPLE_DRAWS)?;
    // the same seed on the same logits draws the same tokens
    gpu.set_sampling(Some(&sampler))?;
    let draws_repeat = gpu.choose_repeatedly(SAMPLE_DRAWS)?;
    let mut counts = std::collections::HashMap::new();
    for &t in &draws {
        *counts.entry(t).or_insert(0usize) += 1;
    }
    let outside = counts
        .keys()
        .filter(|t| !exact.iter().any(|(i, _)| i == *t))
        .count();
    let tv = 0.5
        * (exact
            .iter()
            .map(|&(i, p)| {
                (counts.get(&i).copied().unwrap_or(0) as f64 / SAMPLE_DRAWS as f64 - p as f64).abs()
            })
            .sum::<f64>()
            + counts
                .iter()
                .filter(|(t, _)| !exact.iter().any(|(i, _)| i == *t))
                .map(|(_, &n)| n as f64 / SAMPLE_DRAWS as f64)
                .sum::<f64>());
    // 2. greedy under penalties: the host's choice
    let penalised = Sampler::new(
        SamplingParams {
            repetition_penalty: 1.3,
            presence_penalty: 0.5,
            ..Default::default()
        },
        valid,
        prompt,
    );
    let host_choice = penalised.distribution(&logits)[0].0;
    reprefill(gpu)?;
    gpu.set_sampling(Some(&penalised))?;
    let gpu_choice = gpu.choose_repeatedly(1)?[0];
    // 3. the token stream read one step late equals the device's record; a seeded stream's repeat
    // is reported but not required to match: decode is not bitwise deterministic (the MoE adds
    // its nine partial rows into the residual with float atomics, in arrival order), so a draw
    // that falls at a boundary can part the streams (seen once in ~40 full-width checks)
    let stream = |gpu: &mut CudaDecoder,
                  sampler: Option<&Sampler>|
     -> Result<(Vec<u32>, Vec<u32>, Vec<PositionLogprobs>)> {
        reprefill(gpu)?;
        gpu.set_sampling(sampler)?;
        let (mut got, mut summaries) = (Vec::new(), Vec::new());
        gpu.run_steps(1, 24, Some(SUMMARY_TOP), &mut |t, summary| {
            got.push(t);
            summaries.extend(summary);
            true
        })?;
        gpu.set_sampling(None)?;
        Ok((got, gpu.history(24)?, summaries))
    };
    let (greedy_stream, greedy_record, greedy_summaries) = stream(gpu, None)?;
    let (sampled_a, sampled_record, sampled_summaries) = stream(gpu, Some(&sampler))?;
    let (sampled_b, _, _) = stream(gpu, Some(&sampler))?;
    gpu.set_sampling(None)?;
    // 4. each token's log-probabilities, summarised on the device after its step: one step a
    // call, each summary against the host's of the logits the device then still holds (the
    // same logits: within MAX_SUMMARY_DIFFERENCE), greedy and sampled; then the streamed runs'
    // summaries (two slots, handed over a step late) against those of the same steps run one a
    // call, which are other runs of the step (decode is not bitwise deterministic: ~5e-4 apart
    // measured), within STREAMED_SUMMARY_DIFFERENCE (a summary of the wrong step is off by units)
    // (each step's summary from the device, and the host's of the same logits)
    type Pairs = (Vec<PositionLogprobs>, Vec<PositionLogprobs>);
    let mut one_a_call = |sampler: Option<&Sampler>| -> Result<Pairs> {
        reprefill(gpu)?;
        gpu.set_sampling(sampler)?;
        let (mut device, mut host, mut input) = (Vec::new(), Vec::new(), 1u32);
        for _ in 0..24 {
            let mut got = None;
            gpu.run_steps(input, 1, Some(SUMMARY_TOP), &mut |t, summary| {
                got = Some((t, summary));
                true
            })?;
            let Some((t, Some(summary))) = got else {
                bail!("a decode step asked for log-probabilities handed back none");
            };
            host.push(PositionLogprobs::of(
                &gpu.logits()?[..valid],
                Some(t),
                SUMMARY_TOP,
            ));
            device.push(summary);
            input = t;
        }
        gpu.set_sampling(None)?;
        Ok((device, host))
    };
    let (greedy_stepped, greedy_host) = one_a_call(None)?;
    let (sampled_stepped, sampled_host) = one_a_call(Some(&sampler))?;
    let (step_summaries_gap, step_summaries_differ) = summary_gaps(
        greedy_host
            .iter()
            .zip(&greedy_stepped)
            .chain(sampled_host.iter().zip(&sampled_stepped)),
        MAX_SUMMARY_DIFFERENCE,
    );
    let (streamed_gap, mut streamed_differ) = summary_gaps(
        greedy_stepped.iter().zip(&greedy_summaries),
        STREAMED_SUMMARY_DIFFERENCE,
    );
    streamed_differ += greedy_summaries.len().abs_diff(24) + sampled_summaries.len().abs_diff(24);
    // each way the stream can go wrong, named in the summary when it does
    let stream_faults: Vec<&str> = [
        (
            greedy_stream == greedy_record,
            "greedy stream vs the device's record",
        ),
        (
            sampled_a == sampled_record,
            "sampled stream vs the device's record",
        ),
        (
            draws == draws_repeat,
            "the seeded draws on one step's logits repeated",
        ),
        (
            sampled_a.iter().all(|&t| (t as usize) < valid),
            "sampled tokens inside the vocabulary",
        ),
        (
            step_summaries_gap <= MAX_SUMMARY_DIFFERENCE && step_summaries_differ == 0,
            "each step's log-probabilities vs the host's of the same logits",
        ),
        (
            streamed_gap <= STREAMED_SUMMARY_DIFFERENCE && streamed_differ == 0,
            "the streamed steps' log-probabilities vs the same steps run one a call",
        ),
    ]
    .iter()
    .filter(|(ok, _)| !ok)
    .map(|(_, what)| *what)
    .collect();
    let stream_ok = stream_faults.is_empty();
    let parted_at = sampled_a.iter().zip(&sampled_b).position(|(a, b)| a != b);
    let pass = tv <= MAX_SAMPLE_TV && outside == 0 && gpu_choice == host_choice && stream_ok;
    let summary = format!(
        "gpu sampling: {SAMPLE_DRAWS} draws (T 0.8, top-k 40, top-p 0.9, min-p 0.02) vs the host distribution over {} candidates: total variation {tv:.4} (limit {MAX_SAMPLE_TV}), {outside} outside it; greedy with penalties {} ; one-step-late token stream {}",
        exact.len(),
        if gpu_choice == host_choice { "matches the host" } else { "DIFFERS" },
        if stream_ok {
            let logprobs = format!("each token's log-probabilities (top {SUMMARY_TOP}) within {step_summaries_gap:.1e} of the host's of the same logits, streamed within {streamed_gap:.1e} of the steps run one a call");
            match parted_at {
                None => format!("consistent, seeded draws repeatable, {logprobs}"),
                Some(at) => format!("consistent, seeded draws repeatable (a seeded stream's repeat parted at step {at}), {logprobs}"),
            }
        } else {
            format!(
                "INCONSISTENT ({}; greedy {greedy_stream:?} record {greedy_record:?}; sampled {sampled_a:?} record {sampled_record:?})",
                stream_faults.join(", ")
            )
        }
    );
    let report = json!({"draws": SAMPLE_DRAWS, "candidates": exact.len(), "total_variation": tv, "limit_total_variation": MAX_SAMPLE_TV,
        "draws_outside_support": outside, "greedy_with_penalties_matches_host": gpu_choice == host_choice,
        "token_stream_consistent": stream_ok, "seeded_stream_repeat_parted_at": parted_at,
        "stream_logprobs": {"top": SUMMARY_TOP, "largest_difference_vs_host": step_summaries_gap, "limit": MAX_SUMMARY_DIFFERENCE,
                            "top_ids_differing": step_summaries_differ, "streamed_vs_one_a_call": streamed_gap,
                            "limit_streamed": STREAMED_SUMMARY_DIFFERENCE, "streamed_top_ids_differing": streamed_differ},
        "pass": pass});
    Ok(PartCheck {
        pass,
        summary,
        report,
    })
}

struct TeacherForced {
    rows: Vec<serde_json::Value>,
    gpu_choices: Vec<u32>,
    worst_rel: f32,
    worst_abs: f32,
    disagree: usize,
}

/// Compares `steps` decode steps of the GPU with the CPU, both fed the CPU's greedy choice; the
/// GPU's logits buffer holds the logits of the token before the first step.
fn teacher_forced(
    gpu: &mut CudaDecoder,
    cpu: &Engine,
    session: &mut osprey_engine::Session,
    mut cpu_logits: Vec<f32>,
    steps: usize,
    valid: usize,
) -> Result<TeacherForced> {
    let mut r = TeacherForced {
        rows: Vec::new(),
        gpu_choices: Vec::with_capacity(steps),
        worst_rel: 0.0,
        worst_abs: 0.0,
        disagree: 0,
    };
    for step in 0..steps {
        let gpu_logits = gpu.logits()?;
        let gpu_choice = argmax(&gpu_logits[..valid]);
        r.gpu_choices.push(gpu_choice as u32);
        let c = Compared::new(&cpu_logits[..valid], &gpu_logits[..valid]);
        if c.disagrees(gpu_choice) {
            r.disagree += 1;
        }
        r.worst_rel = r.worst_rel.max(c.rel);
        r.worst_abs = r.worst_abs.max(c.max_abs);
        r.rows.push(json!({"step": step, "relative_rms": c.rel, "max_abs": c.max_abs, "cpu_token": c.cpu_choice, "gpu_token": gpu_choice, "top2_gap": c.gap}));
        gpu.set_token(c.cpu_choice as u32)?;
        gpu.step()?;
        cpu_logits = cpu.decode(session, c.cpu_choice as u32)?;
    }
    Ok(r)
}

fn memory_line(gpu: &CudaDecoder) -> String {
    gpu.memory_report()
        .iter()
        .map(|(k, b)| format!("{k} {:.2} GiB", *b as f64 / (1u64 << 30) as f64))
        .collect::<Vec<_>>()
        .join(", ")
}

/// One step at `ctx` replayed with the timeline probe (osprey_cuda::timeline): each launch's start,
/// release and end, and each kernel family's share of the step, as JSON at `path`.
fn write_timeline(
    gpu: &mut CudaDecoder,
    ctx: usize,
    step_us: f64,
    command: &str,
    path: &Path,
) -> Result<()> {
    use osprey_cuda::timeline;
    let fresh = |gpu: &mut CudaDecoder| -> Result<()> {
        gpu.reset()?;
        gpu.set_position(ctx)?;
        gpu.set_token(1)
    };
    fresh(gpu)?;
    let names = gpu.launch_order()?;
    fresh(gpu)?;
    let marks = gpu.record_timeline()?;
    let launches = timeline::launches(&marks);
    if launches.len() != names.len() {
        warn!(
            "timeline: {} launches recorded, the step issues {}: families go by kernel file and grid",
            launches.len(),
            names.len()
        );
    }
    let families = timeline::family_times(&launches, &names);
    let t0 = launches.first().map_or(0, |l| l.first_start_ns());
    let end = launches
        .iter()
        .filter_map(|l| l.last_end_ns)
        .max()
        .unwrap_or(t0);
    let us = |t: Option<u64>| t.map(|t| (t as f64 - t0 as f64) / 1e3);
    let step_recorded_us = (end - t0) as f64 / 1e3;
    info!("timeline of one step at {ctx} ({step_recorded_us:.0} us from the first block in to the last out; {step_us:.0} us per replay timed with these kernels): per family, last block out to last block out, and the median hand-over (release after the predecessor's last block):");
    for f in &families {
        info!(
            "  {:<52} {:>4} launches {:>8.1} us  hand-over {:>5}",
            f.kernel,
            f.launches,
            f.micros,
            f.median_release_after_predecessor_us
                .map_or("-".to_string(), |u| format!("{u:.2}"))
        );
    }
    let kernels = timeline::launch_names(&launches, &names);
    let phase_rows: Vec<_> = timeline::family_phases(&launches, &names)
        .iter()
        .map(|p| {
            info!(
                "  {:<52} phase {}: first block {:>6.2} us after release, median {:>6.2}, last {:>6.2}",
                p.kernel, p.mark, p.first_block_us, p.median_block_us, p.last_block_us
            );
            json!({"kernel": p.kernel, "mark": p.mark, "first_block_us": p.first_block_us,
                "median_block_us": p.median_block_us, "last_block_us": p.last_block_us})
        })
        .collect();
    // each launch's blocks that started before its predecessor's last block ended
    let early: Vec<Option<usize>> = launches
        .iter()
        .enumerate()
        .map(|(i, l)| {
            let prev_end = launches[..i].last()?.last_end_ns?;
            Some(timeline::started_before(l, prev_end))
        })
        .collect();
    let report = json!({
        "kind": "decode-timeline", "backend": "cuda", "kv_cache": gpu.kv_cache().to_string(), "device": gpu.device_name(), "commit": git_commit(),
        "date": utc_now(), "command": command,
        "kernels_dir": std::env::var(osprey_cuda::KERNELS_DIR_ENV).ok(),
        "context": ctx, "step_us_timed": step_us, "step_us_recorded": step_recorded_us,
        "note": "the kernels carry the probe (a few stores per block): compare launches with each other; the step without the probe is the uninstrumented bench's",
        "method": "one graph replay with kernels from tools/timeline_kernels.py: the first thread of each block records %globaltimer at its start, past griddepcontrol.wait (release) and at its end; a family's time is the sum over its launches of (its last block's end - the previous launch's last block's end)",
        "families": families.iter().map(|f| json!({"kernel": f.kernel, "launches": f.launches, "us": f.micros,
            "median_release_after_predecessor_us": f.median_release_after_predecessor_us})).collect::<Vec<_>>(),
        "phases_note": "marks 2-8 are the phases a kernel's source marks with step_phase (their meaning is beside each call); times are after the launch's release, the median over the family's launches of its first block, its median block and its last block",
        "phases": phase_rows,
        "launches": launches.iter().zip(&kernels).zip(&early).map(|((l, kernel), early)| json!({
            "kernel": kernel,
            "file": l.module, "grid": [l.grid & 0xFFFF, l.grid >> 16], "blocks": l.blocks(),
            "blocks_started_before_predecessor_end": early,
            "start_us": us(Some(l.first_start_ns())), "release_us": us(l.release_ns), "end_us": us(l.last_end_ns),
            "phases": timeline::phase_times(l).iter().map(|p| json!({"mark": p.mark, "first_us": p.first_us, "median_us": p.median_us, "last_us": p.last_us})).collect::<Vec<_>>()})).collect::<Vec<_>>(),
    });
    std::fs::write(path, serde_json::to_string_pretty(&report)?)
        .with_context(|| format!("writing {}", path.display()))?;
    info!("wrote {}", path.display());
    Ok(())
}

/// The read probe's buffer: 1 GiB, far past any Hopper L2 (50-60 MB), so it measures DRAM.
const READ_PROBE_BYTES: usize = 1 << 30;

pub fn bench_decode(
    m: &GpuModel,
    contexts: &[usize],
    steps: usize,
    rounds: usize,
    sampling: Option<SamplingParams>,
    out: Option<&Path>,
    timeline: Option<&Path>,
) -> Result<()> {
    let command = std::env::args().collect::<Vec<_>>().join(" ");
    let weights = ModelWeights::load(m.dir)?;
    let c = weights.config.clone();
    let max_ctx = contexts.iter().copied().max().unwrap_or(0) + steps * (rounds + 1) + 8;
    let valid_vocab = c.vocab_size.min(TOKENIZER_VOCAB);
    let mut gpu = CudaDecoder::new(&weights, max_ctx, valid_vocab, m.kv)?;
    drop(weights);
    if let Some(p) = &sampling {
        // the token is sampled on the GPU, inside the replayed graph
        gpu.set_sampling(Some(&Sampler::new(p.clone(), valid_vocab, &[])))?;
    }
    info!("loaded on {}: {}", gpu.device_name(), memory_line(&gpu));
    // the ceiling a step's achieved rate is judged against: this device's streaming read
    let read_ceiling = gpu.measure_read_bandwidth(READ_PROBE_BYTES, 5)?;
    info!(
        "streaming read of {} MiB on this device: {:.2} TB/s (the ceiling below)",
        READ_PROBE_BYTES >> 20,
        read_ceiling / 1e12
    );
    let mut results = Vec::new();
    let mut profile = None;
    for &ctx in contexts {
        let mut per_round = Vec::new();
        for _ in 0..rounds {
            gpu.reset()?;
            // the work of a step depends only on how many positions it attends to
            gpu.set_position(ctx)?;
            gpu.set_token(1)?;
            let secs = gpu.time_steps(steps)?;
            per_round.push(steps as f64 / secs);
        }
        per_round.sort_by(|a, b| a.total_cmp(b));
        let med = per_round[per_round.len() / 2];
        let bytes = gpu.step_bytes(ctx + steps / 2) as f64;
        let bw = bytes * med;
        info!(
            "decode @ {ctx:>6}: {med:>8.1} tok/s, {:.2} GB/step, {:.2} TB/s ({:.0}% of {:.1} TB/s)",
            bytes / 1e9,
            bw / 1e12,
            100.0 * bw / read_ceiling,
            read_ceiling / 1e12
        );
        results.push(json!({"tokens": ctx, "tokens_per_s": med, "rounds": per_round, "bytes_per_step": bytes, "achieved_bytes_per_s": bw,
                            "fraction_of_read_ceiling": bw / read_ceiling}));
        if ctx == 4096 || (profile.is_none() && ctx == *contexts.last().unwrap_or(&0)) {
            gpu.reset()?;
            gpu.set_position(ctx)?;
            let p = gpu.profile_step()?;
            let total: f64 = p.iter().map(|k| k.micros).sum();
            // the same families inside the graph: each one issued twice, the extra time per step
            let in_graph = gpu
                .profile_step_in_graph(&p, ctx, steps)
                .unwrap_or_else(|e| {
                    warn!("in-graph profile skipped: {e:#}");
                    Vec::new()
                });
            let graph_us =
                |name: &str| in_graph.iter().find(|k| k.kernel == name).map(|k| k.micros);
            let step_us = 1e6 / med;
            info!("per-kernel time of one step at {ctx} ({step_us:.0} us as a graph): launched one by one with events ({total:.0} us in all), and inside the graph (what issuing the family twice adds to a step):");
            for k in &p {
                let g = graph_us(k.kernel).map_or("-".to_string(), |u| format!("{u:.1} us"));
                info!(
                    "  {:<44} {:>4} launches {:>9.1} us {:>11}",
                    k.kernel, k.launches, k.micros, g
                );
            }
            if let Some(path) = timeline {
                write_timeline(&mut gpu, ctx, step_us, &command, path)?;
            }
            profile = Some(
                json!({"context": ctx, "total_us": total, "graph_step_us": step_us,
                "kernels": p.iter().map(|k| json!({"kernel": k.kernel, "launches": k.launches, "us": k.micros,
                    "graph_us": graph_us(k.kernel)})).collect::<Vec<_>>()}),
            );
        }
    }
    let report = json!({
        "kind": "decode", "backend": "cuda", "kv_cache": gpu.kv_cache().to_string(), "device": gpu.device_name(), "host": cpu_name(), "commit": git_commit(), "date": utc_now(),
        "command": command, "model": {"dir": m.dir.display().to_string(), "layers": c.num_layers(), "hidden_size": c.hidden_size},
        "method": format!("median of {rounds} rounds of {steps} CUDA-graph replays timed with CUDA events; position set to the context length (a step's work depends only on it)"),
        "read_ceiling_bytes_per_s": read_ceiling,
        "read_ceiling_method": format!("best of 5 streaming reads of {} MiB by ceiling.cu read_stream on this device", READ_PROBE_BYTES >> 20),
        "sampling": sampling.as_ref().map(crate::bench::sampling_json),
        "gpu_memory": gpu.memory_report().iter().map(|(k, b)| json!({"part": k, "bytes": b})).collect::<Vec<_>>(),
        "results": results, "profile": profile,
    });
    let text = serde_json::to_string_pretty(&report)?;
    match out {
        Some(p) => std::fs::write(p, text + "\n")?,
        None => println!("{text}"),
    }
    Ok(())
}

/// Measured dense bf16 tensor-core ceiling of an H200 (gpu.md), for the achieved-TFLOP/s column.
const BF16_CEILING_FLOP_PER_S: f64 = 790e12;

pub fn bench_prefill(
    m: &GpuModel,
    lengths: &[usize],
    rounds: usize,
    chunk: usize,
    out: Option<&Path>,
) -> Result<()> {
    let command = std::env::args().collect::<Vec<_>>().join(" ");
    let weights = ModelWeights::load(m.dir)?;
    let c = weights.config.clone();
    let longest = lengths.iter().copied().max().unwrap_or(1);
    let valid = c.vocab_size.min(TOKENIZER_VOCAB);
    let mut gpu = CudaDecoder::new(&weights, longest + 8, valid, m.kv)?;
    drop(weights);
    info!("loaded on {}: {}", gpu.device_name(), memory_line(&gpu));
    let tokens = spread_tokens(longest, valid);
    // warm-up: every kernel once, scratch allocated for the chunk
    gpu.reset()?;
    gpu.prefill(0, &tokens[..longest.min(chunk)], chunk)?;
    gpu.synchronize()?;
    let mut results = Vec::new();
    let mut profiles = Vec::new();
    // where the time goes: the shortest length (latency), 4K (the headline) and the longest
    // (attention's quadratic share)
    let profiled = [lengths.iter().copied().min().unwrap_or(0), 4096, longest];
    for &len in lengths {
        let mut per_round = Vec::new();
        for _ in 0..rounds {
            gpu.reset()?;
            gpu.synchronize()?;
            let start = std::time::Instant::now();
            gpu.prefill(0, &tokens[..len], chunk)?;
            gpu.synchronize()?;
            per_round.push(len as f64 / start.elapsed().as_secs_f64());
        }
        let mut sorted = per_round.clone();
        sorted.sort_by(|a, b| a.total_cmp(b));
        let med = sorted[sorted.len() / 2];
        // the two GDN forms forced, one prefill each (what `Auto` chooses between)
        let mut forms = serde_json::Map::new();
        if len <= 16_384 {
            for (name, form) in [
                ("recurrent", GdnPrefill::Recurrent),
                ("chunked", GdnPrefill::Chunked),
            ] {
                gpu.set_gdn_prefill(form);
                gpu.reset()?;
                gpu.synchronize()?;
                let start = std::time::Instant::now();
                gpu.prefill(0, &tokens[..len], chunk)?;
                gpu.synchronize()?;
                forms.insert(
                    name.into(),
                    json!(len as f64 / start.elapsed().as_secs_f64()),
                );
            }
            gpu.set_gdn_prefill(GdnPrefill::Auto);
            info!(
                "  gdn forms forced at {len}: {}",
                serde_json::Value::Object(forms.clone())
            );
        }
        info!(
            "prefill {len:>6}: {med:>9.1} tok/s (min {:.1}, max {:.1})",
            sorted[0],
            sorted[sorted.len() - 1]
        );
        results.push(json!({"tokens": len, "tokens_per_s": med, "min": sorted[0], "max": sorted[sorted.len() - 1], "rounds": per_round,
                            "gdn_form_tokens_per_s": forms}));
        if profiled.contains(&len) {
            gpu.reset()?;
            let p = gpu.profile_prefill(0, &tokens[..len], chunk)?;
            let total: f64 = p.iter().map(|k| k.micros).sum();
            info!("per-kernel time of a {len}-token prefill (launched with events, {total:.0} us in all):");
            for k in &p {
                info!(
                    "  {:<44} {:>5} launches {:>10.1} us",
                    k.kernel, k.launches, k.micros
                );
            }
            // routed experts: gate+up (2·I rows) and down (H rows), k experts per token
            let expert_flop = 2.0
                * len as f64
                * c.num_experts_per_tok as f64
                * 3.0
                * (c.hidden_size * c.moe_intermediate_size) as f64
                * c.num_layers() as f64;
            let expert_us: f64 = p
                .iter()
                .filter(|k| k.kernel.contains("(grouped)"))
                .map(|k| k.micros)
                .sum();
            let tflops = expert_flop / (expert_us * 1e-6) / 1e12;
            info!(
                "expert GEMMs: {:.2} TFLOP in {:.1} ms = {tflops:.0} TFLOP/s ({:.0}% of {:.0})",
                expert_flop / 1e12,
                expert_us / 1e3,
                100.0 * tflops * 1e12 / BF16_CEILING_FLOP_PER_S,
                BF16_CEILING_FLOP_PER_S / 1e12
            );
            // the recurrence's kernels under each form forced (the default profile above serves
            // for the form it ran alone)
            let ran = |prefix: &str| p.iter().any(|k| k.kernel.starts_with(prefix));
            let (ran_scan, ran_chunked) = (ran("gdn scan"), ran("gdn chunked"));
            let mut gdn_forms = serde_json::Map::new();
            for (name, form, ran_alone) in [
                ("recurrent", GdnPrefill::Recurrent, ran_scan && !ran_chunked),
                ("chunked", GdnPrefill::Chunked, ran_chunked && !ran_scan),
            ] {
                let forced;
                let profile = if ran_alone {
                    &p
                } else {
                    gpu.set_gdn_prefill(form);
                    gpu.reset()?;
                    forced = gpu.profile_prefill(0, &tokens[..len], chunk)?;
                    &forced
                };
                let mut kernels = Vec::new();
                for k in profile.iter().filter(|k| k.kernel.starts_with("gdn")) {
                    info!("  {name:<9} {:<34} {:>10.1} us", k.kernel, k.micros);
                    kernels
                        .push(json!({"kernel": k.kernel, "launches": k.launches, "us": k.micros}));
                }
                gdn_forms.insert(name.into(), json!(kernels));
            }
            gpu.set_gdn_prefill(GdnPrefill::Auto);
            profiles.push(json!({"tokens": len, "total_us": total,
                "expert_gemm": {"flop": expert_flop, "us": expert_us, "tflop_per_s": tflops, "fraction_of_bf16_ceiling": tflops * 1e12 / BF16_CEILING_FLOP_PER_S},
                "kernels": p.iter().map(|k| json!({"kernel": k.kernel, "launches": k.launches, "us": k.micros})).collect::<Vec<_>>(),
                "gdn_kernels_per_form": gdn_forms}));
        }
    }
    let report = json!({
        "kind": "prefill", "backend": "cuda", "kv_cache": gpu.kv_cache().to_string(), "device": gpu.device_name(), "host": cpu_name(), "commit": git_commit(), "date": utc_now(),
        "command": command, "model": {"dir": m.dir.display().to_string(), "layers": c.num_layers(), "hidden_size": c.hidden_size},
        "method": format!("median of {rounds} fresh prefills from position 0, wall clock around prefill + device synchronise; chunks of {chunk} tokens"),
        "prefill_chunk": chunk, "prefill_scratch_bytes": gpu.prefill_scratch_bytes(),
        "bf16_ceiling_flop_per_s": BF16_CEILING_FLOP_PER_S,
        "gpu_memory": gpu.memory_report().iter().map(|(k, b)| json!({"part": k, "bytes": b})).collect::<Vec<_>>(),
        "results": results, "profiles": profiles,
    });
    let text = serde_json::to_string_pretty(&report)?;
    match out {
        Some(p) => std::fs::write(p, text + "\n")?,
        None => println!("{text}"),
    }
    Ok(())
}
