"""tools/ncu_warp_instructions.py: instructions a warp from an ncu metrics CSV (after ncu's log
lines), one line per kernel from its first launch, and a clear error when the capture lacks a
metric or is not ncu's CSV."""
import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("ncu_warp_instructions", ROOT / "tools/ncu_warp_instructions.py")
nwi = importlib.util.module_from_spec(spec)
spec.loader.exec_module(nwi)

HEADER = '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",' \
         '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"'


def rows(launch_id, kernel, grid, block, inst, us, regs):
    head = f'"{launch_id}","906","osprey","127.0.0.1","{kernel}","1","13","({block}, 1, 1)","({grid}, 1, 1)","0","9.0",""'
    metrics = [("gpu__time_duration.sum", "usecond", us), ("launch__block_size", "", str(block)),
               ("launch__grid_size", "", str(grid)), ("launch__registers_per_thread", "register/thread", str(regs)),
               ("smsp__inst_executed.sum", "inst", inst)]
    return [f'{head},"{name}","{unit}","{value}"' for name, unit, value in metrics]


def capture(*launches):
    lines = ["==PROF== Connected to process 906", "==PROF== Profiling \"gemv_q\": 0%....50%....100% - 1 pass", HEADER]
    for launch in launches:
        lines += rows(*launch)
    return lines


def test_instructions_a_warp_per_kernel_from_its_first_launch():
    out = nwi.summary(capture((0, "gemv_q_k2048", 161, 256, "1,738,766", "7.17", 115),
                              (1, "moe_experts_h2048", 256, 256, "1,234,944", "14.05", 80),
                              (2, "gemv_q_k2048", 161, 256, "9,999,999", "9.00", 115)))
    assert len(out) == 2
    # 161 x 256 threads = 1,288 warps
    assert out[0].startswith("gemv_q_k2048") and out[0].endswith(" 1350 instructions a warp")
    assert "grid   161 x  256" in out[0] and "regs  115" in out[0] and "7.17 usecond" in out[0]
    # 256 x 256 threads = 2,048 warps
    assert out[1].startswith("moe_experts_h2048") and out[1].endswith(" 603 instructions a warp")


def test_a_missing_metric_or_no_csv_is_named():
    lines = capture((0, "gemv_q", 161, 256, "1,000", "7.0", 115))
    lines = [line for line in lines if "smsp__inst_executed.sum" not in line]
    with pytest.raises(ValueError, match="gemv_q: metrics missing from the capture: smsp__inst_executed.sum"):
        nwi.summary(lines)
    with pytest.raises(ValueError, match="no ncu CSV header"):
        nwi.summary(["==PROF== Connected to process 906", "no kernels were profiled"])
