"""lm-evaluation-harness (its `local-completions` model) against `osprey serve`: a multiple-choice
task from a local file, scored by loglikelihood through the completions endpoint (echo, prompt
log-probabilities) with the server's own tokenizer (found through /tokenizer_info and /tokenize).

Run by .ci/run:  OSPREY_BIN=target/debug/osprey python -m pytest tests/python
"""
import json
import math

import lm_eval
import requests
from lm_eval.tasks import TaskManager

DOCS = [
    {"question": "The capital of France is", "choices": [" Paris", " Rome", " Berlin"], "answer": 0},
    {"question": "Two plus two equals", "choices": [" four", " five"], "answer": 0},
    {"question": "Ospreys eat", "choices": [" fish", " rocks"], "answer": 0},
]

TASK = """task: osprey_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""

GEN_TASK = """task: osprey_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{choices[0]}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 12
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""

KEY = {"Authorization": "Bearer test-key"}


def loglikelihood(base, context, continuation):
    """What the harness should compute, asked of the server directly: the continuation's tokens'
    log-probabilities after the context (the pair encoded whole and split where the context's
    own tokens end, as the harness does)."""
    tok = lambda text: requests.post(f"{base}/tokenize", json={"prompt": text}, headers=KEY).json()["tokens"]  # noqa: E731
    whole, ctx = tok(context + continuation), tok(context)
    r = requests.post(f"{base}/v1/completions", headers=KEY, json={
        "prompt": [whole], "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0}).json()
    return sum(r["choices"][0]["logprobs"]["token_logprobs"][len(ctx):])


def evaluate(base, tmp_path, monkeypatch, task, template):
    """The harness's run of `template` (a task over DOCS) against the server, samples logged."""
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tmp_path / f"{task}.yaml").write_text(template.format(data=data))
    monkeypatch.setenv("OPENAI_API_KEY", "test-key")
    return lm_eval.simple_evaluate(
        model="local-completions",
        model_args=f"model=tiny,base_url={base}/v1/completions,auth_token=test-key,num_concurrent=1,max_retries=1",
        tasks=[task], task_manager=TaskManager(include_path=str(tmp_path)), log_samples=True)


def test_a_multiple_choice_task_scores_through_the_completions_endpoint(osprey_server, tmp_path, monkeypatch):
    out = evaluate(osprey_server, tmp_path, monkeypatch, "osprey_mc", TASK)
    acc = out["results"]["osprey_mc"]["acc,none"]
    assert 0 <= acc <= 1
    samples = out["samples"]["osprey_mc"]
    assert len(samples) == len(DOCS)
    # the harness's loglikelihood of each choice is the server's, position by position
    for s in samples:
        doc = s["doc"]
        for choice, resp in zip(doc["choices"], s["resps"]):
            ll, _greedy = resp[0]
            assert math.isfinite(ll) and ll < 0
            # (the harness puts its target delimiter, a space, between question and choice)
            assert abs(ll - loglikelihood(osprey_server, doc["question"], " " + choice)) < 1e-4


def test_generation_until_a_stop_string(osprey_server, tmp_path, monkeypatch):
    # (the tiny model's random text is mostly CJK: a stop string after multibyte text once
    # panicked the engine)
    out = evaluate(osprey_server, tmp_path, monkeypatch, "osprey_gen", GEN_TASK)
    samples = out["samples"]["osprey_gen"]
    assert len(samples) == len(DOCS)
    for s in samples:
        text = s["resps"][0][0]
        # the server's own greedy reply to the same prompt and stop
        r = requests.post(f"{osprey_server}/v1/completions", headers=KEY, json={
            "prompt": s["doc"]["question"], "max_tokens": 12, "temperature": 0, "stop": ["\n"]}).json()
        assert text == r["choices"][0]["text"] and "\n" not in text
