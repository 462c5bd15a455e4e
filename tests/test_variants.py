"""Layer variants and the device layer: the registry, chunk splitting and the pre-launch checks
on the CPU; on the GPU, every variant against separate (bitwise) and separate against the
float64 reference, stage by stage, on small problems."""

from __future__ import annotations

import importlib

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lab import checks, layer as layer_mod
from lab.problem import MoEProblem, Routing, make_routing, random_activations, random_weights
from lab.runner import EXPECTS
from lab.variants import DEFAULT, NAMES, REGISTRY, ON_REQUEST, make
from lab.variants import w4a8 as w4a8_variants
from lab.variants.chunked import CHUNKS, Chunked, chunk_bounds
from oracles import fold_e4m3
from strategies import routings

# ---------------------------------------------------------------------------------------------
# CPU: registry and chunks
# ---------------------------------------------------------------------------------------------


def test_registry_lists_the_study_variants_in_order():
    assert NAMES == ("separate", "cuda-graph", "chunked-2", "chunked-4", "chunked-8", "chunked-16",
                     "fused-swiglu", "fused-layer", "fused-layer-classes", "fused-layer-swiglu", "fused-out", "one-launch-2G", "fold-b", "w4a16",
                     "w4a16-fused", "w4a16-layer", "w4a8", "w4a8-fused", "w4a8-layer")
    for name in NAMES:
        v = make(name)
        assert v.name == name and v.expect in EXPECTS
    assert [make(n).expect for n in NAMES].count("baseline") == 1


def test_default_variants_are_the_registry_less_the_unmeasured_ones():
    assert set(ON_REQUEST) <= set(NAMES) and "separate" in DEFAULT
    assert DEFAULT == tuple(n for n in NAMES if n not in ON_REQUEST)


@pytest.mark.parametrize("module", ["separate", "cuda_graph", "chunked", "fused_swiglu", "fused_layer", "fused_out",
                                    "one_launch_2g", "fold_b", "w4a16", "w4a8"])
def test_each_variant_file_declares_name_and_expect(module):
    m = importlib.import_module(f"lab.variants.{module}")
    assert isinstance(m.name, str) and m.expect in EXPECTS


def test_fused_swiglu_declares_the_stages_its_plan_launches():
    """Where w2 runs an image tile fused-swiglu's w2 writes the bf16 output (one "w2+out"
    stage, as launch_w2_out names it); else w2 and the conversion. (The GPU test times them.)"""
    from lab.kernels import gemm_config as gc
    from lab.variants.fused_swiglu import stages_for

    small, large = gc.heuristic(4096, 2048, [8] * 8), gc.heuristic(4096, 2048, [300] * 8)
    assert not small.image and stages_for(small) == ("w13+act", "w2", "out")
    assert large.image and stages_for(large) == ("w13+act", "w2+out")


def test_w4a8_is_on_request_and_compared_with_the_fp8_ceiling():
    """Not in the default set until it has run on a GPU; `tensor` is what token_axis reads to
    put its roofline on the fp8 tensor ceiling."""
    from lab.runner import check_variant

    v = make("w4a8")
    check_variant(v)
    assert (v.expect, v.tensor, v.stages) == ("approx", "fp8", ("w13", "act", "w2", "out"))
    assert "w4a8" in ON_REQUEST and "w4a8" not in DEFAULT
    f = make("w4a8-fused")
    check_variant(f)
    assert (f.expect, f.tensor, f.stages) == ("approx", "fp8", ("w13+act", "w2", "out"))
    assert "w4a8-fused" in ON_REQUEST
    one = make("w4a8-layer")
    check_variant(one)
    assert (one.expect, one.tensor, one.stages, one.fp32_out) == ("approx", "fp8", ("layer",), False)
    assert "w4a8-layer" in ON_REQUEST


@pytest.mark.parametrize("hot", [-1, 2.5, True, "32"])
def test_w4a8_layer_refuses_a_hot_threshold_that_is_not_a_count(hot):
    with pytest.raises(ValueError, match="hot_tokens"):
        w4a8_variants.W4A8Layer(hot_tokens=hot)


@pytest.mark.parametrize("tokens", [4, 64, 16.0, "16"])
def test_w4a8_layer_refuses_a_tile_it_has_not(tokens):
    with pytest.raises(ValueError, match="tokens: the layer kernel takes a token tile of"):
        w4a8_variants.W4A8Layer(tokens=tokens)
    assert w4a8_variants.W4A8Layer(tokens=16).tokens == 16 and w4a8_variants.W4A8Layer().tokens is None


@pytest.mark.parametrize("problem, match", [(MoEProblem(8, 192, 128, 2), r"hidden: H=192 must be a positive multiple of 128"),
                                            (MoEProblem(1025, 256, 128, 2), r"experts: E=1025; the layer kernel takes at most 1024")])
def test_w4a8_layer_refuses_what_its_kernel_cannot_run_before_anything_else(problem, match):
    from types import SimpleNamespace

    layer = SimpleNamespace(problem=problem, weights=_Untouchable(), offsets=_Untouchable(), h=_Untouchable())
    with pytest.raises(ValueError, match=match):
        make("w4a8-layer").prepare(_Untouchable(), layer)


def test_w4a8_fused_refuses_an_intermediate_size_off_the_cluster_before_anything_else():
    from types import SimpleNamespace

    layer = SimpleNamespace(problem=MoEProblem(8, 256, 192, 2), weights=_Untouchable(), offsets=_Untouchable(),
                            h=_Untouchable())
    with pytest.raises(ValueError, match=r"intermediate: I=192 must be a positive multiple of 128"):
        make("w4a8-fused").prepare(_Untouchable(), layer)


class _Untouchable:
    """A runner or weights object that fails any use: what is refused must be refused before."""

    def __getattr__(self, attr):
        raise AssertionError(f"touched .{attr} before the shape check")


@pytest.mark.parametrize("problem, word", [
    (MoEProblem(8, 96, 64, 2), r"hidden: H=96 must be a positive multiple of 64"),
    (MoEProblem(8, 256, 96, 2), r"intermediate: I=96 must be a positive multiple of 64"),
    (MoEProblem(8, 256, 0, 2), r"intermediate: I=0"),
    (MoEProblem(70000, 256, 64, 2), r"experts: E=70000 must lie in \[1, 65535\]"),
])
def test_w4a8_refuses_shapes_it_cannot_run_before_anything_else(problem, word):
    from types import SimpleNamespace

    from lab.variants import w4a8 as v8

    with pytest.raises(ValueError, match=word):
        v8.check_problem(problem)
    layer = SimpleNamespace(problem=problem, weights=_Untouchable(), offsets=_Untouchable(), h=_Untouchable())
    with pytest.raises(ValueError, match=word):
        make("w4a8").prepare(_Untouchable(), layer)
    v8.check_problem(MoEProblem(8, 320, 192, 2))  # short last groups are fine


@pytest.mark.parametrize("matrix", ["w13", "w2"])
def test_w4a8_weight_conversion_names_the_matrix_it_refuses(small_weights, matrix):
    """A negative e4m3 block scale (which check_weights lets through: only NaN codes are its
    concern) has no e4m3 weight; the refusal names the matrix and nothing is cached."""
    import dataclasses
    from types import SimpleNamespace

    from lab.variants import w4a8 as v8

    scales = getattr(small_weights, f"{matrix}_scales").copy()
    scales[1, 2, 3] = 0x85
    holder = SimpleNamespace(host=dataclasses.replace(small_weights, **{f"{matrix}_scales": scales}), cache={})
    layer_mod.check_weights(holder.host)
    with pytest.raises(ValueError, match=rf"{matrix}_scales / {matrix}_packed: scales must be finite non-negative"):
        v8.prepared_weights(holder)
    assert holder.cache == {}


def test_unknown_variant_names_the_known_ones():
    with pytest.raises(ValueError, match="known: separate, cuda-graph"):
        make("fused")


def test_one_launch_2g_takes_one_tile_for_both_gemms():
    from lab.kernels import gemm_config as gc
    from lab.variants.one_launch_2g import pair_config

    cfg = pair_config(gc.GemmConfig(4, 4, 128, 4, 1), gc.GemmConfig(4, 4, 128, 4, 2))
    assert cfg == gc.GemmConfig(4, 4, 128, 4, 2)
    with pytest.raises(ValueError, match="share a layout"):
        pair_config(gc.GemmConfig(4, 4, 128, 4, 1), gc.GemmConfig(4, 4, 64, 4, 1))


@settings(max_examples=200)
@given(st.integers(1, 400), st.integers(1, 40))
def test_chunk_bounds_cover_the_experts_contiguously_and_evenly(experts, k):
    b = chunk_bounds(experts, k)
    assert len(b) == min(k, experts)
    assert b[0][0] == 0 and b[-1][1] == experts
    assert all(b[i][1] == b[i + 1][0] for i in range(len(b) - 1))
    sizes = [e1 - e0 for e0, e1 in b]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1


def test_chunk_bounds_of_the_study():
    assert chunk_bounds(288, 16)[:2] == [(0, 18), (18, 36)]
    assert [len(chunk_bounds(288, k)) for k in CHUNKS] == list(CHUNKS)
    with pytest.raises(ValueError):
        chunk_bounds(0, 2)
    with pytest.raises(ValueError):
        Chunked(1)


# ---------------------------------------------------------------------------------------------
# CPU: checks before launch
# ---------------------------------------------------------------------------------------------

SMALL = MoEProblem(experts=6, hidden=128, intermediate=64, top_k=2)


@pytest.fixture(scope="module")
def small_weights():
    return random_weights(SMALL, seed=1)


def test_check_weights_accepts_synthetic_weights(small_weights):
    p = layer_mod.check_weights(small_weights)
    assert (p.experts, p.hidden, p.intermediate) == (6, 128, 64)


@pytest.mark.parametrize("field, make_bad, word", [
    ("w13_packed", lambda w: w.w13_packed[:, :, :-1], "w13_packed"),  # H not a multiple of 64
    ("w13_packed", lambda w: w.w13_packed.astype(np.int8), "w13_packed"),  # dtype
    ("w2_packed", lambda w: w.w2_packed[:-1], "w2_packed"),  # expert count differs from w13
    ("w2_scales", lambda w: w.w2_scales[:, :, :-1], "w2_scales"),
    ("w13_scales", lambda w: np.where(np.arange(w.w13_scales.shape[-1]) == 3, 0x7F, w.w13_scales).astype(np.uint8),
     "NaN"),
    ("gate_global", lambda w: w.gate_global.astype(np.float64), "gate_global"),
    ("up_global", lambda w: np.where(np.arange(6) == 4, np.float32(0), w.up_global).astype(np.float32), "expert 4"),
    ("w2_global", lambda w: np.full(6, np.nan, np.float32), "w2_global"),
    ("w13_input_scale", lambda w: -1.0, "w13_input_scale"),
    ("w2_input_scale", lambda w: float("inf"), "w2_input_scale"),
])
def test_check_weights_names_what_is_wrong(small_weights, field, make_bad, word):
    import dataclasses

    bad = dataclasses.replace(small_weights, **{field: make_bad(small_weights)})
    with pytest.raises(ValueError, match=word):
        layer_mod.check_weights(bad)


def _routing(tokens=5, experts=6, top_k=2, seed=0):
    return make_routing(tokens, experts, top_k, seed=seed)


def test_check_routing_accepts_ragged_routings_with_empty_experts():
    r = _routing(tokens=2)  # 4 rows over 6 experts: at least two experts have none
    assert (r.counts == 0).sum() >= 2
    layer_mod.check_routing(r, 6)


def test_all_tokens_to_one_expert_is_a_valid_routing():
    offsets = np.array([0, 0, 0, 7, 7, 7, 7], np.int32)
    r = Routing(offsets, np.diff(offsets), np.arange(7, dtype=np.int32), np.full((7, 1), 2, np.int32), 7, 1)
    layer_mod.check_routing(r, 6)
    assert checks.sample_experts(r.counts, 16) == [2]


def _with(r: Routing, **kw) -> Routing:
    import dataclasses

    return dataclasses.replace(r, **kw)


@pytest.mark.parametrize("mutate, word", [
    (lambda r: _with(r, offsets=r.offsets[:-1]), "offsets: expected"),  # wrong length
    (lambda r: _with(r, offsets=r.offsets.astype(np.float32)), "offsets: expected"),
    (lambda r: _with(r, offsets=r.offsets + 1), "start at 0"),
    (lambda r: _with(r, offsets=np.r_[r.offsets[:-1], r.offsets[-1] - 1].astype(np.int32)),
     "tokens \\* top_k"),  # offsets do not sum to T * top_k
    (lambda r: _with(r, offsets=np.r_[0, 5, 3, r.offsets[3:]].astype(np.int32)), "never decrease"),
    (lambda r: _with(r, counts=r.counts[::-1].copy()), "counts"),
    (lambda r: _with(r, row_token=r.row_token[:-1]), "row_token"),
    (lambda r: _with(r, row_token=np.r_[r.row_token[:-1], 99].astype(np.int32)), r"\[0, 5\)"),
])
def test_check_routing_names_what_is_wrong(mutate, word):
    r = _routing()
    if word == "counts" and (r.counts == r.counts[::-1]).all():
        pytest.skip("symmetric counts")
    with pytest.raises(ValueError, match=word):
        layer_mod.check_routing(mutate(r), 6)


def test_check_activations():
    x = random_activations(5, 128)
    assert layer_mod.check_activations(x, 5, 128) is not None
    xb = x.astype(ml_dtypes.bfloat16)
    dev = layer_mod.check_activations(xb, 5, 128)
    assert dev.dtype == np.uint16 and (dev == xb.view(np.uint16)).all()
    with pytest.raises(ValueError, match=r"x: expected shape \(T, H\) = \(5, 128\)"):
        layer_mod.check_activations(x[:4], 5, 128)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        layer_mod.check_activations(x.astype(np.float64), 5, 128)
    x[3, 17] = np.inf
    x[4, 0] = np.nan
    with pytest.raises(ValueError, match="2 non-finite values \\(first at token 3, column 17"):
        layer_mod.check_activations(x, 5, 128)


def test_check_helpers():
    assert checks.compare_bits(np.arange(4), np.arange(4)) == (True, "bitwise equal")
    ok, msg = checks.compare_bits(np.array([[1, 2], [3, 4]]), np.array([[1, 2], [3, 5]]))
    assert not ok and "first at (1, 1)" in msg and "1 of 4" in msg
    assert not checks.compare_bits(np.zeros(3), np.zeros(4))[0]
    assert checks.checksum(np.arange(5)) == checks.checksum(np.arange(5)) != checks.checksum(np.arange(6))
    counts = np.array([0, 3, 0, 1, 2, 5])
    assert checks.sample_experts(counts, 16) == [1, 3, 4, 5]
    s = checks.sample_experts(counts, 2, seed=3)
    assert len(s) == 2 and set(s) <= {1, 3, 4, 5} and s == checks.sample_experts(counts, 2, seed=3)
    np.testing.assert_array_equal(checks.expert_rows(np.array([0, 0, 3, 3, 4]), [1, 3]), [0, 1, 2, 3])


# ---------------------------------------------------------------------------------------------
# GPU: every variant against separate, separate against float64
# ---------------------------------------------------------------------------------------------

MATCHING = [n for n in NAMES if REGISTRY[n]().expect == "match"]

# (problem, routing): each case is commented
GPU_CASES = [
    # E=8, H=I=256, mean 8 tokens per expert, uniform routing
    (MoEProblem(8, 256, 256, 8), dict(tokens=8, skew=0.0)),
    # E=16, H=512, I=256, mean 2 tokens per expert: several experts empty
    (MoEProblem(16, 512, 256, 4), dict(tokens=8, skew=0.0)),
    # E=12, H=256, I=512, skewed routing: a few experts own most rows (multi-pass GEMM tiles)
    (MoEProblem(12, 256, 512, 4), dict(tokens=40, skew=2.0)),
    # E=128, H=1024, I=512, mean 4, skew 0.8: gemm_plan splits both GEMMs by expert size (two
    # launches each; 100 of 100 drawn seeds)
    (MoEProblem(128, 1024, 512, 4), dict(tokens=128, skew=0.8)),
    # E=8, H=I=256, top_k=1 and every token to expert 5 (built by hand below)
    (MoEProblem(8, 256, 256, 1), dict(tokens=19, one_expert=5)),
]


def test_the_skewed_gpu_case_runs_split_gemms():
    """The skewed GPU case exercises gemm_plan's two launches for both GEMMs."""
    from lab.kernels import gemm_config as gc

    problem, spec = next((p, s) for p, s in GPU_CASES if s.get("skew") == 0.8)
    for seed in range(8):
        counts = _case_routing(problem, spec, seed).counts
        for n, k in ((2 * problem.intermediate, problem.hidden), (problem.hidden, problem.intermediate)):
            assert len(gc.gemm_plan(n, k, counts)) == 2, (seed, n, k)


def _case_routing(problem, spec, seed=0):
    if spec.get("one_expert") is not None:
        t, e = spec["tokens"], spec["one_expert"]
        counts = np.zeros(problem.experts, np.int32)
        counts[e] = t
        offsets = np.r_[0, np.cumsum(counts)].astype(np.int32)
        return Routing(offsets, counts, np.arange(t, dtype=np.int32), np.full((t, 1), e, np.int32), t, 1)
    return make_routing(spec["tokens"], problem.experts, problem.top_k, skew=spec["skew"], seed=seed)


def poisoned_runner(problem, routing):
    """A Runner whose buffers that checked runs do not poison (the quantized input, which
    load_layer writes once, and check_separate's second SwiGLU launch) start as NaN or 0xFF (an
    e4m3 NaN scale), so that rows a launch leaves unwritten cannot pass as stale memory."""
    from lab.runner import Runner

    r = Runner()
    rows, h, i = routing.rows, problem.hidden, problem.intermediate
    with r.stream:
        for name, shape, dtype, value in (("x_packed", (rows, h // 2), np.uint8, 0xFF),
                                          ("x_scales", (rows, h // 16), np.uint8, 0xFF),
                                          ("check/a32", (rows, i), np.float32, np.nan),
                                          ("check/a_packed", (rows, i // 2), np.uint8, 0xFF),
                                          ("check/a_scales", (rows, i // 16), np.uint8, 0xFF)):
            r.buffer(name, shape, dtype).fill(value)
    r.synchronize()
    return r


def assert_matches_separate(runner, layer, v, bf16, out, label) -> None:
    """A checked run of `v` writes separate's bf16 output (and fp32 output, where it has one)
    bit for bit."""
    runner.checked_run(v, layer)
    ok, msg = checks.compare_bits(layer.out_bf16.get(), bf16)
    assert ok, f"{label}: {msg}"
    if getattr(v, "fp32_out", True):
        ok, msg = checks.compare_bits(layer.out.get().view(np.uint32), out.view(np.uint32))
        assert ok, f"{label} fp32 out: {msg}"


@pytest.fixture(scope="module", params=range(len(GPU_CASES)))
def gpu_case(request):
    from lab.layer import load_layer, upload_weights

    problem, spec = GPU_CASES[request.param]
    seed = int(np.random.default_rng().integers(2**31))  # fresh inputs each run; the seed names them
    weights = random_weights(problem, seed=seed)
    routing = _case_routing(problem, spec, seed=seed)
    x = random_activations(routing.tokens, problem.hidden, seed=seed)
    runner = poisoned_runner(problem, routing)
    layer = load_layer(runner, upload_weights(weights), routing, x)
    sep = make("separate")
    runner.prepare(sep, layer)
    runner.checked_run(sep, layer)
    baseline = (layer.out_bf16.get(), layer.out.get())
    res = checks.check_separate(runner, layer, checks.sample_experts(routing.counts, problem.experts))
    res["seed"] = seed
    return runner, layer, baseline, res


@pytest.mark.gpu
def test_separate_matches_float64_stage_by_stage(gpu_case):
    _, _, _, res = gpu_case
    for stage in ("x_q", "h", "a", "a_q", "out", "bf16"):
        assert res[stage]["ok"], f"seed {res['seed']}, {stage}: {res[stage]['detail']}"
    assert res["layer_rel"] < 1e-2, res["layer_rel"]  # only a_q codes on rounding boundaries may differ


@pytest.mark.gpu
@pytest.mark.parametrize("name", MATCHING)
def test_matching_variants_are_bitwise_equal_to_separate(gpu_case, name):
    runner, layer, (bf16, out), _ = gpu_case
    v = make(name)
    runner.prepare(v, layer)
    for _ in range(2):  # a second run, over the first one's buffers, must not differ
        assert_matches_separate(runner, layer, v, bf16, out, name)


def _separate_bf16(problem, routing, seed):
    """(runner, layer, separate's bf16 output) on fresh weights and activations of `seed`."""
    from lab.layer import load_layer, upload_weights

    runner = poisoned_runner(problem, routing)
    layer = load_layer(runner, upload_weights(random_weights(problem, seed=seed)), routing,
                       random_activations(routing.tokens, problem.hidden, seed=seed))
    sep = make("separate")
    runner.prepare(sep, layer)
    runner.checked_run(sep, layer)
    return runner, layer, layer.out_bf16.get()


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [300, 600])
@pytest.mark.parametrize("name", ["fused-out", "fused-swiglu", "fused-layer", "fused-layer-swiglu"])
def test_fused_epilogues_on_image_tiles_are_bitwise_equal_to_separate(name, tokens):
    """Past 64 tokens per expert w2 runs an image tile whose epilogue writes the bf16 output, and
    past 96 (600 tokens: mean 150) fused-swiglu's w13 the 160-token tile with SwiGLU in registers
    (the GPU cases above stay below both); fused-layer takes fused-out's stages there and
    fused-layer-swiglu fused-swiglu's two launches (hot_image_plan): the same bits as separate,
    graph replay and direct launches alike."""
    problem = MoEProblem(8, 256, 256, 2)
    seed = int(np.random.default_rng().integers(2**31))
    routing = make_routing(tokens, problem.experts, problem.top_k, seed=seed)
    runner, layer, bf16 = _separate_bf16(problem, routing, seed)
    assert layer.w2_cfg.image, layer.w2_cfg
    v = make(name)
    runner.prepare(v, layer)
    assert not v.fp32_out
    if name.startswith("fused-layer"):
        from lab.kernels import gemm_config as gc

        assert v.hot is not None and v.hot[2] == gc.ALL_COUNTS, v.hot
    for _ in range(2):
        runner.checked_run(v, layer)
        ok, msg = checks.compare_bits(layer.out_bf16.get(), bf16)
        assert ok, f"seed {seed}: {msg}"
    st = runner.time_stages(v, layer, iterations=2, warmup=1)
    assert list(st) == {"fused-out": ["w13", "act", "w2+out"], "fused-layer": ["layer"],
                        "fused-layer-swiglu": ["layer"]}.get(name, ["w13+act", "w2+out"]), st
    runner.checked_run(v, layer)  # graph replay after direct launches: counters were left at zero
    ok, msg = checks.compare_bits(layer.out_bf16.get(), bf16)
    assert ok, f"seed {seed}: {msg}"


# E=288, H=1024, I=512, top 8, mean 8, skew 0.8: both GEMMs split at 16 tokens and the large class
# passes 64 tokens, past HOT_TOKENS (12 of 12 seeds checked), so fused-layer runs its large class on
# the image tiles beside the small class's persistent layer on the side stream (hot_image_plan)
TWO_FORM_CASE = (MoEProblem(288, 1024, 512, 8), dict(tokens=288, skew=0.8))


def _fused_layer_plan(problem, counts):
    from types import SimpleNamespace

    from lab.kernels import gemm_config as gc
    from lab.kernels import gemm_weights as gw
    from lab.variants import fused_layer
    from lab.variants.one_launch_2g import pair_config

    p = problem
    layer = SimpleNamespace(problem=p, counts=counts, w13_plan=gc.gemm_plan(2 * p.intermediate, p.hidden, counts),
                            w2_plan=gc.gemm_plan(p.hidden, p.intermediate, counts))
    layout = gw.shared_layout([(2 * p.intermediate, p.hidden), (p.hidden, p.intermediate)])
    one = pair_config(gc.heuristic(2 * p.intermediate, p.hidden, counts, layout),
                      gc.heuristic(p.hidden, p.intermediate, counts, layout))
    launches = fused_layer.launches(layer, one)
    return launches, fused_layer.hot_image_plan(layer, one, launches)


def test_the_two_form_case_splits_with_a_large_class_past_64_tokens():
    problem, spec = TWO_FORM_CASE
    for seed in range(6):
        launches, hot = _fused_layer_plan(problem, _case_routing(problem, spec, seed).counts)
        assert len(launches) == 2 and hot is not None, seed


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["fused-layer", "fused-layer-swiglu"])
def test_fused_layer_two_forms_side_by_side_are_bitwise_equal_to_separate(name):
    """Under skew the small experts' persistent layer (side stream) and the large experts' image
    tiles (main stream) write disjoint rows of a_q and of the output: the same bits as separate,
    graph replay and direct launches alike."""
    problem, spec = TWO_FORM_CASE
    rng = np.random.default_rng()
    for _ in range(20):  # a fresh routing that takes both forms (every one of the seeds checked did)
        seed = int(rng.integers(2**31))
        routing = _case_routing(problem, spec, seed)
        launches, hot = _fused_layer_plan(problem, routing.counts)
        if len(launches) == 2 and hot is not None:
            break
    runner, layer, bf16 = _separate_bf16(problem, routing, seed)
    v = make(name)
    runner.prepare(v, layer)
    assert len(v.launches) == 2 and v.hot is not None, (seed, v.launches, v.hot)
    for _ in range(2):
        runner.checked_run(v, layer)
        ok, msg = checks.compare_bits(layer.out_bf16.get(), bf16)
        assert ok, f"seed {seed}: {msg}"
    runner.time_stages(v, layer, iterations=2, warmup=1)
    runner.checked_run(v, layer)  # graph replay after direct launches
    ok, msg = checks.compare_bits(layer.out_bf16.get(), bf16)
    assert ok, f"seed {seed}: {msg}"


@pytest.mark.gpu
def test_chunked_launched_directly_is_bitwise_equal_to_separate(gpu_case):
    """The two-stream sequence without the graph (what the graph captures)."""
    runner, layer, (bf16, _), _ = gpu_case
    v = Chunked(4, graph=False)
    runner.prepare(v, layer)
    runner.checked_run(v, layer)
    ok, msg = checks.compare_bits(layer.out_bf16.get(), bf16)
    assert ok, msg


@pytest.mark.gpu
def test_fold_b_is_separate_on_the_folded_weights_bit_for_bit(gpu_case):
    """fold-b against separate on weights whose scales the independent oracle folded
    (oracles.fold_e4m3) the way fold-b folds them: per expert into the half with the smaller
    global, by g_small / g_large in float32, run with fold-b's arithmetic (w13 alpha
    float32(w13_input_scale * g_large), no global in SwiGLU): the same bits, and not option
    (a)'s."""
    import dataclasses

    import cupy as cp

    from lab.layer import load_layer, upload_weights

    runner, layer, (bf16_a, _), res = gpu_case
    v = make("fold-b")
    runner.prepare(v, layer)
    runner.checked_run(v, layer)
    got_bf16, got_out = layer.out_bf16.get(), layer.out.get()
    host = layer.weights.host
    i, e = layer.problem.intermediate, layer.problem.experts
    g, u = host.gate_global.astype(np.float32), host.up_global.astype(np.float32)
    large = np.maximum(g, u)
    factor = (np.minimum(g, u) / large).astype(np.float32)
    scales = host.w13_scales.copy()
    for ex in range(e):
        half = slice(0, i) if g[ex] < u[ex] else slice(i, 2 * i)
        scales[ex, half], saturated = fold_e4m3(host.w13_scales[ex, half], factor[ex])
        assert not saturated.any()  # a factor <= 1 never saturates
    folded = dataclasses.replace(host, w13_scales=scales, gate_global=large.copy(), up_global=large.copy())
    alpha = (np.float32(host.w13_input_scale) * large).astype(np.float32)
    ones = cp.ones(e, cp.float32)
    dw = dataclasses.replace(upload_weights(folded), w13_alpha=cp.asarray(alpha), gate_global=ones, up_global=ones)
    sep_runner = poisoned_runner(layer.problem, layer.routing)
    sep_layer = load_layer(sep_runner, dw, layer.routing, checks._host_x(layer))
    sep = make("separate")
    sep_runner.prepare(sep, sep_layer)
    sep_runner.checked_run(sep, sep_layer)
    ok, msg = checks.compare_bits(got_bf16, sep_layer.out_bf16.get())
    assert ok, f"seed {res['seed']}: {msg}"
    if v.fp32_out:  # (where w2 runs an image tile fold-b writes the bf16 output only)
        ok, msg = checks.compare_bits(got_out.view(np.uint32), sep_layer.out.get().view(np.uint32))
        assert ok, f"seed {res['seed']} fp32 out: {msg}"
    assert not checks.compare_bits(got_bf16, bf16_a)[0], "folding the ratio changed no output bit"



@pytest.fixture(scope="module")
def drawn_routing_weights():
    from lab.layer import upload_weights

    problem = MoEProblem(8, 256, 256, 2)
    return problem, upload_weights(random_weights(problem, seed=int(np.random.default_rng().integers(2**31))))


@pytest.mark.gpu
@settings(max_examples=12, deadline=None)
@given(routing=routings(8, 2), seed=st.integers(0, 2**31))
def test_matching_variants_equal_separate_on_drawn_routings(drawn_routing_weights, routing, seed):
    """Routings drawn token by token (one token, empty experts, a hot expert past one token
    tile): separate against float64 stage by stage, and every 'match' variant bitwise against
    separate."""
    from lab.layer import load_layer

    problem, dw = drawn_routing_weights
    x = random_activations(routing.tokens, problem.hidden, seed=seed)
    runner = poisoned_runner(problem, routing)
    layer = load_layer(runner, dw, routing, x)
    sep = make("separate")
    runner.prepare(sep, layer)
    runner.checked_run(sep, layer)
    bf16, out = layer.out_bf16.get(), layer.out.get()
    res = checks.check_separate(runner, layer, checks.sample_experts(routing.counts, problem.experts))
    for stage in ("x_q", "h", "a", "a_q", "out", "bf16"):
        assert res[stage]["ok"], f"{stage}: {res[stage]['detail']}"
    for name in MATCHING:
        v = make(name)
        runner.prepare(v, layer)
        assert_matches_separate(runner, layer, v, bf16, out, name)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["fused-swiglu", "fused-layer"])
def test_fused_variants_time_their_stages(gpu_case, name):
    runner, layer, (bf16, _), _ = gpu_case
    v = make(name)
    runner.prepare(v, layer)
    st = runner.time_stages(v, layer, iterations=2, warmup=1)
    assert list(st) == list(v.stages)
    runner.checked_run(v, layer)  # graph replay after direct launches: counters were left at zero
    ok, msg = checks.compare_bits(layer.out_bf16.get(), bf16)
    assert ok, msg


@pytest.mark.gpu
def test_timing_every_runnable_variant(gpu_case):
    runner, layer, _, _ = gpu_case
    for name in NAMES:
        v = make(name)
        try:
            runner.prepare(v, layer)
        except NotImplementedError:
            continue
        t = runner.time(v, layer, iterations=3, warmup=1)
        assert 0 < t.min_ms <= t.median_ms <= t.max_ms
    st = runner.time_stages(make("separate"), layer, iterations=3, warmup=1)
    assert list(st) == ["w13", "act", "w2", "out"]


@pytest.mark.gpu
def test_load_layer_rejects_bad_input_before_launch():
    from lab.layer import load_layer, upload_weights
    from lab.runner import Runner

    problem = MoEProblem(8, 256, 256, 2)
    dw = upload_weights(random_weights(problem))
    r = _case_routing(problem, dict(tokens=6, skew=0.0))
    x = random_activations(6, 256)
    runner = Runner()
    with pytest.raises(ValueError, match="x: expected shape"):
        load_layer(runner, dw, r, x[:5])
    x[2, 2] = np.nan
    with pytest.raises(ValueError, match="non-finite"):
        load_layer(runner, dw, r, x)
    with pytest.raises(ValueError, match="offsets"):
        load_layer(Runner(), dw, _routing(tokens=6, experts=6), random_activations(6, 256))


def test_run_plan_puts_a_split_on_two_streams_only_where_asked():
    """run_plan: a two-class plan with split_streams on the runner's main stream forks, issues the
    small experts' launch on the side stream first, the rest on the main stream, then joins; a
    one-launch plan, split_streams off or another stream keep the launches in order there."""
    from types import SimpleNamespace

    from lab.variants.separate import run_plan

    log = []
    runner = SimpleNamespace(stream="main", side="side", fork=lambda: log.append("fork"),
                             join=lambda: log.append("join"))
    launch = lambda cfg, counts_in, s: log.append((cfg, counts_in, s))  # noqa: E731
    split = (("cold", (1, 16)), ("hot", (17, 99)))
    run_plan(runner, split, launch, "main", split_streams=True)
    assert log == ["fork", ("cold", (1, 16), "side"), ("hot", (17, 99), "main"), "join"]
    for plan, stream, on in ((split, "main", False), (split, "side", True), (split[:1], "main", True)):
        log.clear()
        run_plan(runner, plan, launch, stream, split_streams=on)
        assert log == [(c, r, stream) for c, r in plan], (plan, stream, on)
