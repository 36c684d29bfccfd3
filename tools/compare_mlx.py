#!/usr/bin/env python3
"""Side-by-side throughput of Osprey and MLX-LM on one GPU, same checkpoint bytes, as Lily measured
itself: the engines alternate within each round (Osprey's prefill and decode benchmarks, then
MLX-LM's, per round), the median of the rounds is reported per length, with the Osprey / MLX-LM
ratio per length and the mean ratio.

MLX-LM runs its fastest direct path: mlx_lm.stream_generate on token ids (prefill in steps of
2048, greedy decoding), whose own prompt_tps and generation_tps figures are used. Osprey runs
`osprey bench prefill|decode --backend cuda` (a fresh prefill from position 0; decode steps at the
given context as CUDA-graph replays with the token chosen on the GPU). Every MLX shape is warmed up
once before timing (MLX's CUDA build compiles kernels for each new shape on first use).

    python3 tools/compare_mlx.py --model /tmp/full --osprey target/release/osprey \
        --lengths 256,1K,4K --rounds 2 --out bench/results/compare-mlx-h200.json

Needs: mlx + mlx-cuda + mlx-lm (see README), numpy.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def parse_lengths(s):
    out = []
    for p in s.split(","):
        p = p.strip()
        out.append(int(p[:-1]) * 1024 if p[-1] in "kK" else int(p))
    return out


def osprey_bench(binary, kind, model, lengths, steps):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "r.json")
        flag = "--prompt" if kind == "prefill" else "--context"
        cmd = [binary, "bench", kind, "--backend", "cuda", "--model", model, flag,
               ",".join(str(n) for n in lengths), "--rounds", "1", "--out", path]
        if kind == "decode":
            cmd += ["--steps", str(steps)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        with open(path) as f:
            report = json.load(f)
    return {r["tokens"]: r["tokens_per_s"] for r in report["results"]}, report.get("commit")


def mlx_run(model, tokenizer, ids, steps):
    from mlx_lm import stream_generate

    last = None
    for last in stream_generate(model, tokenizer, ids, max_tokens=steps):
        pass
    return last.prompt_tps, last.generation_tps


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--osprey", required=True, help="path of the osprey binary (built with --features cuda)")
    ap.add_argument("--lengths", default="256,1K,4K")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=32, help="decode steps timed per length")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    lengths = parse_lengths(a.lengths)

    import mlx.core as mx
    import numpy as np
    from mlx_lm import load

    started = time.time()
    model, tokenizer = load(a.model)
    vocab = 248_077  # ids the real tokenizer can produce
    rng = np.random.default_rng(0)
    prompts = {n: rng.integers(0, vocab, size=n).tolist() for n in lengths}
    print(f"mlx-lm loaded in {time.time() - started:.1f} s; warming up every shape", flush=True)
    for n in lengths:
        t0 = time.time()
        mlx_run(model, tokenizer, prompts[n], a.steps)
        print(f"  warm-up {n}: {time.time() - t0:.1f} s", flush=True)

    rows = {n: {"osprey_prefill": [], "osprey_decode": [], "mlx_prefill": [], "mlx_decode": []} for n in lengths}
    commit = None
    for r in range(a.rounds):
        pre, commit = osprey_bench(a.osprey, "prefill", a.model, lengths, a.steps)
        dec, _ = osprey_bench(a.osprey, "decode", a.model, lengths, a.steps)
        for n in lengths:
            rows[n]["osprey_prefill"].append(pre[n])
            rows[n]["osprey_decode"].append(dec[n])
        for n in lengths:
            p, g = mlx_run(model, tokenizer, prompts[n], a.steps)
            rows[n]["mlx_prefill"].append(p)
            rows[n]["mlx_decode"].append(g)
        print(f"round {r + 1}/{a.rounds} done", flush=True)

    results = []
    for n in lengths:
        med = {k: statistics.median(v) for k, v in rows[n].items()}
        results.append({"tokens": n, **{k: med[k] for k in med},
                        "prefill_ratio": med["osprey_prefill"] / med["mlx_prefill"],
                        "decode_ratio": med["osprey_decode"] / med["mlx_decode"], "rounds": rows[n]})
        print(f"{n:>7}: prefill osprey {med['osprey_prefill']:>9.1f} mlx {med['mlx_prefill']:>8.1f} tok/s "
              f"({results[-1]['prefill_ratio']:.1f}x); decode osprey {med['osprey_decode']:>7.1f} "
              f"mlx {med['mlx_decode']:>6.1f} tok/s ({results[-1]['decode_ratio']:.1f}x)")
    import mlx_lm

    report = {
        "kind": "compare", "peer": f"mlx-lm {mlx_lm.__version__} (mlx {mx.__version__}, CUDA build)",
        "device": subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                 capture_output=True, text=True).stdout.strip() or "unknown",
        "commit": commit, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join(sys.argv), "model": a.model, "rounds": a.rounds, "decode_steps": a.steps,
        "method": "engines alternate within each round; median of rounds; MLX-LM prompt_tps/generation_tps "
                  "from stream_generate (greedy); Osprey bench prefill (fresh prefill) and bench decode "
                  "(CUDA-graph steps at the context length, token chosen on the GPU)",
        "mean_prefill_ratio": statistics.mean(r["prefill_ratio"] for r in results),
        "mean_decode_ratio": statistics.mean(r["decode_ratio"] for r in results),
        "results": results,
    }
    with open(a.out, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    print(f"mean ratio: prefill {report['mean_prefill_ratio']:.2f}x, decode {report['mean_decode_ratio']:.2f}x -> {a.out}")


if __name__ == "__main__":
    main()
