"""attngen.merge on plain tensors (no kernel): its values, its gradients, and the LSEs it refuses."""

from __future__ import annotations

import math

import pytest
import torch

import attngen
from attngen.errors import ArgumentError

B, H, Q_LEN, DV = 1, 2, 3, 4


def _parts(empty_rows: dict[int, list[int]], dtype=torch.float64):
    """Two parts whose rows listed in `empty_rows[part]` have no key (LSE -inf, O = 0)."""
    generator = torch.Generator().manual_seed(0)
    outs, lses = [], []
    for part in range(2):
        out = torch.randn(B, H, Q_LEN, DV, generator=generator, dtype=dtype)
        lse = torch.randn(B, H, Q_LEN, generator=generator, dtype=dtype)
        for row in empty_rows.get(part, []):
            out[..., row, :] = 0
            lse[..., row] = -math.inf
        outs.append(out.requires_grad_())
        lses.append(lse.requires_grad_())
    return outs, lses


def test_merge_gradients_match_finite_differences():
    # Row 0 has keys in both parts, row 1 only in part 1, row 2 in none.
    outs, lses = _parts({0: [1, 2], 1: [2]})

    def merged(o0, o1, l0, l1):
        out, lse = attngen.merge([o0, o1], [l0, l1])
        # A -inf entry of the merged LSE has no finite difference: compare the finite ones.
        return out, torch.where(torch.isfinite(lse), lse, 0.0)

    assert torch.autograd.gradcheck(merged, (*outs, *lses))


def test_rows_with_no_key_in_any_part_get_zero_gradients_not_nan():
    outs, lses = _parts({0: [2], 1: [2]})
    out, lse = attngen.merge(outs, lses)
    assert torch.equal(out[..., 2, :], torch.zeros_like(out[..., 2, :])) and (lse[..., 2] == -math.inf).all()
    # A loss on the LSE too, as a kernel's LSE takes one: its -inf rows carry an upstream gradient.
    (out.sum() + torch.where(torch.isfinite(lse), lse, 0.0).sum() + lse.exp().sum()).backward()
    for tensor in (*outs, *lses):
        assert torch.isfinite(tensor.grad).all(), tensor.grad
    for lse_part in lses:
        assert (lse_part.grad[..., 2] == 0).all()
    for out_part in outs:
        assert (out_part.grad[..., 2, :] == 0).all()


@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_an_lse_that_is_not_finite_or_minus_inf_is_refused(bad):
    outs, lses = _parts({})
    lses[1] = lses[1].detach().clone()
    lses[1][0, 1, 2] = bad
    with pytest.raises(ArgumentError, match=rf"merge: LSE 1 must be finite or -inf, got {bad}"):
        attngen.merge(outs, lses)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_accumulating_parts_one_by_one_is_merging_them(dtype):
    """merge.accumulate adds part after part into a running (out, lse) in place, as merge does all at once; rows
    with no key in a part, or in any, included (row 1 only in part 1, row 2 in none)."""
    from attngen.merge import accumulate

    outs, lses = _parts({0: [1, 2], 1: [2]}, dtype)
    out = torch.zeros(B, H, Q_LEN, DV, dtype=dtype)
    lse = torch.full((B, H, Q_LEN), -math.inf, dtype=dtype)
    for o, l in zip(outs, lses):
        accumulate(out, lse, o.detach().to(torch.float16 if dtype == torch.float32 else dtype), l.detach())
    expected_out, expected_lse = attngen.merge([o.detach() for o in outs], [l.detach() for l in lses])
    tolerance = dict(rtol=1e-3, atol=1e-3) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out, expected_out, **tolerance)
    torch.testing.assert_close(lse, expected_lse, **tolerance)
    assert (lse[..., 2] == -math.inf).all() and (out[..., 2, :] == 0).all()


def test_importing_the_merge_module_leaves_attngen_merge_the_function():
    """attngen/merge.py is a submodule of the same name as the public function: importing it first (as
    attngen.distributed does) must not bind the module over attngen.merge."""
    import subprocess
    import sys

    code = ("from attngen.merge import accumulate\nimport attngen\n"
            "assert callable(attngen.merge) and attngen.merge.__name__ == 'merge', attngen.merge\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
