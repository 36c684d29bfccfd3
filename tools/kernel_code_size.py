#!/usr/bin/env python3
"""SASS instructions per kernel of Osprey's built cubins, and where a kernel's code comes from.

Code size moves the decode step: the experts selection's rounds kept as a loop (192 instructions
fewer in moe_experts_h2048) gained 2.2% at 4K, more than the selection's own time
(bench/results/cuda-decode-code-size.json), and a layer runs 5-7 kernels of 0.7-2.9K instructions.
This lists each kernel's instruction count and bytes (16 bytes an instruction), largest first, so a
change's effect on code size is read before it goes to the GPU; with --lines KERNEL it attributes
that kernel's instructions to the source lines they came from (the innermost inlined line, from the
cubin's -lineinfo), largest first. Needs cuobjdump (and nvdisasm for --lines) from the CUDA
toolkit; on this machine: pip install nvidia-cuda-cuobjdump==13.2.51 "nvidia-cuda-nvdisasm==13.2.*".

    python3 tools/kernel_code_size.py target/release/build/osprey-cuda-*/out/*.cubin
    python3 tools/kernel_code_size.py --lines moe_experts_h2048 target/release/build/osprey-cuda-*/out/moe.cubin
"""
import argparse
import collections
import re
import subprocess
import sys

INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+\S")
FUNCTION = re.compile(r"^\s+Function : (\S+)")
LINE_INFO = re.compile(r'//## File "([^"]+)", line (\d+)')
SECTION = re.compile(r"^\s*\.section\s+\.text\.([^,\s]+)")


def sass_counts(text):
    """{kernel: instructions} from `cuobjdump -sass` output."""
    counts, current = {}, None
    for line in text.splitlines():
        m = FUNCTION.match(line)
        if m:
            current = m.group(1)
            counts[current] = 0
        elif current is not None and INSTRUCTION.match(line):
            counts[current] += 1
    return counts


def line_counts(text, kernel):
    """Counter of 'file:line' -> instructions of `kernel` in `nvdisasm -gi` output. nvdisasm writes
    a block of line annotations (innermost line first, then where it was inlined) only where the
    line changes: each instruction goes to the first line of the last block above it."""
    counts, inside, current, fresh = collections.Counter(), False, "?", True
    for line in text.splitlines():
        m = SECTION.match(line)
        if m:
            inside, current, fresh = m.group(1) == kernel, "?", True
            continue
        if not inside:
            continue
        m = LINE_INFO.search(line)
        if m:
            if fresh:
                current, fresh = f"{m.group(1).rsplit('/', 1)[-1]}:{m.group(2)}", False
            continue
        if INSTRUCTION.match(line):
            counts[current] += 1
            fresh = True
    if not counts:
        raise ValueError(f"no instructions of {kernel} (is it in this cubin?)")
    return counts


def run(tool, *args):
    try:
        return subprocess.run([tool, *args], check=True, capture_output=True, text=True).stdout
    except FileNotFoundError:
        sys.exit(f"{tool} not found: put the CUDA toolkit's bin on PATH (see this script's help)")
    except subprocess.CalledProcessError as e:
        sys.exit(f"{tool} {' '.join(args)}: {e.stderr.strip()}")


def main(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cubins", nargs="+")
    p.add_argument("--lines", metavar="KERNEL", help="attribute KERNEL's instructions to source lines")
    p.add_argument("--top", type=int, default=25, help="rows of --lines (default 25)")
    a = p.parse_args(argv)
    if a.lines:
        for cubin in a.cubins:
            try:
                counts = line_counts(run("nvdisasm", "-gi", cubin), a.lines)
            except ValueError:
                continue
            print(f"{a.lines} ({cubin}): {sum(counts.values())} instructions")
            for where, n in counts.most_common(a.top):
                print(f"  {n:6d}  {where}")
            return
        sys.exit(f"{a.lines}: not in {', '.join(a.cubins)}")
    rows = []
    for cubin in a.cubins:
        rows += [(n, k, cubin) for k, n in sass_counts(run("cuobjdump", "-sass", cubin)).items()]
    for n, k, cubin in sorted(rows, reverse=True):
        print(f"{k:28s} {n:6d} instructions {16 * n / 1024:6.1f} KB  {cubin.rsplit('/', 1)[-1]}")


if __name__ == "__main__":
    main(sys.argv[1:])
