//! Synthetic checkpoints in the exact MLX 4-bit layout (model-spec §5), with the real model's
//! config, tokenizer and chat template. Weights are random but chosen to keep the network
//! well-conditioned: codes are drawn uniformly and each group's scale sets the weight's standard
//! deviation, input projections preserve activation scale (σ = 1/√fan_in), and every block's output
//! projection is damped (σ = α/√fan_in) so a block adds a modest update to the residual stream.
//! That keeps the 40-layer map close to the identity plus small terms, so rounding differences
//! (bf16 vs f32, GPU vs CPU) stay small instead of being amplified layer after layer.
//!
//! The writer streams: tensors are generated in parallel chunks from per-chunk seeds and written
//! straight to ~5 GB shards, so memory stays small and the output depends only on the seed.

use std::io::Write;
use std::path::Path;

use anyhow::{bail, Context, Result};
use half::bf16;
use indicatif::ProgressBar;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;
use serde_json::{json, Value};

use crate::config::{LayerKind, ModelConfig};
use crate::shards::{bytes_progress, write_shards, ShardTensor};

pub const REAL_CONFIG: &str = include_str!("../../../assets/qwen3.6-35b-a3b/config.json");
const MODEL_FILES: [(&str, &[u8]); 4] = [
    (
        "tokenizer.json",
        include_bytes!("../../../assets/qwen3.6-35b-a3b/tokenizer.json"),
    ),
    (
        "tokenizer_config.json",
        include_bytes!("../../../assets/qwen3.6-35b-a3b/tokenizer_config.json"),
    ),
    (
        "chat_template.jinja",
        include_bytes!("../../../assets/qwen3.6-35b-a3b/chat_template.jinja"),
    ),
    (
        "generation_config.json",
        include_bytes!("../../../assets/qwen3.6-35b-a3b/generation_config.json"),
    ),
];

/// Damping of block output projections (see module docs).
const OUTPUT_GAIN: f32 = 0.25;
/// Logit standard deviation the lm_head aims for: peaked enough to be non-degenerate.
const LOGIT_STD: f32 = 3.0;
/// Router logit standard deviation: decisive routing, few near-ties between experts.
const ROUTER_STD: f32 = 2.0;
const CHUNK_ELEMS: usize = 1 << 20;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Preset {
    /// The real Qwen3.6-35B-A3B shape (~19.5 GB).
    Full,
    /// A small model over the real tokenizer and vocabulary (hidden 512, 4 layers), for tests and
    /// first runs.
    Tiny,
}

impl std::str::FromStr for Preset {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "qwen3.6-35b-a3b" | "full" => Ok(Preset::Full),
            "tiny" => Ok(Preset::Tiny),
            _ => bail!("unknown preset \"{s}\" (expected qwen3.6-35b-a3b or tiny)"),
        }
    }
}

pub struct SynthOptions {
    pub preset: Preset,
    pub layers: Option<usize>,
    pub seed: u64,
    pub show_progress: bool,
    /// Also write the multi-token-prediction head (`mtp.*`, model-spec §7), quantised as the
    /// layers are.
    pub mtp: bool,
}

/// The config.json a synthetic checkpoint gets: the real one, resized for the preset, with the
/// MLX quantisation section (router and shared-expert gate at 8 bits, as mlx-lm's predicate does).
pub fn synthetic_config(opts: &SynthOptions) -> Result<Value> {
    let mut root: Value = serde_json::from_str(REAL_CONFIG)?;
    let tc = root["text_config"]
        .as_object_mut()
        .context("real config has no text_config")?;
    if opts.preset == Preset::Tiny {
        // the smallest shape the CUDA kernels run (hidden a multiple of 512, attention head 256,
        // DeltaNet heads 128): the same code paths as the real model at ~1/40 of its width
        for (k, v) in [
            ("hidden_size", 512),
            ("num_hidden_layers", 4),
            ("num_attention_heads", 4),
            ("num_key_value_heads", 2),
            ("head_dim", 256),
            ("linear_num_key_heads", 2),
            ("linear_num_value_heads", 4),
            ("linear_key_head_dim", 128),
            ("linear_value_head_dim", 128),
            ("num_experts", 16),
            ("num_experts_per_tok", 4),
            ("moe_intermediate_size", 512),
            ("shared_expert_intermediate_size", 512),
        ] {
            tc.insert(k.into(), json!(v));
        }
    }
    let layers = opts
        .layers
        .unwrap_or(tc["num_hidden_layers"].as_u64().unwrap_or(40) as usize);
    if layers == 0 {
        bail!("--layers must be at least 1");
    }
    tc.insert("num_hidden_layers".into(), json!(layers));
    let types: Vec<&str> = (0..layers)
        .map(|i| {
            if (i + 1) % 4 == 0 {
                "full_attention"
            } else {
                "linear_attention"
            }
        })
        .collect();
    tc.insert("layer_types".into(), json!(types));
    let mut q = serde_json::Map::new();
    q.insert("group_size".into(), json!(64));
    q.insert("bits".into(), json!(4));
    q.insert("mode".into(), json!("affine"));
    crate::convert::eight_bit_overrides(&mut q, layers, opts.mtp);
    root["quantization"] = Value::Object(q.clone());
    root["quantization_config"] = Value::Object(q);
    Ok(root)
}

#[derive(Clone, Copy)]
enum Gen {
    /// Uniform random codes of `bits` bits, packed.
    Codes,
    /// Per-group scale giving weights of standard deviation `sigma`.
    Scale {
        sigma: f32,
        bits: u32,
    },
    /// Per-group bias centring the codes (depends on the scale stream `scale_seed`).
    Bias {
        sigma: f32,
        bits: u32,
        scale_seed: u64,
    },
    /// `1 + u`, u uniform in ±amp (norm scales).
    OnePlus {
        amp: f32,
    },
    Uniform {
        amp: f32,
    },
    /// `log(U(1, 16))`, the real model's A_log init.
    ALog,
    /// softplus⁻¹ of a log-uniform step in [0.001, 0.1].
    DtBias,
}

#[derive(Clone, Copy, PartialEq)]
enum DType {
    U32,
    Bf16,
    F32,
}

struct Planned {
    name: String,
    shape: Vec<usize>,
    dtype: DType,
    gen: Gen,
    seed: u64,
}

impl Planned {
    fn elems(&self) -> usize {
        self.shape.iter().product()
    }
    fn bytes(&self) -> usize {
        self.elems()
            * if self.dtype == DType::U32 || self.dtype == DType::F32 {
                4
            } else {
                2
            }
    }
}

struct Planner {
    seed: u64,
    out: Vec<Planned>,
}

impl Planner {
    fn next_seed(&mut self) -> u64 {
        let n = self.out.len() as u64;
        self.seed
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .wrapping_add(n.wrapping_mul(0xD1B5_4A32_D192_ED03))
            ^ n
    }
    fn push(&mut self, name: String, shape: Vec<usize>, dtype: DType, gen: Gen) -> u64 {
        let seed = self.next_seed();
        self.out.push(Planned {
            name,
            shape,
            dtype,
            gen,
            seed,
        });
        seed
    }
    /// A quantised linear `[lead…, rows, cols]` with weight standard deviation `sigma`.
    fn linear(
        &mut self,
        module: &str,
        lead: &[usize],
        rows: usize,
        cols: usize,
        bits: u32,
        sigma: f32,
    ) {
        let shape = |last: usize| [lead, &[rows, last]].concat();
        self.push(
            format!("{module}.weight"),
            shape(cols * bits as usize / 32),
            DType::U32,
            Gen::Codes,
        );
        let scale_seed = self.push(
            format!("{module}.scales"),
            shape(cols / 64),
            DType::Bf16,
            Gen::Scale { sigma, bits },
        );
        self.push(
            format!("{module}.biases"),
            shape(cols / 64),
            DType::Bf16,
            Gen::Bias {
                sigma,
                bits,
                scale_seed,
            },
        );
    }
    fn vector(&mut self, name: String, len: usize, dtype: DType, gen: Gen) {
        self.push(name, vec![len], dtype, gen);
    }

    /// A norm's scale: bf16 values 1 + u, u uniform in ±0.1 (stored as MLX stores them).
    fn norm(&mut self, name: String, len: usize) {
        self.vector(name, len, DType::Bf16, Gen::OnePlus { amp: 0.1 });
    }
}

fn plan(cfg: &ModelConfig, seed: u64, mtp: bool) -> Vec<Planned> {
    let mut p = Planner {
        seed,
        out: Vec::new(),
    };
    let h = cfg.hidden_size;
    let inv = |fan_in: usize| 1.0 / (fan_in as f32).sqrt();
    let lm = "language_model";
    p.linear(
        &format!("{lm}.model.embed_tokens"),
        &[],
        cfg.vocab_size,
        h,
        4,
        1.0,
    );
    p.linear(
        &format!("{lm}.lm_head"),
        &[],
        cfg.vocab_size,
        h,
        4,
        LOGIT_STD * inv(h),
    );
    p.norm(format!("{lm}.model.norm.weight"), h);
    for (l, kind) in cfg.layers.iter().enumerate() {
        plan_layer(&mut p, cfg, &format!("{lm}.model.layers.{l}"), *kind);
    }
    if mtp {
        let m = format!("{lm}.mtp");
        p.linear(&format!("{m}.fc"), &[], h, 2 * h, 4, inv(2 * h));
        for norm in ["pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"] {
            p.norm(format!("{m}.{norm}.weight"), h);
        }
        plan_layer(&mut p, cfg, &format!("{m}.layers.0"), LayerKind::Attention);
    }
    p.out
}

/// The tensors of one decoder layer stored under `pre`.
fn plan_layer(p: &mut Planner, cfg: &ModelConfig, pre: &str, kind: LayerKind) {
    let h = cfg.hidden_size;
    let inv = |fan_in: usize| 1.0 / (fan_in as f32).sqrt();
    let (kd, vd) = (cfg.linear_key_dim(), cfg.linear_value_dim());
    let (hv, dv) = (cfg.linear_num_value_heads, cfg.linear_value_head_dim);
    let (hq, hkv, d) = (
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
    );
    let (e, i, is) = (
        cfg.num_experts,
        cfg.moe_intermediate_size,
        cfg.shared_expert_intermediate_size,
    );
    p.norm(format!("{pre}.input_layernorm.weight"), h);
    p.norm(format!("{pre}.post_attention_layernorm.weight"), h);
    match kind {
        LayerKind::GatedDeltaNet => {
            let a = format!("{pre}.linear_attn");
            p.linear(&format!("{a}.in_proj_qkv"), &[], 2 * kd + vd, h, 4, inv(h));
            p.linear(&format!("{a}.in_proj_z"), &[], vd, h, 4, inv(h));
            p.linear(&format!("{a}.in_proj_b"), &[], hv, h, 4, inv(h));
            p.linear(&format!("{a}.in_proj_a"), &[], hv, h, 4, inv(h));
            p.push(
                format!("{a}.conv1d.weight"),
                vec![2 * kd + vd, cfg.conv_kernel, 1],
                DType::Bf16,
                Gen::Uniform { amp: 0.9 },
            );
            p.vector(format!("{a}.A_log"), hv, DType::F32, Gen::ALog);
            p.vector(format!("{a}.dt_bias"), hv, DType::Bf16, Gen::DtBias);
            p.norm(format!("{a}.norm.weight"), dv);
            p.linear(
                &format!("{a}.out_proj"),
                &[],
                h,
                vd,
                4,
                OUTPUT_GAIN * inv(vd),
            );
        }
        LayerKind::Attention => {
            let a = format!("{pre}.self_attn");
            p.linear(&format!("{a}.q_proj"), &[], 2 * hq * d, h, 4, inv(h));
            p.linear(&format!("{a}.k_proj"), &[], hkv * d, h, 4, inv(h));
            p.linear(&format!("{a}.v_proj"), &[], hkv * d, h, 4, inv(h));
            p.linear(
                &format!("{a}.o_proj"),
                &[],
                h,
                hq * d,
                4,
                OUTPUT_GAIN * inv(hq * d),
            );
            p.norm(format!("{a}.q_norm.weight"), d);
            p.norm(format!("{a}.k_norm.weight"), d);
        }
    }
    let m = format!("{pre}.mlp");
    p.linear(&format!("{m}.gate"), &[], e, h, 8, ROUTER_STD * inv(h));
    p.linear(&format!("{m}.shared_expert_gate"), &[], 1, h, 8, inv(h));
    p.linear(
        &format!("{m}.shared_expert.gate_proj"),
        &[],
        is,
        h,
        4,
        inv(h),
    );
    p.linear(&format!("{m}.shared_expert.up_proj"), &[], is, h, 4, inv(h));
    p.linear(
        &format!("{m}.shared_expert.down_proj"),
        &[],
        h,
        is,
        4,
        OUTPUT_GAIN * inv(is),
    );
    p.linear(&format!("{m}.switch_mlp.gate_proj"), &[e], i, h, 4, inv(h));
    p.linear(&format!("{m}.switch_mlp.up_proj"), &[e], i, h, 4, inv(h));
    p.linear(
        &format!("{m}.switch_mlp.down_proj"),
        &[e],
        h,
        i,
        4,
        OUTPUT_GAIN * inv(i),
    );
}

fn chunk_rng(seed: u64, chunk: usize) -> ChaCha8Rng {
    let mut r = ChaCha8Rng::seed_from_u64(seed);
    r.set_stream(chunk as u64);
    r
}

/// Standard deviation of uniform codes in [0, 2^bits).
fn code_std(bits: u32) -> f32 {
    let n = (1u64 << bits) as f32;
    ((n * n - 1.0) / 12.0).sqrt()
}

fn group_scale(rng: &mut ChaCha8Rng, sigma: f32, bits: u32) -> f32 {
    let jitter: f32 = rng.random_range(0.8..1.2);
    bf16::from_f32(sigma / code_std(bits) * jitter).to_f32()
}

/// Fills `out` with elements `[first, first + n)` of tensor `t`, as little-endian bytes.
fn generate(t: &Planned, first: usize, out: &mut [u8]) {
    let chunk = first / CHUNK_ELEMS;
    let mut rng = chunk_rng(t.seed, chunk);
    match t.gen {
        Gen::Codes => out
            .chunks_exact_mut(4)
            .for_each(|w| w.copy_from_slice(&rng.random::<u32>().to_le_bytes())),
        Gen::Scale { sigma, bits } => out.chunks_exact_mut(2).for_each(|w| {
            w.copy_from_slice(&bf16::from_f32(group_scale(&mut rng, sigma, bits)).to_le_bytes())
        }),
        Gen::Bias {
            sigma,
            bits,
            scale_seed,
        } => {
            let mut srng = chunk_rng(scale_seed, chunk);
            let mid = ((1u64 << bits) - 1) as f32 / 2.0;
            out.chunks_exact_mut(2).for_each(|w| {
                let s = group_scale(&mut srng, sigma, bits);
                let b = -mid * s + rng.random_range(-0.05..0.05) * sigma;
                w.copy_from_slice(&bf16::from_f32(b).to_le_bytes())
            })
        }
        Gen::OnePlus { amp } => out.chunks_exact_mut(2).for_each(|w| {
            w.copy_from_slice(&bf16::from_f32(1.0 + rng.random_range(-amp..amp)).to_le_bytes())
        }),
        Gen::Uniform { amp } => out.chunks_exact_mut(2).for_each(|w| {
            w.copy_from_slice(&bf16::from_f32(rng.random_range(-amp..amp)).to_le_bytes())
        }),
        Gen::ALog => out
            .chunks_exact_mut(4)
            .for_each(|w| w.copy_from_slice(&rng.random_range(1.0f32..16.0).ln().to_le_bytes())),
        Gen::DtBias => out.chunks_exact_mut(2).for_each(|w| {
            let dt = rng.random_range(0.001f32.ln()..0.1f32.ln()).exp();
            let inv_softplus = dt + (-(-dt).exp_m1()).ln();
            w.copy_from_slice(&bf16::from_f32(inv_softplus).to_le_bytes())
        }),
    }
}

fn write_tensor(
    t: &Planned,
    w: &mut dyn Write,
    buf: &mut Vec<u8>,
    bar: &ProgressBar,
) -> Result<()> {
    let elem = t.bytes() / t.elems().max(1);
    let total = t.elems();
    let batch = CHUNK_ELEMS * rayon::current_num_threads().max(1) * 4;
    let mut first = 0;
    while first < total {
        let n = batch.min(total - first);
        buf.resize(n * elem, 0);
        buf.par_chunks_mut(CHUNK_ELEMS * elem)
            .enumerate()
            .for_each(|(k, out)| generate(t, first + k * CHUNK_ELEMS, out));
        w.write_all(buf)?;
        bar.inc(buf.len() as u64);
        first += n;
    }
    Ok(())
}

/// Writes a synthetic checkpoint to `out`. Returns the total tensor bytes written.
pub fn write_checkpoint(out: &Path, opts: &SynthOptions) -> Result<u64> {
    let config_json = synthetic_config(opts)?;
    let cfg = ModelConfig::from_json_str(&config_json.to_string())?;
    let planned = plan(&cfg, opts.seed, opts.mtp);
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;

    let total: u64 = planned.iter().map(|t| t.bytes() as u64).sum();
    let bar = bytes_progress(total, opts.show_progress, "writing")?;
    let tensors: Vec<ShardTensor> = planned
        .iter()
        .map(|t| ShardTensor {
            name: t.name.clone(),
            dtype: match t.dtype {
                DType::U32 => "U32",
                DType::Bf16 => "BF16",
                DType::F32 => "F32",
            },
            shape: t.shape.clone(),
        })
        .collect();
    let mut buf = Vec::new();
    let written = write_shards(out, &tensors, true, |i, w| {
        write_tensor(&planned[i], w, &mut buf, &bar)
    })?;
    bar.finish_and_clear();
    std::fs::write(
        out.join("config.json"),
        serde_json::to_vec_pretty(&config_json)?,
    )?;
    for (name, bytes) in MODEL_FILES {
        std::fs::write(out.join(name), bytes)?;
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weights::{ModelWeights, StorageLayout};

    fn tiny(seed: u64, layers: usize) -> (tempfile::TempDir, u64) {
        let dir = tempfile::tempdir().unwrap();
        let opts = SynthOptions {
            preset: Preset::Tiny,
            layers: Some(layers),
            seed,
            show_progress: false,
            mtp: false,
        };
        let n = write_checkpoint(dir.path(), &opts).unwrap();
        (dir, n)
    }

    #[test]
    fn tiny_checkpoint_loads_and_validates() {
        let (dir, bytes) = tiny(1, 4);
        let w = ModelWeights::load(dir.path()).unwrap();
        assert_eq!(w.layout, StorageLayout::Mlx);
        assert_eq!(w.layers.len(), 4);
        assert!(bytes > 0);
        // code tensors are mapped in place, not copied
        match &w.layers[0].moe.experts[0].gate.matrix.data {
            crate::tensor::MatrixData::Quantized { codes, bits, .. } => {
                assert!(codes.is_mapped());
                assert_eq!(*bits, 4);
            }
            _ => panic!("expected quantised experts"),
        }
        match &w.layers[0].moe.router.matrix.data {
            crate::tensor::MatrixData::Quantized { bits, .. } => assert_eq!(*bits, 8),
            _ => panic!("expected quantised router"),
        }
    }

    #[test]
    fn the_mtp_head_is_written_and_loaded_when_asked() {
        let dir = tempfile::tempdir().unwrap();
        let opts = |mtp| SynthOptions {
            preset: Preset::Tiny,
            layers: Some(1),
            seed: 3,
            show_progress: false,
            mtp,
        };
        write_checkpoint(dir.path(), &opts(true)).unwrap();
        let w = ModelWeights::load(dir.path()).unwrap();
        let m = w.mtp.as_ref().expect("an MTP head");
        let h = w.config.hidden_size;
        assert_eq!((m.fc.matrix.rows, m.fc.matrix.cols), (h, 2 * h));
        assert!(matches!(m.layer.mixer, crate::weights::Mixer::Attention(_)));
        match &m.layer.moe.router.matrix.data {
            crate::tensor::MatrixData::Quantized { bits, .. } => assert_eq!(*bits, 8),
            _ => panic!("expected the MTP router quantised at 8 bits"),
        }
        assert!(w
            .footprint()
            .iter()
            .any(|(part, b)| *part == "mtp head" && *b > 0));
        let plain = tempfile::tempdir().unwrap();
        write_checkpoint(plain.path(), &opts(false)).unwrap();
        assert!(ModelWeights::load(plain.path()).unwrap().mtp.is_none());
    }

    #[test]
    fn same_seed_same_bytes_other_seed_differs() {
        let (a, _) = tiny(7, 1);
        let (b, _) = tiny(7, 1);
        let (c, _) = tiny(8, 1);
        let read =
            |d: &tempfile::TempDir| std::fs::read(d.path().join("model.safetensors")).unwrap();
        assert_eq!(read(&a), read(&b));
        assert_ne!(read(&a), read(&c));
    }

    #[test]
    fn weights_have_the_planned_spread() {
        let (dir, _) = tiny(3, 4);
        let w = ModelWeights::load(dir.path()).unwrap();
        let lin = &w.layers[0].moe.shared.gate;
        let mut row = vec![0.0; lin.cols()];
        let (mut s, mut s2, mut n) = (0.0f64, 0.0f64, 0.0f64);
        for r in 0..lin.rows {
            lin.dequantize_row(r, &mut row);
            for &x in &row {
                s += x as f64;
                s2 += (x * x) as f64;
                n += 1.0;
            }
        }
        let std = (s2 / n - (s / n).powi(2)).sqrt();
        let want = 1.0 / (w.config.hidden_size as f64).sqrt();
        assert!((std / want - 1.0).abs() < 0.1, "std {std} want {want}");
        assert!((s / n).abs() < 0.1 * want, "mean {}", s / n);
    }
}
