"""chunked-k: the experts split into k contiguous chunks; chunk i runs its four stages on the
main stream (i even) or the side stream (i odd), and its w13 waits for chunk i-1's w13, so the
weight stream of w13 stays in expert order while chunk i's SwiGLU and w2 overlap chunk i+1's w13.

    main:  w13[0] act[0] w2[0] out[0]                 w13[2] ...
    side:         (waits w13[0]) w13[1] act[1] w2[1] out[1]   ...
    main waits for side before the runner's end event (join).

The two-stream sequence is captured once as a CUDA graph and replayed (``graph=False`` launches
it directly): chunked-16 is 64 launches, and at ~1 ms per layer Python's launch overhead would
otherwise decide the time. The graph keeps the streams' concurrency as dependencies.

Chunks own disjoint expert ranges and row ranges, so no two streams write the same bytes, and
every output element is computed by the same kernels on the same inputs as in `separate`.
"""

from __future__ import annotations

from .separate import launch_stages

name = "chunked"  # a family: instances are named chunked-<k>
expect = "match"
CHUNKS = (2, 4, 8, 16)


def chunk_bounds(experts: int, k: int) -> list[tuple[int, int]]:
    """min(k, experts) contiguous expert ranges [e0, e1) covering 0..experts-1, sizes within one."""
    if experts < 1 or k < 1:
        raise ValueError(f"need experts >= 1 and k >= 1, got {experts}, {k}")
    k = min(k, experts)
    edges = [(i * experts) // k for i in range(k + 1)]
    return [(edges[i], edges[i + 1]) for i in range(k)]


class Chunked:
    expect = expect

    def __init__(self, k: int, graph: bool = True):
        if k < 2:
            raise ValueError(f"chunked needs k >= 2, got {k}")
        self.k = k
        self.graph = graph
        self.name = f"chunked-{k}" + ("" if graph else "-launches")
        self.parts = []
        self.w13_done = []
        self._graph = None

    @property
    def stages(self) -> tuple[str, ...]:
        return ("graph",) if self.graph else ("w13", "act", "w2", "out")

    def prepare(self, runner, layer) -> None:
        self.parts = [layer.part(runner, e0, e1, f"chunked-{self.k}/offsets{i}")
                      for i, (e0, e1) in enumerate(chunk_bounds(layer.problem.experts, self.k))]
        self.w13_done = [runner.event() for _ in self.parts]
        self.launch(runner, layer)  # compiles, and checks every launch's arguments once
        if self.graph:
            runner.synchronize()
            self._graph = runner.capture(lambda: self.launch(runner, layer))

    def launch(self, runner, layer) -> None:
        runner.fork()
        for i, part in enumerate(self.parts):
            stream = runner.stream if i % 2 == 0 else runner.side
            if i:
                stream.wait_event(self.w13_done[i - 1])
            launch_stages(runner, layer, part, stream, after_w13=self.w13_done[i])
        runner.join()

    def run(self, runner, layer) -> None:
        if self.graph:
            with runner.stage("graph"):
                runner.replay(self._graph)
        else:
            self.launch(runner, layer)
