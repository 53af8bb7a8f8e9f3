"""The Hopper family's device side that no spec changes: the warp-specialized pipelines of its Gluon
forward and backward (TMA producers, wgmma consumers, their shared buffers and barriers) and the helpers
they call. A module's kernels (families/hopper/kernels.py.jinja) hold only what the spec decides (its tile
ranges, its score and mask on an S tile, its backward's steps) and hand those to these pipelines as
constexpr functions (SPEC_RANGE, SPEC_STEP, SPEC_STEPS); the spec's inputs and tile table travel through
them as tuples (`inputs`, `table`, `grads`), which only the spec's functions unpack. Triton keys a compiled
kernel by the source of every function it calls, these constexpr ones included.

The Gluon API is triton 3.6's (families/hopper/family.py checks the version; tools/hopper/NOTES.md pins it).
"""

import triton
import triton.language as tl
from triton._C.libtriton import ir as _triton_ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin as _gluon_builtin
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

from ...runtime.helpers import LN2, LOG2E, _dropout_state, _fp8_descales, _tile_start

# Registers of the producer warp (setmaxnreg: the consumers take what it leaves).
HOPPER_PRODUCER_REGS = gl.constexpr(24)
# Triton 3.6 lowers mbarrier.arrive in a multi-warp partition to `bar.sync` over the partition's threads
# followed by one arrival from the partition's first thread (PTX: `@(tid & (threads-1)) == 0
# mbarrier.arrive`), so a partition counts once however many warpgroups it has. Newer Triton arrives
# once per warpgroup (tid & 127): re-check this when upgrading.
HOPPER_PARTITION_ARRIVALS = gl.constexpr(1)
# Consumer worker budget in the pingpong variant (FA3 gives its two consumer warpgroups 240 each), and with
# three consumers (FA3's D=64 forward: 160 each, what 64K registers leave beside the producer's warpgroup).
HOPPER_CONSUMER_REGS = gl.constexpr(240)
HOPPER_CONSUMER_REGS_3 = gl.constexpr(160)
# The bytes of K and V that the forward's work items in flight may read again and again: a group of heads'
# (_hopper_head_group), of L2's 50 MB on the H100 and H200. Measured on an H100 (B4 H16 N4096 D64, forward):
# at 8 MB causal 3% and a chunk mask 10% faster than head by head, full 1.5%; at 32 MB the chunk mask 23%
# but full 1.5% slower (BENCHMARKS.md, "The forward's work items in groups of heads").
HOPPER_L2_GROUP_BYTES = gl.constexpr(8 * 1024 * 1024)


# --- helpers (the pipelines call them, and so do a module's functions: its emit side's DEVICE_HELPERS) ----
@gluon.jit
def _hopper_round_pairs(x, dtype: gl.constexpr):
    # fp32 to dtype, two neighbours (the pair one wgmma A-operand register holds) in one packed cvt. With
    # Triton's per-element rounding, P crosses the loop's back edge as 16-bit values and ptxas packs each
    # pair in the wrong half order, then swaps the halves with a PRMT: at D=64, 504 PRMTs a 128x128 tile,
    # 12% of the consumers' instructions (ncu). cvt.rn.*x2 puts its first source in the upper
    # half, so the pair's second element goes first.
    if dtype == gl.float8e4nv:
        # An FP8 call's P: Triton's own conversion is cvt.rn.satfinite.e4m3x2.f32, two at a time (P <= 1).
        return x.to(dtype)
    elif dtype == gl.bfloat16:
        return gl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,f,f", [x], dtype=gl.bfloat16,
                                         is_pure=True, pack=2)
    else:
        return gl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,f,f", [x], dtype=gl.float16,
                                         is_pure=True, pack=2)


# Four fp32 values ($1..$4) rounded to e4m3 into one 32-bit register ($0), the first in its lowest byte: two
# cvt.rn.satfinite.e4m3x2, each putting its first source in the upper byte, and a move. An FP8 call's P
# enters its PV wgmma four values a register so (_hopper_pv_a, _hopper_pack_p).
HOPPER_E4M3X4 = gl.constexpr("{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; "
                             "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; mov.b32 $0, {lo, hi}; }")


# The widest padded DV at which an FP8 call's P crosses the forward's loop as packed e4m3 words rather than
# fp32 (_hopper_pack_p). Measured on an H100 (benchmarks/fp8_bench.py, the kernel alone, 2026-12-07): packed,
# D=64 565 TFLOP/s against 499; D=128 711 against 830, D=256 669 against 953.
HOPPER_FP8_PACKED_P_WIDTH = gl.constexpr(64)


@gluon.constexpr_function
def _hopper_packs_p(fp8, dv_pad):
    # Whether the forward carries P as packed e4m3 words (_hopper_pack_p): FP8 calls up to the width above.
    return fp8 and dv_pad <= HOPPER_FP8_PACKED_P_WIDTH


@gluon.jit
def _hopper_p_operand(p_f32, dtype: gl.constexpr, p_layout: gl.constexpr, BLOCK_M: gl.constexpr,
                      BLOCK_N: gl.constexpr, PACK_P: gl.constexpr):
    # P (fp32, the QK^T accumulator's layout) as PV's A operand in registers (p_layout). An 8-bit operand
    # register holds four adjacent keys of a row where the accumulator gives each thread pairs (keys 2c, 2c+1
    # of every 8); FlashAttention-3's answer is to take each thread's own values as the operand, keys 2c, 2c+1,
    # 8+2c, 9+2c as operand positions 4c..4c+3 (and 16 more on in each 32-key chunk), with V's keys stored in
    # that order (_hopper_keys_inner): the product sums over keys, so their order is free. The reshape below
    # is that order; the conversion it leaves is a renaming of registers. P stays fp32 until its wgmma
    # (_hopper_pv_a), or with PACK_P leaves as int32 words of four e4m3 values (_hopper_pack_p).
    if dtype == gl.float8e4nv:
        p = p_f32.reshape([BLOCK_M, BLOCK_N // 32, 2, 2, 4, 2]).permute((0, 1, 2, 4, 3, 5)).reshape([BLOCK_M, BLOCK_N])
        p = gl.convert_layout(p, p_layout, assert_trivial=True)
        if PACK_P:
            return _hopper_pack_p(p, BLOCK_M, BLOCK_N)
        else:
            return p
    else:
        return gl.convert_layout(_hopper_round_pairs(p_f32, dtype), p_layout)


@gluon.jit
def _hopper_pack_p(p, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    # An FP8 call's P (fp32, p_layout) as int32 words, keys 4g..4g+3 of a row in word g's bytes 0..3
    # (HOPPER_E4M3X4). P crosses the loop's back edge
    # (each step's P meets the next step's V) as these words: Triton would carry e4m3 values a byte a
    # register, unpacking and repacking them (2 PRMT and 1 LOP3 an element in SASS); ptxas folds the words'
    # opening in _hopper_pv_a away. Fewer registers than fp32 P, and faster at D=64 only
    # (HOPPER_FP8_PACKED_P_WIDTH).
    p4 = p.reshape([BLOCK_M, BLOCK_N // 4, 2, 2])
    k01, k23 = gl.split(p4.permute((0, 1, 3, 2)))  # by the pair: keys 4g, 4g+1 and 4g+2, 4g+3
    k0, k1 = gl.split(k01)
    k2, k3 = gl.split(k23)
    return gl.inline_asm_elementwise(HOPPER_E4M3X4, "=r,f,f,f,f", [k0, k1, k2, k3], dtype=gl.int32, is_pure=True,
                                     pack=1)


@gluon.jit
def _hopper_pv_a(p, FP8: gl.constexpr, PACK_P: gl.constexpr, p_layout: gl.constexpr, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr):
    # PV's A operand: P as _hopper_p_operand left it. An FP8 call's fp32 P is rounded to e4m3 here, four values
    # (one operand register) at a time (HOPPER_E4M3X4); its packed words (PACK_P) are opened into their
    # four e4m3 values (byte k of word g is key 4g+k), which the wgmma takes back four to a register.
    if FP8 and not PACK_P:
        return gl.inline_asm_elementwise(HOPPER_E4M3X4, "=r,f,f,f,f", [p], dtype=gl.float8e4nv, is_pure=True, pack=4)
    elif FP8:
        b0 = (p & 0xFF).to(gl.int8).to(gl.float8e4nv, bitcast=True)
        b1 = ((p >> 8) & 0xFF).to(gl.int8).to(gl.float8e4nv, bitcast=True)
        b2 = ((p >> 16) & 0xFF).to(gl.int8).to(gl.float8e4nv, bitcast=True)
        b3 = ((p >> 24) & 0xFF).to(gl.int8).to(gl.float8e4nv, bitcast=True)
        # join stacks on a new last dim: element (g, c, d) is key 4g + 2c + d, as the reshape reads it.
        keys = gl.join(gl.join(b0, b2), gl.join(b1, b3))
        return gl.convert_layout(keys.reshape([BLOCK_M, BLOCK_N]), p_layout, assert_trivial=True)
    else:
        return p


@gluon.constexpr_function
def _hopper_tile_layout(width, dtype):
    # The shared layout of tiles whose rows hold `width` elements of dtype: the widest swizzle a row's bytes
    # take, as the host's TMA descriptors have it (NVMMASharedLayout.get_default_for, runtime._hopper_layout),
    # and as wgmma reads it: 128 bytes for 16-bit rows of 64 or more, 64 for 64 FP8 elements.
    return gl.NVMMASharedLayout.get_default_for([8, width], dtype)


@gluon.constexpr_function
def _hopper_k_width(dtype):
    # Elements of a wgmma A operand in registers that one 32-bit register holds, and the K of one wgmma
    # instruction (32 bytes): 2 and 16 for 16-bit operands, 4 and 32 for FP8.
    return 32 // dtype.primitive_bitwidth


@gluon.jit
def _hopper_sigmoid2(s2):
    # sigmoid(score') of a base-2 score s2 = score' * log2(e): 1 / (1 + 2^-s2) in two MUFU ops, ex2 and rcp
    # (relative error of a few ulps; Triton's division would add a range check and a rescale to each element,
    # which the argument 1 + 2^-s2 >= 1 never needs). 2^-s2 = inf (s2 = -inf on a masked key, or a very
    # negative score) gives rcp(inf) = 0. The tanh form, one MUFU op, cancels catastrophically for the small
    # weights sigmoid attention's -log(n) bias makes common.
    return gl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [1.0 + gl.exp2(-s2)], dtype=gl.float32,
                                     is_pure=True, pack=1)


@triton.jit
def _hopper_tile_start(i, n_masked, masked_tiles, masked_lo, masked_hi, gap_at, gap, full_tiles, full_lo, full_hi,
                       BLOCK: tl.constexpr, FOLLOW_TABLE: tl.constexpr):
    # Step i's tile (key tiles in the forward, query tiles in the backward), as its first row: the
    # masked tiles come first, then the unmasked ones (TILE_RANGE). Producer and consumers both walk this
    # one sequence, so a stage of the ring always holds the tile a step expects.
    if i < n_masked:
        start = _tile_start(masked_tiles, masked_lo + i, masked_hi, gap_at, gap, BLOCK, FOLLOW_TABLE)
    else:
        start = _tile_start(full_tiles, full_lo + (i - n_masked), full_hi, 0, 0, BLOCK, FOLLOW_TABLE)
    return start


@gluon.jit
def _hopper_box(buffer, desc):
    # A tile buffer seen as the box of a TMA descriptor, (1, 1, rows, width) or (1, rows): the same bytes,
    # since leading dims of 1 change nothing in the swizzled layout; the wgmmas read the 2-D view.
    return buffer._reinterpret(buffer.dtype, desc.block_type.shape, desc.layout)


@gluon.jit
def _hopper_take_turn(sched, t, WG: gl.constexpr, NUM_CONSUMERS: gl.constexpr):
    # FA3 pingpong: the consumer warpgroups take turns issuing their MMAs, in order round the CTA, so one
    # warpgroup's GEMMs own the tensor cores while the others run their softmax. t counts this warpgroup's
    # issue points; sched[WG] completes a phase when the warpgroup before it has issued, and warpgroup 0 goes
    # first (a fresh mbarrier passes a wait on parity 1).
    if NUM_CONSUMERS > 1:
        mbarrier.wait(sched.index(WG), (t & 1) ^ (1 if WG == 0 else 0))


@gluon.jit
def _hopper_pass_turn(sched, WG: gl.constexpr, NUM_CONSUMERS: gl.constexpr):
    if NUM_CONSUMERS > 1:
        mbarrier.arrive(sched.index((WG + 1) % NUM_CONSUMERS), count=1)


@gluon.jit
def _hopper_store_rows(Out, tile, head, stride_row, first_row, length, WIDTH: gl.constexpr, ROWS: gl.constexpr,
                       WIDTH_PAD: gl.constexpr, layout: gl.constexpr):
    # A tile's rows straight from its wgmma accumulator layout into one head's rows (offset `head`, rows
    # stride_row apart, columns unit-stride): the rows below `length` and the columns below WIDTH. For O
    # where it is wider or narrower than Q's buffer (which stages the TMA store otherwise), and for dK and dV.
    rows = first_row + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, WIDTH_PAD, layout=gl.SliceLayout(0, layout))
    ptrs = Out + head + gl.expand_dims(rows.to(gl.int64) * stride_row, 1) + gl.expand_dims(cols, 0)
    gl.store(ptrs, tile, mask=gl.expand_dims(rows < length, 1) & gl.expand_dims(cols < WIDTH, 0))


@_gluon_builtin
def _hopper_reduce_add(tensor_desc, coord, src, _semantic=None):
    # cp.reduce.async.bulk.tensor .add (FA3's dQ accumulation). Gluon 3.6's builder has it, but no public
    # function calls it (hopper.tma has loads, stores and store_wait); this is that missing wrapper,
    # written like tma.async_copy_shared_to_global. Private API: the family pins triton 3.6.
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(_triton_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                              src.handle)


@gluon.jit
def _hopper_step_lse(lse_bufs, stage, offs_m, Q_LEN, col_layout: gl.constexpr, VARLEN: gl.constexpr):
    # A backward step's rows' LSE (base 2), from shared memory: a column vector is BLOCK_M / 4 values a thread
    # in the steps' layout, whose addresses by pointer spilled registers. Rows past Q_LEN and rows no key was
    # allowed hold +inf, so P = 0 there; a packed call's rows past its sequence's end are the next sequence's,
    # their LSE finite: +inf here too.
    lse = lse_bufs.index(stage).load(col_layout)
    if VARLEN:
        lse = gl.where(offs_m < Q_LEN, lse, float("inf"))
    return lse


@triton.jit
def _hopper_dq_finish(DqSum, Dq, scale, n_groups, BLOCK: tl.constexpr):
    # dQ = scale * the fp32 sum the backward's reduce-adds left, rounded to dQ's dtype. Both are laid out
    # alike (q's layout, densely), so the pass walks their memory; it holds groups of 8 elements (head
    # dims are multiples of 8, and the last dim is innermost), so the mask is per group and the pass reads
    # 32 and writes 16 bytes a group (torch.mul with a dtype change does not vectorize).
    groups = tl.program_id(0).to(tl.int64) * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
    offs = groups[:, None] * 8 + tl.arange(0, 8)[None, :]
    dq = tl.load(DqSum + offs, mask=(groups < n_groups)[:, None]) * scale
    tl.store(Dq + offs, dq.to(Dq.dtype.element_ty), mask=(groups < n_groups)[:, None])


@gluon.jit
def _hopper_bwd_sequence(off_b, Q_LEN, KV_LEN, CuSeqlensQ, CuSeqlensK, VARLEN: gl.constexpr):
    # Where a backward program's sequence lies in the descriptors (SEQUENCE) and its lengths: batch off_b
    # from row 0 with the call's lengths, or in a packed call (VARLEN) sequence b = off_b of the (1, heads,
    # TOTAL, D) views from its first rows, with its own lengths (the grid is sized by the longest).
    # row_start: where its rows begin in the rows' LSE and delta. TMA reads those fp32 rows from a 16-byte
    # aligned column only (an unaligned one is an illegal instruction), so a packed call's sequence b
    # starts at 4 * (q_start // 4 + b) there, never before the previous one's end (_hopper_sequence_rows).
    tma_b = off_b
    q_start = off_b * 0
    k_start = off_b * 0
    row_start = off_b * 0
    q_len = Q_LEN + off_b * 0
    kv_len = KV_LEN + off_b * 0
    if VARLEN:
        tma_b = off_b * 0
        q_start = gl.load(CuSeqlensQ + off_b)
        k_start = gl.load(CuSeqlensK + off_b)
        row_start = (q_start // 4 + off_b) * 4
        q_len = gl.load(CuSeqlensQ + off_b + 1) - q_start
        kv_len = gl.load(CuSeqlensK + off_b + 1) - k_start
    return tma_b, q_start, k_start, row_start, q_len, kv_len


# --- forward (Gluon: TMA, mbarriers, asynchronous wgmma, warp specialization) ------------------------------
# A producer warp streams K/V tiles by TMA into a ring of shared-memory stages guarded by mbarriers; two
# consumer warpgroups of 64 query rows take turns at the tensor cores (FA3's pingpong), each overlapping the
# softmax of key tile j with the P.V product of tile j-1, P kept in registers. The spec's score and mask run
# on each S accumulator tile in the wgmma layout (SPEC_STEP: the portable forward's elementwise code, in the
# Gluon spellings of hooks.HOPPER_SCORE / HOPPER_MASK), over the spec's tile ranges and tables (SPEC_RANGE).


@gluon.jit
def _hopper_head_group(n_heads, rows, ROW_BYTES: gl.constexpr):
    # The heads a group of work items spans: as many as whose `rows` rows of ROW_BYTES each (what each
    # head's items read again and again) fit in HOPPER_L2_GROUP_BYTES, at least 1, at most n_heads.
    fit = (HOPPER_L2_GROUP_BYTES // ROW_BYTES) // gl.maximum(rows, 1)
    return gl.minimum(gl.maximum(fit, 1), n_heads)


@gluon.jit
def _hopper_grouped_item(item, n_tiles, n_heads, n_group):
    # (tile rank, head) of item `item` of n_heads * n_tiles, the items numbered group by group of n_group
    # heads (the last group holds the heads left over), within a group rank by rank, the group's heads side
    # by side. Taken from a counter in this order, the items of one rank (the longest where rank 0 is) run
    # together: no group ends on one head's longest item alone. n_group = 1 runs head by head.
    per_group = n_group * n_tiles
    group = item // per_group
    in_group = gl.minimum(n_group, n_heads - group * n_group)
    rank = item - group * per_group
    return rank // in_group, group * n_group + rank % in_group


@gluon.jit
def _hopper_fwd_work(work, n_m, n_group, inputs, table, B, H, HKV, Q_LEN, KV_LEN, CuSeqlensQ, CuSeqlensK,
                     SPEC_RANGE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                     FOLLOW_TABLE: gl.constexpr, VARLEN: gl.constexpr):
    # Work item `work` of a persistent CTA: a query tile of BLOCK_M rows of one (batch, head), and the
    # key tiles it visits (TILE_RANGE). Items run in groups of n_group heads (_hopper_head_group: their K/V
    # fit in L2), query tile by query tile, last first, the group's heads side by side: under causal-like
    # masks the last query tiles visit the most keys, so the longest items start first in every group and
    # the shortest end the kernel (_hopper_grouped_item). Producer and consumers both call this, so they
    # walk the same tiles.
    rank, off_bh = _hopper_grouped_item(work, n_m, B * H, n_group)
    start_m = n_m - 1 - rank
    off_b = off_bh // H
    off_h = off_bh % H
    off_hkv = off_h // (H // HKV)  # grouped-query attention: K/V are shared, never repeated
    # Where the item's sequence lies in the descriptors (SEQUENCE): batch off_b from row 0, or in a packed
    # call (VARLEN) sequence b = off_b of the (1, heads, TOTAL, D) views, from its first rows; Q_LEN and
    # KV_LEN arrive as the longest sequence's (the item numbering's) and become this sequence's, so the
    # tile range below is the sequence's and no tile of another sequence is visited.
    tma_b = off_b
    q_start = off_b * 0
    k_start = off_b * 0
    if VARLEN:
        tma_b = off_b * 0
        q_start = gl.load(CuSeqlensQ + off_b)
        k_start = gl.load(CuSeqlensK + off_b)
        Q_LEN = gl.load(CuSeqlensQ + off_b + 1) - q_start
        KV_LEN = gl.load(CuSeqlensK + off_b + 1) - k_start
    masked_tiles, masked_lo, masked_hi, gap_at, gap, full_tiles, full_lo, full_hi = SPEC_RANGE(
        start_m=start_m, off_b=off_b, off_h=off_h, off_hkv=off_hkv, B=B, H=H, HKV=HKV, Q_LEN=Q_LEN, KV_LEN=KV_LEN,
        inputs=inputs, table=table, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, FOLLOW_TABLE=FOLLOW_TABLE)
    n_tiles = (masked_hi - masked_lo) + (full_hi - full_lo)
    # An item past its sequence's end (packed calls number every sequence's items by the longest) has no
    # rows: no tile to visit, nothing to store.
    n_tiles = gl.where(start_m * BLOCK_M < Q_LEN, n_tiles, 0)
    return (start_m * BLOCK_M, off_bh, off_b, off_h, off_hkv, n_tiles, masked_tiles, masked_lo,
            masked_hi, gap_at, gap, full_tiles, full_lo, full_hi, tma_b, q_start, k_start, Q_LEN + off_b * 0,
            KV_LEN + off_b * 0)


@gluon.jit
def _hopper_producer(q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, k_empty, v_ready,
                     v_empty, work_ids, work_counter, n_work, n_m, n_group, inputs, table, B, H, HKV, Q_LEN, KV_LEN,
                     CuSeqlensQ, CuSeqlensK, SPEC_RANGE: gl.constexpr, BLOCK_M: gl.constexpr,
                     BLOCK_N: gl.constexpr, STAGES: gl.constexpr, Q_BUFFERS: gl.constexpr,
                     NUM_CONSUMERS: gl.constexpr, FOLLOW_TABLE: gl.constexpr, VARLEN: gl.constexpr,
                     FP8: gl.constexpr):
    # One warp, scalars only: everything it does is issue TMA and wait on "empty" barriers, running ahead
    # of the consumers across work items (the next item's Q and first K/V tiles load while the consumers
    # finish this one). Boxes are (1, 1 head, rows, width) of (B, heads, length, D) tensors in their own
    # strides: TMA fills the rows past a head's length with zeros (a tile never reads the next head's rows,
    # whose values could be anything, inf included). An FP8 call's V is V^T, (B, HKV, DV, keys): its boxes
    # are (1, 1 head, DV, keys), zero-filled past the last key.
    ROWS: gl.constexpr = q_desc.block_type.shape[2]
    id_layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    ring = 0  # K/V stages handed out so far: the ring's position carries over from item to item
    done = 0  # work items loaded so far
    # Items are handed out by a counter in global memory (zero at launch): a CTA takes the next one when
    # it is ready for it, so CTAs whose items are short take more of them.
    work = gl.atomic_add(work_counter, 1)
    while work < n_work:
        tile_m, off_bh, off_b, off_h, off_hkv, n_tiles, masked_tiles, masked_lo, masked_hi, gap_at, gap, \
            full_tiles, full_lo, full_hi, tma_b, q_start, k_start, seq_q_len, seq_kv_len = \
            _hopper_fwd_work(work, n_m, n_group, inputs, table, B, H, HKV, Q_LEN, KV_LEN, CuSeqlensQ, CuSeqlensK, SPEC_RANGE,
                             BLOCK_M, BLOCK_N, FOLLOW_TABLE, VARLEN)
        n_masked = masked_hi - masked_lo
        slot = done % Q_BUFFERS
        # Fresh mbarriers count as having completed phase 1, so the first lap passes straight through.
        mbarrier.wait(q_empty.index(slot), ((done // Q_BUFFERS) & 1) ^ 1)
        # The consumers read the item's number once its Q has landed (the arrival below releases it).
        work_ids.index(slot).store(gl.full([1], work, gl.int32, id_layout))
        if tile_m < seq_q_len:
            mbarrier.expect(q_ready.index(slot), NUM_CONSUMERS * q_desc.block_type.nbytes)
            for c in gl.static_range(NUM_CONSUMERS):
                tma.async_copy_global_to_shared(q_desc, [tma_b, off_h, q_start + tile_m + c * ROWS, 0],
                                                q_ready.index(slot),
                                                _hopper_box(q_bufs.index(slot * NUM_CONSUMERS + c), q_desc))
        else:  # an item past its sequence's end (packed calls): no Q to load, only its number to pass on
            mbarrier.arrive(q_ready.index(slot), count=1)
        for i in range(n_tiles):
            stage = (ring + i) % STAGES
            phase = (((ring + i) // STAGES) & 1) ^ 1
            start_n = _hopper_tile_start(i, n_masked, masked_tiles, masked_lo, masked_hi, gap_at, gap, full_tiles,
                                         full_lo, full_hi, BLOCK_N, FOLLOW_TABLE)
            mbarrier.wait(k_empty.index(stage), phase)
            mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [tma_b, off_hkv, k_start + start_n, 0], k_ready.index(stage),
                                            _hopper_box(k_bufs.index(stage), k_desc))
            mbarrier.wait(v_empty.index(stage), phase)
            mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
            if FP8:
                tma.async_copy_global_to_shared(v_desc, [tma_b, off_hkv, 0, k_start + start_n], v_ready.index(stage),
                                                _hopper_box(v_bufs.index(stage), v_desc))
            else:
                tma.async_copy_global_to_shared(v_desc, [tma_b, off_hkv, k_start + start_n, 0], v_ready.index(stage),
                                                _hopper_box(v_bufs.index(stage), v_desc))
        ring += n_tiles
        done += 1
        work = gl.atomic_add(work_counter, 1)
    # No item left: the consumers' next slot says so (n_work), with an arrival and no copy.
    slot = done % Q_BUFFERS
    mbarrier.wait(q_empty.index(slot), ((done // Q_BUFFERS) & 1) ^ 1)
    work_ids.index(slot).store(gl.full([1], n_work, gl.int32, id_layout))
    mbarrier.arrive(q_ready.index(slot), count=1)
    # The last CTA to take its last number sets the counter back to zero (no CTA takes one after it), so
    # a later launch with the same counter starts from item 0.
    if gl.atomic_add(work_counter + 1, 1) == gl.num_programs(0) - 1:
        gl.atomic_xchg(work_counter, 0)
        gl.atomic_xchg(work_counter + 1, 0)


@gluon.jit
def _hopper_pv_operand(v_tile, FP8: gl.constexpr):
    # The B operand of P V, (keys, DV): V's tile itself, or in an FP8 call V^T's (DV, keys) tile seen
    # transposed, since wgmma reads 8-bit B operands with K (the keys) contiguous only.
    if FP8:
        return v_tile.permute((1, 0))
    else:
        return v_tile


@gluon.jit
def _hopper_consumer_loop(o, p, m_i, l_i, i_lo, i_hi, ring, turn, q_smem, k_bufs, v_bufs, k_ready, k_empty, v_ready,
                          v_empty, sched, off_m, offs_m, pos_m, s_zero, masked_tiles, masked_lo, masked_hi, gap_at,
                          gap, full_tiles, full_lo, full_hi, sm_scale, qk_scale, off_b, off_h, off_hkv, B, H, HKV,
                          Q_LEN, KV_LEN, inputs, dropout_seed, dropout_offset, dropout_threshold, dropout_scale,
                          SPEC_STEP: gl.constexpr, HEAD_DIM: gl.constexpr, HEAD_DIM_V: gl.constexpr,
                          HEAD_DIM_PAD: gl.constexpr, HEAD_DIM_V_PAD: gl.constexpr, BLOCK_M: gl.constexpr,
                          BLOCK_N: gl.constexpr, STAGES: gl.constexpr, MASKED: gl.constexpr,
                          FOLLOW_TABLE: gl.constexpr, DEFER_SCALE: gl.constexpr, dtype: gl.constexpr,
                          s_layout: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr,
                          WG: gl.constexpr, NUM_CONSUMERS: gl.constexpr, SIGMOID: gl.constexpr,
                          DROPOUT: gl.constexpr, FP8: gl.constexpr, ONE_LOOP: gl.constexpr):
    PACK_P: gl.constexpr = _hopper_packs_p(FP8, HEAD_DIM_V_PAD)
    # Invariant on entry to step i: p holds step i-1's probabilities, o all PV products before i-1,
    # already rescaled to m_i. `ring` is the K/V ring's position at this item's step 0, `turn` the
    # pingpong's issue count then (both carry over from the CTA's earlier work items). ONE_LOOP: the
    # loop runs the masked and the unmasked steps, the mask code under a branch the whole warpgroup takes
    # alike (mask_step); otherwise MASKED says which kind all its steps are.
    n_masked = masked_hi - masked_lo
    for i in range(i_lo, i_hi):
        if ONE_LOOP:
            mask_step = i < n_masked
        else:
            mask_step = True
        stage = (ring + i) % STAGES
        phase = ((ring + i) // STAGES) & 1
        prev = (ring + i - 1) % STAGES
        prev_phase = ((ring + i - 1) // STAGES) & 1
        k_smem = k_bufs.index(stage)
        v_prev = v_bufs.index(prev)
        start_n = _hopper_tile_start(i, n_masked, masked_tiles, masked_lo, masked_hi, gap_at, gap, full_tiles,
                                     full_lo, full_hi, BLOCK_N, FOLLOW_TABLE)

        mbarrier.wait(k_ready.index(stage), phase)
        mbarrier.wait(v_ready.index(prev), prev_phase)
        _hopper_take_turn(sched, turn + i, WG, NUM_CONSUMERS)
        s_tok = warpgroup_mma(q_smem, k_smem.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        pv_a = _hopper_pv_a(p, FP8, PACK_P, p_layout, BLOCK_M, BLOCK_N)
        o_tok = warpgroup_mma(pv_a, _hopper_pv_operand(v_prev, FP8), o, is_async=True)
        _hopper_pass_turn(sched, WG, NUM_CONSUMERS)
        # wgmma groups retire in order: at most one outstanding means QK^T is done, PV may still run.
        qk, _, _ = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, q_smem, k_smem))
        mbarrier.arrive(k_empty.index(stage), count=1)

        p_f32, alpha, m_i, l_i = SPEC_STEP(
            qk=qk, m_i=m_i, l_i=l_i, start_n=start_n, off_m=off_m, offs_m=offs_m, pos_m=pos_m, sm_scale=sm_scale,
            qk_scale=qk_scale, off_b=off_b, off_h=off_h, off_hkv=off_hkv, B=B, H=H, HKV=HKV, Q_LEN=Q_LEN,
            KV_LEN=KV_LEN, inputs=inputs, dropout_seed=dropout_seed, dropout_offset=dropout_offset,
            dropout_threshold=dropout_threshold, dropout_scale=dropout_scale, HEAD_DIM=HEAD_DIM,
            HEAD_DIM_V=HEAD_DIM_V, HEAD_DIM_PAD=HEAD_DIM_PAD, HEAD_DIM_V_PAD=HEAD_DIM_V_PAD, BLOCK_M=BLOCK_M,
            BLOCK_N=BLOCK_N, MASKED=MASKED, DEFER_SCALE=DEFER_SCALE, s_layout=s_layout, DROPOUT=DROPOUT,
            mask_step=mask_step)
        p_next = _hopper_p_operand(p_f32, dtype, p_layout, BLOCK_M, BLOCK_N, PACK_P)

        o, _ = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, v_prev))
        mbarrier.arrive(v_empty.index(prev), count=1)
        if not SIGMOID:
            alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))
            o = o * gl.expand_dims(alpha_o, 1)
        p = p_next
    return o, p, m_i, l_i


@gluon.jit
def _hopper_consumer(q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, sched, o_desc, Out,
                     stride_oz, stride_oh, stride_om, Lse, sink_args, work_ids, n_work, n_m, n_group, sm_scale, qk_scale, Rng,
                     dropout_p, QDescale, KDescale, VDescale, stride_db, stride_dh, inputs, table, B, H, HKV, Q_LEN, KV_LEN, CuSeqlensQ, CuSeqlensK, TOTAL_Q,
                     SPEC_RANGE: gl.constexpr, SPEC_STEP: gl.constexpr, HEAD_DIM: gl.constexpr,
                     HEAD_DIM_V: gl.constexpr, HEAD_DIM_PAD: gl.constexpr, HEAD_DIM_V_PAD: gl.constexpr,
                     BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, Q_BUFFERS: gl.constexpr,
                     FOLLOW_TABLE: gl.constexpr, DEFER_SCALE: gl.constexpr, WG: gl.constexpr,
                     NUM_CONSUMERS: gl.constexpr, SIGMOID: gl.constexpr, SINK: gl.constexpr, VARLEN: gl.constexpr,
                     DROPOUT: gl.constexpr, FP8: gl.constexpr, ONE_LOOP: gl.constexpr):
    # BLOCK_M here is this partition's share of the CTA's query tile; WG says which share.
    dtype: gl.constexpr = q_bufs.dtype
    NUM_WARPS: gl.constexpr = BLOCK_M // 16
    K_WIDTH: gl.constexpr = _hopper_k_width(dtype)
    # One 16-row slab per warp, so rows never span warps: row max/sum are intra-warp shuffles and the
    # accumulator-to-A-operand conversion of P stays in registers.
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                       instr_shape=[16, BLOCK_N, 8 * K_WIDTH])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                       instr_shape=[16, HEAD_DIM_V_PAD, 8 * K_WIDTH])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=K_WIDTH)
    PACK_P: gl.constexpr = _hopper_packs_p(FP8, HEAD_DIM_V_PAD)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    if SINK:  # the rows' sinks, fp32 (B, H, Q_LEN) in any strides (signatures.SINK)
        Sink, stride_sb, stride_sh, stride_sm = sink_args

    id_layout: gl.constexpr = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])
    dropout_seed, dropout_offset, dropout_threshold, dropout_scale = _dropout_state(Rng, dropout_p, DROPOUT)
    ring = 0  # K/V stages consumed so far, over this CTA's work items
    turn = 0  # pingpong issue points so far
    done = 0  # work items finished
    # The first item's Q and number.
    mbarrier.wait(q_ready.index(0), 0)
    work = gl.max(work_ids.index(0).load(id_layout), 0)
    while work < n_work:
        tile_m, off_bh, off_b, off_h, off_hkv, n_tiles, masked_tiles, masked_lo, masked_hi, gap_at, gap, \
            full_tiles, full_lo, full_hi, tma_b, q_start, k_start, seq_q_len, seq_kv_len = \
            _hopper_fwd_work(work, n_m, n_group, inputs, table, B, H, HKV, Q_LEN, KV_LEN, CuSeqlensQ, CuSeqlensK, SPEC_RANGE,
                             BLOCK_M * NUM_CONSUMERS, BLOCK_N, FOLLOW_TABLE, VARLEN)
        slot = done % Q_BUFFERS
        q_smem = q_bufs.index(slot * NUM_CONSUMERS + WG)
        off_m = tile_m + WG * BLOCK_M
        offs_m = off_m + gl.arange(0, BLOCK_M, layout=row_layout)
        # Query positions: the family takes no cache calls, so query i sits at position i.
        pos_m = offs_m
        if FP8:
            # float8_e4m3fn q, k and v (an FP8 call, never packed): the products of q and k count q_descale[b,
            # hkv] * k_descale[b, hkv] times over, so this item's scales take that factor (the portable forward's
            # rule); O takes v_descale's in the epilogue.
            qk_descale, o_descale = _fp8_descales(QDescale, KDescale, VDescale,
                                                  off_b.to(gl.int64) * stride_db + off_hkv.to(gl.int64) * stride_dh)
            item_sm_scale = sm_scale * qk_descale
            item_qk_scale = qk_scale * qk_descale
        else:
            item_sm_scale = sm_scale
            item_qk_scale = qk_scale
        if SINK:
            # The sink is the softmax's first term, as in the portable forward: m starts at it (base 2), l at 1;
            # a row whose sink is +inf or NaN runs as one without a sink, its O and LSE set in the epilogue.
            sink_rows = Sink + tma_b.to(gl.int64) * stride_sb + off_h.to(gl.int64) * stride_sh
            sink = gl.load(sink_rows + (q_start + offs_m).to(gl.int64) * stride_sm, mask=offs_m < seq_q_len,
                           other=float("-inf"))
            m_i = gl.where(sink < float("inf"), sink * LOG2E, float("-inf"))
            l_i = gl.full([BLOCK_M], 1.0, gl.float32, row_layout)
        else:
            m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_layout)
            l_i = gl.zeros([BLOCK_M], gl.float32, row_layout)
        o = gl.zeros([BLOCK_M, HEAD_DIM_V_PAD], gl.float32, o_layout)
        n_masked = masked_hi - masked_lo
        if n_tiles > 0:
            # Peeled step 0: there is no PV to overlap yet. Masked whichever tile it is (masks are exact
            # on any tile), so the loops below need not special-case it.
            start_n = _hopper_tile_start(0, n_masked, masked_tiles, masked_lo, masked_hi, gap_at, gap, full_tiles,
                                         full_lo, full_hi, BLOCK_N, FOLLOW_TABLE)
            first = ring % STAGES
            mbarrier.wait(k_ready.index(first), (ring // STAGES) & 1)
            _hopper_take_turn(sched, turn, WG, NUM_CONSUMERS)
            s_tok = warpgroup_mma(q_smem, k_bufs.index(first).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            _hopper_pass_turn(sched, WG, NUM_CONSUMERS)
            qk, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok, q_smem, k_bufs.index(first)))
            mbarrier.arrive(k_empty.index(first), count=1)
            p_f32, alpha, m_i, l_i = SPEC_STEP(
                qk=qk, m_i=m_i, l_i=l_i, start_n=start_n, off_m=off_m, offs_m=offs_m, pos_m=pos_m,
                sm_scale=item_sm_scale, qk_scale=item_qk_scale, off_b=off_b, off_h=off_h, off_hkv=off_hkv, B=B, H=H,
                HKV=HKV, Q_LEN=seq_q_len, KV_LEN=seq_kv_len, inputs=inputs, dropout_seed=dropout_seed,
                dropout_offset=dropout_offset, dropout_threshold=dropout_threshold, dropout_scale=dropout_scale,
                HEAD_DIM=HEAD_DIM, HEAD_DIM_V=HEAD_DIM_V, HEAD_DIM_PAD=HEAD_DIM_PAD, HEAD_DIM_V_PAD=HEAD_DIM_V_PAD,
                BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, MASKED=True, DEFER_SCALE=DEFER_SCALE, s_layout=s_layout,
                DROPOUT=DROPOUT, mask_step=True)
            p = _hopper_p_operand(p_f32, dtype, p_layout, BLOCK_M, BLOCK_N, PACK_P)

            # Steps [1, n_masked) with mask code and [n_masked, n_tiles) without: two loops, each with a copy of
            # the step, or with ONE_LOOP (a spec whose step is long: the emitter's HOPPER_ONE_LOOP) one loop.
            masked_end = n_tiles if ONE_LOOP else n_masked
            o, p, m_i, l_i = _hopper_consumer_loop(
                o, p, m_i, l_i, 1, masked_end, ring, turn, q_smem, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty,
                sched, off_m, offs_m, pos_m, s_zero, masked_tiles, masked_lo, masked_hi, gap_at, gap, full_tiles,
                full_lo, full_hi, item_sm_scale, item_qk_scale, off_b, off_h, off_hkv, B, H, HKV, seq_q_len, seq_kv_len,
                inputs,
                dropout_seed, dropout_offset, dropout_threshold, dropout_scale, SPEC_STEP, HEAD_DIM, HEAD_DIM_V,
                HEAD_DIM_PAD, HEAD_DIM_V_PAD, BLOCK_M, BLOCK_N, STAGES, True, FOLLOW_TABLE, DEFER_SCALE, dtype,
                s_layout, o_layout, p_layout, WG, NUM_CONSUMERS, SIGMOID, DROPOUT, FP8, ONE_LOOP)
            if not ONE_LOOP:
                o, p, m_i, l_i = _hopper_consumer_loop(
                    o, p, m_i, l_i, gl.maximum(n_masked, 1), n_tiles, ring, turn, q_smem, k_bufs, v_bufs, k_ready,
                    k_empty, v_ready, v_empty, sched, off_m, offs_m, pos_m, s_zero, masked_tiles, masked_lo, masked_hi,
                    gap_at, gap, full_tiles, full_lo, full_hi, item_sm_scale, item_qk_scale, off_b, off_h, off_hkv, B,
                    H, HKV, seq_q_len, seq_kv_len, inputs, dropout_seed, dropout_offset, dropout_threshold,
                    dropout_scale, SPEC_STEP, HEAD_DIM, HEAD_DIM_V, HEAD_DIM_PAD, HEAD_DIM_V_PAD, BLOCK_M, BLOCK_N,
                    STAGES, False, FOLLOW_TABLE, DEFER_SCALE, dtype, s_layout, o_layout, p_layout, WG, NUM_CONSUMERS,
                    SIGMOID, DROPOUT, FP8, False)

            # Drain: the last tile's PV.
            last = (ring + n_tiles - 1) % STAGES
            v_last = v_bufs.index(last)
            mbarrier.wait(v_ready.index(last), ((ring + n_tiles - 1) // STAGES) & 1)
            _hopper_take_turn(sched, turn + n_tiles, WG, NUM_CONSUMERS)
            pv_a = _hopper_pv_a(p, FP8, PACK_P, p_layout, BLOCK_M, BLOCK_N)
            o_tok = warpgroup_mma(pv_a, _hopper_pv_operand(v_last, FP8), o, is_async=True)
            _hopper_pass_turn(sched, WG, NUM_CONSUMERS)
            o, _ = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, v_last))
            mbarrier.arrive(v_empty.index(last), count=1)
            ring += n_tiles
            turn += n_tiles + 1

        if SIGMOID:
            # Epilogue. Sigmoid attention has no row sum to divide by and no LSE: O is the weighted sum itself
            # (of the kept weights with dropout, scaled once here).
            if DROPOUT:
                o = o * dropout_scale
            if FP8:
                o = o * o_descale
        else:
            # Epilogue. l == 0 only for rows with no allowed key: O = 0 and LSE = -inf.
            empty_row = l_i == 0.0
            inv_l = gl.where(empty_row, 0.0, 1.0 / l_i)
            if DROPOUT:
                inv_l = inv_l * dropout_scale
            lse = gl.where(empty_row, float("-inf"), (m_i + gl.log2(l_i)) * LN2)
            if SINK:
                # A sink of +inf: O = 0, LSE = +inf; of NaN: both NaN (read again: no register held across the
                # loop).
                sink = gl.load(sink_rows + (q_start + offs_m).to(gl.int64) * stride_sm, mask=offs_m < seq_q_len,
                               other=float("-inf"))
                inv_l = gl.where(sink < float("inf"), inv_l, gl.where(sink == float("inf"), 0.0, float("nan")))
                lse = gl.where(sink < float("inf"), lse, sink)
            if FP8:  # last: a negative factor's NaN (_fp8_descales) wins over a sink's values
                inv_l = inv_l * o_descale
                lse = gl.where(o_descale == o_descale, lse, float("nan"))
            o = o * gl.expand_dims(gl.convert_layout(inv_l, gl.SliceLayout(1, o_layout)), 1)
        if HEAD_DIM_V_PAD == HEAD_DIM_PAD and not VARLEN and not FP8:
            # Reuse Q's shared buffer (every wgmma reading it has retired) and TMA-store O: TMA drops the rows
            # past the head's Q_LEN and the columns past HEAD_DIM_V. The buffer takes a later item's Q once the
            # store has read it. (A packed call's next rows are the next sequence's, and an FP8 call's O, bf16, is
            # wider than its Q: both stored by row below.)
            q_smem.store(o.to(dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(o_desc, [off_b, off_h, off_m, 0], _hopper_box(q_smem, o_desc))
            tma.store_wait(pendings=0)
        else:
            _hopper_store_rows(Out, o.to(Out.dtype.element_ty), tma_b.to(gl.int64) * stride_oz + off_h.to(gl.int64) * stride_oh
                               + q_start.to(gl.int64) * stride_om, stride_om, off_m, seq_q_len, HEAD_DIM_V, BLOCK_M,
                               HEAD_DIM_V_PAD, o_layout)
        # The producer may refill the slot: O has left it, and the item's number was read at its start.
        mbarrier.arrive(q_empty.index(slot), count=1)
        if not SIGMOID:
            if VARLEN:  # LSE (1, H, TOTAL_Q): the sequence's rows of the head's row
                lse_row = off_h.to(gl.int64) * TOTAL_Q + q_start
            else:
                lse_row = off_bh.to(gl.int64) * Q_LEN
            gl.store(Lse + lse_row + offs_m, lse, mask=offs_m < seq_q_len)
        done += 1
        # The next item's Q (the wait covers its number too); Q's buffer is O's staging buffer in the
        # epilogue, so the wait comes even for an item that visits no tile.
        mbarrier.wait(q_ready.index(done % Q_BUFFERS), (done // Q_BUFFERS) & 1)
        work = gl.max(work_ids.index(done % Q_BUFFERS).load(id_layout), 0)


@gluon.jit
def _hopper_fwd_pipeline(q_desc, k_desc, v_desc, o_desc, Out, stride_oz, stride_oh, stride_om, Lse, sink_args,
                         work_counter, sm_scale, qk_scale, Rng, dropout_p, QDescale, KDescale, VDescale, stride_db,
                         stride_dh, inputs, table, B, H, HKV, Q_LEN, KV_LEN, CuSeqlensQ, CuSeqlensK, TOTAL_Q, SPEC_RANGE: gl.constexpr, SPEC_STEP: gl.constexpr,
                         HEAD_DIM: gl.constexpr, HEAD_DIM_V: gl.constexpr, HEAD_DIM_PAD: gl.constexpr,
                         HEAD_DIM_V_PAD: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                         STAGES: gl.constexpr, Q_BUFFERS: gl.constexpr, CONSUMERS: gl.constexpr,
                         FOLLOW_TABLE: gl.constexpr, DEFER_SCALE: gl.constexpr, SIGMOID: gl.constexpr,
                         SINK: gl.constexpr, VARLEN: gl.constexpr, DROPOUT: gl.constexpr, FP8: gl.constexpr,
                         ONE_LOOP: gl.constexpr):
    # The forward kernel's body (a module's _hopper_fwd_kernel runs it with its spec's functions and inputs;
    # Lse is None in a sigmoid spec's, and `sink_args` the sink's rows (signatures.SINK) in a spec with one).
    # A persistent kernel: one CTA an SM, each taking work items (query tiles of one batch x head:
    # _hopper_fwd_work) from a counter until none is left, so the producer loads the next item's Q and K/V
    # while the consumers finish this one, and the CTA's set-up is paid once.
    # CONSUMERS=1: one consumer partition of BLOCK_M/16 warps (the default partition).
    # CONSUMERS=2 or 3: as many 4-warp consumer partitions (the default and workers), BLOCK_M / CONSUMERS
    # query rows each, taking turns at the tensor cores (FA3's inter-warpgroup pingpong; three at D=64, as
    # FA3's 192-row tiles, so each warpgroup's softmax has two others' GEMMs to hide behind); q_desc/o_desc
    # boxes are then BLOCK_M / CONSUMERS rows. Q_BUFFERS: 2 where shared memory holds a second Q tile (the next
    # item's), else 1.
    # FP8: float8_e4m3fn q, k and v with their descale factors ((B, HKV) fp32, signatures.FP8_SCALES), and V
    # as V^T (B, HKV, DV, keys); O is bfloat16.
    # ONE_LOOP: each consumer runs its masked and unmasked steps in one loop (_hopper_consumer_loop).
    NUM_CONSUMERS: gl.constexpr = CONSUMERS
    ROWS: gl.constexpr = BLOCK_M // NUM_CONSUMERS
    dtype: gl.constexpr = q_desc.dtype
    n_m = gl.cdiv(Q_LEN, BLOCK_M)
    n_work = n_m * B * H
    # What a query head's items read again and again: its K and V rows, which H // HKV heads share.
    n_group = _hopper_head_group(B * H, gl.cdiv(KV_LEN, H // HKV),
                                 (HEAD_DIM_PAD + HEAD_DIM_V_PAD) * dtype.primitive_bitwidth // 8)
    gl.static_assert(q_desc.block_type.shape[2] == ROWS)
    tile_layout: gl.constexpr = _hopper_tile_layout(HEAD_DIM_PAD, dtype)
    q_bufs = gl.allocate_shared_memory(dtype, [Q_BUFFERS * NUM_CONSUMERS, ROWS, HEAD_DIM_PAD], tile_layout)
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM_PAD], tile_layout)
    if FP8:
        v_bufs = gl.allocate_shared_memory(dtype, [STAGES, HEAD_DIM_V_PAD, BLOCK_N], _hopper_tile_layout(BLOCK_N, dtype))
    else:
        v_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM_V_PAD],
                                           _hopper_tile_layout(HEAD_DIM_V_PAD, dtype))
    q_ready = gl.allocate_shared_memory(gl.int64, [Q_BUFFERS, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [Q_BUFFERS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    sched = gl.allocate_shared_memory(gl.int64, [NUM_CONSUMERS, 1], mbarrier.MBarrierLayout())
    # Each Q buffer's work item number, from the producer to the consumers.
    work_ids = gl.allocate_shared_memory(gl.int32, [Q_BUFFERS, 1], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    for i in gl.static_range(Q_BUFFERS):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=NUM_CONSUMERS * HOPPER_PARTITION_ARRIVALS)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=NUM_CONSUMERS * HOPPER_PARTITION_ARRIVALS)
        mbarrier.init(v_empty.index(i), count=NUM_CONSUMERS * HOPPER_PARTITION_ARRIVALS)
    for i in gl.static_range(NUM_CONSUMERS):
        mbarrier.init(sched.index(i), count=HOPPER_PARTITION_ARRIVALS)
    # Barrier initialisation must be visible to the async proxy (TMA) before the first copy.
    fence_async_shared()

    # (The partitions' arguments are written out in each tuple: a tuple bound to a name would have its
    # constexprs, the spec's functions among them, turned into tensors.)
    if NUM_CONSUMERS == 3:
        gl.warp_specialize([
            (_hopper_consumer, (q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, sched,
                                o_desc, Out, stride_oz, stride_oh, stride_om, Lse, sink_args, work_ids, n_work, n_m, n_group,
                                sm_scale, qk_scale, Rng, dropout_p, QDescale, KDescale, VDescale, stride_db,
                                stride_dh, inputs, table, B, H, HKV, Q_LEN, KV_LEN,
                                CuSeqlensQ, CuSeqlensK, TOTAL_Q, SPEC_RANGE, SPEC_STEP, HEAD_DIM, HEAD_DIM_V,
                                HEAD_DIM_PAD, HEAD_DIM_V_PAD, ROWS, BLOCK_N, STAGES, Q_BUFFERS, FOLLOW_TABLE,
                                DEFER_SCALE, 0, NUM_CONSUMERS, SIGMOID, SINK, VARLEN, DROPOUT, FP8, ONE_LOOP)),
            (_hopper_consumer, (q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, sched,
                                o_desc, Out, stride_oz, stride_oh, stride_om, Lse, sink_args, work_ids, n_work, n_m, n_group,
                                sm_scale, qk_scale, Rng, dropout_p, QDescale, KDescale, VDescale, stride_db,
                                stride_dh, inputs, table, B, H, HKV, Q_LEN, KV_LEN,
                                CuSeqlensQ, CuSeqlensK, TOTAL_Q, SPEC_RANGE, SPEC_STEP, HEAD_DIM, HEAD_DIM_V,
                                HEAD_DIM_PAD, HEAD_DIM_V_PAD, ROWS, BLOCK_N, STAGES, Q_BUFFERS, FOLLOW_TABLE,
                                DEFER_SCALE, 1, NUM_CONSUMERS, SIGMOID, SINK, VARLEN, DROPOUT, FP8, ONE_LOOP)),
            (_hopper_consumer, (q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, sched,
                                o_desc, Out, stride_oz, stride_oh, stride_om, Lse, sink_args, work_ids, n_work, n_m, n_group,
                                sm_scale, qk_scale, Rng, dropout_p, QDescale, KDescale, VDescale, stride_db,
                                stride_dh, inputs, table, B, H, HKV, Q_LEN, KV_LEN,
                                CuSeqlensQ, CuSeqlensK, TOTAL_Q, SPEC_RANGE, SPEC_STEP, HEAD_DIM, HEAD_DIM_V,
                                HEAD_DIM_PAD, HEAD_DIM_V_PAD, ROWS, BLOCK_N, STAGES, Q_BUFFERS, FOLLOW_TABLE,
                                DEFER_SCALE, 2, NUM_CONSUMERS, SIGMOID, SINK, VARLEN, DROPOUT, FP8, ONE_LOOP)),
            (_hopper_producer, (q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, k_empty,
                                v_ready, v_empty, work_ids, work_counter, n_work, n_m, n_group, inputs, table, B, H, HKV, Q_LEN,
                                KV_LEN, CuSeqlensQ, CuSeqlensK, SPEC_RANGE, BLOCK_M, BLOCK_N, STAGES, Q_BUFFERS,
                                NUM_CONSUMERS, FOLLOW_TABLE, VARLEN, FP8)),
        ], [4, 4, 1], [HOPPER_CONSUMER_REGS_3, HOPPER_CONSUMER_REGS_3, HOPPER_PRODUCER_REGS])
    elif NUM_CONSUMERS == 2:
        gl.warp_specialize([
            (_hopper_consumer, (q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, sched,
                                o_desc, Out, stride_oz, stride_oh, stride_om, Lse, sink_args, work_ids, n_work, n_m, n_group,
                                sm_scale, qk_scale, Rng, dropout_p, QDescale, KDescale, VDescale, stride_db,
                                stride_dh, inputs, table, B, H, HKV, Q_LEN, KV_LEN,
                                CuSeqlensQ, CuSeqlensK, TOTAL_Q, SPEC_RANGE, SPEC_STEP, HEAD_DIM, HEAD_DIM_V,
                                HEAD_DIM_PAD, HEAD_DIM_V_PAD, ROWS, BLOCK_N, STAGES, Q_BUFFERS, FOLLOW_TABLE,
                                DEFER_SCALE, 0, NUM_CONSUMERS, SIGMOID, SINK, VARLEN, DROPOUT, FP8, ONE_LOOP)),
            (_hopper_consumer, (q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, sched,
                                o_desc, Out, stride_oz, stride_oh, stride_om, Lse, sink_args, work_ids, n_work, n_m, n_group,
                                sm_scale, qk_scale, Rng, dropout_p, QDescale, KDescale, VDescale, stride_db,
                                stride_dh, inputs, table, B, H, HKV, Q_LEN, KV_LEN,
                                CuSeqlensQ, CuSeqlensK, TOTAL_Q, SPEC_RANGE, SPEC_STEP, HEAD_DIM, HEAD_DIM_V,
                                HEAD_DIM_PAD, HEAD_DIM_V_PAD, ROWS, BLOCK_N, STAGES, Q_BUFFERS, FOLLOW_TABLE,
                                DEFER_SCALE, 1, NUM_CONSUMERS, SIGMOID, SINK, VARLEN, DROPOUT, FP8, ONE_LOOP)),
            (_hopper_producer, (q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, k_empty,
                                v_ready, v_empty, work_ids, work_counter, n_work, n_m, n_group, inputs, table, B, H, HKV, Q_LEN,
                                KV_LEN, CuSeqlensQ, CuSeqlensK, SPEC_RANGE, BLOCK_M, BLOCK_N, STAGES, Q_BUFFERS,
                                NUM_CONSUMERS, FOLLOW_TABLE, VARLEN, FP8)),
        ], [4, 1], [HOPPER_CONSUMER_REGS, HOPPER_PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_hopper_consumer, (q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, sched,
                                o_desc, Out, stride_oz, stride_oh, stride_om, Lse, sink_args, work_ids, n_work, n_m, n_group,
                                sm_scale, qk_scale, Rng, dropout_p, QDescale, KDescale, VDescale, stride_db,
                                stride_dh, inputs, table, B, H, HKV, Q_LEN, KV_LEN,
                                CuSeqlensQ, CuSeqlensK, TOTAL_Q, SPEC_RANGE, SPEC_STEP, HEAD_DIM, HEAD_DIM_V,
                                HEAD_DIM_PAD, HEAD_DIM_V_PAD, ROWS, BLOCK_N, STAGES, Q_BUFFERS, FOLLOW_TABLE,
                                DEFER_SCALE, 0, NUM_CONSUMERS, SIGMOID, SINK, VARLEN, DROPOUT, FP8, ONE_LOOP)),
            (_hopper_producer, (q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, k_empty,
                                v_ready, v_empty, work_ids, work_counter, n_work, n_m, n_group, inputs, table, B, H, HKV, Q_LEN,
                                KV_LEN, CuSeqlensQ, CuSeqlensK, SPEC_RANGE, BLOCK_M, BLOCK_N, STAGES, Q_BUFFERS,
                                NUM_CONSUMERS, FOLLOW_TABLE, VARLEN, FP8)),
        ], [1], [HOPPER_PRODUCER_REGS])


# --- backward (Gluon): FlashAttention-3's layout --------------------------------------------------------
# One CTA per key tile of one (batch, kv head) keeps K_j, V_j in shared memory and dK_j, dV_j in
# registers, and walks the query tiles of every query head of its group (so GQA sums dK/dV in
# registers, no atomics). A TMA producer warp streams Q_i and dO_i into a ring of stages; the consumer
# (BLOCK_N / 16 warps, a 16-key slab each) computes per step (SPEC_STEPS, a module's _hopper_bwd_steps), on
# transposed tiles (rows are keys):
#   S^T = K Q^T, dP^T = V dO^T (asynchronous wgmmas), P^T = exp2(score - LSE) with the spec's score and
#   mask (hooks.HOPPER_BWD_*, the portable dK/dV kernel's code), dV += P^T dO (P^T from registers),
#   dS^T = P^T (dP^T - delta) through the score's derivative, dK += dS^T Q (registers), and
#   dQ_i = dS K (dS through shared memory), added into an fp32 dQ by a TMA reduce-add.
# The learnable inputs' gradients are scattered from dS^T as in the portable dQ kernel, by fp32 atomics.
# The key tiles' dQ_i and those atomics add in an order the GPU decides, so the last bits of dQ and of the
# learnable inputs' gradients may vary from run to run: deterministic calls run the portable backward
# (HopperFamily.backward_serves).


@gluon.jit
def _hopper_bwd_producer(q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, q_bufs, do_bufs, lse_bufs,
                         delta_bufs, k_smem, v_smem, kv_bar, ready, empty, start_n, off_b, off_hkv, B, H, HKV, Q_LEN,
                         KV_LEN, CuSeqlensQ, CuSeqlensK, inputs, table, SPEC_RANGE: gl.constexpr,
                         BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                         FOLLOW_TABLE: gl.constexpr, SIGMOID: gl.constexpr, VARLEN: gl.constexpr):
    # One warp, scalars only: K_j and V_j once, then Q_i, dO_i and their rows' base-2 LSE and delta for
    # every step, in the consumer's order. Boxes are (1, 1 head, rows, width) and (1 head, rows): TMA
    # zero-fills the rows past a head's length (LSE and delta come padded to whole tiles, +inf and 0 there).
    tma_b, q_start, k_start, row_start, Q_LEN, KV_LEN = _hopper_bwd_sequence(off_b, Q_LEN, KV_LEN, CuSeqlensQ,
                                                                             CuSeqlensK, VARLEN)
    # A packed call's key tile past its sequence's end (the grid follows the longest) takes no step, as a key
    # tile no query tile sees: its K and V boxes are still loaded (TMA zero-fills past the tensor), so both
    # partitions keep the one protocol.
    live = start_n * BLOCK_N < KV_LEN
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [tma_b, off_hkv, k_start + start_n * BLOCK_N, 0], kv_bar,
                                    _hopper_box(k_smem, k_desc))
    tma.async_copy_global_to_shared(v_desc, [tma_b, off_hkv, k_start + start_n * BLOCK_N, 0], kv_bar,
                                    _hopper_box(v_smem, v_desc))
    if SIGMOID:
        step_bytes: gl.constexpr = q_desc.block_type.nbytes + do_desc.block_type.nbytes  # no row terms
    else:
        step_bytes: gl.constexpr = (q_desc.block_type.nbytes + do_desc.block_type.nbytes
                                    + lse_desc.block_type.nbytes + delta_desc.block_type.nbytes)
    group = H // HKV
    t = 0
    for g in range(group):
        off_h = off_hkv * group + g
        masked_tiles, masked_lo, masked_hi, gap_at, gap, full_tiles, full_lo, full_hi = SPEC_RANGE(
            start_n=start_n, off_b=off_b, off_h=off_h, off_hkv=off_hkv, B=B, H=H, HKV=HKV, Q_LEN=Q_LEN,
            KV_LEN=KV_LEN, inputs=inputs, table=table, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, FOLLOW_TABLE=FOLLOW_TABLE)
        n_masked = masked_hi - masked_lo
        n_steps = gl.where(live, n_masked + (full_hi - full_lo), 0)
        for i in range(n_steps):
            start_m = _hopper_tile_start(i, n_masked, masked_tiles, masked_lo, masked_hi, gap_at, gap, full_tiles,
                                         full_lo, full_hi, BLOCK_M, FOLLOW_TABLE)
            stage = t % STAGES
            # Fresh mbarriers count as having completed phase 1, so the first lap passes straight through.
            mbarrier.wait(empty.index(stage), ((t // STAGES) & 1) ^ 1)
            bar = ready.index(stage)
            mbarrier.expect(bar, step_bytes)
            tma.async_copy_global_to_shared(q_desc, [tma_b, off_h, q_start + start_m, 0], bar,
                                            _hopper_box(q_bufs.index(stage), q_desc))
            tma.async_copy_global_to_shared(do_desc, [tma_b, off_h, q_start + start_m, 0], bar,
                                            _hopper_box(do_bufs.index(stage), do_desc))
            if not SIGMOID:
                tma.async_copy_global_to_shared(lse_desc, [tma_b * H + off_h, row_start + start_m], bar,
                                                _hopper_box(lse_bufs.index(stage), lse_desc))
                tma.async_copy_global_to_shared(delta_desc, [tma_b * H + off_h, row_start + start_m], bar,
                                                _hopper_box(delta_bufs.index(stage), delta_desc))
            t += 1


@gluon.jit
def _hopper_bwd_consumer(q_bufs, do_bufs, lse_bufs, delta_bufs, k_smem, v_smem, ds_smem, dq_smem, kv_bar, ready, empty,
                         dq_desc, DK, DV, stride_dkz, stride_dkh, stride_dkn, stride_dvz, stride_dvh, stride_dvn,
                         start_n, off_b, off_hkv, sm_scale, qk_scale, Rng, dropout_p, B, H, HKV, Q_LEN, KV_LEN,
                         CuSeqlensQ, CuSeqlensK, inputs, grads, table, SPEC_RANGE: gl.constexpr,
                         SPEC_STEPS: gl.constexpr, HEAD_DIM: gl.constexpr, HEAD_DIM_V: gl.constexpr,
                         HEAD_DIM_PAD: gl.constexpr, HEAD_DIM_V_PAD: gl.constexpr, BLOCK_M: gl.constexpr,
                         BLOCK_N: gl.constexpr, STAGES: gl.constexpr, FOLLOW_TABLE: gl.constexpr,
                         SPLIT_D: gl.constexpr, VARLEN: gl.constexpr, DROPOUT: gl.constexpr,
                         FOLD_ROWS: gl.constexpr, FOLD_LSE: gl.constexpr):
    # The accumulators' layouts: a 16-key slab per warp (the steps' S^T tiles have the same rows); with
    # SPLIT_D (head dims above 128, 64-key tiles) two warpgroups side by side, each holding half the head
    # dims' columns of dK and dV (64 fp32 registers a thread each at 256).
    ROW_WARPS: gl.constexpr = BLOCK_N // 16
    COL_WARPS: gl.constexpr = 2 if SPLIT_D else 1
    dk_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[ROW_WARPS, COL_WARPS],
                                                        instr_shape=[16, HEAD_DIM_PAD // COL_WARPS, 16])
    dv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[ROW_WARPS, COL_WARPS],
                                                        instr_shape=[16, HEAD_DIM_V_PAD // COL_WARPS, 16])
    dk = gl.zeros([BLOCK_N, HEAD_DIM_PAD], gl.float32, dk_layout)
    dv = gl.zeros([BLOCK_N, HEAD_DIM_V_PAD], gl.float32, dv_layout)
    dropout_seed, dropout_offset, dropout_threshold, dropout_scale = _dropout_state(Rng, dropout_p, DROPOUT)
    tma_b, q_start, k_start, _, Q_LEN, KV_LEN = _hopper_bwd_sequence(off_b, Q_LEN, KV_LEN, CuSeqlensQ, CuSeqlensK,
                                                                     VARLEN)
    # A ragged key tile's rows past KV_LEN hold TMA's zeros, whose P need not be 0: every step is masked.
    ragged = (start_n + 1) * BLOCK_N > KV_LEN
    # A packed call's key tile past its sequence's end takes no step and stores nothing (rows >= KV_LEN).
    live = start_n * BLOCK_N < KV_LEN
    mbarrier.wait(kv_bar, 0)
    group = H // HKV
    t = 0
    for g in range(group):
        off_h = off_hkv * group + g
        masked_tiles, masked_lo, masked_hi, gap_at, gap, full_tiles, full_lo, full_hi = SPEC_RANGE(
            start_n=start_n, off_b=off_b, off_h=off_h, off_hkv=off_hkv, B=B, H=H, HKV=HKV, Q_LEN=Q_LEN,
            KV_LEN=KV_LEN, inputs=inputs, table=table, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, FOLLOW_TABLE=FOLLOW_TABLE)
        n_masked = masked_hi - masked_lo
        n_steps = gl.where(live, n_masked + (full_hi - full_lo), 0)
        n_checked = gl.minimum(n_masked, n_steps)
        if ragged:
            n_checked = n_steps
        # Steps [0, n_checked) with mask code, the rest without.
        t, dk, dv = SPEC_STEPS(
            t=t, i_lo=0, i_hi=n_checked, dk=dk, dv=dv, q_bufs=q_bufs, do_bufs=do_bufs, lse_bufs=lse_bufs,
            delta_bufs=delta_bufs, k_smem=k_smem, v_smem=v_smem, ds_smem=ds_smem, dq_smem=dq_smem, ready=ready,
            empty=empty, dq_desc=dq_desc, start_n=start_n, n_masked=n_masked, masked_tiles=masked_tiles,
            masked_lo=masked_lo, masked_hi=masked_hi, gap_at=gap_at, gap=gap, full_tiles=full_tiles, full_lo=full_lo,
            full_hi=full_hi, sm_scale=sm_scale, qk_scale=qk_scale, off_b=off_b, off_h=off_h, off_hkv=off_hkv, B=B,
            H=H, HKV=HKV, Q_LEN=Q_LEN, KV_LEN=KV_LEN, tma_b=tma_b, q_start=q_start, k_start=k_start, inputs=inputs,
            grads=grads, dropout_seed=dropout_seed, dropout_offset=dropout_offset,
            dropout_threshold=dropout_threshold, dropout_scale=dropout_scale, HEAD_DIM=HEAD_DIM,
            HEAD_DIM_V=HEAD_DIM_V, HEAD_DIM_PAD=HEAD_DIM_PAD, HEAD_DIM_V_PAD=HEAD_DIM_V_PAD, BLOCK_M=BLOCK_M,
            BLOCK_N=BLOCK_N, STAGES=STAGES, MASKED=True, FOLLOW_TABLE=FOLLOW_TABLE, SPLIT_D=SPLIT_D, VARLEN=VARLEN,
            dk_layout=dk_layout, dv_layout=dv_layout, DROPOUT=DROPOUT, FOLD_ROWS=FOLD_ROWS,
            FOLD_LSE=FOLD_LSE)
        t, dk, dv = SPEC_STEPS(
            t=t, i_lo=n_checked, i_hi=n_steps, dk=dk, dv=dv, q_bufs=q_bufs, do_bufs=do_bufs, lse_bufs=lse_bufs,
            delta_bufs=delta_bufs, k_smem=k_smem, v_smem=v_smem, ds_smem=ds_smem, dq_smem=dq_smem, ready=ready,
            empty=empty, dq_desc=dq_desc, start_n=start_n, n_masked=n_masked, masked_tiles=masked_tiles,
            masked_lo=masked_lo, masked_hi=masked_hi, gap_at=gap_at, gap=gap, full_tiles=full_tiles, full_lo=full_lo,
            full_hi=full_hi, sm_scale=sm_scale, qk_scale=qk_scale, off_b=off_b, off_h=off_h, off_hkv=off_hkv, B=B,
            H=H, HKV=HKV, Q_LEN=Q_LEN, KV_LEN=KV_LEN, tma_b=tma_b, q_start=q_start, k_start=k_start, inputs=inputs,
            grads=grads, dropout_seed=dropout_seed, dropout_offset=dropout_offset,
            dropout_threshold=dropout_threshold, dropout_scale=dropout_scale, HEAD_DIM=HEAD_DIM,
            HEAD_DIM_V=HEAD_DIM_V, HEAD_DIM_PAD=HEAD_DIM_PAD, HEAD_DIM_V_PAD=HEAD_DIM_V_PAD, BLOCK_M=BLOCK_M,
            BLOCK_N=BLOCK_N, STAGES=STAGES, MASKED=False, FOLLOW_TABLE=FOLLOW_TABLE, SPLIT_D=SPLIT_D, VARLEN=VARLEN,
            dk_layout=dk_layout, dv_layout=dv_layout, DROPOUT=DROPOUT, FOLD_ROWS=FOLD_ROWS,
            FOLD_LSE=FOLD_LSE)
    # The last reduce must have read dq_smem before the CTA's shared memory goes away.
    tma.store_wait(pendings=0)
    if DROPOUT:
        dv = dv * dropout_scale
    _hopper_store_rows(DK, (dk * sm_scale).to(DK.dtype.element_ty),
                       tma_b.to(gl.int64) * stride_dkz + off_hkv.to(gl.int64) * stride_dkh
                       + k_start.to(gl.int64) * stride_dkn, stride_dkn, start_n * BLOCK_N, KV_LEN, HEAD_DIM, BLOCK_N,
                       HEAD_DIM_PAD, dk_layout)
    _hopper_store_rows(DV, dv.to(DV.dtype.element_ty),
                       tma_b.to(gl.int64) * stride_dvz + off_hkv.to(gl.int64) * stride_dvh
                       + k_start.to(gl.int64) * stride_dvn, stride_dvn, start_n * BLOCK_N, KV_LEN, HEAD_DIM_V,
                       BLOCK_N, HEAD_DIM_V_PAD, dv_layout)


@gluon.jit
def _hopper_bwd_pipeline(q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, dq_desc, DK, DV, stride_dkz,
                         stride_dkh, stride_dkn, stride_dvz, stride_dvh, stride_dvn, sm_scale, qk_scale, Rng,
                         dropout_p, inputs, grads, table, B, H, HKV, Q_LEN, KV_LEN, CuSeqlensQ, CuSeqlensK,
                         SPEC_RANGE: gl.constexpr, SPEC_STEPS: gl.constexpr, HEAD_DIM: gl.constexpr,
                         HEAD_DIM_V: gl.constexpr, HEAD_DIM_PAD: gl.constexpr, HEAD_DIM_V_PAD: gl.constexpr,
                         BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                         FOLLOW_TABLE: gl.constexpr, SPLIT_D: gl.constexpr, SIGMOID: gl.constexpr,
                         VARLEN: gl.constexpr, DROPOUT: gl.constexpr, FOLD_ROWS: gl.constexpr,
                         FOLD_LSE: gl.constexpr):
    # The backward kernel's body (a module's _hopper_bwd_kernel runs it with its spec's functions and inputs;
    # lse_desc and delta_desc are None in a sigmoid spec's, which has no row terms). FOLD_ROWS: each step's
    # dP^T accumulator starts at -delta, so dS^T = P^T * dP^T; FOLD_LSE: its S^T accumulator starts at
    # -LSE / qk_scale, so P^T = exp2(qk_scale * S^T) (runtime.py's _hopper_folds says when).
    # Grid (key tiles, B * HKV). Under causal-like masks key tile 0 has the most query tiles; it starts first.
    # (Key tiles in groups of heads, as the forward's items go (_hopper_grouped_item), measured 0-2% slower:
    # forward+backward less forward, H100, B4 H16 N4096 D64, causal and full, L2 budgets of 8 and 32 MB.)
    start_n = gl.program_id(0)
    off_bhkv = gl.program_id(1)
    off_b = off_bhkv // HKV
    off_hkv = off_bhkv % HKV
    # A packed call's sequence is read by each partition (_hopper_bwd_sequence), not here: values computed
    # before the warp specialization reach the partitions through shared memory, and the kernel faulted so.
    dtype: gl.constexpr = q_desc.dtype
    # Tiles of at least 64 16-bit elements a row: the 128-byte swizzle that TMA and wgmma share.
    tile_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    q_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM_PAD], tile_layout)
    do_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM_V_PAD], tile_layout)
    if SIGMOID:  # no row terms (constexpr Nones: the partitions' arguments need a type)
        lse_bufs: gl.constexpr = None
        delta_bufs: gl.constexpr = None
    else:
        # The rows' LSE and delta, unswizzled fp32 vectors (the TMA boxes (1, BLOCK_M) are the same bytes).
        row_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)
        lse_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], row_layout)
        delta_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], row_layout)
    k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM_PAD], tile_layout)
    v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM_V_PAD], tile_layout)
    # dS^T (BLOCK_N, BLOCK_M): stored from registers each step, read transposed as dQ's A operand (and
    # with SPLIT_D, P^T first, then dS^T, as dV's and dK's A operands).
    ds_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_M], tile_layout)
    # dQ_i's fp32 staging box for the reduce-add (the descriptor's layout, rank 2).
    dq_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M, HEAD_DIM_PAD],
                                        gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2))
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=HOPPER_PARTITION_ARRIVALS)
    # Barrier initialisation must be visible to the async proxy (TMA) before the first copy.
    fence_async_shared()
    gl.warp_specialize([
        (_hopper_bwd_consumer, (q_bufs, do_bufs, lse_bufs, delta_bufs, k_smem, v_smem, ds_smem, dq_smem, kv_bar,
                                ready, empty, dq_desc, DK, DV, stride_dkz, stride_dkh, stride_dkn, stride_dvz,
                                stride_dvh, stride_dvn, start_n, off_b, off_hkv, sm_scale, qk_scale, Rng, dropout_p,
                                B, H, HKV, Q_LEN, KV_LEN, CuSeqlensQ, CuSeqlensK, inputs, grads, table, SPEC_RANGE,
                                SPEC_STEPS, HEAD_DIM, HEAD_DIM_V, HEAD_DIM_PAD, HEAD_DIM_V_PAD, BLOCK_M, BLOCK_N,
                                STAGES, FOLLOW_TABLE, SPLIT_D, VARLEN, DROPOUT, FOLD_ROWS, FOLD_LSE)),
        (_hopper_bwd_producer, (q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, q_bufs, do_bufs, lse_bufs,
                                delta_bufs, k_smem, v_smem, kv_bar, ready, empty, start_n, off_b, off_hkv, B, H, HKV,
                                Q_LEN, KV_LEN, CuSeqlensQ, CuSeqlensK, inputs, table, SPEC_RANGE, BLOCK_M, BLOCK_N,
                                STAGES, FOLLOW_TABLE, SIGMOID, VARLEN)),
    ], [1], [HOPPER_PRODUCER_REGS])
