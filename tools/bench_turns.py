#!/usr/bin/env python3
"""Multi-turn chats over `osprey serve`: time to first token of each turn, with the GPU's
session copies on (--gpu-cache-mib 8192) and off (0). The chat template drops an earlier reply's
reasoning, so each new turn's prompt leaves what the device ran at the start of the last reply:
with copies the server resumes from the copy kept there and prefills only the new tokens;
without, the GPU prefills the whole conversation again. Two runs: one conversation, and two
conversations taking turns (each return to a conversation also copies back the K/V rows the
other one wrote over), and new conversations that open with one long system prompt (an agent's
sub-tasks: each resumes from the copy kept at the system prompt's end).

    python3 tools/bench_turns.py --osprey target/release/osprey --model /tmp/full --turns 4 \
        --user-tokens 16000 --out bench/results/cuda-serve-turns-full.json

Each turn adds a user message of about --user-tokens tokens (distinct text, so nothing but the
conversation's own prefix is reused) and asks for --reply-tokens tokens of reply (greedy, with
reasoning on: a random model's reply is all reasoning). Streams each reply and reads the usage
chunk. Needs: requests.
"""
import datetime
import json
import sys
import time

import requests

from serving import arguments, binary_commit, gpu_name, serving


def user_text(conversation, turn, tokens):
    # about six tokens a word for these short numbered words
    return " ".join(f"{conversation}{turn}x{i % 997}" for i in range(tokens // 6))


def run_turns(a, cache_mib, order, port):
    """Runs the turns of the conversations named in `order` (one turn each time a name comes)."""
    with serving(a.osprey, a.model, a.backend, port, "--max-context", str(a.max_context),
                 "--gpu-cache-mib", str(cache_mib)) as base:
        chats, turns = {}, []
        for name in order:
            # a conversation named "S..." opens with the system prompt all of them share, then a
            # short task; the others add a long user message each turn
            shared = name.startswith("S")
            messages = chats.setdefault(name, [{"role": "system", "content": user_text("S", 0, a.user_tokens)}]
                                        if shared else [])
            turn = len(messages) // 2
            size = a.user_tokens // 64 if shared else a.user_tokens
            messages.append({"role": "user", "content": user_text(name, turn, size)})
            body = {"messages": messages, "max_tokens": a.reply_tokens, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True}}
            t0 = time.time()
            first = None
            reasoning, content, usage = [], [], {}
            with requests.post(base + "/v1/chat/completions", json=body, stream=True, timeout=600) as r:
                if r.status_code != 200:
                    raise SystemExit(f"turn {turn}: HTTP {r.status_code} {r.text[:300]}")
                for line in r.iter_lines():
                    if not line.startswith(b"data: ") or line == b"data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    for c in chunk.get("choices", []):
                        d = c.get("delta", {})
                        if d.get("reasoning_content") or d.get("content"):
                            first = first or time.time()
                            reasoning.append(d.get("reasoning_content") or "")
                            content.append(d.get("content") or "")
            done = time.time()
            messages.append({"role": "assistant", "content": "".join(content),
                             "reasoning_content": "".join(reasoning)})
            row = {"conversation": name, "turn": turn + 1, "prompt_tokens": usage.get("prompt_tokens"),
                   "cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens"),
                   "completion_tokens": usage.get("completion_tokens"),
                   "time_to_first_token_s": round((first or done) - t0, 4), "seconds": round(done - t0, 4)}
            print(f"cache {cache_mib:>4} MiB: {name} turn {row['turn']}: {row['prompt_tokens']} prompt tokens "
                  f"({row['cached_tokens']} cached), first token in {row['time_to_first_token_s']:.3f} s, "
                  f"{row['completion_tokens']} tokens in {row['seconds']:.2f} s", flush=True)
            turns.append(row)
        return turns


def main():
    ap = arguments(__doc__.split("\n")[0], 8012)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--user-tokens", type=int, default=16000)
    ap.add_argument("--reply-tokens", type=int, default=64)
    ap.add_argument("--max-context", type=int, default=65536)
    a = ap.parse_args()
    orders = {"one conversation": ["A"] * a.turns, "two taking turns": ["A", "B"] * a.turns,
              "new conversations, one system prompt": [f"S{i + 1}" for i in range(a.turns)]}
    runs = [{"scenario": scenario, "gpu_cache_mib": mib, "turns": run_turns(a, mib, order, a.port)}
            for scenario, order in orders.items() for mib in (8192, 0)]
    if a.out:
        out = {"kind": "serve-turns", "backend": a.backend, "device": gpu_name(),
               "commit": binary_commit(a.osprey),
               "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
               "command": " ".join(["python3", "tools/bench_turns.py"] + sys.argv[1:]),
               "note": "each turn's time to first token over HTTP (its prompt's prefill), "
                       "with --gpu-cache-mib 8192 and 0",
               "results": runs}
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
