#!/usr/bin/env python3
"""A Hugging Face-layout bf16 checkpoint made from an MLX-quantised one (e.g. `osprey synth`):
every quantised tensor dequantised (scale * q + bias) to bf16, the MLX sanitize undone
(model-spec §5.4): names `model.language_model.*` and `lm_head`, each layer's
`switch_mlp.{gate,up}_proj` fused into `experts.gate_up_proj` [E, 2I, H] and `down_proj` as
`experts.down_proj`, `conv1d.weight` back to [C, 1, K], the zero-centred norms stored as w - 1.
config.json loses its quantization sections. For testing `osprey quantize` at real shapes (no
real weights here):

    osprey synth --preset qwen3.6-35b-a3b --layers 4 --out /tmp/w4
    python3 tools/hf_from_mlx.py /tmp/w4 /tmp/w4-hf          # needs mlx (CPU build is enough)
    osprey quantize --model /tmp/w4-hf --out /tmp/w4-q
    python -m mlx_lm convert --hf-path /tmp/w4-hf --mlx-path /tmp/w4-mlx -q
    python3 tools/compare_checkpoints.py /tmp/w4-q /tmp/w4-mlx
"""
import argparse
import json
import os
import shutil

import mlx.core as mx

SHIFTED = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
           ".q_norm.weight", ".k_norm.weight")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mlx_dir")
    ap.add_argument("out")
    a = ap.parse_args()
    with open(os.path.join(a.mlx_dir, "config.json")) as f:
        config = json.load(f)
    quant = config.pop("quantization")
    config.pop("quantization_config", None)
    weights = {}
    for name in sorted(os.listdir(a.mlx_dir)):
        if name.endswith(".safetensors"):
            weights.update(mx.load(os.path.join(a.mlx_dir, name)))

    out = {}
    for key in sorted(weights):
        if key.endswith((".scales", ".biases")):
            continue
        w = weights[key]
        module = key[: -len(".weight")] if key.endswith(".weight") else key
        if module + ".scales" in weights:
            spec = quant.get(module, quant)
            w = mx.dequantize(w, weights[module + ".scales"], weights[module + ".biases"],
                              group_size=spec["group_size"], bits=spec["bits"]).astype(mx.bfloat16)
            key = module + ".weight"
        elif key.endswith("conv1d.weight"):
            w = mx.swapaxes(w, 1, 2)
        elif key.endswith(SHIFTED):
            w = (w.astype(mx.float32) - 1.0).astype(mx.bfloat16)
        name = key.removeprefix("language_model.")
        name = "model.language_model." + name.removeprefix("model.") if name.startswith("model.") else name
        out[name] = w

    for key in [k for k in out if k.endswith("switch_mlp.gate_proj.weight")]:
        prefix = key[: -len("switch_mlp.gate_proj.weight")]
        gate = out.pop(key)
        up = out.pop(prefix + "switch_mlp.up_proj.weight")
        out[prefix + "experts.gate_up_proj"] = mx.concatenate([gate, up], axis=1)
        out[prefix + "experts.down_proj"] = out.pop(prefix + "switch_mlp.down_proj.weight")

    os.makedirs(a.out, exist_ok=True)
    mx.save_safetensors(os.path.join(a.out, "model.safetensors"), out, metadata={"format": "pt"})
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    for name in os.listdir(a.mlx_dir):
        if not name.endswith(".safetensors") and name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(os.path.join(a.mlx_dir, name), os.path.join(a.out, name))
    print(f"{len(out)} tensors -> {a.out}")


if __name__ == "__main__":
    main()
