#!/usr/bin/env python3
"""What log-probabilities cost over HTTP (`osprey serve`, on a GPU): 256-token greedy chat replies
(ignore_eos) plain, with top_logprobs 5 and with 20, then a 1,024-token prompt scored by echo
(completions, max_tokens 0) with 5 and 20 alternatives; 3 of each a round. With --against, the
rounds alternate between the binaries (each round starts each binary's server in turn), so that
two builds compare on one machine.

    python3 tools/logprobs_speed.py --osprey target/release/osprey --model /tmp/full --out lp.json
    python3 tools/logprobs_speed.py --osprey new/osprey --against old/osprey --model /tmp/full

Chat figures are tokens a second over the whole request (its prefill included); echo figures are
seconds a request. Needs: requests.
"""
import datetime
import json
import sys
import time

from serving import arguments, binary_commit, gpu_name, post_json, serving

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 256, "temperature": 0, "ignore_eos": True}
ECHO = {"prompt": list(range(1000, 2024)), "max_tokens": 0, "echo": True}
CHAT_FORMS = {"plain": {}, "top5": {"logprobs": True, "top_logprobs": 5}, "top20": {"logprobs": True, "top_logprobs": 20}}


def timed_post(base, path, body):
    """The answer and the seconds it took."""
    start = time.perf_counter()
    out = post_json(base, path, body)
    return time.perf_counter() - start, out


def one_round(base, into, repeats):
    """`repeats` of each request against the server at `base`, each form's figures appended to `into`."""
    timed_post(base, "/v1/chat/completions", CHAT)
    timed_post(base, "/v1/completions", {**ECHO, "logprobs": 5})
    for _ in range(repeats):
        for name, extra in CHAT_FORMS.items():
            seconds, out = timed_post(base, "/v1/chat/completions", {**CHAT, **extra})
            n = out["usage"]["completion_tokens"]
            if extra and len(out["choices"][0]["logprobs"]["content"]) != n:
                sys.exit(f"{name}: {n} tokens but not as many log-probabilities")
            into.setdefault(f"chat_{name}_tokens_per_s", []).append(n / seconds)
        for top in (5, 20):
            seconds, out = timed_post(base, "/v1/completions", {**ECHO, "logprobs": top})
            if len(out["choices"][0]["logprobs"]["token_logprobs"]) != len(ECHO["prompt"]):
                sys.exit(f"echo top {top}: not every prompt token scored")
            into.setdefault(f"echo1024_top{top}_seconds", []).append(seconds)


def main():
    ap = arguments(__doc__.split("\n")[0], 8021)
    ap.add_argument("--against", action="append", default=[], help="another binary, alternated with --osprey")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    binaries = [a.osprey, *a.against]
    results = {b: {"commit": binary_commit(b)} for b in binaries}
    for _ in range(a.rounds):
        for b in binaries:
            with serving(b, a.model, a.backend, a.port, "--max-context", "8192") as base:
                one_round(base, results[b], a.repeats)
    for r in results.values():
        for key in [k for k in r if k.startswith("chat_")]:
            r[key.replace("_tokens_per_s", "_best")] = max(r[key])
        for key in [k for k in r if k.startswith("echo")]:
            r[key.replace("_seconds", "_best")] = min(r[key])
    report = {
        "kind": "serve-logprobs-speed",
        "backend": a.backend,
        "device": gpu_name(),
        "commit": results[a.osprey]["commit"],
        "date": datetime.date.today().isoformat(),
        "command": "python3 tools/logprobs_speed.py " + " ".join(sys.argv[1:]),
        "results": list(results.values()),
    }
    print(json.dumps(report, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
