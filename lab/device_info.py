"""The setup rows every script prints first and stores in its JSON: GPU, clocks, versions, commit."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def lab_commit() -> str:
    """`git rev-parse --short HEAD` (+dirty); LAB_COMMIT overrides it for copies of the working
    tree whose .git does not follow the checkout (a remote machine given the files only)."""
    if os.environ.get("LAB_COMMIT"):
        return os.environ["LAB_COMMIT"]
    root = Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5)
        if out.returncode == 0:
            return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def _smi_clocks() -> dict:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,clocks.max.sm,driver_version",
             "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10)
        sm, mem, sm_max, driver = [v.strip() for v in out.stdout.strip().splitlines()[0].split(",")]
        return {"sm_clock_mhz": sm, "mem_clock_mhz": mem, "sm_clock_max_mhz": sm_max, "driver": driver}
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return {}


# Read before and after timing: under held load the H200's 700 W cap lowers the SM clock, and
# boards of one memory speed time the fused layer 1% apart for a reason not yet known
# (notes/layer-log.md v16); the readings are there to tell.
_STATE_FIELDS = (("temperature.gpu", "temp_c"), ("power.draw", "power_w"), ("power.limit", "power_limit_w"),
                 ("clocks.sm", "sm_clock_mhz"), ("clocks_event_reasons.sw_power_cap", "sw_power_cap"))


def parse_gpu_state(line: str) -> dict:
    """One `nvidia-smi --query-gpu=<_STATE_FIELDS> --format=csv,noheader,nounits` line -> dict
    (numbers as floats where they parse; 'Active' / 'Not Active' kept as text)."""
    values = [v.strip() for v in line.split(",")]
    if len(values) != len(_STATE_FIELDS):
        raise ValueError(f"expected {len(_STATE_FIELDS)} fields, got {line!r}")
    out = {}
    for (_, key), v in zip(_STATE_FIELDS, values):
        try:
            out[key] = float(v)
        except ValueError:
            out[key] = v
    return out


def describe_gpu_state(st: dict) -> str:
    """One line of a gpu_state() reading; a field nvidia-smi left as text ('[N/A]') prints as is."""
    def v(key, unit=""):
        x = st.get(key, "?")
        return f"{x:g}{unit}" if isinstance(x, float) else f"{x}{unit}"
    return (f"{v('temp_c', ' C')}, {v('power_w')} of {v('power_limit_w', ' W')}, SM {v('sm_clock_mhz', ' MHz')}, "
            f"power cap {v('sw_power_cap')}")


def gpu_state() -> dict:
    """Temperature, power draw and limit, SM clock and the power-cap reason now ({} without
    nvidia-smi)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=" + ",".join(f for f, _ in _STATE_FIELDS),
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10)
        return parse_gpu_state(out.stdout.strip().splitlines()[0])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return {}


def setup_info() -> dict:
    """A dict of the device and software; works (with fewer keys) without a GPU."""
    info = {"lab_commit": lab_commit()}
    try:
        import cupy as cp

        info["cupy"] = cp.__version__
        dev = cp.cuda.Device()
        props = cp.cuda.runtime.getDeviceProperties(dev.id)
        info.update({
            "gpu": props["name"].decode() if isinstance(props["name"], bytes) else props["name"],
            "sms": props["multiProcessorCount"],
            "l2_mb": props["l2CacheSize"] / 2**20,
            "memory_gb": props["totalGlobalMem"] / 1e9,
            "compute_capability": f"{props['major']}.{props['minor']}",
            "cuda_runtime": cp.cuda.runtime.runtimeGetVersion(),
            "cuda_driver": cp.cuda.runtime.driverGetVersion(),
        })
        info.update(_smi_clocks())
        state = gpu_state()
        if state:
            info["temp_c_at_start"] = state["temp_c"]
            info["power_limit_w"] = state["power_limit_w"]
    except Exception as exc:  # no cupy, no device: the setup table says so
        info["gpu"] = f"none ({type(exc).__name__})"
    return info
