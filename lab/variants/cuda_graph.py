"""cuda-graph: separate's four launches captured once as a CUDA graph and replayed: one graph
launch per layer instead of four kernel launches."""

from __future__ import annotations

from .separate import launch_stages

name = "cuda-graph"
expect = "match"


class CudaGraph:
    name = name
    expect = expect
    stages = ("graph",)

    def __init__(self):
        self.graph = None

    def prepare(self, runner, layer) -> None:
        launch_stages(runner, layer, layer.full, runner.stream)  # compiles every kernel before capture
        self.graph = runner.capture(lambda: launch_stages(runner, layer, layer.full, runner.stream))

    def run(self, runner, layer) -> None:
        with runner.stage("graph"):
            runner.replay(self.graph)
