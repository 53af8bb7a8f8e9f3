"""The decode family's host side: its per-call rule (with the split-versus-portable speed model), its split-KV launches
and the merge of the splits, a kernel no spec changes."""

import torch
import triton
import triton.language as tl

from ...runtime.arguments import _cache_launch, _dot_precision, _kv_layout, _sink_strides, _sm_count
from ...runtime.helpers import LOG2E, _cache_row_bad
from ...runtime.launch import _launch
from ...runtime.plans import _plan_site
from ...runtime.shared import _cdiv, _empty_in_layout, _next_power_of_2


# Each program should still stream a few key tiles, so a share is at least this many tiles long; and
# about this many programs per SM hide the loads' latency (the loop is memory-bound). Swept on an H200
# (bf16, D=128, 32/8 heads, benchmarks/decode_bench.py --sweep): 2 per SM against 4 and 8, B=1 over
# 128k keys took 0.152 ms against 0.212 and 0.259 (shorter shares pay their pipeline fill more
# often); B=8 over 32k 0.273 against 0.282 and 0.275; B=64 over 4k 0.278 against 0.263 and 0.260.
DECODE_MIN_TILES = 4
DECODE_PROGRAMS_PER_SM = 2


# Calls of more rows than one tile (chunked prefill) go to whichever forward the host predicts is faster
# from the call's shapes alone (no sync, the same answer in a CUDA graph). The model: the portable forward
# runs one program per SM (its 128 KiB of shared memory), so ceil(programs / SMs) waves of its loop over
# the key tiles; the split kernel runs DECODE_PROGRAMS_PER_SM per SM, its tile math at the rate below,
# or its K/V reads at HBM speed if slower. The rates are fitted on an H200 (bf16, D=128, GQA 32/8,
# causal, B 1-16, Q_LEN 16-1024, KV_LEN 4k-64k, CUDA-graph replays: `decode_bench.py --prefill`,
# benchmarks/history/results/2026-12-01-h200-s9-prefill-fit.json), where the model picked the faster
# kernel on 62 of 63 shapes and the miss cost 1%.
PORTABLE_FLOPS_PER_SM = 3.7e12
SPLIT_FLOPS_PER_SM = 1.9e12
HBM_BYTES_PER_SECOND = 4.0e12


def _decode_splits(n_tiles, programs, device):
    """How many shares the key tiles are split into: enough programs for the SMs, chosen per call
    (a runtime argument, so no recompile per batch size or length)."""
    wanted = _cdiv(DECODE_PROGRAMS_PER_SM * _sm_count(device), programs)
    return max(1, min(_cdiv(n_tiles, DECODE_MIN_TILES), wanted))


class DecodeFamily:
    """The decode family (families/decode/family.py) serving the Attention `rt`: its split-KV forward and the
    merge of its splits; max_rows, the most rows (query heads of a key/value head times queries) one tile
    of it holds."""

    # A cache call's values (kv_len, q_offset, the pages) are checked by the merge (_decode_combine's CHECK),
    # which runs anyway: no launch of kernels._cache_values_check after it (Cache._cache_forward).
    checks_cache_values = True

    def __init__(self, rt, forward_kernel, max_rows):
        self.rt = rt
        self.forward_kernel, self.max_rows = forward_kernel, max_rows

    def serves(self, q, k, v, HKV, KV_LEN, cached):
        """Whether a forward call of these tensors over HKV heads of KV_LEN keys (a cache call or not,
        contiguous or paged) goes to the decode family (its family entry's per_call): all queries of
        the query heads of one key/value head fit one tile, or, for a mask without tile tables, the
        split kernel is predicted faster than the portable forward, which would run it otherwise."""
        if (q.shape[1] // HKV) * q.shape[2] <= self.max_rows:
            return True
        # A tile-table mask's portable forward skips the tiles its table rules out, which the model does not
        # see; and the model knows the portable forward's speed only: a call a later family takes (the Hopper
        # family, any call but a cache call) runs there.
        if self.rt.facts.tile_table or self.rt._forward_family(q, k, v, HKV, KV_LEN, cached, after="decode")[0] != "portable":
            return False
        portable, split = self._predicted_seconds(q, v, HKV, KV_LEN)
        return split < portable

    def _predicted_seconds(self, q, v, HKV, KV_LEN):
        """(portable, split): the two forward kernels' predicted times for this call (the model above)."""
        B, H, Q_LEN, D = q.shape
        DV = v.shape[3]
        sms = _sm_count(q.device)
        block_m, block_n = self.rt._tiles(q, v, 0)[:2]
        waves = _cdiv(_cdiv(Q_LEN, block_m) * B * H, sms)
        portable = waves * _cdiv(KV_LEN, block_n) * 2 * block_m * block_n * (D + DV) / PORTABLE_FLOPS_PER_SM
        rows = (H // HKV) * Q_LEN
        split_m, split_n = self._decode_block_m(rows), self._decode_block_n(q, v)
        row_blocks = _cdiv(rows, split_m)
        n_tiles = _cdiv(KV_LEN, split_n)
        splits = _decode_splits(n_tiles, B * HKV * row_blocks, q.device)
        split_waves = max(1.0, splits * B * HKV * row_blocks / (DECODE_PROGRAMS_PER_SM * sms))
        tile_seconds = DECODE_PROGRAMS_PER_SM * 2 * split_m * split_n * (D + DV) / SPLIT_FLOPS_PER_SM
        reads = row_blocks * B * HKV * KV_LEN * (D + DV) * q.element_size() / HBM_BYTES_PER_SECOND
        return portable, max(split_waves * _cdiv(n_tiles, splits) * tile_seconds, reads)

    def _decode_block_m(self, rows):
        """The rows of one decode tile: the call's rows, at least 16 (tl.dot), at most DECODE_MAX_ROWS."""
        return min(self.max_rows, max(16, _next_power_of_2(rows)))

    def _decode_block_n(self, q, v):
        return self.rt._family_tiles(q, v, "decode")[1]

    def forward(self, q, k, v, tensors, table, cache=None, page_table=None, plan=None, sink=None):
        """Runs the split-KV forward and the merge of its splits; `table` is unused (the kernel decides a
        tile-table mask key by key), `cache` is a cache call's (kv_len, q_offset), `page_table` a paged cache's
        (k and v then hold pages (NUM_PAGES, PAGE_SIZE, HKV, D)), `plan` the call's _CallPlan (never with a
        cache), `sink` the spec's sink of every row, which the merge takes as one more split.
        Returns out and the natural-log LSE, as the portable forward does (a sigmoid spec's shares are sums over
        disjoint keys that the merge adds, and its LSE is never written)."""
        B, H, Q_LEN, D = q.shape
        DV = v.shape[3]
        HKV, KV_LEN, k_strides, v_strides, page_args, paging = _kv_layout(k, v, page_table, q)
        sm_scale = self.rt.facts.softmax_scale(D)
        d_pad, dv_pad = self.rt._widths(D, DV)
        _, block_n, warps, stages, _ = self.rt._family_tiles(q, v, "decode")
        rows = (H // HKV) * Q_LEN
        block_m = self._decode_block_m(rows)
        row_blocks = _cdiv(rows, block_m)
        splits = _decode_splits(_cdiv(KV_LEN, block_n), B * HKV * row_blocks, q.device)
        part = torch.empty((splits, B, H, Q_LEN, DV), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((splits, B, H, Q_LEN), dtype=torch.float32, device=q.device)
        cache_args, cache_flags = _cache_launch(cache, part_lse)
        _launch(
            self.forward_kernel, (splits, B * HKV, row_blocks), q, k, v, part, *self.rt._row_args(part_lse), sm_scale,
            sm_scale * LOG2E.value,
            *q.stride(), *k_strides, *v_strides, *self.rt._input_args(tensors), B, H, HKV, Q_LEN, KV_LEN, splits, *cache_args,
            *page_args,
            HEAD_DIM=D, HEAD_DIM_V=DV, HEAD_DIM_PAD=d_pad, HEAD_DIM_V_PAD=dv_pad, BLOCK_M=block_m, BLOCK_N=block_n,
            DOT_PRECISION=_dot_precision(q.dtype), num_warps=warps, num_stages=stages, **cache_flags, **paging,
            bind=_plan_site(plan, "decode"))
        out = _empty_in_layout(q, DV)
        lse = torch.empty((B, H, Q_LEN), dtype=torch.float32, device=q.device)
        _launch(_decode_combine, (B * H * Q_LEN,), part, part_lse, out, *out.stride()[:3], lse,
                *((sink, *_sink_strides(sink)) if sink is not None else (lse, 0, 0, 0)), *cache_args, *page_args[:2],
                H, Q_LEN, B * H * Q_LEN, splits, KV_LEN, self.rt.facts.max_length - Q_LEN, page_args[2],
                page_table.shape[1] if page_table is not None else 0,
                HEAD_DIM_V=DV, HEAD_DIM_V_PAD=dv_pad, SPLIT_BLOCK=min(COMBINE_SPLIT_BLOCK, _next_power_of_2(splits)),
                HAS_SINK=sink is not None, ADD_PARTS=self.rt.facts.sigmoid, CHECK=cache is not None, **cache_flags,
                BLOCK_PAGES=COMBINE_BLOCK_PAGES, **paging, num_warps=4, bind=_plan_site(plan, "combine"))
        return out, lse


# The merge of the shares is the same for every spec (no spec expression in it): here, not in the modules.
# A program merges one row, SPLIT_BLOCK shares a step (their loads independent: the merge of B=1 over 128k
# keys, 33 shares of 32 rows, took 26 us one share a step in two programs, 13% of the call); a cache call's
# page check reads BLOCK_PAGES page numbers a step.
COMBINE_SPLIT_BLOCK = 16
COMBINE_BLOCK_PAGES = 2048


@triton.jit
def _decode_combine(OutPart, LsePart, Out, stride_oz, stride_oh, stride_om, Lse, Sink, stride_sb, stride_sh, stride_sm,
                    KvLen, QOffset, PageTable, stride_pt, H, Q_LEN, n_rows, SPLITS, MAX_KV, MAX_OFFSET, NUM_PAGES,
                    MAX_PAGES, HEAD_DIM_V: tl.constexpr, HEAD_DIM_V_PAD: tl.constexpr, SPLIT_BLOCK: tl.constexpr,
                    HAS_SINK: tl.constexpr, ADD_PARTS: tl.constexpr, CHECK: tl.constexpr, HAS_KV_LEN: tl.constexpr,
                    HAS_Q_OFFSET: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
                    BLOCK_PAGES: tl.constexpr):
    # Merges the SPLITS partial results of one row by their LSE: O = sum_s exp(lse_s - lse) O_s. The
    # program's row (b * H + h) * Q_LEN + m of the parts is O's row (b, h, m), which lies in O's own strides,
    # and of the spec's sink (B, H, Q_LEN, in its strides), if it has one (HAS_SINK): a part with no value
    # (O = 0, LSE = sink), the merge's first, so the row's max starts at its sink (a sink of -inf is no sink:
    # the first parts rescale its 1 by exp(-inf) = 0). A row whose sink is +inf (O = 0, LSE = +inf) or NaN
    # (both NaN) merges as one without a sink and gets those values at the end. ADD_PARTS (sigmoid
    # attention): each part is its keys' weighted sum, not normalised, so O is the parts' sum and there is no
    # LSE (LsePart, Lse and Sink are never read). CHECK (a cache call): the values of the row's batch row b
    # are checked here, as kernels._cache_values_check would in a launch of its own: a row with values
    # outside the cache (_cache_row_bad) gets NaN in O and LSE.
    row = tl.program_id(0)
    b = row // (H * Q_LEN)
    h = row // Q_LEN % H
    m_row = row % Q_LEN
    if CHECK:
        bad = _cache_row_bad(b, KvLen, QOffset, PageTable, stride_pt, Q_LEN, MAX_KV, MAX_OFFSET, NUM_PAGES,
                             MAX_PAGES, HAS_KV_LEN, HAS_Q_OFFSET, PAGED, PAGE_SIZE, BLOCK_PAGES)
    offs_s = tl.arange(0, SPLIT_BLOCK)
    offs_dv = tl.arange(0, HEAD_DIM_V_PAD)
    dv_ok = offs_dv < HEAD_DIM_V
    acc = tl.zeros([HEAD_DIM_V_PAD], dtype=tl.float32)
    if ADD_PARTS:
        for start in range(0, SPLITS, SPLIT_BLOCK):
            share = start + offs_s
            part_row = share.to(tl.int64) * n_rows + row
            acc += tl.sum(tl.load(OutPart + part_row[:, None] * HEAD_DIM_V + offs_dv[None, :],
                                  mask=(share < SPLITS)[:, None] & dv_ok[None, :], other=0.0), 0)
        out = acc
        if CHECK:
            if bad:
                tl.store(Lse + row, float("nan"))
    else:
        m = tl.full([], float("-inf"), tl.float32)
        total = tl.zeros([], dtype=tl.float32)
        sink = m
        if HAS_SINK:
            sink = tl.load(Sink + b.to(tl.int64) * stride_sb + h.to(tl.int64) * stride_sh
                           + m_row.to(tl.int64) * stride_sm)
            m = tl.where(sink < float("inf"), sink, float("-inf"))
            total += 1.0
        for start in range(0, SPLITS, SPLIT_BLOCK):
            share = start + offs_s
            share_ok = share < SPLITS
            part_row = share.to(tl.int64) * n_rows + row
            lse_s = tl.load(LsePart + part_row, mask=share_ok, other=float("-inf"))
            o_s = tl.load(OutPart + part_row[:, None] * HEAD_DIM_V + offs_dv[None, :],
                          mask=share_ok[:, None] & dv_ok[None, :], other=0.0)
            m_new = tl.maximum(m, tl.max(lse_s, 0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - m_safe)
            weight = tl.exp(lse_s - m_safe)
            total = total * alpha + tl.sum(weight, 0)
            acc = acc * alpha + tl.sum(weight[:, None] * o_s, 0)
            m = m_new
        has_keys = total > 0.0
        total_safe = tl.where(has_keys, total, 1.0)
        lse = tl.where(has_keys, m + tl.log(total_safe), float("-inf"))
        out = acc / total_safe
        if HAS_SINK:
            out = tl.where(sink < float("inf"), out, tl.where(sink == float("inf"), 0.0, float("nan")))
            lse = tl.where(sink < float("inf"), lse, sink)
        if CHECK:
            lse = tl.where(bad, float("nan"), lse)
        tl.store(Lse + row, lse)
    if CHECK:
        out = tl.where(bad, float("nan"), out)
    out_row = b.to(tl.int64) * stride_oz + h.to(tl.int64) * stride_oh + m_row.to(tl.int64) * stride_om
    tl.store(Out + out_row + offs_dv, out.to(Out.dtype.element_ty), mask=dv_ok)


# The class the runtime serves a spec's Attention with (runtime.families).
FAMILY = DecodeFamily
