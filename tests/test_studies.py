"""The study scripts' arithmetic, without a GPU: tile candidates, chunk timelines, waves."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from lab.kernels import gemm_config as gc

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def load(name):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_tile_sweep_varies_one_factor_at_a_time_and_reports_what_cannot_exist():
    ts = load("tile_sweep")
    base = gc.GemmConfig(4, 4, 128, 4, 2)
    cands = ts.candidates(base, full=False)
    descs = [d for d, _ in cands]
    assert len(descs) == len({tuple(d.values()) for d in descs})  # no point twice
    for d, cfg in cands:  # every point differs from the base in at most one factor
        diffs = (d["token_tile"] != 16) + (d["block_rows"] != 256) + (d["k_step"] != 128) + (d["stages"] != 4)
        assert diffs <= 1
        if isinstance(cfg, gc.GemmConfig):
            assert (cfg.token_tile, cfg.block_rows, cfg.k_step, cfg.stages) == tuple(d.values())
    why = dict((d["token_tile"], c) for d, c in cands if d["block_rows"] == 256 and d["k_step"] == 128 and d["stages"] == 4)
    # 256 rows x 128 tokens x 4 stages: a reason, the kernel's own (shared memory), not "not built"
    assert isinstance(why[128], str) and "shared memory" in why[128], why[128]
    # on 64 rows the 128-token tile fits, and is built as the kernel builds it: on wgmma
    small = ts.candidates(gc.GemmConfig(4, 1, 128, 3, 2), full=False)
    c128 = dict((d["token_tile"], c) for d, c in small if d["block_rows"] == 64 and d["k_step"] == 128
                and d["stages"] == 3)[128]
    assert isinstance(c128, gc.GemmConfig) and c128.mma == 1 and c128.token_tile == 128, c128
    full = ts.candidates(base, full=True)
    assert len(full) == len(ts.TOKEN_TILES) * len(ts.BLOCK_ROWS) * len(ts.K_STEPS) * len(ts.STAGES)
    layouts = [(d["block_rows"], d["k_step"]) for d, _ in full]
    assert layouts == sorted(layouts)  # grouped by layout: each prepared once


def test_chunk_timeline_gaps_and_idle():
    cs = load("chunk_study")
    spans = [  # chunk 0 on one stream, chunk 1 on the other
        {"stage": "w13", "start_ms": 0.0, "stop_ms": 1.0}, {"stage": "act", "start_ms": 1.0, "stop_ms": 1.1},
        {"stage": "w2", "start_ms": 1.1, "stop_ms": 1.6}, {"stage": "out", "start_ms": 1.6, "stop_ms": 1.7},
        {"stage": "w13", "start_ms": 1.25, "stop_ms": 2.2}, {"stage": "act", "start_ms": 2.2, "stop_ms": 2.3},
        {"stage": "w2", "start_ms": 2.5, "stop_ms": 3.0}, {"stage": "out", "start_ms": 3.0, "stop_ms": 3.1},
    ]
    tl = cs.timeline(spans)
    assert tl["w13_gaps"] == [pytest.approx(0.25)]
    assert tl["idle_ms"] == pytest.approx(0.2)  # 2.3 .. 2.5: nothing runs
    assert tl["span_ms"] == pytest.approx(3.1)


def test_chunk_waves():
    cs = load("chunk_study")
    counts = np.array([1, 0, 3, 5, 0, 2])
    cfg = gc.GemmConfig(4, 4, 128, 4, 1)  # 256 rows per unit
    w = cs.waves(counts, [(0, 3), (3, 6)], cfg, 1024, ctas=4)
    assert w == [2 * 4 / 4, 2 * 4 / 4]


def test_study_arguments_and_json(tmp_path):
    import json

    from lab.gemm_bench import problem_of, study_parser, write_json

    args = study_parser("doc", [8, 32], 7).parse_args(["--experts", "16", "--hidden", "512", "--json",
                                                       str(tmp_path / "r.json")])
    assert args.mean_tokens == [8, 32] and args.iterations == 7
    p = problem_of(args)
    assert (p.experts, p.hidden, p.intermediate) == (16, 512, 2048)
    write_json(args.json, "scripts/x.py", rows=[{"ms": 1.5}])
    d = json.loads((tmp_path / "r.json").read_text())
    assert d["script"] == "scripts/x.py" and d["rows"] == [{"ms": 1.5}] and "argv" in d
    assert d["setup"]["lab_commit"] not in ("", None)  # a probe that measures no setup still records its commit
    write_json(None, "scripts/x.py", rows=[])  # no --json: nothing written, no error
    with pytest.raises(ValueError):
        problem_of(study_parser("doc", [8], 1).parse_args(["--hidden", "100"]))


def test_profile_kernels_says_it_needs_a_gpu():
    from lab.gpu import gpu_available

    if gpu_available():
        pytest.skip("a GPU is present: the script would run")
    with pytest.raises(RuntimeError, match="profile_kernels.py needs a CUDA GPU"):
        load("profile_kernels").main(["--mean-tokens", "8"])


def test_profile_kernels_refuses_split_without_w4a8_before_touching_a_gpu(capsys):
    with pytest.raises(SystemExit) as exc:
        load("profile_kernels").main(["--split", "--mean-tokens", "512"])
    assert exc.value.code == 2 and "--split: a form of the W4A8 w13 (give --w4a8 too)" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["-1", "nan", "90000"])
def test_bench_gemm_refuses_a_bad_sustain_before_touching_a_gpu(capsys, value):
    bg = load("bench_gemm")
    with pytest.raises(SystemExit) as exc:
        bg.main(["--sustain-ms", value])
    assert exc.value.code == 2 and "--sustain-ms" in capsys.readouterr().err


def test_time_sustained_warms_up_for_the_asked_time(monkeypatch):
    from lab import timing

    seen = {}

    def fake(fn, iterations, warmup, stream):
        seen.update(iterations=iterations, warmup=warmup)
        return timing.Timing(1.0, 1.0, 1.0, iterations)

    monkeypatch.setattr(timing, "time_cuda", fake)
    timing.time_sustained(lambda: None, run_ms=0.7, sustain_ms=1000, iterations=20)
    assert seen == {"iterations": 20, "warmup": 1429}  # ceil(1000 / 0.7)
    timing.time_sustained(lambda: None, run_ms=0.7, sustain_ms=0, iterations=5)
    assert seen["warmup"] == 1
    with pytest.raises(ValueError, match="run_ms"):
        timing.time_sustained(lambda: None, run_ms=0, sustain_ms=10)


def test_class_rows_are_the_rows_one_size_class_writes():
    """The probes compare each launch on the rows it writes: the experts with lo..hi tokens."""
    from lab.gemm_bench import class_rows

    counts = np.array([3, 0, 20, 5, 17])
    small = class_rows(counts, (1, 16))
    assert small.tolist() == [True] * 3 + [False] * 20 + [True] * 5 + [False] * 17
    assert (class_rows(counts, (17, 2**31 - 1)) == ~small).all()
    assert not class_rows(counts, (6, 16)).any()
