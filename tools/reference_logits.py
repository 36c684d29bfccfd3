#!/usr/bin/env python3
"""Teacher-forced reference logits of an MLX checkpoint from another engine, for `osprey eval`.

Scores a fixed 192-token sequence (a fixed English passage through the checkpoint's own
tokenizer, as Lily did) with
  --engine mlx           MLX-LM on the checkpoint's own bytes (mlx_lm.load; one forward pass), or
  --engine transformers  Hugging Face transformers (Qwen3_5MoeForCausalLM, eager attention and
                         experts) with the checkpoint dequantised exactly (scale·q + bias in f32),
                         held in bfloat16 (or --dtype float32) on the GPU (or --device cpu),
and writes the logits as f32 [192, vocab] safetensors ("logits") plus the token ids as JSON.

    python3 tools/reference_logits.py --model DIR --engine mlx --out /tmp/ref-mlx
    osprey eval --model DIR --backend cuda --tokens /tmp/ref-mlx/tokens.json \
        --reference /tmp/ref-mlx/logits.safetensors --out fidelity.json

Needs: numpy, safetensors, tokenizers; mlx + mlx-lm (CUDA build) or torch + transformers >= 5.17.
"""
import argparse
import json
import os
import time

import numpy as np

POSITIONS = 192
PASSAGE = (
    "The osprey is a fish-eating bird of prey with a cosmopolitan range. It hunts by flying over "
    "open water, hovering for a moment, then plunging feet first to seize a fish near the surface. "
    "Its outer toe is reversible, so it can grasp with two toes in front and two behind, and barbed "
    "pads on its feet help it hold slippery prey. Ospreys build large nests of sticks on cliffs, "
    "trees and poles near water, returning to the same nest year after year and adding to it each "
    "season. Both parents care for the young: the female broods and shades the chicks while the "
    "male brings most of the fish. In autumn the birds of northern populations migrate thousands "
    "of kilometres to wintering grounds, following coastlines and river valleys, and young birds "
    "often stay in the south for their first two years before returning to breed. Once threatened "
    "by pesticides that thinned their eggshells, ospreys recovered across much of their range "
    "after those chemicals were banned, and artificial nesting platforms helped them return to "
    "places they had abandoned. Engineers who build tools for long tasks admire the same things: "
    "patience, precision, and the ability to carry a heavy load a long way without wasted effort."
)


def tokens_for(model_dir):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    ids = tok.encode(PASSAGE, add_special_tokens=False).ids
    if len(ids) < POSITIONS:
        raise SystemExit(f"the passage gives {len(ids)} tokens, fewer than {POSITIONS}")
    return ids[:POSITIONS]


def write_logits(path, logits):
    from safetensors.numpy import save_file

    save_file({"logits": np.ascontiguousarray(logits, dtype=np.float32)}, path)


def mlx_logits(model_dir, ids):
    import mlx.core as mx
    from mlx_lm import load

    model, _ = load(model_dir)
    x = mx.array(ids, dtype=mx.int32)[None]
    logits = model(x)
    mx.eval(logits)
    return np.array(logits[0].astype(mx.float32))


def dequantize(codes, scales, biases, bits, group):
    """MLX affine dequantisation on the GPU: codes u32 [..., K·bits/32] -> f32 [..., K]."""
    import torch

    per_word = 32 // bits
    c = codes.to(torch.int64)
    shifts = torch.arange(per_word, device=c.device, dtype=torch.int64) * bits
    q = ((c.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).reshape(*codes.shape[:-1], -1).float()
    k = q.shape[-1]
    q = q.reshape(*q.shape[:-1], k // group, group)
    w = q * scales.float().unsqueeze(-1) + biases.float().unsqueeze(-1)
    return w.reshape(*codes.shape[:-1], k)


def transformers_logits(model_dir, ids, dtype_name, device):
    import torch
    from safetensors import safe_open
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype_name]
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    text = dict(config.get("text_config", config))
    quant = config.get("quantization", config.get("quantization_config", {}))
    cfg = Qwen3_5MoeTextConfig(**{k: v for k, v in text.items() if k != "model_type"})
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    torch.set_default_dtype(dtype)
    with torch.device(device):
        model = Qwen3_5MoeForCausalLM(cfg).eval()
    torch.set_default_dtype(torch.float32)

    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    handles = [safe_open(os.path.join(model_dir, f), framework="pt", device=device) for f in files]
    where = {name: h for h in handles for name in h.keys()}

    def tensor(name):
        return where[name].get_tensor(name)

    def spec(module):
        over = quant.get(module, {})
        return over.get("bits", quant.get("bits", 4)), over.get("group_size", quant.get("group_size", 64))

    def weight(module):
        """Dense f32 weight of an MLX module (quantised or not)."""
        if module + ".scales" in where:
            bits, group = spec(module)
            return dequantize(tensor(module + ".weight"), tensor(module + ".scales"), tensor(module + ".biases"), bits, group)
        return tensor(module + ".weight").float()

    shifted = ("input_layernorm.weight", "post_attention_layernorm.weight", "model.norm.weight",
               "q_norm.weight", "k_norm.weight")
    loaded = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            mlx = "language_model." + name
            if name.endswith("experts.gate_up_proj"):
                base = mlx[: -len("experts.gate_up_proj")] + "switch_mlp."
                i = p.shape[1] // 2
                p[:, :i, :].copy_(weight(base + "gate_proj").to(dtype))
                p[:, i:, :].copy_(weight(base + "up_proj").to(dtype))
            elif name.endswith("experts.down_proj"):
                base = mlx[: -len("experts.down_proj")] + "switch_mlp."
                p.copy_(weight(base + "down_proj").to(dtype))
            elif name.endswith("conv1d.weight"):
                p.copy_(tensor(mlx).float().permute(0, 2, 1).to(dtype))  # MLX [C,K,1] -> [C,1,K]
            elif name.endswith(shifted):
                p.copy_((tensor(mlx).float() - 1.0).to(dtype))  # MLX stores the zero-centred norms as 1 + w
            elif p.dim() == 2 and name.endswith(".weight") and "norm" not in name:
                p.copy_(weight(mlx[: -len(".weight")]).to(dtype))
            else:
                p.copy_(tensor(mlx).float().to(dtype))
            loaded += 1
    print(f"transformers: {loaded} parameters loaded from {len(files)} files")
    with torch.no_grad():
        out = model(torch.tensor([ids], device=device), use_cache=False).logits[0].float()
    return out.cpu().numpy()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="MLX checkpoint directory")
    ap.add_argument("--engine", choices=["mlx", "transformers"], required=True)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="transformers only")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="transformers only")
    ap.add_argument("--out", required=True, help="output directory")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    ids = tokens_for(a.model)
    started = time.time()
    logits = mlx_logits(a.model, ids) if a.engine == "mlx" else transformers_logits(a.model, ids, a.dtype, a.device)
    if logits.shape[0] != len(ids):
        raise SystemExit(f"{a.engine} returned {logits.shape[0]} positions for {len(ids)} tokens")
    write_logits(os.path.join(a.out, "logits.safetensors"), logits)
    with open(os.path.join(a.out, "tokens.json"), "w") as f:
        json.dump(ids, f)
    print(f"{a.engine}: logits {logits.shape} in {time.time() - started:.1f} s -> {a.out}")


if __name__ == "__main__":
    main()
