"""tools/compare_mlx.py --merge: runs of disjoint lengths join into one report whose rows keep their
own commit, whose means are recomputed over all rows, and which also writes the peer results that
`osprey chart` draws. Overlapping runs are refused. --restate sets a report's MLX-LM side against
Osprey's latest sweeps, refusing lengths they lack, a sampled decode sweep or another GPU's.

Run by .ci/run:  python -m pytest tests/python
"""
import json
import os
import subprocess
import sys

import pytest

TOOL = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "compare_mlx.py")


def part(path, commit, date, rows):
    results = []
    for n, (op, mp, od, md) in rows.items():
        results.append({"tokens": n, "osprey_prefill": op, "mlx_prefill": mp, "osprey_decode": od, "mlx_decode": md,
                        "prefill_ratio": op / mp, "decode_ratio": od / md,
                        "rounds": {"osprey_prefill": [op], "mlx_prefill": [mp], "osprey_decode": [od], "mlx_decode": [md]}})
    report = {"kind": "compare", "peer": "mlx-lm test", "device": "GPU", "commit": commit, "date": date,
              "command": f"compare {commit}", "decode_steps": 32, "method": "test", "results": results}
    path.write_text(json.dumps(report))
    return str(path)


def merge(tmp_path, *inputs):
    out = tmp_path / "merged.json"
    run = subprocess.run([sys.executable, TOOL, "--merge", *inputs, "--out", str(out), "--peer-dir", str(tmp_path)],
                         capture_output=True, text=True)
    return run, out


def test_merge_joins_disjoint_runs(tmp_path):
    a = part(tmp_path / "a.json", "aaaaaaa", "2026-01-01T00:00:00Z", {4096: (400.0, 100.0, 30.0, 10.0)})
    b = part(tmp_path / "b.json", "bbbbbbb", "2026-01-02T00:00:00Z", {256: (200.0, 100.0, 40.0, 10.0)})
    run, out = merge(tmp_path, a, b)
    assert run.returncode == 0, run.stderr
    d = json.loads(out.read_text())
    assert [r["tokens"] for r in d["results"]] == [256, 4096]
    assert [r["commit"] for r in d["results"]] == ["bbbbbbb", "aaaaaaa"]
    assert d["mean_prefill_ratio"] == pytest.approx(3.0)
    assert d["mean_decode_ratio"] == pytest.approx(3.5)
    assert d["commit"] == "bbbbbbb"  # the newest part
    assert [p["tokens"] for p in d["parts"]] == [[4096], [256]]
    peer = json.loads((tmp_path / "peer-mlxlm-decode-h200.json").read_text())
    assert [(r["tokens"], r["tokens_per_s"]) for r in peer["results"]] == [(256, 10.0), (4096, 10.0)]


def test_merge_refuses_overlapping_lengths(tmp_path):
    a = part(tmp_path / "a.json", "aaaaaaa", "2026-01-01T00:00:00Z", {256: (400.0, 100.0, 30.0, 10.0)})
    b = part(tmp_path / "b.json", "bbbbbbb", "2026-01-02T00:00:00Z", {256: (200.0, 100.0, 40.0, 10.0)})
    run, out = merge(tmp_path, a, b)
    assert run.returncode != 0
    assert "256" in run.stderr and not out.exists()


def sweep(path, kind, commit, rates, device="GPU", sampling=None):
    report = {"kind": kind, "backend": "cuda", "device": device, "commit": commit, "date": "2026-02-01T00:00:00Z",
              "command": f"osprey bench {kind}", "sampling": sampling,
              "results": [{"tokens": n, "tokens_per_s": r} for n, r in rates.items()]}
    path.write_text(json.dumps(report))
    return str(path)


def restate(tmp_path, compare, prefill, decode):
    out = tmp_path / "latest.json"
    run = subprocess.run([sys.executable, TOOL, "--restate", compare, "--prefill", prefill, "--decode", decode,
                          "--out", str(out)], capture_output=True, text=True)
    return run, out


def test_restate_sets_mlx_figures_against_the_latest_sweeps(tmp_path):
    a = part(tmp_path / "a.json", "aaaaaaa", "2026-01-01T00:00:00Z",
             {256: (400.0, 100.0, 30.0, 10.0), 4096: (800.0, 200.0, 20.0, 5.0)})
    p = sweep(tmp_path / "p.json", "prefill", "ppppppp", {256: 1000.0, 4096: 2000.0, 131072: 9.0})
    d = sweep(tmp_path / "d.json", "decode", "ddddddd", {256: 60.0, 4096: 50.0})
    run, out = restate(tmp_path, a, p, d)
    assert run.returncode == 0, run.stderr
    r = json.loads(out.read_text())
    assert r["kind"] == "compare-restated"
    assert [(x["tokens"], x["osprey_prefill"], x["mlx_prefill"]) for x in r["results"]] == [
        (256, 1000.0, 100.0), (4096, 2000.0, 200.0)]
    assert r["mean_prefill_ratio"] == pytest.approx(10.0)
    assert r["mean_decode_ratio"] == pytest.approx((6.0 + 10.0) / 2)
    assert (r["osprey"]["prefill"]["commit"], r["osprey"]["decode"]["commit"]) == ("ppppppp", "ddddddd")


def test_restate_refuses_missing_lengths_sampled_sweeps_and_other_gpus(tmp_path):
    a = part(tmp_path / "a.json", "aaaaaaa", "2026-01-01T00:00:00Z", {4096: (800.0, 200.0, 20.0, 5.0)})
    p = sweep(tmp_path / "p.json", "prefill", "p", {4096: 2000.0})
    for d, words in [(sweep(tmp_path / "d1.json", "decode", "d", {256: 60.0}), "4096"),
                     (sweep(tmp_path / "d2.json", "decode", "d", {4096: 50.0}, sampling={"temperature": 1.0}),
                      "sampled"),
                     (sweep(tmp_path / "d3.json", "decode", "d", {4096: 50.0}, device="Other GPU"), "Other GPU")]:
        run, out = restate(tmp_path, a, p, d)
        assert run.returncode != 0 and words in run.stderr and not out.exists(), run.stderr
