"""attngen.merge: one attention over the union of several key sets, from each set's output and LSE (or, for
sigmoid attention, from the outputs alone)."""

from __future__ import annotations

import functools

import torch

from attngen.errors import ArgumentError


def merge(outs, lses=None, *, normalize: str = "softmax"):
    """Combine partial attention results over disjoint key sets into the attention over their union.

    outs: a list of (B, H, Q_LEN, DV) outputs, lses: the matching (B, H, Q_LEN) natural-log LSEs
    (as `attn(..., return_lse=True)` returns them): O = sum_i exp(lse_i - lse) O_i with
    lse = log sum_i exp(lse_i). A part whose row has no allowed key (LSE -inf) weighs nothing; a
    row with none in any part gets O = 0 and LSE = -inf, as a kernel gives it. For cascade and
    shared-prefix attention: attend the shared prefix once and each suffix apart, then merge.
    Returns (out, lse): out in the parts' dtype, lse in float32 (computed in float64, and returned so,
    when some part is float64, as a float64 reference's are). Differentiable: a row with no key
    in any part gets zero gradients, as a kernel's backward gives it.

    An LSE value of +inf or NaN in a part is an ArgumentError. Checking it reads one flag per part
    back from the device (one sync per call); under torch.compile and CUDA graph capture, where a
    call cannot read device values, the check is skipped.

    Sigmoid attention (a spec's `normalize: sigmoid`) has no LSE: each key's weight is its own, so the
    attention over the union is the sum of the parts. `merge(outs, normalize="sigmoid")` returns that sum
    alone, in the parts' dtype (added in float32, or float64 when the parts are float64); said explicitly, so
    that softmax parts without their LSEs are an error rather than a sum.
    """
    if normalize not in ("softmax", "sigmoid"):
        raise ArgumentError(f"merge: normalize must be 'softmax' or 'sigmoid', got {normalize!r}")
    outs = list(outs)
    if normalize == "sigmoid":
        if lses is not None:
            raise ArgumentError("merge: sigmoid attention's parts have no LSE (each key's weight is its own), so lses "
                                "must be None with normalize='sigmoid'; the parts add")
        return _sum_of_parts(outs)
    if lses is None:
        raise ArgumentError("merge needs the parts' LSEs (attn(..., return_lse=True)) to merge softmax attention; "
                            "parts of sigmoid attention, which have none, add: merge(outs, normalize='sigmoid')")
    lses = list(lses)
    if not outs or len(outs) != len(lses):
        raise ArgumentError(f"merge needs as many outputs as LSEs, at least one; got {len(outs)} and {len(lses)}")
    first = outs[0]
    for n, (o, lse) in enumerate(zip(outs, lses)):
        if not isinstance(o, torch.Tensor) or not isinstance(lse, torch.Tensor):
            raise ArgumentError(f"merge: part {n} must be two tensors, got {type(o).__name__} and {type(lse).__name__}")
        _check_output(n, o, first)
        if lse.shape != first.shape[:3] or not lse.is_floating_point() or lse.device != first.device:
            raise ArgumentError(f"merge: LSE {n} must be a float (B, H, Q_LEN) = {tuple(first.shape[:3])} "
                                f"tensor on {first.device}; got {tuple(lse.shape)} {lse.dtype} on {lse.device}")
    if not torch.compiler.is_compiling() and not (first.is_cuda and torch.cuda.is_current_stream_capturing()):
        _check_lse_values(lses)
    out, lse = combine(outs, lses)
    return out.to(first.dtype), lse


def combine(outs, lses):
    """`merge`'s arithmetic without its checks, for callers whose parts come from the kernels (finite or -inf
    LSEs): (out, lse), both in the working dtype (float32, or float64 when some part is float64), so a caller
    that merges part after part (a ring of context-parallel shards) rounds to its output dtype once."""
    first = outs[0]
    work = functools.reduce(torch.promote_types, [first.dtype, *(lse.dtype for lse in lses)], torch.float32)
    lse_parts = torch.stack([lse.to(work) for lse in lses])
    # logsumexp by hand: torch.logsumexp's gradient on a row of -infs is NaN (exp(-inf - -inf)).
    # The shift only keeps exp in range, so it carries no gradient; a row with no key anywhere
    # sums to 0 and takes lse = -inf through a `where` whose other branch stays finite.
    peak = lse_parts.detach().amax(dim=0)
    peak = torch.where(torch.isfinite(peak), peak, 0.0)
    total = torch.exp(lse_parts - peak).sum(dim=0)
    some = total > 0
    lse = torch.where(some, peak + torch.log(torch.where(some, total, 1.0)), -torch.inf)
    # exp(-inf - finite) = 0; a row with no key anywhere has lse = -inf, so shift it by 0 instead.
    weights = torch.exp(lse_parts - torch.where(some, lse, 0.0))
    out = (weights.unsqueeze(-1) * torch.stack([o.to(work) for o in outs])).sum(dim=0)
    return out, lse


def accumulate(out, lse, part_out, part_lse) -> None:
    """Merges one more part into a running result in place, as `combine` of the two would: `out` (B, H, Q_LEN, DV)
    and `lse` (B, H, Q_LEN) float32 (or float64) tensors hold the parts so far (a row with none yet: 0 and -inf),
    `part_out` in any float dtype, `part_lse` the kernels' (finite or -inf). Parts of a sigmoid spec have no LSE
    (both None): they add, as `merge(..., normalize="sigmoid")` adds them. Not differentiable: for callers that
    add part after part (a ring of context-parallel shards), at about a third of combine's memory traffic."""
    if lse is None:
        out.add_(part_out)
        return
    total = torch.logaddexp(lse, part_lse.to(lse.dtype))
    # A row with no key in either (-inf twice) keeps 0 and -inf: its weights are 0, not exp(nan).
    some = torch.isfinite(total)
    shift = torch.where(some, total, 0.0)
    old = torch.where(some, torch.exp(lse - shift), 0.0)
    new = torch.where(some, torch.exp(part_lse.to(lse.dtype) - shift), 0.0)
    out.mul_(old.unsqueeze(-1)).addcmul_(part_out, new.unsqueeze(-1))
    lse.copy_(total)


def _check_output(n, o, first) -> None:
    if o.dim() != 4 or o.shape != first.shape or o.dtype != first.dtype or o.device != first.device:
        raise ArgumentError(f"merge: output {n} must be (B, H, Q_LEN, DV) like output 0, "
                            f"{tuple(first.shape)} {first.dtype} on {first.device}; got {tuple(o.shape)} "
                            f"{o.dtype} on {o.device}")


def _sum_of_parts(outs):
    """The sigmoid merge: the parts' sum (each part's weights are its keys' own, with no normalisation)."""
    if not outs:
        raise ArgumentError("merge needs at least one output, got none")
    first = outs[0]
    for n, o in enumerate(outs):
        if not isinstance(o, torch.Tensor):
            raise ArgumentError(f"merge: output {n} must be a tensor, got {type(o).__name__}")
        if not o.is_floating_point():
            raise ArgumentError(f"merge: output {n} must be a float tensor, got {o.dtype}")
        _check_output(n, o, first)
    work = torch.promote_types(first.dtype, torch.float32)
    return torch.stack([o.to(work) for o in outs]).sum(dim=0).to(first.dtype)


def _check_lse_values(lses) -> None:
    """Every part's LSE is finite or -inf (an empty row): +inf or NaN would make the merge +-inf or NaN.
    One flag per part, read in one sync; the message, only on failure, reads the offending value."""
    bad = torch.stack([(torch.isnan(lse) | (lse == torch.inf)).any() for lse in lses]).tolist()
    for n, (lse, flag) in enumerate(zip(lses, bad)):
        if flag:
            value = lse[torch.isnan(lse) | (lse == torch.inf)].flatten()[0].item()
            raise ArgumentError(f"merge: LSE {n} must be finite or -inf, got {value} (at index "
                                f"{tuple(torch.nonzero(torch.isnan(lse) | (lse == torch.inf))[0].tolist())})")
