#!/usr/bin/env python3
"""Builds the reference fixtures the Rust tests compare against (model-spec.md §8.2, §3.9).

For each tiny random model of this architecture (transformers' own classes, eager attention and
eager experts, no FLA / causal-conv1d kernels):
  1. re-initialise the weights with the same well-conditioned scheme as `osprey synth`
     (input projections σ = 1/√fan_in, damped output projections, perturbed norms);
  2. quantise every linear MLX-style (mlx/ops.cpp affine_quantize: codes, bf16 scales and biases;
     router and shared_expert_gate at 8 bits as mlx-lm's qwen3_5 predicate does) and write the
     checkpoint in the MLX layout (`language_model.` prefix, switch_mlp experts, conv1d [C,K,1],
     norms stored as 1 + w, `quantization` section in config.json);
  3. load the dequantised values (scale·q + bias, computed in float32) back into the torch model,
     so transformers runs exactly the weights the quantised checkpoint holds;
  4. record logits: the model in float32 (prefill of T tokens; prefill then token-by-token decode
     with the cache) and the same model cast to bfloat16 (prefill).
The released HF layout's fixture also carries an MTP head (model-spec §7: `mtp.*`, which
transformers does not run): its layer is transformers' own full-attention decoder layer, driven
as vLLM's Qwen3_5MultiTokenPredictor drives it, and its logits over the prompt's pairs are recorded.
A bf16 copy in the original Hugging Face layout (save_pretrained: fused experts, zero-centred norms,
conv1d [C,1,K]) is also written, with float32 logits of those bf16-rounded weights, and a tiny
qwen3_next model in its own HF layout.

Run:  python3 tools/make_reference.py --out fixtures/reference
Needs: transformers >= 5.17, torch, numpy, safetensors (CPU only).
"""
import argparse
import copy
import json
import os
import struct

import numpy as np
import torch
import transformers
from transformers import (Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3NextConfig,
                          Qwen3NextForCausalLM)
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as qwen35

OUTPUT_GAIN = 0.25
LOGIT_STD = 3.0
ROUTER_STD = 2.0
OUTPUT_PROJ = ("o_proj", "out_proj", "down_proj")
EIGHT_BIT = ("mlp.gate", "shared_expert_gate")


def write_safetensors(path, tensors, metadata=None):
    """tensors: name -> numpy array (uint32/float32) or torch bf16 tensor."""
    header, blobs, off = {}, [], 0
    if metadata:
        header["__metadata__"] = metadata
    for name in sorted(tensors):
        t = tensors[name]
        if isinstance(t, torch.Tensor):
            assert t.dtype == torch.bfloat16
            data = t.contiguous().view(torch.int16).numpy().tobytes()
            dtype, shape = "BF16", list(t.shape)
        elif t.dtype == np.uint32:
            data, dtype, shape = t.tobytes(), "U32", list(t.shape)
        else:
            data, dtype, shape = t.astype(np.float32).tobytes(), "F32", list(t.shape)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(data)]}
        blobs.append(data)
        off += len(data)
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def bf16_round(x):
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(torch.bfloat16).float().numpy()


def quantize(w, bits, group):
    """MLX affine quantisation of the last axis. Returns (codes u32, scales bf16, biases bf16, dequant f32)."""
    shape = w.shape
    g = w.reshape(-1, shape[-1] // group, group).astype(np.float32)
    levels = float(2 ** bits - 1)
    w_max, w_min = g.max(-1, keepdims=True), g.min(-1, keepdims=True)
    s = np.maximum((w_max - w_min) / levels, np.float32(1e-7)).astype(np.float32)
    neg = np.abs(w_min) > np.abs(w_max)
    s = np.where(neg, s, -s)
    edge = np.where(neg, w_min, w_max)
    q0 = np.rint(edge / s)
    s = np.where(q0 != 0, edge / np.where(q0 == 0, 1, q0), s).astype(np.float32)
    b = np.where(q0 == 0, 0.0, edge).astype(np.float32)
    q = np.clip(np.rint((g - b) / s), 0, levels).astype(np.uint32)
    s_bf, b_bf = bf16_round(s), bf16_round(b)
    deq = (s_bf * q.astype(np.float32) + b_bf).astype(np.float32).reshape(shape)
    per_word = 32 // bits
    qw = q.reshape(-1, shape[-1] // per_word, per_word)
    words = np.zeros(qw.shape[:-1], dtype=np.uint32)
    for n in range(per_word):
        words |= qw[..., n] << np.uint32(bits * n)
    lead = shape[:-1]
    return (words.reshape(*lead, shape[-1] // per_word),
            torch.from_numpy(s_bf.reshape(*lead, shape[-1] // group)).to(torch.bfloat16),
            torch.from_numpy(b_bf.reshape(*lead, shape[-1] // group)).to(torch.bfloat16),
            deq)


def init_weights(model, cfg, seed):
    g = torch.Generator().manual_seed(seed)
    h = cfg.hidden_size
    with torch.no_grad():
        for name, p in model.named_parameters():
            fan_in = p.shape[-1]
            if name.endswith("embed_tokens.weight"):
                p.normal_(0.0, 1.0, generator=g)
            elif name == "lm_head.weight":
                p.normal_(0.0, LOGIT_STD / h ** 0.5, generator=g)
            elif name.endswith("linear_attn.norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.normal_(0.0, 0.1, generator=g)  # zero-centred: effective scale 1 + w
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, ROUTER_STD / fan_in ** 0.5, generator=g)
            elif p.dim() >= 2 and "conv1d" not in name:
                gain = OUTPUT_GAIN if any(k in name for k in OUTPUT_PROJ) else 1.0
                p.normal_(0.0, gain / fan_in ** 0.5, generator=g)


def eager(cfg):
    """The deterministic reference paths: eager attention, eager (looped) experts."""
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    return cfg


def bf16_copy(model):
    """A bfloat16 copy whose rotary inv_freq stays float32, as in a model loaded with dtype=bf16
    (casting the buffer too would shift every RoPE angle)."""
    m = copy.deepcopy(model).to(torch.bfloat16)
    for (_, a), (_, b) in zip(model.named_modules(), m.named_modules()):
        if hasattr(a, "inv_freq"):
            b.inv_freq = a.inv_freq.clone()
            if hasattr(a, "original_inv_freq"):
                b.original_inv_freq = a.original_inv_freq.clone()
    return m


def bf16_rounded(model):
    """A float32 copy whose parameters are rounded to bf16 (buffers untouched)."""
    m = copy.deepcopy(model)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return m


def mlx_module_name(hf_module):
    # model.layers.i.X -> language_model.model.layers.i.X ; lm_head -> language_model.lm_head
    return "language_model." + hf_module


def quantize_model(model, bits, group, overrides):
    """Quantises every linear / embedding / expert stack in place (weights := dequantised values).
    Returns the MLX-layout tensors and the per-module quantisation overrides."""
    out, qcfg = {}, {}

    def spec(module):
        for suffix, bg in overrides.items():
            if module.endswith(suffix):
                return bg
        if module.endswith(EIGHT_BIT):
            return (8, 64 if group != 32 else 32)
        return (bits, group)

    def put(module, w):
        b, gs = spec(module)
        codes, s, bb, deq = quantize(w, b, gs)
        m = mlx_module_name(module)
        out[m + ".weight"], out[m + ".scales"], out[m + ".biases"] = codes, s, bb
        if (b, gs) != (bits, group):
            qcfg[m] = {"group_size": gs, "bits": b}
        return deq

    with torch.no_grad():
        for name, p in model.named_parameters():
            w = p.detach().float().numpy()
            if name.endswith("experts.gate_up_proj"):
                mod = name[: -len("experts.gate_up_proj")] + "switch_mlp"
                i = w.shape[1] // 2
                dg = put(mod + ".gate_proj", w[:, :i, :])
                du = put(mod + ".up_proj", w[:, i:, :])
                p.copy_(torch.from_numpy(np.concatenate([dg, du], axis=1)))
            elif name.endswith("experts.down_proj"):
                mod = name[: -len("experts.down_proj")] + "switch_mlp.down_proj"
                p.copy_(torch.from_numpy(put(mod, w)))
            elif p.dim() == 2 and name.endswith(".weight") and "norm" not in name:
                p.copy_(torch.from_numpy(put(name[: -len(".weight")], w)))
            elif name.endswith("conv1d.weight"):
                out[mlx_module_name(name)] = torch.from_numpy(np.ascontiguousarray(np.moveaxis(w, 2, 1))).to(torch.bfloat16)
                p.copy_(torch.from_numpy(bf16_round(w)))
            elif name.endswith("A_log"):
                out[mlx_module_name(name)] = w.astype(np.float32)
            else:
                shifted = any(name.endswith(s) for s in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                                        "model.norm.weight", "q_norm.weight", "k_norm.weight"))
                stored = bf16_round(w + 1.0 if shifted else w)
                out[mlx_module_name(name)] = torch.from_numpy(stored).to(torch.bfloat16)
                p.copy_(torch.from_numpy(stored - 1.0 if shifted else stored))
    return out, qcfg


def logits_sets(model, ids, decode_from):
    model.eval()
    with torch.no_grad():
        prefill = model(ids, use_cache=False).logits[0].float()
        out = model(ids[:, :decode_from], use_cache=True)
        cache, steps = out.past_key_values, [out.logits[0, -1].float()]
        for t in range(decode_from, ids.shape[1] - 1):
            out = model(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            steps.append(out.logits[0, -1].float())
    return prefill.numpy(), torch.stack(steps).numpy()


def qwen35_config(layers):
    return Qwen3_5MoeTextConfig(
        vocab_size=1024, hidden_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
        rms_norm_eps=1e-6, max_position_embeddings=4096, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                         "mrope_section": [3, 3, 2], "mrope_interleaved": True},
    )


def make_mlx_fixture(out_dir, name, cfg, seed, bits, group, overrides, ids, decode_from):
    torch.manual_seed(seed)
    model = Qwen3_5MoeForCausalLM(eager(cfg)).float().eval()
    init_weights(model, cfg, seed)
    tensors, qcfg = quantize_model(model, bits, group, overrides)
    d = os.path.join(out_dir, name)
    os.makedirs(d, exist_ok=True)
    write_safetensors(os.path.join(d, "model.safetensors"), tensors, {"format": "mlx"})
    text = cfg.to_dict()
    text["model_type"] = "qwen3_5_moe_text"
    quant = {"group_size": group, "bits": bits, "mode": "affine", **qcfg}
    config = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
              "tie_word_embeddings": False, "text_config": text,
              "quantization": quant, "quantization_config": quant}
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config, f, indent=2, default=str)
    f32_prefill, f32_decode = logits_sets(model, ids, decode_from)
    bf_prefill, _ = logits_sets(bf16_copy(model), ids, decode_from)
    return model, {"f32_prefill": f32_prefill, "f32_decode": f32_decode, "bf16_prefill": bf_prefill}


def make_hf_fixture(out_dir, name, model, ids, decode_from, original_layout, mtp=None):
    """The same weights rounded to bf16 in a Hugging Face layout: either the released checkpoint's
    (`model.language_model.*`, fused `experts.gate_up_proj`, nested multimodal config), or whatever
    transformers' save_pretrained writes (per-expert tensors for qwen3_next)."""
    d = os.path.join(out_dir, name)
    model = bf16_rounded(model)
    saved = bf16_copy(model)
    if original_layout:
        os.makedirs(d, exist_ok=True)
        tensors = {}
        for k, v in saved.state_dict().items():
            key = "model.language_model." + k[len("model."):] if k.startswith("model.") else k
            tensors[key] = v.detach().to(torch.bfloat16).contiguous()
        for k, v in (mtp.state_dict().items() if mtp is not None else []):
            tensors["mtp." + k] = v.detach().to(torch.bfloat16).contiguous()
        write_safetensors(os.path.join(d, "model.safetensors"), tensors, {"format": "pt"})
        text = saved.config.to_dict()
        text["model_type"] = "qwen3_5_moe_text"
        config = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
                  "tie_word_embeddings": False, "text_config": text}
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(config, f, indent=2, default=str)
    else:
        saved.save_pretrained(d)
    f32_prefill, f32_decode = logits_sets(model, ids, decode_from)
    r = {"f32_prefill": f32_prefill, "f32_decode": f32_decode}
    if mtp is not None:
        r["mtp"] = mtp_logits(model, mtp, ids)
    return r


class MtpHead(torch.nn.Module):
    """model-spec §7: fc over [norm(embedding of the next token), norm(final-normed hidden)], one
    full-attention decoder layer with its MoE, a final norm, the main model's lm_head."""

    def __init__(self, cfg):
        super().__init__()
        h = cfg.hidden_size
        self.fc = torch.nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = qwen35.Qwen3_5MoeRMSNorm(h, eps=cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = qwen35.Qwen3_5MoeRMSNorm(h, eps=cfg.rms_norm_eps)
        attention = cfg.layer_types.index("full_attention")
        self.layers = torch.nn.ModuleList([qwen35.Qwen3_5MoeDecoderLayer(cfg, attention)])
        self.norm = qwen35.Qwen3_5MoeRMSNorm(h, eps=cfg.rms_norm_eps)

    def forward(self, model, hidden, followers):
        """hidden [1, n, h]: the main model's final-normed states at positions 0..n-1;
        followers [1, n]: the token after each. Logits [n, vocab] for the token after each
        follower, the layer at positions 0..n-1 (vLLM's convention)."""
        e = self.pre_fc_norm_embedding(model.model.embed_tokens(followers))
        u = self.fc(torch.cat([e, self.pre_fc_norm_hidden(hidden)], dim=-1))
        n = followers.shape[1]
        positions = torch.arange(n)
        mask = qwen35.create_causal_mask(config=model.config, inputs_embeds=u, attention_mask=None,
                                         cache=None, position_ids=positions[None])
        rope = model.model.rotary_emb(u, positions.view(1, 1, -1).expand(3, 1, -1))
        u = self.layers[0](u, position_embeddings=rope, attention_mask=mask, position_ids=positions[None])
        return model.lm_head(self.norm(u))[0].float()


def add_mtp_head(model, cfg, seed):
    """An MTP head initialised as the layers are, its weights rounded to bf16 (the HF fixture's)."""
    torch.manual_seed(seed)
    head = MtpHead(eager(cfg)).float().eval()
    init_weights(head, cfg, seed)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return head


def mtp_logits(model, head, ids):
    with torch.no_grad():
        hidden = model.model(ids[:, :-1]).last_hidden_state
        return head(model, hidden, ids[:, 1:]).numpy()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="fixtures/reference")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    rng = np.random.default_rng(1234)
    T, decode_from = 100, 70  # T > 64 and not a multiple of 64: two GDN chunks, one partial
    ids = torch.from_numpy(rng.integers(0, 1024, size=(1, T))).long()
    results = {"tokens": ids[0].numpy().astype(np.float32)}
    manifest = {"transformers": transformers.__version__, "torch": torch.__version__,
                "tokens": T, "decode_from": decode_from, "fixtures": {}}

    cfg = qwen35_config(8)
    model, r = make_mlx_fixture(args.out, "qwen35_q4g64", cfg, 11, 4, 64, {}, ids, decode_from)
    results.update({f"qwen35_q4g64.{k}": v for k, v in r.items()})
    manifest["fixtures"]["qwen35_q4g64"] = "MLX 4-bit g64, router/shared gate 8-bit, 8 layers"
    head = add_mtp_head(model, cfg, 14)
    r = make_hf_fixture(args.out, "qwen35_hf_bf16", model, ids, decode_from, True, head)
    results.update({f"qwen35_hf_bf16.{k}": v for k, v in r.items()})
    manifest["fixtures"]["qwen35_hf_bf16"] = "same weights rounded to bf16, the released HF layout (fused experts, model.language_model.*), with an MTP head (mtp.*; logits of its pairs over the prompt: qwen35_hf_bf16.mtp)"

    overrides = {"mlp.switch_mlp.gate_proj": (4, 128), "self_attn.o_proj": (4, 32)}
    _, r = make_mlx_fixture(args.out, "qwen35_q8g32_mixed", qwen35_config(4), 12, 8, 32, overrides, ids, decode_from)
    results.update({f"qwen35_q8g32_mixed.{k}": v for k, v in r.items()})
    manifest["fixtures"]["qwen35_q8g32_mixed"] = "MLX 8-bit g32 default, experts' gate 4-bit g128, o_proj 4-bit g32"

    ncfg = Qwen3NextConfig(
        vocab_size=1024, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6,
        tie_word_embeddings=False, partial_rotary_factor=0.25,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    )
    torch.manual_seed(13)
    nmodel = Qwen3NextForCausalLM(eager(ncfg)).float().eval()
    init_weights(nmodel, ncfg, 13)
    r = make_hf_fixture(args.out, "qwen3next_hf_bf16", nmodel, ids, decode_from, False)
    results.update({f"qwen3next_hf_bf16.{k}": v for k, v in r.items()})
    manifest["fixtures"]["qwen3next_hf_bf16"] = "tiny qwen3_next, bf16 weights, save_pretrained layout (fused qkvz/ba, per-expert tensors)"

    write_safetensors(os.path.join(args.out, "logits.safetensors"),
                      {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in results.items()})
    with open(os.path.join(args.out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=2)
    print("wrote", args.out, manifest)


if __name__ == "__main__":
    main()
