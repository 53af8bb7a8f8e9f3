"""The kernel families beside the portable one, by name: each is a class whose object serves one
Attention (its `rt`) with the family's kernels, which the generated module hands over by keyword.

A family object has `serves(q, k, v, HKV, KV_LEN, cached)` and `forward(q, k, v, tensors, table,
cache=None, page_table=None, plan=None[, packed=None])` -> (out, lse); one with a backward also has
`backward_serves(q, k, v, deterministic=False)` and `backward(q, k, v, out, lse, do, dlse, tensors, table,
plan=None, packed=None, deterministic=False)` -> (dq, dk, dv, input grads), deterministic asking for the same
bits run after run. Its module is imported only when a spec's plan names it.
"""

import importlib

# name -> (module of this package, class)
FAMILIES = {"hopper": ("hopper", "HopperFamily"), "decode": ("decode", "DecodeFamily")}


def family(name, rt, kernels):
    """The family `name` serving the Attention `rt`, with its kernels and flags (a dict by keyword)."""
    module, cls = FAMILIES[name]
    return getattr(importlib.import_module(f"{__package__}.{module}"), cls)(rt, **kernels)
