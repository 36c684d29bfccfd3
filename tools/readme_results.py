#!/usr/bin/env python3
"""Writes the result tables of README.md and docs/gpu.md from the committed JSON under bench/results/.

Each table sits between `<!-- results:NAME -->` and `<!-- /results:NAME -->`, in one of the two
files; the text around them is hand-written. Run after committing new benchmark JSON:

    python3 tools/readme_results.py            # rewrite the tables
    python3 tools/readme_results.py --check    # fail if a table is out of date (CI runs this)

--check also fails if docs/cuda-decode-tried.md names a result file that bench/results/ lacks.

Needs only the standard library.
"""
import argparse
import fnmatch
import json
import os
import re
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
RESULTS = os.path.join(ROOT, "bench", "results")


def load(name):
    with open(os.path.join(RESULTS, name)) as f:
        return json.load(f)


def n0(x):
    return f"{x:,.0f}"


def cell(text):
    """Table cell text: a literal | would end the cell."""
    return text.replace("|", "\\|")


def source(d, name):
    return f"\n\n<sub>{name}: commit `{d.get('commit')}`, {d.get('device')}, {str(d.get('date'))[:10]}</sub>"


def prefill():
    d = load("cuda-prefill-full.json")
    rows = ["| prompt tokens | prefill tok/s | min – max | GDN forms forced: register scan / chunked |", "|---|---|---|---|"]
    for r in d["results"]:
        forms = r.get("gdn_form_tokens_per_s") or {}
        f = f"{n0(forms['recurrent'])} / {n0(forms['chunked'])}" if forms else "—"
        rows.append(f"| {r['tokens']:,} | {n0(r['tokens_per_s'])} | {n0(r['min'])} – {n0(r['max'])} | {f} |")
    return "\n".join(rows) + source(d, "cuda-prefill-full.json")


def prefill_profile():
    """Per-kernel table with a column per profiled prompt length; launches and the expert-GEMM
    line from the 4,096-token profile (or the longest below it)."""
    d = load("cuda-prefill-full.json")
    by_len = {p["tokens"]: p for p in d["profiles"]}
    lengths = sorted(by_len)
    main = by_len[max([n for n in lengths if n <= 4096] or lengths[:1])]
    us = {n: {k["kernel"]: k["us"] for k in by_len[n]["kernels"]} for n in lengths}

    def ms(v, n):  # short prompts get one more digit
        return "—" if v is None else f"{v / 1e3:.2f}" if n < 1024 else f"{v / 1e3:.1f}"

    rows = [f"| kernel family | launches ({main['tokens']:,}) | " + " | ".join(f"{n:,}-token prompt, ms" for n in lengths) + " |",
            "|---|---|" + "---|" * len(lengths)]
    for k in main["kernels"]:
        rows.append(f"| {cell(k['kernel'])} | {k['launches']} | " + " | ".join(ms(us[n].get(k["kernel"]), n) for n in lengths) + " |")
    rows.append("| **all** | | " + " | ".join(f"**{ms(by_len[n]['total_us'], n)}**" for n in lengths) + " |")
    eg = main["expert_gemm"]
    rows.append("")
    rows.append(f"Routed-expert GEMMs at {main['tokens']:,} tokens: {eg['flop'] / 1e12:.2f} TFLOP in {eg['us'] / 1e3:.1f} ms = "
                f"{eg['tflop_per_s']:.0f} TFLOP/s ({100 * eg['fraction_of_bf16_ceiling']:.0f}% of the ~790 TFLOP/s bf16 ceiling).")
    return "\n".join(rows)


def decode():
    d = load("cuda-decode-full.json")
    sampled_path = os.path.join(RESULTS, "cuda-decode-sampling-full.json")
    sampled = load("cuda-decode-sampling-full.json") if os.path.exists(sampled_path) else None
    by_len = {r["tokens"]: r["tokens_per_s"] for r in sampled["results"]} if sampled else {}
    int8 = load("cuda-decode-int8kv-full.json")
    int8_by_len = {r["tokens"]: r for r in int8["results"]}
    ceiling = read_ceiling(d)
    if sampled:
        sp = sampled["sampling"]
        head = (f"| context | decode tok/s, greedy | sampled (T {sp['temperature']:g}, top-k {sp['top_k']}, top-p {sp['top_p']:.2f}) "
                f"| greedy, `--kv-cache int8` | bytes per step, bf16 / int8 cache | achieved read rate, greedy (of {ceiling}) |")
        rows = [head, "|---|---|---|---|---|---|"]
    else:
        rows = [f"| context | decode tok/s | greedy, `--kv-cache int8` | bytes per step, bf16 / int8 cache | achieved read rate (of {ceiling}) |",
                "|---|---|---|---|---|"]
    for r in d["results"]:
        s_cell = f" {by_len[r['tokens']]:.1f} |" if r["tokens"] in by_len else (" — |" if sampled else "")
        i8 = int8_by_len.get(r["tokens"])
        i8_cell = f" {i8['tokens_per_s']:.1f} |" if i8 else " — |"
        i8_bytes = f" / {i8['bytes_per_step'] / 1e9:.2f}" if i8 else ""
        rows.append(f"| {r['tokens']:,} | {r['tokens_per_s']:.1f} |{s_cell}{i8_cell} {r['bytes_per_step'] / 1e9:.2f}{i8_bytes} GB | "
                    f"{r['achieved_bytes_per_s'] / 1e12:.2f} TB/s ({100 * r['fraction_of_read_ceiling']:.0f}%) |")
    text = "\n".join(rows) + source(d, "cuda-decode-full.json")
    if sampled:
        text += "<br>" + source(sampled, "cuda-decode-sampling-full.json").strip()
    return text + "<br>" + source(int8, "cuda-decode-int8kv-full.json").strip()


def read_ceiling(d):
    """The read ceiling a decode JSON judged its steps against: measured on its device
    (read_ceiling_method), or, in files from before the probe, budget.md's H200 figure."""
    measured = "read_ceiling_method" in d
    return f"{'' if measured else '~'}{d['read_ceiling_bytes_per_s'] / 1e12:.1f} TB/s{' measured' if measured else ''}"


def h100():
    """Prefill and decode on an H100, one row a length."""
    pre = load("cuda-prefill-h100.json")
    dec = load("cuda-decode-h100.json")
    int8 = load("cuda-decode-int8kv-h100.json")
    long, long_int8 = load("cuda-decode-long-h100.json"), load("cuda-decode-long-int8kv-h100.json")
    pre_by = {r["tokens"]: r["tokens_per_s"] for r in pre["results"]}
    int8_by = {r["tokens"]: r["tokens_per_s"] for r in int8["results"] + long_int8["results"]}
    have = {r["tokens"] for r in dec["results"]}
    rows = [f"| tokens (prompt / context) | prefill tok/s | decode tok/s, greedy | greedy, `--kv-cache int8` | achieved read rate, greedy (of {read_ceiling(dec)}) |",
            "|---|---|---|---|---|"]
    for r in dec["results"] + [r for r in long["results"] if r["tokens"] not in have]:
        n = r["tokens"]
        p = n0(pre_by[n]) if n in pre_by else "—"
        i8 = f"{int8_by[n]:.1f}" if n in int8_by else "—"
        rows.append(f"| {n:,} | {p} | {r['tokens_per_s']:.1f} | {i8} | {r['achieved_bytes_per_s'] / 1e12:.2f} TB/s ({100 * r['fraction_of_read_ceiling']:.0f}%) |")
    sources = [(dec, "cuda-decode-h100.json"), (int8, "cuda-decode-int8kv-h100.json"), (long, "cuda-decode-long-h100.json"),
               (long_int8, "cuda-decode-long-int8kv-h100.json")]
    return "\n".join(rows) + source(pre, "cuda-prefill-h100.json") + "".join("<br>" + source(d, n).strip() for d, n in sources)


def long_context():
    """osprey check --long-context: decode past 128K against the GPU prefill."""
    files = [("tiny", "bf16", "cuda-check-tiny-long-140k.json"), ("tiny", "bf16", "cuda-check-tiny-long-262k.json"),
             ("full width, 4 layers", "bf16", "cuda-check-fullwidth-4l-long-262k.json"),
             ("full width, 4 layers", "int8", "cuda-check-fullwidth-4l-int8kv-long-262k.json")]
    rows = ["| model | KV cache | prompt tokens | decode steps | relative RMS, median (limit) | worst (limit) | greedy disagreements | passed |",
            "|---|---|---|---|---|---|---|---|"]
    subs = []
    for model, kv, name in files:
        d = load(name)
        c = d["long_context"]
        rows.append(f"| {model} | {kv} | {c['prompt_tokens']:,} | {c['steps']} | {c['median_relative_rms']:.1e} ({c['limit_median_relative_rms']:.0e}) "
                    f"| {c['worst_relative_rms']:.1e} ({c['limit_worst_relative_rms']:.0e}) | {c['greedy_disagreements']} | {'yes' if c['pass'] else 'no'} |")
        subs.append(source(d, name).strip())
    return "\n".join(rows) + "\n\n" + "<br>".join(subs)


def decode_profile():
    d = load("cuda-decode-full.json")
    p = d["profile"]
    if not any(k.get("graph_us") is not None for k in p["kernels"]):
        rows = [f"| kernel family (one step at {p['context']:,} context) | launches | µs |", "|---|---|---|"]
        rows += [f"| {cell(k['kernel'])} | {k['launches']} | {k['us']:.0f} |" for k in p["kernels"]]
        rows.append(f"| **all** (launched one by one with events) | | **{p['total_us']:.0f}** |")
        return "\n".join(rows)
    tl = load("cuda-decode-timeline-4k.json") if os.path.exists(os.path.join(RESULTS, "cuda-decode-timeline-4k.json")) else None
    fam = {f["kernel"]: f for f in tl["families"]} if tl and tl["context"] == p["context"] else {}
    head = f"| kernel family (one step at {p['context']:,} context) | launches | µs, launched alone with events | µs inside the graph |"
    rows = [head + (" µs in the step's timeline | hand-over µs |" if fam else ""), "|---|---|---|---|" + ("---|---|" if fam else "")]

    def graph_cell(g):
        # a difference of two graph timings: below a microsecond it is within their noise
        return "—" if g is None else ("<1" if g < 1.0 else f"{g:.0f}")

    def timeline_cells(name):
        f = fam.get(name)
        if f is None:
            return " — | — |"
        h = f["median_release_after_predecessor_us"]
        return f" {f['us']:.0f} | {'—' if h is None else f'{h:.2f}'} |"

    for k in p["kernels"]:
        rows.append(f"| {cell(k['kernel'])} | {k['launches']} | {k['us']:.0f} | {graph_cell(k.get('graph_us'))} |"
                    + (timeline_cells(k["kernel"]) if fam else ""))
    in_graph = sum(max(k["graph_us"] or 0.0, 0.0) for k in p["kernels"])
    last = f"| **all** | | **{p['total_us']:.0f}** | **{in_graph:.0f}** of a {p['graph_step_us']:.0f} µs step |"
    if fam:
        last += f" **{sum(f['us'] for f in fam.values()):.0f}** of {tl['step_us_recorded']:.0f} µs instrumented | |"
        return "\n".join(rows + [last]) + source(d, "cuda-decode-full.json") + "<br>" + source(tl, "cuda-decode-timeline-4k.json").strip()
    return "\n".join(rows + [last])


# The experts kernels' marks (moe.cu moe_experts_body: moe_experts and moe_routed_experts).
EXPERTS_PHASES = {8: "selected", 2: "gate/up asked", 3: "x in", 4: "gate/up in", 5: "h written", 6: "warp 0's part of h met", 7: "down multiplied"}
# gemv.cu gemv_q_resident (the input projections) and gemv_q_pair (the output projections)
RESIDENT_PHASES = {2: "copies asked", 3: "warp 0's x in", 4: "tiles in", 6: "warp 0's first two tile products", 5: "multiplied"}
PAIR_PHASES = {2: "warp 0's x in", 3: "tile in", 5: "warp 0's x fragments", 6: "warp 0's quad product", 4: "multiplied"}

# What each phase mark means (step_phase calls in crates/osprey-cuda/kernels), per family.
PHASES = {
    "gdn in_proj (norm + qkv|z|b|a)": RESIDENT_PHASES,
    "attn in_proj (norm + q|k|v)": RESIDENT_PHASES,
    "gdn step (conv, l2, delta rule)": {2: "conv done", 3: "sums met"},
    "gdn gated norm + out_proj + residual": PAIR_PHASES,
    "attn decode (split-KV) + merge + gate": {2: "Q staged", 3: "attended", 4: "shares in smem", 5: "met", 6: "splits merged"},
    "attn o_proj + residual": PAIR_PHASES,
    "moe router + shared gate/up": {2: "x in", 3: "rows written"},
    "moe experts (top-k, gate/up, swiglu, down) + residual": EXPERTS_PHASES,
    # (moe_routed_experts waits for its gate tile at mark 4 and for the up tile later)
    "moe router + experts (top-k, gate/up, swiglu, down) + residual": {**EXPERTS_PHASES, 4: "gate tile in"},
    # gemv.cu gemv_q_ring: when warp 0 takes its stages
    "lm_head (final norm + gemv + argmax)": {2: "first stage in", 3: "first refilled stage in", 4: "half the run in", 5: "last stage in", 6: "warp 0's stages multiplied"},
}


def decode_phases():
    tl = load("cuda-decode-timeline-4k.json")
    by = {}
    for ph in tl.get("phases", []):
        by.setdefault(ph["kernel"], {})[ph["mark"]] = ph
    rows = ["| kernel family (4,096 context) | phases: µs after the launch's release, median block (last block) |", "|---|---|"]
    for kernel, names in PHASES.items():
        marks = by.get(kernel)
        if not marks:
            continue
        order = sorted(names, key=lambda m: marks[m]["median_block_us"] if m in marks else 1e9)
        cells = [f"{names[m]} {marks[m]['median_block_us']:.1f} ({marks[m]['last_block_us']:.1f})" for m in order if m in marks]
        rows.append(f"| {cell(kernel)} | {' → '.join(cells)} |")
    return "\n".join(rows) + source(tl, "cuda-decode-timeline-4k.json")


def checks():
    tiny, full4 = load("cuda-check-tiny.json"), load("cuda-check-fullwidth-4l.json")

    def pre(d):
        p = d["prefill"]
        return max(p["chunked_relative_rms"], p["whole_relative_rms"], p.get("whole_recurrent_gdn_relative_rms", p.get("whole_chunked_gdn_relative_rms", 0.0)))

    items = [
        ("decode, worst relative RMS of the logits", lambda d: f"{d['worst_relative_rms']:.1e}", f"{tiny['limit_relative_rms']:.0e}"),
        ("prefill (chunked, whole, both GDN forms), last-position logits", lambda d: f"{pre(d):.1e}", f"{tiny['prefill']['limit_relative_rms']:.0e}"),
        ("prefill then decode, worst relative RMS", lambda d: f"{d['prefill']['decode_after_prefill']['worst_relative_rms']:.1e}", f"{tiny['prefill']['limit_relative_rms']:.0e}"),
        ("greedy disagreements (outside near-ties)", lambda d: str(d["greedy_disagreements"] + d["prefill"]["greedy_disagreements"] + d["prefill"]["decode_after_prefill"]["greedy_disagreements"]), "0"),
        ("resumed from a session copy after another branch and another conversation, worst relative RMS",
         lambda d: f"{max(v for k, v in d['resume_from_state_copy'].items() if k.endswith('relative_rms') and k != 'limit_relative_rms'):.1e}"
         if "resume_from_state_copy" in d else "—", f"{tiny['prefill']['limit_relative_rms']:.0e}"),
        ("scored prefill: every position's logits (prompt log-probabilities), worst relative RMS",
         lambda d: f"{d['scored_prefill']['worst_relative_rms']:.1e}" if "scored_prefill" in d else "—", f"{tiny['prefill']['limit_relative_rms']:.0e}"),
        ("scored prefill: the GPU's summaries (normaliser, next token, top 20) vs the host's of the same logits, largest difference",
         lambda d: f"{d['scored_prefill']['device_summaries']['worst_difference']:.1e}"
         if "device_summaries" in d.get("scored_prefill", {}) else "—",
         f"{tiny['scored_prefill']['device_summaries']['limit']:.0e}"),
        ("GPU sampling: total variation vs the host distribution", lambda d: f"{d['gpu_sampling']['total_variation']:.3f}", f"{tiny['gpu_sampling']['limit_total_variation']}"),
        ("decode steps' log-probabilities summarised on the GPU (top 20) vs the host's of the same logits, largest difference",
         lambda d: f"{d['gpu_sampling']['stream_logprobs']['largest_difference_vs_host']:.1e}"
         if "stream_logprobs" in d["gpu_sampling"] else "—",
         f"{tiny['gpu_sampling']['stream_logprobs']['limit']:.0e}"),
        ("passed", lambda d: "yes" if d["pass"] else "NO", ""),
    ]
    int8 = load("cuda-check-fullwidth-4l-int8kv.json")
    rows = ["| check | tiny | full width, 4 layers | full width, 4 layers, `--kv-cache int8` | limit |", "|---|---|---|---|---|"]
    rows += [f"| {name} | {f(tiny)} | {f(full4)} | {f(int8)} | {lim} |" for name, f, lim in items]
    int8_source = "<br>" + source(int8, "cuda-check-fullwidth-4l-int8kv.json").strip()
    if tiny.get("commit") == full4.get("commit"):
        return "\n".join(rows) + source(tiny, "cuda-check-tiny.json, cuda-check-fullwidth-4l.json") + int8_source
    return "\n".join(rows) + source(tiny, "cuda-check-tiny.json") + "<br>" + source(full4, "cuda-check-fullwidth-4l.json").strip() + int8_source


def serve_turns():
    """Time to first token per turn, GPU session copies on and off, per scenario."""
    d = load("cuda-serve-turns-full.json")
    runs = {(r["scenario"], r["gpu_cache_mib"]): r["turns"] for r in d["results"]}
    rows = ["| scenario | turn | prompt tokens | computed with copies (cached) | first token, with copies | without (all computed) |",
            "|---|---|---|---|---|---|"]
    for scenario in dict.fromkeys(r["scenario"] for r in d["results"]):
        on = runs[(scenario, max(m for s, m in runs if s == scenario))]
        off = runs[(scenario, 0)]
        for a, b in zip(on, off):
            rows.append(f"| {scenario} | {a['conversation']} {a['turn']} | {a['prompt_tokens']:,} | "
                        f"{a['prompt_tokens'] - a['cached_tokens']:,} ({a['cached_tokens']:,}) | "
                        f"{a['time_to_first_token_s']:.2f} s | {b['time_to_first_token_s']:.2f} s |")
    return "\n".join(rows) + source(d, "cuda-serve-turns-full.json")


def compare():
    d = load("compare-mlx-h200.json")
    rows = ["| tokens | Osprey prefill tok/s | MLX-LM prefill | ratio | Osprey decode tok/s | MLX-LM decode | ratio | rounds | commit |",
            "|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for r in d["results"]:
        mark = ""
        if r.get("caveat"):
            if r["caveat"] not in notes:
                notes.append(r["caveat"])
            mark = "†" * (notes.index(r["caveat"]) + 1)
        rows.append(f"| {r['tokens']:,} | {n0(r['osprey_prefill'])} | {r['mlx_prefill']:.0f} | {r['prefill_ratio']:.0f}× | "
                    f"{r['osprey_decode']:.0f}{mark} | {r['mlx_decode']:.1f} | {r['decode_ratio']:.1f}×{mark} | "
                    f"{len(r['rounds']['mlx_prefill'])} | `{r.get('commit', d.get('commit'))}` |")
    rows.append(f"| **mean ratio** | | | **{d['mean_prefill_ratio']:.0f}×** | | | **{d['mean_decode_ratio']:.1f}×** | | |")
    for i, n in enumerate(notes):
        rows.append("")
        rows.append(f"{'†' * (i + 1)} {n}.")
    commits = ", ".join(f"`{c}`" for c in dict.fromkeys(p["commit"] for p in d.get("parts", [d])))
    return "\n".join(rows) + (f"\n\n<sub>compare-mlx-h200.json: joined from runs at commits {commits}, "
                              f"{d.get('device')}, {str(d.get('date'))[:10]}</sub>")


def compare_latest():
    d = load("compare-mlx-h200-latest.json")
    rows = ["| tokens | Osprey prefill tok/s | MLX-LM prefill | ratio | Osprey decode tok/s | MLX-LM decode | ratio |",
            "|---|---|---|---|---|---|---|"]
    for r in d["results"]:
        rows.append(f"| {r['tokens']:,} | {n0(r['osprey_prefill'])} | {r['mlx_prefill']:.0f} | {r['prefill_ratio']:.0f}× | "
                    f"{r['osprey_decode']:.0f} | {r['mlx_decode']:.1f} | {r['decode_ratio']:.1f}× |")
    rows.append(f"| **mean ratio** | | | **{d['mean_prefill_ratio']:.0f}×** | | | **{d['mean_decode_ratio']:.1f}×** |")
    o = d["osprey"]
    return "\n".join(rows) + (f"\n\n<sub>compare-mlx-h200-latest.json: Osprey's sweeps at `{o['prefill']['commit']}` "
                              f"(prefill, {o['prefill']['date'][:10]}) and `{o['decode']['commit']}` (decode, "
                              f"{o['decode']['date'][:10]}); MLX-LM from compare-mlx-h200.json ({d['mlx']['date'][:10]}); "
                              f"{d['device']}</sub>")


def fidelity_rows(files):
    rows = ["| reference | perplexity difference | top-1 agreement | max / mean abs logit error |", "|---|---|---|---|"]
    for label, name in files:
        f = load(name)["fidelity"]
        rows.append(f"| {label} | {f['perplexity_difference_percent']:+.3f}% | {100 * f['top1_agreement']:.1f}% | "
                    f"{f['max_abs_logit_error']:.2g} / {f['mean_abs_logit_error']:.2g} |")
    return "\n".join(rows)


def fidelity_full():
    return fidelity_rows([("MLX-LM 0.32.2 (CUDA build, its own bf16 path)", "cuda-fidelity-full-vs-mlx.json"),
                          ("transformers 5.17, bf16, weights dequantised exactly", "cuda-fidelity-full-vs-transformers-bf16.json")])


def fidelity_tiny():
    return fidelity_rows([("transformers 5.24, float32", "cpu-fidelity-synth-tiny-vs-transformers-f32.json"),
                          ("transformers 5.24, bf16", "cpu-fidelity-synth-tiny-vs-transformers-bf16.json"),
                          ("MLX-LM 0.32.2 (CPU build)", "cpu-fidelity-synth-tiny-vs-mlx.json")])


TABLES = {"prefill": prefill, "prefill-profile": prefill_profile, "decode": decode, "decode-profile": decode_profile, "h100": h100,
          "long-context": long_context,
          "decode-phases": decode_phases,
          "checks": checks, "serve-turns": serve_turns, "compare-mlx": compare, "compare-mlx-latest": compare_latest, "fidelity-full": fidelity_full, "fidelity-tiny": fidelity_tiny}


DOCUMENTS = ["README.md", os.path.join("docs", "gpu.md")]


def render(texts):
    """`texts` (document name -> text) with every table rewritten; each table's block must stand
    in exactly one document."""
    texts = dict(texts)
    for name, make in TABLES.items():
        pattern = re.compile(rf"(<!-- results:{name} -->\n).*?(\n<!-- /results:{name} -->)", re.S)
        holders = [doc for doc, text in texts.items() if pattern.search(text)]
        if len(holders) != 1:
            raise SystemExit(f"<!-- results:{name} --> stands in {holders or 'none'} of {', '.join(texts)}: it must stand in one")
        doc = holders[0]
        texts[doc] = pattern.sub(lambda m: m.group(1) + make() + m.group(2), texts[doc])
    return texts


def tried_index_missing():
    """The JSON named in docs/cuda-decode-tried.md's tables that bench/results/ does not have: a name
    is `sNN` (cuda-decode-sessionNN-ablations.json), a decode file without its `cuda-decode-` prefix
    and `.json` (a `*` matching several), or a whole file name without `.json`; "log ..." cells name
    no file."""
    with open(os.path.join(ROOT, "docs", "cuda-decode-tried.md")) as f:
        rows = [line for line in f if line.startswith("| ") and not line.startswith("| idea")]
    have = os.listdir(RESULTS)
    missing = []
    for row in rows:
        for name in re.findall(r"`([^`]+)`", row.rstrip().rstrip("|").rsplit("|", 1)[-1]):
            session = re.fullmatch(r"s(\d+)", name)
            candidates = [f"cuda-decode-session{session.group(1)}-ablations.json"] if session else [f"cuda-decode-{name}.json", f"{name}.json"]
            if not any(fnmatch.filter(have, c) for c in candidates):
                missing.append(name)
    return missing


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="fail if a table is not what the JSON gives")
    a = ap.parse_args()
    texts = {}
    for doc in DOCUMENTS:
        with open(os.path.join(ROOT, doc)) as f:
            texts[doc] = f.read()
    new = render(texts)
    if a.check:
        stale = [doc for doc in DOCUMENTS if new[doc] != texts[doc]]
        if stale:
            sys.exit(f"the result tables of {', '.join(stale)} are out of date: run python3 tools/readme_results.py")
        missing = tried_index_missing()
        if missing:
            sys.exit(f"docs/cuda-decode-tried.md names results that bench/results/ lacks: {', '.join(missing)}")
        return
    for doc in DOCUMENTS:
        if new[doc] != texts[doc]:
            with open(os.path.join(ROOT, doc), "w") as f:
                f.write(new[doc])


if __name__ == "__main__":
    main()
