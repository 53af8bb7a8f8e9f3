"""The runtime is an ordinary library: an Attention built from hand-written facts (no generated module,
no kernel) checks calls, picks families and answers its companions."""

import dataclasses
import math

import pytest
import torch

from attngen.runtime.attention import Attention, Kernels, SpecFacts
from attngen.runtime.tables import TileTables


def _facts(**changes) -> SpecFacts:
    facts = SpecFacts(name="handmade", fingerprint="0" * 16, digest="handmade0000000", inputs={
        "bias": ("f32", ("H",), False)}, plan={(16, 16, "f32"): ((32, 32, 4, 1),) * 3}, tile_table=False, table_reads=(), table_per_b=False,
        table_per_h=False, table_steps={"q": None, "k": None}, one_launch_backward=True, max_length=1024,
        max_length_reason="a test's limit", max_batch_heads=2**16, masked_width_floor=32, family_tiles={},
        softmax_scale=lambda D: 1.0 / math.sqrt(D))
    return dataclasses.replace(facts, **changes)


@pytest.fixture(scope="module")
def attention():
    return Attention(_facts(), Kernels(None, None, None, None, None, None))


def test_facts_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        _facts().name = "other"


def test_calls_are_checked_against_the_facts(attention):
    q = torch.zeros(1, 2, 8, 16)
    with pytest.raises(ValueError, match="handmade: missing input"):
        attention.forward_family(q, q, q)
    with pytest.raises(ValueError, match=r"handmade: Q_LEN and KV_LEN must be at most 1024 \(a test's limit\)"):
        long = torch.zeros(1, 2, 2000, 16)
        attention.forward_family(long, long, long, bias=torch.zeros(2))
    with pytest.raises(ValueError, match="input 'bias' must have shape"):
        attention.backward_family(q, q, q, bias=torch.zeros(3))


def test_families_and_companions_without_a_kernel(attention):
    q = torch.zeros(1, 2, 8, 16)
    assert attention.forward_family(q, q, q, bias=torch.zeros(2)) == "portable"
    assert attention.backward_family(q, q, q, bias=torch.zeros(2)) == "portable"
    tables = attention.tile_tables(q, q, q, bias=torch.zeros(2))  # a mask without tables: an empty object
    assert isinstance(tables, TileTables) and not any(tables.tables.values()) and "handmade" in repr(tables)
    assert len(attention.operators) == 6 and attention.table_stats == {"built": 0}
