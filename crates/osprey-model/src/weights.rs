//! One in-memory layout for every supported checkpoint. The loader checks every tensor's presence,
//! dtype and shape against the config before anything runs and reports all problems at once.

use std::sync::Arc;

use anyhow::{bail, Result};
use safetensors::Dtype;

use crate::checkpoint::{Checkpoint, TensorEntry};
use crate::config::{Family, LayerKind, ModelConfig};
use crate::tensor::{Buf, FloatBuf, Linear, Matrix, MatrixData};

/// How the files stored the weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StorageLayout {
    /// MLX conversion: affine-quantised linears, norms already `1 + w`, conv1d `[C, K, 1]`.
    Mlx,
    /// Original Hugging Face files: dense floats, zero-centred norms, conv1d `[C, 1, K]`.
    HuggingFace,
}

pub struct ModelWeights {
    pub config: ModelConfig,
    pub layout: StorageLayout,
    /// `[vocab, hidden]`; rows are looked up (dequantised) per token.
    pub embed_tokens: Linear,
    /// Effective RMSNorm scale (already `1 + w`).
    pub final_norm: Vec<f32>,
    pub lm_head: Linear,
    pub layers: Vec<Layer>,
    /// The multi-token-prediction head (model-spec §7), when the checkpoint keeps it: the
    /// original bf16 release does, MLX conversions drop it.
    pub mtp: Option<MtpHead>,
}

/// One draft layer that predicts the token after next from the final-normed hidden state at a
/// position and the embedding of the token that follows it; shares `embed_tokens` and `lm_head`.
pub struct MtpHead {
    /// `[hidden, 2·hidden]` over `[norm(embedding), norm(hidden)]`.
    pub fc: Linear,
    pub norm_embedding: Vec<f32>,
    pub norm_hidden: Vec<f32>,
    /// A full-attention layer with its MoE, with its own KV cache.
    pub layer: Layer,
    /// Final norm before the shared lm_head.
    pub norm: Vec<f32>,
}

pub struct Layer {
    pub input_norm: Vec<f32>,
    pub post_attention_norm: Vec<f32>,
    pub mixer: Mixer,
    pub moe: Moe,
}

pub enum Mixer {
    GatedDeltaNet(GdnWeights),
    Attention(AttentionWeights),
}

/// Input projections of a Gated DeltaNet layer.
pub enum GdnProjections {
    /// Qwen3.5/3.6: `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`.
    Split {
        qkv: Linear,
        z: Linear,
        b: Linear,
        a: Linear,
    },
    /// Qwen3-Next: `in_proj_qkvz` and `in_proj_ba`, interleaved per key head (model-spec §4).
    Fused { qkvz: Linear, ba: Linear },
}

pub struct GdnWeights {
    pub projections: GdnProjections,
    /// Depthwise causal conv, `[conv_dim, K]`; tap `K-1` multiplies the current token.
    pub conv: Vec<f32>,
    pub dt_bias: Vec<f32>,
    pub a_log: Vec<f32>,
    /// Gated RMSNorm scale (plain γ), `[linear_value_head_dim]`.
    pub norm: Vec<f32>,
    pub out_proj: Linear,
}

pub struct AttentionWeights {
    /// Per head: `head_dim` query rows then `head_dim` gate rows.
    pub q_proj: Linear,
    pub k_proj: Linear,
    pub v_proj: Linear,
    pub o_proj: Linear,
    pub q_norm: Vec<f32>,
    pub k_norm: Vec<f32>,
}

pub struct Expert {
    pub gate: Linear,
    pub up: Linear,
    pub down: Linear,
}

pub struct Moe {
    pub router: Linear,
    pub experts: Vec<Expert>,
    pub shared: Expert,
    /// `[1, hidden]`: scalar sigmoid gate on the shared expert.
    pub shared_gate: Linear,
}

impl ModelWeights {
    /// Loads and validates `dir` (config.json plus safetensors).
    pub fn load(dir: &std::path::Path) -> Result<Self> {
        let config = ModelConfig::from_dir(dir)?;
        let checkpoint = Checkpoint::open(dir)?;
        Self::from_checkpoint(config, &checkpoint)
    }

    pub fn from_checkpoint(config: ModelConfig, ck: &Checkpoint) -> Result<Self> {
        Self::read(config, ck, false)
    }

    /// Checks that every tensor the config asks for is present with its dtype and shape, as
    /// loading does, without mapping the dense matrices; returns the checkpoint's layout.
    pub fn validate(config: ModelConfig, ck: &Checkpoint) -> Result<StorageLayout> {
        Ok(Self::read(config, ck, true)?.layout)
    }

    fn read(config: ModelConfig, ck: &Checkpoint, shapes_only: bool) -> Result<Self> {
        let mut l = Loader {
            ck,
            cfg: &config,
            problems: Vec::new(),
            shapes_only,
        };
        let layout = l.detect_layout();
        let shift = layout == StorageLayout::HuggingFace;
        let h = config.hidden_size;

        let embed_tokens = l.linear("model.embed_tokens", &[], config.vocab_size, h);
        let final_norm = l.norm("model.norm.weight", h, shift);
        let lm_head = if config.tie_word_embeddings {
            embed_tokens.clone()
        } else {
            l.linear("lm_head", &[], config.vocab_size, h)
        };
        let layers: Vec<Option<Layer>> = (0..config.num_layers())
            .map(|i| l.layer(&format!("model.layers.{i}"), config.layers[i], shift))
            .collect();
        let mtp = l.has_mtp().then(|| l.mtp(shift));

        if !l.problems.is_empty() {
            bail!(
                "checkpoint {} does not match its config.json ({} problem{}):\n  - {}",
                ck.dir.display(),
                l.problems.len(),
                if l.problems.len() == 1 { "" } else { "s" },
                l.problems.join("\n  - ")
            );
        }
        let whole = |m: Option<Arc<Matrix>>| m.map(|m| Linear::rows_of(&m, 0, m.rows));
        let missing = || anyhow::anyhow!("internal: a validated tensor is absent");
        Ok(ModelWeights {
            layout,
            embed_tokens: whole(embed_tokens).ok_or_else(missing)?,
            final_norm: final_norm.ok_or_else(missing)?,
            lm_head: whole(lm_head).ok_or_else(missing)?,
            layers: layers
                .into_iter()
                .collect::<Option<Vec<_>>>()
                .ok_or_else(missing)?,
            mtp: mtp.map(|m| m.ok_or_else(missing)).transpose()?,
            config,
        })
    }

    /// Bytes of weight storage by part, for `osprey inspect` and load reports.
    pub fn footprint(&self) -> Vec<(&'static str, usize)> {
        let mut parts = vec![
            ("embed_tokens", self.embed_tokens.matrix.storage_bytes()),
            (
                "lm_head",
                if self.config.tie_word_embeddings {
                    0
                } else {
                    self.lm_head.matrix.storage_bytes()
                },
            ),
        ];
        let once = |ls: &[&Linear]| -> usize {
            // stacked views share one matrix: count each matrix once
            let mut seen: Vec<*const Matrix> = Vec::new();
            ls.iter()
                .filter(|l| {
                    let p = Arc::as_ptr(&l.matrix);
                    let new = !seen.contains(&p);
                    seen.push(p);
                    new
                })
                .map(|l| l.matrix.storage_bytes())
                .sum()
        };
        // [gdn, attention, routed, shared, routers, small] bytes of one layer
        let layer_parts = |layer: &Layer| -> [usize; 6] {
            let mut b = [0; 6];
            b[5] = 4 * (layer.input_norm.len() + layer.post_attention_norm.len());
            match &layer.mixer {
                Mixer::GatedDeltaNet(g) => {
                    b[0] = match &g.projections {
                        GdnProjections::Split { qkv, z, b, a } => once(&[qkv, z, b, a]),
                        GdnProjections::Fused { qkvz, ba } => once(&[qkvz, ba]),
                    } + g.out_proj.matrix.storage_bytes();
                    b[5] += 4 * (g.conv.len() + g.dt_bias.len() + g.a_log.len() + g.norm.len());
                }
                Mixer::Attention(a) => {
                    b[1] = once(&[&a.q_proj, &a.k_proj, &a.v_proj, &a.o_proj]);
                    b[5] += 4 * (a.q_norm.len() + a.k_norm.len());
                }
            }
            let experts: Vec<&Linear> = layer
                .moe
                .experts
                .iter()
                .flat_map(|e| [&e.gate, &e.up, &e.down])
                .collect();
            b[2] = once(&experts);
            b[3] = once(&[
                &layer.moe.shared.gate,
                &layer.moe.shared.up,
                &layer.moe.shared.down,
            ]);
            b[4] = once(&[&layer.moe.router, &layer.moe.shared_gate]);
            b
        };
        let mut sums = [0; 6];
        for layer in &self.layers {
            for (sum, b) in sums.iter_mut().zip(layer_parts(layer)) {
                *sum += b;
            }
        }
        let [gdn, attn, routed, shared, router, small] = sums;
        parts.extend([
            ("gated deltanet projections", gdn),
            ("attention projections", attn),
            ("routed experts", routed),
            ("shared experts", shared),
            ("routers and shared-expert gates", router),
            (
                "norms, conv, decay (f32 copies)",
                small + 4 * self.final_norm.len(),
            ),
        ]);
        if let Some(m) = &self.mtp {
            let norms = 4 * (m.norm_embedding.len() + m.norm_hidden.len() + m.norm.len());
            let layer: usize = layer_parts(&m.layer).iter().sum();
            parts.push(("mtp head", m.fc.matrix.storage_bytes() + layer + norms));
        }
        parts
    }
}

struct Loader<'a> {
    ck: &'a Checkpoint,
    cfg: &'a ModelConfig,
    problems: Vec<String>,
    /// Check names, dtypes and shapes only: dense matrices are not mapped (a misaligned one
    /// would be copied, the whole model's worth for a file written without padding).
    shapes_only: bool,
}

fn is_float(d: Dtype) -> bool {
    matches!(d, Dtype::BF16 | Dtype::F16 | Dtype::F32)
}

impl Loader<'_> {
    fn detect_layout(&mut self) -> StorageLayout {
        let k = self.cfg.conv_kernel;
        let first_gdn = self
            .cfg
            .layers
            .iter()
            .position(|t| *t == LayerKind::GatedDeltaNet);
        if let Some(i) = first_gdn {
            if let Some(e) = self
                .ck
                .get(&format!("model.layers.{i}.linear_attn.conv1d.weight"))
            {
                if e.shape.len() == 3 && e.shape[1] == 1 && e.shape[2] == k {
                    return StorageLayout::HuggingFace;
                }
                return StorageLayout::Mlx;
            }
        }
        // No GDN layer to tell by: quantised files are MLX conversions.
        if self.cfg.quantization.is_some() {
            StorageLayout::Mlx
        } else {
            StorageLayout::HuggingFace
        }
    }

    /// The entry `name`, checked against `shape` and a dtype predicate; records a problem otherwise.
    fn entry(
        &mut self,
        name: &str,
        shape: &[usize],
        dtype_ok: fn(Dtype) -> bool,
        want: &str,
    ) -> Option<TensorEntry> {
        let Some(e) = self.ck.get(name) else {
            self.problems
                .push(format!("{name}: missing (expected {want} {shape:?})"));
            return None;
        };
        let mut ok = true;
        if !dtype_ok(e.dtype) {
            self.problems
                .push(format!("{name}: dtype {:?}, expected {want}", e.dtype));
            ok = false;
        }
        if e.shape != shape {
            self.problems
                .push(format!("{name}: shape {:?}, expected {shape:?}", e.shape));
            ok = false;
        }
        ok.then(|| e.clone())
    }

    fn float_buf(&self, e: &TensorEntry) -> FloatBuf {
        let map = &self.ck.maps[e.file];
        let n = e.shape.iter().product();
        match e.dtype {
            Dtype::BF16 => FloatBuf::Bf16(Buf::mapped(map, e.start, n)),
            Dtype::F16 => FloatBuf::F16(Buf::mapped(map, e.start, n)),
            _ => FloatBuf::F32(Buf::mapped(map, e.start, n)),
        }
    }

    /// A dense matrix's values (none when only shapes are checked).
    fn dense_buf(&self, e: &TensorEntry) -> FloatBuf {
        if self.shapes_only {
            FloatBuf::F32(Buf::owned(Vec::new()))
        } else {
            self.float_buf(e)
        }
    }

    fn vector(&mut self, name: &str, len: usize) -> Option<Vec<f32>> {
        let e = self.entry(name, &[len], is_float, "bf16/f16/f32")?;
        Some(self.float_buf(&e).to_f32_vec())
    }

    /// A zero-centred RMSNorm weight as its effective scale: `1 + w` for raw HF files.
    fn norm(&mut self, name: &str, len: usize, shift: bool) -> Option<Vec<f32>> {
        let mut v = self.vector(name, len)?;
        if shift {
            v.iter_mut().for_each(|x| *x += 1.0);
        }
        Some(v)
    }

    /// A linear module `[lead…, rows, cols]`, quantised (`.weight` u32 + `.scales` + `.biases`)
    /// or dense (`.weight`); stacks are flattened to `[prod(lead)·rows, cols]`.
    fn linear(
        &mut self,
        module: &str,
        lead: &[usize],
        rows: usize,
        cols: usize,
    ) -> Option<Arc<Matrix>> {
        let total_rows = lead.iter().product::<usize>() * rows;
        let shape = |last: usize| [lead, &[rows, last]].concat();
        if self.ck.get(&format!("{module}.scales")).is_some() {
            let Some(q) = &self.cfg.quantization else {
                self.problems.push(format!(
                    "{module}: stored quantised but config.json has no \"quantization\" section"
                ));
                return None;
            };
            let (bits, group) = q.for_module(module);
            if !cols.is_multiple_of(group) {
                self.problems.push(format!(
                    "{module}: {cols} columns is not a multiple of group size {group}"
                ));
                return None;
            }
            let codes = self.entry(
                &format!("{module}.weight"),
                &shape(cols * bits as usize / 32),
                |d| d == Dtype::U32,
                &format!("u32 ({bits}-bit codes)"),
            );
            let scales = self.entry(
                &format!("{module}.scales"),
                &shape(cols / group),
                is_float,
                "bf16/f16/f32",
            );
            let biases = self.entry(
                &format!("{module}.biases"),
                &shape(cols / group),
                is_float,
                "bf16/f16/f32",
            );
            let (codes, scales, biases) = (codes?, scales?, biases?);
            let map = &self.ck.maps[codes.file];
            let n_words = codes.byte_len / 4;
            return Some(Arc::new(Matrix {
                rows: total_rows,
                cols,
                data: MatrixData::Quantized {
                    bits,
                    group,
                    codes: Buf::mapped(map, codes.start, n_words),
                    scales: self.float_buf(&scales),
                    biases: self.float_buf(&biases),
                },
            }));
        }
        let e = self.entry(
            &format!("{module}.weight"),
            &shape(cols),
            is_float,
            "bf16/f16/f32",
        )?;
        Some(Arc::new(Matrix {
            rows: total_rows,
            cols,
            data: MatrixData::Dense(self.dense_buf(&e)),
        }))
    }

    /// A dense tensor stored without a `.weight` suffix (HF fused experts).
    fn dense_stack(&mut self, name: &str, shape: &[usize]) -> Option<Arc<Matrix>> {
        let e = self.entry(name, shape, is_float, "bf16/f16/f32")?;
        let cols = *shape.last()?;
        let rows = shape.iter().product::<usize>() / cols;
        Some(Arc::new(Matrix {
            rows,
            cols,
            data: MatrixData::Dense(self.dense_buf(&e)),
        }))
    }

    /// A decoder layer stored under `p` (`model.layers.N`, or `mtp.layers.0` for the draft layer).
    fn layer(&mut self, p: &str, kind: LayerKind, shift: bool) -> Option<Layer> {
        let h = self.cfg.hidden_size;
        let input_norm = self.norm(&format!("{p}.input_layernorm.weight"), h, shift);
        let post_attention_norm =
            self.norm(&format!("{p}.post_attention_layernorm.weight"), h, shift);
        let mixer = match kind {
            LayerKind::GatedDeltaNet => self.gdn(p).map(Mixer::GatedDeltaNet),
            LayerKind::Attention => self.attention(p, shift).map(Mixer::Attention),
        };
        let moe = self.moe(p);
        Some(Layer {
            input_norm: input_norm?,
            post_attention_norm: post_attention_norm?,
            mixer: mixer?,
            moe: moe?,
        })
    }

    /// Whether the checkpoint keeps an MTP head (its `fc`, dense or quantised); once it has
    /// one, every other MTP tensor must be there too.
    fn has_mtp(&self) -> bool {
        self.ck.get("mtp.fc.weight").is_some()
    }

    fn mtp(&mut self, shift: bool) -> Option<MtpHead> {
        let h = self.cfg.hidden_size;
        let whole = |m: Option<Arc<Matrix>>| m.map(|m| Linear::rows_of(&m, 0, m.rows));
        let fc = whole(self.linear("mtp.fc", &[], h, 2 * h));
        let norm_embedding = self.norm("mtp.pre_fc_norm_embedding.weight", h, shift);
        let norm_hidden = self.norm("mtp.pre_fc_norm_hidden.weight", h, shift);
        let layer = self.layer("mtp.layers.0", LayerKind::Attention, shift);
        let norm = self.norm("mtp.norm.weight", h, shift);
        Some(MtpHead {
            fc: fc?,
            norm_embedding: norm_embedding?,
            norm_hidden: norm_hidden?,
            layer: layer?,
            norm: norm?,
        })
    }

    fn gdn(&mut self, p: &str) -> Option<GdnWeights> {
        let c = self.cfg;
        let h = c.hidden_size;
        let (kd, vd, hv) = (
            c.linear_key_dim(),
            c.linear_value_dim(),
            c.linear_num_value_heads,
        );
        let whole = |m: Option<Arc<Matrix>>| m.map(|m| Linear::rows_of(&m, 0, m.rows));
        let projections = match c.family {
            Family::Qwen35Moe => {
                let qkv = whole(self.linear(
                    &format!("{p}.linear_attn.in_proj_qkv"),
                    &[],
                    c.conv_dim(),
                    h,
                ));
                let z = whole(self.linear(&format!("{p}.linear_attn.in_proj_z"), &[], vd, h));
                let b = whole(self.linear(&format!("{p}.linear_attn.in_proj_b"), &[], hv, h));
                let a = whole(self.linear(&format!("{p}.linear_attn.in_proj_a"), &[], hv, h));
                Some(GdnProjections::Split {
                    qkv: qkv?,
                    z: z?,
                    b: b?,
                    a: a?,
                })
            }
            Family::Qwen3Next => {
                let qkvz = whole(self.linear(
                    &format!("{p}.linear_attn.in_proj_qkvz"),
                    &[],
                    2 * kd + 2 * vd,
                    h,
                ));
                let ba = whole(self.linear(&format!("{p}.linear_attn.in_proj_ba"), &[], 2 * hv, h));
                Some(GdnProjections::Fused {
                    qkvz: qkvz?,
                    ba: ba?,
                })
            }
        };
        let conv_name = format!("{p}.linear_attn.conv1d.weight");
        let (cd, k) = (c.conv_dim(), c.conv_kernel);
        // [C,1,K] (HF) and [C,K,1] (MLX) are the same bytes: channel-major, tap-minor.
        let conv = match self.ck.get(&conv_name).map(|e| e.shape.clone()) {
            Some(s) if s == [cd, k, 1] => {
                self.entry(&conv_name, &[cd, k, 1], is_float, "bf16/f16/f32")
            }
            _ => self.entry(&conv_name, &[cd, 1, k], is_float, "bf16/f16/f32"),
        }
        .map(|e| self.float_buf(&e).to_f32_vec());
        let dt_bias = self.vector(&format!("{p}.linear_attn.dt_bias"), hv);
        let a_log = self.vector(&format!("{p}.linear_attn.A_log"), hv);
        let norm = self.vector(
            &format!("{p}.linear_attn.norm.weight"),
            c.linear_value_head_dim,
        );
        let out_proj = whole(self.linear(&format!("{p}.linear_attn.out_proj"), &[], h, vd));
        Some(GdnWeights {
            projections: projections?,
            conv: conv?,
            dt_bias: dt_bias?,
            a_log: a_log?,
            norm: norm?,
            out_proj: out_proj?,
        })
    }

    fn attention(&mut self, p: &str, shift: bool) -> Option<AttentionWeights> {
        let c = self.cfg;
        let h = c.hidden_size;
        let (hq, hkv, d) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let whole = |m: Option<Arc<Matrix>>| m.map(|m| Linear::rows_of(&m, 0, m.rows));
        let q_proj = whole(self.linear(&format!("{p}.self_attn.q_proj"), &[], 2 * hq * d, h));
        let k_proj = whole(self.linear(&format!("{p}.self_attn.k_proj"), &[], hkv * d, h));
        let v_proj = whole(self.linear(&format!("{p}.self_attn.v_proj"), &[], hkv * d, h));
        let o_proj = whole(self.linear(&format!("{p}.self_attn.o_proj"), &[], h, hq * d));
        let q_norm = self.norm(&format!("{p}.self_attn.q_norm.weight"), d, shift);
        let k_norm = self.norm(&format!("{p}.self_attn.k_norm.weight"), d, shift);
        Some(AttentionWeights {
            q_proj: q_proj?,
            k_proj: k_proj?,
            v_proj: v_proj?,
            o_proj: o_proj?,
            q_norm: q_norm?,
            k_norm: k_norm?,
        })
    }

    fn moe(&mut self, p: &str) -> Option<Moe> {
        let c = self.cfg;
        let (h, e, i, is) = (
            c.hidden_size,
            c.num_experts,
            c.moe_intermediate_size,
            c.shared_expert_intermediate_size,
        );
        let whole = |m: Option<Arc<Matrix>>| m.map(|m| Linear::rows_of(&m, 0, m.rows));
        let router = whole(self.linear(&format!("{p}.mlp.gate"), &[], e, h));
        let shared = (
            whole(self.linear(&format!("{p}.mlp.shared_expert.gate_proj"), &[], is, h)),
            whole(self.linear(&format!("{p}.mlp.shared_expert.up_proj"), &[], is, h)),
            whole(self.linear(&format!("{p}.mlp.shared_expert.down_proj"), &[], h, is)),
        );
        let shared_gate = whole(self.linear(&format!("{p}.mlp.shared_expert_gate"), &[], 1, h));
        let has = |name: String| self.ck.get(&name).is_some();
        let experts: Option<Vec<Expert>> = if has(format!("{p}.mlp.switch_mlp.gate_proj.weight")) {
            let g = self.linear(&format!("{p}.mlp.switch_mlp.gate_proj"), &[e], i, h);
            let u = self.linear(&format!("{p}.mlp.switch_mlp.up_proj"), &[e], i, h);
            let d = self.linear(&format!("{p}.mlp.switch_mlp.down_proj"), &[e], h, i);
            let (g, u, d) = (g?, u?, d?);
            Some(
                (0..e)
                    .map(|x| Expert {
                        gate: Linear::rows_of(&g, x * i, i),
                        up: Linear::rows_of(&u, x * i, i),
                        down: Linear::rows_of(&d, x * h, h),
                    })
                    .collect(),
            )
        } else if has(format!("{p}.mlp.experts.gate_up_proj")) {
            let gu = self.dense_stack(&format!("{p}.mlp.experts.gate_up_proj"), &[e, 2 * i, h]);
            let d = self.dense_stack(&format!("{p}.mlp.experts.down_proj"), &[e, h, i]);
            let (gu, d) = (gu?, d?);
            Some(
                (0..e)
                    .map(|x| Expert {
                        gate: Linear::rows_of(&gu, x * 2 * i, i),
                        up: Linear::rows_of(&gu, x * 2 * i + i, i),
                        down: Linear::rows_of(&d, x * h, h),
                    })
                    .collect(),
            )
        } else if has(format!("{p}.mlp.experts.0.gate_proj.weight")) {
            (0..e)
                .map(|x| {
                    let q = format!("{p}.mlp.experts.{x}");
                    let g = whole(self.linear(&format!("{q}.gate_proj"), &[], i, h));
                    let u = whole(self.linear(&format!("{q}.up_proj"), &[], i, h));
                    let d = whole(self.linear(&format!("{q}.down_proj"), &[], h, i));
                    Some(Expert {
                        gate: g?,
                        up: u?,
                        down: d?,
                    })
                })
                .collect()
        } else {
            self.problems.push(format!(
                "{p}.mlp: no routed-expert weights (looked for switch_mlp.*, experts.gate_up_proj and experts.0.*)"
            ));
            None
        };
        Some(Moe {
            router: router?,
            experts: experts?,
            shared: Expert {
                gate: shared.0?,
                up: shared.1?,
                down: shared.2?,
            },
            shared_gate: shared_gate?,
        })
    }
}
