"""tools/kernel_code_size.py: SASS instructions per kernel from cuobjdump's listing, and a kernel's
instructions attributed to source lines from nvdisasm's line annotations (written only where the
line changes, innermost line first)."""
import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("kernel_code_size", ROOT / "tools/kernel_code_size.py")
kcs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kcs)

CUOBJDUMP = """
Fatbin elf code:
================
arch = sm_90a
code version = [1,8]

\tcode for sm_90a
\t\tFunction : gdn_step
\t.headerflags\t@"EF_CUDA_64BIT_ADDRESS EF_CUDA_SM90"
        /*0000*/                   LDC R1, c[0x0][0x28] ;
                                                          /* 0x00000a00ff017b82 */
        /*0010*/                   S2R R0, SR_TID.X ;
        /*0020*/                   EXIT ;
\t\t..........

\t\tFunction : moe_experts_h2048
\t.headerflags\t@"EF_CUDA_64BIT_ADDRESS EF_CUDA_SM90"
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/              @!P0 BRA 0x7f0 ;
\t\t..........
"""

NVDISASM = """
\t.section\t.text.gemv_q_pair,"ax",@progbits
\t//## File "/k/gemv.cu", line 740
        /*0000*/                   LDC R1, c[0x0][0x28] ;
\t.section\t.text.moe_experts_h2048,"ax",@progbits
\t//## File "/k/moe.cu", line 543
        /*0000*/                   LDC R1, c[0x0][0x28] ;
\t//## File "/k/tiles.cuh", line 102 inlined at "/k/moe.cu", line 420
\t//## File "/k/moe.cu", line 543
        /*0010*/                   F2I.NTZ R3, R2 ;
        /*0020*/                   VIMNMX R3, R3, 0x7f, PT ;
\t//## File "/k/moe.cu", line 122 inlined at "/k/moe.cu", line 543
        /*0030*/                   REDUX.MAX UR4, R40 ;
"""


def test_instructions_per_kernel_from_the_listing():
    assert kcs.sass_counts(CUOBJDUMP) == {"gdn_step": 3, "moe_experts_h2048": 2}


def test_each_instruction_goes_to_the_innermost_line_of_the_last_annotation_above_it():
    counts = kcs.line_counts(NVDISASM, "moe_experts_h2048")
    assert counts == {"moe.cu:543": 1, "tiles.cuh:102": 2, "moe.cu:122": 1}
    assert kcs.line_counts(NVDISASM, "gemv_q_pair") == {"gemv.cu:740": 1}


def test_a_kernel_not_in_the_listing_is_an_error():
    with pytest.raises(ValueError, match="no instructions of gdn_step"):
        kcs.line_counts(NVDISASM, "gdn_step")
