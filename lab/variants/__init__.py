"""Layer variants: small files that compose kernels on one runner."""
