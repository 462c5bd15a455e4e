import pytest
from hypothesis import HealthCheck, settings

from lab.gpu import gpu_available

# CI machines have 2 cores: keep example counts moderate; deadlines off (timings vary).
settings.register_profile("lab", deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("lab")


def pytest_collection_modifyitems(config, items):
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
