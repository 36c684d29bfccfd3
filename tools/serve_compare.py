#!/usr/bin/env python3
"""The server on the GPU against the server on the CPU: the same requests over real HTTP to
`osprey serve --backend cuda` and `--backend cpu` on one checkpoint (the full-width 4-layer
synthetic model is the one to use: the CPU answers in seconds), then their answers compared.

    python3 tools/serve_compare.py --osprey target/release/osprey --model /tmp/full4 --out serve.json

The requests: a prompt scored by echo (every position's log-probability: the GPU's scored
prefill, bf16 activations, against the CPU's f32), a greedy 48-token chat reply with top-5
log-probabilities (the GPU's device path, summaries made on the device each step), two greedy
choices of one request (`n` 2: the second resumes the prompt's cached state), `min_tokens` (its
first tokens on the host path) and `ignore_eos` with a seed; then, on the GPU alone, a 1,024-token
prompt scored three times for its speed. Fails (exit 1) when:
- a prompt position's log-probability differs by more than 0.1 (measured 0.037-0.048 on the
  full-width 4-layer model, sessions 51-53: bf16 prefill against f32; a wrong position or row is
  off by units);
- the chat reply's log-probabilities differ by more than 0.1 while the two choose the same tokens
  (measured 0.018), the two part before 16 tokens, or their top-5 ids differ at more than a tenth
  of those steps (measured 48 of 48 equal);
- `ignore_eos` stops before max_tokens, `min_tokens` answers with fewer, or `n` 2 does not give
  two choices whose usage counts both (when both run to max_tokens).
Greedy texts that part later (a near-tie in a random model's router or logits decides otherwise
under the GPU's rounding) are reported, not failed. Needs: requests.
"""
import datetime
import json
import sys
import time

from serving import arguments, binary_commit, gpu_name, post_json, serving

LOGPROB_LIMIT = 0.1
AGREE_AT_LEAST = 16
HELLO = [{"role": "user", "content": "Hi"}]
REQUESTS = {
    "echo": ("/v1/completions", {"prompt": list(range(1000, 1040)), "max_tokens": 0, "echo": True, "logprobs": 1}),
    "greedy_n2": ("/v1/chat/completions", {"messages": HELLO, "max_tokens": 24, "temperature": 0, "n": 2}),
    "min_tokens": ("/v1/completions", {"prompt": "Once", "max_tokens": 16, "min_tokens": 8, "temperature": 0}),
    "ignore_eos": ("/v1/completions", {"prompt": "Once", "max_tokens": 48, "ignore_eos": True, "temperature": 0.8, "seed": 3}),
    "chat_logprobs": ("/v1/chat/completions", {"messages": HELLO, "max_tokens": 48, "temperature": 0, "ignore_eos": True,
                                               "logprobs": True, "top_logprobs": 5}),
}
LONG_ECHO = {"prompt": [(i * 7919) % 200000 for i in range(1024)], "max_tokens": 0, "echo": True, "logprobs": 5}


def answers(osprey, model, backend, port, timed):
    """Every request's answer from one server; on `timed`, the long prompt's scoring times too."""
    with serving(osprey, model, backend, port, "--max-context", "4096") as base:
        out = {name: post_json(base, path, body) for name, (path, body) in REQUESTS.items()}
        if timed:
            seconds = []
            for _ in range(3):
                start = time.perf_counter()
                r = post_json(base, "/v1/completions", LONG_ECHO)
                seconds.append(time.perf_counter() - start)
                if len(r["choices"][0]["logprobs"]["token_logprobs"]) != len(LONG_ECHO["prompt"]):
                    sys.exit("the long prompt's echo did not score every position")
            out["long_echo_seconds"] = seconds
        return out


def token_logprobs(reply):
    return [(e["token"], e["logprob"], [t["token"] for t in e["top_logprobs"]]) for e in reply["choices"][0]["logprobs"]["content"]]


def compare(g, c):
    """The summary of the two servers' answers and the list of what failed."""
    failed = []
    lg = g["echo"]["choices"][0]["logprobs"]["token_logprobs"][1:]
    lc = c["echo"]["choices"][0]["logprobs"]["token_logprobs"][1:]
    echo_worst = max(abs(a - b) for a, b in zip(lg, lc))
    if len(lg) != len(lc) or echo_worst > LOGPROB_LIMIT:
        failed.append(f"echo: {len(lg)} against {len(lc)} positions, worst log-probability difference {echo_worst:.3g}")
    cg, cc = token_logprobs(g["chat_logprobs"]), token_logprobs(c["chat_logprobs"])
    same = [a[0] == b[0] for a, b in zip(cg, cc)]
    agree = same.index(False) if False in same else min(len(cg), len(cc))
    chat_worst = max((abs(a[1] - b[1]) for a, b in zip(cg[:agree], cc[:agree])), default=0.0)
    top_equal = sum(1 for a, b in zip(cg[:agree], cc[:agree]) if a[2] == b[2])
    if agree < AGREE_AT_LEAST or chat_worst > LOGPROB_LIMIT or top_equal < 0.9 * agree:
        failed.append(f"chat logprobs: same tokens for {agree} steps, worst difference {chat_worst:.3g}, top 5 equal at {top_equal}")
    ignore, ignore_tokens = g["ignore_eos"], REQUESTS["ignore_eos"][1]["max_tokens"]
    if ignore["usage"]["completion_tokens"] != ignore_tokens or ignore["choices"][0]["finish_reason"] != "length":
        failed.append(f"ignore_eos: {ignore['usage']['completion_tokens']} tokens, finish {ignore['choices'][0]['finish_reason']}")
    least, at_least = g["min_tokens"]["usage"]["completion_tokens"], REQUESTS["min_tokens"][1]["min_tokens"]
    if least < at_least:
        failed.append(f"min_tokens {at_least}: {least} tokens")
    n2 = g["greedy_n2"]
    both_full = all(ch["finish_reason"] == "length" for ch in n2["choices"])
    if len(n2["choices"]) != 2 or (both_full and n2["usage"]["completion_tokens"] != 2 * REQUESTS["greedy_n2"][1]["max_tokens"]):
        failed.append(f"n 2: {len(n2['choices'])} choices, usage {n2['usage']}")
    texts = [ch["message"] for ch in n2["choices"]]
    summary = {
        "echo_positions": len(lg),
        "echo_prompt_logprobs_worst_abs_difference": echo_worst,
        "chat_logprobs_tokens": len(cg),
        "chat_logprobs_same_tokens_for": agree,
        "chat_logprobs_worst_abs_difference": chat_worst,
        "chat_logprobs_top5_ids_equal_steps": top_equal,
        "n2_greedy_choices_equal": texts[0] == texts[-1],
        "n2_greedy_equals_reference": texts[0] == c["greedy_n2"]["choices"][0]["message"],
        "n2_usage": n2["usage"],
        "min_tokens_equals_reference": g["min_tokens"]["choices"][0]["text"] == c["min_tokens"]["choices"][0]["text"],
        "min_tokens_completion_tokens": least,
        "ignore_eos_completion_tokens": ignore["usage"]["completion_tokens"],
        "ignore_eos_finish": ignore["choices"][0]["finish_reason"],
    }
    if "long_echo_seconds" in g:
        summary["echo_1024_positions_top5_seconds"] = g["long_echo_seconds"]
        summary["echo_1024_positions_per_s_best"] = len(LONG_ECHO["prompt"]) / min(g["long_echo_seconds"])
    return summary, failed


def main():
    ap = arguments(__doc__.split("\n")[0], 8031)
    ap.add_argument("--reference-backend", default="cpu")
    a = ap.parse_args()
    gpu = answers(a.osprey, a.model, a.backend, a.port, timed=True)
    reference = answers(a.osprey, a.model, a.reference_backend, a.port + 1, timed=False)
    summary, failed = compare(gpu, reference)
    report = {
        "kind": "serve-check",
        "backend": a.backend,
        "reference_backend": a.reference_backend,
        "device": gpu_name(),
        "commit": binary_commit(a.osprey),
        "date": datetime.date.today().isoformat(),
        "command": "python3 tools/serve_compare.py " + " ".join(sys.argv[1:]),
        "passed": not failed,
        "failed": failed,
        "summary": summary,
        "responses": {"backend": gpu, "reference": reference},
    }
    print(json.dumps({k: report[k] for k in ("passed", "failed", "summary")}, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
