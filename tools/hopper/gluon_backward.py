"""FlashAttention-3-style attention backward for Hopper (sm_90) in Gluon (triton 3.6): a prototype.

    dq, dk, dv = backward(q, k, v, o, dout, lse, causal=False)      # on a Hopper GPU
    python tools/hopper/compile_backward.py                         # CPU: sm_90 compile + schedule model

Plain attention only (the package's specs do not reach it yet): q, o, dout (B, H, N, D), k, v (B, HKV, N, D)
with GQA (query head h reads kv head h // (H // HKV)), bf16 or fp16, D in {64, 128}, softmax scale
1/sqrt(D), optional top-left causal mask (key k allowed iff k <= q); lse (B, H, N) float32, natural log, as
the forward returns it. Returns dq, dk, dv in the input dtype. Not wired into the package.

Three launches:
  1. `_bwd_preprocess` (plain triton.jit): delta = rowsum(dO * O) and lse2 = LSE * log2(e), both fp32 in
     buffers padded to whole BLOCK_M tiles (B*H*N_PAD,), so a 1-D TMA box of BLOCK_M never straddles two
     heads. Padding rows, and rows that saw no allowed key (LSE = -inf), get lse2 = +inf: their P is
     exp2(-inf) = 0 with no query-side mask (FA3 pads its LSE the same way).
  2. `_bwd_kernel` (Gluon), FA3's layout: one CTA per (key tile j of BLOCK_N keys, batch * kv head). It
     keeps K_j, V_j in shared memory and dK_j, dV_j in registers, and walks the query tiles i of every
     query head of its kv head (GQA: the CTA loops over the group, so dK/dV are summed over the query
     heads in registers and written once, with no atomics and no host-side reduction, deterministic; the
     price is B*HKV instead of B*H CTAs along that axis, fine at training shapes. FA3 instead keeps a CTA
     per query head and adds dK/dV of a group in fp32 global buffers). Per step, schedule below.
  3. host: dq = (dq_accum * scale).to(dtype) (FA3's convert_dQ postprocess; the scale is applied once
     here instead of on every tile's atomics).

Partitions (gl.warp_specialize):
  * producer, 1 warp, 24 registers: TMA of K_j and V_j once (one barrier), then for every step Q_i, dO_i,
    lse2_i, delta_i into a STAGES-deep ring (one `ready` barrier per stage for all four: dO is needed
    early anyway, see below; FA3 splits Q/LSE and dO/dPsum onto two barriers).
  * consumer, BLOCK_N / 16 warps (8 at BLOCK_N = 128: two warpgroups of 64 keys each, FA3's D=128
    layout), the rest of the registers (240).

Per step (S^T-major, FA3's "SdP_swapAB" option): every product whose M is the key tile has rows = keys, so P^T
and dS^T are born in the accumulator layout whose rows are the dK/dV accumulators' rows and feed the
next wgmmas straight from registers (DotOperandLayout of the dK/dV layout, as the forward's P):
  S^T  = K_j Q_i^T               wgmma, A = K smem, B = Q smem permuted            (async)
  dP^T = V_j dO_i^T              wgmma, A = V smem, B = dO smem permuted           (async, with S^T)
  P^T  = exp2(S^T * scale*log2e - lse2_i)   [masked on diagonal / ragged tiles]
  dV  += P^T dO_i                wgmma, A = P^T registers (rounded to dtype), B = dO smem; waited for
                                 together with dP^T, which frees P^T's registers before dS^T (D=128
                                 spilled more with dV still in flight there)
  dS^T = P^T * (dP^T - delta_i)  (fp32 P, FA3's order)
  dK  += dS^T Q_i                wgmma, A = dS^T registers (rounded), B = Q smem
  dQ_i = dS K_j                  wgmma, A = dS^T stored to smem and read transposed, B = K smem;
                                 dS is the one operand that must go through shared memory: its rows
                                 (queries) are the columns of the registers it was born in.
  dQ_accum[rows of i] += dQ_i    DQ_TMA_REDUCE=False (default): gl.atomic_add (relaxed; REDG in SASS) from
                                 the accumulator layout, rows < N. DQ_TMA_REDUCE=True: dQ_i to smem and
                                 one cp.reduce.async.bulk.tensor .add, FA3's way; Gluon 3.6 has no public
                                 function for it (hopper.tma: loads, stores, store_wait), so
                                 `_tma_reduce_add` wraps the builder's create_async_tma_reduce. FA3 also
                                 hands the reduce to a dedicated warp; here the consumer issues it.
With two consumer warpgroups, dQ (M = BLOCK_M = 64 rows) is split by columns: warps_per_cta = [4, 2].

What FA3 does beyond this: two consumer warpgroups that are separate partitions, Q/LSE and dO/dPsum on
separate barriers, dQ through smem + TMA reduce-add by a dedicated warp, overlapping the next step's
S^T/dP^T with this step's dK/dQ (here each step ends with wait(0)), deterministic dQ as an option, a
persistent tile scheduler, and per-hdim tiles (D=64: 128x128; D=128: 64x128; the latter is this one).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton._C.libtriton import ir

LOG2E = 1.4426950408889634
PRODUCER_REGS = gl.constexpr(24)
# Triton 3.6 lowers mbarrier.arrive in a multi-warp partition to a partition-wide bar.sync and one
# arrival (tools/hopper/NOTES.md, pitfall 1): the consumer partition counts once on `empty`.
PARTITION_ARRIVALS = gl.constexpr(1)
HEAD_DIMS = (64, 128)
DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


@builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    # cp.reduce.async.bulk.tensor .add: Gluon 3.6's GluonOpBuilder has create_async_tma_reduce, but no public
    # function calls it (hopper.tma has loads, stores and store_wait only); this is that missing wrapper,
    # written like tma.async_copy_shared_to_global. Private API: recheck on any Triton upgrade.
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@triton.jit
def _bwd_preprocess(O, DO, Lse, Delta, Lse2, N, N_PAD, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    # Grid (N_PAD / BLOCK_M, B * H): every padded row is written, so the main kernel's boxes read no garbage.
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    bh = tl.program_id(1).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    in_range = offs_m < N
    ptrs = (bh * N + offs_m)[:, None] * HEAD_DIM + offs_d[None, :]
    o = tl.load(O + ptrs, mask=in_range[:, None], other=0.0).to(tl.float32)
    do = tl.load(DO + ptrs, mask=in_range[:, None], other=0.0).to(tl.float32)
    lse = tl.load(Lse + bh * N + offs_m, mask=in_range, other=float("-inf"))
    tl.store(Delta + bh * N_PAD + offs_m, tl.sum(o * do, 1))
    tl.store(Lse2 + bh * N_PAD + offs_m, tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634))


@gluon.jit
def _bwd_producer(q_desc, do_desc, lse_desc, delta_desc, k_desc, v_desc, q_bufs, do_bufs, lse_bufs, delta_bufs,
                  k_smem, v_smem, kv_bar, ready, empty, kv_row, head0, N, N_PAD, i_lo, n_m, GROUP,
                  BLOCK_M: gl.constexpr, STAGES: gl.constexpr):
    # One warp, scalars only: it issues TMA and waits on `empty`; it walks the consumer's exact step order.
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [kv_row, 0], kv_bar, k_smem)
    tma.async_copy_global_to_shared(v_desc, [kv_row, 0], kv_bar, v_smem)
    step_bytes: gl.constexpr = (q_desc.block_type.nbytes + do_desc.block_type.nbytes + lse_desc.block_type.nbytes
                                + delta_desc.block_type.nbytes)
    t = 0
    for g in range(GROUP):
        bh = head0 + g
        for i in range(i_lo, n_m):
            stage = t % STAGES
            # A fresh mbarrier counts as having completed phase 1: the first lap passes straight through.
            mbarrier.wait(empty.index(stage), ((t // STAGES) & 1) ^ 1)
            bar = ready.index(stage)
            mbarrier.expect(bar, step_bytes)
            # Rows past this head's N read the next head's rows (or TMA's zero fill at the end): finite
            # values whose P is 0 through lse2 = +inf, never stored.
            tma.async_copy_global_to_shared(q_desc, [bh * N + i * BLOCK_M, 0], bar, q_bufs.index(stage))
            tma.async_copy_global_to_shared(do_desc, [bh * N + i * BLOCK_M, 0], bar, do_bufs.index(stage))
            tma.async_copy_global_to_shared(lse_desc, [bh * N_PAD + i * BLOCK_M], bar, lse_bufs.index(stage))
            tma.async_copy_global_to_shared(delta_desc, [bh * N_PAD + i * BLOCK_M], bar, delta_bufs.index(stage))
            t += 1


@gluon.jit
def _bwd_steps(t, i_lo, i_hi, dk, dv, q_bufs, do_bufs, lse_bufs, delta_bufs, k_smem, v_smem, ds_smem, ready, empty,
               dq_ptr, dq_desc, dq_smem, dq_row, start_n, N, qk_scale, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
               BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, DQ_TMA_REDUCE: gl.constexpr,
               MASKED: gl.constexpr):
    # Query tiles [i_lo, i_hi) of one query head; t is the ring position (it runs on across heads).
    dtype: gl.constexpr = k_smem.dtype
    NUM_WARPS: gl.constexpr = BLOCK_N // 16
    WG: gl.constexpr = NUM_WARPS // 4
    # One 16-key slab per warp: P^T, dS^T and dK/dV share rows, so the accumulator -> A-operand
    # conversions stay in registers.
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    # dQ_i has BLOCK_M = 64 rows, one warpgroup's M: the warpgroups split its columns instead.
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WG],
                                                        instr_shape=[16, HEAD_DIM // WG, 16])
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
    dq_zero = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, dq_layout)
    offs_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
    dq_rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, dq_layout))
    dq_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, dq_layout))
    for i in range(i_lo, i_hi):
        stage = t % STAGES
        q_smem = q_bufs.index(stage)
        do_smem = do_bufs.index(stage)
        mbarrier.wait(ready.index(stage), (t // STAGES) & 1)
        # S^T and dP^T both in flight; the exponentials wait only for S^T (wgmma groups retire in order).
        s_tok = warpgroup_mma(k_smem, q_smem.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dp_tok = warpgroup_mma(v_smem, do_smem.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        lse2 = lse_bufs.index(stage).load(col_layout)
        s_t, _, _ = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, k_smem, q_smem))
        # Base 2: the scale and log2(e) fold into one FMA with the (already base-2) LSE.
        p_t = gl.exp2(s_t * qk_scale - gl.expand_dims(lse2, 0))
        if MASKED:
            # Keys past N (the tile's rows read the next head's keys) and, causal, keys after the query.
            offs_m = (i * BLOCK_M) + gl.arange(0, BLOCK_M, layout=col_layout)
            allowed = gl.expand_dims(offs_n < N, 1)
            if CAUSAL:
                allowed = allowed & (gl.expand_dims(offs_n, 1) <= gl.expand_dims(offs_m, 0))
            p_t = gl.where(allowed, p_t, 0.0)
        dv_tok = warpgroup_mma(gl.convert_layout(p_t.to(dtype), a_layout), do_smem, dv, is_async=True)
        # dV is waited for here with dP^T, not at the end of the step: that frees P^T's operand registers
        # before dS^T is built (at D=128 waiting later spills: dK + dV alone are 128 registers a thread).
        dp_t, dv, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(dp_tok, dv_tok, v_smem, do_smem))
        # Loaded late: a column vector is 16 registers a thread in this layout.
        delta = delta_bufs.index(stage).load(col_layout)
        ds_t = (p_t * (dp_t - gl.expand_dims(delta, 0))).to(dtype)
        dk_tok = warpgroup_mma(gl.convert_layout(ds_t, a_layout), q_smem, dk, is_async=True)
        # The previous step's dQ wgmma, the only reader of ds_smem, retired at that step's wait(0), and
        # the partition-wide bar.sync of its `empty` arrive ordered every warpgroup after it.
        ds_smem.store(ds_t)
        fence_async_shared()
        dq_tok = warpgroup_mma(ds_smem.permute((1, 0)), k_smem, dq_zero, use_acc=False, is_async=True)
        dk, dq, _, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(dk_tok, dq_tok, q_smem, ds_smem, k_smem))
        mbarrier.arrive(empty.index(stage), count=1)
        if DQ_TMA_REDUCE:
            # FA3's way, from the consumer itself (FA3 hands it to a dedicated warp): dQ_i to smem, then
            # one TMA reduce-add of the whole box. Rows past N add exact zeros (P = 0 there) to the next
            # head's rows or are clipped at the tensor's end. store_wait covers only the issuing threads'
            # bulk groups, hence the partition barrier before anyone overwrites the previous step's box.
            tma.store_wait(pendings=0)
            gl.thread_barrier()
            dq_smem.store(dq)
            fence_async_shared()
            _tma_reduce_add(dq_desc, [dq_row + i * BLOCK_M, 0], dq_smem)
        else:
            rows = i * BLOCK_M + dq_rows
            ptrs = dq_ptr + gl.expand_dims((dq_row + rows).to(gl.int64) * HEAD_DIM, 1) + gl.expand_dims(dq_cols, 0)
            gl.atomic_add(ptrs, dq, mask=gl.expand_dims(rows < N, 1), sem="relaxed")
        t += 1
    return t, dk, dv


@gluon.jit
def _bwd_consumer(q_bufs, do_bufs, lse_bufs, delta_bufs, k_smem, v_smem, ds_smem, kv_bar, ready, empty, dq_ptr, dq_desc,
                  dq_smem, dk_ptr, dv_ptr, kv_row0, head0, start_n, N, i_lo, i_mid, n_m, GROUP, qk_scale, sm_scale,
                  HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                  CAUSAL: gl.constexpr, DQ_TMA_REDUCE: gl.constexpr):
    NUM_WARPS: gl.constexpr = BLOCK_N // 16
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout)
    dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout)
    mbarrier.wait(kv_bar, 0)
    t = 0
    for g in range(GROUP):
        dq_row = (head0 + g) * N
        # Diagonal (and ragged-key) tiles first with the mask, then the rest without it.
        t, dk, dv = _bwd_steps(t, i_lo, i_mid, dk, dv, q_bufs, do_bufs, lse_bufs, delta_bufs, k_smem, v_smem, ds_smem,
                               ready, empty, dq_ptr, dq_desc, dq_smem, dq_row, start_n, N, qk_scale, HEAD_DIM, BLOCK_M,
                               BLOCK_N, STAGES, CAUSAL, DQ_TMA_REDUCE, True)
        t, dk, dv = _bwd_steps(t, i_mid, n_m, dk, dv, q_bufs, do_bufs, lse_bufs, delta_bufs, k_smem, v_smem, ds_smem,
                               ready, empty, dq_ptr, dq_desc, dq_smem, dq_row, start_n, N, qk_scale, HEAD_DIM, BLOCK_M,
                               BLOCK_N, STAGES, CAUSAL, DQ_TMA_REDUCE, False)
    if DQ_TMA_REDUCE:
        # The last reduce must have read dq_smem before the CTA's shared memory goes away.
        tma.store_wait(pendings=0)
    # Ragged key tiles make a 2-D TMA store spill into the next head, so the epilogue stores rows from the
    # accumulator layout (once per CTA; FA3 goes through smem + TMA).
    offs_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc_layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))
    offs = gl.expand_dims((kv_row0 + offs_n).to(gl.int64) * HEAD_DIM, 1) + gl.expand_dims(cols, 0)
    in_range = gl.expand_dims(offs_n < N, 1)
    gl.store(dk_ptr + offs, (dk * sm_scale).to(dk_ptr.dtype.element_ty), mask=in_range)
    gl.store(dv_ptr + offs, dv.to(dv_ptr.dtype.element_ty), mask=in_range)


@gluon.jit
def _bwd_kernel(q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, dq_desc, dq_ptr, dk_ptr, dv_ptr, qk_scale,
                sm_scale, N, N_PAD, H, HKV, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                STAGES: gl.constexpr, CAUSAL: gl.constexpr, DQ_TMA_REDUCE: gl.constexpr):
    # Grid (cdiv(N, BLOCK_N), B * HKV). Causal: key tile 0 has the most query tiles and is launched first.
    j = gl.program_id(0)
    off_bkv = gl.program_id(1)
    GROUP = H // HKV
    head0 = (off_bkv // HKV) * H + (off_bkv % HKV) * GROUP
    start_n = j * BLOCK_N
    kv_row0 = off_bkv * N
    n_m = gl.cdiv(N, BLOCK_M)
    if CAUSAL:
        # Query tiles wholly before the key tile see none of it; tiles whose first query is at or after the
        # tile's last key need no mask.
        i_lo = start_n // BLOCK_M
        i_mid = gl.minimum(gl.cdiv(start_n + BLOCK_N - 1, BLOCK_M), n_m)
    else:
        i_lo = 0
        i_mid = 0
    if start_n + BLOCK_N > N:
        i_mid = n_m

    dtype: gl.constexpr = q_desc.dtype
    q_bufs = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_bufs = gl.allocate_shared_memory(dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
    lse_bufs = gl.allocate_shared_memory(gl.float32, [STAGES] + lse_desc.block_type.shape, lse_desc.layout)
    delta_bufs = gl.allocate_shared_memory(gl.float32, [STAGES] + delta_desc.block_type.shape, delta_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, v_desc.block_type.shape, v_desc.layout)
    # dS^T, (BLOCK_N, BLOCK_M): stored from registers each step, read transposed as dQ's A operand.
    ds_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_M],
                                        gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype))
    if DQ_TMA_REDUCE:
        # dQ_i's staging box for the TMA reduce-add (fp32: 32 KB at D=128).
        dq_smem = gl.allocate_shared_memory(gl.float32, dq_desc.block_type.shape, dq_desc.layout)
    else:
        # Unused (constexpr-dead) placeholder: every partition takes the same arguments.
        dq_smem = gl.allocate_shared_memory(gl.float32, [8, 8], gl.NVMMASharedLayout.get_default_for([8, 8],
                                                                                                  gl.float32))
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=PARTITION_ARRIVALS)
    # Barrier initialisation must be visible to the async proxy (TMA) before the first copy.
    fence_async_shared()

    gl.warp_specialize([
        (_bwd_consumer, (q_bufs, do_bufs, lse_bufs, delta_bufs, k_smem, v_smem, ds_smem, kv_bar, ready, empty, dq_ptr,
                         dq_desc, dq_smem, dk_ptr, dv_ptr, kv_row0, head0, start_n, N, i_lo, i_mid, n_m, GROUP,
                         qk_scale, sm_scale, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, CAUSAL, DQ_TMA_REDUCE)),
        (_bwd_producer, (q_desc, do_desc, lse_desc, delta_desc, k_desc, v_desc, q_bufs, do_bufs, lse_bufs, delta_bufs,
                         k_smem, v_smem, kv_bar, ready, empty, kv_row0 + start_n, head0, N, N_PAD, i_lo, n_m, GROUP,
                         BLOCK_M, STAGES)),
    ], [1], [PRODUCER_REGS])


def launch_config(head_dim: int, causal: bool = False):
    """(BLOCK_M, BLOCK_N, STAGES, num_warps, maxnreg): FA3's D=128 tile (64 queries x 128 keys, two
    consumer warpgroups) for both head dims, 2 stages of Q/dO."""
    assert head_dim in HEAD_DIMS, f"head_dim must be one of {HEAD_DIMS}, got {head_dim}"
    block_m, block_n, stages = 64, 128, 2
    num_warps = block_n // 16
    # Registers are granted per warpgroup: the 1-warp producer takes a whole warpgroup's slots. maxnreg
    # caps the kernel so all warps fit the 64K-register file; setmaxnreg then moves the producer down to
    # PRODUCER_REGS and the consumer up to what is left (8 x 240 + 4 x 24 = 12 x 168).
    total_threads = (num_warps + 4) * 32
    return block_m, block_n, stages, num_warps, min(256, (65536 // total_threads) // 8 * 8)


def _descriptor(t, block_shape):
    layout = gl.NVMMASharedLayout.get_default_for(list(block_shape), DTYPES.get(t.dtype, gl.float32))
    return TensorDescriptor.from_tensor(t, list(block_shape), layout)


def launch_args(q, k, v, dout, delta, lse2, dq_accum, dk, dv, causal: bool, dq_tma_reduce: bool = False):
    """(grid, args, kwargs) of the main kernel's launch; compile_backward.py binds the same arguments with
    the JIT's own binder on the CPU, so a launch's specialisations (N = 1, N % 16) are compiled there too."""
    B, H, N, D = q.shape
    block_m, block_n, stages, num_warps, maxnreg = launch_config(D, causal)
    sm_scale = 1.0 / math.sqrt(D)
    descriptors = [_descriptor(q.view(-1, D), [block_m, D]), _descriptor(k.view(-1, D), [block_n, D]),
                   _descriptor(v.view(-1, D), [block_n, D]), _descriptor(dout.view(-1, D), [block_m, D]),
                   _descriptor(lse2, [block_m]), _descriptor(delta, [block_m]),
                   _descriptor(dq_accum.view(-1, D), [block_m, D])]
    args = [*descriptors, dq_accum, dk, dv, sm_scale * LOG2E, sm_scale, N, lse2.numel() // (B * H), H, k.shape[1]]
    kwargs = dict(HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages, CAUSAL=causal,
                  DQ_TMA_REDUCE=dq_tma_reduce, num_warps=num_warps, maxnreg=maxnreg)
    return (triton.cdiv(N, block_n), B * k.shape[1]), args, kwargs


def backward(q, k, v, o, dout, lse, causal: bool = False, dq_tma_reduce: bool = False):
    """dq, dk, dv of attention(q, k, v) (scale 1/sqrt(D)) for the upstream gradient dout; see the module
    docstring for the shapes. dq_tma_reduce: dQ by TMA reduce-add instead of atomics. Needs a Hopper GPU."""
    B, H, N, D = q.shape
    HKV = k.shape[1]
    if q.dtype not in DTYPES or D not in HEAD_DIMS or H % HKV:
        raise ValueError(f"q must be bf16/fp16 with D in {HEAD_DIMS} and H % HKV == 0, got {q.dtype}, D={D}, "
                         f"H={H}, HKV={HKV}")
    block_m = launch_config(D, causal)[0]
    q, k, v, o, dout, lse = (t.contiguous() for t in (q, k, v, o, dout, lse))
    n_pad = triton.cdiv(N, block_m) * block_m
    delta = torch.empty(B * H * n_pad, device=q.device, dtype=torch.float32)
    lse2 = torch.empty_like(delta)
    _bwd_preprocess[(n_pad // block_m, B * H)](o, dout, lse, delta, lse2, N, n_pad, HEAD_DIM=D, BLOCK_M=block_m)
    dq_accum = torch.zeros(B, H, N, D, device=q.device, dtype=torch.float32)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    grid, args, kwargs = launch_args(q, k, v, dout, delta, lse2, dq_accum, dk, dv, causal, dq_tma_reduce)
    _bwd_kernel[grid](*args, **kwargs)
    return (dq_accum * (1.0 / math.sqrt(D))).to(q.dtype), dk, dv
