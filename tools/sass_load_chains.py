#!/usr/bin/env python3
"""Loads that wait on each other, from a kernel's SASS.

For each global load (LDG / LD) of one kernel: how many instructions until its result is first
read, and how many global loads are issued within 60 instructions after that read. A load used a
few instructions after it is issued, with more loads behind the use, usually means the later loads
wait out its round trip although they do not depend on it (a conversion or a branch between
them, a reduction between a load and the next). That is a lead to check, not a verdict: reorder
the source, rebuild, and measure the step.

    cuobjdump -sass -fun gdn_step target/.../gdn.cubin > gdn_step.sass
    python3 tools/sass_load_chains.py gdn_step.sass

cuobjdump ships in the PyPI package nvidia-cuda-cuobjdump and disassembles with nvdisasm from
nvidia-cuda-nvdisasm (both into the toolkit's venv: .cuda-toolkit/bin/pip install
nvidia-cuda-cuobjdump==13.2.51 "nvidia-cuda-nvdisasm==13.2.*"); build a cubin as gpu.md shows
(nvcc -arch=sm_90a -cubin -O3 kernels/<family>.cu).
"""
import re
import sys

LOAD = re.compile(r"(@!?U?P\w+\s+)?(LDG|LD)\.(\S*)\s+R(\d+),")
USE_WINDOW = 400
AFTER_WINDOW = 60


def instructions(path):
    out = []
    for line in open(path):
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            out.append((m.group(1), m.group(2).strip()))
    return out


def registers(text):
    return {int(r) for r in re.findall(r"\bR(\d+)\b", text)}


def sources(text):
    """The operands an instruction reads (all but the first, the destination, unless it stores)."""
    op, _, rest = text.partition(" ")
    if op.startswith("@"):
        op, _, rest = rest.strip().partition(" ")
    if op.startswith(("ST", "RED", "ATOM")) or "," not in rest:
        return rest
    return rest.split(",", 1)[1]


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    ins = instructions(sys.argv[1])
    flagged = 0
    for i, (addr, text) in enumerate(ins):
        m = LOAD.match(text)
        if not m:
            continue
        width = 4 if "128" in m.group(3) else 2 if "64" in m.group(3) else 1
        dst = set(range(int(m.group(4)), int(m.group(4)) + width))
        use = next(
            (j for j in range(i + 1, min(i + USE_WINDOW, len(ins))) if registers(sources(ins[j][1])) & dst),
            None,
        )
        after = 0
        if use is not None:
            after = sum(1 for k in range(use + 1, min(use + AFTER_WINDOW, len(ins))) if LOAD.match(ins[k][1]))
        distance = "-" if use is None else str(use - i)
        waits = use is not None and use - i < 12 and after > 0
        flagged += waits
        note = "  <- later loads wait behind its use" if waits else ""
        print(f"{addr} {text[:60]:60s} used after {distance:>3}, loads after the use {after}{note}")
    print(f"{flagged} load(s) flagged")


if __name__ == "__main__":
    main()
