"""How much host and device memory a run of the layer needs, estimated before anything is
allocated, so that a size that cannot fit is refused with the figure and the limit instead of
failing in the middle of an allocation (NumPy's "Unable to allocate 1.05 TiB", or CuPy's
out-of-memory after minutes of setup).

    est = run_layer_memory(problem, means, variants, check=True)    (host, device) Estimates
    require_fits(est.host, host_limit())                              MemoryLimitError if not

The per-row and per-element byte counts below follow the arrays run_layer allocates
(lab/problem.py, lab/layer.py, lab/checks.py, lab/variants/); the transient terms are the
temporaries measured with tracemalloc at small sizes (tests/test_memory.py checks that the
estimates stay above what is measured). They are upper estimates: a run that fits them fits.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from .nvfp4 import BLOCK
from .problem import MoEProblem, tokens_for_mean

GB = 1e9
FLAT_READ_BYTES = 4_077_000_000  # lab/kernels/stream_read.measure_read_roofline's default buffer
_ROUTING_CHUNK = 8192  # lab/problem.make_routing draws scores for this many tokens at a time
# make_routing: token_experts and row_token (4 + 4 bytes a row) stay; while grouping, three int64
# keys and the int64 order exist at once (measured peak ~30 bytes a row).
ROUTING_KEPT_PER_ROW = 8
ROUTING_PEAK_PER_ROW = 40
ROUTING_SCORE_BYTES = 32  # per (token of a chunk, expert): float64 scores, Gumbel draw, argsort
ROUTING_FIXED = 1 << 16  # the generator's state and small arrays, whatever the size
ACT_PEAK_PER_ELEMENT = 13  # random_activations: float32 x, a float64 uniform draw, a bool mask
ACT_KEPT_PER_ELEMENT = 4


class MemoryLimitError(ValueError):
    """A run that needs more memory than the machine has; the message gives both figures."""


@dataclass
class Estimate:
    """Bytes one kind of memory needs at its peak, by part."""

    kind: str  # "host" or "device"
    parts: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return int(sum(self.parts.values()))

    def describe(self) -> str:
        big = sorted(self.parts.items(), key=lambda kv: -kv[1])
        return ", ".join(f"{k} {v / GB:.3g} GB" for k, v in big if v >= 0.01 * max(1, self.total))


@dataclass
class RunMemory:
    host: Estimate
    device: Estimate


def weight_bytes(problem: MoEProblem) -> int:
    """NVFP4 weights of all experts: packed codes and e4m3 block scales (globals are negligible)."""
    e, h, i = problem.experts, problem.hidden, problem.intermediate
    per_elem = 0.5 + 1 / BLOCK
    return int(e * (2 * i * h + h * i) * per_elem) + 16 * e


def routing_bytes(problem: MoEProblem, mean: float) -> tuple[int, int]:
    """(peak while make_routing draws it, bytes kept afterwards) for one routing at `mean`."""
    tokens = tokens_for_mean(mean, problem.experts, problem.top_k)
    rows = tokens * problem.top_k
    score = min(tokens, _ROUTING_CHUNK) * problem.experts * ROUTING_SCORE_BYTES
    return (rows * ROUTING_PEAK_PER_ROW + score + ROUTING_FIXED,
            rows * ROUTING_KEPT_PER_ROW + 8 * problem.experts)


def routing_host(problem: MoEProblem, means) -> Estimate:
    """Host memory of drawing every mean's routing (all are kept, as run_layer keeps them)."""
    kept = [routing_bytes(problem, m)[1] for m in means]
    extra = max((routing_bytes(problem, m)[0] - routing_bytes(problem, m)[1] for m in means), default=0)
    return Estimate("host", {"routings": sum(kept), "drawing a routing": extra})


def check_host_parts(problem: MoEProblem, rows: int, tokens: int, sample_rows: int) -> dict[str, int]:
    """Host bytes of checking one mean, by part: lab/checks.check_separate's ("check: ...") and
    what run_layer keeps beside it ("run_layer: ..."). The float64 layer and the copies it is
    compared with hold the sampled experts' rows only (32 H + 80 I bytes a row covers the peaks
    measured with tracemalloc in tests/test_checks.py, 25-35 H + 55-68 I, plus one expert's
    dequantized float64 weights); the all-rows bitwise comparisons hold CHECK_CHUNK_ROWS rows at a
    time on each of CHECK_WORKERS threads, and one more fetched (a quantization's 16.8 bytes an element
    and the copies beside it)."""
    from .checks import CHECK_CHUNK_ROWS, CHECK_WORKERS

    h, i = problem.hidden, problem.intermediate
    sample_rows = min(rows, sample_rows)
    return {"check: float64 layer on the sampled rows": sample_rows * (32 * h + 80 * i) + 2 * (2 * i * h * 8),
            "check: all-rows comparisons, a chunk at a time": (CHECK_WORKERS + 1) * min(rows, CHECK_CHUNK_ROWS)
            * 24 * max(h, i),
            "check: the device's x": tokens * h * 4,
            "run_layer: bf16 outputs of the baseline and of the variant compared": rows * 2 * h * 2,
            "run_layer: the unquantized float64 layer on the sample": sample_rows * (8 * h + 40 * i)}


def w4a8_image_bytes(variants, rows: int, experts: int, hidden: int, intermediate: int) -> int:
    """The W4A8 variants' activation images (lab/variants/w4a8.py image_buffers, runner buffers
    shared by tile), at most: w13's and w2's at the largest image tile where `variants` has w4a8,
    the fused w13's at the fused kernel's largest and w2's where it has w4a8-fused or w4a8-layer.
    Each is image_rows x K bytes and K / 128 float scales."""
    from .kernels import w4a8_gemm as wg

    def image(tokens: int, k: int) -> int:
        return wg.image_rows(rows, experts, tokens) * (k + 4 * (k // wg.GROUP_K))

    big, fused = max(wg.IMAGE_AHEAD_TILES), wg.IMAGE_TILES[-1]
    plain, other = "w4a8" in variants, bool(set(variants) & {"w4a8-fused", "w4a8-layer"})
    return ((image(big, hidden) if plain else 0) + (image(big, intermediate) if plain or other else 0)
            + (image(fused, hidden) if other else 0))


def run_layer_memory(problem: MoEProblem, means, variants=(), check: bool = True, skew: float = 0.0,
                     check_rows: dict | None = None) -> RunMemory:
    """Host and device memory at the peak of run_layer's GPU run: weights, routings, one mean's
    batch at a time (the largest), the layouts `variants` add, and the flat read. `check_rows`
    ({mean: rows}) gives the rows of the experts each mean's check samples; a mean it leaves out
    is counted as checking every row."""
    from .kernels.grouped_gemm import image_bytes

    e, h, i = problem.experts, problem.hidden, problem.intermediate
    w = weight_bytes(problem)
    means = list(means)
    variants = set(variants)
    rout = routing_host(problem, means)

    def rows_tokens(m):
        t = tokens_for_mean(m, e, problem.top_k)
        return t * problem.top_k, t

    # host: the weights, every routing, and the largest mean's activations and checks
    batch_host = 0
    for m in means:
        rows, t = rows_tokens(m)
        b = t * h * ACT_PEAK_PER_ELEMENT
        if check:
            b += sum(check_host_parts(problem, rows, t, (check_rows or {}).get(m, rows)).values())
        batch_host = max(batch_host, b)
    host_parts = {"weights": w, "routings": rout.parts["routings"], "one mean's batch": batch_host}
    if "w4a8" in variants:  # prepare_w4a8_weights builds w13's layout (the larger matrix) on the host first
        host_parts["W4A8 w13 prepared on the host (w4a8)"] = int(e * 2 * i * h * (0.5 + 1 / BLOCK))
    host = Estimate("host", host_parts)

    # device: prepared weights (same bytes as packed + scales), the layouts variants add
    layouts = {"weights": w}
    w13 = int(e * 2 * i * h * (0.5 + 1 / BLOCK))
    if variants & {"fused-swiglu", "fused-layer", "w4a16-fused", "w4a16-layer"}:
        layouts["w13 paired for the fused epilogue"] = w13
    if "fold-b" in variants:
        layouts["w13 folded (fold-b)"] = w13
    if "w4a8" in variants:  # lab/variants/w4a8.py: both matrices in the W4A8 GEMM's layout, the packed bytes again
        layouts["W4A8 weights (w4a8)"] = w
    if "torch-bf16" in variants:  # peers/torch_grouped.py: its own weights, and one expert chunk's float32
        layouts["bf16 weights (torch-bf16)"] = e * 3 * i * h * 2
    if "torch-fp8" in variants:
        layouts["fp8 weights and row scales (torch-fp8)"] = e * 3 * i * h + e * (2 * i + h) * 4
    if variants & {"torch-bf16", "torch-fp8"}:
        layouts["dequantization chunk (torch)"] = 8 * 2 * i * h * (4 + 8 + 4)
    batch_dev = 0
    for m in means:
        rows, t = rows_tokens(m)
        b = t * h * 4 + rows * 4  # x and row_token
        b += rows * (h * (0.5 + 1 / BLOCK) + 2 * i * 4 + i * (0.5 + 1 / BLOCK) + h * 4 + h * 2)  # layer buffers
        if check:
            b += rows * i * (4 + 0.5 + 1 / BLOCK)
        if variants & {"w4a16", "w4a16-fused", "w4a16-layer"}:  # their bf16 x and a
            b += rows * (h + i) * 2
        if "w4a8" in variants:  # its fp8 x and a with their 1x128 scales, and the input's token rows in prepare
            b += (rows + t) * (h + 4 * -(-h // 128)) + rows * (i + 4 * -(-i // 128))
        # the activation images of the image tiles (grouped_gemm.image_workspace): one per stream, the
        # runner's two, each at most twice its largest request (a launch's images of both problems)
        b += 2 * 2 * image_bytes(rows, e, h + i)
        b += w4a8_image_bytes(variants, rows, e, h, i)
        for peer in variants & {"torch-bf16", "torch-fp8"}:  # x rows, h, a (and its fp32 copy), out
            b += rows * (h * 2 + 2 * i * 2 + i * (2 + 4) + h * 2) + (rows * (h + i) * 4 if peer == "torch-fp8" else 0)
        batch_dev = max(batch_dev, int(b))
    # the flat read runs once, before any variant adds a layout or a batch is loaded
    timed = Estimate("device", {**layouts, "one mean's batch": batch_dev})
    read = Estimate("device", {"weights": w, "flat read": FLAT_READ_BYTES})
    return RunMemory(host, max(timed, read, key=lambda est: est.total))


def host_limit() -> tuple[int | None, str]:
    """(bytes of host memory available now, where the figure comes from); None when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "free physical pages"
    except (ValueError, OSError, AttributeError):
        return None, "unknown"


def device_limit(cp) -> tuple[int, str]:
    """(free bytes on the current device, where the figure comes from)."""
    free, total = cp.cuda.runtime.memGetInfo()
    return int(free), f"free of the device's {total / GB:.1f} GB"


def require_fits(estimate: Estimate, limit: int | None, source: str, what: str = "the run") -> None:
    """Raise MemoryLimitError when `estimate` exceeds `limit` bytes, naming both and the parts;
    a limit of None (unknown) passes."""
    if limit is None or estimate.total <= limit:
        return
    raise MemoryLimitError(f"{what} needs about {estimate.total / GB:.3g} GB of {estimate.kind} memory "
                           f"({estimate.describe()}), more than the {limit / GB:.3g} GB available "
                           f"({source})")


def rows_fit_int32(problem: MoEProblem, mean: float) -> None:
    """The kernels take int32 row offsets: refuse a mean whose rows do not fit, naming it."""
    rows = tokens_for_mean(mean, problem.experts, problem.top_k) * problem.top_k
    if rows > np.iinfo(np.int32).max:
        raise MemoryLimitError(f"--mean-tokens {mean:g}: {rows} rows exceed the {np.iinfo(np.int32).max} "
                               f"the kernels' int32 offsets address")
