#!/usr/bin/env python3
"""Instructions a warp for each kernel of an ncu metrics capture.

A small decode launch is often bound by the instructions its warps issue around the work (index
arithmetic, loops over shapes known only at run time, lookups) rather than by its bytes: the router
GEMV spent 1,350 instructions a warp on one 2 KB row until it was compiled for its shape
(bench/results/cuda-decode-shape-specialised.json). This prints, per kernel (its first launch in
the capture), the grid, the block, the registers, the duration and the warp instructions divided
by the launch's warps, so such launches stand out.

    ncu --clock-control none -c 40 --csv --metrics smsp__inst_executed.sum,gpu__time_duration.sum,\\
        launch__grid_size,launch__block_size,launch__registers_per_thread \\
        osprey bench decode --backend cuda --model DIR --context 4K --rounds 1 > ncu.csv
    python3 tools/ncu_warp_instructions.py ncu.csv
"""
import csv
import sys

METRICS = (
    "smsp__inst_executed.sum",
    "gpu__time_duration.sum",
    "launch__grid_size",
    "launch__block_size",
    "launch__registers_per_thread",
)


def number(text):
    return float(text.replace(",", ""))


def launches(lines):
    """(id, kernel, {metric: (value, unit)}) per profiled launch, in capture order. ncu's CSV comes
    after its own log lines; rows are read from the header on."""
    rows = list(csv.reader(lines))
    start = next((i for i, r in enumerate(rows) if "Metric Name" in r and "Kernel Name" in r), None)
    if start is None:
        raise ValueError("no ncu CSV header (ID, Kernel Name, Metric Name, ...) in the input")
    ix = {name: i for i, name in enumerate(rows[start])}
    by_launch = {}
    for r in rows[start + 1:]:
        if len(r) < len(ix):
            continue
        key = (int(r[ix["ID"]]), r[ix["Kernel Name"]])
        by_launch.setdefault(key, {})[r[ix["Metric Name"]]] = (r[ix["Metric Value"]], r[ix["Metric Unit"]])
    return [(i, k, m) for (i, k), m in sorted(by_launch.items())]


def summary(lines):
    """One line per kernel name (its first launch): grid, block, registers, duration, instructions a warp."""
    out, seen = [], set()
    for _, kernel, m in launches(lines):
        if kernel in seen:
            continue
        missing = [x for x in METRICS if x not in m]
        if missing:
            raise ValueError(f"{kernel}: metrics missing from the capture: {', '.join(missing)}")
        seen.add(kernel)
        grid, block = number(m["launch__grid_size"][0]), number(m["launch__block_size"][0])
        per_warp = number(m["smsp__inst_executed.sum"][0]) / (grid * block / 32)
        duration, unit = m["gpu__time_duration.sum"]
        out.append(
            f"{kernel:28s} grid {int(grid):5d} x {int(block):4d}  regs {m['launch__registers_per_thread'][0]:>4s}  "
            f"{duration:>8s} {unit:8s} {per_warp:8.0f} instructions a warp"
        )
    return out


def main(argv):
    if len(argv) != 2:
        sys.exit(__doc__)
    with open(argv[1], newline="") as f:
        try:
            print("\n".join(summary(f)))
        except ValueError as e:
            sys.exit(f"{argv[1]}: {e}")


if __name__ == "__main__":
    main(sys.argv)
