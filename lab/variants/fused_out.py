"""fused-out: separate's stages with the bf16 output conversion in the w2 GEMM's epilogue, where
w2 runs an image tile (past 32 tokens per expert), captured once as a CUDA graph and replayed.

    x_q --w13--> h (rows, 2I) f32 --act--> a_q (rows, I) --w2 + bf16--> out_bf16

The fp32 w2 output never reaches memory: at large token counts its write and the conversion's
read and write are the largest traffic beside the GEMMs. The epilogue rounds each value as the
conversion kernel does, so the output equals `separate`'s bit for bit. Where w2 runs a tile
without the image the stages are separate's four.
"""

from __future__ import annotations

from .cuda_graph import CudaGraph

name = "fused-out"
expect = "match"


class FusedOut(CudaGraph):
    name = name
    expect = expect
    fuse_out = True

    def prepare(self, runner, layer) -> None:
        self.fp32_out = not layer.w2_cfg.image  # (an image w2 writes the bf16 output only)
        super().prepare(runner, layer)

    def run(self, runner, layer) -> None:
        if runner.timing_stages:
            self.launch(runner, layer)  # direct launches, so that each stage gets its events
        else:
            super().run(runner, layer)
