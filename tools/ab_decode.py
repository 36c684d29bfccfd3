#!/usr/bin/env python3
"""A/B of decode variants on one machine: `osprey bench decode` for each variant in turn, the whole
set repeated --rounds times (interleaved, so drift in the machine's clocks falls on every variant
alike), into one JSON in the form of bench/results/*-ablation.json.

A variant is NAME or NAME:VAR=VALUE[,VAR=VALUE...]: environment for that run, typically
OSPREY_KERNELS_DIR=DIR (cubins built from a changed source; the rest embedded) or one of the
decoder's A/B switches. NAME alone runs the binary as it is. OSPREY_BIN=PATH is not passed on:
that variant runs the binary at PATH instead of --osprey (a change on the host side of the step).

    python3 tools/ab_decode.py --osprey target/release/osprey --model /tmp/full --context 4K,32K,128K \\
        --variant main --variant noinline:OSPREY_KERNELS_DIR=/tmp/v/noinline --rounds 2 --out ab.json
"""
import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile

BIN_VAR = "OSPREY_BIN"


def parse_variant(text):
    """'name' or 'name:VAR=VALUE,VAR=VALUE' -> (name, {VAR: VALUE})."""
    name, _, rest = text.partition(":")
    if not name:
        raise ValueError(f"variant {text!r}: no name")
    env = {}
    for item in filter(None, rest.split(",")):
        var, eq, value = item.partition("=")
        if not eq or not var:
            raise ValueError(f"variant {text!r}: {item!r} is not VAR=VALUE")
        env[var] = value
    return name, env


def rates(result):
    """{context tokens: tokens/s} of one `osprey bench decode --out` JSON."""
    return {r["tokens"]: round(r["tokens_per_s"], 1) for r in result["results"]}


def run_variant(osprey, model, context, env, extra):
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "bench.json")
        cmd = [osprey, "bench", "decode", "--backend", "cuda", "--model", model, "--context", context, "--out", out, *extra]
        subprocess.run(cmd, check=True, env={**os.environ, **env}, stdout=subprocess.DEVNULL)
        with open(out) as f:
            return json.load(f)


def main(argv, run=run_variant):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--osprey", default="target/release/osprey")
    p.add_argument("--model", required=True)
    p.add_argument("--context", default="4K,32K,128K")
    p.add_argument("--variant", action="append", required=True)
    p.add_argument("--rounds", type=int, default=2, help="passes over the variants (default 2)")
    p.add_argument("--bench-rounds", default="2", help="osprey bench decode --rounds of each run (default 2)")
    p.add_argument("--kv-cache", default="bf16")
    p.add_argument("--sample", action="store_true", help="osprey bench decode --sample (the checkpoint's sampling settings)")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    try:
        variants = [parse_variant(v) for v in a.variant]
    except ValueError as e:
        sys.exit(str(e))
    if len({n for n, _ in variants}) != len(variants):
        sys.exit("variant names must differ")
    extra = ["--rounds", a.bench_rounds, "--kv-cache", a.kv_cache, *(["--sample"] if a.sample else [])]
    rounds = {n: [] for n, _ in variants}
    first = None
    for r in range(a.rounds):
        for name, env in variants:
            osprey = env.get(BIN_VAR, a.osprey)
            result = run(osprey, a.model, a.context, {k: v for k, v in env.items() if k != BIN_VAR}, extra)
            first = first or result
            rounds[name].append(rates(result))
            print(f"round {r + 1} {name:16s} " + "  ".join(f"{t}: {v}" for t, v in rates(result).items()), flush=True)
    out = {
        "kind": "decode-ablation",
        "backend": "cuda",
        "device": first.get("device"),
        "commit": first.get("commit"),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": " ".join(["python3 tools/ab_decode.py", *argv]),
        "note": "one machine, the variants interleaved round by round (one binary unless a variant names its "
        f"{BIN_VAR}): compare rows with each other",
        "variants": [{"name": n, "env": env, "rounds": rounds[n]} for n, env in variants],
    }
    text = json.dumps(out, indent=1)
    with open(a.out, "w") as f:
        f.write(text)
    return json.loads(text)


if __name__ == "__main__":
    main(sys.argv[1:])
