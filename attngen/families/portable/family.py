"""The portable family's plan entry: it serves every spec on every target, every kernel and every call."""

from __future__ import annotations

from attngen.plan.family import Family

FAMILY = Family(
    name="portable",
    strength=("FlashAttention-2-style Triton kernels (tl.dot, software-pipelined loads): any CUDA GPU and "
              "Triton's interpreter"),
    problem=lambda facts, target: None,
    # dQ, dK and dV are each written once, by one program: the same bits run after run whatever the order.
    deterministic=lambda facts: (True, "each dQ program writes its query tile's rows once, each dK/dV program its "
                                       "key tile's"),
    dropout=True,
)
