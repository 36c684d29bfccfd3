//! `osprey quantize`: a Hugging Face checkpoint of Qwen3.5/3.6-MoE (bf16, f16 or f32, e.g. the
//! released `Qwen/Qwen3.6-35B-A3B`) rewritten in the MLX affine layout that `mlx_lm convert -q`
//! writes (model-spec §5.3-5.5), so the GPU backend, which runs MLX-quantised checkpoints, can load
//! it without Python or MLX. Byte for byte what mlx-lm writes for the same source (CI converts the
//! transformers fixture both ways and compares every tensor):
//! - names `language_model.model.*` / `language_model.lm_head`; `mtp.*` and the vision tower
//!   dropped (`keep_mtp` keeps the MTP head, quantised as a layer is, as `language_model.mtp.*`:
//!   not what mlx-lm writes, but what `--speculative mtp` needs);
//! - `experts.gate_up_proj` [E, 2I, H] split into `switch_mlp.gate_proj` / `up_proj`,
//!   `experts.down_proj` into `switch_mlp.down_proj`;
//! - `conv1d.weight` [C, 1, K] stored as [C, K, 1];
//! - the zero-centred norms (input, post-attention, final, q/k) stored as 1 + w (the GDN gated
//!   norm is not zero-centred and stays), rounded to bf16;
//! - every linear and the embedding quantised (`quant::quantize_row`), the router (`mlp.gate`) and
//!   `shared_expert_gate` at 8 bits in groups of 64 as mlx-lm's qwen3_5 predicate does; other
//!   floats cast to bf16 except `A_log`, which keeps its dtype.
//!
//! Streams: each module is read from the memory map, quantised in parallel by rows and written
//! to ~5 GB shards before the next is read.

use std::path::Path;

use anyhow::{bail, Context, Result};
use half::{bf16, f16};
use rayon::prelude::*;
use safetensors::Dtype;
use serde_json::{json, Value};

use crate::checkpoint::{Checkpoint, TensorEntry};
use crate::config::{Family, ModelConfig};
use crate::quant::quantize_row;
use crate::shards::{bytes_progress, write_shards, ShardTensor};
use crate::weights::{ModelWeights, StorageLayout};

/// Modules mlx-lm's qwen3_5 predicate quantises at 8 bits in groups of 64, whatever the default.
const EIGHT_BIT_MODULES: [&str; 2] = ["mlp.gate", "mlp.shared_expert_gate"];
/// Norms stored zero-centred in the Hugging Face files and as 1 + w in MLX's.
const SHIFTED_NORMS: [&str; 8] = [
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    "model.norm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
    "mtp.norm.weight",
    "mtp.pre_fc_norm_embedding.weight",
    "mtp.pre_fc_norm_hidden.weight",
];

pub struct QuantizeOptions {
    pub bits: u32,
    pub group_size: usize,
    pub show_progress: bool,
    /// Keep the MTP head (`mtp.*`) instead of dropping it as mlx-lm does.
    pub keep_mtp: bool,
}

/// What a conversion wrote.
pub struct QuantizeReport {
    pub tensors: usize,
    pub bytes: u64,
    pub source_bytes: u64,
}

/// Rows of a source tensor to quantise: for each of `lead` leading indices (experts; 1 for a
/// plain linear), source rows `offset .. offset + rows` of that index's `stride` rows.
struct QuantJob {
    src: TensorEntry,
    lead: usize,
    stride: usize,
    offset: usize,
    rows: usize,
    cols: usize,
    bits: u32,
    group: usize,
}

/// One output module and where its values come from.
enum Job {
    Quantize(QuantJob),
    /// A float tensor: cast to bf16 (optionally 1 + w), or copied as stored (`keep`).
    Plain {
        src: TensorEntry,
        add_one: bool,
        keep: bool,
    },
}

/// Converts the Hugging Face checkpoint at `src` into an MLX-quantised one at `out`.
pub fn quantize_checkpoint(
    src: &Path,
    out: &Path,
    opts: &QuantizeOptions,
) -> Result<QuantizeReport> {
    if ![4, 8].contains(&opts.bits) {
        bail!("--bits {}: 4 or 8", opts.bits);
    }
    if ![32, 64, 128].contains(&opts.group_size) {
        bail!("--group-size {}: 32, 64 or 128", opts.group_size);
    }
    let config = ModelConfig::from_dir(src)?;
    if config.quantization.is_some() {
        bail!(
            "{} is already quantised (its config.json has a quantization section)",
            src.display()
        );
    }
    if config.family != Family::Qwen35Moe {
        bail!(
            "{}: model_type {} — `osprey quantize` converts Qwen3.5/3.6-MoE checkpoints (qwen3_5_moe)",
            src.display(),
            config.model_type
        );
    }
    let ck = Checkpoint::open(src)?;
    // every tensor present with the config's shapes before anything is written
    if ModelWeights::validate(config.clone(), &ck)? != StorageLayout::HuggingFace {
        bail!("{}: not in the Hugging Face layout", src.display());
    }
    if out.join("config.json").exists() {
        bail!(
            "{} already holds a checkpoint; choose an empty directory",
            out.display()
        );
    }
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;

    let raw_conv = ck
        .tensors
        .iter()
        .any(|(n, t)| n.ends_with("conv1d.weight") && t.shape.last() != Some(&1));
    let mut jobs = Vec::new();
    for (name, t) in &ck.tensors {
        // mlx_lm convert drops the MTP head
        let dropped = name.starts_with("mtp.") && !opts.keep_mtp;
        if dropped || (config.tie_word_embeddings && name == "lm_head.weight") {
            continue;
        }
        plan_tensor(name, t, raw_conv, opts, &mut jobs)?;
    }

    let mut tensors = Vec::new();
    let mut parts = Vec::new(); // (job, part) of each output tensor
    for (j, (module, job)) in jobs.iter().enumerate() {
        let name = format!("language_model.{module}");
        match job {
            Job::Quantize(q) => {
                let lead_shape: Vec<usize> = if q.src.shape.len() == 3 {
                    vec![q.lead]
                } else {
                    vec![]
                };
                let shape = |last: usize| [lead_shape.as_slice(), &[q.rows, last]].concat();
                for (part, (suffix, dtype, last)) in [
                    ("weight", "U32", q.cols * q.bits as usize / 32),
                    ("scales", "BF16", q.cols / q.group),
                    ("biases", "BF16", q.cols / q.group),
                ]
                .into_iter()
                .enumerate()
                {
                    tensors.push(ShardTensor {
                        name: format!("{name}.{suffix}"),
                        dtype,
                        shape: shape(last),
                    });
                    parts.push((j, part));
                }
            }
            Job::Plain { src, keep, .. } => {
                let shape = if module.ends_with("conv1d.weight") && src.shape.len() == 3 {
                    vec![src.shape[0], src.shape[1] * src.shape[2], 1]
                } else {
                    src.shape.clone()
                };
                let dtype = match (keep, src.dtype) {
                    (true, Dtype::F32) => "F32",
                    (true, Dtype::F16) => "F16",
                    _ => "BF16",
                };
                tensors.push(ShardTensor { name, dtype, shape });
                parts.push((j, 0));
            }
        }
    }

    let source_bytes = ck.total_bytes() as u64;
    let bar = bytes_progress(source_bytes, opts.show_progress, "quantising")?;
    // a module's codes, scales and biases are consecutive: computed once, written in turn
    let mut held: Option<(usize, Quantized)> = None;
    let bytes = write_shards(out, &tensors, false, |i, w| {
        let (j, part) = parts[i];
        match &jobs[j].1 {
            Job::Quantize(job) => {
                if held.as_ref().is_none_or(|(hj, _)| *hj != j) {
                    held = Some((j, job.run(&ck)));
                    bar.inc(job.source_bytes());
                }
                let q = &held.as_ref().context("internal: no module held")?.1;
                match part {
                    0 => w.write_all(bytemuck::cast_slice(&q.words))?,
                    1 => w.write_all(bytemuck::cast_slice(&q.scales))?,
                    _ => w.write_all(bytemuck::cast_slice(&q.biases))?,
                }
            }
            Job::Plain { src, add_one, keep } => {
                let data = source_data(&ck, src);
                if *keep {
                    w.write_all(data)?;
                } else {
                    let values: Vec<bf16> = read_floats(data, src.dtype)
                        .map(|v| bf16::from_f32(if *add_one { v + 1.0 } else { v }))
                        .collect();
                    w.write_all(bytemuck::cast_slice(&values))?;
                }
                bar.inc(src.byte_len as u64);
            }
        }
        Ok(())
    })?;
    bar.finish_and_clear();

    let mtp = opts.keep_mtp && ck.tensors.keys().any(|n| n.starts_with("mtp."));
    write_config(src, out, &config, opts, mtp)?;
    copy_other_files(src, out)?;
    // the result loads and matches its config, as any MLX checkpoint must
    ModelWeights::load(out).context("the converted checkpoint does not load")?;
    Ok(QuantizeReport {
        tensors: tensors.len(),
        bytes,
        source_bytes,
    })
}

/// The output module(s) of one source tensor (canonical name), appended to `jobs`.
fn plan_tensor(
    name: &str,
    t: &TensorEntry,
    raw_conv: bool,
    opts: &QuantizeOptions,
    jobs: &mut Vec<(String, Job)>,
) -> Result<()> {
    if !matches!(t.dtype, Dtype::BF16 | Dtype::F16 | Dtype::F32) {
        bail!("{name}: {:?} values; expected bf16, f16 or f32", t.dtype);
    }
    let quantize = |src: &TensorEntry, lead, stride, offset, rows, cols, module: &str| {
        let (bits, group) = if EIGHT_BIT_MODULES.iter().any(|m| module.ends_with(m)) {
            (8, 64)
        } else {
            (opts.bits, opts.group_size)
        };
        if cols % group != 0 {
            bail!("{name}: rows of {cols} do not divide into groups of {group}");
        }
        Ok(Job::Quantize(QuantJob {
            src: src.clone(),
            lead,
            stride,
            offset,
            rows,
            cols,
            bits,
            group,
        }))
    };
    if let Some(prefix) = name.strip_suffix("experts.gate_up_proj") {
        let [e, two_i, h] = t.shape[..] else {
            bail!(
                "{name}: shape {:?}, expected [experts, 2 x intermediate, hidden]",
                t.shape
            );
        };
        let i = two_i / 2;
        for (half, offset) in [("gate_proj", 0), ("up_proj", i)] {
            let module = format!("{prefix}switch_mlp.{half}");
            let job = quantize(t, e, two_i, offset, i, h, &module)?;
            jobs.push((module, job));
        }
    } else if let Some(prefix) = name.strip_suffix("experts.down_proj") {
        let [e, h, i] = t.shape[..] else {
            bail!(
                "{name}: shape {:?}, expected [experts, hidden, intermediate]",
                t.shape
            );
        };
        let module = format!("{prefix}switch_mlp.down_proj");
        let job = quantize(t, e, h, 0, h, i, &module)?;
        jobs.push((module, job));
    } else if name.ends_with("conv1d.weight") || t.shape.len() == 1 {
        let keep = name.ends_with("A_log");
        let add_one = raw_conv && SHIFTED_NORMS.iter().any(|s| name.ends_with(s));
        jobs.push((
            name.to_string(),
            Job::Plain {
                src: t.clone(),
                add_one,
                keep,
            },
        ));
    } else if let (Some(module), [rows, cols]) = (name.strip_suffix(".weight"), &t.shape[..]) {
        let job = quantize(t, 1, *rows, 0, *rows, *cols, module)?;
        jobs.push((module.to_string(), job));
    } else {
        bail!(
            "{name}: shape {:?} is not a tensor of the Qwen3.5/3.6 layout",
            t.shape
        );
    }
    Ok(())
}

struct Quantized {
    words: Vec<u32>,
    scales: Vec<bf16>,
    biases: Vec<bf16>,
}

fn source_data<'a>(ck: &'a Checkpoint, t: &TensorEntry) -> &'a [u8] {
    &ck.maps[t.file][t.start..t.start + t.byte_len]
}

fn element_bytes(dtype: Dtype) -> usize {
    if dtype == Dtype::F32 {
        4
    } else {
        2
    }
}

fn read_floats(data: &[u8], dtype: Dtype) -> impl Iterator<Item = f32> + '_ {
    data.chunks_exact(element_bytes(dtype))
        .map(move |b| match dtype {
            Dtype::F32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            Dtype::F16 => f16::from_le_bytes([b[0], b[1]]).to_f32(),
            _ => bf16::from_le_bytes([b[0], b[1]]).to_f32(),
        })
}

impl QuantJob {
    fn source_bytes(&self) -> u64 {
        (self.lead * self.rows * self.cols * element_bytes(self.src.dtype)) as u64
    }

    /// The module's codes, scales and biases, its rows quantised in parallel.
    fn run(&self, ck: &Checkpoint) -> Quantized {
        let (n, cols, group) = (self.lead * self.rows, self.cols, self.group);
        let words_per_row = cols * self.bits as usize / 32;
        let groups = cols / group;
        let mut q = Quantized {
            words: vec![0; n * words_per_row],
            scales: vec![bf16::ZERO; n * groups],
            biases: vec![bf16::ZERO; n * groups],
        };
        let data = source_data(ck, &self.src);
        let row_bytes = cols * element_bytes(self.src.dtype);
        q.words
            .par_chunks_mut(words_per_row)
            .zip(q.scales.par_chunks_mut(groups))
            .zip(q.biases.par_chunks_mut(groups))
            .enumerate()
            .for_each_init(
                || vec![0.0f32; cols],
                |row, (r, ((words, scales), biases))| {
                    let source_row = (r / self.rows) * self.stride + self.offset + r % self.rows;
                    let bytes = &data[source_row * row_bytes..(source_row + 1) * row_bytes];
                    for (x, v) in row.iter_mut().zip(read_floats(bytes, self.src.dtype)) {
                        *x = v;
                    }
                    quantize_row(row, self.bits, group, words, scales, biases);
                },
            );
        q
    }
}

/// The source's config.json with the quantisation section mlx-lm writes (model-spec §5.2).
fn write_config(
    src: &Path,
    out: &Path,
    config: &ModelConfig,
    opts: &QuantizeOptions,
    mtp: bool,
) -> Result<()> {
    let path = src.join("config.json");
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read {}", path.display()))?;
    let mut root: Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not valid JSON", path.display()))?;
    let mut q = serde_json::Map::new();
    q.insert("group_size".into(), json!(opts.group_size));
    q.insert("bits".into(), json!(opts.bits));
    q.insert("mode".into(), json!("affine"));
    eight_bit_overrides(&mut q, config.num_layers(), mtp);
    let map = root
        .as_object_mut()
        .with_context(|| format!("{} is not a JSON object", path.display()))?;
    map.insert("quantization".into(), Value::Object(q.clone()));
    map.insert("quantization_config".into(), Value::Object(q));
    std::fs::write(out.join("config.json"), serde_json::to_vec_pretty(&root)?)?;
    Ok(())
}

/// The quantisation section's per-module entries for EIGHT_BIT_MODULES (8 bits, groups of 64)
/// in each of `layers` layers and, with `mtp`, in the MTP head's layer.
pub(crate) fn eight_bit_overrides(
    q: &mut serde_json::Map<String, Value>,
    layers: usize,
    mtp: bool,
) {
    let layer_paths = (0..layers).map(|i| format!("language_model.model.layers.{i}"));
    let mtp_path = mtp.then(|| "language_model.mtp.layers.0".to_string());
    for path in layer_paths.chain(mtp_path) {
        for m in EIGHT_BIT_MODULES {
            q.insert(format!("{path}.{m}"), json!({"group_size": 64, "bits": 8}));
        }
    }
}

/// Tokenizer, chat template, generation config and any other file beside the weights.
fn copy_other_files(src: &Path, out: &Path) -> Result<()> {
    for entry in std::fs::read_dir(src).with_context(|| format!("cannot list {}", src.display()))? {
        let entry = entry?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        let weights = name.ends_with(".safetensors") || name == "model.safetensors.index.json";
        if entry.file_type()?.is_file() && !weights && name != "config.json" {
            std::fs::copy(entry.path(), out.join(&*name))
                .with_context(|| format!("cannot copy {}", entry.path().display()))?;
        }
    }
    Ok(())
}
