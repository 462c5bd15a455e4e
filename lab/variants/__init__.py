"""Layer variants: small files that compose kernels on one runner (lab/runner.py).

Each variant has a ``name``, an ``expect`` saying what its output should be, ``prepare`` and
``run``:

    baseline  separate                     the reference every other variant is compared with
    match     cuda-graph, chunked-{2,4,8,16}, fused-swiglu, fused-layer, fused-out,
              fused-layer-classes (under skew: one fused layer per size class, for A/Bs),
              fused-layer-swiglu (its large experts with the SwiGLU in w13's epilogue, for A/Bs)
                                           bitwise equal to separate's output
    ceiling   one-launch-2G                numerically wrong by construction; timed as a bound
    approx    fold-b                       option (b): gate/up ratio folded into e4m3 scales
              w4a16, w4a16-fused, w4a16-layer   NVFP4 weights, bf16 activations, on the same kernels:
                                           as a graph, with the SwiGLU epilogue, as one launch
              w4a8, w4a8-fused, w4a8-layer NVFP4 weights as e4m3 on the fp8 tensor cores, 1x128 fp8
                                           activations (lab/w4a8.py): one launch per stage, with
                                           the SwiGLU + quantize in w13's epilogue, and as one
                                           persistent launch (the three give the same bits)

What a user would run instead (PyTorch's grouped GEMMs) lives beside the lab, in `peers/`, on
the same runner contract.
"""

from __future__ import annotations

from . import (chunked, cuda_graph, fold_b, from_tree, fused_layer, fused_out, fused_swiglu, one_launch_2g, separate, w4a8,
               w4a16)

# name -> factory, in the order the layer table lists them
REGISTRY = {
    separate.name: separate.Separate,
    cuda_graph.name: cuda_graph.CudaGraph,
    **{f"chunked-{k}": (lambda k=k: chunked.Chunked(k)) for k in chunked.CHUNKS},
    fused_swiglu.name: fused_swiglu.FusedSwiglu,
    fused_layer.name: fused_layer.FusedLayer,
    f"{fused_layer.name}-classes": (lambda: fused_layer.FusedLayer(large=None)),
    f"{fused_layer.name}-swiglu": (lambda: fused_layer.FusedLayer(large="swiglu")),
    fused_out.name: fused_out.FusedOut,
    one_launch_2g.name: one_launch_2g.OneLaunch2G,
    fold_b.name: fold_b.FoldB,
    w4a16.name: w4a16.W4A16,
    w4a16.W4A16Fused.name: w4a16.W4A16Fused,
    w4a16.W4A16Layer.name: w4a16.W4A16Layer,
    w4a8.name: w4a8.W4A8,
    w4a8.W4A8Fused.name: w4a8.W4A8Fused,
    w4a8.W4A8Layer.name: w4a8.W4A8Layer,
}
NAMES = tuple(REGISTRY)
# Variants scripts take only when asked by name: ones built and checked on the CPU but not yet run
# on the H200 (so a default run reports measured kernels only), and forms kept for an A/B.
# fused-layer-classes is fused-layer's form of 947d39e-0015690 (one persistent layer per size
# class), kept for the A/B against its large class on image tiles
# (results/studies/fused_layer_large_class.json fused_layer_image_form; the two are the same where
# no expert passes HOT_TOKENS, 48).
# fused-layer-swiglu runs the large class with the SwiGLU in w13's epilogue (fused-layer's form of
# ea736dd-d1bc039), kept for the A/B against fused-out's stages (notes/gemm-log.md v28).
# w4a8, w4a8-fused and w4a8-layer give up exactness (fp8 activations and accumulation: notes/w4a8.md) and
# trail compiled torch-fp8 from 128 tokens per expert (from 32 on the H200): on request until they
# lead every band.
ON_REQUEST: tuple[str, ...] = ("fused-layer-classes", "fused-layer-swiglu", "w4a8", "w4a8-fused", "w4a8-layer")
DEFAULT = tuple(n for n in NAMES if n not in ON_REQUEST)


def make(name: str, trees: dict | None = None):
    """A fresh variant by name; ValueError listing the known names otherwise. "<name>@<label>" is
    that variant with its kernels compiled from trees[label] (from_tree.FromTree)."""
    base, label = from_tree.split(name)
    try:
        factory = REGISTRY[base]
    except KeyError:
        raise ValueError(f"unknown variant {base!r}; known: {', '.join(NAMES)}") from None
    if label is None:
        return factory()
    if not trees or label not in trees:
        raise ValueError(f"variant {name!r}: no kernel tree labelled {label!r}; "
                         f"known: {', '.join(trees or {}) or 'none (token_axis.py --tree LABEL=DIR)'}")
    return from_tree.FromTree(factory(), label, trees[label])
