"""What the GEMM benchmarks share: the study's weights on the GPU in any tile layout, the
NVFP4 activations of a routing, and one timed measurement of a tile (GEMM, and the same grid
and pipeline reading its bytes with no math). Scripts compose these; none hides a loop.

    bench = GemmBench(problem, seed)                       host weights, once
    case = bench.case("w13", mean_tokens, skew)            routing + activations on the GPU
    row = bench.measure(case, cfg, roofline_gbps, iters)   {ms, read_pattern_ms, roof_pct, ...}
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from lab import checks, models, nvfp4, reference
from lab.cli import HelpFormatter, output_path
from lab.device_info import setup_info
from lab.kernels import gemm_config as gc
from lab.kernels import gemm_weights as gw
from lab.kernels import grouped_gemm as gg
from lab.problem import (W2_INPUT_SCALE, W13_INPUT_SCALE, MoEProblem, make_routing, random_activations,
                         random_weights, tokens_for_mean)
from lab.timing import time_cuda


def log(tag: str, msg: str) -> None:
    print(f"[{tag} {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


CONFIG_HELP = ("override the tile: warps,row_tiles,k_step,stages[,mma[,ctas_per_sm[,max_frags[,image]]]] (token "
               "tile 8 * max_frags, default the heuristic's; mma 0 = mma.sync, 1 = wgmma; ctas_per_sm 0 = as many "
               "as fit; max_frags 12, 16 or 20, a 96-, 128- or 160-token tile, needs wgmma; image 1: the activations as a "
               "pre-decoded fp16 image, no decoder warps, wgmma only; image 2: that image built inside the launch by "
               "a producer warpgroup on the 64- and 96-token tiles too, build_image)")


def parse_config(text: str) -> tuple[int, ...]:
    """--config's value: 4 to 8 integers (CONFIG_HELP)."""
    try:
        vals = tuple(int(v) for v in text.split(","))
    except ValueError:
        vals = ()
    if len(vals) not in (4, 5, 6, 7, 8) or (len(vals) == 8 and vals[7] not in (0, 1, 2)):
        raise argparse.ArgumentTypeError(
            f"--config: expected warps,row_tiles,k_step,stages[,mma[,ctas_per_sm[,max_frags[,image 0/1/2]]]], got {text!r}")
    return vals


def config_of(values: tuple[int, ...], default: gc.GemmConfig) -> gc.GemmConfig:
    """The GemmConfig a --config value names (not yet validated); what it leaves out comes from
    `default` (max_frags and the activation form) or is 0 (mma, ctas_per_sm, image)."""
    w, r, ks, st, *rest = values
    frags = rest[2] if len(rest) > 2 else default.max_frags
    return gc.GemmConfig(w, r, ks, st, frags, mma=rest[0] if rest else 0,
                         ctas_per_sm=rest[1] if len(rest) > 1 else 0, act=default.act,
                         image=bool(rest[3]) if len(rest) > 3 else False,
                         build_image=len(rest) > 3 and rest[3] == 2)


def study_parser(doc: str, means: list[float], iterations: int) -> argparse.ArgumentParser:
    """The arguments every study script takes, each with its help: means, --model and the shape
    flags (lab/models.py), seed, iterations, --json (checked as the arguments are parsed: a path
    that cannot be written ends the script before its work, not after it)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=HelpFormatter)
    ap.add_argument("--mean-tokens", type=float, nargs="+", default=means,
                    help="mean tokens per expert, one measurement each")
    models.add_shape_arguments(ap)
    ap.add_argument("--seed", type=int, default=0, help="seed of the synthetic weights, routing and activations")
    ap.add_argument("--iterations", type=int, default=iterations, help="timed runs per measurement (median, min, max)")
    ap.add_argument("--json", type=output_path, metavar="PATH", help="write every table here as JSON")
    return ap


def problem_of(args) -> MoEProblem:
    """The problem the shape flags ask for: --model's preset (the study's by default), each flag
    given over it (models.resolve_shape, which fills args too); ValueError naming a bad one."""
    return models.resolve_shape(args)


def write_json(path: str | None, script: str, **fields) -> None:
    """The JSON a study script leaves: its name and arguments, the setup (lab commit, device) unless
    the script measured its own, then its fields."""
    if path:
        fields.setdefault("setup", setup_info())
        with open(path, "w") as f:
            json.dump({"script": script, "argv": sys.argv[1:], **fields}, f, indent=1)


def class_rows(counts: np.ndarray, counts_in: tuple[int, int]) -> np.ndarray:
    """(rows,) bool: the rows of the experts holding counts_in[0]..counts_in[1] tokens (what one
    size class's launch writes)."""
    lo, hi = counts_in
    return np.repeat((counts >= lo) & (counts <= hi), counts)


@dataclass
class GemmCase:
    """One GEMM (w13 or w2) at one routing: device inputs, host copies for checks."""

    gemm: str
    mean_tokens: float
    n: int
    k: int
    counts: np.ndarray  # (E,) host
    offsets: np.ndarray  # (E+1,) host int64
    xq: nvfp4.NVFP4Tensor  # host activations
    alpha: np.ndarray  # (E,) float32 host
    d_xp: object
    d_xs: object
    d_off: object
    d_alpha: object
    out: object  # (rows, N) float32 device
    x_bf16: np.ndarray = None  # (rows, K) the same activations as bf16 bits (W4A16), host
    d_xb: object = None  # and on the device
    d_alpha_bf16: object = None  # (E,) the W4A16 alpha: the weight's global alone (w13: 1); W4A8's too
    x8: np.ndarray = None  # (rows, K) uint8 e4m3 of the bf16 activations (W4A8, lab/w4a8.py quantize_act), host
    s_x: np.ndarray = None  # (rows, ceil(K/128)) float32 their 1x128 scales, host
    d_x8: object = None  # both on the device (GemmBench.fp8_inputs fills the four)
    d_sx: object = None

    @property
    def rows(self) -> int:
        return int(self.offsets[-1])


class StreamPair:
    """Two streams for the probes that run a split GEMM's launches side by side: `both(first,
    second)` issues first(main) and second(side) after everything already on main, and main waits
    for side after them (what separate.run_plan does with the runner's streams)."""

    def __init__(self, cp):
        self.main, self.side = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
        self._fork, self._join = cp.cuda.Event(disable_timing=True), cp.cuda.Event(disable_timing=True)

    def both(self, first, second) -> None:
        self._fork.record(self.main)
        self.side.wait_event(self._fork)
        first(self.main)
        second(self.side)
        self._join.record(self.side)
        self.main.wait_event(self._join)


class GemmBench:
    """The study's weights (host, generated once) and their kernel layouts on the GPU (one layout
    per GEMM kept at a time, so a sweep over layouts does not hold several copies)."""

    def __init__(self, problem: MoEProblem, seed: int = 0, tag: str = "gemm"):
        from lab.gpu import require_gpu

        self.cp = require_gpu("GemmBench")
        self.problem, self.seed, self.tag = problem.validate(), seed, tag
        log(tag, "weights: generating on the host")
        self.w = random_weights(problem, seed=seed)
        p = problem
        self.gemms = {
            "w13": dict(packed=self.w.w13_packed, scales=self.w.w13_scales, n=2 * p.intermediate, k=p.hidden,
                        input_scale=W13_INPUT_SCALE),
            "w2": dict(packed=self.w.w2_packed, scales=self.w.w2_scales, n=p.hidden, k=p.intermediate,
                       input_scale=W2_INPUT_SCALE),
        }
        self._prep: dict[str, tuple] = {}

    def prepared(self, gemm: str, layout: tuple[int, int]) -> gw.PreparedWeights:
        cached = self._prep.get(gemm)
        if cached is None or cached[0] != layout:
            self._prep.pop(gemm, None)  # free the old layout first
            g = self.gemms[gemm]
            log(self.tag, f"{gemm}: preparing the kernel layout {layout} on the GPU")
            self._prep[gemm] = (layout, gw.prepare_weights(g["packed"], g["scales"], xp=self.cp, layout=layout))
        return self._prep[gemm][1]

    def paired_w13(self, layout: tuple[int, int]) -> gw.PreparedWeights:
        """w13 with gate/up rows paired (the SwiGLU epilogue's weights) in `layout`, one layout kept."""
        cached = self._prep.get("w13_paired")
        if cached is None or cached[0] != layout:
            self._prep.pop("w13_paired", None)
            g = self.gemms["w13"]
            log(self.tag, f"w13 (gate/up paired): preparing the kernel layout {layout} on the GPU")
            self._prep["w13_paired"] = (layout, gw.prepare_weights(g["packed"], g["scales"], xp=self.cp, layout=layout,
                                                                   pair_gate_up=True))
        return self._prep["w13_paired"][1]

    def w4a8_prepared(self, gemm: str):
        """The GEMM's weights in the W4A8 kernel's layout on the GPU (p chosen per expert), once."""
        from lab.kernels import w4a8_gemm as wg

        key = f"w4a8_{gemm}"
        if key not in self._prep:
            g = self.gemms[gemm]
            log(self.tag, f"{gemm}: converting to the W4A8 layout (host) and copying it to the GPU")
            self._prep[key] = (None, wg.prepare_w4a8_weights(g["packed"], g["scales"]).to_device())
        return self._prep[key][1]

    def fp8_inputs(self, case: GemmCase) -> GemmCase:
        """Fill `case`'s W4A8 activations (the bf16 activations quantized 1x128 to e4m3), once."""
        from lab import w4a8

        if case.x8 is None:
            x = case.x_bf16.view(ml_dtypes.bfloat16).astype(np.float32)
            case.x8, case.s_x = w4a8.quantize_act(x)
            case.d_x8, case.d_sx = self.cp.asarray(case.x8), self.cp.asarray(case.s_x)
        return case

    def case(self, gemm: str, mean_tokens: float, skew: float = 0.0) -> GemmCase:
        cp, p, g = self.cp, self.problem, self.gemms[gemm]
        tokens = tokens_for_mean(mean_tokens, p.experts, p.top_k)
        routing = make_routing(tokens, p.experts, p.top_k, skew=skew, seed=self.seed)
        x = random_activations(routing.rows, g["k"], seed=self.seed + int(mean_tokens * 10) + len(gemm))
        xq = nvfp4.quantize(x, g["input_scale"])
        xb = x.astype(ml_dtypes.bfloat16).view(np.uint16)
        if gemm == "w13":
            alpha = np.full(p.experts, xq.global_scale, np.float32)
            alpha_b = np.ones(p.experts, np.float32)
        else:
            alpha = (np.float32(xq.global_scale) * self.w.w2_global).astype(np.float32)
            alpha_b = self.w.w2_global.astype(np.float32)
        return GemmCase(gemm, mean_tokens, g["n"], g["k"], routing.counts, routing.offsets.astype(np.int64), xq,
                        alpha, cp.asarray(xq.packed), cp.asarray(xq.scales),
                        cp.asarray(routing.offsets.astype(np.int32)), cp.asarray(alpha),
                        cp.full((routing.rows, g["n"]), cp.nan, dtype=cp.float32), xb, cp.asarray(xb),
                        cp.asarray(alpha_b))

    def check(self, case: GemmCase, experts: np.ndarray, act: str = "nvfp4") -> float | None:
        """Relative Frobenius error of the last output on `experts` against float64 (None:
        undefined, the reference is zero); `act` says which activations the last run read (fp8: against
        the W4A8 contract, check_fp8)."""
        if act == "fp8":
            return self.check_fp8(case, experts)["rel_frobenius"]
        g = self.gemms[case.gemm]
        got = case.out.get()
        rows = np.concatenate([np.arange(case.offsets[e], case.offsets[e + 1]) for e in experts])
        if act == "bf16":
            x = case.x_bf16.view(ml_dtypes.bfloat16).astype(np.float64)
            alpha = case.d_alpha_bf16.get()
            ref = np.concatenate([alpha[e] * (x[case.offsets[e]:case.offsets[e + 1]] @
                                              nvfp4.dequantize_blocks(g["packed"][e], g["scales"][e]).T)
                                  for e in experts])
            return checks.rel_error(got[rows], ref)
        ref = reference.grouped_gemm(case.xq.packed, case.xq.scales, case.offsets, g["packed"], g["scales"],
                                     case.alpha, experts=experts)
        return checks.rel_error(got[rows], ref[rows])

    def check_fp8(self, case: GemmCase, experts: np.ndarray) -> dict:
        """The last W4A8 output on `experts` against the W4A8 contract in float64 (lab/w4a8.py gemm,
        on e4m3 weights converted with the prepared p): its relative Frobenius error (None where the
        reference is zero) and c, the largest |got - gemm| / (2^-12 gemm_abs + TINY), which the
        contract bounds by w4a8.ACCUMULATION_C."""
        from lab import w4a8

        g, prep = self.gemms[case.gemm], self.w4a8_prepared(case.gemm)
        p = np.asarray(prep.p.get() if hasattr(prep.p, "get") else prep.p)
        alpha = case.d_alpha_bf16.get()
        experts = np.asarray(experts)
        rows = np.concatenate([np.arange(case.offsets[e], case.offsets[e + 1]) for e in experts])
        offs = np.concatenate([[0], np.cumsum(case.counts[experts])])
        w8 = np.stack([w4a8.convert_weights(g["packed"][e], g["scales"][e], p=p[e]).codes for e in experts])
        args = (case.x8[rows], case.s_x[rows], offs, w8, p[experts], alpha[experts])
        ref, mag = w4a8.gemm(*args), w4a8.gemm_abs(*args)
        got = case.out.get()[rows].astype(np.float64)
        c = np.abs(got - ref) / (2.0**-12 * mag + w4a8.TINY)
        return {"rel_frobenius": checks.rel_error(got, ref), "bound_c": float(c.max()) if c.size else None}

    def measure_fp8(self, case: GemmCase, roofline_gbps: float, iterations: int) -> dict:
        """Time the W4A8 GEMM's planned launch on `case` (after one poisoned run whose unwritten
        elements are counted); bytes: the NVFP4 weights of experts with tokens, e4m3 activations and
        their scales, fp32 out."""
        cp = self.cp
        run, stream, plan = self.fp8_launch(case)
        with stream:  # poisoned on the launch's stream
            case.out.fill(cp.nan)
        run()
        stream.synchronize()
        unwritten = int(cp.isnan(case.out).sum())
        t = time_cuda(run, iterations=iterations, stream=stream)
        nbytes = self.required_bytes(case, "fp8")
        t_roof = nbytes / (roofline_gbps * 1e9) * 1e3
        return {"gemm": case.gemm, "act": "fp8", "mean_tokens": case.mean_tokens, "rows": case.rows,
                "max_count": int(case.counts.max()),
                "config": {"kernel": "w4a8", "tokens": plan.tokens, "warpgroups": plan.warpgroups,
                           "token_blocks": plan.token_blocks},
                "bytes": nbytes, "ms": t.median_ms, "ms_min": t.min_ms, "ms_max": t.max_ms,
                "gbps": nbytes / t.median_ms / 1e6, "roof_pct": 100 * t_roof / t.median_ms, "unwritten": unwritten,
                "read_pattern_ms": None, "pattern_pct": None, "builders": False}

    def fp8_launch(self, case: GemmCase):
        """(run, stream, plan): the W4A8 GEMM's planned launch on `case` as a no-argument call on
        its own stream (inputs landed before it returns)."""
        from lab.kernels import w4a8_gemm as wg

        prep = self.w4a8_prepared(case.gemm)
        self.fp8_inputs(case)
        plan = wg.plan_w4a8_gemm(prep, case.d_x8, case.d_sx, case.d_off, case.d_alpha_bf16, case.out)
        image = wg.image_workspace(plan, prep, case.d_x8.shape[0])
        stream = self.cp.cuda.Stream(non_blocking=True)
        self.cp.cuda.get_current_stream().synchronize()  # the inputs land before the stream reads them

        def run():
            wg.launch_w4a8_gemm(plan, prep, case.d_x8, case.d_sx, case.d_off, case.d_alpha_bf16, case.out, stream,
                                image)

        return run, stream, plan

    def split_cases(self, skews, gemms, mean_tokens: float):
        """(skew, gemm, case, plan) for each GEMM whose gemm_plan at `mean_tokens` and `skew` is two
        launches by expert size (the probes of the split); the others are logged and skipped."""
        for skew in skews:
            for gemm in gemms:
                case = self.case(gemm, mean_tokens, skew)
                plan = gc.gemm_plan(case.n, case.k, case.counts)
                if len(plan) != 2:
                    log(self.tag, f"{gemm} skew {skew}: the plan is one launch; skipped")
                    continue
                yield skew, gemm, case, plan

    def mode_rows(self, case: GemmCase, skew: float, plan, got: dict, width: int, **extra) -> list[dict]:
        """time_modes' results as JSON rows (with `extra` in each), each logged on one line."""
        nbytes = self.required_bytes(case)
        rows = []
        for m, g in got.items():
            rows.append({"gemm": case.gemm, "skew": skew, "mean_tokens": case.mean_tokens, "mode": m, **extra,
                         "plan": gc.plan_record(plan), **g, "bytes": nbytes})
            log(self.tag, f"{case.gemm} skew {skew} {m:{width}s} rounds "
                          f"{' '.join(f'{v:.4f}' for v in g['round_median_ms'])} ms  "
                          f"differ {g['differ']} unwritten {g['unwritten']}")
        return rows

    def time_modes(self, case: GemmCase, modes: dict, writes: dict, base: str, iterations: int, rounds: int,
                   stream) -> dict[str, dict]:
        """Launch forms of one GEMM side by side, for the probes: each mode (a callable that launches
        into case.out on `stream`) runs once on a NaN-poisoned output and the rows it writes
        (`writes[mode]`, a (rows,) bool mask) are compared bit for bit with `base`'s; then every mode
        is timed in `rounds` rounds (each the median of `iterations` runs), in turn within a round.
        Returns {mode: {round_median_ms, ms (the fastest round), rows_written, differ, unwritten}}."""
        from lab.timing import time_cuda_samples

        cp = self.cp
        bits, ms = {}, {m: [] for m in modes}
        for m, fn in modes.items():
            case.out.fill(cp.nan)
            cp.cuda.Device().synchronize()
            fn()
            cp.cuda.Device().synchronize()
            bits[m] = case.out.get().view(np.uint32)[writes[m]]
        for _ in range(rounds):
            for m, fn in modes.items():
                ms[m].append(float(np.median(time_cuda_samples(fn, iterations, 3, stream))))
        ref = bits[base]
        return {m: {"round_median_ms": ms[m], "ms": min(ms[m]), "rows_written": int(writes[m].sum()),
                    "differ": int((bits[m] != ref[writes[m]]).sum()),
                    "unwritten": int(np.isnan(bits[m].view(np.float32)).sum())} for m in modes}

    def required_bytes(self, case: GemmCase, act: str = "nvfp4") -> int:
        """What the GEMM must move: weights of experts with tokens, the activations (NVFP4, or
        bf16), fp32 out."""
        wbytes = int((case.counts > 0).sum()) * case.n * case.k * 9 // 16
        return wbytes + self.activation_bytes(case, act) + case.rows * case.n * 4

    @staticmethod
    def activation_bytes(case: GemmCase, act: str = "nvfp4") -> int:
        """The GEMM's activations as it reads them: NVFP4 codes and scales, bf16, or e4m3 and their
        1x128 scales (fp8)."""
        if act == "fp8":
            return case.rows * case.k + case.rows * (-(-case.k // 128)) * 4
        return case.xq.packed.nbytes + case.xq.scales.nbytes if act == "nvfp4" else case.x_bf16.nbytes

    def measure_split(self, case: GemmCase, hot_from, roofline_gbps: float, iterations: int,
                      act: str = "nvfp4", wgmma: bool = True, streams: int = 1) -> dict:
        """Time the GEMM as split_configs' launches by expert size, in order on one stream, cut at
        `hot_from` (one bound or several; after one poisoned run whose unwritten elements are
        counted); the row's "config" is the first launch's, "plan" every launch's; `wgmma=False`
        keeps both on mma.sync tiles (gemm_plan's split). `streams=2`
        with two or more size classes: the small experts' launch on a second stream, issued first,
        beside the rest in order on the first, as the layer's graph variants run a split of two
        (separate.run_plan); the row's "streams" says which ran."""
        plan = gc.split_configs(case.n, case.k, case.counts, hot_from, act=act, wgmma=wgmma)
        layouts = {(c.block_rows, c.k_step) for c, _ in plan}
        assert len(layouts) == 1, plan  # (one prepared layout: the heuristic's for this N and K)
        prep = self.prepared(case.gemm, layouts.pop())
        xs = (case.d_xb, None, case.d_alpha_bf16) if act == "bf16" else (case.d_xp, case.d_xs, case.d_alpha)

        streams = 2 if streams == 2 and len(plan) >= 2 else 1
        main_s = self.cp.cuda.get_current_stream()
        side = self.cp.cuda.Stream(non_blocking=True)
        fork, join = self.cp.cuda.Event(disable_timing=True), self.cp.cuda.Event(disable_timing=True)

        def run():
            if streams == 2:
                fork.record(main_s)
                side.wait_event(fork)
            for i, (cfg, counts_in) in enumerate(plan):
                gg.grouped_gemm(prep, xs[0], xs[1], case.d_off, xs[2], case.out, cfg, counts_in=counts_in,
                                stream=side if streams == 2 and i == 0 else main_s)
            if streams == 2:
                join.record(side)
                main_s.wait_event(join)

        case.out.fill(self.cp.nan)
        run()
        self.cp.cuda.Device().synchronize()
        unwritten = int(self.cp.isnan(case.out).sum())
        t = time_cuda(run, iterations=iterations)
        nbytes = self.required_bytes(case, act)
        t_roof = nbytes / (roofline_gbps * 1e9) * 1e3
        return {"gemm": case.gemm, "act": act, "mean_tokens": case.mean_tokens, "rows": case.rows,
                "max_count": int(case.counts.max()), "config": plan[0][0].__dict__, "split": [int(b) for b in np.atleast_1d(hot_from)], "wgmma": wgmma, "streams": streams,
                "plan": gc.plan_record(plan), "bytes": nbytes,
                "ms": t.median_ms, "ms_min": t.min_ms, "ms_max": t.max_ms, "gbps": nbytes / t.median_ms / 1e6,
                "roof_pct": 100 * t_roof / t.median_ms, "unwritten": unwritten}

    def measure(self, case: GemmCase, cfg: gc.GemmConfig, roofline_gbps: float, iterations: int,
                read_pattern: bool = True) -> dict:
        """Time `cfg` on `case` (after one poisoned run whose unwritten elements are counted)."""
        prep = self.prepared(case.gemm, (cfg.block_rows, cfg.k_step))
        cfg.validate(case.n, case.k)

        def run(read_only=False, prepass=None):
            if cfg.act == "bf16":
                gg.grouped_gemm(prep, case.d_xb, None, case.d_off, case.d_alpha_bf16, case.out, cfg, read_only=read_only,
                                prepass=prepass)
            else:
                gg.grouped_gemm(prep, case.d_xp, case.d_xs, case.d_off, case.d_alpha, case.out, cfg,
                                read_only=read_only, prepass=prepass)

        case.out.fill(self.cp.nan)
        run()
        self.cp.cuda.Device().synchronize()
        unwritten = int(self.cp.isnan(case.out).sum())
        t = time_cuda(run, iterations=iterations)
        nbytes = self.required_bytes(case, cfg.act)
        t_roof = nbytes / (roofline_gbps * 1e9) * 1e3
        row = {"gemm": case.gemm, "act": cfg.act, "mean_tokens": case.mean_tokens, "rows": case.rows,
               "max_count": int(case.counts.max()), "config": cfg.__dict__, "bytes": nbytes,
               "ms": t.median_ms, "ms_min": t.min_ms, "ms_max": t.max_ms, "gbps": nbytes / t.median_ms / 1e6,
               "roof_pct": 100 * t_roof / t.median_ms, "unwritten": unwritten}
        if read_pattern:
            tr = time_cuda(lambda: run(True), iterations=iterations)
            row.update({"read_pattern_ms": tr.median_ms, "pattern_pct": 100 * tr.median_ms / t.median_ms,
                        "read_pattern_roof_pct": 100 * t_roof / tr.median_ms})
        gemm_ms = t.median_ms
        if cfg.builders:  # the image written inside the launch: the same launch with the pre-pass beside it
            first = case.out.copy()
            case.out.fill(self.cp.nan)
            run(prepass=True)
            self.cp.cuda.Device().synchronize()
            same = bool(self.cp.array_equal(first.view(self.cp.uint32), case.out.view(self.cp.uint32)))
            tp = time_cuda(lambda: run(prepass=True), iterations=iterations)
            gemm_ms = tp.median_ms
            row.update({"builders": True, "prepass_ms": tp.median_ms, "prepass_roof_pct": 100 * t_roof / tp.median_ms,
                        "prepass_same_bits": same})
            del first
        else:
            row["builders"] = False
        row.update(self.image_pass(case, prep, cfg, gemm_ms, roofline_gbps, iterations))
        return row

    def image_pass(self, case: GemmCase, prep: gw.PreparedWeights, cfg: gc.GemmConfig, gemm_ms: float,
                   roofline_gbps: float, iterations: int) -> dict:
        """The activation-image pre-pass that an image tile's launch runs first (grouped_gemm's
        act_image), timed alone on the same inputs: its ms, its share of `gemm_ms` (the GEMM's with
        the pre-pass, which includes it; on the tiles that write the image themselves, their launch
        with the pre-pass instead), and its rate against the read roofline for what it must move
        (the activations read, the fp16 image written). None for tiles without the image."""
        if not cfg.image:
            return {"image_ms": None, "image_pct_of_gemm": None, "image_roof_pct": None}
        x, xs = (case.d_xb, None) if cfg.act == "bf16" else (case.d_xp, case.d_xs)
        nbytes = self.activation_bytes(case, cfg.act) + gg.image_bytes(case.rows, prep.experts, case.k)
        t = time_cuda(lambda: gg.activation_image(prep, x, xs, case.d_off, cfg.act), iterations=iterations)
        return {"image_ms": t.median_ms, "image_pct_of_gemm": 100 * t.median_ms / gemm_ms,
                "image_roof_pct": 100 * nbytes / (roofline_gbps * 1e9) * 1e3 / t.median_ms}
