#!/usr/bin/env python3
"""Side-by-side throughput of Osprey and MLX-LM on one GPU, same checkpoint bytes, as Lily measured
itself: the engines alternate within each round (Osprey's prefill and decode benchmarks, then
MLX-LM's, per round), the median of the rounds is reported per length, with the Osprey / MLX-LM
ratio per length and the mean ratio.

MLX-LM runs its fastest direct path: mlx_lm.stream_generate on token ids (prefill in steps of
2048, greedy decoding), whose own prompt_tps and generation_tps figures are used. Osprey runs
`osprey bench prefill|decode --backend cuda` (a fresh prefill from position 0; decode steps at the
given context as CUDA-graph replays with the token chosen on the GPU). Every MLX shape up to
--warmup-max tokens is warmed up once before timing (MLX's CUDA build compiles kernels for each new
shape on first use); longer prompts run in the same 2048-token steps as a --warmup-max prompt, so
that one warm-up covers their kernels (a long prompt's own warm-up would double the run: MLX-LM
prefills at ~230 tok/s here, 128K takes ~10 minutes).

    python3 tools/compare_mlx.py --model /tmp/full --osprey target/release/osprey \
        --lengths 256,1K,4K --rounds 2 --out bench/results/compare-mlx-h200.json

Runs of different lengths (on different GPUs, or in different sessions) are joined into one report,
which also writes the MLX-LM side as peer results for `osprey chart`:

    python3 tools/compare_mlx.py --merge short.json long.json --out bench/results/compare-mlx-h200.json \
        --peer-dir bench/results

Osprey moves faster than MLX-LM's wheels do, and MLX-LM at long lengths takes most of a loan. So a
report's MLX-LM side can be set against Osprey's latest committed sweeps (same GPU kind, same
checkpoint bytes, same MLX-LM wheels; not alternated, which only matters within the few percent one
loan differs from the next):

    python3 tools/compare_mlx.py --restate bench/results/compare-mlx-h200.json \
        --prefill bench/results/cuda-prefill-full.json --decode bench/results/cuda-decode-full.json \
        --out bench/results/compare-mlx-h200-latest.json

Needs: mlx + mlx-cuda + mlx-lm (see README), numpy (neither for --merge or --restate).
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


def summarise(rows):
    """One result row per length from its per-round figures: medians and the two ratios."""
    med = {k: statistics.median(v) for k, v in rows.items()}
    return {**med, "prefill_ratio": med["osprey_prefill"] / med["mlx_prefill"],
            "decode_ratio": med["osprey_decode"] / med["mlx_decode"], "rounds": rows}


def with_means(report, results):
    report["mean_prefill_ratio"] = statistics.mean(r["prefill_ratio"] for r in results)
    report["mean_decode_ratio"] = statistics.mean(r["decode_ratio"] for r in results)
    report["results"] = results
    return report


def merge(paths, out, peer_dir):
    """Joins compare reports of disjoint lengths; each row keeps the commit, date and command it came from."""
    parts = []
    for p in paths:
        with open(p) as f:
            parts.append(json.load(f))
    by_tokens = {}
    for part in parts:
        if part.get("kind") != "compare":
            sys.exit(f"{part}: not a compare report")
        for r in part["results"]:
            if r["tokens"] in by_tokens:
                sys.exit(f"length {r['tokens']} appears in more than one input; merge disjoint runs")
            by_tokens[r["tokens"]] = {**r, "commit": r.get("commit", part["commit"]), "date": r.get("date", part["date"]),
                                      "command": r.get("command", part["command"])}
    results = [by_tokens[n] for n in sorted(by_tokens)]
    newest = max(parts, key=lambda p: p["date"])
    report = {k: newest[k] for k in ("kind", "peer", "device", "commit", "date", "decode_steps", "method")}
    report["command"] = "tools/compare_mlx.py --merge " + " ".join(paths)
    report["rounds"] = "per length, see each row's rounds"
    report["parts"] = [{"command": p["command"], "commit": p["commit"], "date": p["date"],
                        "machine": p.get("machine", "nvidia-h200"), "tokens": [r["tokens"] for r in p["results"]]}
                       for p in parts]
    with_means(report, results)
    write(report, out)
    if peer_dir:
        for kind in ("prefill", "decode"):
            peer = {"kind": kind, "backend": report["peer"], "device": report["device"],
                    "source": f"the MLX-LM side of {os.path.basename(out)} (tools/compare_mlx.py, engines alternating, "
                              "median of each length's rounds)",
                    "commit": report["commit"], "date": report["date"],
                    "results": [{"tokens": r["tokens"], "tokens_per_s": r[f"mlx_{kind}"]} for r in results]}
            write(peer, os.path.join(peer_dir, f"peer-mlxlm-{kind}-h200.json"))


def restate(compare_path, prefill_path, decode_path, out):
    """The MLX-LM side of a compare report against Osprey's sweeps: each length's ratio from the
    sweep's median and MLX-LM's median of the compare report's rounds."""
    reports = []
    for path in (compare_path, prefill_path, decode_path):
        with open(path) as f:
            reports.append(json.load(f))
    compare, prefill, decode = reports
    if compare.get("kind") != "compare" or prefill.get("kind") != "prefill" or decode.get("kind") != "decode":
        sys.exit("--restate takes a compare report, then --prefill a prefill sweep and --decode a decode sweep")
    if decode.get("sampling") is not None:
        sys.exit(f"{decode_path}: a sampled sweep; MLX-LM decoded greedily")
    for sweep in (prefill, decode):
        if sweep["device"] != compare["device"]:
            sys.exit(f"{sweep['command']}: ran on {sweep['device']}, the MLX-LM side on {compare['device']}")
    osprey = {kind: {r["tokens"]: r["tokens_per_s"] for r in sweep["results"]}
              for kind, sweep in (("prefill", prefill), ("decode", decode))}
    results = []
    for r in compare["results"]:
        n = r["tokens"]
        if n not in osprey["prefill"] or n not in osprey["decode"]:
            sys.exit(f"length {n}: missing from the Osprey sweeps")
        row = {"tokens": n, "osprey_prefill": osprey["prefill"][n], "osprey_decode": osprey["decode"][n],
               "mlx_prefill": r["mlx_prefill"], "mlx_decode": r["mlx_decode"],
               "rounds": {"mlx_prefill": r["rounds"]["mlx_prefill"], "mlx_decode": r["rounds"]["mlx_decode"]},
               "mlx_measured": r.get("date", compare["date"])}
        row["prefill_ratio"] = row["osprey_prefill"] / row["mlx_prefill"]
        row["decode_ratio"] = row["osprey_decode"] / row["mlx_decode"]
        results.append(row)
    report = {"kind": "compare-restated", "peer": compare["peer"], "device": compare["device"],
              "commit": decode["commit"], "date": max(prefill["date"], decode["date"]),
              "command": f"tools/compare_mlx.py --restate {compare_path} --prefill {prefill_path} "
                         f"--decode {decode_path}",
              "method": "Osprey: the medians of its latest sweeps (bench prefill: fresh prefills from position 0; "
                        "bench decode: CUDA-graph steps at the context length, greedy); MLX-LM: the medians of "
                        f"its rounds in {os.path.basename(compare_path)} (stream_generate, greedy), same GPU kind, "
                        "same checkpoint bytes; not alternated within a round",
              "osprey": {kind: {"commit": sweep["commit"], "date": sweep["date"], "command": sweep["command"]}
                         for kind, sweep in (("prefill", prefill), ("decode", decode))},
              "mlx": {"commit": compare["commit"], "date": compare["date"], "command": compare["command"]}}
    with_means(report, results)
    write(report, out)
    print(f"mean ratio: prefill {report['mean_prefill_ratio']:.1f}x, decode {report['mean_decode_ratio']:.1f}x -> {out}")


def write(report, path):
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--osprey", help="path of the osprey binary (built with --features cuda)")
    ap.add_argument("--lengths", default="256,1K,4K")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=32, help="decode steps timed per length")
    ap.add_argument("--warmup-max", default="4K", help="longest prompt warmed up on its own (longer ones share its warm-up)")
    ap.add_argument("--merge", nargs="+", metavar="REPORT", help="join these compare reports instead of measuring")
    ap.add_argument("--peer-dir", help="with --merge: also write peer-mlxlm-{prefill,decode}-h200.json here")
    ap.add_argument("--restate", metavar="REPORT",
                    help="set this compare report's MLX-LM side against --prefill and --decode sweeps")
    ap.add_argument("--prefill", help="with --restate: an `osprey bench prefill` report")
    ap.add_argument("--decode", help="with --restate: an `osprey bench decode` report")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if a.merge:
        merge(a.merge, a.out, a.peer_dir)
        return
    if a.restate:
        if not a.prefill or not a.decode:
            ap.error("--restate needs --prefill and --decode")
        restate(a.restate, a.prefill, a.decode, a.out)
        return
    if not a.model or not a.osprey:
        ap.error("--model and --osprey are needed to measure (or --merge to join reports)")
    lengths = parse_lengths(a.lengths)
    warmup_max = parse_lengths(a.warmup_max)[0]

    import mlx.core as mx
    import numpy as np
    from mlx_lm import load

    started = time.time()
    model, tokenizer = load(a.model)
    vocab = 248_077  # ids the real tokenizer can produce
    rng = np.random.default_rng(0)
    prompts = {n: rng.integers(0, vocab, size=n).tolist() for n in lengths}
    warmups = sorted({min(n, warmup_max) for n in lengths})
    for n in warmups:
        prompts.setdefault(n, rng.integers(0, vocab, size=n).tolist())
    print(f"mlx-lm loaded in {time.time() - started:.1f} s; warming up {warmups}", flush=True)
    for n in warmups:
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
            t0 = time.time()
            p, g = mlx_run(model, tokenizer, prompts[n], a.steps)
            rows[n]["mlx_prefill"].append(p)
            rows[n]["mlx_decode"].append(g)
            print(f"  mlx {n}: {time.time() - t0:.1f} s", flush=True)
        print(f"round {r + 1}/{a.rounds} done", flush=True)

    results = []
    for n in lengths:
        r = {"tokens": n, **summarise(rows[n])}
        results.append(r)
        print(f"{n:>7}: prefill osprey {r['osprey_prefill']:>9.1f} mlx {r['mlx_prefill']:>8.1f} tok/s "
              f"({r['prefill_ratio']:.1f}x); decode osprey {r['osprey_decode']:>7.1f} "
              f"mlx {r['mlx_decode']:>6.1f} tok/s ({r['decode_ratio']:.1f}x)")
    import mlx_lm

    report = {
        "kind": "compare", "peer": f"mlx-lm {mlx_lm.__version__} (mlx {mx.__version__}, CUDA build)",
        "device": (subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                  capture_output=True, text=True).stdout.strip() or "unknown").splitlines()[0],
        "commit": commit, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join(sys.argv), "model": a.model, "rounds": a.rounds, "decode_steps": a.steps,
        "method": "engines alternate within each round; median of rounds; MLX-LM prompt_tps/generation_tps "
                  "from stream_generate (greedy); Osprey bench prefill (fresh prefill) and bench decode "
                  "(CUDA-graph steps at the context length, token chosen on the GPU)",
        "warmup": warmups,
    }
    with_means(report, results)
    write(report, a.out)
    print(f"mean ratio: prefill {report['mean_prefill_ratio']:.2f}x, decode {report['mean_decode_ratio']:.2f}x -> {a.out}")


if __name__ == "__main__":
    main()
