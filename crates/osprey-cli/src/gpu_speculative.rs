//! Speculative decoding on the GPU (`CudaDecoder::run_speculative`): its phase of `osprey check
//! --backend cuda` and `osprey bench speculative --backend cuda`.

use std::time::Instant;

use anyhow::{bail, Result};
use osprey_cuda::{CudaDecoder, Drafts, SpecRun};
use osprey_engine::sampler::argmax;
use osprey_engine::Engine;
use serde_json::{json, Value};
use tracing::info;

use crate::bench::{cpu_name, git_commit, median, utc_now};
use crate::commands::GpuModel;

/// Tokens each speculative run of the check generates.
const CHECK_TOKENS: usize = 24;
/// Plain steps run after a speculative run, from the state it left.
const CONTINUE_STEPS: usize = 4;

/// The check's verdict on one drafter.
pub struct SpecCheck {
    pub pass: bool,
    pub line: String,
    pub json: Value,
}

/// Plain greedy steps from the device's state: `first` runs at the current position; returns the
/// `n` tokens chosen.
fn plain_greedy(gpu: &mut CudaDecoder, first: u32, n: usize) -> Result<Vec<u32>> {
    gpu.set_sampling(None)?;
    let mut out = Vec::new();
    gpu.run_steps(first, n, None, &mut |t, _| {
        out.push(t);
        true
    })?;
    Ok(out)
}

/// Puts the device at the end of `prompt` (prefilled) and returns the greedy first token.
fn prefill_prompt(gpu: &mut CudaDecoder, prompt: &[u32], valid: usize) -> Result<u32> {
    gpu.reset()?;
    gpu.prefill(0, prompt, prompt.len())?;
    Ok(argmax(&gpu.logits()?[..valid]) as u32)
}

/// Speculative greedy decoding on the GPU against plain greedy steps from the same prompt: with
/// drafts that are always right (every replay keeps its draft), always wrong (none kept: the
/// Gated DeltaNet state of row 0 taken every replay) and by prompt lookup, the tokens must be
/// the plain steps' tokens, and plain steps run after each speculative run (from the state and
/// position it left) must go on choosing them. Both sides run on the GPU, whose float atomics
/// make runs differ in the last bits: a difference is accepted only where the CPU's logits
/// (`cpu`, teacher-forced on the plain tokens) put the two choices within `tie` of each other.
pub fn check(
    gpu: &mut CudaDecoder,
    cpu: &Engine,
    prompt: &[u32],
    valid: usize,
    tie: f32,
) -> Result<SpecCheck> {
    let first = prefill_prompt(gpu, prompt, valid)?;
    let plain = plain_greedy(gpu, first, CHECK_TOKENS + CONTINUE_STEPS)?;
    let mut context = prompt.to_vec();
    context.push(first);
    let from = context.len();
    let wrong: Vec<u32> = plain.iter().map(|&t| (t + 1) % valid as u32).collect();
    let cases: [(&str, Drafts); 3] = [
        (
            "right",
            Drafts::Known {
                from,
                tokens: &plain,
            },
        ),
        (
            "wrong",
            Drafts::Known {
                from,
                tokens: &wrong,
            },
        ),
        ("lookup", Drafts::Lookup),
    ];
    let mut pass = true;
    let mut rows = Vec::new();
    let mut parts = Vec::new();
    for (name, drafts) in cases {
        prefill_prompt(gpu, prompt, valid)?;
        let mut handed = Vec::new();
        let run = gpu.run_speculative(&context, CHECK_TOKENS, drafts, &mut |t| {
            handed.push(t);
            true
        })?;
        // the state holds the tokens before run.position; the next input is the token there
        let held = run.position - (from - 1);
        let next = run.chosen[held - 1];
        let after = plain_greedy(gpu, next, CONTINUE_STEPS)?;
        let mut tokens = run.chosen[..held].to_vec();
        tokens.extend_from_slice(&after);
        let n = tokens.len().min(plain.len());
        let diverged = (0..n).find(|&i| tokens[i] != plain[i]);
        let near_tie = match diverged {
            Some(i) => Some(choice_gap(cpu, &context, &plain[..i], plain[i], tokens[i])?),
            None => None,
        };
        // right drafts are all kept (each replay two tokens), wrong ones never (unless the
        // tokens parted at a near-tie, after which the known drafts no longer follow them)
        let expected_accepts = diverged.is_some()
            || match name {
                "right" => run.accepted == run.replays,
                "wrong" => run.accepted == 0,
                _ => true,
            };
        let tokens_ok = handed.len() == CHECK_TOKENS && near_tie.is_none_or(|gap| gap <= tie);
        let ok = tokens_ok && expected_accepts;
        pass &= ok;
        parts.push(format!(
            "{name} drafts {}/{} kept{}",
            run.accepted,
            run.replays,
            match (diverged, near_tie) {
                (Some(i), Some(gap)) => format!(" (differs from token {i} at a gap of {gap:.2e})"),
                _ => String::new(),
            }
        ));
        rows.push(json!({"drafts": name, "replays": run.replays, "accepted": run.accepted, "position_after": run.position,
                         "tokens_match": diverged.is_none(), "diverged_at": diverged, "cpu_gap_at_divergence": near_tie, "pass": ok}));
    }
    Ok(SpecCheck {
        pass,
        line: format!(
            "speculative (verify step, greedy): {CHECK_TOKENS} tokens + {CONTINUE_STEPS} plain steps after, against plain steps: {} -> {}",
            parts.join(", "),
            if pass { "same tokens" } else { "FAILED" }
        ),
        json: json!({"tokens": CHECK_TOKENS, "continued_steps": CONTINUE_STEPS, "near_tie_limit": tie, "runs": rows, "pass": pass}),
    })
}

/// |logit(a) − logit(b)| at the position after `context` + `prefix`, on the CPU.
fn choice_gap(cpu: &Engine, context: &[u32], prefix: &[u32], a: u32, b: u32) -> Result<f32> {
    let mut tokens = context.to_vec();
    tokens.extend_from_slice(prefix);
    let mut session = cpu.new_session();
    let (logits, _) = cpu.prefill(&mut session, &tokens)?;
    Ok((logits[a as usize] - logits[b as usize]).abs())
}

/// `osprey bench speculative --backend cuda`: at a context of `context` positions, greedy
/// generation of `tokens` tokens by plain steps and by verify steps with each drafter (`none`:
/// plain steps; `known`: the plain run's tokens, every draft right; `wrong`: every draft wrong,
/// the verify step's cost; `ngram`: prompt lookup), alternated per round; tokens/s from the first
/// token handed over to the last (host loop included: tokens reach the host one step late).
pub fn bench(
    m: &GpuModel,
    context: usize,
    tokens: usize,
    drafts: &[&str],
    rounds: usize,
    command: &str,
    out: Option<&std::path::Path>,
) -> Result<()> {
    let weights = osprey_model::ModelWeights::load(m.dir)?;
    let c = weights.config.clone();
    let valid = c.vocab_size.min(crate::gpu::TOKENIZER_VOCAB);
    let mut gpu = CudaDecoder::new(&weights, context + 2 * tokens + 8, valid, m.kv)?;
    drop(weights);
    // a context of distinct-looking ids (the lookup scans it; the step's work depends only on
    // its length)
    let mut ctx = crate::gpu::spread_tokens(context, valid);
    let start = |gpu: &mut CudaDecoder| -> Result<()> {
        gpu.reset()?;
        gpu.set_position(context)?;
        Ok(())
    };
    start(&mut gpu)?;
    let plain = plain_greedy(&mut gpu, 1, tokens)?;
    ctx.push(1);
    let wrong: Vec<u32> = plain.iter().map(|&t| (t + 1) % valid as u32).collect();
    let mut timings: Vec<(String, Vec<f64>, Vec<SpecRun>)> = drafts
        .iter()
        .map(|d| (d.to_string(), Vec::new(), Vec::new()))
        .collect();
    for _ in 0..rounds {
        for (name, rates, runs) in timings.iter_mut() {
            start(&mut gpu)?;
            let t0 = Instant::now();
            let (got, run) = if name == "none" {
                (plain_greedy(&mut gpu, 1, tokens)?, None)
            } else {
                let d = match name.as_str() {
                    "known" => Drafts::Known {
                        from: context + 1,
                        tokens: &plain,
                    },
                    "wrong" => Drafts::Known {
                        from: context + 1,
                        tokens: &wrong,
                    },
                    _ => Drafts::Lookup,
                };
                let mut got = Vec::new();
                let run = gpu.run_speculative(&ctx, tokens, d, &mut |t| {
                    got.push(t);
                    true
                })?;
                (got, Some(run))
            };
            let secs = t0.elapsed().as_secs_f64();
            if got != plain {
                info!("{name}: the tokens differ from plain steps' (a near-tie on the device; see osprey check)");
            }
            rates.push(got.len() as f64 / secs);
            runs.extend(run);
        }
    }
    let mut results = Vec::new();
    let base = median(&mut timings[0].1.clone());
    for (name, rates, runs) in &timings {
        let med = median(&mut rates.clone());
        let replays: usize = runs.iter().map(|r| r.replays).sum();
        let accepted: usize = runs.iter().map(|r| r.accepted).sum();
        let per_replay_us = (!runs.is_empty()).then(|| {
            // tokens per replay over the runs, and the median rate: the time a replay takes
            let tokens_per_replay = (replays + accepted) as f64 / replays as f64;
            1e6 * tokens_per_replay / med
        });
        info!(
            "speculative {name:>5} @ {context}: {med:>8.1} tok/s ({:.2}x the first), {}",
            med / base,
            match per_replay_us {
                Some(us) => format!(
                    "{replays} verify steps, {accepted} drafts kept ({:.0}%), {us:.0} us a verify step",
                    100.0 * accepted as f64 / replays.max(1) as f64
                ),
                None => format!("{:.0} us a token", 1e6 / med),
            }
        );
        results.push(json!({"drafts": name, "tokens_per_s": med, "rounds": rates, "verify_steps": replays, "accepted": accepted,
                            "us_per_verify_step": per_replay_us}));
    }
    let report = json!({
        "kind": "speculative", "backend": "cuda", "kv_cache": gpu.kv_cache().to_string(), "device": gpu.device_name(), "host": cpu_name(),
        "commit": git_commit(), "date": utc_now(), "command": command,
        "model": {"dir": m.dir.display().to_string(), "layers": c.num_layers(), "hidden_size": c.hidden_size},
        "context": context, "tokens": tokens,
        "method": format!("median of {rounds} rounds, drafters alternated in each; greedy generation of {tokens} tokens from position {context} (the step's work depends only on it), timed on the host from the call to the last token handed over"),
        "results": results,
    });
    let text = serde_json::to_string_pretty(&report)?;
    match out {
        Some(p) => std::fs::write(p, text + "\n")?,
        None => println!("{text}"),
    }
    Ok(())
}

/// Drafter names `bench speculative --backend cuda` takes.
pub fn check_drafts(drafts: &[&str]) -> Result<()> {
    if drafts.is_empty() {
        bail!("--drafts: no GPU drafter given (none, known, wrong, ngram)");
    }
    match drafts
        .iter()
        .find(|d| !matches!(**d, "none" | "known" | "wrong" | "ngram"))
    {
        Some(bad) => bail!("--drafts: \"{bad}\" is not a GPU drafter (none, known, wrong, ngram)"),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_drafters_are_named_and_some_are_given() {
        assert!(check_drafts(&["none", "known", "wrong", "ngram"]).is_ok());
        let err = check_drafts(&["none", "mtp"]).unwrap_err().to_string();
        assert!(err.contains("\"mtp\" is not a GPU drafter"), "{err}");
        assert!(check_drafts(&[]).is_err());
    }
}
