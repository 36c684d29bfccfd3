//! `osprey bench prefill|decode|speculative`: throughput per length (or per drafter), repeated
//! rounds, median and spread, written as JSON (kind, backend, device, commit, date, command,
//! results) for bench/results/.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Subcommand;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::json;
use tracing::info;

use crate::commands::GpuModel;
use crate::commands::{load_engine, sampling_params};
use crate::{ModelArgs, SamplingArgs};
use osprey_engine::sampler::{argmax, Sampler, SamplingParams};
use osprey_prompt::PromptFormat;

#[derive(Subcommand)]
pub enum BenchKind {
    /// Prompt processing: tokens/s of a fresh prefill of each length.
    Prefill {
        #[command(flatten)]
        model: ModelArgs,
        /// Prompt lengths (K = 1024).
        #[arg(long, default_value = "256,512,1K,2K,4K")]
        prompt: String,
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        /// Write the results here as JSON.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Generation: tokens/s of single-token steps after a context of each length.
    Decode {
        #[command(flatten)]
        model: ModelArgs,
        /// Context lengths (K = 1024).
        #[arg(long, default_value = "256,512,1K,2K,4K")]
        context: String,
        /// Decode steps timed per round.
        #[arg(long, default_value_t = 32)]
        steps: usize,
        /// Choose each token by sampling with the checkpoint's generation_config.json (e.g.
        /// temperature 1.0, top-k 20, top-p 0.95) instead of greedily.
        #[arg(long)]
        sample: bool,
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        #[arg(long)]
        out: Option<PathBuf>,
        /// CUDA: write the timeline of one step at the profiled context (4K, or the last) here as
        /// JSON: each launch's start, release and end from kernels built with
        /// tools/timeline_kernels.py and loaded through OSPREY_KERNELS_DIR.
        #[arg(long)]
        timeline: Option<PathBuf>,
    },
    /// Greedy generation verifying one drafted token a step (CPU): decode tokens/s per drafter
    /// against one-token steps, with the share of drafts accepted. `known` drafts the plain
    /// run's own tokens (every draft right: the two-row step's best case); `mtp` needs a
    /// checkpoint with the MTP head and is skipped without one.
    Speculative {
        #[command(flatten)]
        model: ModelArgs,
        /// Random prompt tokens before generation (--backend cuda: the context's length, the
        /// position generation starts at).
        #[arg(long, default_value_t = 64)]
        prompt_tokens: usize,
        /// Tokens generated per round.
        #[arg(long, default_value_t = 32)]
        tokens: usize,
        /// Drafters, from none, known, ngram, mtp; --backend cuda: none, known, wrong (every
        /// draft wrong: the verify step's cost), ngram (mtp is skipped there).
        #[arg(long, default_value = "none,known,ngram,mtp")]
        drafts: String,
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        #[arg(long)]
        out: Option<PathBuf>,
    },
}

/// "256,1K,4K" → [256, 1024, 4096].
pub fn parse_lengths(s: &str) -> Result<Vec<usize>> {
    s.split(',')
        .map(|p| {
            let p = p.trim();
            let (num, mult) = match p.strip_suffix(['K', 'k']) {
                Some(n) => (n, 1024),
                None => (p, 1),
            };
            let n: usize = num
                .parse()
                .with_context(|| format!("length \"{p}\" is not a number like 512 or 4K"))?;
            if n == 0 {
                bail!("length \"{p}\" must be positive");
            }
            Ok(n * mult)
        })
        .collect()
}

pub(crate) fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

pub fn cpu_name() -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let name = info
        .lines()
        .find_map(|l| {
            l.strip_prefix("model name")
                .and_then(|r| r.split(':').nth(1))
        })
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|| std::env::consts::ARCH.to_string());
    format!(
        "{name}, {} threads",
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    )
}

/// The commit this binary was built from (`+dirty` with uncommitted code changes), recorded at
/// build time: a binary carried to another machine reports its own code, not that tree's.
pub fn git_commit() -> String {
    env!("OSPREY_BUILD_COMMIT").to_string()
}

/// UTC now as ISO 8601.
pub fn utc_now() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    osprey_server::rfc3339(secs)
}

fn random_tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n).map(|_| rng.random_range(0..vocab as u32)).collect()
}

pub fn run(kind: BenchKind) -> Result<()> {
    let command = std::env::args().collect::<Vec<_>>().join(" ");
    // decode: Some((steps timed a round, sample, timeline))
    let (kind_name, model, lengths, rounds, out, decode) = match &kind {
        BenchKind::Prefill {
            model,
            prompt,
            rounds,
            out,
        } => ("prefill", model, parse_lengths(prompt)?, *rounds, out, None),
        BenchKind::Decode {
            model,
            context,
            rounds,
            out,
            steps,
            sample,
            timeline,
        } => (
            "decode",
            model,
            parse_lengths(context)?,
            *rounds,
            out,
            Some((*steps, *sample, timeline.as_deref())),
        ),
        BenchKind::Speculative {
            model,
            prompt_tokens,
            tokens,
            drafts,
            rounds,
            out,
        } => {
            let runs = SpeculativeBench {
                prompt_tokens: *prompt_tokens,
                tokens: *tokens,
                drafts,
                rounds: *rounds,
            };
            return speculative(model, &runs, &command, out.as_deref());
        }
    };
    if rounds == 0 {
        bail!("--rounds must be at least 1");
    }
    let sample = decode.is_some_and(|(_, sample, _)| sample);
    let timeline = decode.and_then(|(_, _, timeline)| timeline);
    if timeline.is_some() && model.backend != "cuda" {
        bail!("--timeline needs --backend cuda (it reads marks recorded by instrumented kernels)");
    }
    if model.backend == "cuda" {
        let dir = crate::commands::model_dir(model)?;
        let sampling = sample.then(|| checkpoint_sampling(&dir)).transpose()?;
        let gpu_model = GpuModel {
            dir: &dir,
            kv: model.kv_cache,
        };
        return match decode {
            Some((steps, _, _)) => cuda_decode(
                &gpu_model,
                &lengths,
                steps,
                rounds,
                sampling,
                out.as_deref(),
                timeline,
            ),
            None => cuda_prefill(
                &gpu_model,
                model.prefill_chunk,
                &lengths,
                rounds,
                out.as_deref(),
            ),
        };
    }
    let (engine, dir) = load_engine(model)?;
    let sampling = sample.then(|| checkpoint_sampling(&dir)).transpose()?;
    let c = engine.config().clone();
    // ids the real tokenizer can produce (the tail of the embedding is padding)
    let vocab = c.vocab_size.min(248_077);
    let mut results = Vec::new();
    for (li, &len) in lengths.iter().enumerate() {
        let mut per_round = Vec::new();
        match decode {
            None => {
                let tokens = random_tokens(len, vocab, li as u64);
                if li == 0 {
                    engine.prefill(&mut engine.new_session(), &tokens[..len.min(64)])?;
                    // warm-up
                }
                for _ in 0..rounds {
                    let mut s = engine.new_session();
                    let (_, t) = engine.prefill(&mut s, &tokens)?;
                    per_round.push(t.tokens_per_s());
                }
            }
            Some((steps, _, _)) => {
                let tokens = random_tokens(len, vocab, li as u64);
                let mut s = engine.new_session();
                let (first, _) = engine.prefill(&mut s, &tokens)?;
                let snapshot = s.snapshot();
                engine.decode(&mut s, argmax(&first) as u32)?; // warm-up
                let mut sampler = sampling.clone().map(|p| Sampler::new(p, vocab, &tokens));
                let mut choose = |logits: &[f32]| match sampler.as_mut() {
                    Some(sm) => {
                        let t = sm.sample(logits);
                        sm.observe(t);
                        t
                    }
                    None => argmax(logits) as u32,
                };
                for _ in 0..rounds {
                    s.restore(&snapshot);
                    // the first step after a restore is untimed: a backend that keeps the state on
                    // a device rebuilds it there from the session's tokens
                    let mut next = choose(&engine.decode(&mut s, argmax(&first) as u32)?);
                    let start = Instant::now();
                    for _ in 0..steps {
                        next = choose(&engine.decode(&mut s, next)?);
                    }
                    per_round.push(steps as f64 / start.elapsed().as_secs_f64());
                }
            }
        }
        let (lo, hi) = per_round
            .iter()
            .fold((f64::MAX, 0.0f64), |(a, b), &x| (a.min(x), b.max(x)));
        let med = median(&mut per_round.clone());
        info!("{kind_name} {len:>6} tokens: {med:>9.1} tok/s (min {lo:.1}, max {hi:.1}, {rounds} rounds)");
        results.push(
            json!({"tokens": len, "tokens_per_s": med, "min": lo, "max": hi, "rounds": per_round}),
        );
    }
    let device = engine.backend.device_name().unwrap_or_else(cpu_name);
    let report = with_provenance(
        kind_name,
        engine.backend.name(),
        &device,
        &command,
        json!({
            "model": {
                "dir": dir.display().to_string(),
                "layers": c.num_layers(),
                "hidden_size": c.hidden_size,
                "num_experts": c.num_experts,
                "experts_per_token": c.num_experts_per_tok,
                "vocab_size": c.vocab_size,
            },
            "prefill_chunk": engine.prefill_chunk,
            "sampling": sampling.as_ref().map(sampling_json),
            "results": results,
        }),
    );
    write_report(&report, out.as_deref())
}

/// A report's fields after where it was measured: kind, backend, device, host, commit, date and
/// command.
fn with_provenance(
    kind: &str,
    backend: &str,
    device: &str,
    command: &str,
    fields: serde_json::Value,
) -> serde_json::Value {
    let mut report = json!({
        "kind": kind,
        "backend": backend,
        "device": device,
        "host": cpu_name(),
        "commit": git_commit(),
        "date": utc_now(),
        "command": command,
    });
    if let (Some(head), serde_json::Value::Object(rest)) = (report.as_object_mut(), fields) {
        head.extend(rest);
    }
    report
}

/// The report as JSON into `out`, or on stdout.
fn write_report(report: &serde_json::Value, out: Option<&std::path::Path>) -> Result<()> {
    let text = serde_json::to_string_pretty(report)?;
    match out {
        Some(path) => {
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent)?;
            }
            std::fs::write(path, text + "\n")
                .with_context(|| format!("cannot write {}", path.display()))?;
            info!("wrote {}", path.display());
        }
        None => println!("{text}"),
    }
    Ok(())
}

/// `bench speculative`'s settings.
struct SpeculativeBench<'a> {
    prompt_tokens: usize,
    tokens: usize,
    drafts: &'a str,
    rounds: usize,
}

/// Greedy generation on the CPU with each drafter: decode tokens/s (from the first token to the
/// last, the prompt's prefill left out), steps, drafts accepted; every run's tokens checked
/// against the one-token run's.
fn speculative(
    model: &ModelArgs,
    b: &SpeculativeBench,
    command: &str,
    out: Option<&std::path::Path>,
) -> Result<()> {
    use osprey_engine::speculative::{self as spec, Drafter};
    if b.rounds == 0 || b.tokens < 2 || b.prompt_tokens == 0 {
        bail!("bench speculative needs --rounds >= 1, --tokens >= 2 and --prompt-tokens >= 1");
    }
    let drafts: Vec<&str> = b.drafts.split(',').map(str::trim).collect();
    match model.backend.as_str() {
        "cpu" => {}
        "cuda" => return cuda_speculative(model, b, &drafts, command, out),
        other => bail!("bench speculative runs on --backend cpu or cuda, not {other}"),
    }
    if let Some(bad) = drafts
        .iter()
        .find(|d| !matches!(**d, "none" | "known" | "ngram" | "mtp"))
    {
        bail!("--drafts: unknown drafter \"{bad}\" (expected none, known, ngram, mtp)");
    }
    let dir = crate::commands::model_dir(model)?;
    let cpu = crate::commands::cpu_model(&dir, model.kv_cache)?;
    let c = cpu.config().clone();
    let vocab = c.vocab_size.min(248_077);
    let prompt = random_tokens(b.prompt_tokens, vocab, 7);
    let timed = |drafter: &mut dyn Drafter| -> Result<(spec::SpeculativeRun, f64)> {
        let mut first_at = None;
        let run = spec::speculative_greedy(&cpu, drafter, &prompt, b.tokens, vocab, &mut |_| {
            first_at.get_or_insert_with(Instant::now);
            true
        })?;
        let since_first = first_at.map_or(0.0, |t| t.elapsed().as_secs_f64());
        let rate = (run.tokens.len() - 1) as f64 / since_first;
        Ok((run, rate))
    };
    let (reference, _) = timed(&mut spec::NoDraft)?;
    let drafts: Vec<&str> = drafts
        .into_iter()
        .filter(|&name| {
            let skip = name == "mtp" && cpu.weights.mtp.is_none();
            if skip {
                info!("speculative mtp: skipped (the checkpoint has no MTP head)");
            }
            !skip
        })
        .collect();
    // rounds alternate the drafters, so that drift in the machine's speed falls on all alike
    let mut per_round = vec![Vec::new(); drafts.len()];
    let mut last = Vec::new();
    for _ in 0..b.rounds {
        last.clear();
        for (i, &name) in drafts.iter().enumerate() {
            let mut drafter: Box<dyn Drafter> = match name {
                "none" => Box::new(spec::NoDraft),
                "known" => Box::new(spec::KnownAnswer::new(
                    reference.tokens.clone(),
                    prompt.len(),
                )),
                "ngram" => Box::new(spec::NgramDrafter::new(prompt[0], 3)),
                _ => Box::new(spec::MtpDrafter::new(&cpu, vocab)),
            };
            let (run, tps) = timed(drafter.as_mut())?;
            if run.tokens != reference.tokens {
                bail!("speculative {name}: the tokens differ from one-token steps'");
            }
            per_round[i].push(tps);
            last.push(run);
        }
    }
    let mut results = Vec::new();
    let mut baseline = None;
    for ((name, rounds), run) in drafts.iter().zip(&per_round).zip(&last) {
        let med = median(&mut rounds.clone());
        let base = *baseline.get_or_insert(med);
        info!(
            "speculative {name:>5}: {med:>8.2} tok/s ({:.2}x the first drafter), {} two-row steps, {} drafts accepted ({:.0}%)",
            med / base,
            run.steps,
            run.accepted,
            100.0 * run.acceptance()
        );
        results.push(json!({
            "drafts": name,
            "tokens_per_s": med,
            "rounds": rounds,
            "two_row_steps": run.steps,
            "accepted": run.accepted,
            "acceptance": run.acceptance(),
            "tokens": run.tokens.len(),
        }));
    }
    let report = with_provenance(
        "speculative",
        "cpu",
        &cpu_name(),
        command,
        json!({
            "model": {
                "dir": dir.display().to_string(),
                "layers": c.num_layers(),
                "hidden_size": c.hidden_size,
                "mtp_head": cpu.weights.mtp.is_some(),
            },
            "prompt_tokens": b.prompt_tokens,
            "method": "greedy generation after a random prompt; tokens/s from the first generated token to the last (prefill left out), median of rounds; every drafter's tokens equal the one-token run's",
            "results": results,
        }),
    );
    write_report(&report, out)
}

/// The sampling settings of the checkpoint's generation_config.json (bench decode --sample).
fn checkpoint_sampling(dir: &std::path::Path) -> Result<SamplingParams> {
    let p = sampling_params(&SamplingArgs::default(), &PromptFormat::from_dir(dir)?);
    info!(
        "sampling: temperature {}, top-k {}, top-p {}, min-p {}",
        p.temperature, p.top_k, p.top_p, p.min_p
    );
    Ok(p)
}

/// How a decode benchmark chose its tokens, for the JSON report.
pub fn sampling_json(p: &SamplingParams) -> serde_json::Value {
    json!({"temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p, "min_p": p.min_p,
           "repetition_penalty": p.repetition_penalty, "seed": p.seed})
}

fn cuda_decode(
    m: &GpuModel,
    contexts: &[usize],
    steps: usize,
    rounds: usize,
    sampling: Option<SamplingParams>,
    out: Option<&std::path::Path>,
    timeline: Option<&std::path::Path>,
) -> Result<()> {
    #[cfg(feature = "cuda")]
    {
        crate::gpu::bench_decode(m, contexts, steps, rounds, sampling, out, timeline)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (
            m.dir, m.kv, contexts, steps, rounds, sampling, out, timeline,
        );
        bail!("this build has no CUDA backend (rebuild with --features cuda)")
    }
}

/// `bench speculative --backend cuda` (gpu_speculative.rs): the prompt is a context of
/// `prompt_tokens` positions.
fn cuda_speculative(
    model: &ModelArgs,
    b: &SpeculativeBench,
    drafts: &[&str],
    command: &str,
    out: Option<&std::path::Path>,
) -> Result<()> {
    #[cfg(feature = "cuda")]
    {
        let drafts: Vec<&str> = drafts.iter().copied().filter(|d| *d != "mtp").collect();
        crate::gpu_speculative::check_drafts(&drafts)?;
        let dir = crate::commands::model_dir(model)?;
        let m = GpuModel {
            dir: &dir,
            kv: model.kv_cache,
        };
        crate::gpu_speculative::bench(
            &m,
            b.prompt_tokens,
            b.tokens,
            &drafts,
            b.rounds,
            command,
            out,
        )
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (model, b, drafts, command, out);
        bail!("this build has no CUDA backend (rebuild with --features cuda)")
    }
}

fn cuda_prefill(
    m: &GpuModel,
    prefill_chunk: Option<usize>,
    lengths: &[usize],
    rounds: usize,
    out: Option<&std::path::Path>,
) -> Result<()> {
    #[cfg(feature = "cuda")]
    {
        let chunk = prefill_chunk.unwrap_or(osprey_cuda::DEFAULT_CUDA_PREFILL_CHUNK);
        crate::gpu::bench_prefill(m, lengths, rounds, chunk, out)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (m.dir, m.kv, prefill_chunk, lengths, rounds, out);
        bail!("this build has no CUDA backend (rebuild with --features cuda)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lengths_parse_with_k_suffix() {
        assert_eq!(parse_lengths("256, 1K,4k").unwrap(), vec![256, 1024, 4096]);
        assert!(parse_lengths("12x").is_err());
        assert!(parse_lengths("0").is_err());
    }

    #[test]
    fn date_is_iso() {
        let d = utc_now();
        assert_eq!(d.len(), 20);
        assert!(d.starts_with("20") && d.ends_with('Z'));
    }
}
