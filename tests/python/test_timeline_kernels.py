"""tools/timeline_kernels.py: the probe goes into a copy of the real kernels, one begin (the start
mark and the block's record reservation) and one end mark per kernel, the phase marks become
real, and the instrumented copy compiles (when nvcc is at hand, as in CI)."""
import importlib.util
import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("timeline_kernels", ROOT / "tools/timeline_kernels.py")
tk = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tk)


def test_begin_follows_each_kernels_opening_brace_and_end_mark_goes_before_its_closing_one():
    src = 'struct S { int a; };\nextern "C" __global__ void k(int x) {\n    if (x) { return; }\n    { int y = x; }\n}\n' \
          '__device__ int f() { return 1; }\nextern "C" __global__ void __launch_bounds__(256) g() { f(); }\n'
    out = tk.instrument_kernels(src)
    assert out.count("timeline_mark(9)") == 2 and out.count("timeline_begin();") == 2
    assert out.endswith("void __launch_bounds__(256) g() { timeline_begin(); f();  timeline_mark(9); }\n")
    assert 'void k(int x) { timeline_begin();\n    if (x) { return; }' in out
    assert "{ int y = x; }\n timeline_mark(9); }\n__device__ int f() { return 1; }" in out
    assert "__device__ int f() { return 1; }" in out and "f() { timeline_begin()" not in out


def test_every_kernel_of_the_real_sources_is_instrumented(tmp_path):
    tk.instrument_tree(tk.KERNELS, tmp_path / "k")
    common = (tmp_path / "k/common.cuh").read_text()
    assert "timeline_mark(1);" in common and "void step_phase(unsigned mark) { timeline_mark(mark); }" in common
    assert "void step_phase(unsigned) {}" not in common
    for f in tk.KERNELS.glob("*.cu"):
        kernels = len(re.findall(r'extern "C" __global__', f.read_text()))
        probed = (tmp_path / "k" / f.name).read_text()
        assert probed.count("timeline_mark(9)") == kernels and probed.count("timeline_begin();") == kernels, f.name


def test_an_instrumented_family_compiles(tmp_path):
    try:
        nvcc = tk.find_nvcc()
    except SystemExit:
        pytest.skip("nvcc not found")
    tk.instrument_tree(tk.KERNELS, tmp_path / "k")
    subprocess.run([nvcc, "-gencode=arch=compute_90a,code=sm_90a", "-cubin", "-O3", "-std=c++17", "-DOSPREY_TIMELINE",
                    "-o", str(tmp_path / "gdn.cubin"), str(tmp_path / "k/gdn.cu")], check=True)
    assert (tmp_path / "gdn.cubin").stat().st_size > 0
