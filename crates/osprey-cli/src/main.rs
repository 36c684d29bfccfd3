//! `osprey`: run Qwen3.5/3.6-35B-A3B checkpoints. See README.md.

mod bench;
mod chart;
mod chat;
mod commands;
#[cfg(feature = "cuda")]
mod gpu;
#[cfg(feature = "cuda")]
mod gpu_speculative;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

/// The version and the commit this binary was built from (see build.rs).
const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (",
    env!("OSPREY_BUILD_COMMIT"),
    ")"
);

#[derive(Parser)]
#[command(name = "osprey", version = VERSION, about = "A Qwen3.6-35B-A3B inference engine")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// Where the model comes from.
#[derive(Args, Clone)]
pub struct ModelArgs {
    /// Checkpoint directory (MLX 4/8-bit or Hugging Face layout). Without it, a small synthetic
    /// model is made on first use under the cache directory and used.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Backend: cpu, cuda or auto (the best available).
    #[arg(long, default_value = "auto")]
    pub backend: String,
    /// Prompt tokens processed per forward call (bounds scratch memory). Default: 512 on the
    /// CPU, 4096 on the GPU.
    #[arg(long)]
    pub prefill_chunk: Option<usize>,
    /// Longest prompt + reply in tokens (default: the model's max_position_embeddings, 262144
    /// for Qwen3.6). Sizes the GPU's KV cache (20 KB a position at full size in bf16, 5.4 GB at
    /// 262144; half with --kv-cache int8).
    #[arg(long)]
    pub max_context: Option<usize>,
    /// How attention layers keep keys and values: bf16, or int8 (a byte per value and a scale
    /// per row: half the bytes a decode step reads at long context; the CPU backend rounds the
    /// same way).
    #[arg(long, default_value = "bf16")]
    pub kv_cache: osprey_engine::KvCache,
    /// GPU: memory for session copies kept on the device at the points a chat may branch from
    /// (a reply's start and end, a long system prompt's end), so that the next turn, a retry, a
    /// return to another conversation or a new one with the same system prompt resumes there
    /// instead of prefilling from the first token: each copy is the
    /// Gated DeltaNet state (~63 MB at full size) plus the K/V rows (20 KB a token, bf16) that
    /// other conversations wrote over since. Least recently used out first; 0 turns it off.
    #[arg(long, default_value_t = 8192)]
    pub gpu_cache_mib: usize,
}

/// Sampling settings; unset values come from the model's generation_config.json.
#[derive(Args, Clone, Default)]
pub struct SamplingArgs {
    /// 0 = greedy.
    #[arg(long)]
    pub temperature: Option<f32>,
    #[arg(long)]
    pub top_k: Option<usize>,
    #[arg(long)]
    pub top_p: Option<f32>,
    #[arg(long)]
    pub min_p: Option<f32>,
    #[arg(long)]
    pub presence_penalty: Option<f32>,
    #[arg(long)]
    pub frequency_penalty: Option<f32>,
    #[arg(long)]
    pub repetition_penalty: Option<f32>,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// What `osprey generate` writes after.
#[derive(Args, Clone)]
pub struct GenerateArgs {
    #[arg(long, default_value = "Write a haiku about ospreys.")]
    pub prompt: String,
    /// Wrap the prompt as a user message in the chat template.
    #[arg(long)]
    pub chat: bool,
    /// With --chat: a system message before the prompt.
    #[arg(long, requires = "chat")]
    pub system: Option<String>,
    /// With --chat: turn thinking off.
    #[arg(long)]
    pub no_think: bool,
    /// With --chat: close the reasoning block after this many tokens of it (the model then
    /// answers; the server's `thinking_token_budget`).
    #[arg(long, requires = "chat", conflicts_with = "no_think")]
    pub thinking_budget: Option<usize>,
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// Stop when this text appears (repeatable); it is not printed.
    #[arg(long)]
    pub stop: Vec<String>,
    /// Speculative decoding, one draft token verified a step: `mtp` drafts with the
    /// checkpoint's MTP head (the original bf16 release has it; MLX conversions drop it),
    /// `ngram` by prompt lookup (the token that followed the latest earlier occurrence of the
    /// last 1-3 tokens; any checkpoint). Greedy (--temperature 0), on the CPU (`--backend
    /// auto` runs it there); the output is the plain greedy sequence.
    #[arg(long, value_parser = ["mtp", "ngram"])]
    pub speculative: Option<String>,
}

/// Server settings.
#[derive(Args, Clone)]
pub struct ServeArgs {
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` on /v1 routes.
    #[arg(long)]
    pub api_key: Option<String>,
    /// Requests allowed to wait for the engine; more get 429.
    #[arg(long, default_value_t = 16)]
    pub max_queue: usize,
    /// Seconds before a request is abandoned.
    #[arg(long, default_value_t = 600)]
    pub request_timeout: u64,
    /// Session snapshots kept for prefix reuse.
    #[arg(long, default_value_t = 16)]
    pub cache_entries: usize,
    /// Memory the snapshots may use, in MiB.
    #[arg(long, default_value_t = 4096)]
    pub cache_mib: usize,
    /// Largest request body, in MiB.
    #[arg(long, default_value_t = 16)]
    pub max_body_mib: usize,
    /// max_tokens when a request sets none.
    #[arg(long, default_value_t = 4096)]
    pub default_max_tokens: usize,
    /// Model id reported by /v1/models and accepted in requests (default: the directory name);
    /// repeat it to accept more names (the first is the one replies report).
    #[arg(long)]
    pub served_model_name: Vec<String>,
}

#[derive(Subcommand)]
enum Command {
    /// Write a synthetic checkpoint (random weights, real MLX 4-bit layout, real tokenizer).
    Synth {
        /// qwen3.6-35b-a3b (full size, ~19.5 GB) or tiny.
        #[arg(long, default_value = "tiny")]
        preset: String,
        /// Override the number of layers.
        #[arg(long)]
        layers: Option<usize>,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Also write the multi-token-prediction head (mtp.*), which the original bf16 release
        /// has and MLX conversions drop; `generate --speculative mtp` drafts with it.
        #[arg(long)]
        mtp: bool,
        #[arg(long)]
        out: PathBuf,
    },
    /// Quantise a Hugging Face checkpoint (bf16/f16/f32, e.g. Qwen/Qwen3.6-35B-A3B) into the MLX
    /// affine layout mlx-lm writes, which the GPU backend runs (router and shared-expert gate at 8
    /// bits, as mlx-lm does).
    Quantize {
        /// The Hugging Face checkpoint directory.
        #[arg(long)]
        model: PathBuf,
        /// Where to write the quantised checkpoint (a new or empty directory).
        #[arg(long)]
        out: PathBuf,
        /// Bits per weight: 4 or 8.
        #[arg(long, default_value_t = 4)]
        bits: u32,
        /// Weights per scale and bias: 32, 64 or 128.
        #[arg(long, default_value_t = 64)]
        group_size: usize,
        /// Keep the multi-token-prediction head (mtp.*), quantised as a layer is, for
        /// `generate --speculative mtp` (mlx_lm convert drops it).
        #[arg(long)]
        keep_mtp: bool,
    },
    /// Generate text from a prompt, streaming it, then report tokens/s.
    Generate {
        #[command(flatten)]
        model: ModelArgs,
        #[command(flatten)]
        generate: GenerateArgs,
        #[command(flatten)]
        sampling: SamplingArgs,
    },
    /// Serve the OpenAI chat-completions API (binds to 127.0.0.1 unless told otherwise).
    Serve {
        #[command(flatten)]
        model: ModelArgs,
        #[command(flatten)]
        server: ServeArgs,
    },
    /// Chat in the terminal (multi-turn; /reset, /think on|off, /quit).
    Chat {
        #[command(flatten)]
        model: ModelArgs,
        #[arg(long, default_value_t = 1024)]
        max_tokens: usize,
        /// A system message opening the conversation (kept by /reset).
        #[arg(long)]
        system: Option<String>,
        /// Close each reply's reasoning block after this many tokens of it (the model then
        /// answers).
        #[arg(long)]
        thinking_budget: Option<usize>,
        #[command(flatten)]
        sampling: SamplingArgs,
    },
    /// Print the config, the tensor inventory and the memory footprint of a checkpoint.
    Inspect {
        #[command(flatten)]
        model: ModelArgs,
        /// List every tensor.
        #[arg(long)]
        tensors: bool,
    },
    /// Write the logits of every position of a token sequence as f32 [T, vocab] safetensors.
    Score {
        #[command(flatten)]
        model: ModelArgs,
        /// JSON array of token ids.
        #[arg(long)]
        tokens: PathBuf,
        #[arg(long)]
        out: PathBuf,
    },
    /// Teacher-forced fidelity against reference logits of the same tokens (e.g. from transformers,
    /// MLX-LM or `osprey score` on another backend): perplexity, top-1 agreement, logit error.
    Eval {
        #[command(flatten)]
        model: ModelArgs,
        /// JSON array of token ids.
        #[arg(long)]
        tokens: PathBuf,
        /// safetensors file holding the reference logits, f32 [T, vocab].
        #[arg(long)]
        reference: PathBuf,
        /// Name of the reference tensor.
        #[arg(long, default_value = "logits")]
        tensor: String,
        /// Fail when the perplexity differs from the reference's by more than this many percent.
        #[arg(long)]
        max_perplexity_difference: Option<f64>,
        /// Fail when fewer positions than this fraction agree on the top-1 token.
        #[arg(long)]
        min_top1: Option<f64>,
        /// Also write the result as JSON.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Check a GPU backend against the CPU reference, logits step by step (teacher-forced).
    Check {
        #[command(flatten)]
        model: ModelArgs,
        /// Prompt tokens run before the compared steps.
        #[arg(long, default_value_t = 16)]
        prompt_tokens: usize,
        /// Decode steps compared.
        #[arg(long, default_value_t = 64)]
        steps: usize,
        /// Prompt length of the prefill comparison (run in chunks of --prefill-chunk, default
        /// 128 here, and unchunked).
        #[arg(long, default_value_t = 300)]
        prefill_tokens: usize,
        /// Also check decode after a prompt this long (0: not), against the GPU's own prefill
        /// of the same positions: lengths past what the CPU reference can run in minutes, such
        /// as the model's 262,144.
        #[arg(long, default_value_t = 0)]
        long_context: usize,
        /// Also write the per-step comparison as JSON.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Measure how far bf16 arithmetic moves this model's outputs (per-layer divergence).
    Numerics {
        #[command(flatten)]
        model: ModelArgs,
        /// Length of the random token sequence.
        #[arg(long, default_value_t = 64)]
        tokens: usize,
        /// Also write the measurement as JSON.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Draw benchmark results (JSON files) as an SVG chart of tokens/s against length.
    Chart {
        /// Benchmark JSON files, one line each.
        #[arg(long, required = true)]
        input: Vec<PathBuf>,
        /// Line labels, in the order of --input (default: kind, backend and device).
        #[arg(long)]
        label: Vec<String>,
        #[arg(long, default_value = "Osprey throughput")]
        title: String,
        #[arg(long)]
        out: PathBuf,
    },
    /// Measure prefill or decode throughput over a list of lengths; writes JSON.
    Bench {
        #[command(subcommand)]
        kind: bench::BenchKind,
    },
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("OSPREY_LOG")
                .unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .with_target(false)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .without_time()
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Synth {
            preset,
            layers,
            seed,
            mtp,
            out,
        } => commands::synth(&preset, layers, seed, mtp, &out),
        Command::Quantize {
            model,
            out,
            bits,
            group_size,
            keep_mtp,
        } => commands::quantize(&model, &out, bits, group_size, keep_mtp),
        Command::Generate {
            model,
            generate,
            sampling,
        } => commands::generate(&model, &generate, &sampling),
        Command::Serve { model, server } => commands::serve(&model, &server),
        Command::Chat {
            model,
            max_tokens,
            system,
            thinking_budget,
            sampling,
        } => chat::run(
            &model,
            max_tokens,
            system.as_deref(),
            thinking_budget,
            &sampling,
        ),
        Command::Inspect { model, tensors } => commands::inspect(&model, tensors),
        Command::Score { model, tokens, out } => commands::score(&model, &tokens, &out),
        Command::Eval {
            model,
            tokens,
            reference,
            tensor,
            max_perplexity_difference,
            min_top1,
            out,
        } => commands::eval(
            &model,
            &tokens,
            &reference,
            &tensor,
            (max_perplexity_difference, min_top1),
            out.as_deref(),
        ),
        Command::Check {
            model,
            prompt_tokens,
            steps,
            prefill_tokens,
            long_context,
            out,
        } => commands::check(
            &model,
            prompt_tokens,
            steps,
            prefill_tokens,
            long_context,
            out.as_deref(),
        ),
        Command::Numerics { model, tokens, out } => {
            commands::numerics(&model, tokens, out.as_deref())
        }
        Command::Chart {
            input,
            label,
            title,
            out,
        } => chart::write_chart(&input, &label, &title, &out),
        Command::Bench { kind } => bench::run(kind),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
