"""The kernels every spec shares (no spec expression in them): the backward's row-terms pass, the rounding
of deterministic sums and the device check of a cache call's values. Generated modules import those their
kernels call; the launches are the runtime's."""

import triton
import triton.language as tl

from .helpers import EXACT_DIGITS, EXACT_WORDS, LOG2E, _cache_row_bad


@triton.jit
def _bwd_preprocess(Out, DO, DLse, Lse, Delta, Lse2, DqSum, Sink, stride_sb, stride_sh, stride_sm, DSink,
                    stride_oz, stride_oh, stride_om, stride_ok, stride_doz, stride_doh, stride_dom, stride_dok, H,
                    Q_LEN, Q_ROWS,
                    HEAD_DIM_V: tl.constexpr, HEAD_DIM_V_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                    HAS_DLSE: tl.constexpr, BASE2_LSE: tl.constexpr, HEAD_DIM: tl.constexpr,
                    HEAD_DIM_PAD: tl.constexpr, ZERO_DQ: tl.constexpr, SINK_GRAD: tl.constexpr):
    # delta = rowsum(dO * O) - dLSE: the softmax backward's row term (dLSE enters here), Q_ROWS >= Q_LEN
    # rows a head (0 past Q_LEN). BASE2_LSE: also the base-2 LSE in the same rows (_base2_lse: +inf past
    # Q_LEN), for kernels that stream both by TMA in whole tiles. ZERO_DQ: also zeros the fp32
    # DqSum of B * H * Q_LEN * HEAD_DIM elements laid out densely (in any dim order: the pass covers its
    # memory, not its rows) that a backward then adds dQ into, so that needs no launch of its own.
    # SINK_GRAD: also the gradient DSink (B * H * Q_LEN, laid out as LSE) of a spec's sink rows Sink ((B, H,
    # Q_LEN) in its strides), the first term of each row's softmax: -exp(sink - LSE) * delta, the weight 1
    # where the sink is +inf (all of the row's weight; LSE is +inf too).
    start_m = tl.program_id(0)
    off_bh = tl.program_id(1)
    off_b = off_bh // H
    off_h = off_bh % H
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, HEAD_DIM_V_PAD)
    ok = (offs_m[:, None] < Q_LEN) & (offs_dv[None, :] < HEAD_DIM_V)
    o = tl.load(Out + off_b.to(tl.int64) * stride_oz + off_h.to(tl.int64) * stride_oh
                + offs_m[:, None] * stride_om + offs_dv[None, :] * stride_ok, mask=ok, other=0.0)
    do = tl.load(DO + off_b.to(tl.int64) * stride_doz + off_h.to(tl.int64) * stride_doh
                 + offs_m[:, None] * stride_dom + offs_dv[None, :] * stride_dok, mask=ok, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if HAS_DLSE:
        delta -= tl.load(DLse + off_bh.to(tl.int64) * Q_LEN + offs_m, mask=offs_m < Q_LEN, other=0.0)
    tl.store(Delta + off_bh.to(tl.int64) * Q_ROWS + offs_m, delta, mask=offs_m < Q_ROWS)
    if BASE2_LSE:
        tl.store(Lse2 + off_bh.to(tl.int64) * Q_ROWS + offs_m, _base2_lse(Lse, off_bh.to(tl.int64) * Q_LEN, offs_m,
                                                                          Q_LEN), mask=offs_m < Q_ROWS)
    if SINK_GRAD:
        rows = off_bh.to(tl.int64) * Q_LEN + offs_m
        lse = tl.load(Lse + rows, mask=offs_m < Q_LEN, other=float("-inf"))
        sink = tl.load(Sink + off_b.to(tl.int64) * stride_sb + off_h.to(tl.int64) * stride_sh
                       + offs_m.to(tl.int64) * stride_sm, mask=offs_m < Q_LEN, other=float("-inf"))
        # A row with neither a key nor a sink (LSE = -inf, and so sink = -inf) weighs its sink exp(-inf - 0) = 0,
        # never exp(-inf - -inf).
        weight = tl.where(sink == float("inf"), 1.0, tl.exp(sink - tl.where(lse == float("-inf"), 0.0, lse)))
        tl.store(DSink + rows, -weight * delta, mask=offs_m < Q_LEN)
    if ZERO_DQ:
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        tl.store(DqSum + (off_bh.to(tl.int64) * Q_LEN + offs_m[:, None]) * HEAD_DIM + offs_d[None, :],
                 tl.zeros((BLOCK_M, HEAD_DIM_PAD), DqSum.dtype.element_ty),
                 mask=(offs_m[:, None] < Q_LEN) & (offs_d[None, :] < HEAD_DIM))


@triton.jit
def _base2_lse(Lse, row, offs, n):
    # Rows with no allowed key (LSE = -inf) and padding rows get +inf, so p = exp2(s - lse) = 0.
    lse = tl.load(Lse + row + offs, mask=offs < n, other=float("inf")) * LOG2E
    return tl.where(lse == float("-inf"), float("inf"), lse)


@triton.jit
def _exact_finish(Words, Out, n, BLOCK: tl.constexpr):
    # Each of n entries' exact sum (helpers._exact_add's words) as float32: the carries moved up so that
    # every digit but the top one lies in [-2**23, 2**23) (balanced: a digit's sign never carries through
    # the words above it, so the top nonzero digit outweighs all below it and their float64 sum cancels
    # nothing), summed from the bottom in float64 (each digit exact there), then +-inf or NaN where the
    # entry had such terms (NaN for both infinities, as float addition gives). The same words give the
    # same bits.
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    words = Words + offs.to(tl.int64) * EXACT_WORDS
    carry = tl.zeros([BLOCK], dtype=tl.int64)
    total = tl.zeros([BLOCK], dtype=tl.float64)
    scale = tl.full([BLOCK], 2.0 ** -149, dtype=tl.float64)  # the lowest digit's unit
    for i in tl.static_range(EXACT_DIGITS):
        digit = tl.load(words + i, mask=ok, other=0) + carry
        if i < EXACT_DIGITS - 1:
            carry = (digit + 8388608) >> 24
            digit -= carry << 24
        total += digit.to(tl.float64) * scale
        scale *= 16777216.0
    plus = tl.load(words + EXACT_DIGITS, mask=ok, other=0) > 0
    minus = tl.load(words + EXACT_DIGITS + 1, mask=ok, other=0) > 0
    nan = (tl.load(words + EXACT_DIGITS + 2, mask=ok, other=0) > 0) | (plus & minus)
    result = tl.where(plus, float("inf"), tl.where(minus, float("-inf"), total.to(tl.float32)))
    tl.store(Out + offs, tl.where(nan, float("nan"), result), mask=ok)


@triton.jit
def _cache_values_check(Out, Lse, KvLen, QOffset, PageTable, stride_ob, stride_oh, stride_om, stride_ok,
                        stride_lb, stride_lh, stride_lm, stride_pt, H, Q_LEN, HEAD_DIM_V, MAX_KV, MAX_OFFSET,
                        NUM_PAGES, MAX_PAGES, HAS_KV_LEN: tl.constexpr, HAS_Q_OFFSET: tl.constexpr,
                        PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, HAS_LSE: tl.constexpr, BLOCK_PAGES: tl.constexpr,
                        BLOCK_ROWS: tl.constexpr, HEAD_DIM_V_PAD: tl.constexpr):
    # A cache call's values, checked on the device after its forward (the host never reads them, so an
    # eager decoding step never waits on the GPU), for a family whose forward does not check them itself
    # (the decode family's merge does): one program a batch row b, whose O (B, H, Q_LEN, HEAD_DIM_V, in
    # its strides) and LSE become NaN if _cache_row_bad finds it bad.
    b = tl.program_id(0)
    bad = _cache_row_bad(b, KvLen, QOffset, PageTable, stride_pt, Q_LEN, MAX_KV, MAX_OFFSET, NUM_PAGES, MAX_PAGES,
                         HAS_KV_LEN, HAS_Q_OFFSET, PAGED, PAGE_SIZE, BLOCK_PAGES)
    if bad:
        offs_d = tl.arange(0, HEAD_DIM_V_PAD)
        for start in range(0, H * Q_LEN, BLOCK_ROWS):
            rows = start + tl.arange(0, BLOCK_ROWS)
            ok = rows < H * Q_LEN
            h = (rows // Q_LEN).to(tl.int64)
            m = (rows % Q_LEN).to(tl.int64)
            row = b.to(tl.int64) * stride_ob + h * stride_oh + m * stride_om
            tl.store(Out + row[:, None] + offs_d[None, :] * stride_ok,
                     tl.full([BLOCK_ROWS, HEAD_DIM_V_PAD], float("nan"), Out.dtype.element_ty),
                     mask=ok[:, None] & (offs_d[None, :] < HEAD_DIM_V))
            if HAS_LSE:
                tl.store(Lse + b.to(tl.int64) * stride_lb + h * stride_lh + m * stride_lm,
                         tl.full([BLOCK_ROWS], float("nan"), tl.float32), mask=ok)
