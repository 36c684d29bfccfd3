"""tools/timeline_layers.py: a step's launches grouped into layers at each input projection, each
launch timed from the previous launch's end, in_proj's copies-asked mark shown, and two timelines
compared launch by launch (a launch only one has shows "-")."""
import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("timeline_layers", ROOT / "tools/timeline_layers.py")
tl = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tl)


def launch(kernel, end, mark2=None, early=None):
    phases = [] if mark2 is None else [{"mark": 2, "median_us": mark2, "last_us": mark2 + 1}]
    out = {"kernel": kernel, "blocks": 132, "start_us": 0.0, "release_us": 0.0, "end_us": end, "phases": phases}
    if early is not None:
        out["blocks_started_before_predecessor_end"] = early
    return out


def step(combine=True, copies=0.5, early=None):
    ls = [launch("embed", 8.0),
          launch("gdn in_proj (norm + qkv|z|b|a)", 16.0, mark2=-6.0, early=early),
          launch("gdn step (conv, l2, delta rule)", 18.0),
          launch("moe experts (top-k, gate/up, swiglu, down) + residual", 30.0),
          launch("attn in_proj (norm + q|k|v)", 36.0, mark2=copies),
          launch("attn decode (split-KV)", 43.0)]
    if combine:
        ls.append(launch("attn combine + gate", 47.0))
    ls += [launch("attn o_proj + residual", 51.0),
           launch("lm_head (final norm + gemv + argmax)", 120.0),
           launch("sample (when sampling)", None)]
    return {"launches": ls}


def test_launches_group_into_layers_timed_from_the_previous_end():
    got = tl.layers(step())
    assert got == [("gdn", [("in_proj", 8.0, -6.0, None), ("gdn_step", 2.0, None, None), ("experts", 12.0, None, None)]),
                   ("attn", [("in_proj", 6.0, 0.5, None), ("attn", 7.0, None, None), ("combine", 4.0, None, None),
                             ("o_proj", 4.0, None, None)])]
    rows = tl.render(step())
    assert rows[0] == " 0 gdn  in_proj  8.00 (copies -6.0)  gdn_step  2.00  experts 12.00  =  22.00"
    assert rows[1].endswith("o_proj  4.00  =  21.00")


def test_two_timelines_compare_launch_by_launch():
    rows = tl.render(step(), step(combine=False, copies=-12.0))
    assert "in_proj  6.00-> 6.00 (copies +0.5->-12.0)" in rows[1]
    assert "combine  4.00->-" in rows[1] and "o_proj  4.00-> 8.00" in rows[1]
    assert rows[1].endswith("=  21.00-> 21.00")


def test_blocks_landed_beside_the_predecessor_are_shown_when_recorded():
    rows = tl.render(step(early=4))
    assert rows[0].startswith(" 0 gdn  in_proj  8.00 (copies -6.0) (landed early 4/132)  gdn_step")
    rows = tl.render(step(early=4), step(early=128))
    assert "(landed early 4/132->128/132)" in rows[0]


def test_timelines_of_different_layers_are_refused():
    short = {"launches": step()["launches"][:4]}
    with pytest.raises(ValueError, match="same layers"):
        tl.render(step(), short)
