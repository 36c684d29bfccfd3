#!/usr/bin/env python3
"""Whether two safetensors checkpoints hold the same tensors, byte for byte, and the same
quantisation section in config.json: CI's check that `osprey quantize` writes what `mlx_lm convert
-q` writes for the same Hugging Face checkpoint.

    osprey quantize --model fixtures/reference/qwen35_hf_bf16 --out /tmp/osprey-q4
    python -m mlx_lm convert --hf-path fixtures/reference/qwen35_hf_bf16 --mlx-path /tmp/mlx-q4 -q
    python3 tools/compare_checkpoints.py /tmp/osprey-q4 /tmp/mlx-q4

Exit status 0 when every tensor (name, dtype, shape, bytes) and the quantisation section agree;
1 with the differences listed otherwise. Needs only the standard library.
"""
import argparse
import glob
import json
import os
import struct
import sys


def tensors(directory):
    """{name: (dtype, shape, bytes)} over every *.safetensors file of the directory."""
    out = {}
    for path in sorted(glob.glob(os.path.join(directory, "*.safetensors"))):
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
            base = 8 + n
            for name, t in header.items():
                if name == "__metadata__":
                    continue
                start, end = t["data_offsets"]
                f.seek(base + start)
                out[name] = (t["dtype"], t["shape"], f.read(end - start))
    if not out:
        sys.exit(f"{directory}: no safetensors files")
    return out


def quantization(directory):
    with open(os.path.join(directory, "config.json")) as f:
        c = json.load(f)
    return c.get("quantization"), c.get("quantization_config")


def differences(a_dir, b_dir):
    a, b = tensors(a_dir), tensors(b_dir)
    out = [f"only in {a_dir}: {n}" for n in sorted(set(a) - set(b))]
    out += [f"only in {b_dir}: {n}" for n in sorted(set(b) - set(a))]
    for name in sorted(set(a) & set(b)):
        (da, sa, ba), (db, sb, bb) = a[name], b[name]
        if (da, sa) != (db, sb):
            out.append(f"{name}: {da} {sa} vs {db} {sb}")
        elif ba != bb:
            same = sum(x == y for x, y in zip(ba, bb))
            out.append(f"{name}: {len(ba) - same} of {len(ba)} bytes differ")
    if quantization(a_dir) != quantization(b_dir):
        out.append("config.json: the quantization sections differ")
    return out, len(a)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("a")
    ap.add_argument("b")
    args = ap.parse_args()
    diffs, n = differences(args.a, args.b)
    if diffs:
        print("\n".join(diffs))
        sys.exit(1)
    print(f"{n} tensors and the quantization section identical")


if __name__ == "__main__":
    main()
