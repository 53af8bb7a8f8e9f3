"""The portable family's plan entry: it serves every spec on every target, every kernel and every call."""

from __future__ import annotations

from attngen.plan.family import Family

FAMILY = Family(
    name="portable",
    strength=("FlashAttention-2-style Triton kernels (tl.dot, software-pipelined loads): any CUDA GPU and "
              "Triton's interpreter"),
    problem=lambda facts, target: None,
)
