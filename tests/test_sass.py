"""The SASS reader (lab/kernels/sass.py) and scripts/sass_mix.py: nvdisasm's text parsed into
instructions with resolved branches, the tensor loops told from ptxas's out-of-line barrier retries,
and on the GEMM itself the structure the per-pass dispatch promises (one loop per fragment count,
each of a single wgmma shape, the decode's instruction count per tile-step)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lab.kernels import gemm_config as gc
from lab.kernels import grouped_gemm as gg
from lab.kernels import jit, sass

ROOT = Path(__file__).resolve().parent.parent
TOOLS = pytest.mark.skipif(jit.nvcc_path() is None or sass.nvdisasm_path() is None, reason="needs nvcc and nvdisasm")

# The shape of `nvdisasm -c` output (CUDA 13): a section per function, labels on lines of their
# own, `/*offset*/` before each instruction, branch targets as `(.L_x_N)`.
LISTING = """
\t.target\tsm_90a
//--------------------- .text._Z1kv --------------------------
\t.section\t.text._Z1kv,"ax",@progbits
_Z1kv:
.text._Z1kv:
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R12+URZ], R5 ;
        /*0020*/              @!P0 BRA `(.L_x_9) ;
.L_x_1:
        /*0030*/                   LDS.128 R84, [R120] ;
        /*0040*/                   HMUL2 R84, R89, R88.H0_H0 ;
        /*0050*/                   HGMMA.64x32x16.F32 R24, R84, gdesc[UR4], R24 ;
        /*0060*/              @P1 BRA `(.L_x_1) ;
        /*0070*/                   VIADD R3, R3, 0x1 ;
        /*0080*/              @!P2 BRA `(.L_x_0) ;
        /*0090*/              @P3 EXIT ;
        /*00a0*/                   HMMA.16816.F32 R4, R8, R12, R4 ;
        /*00b0*/                   BRA `(.L_x_0) ;
        /*00c0*/                   EXIT ;
.L_x_9:
        /*00d0*/                   YIELD ;
        /*00e0*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R12+URZ], R5 ;
        /*00f0*/              @!P0 BRA `(.L_x_9) ;
        /*0100*/                   BRA `(.L_x_1) ;
.L_x_10:
        /*0110*/                   BRA `(.L_x_10);
//--------------------- .text._Z1jv --------------------------
\t.section\t.text._Z1jv,"ax",@progbits
        /*0000*/                   EXIT ;
"""


def test_the_listing_parses_into_functions_with_resolved_branches():
    funcs = sass.parse_nvdisasm(LISTING)
    assert set(funcs) == {"_Z1kv", "_Z1jv"}
    k = funcs["_Z1kv"]
    assert [x.offset for x in k] == list(range(0, 0x120, 0x10))
    hgmma = next(x for x in k if x.base == "HGMMA")
    assert hgmma.opcode == "HGMMA.64x32x16.F32" and hgmma.operands.startswith("R24, R84")
    branches = {x.offset: (x.predicate, x.target) for x in k if x.base == "BRA"}
    assert branches[0x20] == ("@!P0", 0xD0) and branches[0x60] == ("@P1", 0x30) and branches[0x110] == ("", 0x110)
    assert sass.class_of(hgmma) == "tensor" and sass.class_of(k[0]) == "integer"


def test_tensor_loops_are_innermost_and_ignore_the_out_of_line_retries():
    k = sass.parse_nvdisasm(LISTING)["_Z1kv"]
    # loops: 0x30-0x60 (HGMMA, innermost), 0x10-0x80 and 0x10-0xb0 (enclose it); the retry at
    # 0x100 jumps back to 0x30 from past the last EXIT and is no loop
    spans = sass.tensor_loops(k)
    assert [(k[a].offset, k[b].offset) for a, b in spans] == [(0x30, 0x60)]
    mix = sass.loop_mix(k, spans[0])
    assert (mix.n_tensor, mix.tokens, mix.instructions) == (1, 32, 4)
    assert mix.counts == {"shared": 1, "fp16": 1, "tensor": 1, "branch": 1}
    assert sass.tile_steps(mix) == 1
    # an mma.sync loop (one loop for every fragment count's case) has no wgmma N to count steps by
    hmma = sass.loop_mix(k, (k.index(next(x for x in k if x.base == "HMMA")),) * 2)
    assert hmma.tokens == 0
    with pytest.raises(ValueError, match="register-A"):
        sass.tile_steps(hmma)


def test_an_unresolved_label_leaves_no_target():
    text = LISTING.replace("`(.L_x_9)", "`(.L_x_77)")
    k = sass.parse_nvdisasm(text)["_Z1kv"]
    assert all(x.target is None for x in k if x.offset in (0x20, 0xF0))


# A loop with forks (decode skipped past the last group, a third batch or not), a barrier wait's
# out-of-line retry, the loop's exit and its back edge, for loop_paths.
FORKS = """
\t.section\t.text._Z1fv,"ax",@progbits
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R12+URZ], R5 ;
        /*0020*/              @!P0 BRA `(.L_x_9) ;
        /*0030*/               @P1 BRA `(.L_x_2) ;
        /*0040*/                   LDS.64 R2, [R3] ;
        /*0050*/                   PRMT R4, R2, R5, R6 ;
.L_x_2:
        /*0060*/                   QGMMA.64x64x32.F32.E4M3.E4M3 R24, R4, gdesc[UR4], R24 ;
        /*0070*/               @P2 BRA `(.L_x_3) ;
        /*0080*/                   QGMMA.64x64x32.F32.E4M3.E4M3 R56, R4, gdesc[UR8], R56 ;
        /*0090*/                   BRA `(.L_x_4) ;
.L_x_3:
        /*00a0*/                   FFMA R1, R2, R3, R1 ;
.L_x_4:
        /*00b0*/                   SYNCS.ARRIVE.TRANS64.A1T0 RZ, [UR14], RZ ;
        /*00c0*/               @P3 BRA `(.L_x_5) ;
        /*00d0*/              @!P4 BRA `(.L_x_0) ;
.L_x_5:
        /*00e0*/                   EXIT ;
.L_x_9:
        /*00f0*/                   YIELD ;
        /*0100*/                   BRA `(.L_x_2) ;
"""


def test_loop_paths_fork_on_branches_inside_the_loop_only():
    k = sass.parse_nvdisasm(FORKS)["_Z1fv"]
    spans = sass.tensor_loops(k)
    assert [(k[a].offset, k[b].offset) for a, b in spans] == [(0x10, 0xD0)]
    paths = sass.loop_paths(k, spans[0])
    # the retry (0x20) and the exit (0xc0) are never taken on a trip; 0x30 and 0x70 fork; 0x90
    # jumps over the FFMA
    assert [(p.instructions, p.tensor_ops, p.tensor_cycles, p.releases) for p in paths] == [
        (9, 1, 32.0, 1), (10, 2, 64.0, 1), (11, 1, 32.0, 1), (12, 2, 64.0, 1)]
    assert paths[-1].issue_per_tensor_cycle == 12 / 64
    # one release (SYNCS.ARRIVE) a trip: one group; the steady paths: the longest of each wgmma
    # count a group, whole batches only
    assert all(p.groups == 1 for p in paths)
    assert [p.instructions for p in sass.steady_paths(paths, steps=1)] == [11, 12]
    assert [p.instructions for p in sass.steady_paths(paths, steps=2)] == [12]
    assert sass.LoopPath(5, 1, 32.0, 0).groups == 1 and sass.LoopPath(5, 8, 256.0, 4).groups == 4


def test_tensor_cycles_are_the_warps_share_at_the_dense_rate():
    assert sass.tensor_cycles("QGMMA.64x64x32.F32.E4M3.E4M3") == 32  # 16 x 64 x 32 / 1024
    assert sass.tensor_cycles("QGMMA.64x8x32.F32.E4M3.E4M3") == 4
    assert sass.tensor_cycles("HGMMA.64x32x16.F32") == 16  # 16 x 32 x 16 / 512
    with pytest.raises(ValueError, match="wgmma"):
        sass.tensor_cycles("HMMA.16816.F32")


@TOOLS
def test_the_image_kernels_issue_models_are_their_loops_steady_paths():
    """w4a8_gemm.py's issue models of the activation-image kernel (IMAGE_ISSUE, IMAGE_AHEAD_ISSUE,
    IMAGE_BATCH_ISSUE) are the consumers' group loops as ptxas compiles them: per group on the loop's
    steady paths (sass.steady_paths; a trip is as many groups as it releases stages), to within
    the rounding of a several-group trip's share."""
    from lab.kernels import w4a8_gemm as wg

    def per_group(expr):
        code = sass.kernel_sass(wg.GEMM_SOURCE, expr)
        loops = sass.tensor_loops(code)
        assert len(loops) == 1, (expr, loops)
        return {p.tensor_ops // p.groups: p.instructions / p.groups
                for p in sass.steady_paths(sass.loop_paths(code, loops[0]))}

    for t in wg.IMAGE_TILES:
        assert per_group(wg.image_expression(t)) == {4: wg.IMAGE_ISSUE[t]}, t
        (four, ahead), = per_group(wg.image_expression(t, ahead=True)).items()
        assert four == 4 and abs(ahead - wg.IMAGE_AHEAD_ISSUE[t]) <= 0.5, (t, ahead)
    for t, (two, three) in wg.IMAGE_BATCH_ISSUE.items():
        got = per_group(wg.image_expression(t, ahead=True))
        assert sorted(got) == [8, 12], got  # two batches of four k32 steps, or three
        assert abs(got[8] - two) <= 0.5 and abs(got[12] - three) <= 0.5, (got, two, three)


@TOOLS
@pytest.mark.parametrize("act", gc.ACTS)
def test_the_64_token_image_tile_has_one_stage_loop_per_fragment_count(act):
    """The per-pass dispatch (grouped_gemm.cu): a loop for each fragment count 1..8, each issuing
    one wgmma shape, m64 x (8F), two row tiles x eight k16 steps per stage, with the decode's 4
    HMUL2 and 1 scale conversion per tile-step and nothing on the FP32 pipe."""
    cfg = gc.GemmConfig(8, 2, 128, 4, 8, 1, act=act, image=True)
    mixes = sass.stage_mixes(gg.SOURCE, cfg.expression)
    assert sorted(m.tokens for m in mixes) == [8 * f for f in range(1, 9)]
    for m in mixes:
        assert m.tensor_ops == (f"HGMMA.64x{m.tokens}x16.F32",) and m.n_tensor == 16, m
        assert m.opcodes.get("HMUL2") == 4 * 16 and m.counts.get("convert") == 16, m
        assert "fp32" not in m.counts, m
        steps = sass.tile_steps(m)
        assert 14 <= m.instructions / steps < 30, m


@TOOLS
def test_the_160_token_tile_with_builders_has_twenty_stage_loops():
    cfg = gc.GemmConfig(8, 2, 128, 3, 20, 1, image=True)
    mixes = sass.stage_mixes(gg.SOURCE, cfg.expression_for(False, builders=True))
    assert sorted(m.tokens for m in mixes) == [8 * f for f in range(1, 21)]
    assert all(m.n_tensor == 16 and len(m.tensor_ops) == 1 for m in mixes)


@TOOLS
def test_sass_of_another_tree_compiles_from_that_tree(tmp_path):
    tree = tmp_path / "kernels"
    subprocess.run(["cp", "-r", str(jit.KERNEL_DIR), str(tree)], check=True)
    cu = tree / gg.SOURCE
    # one more shift per tile-step in the decode (compiled only: the bits it gives are wrong)
    text = (tree / "gemm" / "decode.cuh").read_text()
    edited = text.replace("  p0 = (w << 6) & DECODE_MASK;", "  p0 = ((w << 6) & DECODE_MASK) ^ (w >> 17);")
    assert edited != text and cu.is_file()
    (tree / "gemm" / "decode.cuh").write_text(edited)
    cfg = gc.GemmConfig(8, 2, 128, 4, 8, 1, image=True)
    base = {m.tokens: m for m in sass.stage_mixes(gg.SOURCE, cfg.expression)}
    other = {m.tokens: m for m in sass.stage_mixes(gg.SOURCE, cfg.expression, tree)}
    assert base.keys() == other.keys()
    assert all(other[t].instructions > base[t].instructions for t in base)


def test_the_script_names_a_bad_tree():
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "sass_mix.py"), "--tree", "x=/nonexistent"],
                         capture_output=True, text=True)
    assert res.returncode == 2 and "--tree: expected NAME=DIR" in res.stderr and "Traceback" not in res.stderr


@TOOLS
def test_the_script_prints_a_tiles_loops_and_writes_them(tmp_path):
    out = tmp_path / "mix.json"
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "sass_mix.py"), "--config", "8,2,128,4,1,0,8,1",
                          "--tokens", "32", "40", "--json", str(out)], capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    import json

    rows = json.loads(out.read_text())["rows"]
    assert [r["tokens"] for r in rows] == [32, 40]
    assert all(r["tile_steps"] == 16 and r["per_tile_step"] > 14 for r in rows)
    # 256 rows: 16 tile-steps of every k16 step, over 4 schedulers
    assert all(r["issue_cycles_per_k16_step"] == round(r["per_tile_step"] * 4, 1) for r in rows)
    assert "8x2 k128 s4 64 tok wgmma image" in res.stdout


@TOOLS
def test_the_script_reads_the_w4a8_group_loops(tmp_path):
    out = tmp_path / "mix.json"
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "sass_mix.py"), "--act", "fp8", "--tokens", "16",
                          "--json", str(out)], capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    import json

    rows = json.loads(out.read_text())["rows"]
    assert [r["kernel"] for r in rows] == ["w4a8", "w4a8 wide", "w4a8-fused", "w4a8-fused wide"]
    assert all(r["tensor_ops"] == ["QGMMA.64x16x32.F32.E4M3.E4M3"] and r["counts"]["tensor"] == 4 for r in rows)
    # a ring kernel's trip is one group, its steady path the whole loop; four m64n16k32 a group are
    # 4 x 8 tensor cycles of the warp's
    assert all(r["instructions_a_group"] == r["loop_instructions"] and r["wgmma_a_group"] == 4 for r in rows)
    assert all(r["tensor_cycles_a_group"] == 32 and r["issue_a_tensor_cycle"] == round(r["loop_instructions"] / 32, 4)
               for r in rows)
    assert all(r["issue_cycles_per_group"] == r["instructions_a_group"] * r["warpgroups"] for r in rows)
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "sass_mix.py"), "--act", "fp8", "--config",
                          "8,2,128,4,1,0,8,1"], capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 2 and "--config: the W4A4/W4A16 GEMM's tiles" in res.stderr


def _same_sass():
    import importlib.util

    spec = importlib.util.spec_from_file_location("same_sass", ROOT / "scripts" / "same_sass.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_same_sass_covers_the_no_spill_checks_instantiations():
    exprs = _same_sass().instantiations()
    assert len(exprs) == len(set(exprs)) > 100
    for cfg in gc.SHIPPED_CONFIGS + gc.SHIPPED_FUSED + gc.SHIPPED_W4A16 + gc.SHIPPED_LARGE:
        assert cfg.expression in exprs, cfg
    assert all(c.expression_for(False, True) in exprs for c in gc.SHIPPED_SS)
    assert all(c.expression_for(False, bf16_out=True) in exprs for c in gc.SHIPPED_IMAGE)
    assert {f"lab_gemm::act_image<lab_gemm::Act::{a}>" for a in gc.ACTS} <= set(exprs)


@pytest.mark.skipif(jit.nvcc_path() is None, reason="needs nvcc")
def test_same_sass_tells_an_edited_tree_from_a_copy(tmp_path):
    """The refactor check on its smallest instantiation (the activation image kernel): a copy of the
    tree compiles to the same .text, an edited constant (k16 blocks per thread) to another."""
    same_sass = _same_sass()
    copy, edited = tmp_path / "copy", tmp_path / "edited"
    for tree in (copy, edited):
        subprocess.run(["cp", "-r", str(jit.KERNEL_DIR), str(tree)], check=True)
    header = edited / "gemm" / "act_image.cuh"
    text = header.read_text()
    assert "constexpr int IMAGE_QB = 4;" in text
    header.write_text(text.replace("constexpr int IMAGE_QB = 4;", "constexpr int IMAGE_QB = 2;"))
    expr = ["lab_gemm::act_image<lab_gemm::Act::nvfp4>"]
    same = same_sass.compare([("main", jit.KERNEL_DIR), ("copy", copy)], expr)
    assert [r["text_identical"] for r in same] == [True] and same[0]["text_bytes"]["main"] > 0
    other = same_sass.compare([("main", jit.KERNEL_DIR), ("edited", edited)], expr)
    assert [r["text_identical"] for r in other] == [False]
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "same_sass.py"), "--tree", f"main={jit.KERNEL_DIR}",
                          "--tree", f"edited={edited}", "--expression", expr[0]], capture_output=True, text=True)
    assert res.returncode == 1 and "DIFFERENT" in res.stdout and "identical in 0 of 1" in res.stdout, res.stderr[-2000:]


def test_same_sass_names_a_bad_tree():
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "same_sass.py"), "--tree", "x=/nonexistent",
                          "--tree", f"y={jit.KERNEL_DIR}"], capture_output=True, text=True)
    assert res.returncode == 2 and "--tree: expected NAME=DIR" in res.stderr and "Traceback" not in res.stderr
