"""The ceilings every figure is a ratio to: the schema their JSON keeps (CPU), and on a GPU that
the fp8 dense GEMM through cuBLASLt computes what float64 says and is timed."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest

from lab import ceilings

FIXTURE = Path(__file__).parent / "fixtures" / "token_axis.json"


def _good() -> dict:
    c = copy.deepcopy(json.loads(FIXTURE.read_text())["ceilings"])
    c["tensor_fp8"] = {"tflops": 1400.0, "shapes": [{"m": 8192, "n": 8192, "k": 8192, "ms": 0.785, "tflops": 1400.0},
                                                    {"m": 16384, "n": 8192, "k": 8192, "ms": 1.6, "tflops": 1374.4}]}
    return c


def test_a_run_before_the_fp8_ceiling_and_one_with_it_both_pass():
    ceilings.validate(json.loads(FIXTURE.read_text())["ceilings"])  # no tensor_fp8: an older run
    ceilings.validate(_good())
    failed = _good()
    failed["tensor_fp8"] = {"tflops": None, "error": "RuntimeError: cuBLAS Lt not found"}
    ceilings.validate(failed)


@pytest.mark.parametrize("breaks, names", [
    (lambda c: c.pop("read"), "'read'"),
    (lambda c: c["read"].update(gbps=0.0), "read.gbps"),
    (lambda c: c["read"].update(gbps=float("nan")), "read.gbps"),
    (lambda c: c["tensor"].update(tflops=None), "tensor.tflops"),  # the fp16 ceiling is never optional
    (lambda c: c["tensor_fp8"].update(tflops=None), "without an 'error'"),  # a failure must say why
    (lambda c: c["tensor_fp8"].update(shapes=[]), "tensor_fp8.shapes"),
    (lambda c: c["tensor_fp8"]["shapes"][1].update(ms=-1.0), "tensor_fp8.shapes[1].ms"),
    (lambda c: c["tensor_fp8"].update(tflops=2000.0), "not the best of its shapes"),
    (lambda c: c.update(tensor_fp8="1400"), "'tensor_fp8' is not a dict"),
])
def test_a_broken_ceiling_is_named(breaks, names):
    c = _good()
    breaks(c)
    with pytest.raises(ValueError, match=names.replace("[", r"\[").replace("]", r"\]")):
        ceilings.validate(c)


def test_the_tensor_ceiling_of_each_operand_kind():
    c = _good()
    assert ceilings.tensor_ceiling(c, "fp16") == c["tensor"]["tflops"]
    assert ceilings.tensor_ceiling(c, "fp8") == 1400.0
    del c["tensor_fp8"]
    assert ceilings.tensor_ceiling(c, "fp8") is None  # not measured: no ratio, never a 0
    with pytest.raises(ValueError, match="kind: expected one of fp16, fp8"):
        ceilings.tensor_ceiling(c, "int8")


def test_the_fp8_gemm_refuses_a_shape_cublaslt_cannot_take():
    from lab import cublaslt

    with pytest.raises(ValueError, match=r"multiples of 16, got \(100, 256, 256\)"):
        cublaslt.Fp8Gemm(100, 256, 256)


@pytest.mark.gpu
def test_fp8_peak_is_measured_and_checked_on_a_small_shape():
    """The peak on a small shape (its own float64 check passes), and the layout the binding
    documents: d[n, m] = sum_k a[m, k] b[n, k], every element against float64 within bf16's
    rounding of the largest output."""
    import cupy as cp

    from lab import cublaslt
    from lab.nvfp4 import decode_e4m3

    r = ceilings.measure_fp8_peak(shapes=((256, 512, 1024),), iterations=3, seed=int(np.random.default_rng().integers(2**31)))
    assert r["tflops"] > 0 and r["shapes"][0]["ms"] > 0
    rng = cp.random.default_rng(int(np.random.default_rng().integers(2**31)))
    m, n, k = 128, 256, 512
    a, b = ceilings._e4m3_codes(rng, (m, k)), ceilings._e4m3_codes(rng, (n, k))
    d = cp.full((n, m), 0x7FC0, dtype=cp.uint16)
    g = cublaslt.Fp8Gemm(m, n, k)
    stream = cp.cuda.Stream(non_blocking=True)
    g.run(a, b, d, stream)
    stream.synchronize()
    g.close()
    import ml_dtypes

    e4m3 = decode_e4m3(np.arange(256, dtype=np.uint8)).astype(np.float64)
    want = e4m3[cp.asnumpy(b)] @ e4m3[cp.asnumpy(a)].T  # (n, m)
    got = cp.asnumpy(d).view(ml_dtypes.bfloat16).astype(np.float64)
    assert np.isfinite(got).all()
    assert np.abs(got - want).max() <= 2.0**-7 * np.abs(want).max() + 1e-6
