"""attngen.merge: one attention over the union of several key sets, from each set's output and LSE."""

from __future__ import annotations

import torch

from attngen.errors import ArgumentError


def merge(outs, lses):
    """Combine partial attention results over disjoint key sets into the attention over their union.

    outs: a list of (B, H, Q_LEN, DV) outputs, lses: the matching (B, H, Q_LEN) natural-log LSEs
    (as `attn(..., return_lse=True)` returns them): O = sum_i exp(lse_i - lse) O_i with
    lse = log sum_i exp(lse_i). A part whose row has no allowed key (LSE -inf) weighs nothing; a
    row with none in any part gets O = 0 and LSE = -inf, as a kernel gives it. For cascade and
    shared-prefix attention: attend the shared prefix once and each suffix apart, then merge.
    Returns (out, lse): out in the parts' dtype, lse in float32. Differentiable.
    """
    outs, lses = list(outs), list(lses)
    if not outs or len(outs) != len(lses):
        raise ArgumentError(f"merge needs as many outputs as LSEs, at least one; got {len(outs)} and {len(lses)}")
    first = outs[0]
    for n, (o, lse) in enumerate(zip(outs, lses)):
        if not isinstance(o, torch.Tensor) or not isinstance(lse, torch.Tensor):
            raise ArgumentError(f"merge: part {n} must be two tensors, got {type(o).__name__} and {type(lse).__name__}")
        if o.dim() != 4 or o.shape != first.shape or o.dtype != first.dtype or o.device != first.device:
            raise ArgumentError(f"merge: output {n} must be (B, H, Q_LEN, DV) like output 0, "
                                f"{tuple(first.shape)} {first.dtype} on {first.device}; got {tuple(o.shape)} "
                                f"{o.dtype} on {o.device}")
        if lse.shape != first.shape[:3] or not lse.is_floating_point() or lse.device != first.device:
            raise ArgumentError(f"merge: LSE {n} must be a float (B, H, Q_LEN) = {tuple(first.shape[:3])} "
                                f"tensor on {first.device}; got {tuple(lse.shape)} {lse.dtype} on {lse.device}")
    lse_parts = torch.stack([lse.float() for lse in lses])
    lse = torch.logsumexp(lse_parts, dim=0)
    # exp(-inf - finite) = 0; a row with no key anywhere has lse = -inf, so shift it by 0 instead.
    weights = torch.exp(lse_parts - torch.where(torch.isfinite(lse), lse, 0.0))
    out = (weights.unsqueeze(-1) * torch.stack([o.float() for o in outs])).sum(dim=0)
    return out.to(first.dtype), lse
