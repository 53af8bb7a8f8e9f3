"""Shared test setup: a private kernel cache per test session, the gpu marker, hypothesis profiles.

Fuzzing profiles (tests/test_fuzz.py): `ci`, the default, is derandomized and sized for CI's
time limit; `pytest --hypothesis-profile=long` draws many more examples at random.
"""

import os

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings

settings.register_profile("ci", derandomize=True, deadline=None, max_examples=200,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("long", deadline=None, max_examples=3000,
                          suppress_health_check=[HealthCheck.too_slow])
# The ci examples without shrinking: tools/planted_bugs.py asks which properties fail, not how small.
settings.register_profile("ci-noshrink", settings.get_profile("ci"),
                          phases=[Phase.explicit, Phase.reuse, Phase.generate])
settings.load_profile("ci")


@pytest.fixture(scope="session", autouse=True)
def _kernel_cache(tmp_path_factory):
    os.environ["ATTNGEN_CACHE_DIR"] = str(tmp_path_factory.mktemp("attngen-cache"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
