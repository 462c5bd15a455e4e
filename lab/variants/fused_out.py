"""fused-out: separate's stages with the bf16 output conversion in the w2 GEMM's epilogue, where
w2 runs an image tile (past 32 tokens per expert), captured once as a CUDA graph and replayed.

    x_q --w13--> h (rows, 2I) f32 --act--> a_q (rows, I) --w2 + bf16--> out_bf16

The fp32 w2 output never reaches memory: at large token counts its write and the conversion's
read and write are the largest traffic beside the GEMMs. The epilogue rounds each value as the
conversion kernel does, so the output equals `separate`'s bit for bit. Where w2 runs a tile
without the image the stages are separate's four.
"""

from __future__ import annotations

from .separate import launch_stages

name = "fused-out"
expect = "match"


class FusedOut:
    name = name
    expect = expect
    stages = ("graph",)

    def __init__(self):
        self.graph = None

    def launch(self, runner, layer) -> None:
        launch_stages(runner, layer, layer.full, runner.stream, fuse_out=True)

    def prepare(self, runner, layer) -> None:
        self.fp32_out = not layer.w2_cfg.image  # (an image w2 writes the bf16 output only)
        self.launch(runner, layer)  # compiles every kernel and checks the arguments before capture
        self.graph = runner.capture(lambda: self.launch(runner, layer))

    def run(self, runner, layer) -> None:
        if runner.timing_stages:
            self.launch(runner, layer)  # direct launches, so that each stage gets its events
        else:
            with runner.stage("graph"):
                runner.replay(self.graph)
