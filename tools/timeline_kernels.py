#!/usr/bin/env python3
"""Builds timeline-instrumented copies of Osprey's CUDA kernels.

Every kernel's first thread of each block records the GPU's global clock (%globaltimer) when the
block starts (mark 0), when it passes griddepcontrol.wait (mark 1: its inputs are ready), at the
phases its source marks with step_phase(2..8) (common.cuh; nothing in normal builds) and when it
ends (mark 9), into per-SM buffers. `osprey bench decode --timeline FILE`, run with
OSPREY_KERNELS_DIR pointing at the cubins built here, replays one decode step and writes each
launch's real start, release and end, so a kernel's cost is read off the step itself: exit to exit,
with what it waited for (the in-graph profile issues a family twice, and the second copy finds
its weights in L2).

    python3 tools/timeline_kernels.py --out target/timeline-kernels
    OSPREY_KERNELS_DIR=target/timeline-kernels osprey bench decode --backend cuda --model DIR \
        --context 4K --timeline timeline.json

The instrumentation (one atomic and a few global stores per block) slows a step by ~5% (628 vs
658 tok/s at 4K, commit f01a27e); compare launches with each other, not with the uninstrumented
step's tokens/s. The kernel sources are not changed: the probe is added to a copy (common.cuh's
step_inputs_ready and step_phase gain their marks, and each `extern "C" __global__` function a
timeline_begin first and a final mark) and compiled with -DOSPREY_TIMELINE.
"""
import argparse
import os
import pathlib
import re
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
KERNELS = ROOT / "crates/osprey-cuda/kernels"
# the decode step's families (prefill-only families are left embedded)
FAMILIES = ["act", "attention", "gdn", "gemv", "moe", "sample"]

HELPERS = '''__device__ __forceinline__ void step_overlap_begin() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
__device__ __forceinline__ void step_inputs_ready() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void step_phase(unsigned) {}  // a timeline mark (2..8) in probed builds
__device__ __forceinline__ void step_phase_after(unsigned, unsigned) {}  // the same, once a value is in'''

# Must match crates/osprey-cuda/src/timeline.rs (record layout, buffer sizes, symbol names).
# A block reserves TIMELINE_MARKS records with one atomic when it starts (mark 0, recorded with
# the time before that atomic; the unused ones are left marked 0xFFFFFFFF) and every later mark is
# a store into its own record: with an atomic per mark, each mark cost its thread a round trip to
# L2 and stretched the phases it separated.
PROBE = '''#ifdef OSPREY_TIMELINE
struct TimelineRecord {
    unsigned long long time_ns;
    unsigned int mark, block, grid, sm;
};
#define TIMELINE_SMS 256
#define TIMELINE_PER_SM 16384
#define TIMELINE_MARKS 10
__device__ TimelineRecord timeline_records[TIMELINE_SMS * TIMELINE_PER_SM];
__device__ unsigned int timeline_counts[TIMELINE_SMS];
__shared__ unsigned int timeline_slot;
__device__ __forceinline__ void timeline_store(unsigned int mark, unsigned long long t) {
    unsigned int sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    const unsigned int i = timeline_slot;
    if (i + TIMELINE_MARKS <= TIMELINE_PER_SM)
        timeline_records[sm * TIMELINE_PER_SM + i + mark] =
            TimelineRecord{t, mark, blockIdx.x | (blockIdx.y << 16), gridDim.x | (gridDim.y << 16), sm};
}
__device__ __forceinline__ void timeline_begin() {
    if (threadIdx.x != 0 || threadIdx.y != 0) return;
    unsigned long long t;
    unsigned int sm;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    const unsigned int i = atomicAdd(&timeline_counts[sm], (unsigned int)TIMELINE_MARKS);
    timeline_slot = i;
    if (i + TIMELINE_MARKS <= TIMELINE_PER_SM)
        for (int m = 1; m < TIMELINE_MARKS; ++m) timeline_records[sm * TIMELINE_PER_SM + i + m].mark = 0xFFFFFFFFu;
    timeline_store(0, t);
}
__device__ __forceinline__ void timeline_mark(unsigned int mark) {
    if (threadIdx.x != 0 || threadIdx.y != 0) return;
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    timeline_store(mark, t);
}
// The clock read predicated on a comparison of `bits`, so that it cannot issue before the value is
// in (a load's or an mma's result): a plain mark may be read while the loads it follows are in flight.
__device__ __forceinline__ void timeline_mark_after(unsigned int mark, unsigned int bits) {
    if (threadIdx.x != 0 || threadIdx.y != 0) return;
    unsigned long long t;
    asm volatile("{\\n\\t.reg .pred p;\\n\\tsetp.eq.b32 p, %1, 0x7FFFFFFF;\\n\\t@p mov.u64 %0, 0;\\n\\t"
                 "@!p mov.u64 %0, %%globaltimer;\\n\\t}" : "=l"(t) : "r"(bits));
    timeline_store(mark, t);
}
#endif
__device__ __forceinline__ void step_overlap_begin() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
__device__ __forceinline__ void step_inputs_ready() {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    timeline_mark(1);
}
__device__ __forceinline__ void step_phase(unsigned mark) { timeline_mark(mark); }
__device__ __forceinline__ void step_phase_after(unsigned mark, unsigned bits) { timeline_mark_after(mark, bits); }'''

KERNEL = re.compile(r'extern "C" __global__[^{;]*\{')


def instrument_common(text):
    if HELPERS not in text:
        raise SystemExit("common.cuh: step_overlap_begin / step_inputs_ready not found as expected")
    return text.replace(HELPERS, PROBE)


def instrument_kernels(text):
    """Adds timeline_begin() after the opening brace of every extern "C" __global__ function and
    timeline_mark(9) before its closing brace."""
    out, i = [], 0
    for m in KERNEL.finditer(text):
        if m.start() < i:
            continue
        j, depth = m.end(), 1
        while depth:
            if j >= len(text):
                raise SystemExit("unbalanced braces after " + m.group(0))
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            j += 1
        out.append(text[i:m.end()])
        out.append(" timeline_begin();")
        out.append(text[m.end():j - 1])
        out.append(" timeline_mark(9); }")
        i = j
    out.append(text[i:])
    return "".join(out)


def instrument_tree(src, dst):
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    common = dst / "common.cuh"
    common.write_text(instrument_common(common.read_text()))
    for f in dst.glob("*.cu"):
        f.write_text(instrument_kernels(f.read_text()))


def find_nvcc():
    if os.environ.get("NVCC"):
        return os.environ["NVCC"]
    for p in sorted(ROOT.glob(".cuda-toolkit/lib/python3*/site-packages/nvidia/cu13/bin/nvcc")):
        return str(p)
    return shutil.which("nvcc") or sys.exit("nvcc not found (set NVCC; see docs in README)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="directory for the instrumented <family>.cubin files")
    ap.add_argument("--families", nargs="*", default=FAMILIES)
    args = ap.parse_args()
    out = pathlib.Path(args.out).resolve()
    src = out / "src"
    instrument_tree(KERNELS, src)
    nvcc = find_nvcc()
    for fam in args.families:
        cmd = [nvcc, "-gencode=arch=compute_90a,code=sm_90a", "-cubin", "-O3", "-lineinfo", "-std=c++17",
               "-DOSPREY_TIMELINE", "-o", str(out / f"{fam}.cubin"), str(src / f"{fam}.cu")]
        print(" ".join(cmd[-3:]), flush=True)
        subprocess.run(cmd, check=True)


if __name__ == "__main__":
    main()
