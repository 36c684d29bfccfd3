"""tools/sass_load_chains.py: a load whose result is used a few instructions later, with more loads
behind that use, is flagged; loads issued together and used later are not.

Run by .ci/run:  python -m pytest tests/python
"""
import os
import subprocess
import sys

TOOL = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "sass_load_chains.py")


def sass(lines):
    """cuobjdump -sass layout: address comment, instruction, encoding comment."""
    out = ["        Function : k", ""]
    for i, text in enumerate(lines):
        out.append(f"        /*{i * 16:04x}*/                   {text} ;   /* 0x000 */")
        out.append("                                                          /* 0x000 */")
    return "\n".join(out) + "\n"


def run(tmp_path, lines):
    path = tmp_path / "k.sass"
    path.write_text(sass(lines))
    done = subprocess.run([sys.executable, TOOL, str(path)], capture_output=True, text=True, check=True)
    return done.stdout.splitlines()


def test_a_load_used_at_once_with_loads_behind_it_is_flagged(tmp_path):
    out = run(tmp_path, [
        "LDG.E.U16 R2, desc[UR8][R6.64]",
        "IMAD.U32 R2, R2, 0x10000, RZ",
        "LDG.E.128 R24, desc[UR8][R8.64]",
        "FFMA R3, R24, R2, RZ",
    ])
    assert "later loads wait" in out[0]
    assert out[-1] == "1 load(s) flagged"


def test_loads_issued_together_are_not_flagged(tmp_path):
    out = run(tmp_path, [
        "LDG.E.U16 R2, desc[UR8][R6.64]",
        "LDG.E.128 R24, desc[UR8][R8.64]",
        "IMAD.U32 R2, R2, 0x10000, RZ",
        "FFMA R3, R24, R2, RZ",
    ])
    assert not any("later loads wait" in line for line in out)
    assert out[-1] == "0 load(s) flagged"


def test_a_store_reading_the_loaded_register_counts_as_its_use(tmp_path):
    out = run(tmp_path, [
        "LDG.E R4, desc[UR8][R6.64]",
        "STS [R10], R4",
        "LDG.E R5, desc[UR8][R8.64]",
        "STS [R11], R5",
    ])
    assert "used after   1" in out[0] and "later loads wait" in out[0]
