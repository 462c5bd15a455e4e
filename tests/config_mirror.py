"""The Python mirror of a kernel's Config<> checked by nvcc: static_asserts in one compile unit.

GemmConfig.smem_bytes, .threads and .stage_bytes size launches, grids and tensor maps; the
kernel computes the same quantities in Config<>. One nvcc compile of static_asserts proves they
agree for every configuration given, without a GPU."""

from __future__ import annotations

import subprocess

from lab.kernels import grouped_gemm as gg
from lab.kernels import jit


def config_type(c) -> str:
    """The C++ Config<> a GemmConfig instantiates."""
    return (f"lab_gemm::Config<{c.warps}, {c.row_tiles}, {c.k_step}, {c.stages}, {c.max_frags}, {c.mma}, "
            f"{c.decoder_warps}, {c.epilogue_warps}, lab_gemm::Mode::{c.mode}, lab_gemm::Act::{c.act}"
            + (", true>" if c.build_image else ">"))  # (BUILDERS_: the smaller tiles' producer warpgroup)


def assert_config_mirror(tmp_path, cfgs, extra=lambda conf, c: []) -> None:
    """Compile static_asserts that SMEM, THREADS and STAGE_W equal the mirror's for each config,
    plus extra(conf, c)'s C++ conditions; fail with nvcc's message otherwise."""
    lines = [f'#include "{jit.KERNEL_DIR / gg.SOURCE}"']
    for c in cfgs:
        conf = config_type(c)
        conds = [f"{conf}::SMEM == {c.smem_bytes}", f"{conf}::THREADS == {c.threads}",
                 f"{conf}::STAGE_W == {c.stage_bytes}", *extra(conf, c)]
        lines += [f'static_assert({cond}, "{c}");' for cond in conds]
    unit = tmp_path / "config_mirror.cu"
    unit.write_text("\n".join(lines) + "\n")
    proc = subprocess.run([jit.nvcc_path(), "-std=c++17", "-arch=sm_90a", "-c", "-o",
                           str(tmp_path / "config_mirror.o"), str(unit)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
