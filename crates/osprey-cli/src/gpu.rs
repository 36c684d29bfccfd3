//! CUDA paths of the CLI: `osprey check --backend cuda` (GPU logits against the CPU reference,
//! step by step) and the GPU side of `osprey bench decode`.

use std::path::Path;

use anyhow::{bail, Result};
use osprey_cuda::CudaDecoder;
use osprey_engine::sampler::argmax;
use osprey_engine::{CpuBackend, Engine};
use osprey_model::ModelWeights;
use serde_json::json;
use tracing::info;

use crate::bench::{cpu_name, git_commit, utc_now};

/// Ids the real tokenizer can produce; the embedding's tail rows are padding.
const TOKENIZER_VOCAB: usize = 248_077;

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

/// Relative RMS difference allowed between GPU and CPU logits. The GPU keeps the KV cache in
/// bf16 (a 2^-9 relative rounding of every K and V) and sums in other orders; everything else is
/// f32 as on the CPU. Measured differences are far below this; a wrong kernel gives O(1).
const MAX_RELATIVE_RMS: f32 = 1e-2;

pub fn check(dir: &Path, prompt_len: usize, steps: usize, out: Option<&Path>) -> Result<()> {
    let weights = ModelWeights::load(dir)?;
    let vocab = weights.config.vocab_size;
    let valid = vocab.min(TOKENIZER_VOCAB);
    let mut gpu = CudaDecoder::new(&weights, prompt_len + steps + 8, valid)?;
    info!("loaded on {}: {}", gpu.device_name(), memory_line(&gpu));
    let cpu = Engine::new(Box::new(CpuBackend::new(weights)));
    let prompt: Vec<u32> = (0..prompt_len as u32)
        .map(|i| i.wrapping_mul(2_654_435_761) % valid as u32)
        .collect();

    gpu.reset()?;
    for &t in &prompt {
        gpu.set_token(t)?;
        gpu.step()?;
    }
    let mut session = cpu.new_session();
    let (mut cpu_logits, _) = cpu.prefill(&mut session, &prompt)?;
    let mut rows = Vec::new();
    let mut gpu_choices = Vec::with_capacity(steps);
    let (mut worst_rel, mut worst_abs, mut disagree) = (0f32, 0f32, 0usize);
    for step in 0..steps {
        let gpu_logits = gpu.logits()?;
        let gpu_choice = gpu.last_token()? as usize;
        gpu_choices.push(gpu_choice as u32);
        let c = &cpu_logits[..valid];
        let g = &gpu_logits[..valid];
        let diff2: f64 = c.iter().zip(g).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
        let norm2: f64 = c.iter().map(|a| (*a as f64).powi(2)).sum();
        let rel = (diff2 / norm2).sqrt() as f32;
        let max_abs = c
            .iter()
            .zip(g)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        let cpu_choice = argmax(c);
        let gap = top2_gap(c);
        // a different choice is only acceptable at a near-tie that the measured error can flip
        let tie = gap <= 2.0 * max_abs;
        if cpu_choice != gpu_choice && !tie {
            disagree += 1;
        }
        worst_rel = worst_rel.max(rel);
        worst_abs = worst_abs.max(max_abs);
        rows.push(json!({"step": step, "relative_rms": rel, "max_abs": max_abs, "cpu_token": cpu_choice, "gpu_token": gpu_choice, "top2_gap": gap}));
        // both sides continue with the CPU's choice (teacher forcing)
        gpu.set_token(cpu_choice as u32)?;
        gpu.step()?;
        cpu_logits = cpu.decode(&mut session, cpu_choice as u32)?;
    }
    // the device also records every step's choice (what an asynchronous reader consumes)
    let recorded = gpu.history(prompt_len + steps)?;
    let record_ok = recorded[prompt_len - 1..prompt_len - 1 + steps] == gpu_choices[..];
    let pass = worst_rel <= MAX_RELATIVE_RMS && disagree == 0 && record_ok;
    println!(
        "cuda vs cpu over {steps} decode steps after a {prompt_len}-token prompt: worst relative RMS {worst_rel:.2e} (limit {MAX_RELATIVE_RMS:.0e}), worst max |Δ| {worst_abs:.3e}, greedy disagreements {disagree}, device token record {} -> {}",
        if record_ok { "consistent" } else { "INCONSISTENT" },
        if pass { "PASS" } else { "FAIL" }
    );
    if let Some(path) = out {
        let report = json!({
            "kind": "check", "backend": "cuda", "device": gpu.device_name(), "commit": git_commit(), "date": utc_now(),
            "command": std::env::args().collect::<Vec<_>>().join(" "), "model": dir.display().to_string(),
            "prompt_tokens": prompt_len, "steps": steps, "worst_relative_rms": worst_rel, "worst_max_abs": worst_abs,
            "limit_relative_rms": MAX_RELATIVE_RMS, "greedy_disagreements": disagree, "device_token_record_consistent": record_ok, "pass": pass, "per_step": rows,
        });
        std::fs::write(path, serde_json::to_string_pretty(&report)? + "\n")?;
    }
    if !pass {
        bail!("CUDA logits differ from the CPU reference beyond tolerance");
    }
    Ok(())
}

fn memory_line(gpu: &CudaDecoder) -> String {
    gpu.memory_report()
        .iter()
        .map(|(k, b)| format!("{k} {:.2} GiB", *b as f64 / (1u64 << 30) as f64))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Measured streaming-read ceiling of an H200 (budget.md), for the achieved-bandwidth column.
const READ_CEILING_BYTES_PER_S: f64 = 3.7e12;

pub fn bench_decode(
    dir: &Path,
    contexts: &[usize],
    steps: usize,
    rounds: usize,
    out: Option<&Path>,
) -> Result<()> {
    let command = std::env::args().collect::<Vec<_>>().join(" ");
    let weights = ModelWeights::load(dir)?;
    let c = weights.config.clone();
    let max_ctx = contexts.iter().copied().max().unwrap_or(0) + steps * (rounds + 1) + 8;
    let mut gpu = CudaDecoder::new(&weights, max_ctx, c.vocab_size.min(TOKENIZER_VOCAB))?;
    drop(weights);
    info!("loaded on {}: {}", gpu.device_name(), memory_line(&gpu));
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
            100.0 * bw / READ_CEILING_BYTES_PER_S,
            READ_CEILING_BYTES_PER_S / 1e12
        );
        results.push(json!({"tokens": ctx, "tokens_per_s": med, "rounds": per_round, "bytes_per_step": bytes, "achieved_bytes_per_s": bw,
                            "fraction_of_read_ceiling": bw / READ_CEILING_BYTES_PER_S}));
        if ctx == 4096 || (profile.is_none() && ctx == *contexts.last().unwrap_or(&0)) {
            gpu.reset()?;
            gpu.set_position(ctx)?;
            let p = gpu.profile_step()?;
            let total: f64 = p.iter().map(|k| k.micros).sum();
            info!("per-kernel time of one step at {ctx} (launched one by one with events, {total:.0} us in all):");
            for k in &p {
                info!(
                    "  {:<44} {:>4} launches {:>9.1} us",
                    k.kernel, k.launches, k.micros
                );
            }
            profile = Some(json!({"context": ctx, "total_us": total,
                "kernels": p.iter().map(|k| json!({"kernel": k.kernel, "launches": k.launches, "us": k.micros})).collect::<Vec<_>>()}));
        }
    }
    let report = json!({
        "kind": "decode", "backend": "cuda", "device": gpu.device_name(), "host": cpu_name(), "commit": git_commit(), "date": utc_now(),
        "command": command, "model": {"dir": dir.display().to_string(), "layers": c.num_layers(), "hidden_size": c.hidden_size},
        "method": format!("median of {rounds} rounds of {steps} CUDA-graph replays timed with CUDA events; position set to the context length (a step's work depends only on it)"),
        "read_ceiling_bytes_per_s": READ_CEILING_BYTES_PER_S,
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
