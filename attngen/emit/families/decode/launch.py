"""The decode family's host code: its per-call rule and its launches (plan.families.DECODE)."""

import torch

from attngen.emit.static.helpers import LOG2E
from attngen.emit.static.shared import _DTYPES, _cdiv, _next_power_of_2

# ---- inlined into every generated module from here on ----

# --- decode family: split-KV forward ----------------------------------------------------------------
# Each program should still stream a few key tiles, so a share is at least this many tiles long; and
# about this many programs per SM hide the loads' latency (the loop is memory-bound). Swept on an H200
# (bf16, D=128, 32/8 heads, benchmarks/decode_bench.py --sweep): 2 per SM against 4 and 8, B=1 over
# 128k keys took 0.152 ms against 0.212 and 0.259 (shorter shares pay their pipeline fill more
# often); B=8 over 32k 0.273 against 0.282 and 0.275; B=64 over 4k 0.278 against 0.263 and 0.260.
DECODE_MIN_TILES = 4
DECODE_PROGRAMS_PER_SM = 2
_SM_COUNTS = {}


def _decode_serves(q, k, v):
    """Whether this forward call goes to the decode family (plan.families.DECODE.per_call): all
    queries of the query heads of one key/value head fit one tile."""
    return (q.shape[1] // k.shape[1]) * q.shape[2] <= DECODE_MAX_ROWS


def _sm_count(device):
    # Triton's interpreter on the CPU: a few "SMs", so tests split the keys.
    if device.type != "cuda":
        return 4
    if device not in _SM_COUNTS:
        _SM_COUNTS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SM_COUNTS[device]


def _decode_splits(n_tiles, programs, device):
    """How many shares the key tiles are split into: enough programs for the SMs, chosen per call
    (a runtime argument, so no recompile per batch size or length)."""
    wanted = _cdiv(DECODE_PROGRAMS_PER_SM * _sm_count(device), programs)
    return max(1, min(_cdiv(n_tiles, DECODE_MIN_TILES), wanted))


def _decode_forward(q, k, v, tensors, table, cache=None, page_table=None):
    """Runs the split-KV forward and the merge of its splits; `table` is unused (the family serves
    no tile-table mask), `cache` is a cache call's (kv_len, q_offset), `page_table` a paged cache's
    (k and v then hold pages (NUM_PAGES, PAGE_SIZE, HKV, D)). Returns out and the natural-log LSE,
    as the portable forward does."""
    B, H, Q_LEN, D = q.shape
    DV = v.shape[3]
    if page_table is None:
        HKV, KV_LEN, page_size = k.shape[1], k.shape[2], 1
        # (batch, head, key, dim) strides; a paged cache's are (page, head, slot, dim).
        k_strides, v_strides = k.stride(), v.stride()
    else:
        HKV, page_size = k.shape[2], k.shape[1]
        KV_LEN = page_table.shape[1] * page_size
        k_strides = (k.stride(0), k.stride(2), k.stride(1), k.stride(3))
        v_strides = (v.stride(0), v.stride(2), v.stride(1), v.stride(3))
    sm_scale = softmax_scale(D)
    d_pad, dv_pad = _widths(D, DV)
    _, block_n, warps, stages = FAMILY_TILES[(d_pad, dv_pad, _DTYPES[q.dtype])]["decode"]
    rows = (H // HKV) * Q_LEN
    block_m = min(DECODE_MAX_ROWS, max(16, _next_power_of_2(rows)))
    row_blocks = _cdiv(rows, block_m)
    splits = _decode_splits(_cdiv(KV_LEN, block_n), B * HKV * row_blocks, q.device)
    part = torch.empty((splits, B, H, Q_LEN, DV), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((splits, B, H, Q_LEN), dtype=torch.float32, device=q.device)
    cache_args, cache_flags = _cache_launch(cache, part_lse)
    # PageTable, its row stride and NUM_PAGES; without a page table, a placeholder never read.
    page_args = (part_lse, 0, 1) if page_table is None else (page_table, page_table.stride(0), k.shape[0])
    _decode_fwd_kernel[(splits, B * HKV, row_blocks)](
        q, k, v, part, part_lse, sm_scale, sm_scale * LOG2E.value, *q.stride(), *k_strides, *v_strides,
        *_input_args(tensors), B, H, HKV, Q_LEN, KV_LEN, splits, *cache_args, *page_args,
        HEAD_DIM=D, HEAD_DIM_V=DV, HEAD_DIM_PAD=d_pad, HEAD_DIM_V_PAD=dv_pad, BLOCK_M=block_m, BLOCK_N=block_n,
        DOT_PRECISION=_dot_precision(q.dtype), PAGED=page_table is not None, PAGE_SIZE=page_size,
        num_warps=warps, num_stages=stages, **cache_flags)
    out = torch.empty((B, H, Q_LEN, DV), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, Q_LEN), dtype=torch.float32, device=q.device)
    n_rows = B * H * Q_LEN
    block_r = 16
    _decode_combine[(_cdiv(n_rows, block_r),)](part, part_lse, out, lse, n_rows, splits, HEAD_DIM_V=DV,
                                               HEAD_DIM_V_PAD=dv_pad, BLOCK_R=block_r, num_warps=4)
    return out, lse
