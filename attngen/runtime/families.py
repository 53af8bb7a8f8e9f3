"""The kernel families' runtime sides, by registered name (attngen.families): each family's folder holds a
runtime.py whose FAMILY class serves one Attention (its `rt`) with the family's kernels, which the generated
module hands over by keyword.

A family object has `serves(q, k, v, HKV, KV_LEN, cached)` and `forward(q, k, v, tensors, table,
cache=None, page_table=None, plan=None[, packed=None])` -> (out, lse); one with a backward also has
`backward_serves(q, k, v, deterministic=False)` and `backward(q, k, v, out, lse, do, dlse, tensors, table,
plan=None, packed=None, deterministic=False)` -> (dq, dk, dv, input grads), deterministic asking for the same
bits run after run. A family whose forward checks a cache call's values itself (kv_len, q_offset, the pages:
a bad batch row's O and LSE NaN) says so with `checks_cache_values = True`, and the runtime launches no
separate check after it (Cache._cache_forward). Its module is imported only when a spec's plan names it.
"""

import importlib


def family(name, rt, kernels):
    """The family `name` serving the Attention `rt`, with its kernels and flags (a dict by keyword)."""
    # Relative to this package's parent, so a bundle (attngen.emit.bundle) imports its own copy.
    module = importlib.import_module(f"..families.{name}.runtime", __package__)
    return module.FAMILY(rt, **kernels)
