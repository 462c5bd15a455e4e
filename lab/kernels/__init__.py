"""Hand-written CUDA kernels, each with its launcher and contract."""
