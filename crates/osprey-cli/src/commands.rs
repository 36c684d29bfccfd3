//! The subcommands other than `bench`.

use std::io::Write;
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use osprey_engine::generate::{
    generate as run_generation, GenerateOptions, ReasoningBudget, TokenText,
};
use osprey_engine::sampler::SamplingParams;
use osprey_engine::{speculative, Engine};
use osprey_model::checkpoint::Checkpoint;
use osprey_model::convert::{quantize_checkpoint, QuantizeOptions};
use osprey_model::synth::{write_checkpoint, Preset, SynthOptions};
use osprey_model::{ModelConfig, ModelWeights};
use osprey_prompt::{ChatOptions, IncrementalDecoder, PromptFormat};
use osprey_server::parse::{CLOSE_REASONING, THINK_CLOSE, THINK_OPEN};
use tracing::info;

use crate::{GenerateArgs, ModelArgs, SamplingArgs, ServeArgs};

pub fn synth(preset: &str, layers: Option<usize>, seed: u64, mtp: bool, out: &Path) -> Result<()> {
    let preset: Preset = preset.parse()?;
    let started = std::time::Instant::now();
    let bytes = write_checkpoint(
        out,
        &SynthOptions {
            preset,
            layers,
            seed,
            show_progress: true,
            mtp,
        },
    )?;
    info!(
        "wrote {:.2} GB to {} in {:.1} s",
        bytes as f64 / 1e9,
        out.display(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

pub fn quantize(
    src: &Path,
    out: &Path,
    bits: u32,
    group_size: usize,
    keep_mtp: bool,
) -> Result<()> {
    let started = std::time::Instant::now();
    let report = quantize_checkpoint(
        src,
        out,
        &QuantizeOptions {
            bits,
            group_size,
            show_progress: true,
            keep_mtp,
        },
    )?;
    info!(
        "quantised {:.2} GB to {:.2} GB ({} tensors, {bits}-bit groups of {group_size}) in {} in {:.1} s",
        report.source_bytes as f64 / 1e9,
        report.bytes as f64 / 1e9,
        report.tensors,
        out.display(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Bumped whenever the tiny preset's shape or distributions change, so a stale cached copy is not used.
const TINY_PRESET_REVISION: &str = "r2";

/// The directory of the built-in default model: a tiny synthetic checkpoint made on first use.
fn default_model_dir() -> Result<PathBuf> {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    let dir = base
        .join("osprey")
        .join(format!("synthetic-tiny-{TINY_PRESET_REVISION}"));
    if !dir.join("config.json").exists() {
        info!("no --model given: writing a tiny synthetic checkpoint to {} (random weights, real tokenizer)", dir.display());
        let tmp = dir.with_extension("partial");
        let _ = std::fs::remove_dir_all(&tmp);
        write_checkpoint(
            &tmp,
            &SynthOptions {
                preset: Preset::Tiny,
                layers: None,
                seed: 0,
                show_progress: false,
                mtp: false,
            },
        )?;
        std::fs::rename(&tmp, &dir)
            .with_context(|| format!("cannot move the synthetic model to {}", dir.display()))?;
    } else {
        info!(
            "no --model given: using the tiny synthetic checkpoint at {}",
            dir.display()
        );
    }
    Ok(dir)
}

pub fn model_dir(args: &ModelArgs) -> Result<PathBuf> {
    match &args.model {
        Some(d) => Ok(d.clone()),
        None => default_model_dir(),
    }
}

/// The checkpoint a GPU command (check, bench) loads and how the GPU keeps its K/V.
pub struct GpuModel<'a> {
    pub dir: &'a Path,
    pub kv: osprey_engine::KvCache,
}

/// Default prefill chunk of the CUDA backend (only reached when it loaded).
fn osprey_cuda_chunk() -> usize {
    #[cfg(feature = "cuda")]
    return osprey_cuda::DEFAULT_CUDA_PREFILL_CHUNK;
    #[cfg(not(feature = "cuda"))]
    osprey_engine::DEFAULT_PREFILL_CHUNK
}

/// The CUDA backend for these weights, or why it cannot be had.
#[cfg(feature = "cuda")]
fn cuda_backend(
    weights: &ModelWeights,
    args: &ModelArgs,
) -> Result<Box<dyn osprey_engine::Backend>> {
    let max_context = args
        .max_context
        .unwrap_or(weights.config.max_position_embeddings);
    let valid = weights.config.vocab_size.min(248_077);
    let chunk = args
        .prefill_chunk
        .unwrap_or(osprey_cuda::DEFAULT_CUDA_PREFILL_CHUNK);
    let b = osprey_cuda::CudaBackend::new(
        weights,
        max_context,
        valid,
        chunk,
        args.kv_cache,
        args.gpu_cache_mib << 20,
    )?;
    let mem: Vec<String> = b
        .memory_report()
        .iter()
        .map(|(k, v)| format!("{k} {:.2} GiB", *v as f64 / (1u64 << 30) as f64))
        .collect();
    info!("GPU {}: {}", b.device_name(), mem.join(", "));
    Ok(Box::new(b))
}

#[cfg(not(feature = "cuda"))]
fn cuda_backend(
    _weights: &ModelWeights,
    _args: &ModelArgs,
) -> Result<Box<dyn osprey_engine::Backend>> {
    bail!("this build has no CUDA backend (rebuild with --features cuda)")
}

/// Loads the model on the requested backend; `auto` takes the GPU when there is one.
pub fn load_engine(args: &ModelArgs) -> Result<(Engine, PathBuf)> {
    let dir = model_dir(args)?;
    if args.prefill_chunk == Some(0) {
        bail!("--prefill-chunk must be at least 1");
    }
    let started = std::time::Instant::now();
    if !matches!(args.backend.as_str(), "cpu" | "cuda" | "auto") {
        bail!("--backend {}: expected cpu, cuda or auto", args.backend);
    }
    let weights = ModelWeights::load(&dir)?;
    let backend: Box<dyn osprey_engine::Backend> = match args.backend.as_str() {
        "cpu" => Box::new(osprey_engine::CpuBackend::new(weights).with_kv_cache(args.kv_cache)),
        "cuda" => cuda_backend(&weights, args).context("--backend cuda")?,
        _ => match cuda_backend(&weights, args) {
            Ok(b) => b,
            Err(e) => {
                info!("backend auto: CUDA unavailable ({e:#}); running on the CPU");
                Box::new(osprey_engine::CpuBackend::new(weights).with_kv_cache(args.kv_cache))
            }
        },
    };
    let mut engine = Engine::new(backend);
    engine.prefill_chunk = args.prefill_chunk.unwrap_or(match engine.backend.name() {
        "cuda" => osprey_cuda_chunk(),
        _ => osprey_engine::DEFAULT_PREFILL_CHUNK,
    });
    info!(
        "loaded {} on {} in {:.2} s",
        dir.display(),
        engine.backend.name(),
        started.elapsed().as_secs_f64()
    );
    Ok((engine, dir))
}

/// Sampling parameters: flags first, then generation_config.json, then greedy-safe defaults.
pub fn sampling_params(a: &SamplingArgs, f: &PromptFormat) -> SamplingParams {
    let d = &f.defaults;
    SamplingParams {
        temperature: a.temperature.or(d.temperature).unwrap_or(0.0),
        top_k: a.top_k.or(d.top_k).unwrap_or(0),
        top_p: a.top_p.or(d.top_p).unwrap_or(1.0),
        min_p: a.min_p.or(d.min_p).unwrap_or(0.0),
        presence_penalty: a.presence_penalty.unwrap_or(0.0),
        frequency_penalty: a.frequency_penalty.unwrap_or(0.0),
        repetition_penalty: a.repetition_penalty.or(d.repetition_penalty).unwrap_or(1.0),
        seed: a.seed,
    }
}

pub struct Detok<'a>(pub IncrementalDecoder<'a>);

impl TokenText for Detok<'_> {
    fn push(&mut self, token: u32) -> String {
        self.0.push(token)
    }
    fn flush(&mut self) -> String {
        self.0.flush()
    }
}

/// A thinking budget of `tokens` for the engine: the tokenizer's `<think>` and `</think>` (one
/// token each) and the closing the server puts in.
pub fn reasoning_budget(format: &PromptFormat, tokens: usize) -> Result<ReasoningBudget> {
    let single = |tag: &str| -> Result<u32> {
        match format.encode(tag)?.as_slice() {
            [id] => Ok(*id),
            ids => bail!(
                "a thinking budget needs {tag} to be one token; this tokenizer makes it {}",
                ids.len()
            ),
        }
    };
    Ok(ReasoningBudget {
        tokens,
        open_id: single(THINK_OPEN)?,
        close_id: single(THINK_CLOSE)?,
        close: format.encode(CLOSE_REASONING)?,
    })
}

/// A conversation's opening: the system message, if any.
pub fn opening(system: Option<&str>) -> Vec<serde_json::Value> {
    system
        .map(|s| serde_json::json!({"role": "system", "content": s}))
        .into_iter()
        .collect()
}

pub fn generate(args: &ModelArgs, g: &GenerateArgs, sampling: &SamplingArgs) -> Result<()> {
    if g.speculative.is_some() {
        return generate_speculative(args, g, sampling);
    }
    let (engine, dir) = load_engine(args)?;
    let format = PromptFormat::from_dir(&dir)?;
    let (prompt, chat) = (g.prompt.as_str(), g.chat);
    let ids = prompt_ids(&format, g)?;
    let opts = GenerateOptions {
        max_tokens: g.max_tokens,
        stop_ids: format.stop_ids.clone(),
        stop_strings: g.stop.clone(),
        sampling: sampling_params(sampling, &format),
        valid_vocab: format.vocab_size.min(engine.config().vocab_size),
        reasoning_budget: g
            .thinking_budget
            .map(|n| reasoning_budget(&format, n))
            .transpose()?,
    };
    let mut session = engine.new_session();
    let mut detok = Detok(format.incremental());
    let mut out = std::io::stdout().lock();
    if !chat {
        write!(out, "{prompt}")?;
    }
    let g = run_generation(
        &engine,
        &mut session,
        &ids,
        &opts,
        &mut detok,
        &mut |piece| {
            let _ = write!(out, "{piece}");
            let _ = out.flush();
            ControlFlow::Continue(())
        },
    )?;
    writeln!(out)?;
    eprintln!(
        "prompt: {} tokens, {:.1} tok/s | decode: {} tokens, {:.1} tok/s | finish: {:?}",
        g.prompt.tokens,
        g.prompt.tokens_per_s(),
        g.tokens.len(),
        g.decode.tokens_per_s(),
        g.finish
    );
    Ok(())
}

/// The CPU model itself (not behind the engine) with its KV cache in the form `kv`: for what
/// runs the forward pass directly (speculative decoding).
pub fn cpu_model(
    dir: &Path,
    kv: osprey_engine::KvCache,
) -> Result<osprey_engine::cpu::forward::CpuModel> {
    let mut model = osprey_engine::cpu::forward::CpuModel::new(ModelWeights::load(dir)?);
    model.kv_cache = kv;
    Ok(model)
}

/// The prompt's tokens: the text as it is, or wrapped as a user message by the chat template.
fn prompt_ids(format: &PromptFormat, g: &GenerateArgs) -> Result<Vec<u32>> {
    let ids = if g.chat {
        let mut kwargs = serde_json::Map::new();
        if g.no_think {
            kwargs.insert("enable_thinking".into(), false.into());
        }
        let mut messages = opening(g.system.as_deref());
        messages.push(serde_json::json!({"role": "user", "content": g.prompt}));
        let messages = serde_json::Value::Array(messages);
        format.encode_chat(
            &messages,
            &ChatOptions {
                add_generation_prompt: true,
                tools: None,
                kwargs,
                ..Default::default()
            },
        )?
    } else {
        format.encode(&g.prompt)?
    };
    if ids.is_empty() {
        bail!("the prompt encodes to no tokens");
    }
    Ok(ids)
}

/// `osprey generate --speculative mtp|ngram`: greedy tokens verified two at a time on the CPU,
/// with drafts from the checkpoint's MTP head or by prompt lookup.
fn generate_speculative(args: &ModelArgs, g: &GenerateArgs, sampling: &SamplingArgs) -> Result<()> {
    if args.backend == "cuda" {
        bail!("--speculative runs on the CPU backend so far (--backend cpu or auto): the GPU's decode step takes one token");
    }
    let unsupported = [
        (!g.stop.is_empty(), "--stop"),
        (g.thinking_budget.is_some(), "--thinking-budget"),
    ];
    if let Some((_, flag)) = unsupported.iter().find(|(set, _)| *set) {
        bail!("--speculative does not take {flag} yet");
    }
    let dir = model_dir(args)?;
    let format = PromptFormat::from_dir(&dir)?;
    let params = sampling_params(sampling, &format);
    if params.temperature != 0.0 {
        bail!("--speculative verifies greedy choices only: pass --temperature 0 (this checkpoint's default is {})", params.temperature);
    }
    if params.presence_penalty != 0.0
        || params.frequency_penalty != 0.0
        || params.repetition_penalty != 1.0
    {
        bail!("--speculative does not apply penalties");
    }
    let started = std::time::Instant::now();
    let model = cpu_model(&dir, args.kv_cache)?;
    let by_mtp = g.speculative.as_deref() == Some("mtp");
    if by_mtp {
        speculative::require_mtp(&model)?;
    }
    info!(
        "loaded {} on cpu in {:.2} s",
        dir.display(),
        started.elapsed().as_secs_f64()
    );
    let ids = prompt_ids(&format, g)?;
    let valid = format.vocab_size.min(model.config().vocab_size);
    let mut detok = format.incremental();
    let mut out = std::io::stdout().lock();
    if !g.chat {
        write!(out, "{}", g.prompt)?;
    }
    let started = std::time::Instant::now();
    let mut on_token = |t| {
        let _ = write!(out, "{}", detok.push(t));
        let _ = out.flush();
        !format.stop_ids.contains(&t)
    };
    let run = if by_mtp {
        speculative::mtp_greedy(&model, &ids, g.max_tokens, valid, &mut on_token)?
    } else {
        let mut drafter = speculative::NgramDrafter::new(ids[0], 3);
        speculative::speculative_greedy(
            &model,
            &mut drafter,
            &ids,
            g.max_tokens,
            valid,
            &mut on_token,
        )?
    };
    let seconds = started.elapsed().as_secs_f64();
    writeln!(out, "{}", detok.flush())?;
    eprintln!(
        "prompt: {} tokens | {} tokens in {:.2} s ({:.1} tok/s, prompt included) | {} steps of two rows, {} drafts accepted ({:.0}%)",
        ids.len(),
        run.tokens.len(),
        seconds,
        run.tokens.len() as f64 / seconds,
        run.steps,
        run.accepted,
        100.0 * run.acceptance()
    );
    Ok(())
}

fn gib(b: usize) -> String {
    format!("{:.3} GiB", b as f64 / (1u64 << 30) as f64)
}

pub fn inspect(args: &ModelArgs, list_tensors: bool) -> Result<()> {
    let dir = model_dir(args)?;
    let config = ModelConfig::from_dir(&dir)?;
    let ck = Checkpoint::open(&dir)?;
    let c = &config;
    println!(
        "model: {} ({:?}, model_type {})",
        dir.display(),
        c.family,
        c.model_type
    );
    println!(
        "layers: {} ({} Gated DeltaNet, {} attention), hidden {}, vocab {}",
        c.num_layers(),
        c.gdn_layers(),
        c.attention_layers(),
        c.hidden_size,
        c.vocab_size
    );
    println!(
        "attention: {} q heads / {} kv heads x {}, rotary {} dims, theta {}",
        c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rotary_dim, c.rope_theta
    );
    println!(
        "deltanet: {} k heads / {} v heads x {}/{}, conv {}",
        c.linear_num_key_heads,
        c.linear_num_value_heads,
        c.linear_key_head_dim,
        c.linear_value_head_dim,
        c.conv_kernel
    );
    println!(
        "moe: {} experts, top {}, intermediate {}, shared {}",
        c.num_experts,
        c.num_experts_per_tok,
        c.moe_intermediate_size,
        c.shared_expert_intermediate_size
    );
    match &c.quantization {
        Some(q) => println!(
            "quantisation: {}-bit affine, group {}, {} module overrides",
            q.bits,
            q.group_size,
            q.overrides.len()
        ),
        None => println!("quantisation: none (dense floats)"),
    }
    println!(
        "files: {} safetensors, {} tensors, {}",
        ck.files.len(),
        ck.tensors.len(),
        gib(ck.total_bytes())
    );
    if list_tensors {
        for (name, t) in &ck.tensors {
            println!("  {name:<70} {:?} {:?}", t.dtype, t.shape);
        }
    }
    let w = ModelWeights::from_checkpoint(config, &ck)?;
    println!(
        "layout: {:?} (validated: every tensor present with the expected dtype and shape)",
        w.layout
    );
    println!("memory footprint:");
    let mut total = 0;
    for (part, bytes) in w.footprint() {
        println!("  {part:<34} {}", gib(bytes));
        total += bytes;
    }
    println!("  {:<34} {}", "total weights", gib(total));
    let kv = w.config.kv_bytes_per_token();
    println!(
        "per session: KV cache {} KiB/token (bf16 on GPU, f32 on CPU: twice that; --kv-cache int8 on GPU: about half)",
        kv / 1024
    );
    let state = osprey_engine::SessionState::new(&w.config);
    println!(
        "per session: recurrent + conv state {} (f32)",
        gib(state.bytes())
    );
    Ok(())
}

/// A JSON array of token ids from a file.
fn read_token_file(tokens: &Path) -> Result<Vec<u32>> {
    let text = std::fs::read_to_string(tokens)
        .with_context(|| format!("cannot read {}", tokens.display()))?;
    let ids: Vec<u32> = serde_json::from_str(&text).with_context(|| {
        format!(
            "{} must hold a JSON array of token ids (non-negative integers)",
            tokens.display()
        )
    })?;
    if ids.is_empty() {
        bail!("{} holds no tokens", tokens.display());
    }
    Ok(ids)
}

pub fn score(args: &ModelArgs, tokens: &Path, out: &Path) -> Result<()> {
    let ids = read_token_file(tokens)?;
    let (engine, _) = load_engine(args)?;
    let vocab = engine.config().vocab_size;
    let started = std::time::Instant::now();
    let logits = engine.score(&ids)?;
    let bytes: Vec<u8> = logits.iter().flat_map(|x| x.to_le_bytes()).collect();
    let view = safetensors::tensor::TensorView::new(
        safetensors::Dtype::F32,
        vec![ids.len(), vocab],
        &bytes,
    )
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    safetensors::serialize_to_file([("logits", view)], None, out)
        .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", out.display()))?;
    info!(
        "scored {} tokens in {:.2} s -> {}",
        ids.len(),
        started.elapsed().as_secs_f64(),
        out.display()
    );
    Ok(())
}

pub fn numerics(args: &ModelArgs, n: usize, out: Option<&Path>) -> Result<()> {
    if n == 0 {
        bail!("--tokens must be at least 1");
    }
    let dir = model_dir(args)?;
    let mut model = osprey_engine::cpu::forward::CpuModel::new(ModelWeights::load(&dir)?);
    let vocab = model.config().vocab_size.min(248_077) as u32;
    let tokens: Vec<u32> = (0..n as u32)
        .map(|i| i.wrapping_mul(2_654_435_761) % vocab)
        .collect();
    let d = osprey_engine::cpu::numerics::bf16_divergence(&mut model, &tokens)?;
    println!("bf16 vs f32 over {n} tokens of {}:", dir.display());
    println!(
        "  {:<10} {:>14} {:>14}",
        "after", "rel. diff", "residual rms"
    );
    for (i, (rel, rms)) in d.per_layer.iter().zip(&d.residual_rms).enumerate() {
        let at = if i == 0 {
            "embedding".to_string()
        } else {
            format!("layer {}", i - 1)
        };
        println!("  {at:<10} {rel:>14.5} {rms:>14.3}");
    }
    println!(
        "  logits: relative RMS difference {:.5}, std {:.3}, top-1 agreement {:.1}%",
        d.logits_relative_rms,
        d.logits_std,
        100.0 * d.top1_agreement
    );
    let worst = d
        .per_position
        .iter()
        .enumerate()
        .fold((0, 0.0f32), |w, (i, &r)| if r > w.1 { (i, r) } else { w });
    println!(
        "  per position: worst {:.5} at position {}",
        worst.1, worst.0
    );
    if let Some(path) = out {
        let report = serde_json::json!({
            "kind": "numerics",
            "backend": "cpu",
            "device": crate::bench::cpu_name(),
            "commit": crate::bench::git_commit(),
            "date": crate::bench::utc_now(),
            "command": std::env::args().collect::<Vec<_>>().join(" "),
            "model": dir.display().to_string(),
            "layers": model.config().num_layers(),
            "tokens": n,
            "divergence": d,
        });
        std::fs::write(path, serde_json::to_string_pretty(&report)? + "\n")?;
    }
    Ok(())
}

pub fn serve(args: &ModelArgs, s: &ServeArgs) -> Result<()> {
    let addr: std::net::SocketAddr = format!("{}:{}", s.host, s.port)
        .parse()
        .with_context(|| format!("--host {} --port {} is not a valid address", s.host, s.port))?;
    let (engine, dir) = load_engine(args)?;
    let format = PromptFormat::from_dir(&dir)?;
    let mut names = s.served_model_name.clone();
    if names.is_empty() {
        names.push(
            dir.file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| "osprey".into()),
        );
    }
    let name = names.remove(0);
    let max_context = args
        .max_context
        .unwrap_or(engine.config().max_position_embeddings);
    if max_context < 2 {
        bail!("--max-context must be at least 2");
    }
    let cfg = osprey_server::ServerConfig {
        model_name: name.clone(),
        model_aliases: names,
        api_key: s.api_key.clone(),
        max_context,
        max_queue: s.max_queue,
        request_timeout: std::time::Duration::from_secs(s.request_timeout.max(1)),
        cache_entries: s.cache_entries,
        cache_bytes: s.cache_mib << 20,
        max_body_bytes: s.max_body_mib.max(1) << 20,
        default_max_tokens: s.default_max_tokens.max(1),
    };
    info!("serving \"{name}\" (context {max_context} tokens)");
    let router = osprey_server::app(engine, format, cfg)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(osprey_server::serve(router, addr))
}

pub fn check(
    args: &ModelArgs,
    prompt_tokens: usize,
    steps: usize,
    prefill_tokens: usize,
    long_context: usize,
    out: Option<&Path>,
) -> Result<()> {
    if args.backend != "cuda" {
        bail!("osprey check compares a GPU backend with the CPU reference: pass --backend cuda");
    }
    if steps == 0 || prompt_tokens == 0 || prefill_tokens < 16 {
        bail!("--steps and --prompt-tokens must be at least 1, --prefill-tokens at least 16");
    }
    let chunk = args.prefill_chunk.unwrap_or(128);
    let dir = model_dir(args)?;
    #[cfg(feature = "cuda")]
    {
        let m = GpuModel {
            dir: &dir,
            kv: args.kv_cache,
        };
        crate::gpu::check(
            &m,
            prompt_tokens,
            steps,
            prefill_tokens,
            chunk,
            long_context,
            out,
        )
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (dir, out, chunk, long_context);
        bail!("this build has no CUDA backend (rebuild with --features cuda)")
    }
}

/// `limits`: the largest |perplexity difference| in percent and the smallest top-1 agreement
/// accepted (none: report only).
pub fn eval(
    args: &ModelArgs,
    tokens: &Path,
    reference: &Path,
    tensor: &str,
    limits: (Option<f64>, Option<f64>),
    out: Option<&Path>,
) -> Result<()> {
    let ids = read_token_file(tokens)?;
    let bytes =
        std::fs::read(reference).with_context(|| format!("cannot read {}", reference.display()))?;
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| {
        anyhow::anyhow!(
            "{} is not a valid safetensors file: {e}",
            reference.display()
        )
    })?;
    let t = st
        .tensor(tensor)
        .map_err(|_| anyhow::anyhow!("{} has no tensor \"{tensor}\"", reference.display()))?;
    if t.dtype() != safetensors::Dtype::F32 || t.shape().len() != 2 || t.shape()[0] != ids.len() {
        bail!(
            "reference tensor \"{tensor}\" must be f32 [{}, vocab], found {:?} {:?}",
            ids.len(),
            t.dtype(),
            t.shape()
        );
    }
    let reference_logits: Vec<f32> = t
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let (engine, dir) = load_engine(args)?;
    let vocab = engine.config().vocab_size;
    if t.shape()[1] != vocab {
        bail!(
            "reference has {} logits per position, the model {vocab}",
            t.shape()[1]
        );
    }
    let logits = engine.score(&ids)?;
    let f = osprey_engine::fidelity::compare(
        &ids,
        &logits,
        &reference_logits,
        vocab,
        vocab.min(248_077),
    )?;
    println!(
        "{} positions: perplexity {:.4} vs reference {:.4} ({:+.3}%), top-1 agreement {:.2}%, logit error max {:.3e} mean {:.3e}",
        f.positions,
        f.perplexity,
        f.reference_perplexity,
        f.perplexity_difference_percent,
        100.0 * f.top1_agreement,
        f.max_abs_logit_error,
        f.mean_abs_logit_error
    );
    if let Some(path) = out {
        let report = serde_json::json!({
            "kind": "fidelity",
            "backend": engine.backend.name(),
            "device": engine.backend.device_name().unwrap_or_else(crate::bench::cpu_name), "host": crate::bench::cpu_name(),
            "commit": crate::bench::git_commit(),
            "date": crate::bench::utc_now(),
            "command": std::env::args().collect::<Vec<_>>().join(" "),
            "model": dir.display().to_string(),
            "reference": reference.display().to_string(),
            "fidelity": f,
            "limits": {"max_perplexity_difference_percent": limits.0, "min_top1_agreement": limits.1},
        });
        std::fs::write(path, serde_json::to_string_pretty(&report)? + "\n")?;
    }
    if let Some(max) = limits.0 {
        if f.perplexity_difference_percent.abs() > max {
            bail!(
                "perplexity differs by {:+.3}% from the reference (limit ±{max}%)",
                f.perplexity_difference_percent
            );
        }
    }
    if let Some(min) = limits.1 {
        if f.top1_agreement < min {
            bail!(
                "top-1 agreement {:.2}% is below the limit {:.2}%",
                100.0 * f.top1_agreement,
                100.0 * min
            );
        }
    }
    Ok(())
}
