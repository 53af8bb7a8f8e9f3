"""Shared test setup: a private kernel cache per test session, and the gpu marker."""

import os

import pytest
import torch


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
