"""separate: the baseline. w13 grouped GEMM, SwiGLU + quantize, w2 grouped GEMM, then the
fp32 -> bf16 output conversion, one launch each on the runner's stream (under skewed routing
each GEMM is its plan's two launches by expert size, one after the other).

    x_q (rows, H) --w13--> h (rows, 2I) f32 --act--> a_q (rows, I) --w2--> out f32 --out--> bf16
"""

from __future__ import annotations

from lab.kernels import gemm_config as gc
from lab.kernels import grouped_gemm as gg
from lab.kernels import swiglu_quant as sq

name = "separate"
expect = "baseline"
STAGES = ("w13", "act", "w2", "out")


def run_plan(runner, plan, launch, stream, split_streams: bool = False) -> None:
    """`launch(cfg, counts_in, stream)` for each (cfg, counts_in) of a GEMM's plan (gc.gemm_plan).
    `split_streams` (with `stream` the runner's main stream, and a plan of two size classes): the
    small experts' launch goes to the side stream, issued first, beside the large experts' launch
    on `stream`, and `stream` waits for both; each launch's CTAs then take the SMs that the other's
    tail leaves idle. The classes write disjoint rows and count their units on their own
    counters (grouped_gemm._scheduler_state), so the bits are those of the launches in order."""
    if split_streams and len(plan) == 2 and stream is runner.stream:
        runner.fork()
        launch(*plan[0], runner.side)
        launch(*plan[1], stream)
        runner.join()
        return
    for cfg, counts_in in plan:
        launch(cfg, counts_in, stream)


def launch_stages(runner, layer, part, stream, after_w13=None, fuse_out: bool = False,
                  split_streams: bool = False) -> None:
    """The four stages of `part` (a lab.layer.Part) on `stream`; `after_w13` (an event) is
    recorded on `stream` once the w13 GEMM is enqueued, for pipelines that order on it;
    `fuse_out` as for launch_w2_out, `split_streams` as for run_plan."""
    with runner.stage("w13", stream):
        run_plan(runner, layer.w13_plan, lambda cfg, counts_in, s: gg.grouped_gemm(
            part.w13, part.x_packed, part.x_scales, part.offsets, part.w13_alpha, part.h, cfg, stream=s,
            counts_in=counts_in), stream, split_streams)
    if after_w13 is not None:
        after_w13.record(stream)
    with runner.stage("act", stream):
        sq.swiglu_quant(part.h, part.offsets, part.gate_global, part.up_global, layer.weights.w2_input_scale,
                        part.a_packed, part.a_scales, runner.counter, stream=stream)
    launch_w2_out(runner, layer, part, stream, fuse_out, split_streams)


def launch_w2_out(runner, layer, part, stream, fuse_out: bool = False, split_streams: bool = False) -> None:
    """The w2 GEMM on a_q and the bf16 conversion: the stages every unfused-w2 variant ends with.
    `fuse_out`: where w2 runs an image tile, its epilogue writes the bf16 output itself (one
    stage, "w2+out"; the same bits, grouped_gemm's bf16 out). Each GEMM runs its plan's launches
    (gc.gemm_plan: one, or two by expert size under skewed routing; `split_streams` as for
    run_plan)."""
    if fuse_out and layer.w2_cfg.image:
        assert len(layer.w2_plan) == 1, layer.w2_plan  # (gemm_plan splits only launches on mma.sync tiles)
        with runner.stage("w2+out", stream):
            gg.grouped_gemm(part.w2, part.a_packed, part.a_scales, part.offsets, part.w2_alpha, part.out_bf16,
                            layer.w2_cfg, stream=stream, nonfinite=runner.counter)
        return
    with runner.stage("w2", stream):
        run_plan(runner, layer.w2_plan, lambda cfg, counts_in, s: gg.grouped_gemm(
            part.w2, part.a_packed, part.a_scales, part.offsets, part.w2_alpha, part.out, cfg, stream=s,
            counts_in=counts_in), stream, split_streams)
    with runner.stage("out", stream):
        sq.to_bf16(part.out, part.out_bf16, runner.counter, stream=stream)


class Separate:
    name = name
    expect = expect
    stages = STAGES

    def prepare(self, runner, layer) -> None:
        pass  # every buffer is the layer's

    def run(self, runner, layer) -> None:
        launch_stages(runner, layer, layer.full, runner.stream)
