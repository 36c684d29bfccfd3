#!/usr/bin/env python3
"""Smoke test of `osprey serve` on a GPU: starts the server on a checkpoint, sends chat requests
over real HTTP (plain, streamed, sampled, forced tool call, log-probabilities) and prints status,
finish reason and decode speed of each. Exits non-zero on any failure.

    python3 tools/smoke_serve.py --osprey target/release/osprey --model /tmp/full --backend cuda

With --out FILE it also writes what it printed as JSON (kind "serve", for bench/results).

Needs: requests (no openai client on the GPU machine; CI runs the openai-client tests).
"""
import datetime
import json
import sys
import time

import requests

from serving import arguments, binary_commit, gpu_name, serving


def main():
    a = arguments(__doc__.split("\n")[0], 8011).parse_args()
    results = []
    with serving(a.osprey, a.model, a.backend, a.port, "--max-context", "8192") as base:
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}}}}]
        user = [{"role": "user", "content": "Tell me about ospreys."}]
        cases = {
            "greedy": {"messages": user, "max_tokens": 256, "temperature": 0},
            "sampled": {"messages": user, "max_tokens": 256, "temperature": 0.7, "top_p": 0.95, "top_k": 20, "seed": 5},
            "penalties": {"messages": user, "max_tokens": 128, "temperature": 0.7, "presence_penalty": 1.0, "frequency_penalty": 0.5},
            "tool_choice": {"messages": user, "tools": tools, "max_tokens": 4,
                            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                            "chat_template_kwargs": {"enable_thinking": False}},
            "logprobs": {"messages": user, "max_tokens": 32, "logprobs": True, "top_logprobs": 2},
        }
        failed = False
        for name, body in cases.items():
            t0 = time.time()
            r = requests.post(base + "/v1/chat/completions", json=body, timeout=300)
            dt = time.time() - t0
            ok = r.status_code == 200
            j = r.json() if ok else {}
            usage = j.get("usage", {})
            finish = j.get("choices", [{}])[0].get("finish_reason")
            if name == "tool_choice":
                ok = ok and bool(j["choices"][0]["message"].get("tool_calls"))
            n = usage.get("completion_tokens", 0)
            print(f"{name:>22}: HTTP {r.status_code}, finish {finish}, {n} tokens in {dt:.2f} s "
                  f"({n / dt:.0f} tok/s incl. prefill) {'ok' if ok else 'FAILED ' + r.text[:300]}")
            results.append({"request": name, "body": {k: v for k, v in body.items() if k not in ("messages", "tools")},
                            "status": r.status_code, "finish_reason": finish, "completion_tokens": n,
                            "seconds": round(dt, 3), "tokens_per_s_incl_prefill": round(n / dt, 1), "ok": ok})
            failed |= not ok
        # streamed: the same greedy reply
        t0 = time.time()
        r = requests.post(base + "/v1/chat/completions", json={**cases["greedy"], "stream": True}, timeout=300)
        # split on newlines only: generated text may hold other line separators (U+2028)
        chunks = [line[6:].decode() for line in r.content.split(b"\n") if line.startswith(b"data: ")]
        streamed = "".join((json.loads(c)["choices"][0]["delta"].get("content") or "") +
                           (json.loads(c)["choices"][0]["delta"].get("reasoning_content") or "")
                           for c in chunks[:-1] if json.loads(c)["choices"])
        dt = time.time() - t0
        print(f"{'streamed greedy':>22}: {len(chunks)} events, last {chunks[-1]!r}, {len(streamed)} characters in {dt:.2f} s")
        results.append({"request": "streamed greedy", "events": len(chunks), "last_event": chunks[-1],
                        "characters": len(streamed), "seconds": round(dt, 3), "ok": chunks[-1] == "[DONE]"})
        failed |= chunks[-1] != "[DONE]"
        metrics = requests.get(base + "/metrics", timeout=5).text
        lines = [l for l in metrics.splitlines() if l.startswith("osprey_") and "bucket" not in l]
        print("\n".join(lines)[:1500])
        if a.out:
            write_json(a, results, lines, failed)
    sys.exit(1 if failed else 0)


def write_json(a, results, metrics, failed):
    out = {"kind": "serve", "backend": a.backend, "device": gpu_name(),
           "commit": binary_commit(a.osprey),
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
           "command": " ".join(["python3", "tools/smoke_serve.py"] + sys.argv[1:]),
           "note": "wall clock of each HTTP request, including the prefill of its prompt",
           "pass": not failed, "results": results, "metrics": metrics}
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
