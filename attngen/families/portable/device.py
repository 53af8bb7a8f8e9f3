"""The portable family's device side that no spec changes: the body of its forward kernel (a program's
setup, a packed call's sequence, a cache call's positions and lengths, the sink, the two passes over the
key tiles and the epilogue). A module's _fwd_kernel (families/portable/fwd.py.jinja) runs it with what the
spec decides, its tile range and its inner loop over key tiles (where its score and mask run), bound as the
constexprs SPEC_RANGE and SPEC_INNER; the spec's inputs and tile table travel as the tuples `inputs` and
`table`, which only the spec's functions unpack. Triton keys a compiled kernel by the source of every
function it calls, these constexpr ones included, and the interpreter runs them as it runs any helper.
"""

import triton
import triton.language as tl

from ...runtime.helpers import LN2, LOG2E, _cache_query_offset, _dropout_state, _fp8_descales, _load_tile


@triton.jit
def _fwd_program(Q, K, V, Out, Lse, sink_args, sm_scale, qk_scale, Rng, dropout_p, QDescale, KDescale, VDescale,
                 stride_db, stride_dh, stride_qz, stride_qh, stride_qm,
                 stride_qk, stride_kz, stride_kh, stride_kn, stride_kk, stride_vz, stride_vh, stride_vn, stride_vk,
                 stride_oz, stride_oh, stride_om, stride_ok, inputs, table, B, H, HKV, Q_LEN, KV_LEN, Visits, KvLen,
                 QOffset, PageTable, stride_pt, NUM_PAGES, CuSeqlensQ, CuSeqlensK, TOTAL_Q, SPEC_RANGE: tl.constexpr,
                 SPEC_INNER: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                 HEAD_DIM_PAD: tl.constexpr, HEAD_DIM_V_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, COUNT_VISITS: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 FOLLOW_TABLE: tl.constexpr, HAS_KV_LEN: tl.constexpr, HAS_Q_OFFSET: tl.constexpr, PAGED: tl.constexpr,
                 PAGE_SIZE: tl.constexpr, SIGMOID: tl.constexpr, SINK: tl.constexpr, VARLEN: tl.constexpr,
                 DROPOUT: tl.constexpr, FP8: tl.constexpr):
    # One program owns BLOCK_M query rows of one (batch, head) (Lse is None in a sigmoid spec's kernel, and
    # `sink_args` the sink's rows, signatures.SINK, in a spec with one).
    start_m = tl.program_id(0)
    off_bh = tl.program_id(1)
    off_b = off_bh // H
    off_h = off_bh % H
    off_hkv = off_h // (H // HKV)  # grouped-query attention: K/V are shared, never repeated
    if FP8:
        # float8_e4m3fn q, k and v (an FP8 call, never packed): the dot of q and k counts q_descale[b, hkv] *
        # k_descale[b, hkv] times over, so the scores' scales take that factor; O takes v_descale's at the end.
        # P enters its product with V as e4m3 too, as FlashAttention-3's FP8 forward does.
        qk_descale, o_descale = _fp8_descales(QDescale, KDescale, VDescale,
                                              off_b.to(tl.int64) * stride_db + off_hkv.to(tl.int64) * stride_dh)
        sm_scale = sm_scale * qk_descale
        qk_scale = qk_scale * qk_descale
    visits = Visits + (off_bh.to(tl.int64) * ((Q_LEN + BLOCK_M - 1) // BLOCK_M) + start_m) * (
        (KV_LEN + BLOCK_N - 1) // BLOCK_N)
    if not SIGMOID:
        lse_row = off_bh.to(tl.int64) * Q_LEN
    # A packed call (VARLEN): batch row b is sequence b, tokens cu_seqlens[b] .. cu_seqlens[b + 1] - 1 of
    # (1, heads, TOTAL, D) views. Q_LEN and KV_LEN arrive as the longest sequence's lengths (the grid's)
    # and become this sequence's, so every bound below is the sequence's and no tile of another
    # sequence is visited; a program past the end of its sequence has nothing to do.
    q_start = 0
    if VARLEN:
        q_start = tl.load(CuSeqlensQ + off_b)
        k_start = tl.load(CuSeqlensK + off_b)
        Q_LEN = tl.load(CuSeqlensQ + off_b + 1) - q_start
        KV_LEN = tl.load(CuSeqlensK + off_b + 1) - k_start
        if start_m * BLOCK_M >= Q_LEN:
            return
        Q += q_start.to(tl.int64) * stride_qm
        Out += q_start.to(tl.int64) * stride_om
        K += k_start.to(tl.int64) * stride_kn
        V += k_start.to(tl.int64) * stride_vn
    if not SIGMOID:
        if VARLEN:  # LSE (H, TOTAL_Q): the sequence's rows of the head's row
            lse_row = off_h.to(tl.int64) * TOTAL_Q + q_start
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_dv = tl.arange(0, HEAD_DIM_V_PAD)
    Q_head = Q + off_b.to(tl.int64) * stride_qz + off_h.to(tl.int64) * stride_qh
    # A paged cache (PAGED): K and V hold pages (NUM_PAGES, PAGE_SIZE, HKV, D), their strides arrive as
    # (page, head, slot, d), and the row's keys are found through its page table.
    K_head = K + off_hkv.to(tl.int64) * stride_kh
    V_head = V + off_hkv.to(tl.int64) * stride_vh
    pages = PageTable + off_b.to(tl.int64) * stride_pt
    if not PAGED:
        K_head += off_b.to(tl.int64) * stride_kz
        V_head += off_b.to(tl.int64) * stride_vz
    q = _load_tile(Q_head + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qk,
                   offs_m[:, None] < Q_LEN, offs_d[None, :] < HEAD_DIM, True, HEAD_DIM != HEAD_DIM_PAD)
    # A cache call: query i of batch b sits at position q_offset[b] + i, and the row's keys end at
    # kv_len[b] (clamped to the cache, so no value can reach past its memory).
    q_off = _cache_query_offset(KvLen, QOffset, off_b, Q_LEN, HAS_KV_LEN, HAS_Q_OFFSET)
    if HAS_KV_LEN:
        KV_LEN = tl.minimum(tl.maximum(tl.load(KvLen + off_b), 0), KV_LEN)
    pos_m = offs_m + q_off

    if SINK:
        # The sink is the softmax's first term, one with no value: the running max starts at it (base 2) and
        # the running sum at its exp2(0) = 1, so O and LSE below include it. A sink of -inf is no sink: the
        # first tile rescales that 1 by exp2(-inf) = 0, and a row that visits no tile keeps LSE = -inf, O = 0.
        # A row whose sink is +inf (all its weight on the sink: O = 0, LSE = +inf) or NaN (O and LSE NaN)
        # runs as one without a sink, never inf - inf, and gets those values at the end.
        Sink, stride_sb, stride_sh, stride_sm = sink_args
        sink = tl.load(Sink + off_b.to(tl.int64) * stride_sb + off_h.to(tl.int64) * stride_sh
                       + (q_start + offs_m).to(tl.int64) * stride_sm, mask=offs_m < Q_LEN, other=float("-inf"))
        m_i = tl.where(sink < float("inf"), sink * LOG2E, float("-inf"))
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    else:
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_V_PAD], dtype=tl.float32)
    dropout_seed, dropout_offset, dropout_threshold, dropout_scale = _dropout_state(Rng, dropout_p, DROPOUT)
    masked_tiles, masked_lo, masked_hi, gap_at, gap, full_tiles, full_lo, full_hi = SPEC_RANGE(
        start_m=start_m, off_b=off_b, off_h=off_h, off_hkv=off_hkv, B=B, H=H, HKV=HKV, Q_LEN=Q_LEN, KV_LEN=KV_LEN,
        q_off=q_off, inputs=inputs, table=table, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, FOLLOW_TABLE=FOLLOW_TABLE)
    q_first = start_m * BLOCK_M + q_off
    # The tiles with mask code, then those without.
    acc, l_i, m_i = SPEC_INNER(
        acc=acc, l_i=l_i, m_i=m_i, q=q, K_head=K_head, V_head=V_head, stride_kz=stride_kz, stride_kn=stride_kn,
        stride_kk=stride_kk, stride_vz=stride_vz, stride_vn=stride_vn, stride_vk=stride_vk, tiles=masked_tiles,
        j_lo=masked_lo, j_hi=masked_hi, gap_at=gap_at, gap=gap, visits=visits, offs_m=offs_m, pos_m=pos_m,
        q_off=q_off, q_first=q_first, offs_d=offs_d, offs_dv=offs_dv, sm_scale=sm_scale, qk_scale=qk_scale,
        off_b=off_b, off_h=off_h, off_hkv=off_hkv, B=B, H=H, HKV=HKV, Q_LEN=Q_LEN, KV_LEN=KV_LEN, inputs=inputs,
        pages=pages, NUM_PAGES=NUM_PAGES, dropout_seed=dropout_seed, dropout_offset=dropout_offset,
        dropout_threshold=dropout_threshold, dropout_scale=dropout_scale, HEAD_DIM=HEAD_DIM, HEAD_DIM_V=HEAD_DIM_V,
        HEAD_DIM_PAD=HEAD_DIM_PAD, HEAD_DIM_V_PAD=HEAD_DIM_V_PAD, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, MASKED=True,
        COUNT_VISITS=COUNT_VISITS, DOT_PRECISION=DOT_PRECISION, FOLLOW_TABLE=FOLLOW_TABLE, PAGED=PAGED,
        PAGE_SIZE=PAGE_SIZE, DROPOUT=DROPOUT)
    acc, l_i, m_i = SPEC_INNER(
        acc=acc, l_i=l_i, m_i=m_i, q=q, K_head=K_head, V_head=V_head, stride_kz=stride_kz, stride_kn=stride_kn,
        stride_kk=stride_kk, stride_vz=stride_vz, stride_vn=stride_vn, stride_vk=stride_vk, tiles=full_tiles,
        j_lo=full_lo, j_hi=full_hi, gap_at=0, gap=0, visits=visits, offs_m=offs_m, pos_m=pos_m, q_off=q_off,
        q_first=q_first, offs_d=offs_d, offs_dv=offs_dv, sm_scale=sm_scale, qk_scale=qk_scale, off_b=off_b,
        off_h=off_h, off_hkv=off_hkv, B=B, H=H, HKV=HKV, Q_LEN=Q_LEN, KV_LEN=KV_LEN, inputs=inputs, pages=pages,
        NUM_PAGES=NUM_PAGES, dropout_seed=dropout_seed, dropout_offset=dropout_offset,
        dropout_threshold=dropout_threshold, dropout_scale=dropout_scale, HEAD_DIM=HEAD_DIM, HEAD_DIM_V=HEAD_DIM_V,
        HEAD_DIM_PAD=HEAD_DIM_PAD, HEAD_DIM_V_PAD=HEAD_DIM_V_PAD, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, MASKED=False,
        COUNT_VISITS=COUNT_VISITS, DOT_PRECISION=DOT_PRECISION, FOLLOW_TABLE=FOLLOW_TABLE, PAGED=PAGED,
        PAGE_SIZE=PAGE_SIZE, DROPOUT=DROPOUT)

    if SIGMOID:
        # Sigmoid attention has no row sum to divide by and no LSE: O is the weighted sum itself (0 on a row with
        # no allowed key), of the kept weights with dropout.
        if DROPOUT:
            acc = acc * dropout_scale
    else:
        # A row with no allowed key: O = 0 and LSE = -inf (never 0/0).
        has_keys = l_i > 0.0
        l_safe = tl.where(has_keys, l_i, 1.0)
        acc = acc / l_safe[:, None]
        if DROPOUT:
            acc = acc * dropout_scale
        lse = tl.where(has_keys, (m_i + tl.log2(l_safe)) * LN2, float("-inf"))
        if SINK:
            acc = tl.where((sink < float("inf"))[:, None], acc,
                           tl.where((sink == float("inf"))[:, None], 0.0, float("nan")))
            lse = tl.where(sink < float("inf"), lse, sink)
    if FP8:
        acc = acc * o_descale
        if not SIGMOID:
            lse = tl.where(o_descale == o_descale, lse, float("nan"))  # NaN O: NaN LSE (_fp8_descales)
    O_head = Out + off_b.to(tl.int64) * stride_oz + off_h.to(tl.int64) * stride_oh
    tl.store(O_head + offs_m[:, None] * stride_om + offs_dv[None, :] * stride_ok,
             acc.to(Out.dtype.element_ty), mask=(offs_m[:, None] < Q_LEN) & (offs_dv[None, :] < HEAD_DIM_V))
    if not SIGMOID:
        tl.store(Lse + lse_row + offs_m, lse, mask=offs_m < Q_LEN)
