"""The tiles each kernel visits set against those the mask needs: `visit_counts` beside the reference mask, tile by tile."""

from __future__ import annotations

import torch

from attngen.reference import evaluate_expr, make_env

KERNELS = ("fwd", "dkdv", "dq")  # in the order of the portable kernels' tiles (the Attention's _tiles index)


def tile_truth(allowed: torch.Tensor, block_rows: int, block_cols: int, rows_len: int, cols_len: int):
    """Per tile of a (B, H, rows, cols) boolean grid: whether any element is allowed, and whether the
    tile is full (every in-range row allowed everywhere, and it does not run past the columns' end)."""
    B, H = allowed.shape[:2]
    n_r, n_c = -(-rows_len // block_rows), -(-cols_len // block_cols)
    pad = torch.zeros(B, H, n_r * block_rows, n_c * block_cols, dtype=torch.bool, device=allowed.device)
    pad[:, :, :rows_len, :cols_len] = allowed
    tiles = pad.view(B, H, n_r, block_rows, n_c, block_cols).permute(0, 1, 2, 4, 3, 5)
    some = tiles.flatten(-2).any(-1)
    in_rows = torch.zeros(n_r * block_rows, dtype=torch.bool, device=allowed.device)
    in_rows[:rows_len] = True
    in_rows = in_rows.view(n_r, 1, block_rows, 1)
    every = (tiles | ~in_rows).flatten(-2).all(-1)
    return some, every


def allowed_grid(spec, q, k, inputs) -> torch.Tensor:
    """The reference mask of a plain call of these tensors, (B, H, Q_LEN, KV_LEN) booleans on q's device."""
    (B, H, N, D), (HKV, M) = q.shape, k.shape[1:3]
    env = make_env(spec, B=B, H=H, HKV=HKV, Q_LEN=N, KV_LEN=M, D=D, inputs=dict(inputs), device=q.device)
    if spec.mask is None:
        return torch.ones((B, H, N, M), dtype=torch.bool, device=q.device)
    return evaluate_expr(spec.mask, env).expand(B, H, N, M)


def truths(attn, q, k, v, inputs) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per kernel (KERNELS): tile_truth of the reference mask at the kernel's own tiles (dK/dV's transposed:
    key tiles along rows)."""
    allowed = allowed_grid(attn.spec, q, k, inputs)
    N, M = q.shape[2], k.shape[2]
    result = {}
    for i, kernel in enumerate(KERNELS):
        bm, bn = attn.module._tiles(q, v, i)[:2]
        result[kernel] = (tile_truth(allowed.transpose(-1, -2), bn, bm, M, N) if kernel == "dkdv"
                          else tile_truth(allowed, bm, bn, N, M))
    return result


def visit_summary(attn, q, k, v, inputs) -> dict[str, dict[str, int]]:
    """Per kernel: its tiles, those it visits (`visit_counts`), those with an allowed pair (`needed`), the
    empty ones it visits (`wasted`), allowed ones it skips (`missed`, always 0 unless a kernel is wrong), the
    full ones it runs with mask code (`masked_full`) and those it runs without mask code that are not full
    (`unmasked_partial`, 0 unless wrong)."""
    counts = attn.visit_counts(q, k, v, **inputs)
    summary = {}
    for kernel, (some, every) in truths(attn, q, k, v, inputs).items():
        c = counts[kernel].to(some.device)
        visited, unmasked = c != 0, c == 16
        summary[kernel] = {"tiles": c.numel(), "visited": int(visited.sum()), "needed": int(some.sum()),
                           "wasted": int((visited & ~some).sum()), "missed": int((some & ~visited).sum()),
                           "masked_full": int((every & some & ~unmasked).sum()),
                           "unmasked_partial": int((unmasked & ~every).sum())}
    return summary
