"""cuda-graph: separate's four launches captured once as a CUDA graph and replayed: one graph
launch per layer instead of four kernel launches. Where a GEMM's plan splits by expert size, its
two launches run side by side on the runner's two streams (separate.run_plan)."""

from __future__ import annotations

from .separate import launch_stages

name = "cuda-graph"
expect = "match"


class CudaGraph:
    name = name
    expect = expect
    stages = ("graph",)
    fuse_out = False  # (fused-out: the same graph with the conversion in w2's epilogue)

    def __init__(self):
        self.graph = None

    def launch(self, runner, layer) -> None:
        launch_stages(runner, layer, layer.full, runner.stream, fuse_out=self.fuse_out, split_streams=True)

    def prepare(self, runner, layer) -> None:
        self.launch(runner, layer)  # compiles every kernel before capture
        self.graph = runner.capture(lambda: self.launch(runner, layer))

    def run(self, runner, layer) -> None:
        with runner.stage("graph"):
            runner.replay(self.graph)
