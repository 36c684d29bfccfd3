//! `config.json` for the three model types this engine runs (model-spec.md §1.2 and §4):
//! `qwen3_5_moe` (multimodal wrapper, nested `text_config`), `qwen3_5_moe_text` (flat) and
//! `qwen3_next` (flat, fused GDN projections, per-expert tensors). Every dimension comes from the file.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{bail, Context, Result};
use serde_json::{Map, Value};

/// Architecture family: decides tensor names and the GDN projection layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// Qwen3.5 / Qwen3.6 MoE: split `in_proj_qkv/z/b/a`, fused `experts.gate_up_proj`.
    Qwen35Moe,
    /// Qwen3-Next: fused `in_proj_qkvz` / `in_proj_ba` grouped by key head.
    Qwen3Next,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerKind {
    /// Gated DeltaNet ("linear_attention").
    GatedDeltaNet,
    /// Gated full attention ("full_attention").
    Attention,
}

/// MLX affine quantisation settings (`quantization` in config.json, model-spec.md §5.2).
#[derive(Clone, Debug, PartialEq)]
pub struct QuantSpec {
    pub bits: u32,
    pub group_size: usize,
    /// Per-module overrides keyed by canonical module path (see [`canonical_name`]).
    pub overrides: HashMap<String, (u32, usize)>,
}

impl QuantSpec {
    /// Bits and group size for the module at canonical path `module`.
    pub fn for_module(&self, module: &str) -> (u32, usize) {
        self.overrides
            .get(module)
            .copied()
            .unwrap_or((self.bits, self.group_size))
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub family: Family,
    /// The `model_type` string the config was read as.
    pub model_type: String,
    pub hidden_size: usize,
    pub vocab_size: usize,
    pub layers: Vec<LayerKind>,
    pub rms_norm_eps: f32,
    pub tie_word_embeddings: bool,
    pub max_position_embeddings: usize,
    // Gated attention.
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rotary_dim: usize,
    pub rope_theta: f64,
    // Gated DeltaNet.
    pub linear_num_key_heads: usize,
    pub linear_num_value_heads: usize,
    pub linear_key_head_dim: usize,
    pub linear_value_head_dim: usize,
    pub conv_kernel: usize,
    // Sparse MoE.
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    pub moe_intermediate_size: usize,
    pub shared_expert_intermediate_size: usize,
    pub norm_topk_prob: bool,
    /// Present for MLX-quantised checkpoints.
    pub quantization: Option<QuantSpec>,
}

/// Reads typed fields out of one JSON object, naming the full field path in every error.
struct Fields<'a> {
    obj: &'a Map<String, Value>,
    prefix: &'a str,
}

impl<'a> Fields<'a> {
    fn name(&self, key: &str) -> String {
        format!("{}{}", self.prefix, key)
    }
    fn get(&self, key: &str) -> Option<&'a Value> {
        self.obj.get(key).filter(|v| !v.is_null())
    }
    fn usize(&self, key: &str) -> Result<usize> {
        match self.get(key) {
            None => bail!("config.json: field \"{}\" is missing", self.name(key)),
            Some(v) => match v.as_u64() {
                Some(n) if n > 0 => Ok(n as usize),
                _ => bail!(
                    "config.json: field \"{}\" must be a positive integer, got {v}",
                    self.name(key)
                ),
            },
        }
    }
    fn usize_or(&self, key: &str, default: usize) -> Result<usize> {
        if self.get(key).is_some() {
            self.usize(key)
        } else {
            Ok(default)
        }
    }
    fn f64_or(&self, key: &str, default: f64) -> Result<f64> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => match v.as_f64() {
                Some(x) if x.is_finite() && x > 0.0 => Ok(x),
                _ => bail!(
                    "config.json: field \"{}\" must be a positive number, got {v}",
                    self.name(key)
                ),
            },
        }
    }
    fn bool_or(&self, key: &str, default: bool) -> Result<bool> {
        match self.get(key) {
            None => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(v) => bail!(
                "config.json: field \"{}\" must be true or false, got {v}",
                self.name(key)
            ),
        }
    }
}

impl ModelConfig {
    /// Reads `DIR/config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        Self::from_json_str(&text).with_context(|| format!("in {}", path.display()))
    }

    pub fn from_json_str(text: &str) -> Result<Self> {
        let root: Value = serde_json::from_str(text).context("config.json is not valid JSON")?;
        let root = root
            .as_object()
            .context("config.json must hold a JSON object")?;
        let model_type = root
            .get("model_type")
            .and_then(Value::as_str)
            .context("config.json: field \"model_type\" is missing or not a string")?;
        let (family, text_obj, prefix) = match model_type {
            "qwen3_5_moe" => match root.get("text_config") {
                Some(Value::Object(tc)) => (Family::Qwen35Moe, tc, "text_config."),
                // mlx-lm accepts a flat qwen3_5_moe dict as the text config itself (model-spec §8.3).
                None => (Family::Qwen35Moe, root, ""),
                Some(_) => bail!("config.json: field \"text_config\" must be an object"),
            },
            "qwen3_5_moe_text" => (Family::Qwen35Moe, root, ""),
            "qwen3_next" => (Family::Qwen3Next, root, ""),
            other => bail!(
                "config.json: model_type \"{other}\" is not supported \
                 (expected qwen3_5_moe, qwen3_5_moe_text or qwen3_next)"
            ),
        };
        let f = Fields {
            obj: text_obj,
            prefix,
        };

        let num_layers = f.usize("num_hidden_layers")?;
        let layers = parse_layer_kinds(&f, num_layers)?;

        let hidden_size = f.usize("hidden_size")?;
        let num_attention_heads = f.usize("num_attention_heads")?;
        let head_dim = f.usize_or("head_dim", hidden_size / num_attention_heads)?;

        // rope settings: newer configs nest them in rope_parameters, older ones keep them flat.
        let rope_obj = match text_obj
            .get("rope_parameters")
            .or(text_obj.get("rope_scaling"))
        {
            Some(Value::Object(o)) => Some(o),
            _ => None,
        };
        let rope_prefix = format!("{prefix}rope_parameters.");
        let rope_fields = rope_obj.map(|o| Fields {
            obj: o,
            prefix: &rope_prefix,
        });
        if let Some(rf) = &rope_fields {
            if let Some(kind) = rf.get("rope_type").and_then(Value::as_str) {
                if kind != "default" {
                    bail!(
                        "config.json: field \"{}rope_type\" = \"{kind}\" is not supported (only \"default\")",
                        rope_prefix
                    );
                }
            }
        }
        let rope_theta = match &rope_fields {
            Some(rf) if rf.get("rope_theta").is_some() => rf.f64_or("rope_theta", 1e7)?,
            _ => f.f64_or("rope_theta", 1e7)?,
        };
        let partial = match &rope_fields {
            Some(rf) if rf.get("partial_rotary_factor").is_some() => {
                rf.f64_or("partial_rotary_factor", 0.25)?
            }
            _ => f.f64_or("partial_rotary_factor", 0.25)?,
        };
        let rotary_dim = (head_dim as f64 * partial) as usize;

        let (norm_topk_prob, decoder_sparse_step) = match family {
            // Qwen3.5-MoE always renormalises the top-k weights (model-spec §1.2).
            Family::Qwen35Moe => (true, 1),
            Family::Qwen3Next => (
                f.bool_or("norm_topk_prob", true)?,
                f.usize_or("decoder_sparse_step", 1)?,
            ),
        };
        if decoder_sparse_step != 1 {
            bail!(
                "config.json: field \"{prefix}decoder_sparse_step\" = {decoder_sparse_step} is not supported (every layer must be MoE)"
            );
        }
        if let Some(Value::Array(a)) = text_obj.get("mlp_only_layers") {
            if !a.is_empty() {
                bail!("config.json: field \"{prefix}mlp_only_layers\" must be empty (dense MLP layers are not supported)");
            }
        }
        if let Some(act) = text_obj.get("hidden_act").and_then(Value::as_str) {
            if act != "silu" {
                bail!("config.json: field \"{prefix}hidden_act\" = \"{act}\" is not supported (only silu)");
            }
        }

        let tie = match f.get("tie_word_embeddings") {
            Some(_) => f.bool_or("tie_word_embeddings", false)?,
            None => Fields {
                obj: root,
                prefix: "",
            }
            .bool_or("tie_word_embeddings", false)?,
        };

        let cfg = ModelConfig {
            family,
            model_type: model_type.to_string(),
            hidden_size,
            vocab_size: f.usize("vocab_size")?,
            layers,
            rms_norm_eps: f.f64_or("rms_norm_eps", 1e-6)? as f32,
            tie_word_embeddings: tie,
            max_position_embeddings: f.usize_or("max_position_embeddings", 262_144)?,
            num_attention_heads,
            num_key_value_heads: f.usize("num_key_value_heads")?,
            head_dim,
            rotary_dim,
            rope_theta,
            linear_num_key_heads: f.usize("linear_num_key_heads")?,
            linear_num_value_heads: f.usize("linear_num_value_heads")?,
            linear_key_head_dim: f.usize("linear_key_head_dim")?,
            linear_value_head_dim: f.usize("linear_value_head_dim")?,
            conv_kernel: f.usize_or("linear_conv_kernel_dim", 4)?,
            num_experts: f.usize("num_experts")?,
            num_experts_per_tok: f.usize("num_experts_per_tok")?,
            moe_intermediate_size: f.usize("moe_intermediate_size")?,
            shared_expert_intermediate_size: f.usize("shared_expert_intermediate_size")?,
            norm_topk_prob,
            quantization: parse_quantization(root)?,
        };
        cfg.check_consistency(prefix)?;
        Ok(cfg)
    }

    fn check_consistency(&self, p: &str) -> Result<()> {
        let mut problems = Vec::new();
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            problems.push(format!(
                "\"{p}num_attention_heads\" ({}) must be a multiple of \"{p}num_key_value_heads\" ({})",
                self.num_attention_heads, self.num_key_value_heads
            ));
        }
        if !self
            .linear_num_value_heads
            .is_multiple_of(self.linear_num_key_heads)
        {
            problems.push(format!(
                "\"{p}linear_num_value_heads\" ({}) must be a multiple of \"{p}linear_num_key_heads\" ({})",
                self.linear_num_value_heads, self.linear_num_key_heads
            ));
        }
        if self.rotary_dim == 0
            || !self.rotary_dim.is_multiple_of(2)
            || self.rotary_dim > self.head_dim
        {
            problems.push(format!(
                "\"{p}partial_rotary_factor\" gives a rotary dimension of {} for head_dim {}: it must be even, positive and at most head_dim",
                self.rotary_dim, self.head_dim
            ));
        }
        if self.num_experts_per_tok > self.num_experts {
            problems.push(format!(
                "\"{p}num_experts_per_tok\" ({}) exceeds \"{p}num_experts\" ({})",
                self.num_experts_per_tok, self.num_experts
            ));
        }
        if self.conv_kernel < 2 {
            problems.push(format!("\"{p}linear_conv_kernel_dim\" must be at least 2"));
        }
        if !problems.is_empty() {
            bail!("config.json is inconsistent:\n  {}", problems.join("\n  "));
        }
        Ok(())
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }
    /// Width of the GDN key projection (all key heads).
    pub fn linear_key_dim(&self) -> usize {
        self.linear_num_key_heads * self.linear_key_head_dim
    }
    pub fn linear_value_dim(&self) -> usize {
        self.linear_num_value_heads * self.linear_value_head_dim
    }
    /// Channels that run through the causal conv: q | k | v.
    pub fn conv_dim(&self) -> usize {
        2 * self.linear_key_dim() + self.linear_value_dim()
    }
    pub fn attention_layers(&self) -> usize {
        self.layers
            .iter()
            .filter(|k| **k == LayerKind::Attention)
            .count()
    }
    pub fn gdn_layers(&self) -> usize {
        self.layers.len() - self.attention_layers()
    }
    /// Bytes of bf16 K and V cache per token over all attention layers.
    pub fn kv_bytes_per_token(&self) -> usize {
        self.attention_layers() * 2 * self.num_key_value_heads * self.head_dim * 2
    }
}

fn parse_layer_kinds(f: &Fields, num_layers: usize) -> Result<Vec<LayerKind>> {
    if let Some(v) = f.get("layer_types") {
        let arr = v.as_array().with_context(|| {
            format!(
                "config.json: field \"{}\" must be a list",
                f.name("layer_types")
            )
        })?;
        if arr.len() != num_layers {
            bail!(
                "config.json: field \"{}\" has {} entries but \"{}\" is {num_layers}",
                f.name("layer_types"),
                arr.len(),
                f.name("num_hidden_layers")
            );
        }
        return arr
            .iter()
            .enumerate()
            .map(|(i, t)| match t.as_str() {
                Some("linear_attention") => Ok(LayerKind::GatedDeltaNet),
                Some("full_attention") => Ok(LayerKind::Attention),
                _ => bail!(
                    "config.json: field \"{}[{i}]\" = {t} is not \"linear_attention\" or \"full_attention\"",
                    f.name("layer_types")
                ),
            })
            .collect();
    }
    let interval = f.usize_or("full_attention_interval", 4)?;
    Ok((0..num_layers)
        .map(|i| {
            if (i + 1) % interval == 0 {
                LayerKind::Attention
            } else {
                LayerKind::GatedDeltaNet
            }
        })
        .collect())
}

fn parse_quantization(root: &Map<String, Value>) -> Result<Option<QuantSpec>> {
    let q = match root.get("quantization").or(root.get("quantization_config")) {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(q)) => q,
        Some(_) => bail!("config.json: field \"quantization\" must be an object"),
    };
    let f = Fields {
        obj: q,
        prefix: "quantization.",
    };
    if let Some(mode) = q.get("mode").and_then(Value::as_str) {
        if mode != "affine" {
            bail!("config.json: field \"quantization.mode\" = \"{mode}\" is not supported (only affine)");
        }
    }
    let bits = f.usize("bits")? as u32;
    let group_size = f.usize("group_size")?;
    check_bits_group(bits, group_size, "quantization")?;
    let mut overrides = HashMap::new();
    for (key, value) in q {
        if let Value::Object(o) = value {
            let prefix = format!("quantization.{key}.");
            let of = Fields {
                obj: o,
                prefix: &prefix,
            };
            let b = of.usize_or("bits", bits as usize)? as u32;
            let g = of.usize_or("group_size", group_size)?;
            check_bits_group(b, g, &format!("quantization.{key}"))?;
            overrides.insert(canonical_name(key), (b, g));
        }
    }
    Ok(Some(QuantSpec {
        bits,
        group_size,
        overrides,
    }))
}

fn check_bits_group(bits: u32, group: usize, field: &str) -> Result<()> {
    if !matches!(bits, 4 | 8) {
        bail!("config.json: field \"{field}.bits\" = {bits} is not supported (4 or 8)");
    }
    if !matches!(group, 32 | 64 | 128) {
        bail!(
            "config.json: field \"{field}.group_size\" = {group} is not supported (32, 64 or 128)"
        );
    }
    Ok(())
}

/// Maps the tensor/module names of every supported layout onto one canonical form:
/// `model.layers.{i}.…`, `model.embed_tokens…`, `model.norm…`, `lm_head…`.
/// MLX uses `language_model.model.X`, the HF multimodal file `model.language_model.X`.
pub fn canonical_name(name: &str) -> String {
    let n = name.strip_prefix("language_model.").unwrap_or(name);
    match n.strip_prefix("model.language_model.") {
        Some(rest) => format!("model.{rest}"),
        None => n.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const REAL: &str = include_str!("../../../assets/qwen3.6-35b-a3b/config.json");

    #[test]
    fn real_config_parses_with_spec_values() {
        let c = ModelConfig::from_json_str(REAL).unwrap();
        assert_eq!(c.family, Family::Qwen35Moe);
        assert_eq!(c.hidden_size, 2048);
        assert_eq!(c.num_layers(), 40);
        assert_eq!(c.attention_layers(), 10);
        assert_eq!(c.layers[3], LayerKind::Attention);
        assert_eq!(c.layers[4], LayerKind::GatedDeltaNet);
        assert_eq!(c.rotary_dim, 64);
        assert_eq!(c.rope_theta, 1e7);
        assert_eq!(c.conv_dim(), 8192);
        assert_eq!(c.vocab_size, 248320);
        assert_eq!(c.num_experts, 256);
        assert_eq!(c.num_experts_per_tok, 8);
        assert_eq!(c.kv_bytes_per_token(), 20 * 1024);
        assert!(c.quantization.is_none());
    }

    #[test]
    fn missing_field_is_named() {
        let mut v: Value = serde_json::from_str(REAL).unwrap();
        v["text_config"]
            .as_object_mut()
            .unwrap()
            .remove("hidden_size");
        let err = ModelConfig::from_json_str(&v.to_string())
            .unwrap_err()
            .to_string();
        assert!(err.contains("text_config.hidden_size"), "{err}");
    }

    #[test]
    fn wrong_type_is_named() {
        let mut v: Value = serde_json::from_str(REAL).unwrap();
        v["text_config"]["num_experts"] = Value::String("many".into());
        let err = ModelConfig::from_json_str(&v.to_string())
            .unwrap_err()
            .to_string();
        assert!(err.contains("text_config.num_experts"), "{err}");
    }

    #[test]
    fn unsupported_model_type_is_rejected() {
        let err = ModelConfig::from_json_str(r#"{"model_type":"llama"}"#)
            .unwrap_err()
            .to_string();
        assert!(err.contains("llama"), "{err}");
    }

    #[test]
    fn inconsistent_heads_are_reported() {
        let mut v: Value = serde_json::from_str(REAL).unwrap();
        v["text_config"]["num_key_value_heads"] = 3.into();
        let err = ModelConfig::from_json_str(&v.to_string())
            .unwrap_err()
            .to_string();
        assert!(err.contains("num_key_value_heads"), "{err}");
    }

    #[test]
    fn quantization_overrides_are_canonicalised() {
        let mut v: Value = serde_json::from_str(REAL).unwrap();
        v["quantization"] = serde_json::json!({
            "group_size": 64, "bits": 4, "mode": "affine",
            "language_model.model.layers.0.mlp.gate": {"group_size": 64, "bits": 8}
        });
        let c = ModelConfig::from_json_str(&v.to_string()).unwrap();
        let q = c.quantization.unwrap();
        assert_eq!(q.for_module("model.layers.0.mlp.gate"), (8, 64));
        assert_eq!(
            q.for_module("model.layers.0.mlp.shared_expert.up_proj"),
            (4, 64)
        );
    }

    #[test]
    fn bad_quant_bits_rejected() {
        let mut v: Value = serde_json::from_str(REAL).unwrap();
        v["quantization"] = serde_json::json!({"group_size": 64, "bits": 3});
        let err = ModelConfig::from_json_str(&v.to_string())
            .unwrap_err()
            .to_string();
        assert!(err.contains("quantization.bits"), "{err}");
    }

    #[test]
    fn qwen3_next_flat_config() {
        let text = r#"{"model_type":"qwen3_next","hidden_size":128,"num_hidden_layers":4,
            "num_attention_heads":4,"num_key_value_heads":2,"head_dim":64,"vocab_size":1024,
            "linear_num_key_heads":2,"linear_num_value_heads":4,"linear_key_head_dim":64,
            "linear_value_head_dim":64,"num_experts":8,"num_experts_per_tok":2,
            "moe_intermediate_size":64,"shared_expert_intermediate_size":64,"rope_theta":10000000,
            "partial_rotary_factor":0.25,"norm_topk_prob":true,"decoder_sparse_step":1,"mlp_only_layers":[]}"#;
        let c = ModelConfig::from_json_str(text).unwrap();
        assert_eq!(c.family, Family::Qwen3Next);
        assert_eq!(c.rotary_dim, 16);
        assert_eq!(c.layers[3], LayerKind::Attention);
    }

    #[test]
    fn canonical_names() {
        assert_eq!(
            canonical_name("language_model.model.layers.3.mlp.gate"),
            "model.layers.3.mlp.gate"
        );
        assert_eq!(
            canonical_name("model.language_model.embed_tokens.weight"),
            "model.embed_tokens.weight"
        );
        assert_eq!(canonical_name("language_model.lm_head"), "lm_head");
        assert_eq!(canonical_name("lm_head.weight"), "lm_head.weight");
    }
}
