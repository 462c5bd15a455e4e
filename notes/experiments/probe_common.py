"""What the GEMM probes share: the run's read roofline and bench, an in-memory edit of the
kernel source, and a cap on CTAs per SM. Probes run as `python notes/experiments/<probe>.py`,
which puts this directory on sys.path."""
from lab.gemm_bench import GemmBench, problem_of
from lab.kernels import grouped_gemm as gg, jit
from lab.kernels.stream_read import measure_read_roofline

_SHIPPED_SOURCE = jit.source


def start(args, tag: str = "probe"):
    """(read roofline in GB/s, GemmBench) for a probe's arguments (study_parser's)."""
    roof = measure_read_roofline(iterations=args.iterations)["gbps"]
    print(f"roofline {roof:.0f} GB/s", flush=True)
    return roof, GemmBench(problem_of(args), args.seed, tag)


def measure_tile(bench, case, cfg, roof: float, iterations: int, read_pattern: bool = False) -> dict | None:
    """`bench.measure` of `cfg` on `case`, or None (with a line saying why) for a tile the
    problem cannot take."""
    try:
        cfg.validate(case.n, case.k)
    except ValueError as e:
        print(f"skip {cfg}: {e}")
        return None
    return bench.measure(case, cfg, roof, iterations, read_pattern=read_pattern)


def check_sample(bench, case, rng, experts: int) -> float:
    """Relative error against float64 on `experts` active experts drawn with `rng` (the output
    of the last launch on `case`)."""
    import numpy as np

    active = np.flatnonzero(case.counts)
    sample = rng.choice(active, size=min(experts, active.size), replace=False)
    return bench.check(case, np.sort(sample))


def start_layer(args, roofline: bool = True):
    """(read roofline in GB/s or None, problem, its random weights on the device) for a layer
    probe's arguments (study_parser's): what every layer probe begins with."""
    from lab.layer import upload_weights
    from lab.problem import random_weights

    problem = problem_of(args)
    gbps = None
    if roofline:
        gbps = measure_read_roofline(iterations=args.iterations)["gbps"]
        print(f"roofline {gbps:.0f} GB/s", flush=True)
    return gbps, problem, upload_weights(random_weights(problem, seed=args.seed))


def study_layer(problem, dweights, mean: float, seed: int):
    """(Runner, Layer) of the study's routing at `mean` tokens per expert, activations drawn with
    `seed`, on weights already uploaded: what the layer probes time."""
    from lab.layer import load_layer
    from lab.problem import make_routing, random_activations, tokens_for_mean
    from lab.runner import Runner

    routing = make_routing(tokens_for_mean(mean, problem.experts, problem.top_k), problem.experts,
                           problem.top_k, seed=seed)
    runner = Runner()
    return runner, load_layer(runner, dweights, routing, random_activations(routing.tokens, problem.hidden,
                                                                            seed=seed))


def settled_ms(runner, variant, layer, iterations: int, settle_ms: float, prepare: bool = True) -> float:
    """Median ms of one burst of `variant` (3 warm-up runs) after an idle pause of `settle_ms`,
    so that every burst starts uncapped (notes/layer.md v15); prepares it first unless told not to."""
    import time

    import numpy as np

    if prepare:
        runner.prepare(variant, layer)
    runner.synchronize()
    time.sleep(settle_ms / 1000)
    return float(np.median(runner.time_samples(variant, layer, iterations, 3)))


def edited(text: str, subs: dict) -> str:
    """`text` with each key replaced by its value; every key must occur exactly once, or the
    probe would time the shipped kernel under another name."""
    for old, new in subs.items():
        if text.count(old) != 1:
            raise RuntimeError(f"probe edit: {text.count(old)} places match {old[:70]!r} in {gg.SOURCE}")
        text = text.replace(old, new)
    return text


def edit_kernel(subs: dict | None) -> None:
    """Compile grouped_gemm.cu with `subs` applied from now on (None or {}: as shipped)."""
    def source(name, _seen=frozenset()):
        text = _SHIPPED_SOURCE(name, _seen)
        return edited(text, subs) if subs and name == gg.SOURCE else text
    jit.source = source
    jit._module.cache_clear()
