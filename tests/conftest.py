"""Shared test setup: a private kernel cache per test session, the gpu marker, hypothesis profiles,
the slow tier.

Fuzzing profiles (tests/test_fuzz.py): `ci`, the default, is derandomized and sized for CI's
time limit; `pytest --hypothesis-profile=long` draws many more examples at random.

Tiers: `python -m pytest -q` runs every test not marked `slow` (pyproject's addopts), spread over
the CPU's cores by pytest-xdist; `python -m pytest -q -m slow` runs the rest. CI runs both.
"""

import os
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings

import attngen
from attngen import testing

# pytest-xdist gives each worker a core of its own; torch's intra-op threads (one per core by default)
# would have every worker's interpreter loops compete for all of them.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

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
    # One per xdist worker (each has its own base temp folder): tests that damage a cached module
    # must not race another worker loading it.
    os.environ["ATTNGEN_CACHE_DIR"] = str(tmp_path_factory.mktemp("attngen-cache"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


SPECS = Path(__file__).resolve().parent.parent / "specs"
# Small params for the catalog, so the interpreter's 16 x 16 tiles see windows, chunks and blocks
# cross tiles.
SMALL_PARAMS = {"window": 7, "cap": 2.0, "chunk": 8, "block": 16}


@pytest.fixture
def fresh_dynamo():
    """torch.compile's caches emptied before and after a test, so its graphs and guards are its own."""
    torch._dynamo.reset()
    yield
    torch.compiler.set_stance("default")
    torch._dynamo.reset()


@pytest.fixture
def build_small():
    """build(spec, **params): a catalog spec (a name in specs/ or a path) built with SMALL_PARAMS,
    overridden by `params`, for the params it declares."""
    def build(spec, **params):
        path = spec if isinstance(spec, Path) else SPECS / f"{spec}.attn"
        declared = {p.name for p in attngen.load_spec(path)[0].params}
        return attngen.build(path, params={k: v for k, v in {**SMALL_PARAMS, **params}.items() if k in declared})
    return build


# The mark of kernel cases that are slow in Triton's interpreter: on a GPU they stay in the default run.
SLOW_IN_INTERPRETER = () if torch.cuda.is_available() else pytest.mark.slow


def slow_in_interpreter(test):
    """SLOW_IN_INTERPRETER as a test's decorator: the test joins the slow tier on a machine without CUDA."""
    return pytest.mark.slow(test) if SLOW_IN_INTERPRETER else test


# Tests whose calls run on the CPU (Triton's interpreter). On a machine with CUDA attngen builds for the GPU,
# which refuses CPU tensors: there the tests marked gpu check the same contracts with CUDA tensors.
CPU_CALLS = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU calls (the gpu tests check a GPU's)")


def tiered(cases, fast, ids=None):
    """`cases` (tuples of arguments) for pytest.mark.parametrize, each not in `fast` marked
    SLOW_IN_INTERPRETER: on the CPU the default run checks the `fast` ones, chosen for coverage, and
    the slow tier the rest of the cross product."""
    fast = set(fast)
    assert fast <= set(cases), fast - set(cases)
    return [pytest.param(*case, id=ids(case) if ids else None, marks=() if case in fast else SLOW_IN_INTERPRETER)
            for case in cases]


def rows_case(attn, B=2, H=4, HKV=2, N=21, M=21, D=16, dtype=torch.float32):
    """q, k, v and inputs for a spec whose `lens: i32[B]` input ends each batch row's keys (mask `k > q + 2 and
    k < lens[b]`, as the sink and sigmoid tests' ROWS specs): the first row keeps all M keys, the second M // 2,
    so some query rows have no allowed key."""
    q, k, v = testing.random_qkv(B, H, HKV, N, M, D, D, dtype)
    inputs = testing.random_inputs(attn.spec, B, H, HKV, N, M)
    inputs["lens"] = torch.tensor([M, M // 2], dtype=torch.int32)[:B]
    return q, k, v, inputs


# The start of a script run in a fresh interpreter that must not reach attngen (a standalone bundle): a
# finder first on sys.meta_path refuses it, then the folder in argv[1] (the bundle's) goes on the path.
NO_ATTNGEN = """
import importlib.abc, sys

class NoAttngen(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "attngen" or name.startswith("attngen."):
            raise ImportError(f"attngen is blocked in this process: {name}")
        return None

sys.meta_path.insert(0, NoAttngen())
sys.path.insert(0, sys.argv[1])
"""
