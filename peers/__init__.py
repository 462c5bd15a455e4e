"""Peers: the MoE layer as a user would run it instead of the lab's kernels, on the same
routing, shape and runner, timed and checked like every lab variant.

    torch-bf16        torch._grouped_mm on bf16 weights (the NVFP4 weights dequantized, globals
                      applied), bf16 activations, SwiGLU in between, compiled (torch.compile)
    torch-fp8         torch._scaled_grouped_mm on fp8 e4m3 weights and activations with rowwise
                      scales, SwiGLU and the activations' fp8 quantization in between, compiled
    torch-bf16-eager  the same with the activation stage in eager PyTorch (five or six kernels)
    torch-fp8-eager

torch is an optional extra (``pip install -e '.[peers]'``); nothing in `lab/` imports it, and
importing this package does not either: a peer asks for torch when it is prepared, and without
it raises NotImplementedError saying how to get it (the scripts report the row as skipped).
"""

from __future__ import annotations

import importlib.util

from . import torch_grouped

INSTALL_HINT = "torch is not installed: pip install -e '.[peers]' adds it"

# name -> factory, in the order the tables list them
REGISTRY = {
    torch_grouped.NAME_BF16: lambda: torch_grouped.TorchGrouped("bf16"),
    torch_grouped.NAME_FP8: lambda: torch_grouped.TorchGrouped("fp8"),
    torch_grouped.NAME_BF16 + torch_grouped.EAGER: lambda: torch_grouped.TorchGrouped("bf16", "eager"),
    torch_grouped.NAME_FP8 + torch_grouped.EAGER: lambda: torch_grouped.TorchGrouped("fp8", "eager"),
}
NAMES = tuple(REGISTRY)
# What a torch user runs (the activation stage compiled): the peers scripts run by default where
# a table is about the layer rather than about the peers themselves.
COMPILED = (torch_grouped.NAME_BF16, torch_grouped.NAME_FP8)


def available() -> bool:
    """True when torch can be imported (without importing it)."""
    return importlib.util.find_spec("torch") is not None


def make(name: str):
    """A fresh peer by name; ValueError listing the known names otherwise."""
    try:
        return REGISTRY[name]()
    except KeyError:
        raise ValueError(f"unknown peer {name!r}; known: {', '.join(NAMES)}") from None
