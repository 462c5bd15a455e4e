"""NVFP4 Mixture-of-Experts kernel lab.

The package imports on any machine: only the code that launches kernels needs CuPy and a
GPU, and it says so through :func:`lab.gpu.require_gpu` when called.
"""
