"""jit's ptxas report: the figures of the kernel asked about, not of its neighbours in the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from lab.kernels import jit
from lab.kernels import swiglu_quant as sq

FIXTURES = Path(__file__).resolve().parent / "fixtures"
# `nvcc -cubin -Xptxas -v` (CUDA 13.0) on ptxas_report's unit for swiglu_quant.cu. ptxas reports
# div_check (24 registers) first and the marker kernel (4) last; the kernel asked about lies between.
SWIGLU_REPORT = (FIXTURES / "ptxas_swiglu_quant.txt").read_text()
QUANTIZE_U16_REPORT = (FIXTURES / "ptxas_quantize_rows_u16.txt").read_text()
SWIGLU = "_ZN7lab_act12swiglu_quantEPKfPKiiiS1_S1_fPhS4_PfPj"
DIV_CHECK = "_ZN7lab_act9div_checkEPKfS1_yPy"


def test_the_fixture_holds_several_entries_in_ptxas_order():
    entries = jit._ENTRY.findall(SWIGLU_REPORT)
    assert entries[0] == DIV_CHECK and SWIGLU in entries and len(entries) == 4


def test_report_of_a_multi_kernel_file_reads_the_block_of_the_kernel_asked_about():
    info = jit._parse_ptxas(SWIGLU_REPORT, "lab_act::swiglu_quant")
    assert (info.registers, info.smem_static) == (29, 4), info
    assert (info.stack_bytes, info.spill_stores, info.spill_loads) == (0, 0, 0)
    assert info.expression == "lab_act::swiglu_quant" and not info.wgmma_serialized


def test_report_flags_a_setmaxnreg_that_ptxas_ignored():
    """ptxas 13.0's C7507 line (it names no function) marks the report: the consumers of a
    producer-warpgroup tile would run on the entry budget."""
    assert not jit._parse_ptxas(SWIGLU_REPORT, "lab_act::swiglu_quant").setmaxnreg_ignored
    line = ("ptxas info    : (C7507) Potential Performance Loss: 'setmaxnreg' ignored to maintain minimum "
            "register requirements.\n")
    at = SWIGLU_REPORT.index("ptxas info    : Function properties for " + SWIGLU)
    info = jit._parse_ptxas(SWIGLU_REPORT[:at] + line + SWIGLU_REPORT[at:], "lab_act::swiglu_quant")
    assert info.setmaxnreg_ignored and info.registers == 29, info


def test_report_reads_the_frame_of_the_kernel_asked_about():
    """div_check's frame line comes first in the report: a spill there is not swiglu_quant's."""
    text = SWIGLU_REPORT.replace("0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads",
                                 "16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads", 1)
    info = jit._parse_ptxas(text, "lab_act::swiglu_quant")
    assert (info.stack_bytes, info.spill_stores, info.spill_loads) == (0, 0, 0), info
    spilled = SWIGLU_REPORT.replace(
        f"Function properties for {SWIGLU}\n    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads",
        f"Function properties for {SWIGLU}\n    16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads")
    assert spilled != SWIGLU_REPORT
    info = jit._parse_ptxas(spilled, "lab_act::swiglu_quant")
    assert (info.stack_bytes, info.spill_stores, info.spill_loads) == (16, 8, 4), info


def test_template_instance_found_through_the_markers_shifted_back_references():
    """quantize_rows<uint16_t> mangles with back-reference S6_, which reads S7_ inside the
    marker's name (one substitution candidate more precedes it there)."""
    assert "S7_PjEEEvv" in QUANTIZE_U16_REPORT and "PhS6_Pj'" in QUANTIZE_U16_REPORT
    info = jit._parse_ptxas(QUANTIZE_U16_REPORT, "lab_act::quantize_rows<lab_act::uint16_t>")
    assert (info.registers, info.smem_static) == (29, 0), info


@pytest.mark.parametrize("inside, want", [
    ("_ZN1aS0_S9_SA_SZ_S10_E", "_ZN1aS_S8_S9_SY_SZ_E"),  # base 36, with a carry
    ("_Z12S1_in_a_nameS0_", "_Z12S1_in_a_nameS_"),  # source names are skipped by length
    ("_Z1fILi10ELb1EEvT_S1_", "_Z1fILi10ELb1EEvT_S0_"),  # literals and template parameters kept
    ("_Z1fILNS0_4ModeE0ELDnEEvS1_", "_Z1fILNS_4ModeE0ELDnEEvS0_"),  # an enum literal's type is a name
    # the GEMM's instantiation with an enum argument, as the marker spells it, and as ptxas does
    ("_ZN8lab_gemm18grouped_gemm_nvfp4ILi4ELi4ELi128ELi3ELi1ELi0ELi1ELi0ELNS0_4ModeE0ELb0EEEvPKvPKhS6_PKiPKfPfiiiS4_"
     "S6_S6_S8_SA_SB_iiiPiSA_SA_fPhSD_SC_PtPj",
     "_ZN8lab_gemm18grouped_gemm_nvfp4ILi4ELi4ELi128ELi3ELi1ELi0ELi1ELi0ELNS_4ModeE0ELb0EEEvPKvPKhS5_PKiPKfPfiiiS3_"
     "S5_S5_S7_S9_SA_iiiPiS9_S9_fPhSC_SB_PtPj"),
])
def test_back_references_move_down_by_one(inside, want):
    assert jit._unshift_substitutions(inside) == want


def test_a_back_reference_to_the_marker_itself_raises():
    with pytest.raises(ValueError, match="marker"):
        jit._unshift_substitutions("_Z1fS_S0_")


def test_serialized_wgmma_counts_for_the_function_it_names_only():
    msg = ("ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized due "
           "to non wgmma instructions defining accumulator registers of a wgmma between start and end of the "
           "pipeline stage in the function '{}'\n")
    # ptxas prints the message in the block of the function it names
    at = SWIGLU_REPORT.index(f"ptxas info    : Function properties for {DIV_CHECK}")
    other = SWIGLU_REPORT[:at] + msg.format(DIV_CHECK) + SWIGLU_REPORT[at:]
    assert not jit._parse_ptxas(other, "lab_act::swiglu_quant").wgmma_serialized
    at = SWIGLU_REPORT.index(f"ptxas info    : Function properties for {SWIGLU}")
    own = SWIGLU_REPORT[:at] + msg.format(SWIGLU) + SWIGLU_REPORT[at:]
    assert jit._parse_ptxas(own, "lab_act::swiglu_quant").wgmma_serialized
    # printed apart from the blocks, it still names its function
    assert jit._parse_ptxas(msg.format(SWIGLU) + SWIGLU_REPORT, "lab_act::swiglu_quant").wgmma_serialized
    assert not jit._parse_ptxas(msg.format(DIV_CHECK) + SWIGLU_REPORT, "lab_act::swiglu_quant").wgmma_serialized
    # C7512 (register resources) says "for the function", and nvcc prints it before the entry's block
    regs = ("ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are serialized due "
            "to insufficient register resources for the function '{}'\n")
    assert jit._parse_ptxas(regs.format(SWIGLU) + SWIGLU_REPORT, "lab_act::swiglu_quant").wgmma_serialized
    assert not jit._parse_ptxas(regs.format(DIV_CHECK) + SWIGLU_REPORT, "lab_act::swiglu_quant").wgmma_serialized


def test_a_report_without_the_kernels_block_raises_instead_of_reading_another():
    start = SWIGLU_REPORT.index(f"ptxas info    : Compiling entry function '{SWIGLU}'")
    end = SWIGLU_REPORT.index("ptxas info    : Compiling entry function '_Z15lab_ptxas_which")
    with pytest.raises(RuntimeError, match="no entry"):
        jit._parse_ptxas(SWIGLU_REPORT[:start] + SWIGLU_REPORT[end:], "lab_act::swiglu_quant")
    with pytest.raises(RuntimeError, match="0 marker entries"):
        jit._parse_ptxas(SWIGLU_REPORT[:end], "lab_act::swiglu_quant")


@pytest.mark.skipif(jit.nvcc_path() is None, reason="needs nvcc")
def test_each_activation_kernel_gets_its_own_report():
    """Every kernel of swiglu_quant.cu, compiled in one unit with the others: each report is of
    the entry the marker names, so the figures are those of that entry's block in the same run."""
    names = {}
    for expression in sq.EXPRESSIONS:
        info = jit.ptxas_report(sq.SOURCE, expression)
        assert info.expression == expression
        names[expression] = info
    # to_bf16 converts 4 floats a thread; it needs far fewer registers than quantizing a block
    assert names["lab_act::to_bf16"].registers < names["lab_act::swiglu_quant"].registers
    assert names["lab_act::swiglu_quant"].smem_static > 0 == names["lab_act::to_bf16"].smem_static


def test_source_inlines_every_header_once_in_nvcc_include_order(tmp_path):
    """What NVRTC gets (one string from jit.source) is what nvcc builds from the files: every
    `#include` of the GEMM's header tree inlined once, none left, and the flattened text
    compiles to the same machine code as the file it came from."""
    import re
    import subprocess

    from lab.kernels import gemm_config as gc
    from lab.kernels import grouped_gemm as gg

    text = jit.source(gg.SOURCE)
    assert not re.search(r'^#include "', text, re.M)
    # the headers the GEMM's include tree reaches (a header no kernel includes yet is not in it)
    reached, todo = set(), [(jit.KERNEL_DIR / gg.SOURCE).resolve()]
    while todo:
        f = todo.pop()
        for inc in re.findall(r'^#include "([\w./]+)"', f.read_text(), re.M):
            h = (f.parent / inc).resolve()
            if h not in reached:
                reached.add(h)
                todo.append(h)
    headers = sorted(h for h in (jit.KERNEL_DIR / "gemm").glob("*.cuh") if h.resolve() in reached)
    assert len(headers) >= 8
    for h in headers:  # each header's first definition line (one of a kind in the tree) appears once
        lines = h.read_text().splitlines()
        first = next(line for line in lines if len(line) > 30 and lines.count(line) == 1
                     and line.startswith(("__device__", "struct", "constexpr", "enum", "extern")))
        assert text.count(first) == 1, (h.name, first)
    nvcc = jit.nvcc_path()
    if nvcc is None:
        pytest.skip("needs nvcc")
    expr = gc.SHIPPED_FUSED[-1].expression
    cubins = []
    for name, src in (("files", f'#include "{jit.KERNEL_DIR / gg.SOURCE}"\n'), ("flat", text)):
        unit = tmp_path / f"{name}.cu"
        unit.write_text(src + f"\nvoid* lab_keep = (void*)&{expr};\n")
        out = tmp_path / f"{name}.cubin"
        proc = subprocess.run([nvcc, "-cubin", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-o", str(out),
                               str(unit)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-2000:]
        cubins.append(out.read_bytes())
    assert cubins[0] == cubins[1]
