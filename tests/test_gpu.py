import subprocess
import sys

import pytest

from lab import gpu


def test_package_imports_without_touching_a_gpu():
    # a fresh interpreter: importing every module must not initialise CUDA or need a device
    code = ("import sys, lab, lab.nvfp4, lab.problem, lab.reference, lab.checkpoint, lab.roofline, "
            "lab.scale_fold, lab.gpu, lab.kernels, lab.variants; "
            "print('cupy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "False"


def test_gpu_available_is_a_bool_and_require_gpu_agrees():
    ok = gpu.gpu_available()
    assert isinstance(ok, bool)
    if ok:
        assert gpu.require_gpu("the test") is not None
    else:
        with pytest.raises(RuntimeError, match=r"^the w13 kernel needs a CUDA GPU \(CuPy found none: .+\)$"):
            gpu.require_gpu("the w13 kernel")


@pytest.mark.gpu
def test_require_gpu_returns_cupy_on_a_gpu():
    cupy = gpu.require_gpu("this test")
    assert cupy.cuda.runtime.getDeviceCount() >= 1
    assert int(cupy.arange(4).sum()) == 6
