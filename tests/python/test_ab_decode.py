"""tools/ab_decode.py: variants parsed from NAME[:VAR=VALUE,...], run interleaved round by round with
their own environment, and gathered into one ablation JSON."""
import importlib.util
import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("ab_decode", ROOT / "tools/ab_decode.py")
ab = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ab)


def test_variants_parse_into_names_and_environments():
    assert ab.parse_variant("main") == ("main", {})
    assert ab.parse_variant("v:OSPREY_KERNELS_DIR=/tmp/v,X=1") == ("v", {"OSPREY_KERNELS_DIR": "/tmp/v", "X": "1"})
    with pytest.raises(ValueError, match="not VAR=VALUE"):
        ab.parse_variant("v:OSPREY_KERNELS_DIR")
    with pytest.raises(ValueError, match="no name"):
        ab.parse_variant(":X=1")


def test_rounds_interleave_the_variants_and_land_in_one_json(tmp_path):
    calls = []

    def fake_run(osprey, model, context, env, extra):
        calls.append(env.get("OSPREY_KERNELS_DIR", "embedded"))
        speed = 700.0 + len(calls)
        return {"device": "NVIDIA H200", "commit": "abc1234",
                "results": [{"tokens": 4096, "tokens_per_s": speed}, {"tokens": 131072, "tokens_per_s": speed / 2}]}

    out_path = tmp_path / "ab.json"
    out = ab.main(["--model", "/tmp/full", "--variant", "main", "--variant", "v:OSPREY_KERNELS_DIR=/tmp/v",
                   "--rounds", "2", "--out", str(out_path)], run=fake_run)
    assert calls == ["embedded", "/tmp/v", "embedded", "/tmp/v"]
    assert out == json.loads(out_path.read_text())
    assert out["kind"] == "decode-ablation" and out["commit"] == "abc1234" and out["device"] == "NVIDIA H200"
    main, v = out["variants"]
    assert main["name"] == "main" and main["rounds"] == [{"4096": 701.0, "131072": 350.5}, {"4096": 703.0, "131072": 351.5}]
    assert v["env"] == {"OSPREY_KERNELS_DIR": "/tmp/v"} and len(v["rounds"]) == 2


def test_variant_names_must_differ(tmp_path):
    with pytest.raises(SystemExit, match="must differ"):
        ab.main(["--model", "m", "--variant", "a", "--variant", "a", "--out", str(tmp_path / "x.json")],
                run=lambda *args: None)


def test_a_variant_may_run_its_own_binary(tmp_path):
    calls = []

    def fake_run(osprey, model, context, env, extra):
        calls.append((osprey, env))
        return {"device": "NVIDIA H200", "commit": "abc1234", "results": [{"tokens": 4096, "tokens_per_s": 700.0}]}

    out = ab.main(["--osprey", "/b/main", "--model", "m", "--variant", "main", "--variant", "new:OSPREY_BIN=/b/new,X=1",
                   "--rounds", "1", "--out", str(tmp_path / "ab.json")], run=fake_run)
    assert calls == [("/b/main", {}), ("/b/new", {"X": "1"})]
    assert out["variants"][1]["env"] == {"OSPREY_BIN": "/b/new", "X": "1"}


def test_sample_times_the_sampled_step(tmp_path):
    extras = []

    def fake_run(osprey, model, context, env, extra):
        extras.append(extra)
        return {"device": "d", "commit": "c", "results": [{"tokens": 4096, "tokens_per_s": 1.0}]}

    ab.main(["--model", "m", "--variant", "a", "--rounds", "1", "--out", str(tmp_path / "x.json")], run=fake_run)
    ab.main(["--model", "m", "--variant", "a", "--rounds", "1", "--sample", "--out", str(tmp_path / "y.json")],
            run=fake_run)
    assert "--sample" not in extras[0] and extras[1][-1] == "--sample"
