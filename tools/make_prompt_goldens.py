#!/usr/bin/env python3
"""Golden chat-template renderings from transformers' apply_chat_template (the reference) for the
model files in assets/qwen3.6-35b-a3b. Rust tests render the same conversations with minijinja and
encode them with the tokenizers crate, and must produce the same text and the same ids.

Run:  python3 tools/make_prompt_goldens.py --out fixtures/prompt/goldens.json
Needs: transformers >= 5.17 (tokenizer only; no torch needed).
"""
import argparse
import json

import transformers
from transformers import AutoTokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name"},
        "days": {"type": "integer"}}, "required": ["city"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search files — returns paths",
    "parameters": {"type": "object", "properties": {
        "query": {"type": "string"}, "filters": {"type": "object"},
        "limit": {"type": "number"}, "exact": {"type": "boolean"}}}}}


def call(name, args, cid="call_1"):
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


CASES = [
    ("hi_thinking", [{"role": "user", "content": "Hi"}], None, {}, True),
    ("hi_no_thinking", [{"role": "user", "content": "Hi"}], None, {"enable_thinking": False}, True),
    ("system_user", [{"role": "system", "content": "You are terse."},
                     {"role": "user", "content": "Name three primes."}], None, {}, True),
    ("multi_turn", [{"role": "user", "content": "What is 2+2?"},
                    {"role": "assistant", "content": "4"},
                    {"role": "user", "content": "And times 3?"}], None, {}, True),
    ("history_reasoning_dropped", [
        {"role": "user", "content": "Pick a colour."},
        {"role": "assistant", "content": "Blue.", "reasoning_content": "Any colour works; blue."},
        {"role": "user", "content": "Why?"}], None, {}, True),
    ("history_reasoning_preserved", [
        {"role": "user", "content": "Pick a colour."},
        {"role": "assistant", "content": "Blue.", "reasoning_content": "Any colour works; blue."},
        {"role": "user", "content": "Why?"}], None, {"preserve_thinking": True}, True),
    ("inline_think_in_content", [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "<think>\nshort thought\n</think>\n\nA1"},
        {"role": "user", "content": "Q2"}], None, {}, True),
    ("tools_user", [{"role": "user", "content": "Weather in Paris?"}], [WEATHER], {}, True),
    ("tool_round_trip", [
        {"role": "system", "content": "Use tools when useful."},
        {"role": "user", "content": "Weather in Paris for 3 days?"},
        {"role": "assistant", "content": "", "reasoning_content": "Need the weather tool.",
         "tool_calls": [call("get_weather", {"city": "Paris", "days": 3})]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21, \"sky\": \"clear\"}"}],
     [WEATHER], {}, True),
    ("two_calls_two_results", [
        {"role": "user", "content": "Compare Paris and Rome."},
        {"role": "assistant", "content": "Checking both.",
         "tool_calls": [call("get_weather", {"city": "Paris"}, "a"), call("get_weather", {"city": "Rome"}, "b")]},
        {"role": "tool", "tool_call_id": "a", "content": "sunny"},
        {"role": "tool", "tool_call_id": "b", "content": "rain"},
        {"role": "assistant", "content": "Paris is sunny; Rome has rain."},
        {"role": "user", "content": "Thanks!"}], [WEATHER, SEARCH], {}, True),
    ("typed_arguments", [
        {"role": "user", "content": "Find notes"},
        {"role": "assistant", "content": "",
         "tool_calls": [call("search", {"query": "notes \"draft\"", "filters": {"ext": ["md", "txt"], "size": 1.5},
                                        "limit": 10, "exact": False})]},
        {"role": "tool", "content": "[]"}], [SEARCH], {"enable_thinking": False}, True),
    ("unicode", [{"role": "user", "content": "Ciao! 你好 🌍 — café naïve 12345 x²"}], None, {}, True),
    ("no_generation_prompt", [
        {"role": "user", "content": "Say ok"},
        {"role": "assistant", "content": "ok"}], None, {}, False),
]

# continue_final_message: the prompt ends inside the final message (an assistant reply begun by the
# caller); the template trims it, so trailing whitespace goes, and an empty one ends at </think>
CONTINUE_CASES = [
    ("continue_answer", [
        {"role": "user", "content": "Give me JSON"},
        {"role": "assistant", "content": "{\"name\": "}], None, {}),
    ("continue_answer_no_thinking", [
        {"role": "user", "content": "Count to five"},
        {"role": "assistant", "content": "1, 2,"}], None, {"enable_thinking": False}),
    ("continue_after_reasoning", [
        {"role": "user", "content": "Pick a colour."},
        {"role": "assistant", "content": "Blue", "reasoning_content": "Any will do."}], None, {}),
    ("continue_text_parts", [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": " there"}]}],
     None, {}),
    ("continue_empty", [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": ""}], None, {}),
    ("continue_with_tools", [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me check"}], [WEATHER], {}),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="assets/qwen3.6-35b-a3b")
    ap.add_argument("--out", default="fixtures/prompt/goldens.json")
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(args.model)
    out = {"transformers": transformers.__version__, "tokenizer_class": type(tok).__name__, "cases": []}
    for name, messages, tools, kwargs, gen in CASES:
        text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=gen, **kwargs)
        ids = tok.encode(text, add_special_tokens=False)
        out["cases"].append({"name": name, "messages": messages, "tools": tools, "kwargs": kwargs,
                             "add_generation_prompt": gen, "text": text, "ids": ids})
    for name, messages, tools, kwargs in CONTINUE_CASES:
        text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=False,
                                       continue_final_message=True, **kwargs)
        ids = tok.encode(text, add_special_tokens=False)
        out["cases"].append({"name": name, "messages": messages, "tools": tools, "kwargs": kwargs,
                             "add_generation_prompt": False, "continue_final_message": True,
                             "text": text, "ids": ids})
    texts = ["hello world", "  leading spaces\n\n\ttabs", "don't STOP we'll", "数字123 and 4.56e7",
             "emoji 👩‍💻 mix", "<think>\nx\n</think>", "a\r\nb"]
    out["encode"] = [{"text": t, "ids": tok.encode(t, add_special_tokens=False)} for t in texts]
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1, ensure_ascii=False)
    print("wrote", args.out, len(out["cases"]), "conversations with", out["tokenizer_class"])


if __name__ == "__main__":
    main()
